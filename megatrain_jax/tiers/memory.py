"""The two in-memory tiers: device (accelerator memory) and host (pinned host RAM).

Both are plain `jax.Array`s; they differ only in memory kind (`device` vs `pinned_host`), and
moving between them is a `jax.device_put` to the other kind's sharding (from the run's `Layout`),
which JAX issues asynchronously (the consumer waits on it, not the Python thread). On CPU both kinds
are the same RAM, so CPU runs prove the numbers and the placement types, not the copies.
"""

from megatrain_jax.layout import Layout, memory_kind
from megatrain_jax.tiers.base import Store, TransferStats, merge_leaves, tree_nbytes


class DeviceStore(Store):
  """Trees stay in device memory: `fetch` hands out the stored arrays, no copy."""

  tier = 'device'

  def put(self, key, tree, partial=False):
    tree = merge_leaves(self._trees[key], tree) if partial else tree
    if memory_kind(tree) != 'device':
      self.stats.add(h2d_bytes=tree_nbytes(tree))
      tree = self.layout.put(tree, 'device')
    self._trees[key] = tree

  def fetch(self, key):
    self.stats.count_fetch(self.name, key)
    return self._trees[key]


class HostStore(Store):
  """Trees live in pinned host RAM; `fetch` copies them to the device, `put` copies back."""

  tier = 'host'

  def put(self, key, tree, partial=False):
    tree = merge_leaves(self._trees[key], tree) if partial else tree
    if memory_kind(tree) != 'pinned_host':
      self.stats.add(d2h_bytes=tree_nbytes(tree))
      tree = self.layout.put(tree, 'pinned_host')
    self._trees[key] = tree

  def fetch(self, key):
    tree = self._trees[key]
    self.stats.count_fetch(self.name, key)
    self.stats.add(h2d_bytes=tree_nbytes(tree))
    return self.layout.put(tree, 'device')


def make_store(tier: str, name: str, stats: TransferStats, layout: Layout) -> Store:
  return {'device': DeviceStore, 'host': HostStore}[tier](name, stats, layout)
