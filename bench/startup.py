"""What a process pays before it trains: importing the package, and a `--dry_run` of the tiny config.

    python bench/startup.py [--rounds 5] [--baseline OTHER_CHECKOUT] [--json out.json]

Each round starts fresh interpreters, the variants in alternating order, for this checkout and,
with --baseline (e.g. a `git worktree` of an older commit), for that one in the same rounds:

  import    `import megatrain_jax.train` (what launch.py and a notebook import): wall time and
            peak RSS, each reported by the child itself (`resource.getrusage(RUSAGE_SELF)`: the
            whole process), and whether torch or IPython got loaded on the way (megatrain_jax/imports.py)
  dry run   `python launch.py --config tiny --dry_run` end to end (imports, config, the
            planner's search, the printed plan), timed from outside

Medians over the rounds; `--json` writes every figure. The installed packages are this
environment's for both checkouts (a dependency's version is compared by reinstalling it).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = '''
import resource, sys, time
started = time.perf_counter()
import megatrain_jax.train
import json
print(json.dumps({'seconds': time.perf_counter() - started,
                  'loaded': [m for m in ('torch', 'IPython') if m in sys.modules],
                  'max_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def _env(tree: pathlib.Path) -> dict:
  return dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS='cpu')


def _import(tree: pathlib.Path) -> dict:
  out = subprocess.run([sys.executable, '-c', _CHILD], env=_env(tree), capture_output=True,
                       text=True, check=True, cwd=tree)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _dry_run(tree: pathlib.Path) -> dict:
  started = time.perf_counter()
  subprocess.run([sys.executable, 'launch.py', '--config', 'tiny', '--dry_run'], env=_env(tree),
                 capture_output=True, text=True, check=True, cwd=tree)
  return {'seconds': time.perf_counter() - started}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--baseline', default=None, help='another checkout, measured alongside')
  parser.add_argument('--json', default=None)
  args = parser.parse_args()
  trees = {'this tree': REPO_ROOT}
  if args.baseline:
    trees['baseline'] = pathlib.Path(args.baseline).resolve()
  variants = {f'{what} ({label})': (run, tree) for label, tree in trees.items()
              for what, run in (('import', _import), ('dry run', _dry_run))}
  results = {name: [] for name in variants}
  for r in range(args.rounds):
    for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
      run, tree = variants[name]
      results[name].append(run(tree))
  print('| variant | median s | rounds (s) | median max RSS MB |')
  print('|---|---:|---|---:|')
  for name, rows in results.items():
    seconds = [row['seconds'] for row in rows]
    rss = [row['max_rss_mb'] for row in rows if 'max_rss_mb' in row]
    print(f'| {name} | {statistics.median(seconds):.2f} | '
          f'{", ".join(f"{s:.2f}" for s in seconds)} | '
          f'{f"{statistics.median(rss):,.0f}" if rss else "n/a"} |')
  for name, rows in results.items():
    loaded = sorted({m for row in rows for m in row.get('loaded', [])})
    if loaded:
      print(f'{name}: {", ".join(loaded)} got imported on the way')
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
  main()
