"""When and where a layer group's AdamW update runs: the update policy of the streamed step.

The schedule (schedule.py) decides which policy a step uses:
  OverlappedUpdates  clipping off: group g's update is dispatched right after its backward and
                     runs while group g-1's backward computes; its inputs (Adam state; for the host
                     optimizer the weights too) are read one group ahead through a Prefetcher.
  DeferredUpdates    exact global-norm clipping: the clip scale needs the whole gradient's norm,
                     so each group's summed gradient is parked (in its weights' tier, or in device
                     memory with offload.park_grads = device) until the backward is done. The
                     updates then wait as `PendingUpdates` for the next forward: group g's update
                     runs just ahead of group g's forward in the next step (or in an evaluation),
                     dispatched while group g-1 computes, so its transfers and disk I/O overlap
                     compute instead of forming a phase of their own after the
                     backward, and it hands the forward the group's new weights: a device update's
                     inputs include the weights (the forward fetches nothing more), a host
                     update's output is the weights the forward copies to the device (not read back
                     from NVMe). `PendingUpdates.flush` runs the ones still waiting, in group order,
                     their inputs read one group ahead (before a checkpoint or an export reads the
                     stores).
Both apply the same `PieceUpdater`, so the arithmetic is one function for both, and the numbers do
not depend on when an update runs: the same inputs, the same AdamW. The outer pieces (embedding and
head vocabulary chunks, final norm) are updated by their own PieceUpdaters after the embedding's
backward, always at the end of the step (their gradients are complete only then).

Deferred host-optimizer updates run band by band: AdamW is elementwise, so a piece's update can
run over a few of its leaves at a time (`Band`s of at most Placement.update_band_bytes of
weights), and host memory holds the weights, gradient and Adam moments of one band and the next
one read ahead, not of two whole pieces (Llama-3.2-1B, one layer per group: 2 x 268 MB instead of
2 x 0.97 GB). The step counts (optax's `count`) are read with every band and written with the
piece's last band only, so every band of a piece updates at the same step.
"""

import dataclasses

import jax
import jax.numpy as jnp

from megatrain_jax import faults, partition
from megatrain_jax.engine.functions import StageFunctions
from megatrain_jax.layout import Layout, memory_kind
from megatrain_jax.prefetch import Prefetcher
from megatrain_jax.schedule import StepSchedule
from megatrain_jax.tiers.base import TransferStats, assemble, keep_leaves, tree_nbytes


@dataclasses.dataclass(frozen=True)
class PieceStores:
  """The stores of one kind of piece (layer groups, embedding chunks, ...): weights, Adam state,
  and gradients parked until their update (all keyed alike)."""
  params: object
  opt_state: object
  grads: object

  def all(self) -> tuple:
    return (self.params, self.opt_state, self.grads)


@dataclasses.dataclass(frozen=True)
class Band:
  """Some leaves of one piece, updated together (piece paths, as the stores name leaves)."""
  params: frozenset  # the band's weights (and their parked gradients)
  moments: frozenset  # their Adam moments (m and v)
  counts: frozenset  # the optimizer's step counts: read by every band, written by the last
  last: bool

  @property
  def opt_reads(self) -> frozenset:
    return self.moments | self.counts

  @property
  def opt_writes(self) -> frozenset:
    return self.opt_reads if self.last else self.moments


def piece_bands(template: dict, band_bytes: int) -> list[Band] | None:
  """The bands of a piece whose ShapeDtypeStructs are `template` (partition.piece_template):
  its weights in tree order, cut before a band would exceed `band_bytes` (a larger leaf is a band
  alone). None when the optimizer state is not elementwise moments of the weights plus scalar
  step counts (a custom optimizer): such a piece updates whole."""
  params = partition.by_path(template['params'])
  opt = partition.by_path(template['opt_state'])
  first = next(iter(params))
  prefixes = [o[:-len(first)] for o in opt if o.endswith(first)]  # e.g. '[0].mu', '[0].nu'
  moments_of = lambda paths: frozenset(pre + p for pre in prefixes for p in paths)
  counts = frozenset(opt) - moments_of(params)
  if not moments_of(params) <= frozenset(opt) or any(opt[c].size > 1 for c in counts):
    return None
  cuts, size = [[]], 0
  for path, leaf in params.items():
    nbytes = leaf.size * leaf.dtype.itemsize
    if cuts[-1] and size + nbytes > band_bytes:
      cuts.append([])
      size = 0
    cuts[-1].append(path)
    size += nbytes
  return [Band(frozenset(paths), moments_of(paths), counts, last=i == len(cuts) - 1)
          for i, paths in enumerate(cuts)]


class PieceUpdater:
  """AdamW of one piece, on the device or on the host, writing the results to their tiers."""

  def __init__(self, stores: PieceStores, functions: StageFunctions, layout: Layout,
               stats: TransferStats, host_optimizer: bool, bands=None):
    """`bands(key)`: piece key's update bands (piece_bands), or None to update it whole; used by
    deferred host-optimizer updates."""
    self.params, self.opt_state, self.parked_grads = stores.all()
    self.bands = bands if host_optimizer and bands is not None else (lambda key: None)
    self.fn = functions
    self.layout = layout
    self.stats = stats
    self.host_optimizer = host_optimizer  # the update runs where the weights and Adam state live
    # One output leaf of the newest update, to wait on at the end of a step: every output of one
    # jitted call is ready together, and holding the whole outputs would keep a piece's new
    # weights and Adam state in memory after their write-behind has landed.
    self.last = None
    self._host_scale = (None, None)  # (a device scale, its pinned-host copy): one put per step

  def request_inputs(self, key, parked: bool, refetch_weights: bool):
    """Starts reading what piece `key`'s update needs: (Adam state, weights or None, parked
    gradient or None), each an array tree or a Future of one. `refetch_weights`: a device update
    whose weights' device copy is gone fetches them again."""
    if self.host_optimizer:
      return (self.opt_state.get_async(key), self.params.get_async(key),
              self.parked_grads.get_async(key) if parked else None)
    return (self.opt_state.fetch(key), self.params.fetch(key) if refetch_weights else None,
            self.parked_grads.fetch(key) if parked else None)

  def request_band(self, key, band: Band):
    """Starts reading one band's update inputs (host optimizer, parked gradient)."""
    return (self.opt_state.get_async(key, band.opt_reads), self.params.get_async(key, band.params),
            self.parked_grads.get_async(key, band.params))

  def apply(self, key, inputs, *, scale, num_micro: int, grad_sum=None,
            device_params=None, band: Band | None = None):
    """AdamW on piece `key` (or on one `band` of it); returns the new weights (in pinned host
    memory from the host optimizer, on the device from the device one). Right after a group's
    backward, `grad_sum` and `device_params` (the backward's device copy of the weights) are
    passed in; deferred updates read them from `inputs`."""
    opt, params, parked = inputs
    grad_sum = parked if grad_sum is None else grad_sum
    if self.host_optimizer:
      host = lambda tree: (tree if memory_kind(tree) == 'pinned_host'
                           else self.layout.put(tree, 'pinned_host'))
      params, opt = self.fn.host_update(host(self._to_host(grad_sum)), host(opt), host(params),
                                        self._scale_on_host(scale), num_micro)
    else:
      params = device_params if device_params is not None else params
      params, opt = self.fn.device_update(self.to_device(grad_sum), opt, params, scale, num_micro)
    if band is not None:
      opt = keep_leaves(opt, band.opt_writes)
    self.params.put(key, params, partial=band is not None)
    faults.point('optimizer')  # the piece's new weights are queued, its Adam state not yet
    self.opt_state.put(key, opt, partial=band is not None)
    self.last = jax.tree.leaves(params)[:1]
    return params

  def _scale_on_host(self, scale):
    """The clip scale in pinned host memory, copied once for all the pieces updated with it."""
    if self._host_scale[0] is not scale:
      self._host_scale = (scale, self.layout.put(scale, 'pinned_host'))
    return self._host_scale[1]

  def forward_fetch(self, key, on_device: list):
    """Piece `key`'s weights for the forward from its bands' outputs (`to_device`):
    the fetch from the store they replace, counted as one."""
    self.stats.count_fetch(self.params.name, key)
    return assemble(on_device)

  def _to_host(self, tree):
    """A device gradient to pinned host memory for the host optimizer, counting the bytes."""
    if memory_kind(tree) == 'pinned_host':
      return tree
    self.stats.add(d2h_bytes=sum(x.nbytes for x in jax.tree.leaves(tree)
                                 if isinstance(x, jax.Array)))
    return self.layout.put(tree, 'pinned_host')

  def to_device(self, tree):
    """`tree` on the device (a gradient for the device optimizer, a host update's new weights
    for the forward), counting the bytes that cross."""
    if memory_kind(tree) == 'device':
      return tree
    self.stats.add(h2d_bytes=tree_nbytes(tree))
    return self.layout.put(tree, 'device')


class OverlappedUpdates:
  """Each group's update follows its backward at once (see module docstring)."""

  def __init__(self, updater: PieceUpdater, schedule: StepSchedule, depth: int):
    self.updater, self.schedule = updater, schedule
    order = reversed(range(schedule.num_groups))  # the backward's order
    self._prefetcher = Prefetcher(
        lambda g: updater.request_inputs(g, parked=False, refetch_weights=False), order, depth)
    self._inputs = iter(self._prefetcher)
    self._unclipped = jnp.ones((), jnp.float32)  # one scale for every group, not one each

  @property
  def wait_s(self) -> float:
    return self._prefetcher.wait_s

  def after_backward(self, g: int, grad_sum, device_params) -> None:
    key, inputs = next(self._inputs)
    assert key == g, (key, g)
    self.updater.apply(g, inputs, scale=self._unclipped,
                       num_micro=self.schedule.microbatches, grad_sum=grad_sum,
                       device_params=device_params)

  def finish(self, scale) -> None:
    """Nothing waits for the norm: every group was updated during the backward."""
    del scale


class DeferredUpdates:
  """Gradients wait for the global norm, then the updates wait for the next forward (see module
  docstring)."""

  wait_s = 0.0  # nothing is read in this step: its updates' stalls are PendingUpdates.wait_s

  def __init__(self, updater: PieceUpdater, schedule: StepSchedule, depth: int):
    self.updater, self.schedule, self.depth = updater, schedule, depth

  def after_backward(self, g: int, grad_sum, device_params) -> None:
    del device_params  # freed: the update runs in the next forward, which fetches the weights
    self.updater.parked_grads.put(g, grad_sum)

  def finish(self, scale) -> 'PendingUpdates':
    """The updates, with the global norm's clip `scale` (a device scalar), left to the next
    forward."""
    return PendingUpdates(self.updater, self.schedule.num_groups, scale,
                          self.schedule.microbatches, self.depth)


class PendingUpdates:
  """A clipped step's layer-group updates, waiting for the next forward (see module docstring).

  The forward draws `forward_weights()` group by group; a checkpoint or an export calls `flush`.
  A group is updated once, whichever runs it."""

  def __init__(self, updater: PieceUpdater, num_groups: int, scale, num_micro: int, depth: int):
    self.updater, self.scale, self.num_micro, self.depth = updater, scale, num_micro, depth
    self.waiting = list(range(num_groups))
    self._inputs = None  # the forward's Prefetcher of update inputs

  @property
  def wait_s(self) -> float:
    """Seconds the forward's updates stalled waiting for their inputs."""
    return self._inputs.wait_s if self._inputs is not None else 0.0

  def forward_weights(self):
    """Yields (g, group g's new weights on the device) in group order, running each update as
    it is drawn, its inputs (and the next ones') read ahead: the device optimizer's include the
    weights, the forward's fetch of them; the host optimizer's new weights go to the device band by
    band as each band's update is dispatched (host memory holds the bands in AdamW, no more)."""
    updater = self.updater
    host = updater.host_optimizer
    self._inputs = _update_inputs(updater, list(self.waiting), self.depth, refetch_weights=not host)
    bands = []
    for key, band, params in _apply_updates(updater, self._inputs, self.scale, self.num_micro):
      if host:
        bands.append(updater.to_device(params))
        if band is not None and not band.last:
          continue
        params, bands = updater.forward_fetch(key, bands), []
      self.waiting.remove(key)
      yield key, params

  def flush(self) -> None:
    """Runs the updates still waiting (without a forward): their inputs read one group ahead, the
    device optimizer's weights fetched for them."""
    waiting, self.waiting = self.waiting, []
    update_parked(self.updater, waiting, self.scale, self.num_micro, self.depth,
                  refetch_weights=not self.updater.host_optimizer)


def _update_inputs(updater: PieceUpdater, keys, depth: int, refetch_weights: bool) -> Prefetcher:
  """The update inputs of every piece in `keys` from its parked gradient, band by band where the
  updater has bands, the next `depth` pieces (bands) read ahead."""
  units = [(key, band) for key in keys for band in (updater.bands(key) or [None])]

  def request(unit):
    key, band = unit
    if band is None:
      return updater.request_inputs(key, parked=True, refetch_weights=refetch_weights)
    return updater.request_band(key, band)

  return Prefetcher(request, units, depth)


def _apply_updates(updater: PieceUpdater, inputs: Prefetcher, scale, num_micro: int):
  """Yields (key, band or None, new weights) as each unit of `inputs` is updated."""
  for (key, band), unit_inputs in inputs:
    params = updater.apply(key, unit_inputs, scale=scale, num_micro=num_micro, band=band)
    if band is None or band.last:  # the gradient is spent: its memory is not held to the next step
      updater.parked_grads.release(key)
    yield key, band, params


def update_parked(updater: PieceUpdater, keys, scale, num_micro: int, depth: int,
                  refetch_weights: bool) -> float:
  """Updates every piece in `keys` from its parked gradient, band by band where the updater has
  bands, the inputs of the next `depth` pieces (bands) read ahead through a Prefetcher. Returns
  the seconds stalled waiting for them."""
  inputs = _update_inputs(updater, keys, depth, refetch_weights)
  for _ in _apply_updates(updater, inputs, scale, num_micro):
    pass
  return inputs.wait_s


def update_policy(updater: PieceUpdater, schedule: StepSchedule):
  """The layer groups' policy this step's schedule asks for; inputs are read one group ahead."""
  return (DeferredUpdates if schedule.deferred_updates else OverlappedUpdates)(updater, schedule, 1)
