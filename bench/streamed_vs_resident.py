"""Streamed host-tier step time vs resident step time, measured side by side in one process.

    python bench/streamed_vs_resident.py [--sweeps 12] [--json out.json]

The same model, batch and optimizer run in the resident engine (everything in device memory) and
in the streamed engine with layer weights and Adam state in pinned host memory, for a few
placements. Each of the `--sweeps` sweeps runs one step of every streamed engine, in reverse
order every other sweep, with a resident step before the first and after each one:
R E1 R E2 R ... En R. An engine's ratio to resident is the median over sweeps of its step time
over the mean of the two resident steps that bracket it, printed with the quartiles of those
ratios. This VM's speed drifts by up to 1.4x within a minute (resident steps of 0.77-1.14 s in
one run of 2026-12-05), so the reference has to be measured within seconds of the step it
divides. Until 2026-12-05 one resident step per sweep served every engine of the sweep, up to
five steps away, and before that the bench divided the engines' median step times (still in the
JSON as `ratio_of_medians`). Compilation and the first step are excluded. The placements are
what the planner runs when everything fits: with the optimizer on the device the gradients wait
for the global norm in device memory (offload.park_grads; K = 1 also with them in the weights'
tier, for comparison), and K = 2 keeps the layer inputs (offload.keep_layer_inputs; also without
them, for comparison). The last row runs the same K = 1 group loop with the weights and Adam state
in device memory, so nothing is copied: the first row's excess over it is the copies' cost. (On
this CPU the planner itself puts a host-tier K = 1 run's optimizer on the host, the
'optimizer on host' row: `launch.py --config tiny --dry_run` with the layers' params and Adam on
host and K = 1.)

On CPU both memory kinds are the same RAM: the ratio measures the engine's own overhead (group
loop, extra dispatches, copies between memory kinds, the recompute schedule), not PCIe. The CPU
columns (the process's CPU time per step, all threads) are the work done: on a machine other
processes load, wall time says more about them than about the engines. The last columns are the
bytes each streamed step moves between memory kinds (the engine's `io/h2d_gb` + `io/d2h_gb`) and
what copying them costs at the rate `jax.device_put` of one layer group's weights and Adam state
runs at here (measured in the same process, both directions): on CPU those copies are memcpys on
the cores that compute, which on a GPU its DMA engines do beside the compute.

The process runs under the allocator the package applies at import ('tuned' without a trim
limit, or MEGATRAIN_JAX_ALLOCATOR): one setting for every engine. A launch.py streamed run also
trims its heap above the plan's host peak x 1.1 (runtime.trim_limit); bench/host_allocator.py
compares the allocators on whole runs.
"""

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import optim
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement

MODEL = ModelConfig(vocab_size=256, d_model=384, num_layers=6, num_heads=6, num_kv_heads=3,
                    d_ff=1024, max_seq_len=256, remat='full')
MICROBATCHES, BATCH, SEQ = 2, 4, 256

PLACEMENTS = {
    # K = 1 with the gradients parked in device memory until the global norm (offload.park_grads,
    # what the planner picks when they fit) and, for comparison, in the weights' tier.
    'streamed K=1, optimizer on device': Placement(params='host', opt_state='host',
                                                   layers_per_group=1, park_grads='device'),
    "streamed K=1, gradients in the weights' tier": Placement(params='host', opt_state='host',
                                                              layers_per_group=1),
    # K = 2 as the planner runs it (offload.keep_layer_inputs: each layer recomputed once in the
    # backward), and without the layer inputs (the group recomputed first: a third forward).
    'streamed K=2, optimizer on device': Placement(params='host', opt_state='host',
                                                   layers_per_group=2, keep_layer_inputs=True,
                                                   park_grads='device'),
    'streamed K=2, group inputs only': Placement(params='host', opt_state='host',
                                                 layers_per_group=2, keep_layer_inputs=False,
                                                 park_grads='device'),
    'streamed K=1, optimizer on host': Placement(params='host', opt_state='host',
                                                 layers_per_group=1, optimizer_on='host'),
    'streamed K=1, activations on host': Placement(params='host', opt_state='host',
                                                   activations='host', layers_per_group=1,
                                                   park_grads='device'),
    # The streamed engine's group loop with nothing to copy: weights and Adam state in device
    # memory. Its ratio is the loop's own cost (dispatches, per-group programs, the recompute
    # schedule); the first row's excess over it is what the copies between memory kinds cost.
    'streamed K=1, weights and Adam on device (no copies)': Placement(
        params='device', opt_state='device', layers_per_group=1, park_grads='device'),
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--sweeps', type=int, default=12,
                      help='timed sweeps, each one step of every engine')
  parser.add_argument('--json', default='')
  args = parser.parse_args()

  train_cfg = config_lib.load_config('tiny', train__steps=1000).train
  tx, schedule = optim.make_optimizer(train_cfg), optim.lr_schedule(train_cfg)
  state = jax.tree.map(np.asarray, jax.jit(resident.init_state, static_argnums=(0, 1))(MODEL, tx, 0))
  rng = np.random.default_rng(0)
  batch = rng.integers(0, MODEL.vocab_size, (MICROBATCHES, BATCH, SEQ + 1)).astype(np.int32)

  engines = {'resident': resident.ResidentEngine(MODEL, tx, schedule, 1.0,
                                                 jax.tree.map(np.copy, state))}
  for name, placement in PLACEMENTS.items():
    engines[name] = StreamedEngine(MODEL, tx, schedule, 1.0, placement, state)
  for engine in engines.values():  # compile + first step
    float(engine.train_step(batch)['learning/loss'])

  times = {name: [] for name in engines}
  cpu = {name: [] for name in engines}  # the process's CPU seconds (all threads) per step
  # step time / the mean of the two resident steps that bracket it
  ratios = {name: [] for name in engines}
  cpu_ratios = {name: [] for name in engines}
  moved = {}  # streamed engine -> GB copied between memory kinds per step

  def step(name):
    started, cpu_started = time.perf_counter(), time.process_time()
    metrics = engines[name].train_step(batch)
    float(metrics['learning/loss'])
    times[name].append(time.perf_counter() - started)
    cpu[name].append(time.process_time() - cpu_started)
    if 'io/h2d_gb' in metrics:
      moved[name] = metrics['io/h2d_gb'] + metrics['io/d2h_gb']

  # The reference of the step just taken: the mean of the resident steps before and after it.
  reference = lambda samples: (samples['resident'][-1] + samples['resident'][-2]) / 2
  streamed = list(PLACEMENTS)
  for sweep in range(args.sweeps):  # R E1 R E2 R ... En R
    step('resident')
    for name in streamed[::1 if sweep % 2 == 0 else -1]:
      step(name)
      step('resident')
      ratios[name].append(times[name][-1] / reference(times))
      cpu_ratios[name].append(cpu[name][-1] / reference(cpu))
  ratios['resident'] = [1.0] * len(times['resident'])
  cpu_ratios['resident'] = ratios['resident']
  copy_gbps = _copy_gbps(engines[next(iter(PLACEMENTS))])

  base = statistics.median(times['resident'])
  tokens = MICROBATCHES * BATCH * SEQ
  flops = MODEL.flops_per_token(SEQ) * tokens
  print(f'machine: {platform.node()} {platform.processor() or platform.machine()}, '
        f'{jax.devices()[0].device_kind}, jax {jax.__version__}')
  print(f'model: {MODEL.num_params:,} params, {MODEL.num_layers} layers, d_model {MODEL.d_model}; '
        f'{MICROBATCHES} x {BATCH} x {SEQ} tokens/step; remat {MODEL.remat}; '
        f'{args.sweeps} sweeps of one step per engine, each bracketed by resident steps')
  print(f'copies between memory kinds: {copy_gbps:.2f} GB/s (jax.device_put of one group, median)')
  print('| engine | median step (s) | ratio to resident (quartiles) | TFLOP/s | median CPU s | '
        'CPU ratio | GB moved / step | copy s / step |')
  print('|---|---|---|---|---|---|---|---|')
  rows = {}
  for name, samples in times.items():
    low, ratio, high = np.percentile(ratios[name], [25, 50, 75])
    median, cpu_median = statistics.median(samples), statistics.median(cpu[name])
    rows[name] = {'median_s': median, 'ratio': ratio, 'ratio_quartiles': [low, high],
                  'ratio_of_medians': median / base, 'ratios': ratios[name], 'samples': samples,
                  'cpu_median_s': cpu_median, 'cpu_ratio': statistics.median(cpu_ratios[name]),
                  'cpu_samples': cpu[name], 'moved_gb': moved.get(name, 0.0),
                  'copy_s': moved.get(name, 0.0) / copy_gbps}
    print(f'| {name} | {median:.3f} | {ratio:.3f} ({low:.3f}-{high:.3f}) | '
          f'{flops / median / 1e12:.3f} | {cpu_median:.3f} | {rows[name]["cpu_ratio"]:.3f} | '
          f'{rows[name]["moved_gb"]:.3f} | {rows[name]["copy_s"]:.3f} |')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'copy_gbps': copy_gbps, 'engines': rows}, f, indent=2)


def _copy_gbps(engine: StreamedEngine, repeats: int = 10) -> float:
  """GB/s of copying group 0's weights and Adam state between memory kinds and back (median of
  `repeats` round trips): what the streamed engine's transfers cost on this machine."""
  tree = {'params': engine.params.get(0), 'opt_state': engine.opt_state.get(0)}
  nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
  seconds = []
  for _ in range(repeats):
    started = time.perf_counter()
    on_device = jax.block_until_ready(engine.layout.put(tree, 'device'))
    jax.block_until_ready(engine.layout.put(on_device, 'pinned_host'))
    seconds.append(time.perf_counter() - started)
  return 2 * nbytes / statistics.median(seconds) / 1e9


if __name__ == '__main__':
  main()
