"""Write-behind throughput of the NVMe tier's layout with and without an fsync per write.

    python bench/nvme_write.py [--dir /path/on/local/disk] [--layers 32] [--layer_mb 32] [--rounds 3]

The live stores' writer thread writes one layer group after another (tiers/nvme.py). This writes
`--layers` layers of `--layer_mb` of FP32 (the store's zarr3 layout, 4 MB inner chunks, crc32c)
one after the other, twice over, with the live stores' TensorStore context
(`nvme.live_context()`: no fsync per write, what the stores use since 2026-12-05) and with the
same context but `file_io_sync` on (TensorStore's default, what they used before), alternating
the two each round. Each figure is GB written / wall time, best of the rounds; the table also
gives the time of one fsync of every file afterwards (what a checkpoint's commit pays for the
files it links).
"""

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
import tensorstore as ts

from megatrain_jax.tiers import codecs, nvme


def _write_pass(directory: pathlib.Path, data: np.ndarray, layers: int, sync: bool) -> tuple:
  """(seconds to write every layer twice, one after the other; seconds to fsync every file)."""
  shutil.rmtree(directory, ignore_errors=True)
  spec = codecs.array_spec(str(directory), (layers, *data.shape), shard_mb=4)
  context = nvme.live_context() if not sync else ts.Context(
      {**nvme.live_context().spec.to_json(), 'file_io_sync': True})
  array = ts.open(spec, create=True, delete_existing=True, context=context).result()
  started = time.perf_counter()
  for _ in range(2):
    for layer in range(layers):
      array[layer].write(data).result()
  write_s = time.perf_counter() - started
  started = time.perf_counter()
  for path in directory.rglob('*'):
    if path.is_file():
      fd = os.open(path, os.O_RDONLY)
      os.fsync(fd)
      os.close(fd)
  return write_s, time.perf_counter() - started


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--dir', default='')
  parser.add_argument('--layers', type=int, default=32)
  parser.add_argument('--layer_mb', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix='nvme_write_'))
  data = np.random.default_rng(0).standard_normal((args.layer_mb, 1 << 18), dtype=np.float32)
  gb = 2 * args.layers * data.nbytes / 1e9
  results = {'fsync per write': [], 'no fsync (live stores)': []}
  try:
    for round_ in range(args.rounds):
      for name in list(results)[::1 if round_ % 2 == 0 else -1]:
        results[name].append(_write_pass(root / 'array', data, args.layers,
                                         sync=name == 'fsync per write'))
  finally:
    shutil.rmtree(root / 'array', ignore_errors=True)
  print(f'{gb:.2f} GB per pass ({args.layers} layers x {args.layer_mb} MB, twice) in {root}')
  print('| writes | GB/s (best of rounds) | every round | fsync of all files after (s) |')
  print('|---|---:|---|---:|')
  for name, runs in results.items():
    rates = [gb / w for w, _ in runs]
    print(f'| {name} | {max(rates):.2f} | {", ".join(f"{r:.2f}" for r in rates)} | '
          f'{min(s for _, s in runs):.2f} |')
  print(json.dumps({name: [{'write_s': w, 'fsync_s': s} for w, s in runs]
                    for name, runs in results.items()}))


if __name__ == '__main__':
  main()
