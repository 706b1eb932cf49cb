"""The planner's predicted peak host memory against the measured peak RSS of whole runs.

    python bench/memory_accuracy.py [--shapes tiny,125m,1b] [--placements resident,host,nvme]

For each shape x placement: `launch.py --dry_run` gives predicted_host_peak_gb (or the planner's
refusal, printed as such), then the same command trains `--steps` steps, end-of-run checkpoint
included, under a wrapper process whose RUSAGE_CHILDREN ru_maxrss is the run's peak RSS (the
whole process: Python, XLA, stores, write-behind). Prints one markdown row per run with the ratio
predicted / measured; the acceptance band is 0.8-1.2.

Every run uses batch 1 x `--seq` tokens of the embedded default corpus (no downloads), its own
workdir under --workdir (deleted afterwards: the 1b NVMe stores take 20 GB), and the placement's
flags below; everything else is the size config's.
"""

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLACEMENTS = {
    'resident': [],
    'host': ['--config.offload.params=host', '--config.offload.opt_state=host',
             '--config.offload.embed_head=host'],
    'nvme': ['--config.offload.params=nvme', '--config.offload.opt_state=nvme',
             '--config.offload.embed_head=nvme'],
}
# The wrapper's only child is the run, so its RUSAGE_CHILDREN peak is the run's peak RSS.
WRAPPER = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
           'print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); '
           'sys.exit(r.returncode)')


def run_one(shape: str, placement: str, args) -> dict:
  workdir = pathlib.Path(args.workdir) / f'{shape}-{placement}'
  shutil.rmtree(workdir, ignore_errors=True)
  flags = [f'--config={shape}', *PLACEMENTS[placement], '--config.train.batch_size=1',
           f'--config.train.seq_len={args.seq}', f'--config.train.steps={args.steps}',
           '--config.train.eval_batches=1', '--config.checkpoint.every=0',
           '--config.train.progress_bar=False', f'--workdir={workdir}']
  dry = subprocess.run([sys.executable, 'launch.py', '--dry_run', *flags], cwd=ROOT,
                       capture_output=True, text=True)
  found = re.search(r'predicted_host_peak_gb: ([0-9.]+)', dry.stdout)
  if dry.returncode != 0 or not found:
    reason = (dry.stderr.strip().splitlines() or ['?'])[-1]
    return dict(shape=shape, placement=placement, refused=reason[:160])
  predicted = float(found.group(1))
  started = time.perf_counter()
  run = subprocess.run([sys.executable, '-c', WRAPPER, sys.executable, 'launch.py', *flags],
                       cwd=ROOT, capture_output=True, text=True)
  wall = time.perf_counter() - started
  shutil.rmtree(workdir, ignore_errors=True)
  if run.returncode != 0:
    return dict(shape=shape, placement=placement, refused='run failed: ' + run.stderr[-300:])
  measured = int(re.search(r'PEAK (\d+)', run.stdout).group(1)) / 1e9
  return dict(shape=shape, placement=placement, predicted=predicted, measured=measured,
              ratio=predicted / measured, wall=wall)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shapes', default='tiny,125m,1b')
  parser.add_argument('--placements', default='resident,host,nvme')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--workdir', default='/tmp/megatrain_memory_accuracy')
  args = parser.parse_args()
  print('| shape | placement | predicted_host_peak_gb | measured peak RSS (GB) | predicted / '
        'measured | wall (s) |')
  print('|---|---|---|---|---|---|')
  for shape in args.shapes.split(','):
    for placement in args.placements.split(','):
      r = run_one(shape, placement, args)
      if 'refused' in r:
        print(f"| {shape} | {placement} | planner refuses: {r['refused']} | - | - | - |", flush=True)
      else:
        print(f"| {shape} | {placement} | {r['predicted']:.2f} | {r['measured']:.2f} | "
              f"{r['ratio']:.2f} | {r['wall']:.0f} |", flush=True)


if __name__ == '__main__':
  main()
