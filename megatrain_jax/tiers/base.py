"""The store interface and its transfer accounting."""

import abc
import collections
import dataclasses
from typing import Any, Hashable

import jax

PyTree = Any


def tree_nbytes(tree: PyTree) -> int:
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class TransferStats:
  """Bytes moved between tiers, and fetch counts per (store, key), since the last `reset`."""
  h2d_bytes: int = 0
  d2h_bytes: int = 0
  fetches: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def reset(self) -> None:
    self.h2d_bytes = self.d2h_bytes = 0
    self.fetches.clear()


class Store(abc.ABC):
  """Named pytrees kept in one tier. Subclasses define where and how they move."""

  tier: str = ''

  def __init__(self, name: str, stats: TransferStats):
    self.name = name
    self.stats = stats
    self._trees: dict[Hashable, PyTree] = {}

  def keys(self):
    return self._trees.keys()

  def get(self, key: Hashable) -> PyTree:
    """The tree as stored, without a transfer."""
    return self._trees[key]

  @abc.abstractmethod
  def put(self, key: Hashable, tree: PyTree) -> None:
    """Takes `tree` (device or host arrays) into this tier under `key`."""

  @abc.abstractmethod
  def fetch(self, key: Hashable) -> PyTree:
    """A device-resident copy of the tree under `key`; the transfer is asynchronous."""
