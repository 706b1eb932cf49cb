"""Where one training step's time goes, per engine, from a jax.profiler trace.

    python bench/profile_step.py [--engines "resident;streamed K=1, optimizer on device"]
                                 [--steps 3] [--out /tmp/profile_step]

Runs bench/streamed_vs_resident.py's model, batch and placements (two warm-up steps, then
`--steps` traced ones) and reads the trace's Chrome-format file (profiling.py writes the same
files for a training run with profile.start_step). For each engine it prints the step time, how
long each thread was busy per step (the union of its spans: the Python thread that dispatches,
XLA's compute threads, PJRT's execute and transfer threads), the XLA op kinds that filled the
compute threads, and the Python-side calls that took longest (dispatches, device_put, waits).
Busy time below the step time on the compute threads is time the cores did something else (the
Python thread, copies, single-threaded ops) or nothing. On a GPU the device's streams show up as
threads of their own, and whether the fetches overlap the compute is read off the same table.
"""

import argparse
import collections
import glob
import gzip
import json
import time

import jax
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import optim
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine

import streamed_vs_resident as shapes  # pylint: disable=wrong-import-order  (bench/ sibling)


def _engine(name: str):
  cfg = shapes.MODEL
  train = config_lib.load_config('tiny', train__steps=100).train
  tx, schedule = optim.make_optimizer(train), optim.lr_schedule(train)
  state = jax.tree.map(np.asarray,
                       jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0))
  if name == 'resident':
    return resident.ResidentEngine(cfg, tx, schedule, 1.0, state)
  return StreamedEngine(cfg, tx, schedule, 1.0, shapes.PLACEMENTS[name], state)


def _trace(name: str, steps: int, out: str) -> tuple[float, list]:
  """(seconds per traced step, the trace's events) of `steps` steps of engine `name`."""
  engine = _engine(name)
  batch = np.random.default_rng(0).integers(
      0, shapes.MODEL.vocab_size,
      (shapes.MICROBATCHES, shapes.BATCH, shapes.SEQ + 1)).astype(np.int32)
  for _ in range(2):  # compilation and the first fetches
    float(engine.train_step(batch)['learning/loss'])
  jax.profiler.start_trace(out)
  started = time.perf_counter()
  for step in range(steps):
    with jax.profiler.StepTraceAnnotation('train', step_num=step):
      float(engine.train_step(batch)['learning/loss'])
  seconds = (time.perf_counter() - started) / steps
  jax.profiler.stop_trace()
  getattr(engine, 'close', lambda: None)()
  newest = sorted(glob.glob(f'{out}/plugins/profile/*/*.trace.json.gz'))[-1]
  return seconds, json.loads(gzip.decompress(open(newest, 'rb').read()))['traceEvents']


def _busy_ms(spans: list) -> float:
  """Total length of the union of (start, end) spans, in ms."""
  total, end = 0.0, float('-inf')
  for start, stop in sorted(spans):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total / 1e3


def summarize(events: list, steps: int) -> dict:
  """{'threads': {thread: busy ms/step}, 'ops': {XLA op kind: ms/step on the compute threads},
  'python': {call: ms/step}} of a trace's complete ('X') events."""
  names = {(e['pid'], e['tid']): e['args']['name'] for e in events
           if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  spans, ops, python = (collections.defaultdict(list), collections.defaultdict(float),
                        collections.defaultdict(float))
  for e in events:
    if e.get('ph') != 'X':
      continue
    thread = names.get((e['pid'], e['tid']), '?').split('/')[0]
    spans[f"{thread} {e['tid'] % 1000:03d}"].append((e['ts'], e['ts'] + e['dur']))
    if 'XLAEigen' in thread and not e['name'].startswith(('ThunkExecutor', 'SlinkyThreadPool')):
      ops[e['name'].split('.')[0]] += e['dur'] / 1e3 / steps
    elif thread == 'python' and e['name'].startswith('$') and 'profiler.py' not in e['name']:
      python[e['name'][1:]] += e['dur'] / 1e3 / steps
  return {'threads': {t: _busy_ms(s) / steps for t, s in spans.items()},
          'ops': dict(ops), 'python': dict(python)}


def _print(name: str, seconds: float, summary: dict, top: int) -> None:
  print(f'\n{name}: {seconds * 1e3:.0f} ms/step')
  print('  busy per step, by thread:')
  for thread, ms in sorted(summary['threads'].items(), key=lambda kv: -kv[1]):
    print(f'    {ms:8.1f} ms  {thread}')
  print('  XLA op kinds on the compute threads (ms/step, all of them together):')
  for op, ms in sorted(summary['ops'].items(), key=lambda kv: -kv[1])[:top]:
    print(f'    {ms:8.1f} ms  {op}')
  print('  Python calls (inclusive ms/step; nested calls count in their callers too):')
  for call, ms in sorted(summary['python'].items(), key=lambda kv: -kv[1])[:top]:
    print(f'    {ms:8.1f} ms  {call}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--engines', default='resident;streamed K=1, optimizer on device',
                      help="';'-separated: 'resident' and names of streamed_vs_resident's "
                           'PLACEMENTS (or their beginnings)')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--top', type=int, default=12)
  parser.add_argument('--out', default='/tmp/profile_step')
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  known = ['resident', *shapes.PLACEMENTS]
  asked = [w.strip() for w in args.engines.split(';') if w.strip()]
  wanted = [n for n in known if any(n.startswith(w) for w in asked)]
  print(f'jax {jax.__version__}, {jax.devices()[0].device_kind}; engines: {wanted}')
  results = {}
  for name in wanted:
    seconds, events = _trace(name, args.steps, args.out)
    results[name] = {'seconds_per_step': seconds, **summarize(events, args.steps)}
    _print(name, seconds, results[name], args.top)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
