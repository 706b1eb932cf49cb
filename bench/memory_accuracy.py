"""The planner's predicted peak host memory against the measured peak RSS of whole runs.

    python bench/memory_accuracy.py [--shapes tiny,125m,1b] [--placements resident,host,nvme]
                                    [--cache both|cold|default] [--flags "--config.x.y=z ..."]

For each shape x placement: `launch.py --dry_run` gives predicted_host_peak_gb (or the planner's
refusal, printed as such), then the same command trains `--steps` steps, end-of-run checkpoint
included, under a wrapper process whose RUSAGE_CHILDREN ru_maxrss is the run's peak RSS (the
whole process: Python, XLA, stores, write-behind). Prints one markdown row per run with the ratio
predicted / measured; the acceptance band is 0.8-1.2.

Every run uses batch 1 x `--seq` tokens of the embedded default corpus (no downloads), its own
workdir under --workdir (deleted afterwards: the 1b NVMe stores take 20 GB), and the placement's
flags below; everything else is the size config's.

The persistent XLA compilation cache moves the peak: a run that compiles its programs holds the
compiler's heap too (the resident step's, kept by the 'tuned' allocator: +0.2 GB on tiny), one
that finds them in the cache does not. --cache=both (the default) runs each config twice on a
fresh cache of its own, cold then warm, and reports both; cold: once, on an empty cache; default:
once, on the config's jax_cache_dir as it is.
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
    # Named, not left to `auto` (which streams what does not fit: 1b's embedding/head on NVMe).
    'resident': ['--config.offload.params=device', '--config.offload.opt_state=device',
                 '--config.offload.embed_head=device', '--config.offload.activations=device'],
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
  cache = pathlib.Path(args.workdir) / f'{shape}-{placement}-jax-cache'
  for path in (workdir, cache):
    shutil.rmtree(path, ignore_errors=True)
  flags = [f'--config={shape}', *PLACEMENTS[placement], '--config.train.batch_size=1',
           f'--config.train.seq_len={args.seq}', f'--config.train.steps={args.steps}',
           '--config.train.eval_batches=1', '--config.checkpoint.every=0',
           '--config.train.progress_bar=False', f'--workdir={workdir}', *args.flags.split()]
  if args.cache != 'default':
    flags.append(f'--config.jax_cache_dir={cache}')
  dry = subprocess.run([sys.executable, 'launch.py', '--dry_run', *flags], cwd=ROOT,
                       capture_output=True, text=True)
  found = re.search(r'predicted_host_peak_gb: ([0-9.]+)', dry.stdout)
  if dry.returncode != 0 or not found:
    reason = (dry.stderr.strip().splitlines() or ['?'])[-1]
    return dict(shape=shape, placement=placement, refused=reason[:160])
  predicted = float(found.group(1))
  measured, walls = [], []
  for _ in range(2 if args.cache == 'both' else 1):  # cold, then warm on the same cache
    started = time.perf_counter()
    run = subprocess.run([sys.executable, '-c', WRAPPER, sys.executable, 'launch.py', *flags],
                         cwd=ROOT, capture_output=True, text=True)
    walls.append(time.perf_counter() - started)
    shutil.rmtree(workdir, ignore_errors=True)
    if run.returncode != 0:
      shutil.rmtree(cache, ignore_errors=True)
      return dict(shape=shape, placement=placement, refused='run failed: ' + run.stderr[-300:])
    measured.append(int(re.search(r'PEAK (\d+)', run.stdout).group(1)) / 1e9)
  shutil.rmtree(cache, ignore_errors=True)
  return dict(shape=shape, placement=placement, predicted=predicted, measured=measured,
              ratio=[predicted / m for m in measured], wall=walls)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shapes', default='tiny,125m,1b')
  parser.add_argument('--placements', default='resident,host,nvme')
  parser.add_argument('--steps', type=int, default=2)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--workdir', default='/tmp/megatrain_memory_accuracy')
  parser.add_argument('--cache', choices=('both', 'cold', 'default'), default='both',
                      help='XLA compilation cache of the runs (module docstring)')
  parser.add_argument('--flags', default='',
                      help='more launch.py flags for every run, space-separated (e.g. '
                           '"--config.train.grad_clip=0")')
  args = parser.parse_args()
  runs = {'both': 'cold / warm cache', 'cold': 'cold cache', 'default': 'jax_cache_dir as is'}
  print(f'| shape | placement | predicted_host_peak_gb | measured peak RSS (GB), '
        f'{runs[args.cache]} | predicted / measured | wall (s) |')
  print('|---|---|---|---|---|---|')
  for shape in args.shapes.split(','):
    for placement in args.placements.split(','):
      r = run_one(shape, placement, args)
      if 'refused' in r:
        print(f"| {shape} | {placement} | planner refuses: {r['refused']} | - | - | - |", flush=True)
      else:
        both = lambda values, digits: ' / '.join(f'{v:.{digits}f}' for v in values)
        print(f"| {shape} | {placement} | {r['predicted']:.2f} | {both(r['measured'], 2)} | "
              f"{both(r['ratio'], 2)} | {both(r['wall'], 0)} |", flush=True)


if __name__ == '__main__':
  main()
