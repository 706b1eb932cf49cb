"""Raw read bandwidth of the filesystem behind a directory, measured with `dd` (bs=16M).

    python bench/disk_read.py [--dir DIR] [--size-gb 2] [--repeats 2] [--json out.json]

Writes one file of random bytes (numpy, not /dev/zero: zero pages can be special-cased by
filesystems, thin-provisioned and compressing block devices), fsyncs it, then reads it with `dd`:

  buffered cold   page cache dropped first (`sync; echo 3 > /proc/sys/vm/drop_caches`, needs root)
  O_DIRECT        `iflag=direct`: bypasses the page cache, so it is cold without dropping anything
  cached          buffered read of the file right after a buffered read loaded it (RAM speed)

GB/s = 1e9 bytes / s. Other benchmarks (codecs.py, nvme_read.py, nvme_big_run.py) run this script
with --json to compare what they achieve against this disk in the same run (bench scripts import
only the package, not each other; the small `drop_page_cache()` and `cached_bytes(paths)` are
copied where needed).

"Cold" means the *guest* page cache is empty (checked with `fincore`). On a virtual machine the
host may still cache the disk image, which no guest can control or see.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
from megatrain_jax.fs import cached_bytes, drop_page_cache

_CHUNK = 64 << 20  # random data is generated and written in 64 MiB pieces


def _dd_read(path: str, direct: bool) -> float:
  """GB/s of one `dd` pass over `path` with bs=16M, to /dev/null."""
  cmd = ['dd', f'if={path}', 'of=/dev/null', 'bs=16M'] + (['iflag=direct'] if direct else [])
  # LC_ALL=C: dd's summary line uses the locale's decimal separator otherwise.
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       env={**os.environ, 'LC_ALL': 'C'})
  match = re.search(r'(\d+) bytes .* copied, ([\d.]+) s', out.stderr)
  if match is None:
    raise RuntimeError(f'cannot parse dd output: {out.stderr!r}')
  return int(match.group(1)) / float(match.group(2)) / 1e9


def _write_random(path: str, size: int, seed: int = 0) -> float:
  """Writes `size` random bytes to `path` and fsyncs; GB/s counting write calls + fsync only."""
  rng = np.random.default_rng(seed)
  busy = 0.0
  with open(path, 'wb', buffering=0) as f:
    for offset in range(0, size, _CHUNK):
      n = min(_CHUNK, size - offset)
      data = rng.integers(0, np.iinfo(np.uint64).max, n // 8, dtype=np.uint64, endpoint=True)
      started = time.perf_counter()
      f.write(memoryview(data).cast('B'))
      busy += time.perf_counter() - started
    started = time.perf_counter()
    os.fsync(f.fileno())
    busy += time.perf_counter() - started
  return size / busy / 1e9


def raw_read_gbps(directory: str, size_gb: float = 2, repeats: int = 2) -> dict:
  """dd read bandwidth (GB/s) of the filesystem holding `directory`.

  Returns medians over `repeats` passes: 'buffered_cold_gbps' (None when the page cache cannot
  be dropped), 'direct_gbps', 'cached_gbps'; also 'write_gbps' (numpy write + fsync),
  'drop_caches_ok', 'cached_after_drop_bytes' (fincore, None if unavailable) and all samples.
  The test file is deleted before returning.
  """
  size = int(size_gb * 2**30) // _CHUNK * _CHUNK or _CHUNK
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f'raw_read_{os.getpid()}.bin')
  samples = {'buffered_cold_gbps': [], 'direct_gbps': [], 'cached_gbps': []}
  try:
    write_gbps = _write_random(path, size)
    drop_ok, left = False, None
    for _ in range(repeats):
      drop_ok = drop_page_cache()
      left = cached_bytes([path])
      if drop_ok:
        samples['buffered_cold_gbps'].append(_dd_read(path, direct=False))
        # The buffered pass left the file in the page cache (it fits in RAM): a second buffered
        # pass measures the cache, not the disk.
        samples['cached_gbps'].append(_dd_read(path, direct=False))
      drop_page_cache()  # O_DIRECT ignores the cache; dropping keeps the passes alike
      samples['direct_gbps'].append(_dd_read(path, direct=True))
  finally:
    if os.path.exists(path):
      os.remove(path)
  result = {'directory': os.path.abspath(directory), 'size_bytes': size, 'block_size': '16M',
            'repeats': repeats, 'write_gbps': write_gbps, 'drop_caches_ok': drop_ok,
            'cached_after_drop_bytes': left, 'samples': samples}
  for name, values in samples.items():
    result[name] = statistics.median(values) if values else None
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', default='', help='directory on the filesystem to measure '
                      '(default: a fresh /tmp/megatrain_bench_*, deleted afterwards)')
  parser.add_argument('--size-gb', type=float, default=2, help='test file size in GiB')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--json', default='')
  args = parser.parse_args()

  directory = args.dir or tempfile.mkdtemp(prefix='megatrain_bench_', dir='/tmp')
  try:
    r = raw_read_gbps(directory, args.size_gb, args.repeats)
  finally:
    if not args.dir:
      shutil.rmtree(directory, ignore_errors=True)

  def fmt(v):
    return 'n/a' if v is None else f'{v:.2f}'

  print(f'dd read, bs=16M, {r["size_bytes"] / 2**30:.2f} GiB random file in {r["directory"]}, '
        f'median of {r["repeats"]} (GB/s = 1e9 B/s)')
  print(f'drop_caches works: {r["drop_caches_ok"]}; bytes still cached after the drop (fincore): '
        f'{r["cached_after_drop_bytes"]}')
  print('| read | GB/s | samples |')
  print('|---|---|---|')
  for name, label in (('buffered_cold_gbps', 'buffered, cold'), ('direct_gbps', 'O_DIRECT'),
                      ('cached_gbps', 'buffered, page cache')):
    print(f'| {label} | {fmt(r[name])} | {", ".join(f"{v:.2f}" for v in r["samples"][name])} |')
  print(f'| (write + fsync, numpy) | {r["write_gbps"]:.2f} | |')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(r, f, indent=2)


if __name__ == '__main__':
  main()
