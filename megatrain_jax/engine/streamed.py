"""The streamed engine: trains a model whose weights and Adam state are kept off the device.

Layer groups' params and Adam state live in stores (tiers/: device, pinned host RAM or NVMe); the
embedding, final norm and LM head are pieces of their own in the embed_head tier. The device holds
at most prefetch_depth + 1 groups' weights at a time, the group-boundary activations (unless
offload.activations=host) and the outer pieces while they run.

`train_step` runs the stages of schedule.py, in order, each a method below:

  embed -> forward (group by group) -> head (final norm, LM head, loss) -> backward (groups in
  reverse; each group's update per the step's update policy, engine/updates.py) -> embed_backward
  -> updates that waited for the global norm, and the outer pieces' updates.

Each group's weights cross to the device exactly twice per optimizer step, whatever M is
(MegaTrain: 3 times per microbatch); with exact clipping and the device optimizer, three times.
The forward stage is shared with evaluation. Arithmetic mirrors engine/resident.py (see
engine/functions.py), so both engines train to the same numbers within float32 rounding.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax import faults
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax import partition
from megatrain_jax.engine.functions import StageFunctions
from megatrain_jax.engine.updates import GroupUpdater, update_policy
from megatrain_jax.layout import Layout
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement
from megatrain_jax.prefetch import Prefetcher
from megatrain_jax.schedule import StepSchedule, outer_pieces
from megatrain_jax.tiers import TransferStats, make_store
from megatrain_jax.tiers.nvme import NvmeStore

_GB = 1e9


@dataclasses.dataclass
class _Step:
  """What the stages of one step share. M microbatches of [B, S] tokens."""
  schedule: StepSchedule
  tokens: jax.Array  # [M, B, S] int32
  targets: jax.Array  # [M, B, S] int32
  positions: jax.Array  # [B, S] int32
  outer: dict  # {piece: device params}
  outer_grads: dict = None  # {piece: summed gradient}
  squares: list = dataclasses.field(default_factory=list)  # per piece: sum of squares of the mean grad
  fetch_wait_s: float = 0.0
  started: float = dataclasses.field(default_factory=time.perf_counter)
  backward_done: float = 0.0

  @property
  def num_micro(self) -> int:
    return self.tokens.shape[0]


def _small_leaves_of(reader):
  """A checkpoint `read` for stores whose layers were linked: placeholders for layer leaves."""
  def read(path, start=None, stop=None):
    return np.zeros(0, np.float32) if start is not None else reader.read(path)
  return read


class StreamedEngine:
  """Trains from params and Adam state held in stores; see the module docstring for the stages."""

  def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_clip: float, placement: Placement,
               state: dict | None = None, seed: int = 0, restore_from=None,
               layout: Layout | None = None):
    """Loads `state` (a full train state) or `restore_from` (a checkpoint.CheckpointReader) into
    the stores, or initialises from `seed`."""
    self.cfg, self.tx, self.lr_schedule = model_cfg, tx, schedule
    self.grad_clip = grad_clip
    self.placement = placement
    self.layout = layout or Layout.single_device()
    self.slices = placement.group_slices(model_cfg.num_layers)
    self.pieces = outer_pieces(model_cfg.tie_embeddings)
    self.stats = TransferStats()
    self.params = self._make_store(placement.params, 'params')
    self.opt_state = self._make_store(placement.opt_state, 'opt_state')
    self.outer_params = self._make_store(placement.embed_head, 'embed_head_params')
    self.outer_opt = self._make_store(placement.embed_head, 'embed_head_opt')
    # With exact clipping, finished group gradients wait here (in the weights' tier, so memory
    # stays bounded on every tier) until the global norm is known.
    self.parked_grads = self._make_store(placement.params, 'grads')
    self.fn = StageFunctions(model_cfg, tx, self.layout)
    self.updater = GroupUpdater((self.params, self.opt_state, self.parked_grads), self.fn,
                                self.layout, self.stats)
    self._disk_seen = {}
    if restore_from is not None:
      self.load_checkpoint(restore_from)
    elif state is None:
      self.init_state(seed)
    else:
      self.load_state(state)

  def _make_store(self, tier: str, name: str):
    if tier != 'nvme':
      return make_store(tier, name, self.stats, self.layout)
    if not self.placement.dir:
      raise ValueError('the NVMe tier needs placement.dir (the trainer sets <workdir>/offload)')
    return NvmeStore(name, self.stats, self.layout, directory=self.placement.dir,
                     slices=self.slices, codec=self.placement.codec,
                     level=self.placement.codec_level, shard_mb=self.placement.shard_mb,
                     max_pending_writes=self.placement.max_pending_writes(self.cfg),
                     read_threads=max(2, self.placement.prefetch_depth))

  def close(self) -> None:
    """Waits for pending writes and stops the stores' I/O threads."""
    for store in (self.params, self.opt_state, self.outer_params, self.outer_opt,
                  self.parked_grads):
      store.close()

  # --------------------------------------------------------------------------------------------
  # State in and out (checkpoints hold the full, resident-shaped state: portable across engines).
  # --------------------------------------------------------------------------------------------

  def _put_outer(self, outer: dict) -> None:
    """{piece: {'params', 'opt_state'}} into the embed_head stores."""
    for name, piece in outer.items():
      self.outer_params.put(name, piece['params'])
      self.outer_opt.put(name, piece['opt_state'])

  def load_state(self, state: dict) -> None:
    outer, groups = partition.split_state(state, self.tx, self.slices)
    self._put_outer(outer)
    for g, piece in enumerate(groups):
      self.params.put(g, piece['params'])
      self.opt_state.put(g, piece['opt_state'])
    self.step = int(np.asarray(state['step']))
    self.rng = np.asarray(state['rng'])

  def init_state(self, seed: int) -> None:
    """Fresh state, built piece by piece straight into the stores (never whole on the device).

    Uses the same keys as resident.init_state, so both engines start from the same weights.
    """
    init_key, rng = jax.random.split(jax.random.key(seed))
    layers_key = model_lib.param_keys(init_key)[1]
    init_opt = jax.jit(self.tx.init)
    outer = jax.jit(model_lib.init_outer, static_argnums=0)(self.cfg, init_key)
    self._put_outer({name: {'params': piece, 'opt_state': init_opt(piece)}
                     for name, piece in partition.outer_pieces(outer).items()})
    init_layers = jax.jit(model_lib.init_layers, static_argnums=(0, 3))
    for g, (start, stop) in enumerate(self.slices):
      group = {'layers': init_layers(self.cfg, layers_key, start, stop - start)}
      self.params.put(g, group)
      self.opt_state.put(g, init_opt(group))
    self.step = 0
    self.rng = np.asarray(jax.random.key_data(rng))

  def export_state(self) -> dict:
    """The full train state as host numpy arrays (what the resident engine would hold).

    Gathers every group in host RAM (tests, export); checkpoints use `checkpoint_parts`, which
    leaves the NVMe tier on disk.
    """
    outer = {name: {'params': self.outer_params.get(name), 'opt_state': self.outer_opt.get(name)}
             for name in self.pieces}
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
    for name in self.pieces:  # the step counts sit at the same path in every piece: all equal
      memory.update(copy(self.outer_params.get(name), "['params']"))
      memory.update(copy(self.outer_opt.get(name), "['opt_state']"))
    disk = {}
    for part, store in (('params', self.params), ('opt_state', self.opt_state)):
      if isinstance(store, NvmeStore):
        disk.update({f"['{part}']" + p: d for p, d in store.array_dirs().items()})
        continue
      groups = [partition.by_path(store.get(g), f"['{part}']") for g in range(len(self.slices))]
      memory.update({p: np.concatenate([np.asarray(g[p]) for g in groups])
                     for p in groups[0] if partition.LAYERS in p})
    return memory, disk

  def load_checkpoint(self, reader) -> None:
    """Fills the stores from a verified checkpoint, group by group (never the whole state in RAM).
    An NVMe store whose snapshot has its on-disk layout links the snapshot's files instead."""
    abstract = model_lib.abstract_params(self.cfg)
    self._put_outer(partition.read_outer(reader.read, self.tx, abstract))
    for part, store in (('params', self.params), ('opt_state', self.opt_state)):
      linked = False
      if isinstance(store, NvmeStore):
        template = partition.group_template(self.tx, abstract, *self.slices[0])[part]
        sources = {p: (x.shape[1:], reader.snapshot_dir(f"['{part}']" + p))
                   for p, x in partition.by_path(template).items() if partition.LAYERS in p}
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
  # The step: the stages of schedule.py, in order.
  # --------------------------------------------------------------------------------------------

  def train_step(self, batch: np.ndarray) -> dict:
    """One optimizer step on batch [M, B, S+1] int32. Returns the step's metrics."""
    step = self._begin(batch)
    hidden = self._embed(step.outer, step.tokens)
    hidden, saved, step.fetch_wait_s = self._forward(hidden, step.positions, keep_inputs=True)
    loss, dys = self._head(step, hidden)
    updates = update_policy(self.updater, step.schedule)
    dys = self._backward(step, saved, dys, updates)
    self._embed_backward(step, dys)
    grad_norm = jnp.sqrt(sum(step.squares))
    scale = optim.clip_scale(grad_norm, self.grad_clip)
    updates.finish(scale)  # deferred updates run now; overlapped ones have run already
    self._update_outer(step, scale)
    step.fetch_wait_s += updates.wait_s
    # Wait for the last update's results (not for write-behind to disk, which overlaps the next
    # step's forward).
    jax.block_until_ready((loss, self.updater.last, self.outer_params.get('embed')))
    return self._metrics(step, loss, grad_norm)

  def _begin(self, batch: np.ndarray) -> _Step:
    """Starts a step: the batch's tokens on the device and the outer pieces fetched."""
    self.stats.reset()
    batch = jnp.asarray(batch)
    tokens, targets = batch[:, :, :-1], batch[:, :, 1:]
    schedule = StepSchedule(self.placement, self.cfg.num_layers, batch.shape[0], self.grad_clip > 0)
    return _Step(schedule, tokens, targets, model_lib.default_positions(tokens[0]),
                 outer={name: self.outer_params.fetch(name) for name in self.pieces})

  def _embed(self, outer: dict, tokens) -> list:
    """Stage 'embed': [B, S] tokens -> [B, S, D] hidden, per microbatch."""
    return [self.fn.embed(outer['embed'], t) for t in tokens]

  def _forward(self, hidden: list, positions, keep_inputs: bool):
    """Stage 'forward': every group in order, each fetched once (the next ones already in
    flight). Returns (output hidden, each group's inputs if `keep_inputs`, seconds stalled)."""
    saved = []
    groups = Prefetcher(self.params.fetch, range(len(self.slices)), self.placement.prefetch_depth)
    for _, group_params in groups:
      if keep_inputs:
        saved.append([self._stash(h) for h in hidden])
      hidden = [self.fn.group_forward(group_params, h, positions) for h in hidden]
      faults.point('forward')
      jax.block_until_ready(hidden)
    return hidden, saved, groups.wait_s

  def _head(self, step: _Step, hidden: list):
    """Stage 'head': final norm, LM head and loss of every microbatch, and their backward.
    Returns (mean loss, [d hidden]); the outer gradients start here."""
    head_piece = 'embed' if self.cfg.tie_embeddings else 'head'
    grads = {name: self.fn.zeros(params) for name, params in step.outer.items()}
    loss_sum, dys = jnp.zeros((), jnp.float32), []
    for m, x in enumerate(hidden):
      normed = self.fn.final_norm(step.outer['final_norm'], x)
      loss, d_head, d_normed = self.fn.head_forward_backward(step.outer[head_piece], normed,
                                                              step.targets[m])
      d_norm, dy = self.fn.final_norm_backward(step.outer['final_norm'], x, d_normed)
      grads[head_piece] = self.fn.add(grads[head_piece], d_head)
      grads['final_norm'] = self.fn.add(grads['final_norm'], d_norm)
      loss_sum, dys = loss_sum + loss, dys + [dy]
    step.outer_grads = grads
    return loss_sum / step.num_micro if step.num_micro > 1 else loss_sum, dys

  def _backward(self, step: _Step, saved: list, dys: list, updates) -> list:
    """Stage 'backward': groups in reverse, each fetched again; each group's summed gradient goes
    to the update policy as soon as its backward is done. Returns [d embed output]."""
    groups = Prefetcher(self.params.fetch, reversed(range(len(self.slices))),
                        self.placement.prefetch_depth)
    for g, group_params in groups:
      grad_sum = self.fn.zeros(group_params)
      for m in range(step.num_micro):
        grad_sum, dys[m] = self.fn.group_backward(group_params, self._unstash(saved[g][m]),
                                                  dys[m], step.positions, grad_sum)
      saved[g] = None
      faults.point('backward')
      step.squares.append(self.fn.sum_of_squares(grad_sum, step.num_micro))
      updates.after_backward(g, grad_sum, group_params)
      jax.block_until_ready(dys)
    step.fetch_wait_s += groups.wait_s
    step.backward_done = time.perf_counter()
    return dys

  def _embed_backward(self, step: _Step, dys: list) -> None:
    """Stage 'embed_backward': the embedding's gradient, added to the head's when tied."""
    for m in range(step.num_micro):
      step.outer_grads['embed'] = self.fn.embed_backward(step.outer['embed'], step.tokens[m],
                                                         dys[m], step.outer_grads['embed'])
    step.squares += [self.fn.sum_of_squares(step.outer_grads[name], step.num_micro)
                     for name in self.pieces]

  def _update_outer(self, step: _Step, scale) -> None:
    """Stage 'outer_update': AdamW of each outer piece (on the device)."""
    for name in self.pieces:
      params, opt = self.fn.device_update(step.outer_grads[name], self.outer_opt.fetch(name),
                                          step.outer[name], scale, step.num_micro)
      self.outer_params.put(name, params)
      self.outer_opt.put(name, opt)
    faults.point('optimizer')

  # --------------------------------------------------------------------------------------------
  # Activations between forward and backward, and the step's metrics.
  # --------------------------------------------------------------------------------------------

  def _stash(self, x):
    if self.placement.activations != 'host':
      return x
    self.stats.add(d2h_bytes=x.nbytes)
    return self.layout.put(x, 'pinned_host')

  def _unstash(self, x):
    if self.placement.activations != 'host':
      return x
    self.stats.add(h2d_bytes=x.nbytes)
    return self.layout.put(x, 'device')

  def _metrics(self, step: _Step, loss, grad_norm) -> dict:
    finished = time.perf_counter()
    lr = self.lr_schedule(self.step)
    self.step += 1
    metrics = {'learning/loss': loss, 'learning/grad_norm': grad_norm, 'learning/lr': lr,
               'io/h2d_gb': self.stats.h2d_bytes / _GB, 'io/d2h_gb': self.stats.d2h_bytes / _GB,
               'perf/fetch_wait_s': step.fetch_wait_s,
               'perf/compute_s': step.backward_done - step.started - step.fetch_wait_s,
               'perf/optimizer_s': finished - step.backward_done}
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
          'io/compression_ratio': disk['write_bytes'] / max(disk['stored_bytes'], 1)})
    return metrics

  def eval_losses(self, batches: list[np.ndarray]) -> list[float]:
    """Mean loss of each [B, S+1] batch; layer-major, so each group is fetched once for all."""
    tokens = [jnp.asarray(b[:, :-1]) for b in batches]
    outer = {name: self.outer_params.fetch(name) for name in self.pieces}
    hidden, _, _ = self._forward(self._embed(outer, tokens), model_lib.default_positions(tokens[0]),
                                 keep_inputs=False)
    head = outer['embed' if self.cfg.tie_embeddings else 'head']
    return [float(self.fn.head_loss(head, self.fn.final_norm(outer['final_norm'], h),
                                    jnp.asarray(b[:, 1:])))
            for h, b in zip(hidden, batches)]
