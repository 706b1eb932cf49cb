"""The Python thread's own work per streamed step at real vocabularies: programs, copies, CPU ms.

    python bench/dispatch_overhead.py [--vocabs 128256,151936] [--layers 16] [--micro 1,4]
                                      [--placements all] [--steps 3] [--profile NAME] [--json f]

On a GPU the Python thread dispatches every program of a streamed step (one per layer group,
vocabulary chunk and microbatch) and must stay ahead of the device: Python time per step that
grows with layers x microbatches or vocabulary chunks x microbatches is idle device time once it
exceeds the compute. On CPU it can be counted exactly. A model of real vocabulary (Llama 3's
128,256, Qwen2's 151,936) and real depth but tiny width (d_model 64: the vocabulary splits into
as many chunks as the placement's rules make of a small model's, the compute is negligible) runs
`--steps` timed steps after two warm-up ones, in the resident engine and in the streamed one on
each placement, and per step the table gives:

  programs    jitted programs dispatched: the engine's stage functions (engine/functions.py) and
              eager jax operations (each one a program of its own: jnp.int32(...), sums of scalars)
  eager       of which eager operations
  puts        leaves handed to jax.device_put (every copy between memory kinds, every batch array)
  cpu ms      the main (Python) thread's CPU time (time.thread_time): dispatch, tree maps,
              bookkeeping; XLA's compute runs on its own threads on CPU and is not in it
  wall ms     the step's wall time
  compiles    backend compilations during the timed steps (must be 0: no retracing after warm-up)

`--profile NAME` also prints cProfile's top functions (by own time) of one timed step of the
engine whose row name starts with NAME. The counts are exact and repeatable; the ms figures are
medians of the timed steps on a shared 2-core VM (rerun to compare, alternating trees).
"""

import argparse
import collections
import contextlib
import cProfile
import json
import pstats
import sys
import tempfile
import time

import jax
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import optim
from megatrain_jax import profiling
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement

BATCH, SEQ = 1, 32
# The engines' own programs (engine/functions.py, resident.py); any other is an eager operation.
STAGES = {'embed_chunk', 'embed_chunk_add', 'lse_init', '_lse_update', 'lse_finish',
          'head_chunk_backward', 'embed_chunk_backward', 'group_forward',
          'group_forward_keeping_inputs', 'token_positions', 'final_norm', 'final_norm_backward',
          'group_backward', 'group_backward_from_inputs', 'add_gradients', 'mean_sum_of_squares',
          '_global_norm', 'device_update', '_host_update', 'train_step'}


def placements(directory: str) -> dict:
  """Row name -> Placement: one-layer groups, the embedding and head streamed beside them."""
  host = dict(params='host', opt_state='host', embed_head='host', layers_per_group=1)
  nvme = dict(params='nvme', opt_state='nvme', embed_head='nvme', layers_per_group=1,
              dir=directory)
  return {'host, opt device': Placement(**host),
          'host, opt host': Placement(**host, optimizer_on='host'),
          'nvme, opt device': Placement(**nvme),
          'nvme, opt host': Placement(**nvme, optimizer_on='host')}


class Counts:
  """What the main thread runs while `on`: programs executed by name, device_put leaves, and
  backend compiles."""

  def __init__(self):
    self.programs, self.puts, self.compiles, self.on = collections.Counter(), 0, 0, False

  def reset(self) -> None:
    self.programs, self.puts, self.compiles = collections.Counter(), 0, 0


@contextlib.contextmanager
def listening(counts: Counts):
  """Counts backend compiles (always) and device_put leaves (while counts.on)."""
  put = jax.device_put

  def device_put(x, *args, **kwargs):
    if counts.on:
      counts.puts += len(jax.tree.leaves(x))
    return put(x, *args, **kwargs)

  def compiled(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      counts.compiles += 1

  jax.monitoring.register_event_duration_secs_listener(compiled)
  jax.device_put = device_put
  try:
    yield
  finally:
    jax.device_put = put


def model(vocab: int, layers: int, d_model: int) -> ModelConfig:
  return ModelConfig(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=4,
                     num_kv_heads=2, d_ff=4 * d_model, max_seq_len=SEQ, remat='full')


def measure(engine, batch, steps: int, counts: Counts, profile: bool) -> dict:
  """Medians of `steps` timed steps of `engine` (after two warm-up ones), then the programs and
  device_put leaves of one more step."""
  for _ in range(2):
    float(engine.train_step(batch)['learning/loss'])
  counts.reset()
  cpu, wall = [], []
  # CPU time of the main thread: the Python work, not the waits for XLA's threads.
  profiler = cProfile.Profile(time.thread_time) if profile else None
  for i in range(steps):
    if profiler is not None and i == steps - 1:
      profiler.enable()
    started, cpu_started = time.perf_counter(), time.thread_time()
    float(engine.train_step(batch)['learning/loss'])
    cpu.append(time.thread_time() - cpu_started)
    wall.append(time.perf_counter() - started)
    if profiler is not None and i == steps - 1:
      profiler.disable()
  compiles = counts.compiles
  with profiling.programs_executed() as programs:
    counts.on = True
    float(engine.train_step(batch)['learning/loss'])
    counts.on = False
  counts.programs = programs
  if profiler is not None:
    pstats.Stats(profiler, stream=sys.stdout).sort_stats('tottime').print_stats(30)
  eager = sum(n for name, n in counts.programs.items() if name not in STAGES)
  return {'programs': sum(counts.programs.values()), 'eager': eager, 'puts': counts.puts,
          'compiles': compiles + counts.compiles, 'cpu_ms': float(np.median(cpu)) * 1e3,
          'wall_ms': float(np.median(wall)) * 1e3, 'by_program': dict(counts.programs)}


def run(args, counts: Counts, directory: str) -> list:
  train = config_lib.load_config('tiny', train__steps=100).train
  tx, schedule = optim.make_optimizer(train), optim.lr_schedule(train)
  rows = []
  for vocab in args.vocabs:
    cfg = model(vocab, args.layers, args.d_model)
    state = jax.tree.map(np.asarray,
                         jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0))
    for micro in args.micro:
      batch = np.random.default_rng(0).integers(0, vocab, (micro, BATCH, SEQ + 1)).astype(
          np.int32)
      engines = {'resident': None, **placements(directory)}
      for name, placement in engines.items():
        if args.placements != 'all' and name != 'resident' and not any(
            name.startswith(p) for p in args.placements.split(';')):
          continue
        if name == 'resident':
          engine = resident.ResidentEngine(cfg, tx, schedule, args.clip, jax.tree.map(np.copy,
                                                                                   state))
          chunks = 1
        else:
          engine = StreamedEngine(cfg, tx, schedule, args.clip, placement, state)
          chunks = len(engine.vocab)
        profile = bool(args.profile) and f'{vocab} M={micro} {name}'.startswith(args.profile)
        row = {'vocab': vocab, 'layers': args.layers, 'micro': micro, 'engine': name,
               'chunks': chunks, **measure(engine, batch, args.steps, counts, profile)}
        getattr(engine, 'close', lambda: None)()
        rows.append(row)
        _print_row(row)
  return rows


def _print_row(row: dict) -> None:
  print(f"{row['vocab']:>7} {row['layers']:>3} {row['micro']:>2} {row['engine']:<17}"
        f"{row['chunks']:>4} {row['programs']:>7} {row['eager']:>6} {row['puts']:>6}"
        f"{row['cpu_ms']:>9.1f} {row['wall_ms']:>9.1f} {row['compiles']:>4}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ints = lambda s: [int(x) for x in s.split(',')]
  parser.add_argument('--vocabs', type=ints, default=[128256, 151936])
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--d_model', type=int, default=64)
  parser.add_argument('--micro', type=ints, default=[1, 4])
  parser.add_argument('--clip', type=float, default=1.0,
                      help='grad_clip: > 0 defers the layer updates to the next forward')
  parser.add_argument('--placements', default='all',
                      help="'all' or ';'-separated beginnings of row names")
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--profile', default='',
                      help="cProfile one step of the row starting '<vocab> M=<micro> <engine>'")
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; d_model {args.d_model}, "
        f"B={BATCH}, S={SEQ}, grad_clip {args.clip}\n  command: {' '.join(sys.argv)}")
  print(f"{'vocab':>7} {'L':>3} {'M':>2} {'engine':<17}{'Vc':>4} {'progs':>7} {'eager':>6} "
        f"{'puts':>6}{'cpu ms':>9} {'wall ms':>9} {'comp':>4}")
  counts = Counts()
  with listening(counts), tempfile.TemporaryDirectory() as directory:
    rows = run(args, counts, directory)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
