"""A model whose FP32 state is larger than this machine's RAM, trained from the NVMe tier.

    /usr/bin/time -v python bench/nvme_big_run.py --dir /path/on/local/disk [--steps 3]

A ~3B-parameter Llama-style model ('wide': 44 layers x 2560, GQA 20/4, SwiGLU 6912; 'deep': 67 x
2048, GQA 16/4, SwiGLU 5632; byte vocab): FP32 params + Adam m + v = 36.3-36.4 GB, plus 12 GB of
parked gradients (exact clipping), all on disk in the NVMe tier; the machine has 24 GiB of RAM.
'llama3b' is Llama-3.2-3B's shape with its 128,256-token tied embedding, which goes to the NVMe
tier too (vocabulary chunks), updated by the host optimizer band by band: 51.4 GB of params +
Adam m, v, plus 12.8 GB of parked gradients. Before training, the script measures the raw cold read
bandwidth of the same disk with dd (bench/disk_read.py), so the achieved read GB/s of the
I/O-bound training steps can be compared side by side. Prints per step: loss, step time and its
split (prefetch stall, compute, optimizer), GB read and written, read and write GB/s.

The batch (1 x 64 tokens of tiny Shakespeare) is the same every step, so three steps show the
loss falling; the point is the I/O path, not learning.
"""

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from megatrain_jax import optim, runtime
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement

MODELS = {  # both ~3.0B params, 36.3-36.4 GB of FP32 params + Adam m, v
    'wide': ModelConfig(vocab_size=256, d_model=2560, num_layers=44, num_heads=20, num_kv_heads=4,
                        d_ff=6912, max_seq_len=256, remat='full'),
    'deep': ModelConfig(vocab_size=256, d_model=2048, num_layers=67, num_heads=16, num_kv_heads=4,
                        d_ff=5632, max_seq_len=256, remat='full'),  # 35% smaller groups: less RSS
    # Llama-3.2-3B's shape: 28 x 3072, GQA 24/8, SwiGLU 8192, tied 128,256-token embedding
    # (394M of its 3.21B params). FP32 params + Adam m, v = 51.4 GB; with the embedding/head on
    # NVMe too and the host optimizer (issue 10's moonshot).
    'llama3b': ModelConfig(vocab_size=128256, d_model=3072, num_layers=28, num_heads=24,
                           num_kv_heads=8, d_ff=8192, max_seq_len=256, remat='full',
                           tie_embeddings=True),
}
# Where each model's embedding/head and optimizer run (the byte-vocabulary models keep their
# 0.7M-parameter embedding on the device, as when they were first measured).
OUTER = {'wide': dict(embed_head='device', optimizer_on='device'),
         'deep': dict(embed_head='device', optimizer_on='device'),
         'llama3b': dict(embed_head='nvme', optimizer_on='host')}
SHARED = pathlib.Path(__file__).resolve().parents[2] / 'shared' / 'data'
DISK_READ = pathlib.Path(__file__).resolve().parent / 'disk_read.py'


def raw_read_gbps(directory, size_gb: float = 2, repeats: int = 2) -> dict:
  """dd read bandwidth of `directory`'s filesystem: the --json result of bench/disk_read.py, run
  as a program (bench scripts import only the package, not each other)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / 'disk_read.json'
    subprocess.run([sys.executable, str(DISK_READ), '--dir', str(directory), '--size-gb',
                    str(size_gb), '--repeats', str(repeats), '--json', str(out)],
                   stdout=subprocess.DEVNULL, check=True)
    return json.loads(out.read_text())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--dir', required=True, help='directory on the disk under test')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--model', choices=sorted(MODELS), default='wide')
  parser.add_argument('--host_buffer_gb', type=float, default=2.5,
                      help='>= 3 groups: 2.5 for wide, 1.7 for deep; llama3b: 2.5 (write-behind '
                      'budget = this - 2 groups, at least one group of 1.2 GB)')
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  directory = pathlib.Path(args.dir)
  model = MODELS[args.model]
  directory.mkdir(parents=True, exist_ok=True)
  # What train.py sets for a streamed run (runtime.trim_limit): the 'tuned' heap is trimmed
  # whenever the resident set passes the host buffer plus ~1 GB of runtime (x TRIM_MARGIN), so
  # the peak RSS tracks live memory (the package applies 'tuned' without a limit at import).
  runtime.configure_allocator('tuned', (args.host_buffer_gb + 1) * 1e9 * runtime.TRIM_MARGIN)

  raw = raw_read_gbps(directory)
  print('raw disk read (dd):', json.dumps(raw), flush=True)

  n = model.num_params
  print(f'model: {n / 1e9:.2f}B params; FP32 params + Adam m, v = {12 * n / 1e9:.1f} GB '
        f'(+ {4 * n / 1e9:.1f} GB parked gradients); RAM {os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30:.1f} GiB',
        flush=True)
  # Adam's first updates move each of the 3B weights by ~lr at once: lr 3e-4 (6.08 -> 4.87 ->
  # 12.08) and 5e-5 (6.08 -> 3.38 -> 5.23) overshot on the third step of this fixed batch.
  train = types.SimpleNamespace(lr=1.5e-5, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                warmup_steps=0, steps=100, min_lr_ratio=0.1)
  placement = Placement(params='nvme', opt_state='nvme', layers_per_group=1, prefetch_depth=1,
                        dir=str(directory / 'stores'), host_buffer_gb=args.host_buffer_gb,
                        **OUTER[args.model])
  placement.check(model)
  started = time.perf_counter()
  engine = StreamedEngine(model, optim.make_optimizer(train), optim.lr_schedule(train), 1.0,
                          placement, seed=0)
  for store in (s for stores in engine.stores.values() for s in stores.all()):
    store.flush()
  print(f'initialised on disk group by group in {time.perf_counter() - started:.0f} s', flush=True)

  text = (SHARED / 'tinyshakespeare' / 'input.txt').read_bytes()[:65]
  batch = np.frombuffer(text, np.uint8).astype(np.int32).reshape(1, 1, 65)
  rows = []
  for step in range(args.steps):
    t0 = time.perf_counter()
    metrics = engine.train_step(batch)
    loss = float(metrics['learning/loss'])
    row = {'step': step + 1, 'loss': loss, 'step_s': time.perf_counter() - t0,
           **{k: float(v) for k, v in metrics.items() if k.startswith(('io/', 'perf/'))}}
    row['read_gbps_over_step'] = row['io/read_gb'] / row['step_s']
    rows.append(row)
    print(json.dumps(row), flush=True)
  engine.close()
  peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f'peak RSS: {peak_rss:.2f} GiB')
  print('| step | loss | step (s) | stall (s) | compute (s) | optimizer (s) | read GB | read GB/s '
        '(busy) | write GB/s (busy) |')
  print('|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f'| {r["step"]} | {r["loss"]:.4f} | {r["step_s"]:.1f} | {r["perf/fetch_wait_s"]:.1f} '
          f'| {r["perf/compute_s"]:.1f} | {r["perf/optimizer_s"]:.1f} | {r["io/read_gb"]:.1f} | '
          f'{r["io/read_gbps"]:.2f} | {r["io/write_gbps"]:.2f} |')
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({'raw': raw, 'rows': rows,
                                                   'peak_rss_gib': peak_rss}, indent=2))


if __name__ == '__main__':
  main()
