"""The streamed engine: trains a model whose weights and Adam state are kept off the device.

Layer groups' params and Adam state live in stores (tiers/: device, pinned host RAM or NVMe); the
embedding, final norm and LM head are pieces of their own in the embed_head tier. The device holds
at most prefetch_depth + 1 groups' weights at a time, the group-boundary activations (every
layer's input with offload.keep_layer_inputs; unless offload.activations=host) and the outer
pieces while they run.

`train_step` runs the stages of schedule.py, in order, each a method below:

  embed -> forward (group by group; with exact clipping, each group's update from the step
  before runs just ahead of it, engine/updates.PendingUpdates) -> head (final norm, LM head,
  loss) -> backward (groups in reverse; without clipping each group's update follows its
  backward, engine/updates.py) -> embed_backward -> the outer pieces' updates.

Each group's weights cross to the device exactly twice per optimizer step, whatever M is
(MegaTrain: 3 times per microbatch), with or without clipping, on either optimizer. Layer updates
that wait for the next forward are flushed before anything reads the stores whole (a checkpoint, an
export), and an evaluation's forward runs them like a training step's.
The forward stage is shared with evaluation. Arithmetic mirrors engine/resident.py (see
engine/functions.py), so both engines train to the same numbers within float32 rounding.

On N devices (`layout`) every piece in every in-memory tier is split over the devices by the
layout's per-leaf specs (each device's share of pinned host memory holds 1/N of a group), the
batch along B; a fetched group is gathered on the devices inside the jitted group functions and
its gradient reduce-scattered back to shards (engine/functions.py).
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
from megatrain_jax.checkpoint import LeafLayout, Parts, array_parts
from megatrain_jax.engine.functions import stage_functions, step_inputs
from megatrain_jax.engine.updates import (PieceStores, PieceUpdater, piece_bands, update_parked,
                                          update_policy)
from megatrain_jax.layout import Layout, replicated_value, spread
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement
from megatrain_jax.prefetch import Prefetcher
from megatrain_jax.schedule import StepSchedule, outer_host_optimizer, piece_kinds
from megatrain_jax.tiers import TransferStats, make_store
from megatrain_jax.tiers.base import WriteBudget, resolve
from megatrain_jax.tiers import nvme
from megatrain_jax.tiers.nvme import NvmeStore

_GB = 1e9


@dataclasses.dataclass
class _Step:
  """What the stages of one step share. M microbatches of [B, S] tokens, each split along B over
  the layout's devices (one array per microbatch: with several processes no process can slice
  a global [M, B, S] array outside jit)."""
  schedule: StepSchedule
  tokens: list  # M x [B, S] int32
  targets: list  # M x [B, S] int32
  # M x RopePositions: [B, S] int32 positions and their RoPE tables [B, S, Dh] (one shared
  # object unless a document mask makes each microbatch's its own).
  positions: list
  norm: dict  # the final norm's params, on the device
  # M x [B, S] float32 per-token loss weights of a masked batch (functions.step_inputs), or None:
  # every target learned, each microbatch's loss its mean.
  weights: list | None = None
  norm_grad: dict = None
  # Per piece: the sum of squares of its mean gradient (the global norm's terms).
  squares: list = dataclasses.field(default_factory=list)
  fetch_wait_s: float = 0.0
  started: float = dataclasses.field(default_factory=time.perf_counter)
  backward_done: float = 0.0

  @property
  def num_micro(self) -> int:
    return len(self.tokens)


def _small_leaves_of(reader):
  """A checkpoint `read` for stores whose leaves were linked: placeholders for split leaves."""
  def read(path, start=None, stop=None, axis=0):
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
    self.vocab = placement.vocab_slices(model_cfg)
    # Each chunk's first id as a device scalar, made once: a jnp.int32 per chunk call would be an
    # eager program of its own (chunks x microbatches x 4 stages of them per step).
    self._chunk_starts = [jnp.int32(start) for start, _ in self.vocab]
    self.kinds = piece_kinds(model_cfg.tie_embeddings)
    self.kind_slices = {'layers': self.slices, 'embed': self.vocab, 'head': self.vocab,
                        'final_norm': [(0, 0)]}
    self.stats = TransferStats()
    # One write-behind budget for every NVMe store (layers, vocabulary chunks, parked gradients).
    self.write_budget = WriteBudget(placement.write_budget_bytes(model_cfg))
    self.fn = stage_functions(model_cfg, tx, self.layout)
    self.stores, self._opened = {}, []  # _opened: every store made, in order (`close`)
    try:
      for kind in self.kinds:
        self.stores[kind] = self._make_stores(kind)
      self._fill(state, seed, restore_from)
    except BaseException:
      # The NVMe stores' writer threads would go on writing into an offload.dir whose lock the
      # failing run gives back: they finish what they queued and stop.
      self.close(quietly=True)
      raise

  def _fill(self, state, seed: int, restore_from) -> None:
    """Everything beside the stores: the updaters, then the state (`__init__`)."""
    placement = self.placement
    if placement.uses_nvme:  # stores of another placement or process count: the run's to free
      nvme.remove_other_stores(placement.dir, {store.name for stores in self.stores.values()
                                              for store in stores.all()
                                              if isinstance(store, NvmeStore)})
    # With exact clipping, finished group gradients wait in `grads` until the global norm is known:
    # in the weights' tier, so memory stays bounded on every tier, or with offload.park_grads =
    # device in device memory, which spares each one a round trip through the host.
    self.params, self.opt_state, self.parked_grads = self.stores['layers'].all()
    host_optimizer = {'layers': placement.optimizer_on == 'host',
                      'final_norm': False}  # D floats: on the device
    self.updaters = {
        kind: PieceUpdater(stores, self.fn, self.layout, self.stats,
                           host_optimizer=host_optimizer.get(kind, outer_host_optimizer(placement)),
                           bands=self._bands_of(kind))
        for kind, stores in self.stores.items()}
    self.updater = self.updaters['layers']
    # A clipped step's layer updates, waiting for the next forward (updates.PendingUpdates).
    self._pending = None
    self._disk_seen = {}
    if restore_from is not None:
      self.load_checkpoint(restore_from)
    elif state is None:
      self.init_state(seed)
    else:
      self.load_state(state)

  def _bands_of(self, kind: str):
    """key -> the update bands of piece `key` of `kind` (engine/updates.py), per piece length."""
    abstract = model_lib.abstract_params(self.cfg)
    band_bytes = self.placement.update_band_bytes()
    cache = {}

    def bands(key):
      start, stop = self.kind_slices[kind][key]
      if stop - start not in cache:
        template = partition.piece_template(self.tx, abstract, kind, start, stop)
        cache[stop - start] = piece_bands(template, band_bytes)
      return cache[stop - start]

    return bands

  def _make_stores(self, kind: str) -> PieceStores:
    p = self.placement
    if kind == 'layers':
      return PieceStores(*(self._make_store(tier, name, kind) for tier, name in (
          (p.params, 'params'), (p.opt_state, 'opt_state'), (p.parked_grads_tier, 'grads'))))
    tier = p.embed_head if kind != 'final_norm' or p.embed_head != 'nvme' else 'host'
    return PieceStores(*(self._make_store(tier, f'{kind}_{part}', kind)
                         for part in ('params', 'opt', 'grads')))

  def _make_store(self, tier: str, name: str, kind: str):
    store = self._new_store(tier, name, kind)
    self._opened.append(store)
    return store

  def _new_store(self, tier: str, name: str, kind: str):
    if tier != 'nvme':
      return make_store(tier, name, self.stats, self.layout)
    if not self.placement.dir:
      raise ValueError('the NVMe tier needs placement.dir (the trainer sets <workdir>/offload)')
    return NvmeStore(name, self.stats, self.layout, directory=self.placement.dir,
                     slices=self.kind_slices[kind], codec=self.placement.codec,
                     level=self.placement.codec_level, shard_mb=self.placement.shard_mb,
                     max_pending_writes=self.placement.max_pending_writes(self.cfg),
                     read_threads=max(2, self.placement.prefetch_depth),
                     axis_of=None if kind == 'layers' else partition.split_axis,
                     write_budget=self.write_budget)

  def close(self, quietly: bool = False) -> None:
    """Waits for pending writes and stops the stores' I/O threads. Layer updates still waiting
    for a forward are dropped: what a run keeps is its checkpoints, which flush them. `quietly`:
    a store's error (of a write) does not keep the others open, and is not raised."""
    for store in self._opened:
      try:
        store.close()
      except Exception:  # pylint: disable=broad-except
        if not quietly:
          raise

  # --------------------------------------------------------------------------------------------
  # State in and out (checkpoints hold the full, resident-shaped state: portable across engines).
  # --------------------------------------------------------------------------------------------

  def _keys(self, kind: str) -> range:
    return range(len(self.kind_slices[kind]))

  def flush_updates(self) -> None:
    """Runs the layer updates still waiting for a forward, so the stores hold the state of the
    steps taken."""
    if self._pending is not None:
      self._pending.flush()
      self._pending = None

  def load_state(self, state: dict) -> None:
    self._pending = None  # the stores get a new state: updates of the old one must not run
    for kind, pieces in partition.split_state(state, self.tx, self.kind_slices).items():
      for key, piece in enumerate(pieces):
        piece = self.layout.conform(piece)  # device arrays of a resident state: into shards
        self.stores[kind].params.put(key, piece['params'])
        self.stores[kind].opt_state.put(key, piece['opt_state'])
    self.step = int(np.asarray(state['step']))
    self.rng = np.asarray(state['rng'])

  def init_state(self, seed: int) -> None:
    """Fresh state, built piece by piece straight into the stores (never whole on the device).

    Uses the same keys as resident.init_state, so both engines start from the same weights.
    """
    self._pending = None
    init_key, rng = model_lib.run_keys(seed)
    layers_key = model_lib.param_keys(init_key)[1]
    init_opt = jax.jit(self.tx.init)
    # Vocabulary chunks drawn one at a time (never the whole embedding): see layers.vocab_normal.
    # The start is traced: one program per chunk size (two at most), not one per chunk.
    init_piece = jax.jit(model_lib.init_outer_piece, static_argnums=(0, 2, 4))
    for kind in self.kinds[1:]:
      for key, (start, stop) in enumerate(self.kind_slices[kind]):
        piece = self.layout.conform(init_piece(self.cfg, init_key, kind, start, stop - start))
        self.stores[kind].params.put(key, piece)
        self._put_initial_opt_state(self.stores[kind].opt_state, key, piece, init_opt)
    init_layers = jax.jit(model_lib.init_layers, static_argnums=(0, 3))
    for g, (start, stop) in enumerate(self.slices):
      layers = init_layers(self.cfg, layers_key, start, stop - start)
      group = self.layout.conform({'layers': layers})  # into its shards
      self.params.put(g, group)
      self._put_initial_opt_state(self.opt_state, g, group, init_opt)
    self.step = 0
    self.rng = np.asarray(jax.random.key_data(rng))

  def _put_initial_opt_state(self, store, key, piece, init_opt) -> None:
    """`init_opt(piece)` into `store`; where that is zeros (AdamW: optim.initial_state_is_zero)
    an NVMe store gets only its shapes and writes nothing (tiers/nvme.py)."""
    if isinstance(store, NvmeStore) and optim.initial_state_is_zero(self.tx):
      store.put(key, jax.eval_shape(init_opt, piece))
    else:
      store.put(key, self.layout.conform(init_opt(piece)))

  def export_state(self) -> dict:
    """The full train state as host numpy arrays (what the resident engine would hold).

    Gathers every piece in host RAM (tests, export); checkpoints use `checkpoint_pieces`, which
    hands over one piece at a time and leaves the NVMe tier on disk.
    """
    self.flush_updates()
    pieces = {kind: [{'params': self.stores[kind].params.get(key),
                      'opt_state': self.stores[kind].opt_state.get(key)}
                     for key in self._keys(kind)]
              for kind in self.kinds}
    return partition.merge_state(pieces, self.tx, np.int32(self.step), self.rng)

  def checkpoint_pieces(self, piece_bytes: int) -> Parts:
    """What a checkpoint needs (checkpoint.Parts), by full-state tree path: the in-memory tiers'
    leaves piece by piece as the stores hold them (one store piece handed over at a time, so a save
    adds one piece of host memory, never the whole state), the NVMe tiers' live array directories
    (linked by the checkpointer, not read), and the small leaves (step counts, rng) whole."""
    self.flush_updates()
    small = {"['step']": np.asarray(self.step, np.int32), "['rng']": np.array(self.rng)}
    leaves, disk, in_memory = {}, {}, []
    for kind in self.kinds:
      for part, store in (('params', self.stores[kind].params),
                          ('opt_state', self.stores[kind].opt_state)):
        prefix = f"['{part}']"
        if isinstance(store, NvmeStore):  # split leaves: linked by the checkpointer, not read
          disk.update({prefix + p: d for p, d in store.array_dirs().items()})
          small.update({prefix + p: replicated_value(x)
                        for p, x in store.small_leaves(0).items()})
          continue
        in_memory.append((kind, store, prefix))
        first, extent = self.kind_slices[kind][0], self.kind_slices[kind][-1][1]
        for path, x in partition.by_path(store.get(0), prefix).items():
          axis = partition.split_axis(path)
          if axis is None:  # step counts sit at the same path in every piece: all equal
            # (and the final norm's scale, the one piece of its kind: split over the devices)
            small[path] = x if spread(x) else np.array(x, copy=True)
          else:  # [.., extent, ..] in files of one store piece each
            shape = x.shape[:axis] + (extent,) + x.shape[axis + 1:]
            leaves[path] = LeafLayout(shape, np.dtype(x.dtype), axis, first[1] - first[0])
    small_leaves, small_pieces = array_parts(small, piece_bytes)

    def pieces():
      yield from small_pieces
      for kind, store, prefix in in_memory:
        for key, (start, stop) in enumerate(self.kind_slices[kind]):
          for path, x in partition.by_path(store.get(key), prefix).items():
            if path in leaves:
              yield path, start, stop, x

    return Parts({**leaves, **small_leaves}, pieces(), disk)

  def load_checkpoint(self, reader) -> None:
    """Fills the stores from a verified checkpoint, piece by piece (never the whole state in RAM).
    An NVMe store whose snapshot has its on-disk layout links the snapshot's files instead."""
    self._pending = None
    abstract = model_lib.abstract_params(self.cfg)
    for kind in self.kinds:
      for part in ('params', 'opt_state'):
        self._load_part(reader, abstract, kind, part)
    self.step = int(reader.read("['step']"))
    self.rng = np.asarray(reader.read("['rng']"))

  def _load_part(self, reader, abstract, kind: str, part: str) -> None:
    store = getattr(self.stores[kind], part)
    slices = self.kind_slices[kind]
    linked = False
    if isinstance(store, NvmeStore):
      template = partition.piece_template(self.tx, abstract, kind, *slices[0])[part]
      sources = {}
      for p, x in partition.by_path(template).items():
        axis = partition.split_axis(p)
        if axis is not None:
          sources[p] = (x.shape[:axis] + x.shape[axis + 1:], reader.snapshot_dir(f"['{part}']" + p))
      linked = all(d is not None for _, d in sources.values()) and store.link_arrays(sources)
    for key, (start, stop) in enumerate(slices):
      if linked:  # the split leaves are on disk already: read only the structure and step counts
        store.adopt(key, partition.read_piece(_small_leaves_of(reader), self.tx, abstract, kind,
                                              start, stop, part))
      else:  # AdamW's zeros of an imported model are not written to NVMe (tiers/nvme.py)
        known_zero = reader.known_zero if isinstance(store, NvmeStore) else None
        # With several processes the store reads only this process's shards of each split leaf
        # (partition.LazySlice), not the whole piece in every process.
        read_box = reader.read_box if jax.process_count() > 1 else None
        store.put(key, partition.read_piece(reader.read, self.tx, abstract, kind, start, stop,
                                            part, known_zero, read_box))

  # --------------------------------------------------------------------------------------------
  # The step: the stages of schedule.py, in order.
  # --------------------------------------------------------------------------------------------

  def train_step(self, batch) -> dict:
    """One optimizer step on batch [M, B, S+1] int32, or a data.Batch (tokens, loss_mask [M, B,
    S]): then the loss is the mean over the learned targets of the whole step. Returns the
    step's metrics."""
    step = self._begin(batch)
    hidden = self._embed(step.tokens, step)
    hidden, saved, wait_s = self._forward(hidden, step.positions, keep_inputs=True)
    step.fetch_wait_s += wait_s
    loss, dys = self._head(step, hidden)
    updates = update_policy(self.updater, step.schedule)
    dys = self._backward(step, saved, dys, updates)
    self._embed_backward(step, dys)
    grad_norm, scale = self.fn.global_norm(step.squares, self.grad_clip)
    # Overlapped updates have run already; deferred ones wait for the next forward.
    self._pending = updates.finish(scale)
    self._update_outer(step, scale)
    step.fetch_wait_s += updates.wait_s
    # Wait for the last update's results (not for write-behind to disk, which overlaps the next
    # step's forward).
    jax.block_until_ready((loss, [u.last for u in self.updaters.values()]))
    return self._metrics(step, loss, grad_norm)

  def _begin(self, batch) -> _Step:
    """Starts a step: the batch's tokens (and loss weights) on the device and the final norm
    fetched."""
    self.stats.reset()
    batch, weights, starts = step_inputs(batch)
    batch = np.asarray(batch)  # host [M, B, S+1]; weights host [M, B, S] or None
    put = self.layout.put_batch  # each microbatch split along B over the devices
    schedule = StepSchedule(self.placement, self.cfg, len(batch), self.grad_clip > 0)
    tokens = [put(b[:, :-1]) for b in batch]
    return _Step(schedule, tokens, [put(b[:, 1:]) for b in batch],
                 self._positions(tokens, None if starts is None else starts[..., :-1]),
                 norm=resolve(self.stores['final_norm'].params.fetch(0)),
                 weights=None if weights is None else [put(w) for w in weights])

  def _positions(self, tokens: list, starts=None) -> list:
    """The layers' positions (model.token_positions) of each of M [B, S] token arrays on the
    device, split along B like them, with their RoPE tables (computed once here, not in every
    group program). `starts`: host [M, B, S] where documents begin (data.Batch.starts of the
    inputs), or None."""
    starts = None if starts is None else [self.layout.put_batch(s) for s in starts]
    return model_lib.positions_of_batches(self.cfg, tokens, self.fn.token_positions, starts)

  def _chunks(self, store) -> Prefetcher:
    """The vocabulary chunks of `store` in key order, read ahead like layer groups."""
    return Prefetcher(store.fetch, self._keys('embed'), self.placement.prefetch_depth)

  def _embed(self, tokens, step: _Step | None = None) -> list:
    """Stage 'embed': [B, S] tokens -> [B, S, D] hidden, per microbatch. Each embedding chunk is
    fetched once; a token's row comes from its chunk (the others add zeros)."""
    hidden = None
    chunks = self._chunks(self.stores['embed'].params)
    for c, piece in chunks:
      start = self._chunk_starts[c]
      hidden = ([self.fn.embed_chunk(piece, t, start) for t in tokens] if hidden is None else
                [self.fn.embed_chunk_add(piece, t, start, h) for t, h in zip(tokens, hidden)])
    if step is not None:
      step.fetch_wait_s += chunks.wait_s
    return hidden

  def _forward(self, hidden: list, positions, keep_inputs: bool):
    """Stage 'forward': every group in order, each fetched once (the next ones already in
    flight); a group whose update waits (exact clipping) is updated first, and its new weights
    are the fetch. Returns (output hidden, what the backward needs per group and microbatch if
    `keep_inputs`, seconds stalled): the group's input [B, S, D], or with
    offload.keep_layer_inputs (K > 1) its layers' inputs [K, B, S, D]."""
    saved = []
    layer_inputs = keep_inputs and self.placement.keeps_layer_inputs
    pending = self._pending
    source = (Prefetcher(self.params.fetch, range(len(self.slices)), self.placement.prefetch_depth)
              if pending is None else pending.forward_weights())
    # Waiting updates run in the main thread, so every device and process dispatches the same
    # programs in the same order, and group g + 1's runs while group g computes (dispatched
    # first). A plain fetch is drawn after: its Prefetcher keeps the next groups in flight.
    draw_early = pending is not None
    groups = iter(source)
    drawn = next(groups, None)
    while drawn is not None:
      _, group_params = drawn
      if layer_inputs:
        outputs = [self.fn.group_forward_keeping_inputs(group_params, h, p)
                   for h, p in zip(hidden, positions)]
        saved.append([self._stash(inputs) for _, inputs in outputs])
        hidden = [y for y, _ in outputs]
      else:
        if keep_inputs:
          saved.append([self._stash(h) for h in hidden])
        hidden = [self.fn.group_forward(group_params, h, p) for h, p in zip(hidden, positions)]
      del group_params, drawn
      if draw_early:
        drawn = next(groups, None)
      faults.point('forward')
      jax.block_until_ready(hidden)
      if not draw_early:
        drawn = next(groups, None)
    self._pending = None  # every group updated
    return hidden, saved, (pending or source).wait_s

  def _head_losses(self, normed: list, targets, weights=None) -> tuple[list, list]:
    """The head's forward over its vocabulary chunks: ([loss], [logsumexp [B, S]]) per
    microbatch, from an online logsumexp (the logits of one chunk exist at a time). The loss is
    the mean, or Σ w·nll with `weights` (per microbatch [B, S] or None; None: all None)."""
    carry = [self.fn.lse_init(t) for t in targets]
    for c, piece in self._chunks(self.stores[self._head_kind].params):
      start = self._chunk_starts[c]
      carry = [self.fn.lse_update(piece, n, t, start, k) for n, t, k in zip(normed, targets, carry)]
    weights = [None] * len(carry) if weights is None else weights
    finished = [self.fn.lse_finish(k, w) for k, w in zip(carry, weights)]
    return [loss for loss, _ in finished], [lse for _, lse in finished]

  @property
  def _head_kind(self) -> str:
    return 'embed' if self.cfg.tie_embeddings else 'head'

  def _head(self, step: _Step, hidden: list):
    """Stage 'head': final norm, LM head and loss of every microbatch, and their backward: each
    head chunk is fetched twice (forward, backward) and its gradient parked until the update.
    Returns (mean loss, [d hidden])."""
    normed = [self.fn.final_norm(step.norm, x) for x in hidden]
    losses, lses = self._head_losses(normed, step.targets, step.weights)
    stores, d_normed = self.stores[self._head_kind], [None] * step.num_micro
    # The last microbatch's call also returns the chunk's sum of squares, unless it is the tied
    # embedding's gradient, complete only after the embedding's backward.
    squares_of = None if self.cfg.tie_embeddings else step.num_micro
    for c, piece in self._chunks(stores.params):
      start, grad = self._chunk_starts[c], None
      for m in range(step.num_micro):
        weights = None if step.weights is None else step.weights[m]
        grad, d_normed[m], squares = self.fn.head_chunk_backward(
            piece, normed[m], step.targets[m], start, lses[m], grad, d_normed[m], weights,
            squares_of if m == step.num_micro - 1 else None)
      if squares is not None:
        step.squares.append(squares)
      stores.grads.put(c, grad)
    dys = []
    for m, x in enumerate(hidden):
      d_norm, dy = self.fn.final_norm_backward(step.norm, x, d_normed[m])
      step.norm_grad = d_norm if step.norm_grad is None else self.fn.add(step.norm_grad, d_norm)
      dys.append(dy)
    step.squares.append(self.fn.sum_of_squares(step.norm_grad, step.num_micro))
    loss = sum(losses)
    return loss / step.num_micro if step.num_micro > 1 else loss, dys

  def _backward(self, step: _Step, saved: list, dys: list, updates) -> list:
    """Stage 'backward': groups in reverse, each fetched again; each group's summed gradient goes
    to the update policy as soon as its backward is done. Returns [d embed output]."""
    groups = Prefetcher(self.params.fetch, reversed(range(len(self.slices))),
                        self.placement.prefetch_depth)
    # From the layers' saved inputs (each layer recomputed once), or from the group's (the group
    # recomputed, then each layer again inside its remat): see engine/functions.py.
    group_backward = (self.fn.group_backward_from_inputs if self.placement.keeps_layer_inputs
                      else self.fn.group_backward)
    last = step.num_micro - 1
    for g, group_params in groups:
      grad_sum = None  # the first microbatch's gradient starts the sum
      for m in range(step.num_micro):
        # The last microbatch's program also returns the sum of squares for the global norm.
        grad_sum, dys[m], squares = group_backward(
            group_params, self._unstash(saved[g][m]), dys[m], step.positions[m], grad_sum,
            step.num_micro if m == last else None)
      saved[g] = None
      faults.point('backward')
      step.squares.append(squares)
      updates.after_backward(g, grad_sum, group_params)
      jax.block_until_ready(dys)
    step.fetch_wait_s += groups.wait_s
    step.backward_done = time.perf_counter()
    return dys

  def _embed_backward(self, step: _Step, dys: list) -> None:
    """Stage 'embed_backward': each embedding chunk's gradient (the rows of the batch's tokens),
    added to the tied head's parked one, parked until the update."""
    stores = self.stores['embed']
    tied = (self._chunks(stores.grads) if self.cfg.tie_embeddings
            else ((c, None) for c in self._keys('embed')))
    for c, grad in tied:
      start, stop = self.vocab[c]
      shape = (stop - start, self.cfg.d_model)
      for m in range(step.num_micro):  # the last microbatch's call also returns the squares
        grad, squares = self.fn.embed_chunk_backward(
            shape, step.tokens[m], self._chunk_starts[c], dys[m], grad,
            step.num_micro if m == step.num_micro - 1 else None)
      step.squares.append(squares)
      stores.grads.put(c, grad)

  def _update_outer(self, step: _Step, scale) -> None:
    """Stage 'outer_update': AdamW of the final norm, then of every embedding and head chunk from
    its parked gradient, the inputs read one chunk ahead."""
    norm = self.updaters['final_norm']
    norm.apply(0, norm.request_inputs(0, parked=False, refetch_weights=False), scale=scale,
               num_micro=step.num_micro, grad_sum=step.norm_grad, device_params=step.norm)
    for kind in self.kinds[1:]:
      if kind != 'final_norm':
        step.fetch_wait_s += update_parked(self.updaters[kind], self._keys(kind), scale,
                                           step.num_micro, self.placement.prefetch_depth,
                                           refetch_weights=True)
    faults.point('optimizer')

  # --------------------------------------------------------------------------------------------
  # Activations between forward and backward, and the step's metrics.
  # --------------------------------------------------------------------------------------------

  def _stash(self, x):
    """A saved activation ([B, S, D], or [K, B, S, D] layer inputs) to its tier."""
    if self.placement.activations != 'host':
      return x
    self.stats.add(d2h_bytes=x.nbytes)
    return self._put_activation(x, 'pinned_host')

  def _unstash(self, x):
    if self.placement.activations != 'host':
      return x
    self.stats.add(h2d_bytes=x.nbytes)
    return self._put_activation(x, 'device')

  def _put_activation(self, x, memory_kind: str):
    """x [..., B, S, D] to `memory_kind`, still split along B (axis 1 of stacked layer inputs)."""
    if x.ndim == 3:
      return self.layout.put_activation(x, memory_kind)
    return jax.device_put(x, self.layout.split_along(x.ndim - 3, memory_kind))

  def _metrics(self, step: _Step, loss, grad_norm) -> dict:
    finished = time.perf_counter()
    lr = self.lr_schedule(self.step)
    self.step += 1
    metrics = {'learning/loss': loss, 'learning/grad_norm': grad_norm, 'learning/lr': lr,
               'io/h2d_gb': self.stats.h2d_bytes / _GB, 'io/d2h_gb': self.stats.d2h_bytes / _GB,
               'perf/fetch_wait_s': step.fetch_wait_s,
               'perf/compute_s': step.backward_done - step.started - step.fetch_wait_s,
               'perf/optimizer_s': finished - step.backward_done}
    if self.placement.uses_nvme:
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

  def eval_losses(self, batches: list) -> list[float]:
    """Mean loss of each [B, S+1] batch (a data.Batch: over its learned targets, 0 if none);
    layer-major, so each piece is fetched once for all."""
    inputs = [step_inputs(b) for b in batches]
    tokens = [self.layout.put_batch(b[:, :-1]) for b, _, _ in inputs]  # [B, S], split along B
    weights = [self.layout.put_batch(w) for _, w, _ in inputs]
    starts = [None if s is None else s[:, :-1] for _, _, s in inputs]
    norm = resolve(self.stores['final_norm'].params.fetch(0))
    hidden, _, _ = self._forward(self._embed(tokens), self._positions(tokens, starts),
                                 keep_inputs=False)
    losses, _ = self._head_losses([self.fn.final_norm(norm, h) for h in hidden],
                                  [self.layout.put_batch(b[:, 1:]) for b, _, _ in inputs], weights)
    return [float(loss) for loss in losses]
