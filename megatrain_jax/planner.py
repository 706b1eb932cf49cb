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
  resident, device:  params 4·P, Adam 8·P, gradients 4·P (+4·P accumulator when M > 1),
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
                     G·M·B·S·D·c unless offload.activations = host; the head stage's
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
                     hard-links the stores, and the next write-back unshares every file.
  Budgets: device 90% of its memory; host 85% of RAM; nvme the free space at offload.dir.
  offload.device_memory_gb / host_memory_gb override the first two. On a GPU, pinned host
  memory (host rows but the NVMe staging buffer, which is numpy) must also stay under
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB when the user set it (megatrain_jax/__init__.py otherwise
  raises XLA's 64 GiB default to the machine's RAM).
  One layer's internals (what its backward needs when nothing is recomputed, per microbatch):
    B·S·c·(6·D + 3·H·Dh + 3·Hkv·Dh + 4·F) + 2·B·H·Q·S·c   (attention scores and probabilities
    of one block of Q = min(S, model.attention_chunk) queries; Q = S when unchunked)

TRAFFIC (bytes moved per step; `traffic` sums what each stage of schedule.py declares, the same
StepSchedule the engine takes its decisions from, and tests check it against the engine's own
counters exactly):
  weights off-device are fetched twice (forward, backward), three times with exact clipping and
  the device optimizer (once more for the update); the Adam state crosses to the device optimizer
  and back; the host optimizer receives each gradient (d2h) and touches nothing on the device.

TIME (seconds per step):
  compute = FLOPs / achieved layer FLOP/s, with FLOPs = tokens × (layer forwards × 2·(P_l − 2D)
            + attention 2·S·H·Dh per layer) + head 6·D·V per token. A layer's forward runs
            3 (fwd + 2× in bwd) + recomputes: resident remat full +1; streamed K = 1 +1 (the group
            backward recomputes the layer from its input); streamed K > 1 +1 (group) +1 (remat);
            when S > model.attention_chunk, the attention part once more (query blocks are
            recomputed in their backward).
  optimizer = params / AdamW rate (device or host);  copies = bytes / link rate;
  disk = read / read rate + write / write rate. When the NVMe stores fit in the RAM the plan leaves
  free, the page cache holds them: reads and writes run at the cached rates (the write-backs are
  not fsynced; the kernel flushes them behind the step).
  On an accelerator (profile.overlap) the pipeline overlaps them: a step takes
    max over resources (compute + device optimizer, h2d, d2h, disk, host optimizer)
    + the pipeline fill (the first group's fetch in the forward and in the backward)
  and with exact clipping the updates form a phase of their own after the backward.
  On the CPU backend the same cores do everything, so the terms add up, except disk I/O, whose
  background threads share the cores with compute: it adds disk / cores.

AUTO PLACEMENT: every `auto` field is searched (tiers, optimizer location, K, prefetch depth; M
when train.microbatches = 0; the NVMe staging buffer when offload.host_buffer_gb = 0). A candidate
must fit every tier's budget; the fastest tokens/s wins, and among candidates within 1% of it the
one that offloads the fewest bytes, then the smallest M, group and depth (less memory for the
same speed).
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
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax import partition
from megatrain_jax.errors import ConfigError
from megatrain_jax.hardware import HardwareProfile
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import AUTO, MEMORY_TIERS, TIERS, Placement
from megatrain_jax.schedule import (BACKWARD_TO_UPDATE, FORWARD_TO_BACKWARD, STAGING_ROW, STATE,
                                    Row, StateSizes, StepSchedule, Traffic, hidden_bytes,
                                    layer_internal_bytes, logits_bytes)

RUNTIME_ROW = 'runtime (Python, JAX/XLA, compiled code)'

_GB = 1e9
# Of the device's memory: what JAX's allocator gets (XLA_PYTHON_CLIENT_MEM_FRACTION; 0.9 unless set,
# megatrain_jax/__init__.py), less nothing more: XLA's workspace comes out of the same pool.
DEVICE_USABLE_FRACTION = 0.9
HOST_USABLE_FRACTION = 0.85  # the OS, Python, the data pipeline and the page cache
PINNED_ROW = 'host (pinned, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)'


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
  names = ('lr', 'warmup_steps', 'steps', 'min_lr_ratio', 'weight_decay', 'b1', 'b2', 'eps')
  return tuple((n, train[n]) for n in names)


# -------------------------------------------------------------------------------------------------
# Activations.
# -------------------------------------------------------------------------------------------------

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
  peak_tflops: float
  write_behind_bytes: float = 0.0  # NVMe writes queued at most (placement.write_budget_bytes)

  @property
  def tokens_per_step(self) -> int:
    return self.microbatches * self.batch_size * self.seq_len

  @property
  def tokens_per_s(self) -> float:
    return self.tokens_per_step / self.step_time_s

  @property
  def mfu(self) -> float:
    """Model FLOPs (6·N·T + attention, no recompute) / step time / the profile's peak."""
    return self.flops_per_step / self.step_time_s / (self.peak_tflops * 1e12)

  def used(self, tier: str) -> float:
    return sum(r.bytes for r in self.rows if r.tier == tier)

  @property
  def host_peak_bytes(self) -> float:
    """Peak resident memory of the process (on a unified-memory machine, CPU, the device rows
    live in the same RAM and count too): what stays between steps (state rows, the runtime), plus
    the NVMe write-behind (queued writes land during any stage), plus the heaviest stage: the
    forward and backward (weights in flight, accumulator, activations), the head, or the
    updates. The tier budgets (`over_budget`) add every row instead: a safe bound, not a peak."""
    tiers = ('host', 'device') if self.budgets.get('_unified') else ('host',)
    held = [r for r in self.rows if r.tier in tiers and r.item != STAGING_ROW]
    per_stage = collections.Counter()
    for r in held:
      if r.stage != STATE:  # the forward's weights in flight are the backward's too
        per_stage['layers' if r.stage in ('forward', 'backward') else r.stage] += r.bytes
    for span, phases in ((FORWARD_TO_BACKWARD, ('layers', 'head')),  # boundary activations
                         (BACKWARD_TO_UPDATE, ('layers', 'update', 'outer_update'))):  # parked
      held_across = per_stage.pop(span, 0.0)
      for phase in phases:
        per_stage[phase] += held_across
    return (sum(r.bytes for r in held if r.stage == STATE) + self.write_behind_bytes
            + max(per_stage.values(), default=0.0))

  def over_budget(self) -> dict:
    """{tier: (needed, available)} for every tier whose budget the plan exceeds."""
    over = {}
    device, host, nvme = self.used('device'), self.used('host'), self.used('nvme')
    b = self.budgets
    if device > b['device']:
      over['device'] = (device, b['device'])
    if b.get('_unified'):  # the CPU backend: device and host bytes share one RAM
      if device + host > b['host']:
        over['host (shared with device)'] = (device + host, b['host'])
    elif host > b['host']:
      over['host'] = (host, b['host'])
    pinned = host - sum(r.bytes for r in self.rows if r.item == STAGING_ROW)
    if '_pinned' in b and pinned > b['_pinned']:
      over[PINNED_ROW] = (pinned, b['_pinned'])
    if nvme > b['nvme']:
      over['nvme'] = (nvme, b['nvme'])
    return over

  @property
  def fits(self) -> bool:
    return not self.over_budget()


def _memory_rows(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int,
                 seq: int, clipping: bool, checkpoint_copies: int = 0) -> list:
  """[Row]: the resident step's state and activations, or what each streamed stage holds."""
  if p.streamed:
    schedule = StepSchedule(p, cfg, micro, clipping)
    return schedule.held(cfg, sizes, batch, seq, checkpoint_copies)
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
  add('logits (1 microbatch)', logits_bytes(cfg, batch, seq), '3·B·S·V_c·4 (one vocabulary block)')
  return rows


def traffic(cfg: ModelConfig, sizes: StateSizes, p: Placement, micro: int, batch: int, seq: int,
            clipping: bool) -> dict:
  """Bytes per step: h2d, d2h (host<->device) and read, write (disk): the sum of what every stage
  of the streamed step declares (schedule.py)."""
  if not p.streamed:
    return dict(h2d=0.0, d2h=0.0, read=0.0, write=0.0)
  stages = StepSchedule(p, cfg, micro, clipping).traffic(sizes, hidden_bytes(cfg, batch, seq))
  return dataclasses.asdict(sum(stages.values(), Traffic()))


def step_flops(cfg: ModelConfig, p: Placement, micro: int, batch: int, seq: int) -> tuple:
  """(FLOPs the step executes, model FLOPs without recompute) per step."""
  tokens = micro * batch * seq
  layer_fwd = 2.0 * (cfg.params_per_layer - 2 * cfg.d_model) + 2.0 * seq * cfg.num_heads * cfg.head_dim
  head_fwd = 2.0 * cfg.d_model * cfg.vocab_size
  if not p.streamed:
    recompute = 1 if cfg.remat == 'full' else 0
  elif p.layers_per_group == 1:
    recompute = 1
  else:
    recompute = 1 + (1 if cfg.remat == 'full' else 0)
  executed = tokens * (cfg.num_layers * layer_fwd * (3 + recompute) + 3 * head_fwd)
  if cfg.attention_chunk and seq > cfg.attention_chunk:  # each query block re-runs in its backward
    executed += tokens * cfg.num_layers * 2.0 * seq * cfg.num_heads * cfg.head_dim
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


def make_plan(cfg: ModelConfig, sizes: StateSizes, p: Placement, hw: HardwareProfile, *,
              micro: int, batch: int, seq: int, clipping: bool, budgets: dict,
              checkpoint_copies: int = 0) -> Plan:
  rows = _memory_rows(cfg, sizes, p, micro, batch, seq, clipping, checkpoint_copies)
  rows.append(Row('host', RUNTIME_ROW, hw.runtime_host_gb * _GB,
                  'hardware profile: runtime_host_gb'))
  moved = traffic(cfg, sizes, p, micro, batch, seq, clipping)
  executed, model_flops = step_flops(cfg, p, micro, batch, seq)
  rate = hw.tflops(cfg.dtype, cfg.matmul_precision, cfg.d_model) * 1e12
  compute = executed / rate
  params = cfg.num_params
  host_opt = p.streamed and p.optimizer_on == 'host'
  optimizer = (cfg.num_layers * cfg.params_per_layer / (hw.host_adam_gparams * _GB)
               + (params - cfg.num_layers * cfg.params_per_layer) / (hw.device_adam_gparams * _GB)
               if host_opt else params / (hw.device_adam_gparams * _GB))
  h2d = moved['h2d'] / (hw.h2d_gbps * _GB)
  d2h = moved['d2h'] / (hw.d2h_gbps * _GB)
  # Reads hit the page cache when the disk-resident state fits in the RAM the plan leaves free.
  nvme_bytes = sum(r.bytes for r in rows if r.tier == 'nvme' and 'checkpoint' not in r.item)
  host_free = budgets.get('host', 0) - sum(r.bytes for r in rows if r.tier == 'host')
  if hw.unified_memory:
    host_free -= sum(r.bytes for r in rows if r.tier == 'device')
  cached = nvme_bytes > 0 and nvme_bytes < host_free
  disk = moved['read'] / _read_rate(hw, cached) + moved['write'] / _write_rate(hw, cached)
  calls = (1 if not p.streamed
           else sum(StepSchedule(p, cfg, micro, clipping).jitted_calls().values()))
  dispatch = calls * hw.dispatch_s
  times = {'compute': compute, 'optimizer': optimizer, 'h2d': h2d, 'd2h': d2h, 'disk': disk,
           'dispatch': dispatch}
  if not p.streamed:
    step = compute + optimizer + dispatch
    bottleneck = 'compute'
  elif not hw.overlap:
    # The CPU backend: compute (on all cores), copies and the optimizer run one after another.
    # The NVMe tier's reader/writer threads run beside the compute, but their work (TensorStore
    # chunk I/O and page-cache copies, CPU-bound on these machines) takes its share of the cores:
    # it costs disk / cores of step time.
    step = compute + optimizer + h2d + d2h + disk / hw.host_cores + dispatch
    bottleneck = max(('compute', compute), ('host optimizer' if host_opt else 'optimizer', optimizer),
                     ('host<->device', h2d + d2h), ('disk', disk), key=lambda x: x[1])[0]
  else:
    gw = sizes.group_params(p.layers_per_group)
    fill = 2 * (gw / (hw.h2d_gbps * _GB) + (gw / _read_rate(hw, cached) if p.params == 'nvme' else 0))
    device_work = compute + (0 if host_opt else optimizer)
    if clipping:
      # Updates wait for the global norm: compute, then an update phase bounded by its transfers.
      update_share = 0.5  # the update phase moves about half of a step's copies and disk I/O
      overlapped = max(compute, (1 - update_share) * max(h2d, d2h, disk))
      update = max(optimizer, update_share * max(h2d, d2h, disk))
      step = overlapped + update + fill + dispatch
    else:
      step = max(device_work, h2d, d2h, disk, optimizer if host_opt else 0) + fill + dispatch
    resources = {'compute': device_work, 'host<->device': max(h2d, d2h), 'disk': disk,
                 'host optimizer': optimizer if host_opt else 0}
    bottleneck = max(resources.items(), key=lambda x: x[1])[0]
  peak = hw.peak(cfg.dtype, cfg.matmul_precision, cfg.d_model)
  return Plan(placement=p, microbatches=micro, batch_size=batch, seq_len=seq, rows=rows,
              budgets=budgets, traffic=moved, times=times, step_time_s=step,
              bottleneck=bottleneck, flops_per_step=model_flops, peak_tflops=peak,
              write_behind_bytes=p.write_budget_bytes(cfg) if p.uses_nvme else 0.0)


# -------------------------------------------------------------------------------------------------
# Budgets, auto search, refusal.
# -------------------------------------------------------------------------------------------------

def pinned_limit_bytes() -> float | None:
  """XLA:GPU's cap on pinned host memory when the user set it (GiB); None when megatrain_jax
  raised it to the machine's RAM (megatrain_jax/__init__.py), which the host budget covers."""
  if not megatrain_jax.PINNED_LIMIT_FROM_USER:
    return None
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
  value = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', str(DEVICE_USABLE_FRACTION))
  try:
    fraction = float(value)
  except ValueError:
    fraction = -1.0
  if not 0 < fraction <= 1:
    raise ConfigError(f'XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a fraction in (0, 1]. '
                      'Set it to the share of GPU memory JAX may take, e.g. .9, or unset it.')
  return fraction


def budgets_for(hw: HardwareProfile, offload, disk_free_gb: float | None) -> dict:
  device = (offload.get('device_memory_gb') or hw.device_memory_gb * device_fraction(hw))
  host = (offload.get('host_memory_gb') or hw.host_memory_gb * HOST_USABLE_FRACTION)
  disk = disk_free_gb if disk_free_gb is not None else hw.disk_gb
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


def checkpoint_copies(ckpt, steps: int) -> int:
  """Checkpoints that pin a copy of the NVMe stores: checkpoint.keep, or fewer when the run writes
  fewer (every = 0: the end only, one; every = -1: none). Time-based and preemption checkpoints
  may add one more before the end: counted while keep allows."""
  if ckpt is None or ckpt.every < 0:
    return 0
  written = 1 if ckpt.every == 0 else -(-steps // ckpt.every)
  if ckpt.get('every_minutes', 0.0) > 0:
    written += 1
  return min(ckpt.keep, written)


def plan_run(config, hw: HardwareProfile, disk_free_gb: float | None = None) -> Plan:
  """The plan for `config`: its placement if fully specified, else the best `auto` choice.

  Raises ConfigError when nothing fits, naming needed vs available per tier and what to change.
  """
  cfg = model_lib.ModelConfig.from_config_dict(config.model)
  train, offload = config.train, config.offload
  sizes = state_sizes(cfg, train_key(train))
  budgets = budgets_for(hw, offload, disk_free_gb)
  clipping = train.grad_clip > 0
  ckpt = config.get('checkpoint')
  copies = checkpoint_copies(ckpt, train.steps)
  micro_options = ([1, 2, 4, 8, 16, 32, 64] if train.microbatches == 0
                   else [train.microbatches])
  plans, rejected, invalid = [], [], []
  for micro, placement in candidates(offload, cfg, micro_options):
    try:  # e.g. a group too large for the NVMe staging buffer, or no pinned_host memory
      placement.check(cfg)
    except ConfigError as e:
      invalid.append(e)
      continue
    plan = make_plan(cfg, sizes, placement, hw, micro=micro, batch=train.batch_size,
                     seq=train.seq_len, clipping=clipping, budgets=budgets,
                     checkpoint_copies=copies)
    (plans if plan.fits else rejected).append(plan)
  if not plans:
    if not rejected:
      raise invalid[0]
    closest = min(rejected, key=_overshoot)
    message = refusal_message(cfg, closest)
    pinned_only = [p for p in rejected if list(p.over_budget()) == [PINNED_ROW]]
    if pinned_only:  # the cap the user set is all that stands in the way
      best = max(pinned_only, key=lambda p: p.tokens_per_s)
      message += (f'\nRaising {PINNED_LIMIT_ENV} to {math.ceil(best.over_budget()[PINNED_ROW][0] / 2 ** 30)}'
                  f' (GiB) would fit: {best.placement.summary()}, M={best.microbatches}, '
                  f'{best.step_time_s:,.4g} s/step.')
    raise NoPlacementFits(message, closest)
  best = max(p.tokens_per_s for p in plans)
  near = [p for p in plans if p.tokens_per_s >= 0.99 * best]
  return min(near, key=lambda p: (_offloaded_bytes(p), p.microbatches,
                                  p.placement.layers_per_group, p.placement.prefetch_depth))


class NoPlacementFits(ConfigError):
  """No candidate fits the budgets; `closest` is the plan that misses by the least."""

  def __init__(self, message: str, closest: Plan):
    super().__init__(message)
    self.closest = closest


def _overshoot(plan: Plan) -> float:
  """How far a plan is over its budgets, summed relative to each budget."""
  return sum(max(0.0, n / max(a, 1.0) - 1) for n, a in plan.over_budget().values())


def refusal_message(cfg: ModelConfig, closest: Plan) -> str:
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
    device = [f'lower train.batch_size (now {closest.batch_size})' if closest.batch_size > 1
              else f'lower train.seq_len (now {closest.seq_len})']
    if p.streamed and closest.microbatches > 1:  # each microbatch's hidden state stays on device
      device.append(f'lower train.microbatches (now {closest.microbatches})')
    if cfg.remat != 'full':
      device.append('use model.remat=full')
    if p.streamed and (p.layers_per_group > 1 or p.prefetch_depth > 1):
      device.append('set offload.layers_per_group=1 / offload.prefetch_depth=1')
    if p.streamed and 'device' in (p.embed_head, p.activations):
      device.append("set offload.embed_head='host' / offload.activations='host'")
    hints.append(' or '.join(device) + ' (device memory)')
  if any('XLA_PJRT' in t for t in tiers):
    hints.append(f'raise {PINNED_LIMIT_ENV} (XLA\'s cap on pinned host memory) toward the RAM '
                 'you have')
  if any(t.startswith('host') for t in tiers):
    hints.append("move state to disk (offload.params='nvme', offload.opt_state='nvme') or lower "
                 'offload.host_buffer_gb')
  if 'nvme' in tiers:
    hints.append('point offload.dir at a disk with more free space, lower checkpoint.keep (each '
                 'kept checkpoint pins a copy of the NVMe stores), or keep offload.opt_state '
                 '(2/3 of them) on host')
  hints.append('or choose hardware with more memory (--config.hardware, '
               '--config.offload.device_memory_gb / host_memory_gb)')
  lines.append('Fix: ' + '; '.join(hints) + '.')
  return '\n'.join(lines)


def _gb(n: float) -> str:
  """Bytes as GB with enough digits to tell small numbers apart."""
  return f'{n / _GB:,.2f} GB' if n >= 10 * 1e6 else f'{n / _GB:.6f} GB'


def format_plan(plan: Plan, hw: HardwareProfile) -> str:
  """The memory table, then predicted time, throughput, MFU and bottleneck."""
  out = [f'hardware: {hw.name} ({hw.source})',
         f'placement: {plan.placement.summary()}, microbatches {plan.microbatches}',
         '', f'{"tier":<8}{"item":<44}{"GB":>12}  formula']
  for tier in ('device', 'host', 'nvme'):
    rows = [r for r in plan.rows if r.tier == tier]
    for r in rows:
      out.append(f'{tier:<8}{r.item:<44}{r.bytes / _GB:>12,.3f}  {r.formula}')
    budget = plan.budgets[tier]
    used = plan.used(tier)
    note = ' (shares RAM with device)' if tier == 'host' and plan.budgets.get('_unified') else ''
    out.append(f'{tier:<8}{"total / available" + note:<44}{used / _GB:>12,.3f}  of '
               f'{budget / _GB:,.1f} GB')
    if tier == 'host' and '_pinned' in plan.budgets:
      pinned = used - sum(r.bytes for r in rows if r.item == STAGING_ROW)
      out.append(f'{tier:<8}{"pinned / " + PINNED_LIMIT_ENV:<44}{pinned / _GB:>12,.3f}  of '
                 f'{plan.budgets["_pinned"] / _GB:,.1f} GB')
  t = plan.times
  out += ['', 'per step: ' + ', '.join(f'{k} {v:.4g} s' for k, v in t.items()),
          f'traffic per step: h2d {plan.traffic["h2d"] / _GB:,.2f} GB, d2h '
          f'{plan.traffic["d2h"] / _GB:,.2f} GB, disk read {plan.traffic["read"] / _GB:,.2f} GB, '
          f'disk write {plan.traffic["write"] / _GB:,.2f} GB',
          f'predicted: {plan.tokens_per_s:,.1f} tokens/s, MFU {100 * plan.mfu:.1f}% '
          f'(of {plan.peak_tflops:,.4g} peak TFLOP/s), bottleneck: {plan.bottleneck}',
          f'predicted_host_peak_gb: {plan.host_peak_bytes / _GB:.3f}',
          f'predicted_step_time_s: {plan.step_time_s:.6g}']
  return '\n'.join(out)
