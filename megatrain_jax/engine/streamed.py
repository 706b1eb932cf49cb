"""The streamed engine: the layer-group loop that trains a model from weights kept off-device.

Layer params and Adam state live in stores (tiers/: device or pinned host RAM); the device holds
the embedding and head (unless offload.embed_head=host), the group-boundary activations (unless
offload.activations=host) and at most prefetch_depth + 1 groups' weights at a time.

One optimizer step over M microbatches, layer-major (G groups of K layers; B batch, S seq, D d_model):

  1. embed      x[m] = embed(tokens[m])                              [B, S, D] for m < M
  2. forward    for g = 0..G-1 (weights of g+1.. already in flight):
                  saved[g][m] = x[m];  x[m] = group_g(x[m])           each group fetched once
  3. head       loss[m], d_outer, dy[m] = vjp(head_loss)(x[m])       outer grads accumulate
  4. backward   for g = G-1..0 (weights of g-1.. in flight):
                  grad_g += dW, dy[m] = vjp(group_g)(saved[g][m], dy[m])   recomputes inside
                then group g's AdamW update is dispatched at once (clipping off): it runs while
                group g-1's backward is being computed, and its new weights and Adam state go
                back to their tier.                                  each group fetched again
  5. embed bwd  d_outer += vjp(embed)(dy[m]); the outer update.

So each group's weights cross to the device exactly twice per optimizer step, whatever M is
(MegaTrain: 3 times per microbatch).

Exact global-norm clipping (train.grad_clip > 0) needs the norm of the *whole* gradient before
any update. Each group's accumulated gradient is then parked (in the params' tier) with its
squared norm; once the backward is done the global norm gives the clip scale and the updates run.
Cost: the gradient is held in the params' tier (host RAM for host params: +4 bytes/param) and
the updates no longer overlap the backward; with the optimizer on the device, each group's
weights are fetched a third time for its update (the host optimizer needs no fetch).

Arithmetic mirrors engine/resident.py (sum of microbatch gradients, / M, then * clip scale, then
the same optax update), so both engines train to the same numbers within float32 rounding.
"""

import functools
import inspect
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import compute_on as compute_on_lib

from megatrain_jax import faults
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.engine import partition
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement
from megatrain_jax.prefetch import Prefetcher
from megatrain_jax.tiers import TransferStats, make_store
from megatrain_jax.tiers.base import resolve, tree_nbytes
from megatrain_jax.tiers.nvme import NvmeStore
from megatrain_jax.tiers.memory import memory_kind, memory_sharding

_GB = 1e9


def _on_host():
  """Context that places the enclosed computation on the host CPU (jax.experimental.compute_on).

  jax 0.10 / 0.11.0 take the compute type positionally; later releases as `compute_type=`.
  """
  if 'compute_type' in inspect.signature(compute_on_lib.compute_on).parameters:
    return compute_on_lib.compute_on(compute_type='device_host')
  return compute_on_lib.compute_on('device_host')


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _sum_squares(grad_sum, num_micro: int):
  """Sum of squares of the mean gradient (grad_sum / M), as the resident engine's norm sees it."""
  return sum(jnp.sum(jnp.square(g / num_micro if num_micro > 1 else g))
             for g in jax.tree.leaves(grad_sum))


def _adamw_update(tx, grad_sum, opt_state, params, scale, num_micro: int):
  """(sum of M microbatch grads) -> mean -> clip scale -> optax update. Same order as resident."""
  grads = jax.tree.map(lambda g: g / num_micro, grad_sum) if num_micro > 1 else grad_sum
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _small_leaves_of(reader):
  """A checkpoint `read` for stores whose layers were linked: placeholders for layer leaves."""
  def read(path, start=None, stop=None):
    return np.zeros(0, np.float32) if start is not None else reader.read(path)
  return read


class StreamedEngine:
  """Trains from params and Adam state held in stores; see the module docstring for the schedule."""

  def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_clip: float, placement: Placement,
               state: dict | None = None, seed: int = 0, restore_from=None):
    """Loads `state` (a full train state) or `restore_from` (a checkpoint.CheckpointReader) into
    the stores, or initialises from `seed`."""
    self.cfg = model_cfg
    self.tx = tx
    self.schedule = schedule
    self.grad_clip = grad_clip
    self.placement = placement
    self.slices = placement.group_slices(model_cfg.num_layers)
    self.stats = TransferStats()
    self.params = self._make_store(placement.params, 'params')
    self.opt_state = self._make_store(placement.opt_state, 'opt_state')
    self.outer = self._make_store(placement.embed_head, 'embed_head')
    # With exact clipping, finished group gradients wait here (in the weights' tier, so memory
    # stays bounded on every tier) until the global norm is known.
    self.parked_grads = self._make_store(placement.params, 'grads')
    self._last_update = None
    self._disk_seen = {}
    self._act_host = placement.activations == 'host'
    self._host = memory_sharding('pinned_host')
    self._device = memory_sharding('device')
    self._build_functions()
    if restore_from is not None:
      self.load_checkpoint(restore_from)
    elif state is None:
      self.init_state(seed)
    else:
      self.load_state(state)

  def _make_store(self, tier: str, name: str):
    if tier != 'nvme':
      return make_store(tier, name, self.stats)
    if not self.placement.dir:
      raise ValueError('the NVMe tier needs placement.dir (the trainer sets <workdir>/offload)')
    return NvmeStore(name, self.stats, directory=self.placement.dir, slices=self.slices,
                     codec=self.placement.codec, level=self.placement.codec_level,
                     shard_mb=self.placement.shard_mb,
                     max_pending_writes=self.placement.max_pending_writes(self.cfg),
                     read_threads=max(2, self.placement.prefetch_depth))

  def close(self) -> None:
    """Waits for pending writes and stops the stores' I/O threads."""
    for store in (self.params, self.opt_state, self.outer, self.parked_grads):
      store.close()

  # --------------------------------------------------------------------------------------------
  # State in and out (checkpoints hold the full, resident-shaped state: portable across engines).
  # --------------------------------------------------------------------------------------------

  def load_state(self, state: dict) -> None:
    outer, groups = partition.split_state(state, self.tx, self.slices)
    self.outer.put('params', outer['params'])
    self.outer.put('opt_state', outer['opt_state'])
    for g, piece in enumerate(groups):
      self.params.put(g, piece['params'])
      self.opt_state.put(g, piece['opt_state'])
    self.step = int(np.asarray(state['step']))
    self.rng = np.asarray(state['rng'])

  def init_state(self, seed: int) -> None:
    """Fresh state, built group by group straight into the stores (never whole on the device).

    Uses the same keys as resident.init_state, so both engines start from the same weights.
    """
    init_key, rng = jax.random.split(jax.random.key(seed))
    layers_key = model_lib.param_keys(init_key)[1]
    outer = jax.jit(model_lib.init_outer, static_argnums=0)(self.cfg, init_key)
    self.outer.put('params', outer)
    self.outer.put('opt_state', jax.jit(self.tx.init)(outer))
    init_layers = jax.jit(model_lib.init_layers, static_argnums=(0, 3))
    for g, (start, stop) in enumerate(self.slices):
      group = {'layers': init_layers(self.cfg, layers_key, start, stop - start)}
      self.params.put(g, group)
      self.opt_state.put(g, jax.jit(self.tx.init)(group))
    self.step = 0
    self.rng = np.asarray(jax.random.key_data(rng))

  def export_state(self) -> dict:
    """The full train state as host numpy arrays (what the resident engine would hold).

    Gathers every group in host RAM (tests, export); checkpoints use `checkpoint_parts`, which
    leaves the NVMe tier on disk.
    """
    outer = {'params': self.outer.get('params'), 'opt_state': self.outer.get('opt_state')}
    groups = [{'params': self.params.get(g), 'opt_state': self.opt_state.get(g)}
              for g in range(len(self.slices))]
    return partition.merge_state(outer, groups, self.tx, np.int32(self.step), self.rng)

  def checkpoint_parts(self) -> tuple[dict, dict]:
    """What a checkpoint needs, addressed by full-state tree path (checkpoint.py):
    ({path: host numpy copy} of leaves in memory, {path: live zarr3 array dir} of leaves on NVMe).
    NVMe leaves are not read: the checkpointer links their files once the writes have landed."""
    copy = lambda tree, prefix: {p: np.array(x, copy=True)
                                 for p, x in partition.by_path(tree, prefix).items()}
    memory = {"['step']": np.asarray(self.step, np.int32), "['rng']": np.array(self.rng)}
    for part in ('params', 'opt_state'):
      memory.update(copy(self.outer.get(part), f"['{part}']"))
    disk = {}
    for part, store in (('params', self.params), ('opt_state', self.opt_state)):
      if isinstance(store, NvmeStore):
        disk.update({f"['{part}']" + p: d for p, d in store.array_dirs().items()})
        continue
      groups = [partition.by_path(store.get(g), f"['{part}']") for g in range(len(self.slices))]
      memory.update({p: np.concatenate([np.asarray(g[p]) for g in groups])
                     for p in groups[0] if "['layers']" in p})
    return memory, disk

  def load_checkpoint(self, reader) -> None:
    """Fills the stores from a verified checkpoint, group by group (never the whole state in RAM).
    An NVMe store whose snapshot has its on-disk layout links the snapshot's files instead."""
    abstract = model_lib.abstract_params(self.cfg)
    outer = partition.read_outer(reader.read, self.tx, abstract)
    self.outer.put('params', outer['params'])
    self.outer.put('opt_state', outer['opt_state'])
    for part, store in (('params', self.params), ('opt_state', self.opt_state)):
      linked = False
      if isinstance(store, NvmeStore):
        template = partition.group_template(self.tx, abstract, *self.slices[0])[part]
        sources = {p: (x.shape[1:], reader.snapshot_dir(f"['{part}']" + p))
                   for p, x in partition.by_path(template).items() if "['layers']" in p}
        linked = (all(d is not None for _, d in sources.values())
                  and store.link_arrays(sources))
      for g, (start, stop) in enumerate(self.slices):
        if linked:  # the layers are on disk already: read only the structure and step counts
          store.adopt(g, partition.read_group(_small_leaves_of(reader), self.tx, abstract, start,
                                              stop, part))
        else:
          store.put(g, partition.read_group(reader.read, self.tx, abstract, start, stop, part))
    self.step = int(reader.read("['step']"))
    self.rng = np.asarray(reader.read("['rng']"))

  # --------------------------------------------------------------------------------------------
  # The jitted pieces: pure functions of arrays, compiled once per shape.
  # --------------------------------------------------------------------------------------------

  def _build_functions(self) -> None:
    cfg, tx = self.cfg, self.tx

    def group_fn(group_params, x, positions):
      return model_lib.apply_group(cfg, group_params['layers'], x, positions)

    def head_forward_backward(outer_params, x, targets):
      loss, vjp = jax.vjp(lambda o, h: model_lib.head_loss(cfg, o, h, targets), outer_params, x)
      d_outer, dx = vjp(jnp.ones_like(loss))
      return loss, d_outer, dx

    def group_backward(group_params, x, dy, positions, grad_sum):
      # The vjp recomputes the group's forward from its saved input x. For a one-layer group that
      # recompute *is* the layer checkpoint, so per-layer remat would run the layer's forward a
      # third time for nothing: keep its residuals instead (forward runs 2x per step, as in the
      # resident engine). Larger groups apply model.remat per layer to bound their memory.
      layers = jax.tree.leaves(group_params)[0].shape[0]
      layer_cfg = cfg.replace(remat='none') if layers == 1 else cfg
      _, vjp = jax.vjp(
          lambda p, h: model_lib.apply_group(layer_cfg, p['layers'], h, positions), group_params, x)
      d_params, dx = vjp(dy)
      return _tree_add(grad_sum, d_params), dx

    def embed_backward(outer_params, tokens, dx, grad_sum):
      _, vjp = jax.vjp(lambda o: model_lib.embed(cfg, o, tokens), outer_params)
      return _tree_add(grad_sum, vjp(dx)[0])

    def host_update(grad_sum, opt_state, params, scale, num_micro):
      with _on_host():
        return _adamw_update(tx, grad_sum, opt_state, params, scale, num_micro)

    self._embed = jax.jit(functools.partial(model_lib.embed, cfg))
    self._group_forward = jax.jit(group_fn)
    self._head_forward_backward = jax.jit(head_forward_backward)
    self._head_loss = jax.jit(functools.partial(model_lib.head_loss, cfg))
    self._group_backward = jax.jit(group_backward, donate_argnums=(2, 4))
    self._embed_backward = jax.jit(embed_backward, donate_argnums=(3,))
    self._zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))
    self._sum_squares = jax.jit(_sum_squares, static_argnums=1)
    # Donates the Adam state and the weights (the new ones reuse their buffers); the gradient has
    # no output of its shape left to alias, so it is freed rather than donated.
    self._device_update = jax.jit(functools.partial(_adamw_update, tx), static_argnums=4,
                                  donate_argnums=(1, 2))
    self._host_update = jax.jit(host_update, static_argnums=4, out_shardings=self._host)

  # --------------------------------------------------------------------------------------------
  # Transfers of activations and gradients (weights move through the stores).
  # --------------------------------------------------------------------------------------------

  def _stash_activation(self, x):
    if not self._act_host:
      return x
    self.stats.d2h_bytes += x.nbytes
    return jax.device_put(x, self._host)

  def _unstash_activation(self, x):
    if not self._act_host:
      return x
    self.stats.h2d_bytes += x.nbytes
    return jax.device_put(x, self._device)

  def _host_tree(self, tree):
    """Host staging (numpy from the NVMe tier) as pinned-host jax arrays for host compute."""
    return tree if memory_kind(tree) == 'pinned_host' else jax.device_put(tree, self._host)

  def _to(self, tree, kind: str):
    """Moves a tree of device arrays to `kind` ('device' or 'pinned_host'), counting bytes."""
    if memory_kind(tree) == kind:
      return tree
    if kind == 'pinned_host':  # host numpy staging (from the NVMe tier) crosses no link
      self.stats.d2h_bytes += sum(x.nbytes for x in jax.tree.leaves(tree)
                                  if isinstance(x, jax.Array))
      return jax.device_put(tree, self._host)
    self.stats.h2d_bytes += tree_nbytes(tree)
    return jax.device_put(tree, self._device)

  # --------------------------------------------------------------------------------------------
  # Updates.
  # --------------------------------------------------------------------------------------------

  def _request_update_inputs(self, g: int, parked: bool):
    """Starts reading what group g's update needs, so disk reads overlap the compute: its Adam
    state, and if its gradient was parked (clipping), the gradient and the weights (the
    backward's device copy is gone by then). Returns (opt, params, grads) handles or None."""
    if self.placement.optimizer_on == 'host':
      return (self.opt_state.get_async(g), self.params.get_async(g),
              self.parked_grads.get_async(g) if parked else None)
    return (self.opt_state.fetch(g), self.params.fetch(g) if parked else None,
            self.parked_grads.fetch(g) if parked else None)

  def _update_group(self, g: int, inputs, grad_sum=None, device_params=None, *, scale,
                    num_micro: int) -> None:
    """AdamW on group g from `inputs` = _request_update_inputs(g, ...). Right after the group's
    backward, `grad_sum` and `device_params` (its device copy of the weights) are passed in."""
    opt, params, parked_grads = inputs
    grad_sum = resolve(parked_grads) if grad_sum is None else grad_sum
    if self.placement.optimizer_on == 'host':
      scale = jax.device_put(scale, self._host)
      params, opt = self._host_update(self._host_tree(self._to(grad_sum, 'pinned_host')),
                                      self._host_tree(resolve(opt)),
                                      self._host_tree(resolve(params)), scale, num_micro)
    else:
      params = device_params if device_params is not None else resolve(params)
      params, opt = self._device_update(self._to(grad_sum, 'device'), resolve(opt), params,
                                        scale, num_micro)
    self.params.put(g, params)
    faults.point('optimizer')  # the group's new weights are queued, its Adam state not yet
    self.opt_state.put(g, opt)
    self._last_update = (params, opt)

  def _update_outer(self, grad_sum, device_params, scale, num_micro: int) -> None:
    params, opt = self._device_update(grad_sum, self.outer.fetch('opt_state'), device_params,
                                      scale, num_micro)
    self.outer.put('params', params)
    self.outer.put('opt_state', opt)
    faults.point('optimizer')

  # --------------------------------------------------------------------------------------------
  # The step.
  # --------------------------------------------------------------------------------------------

  def train_step(self, batch: np.ndarray) -> dict:
    """One optimizer step on batch [M, B, S+1] int32. Returns the step's metrics."""
    self.stats.reset()
    started = time.perf_counter()
    num_micro = batch.shape[0]
    tokens = jnp.asarray(batch[:, :, :-1])
    targets = jnp.asarray(batch[:, :, 1:])
    positions = model_lib.default_positions(tokens[0])
    clipping = self.grad_clip > 0
    outer_params = self.outer.fetch('params')

    # 1-2. Embed and forward, group by group; keep each group's input for its backward.
    hidden = [self._embed(outer_params, tokens[m]) for m in range(num_micro)]
    saved = []
    forward = Prefetcher(self.params.fetch, range(len(self.slices)), self.placement.prefetch_depth)
    for _, group_params in forward:
      saved.append([self._stash_activation(h) for h in hidden])
      hidden = [self._group_forward(group_params, h, positions) for h in hidden]
      faults.point('forward')
      jax.block_until_ready(hidden)

    # 3. Head and loss for every microbatch.
    loss_sum = jnp.zeros((), jnp.float32)
    outer_grad = self._zeros(outer_params)
    dys = []
    for m in range(num_micro):
      loss, d_outer, dy = self._head_forward_backward(outer_params, hidden[m], targets[m])
      loss_sum, outer_grad = loss_sum + loss, _tree_add(outer_grad, d_outer)
      dys.append(dy)
    del hidden

    # 4. Backward, groups in reverse; each group's update follows its backward at once.
    squares, parked = [], []
    backward = Prefetcher(self.params.fetch, reversed(range(len(self.slices))),
                          self.placement.prefetch_depth)
    for g, group_params in backward:
      if not clipping:  # the update follows this backward: start reading its inputs now
        update_inputs = self._request_update_inputs(g, parked=False)
      grad_sum = self._zeros(group_params)
      for m in range(num_micro):
        grad_sum, dys[m] = self._group_backward(
            group_params, self._unstash_activation(saved[g][m]), dys[m], positions, grad_sum)
      saved[g] = None
      faults.point('backward')
      squares.append(self._sum_squares(grad_sum, num_micro))
      if clipping:  # park until the global norm is known
        self.parked_grads.put(g, grad_sum)
        parked.append(g)
      else:
        self._update_group(g, update_inputs, grad_sum, group_params,
                           scale=jnp.ones((), jnp.float32), num_micro=num_micro)
      jax.block_until_ready(dys)
    backward_done = time.perf_counter()

    # 5. Embedding backward, global norm, the remaining updates.
    for m in range(num_micro):
      outer_grad = self._embed_backward(outer_params, tokens[m], dys[m], outer_grad)
    squares.append(self._sum_squares(outer_grad, num_micro))
    grad_norm = jnp.sqrt(sum(squares))
    scale = optim.clip_scale(grad_norm, self.grad_clip)
    order = sorted(parked)
    next_inputs = self._request_update_inputs(order[0], parked=True) if order else None
    for i, g in enumerate(order):  # each group's reads are issued one update ahead
      inputs = next_inputs
      if i + 1 < len(order):
        next_inputs = self._request_update_inputs(order[i + 1], parked=True)
      self._update_group(g, inputs, scale=scale, num_micro=num_micro)
    self._update_outer(outer_grad, outer_params, scale, num_micro)
    loss = loss_sum / num_micro if num_micro > 1 else loss_sum
    # Wait for the last update's results (not for write-behind to disk, which overlaps the next
    # step's forward).
    jax.block_until_ready((loss, self._last_update, self.outer.get('params')))
    finished = time.perf_counter()

    lr = self.schedule(self.step)
    self.step += 1
    fetch_wait = forward.wait_s + backward.wait_s
    metrics = {'learning/loss': loss, 'learning/grad_norm': grad_norm, 'learning/lr': lr,
               'io/h2d_gb': self.stats.h2d_bytes / _GB, 'io/d2h_gb': self.stats.d2h_bytes / _GB,
               'perf/fetch_wait_s': fetch_wait,
               'perf/compute_s': backward_done - started - fetch_wait,
               'perf/optimizer_s': finished - backward_done}
    if 'nvme' in (self.placement.params, self.placement.opt_state):
      # Disk I/O completed since the previous step's end (write-behind lands a step late).
      now = self.stats.disk_snapshot()
      disk = {k: now[k] - self._disk_seen.get(k, 0) for k in now}
      self._disk_seen = now
      metrics.update({
          'io/read_gb': disk['read_bytes'] / _GB,
          'io/read_gbps': disk['read_bytes'] / _GB / max(disk['read_busy_s'], 1e-9),
          'io/write_gb': disk['write_bytes'] / _GB,
          'io/write_gbps': disk['write_bytes'] / _GB / max(disk['write_busy_s'], 1e-9),
          'io/compression_ratio': disk['write_bytes'] / max(disk['stored_bytes'], 1),
          'perf/prefetch_stall_s': fetch_wait})
    return metrics

  def eval_losses(self, batches: list[np.ndarray]) -> list[float]:
    """Mean loss of each [B, S+1] batch; layer-major, so each group is fetched once for all."""
    tokens = [jnp.asarray(b[:, :-1]) for b in batches]
    positions = model_lib.default_positions(tokens[0])
    outer_params = self.outer.fetch('params')
    hidden = [self._embed(outer_params, t) for t in tokens]
    for _, group_params in Prefetcher(self.params.fetch, range(len(self.slices)),
                                      self.placement.prefetch_depth):
      hidden = [self._group_forward(group_params, h, positions) for h in hidden]
    return [float(self._head_loss(outer_params, h, jnp.asarray(b[:, 1:])))
            for h, b in zip(hidden, batches)]
