"""When and where a layer group's AdamW update runs: the update policy of the streamed step.

The schedule (schedule.py) decides which policy a step uses:
  OverlappedUpdates  clipping off: group g's update is dispatched right after its backward and
                     runs while group g-1's backward computes; its inputs (Adam state; for the host
                     optimizer the weights too) are read one group ahead through a Prefetcher.
  DeferredUpdates    exact global-norm clipping: the clip scale needs the whole gradient's norm,
                     so each group's summed gradient is parked in its weights' tier and the updates
                     run after the backward, in group order, their inputs again read one group
                     ahead through a Prefetcher. With the device optimizer the weights are fetched a
                     third time (the backward's copy is gone by then).
Both apply the same `PieceUpdater`, so the arithmetic is one function for both. The outer pieces
(embedding and head vocabulary chunks, final norm) are updated by their own PieceUpdaters after the
embedding's backward, always deferred (their gradients are complete only then).

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
from megatrain_jax.tiers.base import TransferStats, keep_leaves, tree_nbytes


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
            device_params=None, band: Band | None = None) -> None:
    """AdamW on piece `key` (or on one `band` of it). Right after a group's backward, `grad_sum`
    and `device_params` (the backward's device copy of the weights) are passed in; deferred
    updates read them from `inputs`."""
    opt, params, parked = inputs
    grad_sum = parked if grad_sum is None else grad_sum
    if self.host_optimizer:
      host = lambda tree: tree if memory_kind(tree) == 'pinned_host' else self.layout.put(tree, 'pinned_host')
      params, opt = self.fn.host_update(host(self._to_host(grad_sum)), host(opt), host(params),
                                        self.layout.put(scale, 'pinned_host'), num_micro)
    else:
      params = device_params if device_params is not None else params
      params, opt = self.fn.device_update(self._to_device(grad_sum), opt, params, scale, num_micro)
    if band is not None:
      opt = keep_leaves(opt, band.opt_writes)
    self.params.put(key, params, partial=band is not None)
    faults.point('optimizer')  # the piece's new weights are queued, its Adam state not yet
    self.opt_state.put(key, opt, partial=band is not None)
    self.last = jax.tree.leaves(params)[:1]

  def _to_host(self, tree):
    """A device gradient to pinned host memory for the host optimizer, counting the bytes."""
    if memory_kind(tree) == 'pinned_host':
      return tree
    self.stats.add(d2h_bytes=sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)))
    return self.layout.put(tree, 'pinned_host')

  def _to_device(self, tree):
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

  @property
  def wait_s(self) -> float:
    return self._prefetcher.wait_s

  def after_backward(self, g: int, grad_sum, device_params) -> None:
    key, inputs = next(self._inputs)
    assert key == g, (key, g)
    self.updater.apply(g, inputs, scale=jnp.ones((), jnp.float32),
                       num_micro=self.schedule.microbatches, grad_sum=grad_sum,
                       device_params=device_params)

  def finish(self, scale) -> None:
    """Nothing waits for the norm: every group was updated during the backward."""
    del scale


class DeferredUpdates:
  """Gradients wait for the global norm, then every group updates (see module docstring)."""

  def __init__(self, updater: PieceUpdater, schedule: StepSchedule, depth: int):
    self.updater, self.schedule, self.depth = updater, schedule, depth
    self.wait_s = 0.0

  def after_backward(self, g: int, grad_sum, device_params) -> None:
    del device_params  # freed: a device update fetches the weights again after the norm
    self.updater.parked_grads.put(g, grad_sum)

  def finish(self, scale) -> None:
    self.wait_s = update_parked(self.updater, range(self.schedule.num_groups), scale,
                                self.schedule.microbatches, self.depth,
                                refetch_weights=self.schedule.update_fetches_weights)


def update_parked(updater: PieceUpdater, keys, scale, num_micro: int, depth: int,
                  refetch_weights: bool) -> float:
  """Updates every piece in `keys` from its parked gradient, band by band where the updater has
  bands, the inputs of the next `depth` pieces (bands) read ahead through a Prefetcher. Returns
  the seconds stalled waiting for them."""
  units = [(key, band) for key in keys for band in (updater.bands(key) or [None])]

  def request(unit):
    key, band = unit
    if band is None:
      return updater.request_inputs(key, parked=True, refetch_weights=refetch_weights)
    return updater.request_band(key, band)

  prefetcher = Prefetcher(request, units, depth)
  for (key, band), inputs in prefetcher:
    updater.apply(key, inputs, scale=scale, num_micro=num_micro, band=band)
    if band is None or band.last:  # the gradient is spent: its memory is not held to the next step
      updater.parked_grads.release(key)
  return prefetcher.wait_s


def update_policy(updater: PieceUpdater, schedule: StepSchedule):
  """The layer groups' policy this step's schedule asks for; inputs are read one group ahead."""
  return (DeferredUpdates if schedule.deferred_updates else OverlappedUpdates)(updater, schedule, 1)
