"""Achieved read bandwidth of the NVMe tier in an I/O-bound pass, against dd on the same disk.

    python bench/nvme_read.py --dir /path/on/local/disk [--passes 2]

Initialises a 3.03B-parameter model (44 layers x 2560) into the NVMe tier (12 GB of FP32 weights
written; its 24 GB of Adam state start as zeros, registered and not written since 2026-12-05), then runs forward passes (eval: 1 x 64 tokens, so the disk, not the
compute, sets the pace) with the page cache dropped before each, so every byte comes from disk
through the engine's real read path: reader threads, prefetch_depth groups in flight,
TensorStore zarr3 with crc32c, host staging, device_put. Reports the pass's read GB / wall time
and the dd figures of bench/disk_read.py measured in the same run. Needs root (drop_caches).
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from megatrain_jax import optim
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement
from megatrain_jax.fs import drop_page_cache

# 3.03B params; 12.1 GB of FP32 weights (275 MB per layer).
MODEL = ModelConfig(vocab_size=256, d_model=2560, num_layers=44, num_heads=20, num_kv_heads=4,
                    d_ff=6912, max_seq_len=256, remat='full')
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
  parser.add_argument('--dir', required=True)
  parser.add_argument('--passes', type=int, default=2)
  parser.add_argument('--prefetch_depth', type=int, default=2)
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  directory = pathlib.Path(args.dir)
  raw = raw_read_gbps(str(directory))
  train = types.SimpleNamespace(lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                warmup_steps=0, steps=100, min_lr_ratio=0.1)
  placement = Placement(params='nvme', opt_state='nvme', layers_per_group=1,
                        prefetch_depth=args.prefetch_depth, dir=str(directory / 'stores'),
                        host_buffer_gb=4.0)
  engine = StreamedEngine(MODEL, optim.make_optimizer(train), optim.lr_schedule(train), 1.0,
                          placement, seed=0)
  engine.params.flush()
  engine.opt_state.flush()
  batch = np.arange(65, dtype=np.int32).reshape(1, 65) % 256
  passes = []
  for _ in range(args.passes):
    assert drop_page_cache(), 'needs root: cannot drop the page cache'
    before = engine.stats.disk_snapshot()['read_bytes']
    started = time.perf_counter()
    engine.eval_losses([batch])
    seconds = time.perf_counter() - started
    gigabytes = (engine.stats.disk_snapshot()['read_bytes'] - before) / 1e9
    passes.append({'read_gb': gigabytes, 'seconds': seconds, 'read_gbps': gigabytes / seconds})
    print(json.dumps(passes[-1]), flush=True)
  engine.close()
  best = max(p['read_gbps'] for p in passes)
  print(f'dd cold buffered {raw["buffered_cold_gbps"]:.2f} GB/s, dd O_DIRECT '
        f'{raw["direct_gbps"]:.2f} GB/s; NVMe tier forward pass {best:.2f} GB/s = '
        f'{best / raw["buffered_cold_gbps"]:.2f} of buffered, {best / raw["direct_gbps"]:.2f} of '
        'O_DIRECT')
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({'raw': raw, 'passes': passes}, indent=2))


if __name__ == '__main__':
  main()
