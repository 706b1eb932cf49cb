"""NVMe-tier codecs on real FP32 training state: compression ratio, write and cold-read MB/s.

    python bench/codecs.py [--dir DIR] [--steps 24] [--mib-per-kind 256] [--layer-mib 32]
                           [--shard-mb 512,16] [--inflight 1,2,4] [--repeats 2]
                           [--file-io-mode default] [--raw-gb 1] [--state-cache NPZ]
                           [--json out.json]

Run as root to get cold reads: the page cache is dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`)
before every cold pass, and `fincore` confirms that none of the files are still cached. Without
root the "cold" passes are not cold: the script says so and reports the bytes `fincore` found
cached. (TensorStore's `file_io_mode: direct` is no way around it: with tensorstore 0.1.86 a
'direct' read pass still left every byte of the files in the page cache.)

The state is real: a small Llama-style model (4 layers, d_model 512, ~2.9M params per layer) is
trained for --steps AdamW steps with the resident engine on byte-level tinyshakespeare, then

  weights   params['layers']              adam_m / adam_v   opt_state mu / nu of the layers
  grads     one more step's raw (unclipped) gradient of loss_fn, params['layers'] part

Each kind is flattened layer by layer into one FP32 stream (~46 MB of real values), tiled
(repeated) up to --mib-per-kind and cut into benchmark "layers" of --layer-mib, stored as
[L, rows, 1024] with `megatrain_jax.tiers.codecs.array_spec` (one file per layer, inner chunks of
at most shard_mb, crc32c). The repeats sit ~46 MB apart, far beyond what any codec here can see
(zstd-1/-3 windows are 0.5/2 MiB, blosc blocks 1 MiB, one inner chunk at most 512 MiB but every
chunk compressed on its own), so tiling does not inflate the ratio; it only gives the disk enough
bytes to time.

Per kind x codec x shard_mb: write MB/s (logical bytes / wall time of one TensorStore write of
the whole array, which includes fsync), ratio (logical bytes / bytes of the layer files), cold
read MB/s with 1..N layer reads in flight (each pass after a page-cache drop; best of --repeats
passes, all kept in the JSON), a warm read (page cache) with the most reads in flight, and a
bit-exact check of every read. MB = 1e6 bytes.
`--file-io-mode default,memmap,direct` reads the same files in each TensorStore file I/O mode
(`memmap` maps the file instead of read(2) into a buffer; `direct` uses O_DIRECT). Writes always
use the default mode. The tables end with each codec averaged over the kinds and the fastest
codec for cold reads with the most reads in flight.
"""

import argparse
import collections
import functools
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import types

import jax
import numpy as np
import tensorstore as ts

from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.engine import resident
from megatrain_jax.model import ModelConfig
from megatrain_jax.tiers import codecs as tier_codecs
from megatrain_jax.fs import cached_bytes, drop_page_cache

MODEL = ModelConfig(vocab_size=256, d_model=512, num_layers=4, num_heads=8, num_kv_heads=4,
                    d_ff=1376, max_seq_len=256)
TRAIN = types.SimpleNamespace(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                              warmup_steps=5, steps=24, min_lr_ratio=0.1)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    '../../shared/data/tinyshakespeare/input.txt')
CODECS = (('none', 0), ('zstd', 1), ('zstd', 3), ('blosc', 1))  # (codec, level)
ROW = 1024  # floats per row of the benchmark arrays: 4 KiB, the unit inner chunks are cut in
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


def _layers_flat(tree) -> np.ndarray:
  """{'layers': leaves [L, ...]} subtree -> [L, P] float32, each layer's leaves concatenated."""
  leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
  num_layers = leaves[0].shape[0]
  return np.concatenate([x.reshape(num_layers, -1) for x in leaves], axis=1)


def make_state(steps: int, batch: int, seq: int, seed: int = 0, cache: str = ''):
  """Trains MODEL for `steps` steps; returns ({kind: [L, P] float32}, loss log, from_cache).

  With `cache`, a .npz saved by an earlier run with the same settings is loaded instead of
  training again (training is most of a run's time on 2 cores); otherwise it is written there.
  """
  settings = np.array([steps, batch, seq, seed])
  if cache and os.path.exists(cache):
    saved = np.load(cache)
    if np.array_equal(saved['settings'], settings):
      kinds = {k: saved[k] for k in ('weights', 'adam_m', 'adam_v', 'grads')}
      return kinds, list(saved['losses']), True
  text = np.frombuffer(open(DATA, 'rb').read(), np.uint8)
  rng = np.random.default_rng(seed)

  def next_batch():  # [1, B, S+1]: one microbatch of random byte windows
    starts = rng.integers(0, len(text) - seq - 1, batch)
    return np.stack([text[s:s + seq + 1] for s in starts]).astype(np.int32)[None]

  train = types.SimpleNamespace(**{**vars(TRAIN), 'steps': steps})
  tx, schedule = optim.make_optimizer(train), optim.lr_schedule(train)
  engine = resident.ResidentEngine(MODEL, tx, schedule, grad_clip=1.0, seed=seed)
  losses = [float(engine.train_step(next_batch())['learning/loss']) for _ in range(steps)]
  state = engine.export_state()
  # optax.adamw = chain(scale_by_adam, add_decayed_weights, scale_by_lr): [0] holds mu and nu.
  adam = state['opt_state'][0]
  grads = jax.jit(jax.grad(functools.partial(model_lib.loss_fn, MODEL)))(
      state['params'], next_batch()[0])
  kinds = {'weights': _layers_flat(state['params']['layers']),
           'adam_m': _layers_flat(adam.mu['layers']),
           'adam_v': _layers_flat(adam.nu['layers']),
           'grads': _layers_flat(grads['layers'])}
  if cache:
    np.savez(cache, settings=settings, losses=np.array(losses), **kinds)
  return kinds, losses, False


def stack(flat: np.ndarray, total_mib: int, layer_mib: int) -> np.ndarray:
  """Real values [L, P] tiled cyclically to [total/layer, rows, ROW] float32."""
  rows = layer_mib * 2**20 // (4 * ROW)
  num = max(1, total_mib // layer_mib)
  return np.resize(flat.reshape(-1), (num, rows, ROW))


def _label(row) -> str:
  return f'{row["codec"]}-{row["level"]}' if row['level'] else row['codec']


def _context(file_io_mode: str) -> ts.Context:
  # As the NVMe tier (tiers/nvme.py): no chunk cache, so a read always goes to the file.
  spec = {'cache_pool': {'total_bytes_limit': 0},
          'data_copy_concurrency': {'limit': os.cpu_count() or 2}}
  if file_io_mode != 'default':
    spec['file_io_mode'] = {'mode': file_io_mode}
  return ts.Context(spec)


def read_pass(spec: dict, num_layers: int, inflight: int, context: ts.Context):
  """Reads layer by layer keeping `inflight` layer reads outstanding; (seconds, [arrays])."""
  store = ts.open(spec, open=True, context=context).result()  # metadata read, not timed
  out = [None] * num_layers
  pending = collections.deque()
  started = time.perf_counter()
  for layer in range(num_layers):
    if len(pending) == inflight:
      done, future = pending.popleft()
      out[done] = future.result()
    pending.append((layer, store[layer].read()))
  while pending:
    done, future = pending.popleft()
    out[done] = future.result()
  return time.perf_counter() - started, out


def bit_exact(out, data) -> bool:
  # Compare bits, not values: NaN != NaN and -0.0 == 0.0 would hide a lossy round trip.
  return all(np.array_equal(o.view(np.uint32), d.view(np.uint32)) for o, d in zip(out, data))


def read_passes(spec, data, files, inflights, repeats, cold_mode, read_mode) -> dict:
  """Cold passes (best of `repeats` per in-flight setting), then warm passes, in `read_mode`."""
  logical, num_layers = data.nbytes, data.shape[0]
  row = {'file_io_mode': read_mode, 'cold_read_mbps': {}, 'cold_read_samples': {},
         'cached_before_read': {}, 'bit_exact': True}
  for n in inflights:
    samples = []
    for _ in range(repeats):
      if cold_mode == 'drop_caches':
        drop_page_cache()
      cached = cached_bytes(files) or 0  # fincore: 0 after a successful drop
      row['cached_before_read'][n] = max(cached, row['cached_before_read'].get(n, 0))
      seconds, out = read_pass(spec, num_layers, n, _context(read_mode))
      samples.append(logical / seconds / 1e6)
      row['bit_exact'] &= bit_exact(out, data)
      del out
    # Best of the repeats: on a shared machine the slower passes are the ones others disturbed.
    row['cold_read_samples'][n] = samples
    row['cold_read_mbps'][n] = max(samples)
  # Warm: the last cold pass left the files in the page cache (in every file_io_mode, 'direct'
  # included, as fincore shows), so these passes price decode and copies alone: the ceiling of
  # the codec on these cores.
  warm = []
  for _ in range(repeats):
    seconds, out = read_pass(spec, num_layers, max(inflights), _context(read_mode))
    warm.append(logical / seconds / 1e6)
    row['bit_exact'] &= bit_exact(out, data)
    del out
  row['warm_read_samples'], row['warm_read_mbps'] = warm, max(warm)
  return row


def bench_one(directory, data, codec, level, shard_mb, inflights, repeats, cold_mode,
              read_modes) -> list[dict]:
  """Writes `data` once with this codec; one result row per TensorStore file_io_mode read."""
  path = os.path.join(directory, f'{codec}{level}_{shard_mb}')
  spec = tier_codecs.array_spec(path, data.shape, codec=codec, level=level, shard_mb=shard_mb)
  logical = data.nbytes
  files = [tier_codecs.chunk_file(path, layer, data.ndim) for layer in range(data.shape[0])]

  store = ts.open(spec, create=True, delete_existing=True, context=_context('default')).result()
  started = time.perf_counter()
  store.write(data).result()  # resolves once the shard files are written (and fsynced)
  write_s = time.perf_counter() - started
  stored = sum(os.path.getsize(f) for f in files)

  common = {'codec': codec, 'level': level, 'shard_mb': shard_mb,
            'inner_chunks_per_layer': -(-data.shape[1] // tier_codecs.inner_chunk_shape(
                data.shape[1:], shard_mb)[1]),
            'logical_bytes': logical, 'stored_bytes': stored, 'ratio': logical / stored,
            'write_mbps': logical / write_s / 1e6}
  rows = [{**common, **read_passes(spec, data, files, inflights, repeats, cold_mode, mode)}
          for mode in read_modes]
  shutil.rmtree(path)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', default='', help='scratch directory (default: a fresh '
                      '/tmp/megatrain_bench_*); everything written is deleted at the end')
  parser.add_argument('--steps', type=int, default=24, help='training steps before sampling')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=128)
  parser.add_argument('--state-cache', default='', help='.npz to reuse the trained state across '
                      'runs (e.g. /tmp/codecs_state.npz); trained and saved if missing')
  parser.add_argument('--mib-per-kind', type=int, default=256)
  parser.add_argument('--layer-mib', type=int, default=32, help='bytes per layer file')
  parser.add_argument('--shard-mb', default='512,16', help='inner chunk sizes to compare')
  parser.add_argument('--inflight', default='1,2,4', help='layer reads kept in flight')
  parser.add_argument('--repeats', type=int, default=2,
                      help='cold passes per in-flight setting; the table shows the best')
  parser.add_argument('--kinds', default='weights,adam_m,adam_v,grads')
  parser.add_argument('--file-io-mode', default='default',
                      help="TensorStore 'file_io_mode' for reads: default, memmap, direct, or a "
                      "comma list to compare them on the same files")
  parser.add_argument('--raw-gb', type=float, default=1,
                      help='GiB for the dd reference read (bench/disk_read.py); 0 = skip')
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  shard_mbs = [float(s) if '.' in s else int(s) for s in args.shard_mb.split(',')]
  inflights = [int(s) for s in args.inflight.split(',')]
  kinds_wanted = args.kinds.split(',')
  read_modes = args.file_io_mode.split(',')

  own_dir = not args.dir
  directory = args.dir or tempfile.mkdtemp(prefix='megatrain_bench_', dir='/tmp')
  os.makedirs(directory, exist_ok=True)
  try:
    started = time.perf_counter()
    flats, losses, from_cache = make_state(args.steps, args.batch, args.seq, cache=args.state_cache)
    train_s = time.perf_counter() - started

    # Can this process drop the page cache? Proved on a real file: cached after a read, gone after.
    probe = os.path.join(directory, 'probe.bin')
    with open(probe, 'wb') as f:
      f.write(np.random.default_rng(0).bytes(8 << 20))
    with open(probe, 'rb') as f:
      f.read()
    cached_probe = cached_bytes([probe])
    drop_ok = drop_page_cache()
    after_drop = cached_bytes([probe])
    os.remove(probe)
    drop_ok = drop_ok and after_drop in (0, None)
    cold_mode = 'drop_caches' if drop_ok else 'NOT COLD (cannot drop the page cache)'

    raw = raw_read_gbps(directory, args.raw_gb, repeats=1) if args.raw_gb else None

    results = []
    for kind in kinds_wanted:
      data = stack(flats[kind], args.mib_per_kind, args.layer_mib)
      repeats = data.size / flats[kind].size
      for codec, level in CODECS:
        for shard_mb in shard_mbs:
          for row in bench_one(directory, data, codec, level, shard_mb, inflights, args.repeats,
                               cold_mode, read_modes):
            row.update(kind=kind, real_bytes=flats[kind].nbytes, repeats=repeats)
            results.append(row)
            cold = ', '.join(f'{v:.0f}' for v in row['cold_read_mbps'].values())
            print(f'  {kind} {codec}-{level} shard {shard_mb} {row["file_io_mode"]}: ratio '
                  f'{row["ratio"]:.3f} write {row["write_mbps"]:.0f} cold {cold} '
                  f'warm {row["warm_read_mbps"]:.0f} exact {row["bit_exact"]}', flush=True)
      del data
  finally:
    if own_dir:
      shutil.rmtree(directory, ignore_errors=True)

  # --- report ----------------------------------------------------------------------------------
  print()
  print(f'machine: {platform.node()}, {os.cpu_count()} cores, load average '
        f'{os.getloadavg()[0]:.2f} (others share it); TensorStore zarr3')
  trained = 'loaded from --state-cache' if from_cache else f'{train_s:.0f} s'
  print(f'state: {MODEL.num_layers}-layer d_model {MODEL.d_model} model trained {args.steps} steps '
        f'(B={args.batch}, S={args.seq}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {trained}); '
        f'per kind {flats["weights"].nbytes / 1e6:.1f} MB of real values tiled '
        f'{results[0]["repeats"]:.1f}x to {args.mib_per_kind} MiB = '
        f'{args.mib_per_kind // args.layer_mib} layer files of {args.layer_mib} MiB')
  still_cached = max(max(r['cached_before_read'].values()) for r in results)
  print(f'cold reads: {cold_mode} (drop_caches works: {drop_ok}; probe cached before drop '
        f'{cached_probe} B, after {after_drop} B); most layer-file bytes still cached before any '
        f'cold pass (fincore): {still_cached} B; best of {args.repeats} cold passes')
  if raw:
    print(f'dd reference, {raw["size_bytes"] / 2**30:.1f} GiB bs=16M: buffered cold '
          f'{raw["buffered_cold_gbps"] or 0:.2f} GB/s, O_DIRECT {raw["direct_gbps"]:.2f} GB/s, '
          f'page cache {raw["cached_gbps"] or 0:.2f} GB/s, '
          f'write+fsync {raw["write_gbps"]:.2f} GB/s')
  print()
  n = max(inflights)
  head = ' | '.join(f'cold read MB/s ({k} in flight)' for k in inflights)
  print(f'| kind | codec | shard MB (chunks/layer) | read file_io_mode | ratio | write MB/s | '
        f'{head} | warm read MB/s ({n}) | bit-exact |')
  print('|---|---|---|---|---|---|' + '---|' * len(inflights) + '---|---|')
  for r in results:
    cold = ' | '.join(f'{r["cold_read_mbps"][k]:.0f}' for k in inflights)
    print(f'| {r["kind"]} | {_label(r)} | {r["shard_mb"]} ({r["inner_chunks_per_layer"]}) | '
          f'{r["file_io_mode"]} | {r["ratio"]:.3f} | {r["write_mbps"]:.0f} | {cold} | '
          f'{r["warm_read_mbps"]:.0f} | {"yes" if r["bit_exact"] else "NO"} |')

  # Per codec and read mode, averaged over kinds, each kind at its better shard size.
  print()
  print(f'| codec (mean over kinds, better shard size each) | read file_io_mode | ratio | '
        f'write MB/s | cold read MB/s ({n} in flight) |')
  print('|---|---|---|---|---|')
  summary = {}
  for mode in read_modes:
    for codec, level in CODECS:
      picked = [max((r for r in results if r['kind'] == kind and r['codec'] == codec
                     and r['level'] == level and r['file_io_mode'] == mode),
                    key=lambda r: r['cold_read_mbps'][n]) for kind in kinds_wanted]
      avg = {key: float(np.mean([get(r) for r in picked])) for key, get in (
          ('ratio', lambda r: r['ratio']), ('write_mbps', lambda r: r['write_mbps']),
          ('cold_read_mbps', lambda r: r['cold_read_mbps'][n]))}
      summary[f'{_label(picked[0])} {mode}'] = avg
      print(f'| {_label(picked[0])} | {mode} | {avg["ratio"]:.3f} | {avg["write_mbps"]:.0f} | '
            f'{avg["cold_read_mbps"]:.0f} |')
  print()
  for mode in read_modes:
    by_codec = {name.split()[0]: v for name, v in summary.items() if name.endswith(' ' + mode)}
    best = max(by_codec, key=lambda c: by_codec[c]['cold_read_mbps'])
    versus = by_codec[best]['cold_read_mbps'] / by_codec['none']['cold_read_mbps']
    print(f'throughput winner, cold read with {n} in flight, file_io_mode {mode}: {best}'
          + (' -- no compression' if best == 'none' else f' ({versus:.2f}x none)'))
  if not all(r['bit_exact'] for r in results):
    print('ERROR: some round trips were not bit-exact')

  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'args': vars(args), 'cold_mode': cold_mode, 'drop_caches_ok': drop_ok,
                 'losses': losses, 'raw_dd': raw, 'summary': summary, 'results': results},
                f, indent=2)
  if not all(r['bit_exact'] for r in results):
    sys.exit(1)


if __name__ == '__main__':
  main()
