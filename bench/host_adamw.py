"""Host AdamW throughput, side by side: torch.optim.AdamW(fused=True), the jitted donated optax
AdamW the engines ran (tx.update + optax.apply_updates), and optim.apply_adamw (one elementwise
expression per output, see optim._adamw_leaf), in Gparam/s.

  python bench/host_adamw.py                         # 64M and 512M params, 1 and all threads
  python bench/host_adamw.py --sizes 64 --rounds 5   # sizes in Mi parameters
  python bench/host_adamw.py --mof both              # also without XLA:CPU's multi-output fusion
  python bench/host_adamw.py --allocator tuned       # JAX's buffers from the 'tuned' heap

Every measurement runs in its own process (the thread count is the process's CPU affinity, so
torch and XLA get the same cores; XLA flags are per process) and the rounds interleave the
implementations, so a shared machine slows all of them alike; each figure is the best of
`--repeats` updates, the table the median over rounds. torch is a bench/dev dependency only.
`--mof`: whether the JAX processes run with --xla_backend_extra_options=
xla_cpu_use_multi_output_fusion ('on', what the package sets at import: runtime.py), without it
('off'), or both.

`pair` runs torch's fused AdamW and optim.apply_adamw in one process, alternately, on the very same
four arrays (allocated as the JAX processes allocate theirs; the jitted update donates them and
writes its outputs back into them): the like-for-like comparison of the two kernels. Both stream p,
g, m, v at DRAM bandwidth, so where those arrays lie and what else uses the memory bus move every
implementation by up to 2x between processes (on the 2-core CI VM one layout of the same 64M arrays
ran torch and apply_adamw alike at 0.45-0.7 Gparam/s, another at 1.3-1.5; BENCHMARKS.md), which a
comparison across processes mixes into the ratio. `--allocator`: the host allocator of the
processes that allocate through JAX (runtime.py): 'tuned' by default, what every run gets
(these processes stay far below its trim limit); 'system' leaves glibc as it is. torch's own
process always has glibc's defaults.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MOF_FLAG = '--xla_backend_extra_options=xla_cpu_use_multi_output_fusion'
ALLOCATOR_ENV = 'MEGATRAIN_JAX_ALLOCATOR'  # runtime.ENV, read when megatrain_jax is imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _best(fn, repeats: int) -> float:
  fn()
  best = float('inf')
  for _ in range(repeats):
    started = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - started)
  return best


def _torch_step(n: int, buffers=None):
  """torch's fused AdamW step over one parameter of n floats: its own arrays, or `buffers` (p, g,
  m, v as numpy arrays of n float32), updated in place."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(len(os.sched_getaffinity(0)))
  if buffers is None:
    p = torch.nn.Parameter(torch.ones(n))
    p.grad = torch.full((n,), 1e-3)
  else:
    p, g, m, v = (torch.from_numpy(b) for b in buffers)
    p = torch.nn.Parameter(p)
    p.grad = g
  opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
  if buffers is not None:  # the Adam state in the given arrays (torch would allocate its own)
    opt.state[p].update(step=torch.tensor(0.0), exp_avg=m, exp_avg_sq=v)
  return opt.step


def _jax_update(impl: str, n: int):
  """(run one update, the four buffers' addresses) for impl 'optax' or 'fused' (optim.apply_adamw),
  jitted with the weights and Adam state donated, over one decayed leaf of n parameters."""
  import types  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
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
  pointers = lambda: [x['kernel'].unsafe_buffer_pointer()
                      for x in (state[0], grads, state[1][0].mu, state[1][0].nu)]
  where = pointers()

  def run():
    state[0], state[1] = update(state[0], state[1], grads)
    jax.block_until_ready(state[0])
    if impl == 'fused' and pointers() != where:  # `pair` relies on the outputs reusing them
      raise RuntimeError('apply_adamw did not update the donated buffers in place')
  return run, where


def _pair(n: int, repeats: int):
  """(torch, apply_adamw) Gparam/s, alternately on the same four buffers."""
  import ctypes  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  fused, where = _jax_update('fused', n)
  torch_step = _torch_step(n, [np.ctypeslib.as_array((ctypes.c_float * n).from_address(a))
                               for a in where])
  fused()
  torch_step()
  best = {'torch': float('inf'), 'fused': float('inf')}
  for i in range(repeats):
    for name, fn in (('torch', torch_step), ('fused', fused))[::1 if i % 2 else -1]:
      started = time.perf_counter()
      fn()
      best[name] = min(best[name], time.perf_counter() - started)
  return [n / best[name] / 1e9 for name in ('torch', 'fused')]


def _child(args) -> None:
  sys.path.insert(0, ROOT)
  os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.threads]))
  n = args.size << 20
  if args.impl == 'pair':
    rates = _pair(n, args.repeats)
  else:
    step = _torch_step(n) if args.impl == 'torch' else _jax_update(args.impl, n)[0]
    rates = [n / _best(step, args.repeats) / 1e9]
  print(json.dumps({'gparams': rates}))


def _measure(impl: str, size: int, threads: int, mof: bool, repeats: int, allocator: str):
  """[Gparam/s] of one child process: one figure, or two for `pair` (torch, apply_adamw)."""
  env = dict(os.environ)
  flags = env.get('XLA_FLAGS', '').replace(MOF_FLAG, '').strip()
  env['XLA_FLAGS'] = f'{flags} {MOF_FLAG}'.strip() if mof else flags
  env['MEGATRAIN_JAX_XLA_CPU_MOF'] = '1' if mof else '0'
  env[ALLOCATOR_ENV] = allocator
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
  parser.add_argument('--allocator', choices=('tuned', 'system'), default='tuned',
                      help="host allocator of the processes that allocate through JAX "
                           "(default: 'tuned', what every run uses)")
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--impl', help=argparse.SUPPRESS)
  parser.add_argument('--size', type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    args.threads = args.threads[0]
    return _child(args)
  cores = len(os.sched_getaffinity(0))
  threads = args.threads or sorted({1, cores})
  mofs = {'on': [True], 'off': [False], 'both': [False, True]}[args.mof]
  # `pair` (torch and apply_adamw in one process) with the last fusion setting listed
  impls = ([('torch', None)] + [(impl, mof) for mof in mofs for impl in ('optax', 'fused')]
           + [('pair', mofs[-1])])
  results = {}
  for r in range(args.rounds):
    for size in args.sizes:
      for t in threads:
        order = impls if r % 2 == 0 else impls[::-1]
        for impl, mof in order:
          rates = _measure(impl, size, t, bool(mof), args.repeats, args.allocator)
          results.setdefault((size, t, impl, mof), []).append(rates)
          print(f'round {r}: {size}M params, {t} thread(s), {impl}'
                f'{"" if mof is None else " mof " + ("on" if mof else "off")}: '
                + ' '.join(f'{rate:.3f}' for rate in rates) + ' Gparam/s', flush=True)
  mof_name = lambda mof: '' if mof is None else ' (mof ' + ('on' if mof else 'off') + ')'
  names = [impl + mof_name(mof) for impl, mof in impls[:-1]]
  names += ['pair: torch', 'pair: fused' + mof_name(mofs[-1])]
  print(f'\nGparam/s, median of {args.rounds} rounds (best of {args.repeats} updates each); '
        f'{cores} cores; JAX processes with allocator {args.allocator!r}. ratio: fused'
        f'{mof_name(mofs[-1])} / torch, each in its own process; pair ratio: the two in one '
        'process on the same buffers')
  print('| params | threads | ' + ' | '.join(names) + ' | ratio | pair ratio |')
  print('|---|---|' + '---:|' * (len(names) + 2))
  for size in args.sizes:
    for t in threads:
      runs = [results[(size, t, impl, mof)] for impl, mof in impls]
      med = [statistics.median(rates[0] for rates in runs_) for runs_ in runs[:-1]]
      med += [statistics.median(rates[k] for rates in runs[-1]) for k in (0, 1)]
      pair = statistics.median(fused / torch for torch, fused in runs[-1])  # per process
      print(f'| {size}M | {t} | ' + ' | '.join(f'{m:.2f}' for m in med)
            + f' | {med[-3] / med[0]:.2f} | {pair:.2f} |')


if __name__ == '__main__':
  main()
