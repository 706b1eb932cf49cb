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
"""

import dataclasses

import jax
import jax.numpy as jnp

from megatrain_jax import faults
from megatrain_jax.engine.functions import StageFunctions
from megatrain_jax.layout import Layout, memory_kind
from megatrain_jax.prefetch import Prefetcher
from megatrain_jax.schedule import StepSchedule
from megatrain_jax.tiers.base import TransferStats, tree_nbytes


@dataclasses.dataclass(frozen=True)
class PieceStores:
  """The stores of one kind of piece (layer groups, embedding chunks, ...): weights, Adam state,
  and gradients parked until their update (all keyed alike)."""
  params: object
  opt_state: object
  grads: object

  def all(self) -> tuple:
    return (self.params, self.opt_state, self.grads)


class PieceUpdater:
  """AdamW of one piece, on the device or on the host, writing the results to their tiers."""

  def __init__(self, stores: PieceStores, functions: StageFunctions, layout: Layout,
               stats: TransferStats, host_optimizer: bool):
    self.params, self.opt_state, self.parked_grads = stores.all()
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

  def apply(self, key, inputs, *, scale, num_micro: int, grad_sum=None,
            device_params=None) -> None:
    """AdamW on piece `key`. Right after a group's backward, `grad_sum` and `device_params` (the
    backward's device copy of the weights) are passed in; deferred updates read them from `inputs`."""
    opt, params, parked = inputs
    grad_sum = parked if grad_sum is None else grad_sum
    if self.host_optimizer:
      host = lambda tree: tree if memory_kind(tree) == 'pinned_host' else self.layout.put(tree, 'pinned_host')
      params, opt = self.fn.host_update(host(self._to_host(grad_sum)), host(opt), host(params),
                                        self.layout.put(scale, 'pinned_host'), num_micro)
    else:
      params = device_params if device_params is not None else params
      params, opt = self.fn.device_update(self._to_device(grad_sum), opt, params, scale, num_micro)
    self.params.put(key, params)
    faults.point('optimizer')  # the piece's new weights are queued, its Adam state not yet
    self.opt_state.put(key, opt)
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
  """Updates every piece in `keys` from its parked gradient, the inputs of the next `depth` pieces
  read ahead through a Prefetcher. Returns the seconds stalled waiting for them."""
  prefetcher = Prefetcher(
      lambda key: updater.request_inputs(key, parked=True, refetch_weights=refetch_weights),
      keys, depth)
  for key, inputs in prefetcher:
    updater.apply(key, inputs, scale=scale, num_micro=num_micro)
  return prefetcher.wait_s


def update_policy(updater: PieceUpdater, schedule: StepSchedule):
  """The layer groups' policy this step's schedule asks for; inputs are read one group ahead."""
  return (DeferredUpdates if schedule.deferred_updates else OverlappedUpdates)(updater, schedule, 1)
