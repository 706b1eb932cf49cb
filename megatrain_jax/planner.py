"""The planner: where every byte lives, how long a step takes, and the placement that is fastest.

Everything here is arithmetic on shapes and a hardware profile (hardware.py): nothing is allocated,
so `--dry_run` of a 405B model runs in seconds. The same functions resolve `offload.* = 'auto'`
before a run starts, and refuse a config that fits nowhere, with needed vs available per tier.

Notation (all per optimizer step): L layers, P_l params per layer, K layers per group, G = ceil(L/K)
groups, M microbatches of B sequences of S tokens, D = d_model, V = vocab, c = bytes of the compute
dtype (4 float32, 2 bfloat16). W = 4·L·P_l bytes of layer weights; A = Adam m + v of the layers
(8·L·P_l, plus a few step counters); E, E_opt = the same for embedding + final norm + head.

MEMORY (bytes; `make_plan` returns them as rows with these formulas; a streamed plan's rows are
what the stages of schedule.py declare they hold, each row naming its stage):
  resident, device:  params 4·P, Adam 8·P, and the larger of a fresh init's XLA temporaries
                     (1.67·4·P, measured; none for a state read into place: a resume,
                     init.from_hf, init.from_run) and the step's rows: gradients 4·P (+4·P
                     accumulator when M > 1),
                     activations of one microbatch:
                       remat full/minimal/offload: L·B·S·D·c saved layer inputs + one layer's
                       internals (recomputed in its backward) + the logits of one
                       vocabulary block 3·B·S·V_c·4 (V_c = model.vocab_chunk)
                       remat none: L × one layer's internals + logits
  streamed, device:  (prefetch_depth + 1) groups of weights in flight, K·P_l·4 each;
                     the group's gradient accumulator (K·P_l·4); the update's inputs (device
                     optimizer: weights + gradient + Adam of 2 groups, one updating and one
                     arriving); hidden states and their gradients 2·M·B·S·D·c; the group
                     backward's working set (K = 1: one layer's internals; K > 1: K saved
                     layer inputs + one layer's internals); boundary activations
                     G·M·B·S·D·c unless offload.activations = host (offload.keep_layer_inputs,
                     K > 1: every layer's input, L·M·B·S·D·c, and the group backward holds one
                     layer's internals, + K·B·S·D·c brought back from the host); the head stage's
                     working set: one vocabulary chunk's gradient and logits (3·B·S·V_c·4),
                     normed states and their gradients; vocabulary chunks in flight
                     (prefetch_depth + 1) unless the embedding/head lives on the device.
  host (pinned):     params W, Adam A, parked gradients W (exact clipping, params on host),
                     boundary activations, embedding/head (params, Adam, parked gradients; in
                     vocabulary chunks), and for the NVMe tier its staging buffer
                     offload.host_buffer_gb.
  nvme:              params W, Adam A (layer leaves), embedding/head (embed_head = nvme),
                     parked gradients W (clipping, params on
                     nvme), and checkpoint.keep more copies of them: each kept checkpoint
                     hard-links the stores, and the next write-back unshares every file (with
                     the workdir on another filesystem one copy: the snapshot a checkpoint
                     copies there from; the workdir's disk is checked apart, train.py).
  process (host rows):  the runtime baseline, measured as this process's RSS when it plans for
                     this machine (the profile's runtime_host_gb when it plans another's), and
                     what a run adds to it besides these rows: compiled programs, the data
                     pipeline, writers (the profile's programs_host_gb).
  Budgets: device 90% of its memory; host 85% of RAM; nvme the free space at offload.dir.
  offload.device_memory_gb / host_memory_gb override the first two. On a GPU, pinned host
  memory (host rows but the NVMe staging buffer, which is numpy) must also stay under
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB when the user set it (megatrain_jax/__init__.py otherwise
  raises XLA's 64 GiB default to the machine's RAM).
  One layer's internals (what its backward needs when nothing is recomputed, per microbatch):
    B·S·c·(6·D + 3·H·Dh + 3·Hkv·Dh + 4·F) + 3·4·B·H·Q·T   (attention scores, probabilities and
    their gradient, float32 whatever model.dtype, of the largest block of Q = min(S,
    model.attention_chunk) queries over the T keys it computes; Q = T = S when unchunked)

TRAFFIC (bytes moved per step; `traffic` sums what each stage of schedule.py declares, the same
StepSchedule the engine takes its decisions from, and tests check it against the engine's own
counters exactly):
  weights off-device are fetched twice (forward, backward), with or without exact clipping (a
  deferred update runs in the next forward: the device optimizer's fetch of the weights is the
  forward's, the host optimizer hands the forward the weights it wrote); the Adam state crosses
  to the device optimizer and back; the host optimizer receives each gradient (d2h) and touches
  nothing on the device.

TIME (seconds per step):
  compute = FLOPs / achieved layer FLOP/s, with FLOPs = tokens × layer forwards × (2·(P_l − 2D)
            + attention 4·T·H·Dh) + head 6·D·V per token, T the keys a query is scored against
            (ModelConfig.attended_keys: S unchunked; about S/2 in query blocks, which skip the
            keys causality masks, and W + a band under a sliding window W). A layer's forward runs
            3 (fwd + 2× in bwd) + recomputes: resident remat full +1; streamed K = 1 +1 (the group
            backward recomputes the layer from its input); streamed K > 1 +1 (group) +1 (remat),
            or +1 with offload.keep_layer_inputs (each layer recomputed from its kept input);
            when S > model.attention_chunk, the attention part once more (query blocks are
            recomputed in their backward).
  optimizer = params / AdamW rate (device or host);  copies = bytes / link rate;
  disk = read / read rate + write / write rate. When the NVMe stores fit in the RAM the plan leaves
  free, the page cache holds them: reads and writes run at the cached rates (the write-backs are
  not fsynced; the kernel flushes them behind the step).
  On an accelerator (profile.overlap) the pipeline overlaps them: a step takes
    max over resources (compute + device optimizer, h2d, d2h, disk, host optimizer)
    + the pipeline fill (the first group's fetch in the forward and in the backward)
  With exact clipping the layer updates wait for the next step's forward and run beside it
  (engine/updates.py): the step is two phases, each the max over its own resources,
    max(f·compute + device optimizer, the forward phase's h2d, d2h, disk, host optimizer)
    + max((1 − f)·compute, the rest's h2d, d2h, disk)  + fill
  with f = the forward's share of the FLOPs (1 / (3 + recomputes) of the layers') and the
  forward phase's bytes those of the stages embed, forward and update (FORWARD_PHASE).
  On the CPU backend the same cores do everything, so the terms add up, except disk I/O, whose
  background threads share the cores with compute: it adds disk / cores.

N DEVICES (parallel.devices, or every visible device when 0; a dry run plans for N whatever this
machine has): the engines split the batch over N devices and every piece of the train state in
every tier with it (ZeRO-3 / FSDP, layout.py), so per device:
  memory:    1/N of each piece of the state, of its in-flight copies, gradients and update inputs,
             in whatever tier (rows whose bytes do not depend on the batch), plus the activations
             of the per-device batch B/N (rows that do: computed at B/N), plus the whole piece
             being computed: a streamed group all-gathered with its gradient before the
             reduce-scatter, 2·K·P_l·4, and one vocabulary chunk 4·V_c·D (resident: one layer,
             2·P_l·4). Device rows are per device; host and nvme rows are the process's: its n
             local devices' shares, which share its RAM and drives (one process driving all N:
             the same bytes as one device). The staging buffer and the runtime are per process.
  traffic:   host<->device and disk bytes 1/N of the state's (each device streams its shard),
             plus its own activations; each device has its own host link, but the process's n
             devices share its drives (disk time = n × per-device bytes / the drives' rate) and
             its CPU (host AdamW over n/N of the layers).
  collectives (GSPMD, inside each jitted call, engine/functions.py): all-gathers of the weights
             each call computes with, reduce-scatters of its gradient; the streamed engine calls
             a group once per microbatch in the forward and in the backward, so per step
             all-gather 2·M·W + M·E + 2·M·H_w, reduce-scatter M·(W + E + H_w) (H_w the head's
             weights, the embedding's when tied); resident 2·M·4·P and M·4·P. A ring gives each
             device (N − 1)/N of them: time = that / profile.interconnect_gbps. They run in the
             device's calls before and after their compute, so they add to it (and to the host
             link's time where the collectives cross it: interconnect_shares_host_link).
  compute:   FLOPs of B/N sequences; on the CPU backend the n devices share the cores, so their
             compute, copies and device optimizer add up.

AUTO PLACEMENT: every `auto` field is searched (tiers, optimizer location, K, prefetch depth; M
when train.microbatches = 0; the NVMe staging buffer when offload.host_buffer_gb = 0). A candidate
must fit every tier's budget; the fastest tokens/s wins, and among candidates within 1% of it the
one that offloads the fewest bytes, then the smallest M, group and depth (less memory for the
same speed). offload.keep_layer_inputs = auto plans a K > 1 candidate with the layer inputs kept
(it recomputes less) and without; offload.park_grads = auto plans a deferred device update's
gradients parked in device memory (no round trip through the host) and in the weights' tier
(`_option_variants`): each variant that fits competes like any other candidate.
"""

import collections
import dataclasses
import functools
import math
import os

import jax
import numpy as np

import megatrain_jax
from megatrain_jax import PINNED_LIMIT_ENV
from megatrain_jax import distributed
from megatrain_jax import hardware
from megatrain_jax import layout
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax import partition
from megatrain_jax import runtime
from megatrain_jax.errors import ConfigError
from megatrain_jax.hardware import HardwareProfile
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import AUTO, MEMORY_TIERS, TIERS, Placement
from megatrain_jax.schedule import (BACKWARD_TO_UPDATE, FORWARD_TO_BACKWARD, STAGING_ROW, STATE,
                                    Row, StateSizes, StepSchedule, Traffic, hidden_bytes,
                                    layer_internal_bytes, logits_bytes)

# The process's own rows (host, held all run, per process): what it holds before any train state,
# and what a run adds to that besides its state and working sets (`runtime_rows`).
RUNTIME_ROW = 'runtime (Python, JAX/XLA, libraries)'
PROGRAMS_ROW = 'compiled programs, data, writers'
# A fresh resident run builds its whole state in one jitted init (engine/resident.init_state):
# beside its output (params + Adam, the state rows) XLA holds temporaries (the random bits and
# normals of the weights) of about 1.67 × the params' bytes: memory_analysis() of the compiled
# init on XLA:CPU gives 1.58, 1.67 and 1.67 × 4·P on the tiny, 125m and 1b configs (0.019,
# 0.824, 8.25 GB). On 125m the whole run peaks there (2.91 GB RSS = the planning process's 0.49 +
# 1.48 state + 0.82 + 0.1), above the step's gradients + activations. A resumed run reads its
# state leaf by leaf and holds none of it: for it the row over-counts.
INIT_ROW = 'init temporaries beyond the step (fresh init)'
RESIDENT_INIT_TEMP_RATIO = 1.67
# Host memory each compiled program keeps for the rest of the process (its machine code and what
# compiling it left in the heap; jax.clear_caches() does not give it back): 5.4, 5.0 and 3.9 MB
# per program, compiling 12-48 vocabulary-chunk inits of a d_model 256, 768 and 2048 model on
# XLA:CPU under the 'tuned' allocator, trimmed above the plan's peak. It matters where a run
# compiles one program per piece: a fresh streamed init draws each vocabulary chunk with its
# bounds static (engine/streamed.py): a 131k-vocabulary d_model 256 model (24 chunks at K=2, its
# state all on NVMe) held 0.21 GB more after its engine's init than before it.
PROGRAM_HOST_BYTES = 5e6

_GB = 1e9
# Of the device's memory: what JAX's allocator gets (XLA_PYTHON_CLIENT_MEM_FRACTION; 0.9 unless set,
# megatrain_jax/__init__.py), less nothing more: XLA's workspace comes out of the same pool.
DEVICE_USABLE_FRACTION = 0.9
HOST_USABLE_FRACTION = 0.85  # the OS, Python, the data pipeline and the page cache
PINNED_ROW = 'host (pinned, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)'
POOL_ROW = "pinned pool growth (XLA's allocator)"
BFC_FIRST_REGION = 2 << 20  # tsl::BFCAllocator's first region under allow_growth


# -------------------------------------------------------------------------------------------------
# Exact sizes of the state pytrees (from shapes; nothing allocated).
# -------------------------------------------------------------------------------------------------

def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=32)
def state_sizes(cfg: ModelConfig, train_key: tuple) -> StateSizes:
  """Exact sizes from jax.eval_shape of the real init functions and the real optimizer."""
  train = dict(train_key)
  tx = optim.make_optimizer(_Attrs(train))
  key = jax.random.key(0)
  one = jax.eval_shape(lambda: model_lib.init_layers(cfg, key, 0, 1))
  two = jax.eval_shape(lambda: model_lib.init_layers(cfg, key, 0, 2))
  opt_one = _nbytes(jax.eval_shape(tx.init, {'layers': one}))
  opt_two = _nbytes(jax.eval_shape(tx.init, {'layers': two}))
  outer = jax.eval_shape(lambda: model_lib.init_outer(cfg, key))
  layer_opt = opt_two - opt_one
  piece = lambda kind: _nbytes(jax.eval_shape(
      lambda o: partition.piece_of(o, kind, 0, cfg.vocab_size), outer)) if (
          kind in partition.kinds_of(outer)) else 0
  return StateSizes(layer_params=_nbytes(one), layer_opt=layer_opt,
                    group_opt_extra=opt_one - layer_opt, outer_params=_nbytes(outer),
                    outer_opt=_nbytes(jax.eval_shape(tx.init, outer)),
                    embed_params=piece('embed'), head_params=piece('head'),
                    norm_params=piece('final_norm'))


class _Attrs(dict):
  __getattr__ = dict.__getitem__


def train_key(train) -> tuple:
  """The optimizer-relevant train fields as a hashable key (for the state_sizes cache)."""
  names = ('lr', 'warmup_steps', 'warmup_ratio', 'steps', 'min_lr_ratio', 'lr_schedule',
           'weight_decay', 'b1', 'b2', 'eps')
  return tuple((n, train[n]) for n in names)


# -------------------------------------------------------------------------------------------------
# Devices.
# -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Devices:
  """What a plan is for: `count` (N) devices split the batch (each computes B/N sequences of every
  microbatch) and shard every piece of the train state (each keeps 1/N, in every tier); `local`
  (n) of them are this process's and share its host RAM, drives and CPU cores; `sharing`
  processes (this one included) run on this machine, and share its RAM and drives."""
  count: int = 1
  local: int = 1
  sharing: int = 1

  def describe(self, hw: HardwareProfile, batch: int) -> list:
    """The plan's lines on what it is for."""
    if self.count == 1:
      return ['devices: 1 (parallel.devices=N plans for N, each keeping 1/N of the state)']
    rate, link = hw.link_gbps()
    n, local = self.count, self.local
    processes = ('one process drives them all' if local == n
                 else f'this process drives {local} of them')
    return [f'devices: {n} x {hw.name}, {processes}; each keeps 1/{n} of every piece of the state '
            f'and computes {batch // n} of the {batch} sequences of each microbatch; collectives '
            f'over {link} at {rate:,.4g} GB/s per device',
            '        device rows are per device; host and nvme rows are the process\'s ('
            + (f'its {local} devices\' shares' if local > 1 else 'its device\'s share')
            + '), against the machine\'s RAM and drives'
            + (f' (1/{self.sharing} of them: {self.sharing} processes run on this machine)'
               if self.sharing > 1 else '')]


def devices_for(config) -> Devices:
  """N = parallel.devices, or every device jax sees when it is 0. With one process (every dry
  run) the process drives all N, even devices this machine lacks: a plan for another machine;
  with several, its own among the first N of jax.devices(). train.batch_size must split over N."""
  parallel = config.get('parallel')
  if parallel is None:
    return Devices()
  distributed.check_fields(config)
  count = parallel.devices or jax.device_count()
  distributed.check_batch(config, count)
  if jax.process_count() == 1:
    return Devices(count, count)
  local = sum(d.process_index == jax.process_index() for d in jax.devices()[:count])
  return Devices(count, max(local, 1), distributed.processes_on_this_machine())


# -------------------------------------------------------------------------------------------------
# The plan of one placement.
# -------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
  placement: Placement
  microbatches: int
  batch_size: int
  seq_len: int
  rows: list  # [Row]
  budgets: dict  # tier -> bytes available
  traffic: dict  # h2d, d2h, read, write (bytes per step)
  times: dict  # named seconds per step
  step_time_s: float
  bottleneck: str
  flops_per_step: float
  peak_tflops: float  # of all N devices together (CPU devices of one process: of its cores)
  write_behind_bytes: float = 0.0  # NVMe writes queued at most (placement.write_budget_bytes)
  staged_bytes: float = 0.0  # NVMe reads staged in XLA's pinned pool at once (pinned_pool_rows)
  devices: Devices = Devices()
  collectives: dict = dataclasses.field(default_factory=dict)  # all_gather, reduce_scatter (whole)

  @property
  def tokens_per_step(self) -> int:
    return self.microbatches * self.batch_size * self.seq_len

  @property
  def tokens_per_s(self) -> float:
    return self.tokens_per_step / self.step_time_s

  @property
  def mfu(self) -> float:
    """Model FLOPs (6·N·T + attention, no recompute) / step time / the devices' peak."""
    return self.flops_per_step / self.step_time_s / (self.peak_tflops * 1e12)

  def used(self, tier: str) -> float:
    """Bytes of the tier's rows: per device for 'device', the process's for 'host' and 'nvme'."""
    return sum(r.bytes for r in self.rows if r.tier == tier)

  def _process_bytes(self, row: Row) -> float:
    """What a row holds in the process's memory: device rows once per local device."""
    return row.bytes * (self.devices.local if row.tier == 'device' else 1)

  @property
  def host_peak_bytes(self) -> float:
    """Peak resident memory of the process (on a unified-memory machine, CPU, the device rows
    live in the same RAM and count too): what stays between steps (state rows, the runtime), plus
    the NVMe write-behind (queued writes land during any stage), plus the heaviest stage: the
    forward and backward (weights in flight, accumulator, activations), the head, or the
    updates. The tier budgets (`over_budget`) add every row instead: a safe bound, not a peak.
    On N devices: the process's (device rows once per local device on a unified machine)."""
    tiers = ('host', 'device') if self.budgets.get('_unified') else ('host',)
    held = [r for r in self.rows if r.tier in tiers and r.item != STAGING_ROW]
    per_stage = collections.Counter()
    for r in held:
      if r.stage != STATE:  # the forward's weights in flight are the backward's too
        per_stage['layers' if r.stage in ('forward', 'backward') else r.stage] += (
            self._process_bytes(r))
    for span, phases in ((FORWARD_TO_BACKWARD, ('layers', 'head')),  # boundary activations
                         (BACKWARD_TO_UPDATE, ('layers', 'update', 'outer_update'))):  # parked
      held_across = per_stage.pop(span, 0.0)
      for phase in phases:
        per_stage[phase] += held_across
    return (sum(self._process_bytes(r) for r in held if r.stage == STATE)
            + self.write_behind_bytes + max(per_stage.values(), default=0.0))

  def over_budget(self) -> dict:
    """{tier: (needed, available)} for every tier whose budget the plan exceeds."""
    over = {}
    device, host, nvme = self.used('device'), self.used('host'), self.used('nvme')
    b = self.budgets
    if device > b['device']:
      over['device'] = (device, b['device'])
    if b.get('_unified'):  # the CPU backend: device and host bytes share one RAM
      shared = device * self.devices.local + host  # every local device's rows
      if shared > b['host']:
        over['host (shared with device)'] = (shared, b['host'])
    elif host > b['host']:
      over['host'] = (host, b['host'])
    pinned = self.pinned_used()
    if '_pinned' in b and pinned > b['_pinned']:
      over[PINNED_ROW] = (pinned, b['_pinned'])
    if nvme > b['nvme']:
      over['nvme'] = (nvme, b['nvme'])
    return over

  def pinned_used(self) -> float:
    """Bytes of XLA's pinned pool at its peak: the pinned rows and the pool's growth beyond them
    (the NVMe reads staged there among it), against XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB."""
    return pinned_bytes(self.rows) + sum(r.bytes for r in self.rows if r.item == POOL_ROW)

  @property
  def fits(self) -> bool:
    return not self.over_budget()


def _memory_rows(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int,
                 seq: int, clipping: bool, checkpoint_copies: int = 0,
                 devices: Devices = Devices(), snapshots_copied: bool = False) -> list:
  """[Row]: the resident step's state and activations, or what each streamed stage holds; on N
  devices per device (device rows) and per process (host, nvme rows), the module docstring's N
  DEVICES. `batch` is the global batch."""
  n = devices.count
  rows = _one_device_rows(cfg, sizes, p, micro, batch // n, seq, clipping, checkpoint_copies,
                          snapshots_copied)
  if n == 1:
    return _init_beyond_step(rows)
  # A row whose bytes change with the batch holds activations (of the per-device batch, as
  # computed); any other holds pieces of the state, their copies in flight, gradients or update
  # inputs, of which each device keeps its 1/N shard.
  twice = _one_device_rows(cfg, sizes, p, micro, 2 * (batch // n), seq, clipping,
                           checkpoint_copies, snapshots_copied)
  out = []
  for row, other in zip(rows, twice, strict=True):
    if row.item == STAGING_ROW:  # the process's NVMe staging, offload.host_buffer_gb
      out.append(row)
      continue
    activations = other.bytes != row.bytes
    local = 1 if row.tier == 'device' else devices.local
    factor = local * (1 if activations else 1 / n)
    if row.tier == 'device':
      note = '' if activations else ' / N'
    elif activations:
      note = ' · n' if local > 1 else ''
    else:
      note = '' if local == n else ' · n/N'
    out.append(dataclasses.replace(row, bytes=row.bytes * factor, formula=row.formula + note))
  return _init_beyond_step(out + _gathered_rows(cfg, sizes, p, micro, clipping))


def _init_beyond_step(rows: list) -> list:
  """A resident plan's init row (a fresh init's XLA temporaries, held beside the new params and
  Adam state before the first step) cut to what it needs beyond the step's own rows (gradients,
  activations, logits, a gathered layer), which it never coexists with: every tier's total and
  the predicted peak then hold the state plus the larger of the two."""
  init = next((r for r in rows if r.item == INIT_ROW), None)
  if init is None:
    return rows
  step = sum(r.bytes for r in rows if r.tier == 'device' and r.item not in (
      INIT_ROW, 'params', 'Adam m, v'))
  beyond = dataclasses.replace(init, bytes=max(0.0, init.bytes - step),
                               formula=f'max(0, {init.formula} − the step\'s rows above)')
  return [beyond if r is init else r for r in rows]


def _gathered_rows(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int,
                   clipping: bool) -> list:
  """On N > 1 devices, the whole piece being computed: all-gathered from the shards before the
  compute, its gradient whole until the reduce-scatter."""
  if not p.streamed:
    return [Row('device', 'gathered layer + its gradient (N > 1)', 2.0 * sizes.layer_params,
                "2·P_l·4 (one layer all-gathered; its gradient before the reduce-scatter)")]
  chunk_rows = max(stop - start for start, stop in
                   StepSchedule(p, cfg, micro, clipping).vocab_chunks())
  gw = sizes.group_params(p.layers_per_group)
  return [Row('device', 'gathered group + its gradient (N > 1)', 2.0 * gw,
              '2·K·P_l·4 (all-gathered; the gradient before its reduce-scatter)', 'backward'),
          Row('device', 'gathered vocabulary chunk (N > 1)', 4.0 * chunk_rows * cfg.d_model,
              '4·V_c·D', 'head')]


def _one_device_rows(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int,
                     seq: int, clipping: bool, checkpoint_copies: int = 0,
                     snapshots_copied: bool = False) -> list:
  """[Row] of one device computing `batch` sequences per microbatch with the whole state."""
  if p.streamed:
    schedule = StepSchedule(p, cfg, micro, clipping)
    rows = schedule.held(cfg, sizes, batch, seq, checkpoint_copies, snapshots_copied)
    return _kept_layer_input_rows(cfg, p, rows, micro, batch, seq) if p.keeps_layer_inputs else rows
  L, E = cfg.num_layers, sizes.outer_params
  W = sizes.group_params(L)
  rows = []
  add = lambda item, n, formula: rows.append(Row('device', item, float(n), formula))
  add('params', W + E, '4·P')
  add('Adam m, v', L * sizes.layer_opt + sizes.outer_opt, '8·P')
  add('gradients', (W + E) * (2 if micro > 1 else 1),
      '4·P' + (' (+4·P accumulator, M > 1)' if micro > 1 else ''))
  internals = layer_internal_bytes(cfg, batch, seq)
  if cfg.remat == 'none':
    add('activations (1 microbatch)', L * internals, 'L × layer internals')
  else:
    add('activations (1 microbatch)', L * hidden_bytes(cfg, batch, seq) + internals,
        "L·B·S·D·c saved inputs + one layer's internals")
  add('logits (1 microbatch)', logits_bytes(cfg, batch, seq),
      '3·B·S·V_c·4 (one vocabulary block)')
  # Whole here; `_init_beyond_step` keeps what it needs beyond the step's rows.
  add(INIT_ROW, RESIDENT_INIT_TEMP_RATIO * (W + E),
      f'{RESIDENT_INIT_TEMP_RATIO:.2f}·4·P (XLA temporaries of the jitted init)')
  return rows


def _kept_layer_input_rows(cfg: ModelConfig, p: Placement, rows: list, micro: int, batch: int,
                           seq: int) -> list:
  """`rows` (schedule.held's, which count one input per group) with offload.keep_layer_inputs:
  every layer's input is kept from the forward to the backward, L·M·B·S·D·c in the activations'
  tier instead of G·M·B·S·D·c (K× for whole groups); the group backward then holds one layer's
  internals, plus the K inputs it brings back when they wait on the host (it no longer
  recomputes the group to find them)."""
  L, K, M = cfg.num_layers, p.layers_per_group, micro
  hidden, internals = hidden_bytes(cfg, batch, seq), layer_internal_bytes(cfg, batch, seq)
  out = []
  for row in rows:
    if row.stage == FORWARD_TO_BACKWARD and row.item.startswith('boundary activations'):
      row = dataclasses.replace(row, item=f'boundary activations ({L} layers × {M} mb)',
                                bytes=float(L * M * hidden),
                                formula='L·M·B·S·D·c (keep_layer_inputs: K per group)')
    elif row.item == 'group backward working set':
      on_host = p.activations == 'host'
      row = dataclasses.replace(
          row, bytes=float(internals + K * hidden * on_host),
          formula=("K·B·S·D·c (inputs back from the host) + one layer's internals" if on_host
                   else "one layer's internals (its inputs: the boundary row)"))
    out.append(row)
  return out


def _kept_layer_input_traffic(cfg: ModelConfig, p: Placement, micro: int, hidden: int) -> Traffic:
  """With offload.keep_layer_inputs and activations on the host, the L − G layer inputs beyond
  the groups' own cross to the host in the forward and back in the backward (schedule.traffic
  counts the G group inputs)."""
  if not (p.keeps_layer_inputs and p.activations == 'host'):
    return Traffic()
  extra = (cfg.num_layers - len(p.group_slices(cfg.num_layers))) * micro * hidden
  return Traffic(h2d=extra, d2h=extra)


# The stages that run in the forward's phase of a step when the layer updates wait for it
# (schedule.StepSchedule.deferred_updates): the rest run in the head's and backward's.
FORWARD_PHASE = ('embed', 'forward', 'update')


def traffic(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int, seq: int,
            clipping: bool, devices: int = 1, stages=None) -> dict:
  """Bytes per step per device: h2d, d2h (host<->device) and read, write (disk): the sum of what
  every stage of the streamed step declares (schedule.py), or only `stages`. On `devices` = N
  each device moves its 1/N shard of every piece and the activations of its batch / N
  sequences."""
  return _sum_stages(stage_traffic(cfg, sizes, p, micro, batch, seq, clipping, devices), stages)


_TRAFFIC_FIELDS = tuple(f.name for f in dataclasses.fields(Traffic))  # h2d, d2h, read, write


def stage_traffic(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int,
                  seq: int, clipping: bool, devices: int = 1) -> dict[str, Traffic]:
  """{stage: Traffic per step per device} (see `traffic`; empty for the resident engine). The
  layer inputs kept for the backward (offload.keep_layer_inputs, activations on the host) count
  as the forward's d2h and the backward's h2d."""
  if not p.streamed:
    return {}
  schedule = StepSchedule(p, cfg, micro, clipping)

  def per_stage(hidden):
    stages = schedule.traffic(sizes, hidden)
    kept = _kept_layer_input_traffic(cfg, p, micro, hidden)
    stages['forward'] += Traffic(d2h=kept.d2h)  # to the host in the forward,
    stages['backward'] += Traffic(h2d=kept.h2d)  # back in the backward
    return stages

  moved = per_stage(hidden_bytes(cfg, batch // devices, seq))
  if devices > 1:  # the activations' part is what the batch adds to the state's
    state = per_stage(0)
    moved = {stage: Traffic(*(getattr(state[stage], f) / devices
                              + getattr(t, f) - getattr(state[stage], f) for f in _TRAFFIC_FIELDS))
             for stage, t in moved.items()}
  return moved


def _sum_stages(stages: dict[str, Traffic], only=None) -> dict:
  """{h2d, d2h, read, write}: the bytes of every stage in `stages`, or of those in `only`."""
  total = sum((t for stage, t in stages.items() if only is None or stage in only), Traffic())
  return {f: getattr(total, f) for f in _TRAFFIC_FIELDS}


def collective_bytes(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int) -> dict:
  """Whole bytes per step that N > 1 devices all-gather (weights, before each call that computes
  with them) and reduce-scatter (each call's gradient, to the shards): the module docstring's N
  DEVICES. Each device receives (N - 1)/N of them."""
  W = sizes.group_params(cfg.num_layers)
  if not p.streamed:  # every microbatch's forward and backward gather all the weights
    whole = W + sizes.outer_params
    return {'all_gather': 2.0 * micro * whole, 'reduce_scatter': 1.0 * micro * whole}
  E = sizes.embed_params
  head = sizes.head_params or E  # the head's weights: the embedding when tied
  # Groups: forward + backward calls per microbatch; embedding once per microbatch, head chunks
  # in the loss pass and the backward pass; gradients once per microbatch each.
  return {'all_gather': micro * (2.0 * W + E + 2.0 * head),
          'reduce_scatter': micro * (1.0 * W + E + head)}


def forward_flops(cfg: ModelConfig, micro: int, batch: int, seq: int) -> float:
  """FLOPs the streamed forward stage executes (every layer once: ModelConfig.layer_forward_flops,
  its attention over the keys each query block computes; step_flops counts it in `executed`)."""
  return micro * batch * seq * cfg.num_layers * cfg.layer_forward_flops(seq)


def step_flops(cfg: ModelConfig, p: Placement, micro: int, batch: int, seq: int) -> tuple:
  """(FLOPs the step executes, model FLOPs without recompute) per step."""
  tokens = micro * batch * seq
  head_fwd = 2.0 * cfg.d_model * cfg.vocab_size
  if not p.streamed:
    recompute = 1 if cfg.remat == 'full' else 0
  elif p.layers_per_group == 1 or p.keeps_layer_inputs:  # each layer recomputed from its input
    recompute = 1
  else:
    recompute = 1 + (1 if cfg.remat == 'full' else 0)
  executed = forward_flops(cfg, micro, batch, seq) * (3 + recompute) + tokens * 3 * head_fwd
  if cfg.attention_chunk and seq > cfg.attention_chunk:  # each query block re-runs in its backward
    executed += (tokens * cfg.num_layers * 4.0 * cfg.attended_keys(seq) * cfg.num_heads
                 * cfg.head_dim)
  model = float(cfg.flops_per_token(seq)) * tokens
  return executed, model


def _read_rate(hw: HardwareProfile, cached: bool) -> float:
  if cached and hw.disk_read_cached_gbps:
    return hw.disk_read_cached_gbps * _GB
  return hw.disk_read_gbps * hw.disks * _GB


def _write_rate(hw: HardwareProfile, cached: bool) -> float:
  if cached and hw.disk_write_cached_gbps:  # the kernel flushes in the background (no fsync)
    return hw.disk_write_cached_gbps * _GB
  return hw.disk_write_gbps * hw.disks * _GB


def _step_time(p: Placement, hw: HardwareProfile, times: dict, sizes: StateSizes,
               devices: Devices, cached: bool, host_opt: bool,
               forward_phase: dict | None = None) -> tuple:
  """(step seconds, bottleneck) of placement `p` from the parts' `times` (per device): summed on
  the CPU backend, overlapped on accelerators (see the module docstring's TIME). `forward_phase`
  (exact clipping: the layer updates wait for the next forward): the forward's share of the
  compute and the seconds of h2d, d2h and disk its phase carries."""
  n, local = devices.count, devices.local
  compute, optimizer, h2d, d2h, disk, dispatch = (
      times[k] for k in ('compute', 'optimizer', 'h2d', 'd2h', 'disk', 'dispatch'))
  comm = times.get('interconnect', 0.0)
  device_bound = 'compute' if compute >= comm else 'interconnect'
  if not p.streamed:
    return compute + optimizer + comm + dispatch, device_bound
  if not hw.overlap:
    # The CPU backend: compute (on all cores), copies and the optimizer run one after another.
    # The NVMe tier's reader/writer threads run beside the compute, but their work (TensorStore
    # chunk I/O and page-cache copies, CPU-bound on these machines) takes its share of the cores:
    # it costs disk / cores of step time.
    step = compute + optimizer + h2d + d2h + comm + disk / hw.host_cores + dispatch
    bottleneck = max((device_bound, max(compute, comm)),
                     ('host optimizer' if host_opt else 'optimizer', optimizer),
                     ('host<->device', h2d + d2h), ('disk', disk), key=lambda x: x[1])[0]
  else:
    gw = sizes.group_params(p.layers_per_group) / n
    fill = 2 * (gw / (hw.h2d_gbps * _GB)
                + (local * gw / _read_rate(hw, cached) if p.params == 'nvme' else 0))
    # The collectives run in the device's calls, before and after their compute; without a
    # peer link they also cross the host link.
    device_opt, host_opt_s = (0, optimizer) if host_opt else (optimizer, 0)
    link_comm = comm if hw.interconnect_shares_host_link else 0
    device_work = compute + comm + device_opt
    link = max(h2d, d2h) + link_comm
    if forward_phase is not None:
      # Updates wait for the global norm, then for the next forward: its phase overlaps their
      # transfers, disk I/O and optimizer with the forward's compute, the rest of the step the
      # rest. The pipeline overlaps within a phase, not across the head between them.
      f, share = forward_phase, forward_phase['compute_share']
      phases = [{device_bound: share * (compute + comm) + device_opt,
                 'host<->device': max(f['h2d'], f['d2h']), 'disk': f['disk'],
                 'host optimizer': host_opt_s},
                {device_bound: (1 - share) * (compute + comm),
                 'host<->device': max(h2d - f['h2d'], d2h - f['d2h']) + link_comm,
                 'disk': disk - f['disk']}]
      step = sum(max(phase.values()) for phase in phases) + fill + dispatch
      return step, _phase_bottleneck(phases)
    step = max(device_work, link, disk, host_opt_s) + fill + dispatch
    resources = {device_bound: device_work, 'host<->device': link, 'disk': disk,
                 'host optimizer': host_opt_s}
    bottleneck = max(resources.items(), key=lambda x: x[1])[0]
  return step, bottleneck


def _phase_bottleneck(phases: list[dict]) -> str:
  """The bottleneck of a step in two phases ({resource: seconds} of the forward, and of the rest
  of the step: `_step_time`), each bound by its slowest resource: that of the longer phase, and
  the other phase's where it differs ('compute (disk in the forward phase)': whole-step totals
  called a step whose forward waits on the disk 'compute')."""
  bounds = [max(phase.items(), key=lambda x: x[1]) for phase in phases]
  names = ('the forward phase', 'the rest of the step')
  major = max(range(2), key=lambda i: bounds[i][1])
  other = 1 - major
  if bounds[other][0] == bounds[major][0] or bounds[other][1] <= 0:
    return bounds[major][0]
  return f'{bounds[major][0]} ({bounds[other][0]} in {names[other]})'


def _disk_cached(rows: list, hw: HardwareProfile, budgets: dict, local: int) -> bool:
  """Whether reads hit the page cache: the disk-resident state fits in the RAM the plan leaves
  free."""
  nvme_bytes = sum(r.bytes for r in rows if r.tier == 'nvme' and 'checkpoint' not in r.item)
  host_free = budgets.get('host', 0) - sum(r.bytes for r in rows if r.tier == 'host')
  if hw.unified_memory:
    host_free -= local * sum(r.bytes for r in rows if r.tier == 'device')
  return nvme_bytes > 0 and nvme_bytes < host_free


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What a placement's step holds, moves and computes whatever the hardware: the part of a plan
  that every hardware profile a search plans for shares (`step_shape`)."""
  rows: tuple  # (Row, ...): per device (device rows) and per process (host, nvme rows)
  moved: dict  # {h2d, d2h, read, write: bytes per step per device}, every stage's
  forward_moved: dict | None  # the same of the forward's phase (deferred updates)
  executed_flops: float  # per device, remat included
  model_flops: float  # of the whole step, every device
  forward_share: float | None  # the forward phase's share of the compute (deferred updates)
  calls: int  # jitted calls per step
  collectives: dict  # {all-gather, reduce-scatter: bytes per step} (N > 1 devices)
  init_programs: int  # `init_programs`
  write_behind_bytes: float  # Placement.write_budget_bytes (NVMe placements)
  staged_bytes: float  # per process: NVMe reads staged in the pinned pool (pinned_pool_rows)


def step_shape(cfg: ModelConfig, sizes: StateSizes, p: Placement, *, micro: int, batch: int,
               seq: int, clipping: bool, checkpoint_copies: int = 0,
               devices: Devices = Devices(), snapshots_copied: bool = False) -> StepShape:
  """The StepShape of placement `p` (make_plan's arguments; the batch is global)."""
  n = devices.count
  executed, model_flops = step_flops(cfg, p, micro, batch // n, seq)  # per device
  schedule = StepSchedule(p, cfg, micro, clipping) if p.streamed else None
  stages = stage_traffic(cfg, sizes, p, micro, batch, seq, clipping, n)
  deferred = schedule is not None and schedule.deferred_updates
  return StepShape(
      rows=tuple(_memory_rows(cfg, sizes, p, micro, batch, seq, clipping, checkpoint_copies,
                              devices, snapshots_copied)),
      moved=_sum_stages(stages),
      forward_moved=_sum_stages(stages, FORWARD_PHASE) if deferred else None,
      executed_flops=executed, model_flops=model_flops * n,
      forward_share=forward_flops(cfg, micro, batch // n, seq) / executed if deferred else None,
      calls=1 if schedule is None else sum(schedule.jitted_calls().values()),
      collectives=collective_bytes(cfg, sizes, p, micro) if n > 1 else {},
      init_programs=init_programs(cfg, p),
      write_behind_bytes=p.write_budget_bytes(cfg) if p.uses_nvme else 0.0,
      staged_bytes=p.staged_reads_bytes(cfg) * devices.local / n)  # the local devices' shards


def make_plan(cfg: ModelConfig, sizes: StateSizes, p: Placement, hw: HardwareProfile, *,
              micro: int, batch: int, seq: int, clipping: bool, budgets: dict,
              checkpoint_copies: int = 0, devices: Devices = Devices(),
              baseline_bytes: float | None = None, shapes: dict | None = None,
              fresh_init: bool = True, snapshots_copied: bool = False) -> Plan:
  """The plan of placement `p` for M = `micro` microbatches of the global `batch` x `seq` tokens
  on `devices` (per device and per process, the module docstring's N DEVICES). `baseline_bytes`:
  the runtime baseline measured in this process (`measured_baseline_bytes`); None: the
  profile's figure. `shapes`: a dict that keeps each StepShape for the next make_plan of the
  same arguments (a search over several hardware profiles computes each once). `fresh_init`
  False: the state is read into place (a resume, init.from_hf, init.from_run), leaf by leaf, so
  the jitted init's temporaries (INIT_ROW) never exist. `snapshots_copied`: the checkpoints are
  on another filesystem than offload.dir: `checkpoint_copies` (one) is a snapshot copied there."""
  args = dict(micro=micro, batch=batch, seq=seq, clipping=clipping,
              checkpoint_copies=checkpoint_copies, devices=devices,
              snapshots_copied=snapshots_copied)
  key = (cfg, sizes, p, *args.values())
  shape = None if shapes is None else shapes.get(key)
  if shape is None:
    shape = step_shape(cfg, sizes, p, **args)
    if shapes is not None:
      shapes[key] = shape
  n, local = devices.count, devices.local
  rows = _process_rows(shape, hw, fresh_init, baseline_bytes)
  moved = dict(shape.moved)
  # On the CPU backend the process's devices are the same cores: their work adds up.
  shared = 1 if hw.overlap else local
  rate = hw.tflops(cfg.dtype, cfg.matmul_precision, cfg.d_model) * 1e12
  params = cfg.num_params
  layer_params = cfg.num_layers * cfg.params_per_layer
  host_opt = p.streamed and p.optimizer_on == 'host'
  # Each device updates its 1/N shard; the host optimizer updates all n local shards on one CPU.
  optimizer = (local * layer_params / n / (hw.host_adam_gparams * _GB)
               + shared * (params - layer_params) / n / (hw.device_adam_gparams * _GB)
               if host_opt else shared * params / n / (hw.device_adam_gparams * _GB))
  cached = _disk_cached(rows, hw, budgets, local)
  # Seconds of bytes `m` over the links and, the process's drives serving the shards of its n
  # devices, the disk.
  seconds = lambda m: {'h2d': shared * m['h2d'] / (hw.h2d_gbps * _GB),
                       'd2h': shared * m['d2h'] / (hw.d2h_gbps * _GB),
                       'disk': local * (m['read'] / _read_rate(hw, cached)
                                        + m['write'] / _write_rate(hw, cached))}
  times = {'compute': shared * shape.executed_flops / rate, 'optimizer': optimizer,
           **seconds(moved), 'dispatch': shape.calls * hw.dispatch_s}
  if n > 1:
    link_rate, _ = hw.link_gbps()
    times['interconnect'] = (n - 1) / n * sum(shape.collectives.values()) / (link_rate * _GB)
  forward_phase = None
  if shape.forward_moved is not None:
    # What the forward's phase of the step carries: its share of the compute, and the seconds
    # of what its stages move (the embedding's, the forward's, the layer updates waiting for it).
    forward_phase = dict(seconds(shape.forward_moved), compute_share=shape.forward_share)
  step, bottleneck = _step_time(p, hw, times, sizes, devices, cached, host_opt, forward_phase)
  # The devices' peak together; CPU devices of one process are the same cores.
  peak = hw.peak(cfg.dtype, cfg.matmul_precision, cfg.d_model) * n / shared
  return Plan(placement=p, microbatches=micro, batch_size=batch, seq_len=seq, rows=rows,
              budgets=budgets, traffic=moved, times=times, step_time_s=step,
              bottleneck=bottleneck, flops_per_step=shape.model_flops, peak_tflops=peak,
              write_behind_bytes=shape.write_behind_bytes, devices=devices,
              collectives=dict(shape.collectives), staged_bytes=shape.staged_bytes)


# -------------------------------------------------------------------------------------------------
# The process's own memory.
# -------------------------------------------------------------------------------------------------

def describes_this_machine(hw: HardwareProfile) -> bool:
  """Whether `hw` is a profile of the devices this process runs on (auto-detected, the `cpu`
  preset on the CPU backend, a GPU preset on that GPU, a calibration made here), not of another
  machine (`--config.hardware=h100` planned on a CPU)."""
  return hw.device_kind == layout.device_kind()


def measured_baseline_bytes(hw: HardwareProfile) -> float | None:
  """The runtime baseline of a plan for this machine: this process's RSS when it plans (Python,
  JAX/XLA with its backend up, every library imported so far, the planner's own shape traces).
  The run that follows holds all of it before its state, so it is measured rather than taken
  from the profile, whose figure is one machine's (the library stack, its versions, whether torch
  is installed all move it). None, so the profile's figure is used, when `hw` is another
  machine's, when RSS cannot be read, and in a multi-process run, whose processes must all reach
  the same plan."""
  if not describes_this_machine(hw) or jax.process_count() > 1:
    return None
  rss = runtime.process_rss_bytes()
  return float(rss) if rss else None


def init_programs(cfg: ModelConfig, p: Placement) -> int:
  """Programs a fresh init compiles for its pieces: the streamed engine's vocabulary chunks (of
  the embedding, and of the head when untied), one per chunk size (their start is traced), and
  the final norm; none for the resident init (one program for the whole state)."""
  if not p.streamed:
    return 0
  sizes = {stop - start for start, stop in p.vocab_slices(cfg)}
  return len(sizes) * (1 if cfg.tie_embeddings else 2) + 1


def runtime_rows(hw: HardwareProfile, baseline_bytes: float | None = None,
                 programs: int = 0) -> list:
  """[Row] of what the process holds besides the train state and the stages' working sets, once
  per process: the runtime baseline (measured in this process, or the profile's runtime_host_gb
  for another machine) and what a run adds to it: compiled executables, XLA's thread pools, the
  data pipeline, the metrics writers (the profile's programs_host_gb, measured on CPU by
  bench/memory_accuracy.py; see hardware.py), plus `programs` compiled one per piece
  (`init_programs`) at PROGRAM_HOST_BYTES each."""
  if baseline_bytes is None:
    baseline = Row('host', RUNTIME_ROW, hw.runtime_host_gb * _GB,
                   'hardware profile: runtime_host_gb')
  else:
    baseline = Row('host', RUNTIME_ROW, baseline_bytes, "measured: this process's RSS at plan time")
  formula = 'hardware profile: programs_host_gb' + (
      f' + {programs} init programs (one per vocabulary chunk size) × '
      f'{PROGRAM_HOST_BYTES / 1e6:g} MB'
      if programs else '')
  return [baseline, Row('host', PROGRAMS_ROW, hw.programs_host_gb * _GB
                        + programs * PROGRAM_HOST_BYTES, formula)]


def _process_rows(shape: StepShape, hw: HardwareProfile, fresh_init: bool,
                  baseline_bytes: float | None) -> list:
  """The step's rows (the jitted init's only for a `fresh_init`), the process's own
  (runtime_rows) and the pinned pool's growth beyond them (pinned_pool_rows)."""
  rows = [r for r in shape.rows if fresh_init or r.item != INIT_ROW]
  rows += runtime_rows(hw, baseline_bytes, shape.init_programs)
  return rows + pinned_pool_rows(rows, hw, shape.staged_bytes)


def pinned_pool_bytes(need: float, cap: float) -> float:
  """Bytes XLA:GPU's pinned host pool holds once `need` bytes live in it: the pool is a BFC
  allocator with allow_growth (xla_gpu_host_bfc), which takes regions of 2 MiB, 4, 8, ...
  (each twice the last, a larger request rounding up to its power of two) and never gives one
  back, the last cut at `cap` (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB): up to about 2 x `need`."""
  region, total = BFC_FIRST_REGION, 0.0
  while total < need and total < cap:
    total += min(region, cap - total)
    region *= 2
  return total


def pinned_bytes(rows: list) -> float:
  """Bytes of the host rows that live in pinned memory: all but the NVMe staging buffer (numpy),
  the process's own (runtime, programs) and the pool's growth beyond them."""
  return sum(r.bytes for r in rows if r.tier == 'host'
             and r.item not in (STAGING_ROW, RUNTIME_ROW, PROGRAMS_ROW, POOL_ROW))


def pinned_pool_rows(rows: list, hw: HardwareProfile, staged: float = 0.0) -> list:
  """On an accelerator, the [Row] of what XLA's pinned pool holds beyond the pinned rows (the host
  rows but the NVMe staging buffer, numpy, and the process's own), `pinned_pool_bytes` against
  the cap in force: the user's, else this machine's RAM (megatrain_jax/__init__.py). Its regions
  grow to 125 GiB for 7b's 72 GiB of layer weights and Adam state under a 128 GiB cap.

  The NVMe tier's reads reach the device as `device_put` of numpy (pageable) arrays, which XLA's
  GPU client copies into a buffer of that pool first (its should_stage_host_to_device_transfers:
  a DMA needs pinned memory): `staged` bytes (Placement.staged_reads_bytes) are in flight there
  at once, and the regions they take stay in the pool."""
  if hw.unified_memory:
    return []
  need = pinned_bytes(rows)
  cap = pinned_limit_bytes() or hw.host_memory_gb * 2**30
  # A cap under the pinned rows and the reads in flight leaves no room: the pinned check refuses.
  growth = max(pinned_pool_bytes(need + staged, cap), need + staged) - need
  if growth <= 0:
    return []
  what = 'NVMe reads staged for the device, ' if staged else ''
  return [Row('host', POOL_ROW, growth,
              f'{what}doubling regions, kept: {PINNED_LIMIT_ENV}=N (GiB) near the pinned rows '
              'stops them there')]


# -------------------------------------------------------------------------------------------------
# Budgets, auto search, refusal.
# -------------------------------------------------------------------------------------------------

def pinned_limit_bytes() -> float | None:
  """XLA:GPU's cap on pinned host memory when the user set it (GiB), or XLA's 64 GiB where JAX
  made its GPU client before the package was imported; None when megatrain_jax raised it to the
  machine's RAM (megatrain_jax/__init__.py), which the host budget covers."""
  if not megatrain_jax.PINNED_LIMIT_FROM_USER:
    # JAX made its client before the package could raise the cap: XLA's default is in force.
    return (megatrain_jax.XLA_DEFAULT_PINNED_LIMIT_GB * 2**30
            if megatrain_jax.XLA_DEFAULTS_IN_FORCE else None)
  value = os.environ.get(PINNED_LIMIT_ENV, '')
  try:
    return float(value) * 2 ** 30
  except ValueError:
    raise ConfigError(f'{PINNED_LIMIT_ENV}={value!r} is not a whole number of GiB. Set it to the '
                      'pinned host memory XLA may use (e.g. 512), or unset it: megatrain_jax then '
                      'raises it to this machine\'s RAM.') from None


def device_fraction(hw: HardwareProfile) -> float:
  """Share of device memory JAX may use: XLA_PYTHON_CLIENT_MEM_FRACTION on accelerators."""
  if hw.unified_memory:
    return DEVICE_USABLE_FRACTION
  default = (megatrain_jax.XLA_DEFAULT_MEM_FRACTION if megatrain_jax.XLA_DEFAULTS_IN_FORCE
             else DEVICE_USABLE_FRACTION)  # JAX's client made before the package could set it
  value = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', str(default))
  try:
    fraction = float(value)
  except ValueError:
    fraction = -1.0
  if not 0 < fraction <= 1:
    raise ConfigError(f'XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a fraction in (0, 1]. '
                      'Set it to the share of GPU memory JAX may take, e.g. .9, or unset it.')
  return fraction


def budgets_for(hw: HardwareProfile, offload, disk_free_gb: float | None,
                sharing: int = 1) -> dict:
  """{tier: bytes} a process plans with: offload.*_memory_gb where set (the process's own), else
  the profile's sizes, the machine's RAM and drives split between the `sharing` processes that
  run on it (each planned them whole: srun's one process per GPU put 8 plans in one RAM)."""
  # A CPU backend's device memory is the same RAM.
  device = (offload.get('device_memory_gb') or hw.device_memory_gb * device_fraction(hw)
            / (sharing if hw.unified_memory else 1))
  host = (offload.get('host_memory_gb') or hw.host_memory_gb * HOST_USABLE_FRACTION / sharing)
  disk = (disk_free_gb if disk_free_gb is not None else hw.disk_gb) / sharing
  budgets = {'device': device * _GB, 'host': host * _GB, 'nvme': disk * _GB}
  pinned = None if hw.unified_memory else pinned_limit_bytes()
  if hw.unified_memory:
    budgets['_unified'] = True
  elif pinned is not None:
    budgets['_pinned'] = pinned
  return budgets


def _choices(value, options):
  return list(options) if value == AUTO else [value]


def _group_sizes(num_layers: int) -> list:
  sizes = {1, num_layers}
  k = 2
  while k < num_layers:
    sizes.add(k)
    k *= 2
  return sorted(sizes)


def candidates(offload, cfg: ModelConfig, micro_options: list):
  """Every placement the config's fixed fields allow (auto fields expanded)."""
  num_layers = cfg.num_layers
  base = dataclasses.asdict(Placement.from_config(offload, cfg, allow_auto=True))
  for params in _choices(base['params'], TIERS):
    for opt in _choices(base['opt_state'], TIERS):
      for embed in _choices(base['embed_head'], TIERS):
        resident = params == opt == embed == 'device'
        for act in (['device'] if resident and base['activations'] == AUTO
                    else _choices(base['activations'], MEMORY_TIERS)):
          streamed = not (resident and act == 'device')
          opt_places = _choices(base['optimizer_on'], ('device', 'host'))
          if base['optimizer_on'] == AUTO and 'device' in (params, opt):
            opt_places = ['device']
          ks = ([1] if not streamed and base['layers_per_group'] == 0
                else _group_sizes(num_layers) if base['layers_per_group'] == 0
                else [base['layers_per_group']])
          depths = ([1] if not streamed and base['prefetch_depth'] == 0
                    else [1, 2, 3] if base['prefetch_depth'] == 0 else [base['prefetch_depth']])
          for on in opt_places:
            for k in ks:
              for depth in depths:
                placement = dataclasses.replace(
                    Placement(), **{**base, 'params': params, 'opt_state': opt,
                                    'embed_head': embed, 'activations': act,
                                    'optimizer_on': on, 'layers_per_group': k,
                                    'prefetch_depth': depth})
                if placement.host_buffer_gb == 0:  # auto: what the NVMe pipeline needs
                  placement = dataclasses.replace(
                      placement, host_buffer_gb=placement.auto_host_buffer_gb(cfg) or 1.0)
                for micro in micro_options:
                  yield micro, placement


def _offloaded_bytes(plan: Plan) -> float:
  return sum(r.bytes for r in plan.rows if r.tier in ('host', 'nvme'))


def kept_checkpoints(ckpt) -> int:
  """Checkpoints a run keeps at most: checkpoint.keep, one more with checkpoint.keep_best (the
  best may be older than the newest `keep`), none with every = -1."""
  if ckpt is None or ckpt.every < 0:
    return 0
  return ckpt.keep + int(bool(ckpt.get('keep_best', False)))


def checkpoints_written(ckpt, steps: int, step: int = 0) -> int:
  """Checkpoints a run at `step` writes up to `steps`: every `every` steps and at the end
  (every = 0: the end only; every = -1: none). Time-based and preemption checkpoints may add one
  more before the end."""
  if ckpt is None or ckpt.every < 0 or steps <= step:
    return 0
  every = ckpt.every
  written = 1 if every == 0 else steps // every - step // every + int(steps % every != 0)
  return written + int(ckpt.get('every_minutes', 0.0) > 0)


def checkpoint_copies(ckpt, steps: int) -> int:
  """Checkpoints that pin a copy of the NVMe stores: `kept_checkpoints`, or fewer when the run
  writes fewer (`checkpoints_written`), counted while keep allows."""
  return min(kept_checkpoints(ckpt), checkpoints_written(ckpt, steps))


def plan_run(config, hw: HardwareProfile, disk_free_gb: float | None = None,
             devices: Devices | None = None, suggest_presets: bool = True,
             fresh_init: bool | None = None, snapshots_copied: bool = False) -> Plan:
  """The plan for `config`: its placement if fully specified, else the best `auto` choice, on
  `devices` (default: parallel.devices, `devices_for`). `fresh_init`: whether the state starts
  from a jitted init (make_plan); None: unless config.init names a checkpoint to start from.
  `snapshots_copied`: the workdir's checkpoints are on another filesystem than offload.dir, which
  then holds one snapshot of the NVMe stores, not one per kept checkpoint (make_plan).

  Raises NoPlacementFits (a ConfigError) when nothing fits, naming needed vs available per tier,
  what to change, and (`suggest_presets`: one more search per preset) the hardware presets it
  would fit.
  """
  devices = devices or devices_for(config)
  shapes = {}  # each candidate's StepShape, shared by the presets' searches
  if fresh_init is None:
    init = config.get('init') or {}
    fresh_init = not (init.get('from_hf') or init.get('from_run'))
  plans, rejected, invalid = _search(config, hw, disk_free_gb, devices, shapes, fresh_init,
                                     snapshots_copied)
  if not plans:
    if not rejected:
      raise invalid[0]
    cfg = model_lib.ModelConfig.from_config_dict(config.model)
    closest = min(rejected, key=_overshoot)
    more = (_devices_that_fit(config, hw, disk_free_gb, devices, fresh_init, snapshots_copied)
            if 'device' in closest.over_budget() and not closest.budgets.get('_unified') else None)
    message = refusal_message(cfg, closest, more)
    pinned_only = [p for p in rejected if list(p.over_budget()) == [PINNED_ROW]]
    if pinned_only:  # the cap the user set is all that stands in the way
      best = max(pinned_only, key=lambda p: p.tokens_per_s)
      gib = math.ceil(best.over_budget()[PINNED_ROW][0] / 2 ** 30)
      message += (f'\nRaising {PINNED_LIMIT_ENV} to {gib} (GiB) would fit: '
                  f'{best.placement.summary()}, M={best.microbatches}, '
                  f'{best.step_time_s:,.4g} s/step.')
    if suggest_presets:
      message += presets_that_fit(config, hw, devices, shapes)
    raise NoPlacementFits(message, closest)
  return _fastest(plans)


def _search(config, hw: HardwareProfile, disk_free_gb: float | None, devices: Devices,
            shapes: dict | None = None, fresh_init: bool = True,
            snapshots_copied: bool = False) -> tuple:
  """(plans that fit, plans that don't, ConfigErrors of invalid candidates) of every candidate
  (`shapes`, `snapshots_copied`: make_plan's)."""
  cfg = model_lib.ModelConfig.from_config_dict(config.model)
  train, offload = config.train, config.offload
  sizes = state_sizes(cfg, train_key(train))
  budgets = budgets_for(hw, offload, disk_free_gb, devices.sharing)
  clipping = train.grad_clip > 0
  ckpt = config.get('checkpoint')
  # train.epochs: the steps are counted once the data is prepared; plan for keep copies.
  copies = checkpoint_copies(ckpt, 1 << 62 if train.get('epochs') else train.steps)
  copies = min(copies, 1) if snapshots_copied else copies
  micro_options = ([1, 2, 4, 8, 16, 32, 64] if train.microbatches == 0
                   else [train.microbatches])
  # Once the shapes are traced (state_sizes): what this process holds now, for every candidate.
  baseline = measured_baseline_bytes(hw)
  plans, rejected, invalid = [], [], []
  for micro, candidate in candidates(offload, cfg, micro_options):
    for placement in _option_variants(candidate, clipping):  # every variant that fits competes
      try:  # e.g. a group too large for the NVMe staging buffer, or no pinned_host memory
        placement.check(cfg)
      except ConfigError as e:
        invalid.append(e)
        break
      plan = make_plan(cfg, sizes, placement, hw, micro=micro, batch=train.batch_size,
                       seq=train.seq_len, clipping=clipping, budgets=budgets,
                       checkpoint_copies=copies, devices=devices, baseline_bytes=baseline,
                       shapes=shapes, fresh_init=fresh_init, snapshots_copied=snapshots_copied)
      (plans if plan.fits else rejected).append(plan)
  return plans, rejected, invalid


def _option_variants(placement: Placement, clipping: bool) -> list:
  """The candidate with its 'auto' options resolved, each planned by _search (the fastest that
  fits wins): offload.keep_layer_inputs (for K > 1, keeping the layer inputs: each layer's forward
  runs twice per step instead of three times; for K = 1 there is nothing to keep beyond the
  group's input) and offload.park_grads (gradients waiting for a deferred update on the device
  stay in device memory: no round trip through the host; else, or where that does not fit, in the
  weights' tier)."""
  keep = [placement.keep_layer_inputs]
  if placement.keep_layer_inputs == AUTO:
    keep = [True, False] if placement.layers_per_group > 1 else [False]
  park = [placement.park_grads]
  if placement.park_grads == AUTO:
    on_device_update = (clipping and placement.optimizer_on == 'device'
                        and placement.params != 'device')
    park = ['device', 'weights'] if on_device_update else ['weights']
  return [dataclasses.replace(placement, keep_layer_inputs=k, park_grads=g)
          for k in keep for g in park]


def _fastest(plans: list) -> Plan:
  best = max(p.tokens_per_s for p in plans)
  near = [p for p in plans if p.tokens_per_s >= 0.99 * best]
  return min(near, key=lambda p: (_offloaded_bytes(p), p.microbatches,
                                  p.placement.layers_per_group, p.placement.prefetch_depth))


# Presets a refusal tries, smallest device first; not 'cpu' (this machine's own sizes).
SUGGESTED_PRESETS = ('rtx4090', 'a100', 'h100', 'h200')


def presets_that_fit(config, hw: HardwareProfile, devices: Devices,
                     shapes: dict | None = None) -> str:
  """A refusal's last line: the GPU presets (other than `hw`) that the config fits on the same
  devices, with the fastest plan of each, as `--dry_run` would plan them (the preset's disk;
  `shapes`: make_plan's)."""
  fits, tried = [], [name for name in SUGGESTED_PRESETS if name != hw.name]
  for name in tried:
    preset = hardware.load_profile(name)
    plans, _, _ = _search(config, preset, preset.disk_gb, devices, shapes)
    if plans:
      best = _fastest(plans)
      fits.append(f'  --config.hardware={name} ({preset.device_memory_gb:g} GB device, '
                  f'{preset.host_memory_gb:,.0f} GB RAM, {preset.disk_gb:,.0f} GB disk): '
                  f'{best.step_time_s:,.1f} s/step, {best.placement.summary()}, '
                  f'M={best.microbatches}')
  on = f' on {devices.count} devices' if devices.count > 1 else ''
  if not fits:
    return f'\nNo hardware preset ({", ".join(tried)}) fits it either{on} with these settings.'
  return (f'\nIt fits these hardware presets{on} (a --dry_run with one of them plans for that '
          'machine):\n' + '\n'.join(fits))


class NoPlacementFits(ConfigError):
  """No candidate fits the budgets; `closest` is the plan that misses by the least."""

  def __init__(self, message: str, closest: Plan):
    super().__init__(message)
    self.closest = closest


def _overshoot(plan: Plan) -> float:
  """How far a plan is over its budgets, summed relative to each budget."""
  return sum(max(0.0, n / max(a, 1.0) - 1) for n, a in plan.over_budget().values())


def _devices_that_fit(config, hw: HardwareProfile, disk_free_gb: float | None,
                      devices: Devices, fresh_init: bool,
                      snapshots_copied: bool = False) -> int | None:
  """The fewest devices of 2N, 4N and 8N (those that split train.batch_size) on which some
  placement's device rows fit; None where none does: what the device holds whole (a gathered
  layer group, a vocabulary chunk, a microbatch of one sequence per device) does not shrink."""
  for factor in (2, 4, 8):
    count = factor * devices.count
    if config.train.batch_size % count:
      break
    more = dataclasses.replace(devices, count=count)
    plans, rejected, _ = _search(config, hw, disk_free_gb, more, fresh_init=fresh_init,
                                 snapshots_copied=snapshots_copied)
    if plans or any('device' not in p.over_budget() for p in rejected):
      return count
  return None


def refusal_message(cfg: ModelConfig, closest: Plan, devices_that_fit: int | None = None) -> str:
  """Why nothing fits (the closest plan's tiers over budget) and what would shrink each;
  `devices_that_fit`: the device count on which the device rows would fit (_devices_that_fit),
  None where more devices would not."""
  lines = [f'this config fits no placement on this hardware: {cfg.num_params:,} params '
           f'need {_gb(16 * cfg.num_params)} of FP32 state (params, grads, Adam m, v). '
           f'The closest placement ({closest.placement.summary()}, M={closest.microbatches}) '
           'needs:']
  for tier, (needed, available) in closest.over_budget().items():
    lines.append(f'  {tier}: {_gb(needed)} needed, {_gb(available)} available')
  tiers = closest.over_budget()
  hints = []
  if 'device' in tiers:  # only what would shrink this plan's device rows
    p = closest.placement
    n = closest.devices.count
    needed, available = tiers['device']
    batch = _batch_hint(closest)
    # Named first only where the batch's rows could close much of the gap.
    device = [batch] if _batch_bytes(closest) >= 0.25 * (needed - available) else []
    if devices_that_fit:
      device.append(f'shard the state over more devices (parallel.devices, now {n}; '
                    f'{devices_that_fit} would hold it)')
    if closest.microbatches > 1:  # streamed: each microbatch's hidden state stays on device;
      # resident: the gradient accumulator (4·P)
      device.append(f'lower train.microbatches (now {closest.microbatches})')
    if not p.streamed:
      device.append("stream the state (offload.params / offload.opt_state = 'host' or 'nvme')")
    if cfg.remat != 'full':
      device.append('use model.remat=full')
    if p.streamed and (p.layers_per_group > 1 or p.prefetch_depth > 1):
      device.append('set offload.layers_per_group=1 / offload.prefetch_depth=1')
    if p.keeps_layer_inputs and p.activations == 'device':
      device.append("set offload.keep_layer_inputs='false'")
    if p.streamed and 'device' in (p.embed_head, p.activations):
      device.append("set offload.embed_head='host' / offload.activations='host'")
    hints.append(' or '.join(device or [batch]) + ' (device memory)')
  if any('XLA_PJRT' in t for t in tiers):
    hints.append(f'raise {PINNED_LIMIT_ENV} (XLA\'s cap on pinned host memory) toward the RAM '
                 'you have')
  if 'host' in tiers:
    hints.append(_host_hint(closest, *tiers['host']))
    pool = sum(r.bytes for r in closest.rows if r.item == POOL_ROW)
    if pool:
      # The NVMe reads staged in the pool need their room under the cap too.
      pinned = pinned_bytes(closest.rows)
      staged = closest.staged_bytes
      hints.append(f'set {PINNED_LIMIT_ENV}={math.ceil((pinned + staged) * 1.05 / 2**30) + 1} '
                   f'before starting: XLA\'s pinned pool then stops near the {_gb(pinned)} '
                   f'pinned rows{" and staged NVMe reads" if staged else ""} instead of growing '
                   f'{_gb(pool)} beyond them')
  if 'nvme' in tiers:
    snapshots = [r.item for r in closest.rows if r.item.startswith('checkpoint snapshots (keep=')]
    keep = (', lower checkpoint.keep (each kept checkpoint pins a copy of the NVMe stores)'
            if snapshots and not snapshots[0].endswith('(keep=1)') else '')
    hints.append(f'point offload.dir at a disk with more free space{keep}, or keep '
                 'offload.opt_state (2/3 of them) on host')
  hints.append('or choose hardware with more memory (--config.hardware, '
               '--config.offload.device_memory_gb / host_memory_gb)')
  lines.append('Fix: ' + '; '.join(hints) + '.')
  return '\n'.join(lines)


def _batch_hint(closest: Plan) -> str:
  """Fewer sequences per microbatch, or shorter ones where each device computes one already
  (train.batch_size splits over the devices: at least 1 sequence each)."""
  if closest.batch_size > closest.devices.count:
    return f'lower train.batch_size (now {closest.batch_size})'
  return f'lower train.seq_len (now {closest.seq_len})'


def _host_hint(closest: Plan, needed: float, available: float) -> str:
  """What would shrink the refused plan's host rows: its layer inputs waiting on the host where
  they are much of the gap (one per group and microbatch: fewer microbatches, a smaller batch),
  the state it still keeps there, its NVMe staging, its kept layer inputs."""
  p, hints = closest.placement, []
  waiting = sum(r.bytes for r in closest.rows if r.tier == 'host' and 'activation' in r.item)
  if waiting >= 0.25 * (needed - available):
    if closest.microbatches > 1:
      hints.append(f'lower train.microbatches (now {closest.microbatches}: each microbatch\'s '
                   'layer inputs wait on the host)')
    hints.append(_batch_hint(closest))
  if 'host' in (p.params, p.opt_state):
    hints.append("move state to disk (offload.params='nvme', offload.opt_state='nvme')")
  if p.uses_nvme:
    hints.append('lower offload.host_buffer_gb')
  if p.keeps_layer_inputs and p.activations == 'host':
    hints.append("set offload.keep_layer_inputs='false'")
  return ' or '.join(hints or ['move the activations to the device (offload.activations)']) + (
      ' (host memory)')


# Device rows that grow with the batch (B·S): what lower train.batch_size or seq_len shrink.
_BATCH_ROWS = ('activation', 'logits', 'hidden', 'working set')


def _batch_bytes(plan: Plan) -> float:
  return sum(r.bytes for r in plan.rows
             if r.tier == 'device' and any(word in r.item for word in _BATCH_ROWS))


def _gb(n: float) -> str:
  """Bytes as GB with enough digits to tell small numbers apart."""
  return f'{n / _GB:,.2f} GB' if n >= 10 * 1e6 else f'{n / _GB:.6f} GB'


def format_plan(plan: Plan, hw: HardwareProfile) -> str:
  """The profile and where it came from, the devices, the memory table, then predicted time,
  throughput, MFU and bottleneck; the last two lines are machine-readable."""
  out = [f'hardware: {hw.describe()}',
         *plan.devices.describe(hw, plan.batch_size),
         f'placement: {plan.placement.summary()}, microbatches {plan.microbatches}',
         '', f'{"tier":<8}{"item":<44}{"GB":>12}  formula']
  for tier in ('device', 'host', 'nvme'):
    rows = [r for r in plan.rows if r.tier == tier]
    for r in rows:
      out.append(f'{tier:<8}{r.item:<44}{r.bytes / _GB:>12,.3f}  {r.formula}')
    budget = plan.budgets[tier]
    used = plan.used(tier)
    note = ' (shares RAM with device)' if tier == 'host' and plan.budgets.get('_unified') else ''
    if tier == 'device' and plan.devices.count > 1:
      note = ' (each device)'
    out.append(f'{tier:<8}{"total / available" + note:<44}{used / _GB:>12,.3f}  of '
               f'{budget / _GB:,.1f} GB')
    if tier == 'host' and '_pinned' in plan.budgets:
      pinned = plan.pinned_used()  # the process's own rows and the NVMe staging: unpinned
      out.append(f'{tier:<8}{"pinned / " + PINNED_LIMIT_ENV:<44}{pinned / _GB:>12,.3f}  of '
                 f'{plan.budgets["_pinned"] / _GB:,.1f} GB')
  t = plan.times
  n = plan.devices.count
  each = ' (each device; the process\'s drives serve its devices\' shards)' if n > 1 else ''
  out += ['', 'per step: ' + ', '.join(f'{k} {v:.4g} s' for k, v in t.items()),
          f'traffic per step{each}: h2d {plan.traffic["h2d"] / _GB:,.2f} GB, d2h '
          f'{plan.traffic["d2h"] / _GB:,.2f} GB, disk read {plan.traffic["read"] / _GB:,.2f} GB, '
          f'disk write {plan.traffic["write"] / _GB:,.2f} GB']
  if plan.collectives:
    c = plan.collectives
    out.append(f'collectives per step (whole bytes; each device receives (N - 1)/N = {n - 1}/{n}): '
               f'all-gather {c["all_gather"] / _GB:,.2f} GB, reduce-scatter '
               f'{c["reduce_scatter"] / _GB:,.2f} GB')
  out += [f'predicted: {plan.tokens_per_s:,.1f} tokens/s, MFU {100 * plan.mfu:.1f}% '
          f'(of {plan.peak_tflops:,.4g} peak TFLOP/s{f" of {n} devices" if n > 1 else ""}), '
          f'bottleneck: {plan.bottleneck}',
          f'predicted_host_peak_gb: {plan.host_peak_bytes / _GB:.3f}',
          f'predicted_step_time_s: {plan.step_time_s:.6g}']
  return '\n'.join(out)
