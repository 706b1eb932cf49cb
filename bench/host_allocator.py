"""runtime.allocator 'tuned' against 'system' on whole launch.py runs, side by side; or, with
`--vary remat`, model.remat=none against full (the default allocator); or, with `--vary mof`,
XLA:CPU's multi-output fusion on (the package's default, runtime.py) against off
(MEGATRAIN_JAX_XLA_CPU_MOF=0).

  python bench/host_allocator.py                       # tiny config, model.remat=none, 100 steps
  python bench/host_allocator.py --vary remat          # tiny config: remat none vs full
  python bench/host_allocator.py --vary mof -- --config tiny   # the default job, fusion on vs off
  python bench/host_allocator.py --rounds 3 --steps 100 -- --config.model.remat=full
  python bench/host_allocator.py --steps 2 --skip 0 -- --config 125m \
      --config.offload.params=nvme --config.offload.opt_state=nvme \
      --config.train.batch_size=1 --config.train.seq_len=128

Each round runs every allocator once, in alternating order, each in a fresh process and workdir
(/usr/bin/time -v), so a loaded machine slows both alike. Reported per variant: the median over
rounds of s/step (mean of metrics.jsonl's perf/step_time_s after the first `--skip` logged rows),
user and system CPU seconds, wall seconds, and the maximum resident set size.
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a run varies: its name -> (launch.py flags, environment).
VARIANTS = {
    'allocator': {a: ([f'--config.runtime.allocator={a}'], {'MEGATRAIN_JAX_ALLOCATOR': a})
                  for a in ('system', 'tuned')},
    'remat': {r: ([f'--config.model.remat={r}'], {}) for r in ('full', 'none')},
    'mof': {m: ([], {'MEGATRAIN_JAX_XLA_CPU_MOF': '1' if m == 'on' else '0'})
            for m in ('off', 'on')},
}


def _run(variant: tuple, steps: int, extra: list[str], skip: int) -> dict:
  flags, env = variant
  with tempfile.TemporaryDirectory(prefix='alloc_bench_') as workdir:
    cmd = ['/usr/bin/time', '-v', sys.executable, str(ROOT / 'launch.py'), *extra,  # --config first
           f'--workdir={workdir}/run', f'--config.train.steps={steps}',
           '--config.checkpoint.every=-1', *flags]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                         text=True)
    if out.returncode:
      raise SystemExit(f'{flags} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}')
    rows = [json.loads(line) for line in (pathlib.Path(workdir) / 'run' / 'metrics.jsonl').open()]
  times = [r['perf/step_time_s'] for r in rows if 'perf/step_time_s' in r][skip:]
  field = lambda name: float(re.search(rf'{name}: ([\d.:]+)', out.stderr).group(1).split(':')[-1])
  wall = re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)', out.stderr).group(1)
  wall_s = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall.split(':'))))
  return {'s_per_step': statistics.mean(times) if times else float('nan'),
          'user_s': field('User time \\(seconds\\)'), 'sys_s': field('System time \\(seconds\\)'),
          'wall_s': wall_s, 'max_rss_mb': field('Maximum resident set size \\(kbytes\\)') / 1024}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=100)
  parser.add_argument('--skip', type=int, default=1, help='logged rows to drop (compilation)')
  parser.add_argument('--vary', choices=sorted(VARIANTS), default='allocator')
  parser.add_argument('extra', nargs='*', help='more launch.py flags (after --)')
  args = parser.parse_args()
  extra = args.extra or (['--config.model.remat=none'] if args.vary == 'allocator' else [])
  variants = VARIANTS[args.vary]
  names = list(variants)
  results = {name: [] for name in names}
  for r in range(args.rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      results[name].append(_run(variants[name], args.steps, extra, args.skip))
      print(f'round {r} {name}: {results[name][-1]}', flush=True)
  print(f'\nlaunch.py {" ".join(extra)} --config.train.steps={args.steps}, {args.rounds} rounds, medians:')
  print(f'| {args.vary} | s/step | user s | system s | wall s | max RSS MB |')
  print('|---|---|---|---|---|---|')
  med = {a: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for a, rs in results.items()}
  for a, m in med.items():
    print(f'| {a} | {m["s_per_step"]:.4f} | {m["user_s"]:.1f} | {m["sys_s"]:.1f} | {m["wall_s"]:.1f} '
          f'| {m["max_rss_mb"]:.0f} |')
  first = names[0]
  for other in names[1:]:
    print(f'{other} / {first}: s/step {med[other]["s_per_step"] / med[first]["s_per_step"]:.3f}, '
          f'max RSS {med[other]["max_rss_mb"] / med[first]["max_rss_mb"]:.3f}')


if __name__ == '__main__':
  main()
