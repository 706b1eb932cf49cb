"""The sharded engines on N devices against 1 device, side by side: step time per device count,
host -> device traffic per device, and scaling (issue 13).

    python bench/multi_device.py                        # every visible device count 1, 2, 4, ...
    python bench/multi_device.py --devices 1 8          # on an 8-GPU machine
    python bench/multi_device.py --cpu_devices 1 4      # CPU: 4 forced devices on the same cores

Each device count runs in a process of its own (XLA fixes the CPU device count when its backend
starts: --cpu_devices sets XLA_FLAGS=--xla_force_host_platform_device_count=N there), the rounds
interleave the device counts so a shared machine slows them alike, and each figure is the median
step time over all rounds (compilation and the first step of every round excluded). The model, the
global batch (MICROBATCHES x BATCH sequences of SEQ tokens) and the optimizer are the same for
every N: each device computes BATCH / N sequences of every microbatch.

    step_s          median step time
    h2d_gbps_per_device  host -> device GB of a step / N / step time (the streamed engine
                    fetches each device's shard of every group: per-device traffic falls N-fold)
    speedup         step_s(1) / step_s(N); on GPUs the goal is N (each device brings its own
                    compute and its own PCIe link)
    efficiency      speedup / N on accelerators; on CPU with forced devices (--cpu_devices), the
                    N "devices" share the same cores, so the figure that matters is the sharded
                    engine's overhead, step_s(N) / step_s(1) (goal <= 1.15: the same total compute)
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICROBATCHES, BATCH, SEQ = 2, 8, 256


def _child(devices: int, placement_name: str, steps: int) -> dict:
  """One round on the first `devices` devices: step times after the first step, h2d bytes."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, ROOT)
  from megatrain_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import optim  # pylint: disable=import-outside-toplevel
  from megatrain_jax.engine import resident  # pylint: disable=import-outside-toplevel
  from megatrain_jax.engine.streamed import StreamedEngine  # pylint: disable=import-outside-toplevel
  from megatrain_jax.layout import Layout  # pylint: disable=import-outside-toplevel
  from megatrain_jax.model import ModelConfig  # pylint: disable=import-outside-toplevel
  from megatrain_jax.placement import Placement  # pylint: disable=import-outside-toplevel

  model = ModelConfig(vocab_size=256, d_model=384, num_layers=6, num_heads=6, num_kv_heads=3,
                      d_ff=1024, max_seq_len=SEQ, remat='full')
  train = config_lib.load_config('tiny').train
  tx, schedule = optim.make_optimizer(train), optim.lr_schedule(train)
  layout = Layout.for_devices(jax.devices()[:devices])
  if placement_name == 'resident':
    engine = resident.ResidentEngine(model, tx, schedule, 1.0, layout=layout)
  else:
    placement = Placement(params='host', opt_state='host', layers_per_group=1)
    engine = StreamedEngine(model, tx, schedule, 1.0, placement, layout=layout)
  rng = np.random.default_rng(0)
  batch = rng.integers(0, model.vocab_size, (MICROBATCHES, BATCH, SEQ + 1)).astype(np.int32)
  times, h2d = [], []
  try:
    for step in range(steps + 1):
      started = time.perf_counter()
      metrics = engine.train_step(batch)
      float(metrics['learning/loss'])  # waits for the step
      if step:  # the first includes compilation
        times.append(time.perf_counter() - started)
        h2d.append(float(metrics.get('io/h2d_gb', 0.0)))  # the step's (the engine's GB)
  finally:
    close = getattr(engine, 'close', None)
    if close:
      close()
  return {'devices': devices, 'kind': layout.devices[0].device_kind, 'times': times,
          'h2d_gb': statistics.median(h2d) if h2d else 0.0}


def _run(devices: int, placement: str, steps: int, cpu: bool) -> dict:
  env = dict(os.environ)
  if cpu:
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={devices}').strip()
    env['JAX_PLATFORMS'] = 'cpu'
  out = subprocess.run([sys.executable, __file__, '--child', str(devices), placement, str(steps)],
                       env=env, capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(out.stderr[-3000:])
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--devices', type=int, nargs='*', help='device counts (default: 1, 2, 4, '
                      '... up to every visible device)')
  parser.add_argument('--cpu_devices', type=int, nargs='*',
                      help='CPU: forced device counts (XLA_FLAGS), e.g. 1 4')
  parser.add_argument('--placements', nargs='*', default=['streamed', 'resident'],
                      choices=['streamed', 'resident'])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3, help='timed steps per round')
  parser.add_argument('--json', help='also write the results here')
  args = parser.parse_args()
  cpu = args.cpu_devices is not None
  counts = args.cpu_devices or args.devices
  if not counts:
    import jax  # pylint: disable=import-outside-toplevel
    visible = jax.device_count()
    counts = [n for n in (1, 2, 4, 8, 16) if n <= visible]
  results = {p: {n: {'times': [], 'h2d': []} for n in counts} for p in args.placements}
  kind = ''
  for _ in range(args.rounds):
    for placement in args.placements:
      for n in counts:
        out = _run(n, placement, args.steps, cpu)
        results[placement][n]['times'] += out['times']
        results[placement][n]['h2d'].append(out['h2d_gb'])
        kind = out['kind']
  print(f'{platform.node()}: {os.cpu_count()} CPUs, devices: {kind}'
        f'{" (forced CPU devices on the same cores)" if cpu else ""}; model d_model 384 x 6 '
        f'layers, global batch {MICROBATCHES} x {BATCH} x {SEQ} tokens, {args.rounds} rounds x '
        f'{args.steps} steps')
  print('| engine | devices | step (s) | h2d GB/s per device | speedup | '
        f'{"overhead vs 1" if cpu else "efficiency"} |')
  print('|---|---:|---:|---:|---:|---:|')
  table = []
  for placement in args.placements:
    base = statistics.median(results[placement][counts[0]]['times'])
    for n in counts:
      step = statistics.median(results[placement][n]['times'])
      h2d = statistics.median(results[placement][n]['h2d']) / n / step
      speedup = base / step
      last = step / base if cpu else speedup / n
      table.append({'engine': placement, 'devices': n, 'step_s': step,
                    'h2d_gbps_per_device': h2d, 'speedup': speedup,
                    'overhead' if cpu else 'efficiency': last})
      print(f'| {placement} | {n} | {step:.3f} | {h2d:.2f} | {speedup:.2f} | {last:.2f} |')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(table, f, indent=1)


if __name__ == '__main__':
  if sys.argv[1:2] == ['--child']:
    print(json.dumps(_child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))
  else:
    main()
