"""On-disk layout of the NVMe tier: one zarr3 TensorStore array per split leaf.

Layer leaves: array [L, *leaf_shape] float32; one outer chunk per layer (a zarr3 shard = one file
per layer), split by `sharding_indexed` into inner chunks of at most `shard_mb` so that codecs and
reads run in parallel over a layer. Vocabulary leaves (embedding [V, D], head kernel [D, V]): one
file per vocabulary chunk of at most `shard_mb`. Every inner chunk and the shard index carry a
crc32c checksum: a read of a corrupted chunk fails instead of returning wrong numbers. Missing
chunks are errors too (`fill_missing_data_reads=False`): a layer that was never written is never
read as zeros, and all-zero chunks are written like any other (`store_data_equal_to_fill_value`).

Codecs (all lossless):
  none   raw little-endian bytes
  zstd   zstd at `level`
  blosc  blosc (zstd inside) with a 4-byte shuffle over 1 MiB blocks: groups the exponent bytes of
         FP32 values, which is where almost all of their redundancy is
"""

import math

CODECS = ('none', 'zstd', 'blosc')
# Valid `level`s (inclusive), as TensorStore accepts them: zstd's negative "fast" levels to its
# maximum 22; blosc's clevel 0 (no compression) to 9.
CODEC_LEVELS = {'zstd': (-131072, 22), 'blosc': (0, 9)}


def compression_codecs(codec: str, level: int) -> list[dict]:
  if codec == 'none':
    return []
  if codec == 'zstd':
    return [{'name': 'zstd', 'configuration': {'level': level, 'checksum': False}}]
  if codec == 'blosc':
    return [{'name': 'blosc', 'configuration': {'cname': 'zstd', 'clevel': level,
                                                 'shuffle': 'shuffle', 'typesize': 4,
                                                 'blocksize': 1 << 20}}]
  raise ValueError(f'unknown codec {codec!r}; use one of {CODECS}')


def inner_chunk_shape(layer_shape: tuple[int, ...], shard_mb: float,
                      itemsize: int = 4) -> list[int]:
  """[1, rows, *rest]: split a layer along its first axis into pieces of at most shard_mb
  (rows divides the first axis; a single row larger than shard_mb stays whole)."""
  if not layer_shape:
    return [1]
  row_bytes = itemsize * math.prod(layer_shape[1:])
  max_rows = max(1, min(layer_shape[0], int(shard_mb * 2**20 // max(row_bytes, 1))))
  # zarr3 needs inner chunks that tile the layer exactly: the largest divisor within the bound.
  rows = next(r for r in range(max_rows, 0, -1) if layer_shape[0] % r == 0)
  return [1, rows, *layer_shape[1:]]


def array_spec(path: str, shape: tuple[int, ...], *, codec: str = 'none', level: int = 1,
               shard_mb: float = 512, dtype: str = 'float32', axis: int = 0,
               chunk: int = 1, parts: tuple[int, int] | None = None) -> dict:
  """TensorStore spec of a leaf split along `axis` into files of `chunk` indices: a stacked layer
  leaf [L, *layer_shape] one layer per file (axis 0, chunk 1), or a vocabulary leaf ([V, D]
  embedding on axis 0, [D, V] head kernel on axis 1) one vocabulary chunk per file. `parts`
  (split axis, N): each of those files is further cut into N equal parts along the split axis,
  one per device shard (layout.py), so that each process writes files of its own only."""
  outer = [chunk if d == axis else n for d, n in enumerate(shape)]
  if parts is not None:
    outer[parts[0]] = shape[parts[0]] // parts[1]
  if axis == 0 and chunk == 1:
    inner = inner_chunk_shape(tuple(outer[1:]), shard_mb)
  else:  # a vocabulary chunk is sized to shard_mb already: one inner chunk per file
    inner = outer
  return {
      'driver': 'zarr3',
      'kvstore': {'driver': 'file', 'path': path},
      'fill_missing_data_reads': False,
      'store_data_equal_to_fill_value': True,  # Adam state starts at zero: still write it
      'metadata': {
          'shape': list(shape),
          'data_type': dtype,
          'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': outer}},
          'codecs': [{
              'name': 'sharding_indexed',
              'configuration': {
                  'chunk_shape': inner,
                  'codecs': [{'name': 'bytes', 'configuration': {'endian': 'little'}},
                             *compression_codecs(codec, level), {'name': 'crc32c'}],
                  'index_codecs': [{'name': 'bytes', 'configuration': {'endian': 'little'}},
                                   {'name': 'crc32c'}],
              },
          }],
      },
  }


def chunk_file(path: str, layer: int, ndim: int, axis: int = 0,
               part: tuple[int, int] | None = None) -> str:
  """The file holding chunk `layer` along `axis` of the array at `path` (zarr3 default chunk key
  encoding): a layer of a stacked leaf, or a vocabulary chunk; `part` (split axis, index): its
  part of an `array_spec(parts=...)` array."""
  index = lambda d: layer if d == axis else part[1] if part is not None and d == part[0] else 0
  return '/'.join([path, 'c'] + [str(index(d)) for d in range(ndim)])
