"""GPU benchmark of the host tier (run on a machine with one NVIDIA GPU, e.g. a lent H200).

    python bench/gpu_host_tier.py [--models 1b,7b] [--steps 3] [--precisions highest,default] [--out DIR]

For each model: the resident engine where the FP32 state fits the GPU, and the streamed engine
with layer weights and Adam state in pinned host RAM (K=1, prefetch depth 1, optimizer on the
device, the gradients waiting for the global norm in device memory: offload.park_grads='device',
which keeps 7b's host share at 81 GB of the lent machines' 128 GiB of RAM), each at matmul
precision 'highest' (true FP32) and 'default' (TF32 on Hopper; --precisions picks). Prints step
time, tokens/s, TFLOP/s, MFU (against the datasheet peak for the precision) and the
streamed engine's I/O and time split; writes gpu_host_tier.json to --out (default $OUT or .).

XLA caps pinned host memory at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by default); this script
sets it from the host tier's size before JAX starts.

It imports the engines only (jax, flax, optax, tensorstore, numpy; not ml_collections, which the
lent GPU machines' image lacks: distributed.py names it for annotations only), so on such a
machine it runs from the repository root as it is:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/gpu_host_tier.py --out $OUT

`--models tiny` runs a small shape that a CPU finishes in seconds: tests/test_packaging.py runs it
so with ml_collections and zstandard made unimportable, which keeps this script working in that
image between the rare sessions that get a GPU.
"""

import argparse
import json
import os
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


def host_tier_gb(model_kwargs) -> int:
  """Pinned host RAM the streamed run needs: params + Adam m, v (12 B per parameter), + 25%."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
  from megatrain_jax.model.config import ModelConfig  # pylint: disable=g-import-not-at-top
  n = ModelConfig(**model_kwargs).num_params
  return int(12 * n * 1.25 / 1e9) + 8


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--models', default='1b,7b')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--precisions', default='highest,default',
                      help="matmul precisions to run, comma-separated ('highest': true FP32)")
  parser.add_argument('--out', default=os.environ.get('OUT', '.'))
  args = parser.parse_args()
  names = args.models.split(',')
  limit = max(host_tier_gb(MODELS[n]) for n in names)
  os.environ.setdefault('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', str(limit))
  os.environ.setdefault('XLA_FLAGS', '--xla_gpu_enable_latency_hiding_scheduler=true')

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from megatrain_jax import hardware  # pylint: disable=g-import-not-at-top
  from megatrain_jax import optim  # pylint: disable=g-import-not-at-top
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
        started = time.perf_counter()
        if placement is None:
          engine = resident.ResidentEngine(cfg, tx, schedule, 1.0, seed=0)
        else:
          engine = StreamedEngine(cfg, tx, schedule, 1.0, placement, seed=0)
        float(engine.train_step(batch)['learning/loss'])  # compile + first step
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
               **{k: float(v) for k, v in last.items() if k.startswith(('io/', 'perf/'))}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'gpu_host_tier.json'), 'w') as f:
    json.dump(rows, f, indent=2)
  print('| model | precision | engine | step (s) | tokens/s | TFLOP/s | MFU |')
  print('|---|---|---|---|---|---|---|')
  for r in rows:
    mfu = f'{100 * r["mfu"]:.1f}%' if r['mfu'] else 'n/a'
    print(f'| {r["model"]} | {r["precision"]} | {r["engine"]} | {r["step_s"]:.2f} | '
          f'{r["tokens_per_s"]:,.0f} | {r["tflops"]:.1f} | {mfu} |')


if __name__ == '__main__':
  sys.exit(main())
