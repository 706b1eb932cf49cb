"""Planner accuracy (issue 5): predicted vs measured step time on this machine, after --calibrate.

Calibrates this machine (`python launch.py --calibrate`, in a subprocess, as a user would), then
trains each (config, placement) for --steps steps with that profile and compares the planner's
`perf/predicted_step_time_s` with the measured median `perf/step_time_s` (steps 3.. : the first
steps compile). Placements are fixed (not auto) so each tier is measured:

  resident  everything in device memory (one jitted step)
  host      layer params + Adam state in pinned host RAM, groups of 1 layer, optimizer on device
  nvme      layer params + Adam state in TensorStore arrays under a temporary offload.dir

Configs:
  small     the tiny default (4 layers, d_model 256, ~3M params; batch 16 x 128 tokens)
  medium    8 layers, d_model 512, d_ff 1376, ~23M params; batch 8 x 256 tokens

Prints a markdown table (for BENCHMARKS.md): predicted, measured, predicted / measured.

  python bench/planner_accuracy.py              # ~6 min on 2 cores
  python bench/planner_accuracy.py --profile hw.json   # reuse a calibration
"""

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax import config as config_lib  # pylint: disable=wrong-import-position
from megatrain_jax import train  # pylint: disable=wrong-import-position

CONFIGS = {
    'small': {},
    'medium': dict(model__d_model=512, model__num_layers=8, model__num_heads=8,
                   model__num_kv_heads=4, model__d_ff=1376, train__batch_size=8,
                   train__seq_len=256),
}
_FIXED = dict(offload__params='device', offload__opt_state='device',
              offload__activations='device', offload__embed_head='device',
              offload__optimizer_on='device', offload__layers_per_group=1,
              offload__prefetch_depth=1, train__microbatches=1)
PLACEMENTS = {
    'resident': {},
    'host': dict(offload__params='host', offload__opt_state='host'),
    'nvme': dict(offload__params='nvme', offload__opt_state='nvme', offload__layers_per_group=2),
}


def calibrate(out: pathlib.Path) -> float:
  started = time.perf_counter()
  subprocess.run([sys.executable, 'launch.py', '--calibrate', f'--profile_out={out}',
                  f'--workdir={out.parent}'], cwd=REPO, check=True)
  return time.perf_counter() - started


def measure(profile: pathlib.Path, size: str, placement: str, steps: int, tmp: pathlib.Path):
  workdir = tmp / f'{size}-{placement}'
  config = config_lib.load_config(
      'tiny', hardware=str(profile), jax_cache_dir='', train__steps=steps, train__log_every=1,
      train__eval_every=0, train__progress_bar=False, checkpoint__every=-1,
      offload__dir=str(workdir / 'offload'),
      **{**_FIXED, **CONFIGS[size], **PLACEMENTS[placement]})
  train.train_and_evaluate(config, str(workdir))
  rows = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  timed = [r for r in rows if 'perf/step_time_s' in r and r['step'] >= 3]
  measured = float(np.median([r['perf/step_time_s'] for r in timed]))
  return timed[-1]['perf/predicted_step_time_s'], measured, timed[-1]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--profile', default='', help='a profile JSON; default: calibrate now')
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--sizes', default='small,medium')
  parser.add_argument('--placements', default='resident,host,nvme')
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(dir=REPO / 'runs' if (REPO / 'runs').is_dir() else None) as tmp:
    tmp = pathlib.Path(tmp)
    profile = pathlib.Path(args.profile) if args.profile else tmp / 'hardware.json'
    if not args.profile:
      print(f'calibration took {calibrate(profile):.1f} s')
    print(pathlib.Path(profile).read_text())
    results = []
    for size in args.sizes.split(','):
      for placement in args.placements.split(','):
        predicted, measured, row = measure(profile, size, placement, args.steps, tmp)
        results.append((size, placement, predicted, measured, row))
        print(f'{size} {placement}: predicted {predicted:.4f} s, measured {measured:.4f} s, '
              f'ratio {predicted / measured:.2f}', flush=True)
  print(f'\nmachine: {platform.node()}, {platform.processor() or platform.machine()}, '
        f'python {platform.python_version()}')
  print('| config | placement | predicted step (s) | measured step (s, median) | predicted / measured |')
  print('|---|---|---|---|---|')
  for size, placement, predicted, measured, _ in results:
    print(f'| {size} | {placement} | {predicted:.3f} | {measured:.3f} | {predicted / measured:.2f} |')
  worst = max(abs(p / m - 1) for _, _, p, m, _ in results)
  print(f'\nworst miss: {100 * worst:.0f}%')


if __name__ == '__main__':
  main()
