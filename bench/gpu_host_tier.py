"""GPU benchmark of the host tier (run on a machine with one NVIDIA GPU, e.g. a lent H200).

    python bench/gpu_host_tier.py [--models 1b,7b] [--steps 3] [--precisions highest,default] [--out DIR]

For each model: the resident engine where the FP32 state fits the GPU, and the streamed engine
with layer weights and Adam state in pinned host RAM (K=1, prefetch depth 1, optimizer on the
device, the gradients waiting for the global norm in device memory: offload.park_grads='device',
which keeps 7b's host share at 81 GB of the lent machines' 128 GiB of RAM), each at matmul
precision 'highest' (true FP32) and 'default' (TF32 on Hopper; --precisions picks). Prints step
time, tokens/s, TFLOP/s, MFU (against the datasheet peak for the precision) and the
streamed engine's I/O and time split; writes gpu_host_tier.json to --out (default $OUT or .).

XLA caps pinned host memory at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by default; the package
raises it to the RAM); this script sets it from the streamed runs' pinned state (pinned_limit_gib)
before JAX and the package are imported, unless it is set. gpu_host_tier.json is rewritten after
each run, and --deadline stops starting runs after that many seconds: a lent GPU's time is
short.

It imports the engines only (jax, flax, optax, tensorstore, numpy; not ml_collections, which the
lent GPU machines' image lacks: distributed.py names it for annotations only), so on such a
machine it runs from the repository root as it is:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/gpu_host_tier.py --deadline 420 --out $OUT

`--models tiny` runs a small shape that a CPU finishes in seconds: tests/test_packaging.py runs it
so with ml_collections and zstandard made unimportable, which keeps this script working in that
image between the rare sessions that get a GPU.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
import types

# Model shapes (the configs/ presets, repeated here to avoid importing ml_collections).
MODELS = {
    '1b': dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               d_ff=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    '7b': dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32,
               d_ff=11008, max_seq_len=4096, tie_embeddings=False),
    # A CPU smoke run of this script (tests/test_packaging.py), not a benchmark.
    'tiny': dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=128,
                 max_seq_len=128, tie_embeddings=False),
}
SEQ, BATCH, MICRO = 2048, 1, 4  # tokens per step: MICRO microbatches of BATCH x SEQ
SHAPES = {'tiny': (64, 1, 2)}  # (SEQ, BATCH, MICRO) where a model needs other than the above


def layer_params(m: dict) -> int:
  """Parameters of a model's decoder layers (q, k, v, o, gate, up, down, two norms), computed here:
  importing the package first would set XLA's environment before this script does."""
  d, heads, kv = m['d_model'], m['num_heads'], m['num_kv_heads']
  head_dim = d // heads
  per_layer = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * m['d_ff'] + 2 * d
  return m['num_layers'] * per_layer


def pinned_limit_gib(names) -> int:
  """XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB for the streamed runs: their layers' params and Adam m, v
  in pinned host memory (12 B a parameter; the embedding, head and parked gradients stay on the
  device), + 10% + 2 GiB. XLA grows its pinned pool in regions that double (a BFC allocator that
  never gives one back): capped at the machine's RAM, as the package sets it, 7b's 72 GiB would
  take about 125 GiB of a 128 GiB machine; capped here, the pool stops at what the runs use."""
  need = max(12 * layer_params(MODELS[n]) for n in names) / 2**30
  return int(need * 1.1) + 2


def _write(rows: list, out: str) -> None:
  """The rows so far, rewritten after each run: a crash or the time limit keeps the others."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'gpu_host_tier.json')
  with open(path + '.tmp', 'w') as f:
    json.dump(rows, f, indent=2)
  os.replace(path + '.tmp', path)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--models', default='1b,7b')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--warmup', type=int, default=2,
                      help='untimed steps first: compilation, and a deferred update\'s first '
                           'program, which compiles in the second step')
  parser.add_argument('--precisions', default='highest,default',
                      help="matmul precisions to run, comma-separated ('highest': true FP32)")
  parser.add_argument('--deadline', type=float, default=0.0,
                      help='seconds after which no further run starts (0: none)')
  parser.add_argument('--out', default=os.environ.get('OUT', '.'))
  args = parser.parse_args()
  started_at = time.perf_counter()
  names = args.models.split(',')
  # Before the package (which sets the cap to the RAM unless it is set) and JAX are imported.
  os.environ.setdefault('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', str(pinned_limit_gib(names)))
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_gpu_enable_latency_hiding_scheduler=true').strip()

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from megatrain_jax import hardware  # pylint: disable=g-import-not-at-top
  from megatrain_jax import optim  # pylint: disable=g-import-not-at-top
  from megatrain_jax import runtime  # pylint: disable=g-import-not-at-top
  from megatrain_jax.engine import resident  # pylint: disable=g-import-not-at-top
  from megatrain_jax.engine.streamed import StreamedEngine  # pylint: disable=g-import-not-at-top
  from megatrain_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from megatrain_jax.placement import Placement  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  print(f'device: {device.device_kind}; jax {jax.__version__}; '
        f'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]}',
        flush=True)
  train = types.SimpleNamespace(lr=1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                warmup_steps=10, steps=1000, min_lr_ratio=0.1)
  tx, schedule = optim.make_optimizer(train), optim.lr_schedule(train)
  rows = []
  device_bytes = (device.memory_stats() or {}).get('bytes_limit', 0)  # None on CPU
  if device.platform == 'cpu':
    device_bytes = 2**40  # a smoke run: the resident engine too
  for name in names:
    seq, batch_size, micro = SHAPES.get(name, (SEQ, BATCH, MICRO))
    for precision in args.precisions.split(','):
      cfg = ModelConfig(**MODELS[name], matmul_precision=precision, remat='full')
      state_gb = 16 * cfg.num_params / 1e9
      runs = [('streamed-host', Placement(params='host', opt_state='host', layers_per_group=1,
                                          park_grads='device'))]
      if state_gb < 0.6 * device_bytes / 1e9:
        runs.insert(0, ('resident', None))
      batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (micro, batch_size, seq + 1),
                                                dtype=np.int32)
      for engine_name, placement in runs:
        if args.deadline and time.perf_counter() - started_at > args.deadline:
          print(f'skipped {name} {precision} {engine_name}: past --deadline', flush=True)
          continue
        started = time.perf_counter()
        if placement is None:
          engine = resident.ResidentEngine(cfg, tx, schedule, 1.0, seed=0)
        else:
          engine = StreamedEngine(cfg, tx, schedule, 1.0, placement, seed=0)
        for _ in range(max(1, args.warmup)):  # compilation and the first steps
          float(engine.train_step(batch)['learning/loss'])
        warmup = time.perf_counter() - started
        times, last = [], {}
        for _ in range(args.steps):
          t0 = time.perf_counter()
          last = engine.train_step(batch)
          float(last['learning/loss'])
          times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        tokens = micro * batch_size * seq
        tflops = cfg.flops_per_token(seq) * tokens / step / 1e12
        peak = hardware.datasheet_peak_tflops(device.device_kind, cfg.dtype, precision)
        row = {'model': name, 'params': cfg.num_params, 'precision': precision,
               'engine': engine_name, 'loss': float(last['learning/loss']), 'step_s': step,
               'steps_s': times, 'warmup_s': warmup,
               'tokens_per_s': tokens / step, 'tflops': tflops,
               'mfu': tflops / peak if peak else None,
               # Host memory, XLA's pinned pool included (its pages are resident once touched):
               # what the planner's pool row (planner.pinned_pool_rows) predicts from XLA's source.
               # The peak is the process's so far (runs go from the smaller model up).
               'host_rss_gb': (runtime.process_rss_bytes() or 0) / 1e9,
               'host_peak_gb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
               **{k: float(v) for k, v in last.items() if k.startswith(('io/', 'perf/'))}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(rows, args.out)
        del engine
  print('| model | precision | engine | step (s) | tokens/s | TFLOP/s | MFU |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    mfu = f'{100 * r["mfu"]:.1f}%' if r['mfu'] else 'n/a'
    print(f'| {r["model"]} | {r["precision"]} | {r["engine"]} | {r["step_s"]:.2f} | '
          f'{r["tokens_per_s"]:,.0f} | {r["tflops"]:.1f} | {mfu} |')


if __name__ == '__main__':
  sys.exit(main())
