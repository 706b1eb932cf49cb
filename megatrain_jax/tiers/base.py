"""The store interface and its transfer accounting."""

import abc
import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Hashable

import jax

from megatrain_jax.layout import Layout

PyTree = Any


def tree_nbytes(tree: PyTree) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def keep_leaves(tree: PyTree, keep) -> PyTree:
  """`tree` with the leaves whose path (jax keystr) is not in `keep` replaced by None (an empty
  subtree to jax): the part of a piece one update band reads or writes."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if jax.tree_util.keystr(path) in keep else None, tree)


def merge_leaves(tree: PyTree, part: PyTree) -> PyTree:
  """`tree` with the leaves `part` holds (a keep_leaves tree of the same structure) replaced."""
  new = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(part)[0]}
  return jax.tree_util.tree_map_with_path(
      lambda path, x: new.get(jax.tree_util.keystr(path), x), tree)


def assemble(parts: list) -> PyTree:
  """One tree from keep_leaves parts of it that hold each leaf once (a piece's update bands'
  outputs): each part has the whole tree's structure, None where another part holds the leaf."""
  is_none = lambda x: x is None
  flat = [jax.tree.flatten(part, is_leaf=is_none) for part in parts]
  leaves = [next((x for x in column if x is not None), None)
            for column in zip(*(leaves for leaves, _ in flat))]
  return jax.tree.unflatten(flat[0][1], leaves)


@dataclasses.dataclass
class TransferStats:
  """Bytes moved between tiers, and fetch counts per (store, key), since the last `reset`.

  Disk figures (NVMe tier): logical bytes read and written, bytes the written files take on disk
  (for the compression ratio), and the wall time during which at least one read (or write) was
  in flight, so read_bytes / read_busy_s is the throughput the disk delivered while busy.
  Updated from the engine and from I/O threads: every update goes through `add` or
  `count_fetch`, under the lock.
  """
  h2d_bytes: int = 0
  d2h_bytes: int = 0
  read_bytes: int = 0
  write_bytes: int = 0
  stored_bytes: int = 0
  read_busy_s: float = 0.0
  write_busy_s: float = 0.0
  fetches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def add(self, **amounts) -> None:
    with self.lock:
      for name, amount in amounts.items():
        setattr(self, name, getattr(self, name) + amount)

  def count_fetch(self, store: str, key: Hashable) -> None:
    with self.lock:
      self.fetches[(store, key)] += 1

  def reset(self) -> None:
    """Starts a new step's transfer and fetch counts. Disk counters are cumulative (write-behind
    lands during the next step): engines report their differences between snapshots."""
    with self.lock:
      self.h2d_bytes = self.d2h_bytes = 0
      self.fetches.clear()

  def disk_snapshot(self) -> dict:
    with self.lock:
      return {name: getattr(self, name) for name in ('read_bytes', 'write_bytes', 'stored_bytes',
                                                      'read_busy_s', 'write_busy_s')}


class WriteBudget:
  """Bytes of write-behind that every NVMe store of one engine may hold queued, together.

  A store's queued write keeps its leaves in host memory until they land on disk; one budget
  shared by the layer, vocabulary and gradient stores bounds that memory as a whole (a per-store
  count would let each store queue its own pieces). A write larger than the whole budget waits
  until nothing else is queued, then goes alone."""

  def __init__(self, capacity_bytes: int):
    self.capacity = max(int(capacity_bytes), 1)
    self.used = 0
    self.peak = 0
    self._cond = threading.Condition()

  def acquire(self, nbytes: int) -> int:
    """Blocks until `nbytes` fit; returns what was taken (to hand back to `release`)."""
    taken = min(int(nbytes), self.capacity)
    with self._cond:
      while self.used and self.used + taken > self.capacity:
        self._cond.wait()
      self.used += taken
      self.peak = max(self.peak, self.used)
    return taken

  def release(self, taken: int) -> None:
    with self._cond:
      self.used -= taken
      self._cond.notify_all()


class BusyTimer:
  """Accumulates the wall time during which at least one operation is in flight (thread-safe)."""

  def __init__(self, stats: TransferStats, field: str):
    self._stats, self._field = stats, field
    self._lock = threading.Lock()
    self._active = 0
    self._since = 0.0

  def __enter__(self):
    with self._lock:
      if self._active == 0:
        self._since = time.perf_counter()
      self._active += 1

  def __exit__(self, *exc):
    with self._lock:
      self._active -= 1
      if self._active == 0:
        self._stats.add(**{self._field: time.perf_counter() - self._since})


class Store(abc.ABC):
  """Named pytrees kept in one tier. Subclasses define where and how they move."""

  tier: str = ''

  def __init__(self, name: str, stats: TransferStats, layout: Layout | None = None):
    self.name = name
    self.stats = stats
    # Shardings of what this store holds and hands out (default: the first device, whole).
    self.layout = layout or Layout.single_device()
    self._trees: dict[Hashable, PyTree] = {}

  def get(self, key: Hashable) -> PyTree:
    """The tree as stored, without a transfer."""
    return self._trees[key]

  @abc.abstractmethod
  def put(self, key: Hashable, tree: PyTree, partial: bool = False) -> None:
    """Takes `tree` (device or host arrays) into this tier under `key`. `partial`: `tree` holds
    some of key's leaves (None for the others, as `keep_leaves` makes) and replaces only those."""

  @abc.abstractmethod
  def fetch(self, key: Hashable) -> PyTree:
    """A device-resident copy of the tree under `key` (or a Future of one); asynchronous."""

  def release(self, key: Hashable) -> None:
    """Forgets the tree under `key` (a parked gradient its update has read): an in-memory tier
    frees it now rather than when the next step puts a new one; a disk tier keeps its files."""
    self._trees.pop(key, None)

  def get_async(self, key: Hashable, keep=None) -> concurrent.futures.Future:
    """`get(key)` as a Future: tiers that must read from disk start the read now. With `keep` (a
    set of leaf paths) only those leaves are read, None in place of the others."""
    future = concurrent.futures.Future()
    tree = self.get(key)
    future.set_result(tree if keep is None else keep_leaves(tree, keep))
    return future

  def flush(self) -> None:
    """Waits until every `put` has reached the tier (a no-op for in-memory tiers)."""

  def close(self) -> None:
    self.flush()


def resolve(value):
  """The value of a Future, or the value itself."""
  return value.result() if isinstance(value, concurrent.futures.Future) else value
