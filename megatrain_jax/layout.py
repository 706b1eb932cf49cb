"""`Layout`: the one place that answers "which devices hold this leaf, how is it split, and in which
memory kind".

A layout is a device mesh plus, for each part of the train state, a memory kind per tier and a
`PartitionSpec` per leaf. Stores (tiers/), the engines' jitted functions and checkpoints take their
shardings from it; nothing else builds one (distributed.py only chooses the devices it spans).

    mesh        one axis, 'data', over the N devices the run uses (`for_devices`; distributed.py
                picks them from parallel.devices); one device is a one-device mesh
    memory kind tier 'device' -> 'device', 'host' -> 'pinned_host'; 'nvme' leaves live on disk and
                are staged through host numpy arrays, then put on the device(s)
    spec        per leaf (`leaf_spec`), ZeRO-3 / FSDP style: a leaf is split over 'data' along its
                first axis whose size is a multiple of N (each device keeps 1/N of it, in every
                memory kind); scalars and leaves with no such axis are whole on every device.
                With one device every leaf is simply whole. Jitted functions take these
                shardings and XLA (GSPMD) inserts the all-gathers before a leaf is used and the
                reduce-scatters of its gradient: no collective is written by hand.
    batch       token arrays [M, B, S] (or [B, S]) are split over 'data' along B
                (`batch_sharding`): data parallel, each device computes B/N sequences of every
                microbatch, so the global batch (B x M) means the same on any device count.

Tier names are plain strings here ('device', 'host', 'nvme'), so this module sits below placement.py
and tiers/ in the layering (pyproject.toml) and any of them may build one.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.errors import ConfigError

MESH_AXIS = 'data'
TIER_MEMORY_KIND = {'device': 'device', 'host': 'pinned_host'}


def default_devices() -> list:
  """The first device: what `Layout.single_device` and the device queries below use (a run on
  more devices gets its Layout from distributed.run_layout)."""
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

  @classmethod
  def for_devices(cls, devices) -> 'Layout':
    """A mesh over `devices` (a list of jax devices, in mesh order) on the one axis 'data'."""
    devices = list(devices)
    if not devices:
      raise ValueError('a Layout needs at least one device')
    return cls(Mesh(np.array(devices), (MESH_AXIS,)))

  @property
  def devices(self) -> list:
    return list(self.mesh.devices.flat)

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  def leaf_spec(self, shape: tuple) -> PartitionSpec:
    """How a leaf of `shape` is split over the mesh: along its first axis whose size is a
    positive multiple of the device count N (e.g. a stacked kernel [L, D, F] with L = N: by
    layer; [97, 32] over 4 devices: by column), else whole (replicated) on every device."""
    n = self.num_devices
    if n > 1:
      for axis, size in enumerate(shape):
        if size >= n and size % n == 0:
          return PartitionSpec(*([None] * axis), MESH_AXIS)
    return PartitionSpec()

  def sharding(self, memory_kind: str = 'device', shape: tuple = ()) -> NamedSharding:
    """The sharding of a leaf of `shape` kept in `memory_kind` ('device' or 'pinned_host')."""
    return NamedSharding(self.mesh, self.leaf_spec(shape), memory_kind=memory_kind)

  def tier_sharding(self, tier: str) -> NamedSharding:
    """Where a memory tier ('device' or 'host') keeps its leaves."""
    return self.sharding(TIER_MEMORY_KIND[tier])

  def shardings(self, tree, memory_kind: str = 'device'):
    """The sharding of every leaf of `tree` (arrays or ShapeDtypeStructs) in `memory_kind`."""
    return jax.tree.map(lambda x: self.sharding(memory_kind, np.shape(x)), tree)

  def put(self, tree, memory_kind: str):
    """`jax.device_put` of every leaf of `tree` to its sharding in `memory_kind` (asynchronous)."""
    return jax.device_put(tree, self.shardings(tree, memory_kind))

  def conform(self, tree):
    """`tree` with each jax.Array leaf moved to its layout sharding in the memory kind it is in
    (a no-op for leaves already there; host numpy leaves unchanged): for arrays made by code that
    does not know the layout (a jitted init) before a store keeps them."""
    def conformed(x):
      if not isinstance(x, jax.Array):
        return x
      return jax.device_put(x, self.sharding(x.sharding.memory_kind or 'device', x.shape))
    return jax.tree.map(conformed, tree)

  def constrain(self, tree):
    """Inside a jitted function: every leaf of a train-state-shaped `tree` (weights, gradients,
    Adam state) held to its `leaf_spec` in device memory, so GSPMD reduce-scatters a gradient to
    its shards instead of leaving it whole on every device."""
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, self.sharding('device', x.shape)), tree)

  def batch_sharding(self, shape: tuple, memory_kind: str = 'device') -> NamedSharding:
    """The sharding of a token (or loss-weight) array [M, B, S] or [B, S] in `memory_kind`:
    split along B (axis -2) over 'data'. B must be a multiple of the device count (config
    validation refuses train.batch_size otherwise: distributed.check_batch)."""
    axis = len(shape) - 2
    if axis < 0 or shape[axis] % self.num_devices:
      raise ConfigError(f'a batch of shape {tuple(shape)} does not split over the run\'s '
                        f'{self.num_devices} devices along its batch axis (axis {axis}): every '
                        'device takes an equal share of each microbatch. Use a train.batch_size '
                        'that is a multiple of the device count, or set parallel.devices to a '
                        'divisor of it.')
    return self.split_along(axis, memory_kind)

  def put_batch(self, array, memory_kind: str = 'device'):
    """A token array [M, B, S] / [B, S] (or None; the global batch, as every process's sampler
    draws it) on the devices, split along B. With several processes each one feeds only the rows
    of its own devices (jax.make_array_from_process_local_data)."""
    if array is None:
      return None
    array = np.asarray(array)
    sharding = self.batch_sharding(array.shape, memory_kind)
    if jax.process_count() == 1:
      return jax.device_put(array, sharding)
    rows = self._process_rows(sharding, array.shape)
    return jax.make_array_from_process_local_data(
        sharding, np.take(array, rows, axis=array.ndim - 2), array.shape)

  @staticmethod
  def _process_rows(sharding: NamedSharding, shape: tuple) -> range:
    """The batch rows (axis -2) of `shape` held by this process's devices: one contiguous run,
    as the mesh orders the devices process by process."""
    spans = [index[len(shape) - 2] for index in
             sharding.addressable_devices_indices_map(shape).values()]
    return range(min(s.start or 0 for s in spans), max(s.stop or shape[-2] for s in spans))

  def put_activation(self, x, memory_kind: str):
    """An activation [B, S, D] moved to `memory_kind`, still split along B."""
    return jax.device_put(x, self.split_along(0, memory_kind))

  def constrain_batch(self, x):
    """Inside a jitted function: an activation [B, S, ...] held split along B over 'data'."""
    return jax.lax.with_sharding_constraint(x, self.split_along(0, 'device'))

  def split_along(self, axis: int, memory_kind: str = 'device') -> NamedSharding:
    """Split along `axis` over 'data' (the batch axis of tokens and activations)."""
    return NamedSharding(self.mesh, PartitionSpec(*([None] * axis), MESH_AXIS),
                         memory_kind=memory_kind)

  def replicated(self, memory_kind: str = 'device') -> NamedSharding:
    """Whole on every device (metrics, scalars)."""
    return NamedSharding(self.mesh, PartitionSpec(), memory_kind=memory_kind)


def memory_kind(tree) -> str | None:
  """The memory kind shared by every leaf of `tree`; None for host numpy arrays or a mix."""
  kinds = {x.sharding.memory_kind if isinstance(x, jax.Array) else None
           for x in jax.tree.leaves(tree)}
  return kinds.pop() if len(kinds) == 1 else None
