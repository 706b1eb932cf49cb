"""The NVMe tier: stacked leaves in TensorStore zarr3 arrays on local disk (layout: codecs.py).

Reads run on background reader threads (`fetch` returns a Future: disk -> host staging ->
device), so the prefetcher keeps `prefetch_depth` groups in flight. Writes are write-behind:
`put` queues the updated leaves (still device arrays: the copy to host happens on the writer
thread, so the main thread never waits for the update to finish) and returns; at most
`max_pending_writes` groups may be queued, after which `put` blocks (back-pressure, bounded RAM).
A read of key k first waits for the pending writes of the leaves it reads, so step n+1 always
reads step n's values. `put(key, part, partial=True)` rewrites only the leaves `part` holds (the
others None): the host optimizer updates a piece band by band (engine/updates.py), and a band's
read ahead never waits on the previous band's write-behind.

A leaf put as a `jax.ShapeDtypeStruct` is zeros of that shape that are never written (AdamW's m
and v of a fresh or imported run: two thirds of the state, which would otherwise be written to
disk only to be read back as zeros by the first update): reads return zeros until a put writes the
leaf, and `array_dirs` (a checkpoint) writes whatever is still zero first, so a checkpoint never
lacks a file and a missing chunk stays an error.

Which leaves go to disk, and along which axis a key slices them, is the store's `axis_of(path)`:
by default leaves whose tree path goes through 'layers' ([num_layers, ...], one file per layer, key
g = layers slices[g]); vocabulary stores split the embedding [V, D] on axis 0 and the head kernel
[D, V] on axis 1 (key c = vocabulary rows slices[c], one file per chunk). Other leaves (optax step
counts) are small and kept in memory.

On several devices each of those files is cut into one part per device shard (the layout splits
every piece of a leaf along the same axis into the same widths: layout.py). With several
processes, each process has a store directory of its own (offload.dir is a local disk of its
machine) and writes only the parts of its own shards (`Layout.owned_boxes`) and reads only its
own devices' slab (`Layout.local_box`), which it hands out as a global jax.Array: a process's
disk and host traffic is 1/P of the state's.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import stat as stat_lib
import threading
import time

import jax
import numpy as np
import tensorstore as ts

from megatrain_jax import distributed
from megatrain_jax.fs import (aligned_empty, human_bytes, is_disk_full, leaf_name, link_file,
                              link_tree, nearest_existing)
from megatrain_jax.layout import Layout, host_part, replicated_value, slices, spread
from megatrain_jax.partition import LAYERS
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
from megatrain_jax.tiers import codecs
from megatrain_jax.tiers.base import BusyTimer, Store, TransferStats, WriteBudget

class NvmeStore(Store):
  """Named trees of layer-group leaves on disk; `key` g covers layers slices[g]."""

  tier = 'nvme'

  def __init__(self, name: str, stats: TransferStats, layout: Layout | None = None, *,
               directory: str, slices: list[tuple[int, int]], codec: str = 'none', level: int = 1,
               shard_mb: float = 512, max_pending_writes: int = 2, read_threads: int = 2,
               axis_of=None, write_budget: WriteBudget | None = None):
    super().__init__(name, stats, layout)
    self._axis_of = axis_of or layer_axis
    # One file per layer; a vocabulary store one per chunk (all chunks but the last are equal).
    self._file_rows = 1 if axis_of is None else slices[0][1] - slices[0][0]
    self._processes = jax.process_count()
    self.directory = distributed.process_dir(directory) / name  # several: its own shards
    if self.directory.exists() or self.directory.is_symlink():
      # The live store is never trusted across runs (resume = reload): replaced, if it is one.
      if not _holds_only_arrays(self.directory):
        raise ConfigError(_not_a_store_error(directory, self.directory))
      _delete_store(self.directory)
    self.directory.mkdir(parents=True)
    self.slices = slices
    self.num_layers = slices[-1][1]
    self._codec = dict(codec=codec, level=level, shard_mb=shard_mb)
    self._context = live_context()
    self._arrays: dict[str, ts.TensorStore] = {}  # tree path -> array [L, ...]
    self._structure = {}  # key -> (treedef, [paths])
    self._small = {}  # key -> {path: small in-memory leaf}
    self._pending: dict = {}  # key -> {leaf path: Future of the newest write of that leaf}
    self._zeros: dict = {}  # key -> {split leaf path: (piece shape, dtype)} zeros not on disk
    # put registers a write and its zero leaves, _read takes both, as one step under this lock.
    self._queue_lock = threading.Lock()
    # Queued writes are bounded by the engine's shared byte budget when there is one (a count of
    # writes would serialize an update's band-sized writes); alone, by `max_pending_writes`.
    self._write_slots = (threading.BoundedSemaphore(max_pending_writes) if write_budget is None
                         else None)
    # Bytes queued across all stores of the engine (shared): bounds write-behind memory as a whole.
    self._write_budget = write_budget
    self._readers = concurrent.futures.ThreadPoolExecutor(read_threads, f'{name}-read')
    self._writers = concurrent.futures.ThreadPoolExecutor(1, f'{name}-write')
    self._read_timer = BusyTimer(stats, 'read_busy_s')
    self._write_timer = BusyTimer(stats, 'write_busy_s')

  # --- writing ---------------------------------------------------------------------------------

  def _array(self, path: str, piece_shape) -> ts.TensorStore:
    """The array of leaf `path`; `piece_shape`: one key's piece, without the split axis."""
    if path not in self._arrays:
      axis = self._axis_of(path)
      shape = (*piece_shape[:axis], self.num_layers, *piece_shape[axis:])
      spec = codecs.array_spec(str(self.directory / leaf_name(path)), shape, axis=axis,
                               chunk=self._file_rows, parts=self.layout.parts(shape, path),
                               **self._codec)
      self._arrays[path] = ts.open(spec, create=True, delete_existing=True,
                                   context=self._context).result()
    return self._arrays[path]

  def put(self, key, tree, partial: bool = False) -> None:
    """Queues `tree` for writing; blocks only while max_pending_writes writes are queued.
    `partial`: `tree` holds some of key's leaves (None elsewhere) and only those are rewritten.
    `jax.ShapeDtypeStruct` leaves are zeros, registered and not written (module docstring)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    if partial and key not in self._structure:
      raise KeyError(f'{self.name}: a partial write of {key!r} before its first full write')
    pending = self._pending.setdefault(key, {})
    for path in paths:
      self._raise_failed(pending.get(path))
    zeros = {p: (x.shape, x.dtype) for p, x in zip(paths, leaves)
             if _is_zeros(x) and self._axis_of(p) is not None}
    if self._write_slots is not None:
      self._write_slots.acquire()
    budget = self._write_budget
    taken = budget.acquire(sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
                               for p, x in zip(paths, leaves)
                               if self._axis_of(p) is not None and p not in zeros)
                           ) if budget is not None else 0
    if not partial:
      self._structure[key] = (treedef, paths)
    # Counted here, not when the writer thread copies: the copy belongs to this step's traffic.
    self.stats.add(d2h_bytes=sum(x.nbytes for x in leaves if isinstance(x, jax.Array)
                                 and x.sharding.memory_kind == 'device'))
    def written(_):
      if self._write_slots is not None:
        self._write_slots.release()
      if budget is not None:
        budget.release(taken)

    with self._queue_lock:  # a read sees this write and its zero leaves together, or neither
      # One writer thread: writes land in the order they were queued (a key's too).
      future = self._writers.submit(self._write, key, paths, leaves)
      pending.update(dict.fromkeys(paths, future))
      key_zeros = self._zeros.setdefault(key, {})
      for path in paths:
        key_zeros.pop(path, None)
      key_zeros.update(zeros)
    future.add_done_callback(written)

  def _write(self, key, paths, leaves, write_zeros: bool = False) -> None:
    """Writes `leaves` (at `paths`) of `key`; zero leaves (ShapeDtypeStructs) only with
    `write_zeros`, part by part (this process's parts only, one at a time in memory)."""
    start, stop = self.slices[key]
    small, writes, nbytes, files = {}, [], 0, []
    with self._write_timer:
      try:
        for path, leaf in zip(paths, leaves):
          axis = self._axis_of(path)
          if axis is None:  # waits for the update that produced it
            small[path] = (np.zeros(leaf.shape, leaf.dtype) if _is_zeros(leaf)
                           else replicated_value(leaf))
            continue
          shape = tuple(leaf.shape)
          array = self._array(path, shape[:axis] + shape[axis + 1:])
          if _is_zeros(leaf) and not write_zeros:  # registered by put: nothing to write
            continue
          for box in self._boxes_to_write(shape, path):
            host = (_zeros_aligned(tuple(b - a for a, b in box), leaf.dtype) if _is_zeros(leaf)
                    else host_part(leaf, box))  # waits for the update that produced it
            box = tuple((start, stop) if d == axis else b for d, b in enumerate(box))
            writes.append(array[slices(box)].write(host))
            nbytes += host.nbytes
            files += self._files(path, box)
        for write in writes:
          write.result()
      except Exception as error:  # pylint: disable=broad-except  (ENOSPC arrives as ValueError)
        if not is_disk_full(error):
          raise
        needed = sum(int(np.prod(x.shape)) * 4 for p, x in zip(paths, leaves)
                     if self._axis_of(p) is not None)
        raise DiskFullError(
            f'NVMe store {self.name!r}: the disk holding {self.directory} is full while writing '
            f'back layers {start}..{stop - 1} ({human_bytes(needed)} for this group, '
            f'{human_bytes(shutil.disk_usage(self.directory).free)} free). Training stops; the '
            'last checkpoint is intact: free space there or point offload.dir at a larger disk, '
            'then rerun with the same --workdir to resume from it.') from error
    self._small.setdefault(key, {}).update(small)
    self.stats.add(write_bytes=nbytes, stored_bytes=sum(os.path.getsize(f) for f in files))

  def _boxes_to_write(self, shape: tuple, path: str) -> list[tuple]:
    """The boxes of a piece leaf of `shape` this process writes: the whole leaf with one process,
    its own shards' with several; and a leaf no axis of which splits over the devices (whole on
    each) whole by every process, since each reads its own copy from its own disk."""
    if self._processes == 1 or self.layout.parts(shape, path) is None:
      return [tuple((0, n) for n in shape)]
    return self.layout.owned_boxes(shape, path)

  def _raise_failed(self, future) -> None:
    if future is not None and future.done() and future.exception() is not None:
      raise future.exception()

  def flush(self) -> None:
    for pending in list(self._pending.values()):
      for future in set(pending.values()):
        future.result()

  def _wait_written(self, key, paths) -> dict:
    """Read-after-write: waits for the queued writes of `paths` of `key`; returns which of them
    are zeros not on disk, as of those writes ({path: (piece shape, dtype)})."""
    with self._queue_lock:
      pending = self._pending.get(key, {})
      futures = {pending[p] for p in paths if p in pending}
      zeros = {p: z for p, z in self._zeros.get(key, {}).items() if p in paths}
    for future in futures:
      future.result()
    return zeros

  # --- reading ---------------------------------------------------------------------------------

  def _read(self, key, keep=None, memory_kind: str = 'pinned_host'):
    """Key's tree as host arrays; with `keep` (a set of leaf paths) only those leaves, None for
    the others. With several processes, this process's slab of each disk leaf, handed out as the
    global jax.Array in `memory_kind`."""
    treedef, paths = self._structure[key]
    wanted = [p for p in paths if keep is None or p in keep]
    zeros = self._wait_written(key, wanted)
    start, stop = self.slices[key]
    small = self._small[key]
    with self._read_timer:
      reads, shapes = {}, {}
      for p in wanted:
        axis = self._axis_of(p)
        if axis is None:
          continue
        array = self._arrays[p]
        shapes[p] = tuple(stop - start if d == axis else n for d, n in enumerate(array.shape))
        box = (self.layout.local_box(shapes[p], p) if self._processes > 1
               else tuple((0, n) for n in shapes[p]))
        box = tuple((start, stop) if d == axis else b for d, b in enumerate(box))
        reads[p] = ((_zeros_aligned(tuple(b - a for a, b in box), zeros[p][1]), None, box)
                    if p in zeros else (*_read_aligned(array[slices(box)]), box))
      leaves = []
      for path in paths:
        if path in reads:
          leaves.append(self._result(path, *reads[path]))
        else:
          leaves.append(small[path] if path in wanted else None)
    self.stats.add(read_bytes=sum(x.nbytes for p, x in zip(paths, leaves)
                                  if p in reads and p not in zeros))
    if self._processes > 1:
      # The small leaves (step counts) too, whole in every process: `device_put` of a numpy
      # array to a sharding over several processes checks that they agree with a collective,
      # which, run from this reader thread, could interleave with the programs the main thread
      # runs in another order on each process and deadlock them.
      leaves = [self.layout.from_local(x, shapes[p], p, memory_kind) if p in reads
                else self.layout.from_local(x, np.shape(x), None, memory_kind) if x is not None
                else x for p, x in zip(paths, leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def _result(self, path, out: np.ndarray, future, box: tuple) -> np.ndarray:
    """`out` once its read (`future`, of `box` of leaf `path`) is done; a chunk that fails its
    checksum or is missing is a StoreCorruptionError naming its file."""
    if future is None:  # zeros not on disk
      return out
    try:
      future.result()
      return out
    except ValueError as error:  # TensorStore reports DATA_LOSS / NOT_FOUND as ValueError
      array, axis = self._arrays[path], self._axis_of(path)
      for file, part in self._file_boxes(path, box):  # name the first bad file
        try:
          array[slices(part)].read().result()
        except ValueError as file_error:
          first = part[axis][0]
          what = f'layer {first}' if self._file_rows == 1 else f'rows from {first}'
          raise StoreCorruptionError(
              f'NVMe store {self.name!r}: array {leaf_name(path)} {what} in file {file} '
              f'cannot be read back intact ({file_error}). Training stops rather than use '
              'damaged data: check the disk, then resume from the last checkpoint.') from error
      raise

  def get(self, key):
    """The tree as host numpy arrays (a disk read)."""
    return self._read(key)

  def get_async(self, key, keep=None) -> concurrent.futures.Future:
    return self._readers.submit(self._read, key, keep)

  def fetch(self, key) -> concurrent.futures.Future:
    """Disk -> host -> device on a reader thread; returns a Future of the device tree."""
    self.stats.count_fetch(self.name, key)

    def read_to_device():
      tree = self._read(key, memory_kind='device')
      self.stats.add(h2d_bytes=sum(_local_nbytes(x) for x in jax.tree.leaves(tree)))
      return self.layout.put(tree, 'device')

    return self._readers.submit(read_to_device)

  def close(self) -> None:
    try:
      self.flush()
    finally:
      self._readers.shutdown(wait=True)
      self._writers.shutdown(wait=True)

  # --- checkpoints (checkpoint.py explains why linking the live files is safe) -----------------

  def array_dirs(self) -> dict:
    """{tree path: live zarr3 array directory [L, ...]}, once every queued write has landed and
    the zero leaves not on disk are written (one leaf of one key at a time)."""
    self.flush()
    for key, zeros in self._zeros.items():
      for path, (shape, dtype) in list(zeros.items()):
        self._write(key, [path], [jax.ShapeDtypeStruct(shape, dtype)], write_zeros=True)
        del zeros[path]
    return {path: self.directory / leaf_name(path) for path in self._arrays}

  def link_arrays(self, sources: dict) -> bool:
    """Fills arrays from checkpoint snapshots {tree path: (layer shape, snapshot dir)} by linking
    (or copying) their chunk files: no data passes through RAM. Only if every snapshot has this
    store's on-disk layout (codec, chunking); otherwise returns False and the caller rewrites."""
    for path, (layer_shape, source) in sources.items():
      self._array(path, layer_shape)  # a fresh array: writes this store's zarr.json
      live = json.loads((self.directory / leaf_name(path) / 'zarr.json').read_text())
      if live != json.loads((source / 'zarr.json').read_text()):
        return False
    for path, (_, source) in sources.items():
      if self._processes == 1:
        link_tree(source / 'c', self.directory / leaf_name(path) / 'c')
        continue
      # Several processes: only this process's parts, the ones it reads and writes. A link to
      # another process's part would go stale once that process writes its own, and the next
      # checkpoint (each process links its whole store into it) could take the stale one.
      live, shape = self.directory / leaf_name(path), tuple(self._arrays[path].shape)
      for file in self._files(path, self.layout.local_box(shape, path)):
        relative = pathlib.Path(file).relative_to(live)
        if (source / relative).exists():  # chunks never written read as zeros (zarr's fill)
          (live / relative).parent.mkdir(parents=True, exist_ok=True)
          link_file(source / relative, live / relative)
    return True

  def adopt(self, key, tree) -> None:
    """Registers group `key` whose disk leaves `link_arrays` filled; `tree` gives the structure
    (disk leaves may be placeholders) and the small in-memory leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    self._structure[key] = (treedef, paths)
    self._zeros.pop(key, None)
    self._small[key] = {p: np.asarray(x) for p, (_, x) in zip(paths, flat)
                        if self._axis_of(p) is None}

  def small_leaves(self, key) -> dict:
    """{piece path: leaf} of the small in-memory leaves of `key` (e.g. optax step counts), once
    its pending write has landed: no disk read."""
    self._wait_written(key, self._structure[key][1])
    return dict(self._small[key])

  def _files(self, path: str, box: tuple) -> list[str]:
    """The chunk files holding `box` ((start, stop) per axis) of the array of leaf `path`."""
    return [file for file, _ in self._file_boxes(path, box)]

  def _file_boxes(self, path: str, box: tuple) -> list[tuple[str, tuple]]:
    """(chunk file, the part of `box` it holds) of each file holding `box` of leaf `path`: one
    per `_file_rows` rows along the store's axis and per device part (layout.parts)."""
    array, axis = self._arrays[path], self._axis_of(path)
    ndim = array.ndim
    start, stop = box[axis]
    parts = self.layout.parts(tuple(array.shape), path)
    width = array.shape[parts[0]] // parts[1] if parts else 1
    part_range = range(box[parts[0]][0] // width, -(-box[parts[0]][1] // width)) if parts else [0]
    out = []
    for i in range(start - start % self._file_rows, stop, self._file_rows):
      for j in part_range:
        part = list(box)
        part[axis] = (max(i, start), min(i + self._file_rows, stop))
        if parts:
          lo, hi = box[parts[0]]
          part[parts[0]] = (max(lo, j * width), min(hi, (j + 1) * width))
        out.append((codecs.chunk_file(str(self.directory / leaf_name(path)), i // self._file_rows,
                                      ndim, axis, (parts[0], j) if parts else None), tuple(part)))
    return out


def _local_nbytes(x) -> int:
  """Bytes of `x` this process holds (a global jax.Array: its addressable shards)."""
  if spread(x):
    return sum(s.data.nbytes for s in x.addressable_shards)
  return x.nbytes


def live_context() -> ts.Context:
  """The TensorStore context of the live stores: no cache (every group is read once per pass),
  copies on every core, and no fsync per write. The live store is never trusted across runs (a
  restart reloads the last checkpoint), and a checkpoint fsyncs the chunk files it links before
  its commit (checkpoint._write_manifest); an fsync per chunk would hold the one writer thread on
  the disk's write latency, one chunk at a time (bench/nvme_write.py: 32 MB layers written one
  after the other at 0.80 GB/s with those fsyncs, 1.79 without, on the CI VM)."""
  return ts.Context({'cache_pool': {'total_bytes_limit': 0}, 'file_io_sync': False,
                     'data_copy_concurrency': {'limit': os.cpu_count() or 2}})


def _is_zeros(leaf) -> bool:
  """A leaf given by its shape and dtype only: zeros (see `NvmeStore.put`)."""
  return isinstance(leaf, jax.ShapeDtypeStruct)


def _zeros_aligned(shape: tuple, dtype) -> np.ndarray:
  """Zeros in an aligned array (as a disk read returns them)."""
  out = aligned_empty(shape, np.dtype(dtype))
  out.fill(0)
  return out


def _read_aligned(view: ts.TensorStore):
  """(numpy array, Future): the read of `view` into an aligned array (fs.aligned_empty)."""
  out = aligned_empty(view.shape, view.dtype.numpy_dtype)
  return out, ts.array(out, copy=False, write=True).write(view)


def layer_axis(path: str) -> int | None:
  """Layer stores: leaves through 'layers' are split on their stacked axis 0."""
  return 0 if LAYERS in path else None


def nvme_bytes(layer_params_bytes: int, params_tier: str, opt_tier: str) -> int:
  """Disk bytes the NVMe stores need, uncompressed: 4 B/param for weights, 8 for Adam m and v."""
  return layer_params_bytes * ((params_tier == 'nvme') + 2 * (opt_tier == 'nvme'))


def bytes_held(roots) -> int:
  """Bytes the files under the directories `roots` take (hard links counted once; symbolic links
  neither followed nor counted)."""
  seen, held = set(), 0
  for root in roots:
    for parent, _, files in os.walk(pathlib.Path(root).expanduser()):
      for name in files:
        try:
          info = os.lstat(os.path.join(parent, name))
        except OSError:  # deleted meanwhile
          continue
        if stat_lib.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
          seen.add((info.st_dev, info.st_ino))
          held += info.st_size
  return held


# The directories of a run's stores in offload.dir (streamed.py names them by what they hold:
# params, opt_state, grads of the layers; <kind>_params, _opt, _grads of the outer pieces) and,
# with one process, the process-<i> directories a run of several left there.
_STORE_DIR = re.compile(r'(params|opt_state|grads|(embed|head|final_norm)_(params|opt|grads))')
_PROCESS_DIR = re.compile(r'process-\d+')
# A checkpoint's snapshot of the stores, staged here while it is copied to a workdir on another
# filesystem (checkpoint.py's _SNAPSHOT_PREFIX): a killed run's is the next attempt's to take.
_SNAPSHOT_DIR = re.compile(r'\.checkpoint-snapshot-\d+')
# A store being deleted (`_delete_store`): a killed run's is the next attempt's to finish.
_DELETING_DIR = re.compile(r'\.deleting-[a-z_]+-\d+')


def store_dirs(directory) -> list:
  """This process's store directories in offload.dir `directory` (`_STORE_DIR`; with one process
  also those of several processes before): live stores, never trusted across runs (a run
  rebuilds every store it uses from its checkpoint; `remove_other_stores` deletes the rest), so
  their disk is the run's to take. Only directories that hold nothing but stores count: a
  user's own `params/` in a shared offload.dir is neither counted nor deleted."""
  mine = distributed.process_dir(directory)
  if not mine.is_dir():
    return []
  stores = _stores_in(mine, _STORE_DIR, _SNAPSHOT_DIR)
  stores += [d for d in mine.iterdir() if _DELETING_DIR.fullmatch(d.name) and d.is_dir()
             and not d.is_symlink()]  # half deleted: no longer only arrays
  if mine == pathlib.Path(directory):  # one process: those of several before
    for process in mine.iterdir():
      if _PROCESS_DIR.fullmatch(process.name) and process.is_dir() and not process.is_symlink():
        stores += _stores_in(process, _STORE_DIR)
  return stores


def _stores_in(parent: pathlib.Path, *names: re.Pattern) -> list:
  """The directories in `parent` of one of the `names` that hold nothing but arrays."""
  return [d for d in parent.iterdir()
          if any(name.fullmatch(d.name) for name in names) and _holds_only_arrays(d)]


def not_stores(directory) -> list:
  """What in this process's part of offload.dir `directory` has a store's name but is not one
  (a file, a link, a directory holding anything but arrays): a run would replace it."""
  mine = distributed.process_dir(directory)
  if not mine.is_dir():
    return []
  return sorted(d for d in mine.iterdir()
                if _STORE_DIR.fullmatch(d.name) and not _holds_only_arrays(d))


def _not_a_store_error(directory, taken: pathlib.Path) -> str:
  return (f'offload.dir={directory}: {taken} is not an NVMe store of a run (it holds other '
          'files), but a run replaces the directories of its stores\' names there (params, '
          'opt_state, grads, embed_*, head_*, final_norm_*) and would delete it. Point '
          'offload.dir at a directory of the run\'s own (the default is <workdir>/offload), or '
          'move it.')


def _holds_only_arrays(directory: pathlib.Path) -> bool:
  """Whether `directory` (not a link) holds nothing but the arrays of a store: directories each
  with a zarr.json beside its chunks (or nothing yet), and TensorStore's lock files."""
  if directory.is_symlink() or not directory.is_dir():
    return False
  for child in directory.iterdir():
    if child.name.endswith('.__lock'):
      continue
    if child.is_symlink() or not child.is_dir():
      return False
    names = {name for name in os.listdir(child) if not name.endswith('.__lock')}
    if not names <= {'zarr.json', 'c'} or (
        (child / 'c').exists() and not (child / 'zarr.json').is_file()):
      return False
  return True


def remove_other_stores(directory, used: set) -> None:
  """Deletes this process's store directories in `directory` that no store of the run (names
  `used`) rebuilds: a placement that moved a piece off NVMe, or a run of another process count,
  left them, and the planner counted their disk as free (`held_by_run`)."""
  for stale in store_dirs(directory):
    if stale.name not in used or stale.parent != distributed.process_dir(directory):
      _delete_store(stale)
      if _PROCESS_DIR.fullmatch(stale.parent.name) and not any(stale.parent.iterdir()):
        stale.parent.rmdir()


def _delete_store(directory: pathlib.Path) -> None:
  """Deletes a store's directory, first renamed out of its name (`_DELETING_DIR`): shutil.rmtree
  deletes each array's zarr.json before its chunks, and a store killed half deleted would hold
  chunks without metadata, refused as a user's directory (`_holds_only_arrays`) by every later
  start. Renamed, a killed deletion is finished by the next (`store_dirs` counts it)."""
  doomed = directory
  if not _DELETING_DIR.fullmatch(directory.name):
    doomed = directory.with_name(f'.deleting-{directory.name}-{time.time_ns()}')
    os.rename(directory, doomed)
  shutil.rmtree(doomed, ignore_errors=True)


def held_by_run(directory, checkpoint_dir=None, keep: int = 0, deleted=(),
                best: int | None = None) -> int:
  """Bytes of a run's NVMe data on offload.dir's filesystem (`bytes_held`): its stores in
  `directory` (`store_dirs`) and, on the same filesystem, the snapshots of the checkpoints in
  `checkpoint_dir` its plan counts (`snapshots`: the newest `keep`, the `best` kept beyond them,
  and the steps `deleted`, which a resume deletes before it writes). The planner and
  `check_offload_dir` count them as free for the run: a resume plans with the disk it started
  with (and a rerun with a lower keep with what the deletion frees)."""
  roots = store_dirs(directory)
  if checkpoint_dir is not None and keep > 0 and same_filesystem(directory, checkpoint_dir):
    roots += snapshots(checkpoint_dir, keep, deleted, best)
  return bytes_held(roots)


def same_filesystem(directory, checkpoint_dir) -> bool:
  """Whether offload.dir `directory` and the workdir's `checkpoint_dir` are (or will be made) on
  one filesystem: there the checkpoints hard-link the stores; elsewhere they copy them from one
  snapshot on offload.dir's (checkpoint.py)."""
  existing = nearest_existing(pathlib.Path(directory).expanduser().absolute())
  checkpoints = nearest_existing(pathlib.Path(checkpoint_dir).expanduser().absolute())
  return os.stat(checkpoints).st_dev == os.stat(existing).st_dev


def snapshots(checkpoint_dir, keep: int, deleted=(), best: int | None = None) -> list:
  """The `nvme/` snapshots of the newest `keep` committed checkpoints in `checkpoint_dir`, of the
  steps `deleted` (checkpoint.beyond_keep), and of the `best` (checkpoint.keep_best), which the
  run keeps however old it is: one of the copies its `keep` counts (the caller's keep + 1), not
  another program's. Left out, a best older than the newest `keep` was counted as taken as well
  as needed, and a disk with room for the run was refused."""
  if checkpoint_dir is None or not pathlib.Path(checkpoint_dir).is_dir():
    return []
  steps = sorted((d for d in pathlib.Path(checkpoint_dir).iterdir() if d.name.isdigit()),
                 key=lambda d: int(d.name))
  newest = steps[-keep:] if keep > 0 else []
  chosen = newest + [d for d in steps if d not in newest and (int(d.name) in deleted
                                                               or int(d.name) == best)]
  return [d / 'nvme' for d in chosen if (d / 'nvme').is_dir()]


def check_offload_dir(directory: str, needed_bytes: int, checkpoint_dir=None, keep: int = 0,
                      deleted=(), best: int | None = None, keep_best: bool = False) -> None:
  """offload.dir must be writable and hold `needed_bytes` (the live stores) plus what `keep`
  checkpoints in `checkpoint_dir` pin (checkpoint.py). Same filesystem: one full copy of the
  stores each (hard links share the live files only until the next write-back). Another
  filesystem: the checkpoints are copies, so that one needs keep + 1 copies (the new one is written
  before the oldest is deleted), and offload.dir one more copy for the staging snapshot being
  copied. The checkpoints `deleted` (steps beyond keep, which a resume deletes first) count as
  free, and the `best` kept beyond the newest (checkpoint.keep_best) as one of the `keep`
  (`keep_best`: `keep` counts it, and the messages name checkpoint.keep without it). Checked
  before anything is written."""
  existing = nearest_existing(pathlib.Path(directory).expanduser().absolute())
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f'offload.dir={directory}: {existing} is not a writable directory. Point '
                      'offload.dir at a directory on a local disk you can write to.')
  for taken in not_stores(directory):
    raise ConfigError(_not_a_store_error(directory, taken))
  fix = ('Free space, point offload.dir at a larger disk, or keep offload.opt_state (2/3 of it) '
         'on host')
  checkpoints = (nearest_existing(pathlib.Path(checkpoint_dir).absolute())
                 if checkpoint_dir is not None and keep > 0 else None)
  same_disk = checkpoints is not None and same_filesystem(directory, checkpoint_dir)
  keep_best = bool(keep_best and keep)  # no checkpoints: none kept
  kept = f'checkpoint.keep={keep - keep_best}' + ' and the best (keep_best)' * keep_best
  lower = keep - keep_best > 1  # keep=1 is the least
  if same_disk:
    needed = needed_bytes * (1 + keep)
    what = (f'the NVMe stores and their checkpoints need {human_bytes(needed)} (uncompressed '
            f'FP32: {human_bytes(needed_bytes)} live, and each of {kept} pins one more copy)')
    fix += ', or lower checkpoint.keep' * lower
  elif checkpoints is not None:
    needed = 2 * needed_bytes
    what = (f'the NVMe stores need {human_bytes(needed)} (uncompressed FP32: '
            f'{human_bytes(needed_bytes)} live, and as much for the snapshot a checkpoint copies '
            'to the workdir on another filesystem)')
    fix += ', or put offload.dir on the workdir\'s filesystem'
  else:
    needed = needed_bytes
    what = f'the NVMe stores need {human_bytes(needed)} (uncompressed FP32)'
  held = held_by_run(directory, checkpoint_dir if same_disk else None, keep, deleted, best)
  free = shutil.disk_usage(existing).free + held
  if free < needed:
    raise ConfigError(f'offload.dir={directory}: {what} but only {human_bytes(free)} are free '
                      f'there{f" (with the {human_bytes(held)} the run holds)" * bool(held)}. '
                      f'{fix}.')
  if checkpoints is not None and not same_disk:
    needed = needed_bytes * (keep + 1)
    free = (shutil.disk_usage(checkpoints).free
            + bytes_held(snapshots(checkpoint_dir, keep, deleted, best)))
    if free < needed:
      raise ConfigError(
          f'{kept}: the checkpoints in {checkpoint_dir} hold copies of the NVMe state '
          '(offload.dir is on another filesystem, so they cannot be hard links): they need '
          f'{human_bytes(needed)} ({keep} kept + 1 being written) but only {human_bytes(free)} '
          'are free there. Put offload.dir on the workdir\'s filesystem, '
          f'{"lower checkpoint.keep, " * lower}'
          'set checkpoint.every=-1 (no checkpoints), or free space.')
