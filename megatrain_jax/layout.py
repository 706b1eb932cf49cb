"""`Layout`: the one place that answers "which devices hold this leaf, how is it split, and in which
memory kind".

A layout is a device mesh plus, for each part of the train state, a memory kind per tier and a
`PartitionSpec` per leaf. Stores (tiers/), the engines' jitted functions and checkpoints take their
shardings from it; nothing else picks devices.

    mesh        one axis, 'data', over the devices the run uses; one device is a one-device mesh
    memory kind tier 'device' -> 'device', 'host' -> 'pinned_host'; 'nvme' leaves live on disk and
                are staged through host numpy arrays, then put on the device
    spec        P() today: every leaf whole on each device of the mesh (with one device, simply
                whole). Sharding leaves over 'data' (ZeRO-3 style, issue 13) changes `leaf_spec`
                and nothing that calls it.

Tier names are plain strings here ('device', 'host', 'nvme'), so this module sits below placement.py
and tiers/ in the layering (pyproject.toml) and any of them may build one.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXIS = 'data'
TIER_MEMORY_KIND = {'device': 'device', 'host': 'pinned_host'}


def default_devices() -> list:
  """The devices a run uses when none are named: today the first one."""
  return jax.devices()[:1]


def device_kind() -> str:
  """What the run computes on (e.g. 'NVIDIA H100 80GB HBM3', or 'cpu')."""
  return default_devices()[0].device_kind


def platform() -> str:
  return default_devices()[0].platform


def available_memory_kinds() -> list[str]:
  return [m.kind for m in default_devices()[0].addressable_memories()]


def device_memory_stats() -> dict:
  return default_devices()[0].memory_stats() or {}


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh: Mesh

  @classmethod
  def single_device(cls, device=None) -> 'Layout':
    """A one-device mesh over `device` (default: the first device)."""
    device = device if device is not None else default_devices()[0]
    return cls(Mesh(np.array([device]), (MESH_AXIS,)))

  @property
  def devices(self) -> list:
    return list(self.mesh.devices.flat)

  def leaf_spec(self, shape: tuple) -> PartitionSpec:
    """How a leaf of `shape` is split over the mesh: whole (replicated) on every device today."""
    del shape
    return PartitionSpec()

  def sharding(self, memory_kind: str = 'device', shape: tuple = ()) -> NamedSharding:
    """The sharding of a leaf of `shape` kept in `memory_kind` ('device' or 'pinned_host')."""
    return NamedSharding(self.mesh, self.leaf_spec(shape), memory_kind=memory_kind)

  def tier_sharding(self, tier: str) -> NamedSharding:
    """Where a memory tier ('device' or 'host') keeps its leaves."""
    return self.sharding(TIER_MEMORY_KIND[tier])

  def put(self, tree, memory_kind: str):
    """`jax.device_put` of every leaf of `tree` to its sharding in `memory_kind` (asynchronous)."""
    shardings = jax.tree.map(lambda x: self.sharding(memory_kind, np.shape(x)), tree)
    return jax.device_put(tree, shardings)


def memory_kind(tree) -> str | None:
  """The memory kind shared by every leaf of `tree`; None for host numpy arrays or a mix."""
  kinds = {x.sharding.memory_kind if isinstance(x, jax.Array) else None
           for x in jax.tree.leaves(tree)}
  return kinds.pop() if len(kinds) == 1 else None
