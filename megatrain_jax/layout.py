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
                memory kind), never along the axis the train state is cut into pieces along
                (partition.split_axis of its tree path: the layer axis of stacked layers, the
                vocabulary axis of the embedding and head). So every piece of a leaf (a layer
                group, a vocabulary chunk, the last and shorter one too) is split along the same
                axis into the same widths as the whole leaf: device shards, NVMe chunk files and
                checkpoint files line up, and each process writes only files of its own shards.
                Scalars and leaves with no such axis are whole on every device. With one device
                every leaf is simply whole. Jitted functions take these
                shardings and XLA (GSPMD) inserts the all-gathers before a leaf is used and the
                reduce-scatters of its gradient: no collective is written by hand.
    batch       token arrays [M, B, S] (or [B, S]) are split over 'data' along B
                (`batch_sharding`): data parallel, each device computes B/N sequences of every
                microbatch, so the global batch (B x M) means the same on any device count.

Tier names are plain strings here ('device', 'host', 'nvme'), so this module sits below placement.py
and tiers/ in the layering (pyproject.toml) and any of them may build one.
"""

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.errors import ConfigError
from megatrain_jax.partition import LazySlice, split_axis

MESH_AXIS = 'data'


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

  def leaf_spec(self, shape: tuple, path: str | None = None) -> PartitionSpec:
    """How a leaf of `shape` at tree `path` (a full-state or piece path; None: a leaf of no
    train state) is split over the mesh: along its first axis whose size is a positive multiple
    of the device count N, skipping the axis its pieces are cut along (e.g. a stacked kernel
    [L, D, F]: by D; the head kernel [D, V]: by D; [97, 32] over 4 devices: by column), else
    whole (replicated) on every device."""
    n, pieces_axis = self.num_devices, split_axis(path) if path else None
    if n > 1:
      for axis, size in enumerate(shape):
        if axis != pieces_axis and size >= n and size % n == 0:
          return PartitionSpec(*([None] * axis), MESH_AXIS)
    return PartitionSpec()

  def parts(self, shape: tuple, path: str | None = None) -> tuple[int, int] | None:
    """(axis, N): a leaf of `shape` at `path` is split along `axis` into N equal device shards;
    None: it is whole on every device. Stored files are cut the same way (tiers/nvme.py,
    checkpoint.py), so that a process writes only files of its own shards."""
    spec = self.leaf_spec(shape, path)
    return (len(spec) - 1, self.num_devices) if len(spec) else None

  def sharding(self, memory_kind: str = 'device', shape: tuple = (),
               path: str | None = None) -> NamedSharding:
    """The sharding of a leaf of `shape` at tree `path` kept in `memory_kind` ('device' or
    'pinned_host')."""
    return NamedSharding(self.mesh, self.leaf_spec(shape, path), memory_kind=memory_kind)

  def shardings(self, tree, memory_kind: str = 'device'):
    """The sharding of every leaf of `tree` (arrays or ShapeDtypeStructs; a train-state-shaped
    tree: its tree paths name the pieces' axis) in `memory_kind`."""
    return _map_with_path(lambda path, x: self.sharding(memory_kind, np.shape(x), path), tree)

  def put(self, tree, memory_kind: str):
    """`jax.device_put` of every leaf of `tree` to its sharding in `memory_kind` (asynchronous;
    with several processes `place`)."""
    leaves, treedef = jax.tree.flatten(tree)
    shardings = self._leaf_shardings(treedef, tuple(np.shape(x) for x in leaves), memory_kind)
    if jax.process_count() == 1:
      return jax.tree.unflatten(treedef, jax.device_put(leaves, list(shardings)))
    return jax.tree.unflatten(treedef, [place(x, s) for x, s in zip(leaves, shardings)])

  @functools.lru_cache(maxsize=512)
  def _leaf_shardings(self, treedef, shapes: tuple, memory_kind: str) -> tuple:
    """`shardings` of a tree of `treedef` and leaf `shapes`, as a tuple in leaf order: computed
    once per kind of tree (a streamed step puts the same few trees hundreds of times)."""
    abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, np.float32) for s in shapes])
    return tuple(jax.tree.leaves(self.shardings(abstract, memory_kind)))

  def conform(self, tree):
    """`tree` with each jax.Array leaf moved to its layout sharding in the memory kind it is in
    (a no-op for leaves already there; host numpy leaves unchanged): for arrays made by code that
    does not know the layout (a jitted init) before a store keeps them."""
    def conformed(path, x):
      if not isinstance(x, jax.Array):
        return x
      return place(x, self.sharding(x.sharding.memory_kind or 'device', x.shape, path))
    return _map_with_path(conformed, tree)

  def constrain(self, tree):
    """Inside a jitted function: every leaf of a train-state-shaped `tree` (weights, gradients,
    Adam state) held to its `leaf_spec` in device memory, so GSPMD reduce-scatters a gradient to
    its shards instead of leaving it whole on every device."""
    return _map_with_path(lambda path, x: jax.lax.with_sharding_constraint(
        x, self.sharding('device', x.shape, path)), tree)

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

  # --- several processes: which part of a leaf is this process's -----------------------------
  # With one process every device is addressable and a leaf is read or written whole. With
  # several, a process holds (and may read or write) only its own devices' shards: these give the
  # boxes, as tuples of (start, stop) per axis of the leaf.

  def owned_boxes(self, shape: tuple, path: str | None = None) -> list[tuple]:
    """The distinct shards of a leaf of `shape` at `path` that this process writes: each one
    once in the whole run, by the process of the first device (in mesh order) that holds it (a
    replicated leaf: by the first process only)."""
    owners = {}
    for device, index in self.sharding('device', shape, path).devices_indices_map(
        tuple(shape)).items():
      owners.setdefault(_box(index, shape), device)
    return [box for box, device in owners.items() if device.process_index == jax.process_index()]

  def local_box(self, shape: tuple, path: str | None = None) -> tuple:
    """The box of a leaf this process's devices hold: one contiguous slab along the split axis
    (the mesh orders the devices process by process), or the whole leaf if it is replicated."""
    boxes = [_box(index, shape) for index in self.sharding('device', shape, path)
             .addressable_devices_indices_map(tuple(shape)).values()]
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes))
                 for d in range(len(shape)))

  def from_local(self, local, shape: tuple, path: str | None, memory_kind: str):
    """The global array of `shape` from this process's `local` part of it (`local_box`)."""
    return jax.make_array_from_process_local_data(
        self.sharding(memory_kind, shape, path), local, tuple(shape))

  def put_activation(self, x, memory_kind: str):
    """An activation [B, S, D] moved to `memory_kind`, still split along B."""
    return jax.device_put(x, self.split_along(0, memory_kind))

  def constrain_batch(self, x):
    """Inside a jitted function: an activation [B, S, ...] held split along B over 'data'."""
    return jax.lax.with_sharding_constraint(x, self.split_along(0, 'device'))

  def shard_layer(self, layer_params, x):
    """Inside a layer's body (model.apply_group's `shard_layer`): the layer's weights whole on
    every device (GSPMD all-gathers their shards: FSDP) and its input x [B, S, D] split along B,
    so each device runs its B/N sequences through the whole layer. Without it GSPMD is free to
    split the layer's matmuls along the weights' sharded axis instead (tensor parallelism), which
    all-reduces [B, S, D] activations several times per layer and runs every device on the whole
    batch: 2.2x the 1-device step time on 4 CPU devices."""
    return (jax.lax.with_sharding_constraint(layer_params, self.replicated()),
            self.constrain_batch(x))

  def split_along(self, axis: int, memory_kind: str = 'device') -> NamedSharding:
    """Split along `axis` over 'data' (the batch axis of tokens and activations)."""
    return NamedSharding(self.mesh, PartitionSpec(*([None] * axis), MESH_AXIS),
                         memory_kind=memory_kind)

  def replicated(self, memory_kind: str = 'device') -> NamedSharding:
    """Whole on every device (metrics, scalars)."""
    return NamedSharding(self.mesh, PartitionSpec(), memory_kind=memory_kind)


def place(x, sharding: NamedSharding):
  """`x` (a host array, a partition.LazySlice, or a jax.Array) in `sharding`: `jax.device_put`,
  except that with several processes a value each process holds whole (a host piece read from a
  checkpoint or a Hugging Face file, a piece a jitted init made on a local device) or can read
  (a LazySlice) goes in as this process's shards only (jax.make_array_from_callback). jax's
  device_put of such a value to shardings that span processes first checks it is the same
  everywhere by all-gathering it: the whole piece from every process into each one (P copies of
  it in RAM, P - 1 of them over the network)."""
  if isinstance(x, LazySlice) and jax.process_count() == 1:
    x = x.whole()
  if jax.process_count() == 1 or spread(x):
    return jax.device_put(x, sharding)
  read = _box_reader(x)
  return jax.make_array_from_callback(x.shape, sharding,
                                      lambda index: read(_box(index, x.shape)))


def _box_reader(x):
  """box ((start, stop) per axis) -> that box of `x` as a host array; a LazySlice's box read once
  however many of this process's devices hold it (a replicated leaf: all of them)."""
  if not isinstance(x, LazySlice):
    host = np.asarray(x)
    return lambda box: host[slices(box)]
  return functools.lru_cache(maxsize=None)(x.read_box)


def _box(index: tuple, shape: tuple) -> tuple:
  """A shard's index (a tuple of slices) as ((start, stop), ...) over every axis of `shape`."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def slices(box: tuple) -> tuple:
  """((start, stop), ...) -> a numpy / TensorStore index."""
  return tuple(slice(a, b) for a, b in box)


def spread(x) -> bool:
  """Whether `x` is a jax.Array with shards in other processes (which this one cannot read)."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def replicated_value(x) -> np.ndarray:
  """A leaf that is whole on every device (a step count) as a host array, a copy: with several
  processes from this process's own shard (jax reads no array that spans other processes)."""
  if spread(x):
    return np.array(x.addressable_shards[0].data, copy=True)
  return np.array(x, copy=True)


def host_part(leaf, box: tuple) -> np.ndarray:
  """`box` ((start, stop) per axis) of a leaf as a host array. Of a jax.Array spread over several
  processes only an addressable shard can be read: `box` must be one (`Layout.owned_boxes`). Of a
  partition.LazySlice only `box` is read."""
  if isinstance(leaf, LazySlice):
    return leaf.read_box(tuple(tuple(b) for b in box))
  if spread(leaf):
    for shard in leaf.addressable_shards:
      if _box(shard.index, leaf.shape) == tuple(box):
        return np.asarray(shard.data)
    raise ValueError(f'no shard of this process holds {box} of a leaf of shape {leaf.shape}')
  host = np.asarray(leaf)
  return host if all(tuple(b) == (0, n) for b, n in zip(box, host.shape)) else host[slices(box)]


def _map_with_path(fn, tree):
  """jax.tree.map of fn(path, leaf), `path` the leaf's keystr (what partition.split_axis reads)."""
  return jax.tree_util.tree_map_with_path(lambda p, x: fn(jax.tree_util.keystr(p), x), tree)


def memory_kind(tree) -> str | None:
  """The memory kind shared by every leaf of `tree`; None for host numpy arrays or a mix."""
  kinds = {x.sharding.memory_kind if isinstance(x, jax.Array) else None
           for x in jax.tree.leaves(tree)}
  return kinds.pop() if len(kinds) == 1 else None
