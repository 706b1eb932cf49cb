"""The two in-memory tiers: device (accelerator memory) and host (pinned host RAM).

Both are plain `jax.Array`s; they differ only in memory kind (`device` vs `pinned_host`), and
moving between them is a `jax.device_put` to the other kind's sharding, which JAX issues
asynchronously (the consumer waits on it, not the Python thread). On CPU both kinds are the same
RAM, so CPU runs prove the numbers and the placement types, not the copies.
"""

import jax

from megatrain_jax.tiers.base import Store, TransferStats, tree_nbytes


def memory_sharding(kind: str) -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def memory_kind(tree) -> str | None:
  """The memory kind shared by every leaf; None for host numpy arrays or a mix."""
  kinds = {x.sharding.memory_kind if isinstance(x, jax.Array) else None
           for x in jax.tree.leaves(tree)}
  return kinds.pop() if len(kinds) == 1 else None


class DeviceStore(Store):
  """Trees stay in device memory: `fetch` hands out the stored arrays, no copy."""

  tier = 'device'

  def __init__(self, name: str, stats: TransferStats):
    super().__init__(name, stats)
    self.sharding = memory_sharding('device')

  def put(self, key, tree):
    if memory_kind(tree) != 'device':
      self.stats.h2d_bytes += tree_nbytes(tree)
      tree = jax.device_put(tree, self.sharding)
    self._trees[key] = tree

  def fetch(self, key):
    self.stats.fetches[(self.name, key)] += 1
    return self._trees[key]


class HostStore(Store):
  """Trees live in pinned host RAM; `fetch` copies them to the device, `put` copies back."""

  tier = 'host'

  def __init__(self, name: str, stats: TransferStats):
    super().__init__(name, stats)
    self.sharding = memory_sharding('pinned_host')
    self.device_sharding = memory_sharding('device')

  def put(self, key, tree):
    if memory_kind(tree) != 'pinned_host':
      self.stats.d2h_bytes += tree_nbytes(tree)
      tree = jax.device_put(tree, self.sharding)
    self._trees[key] = tree

  def fetch(self, key):
    tree = self._trees[key]
    self.stats.fetches[(self.name, key)] += 1
    self.stats.h2d_bytes += tree_nbytes(tree)
    return jax.device_put(tree, self.device_sharding)


def make_store(tier: str, name: str, stats: TransferStats) -> Store:
  return {'device': DeviceStore, 'host': HostStore}[tier](name, stats)
