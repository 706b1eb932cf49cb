"""The streamed step as named stages, and what each stage moves and holds.

engine/streamed.py runs these stages; planner.py prices them. Both read this module: the engine
takes its decisions from a `StepSchedule` (are updates deferred until the global norm is known? does
an update fetch the weights again? are boundary activations stashed on the host?), and the planner
sums the bytes every stage declares here (`traffic`, `held`), so the plan and the engine cannot
drift apart. tests/test_planner.py checks the declared traffic against the stores' own counters,
byte for byte, for every placement path.

One optimizer step over M microbatches, G groups of K layers (B batch, S seq, D d_model):

  stage           what runs                                          weights moved
  embed           x[m] = Σ_c embed_chunk_c(tokens[m])                each embedding chunk once
  forward         for g in 0..G-1: (update of group g waiting from the last step, deferred);
                  saved[g][m] = x[m]; x[m] = group_g(x[m])           each group once
  head            n[m] = final_norm(x[m]); an online logsumexp over the head's vocabulary
                  chunks gives loss[m]; a second pass over them gives d n[m] and each chunk's
                  gradient (parked); dy[m] = vjp(final_norm)(d n[m])  each head chunk twice
  backward        for g in G-1..0: grad_g, dy[m] = vjp(group_g)(saved[g][m], dy[m])
                                                                     each group again
  update          AdamW of group g: right after its backward (overlapped), or (deferred, exact
                  clipping: gradients parked in the weights' tier, or in device memory with
                  offload.park_grads = device, until the global norm is known) just ahead of
                  group g's forward in the next step, sharing its fetch of the weights (device
                  optimizer) or handing it the new ones (host optimizer)
  embed_backward  each embedding chunk's gradient (rows of the batch's tokens; + the tied head's
                  parked one), parked
  outer_update    AdamW of the final norm, then of every embedding / head chunk from its parked
                  gradient (weights, Adam state and gradient read one chunk ahead)

Pieces of the state (partition.py): layer groups (keys 0..G-1) in the params / opt_state tiers;
embedding and head vocabulary chunks of at most offload.shard_mb (keys 0..C-1) and the final norm
in the embed_head tier (the final norm, D floats, in host memory when that tier is nvme). Each
piece keeps the tree paths it has in the full state, so checkpoints address it by the same paths.
"""

import dataclasses
import math


STAGES = ('embed', 'forward', 'head', 'backward', 'update', 'embed_backward', 'outer_update')
STATE = 'state'  # what stays in its tiers between steps (not a stage)
FORWARD_TO_BACKWARD = 'forward..backward'  # held from the forward through the head to the backward
BACKWARD_TO_UPDATE = 'backward..update'  # parked gradients: from the backward to their update


STAGING_ROW = 'NVMe staging buffer'


# -------------------------------------------------------------------------------------------------
# Activation sizes (c = bytes of the compute dtype: 4 float32, 2 bfloat16).
# -------------------------------------------------------------------------------------------------

def compute_bytes(cfg) -> int:
  return 2 if cfg.dtype == 'bfloat16' else 4


def hidden_bytes(cfg, batch: int, seq: int) -> int:
  """One microbatch's hidden state [B, S, D]."""
  return compute_bytes(cfg) * batch * seq * cfg.d_model


def layer_internal_bytes(cfg, batch: int, seq: int) -> int:
  """What one layer's backward keeps when nothing is recomputed, for one microbatch:
  B·S·c·(6·D + 3·H·Dh + 3·Hkv·Dh + 4·F) + 3·4·B·H·Q·T (the largest block of Q = min(S,
  model.attention_chunk) queries' attention scores over its T keys, probabilities and their
  gradient, float32 whatever model.dtype (layers._attend: a stable softmax); Q = T = S
  unchunked, T <= S in blocks: ModelConfig.largest_attention_block)."""
  c, tokens = compute_bytes(cfg), batch * seq
  hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  per_token = 6 * cfg.d_model + 3 * h * hd + 3 * kv * hd + 4 * cfg.d_ff
  # Blocks are recomputed in the backward, one at a time.
  return c * tokens * per_token + 3 * 4 * batch * h * cfg.largest_attention_block(seq)


def logits_bytes(cfg, batch: int, seq: int) -> int:
  """The resident loss's logits: one vocabulary block of Vc = model.vocab_chunk columns at a time
  (model/vocab.py), its exponentials and its gradient: 3·B·S·Vc float32."""
  return 3 * 4 * batch * seq * min(cfg.vocab_size, cfg.resolved_vocab_chunk)


def piece_kinds(tied: bool) -> tuple[str, ...]:
  """The kinds of pieces a model's state is cut into (partition.py); no separate 'head' when it
  is tied to the embedding. Layers come first, the final norm last."""
  return ('layers', 'embed', 'final_norm') if tied else ('layers', 'embed', 'head', 'final_norm')


def outer_host_optimizer(placement) -> bool:
  """The embedding and head chunks are updated on the host when the optimizer runs there and
  they live off the device (the final norm, D floats, always on the device)."""
  return placement.optimizer_on == 'host' and placement.embed_head != 'device'


def host_adamw_bytes(weights: float, opt: float, params_tier: str, opt_tier: str,
                     parked: bool = True) -> float:
  """Host bytes of the one piece in AdamW on the host (engine/updates.PieceUpdater.apply) beyond
  its inputs read ahead: its new weights and Adam state, and the pinned copies of the inputs
  that were read from NVMe as numpy (`device_put` copies, on CPU too): the weights and the
  `parked` gradient in the params tier, the Adam state in the opt tier. An update right after its
  backward (not `parked`) copies its gradient from the device instead."""
  on_nvme = lambda tier: tier == 'nvme'
  grad = weights * on_nvme(params_tier) if parked else weights
  return weights + opt + weights * on_nvme(params_tier) + grad + opt * on_nvme(opt_tier)


@dataclasses.dataclass(frozen=True)
class StateSizes:
  """Bytes of one layer's params and Adam state, and of the outer (embed/norm/head) parts."""
  layer_params: int  # 4·P_l
  layer_opt: int  # Adam m + v of one layer: 8·P_l
  group_opt_extra: int  # per-group optimizer scalars (step counters)
  outer_params: int  # embedding + final norm + head
  outer_opt: int  # their Adam state as the full state holds it (one set of step counters)
  embed_params: int = 0  # 4·V·D
  head_params: int = 0  # 4·D·V, 0 when tied to the embedding
  norm_params: int = 0  # 4·D

  def piece_opt(self, nbytes: int, pieces: int) -> int:
    """Adam state of `pieces` pieces holding `nbytes` of params: m and v, and the step counters
    every piece carries (the same per piece as per layer group)."""
    return 2 * nbytes + pieces * self.group_opt_extra

  def group_params(self, k: int) -> int:
    return k * self.layer_params

  def group_opt(self, k: int) -> int:
    return k * self.layer_opt + self.group_opt_extra


@dataclasses.dataclass
class Row:
  """Bytes held in a tier by one item of the plan, with the formula that gives them."""
  tier: str
  item: str
  bytes: float
  formula: str
  stage: str = STATE


def _adder(rows: list):
  """add(stage, tier, item, bytes, formula): appends that Row to `rows`."""
  def add(stage: str, tier: str, item: str, n, formula: str) -> None:
    rows.append(Row(tier, item, float(n), formula, stage))
  return add


@dataclasses.dataclass
class Traffic:
  """Bytes one stage moves per step: host<->device (h2d, d2h) and disk (read, write)."""
  h2d: float = 0.0
  d2h: float = 0.0
  read: float = 0.0
  write: float = 0.0

  def __add__(self, other: 'Traffic') -> 'Traffic':
    return Traffic(self.h2d + other.h2d, self.d2h + other.d2h, self.read + other.read,
                   self.write + other.write)


@dataclasses.dataclass(frozen=True)
class StepSchedule:
  """The decisions of one streamed step, from the placement (a placement.Placement) and the run."""
  placement: object
  cfg: object  # the model.ModelConfig
  microbatches: int
  clipping: bool  # exact global-norm clipping (train.grad_clip > 0)

  @property
  def num_layers(self) -> int:
    return self.cfg.num_layers

  # --- decisions the engine takes -------------------------------------------------------------

  @property
  def num_groups(self) -> int:
    return math.ceil(self.num_layers / self.placement.layers_per_group)

  @property
  def deferred_updates(self) -> bool:
    """Exact clipping needs the whole gradient's norm before any update: each group's gradient is
    parked (placement.parked_grads_tier) until the backward is done, and the updates run in the
    next step's forward (their transfers and disk I/O share its phase of the step). Otherwise a
    group's update runs right after its backward, overlapping the next group's."""
    return self.clipping

  @property
  def host_optimizer(self) -> bool:
    return self.placement.optimizer_on == 'host'

  @property
  def forward_reads_weights_from_disk(self) -> bool:
    """Whether the forward reads NVMe-resident weights: not when a deferred host update runs
    ahead of it and hands it the new ones (a deferred device update's read of them is the
    forward's)."""
    return self.placement.params == 'nvme' and not (self.deferred_updates and self.host_optimizer)

  @property
  def stash_activations(self) -> bool:
    """Group-boundary activations wait in pinned host memory between forward and backward."""
    return self.placement.activations == 'host'

  # --- what each stage moves (the planner's traffic) --------------------------------------------

  def traffic(self, sizes: StateSizes, hidden_bytes: int) -> dict[str, Traffic]:
    """{stage: bytes it moves per step}; `hidden_bytes` = one microbatch's [B, S, D] activation."""
    p, L, G = self.placement, self.num_layers, self.num_groups
    W = sizes.group_params(L)
    off = {tier: tier != 'device' for tier in ('device', 'host', 'nvme')}
    disk = {tier: tier == 'nvme' for tier in ('device', 'host', 'nvme')}
    fetch_weights = Traffic(h2d=W * off[p.params], read=W * disk[p.params])
    boundary = G * self.microbatches * hidden_bytes * self.stash_activations
    stages = {stage: Traffic() for stage in STAGES}
    stages['forward'] = Traffic(h2d=W * off[p.params],
                                read=W * self.forward_reads_weights_from_disk, d2h=boundary)
    stages['backward'] = fetch_weights + Traffic(h2d=boundary)
    stages['update'] = self._update_traffic(sizes)
    stages.update(self._outer_traffic(sizes))
    return stages

  def vocab_chunks(self) -> list[tuple[int, int]]:
    """The embedding / head vocabulary chunks (partition.vocab_slices)."""
    return self.placement.vocab_slices(self.cfg)

  @property
  def norm_tier(self) -> str:
    """The final norm (D floats) stays in memory: in host RAM when embed_head is nvme."""
    return 'host' if self.placement.embed_head == 'nvme' else self.placement.embed_head

  def _outer_traffic(self, sizes: StateSizes) -> dict[str, Traffic]:
    """Embedding, head and final norm: each chunk is fetched for the embedding (once) or the head
    (twice: forward, backward), its gradient parked, then fetched again with its Adam state and
    gradient for the update (device optimizer), or updated where it lives (host optimizer)."""
    T, chunks = self.placement.embed_head, self.num_vocab_chunks
    off, disk, norm_off = T != 'device', T == 'nvme', self.norm_tier != 'device'
    E, N = sizes.embed_params, sizes.norm_params
    head = sizes.head_params or E  # the weights the head reads: the embedding when tied
    fetch = lambda all_bytes, disk_bytes: Traffic(h2d=all_bytes * off, read=disk_bytes * disk)
    park = lambda n: Traffic(d2h=n * off, write=n * disk)  # a device array put in the tier
    norm_opt = sizes.piece_opt(N, 1)
    stages = {'embed': fetch(E, E) + Traffic(h2d=N * norm_off),
              'head': fetch(2 * head, 2 * head) + park(head),
              'embed_backward': (fetch(E, E) if not sizes.head_params else Traffic()) + park(E),
              'outer_update': Traffic(h2d=norm_opt * norm_off, d2h=(N + norm_opt) * norm_off)}
    for nbytes in (E, sizes.head_params):
      if not nbytes:
        continue
      if outer_host_optimizer(self.placement):  # reads where it lives, writes weights + Adam
        stages['outer_update'] += Traffic(read=4 * nbytes * disk, write=3 * nbytes * disk)
      else:  # Adam state, weights and gradient in; weights and Adam state out
        opt = sizes.piece_opt(nbytes, chunks)
        stages['outer_update'] += fetch(opt + 2 * nbytes, 4 * nbytes) + Traffic(
            d2h=(nbytes + opt) * off, write=3 * nbytes * disk)
    return stages

  def _update_traffic(self, sizes: StateSizes) -> Traffic:
    p, L, G = self.placement, self.num_layers, self.num_groups
    W = sizes.group_params(L)
    A = L * sizes.layer_opt + G * sizes.group_opt_extra  # what crosses to a device optimizer
    A_disk = L * sizes.layer_opt  # the step counters stay in memory
    P_off, P_disk = p.params != 'device', p.params == 'nvme'
    O_off, O_disk = p.opt_state != 'device', p.opt_state == 'nvme'
    adam = Traffic(read=A_disk * O_disk, write=A_disk * O_disk)
    parked = self.deferred_updates
    if self.host_optimizer:  # params and Adam are off the device; each gradient crosses once
      return adam + Traffic(d2h=W, read=W * P_disk * (1 + parked), write=W * P_disk * (1 + parked))
    # (deferred: the weights are the forward's fetch, counted there)
    moved = adam + Traffic(h2d=A * O_off, d2h=A * O_off + W * P_off, write=W * P_disk)
    if parked and P_off and p.parked_grads_tier != 'device':  # the gradient to its tier and back
      moved += Traffic(d2h=W, h2d=W, write=W * P_disk, read=W * P_disk)
    return moved

  # --- what each stage holds (the planner's memory rows) -----------------------------------------

  def held(self, cfg, sizes: StateSizes, batch: int, seq: int, checkpoint_copies: int = 0,
           snapshots_copied: bool = False) -> list:
    """[Row] of every byte the streamed step keeps, per tier, each attributed to the stage that
    holds it (STATE: held between steps). `cfg` is the model.ModelConfig; `checkpoint_copies`,
    `snapshots_copied`: _nvme_rows."""
    p, k, M, G = self.placement, self.placement.layers_per_group, self.microbatches, self.num_groups
    gw, go = sizes.group_params(k), sizes.group_opt(k)
    hidden, internals = hidden_bytes(cfg, batch, seq), layer_internal_bytes(cfg, batch, seq)
    rows = []
    add = _adder(rows)
    add('forward', 'device', f'weights in flight ({p.prefetch_depth + 1} groups)',
        (p.prefetch_depth + 1) * gw, '(prefetch_depth + 1)·K·P_l·4')
    add('backward', 'device', 'group gradient accumulator', gw, 'K·P_l·4')
    # Deferred updates run in the next step's forward: what they hold coincides with its rows.
    update = 'forward' if self.deferred_updates else 'update'
    if not self.host_optimizer:
      if self.deferred_updates and p.parked_grads_tier == 'device':  # grads: the parked row's
        add(update, 'device', 'update inputs (2 groups)', 2 * (gw + go), '2·(weights + Adam)')
      else:
        add(update, 'device', 'update inputs (2 groups)', 2 * (2 * gw + go),
            '2·(weights + grads + Adam)')
    add('backward', 'device', 'hidden states + their gradients', 2 * M * hidden, '2·M·B·S·D·c')
    add('backward', 'device', 'group backward working set',
        internals if k == 1 else k * hidden + internals,
        "one layer's internals" if k == 1 else "K·B·S·D·c + one layer's internals")
    add(FORWARD_TO_BACKWARD, p.activations, f'boundary activations ({G} groups × {M} mb)',
        G * M * hidden, 'G·M·B·S·D·c')
    rows += self._outer_rows(cfg, sizes, batch, seq)
    rows += self._state_rows(sizes)
    if self.host_optimizer:
      if self.deferred_updates:  # band by band (engine/updates.py): p, g, m, v of each band
        band = min(gw, p.update_band_bytes())
        add(update, 'host', f'host optimizer inputs ({p.prefetch_depth + 1} bands)',
            (p.prefetch_depth + 1) * 4 * band, '(prefetch_depth + 1)·4·min(K·P_l·4, band)')
        working = host_adamw_bytes(band, 2 * band, p.params, p.opt_state)
        add(update, 'host', "host optimizer: the band in AdamW (outputs, NVMe inputs' copies)",
            working, f'{working / band:g}·min(K·P_l·4, band)')
      else:  # right after each backward: the weights and Adam state of the group
        add('update', 'host', f'host optimizer inputs ({p.prefetch_depth + 1} groups)',
            (p.prefetch_depth + 1) * (gw + go), '(prefetch_depth + 1)·K·P_l·12')
        add('update', 'host', "host optimizer: the group in AdamW (gradient, outputs, NVMe "
            "inputs' copies)", host_adamw_bytes(gw, go, p.params, p.opt_state, parked=False),
            'K·P_l·4 grads + K·P_l·12 outputs + NVMe inputs')
    return rows + self._nvme_rows(rows, checkpoint_copies, snapshots_copied)

  def _state_rows(self, sizes: StateSizes) -> list:
    """Layer params and Adam state in their tiers, and their parked gradients."""
    p, L = self.placement, self.num_layers
    W, A = sizes.group_params(L), L * sizes.layer_opt + self.num_groups * sizes.group_opt_extra
    rows = []
    add = _adder(rows)
    if p.params != 'nvme':
      add(STATE, p.params, 'layer params', W, '4·L·P_l')
    if p.opt_state != 'nvme':
      add(STATE, p.opt_state, 'layer Adam m, v', A, '8·L·P_l')
    if self.deferred_updates:
      add(BACKWARD_TO_UPDATE, p.parked_grads_tier, 'parked gradients (exact clipping)', W,
          '4·L·P_l')
    if p.params == 'nvme':
      add(STATE, 'nvme', 'layer params', L * sizes.layer_params, '4·L·P_l')
    if p.opt_state == 'nvme':
      add(STATE, 'nvme', 'layer Adam m, v', L * sizes.layer_opt, '8·L·P_l')
    return rows

  def _nvme_rows(self, rows: list, checkpoint_copies: int, snapshots_copied: bool) -> list:
    """The checkpoints that hard-link the NVMe stores in `rows` (`checkpoint_copies` of them), or
    with the checkpoints on another filesystem (`snapshots_copied`) the one snapshot of the stores
    a checkpoint copies from, on offload.dir's; and the NVMe staging buffer."""
    if not self.placement.uses_nvme:
      return []
    extra = []
    if checkpoint_copies and snapshots_copied:
      live = sum(r.bytes for r in rows if r.tier == 'nvme')
      extra.append(Row('nvme', "checkpoint snapshot (copied to the workdir's filesystem)", live,
                       'the stores above, once'))
    elif checkpoint_copies:
      # Each kept checkpoint hard-links the stores; the next write-back unshares them.
      live = sum(r.bytes for r in rows if r.tier == 'nvme')
      extra.append(Row('nvme', f'checkpoint snapshots (keep={checkpoint_copies})',
                       checkpoint_copies * live,
                       'checkpoint.keep (+1 with keep_best) × the stores above'))
    extra.append(Row('host', STAGING_ROW, self.placement.host_buffer_gb * 1e9,
                     'offload.host_buffer_gb (numpy, unpinned)'))
    return extra

  def _outer_rows(self, cfg, sizes: StateSizes, batch: int, seq: int) -> list:
    """The embedding/head chunks and the final norm in their tiers, their parked gradients, and
    the head stage's working set on the device (one vocabulary chunk's logits at a time)."""
    p, M, chunks = self.placement, self.microbatches, self.num_vocab_chunks
    E, H, N = sizes.embed_params, sizes.head_params, sizes.norm_params
    chunk_rows = max(stop - start for start, stop in self.vocab_chunks())
    chunk = 4 * chunk_rows * cfg.d_model
    rows = []
    add = _adder(rows)
    add(STATE, p.embed_head, 'embedding/head params + Adam',
        E + H + sizes.piece_opt(E, chunks) + (sizes.piece_opt(H, chunks) if H else 0),
        f'(4 + 8)·P_embed/head ({chunks} chunks)')
    add(STATE, self.norm_tier, 'final norm params + Adam', N + sizes.piece_opt(N, 1), '(4 + 8)·D')
    add(BACKWARD_TO_UPDATE, p.embed_head, 'parked embedding/head gradients', E + H,
        '4·P_embed/head')
    if p.embed_head != 'device':
      add('head', 'device', f'vocabulary chunks in flight ({p.prefetch_depth + 1})',
          (p.prefetch_depth + 1) * chunk, '(prefetch_depth + 1)·4·V_c·D')
    if p.embed_head != 'device':  # each chunk's weights, gradient and Adam moments, read ahead
      add('outer_update', 'host' if outer_host_optimizer(p) else 'device',
          f'embedding/head update inputs ({p.prefetch_depth + 1} chunks)',
          (p.prefetch_depth + 1) * 4 * chunk, '(prefetch_depth + 1)·4·4·V_c·D')
    if outer_host_optimizer(p):
      working = host_adamw_bytes(chunk, 2 * chunk, p.embed_head, p.embed_head)
      add('outer_update', 'host', "host optimizer: the chunk in AdamW (outputs, NVMe inputs' "
          'copies)', working, f'{working / chunk:g}·4·V_c·D')
    add('head', 'device', 'head working set (one vocabulary chunk)',
        chunk + 3 * 4 * batch * seq * chunk_rows + 2 * M * hidden_bytes(cfg, batch, seq)
        + 3 * 4 * M * batch * seq, "4·V_c·D grads + 3·B·S·V_c·4 logits + 2·M·B·S·D·c + lse")
    return rows

  @property
  def num_vocab_chunks(self) -> int:
    return len(self.vocab_chunks())

  def jitted_calls(self) -> dict[str, int]:
    """{stage: jitted functions dispatched per step} (the planner's dispatch overhead)."""
    G, M, C = self.num_groups, self.microbatches, self.num_vocab_chunks
    kinds = 1 if self.cfg.tie_embeddings else 2
    return {'embed': C * M, 'forward': G * M, 'head': 2 * C * M + 4 * M + 2,
            'backward': G * M + 2 * G, 'update': 2 * G, 'embed_backward': C * (M + 1),
            'outer_update': 1 + kinds * C}
