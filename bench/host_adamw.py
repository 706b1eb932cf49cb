"""Host AdamW throughput, side by side: torch.optim.AdamW(fused=True), the jitted donated optax
AdamW the engines ran (tx.update + optax.apply_updates), and optim.apply_adamw (one elementwise
expression per output, see optim._adamw_leaf), in Gparam/s.

  python bench/host_adamw.py                         # 64M and 512M params, 1 and all threads
  python bench/host_adamw.py --sizes 64 --rounds 5   # sizes in Mi parameters
  python bench/host_adamw.py --mof both              # also without XLA:CPU's multi-output fusion

Every measurement runs in its own process (the thread count is the process's CPU affinity, so
torch and XLA get the same cores; XLA flags are per process) and the rounds interleave the
implementations, so a shared machine slows all of them alike; each figure is the best of
`--repeats` updates, the table the median over rounds. torch is a bench/dev dependency only.
`--mof`: whether the JAX processes run with --xla_backend_extra_options=
xla_cpu_use_multi_output_fusion (runtime.py's opt-in MEGATRAIN_JAX_XLA_CPU_MOF=1: 'on'), without it
('off'), or both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MOF_FLAG = '--xla_backend_extra_options=xla_cpu_use_multi_output_fusion'
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _best(fn, repeats: int) -> float:
  fn()
  best = float('inf')
  for _ in range(repeats):
    started = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - started)
  return best


def _torch(n: int, repeats: int) -> float:
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  p = torch.nn.Parameter(torch.ones(n))
  p.grad = torch.full((n,), 1e-3)
  opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
  return n / _best(opt.step, repeats) / 1e9


def _jax(impl: str, n: int, repeats: int) -> float:
  import types  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, ROOT)
  from megatrain_jax import optim  # pylint: disable=import-outside-toplevel
  train = types.SimpleNamespace(lr=1e-3, warmup_steps=10, steps=1000, min_lr_ratio=0.1, b1=0.9,
                                b2=0.95, eps=1e-8, weight_decay=0.1)
  tx = optim.make_optimizer(train)
  params = {'kernel': jnp.ones((n,), jnp.float32)}  # a decayed leaf
  grads = {'kernel': jnp.full((n,), 1e-3, jnp.float32)}
  state = [params, tx.init(params)]

  def optax_update(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s
  fused_update = lambda p, s, g: optim.apply_adamw(tx, g, s, p)
  update = jax.jit(optax_update if impl == 'optax' else fused_update, donate_argnums=(0, 1))

  def run():
    state[0], state[1] = update(state[0], state[1], grads)
    jax.block_until_ready(state[0])
  return n / _best(run, repeats) / 1e9


def _child(args) -> None:
  os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
  n = args.size << 20
  rate = _torch(n, args.repeats) if args.impl == 'torch' else _jax(args.impl, n, args.repeats)
  print(json.dumps({'gparams': rate}))


def _measure(impl: str, size: int, threads: int, mof: bool, repeats: int) -> float:
  env = dict(os.environ)
  flags = env.get('XLA_FLAGS', '').replace(MOF_FLAG, '').strip()
  env['XLA_FLAGS'] = f'{flags} {MOF_FLAG}'.strip() if mof else flags
  env['MEGATRAIN_JAX_XLA_CPU_MOF'] = '1' if mof else '0'
  out = subprocess.run([sys.executable, __file__, '--child', '--impl', impl, '--size', str(size),
                        '--threads', str(threads), '--repeats', str(repeats)],
                       env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])['gparams']


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--sizes', type=int, nargs='+', default=[64, 512], help='Mi parameters')
  parser.add_argument('--threads', type=int, nargs='+', default=None,
                      help='thread counts (default: 1 and all)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--mof', choices=('on', 'off', 'both'), default='on')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--impl', help=argparse.SUPPRESS)
  parser.add_argument('--size', type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    args.threads = args.threads[0]
    return _child(args)
  cores = len(os.sched_getaffinity(0))
  threads = args.threads or sorted({1, cores})
  impls = [('torch', None)] + [(impl, mof) for mof in ({'on': [True], 'off': [False],
                                                         'both': [False, True]}[args.mof])
                               for impl in ('optax', 'fused')]
  results = {}
  for r in range(args.rounds):
    for size in args.sizes:
      for t in threads:
        order = impls if r % 2 == 0 else impls[::-1]
        for impl, mof in order:
          rate = _measure(impl, size, t, bool(mof), args.repeats)
          results.setdefault((size, t, impl, mof), []).append(rate)
          print(f'round {r}: {size}M params, {t} thread(s), {impl}'
                f'{"" if mof is None else " mof " + ("on" if mof else "off")}: {rate:.3f} Gparam/s',
                flush=True)
  names = [f'{impl}{"" if mof is None else " (mof " + ("on" if mof else "off") + ")"}'
           for impl, mof in impls]
  print(f'\nGparam/s, median of {args.rounds} rounds (best of {args.repeats} updates each); '
        f'{cores} cores; ratio = apply_adamw / torch fused')
  print('| params | threads | ' + ' | '.join(names) + ' | ratio |')
  print('|---' * (len(names) + 3) + '|')
  for size in args.sizes:
    for t in threads:
      med = [statistics.median(results[(size, t, impl, mof)]) for impl, mof in impls]
      print(f'| {size}M | {t} | ' + ' | '.join(f'{m:.2f}' for m in med)
            + f' | {med[-1] / med[0]:.2f} |')


if __name__ == '__main__':
  main()
