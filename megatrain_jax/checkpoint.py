"""Checkpoints in <workdir>/checkpoints/<step>/: one format for every placement; never gathered.

A checkpoint holds the full train state as the resident engine shapes it ({'step', 'params',
'opt_state', 'rng'}, layer leaves stacked [L, ...]); every leaf is addressed by its tree path in
that state, so a checkpoint written under any placement restores under any other. Neither a save
nor a restore ever holds the state (or a copy of it) in host memory: in-memory leaves are written
and read piece by piece, NVMe leaves are snapshotted by hard links. Layout (format 3):

  meta.json      format, step, data_position, seed, model_config, placement, microbatches, and for
                 each leaf path where it is: `arrays` ({dir, shape, dtype} of an array in arrays/)
                 or `disk` (a directory in nvme/)
  arrays/<leaf>/ each leaf that was in memory (device or host: the whole state for resident and
                 host runs; for NVMe runs the embedding/head and their Adam state, step counts, rng,
                 and any layers kept on host or device) as a zarr3 array in the NVMe tier's layout
                 (tiers/codecs.py: raw little-endian, one file per chunk along the piece axis, a
                 crc32c on every inner chunk and on the shard index); 0-d leaves are stored as [1]
  nvme/<leaf>/   NVMe runs: each disk-resident leaf as the live store's zarr3 array (one file per
                 layer or vocabulary chunk): hard links to the live files, or copies where links
                 fail
  manifest.json  the size of every file, and a crc32 of every file except the zarr chunk files
                 (those carry their crc32c per inner chunk, checked on every read).

Saving in pieces. An engine hands over its in-memory leaves as `Parts` (below): the layout of each
leaf (shape, dtype, the axis it is cut along, the indices per file) and an iterator of pieces
(path, start, stop, array) along that axis. `save` pulls one piece, copies it to host (a device ->
host copy of that piece only; on CPU, where device memory is host memory, a view), writes it and
drops it before pulling the next, so a save adds at most one piece to the process's host memory,
plus TensorStore's encoding of one inner chunk (INNER_MB). Leaves `save` cuts itself (a resident
state, `export_state()`) get pieces of min(DEFAULT_PIECE_MB, offload.shard_mb). The pieces are
written before `save` returns (the state changes when training resumes, and a second copy is what
this format exists to avoid), so training waits for the disk writes; fsyncs, the manifest and the
commit run behind. Restore reads file by file into the destination: one file (at most a piece)
and TensorStore's buffer of it on top of the state.

Why not orbax (format 2 used it; it is still a dependency): an orbax PyTree save takes the whole
tree at once, as host arrays or device arrays it copies to host before writing (about 3x the
state at peak, orbax-checkpoint issue #1640), and restore returns the whole tree. Orbax also
verifies nothing: a flipped byte in its array data restores silently as a wrong number (tested
with orbax-checkpoint 0.12.8). Writing the zarr3 arrays with TensorStore directly gives pieces of
any size and crc32c per chunk, with the code the NVMe tier already uses.

Why a hard-link snapshot of the live NVMe store is a consistent checkpoint: TensorStore's file
kvstore never modifies a file in place; it writes `<file>.__lock` and renames it over `<file>`
(seen with strace, tensorstore 0.1.86). Once the write-behind queue is flushed at a step boundary,
linking the live files captures exactly that step, and later writes replace the live directory
entries, never the linked inodes. A snapshot costs metadata operations only: no data is read or
written and no RAM is needed, whatever the model size. Each kept checkpoint pins one full copy of
the NVMe state once the live store has rewritten every layer (the trainer's up-front disk check
counts it). When offload.dir is on another filesystem than the workdir (os.link would fail with
EXDEV), the snapshot is linked into offload.dir/.checkpoint-snapshot-<step> instead, and copied
into the checkpoint on the background thread (training goes on; the staging links pin the old
files until the copy is done, so offload.dir then needs room for a second copy). Restore is the
mirror image: the snapshot's files are linked (or copied) into a fresh live store, which is safe
for the same reason.

Commit: a checkpoint is written into checkpoints/.tmp-<step>, its files fsynced, then renamed to
<step> and the parent directory fsynced, so a checkpoint is complete or ignored (leftover .tmp
directories are deleted). The oldest checkpoints beyond `keep` are deleted only after a new one is
committed. The next save, `wait` and `close` wait for the commit and raise its error.

Restore takes the newest checkpoint that verifies: the manifest (every file present, sizes,
crc32s), then every chunk of every array read once, one at a time (its crc32c), nothing kept. A
damaged one is reported with a warning naming its step and the bad file, and the next older one is
tried; if none is intact the error names the directory and the fix. `CheckpointReader.read` then
serves slices of any leaf, `device_state` builds a resident state on the device piece by piece.

Several processes (distributed.py) write one checkpoint together into the shared workdir. Each
leaf's files are cut into one part per device shard as well (along the axis the layout splits it:
layout.py), and each process writes the parts of its own shards (`Layout.owned_boxes`; a
replicated leaf, process 0) and, of an NVMe leaf, links the chunk files of its own store. Process 0
makes the directory first and, once every process has written its files (fsynced, as they are its
own), writes meta.json and the manifest and commits; the processes meet at a barrier before and
after the writing. A restore reads any box of any leaf, so a checkpoint written on N devices (or
processes) resumes on M: each process reads its own devices' shards (`read_box`: into the
resident engine, `device_state`; into a streamed engine's stores, through partition.LazySlice).

Format 2 checkpoints (orbax `state/`, written before this version) still restore: their leaves are
read with TensorStore straight from orbax's OCDBT files (a slice at a time, though orbax stored
each leaf as one chunk, so a read decodes that whole leaf); their integrity is the manifest's
crc32 of every orbax file. The next checkpoint a resumed run writes is format 3.
"""

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import shutil
import stat
import sys
import threading
from typing import Any, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from megatrain_jax import distributed
from megatrain_jax import faults
from megatrain_jax import fs
from megatrain_jax import locks
from megatrain_jax import partition
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
from megatrain_jax.layout import Layout, host_part, place, slices, spread
from megatrain_jax.model import ModelConfig, fresh_rng
from megatrain_jax.tiers import codecs

FORMAT = 3
READABLE_FORMATS = (2, 3)
DEFAULT_PIECE_MB = 64  # largest piece `save` cuts from a leaf itself (capped by offload.shard_mb)
INNER_MB = 8  # largest inner chunk of a stored array (crc32c and decoding unit)
VERIFY_BYTES = 4 * INNER_MB * 2**20  # inner chunks verify_data reads at once (at least one)
_TMP_PREFIX = '.tmp-'
_SNAPSHOT_PREFIX = '.checkpoint-snapshot-'  # in offload.dir, when the workdir is elsewhere
_SHAPE_FIELDS = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'd_ff',
                 'head_dim', 'qkv_bias', 'qk_norm', 'tie_embeddings')
# The leaves --eval, --sample, --export_hf and init.from_run read (read_checkpoint).
_WEIGHTS = "['params']"


# ------------------------------------------------------------------------------------------------
# What an engine hands to `Checkpointer.save`.
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """An in-memory leaf as the checkpoint stores it: `shape` and `dtype` (of the full-state leaf),
  cut along `axis` into files of `chunk` indices each (the last may be shorter; 0 = one file).
  Every piece `save` receives for the leaf covers whole files: start a multiple of `chunk`, stop
  a multiple of `chunk` or the extent."""
  shape: tuple
  dtype: Any
  axis: int = 0
  chunk: int = 0

  @property
  def stored_shape(self) -> tuple:
    return tuple(self.shape) or (1,)  # 0-d leaves (step counts) are stored as [1]

  @property
  def extent(self) -> int:
    return self.stored_shape[self.axis]

  @property
  def file_indices(self) -> int:
    return self.chunk or max(1, self.extent)

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize


class Parts(NamedTuple):
  """What a checkpoint takes from an engine (`engine.checkpoint_pieces(piece_bytes)` returns one):

  leaves  {full-state path: LeafLayout} of every leaf held in memory (device or host)
  pieces  an iterable of (path, start, stop, array): indices [start, stop) of leaf `path` along
          its layout's axis, as a device or host array; consumed once, on the caller's thread,
          before `save` returns; each piece is copied to host, written and dropped before the next
          is drawn, so a generator that makes each piece on demand bounds the host memory a save
          adds to one piece. Together the pieces must cover every leaf exactly once.
  disk    {full-state path: live zarr3 array directory} of NVMe leaves, every write landed
  """
  leaves: dict
  pieces: Iterable
  disk: dict


def piece_rows(shape, dtype, piece_bytes: int, axis: int = 0) -> int:
  """Indices along `axis` per piece of at most `piece_bytes` (at least 1) of a leaf."""
  shape = tuple(shape) or (1,)
  row_bytes = np.dtype(dtype).itemsize * math.prod(shape) // max(shape[axis], 1)
  return max(1, min(shape[axis], piece_bytes // max(row_bytes, 1)))


def array_parts(arrays: dict, piece_bytes: int) -> tuple[dict, Iterable]:
  """(leaves, pieces) of `Parts` for whole arrays {path: device or host array}: each cut along
  axis 0 into pieces of at most `piece_bytes`, sliced only when drawn (on the device for device
  arrays: only the piece crosses to host; a view on CPU, where device memory is host memory)."""
  def rows(x):  # a leaf spread over several processes: whole, each process writing its shards
    return np.shape(x)[0] if spread(x) and np.ndim(x) else piece_rows(np.shape(x), x.dtype,
                                                                      piece_bytes)

  leaves = {path: LeafLayout(tuple(np.shape(x)), np.dtype(x.dtype), 0, rows(x))
            for path, x in arrays.items()}

  def pieces():
    for path, x in arrays.items():
      layout = leaves[path]
      for start in range(0, layout.extent, layout.chunk):
        stop = min(start + layout.chunk, layout.extent)
        yield path, start, stop, _rows(x, start, stop)

  return leaves, pieces()


def _rows(x, start: int, stop: int):
  """Rows [start, stop) of `x` (0-d: as [1]), without a copy of the rest of `x` on the host."""
  if np.ndim(x) == 0:
    return np.reshape(np.asarray(x), (1,))
  if not isinstance(x, jax.Array):
    return np.asarray(x)[start:stop]
  if start == 0 and stop == x.shape[0]:
    return x
  if _host_is_device(x.sharding) or x.sharding.memory_kind != 'device':
    # CPU: np.asarray is a view of the buffer. Host memory kinds (pinned_host) are copied whole
    # by np.asarray, one leaf: engines with host-tier leaves should hand over their own pieces.
    return np.asarray(x)[start:stop]
  return _device_rows(x, np.int32(start), stop - start)


@functools.partial(jax.jit, static_argnums=2)
def _device_rows(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, 0)


@functools.partial(jax.jit, donate_argnums=0)
def _update_rows(buffer, piece, start):
  return jax.lax.dynamic_update_slice_in_dim(buffer, piece, start, 0)


def _parts_of(engine, piece_bytes: int) -> Parts:
  """The engine's `Parts`: `checkpoint_pieces(piece_bytes)` if it has one; else today's
  `checkpoint_parts()` ({path: host array} in memory, {path: live zarr dir} on disk), or a full
  state (`export_state()`, or the state dict itself), cut here into pieces."""
  if hasattr(engine, 'checkpoint_pieces'):
    return Parts(*engine.checkpoint_pieces(piece_bytes))
  if hasattr(engine, 'checkpoint_parts'):
    memory, disk = engine.checkpoint_parts()
    return Parts(*array_parts(memory, piece_bytes), disk)
  state = engine.export_state() if hasattr(engine, 'export_state') else engine
  return Parts(*array_parts(partition.by_path(state), piece_bytes), {})


# ------------------------------------------------------------------------------------------------
# Writing and reading the arrays.
# ------------------------------------------------------------------------------------------------

def _box(axis: int, start: int, stop: int) -> tuple:
  return (slice(None),) * axis + (slice(start, stop),)


def _context(sync: bool = True) -> ts.Context:
  """No chunk cache; `sync=False` for writes: each file lands in the page cache and the commit's
  manifest pass fsyncs it (off the training thread) before the rename publishes it."""
  return ts.Context({'cache_pool': {'total_bytes_limit': 0}, 'file_io_sync': sync})


def _array_spec(directory: pathlib.Path, layout: LeafLayout,
                parts: tuple[int, int] | None = None) -> dict:
  """The NVMe tier's zarr3 layout (codecs.array_spec: one file per `chunk` indices along the
  axis), with inner chunks (the unit of crc32c and of parallel decoding) of at most INNER_MB:
  TensorStore decodes one inner chunk per thread, so a file of one 64 MB inner chunk reads at
  half the speed of the same file in 8 MB inner chunks (measured on 2 cores)."""
  spec = codecs.array_spec(str(directory), layout.stored_shape, dtype=np.dtype(layout.dtype).name,
                           axis=layout.axis, chunk=layout.file_indices, shard_mb=INNER_MB,
                           parts=parts)
  sharding = spec['metadata']['codecs'][0]['configuration']
  outer = spec['metadata']['chunk_grid']['configuration']['chunk_shape']
  if sharding['chunk_shape'] == outer and outer[layout.axis] > 1:  # one inner chunk per file
    rows = piece_rows(outer, layout.dtype, INNER_MB * 2**20, layout.axis)
    rows = next(r for r in range(rows, 0, -1) if outer[layout.axis] % r == 0)  # must tile it
    sharding['chunk_shape'] = [rows if d == layout.axis else n for d, n in enumerate(outer)]
  return spec


def _write_arrays(directory: pathlib.Path, parts: Parts, entries: dict,
                  layout: Layout | None = None) -> None:
  """Writes every piece of `parts` into its leaf's array (entries[path]['dir'] under
  `directory`), one piece on the host at a time; checks that the pieces tile every leaf. On
  several devices (`layout`) each file is cut into one part per device shard; with several
  processes this process writes only its own shards' parts (the others write theirs), into the
  arrays process 0 created."""
  layout = layout or Layout.single_device()
  processes = jax.process_count()
  split = {path: layout.parts(leaf.stored_shape, path) for path, leaf in parts.leaves.items()}
  context = _context(sync=processes > 1)  # several: each process's files are durable on its own

  def open_array(path, leaf, create):
    spec = _array_spec(directory / entries[path]['dir'], leaf, split[path])
    return ts.open(spec, create=create, delete_existing=create, open=not create,
                   context=context).result()

  if distributed.is_main():
    arrays = {path: open_array(path, leaf, True) for path, leaf in parts.leaves.items()}
  distributed.barrier(f'checkpoint arrays of {directory.name}')
  if not distributed.is_main():
    arrays = {path: open_array(path, leaf, False) for path, leaf in parts.leaves.items()}
  covered = {path: [] for path in parts.leaves}
  for path, start, stop, piece in parts.pieces:
    leaf = _check_piece(parts.leaves, covered, path, start, stop)
    want = tuple(stop - start if d == leaf.axis else n for d, n in enumerate(leaf.stored_shape))
    # Several processes: each its own shards' boxes (a replicated leaf, 0-d ones stored as [1]
    # included: process 0's).
    boxes = ([tuple((0, n) for n in want)] if processes == 1
             else layout.owned_boxes(want, path))
    for box in boxes:
      host = host_part(piece, box)  # a device piece crosses to host here; nothing else does
      shape = tuple(b - a for a, b in box)
      if host.dtype != np.dtype(leaf.dtype) or (host.shape != shape and leaf.shape):
        raise ValueError(f'checkpoint piece {path}[{start}:{stop}] is {host.dtype}{host.shape}, '
                         f'expected {np.dtype(leaf.dtype)}{shape}')
      box = tuple((a + start, b + start) if d == leaf.axis else (a, b)
                  for d, (a, b) in enumerate(box))
      arrays[path][slices(box)].write(
          host.reshape(shape), can_reference_source_data_indefinitely=True).result()
      del host
      _release_freed_memory()
    del piece
  if processes > 1:
    return  # each process covers its own shards: the union is checked by no one process
  for path, ranges in covered.items():
    ranges.sort()
    ends = [0] + [stop for _, stop in ranges]
    if [start for start, _ in ranges] != ends[:-1] or ends[-1] != parts.leaves[path].extent:
      raise ValueError(f'checkpoint pieces of {path} cover {ranges}, not [0, '
                       f'{parts.leaves[path].extent}) exactly once')


def _check_piece(leaves: dict, covered: dict, path: str, start: int, stop: int) -> LeafLayout:
  if path not in leaves:
    raise ValueError(f'checkpoint piece of {path}, which is not among the leaves {sorted(leaves)}')
  layout = leaves[path]
  if not (0 <= start < stop <= layout.extent and start % layout.file_indices == 0
          and (stop % layout.file_indices == 0 or stop == layout.extent)):
    raise ValueError(f'checkpoint piece {path}[{start}:{stop}] does not cover whole files of '
                     f'{layout.file_indices} indices within [0, {layout.extent})')
  covered[path].append((start, stop))
  return layout


def _inner_boxes(array: ts.TensorStore):
  """The index box of every inner chunk of `array` (the unit TensorStore reads and checks by
  crc32c; a file holds one or more), in order."""
  shape = tuple(array.shape)
  chunk = tuple(array.chunk_layout.read_chunk.shape or shape)
  counts = [-(-n // c) if c else 1 for n, c in zip(shape, chunk)]
  for cell in itertools.product(*map(range, counts)):
    yield tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(cell, chunk, shape))


def _host_is_device(sharding) -> bool:
  """Whether `sharding`'s memory is host memory (the CPU platform): no copy needed to get there."""
  return {d.platform for d in sharding.device_set} == {'cpu'} and sharding.memory_kind == 'device'


def _release_freed_memory() -> None:
  """Returns the freed buffers of the last piece to the OS, after each piece: glibc's mmap
  threshold adapts up to 32 MiB, below which freed blocks stay in the arena of the TensorStore
  thread that allocated them (up to 64 MiB each before glibc trims), so without this a save or
  restore ends up holding several pieces per thread (measured: +220 MB for 32 MB pieces instead
  of +70). No-op off glibc."""
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _file_indices(array: ts.TensorStore, axis: int) -> int:
  chunk = array.chunk_layout.write_chunk.shape
  return (chunk[axis] if chunk and chunk[axis] else array.shape[axis]) or 1


def _is_chunk_file(relative: str) -> bool:
  """zarr3 chunk files (arrays/<leaf>/c/..., nvme/<leaf>/c/...): they carry their own crc32c."""
  parts = relative.split('/')
  return len(parts) > 3 and parts[0] in ('arrays', 'nvme') and parts[2] == 'c'


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be used: `file` is the first bad file found, `reason` why."""

  def __init__(self, file, reason: str):
    super().__init__(f'{file}: {reason}')
    self.file, self.reason = file, reason


class CheckpointReader:
  """One committed checkpoint: its meta, and reads of any slice of any leaf (never the whole
  state at once, unless asked with `full_state`)."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    meta_file = directory / 'meta.json'
    if not meta_file.exists() and (directory / 'meta').is_dir():
      raise DamagedCheckpoint(directory, 'written in the layout of earlier versions (an orbax '
                              'CheckpointManager step, no meta.json), which this version does not '
                              'read')
    try:
      self.meta = json.loads(meta_file.read_text())
      self.step = int(self.meta['step'])
      self.format = int(self.meta.get('format', 0))
      self._disk_names = dict(self.meta['disk'])
      if self.format == 2:  # orbax state/: {path: name}, shapes as stored
        self._memory = {p: (name, None) for p, name in self.meta['memory'].items()}
      else:
        self._memory = {p: (e['dir'], tuple(e['shape']))
                        for p, e in self.meta.get('arrays', {}).items()}
      names = list(self._disk_names.values())
      if self.format != 2:  # format 2's names are inside orbax's database
        names += [name for name, _ in self._memory.values()]
      for name in names:  # an entry naming another run's arrays: a ValueError
        fs.inside(directory, name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
      raise DamagedCheckpoint(meta_file,
                              f'not a readable checkpoint meta.json ({error})') from error
    self._arrays = {}
    self._context = _context()
    # Bytes read by read, read_box and device_state (not by verify). With several processes the
    # NVMe stores' writer threads read boxes too (partition.LazySlice): counted under a lock.
    self.bytes_read = 0
    self._count_lock = threading.Lock()
    self.bytes_verified = 0  # by verify_data: this process's share of the chunks

  def check_model(self, model_cfg: ModelConfig) -> None:
    saved = ModelConfig.recorded(self.meta['model_config'])
    current = dataclasses.asdict(model_cfg)
    changed = [f'model.{k}: checkpoint {saved.get(k)!r}, config {current[k]!r}'
               for k in _SHAPE_FIELDS if saved.get(k) != current[k]]
    if changed:
      raise ConfigError(f'the checkpoint at {self.directory} was written for other model shapes '
                        f'({"; ".join(changed)}). Use the config it was trained with, or a new '
                        '--workdir to start fresh.')

  # --- verification ------------------------------------------------------------------------------

  def verify(self) -> None:
    """Raises DamagedCheckpoint naming the first bad file (`verify_files`, then `verify_data`)."""
    self.verify_files()
    self.verify_data()

  def verify_files(self) -> None:
    """Every file of the manifest present, its size, the crc32 of the files that have one; then
    the format (a newer one is a ConfigError: an intact checkpoint this version cannot read)."""
    manifest_file = self.directory / 'manifest.json'
    try:
      manifest = json.loads(manifest_file.read_text())
      if not isinstance(manifest, dict) or not all(
          isinstance(e, dict) and isinstance(e.get('size'), int) for e in manifest.values()):
        raise ValueError('not an object of files to their sizes and checksums')
    except (OSError, ValueError) as error:
      raise DamagedCheckpoint(manifest_file, f'unreadable ({error})') from error
    for relative, entry in sorted(manifest.items()):
      try:
        path = fs.inside(self.directory, relative)
      except ValueError as error:  # read, /dev/zero's crc32 would never end
        raise DamagedCheckpoint(manifest_file, f'lists a file outside the checkpoint ({error})'
                                ) from error
      try:
        info = path.stat()
      except OSError:
        raise DamagedCheckpoint(path, 'missing') from None
      if not stat.S_ISREG(info.st_mode):
        raise DamagedCheckpoint(path, 'not a regular file')
      size = info.st_size
      if size != entry['size']:
        raise DamagedCheckpoint(path, f'{size} bytes, {entry["size"]} when written (truncated?)')
      if 'crc32' in entry and fs.crc32(path) != entry['crc32']:
        raise DamagedCheckpoint(path, 'crc32 differs from when it was written (bit rot?)')
    if self.format > FORMAT:
      raise ConfigError(f'the checkpoint at {self.directory} is format {self.format}, written by '
                        f'a newer megatrain_jax; this version reads formats '
                        f'{", ".join(map(str, READABLE_FORMATS))}. Upgrade megatrain_jax, or use '
                        'a new --workdir to start fresh.')
    if self.format not in READABLE_FORMATS:
      raise DamagedCheckpoint(self.directory / 'meta.json', f'format {self.format} of earlier '
                              'versions, which this version does not read')

  def verify_data(self, prefix: str = '', share: tuple[int, int] = (0, 1)) -> None:
    """Reads every inner chunk of every array (of the leaves whose path starts with `prefix`)
    once, VERIFY_BYTES at a time, keeping nothing: a chunk that fails its crc32c (or is missing)
    is named by its file. Format 2's orbax arrays are only opened: the manifest's crc32 covers
    every byte of them. `share` = (i, P): only the chunks of process i of P, each chunk going to
    the process with the fewest bytes so far (the same split in every process), so P processes
    read the checkpoint once between them (`_newest_intact` has them agree on the verdict)."""
    index, count = share
    loads = [0] * count
    for path in [*self._memory, *self._disk_names]:
      if not path.startswith(prefix):
        continue
      array = self._open(path)
      if path in self._memory and self.format == 2:
        continue
      itemsize = array.dtype.numpy_dtype.itemsize
      chunk_bytes = math.prod(array.chunk_layout.read_chunk.shape or array.shape or (1,))
      in_flight = max(1, VERIFY_BYTES // (chunk_bytes * itemsize))
      pending = collections.deque()
      for box in _inner_boxes(array):
        nbytes = math.prod(s.stop - s.start for s in box) * itemsize
        owner = loads.index(min(loads))
        loads[owner] += nbytes
        if owner != index:
          continue
        self.bytes_verified += nbytes
        pending.append((box, array[box].read()))
        if len(pending) >= in_flight:
          self._check_read(path, array, *pending.popleft())
      while pending:
        self._check_read(path, array, *pending.popleft())

  def _check_read(self, path: str, array: ts.TensorStore, box: tuple, read) -> None:
    try:
      read.result()
    except ValueError as error:
      files = array.chunk_layout.write_chunk.shape or array.shape
      cell = tuple(s.start // c for s, c in zip(box, files))
      raise DamagedCheckpoint(self._location(path) / 'c' / '/'.join(map(str, cell)),
                              f'chunk {cell} of {self._location(path).name} fails its checksum '
                              f'or is missing ({error})') from error
    finally:
      del read
      _release_freed_memory()

  # --- reading -----------------------------------------------------------------------------------

  def _location(self, path: str) -> pathlib.Path:
    if path in self._disk_names:
      return self.directory / self._disk_names[path]
    return self.directory / ('state' if self.format == 2 else self._memory[path][0])

  def _open(self, path: str) -> ts.TensorStore:
    if path in self._arrays:
      return self._arrays[path]
    location = self._location(path)
    if path in self._memory and self.format == 2:  # a leaf in orbax's OCDBT database
      kvstore = {'driver': 'ocdbt', 'base': f'file://{location}/', 'path': self._memory[path][0]}
      drivers, file = ('zarr', 'zarr3'), location
    else:
      kvstore = {'driver': 'file', 'path': str(location)}
      drivers, file = ('zarr3',), location / 'zarr.json'
    for driver in drivers:
      try:
        spec = {'driver': driver, 'kvstore': kvstore, 'fill_missing_data_reads': False}
        self._arrays[path] = ts.open(spec, open=True, read=True, context=self._context).result()
        return self._arrays[path]
      except ValueError as error:
        failure = error
    raise DamagedCheckpoint(file, f'cannot open the array ({failure})') from failure

  def snapshot_dir(self, path: str) -> pathlib.Path | None:
    """The zarr3 array directory of a disk-resident (nvme/) leaf, or None for an in-memory one."""
    name = self._disk_names.get(path)
    return None if name is None else self.directory / name

  def known_zero(self, path: str) -> bool:
    """Whether leaf `path` is zeros without reading it: never, for a run's checkpoint."""
    del path
    return False

  def shape(self, path: str) -> tuple:
    """The full-state shape of leaf `path`."""
    self._check_has(path)
    stored = self._memory.get(path, (None, None))[1]
    return stored if stored is not None else tuple(self._open(path).shape)

  def file_indices(self, path: str, axis: int = 0) -> int:
    """Indices along `axis` per stored file of leaf `path`: reads aligned to it decode each file
    once (a layer of an NVMe leaf, a piece of an in-memory one)."""
    return _file_indices(self._open(path), axis) if self.shape(path) else 1

  def _check_has(self, path: str) -> None:
    if path not in self._memory and path not in self._disk_names:
      raise ConfigError(f'the checkpoint at {self.directory} has no leaf {path}: it was written '
                        'for another model or optimizer structure. Use the config it was trained '
                        'with, or a new --workdir to start fresh.')

  def read(self, path: str, start: int | None = None, stop: int | None = None, *,
           axis: int = 0) -> np.ndarray:
    """Leaf `path` of the full state as host numpy: indices [start:stop] along `axis` (layers of
    a stacked leaf, with axis 0), the whole leaf if start is None. Read file by file into the
    result: no second buffer of the slice. Reads along the axis the leaf was cut on, aligned to
    `file_indices`, decode each file once."""
    shape = self.shape(path)
    if not shape:
      out = np.asarray(self._open(path).read().result()).reshape(())
      self._count(out.nbytes)
      return out
    start, stop = (0, shape[axis]) if start is None else (start, stop)
    array = self._open(path)
    step = _file_indices(array, axis)
    if start // step == (stop - 1) // step:  # in one file: its read is the result, not a copy
      out = array[_box(axis, start, stop)].read().result()
      _release_freed_memory()
      self._count(out.nbytes)
      return out
    out = np.empty(shape[:axis] + (stop - start,) + shape[axis + 1:], array.dtype.numpy_dtype)
    return self._read_into(path, out, start, axis)

  def _count(self, nbytes: int) -> None:
    with self._count_lock:
      self.bytes_read += nbytes

  def read_box(self, path: str, box: tuple) -> np.ndarray:
    """`box` ((start, stop) per axis) of leaf `path` of the full state as host numpy: what one
    process reads of a leaf split over several (its own devices' shards: layout.place). A box
    of a device shard of the layout that wrote the checkpoint is the files of that shard only
    (each file is cut into one part per device shard)."""
    out = np.asarray(self._open(path)[slices(box)].read().result())
    self._count(out.nbytes)
    _release_freed_memory()
    return out

  def _read_into(self, path: str, out: np.ndarray, start: int, axis: int = 0) -> np.ndarray:
    """Fills `out` with indices [start, start + out.shape[axis]) along `axis`, file by file."""
    array = self._open(path)
    step, stop = _file_indices(array, axis), start + out.shape[axis]
    first = start
    while first < stop:
      last = min(stop, (first // step + 1) * step)
      part = _box(axis, first - start, last - start)
      out[part] = array[_box(axis, first, last)].read().result()
      _release_freed_memory()
      self._count(out[part].nbytes)
      first = last
    return out

  def full_state(self, abstract_state):
    """The whole state as host numpy arrays shaped like `abstract_state` (resident layout): a
    gather, for tests and export; training restores with `device_state` or by pieces."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: self.read(jax.tree_util.keystr(p)), abstract_state)

  def device_state(self, abstract_state, layout: Layout | None = None):
    """The whole state on the device(s) of `layout` (default: the first device), shaped like
    `abstract_state`: each leaf is built in place on the device from file-sized pieces, one on
    the host at a time, so the host never holds more than one piece (plus, on CPU, the state
    itself, which is the device's memory there)."""
    layout = layout or Layout.single_device()

    def leaf(key_path, abstract):
      path = jax.tree_util.keystr(key_path)
      if self.shape(path) != tuple(abstract.shape):
        raise ConfigError(f'the checkpoint at {self.directory} holds {path} of shape '
                          f'{self.shape(path)}, the model wants {tuple(abstract.shape)}. Use the '
                          'config it was trained with, or a new --workdir to start fresh.')
      return self.device_leaf(path, abstract, layout.sharding('device', abstract.shape, path))

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)

  def device_leaf(self, path: str, abstract, sharding):
    """Leaf `path` built on the device in `sharding` from file-sized pieces (device_state)."""
    shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
    if not shape:
      return place(self.read(path), sharding)
    if jax.process_count() > 1:  # each process reads its own devices' shards, one at a time
      return place(partition.LazySlice(functools.partial(self.read_box, path), shape, dtype),
                   sharding)
    if _host_is_device(sharding):
      # Device memory is host memory: fill the leaf's own buffer file by file and hand it to
      # jax without a copy (may_alias needs 64-byte alignment).
      out = self._read_into(path, fs.aligned_empty(shape, dtype), 0)
      return jax.device_put(out, sharding, may_alias=True)
    rows = self.file_indices(path)
    if rows >= shape[0]:
      return jax.device_put(self.read(path), sharding)
    out = jnp.zeros(shape, dtype, device=sharding)
    for start in range(0, shape[0], rows):
      piece = jax.device_put(self.read(path, start, min(start + rows, shape[0])), sharding)
      out = _update_rows(out, piece, np.int32(start))  # donated: updated in place
      out.block_until_ready()  # this piece's host copy is freed before the next is read
      del piece
    return out


class WeightsOnly:
  """A fresh run's train state whose params are those of a run's checkpoint (init.from_run):
  the reader interface `train.make_engine(restore_from=...)` fills the engines from, as
  CheckpointReader's, with Adam's state and step counts zero and a fresh run's rng for `seed`
  (as hf.HfReader serves a Hugging Face checkpoint). Params are read slice by slice from
  `reader`, or, where both runs keep them on NVMe, hard-linked from its snapshot as a resume
  links them (`snapshot_dir`): the new run's store writes replace files, never change them, so
  the source checkpoint stays as it is."""

  def __init__(self, reader: CheckpointReader, abstract_state, seed: int = 0):
    self.reader, self.directory = reader, reader.directory
    self.meta = {'step': 0, 'data_position': 0}
    self._leaves = {jax.tree_util.keystr(p): x
                    for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    self._rng = fresh_rng(seed)

  @property
  def bytes_read(self) -> int:
    """Of the params read from the run's checkpoint (not those linked from its NVMe snapshot)."""
    return self.reader.bytes_read

  @staticmethod
  def _is_param(path: str) -> bool:
    return path.startswith(_WEIGHTS)

  def snapshot_dir(self, path: str) -> pathlib.Path | None:
    """The source checkpoint's NVMe snapshot of a params leaf (None for Adam's state: zeros)."""
    return self.reader.snapshot_dir(path) if self._is_param(path) else None

  def known_zero(self, path: str) -> bool:
    return not self._is_param(path) and path != "['rng']"

  def shape(self, path: str) -> tuple:
    return tuple(self._leaves[path].shape)

  def read(self, path: str, start: int | None = None, stop: int | None = None, *,
           axis: int = 0) -> np.ndarray:
    if self._is_param(path):
      return self.reader.read(path, start, stop, axis=axis)
    if path == "['rng']":
      return self._rng.copy()
    shape = self.shape(path)
    if start is not None:
      shape = shape[:axis] + (stop - start,) + shape[axis + 1:]
    return np.zeros(shape, self._leaves[path].dtype)  # AdamW's mu, nu, counts (optax init)

  def read_box(self, path: str, box: tuple) -> np.ndarray:
    """`box` ((start, stop) per axis) of leaf `path` (CheckpointReader.read_box)."""
    if self._is_param(path):
      return self.reader.read_box(path, box)
    return np.zeros(tuple(b - a for a, b in box), self._leaves[path].dtype)

  def device_state(self, abstract_state, layout: Layout | None = None):
    """The whole state on the device(s) of `layout`: the params leaf by leaf as
    CheckpointReader.device_state builds them, the rest zeros (the rng a fresh run's)."""
    layout = layout or Layout.single_device()

    def leaf(key_path, abstract):
      path = jax.tree_util.keystr(key_path)
      sharding = layout.sharding('device', tuple(abstract.shape), path)
      if self._is_param(path):
        return self.reader.device_leaf(path, abstract, sharding)
      if path == "['rng']":
        return place(self._rng, sharding)
      return jnp.zeros(abstract.shape, abstract.dtype, device=sharding)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


class Checkpointer:
  """Saves and restores train states in `<workdir>/checkpoints`, keeping the `keep` newest.
  `piece_mb`: the largest piece `save` cuts from an in-memory leaf (default DEFAULT_PIECE_MB,
  capped by the placement's offload.shard_mb)."""

  def __init__(self, workdir: pathlib.Path, keep: int, piece_mb: float | None = None,
               keep_best: bool = False):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.keep, self.keep_best = keep, keep_best
    self.piece_mb = piece_mb
    self._committer = concurrent.futures.ThreadPoolExecutor(1, 'checkpoint-commit')
    self._pending = None
    # Several processes share the directory: process 0 cleans up and commits.
    if self.directory.is_dir() and distributed.is_main():  # a save cut before its commit
      for leftover in self.directory.glob(_TMP_PREFIX + '*'):
        shutil.rmtree(leftover, ignore_errors=True)

  def steps(self) -> list[int]:
    """Committed checkpoints, oldest first."""
    return committed_steps(self.directory)

  def latest_step(self) -> int | None:
    self.wait()
    steps = self.steps()
    return steps[-1] if steps else None

  def piece_mb_for(self, placement=None) -> float:
    """MB of the largest piece a save cuts from a leaf: what a save adds to host memory."""
    mb = self.piece_mb or DEFAULT_PIECE_MB
    shard_mb = getattr(placement, 'shard_mb', None)
    return min(mb, shard_mb) if shard_mb else mb

  # --- saving ----------------------------------------------------------------------------------

  def save(self, step: int, engine, *, data_position: int, model_cfg: ModelConfig, seed: int = 0,
           placement=None, microbatches: int | None = None,
           eval_loss: float | None = None, extra_meta: dict | None = None) -> None:
    """Checkpoints `engine` (or a full state dict) at `step`. Returns once the state may change:
    NVMe files linked (or linked beside the live store, to be copied behind), every in-memory
    leaf written piece by piece; the fsyncs, the manifest and the commit run behind. `eval_loss`:
    the step's validation loss, recorded in meta.json (checkpoint.keep_best, `best_step`);
    `extra_meta`: more that the trainer records in meta.json (its data, early stopping)."""
    self.wait()  # one checkpoint in flight; raises the previous one's error
    piece_mb = self.piece_mb_for(placement)
    parts = _parts_of(engine, int(piece_mb * 2**20))
    names = [fs.leaf_name(p) for p in [*parts.leaves, *parts.disk]]
    if len(set(names)) != len(names):  # never expected: tree paths map to distinct names
      raise ValueError(f'two state leaves share a checkpoint file name: {sorted(names)}')
    tmp = self.directory / f'{_TMP_PREFIX}{step}'
    if distributed.is_main():
      shutil.rmtree(tmp, ignore_errors=True)
      tmp.mkdir(parents=True)
    distributed.barrier(f'checkpoint {step}: begin')  # the previous one committed, tmp made
    meta = {'format': FORMAT, 'step': step, 'data_position': int(data_position), 'seed': seed,
            'model_config': dataclasses.asdict(model_cfg),
            'placement': dataclasses.asdict(placement) if placement is not None else None,
            'microbatches': microbatches,
            'arrays': {p: {'dir': f'arrays/{fs.leaf_name(p)}', 'shape': list(layout.shape),
                           'dtype': np.dtype(layout.dtype).name}
                       for p, layout in parts.leaves.items()},
            'disk': {p: f'nvme/{fs.leaf_name(p)}' for p in parts.disk}}
    if eval_loss is not None:
      meta['eval_loss'] = float(eval_loss)
    meta.update(extra_meta or {})
    needed = sum(layout.nbytes for layout in parts.leaves.values())
    copies = {}  # staging snapshot on offload.dir's filesystem -> its place in the checkpoint
    try:
      self._snapshot(step, tmp, parts.disk, meta['disk'], copies)
      _write_arrays(tmp, parts, meta['arrays'], getattr(engine, 'layout', None))
      if jax.process_count() > 1:  # every process's files in place before process 0 commits
        for staging, dest in copies.items():
          fs.link_tree(staging, dest, existing_ok=True)
        _remove_staging(copies)
        copies = {}
    except BaseException as error:
      shutil.rmtree(tmp, ignore_errors=True)
      _remove_staging(copies)
      self._raise_disk_full(step, error, needed + sum(_tree_bytes(d) for d in parts.disk.values()))
      raise
    distributed.barrier(f'checkpoint {step}: written')
    if distributed.is_main():
      needed += sum(_tree_bytes(d) for d in copies)
      self._pending = self._committer.submit(self._commit, step, tmp, meta, needed, copies)
    faults.point('checkpoint')  # arrays written, the rest in the background, nothing committed

  def _snapshot(self, step: int, tmp: pathlib.Path, disk: dict, dirs: dict, copies: dict) -> None:
    """Links each live NVMe array into the checkpoint; from another filesystem (EXDEV), links it
    beside the live store instead and records it in `copies`, to be copied behind."""
    for path, live in disk.items():
      live = pathlib.Path(live)
      if os.stat(live).st_dev == os.stat(tmp).st_dev:
        # Several processes: each links its own store's chunk files; zarr.json is the same.
        fs.link_tree(live, tmp / dirs[path], existing_ok=jax.process_count() > 1)
        continue
      staging = live.parent.parent / f'{_SNAPSHOT_PREFIX}{step}'
      if not copies:
        for stale in live.parent.parent.glob(_SNAPSHOT_PREFIX + '*'):  # of a killed run
          shutil.rmtree(stale, ignore_errors=True)
      copies[staging / fs.leaf_name(path)] = tmp / dirs[path]
      fs.link_tree(live, staging / fs.leaf_name(path))

  def _commit(self, step: int, tmp: pathlib.Path, meta: dict, needed: int, copies: dict) -> None:
    """On the background thread: copies of a staging snapshot, meta.json, the manifest, fsyncs,
    the commit rename, and the deletion of checkpoints beyond `keep`."""
    try:
      for staging, dest in copies.items():
        if not staging.is_dir():  # os.walk of a missing directory copies nothing, silently
          raise StoreCorruptionError(
              f'checkpoint step {step}: the snapshot of the NVMe stores staged at {staging} was '
              'deleted before it was copied (did another run take offload.dir?); this '
              'checkpoint is not committed.')
        fs.link_tree(staging, dest)  # copies: another filesystem
      _remove_staging(copies)
      faults.point('checkpoint')  # kill -9 tests: files written, nothing committed
      (tmp / 'meta.json').write_text(json.dumps(meta, indent=1, sort_keys=True))
      _write_manifest(tmp)
    except BaseException as error:
      shutil.rmtree(tmp, ignore_errors=True)
      _remove_staging(copies)
      self._raise_disk_full(step, error, needed)
      raise
    final = self.directory / str(step)
    if final.exists():  # a damaged checkpoint of this step that the run fell back past
      stale = self.directory / f'{_TMP_PREFIX}stale-{step}'
      os.rename(final, stale)
      shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
    fs.fsync(self.directory, directory=True)
    self.delete_beyond_keep(step)  # only now that the new one is complete

  def beyond_keep(self, step: int, keep: int | None = None) -> list[int]:
    """`beyond_keep` of this run's checkpoints (`keep` default: the run's): what
    `delete_beyond_keep` deletes."""
    return beyond_keep(self.directory, step, keep or self.keep, self.keep_best)

  def array_bytes(self, step: int) -> int:
    """Bytes deleting checkpoint `step` frees of its in-memory leaves' files (arrays/; its
    nvme/ files are links the live stores or other checkpoints may share)."""
    files = (self.directory / str(step) / 'arrays').rglob('*')
    return sum(st.st_size for st in (f.stat() for f in files if f.is_file()) if st.st_nlink == 1)

  def delete_beyond_keep(self, step: int) -> list[int]:
    """Deletes the checkpoints older than the newest `keep` up to `step` (the one just committed,
    or a resume's), but the best with keep_best and any being read (a later call deletes it);
    returns their steps. Newer ones are those a resume fell back past (damaged): counted, they
    would delete every intact checkpoint."""
    deleted = []
    for old in self.beyond_keep(step):
      with locks.unless_read(self.directory / str(old)) as free:
        if not free:  # an --eval, --sample or --export_hf is reading it: a later commit deletes it
          continue
        doomed = self.directory / f'{_TMP_PREFIX}delete-{old}'  # a kill mid-delete leaves no
        os.rename(self.directory / str(old), doomed)            # half checkpoint behind
      shutil.rmtree(doomed, ignore_errors=True)
      deleted.append(old)
    return deleted

  def _raise_disk_full(self, step: int, error: BaseException, needed: int) -> None:
    """Raises DiskFullError (naming the directory, the bytes and the fix) if `error` is ENOSPC."""
    if not fs.is_disk_full(error):
      return
    steps = [s for s in self.steps() if s != step]
    previous = (f'The previous checkpoint (step {steps[-1]}) is intact: a rerun with the same '
                '--workdir resumes from it.' if steps else 'No earlier checkpoint exists.')
    free = shutil.disk_usage(self.directory).free
    # A lower keep frees room only where the rerun has older checkpoints than its newest to delete.
    lower = ('rerun with a lower checkpoint.keep (the rerun deletes the checkpoints beyond it '
             'before it saves), ' if self.keep > 1 and len(steps) > 1 else '')
    raise DiskFullError(
        f'checkpoint step {step}: the disk holding {self.directory} is full (the checkpoint needs '
        f'about {fs.human_bytes(needed)}, {fs.human_bytes(free)} are free). {previous} Free space '
        f'there, {lower}or use a --workdir on a larger disk.') from error

  def wait(self) -> None:
    """Waits for the checkpoint being written; raises its error (DiskFullError when full)."""
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._committer.shutdown(wait=True)

  # --- restoring -------------------------------------------------------------------------------

  def restore(self, model_cfg: ModelConfig) -> CheckpointReader | None:
    """The newest intact checkpoint (verified), or None if there is none. A damaged one is
    reported on stderr and skipped; a checkpoint of other model shapes is a ConfigError."""
    self.wait()
    return _newest_intact(self.directory, model_cfg)


def committed_steps(directory: pathlib.Path) -> list[int]:
  """The committed checkpoints in `directory` (<workdir>/checkpoints), oldest first."""
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def beyond_keep(directory: pathlib.Path, step: int | None, keep: int,
                keep_best: bool = False) -> list[int]:
  """The committed checkpoints in `directory` older than the newest `keep` up to `step` (None:
  the newest), but the best with keep_best: those a run deletes after its next commit, or a
  resume at `step` before it starts (train._resumed)."""
  steps = committed_steps(directory)
  upto = [s for s in steps if step is None or s <= step]
  best = best_step(directory) if keep_best and upto else None
  return [s for s in upto[:-keep] if s != best] if keep > 0 else []


def best_step(directory: pathlib.Path) -> int | None:
  """The committed checkpoint in `directory` with the lowest eval_loss its meta.json records (the
  earliest of equal ones), or None if none records one (checkpoint.keep_best)."""
  losses = []
  for step in committed_steps(directory):
    try:
      loss = json.loads((directory / str(step) / 'meta.json').read_text()).get('eval_loss')
    except (OSError, ValueError, AttributeError):
      continue  # being deleted, or damaged (its restore reports it)
    if isinstance(loss, (int, float)) and math.isfinite(loss):
      losses.append((loss, step))
  return min(losses)[1] if losses else None


@contextlib.contextmanager
def read_checkpoint(workdir, model_cfg: ModelConfig, which: str = 'newest'):
  """A checkpoint of `workdir` (a CheckpointReader; None if it has none) held for reading for the
  `with` block: a run training in `workdir` keeps it until the block ends (locks.read_hold). For
  --eval, --sample and --export_hf beside a run; constructs no Checkpointer (whose start-up
  deletes a run's unfinished .tmp- saves).

  `which` (checkpoint.read): 'newest' (the newest intact one, as a resume takes), 'best' (the
  lowest eval_loss recorded: `best_step`) or a step number; those two are read as asked or
  refused (ConfigError naming the steps there are; StoreCorruptionError if it is damaged).

  Its readers want the weights only: the data verified chunk by chunk is the params' (2/3 of a
  checkpoint is Adam's state, which a resume verifies); every file's size and the crc32s of the
  manifest are checked as for a resume."""
  directory = pathlib.Path(workdir).absolute() / 'checkpoints'
  with contextlib.ExitStack() as held:
    if which == 'newest':
      yield _newest_intact(directory, model_cfg, held, verify=_WEIGHTS)
    else:
      yield _chosen(directory, model_cfg, which, held)


def chosen_step(directory: pathlib.Path, which: str) -> int:
  """The step checkpoint.read = 'best' or a step number names in `directory`
  (<workdir>/checkpoints), or a ConfigError naming the steps there are. Reads meta.json only."""
  steps = committed_steps(directory)
  step = best_step(directory) if which == 'best' else int(which)
  if step is None:
    raise ConfigError(f'checkpoint.read=best: no checkpoint in {directory} records an eval/loss '
                      '(a checkpoint records the one evaluated at its step: train.eval_every '
                      'dividing checkpoint.every); pass a step number '
                      f'({", ".join(map(str, steps)) or "none there"}) or newest.')
  if step not in steps:
    raise ConfigError(f'checkpoint.read={which}: {directory} has no checkpoint of step {step} '
                      f'(it has {", ".join(map(str, steps)) or "none"}); pass one of those.')
  return step


def _chosen(directory: pathlib.Path, model_cfg: ModelConfig, which: str,
            held: contextlib.ExitStack) -> CheckpointReader:
  """read_checkpoint's 'best' or step-number checkpoint, verified and held in `held`."""
  step = chosen_step(directory, which)
  if not held.enter_context(locks.read_hold(directory / str(step))):
    if which == 'best':  # a better one was committed as this one was deleted
      return _chosen(directory, model_cfg, which, held)
    raise ConfigError(f'checkpoint.read={which}: the run training in {directory.parent} deleted '
                      'that checkpoint as it was opened (checkpoint.keep); pass a newer step.')
  reader = CheckpointReader(directory / str(step))
  try:
    reader.verify_files()
    reader.check_model(model_cfg)
    reader.verify_data(_WEIGHTS)
  except DamagedCheckpoint as error:
    raise StoreCorruptionError(f'checkpoint step {step} in {directory} is damaged: {error.file}: '
                               f'{error.reason}. Read another one (checkpoint.read).') from error
  return reader


def _newest_intact(directory: pathlib.Path, model_cfg: ModelConfig,
                   held: contextlib.ExitStack | None = None,
                   verify: str = '') -> CheckpointReader | None:
  """The newest checkpoint in `directory` whose leaves under `verify` ('': all) verify
  (Checkpointer.restore). With `held` (read_checkpoint), each is first locked for reading, and the
  one returned stays locked in `held`; one deleted by a run's commit as it was locked (a newer one
  exists then) starts the walk again. Several processes walk process 0's list of steps in step
  and agree at each (`distributed.processes_where`): one they cannot all lock is passed over by
  all, and each collective is called the same number of times in every process."""
  steps = distributed.from_main(committed_steps(directory))
  damaged = []
  for step in reversed(steps):
    hold = contextlib.ExitStack()
    locked = held is None or hold.enter_context(locks.read_hold(directory / str(step)))
    if not locked and distributed.share()[1] == 1:
      hold.close()
      return _newest_intact(directory, model_cfg, held, verify)
    with hold:
      if distributed.processes_where(not locked):  # deleted as it was locked, somewhere
        continue
      reader, error = _verified(directory / str(step), model_cfg, verify)
      # Each process read its share of the chunks: one that found a damaged chunk speaks for all.
      found_by = distributed.processes_where(error is not None)
      if found_by:
        damaged.append(step)
        older = [s for s in steps if s < step]
        then = (f'trying the previous one (step {older[-1]})' if older else 'no older one is left')
        what = (f'{error.file}: {error.reason}' if error is not None else
                f'process {found_by[0]} names the bad file in its log')
        if error is not None or distributed.is_main():
          print(f'warning: checkpoint step {step} in {directory} is damaged: {what}; {then}.',
                file=sys.stderr, flush=True)
        continue
      if held is not None:
        held.enter_context(hold.pop_all())
      return reader
  if damaged:
    raise StoreCorruptionError(
        f'every checkpoint in {directory} is damaged (steps '
        f'{", ".join(map(str, sorted(damaged)))}; see the warnings above for the bad files). '
        f'Delete {directory} to start training from scratch, or use a new --workdir.')
  return None


def _verified(directory: pathlib.Path, model_cfg: ModelConfig,
              verify: str) -> tuple[CheckpointReader | None, DamagedCheckpoint | None]:
  """(reader, None) of the checkpoint in `directory` once its files and this process's share of
  its chunks under `verify` verify, else (None, what is damaged). Other model shapes raise."""
  try:
    reader = CheckpointReader(directory)
    reader.verify_files()
    reader.check_model(model_cfg)
    reader.verify_data(verify, distributed.share())
  except DamagedCheckpoint as error:
    return None, error
  return reader, None


def _write_manifest(tmp: pathlib.Path) -> None:
  """manifest.json: every file's size, and its crc32 unless it is a zarr chunk file; every file
  and directory fsynced, so the commit rename publishes data that is on disk."""
  manifest = {}
  for root, _, files in os.walk(tmp):
    for name in files:
      path = pathlib.Path(root) / name
      relative = str(path.relative_to(tmp))
      entry = {'size': path.stat().st_size}
      if not _is_chunk_file(relative):
        entry['crc32'] = fs.crc32(path)
      manifest[relative] = entry
      fs.fsync(path)  # linked chunk files too: their data must be on disk before the commit
  (tmp / 'manifest.json').write_text(json.dumps(manifest, indent=0, sort_keys=True))
  fs.fsync(tmp / 'manifest.json')
  for root, _, _ in os.walk(tmp):
    fs.fsync(pathlib.Path(root), directory=True)


def _remove_staging(copies: dict) -> None:
  for staging_root in {p.parent for p in copies}:
    shutil.rmtree(staging_root, ignore_errors=True)


def _tree_bytes(directory) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)
