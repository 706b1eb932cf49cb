"""The planner: exact state sizes and per-step traffic against the real pytrees and the engine's
own counters, memory against XLA's memory_analysis, auto placement, refusals, the dry-run plan,
and predicted vs measured step time (a loose bound that catches gross errors)."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import megatrain_jax
from megatrain_jax import config as config_lib
from megatrain_jax import hardware
from megatrain_jax import optim
from megatrain_jax import planner
from megatrain_jax import runtime
from megatrain_jax import train
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig
from megatrain_jax.placement import Placement

from helpers import CFG, REPO_ROOT, TRAIN, batches, config_with, initial_state, make_tx

SIZES = planner.state_sizes(CFG, planner.train_key(TRAIN))
_GB = 1e9


def _nbytes(tree) -> int:
  return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def test_state_sizes_equal_real_pytrees():
  tx = optim.make_optimizer(TRAIN)
  state = jax.jit(resident.init_state, static_argnums=(0, 1))(CFG, tx, 0)
  layers = state['params']['layers']
  outer = {k: v for k, v in state['params'].items() if k != 'layers'}
  assert SIZES.group_params(CFG.num_layers) == _nbytes(layers)
  assert SIZES.outer_params == _nbytes(outer)
  assert SIZES.layer_params == 4 * CFG.params_per_layer
  # The whole Adam state = the layers' moments + the outer parts' (which carry the counters).
  assert CFG.num_layers * SIZES.layer_opt + SIZES.outer_opt == _nbytes(state['opt_state'])
  assert SIZES.layer_opt == 8 * CFG.params_per_layer


def test_resident_plan_rows_are_the_state_bytes():
  plan = planner.make_plan(CFG, SIZES, Placement(), hardware.PRESETS['h100'], micro=1, batch=2,
                           seq=16, clipping=True, budgets={'device': 1e12, 'host': 1e12,
                                                           'nvme': 1e12})
  rows = {r.item: r.bytes for r in plan.rows}
  total_params = SIZES.group_params(CFG.num_layers) + SIZES.outer_params
  assert rows['params'] == total_params == 4 * CFG.num_params
  assert rows['gradients'] == total_params
  assert rows['Adam m, v'] == CFG.num_layers * SIZES.layer_opt + SIZES.outer_opt


# Every path of the engine's transfer code: tiers, optimizer place, clipping, activations and
# embedding/head on host, several groups and microbatches.
TRAFFIC_CASES = [
    dict(params='host', opt_state='host', layers_per_group=1),
    dict(params='host', opt_state='device', layers_per_group=2),
    dict(params='device', opt_state='host', layers_per_group=3),
    dict(params='host', opt_state='host', optimizer_on='host', layers_per_group=2),
    dict(params='host', opt_state='host', activations='host', embed_head='host'),
    dict(params='nvme', opt_state='nvme', layers_per_group=2),
    dict(params='nvme', opt_state='host', optimizer_on='host'),
    dict(params='host', opt_state='nvme', layers_per_group=4),
    # The embedding/head in vocabulary chunks (4 of 32 rows at shard_mb=0.004), in every tier.
    dict(params='host', opt_state='host', embed_head='host', shard_mb=0.004),
    dict(params='nvme', opt_state='nvme', embed_head='nvme', layers_per_group=2, shard_mb=0.004),
    dict(params='host', opt_state='nvme', embed_head='nvme', optimizer_on='host', shard_mb=0.004),
    # Every layer's input kept (offload.keep_layer_inputs) and stashed on the host: K per group,
    # the last group of K = 3 holding one.
    dict(params='host', opt_state='host', activations='host', layers_per_group=2,
         keep_layer_inputs=True),
    dict(params='host', opt_state='host', activations='host', layers_per_group=3,
         keep_layer_inputs=True),
    # Gradients of deferred device updates parked in device memory (offload.park_grads).
    dict(params='host', opt_state='host', layers_per_group=2, park_grads='device'),
    dict(params='nvme', opt_state='host', park_grads='device'),
]


def _run_engine(micro, clip, placement, steps=4):
  """Per-step metrics of a streamed run, and its cumulative transfer counters after close()."""
  tx, schedule, _ = make_tx(clip)
  placement.check(CFG)
  engine = StreamedEngine(CFG, tx, schedule, clip, placement,
                          jax.tree.map(np.copy, initial_state()))
  metrics = [engine.train_step(b) for b in batches(micro)[:steps]]
  engine.flush_updates()  # the last step's deferred updates (a checkpoint would run them)
  engine.close()  # flushes the write-behind
  return metrics, engine.stats


@pytest.mark.parametrize('clip', [0.0, 1.0], ids=['noclip', 'clip'])
@pytest.mark.parametrize('case', TRAFFIC_CASES, ids=lambda c: '-'.join(f'{v}' for v in c.values()))
def test_traffic_equals_engine_counters(tmp_path, case, clip):
  """The planner's bytes per step are exactly what the engine counts moving. With clipping a
  step's layer updates run in the next step's forward: the first step has none to run, and the
  last one's run before the stores are read (`flush_updates`)."""
  micro, steps = 2, 4
  placement = Placement(**{'dir': str(tmp_path), **case})
  metrics, stats = _run_engine(micro, clip, placement, steps)
  want = planner.traffic(CFG, SIZES, placement, micro, 2, 16, clipping=clip > 0)
  for m in metrics if not clip else metrics[1:]:
    assert m['io/h2d_gb'] * _GB == pytest.approx(want['h2d'], rel=1e-9, abs=1)
    assert m['io/d2h_gb'] * _GB == pytest.approx(want['d2h'], rel=1e-9, abs=1)
  if clip:  # nothing waited for the first step's forward
    first = metrics[0]['io/h2d_gb'] + metrics[0]['io/d2h_gb']
    assert first * _GB <= want['h2d'] + want['d2h'] + 1
  if 'nvme' in (placement.params, placement.opt_state):
    # Reads finish inside their step; writes land behind it, so count them over the whole run:
    # the init writes the disk-resident leaves once, then every step writes want['write'].
    for m in metrics[1:]:
      assert m['io/read_gb'] * _GB == pytest.approx(want['read'], rel=1e-9)
    init = (CFG.num_layers * SIZES.layer_params * (placement.params == 'nvme')
            + CFG.num_layers * SIZES.layer_opt * (placement.opt_state == 'nvme')
            + 3 * (SIZES.embed_params + SIZES.head_params) * (placement.embed_head == 'nvme'))
    assert stats.write_bytes == init + steps * want['write']


def test_resident_memory_against_memory_analysis():
  """XLA's own accounting of the compiled resident step: its arguments are the train state and
  the batch (exactly), and its temporaries are within 2x of the plan's gradients + activations."""
  tx = optim.make_optimizer(TRAIN)
  schedule = optim.lr_schedule(TRAIN)
  cfg = CFG.replace(remat='full')
  batch, seq = 4, 32
  state = jax.eval_shape(lambda: resident.init_state(cfg, tx, 0))
  step = resident.make_train_step(cfg, tx, 1.0, schedule)
  tokens = jax.ShapeDtypeStruct((1, batch, seq + 1), np.int32)
  analysis = step.lower(state, tokens).compile().memory_analysis()
  if analysis is None:
    pytest.skip('this backend reports no memory_analysis')
  plan = planner.make_plan(cfg, SIZES, Placement(), hardware.PRESETS['h100'], micro=1,
                           batch=batch, seq=seq, clipping=True,
                           budgets={'device': 1e12, 'host': 1e12, 'nvme': 1e12})
  rows = {r.item: r.bytes for r in plan.rows}
  state_bytes = rows['params'] + rows['Adam m, v'] + 4 + 8  # + step counter + rng key data
  assert analysis.argument_size_in_bytes == state_bytes + 4 * batch * (seq + 1)
  temporaries = rows['gradients'] + rows['activations (1 microbatch)'] + rows['logits (1 microbatch)']
  assert 0.5 * temporaries <= analysis.temp_size_in_bytes <= 2 * temporaries, (
      analysis.temp_size_in_bytes, temporaries)


def test_resident_init_temporaries_against_memory_analysis():
  """XLA's accounting of the compiled fresh init: its output is the state rows (and the output
  tuple's pointers, the step counter and the rng key), its
  temporaries 1.67·4·P (within 25%). The init row holds what they need beyond the step's
  gradients, activations and logits (the two never coexist), so the device total and the
  predicted peak hold the state plus the larger of the two, not both."""
  tx = optim.make_optimizer(TRAIN)
  analysis = jax.jit(resident.init_state, static_argnums=(0, 1)).lower(
      CFG, tx, 0).compile().memory_analysis()
  if analysis is None:
    pytest.skip('this backend reports no memory_analysis')
  budgets = {'device': 1e12, 'host': 1e12, 'nvme': 1e12, '_unified': True}
  plan = planner.make_plan(CFG, SIZES, Placement(), hardware.PRESETS['cpu'], micro=1, batch=2,
                           seq=16, clipping=True, budgets=budgets)
  rows = {r.item: r.bytes for r in plan.rows}
  state = rows['params'] + rows['Adam m, v']
  assert state < analysis.output_size_in_bytes < state + 1024
  init = planner.RESIDENT_INIT_TEMP_RATIO * rows['params']
  assert 0.75 * init <= analysis.temp_size_in_bytes <= 1.25 * init, (
      analysis.temp_size_in_bytes, init)
  step = rows['gradients'] + rows['activations (1 microbatch)'] + rows['logits (1 microbatch)']
  assert rows[planner.INIT_ROW] == pytest.approx(max(0.0, init - step))
  assert plan.used('device') == pytest.approx(state + max(step, init))
  process = rows[planner.RUNTIME_ROW] + rows[planner.PROGRAMS_ROW]
  assert plan.host_peak_bytes == pytest.approx(state + max(step, init) + process)
  # A larger batch: the step's rows outgrow the init's temporaries, and the init row is 0.
  big = planner.make_plan(CFG, SIZES, Placement(), hardware.PRESETS['cpu'], micro=1, batch=64,
                          seq=256, clipping=True, budgets=budgets)
  assert {r.item: r.bytes for r in big.rows}[planner.INIT_ROW] == 0.0


@pytest.mark.parametrize('seq, chunk, dtype', [
    (32, 0, 'float32'), (256, 0, 'float32'), (256, 32, 'float32'), (1024, 0, 'float32'),
    (1024, 128, 'float32'), (2048, 256, 'float32'), (1024, 0, 'bfloat16')],
    ids=['short', 'long-whole', 'long-chunked', '1k-whole', '1k-chunked', '2k-chunked',
         '1k-whole-bf16'])
def test_group_backward_memory_against_memory_analysis(seq, chunk, dtype):
  """The group backward of one layer (remat none) holds about one layer's internals (XLA's
  count 0.75-1.5x of them); at 256 tokens and more those are mostly attention scores, which query
  blocks (model.attention_chunk) shrink: three float32 arrays of a block's scores whatever
  model.dtype (the planner counted two at model.dtype's width: 1.5x low at 1k tokens, 3x in
  bfloat16), and no more: every block's mask kept for the backward (layers._tied_to) made the
  2k-token chunked case 1.84x."""
  from megatrain_jax import model as model_lib
  batch = 4
  cfg = CFG.replace(remat='none', max_seq_len=max(CFG.max_seq_len, seq), attention_chunk=chunk,
                    dtype=dtype)
  params = jax.eval_shape(lambda: {'layers': model_lib.init_layers(cfg, jax.random.key(0), 0, 1)})
  x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), jnp.dtype(dtype))
  positions = jax.ShapeDtypeStruct((batch, seq), np.int32)

  def backward(p, h, pos, dy):
    _, vjp = jax.vjp(lambda p, h: model_lib.apply_group(cfg, p['layers'], h, pos), p, h)
    return vjp(dy)

  analysis = jax.jit(backward).lower(params, x, positions, x).compile().memory_analysis()
  if analysis is None:
    pytest.skip('this backend reports no memory_analysis')
  want = planner.layer_internal_bytes(cfg, batch, seq)
  got = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
  assert 0.75 * want <= got <= 1.5 * want, (got, want, got / want)


# --- auto placement and refusals ----------------------------------------------------------------

def _plan(**overrides):
  config = config_lib.load_config('tiny', **{'hardware': 'cpu', **overrides})
  return planner.plan_run(config, hardware.load_profile('cpu'), disk_free_gb=100.0)


def test_a_state_read_into_place_plans_no_init_temporaries(tmp_path):
  """init.from_hf, init.from_run and a resume read the state leaf by leaf into place: the fresh
  init's XLA temporaries never exist, so a resident plan does not count them (a 1B resident
  fine-tune was refused for 3.25 GB of them)."""
  small = dict(train__batch_size=2, train__seq_len=16, offload__params='device',
               offload__opt_state='device')
  fresh = _plan(**small)
  init = {r.item: r.bytes for r in fresh.rows}[planner.INIT_ROW]
  assert init > 0
  for start in (dict(init__from_hf='/models/llama'), dict(init__from_run='runs/base')):
    plan = _plan(**small, **start)
    assert planner.INIT_ROW not in [r.item for r in plan.rows]
    assert plan.used('device') == pytest.approx(fresh.used('device') - init)
  config = config_lib.load_config('tiny', hardware='cpu', **small)
  (tmp_path / 'checkpoints' / '4').mkdir(parents=True)
  _, resumed = train.plan_for(config, tmp_path, dry_run=True)
  assert planner.INIT_ROW not in [r.item for r in resumed.rows]


def test_auto_picks_device_for_tiny():
  plan = _plan()
  assert not plan.placement.streamed
  assert plan.fits


def test_auto_streams_when_device_budget_is_below_the_model():
  cfg = planner.model_lib.ModelConfig.from_config_dict(config_lib.load_config('tiny').model)
  model_gb = 16 * cfg.num_params / _GB
  plan = _plan(offload__device_memory_gb=model_gb / 4, train__microbatches=0,
               train__batch_size=2, train__seq_len=32)  # activations well below the state
  p = plan.placement
  assert p.streamed and p.params != 'device'
  assert plan.used('device') <= model_gb / 4 * _GB
  # What it chose is a valid placement the engine accepts.
  p.check(cfg)


def test_auto_parks_gradients_on_the_device_when_they_fit():
  """offload.park_grads=auto: with exact clipping and the update on the device, the gradients
  wait in device memory when its budget holds them (two fewer layer-sized copies per step, so the
  plan is faster) and in the weights' tier when it does not; without clipping nothing is parked."""
  base = dict(offload__params='host', offload__opt_state='host', offload__activations='device',
              offload__embed_head='device', offload__optimizer_on='device',
              offload__layers_per_group=1, offload__prefetch_depth=1, train__grad_clip=1.0)
  in_weights_tier = _plan(**base, offload__park_grads='weights')
  roomy = _plan(**base)
  assert roomy.placement.park_grads == 'device'
  config = config_lib.load_config('tiny')
  cfg = planner.model_lib.ModelConfig.from_config_dict(config.model)
  layer_params = planner.state_sizes(cfg, planner.train_key(config.train)).layer_params
  layer_grads = cfg.num_layers * layer_params
  # The parked gradients are on the device; the update (the peak stage here) reads two groups' of
  # them where they are instead of holding copies beside its weights and Adam state.
  assert roomy.used('device') == pytest.approx(
      in_weights_tier.used('device') + layer_grads - 2 * layer_params)
  assert roomy.traffic['h2d'] == in_weights_tier.traffic['h2d'] - layer_grads
  assert roomy.traffic['d2h'] == in_weights_tier.traffic['d2h'] - layer_grads
  assert roomy.step_time_s < in_weights_tier.step_time_s
  tight = _plan(**base, offload__device_memory_gb=(roomy.used('device') - layer_grads / 2) / _GB)
  assert tight.placement.park_grads == 'weights' and tight.fits
  assert _plan(**{**base, 'train__grad_clip': 0.0}).placement.park_grads == 'weights'


def test_auto_on_h100_for_7b():
  """7B: 112 GB of FP32 state > 80 GB of HBM, so auto streams; with 2 TB of host RAM the state
  stays in RAM; with 40 GB the Adam state (56 GB) goes to disk."""
  config = config_lib.load_config('7b', hardware='h100')
  hw = hardware.load_profile('h100')
  plan = planner.plan_run(config, hw, disk_free_gb=10_000.0)
  p = plan.placement
  assert p.streamed and 'host' in (p.params, p.opt_state)
  assert plan.used('device') <= 0.9 * 80 * _GB and plan.used('nvme') == 0
  small = config_lib.load_config('7b', hardware='h100', offload__host_memory_gb=40.0)
  plan = planner.plan_run(small, hw, disk_free_gb=10_000.0)
  assert 'nvme' in (plan.placement.params, plan.placement.opt_state)
  assert plan.used('host') <= 40 * _GB


def test_refusal_device_too_small_for_one_group():
  with pytest.raises(ConfigError) as e:
    _plan(offload__device_memory_gb=1e-4)
  message = str(e.value)
  assert 'fits no placement' in message
  assert 'device:' in message and 'GB needed' in message and 'GB available' in message
  assert 'batch_size' in message  # the concrete suggestion


def test_refusal_names_only_fixes_that_shrink_what_is_over():
  """A resident 1B (128k vocabulary) over its memory by ~5 GB with 1 sequence of 128 tokens:
  its activations are 0.05 GB, so lowering seq_len cannot help, and a resident plan has no
  staging buffer; its gradient accumulator (M > 1) and streaming the state can."""
  config = config_lib.load_config(
      '1b', hardware='cpu', train__batch_size=1, train__seq_len=128, train__microbatches=4,
      offload__params='device', offload__opt_state='device', offload__embed_head='device',
      offload__activations='device', offload__device_memory_gb=20.0,
      offload__host_memory_gb=20.0)
  with pytest.raises(ConfigError) as e:
    planner.plan_run(config, hardware.load_profile('cpu'), disk_free_gb=100.0)
  fix = str(e.value).split('Fix: ')[1]
  assert 'seq_len' not in fix and 'batch_size' not in fix and 'host_buffer_gb' not in fix
  assert fix.startswith('lower train.microbatches (now 4) or stream the state'), fix


def test_refusal_disk_too_small():
  config = config_lib.load_config('tiny', hardware='cpu', offload__params='nvme',
                                  offload__opt_state='nvme')
  with pytest.raises(ConfigError) as e:
    planner.plan_run(config, hardware.load_profile('cpu'), disk_free_gb=1e-4)
  assert 'nvme:' in str(e.value) and 'offload.dir' in str(e.value)


def test_nvme_plan_counts_the_best_checkpoint_as_one_more_copy():
  """checkpoint.keep_best may keep one checkpoint older than the newest `keep`: one more snapshot
  of the NVMe stores on disk."""
  def snapshots(**fields):
    plan = _plan(offload__params='nvme', offload__opt_state='nvme', checkpoint__keep=2,
                 checkpoint__every=10, train__eval_every=10, train__steps=100, **fields)
    return [r for r in plan.rows if r.item.startswith('checkpoint snapshots')]
  plain, best = snapshots(), snapshots(checkpoint__keep_best=True)
  assert len(plain) == len(best) == 1
  assert best[0].bytes == pytest.approx(1.5 * plain[0].bytes)


def test_refusal_through_train_and_evaluate_writes_nothing(tmp_path):
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError, match='fits no placement'):
    train.train_and_evaluate(config_with(hardware='cpu', offload__device_memory_gb=1e-4),
                             str(workdir))
  assert not workdir.exists()


def test_explicit_placement_is_kept():
  plan = _plan(offload__params='host', offload__opt_state='host', offload__activations='host',
               offload__embed_head='device', offload__optimizer_on='host',
               offload__layers_per_group=2, offload__prefetch_depth=2)
  p = plan.placement
  assert (p.params, p.opt_state, p.activations, p.optimizer_on, p.layers_per_group,
          p.prefetch_depth) == ('host', 'host', 'host', 'host', 2, 2)


def test_pinned_host_limit_the_user_set_is_budgeted_and_named(monkeypatch):
  """On a GPU, pinned host memory must fit XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB when the user set
  it: 1 GiB cannot hold even the all-NVMe plan's pinned working set (the host optimizer's bands,
  read ahead, the one in AdamW with its outputs and its NVMe inputs' pinned copies, and the
  weights read from NVMe on their way to the device, which XLA stages in its pinned pool: two
  4-layer groups, 25.5 GiB; the runtime and the NVMe staging buffer are not pinned); 32 GiB
  can, and the refusal says which limit would fit."""
  config = config_lib.load_config('101b', hardware='h200')
  hw = hardware.load_profile('h200')
  unlimited = planner.plan_run(config, hw)  # the cap raised to RAM: RAM is the budget
  assert unlimited.fits
  monkeypatch.setattr(megatrain_jax, 'PINNED_LIMIT_FROM_USER', True)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '32')
  assert planner.plan_run(config, hw).placement.params == 'nvme'
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '1')
  with pytest.raises(ConfigError) as e:
    planner.plan_run(config, hw)
  message = str(e.value)
  assert 'fits no placement' in message
  limit = int(re.search(r'Raising XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to (\d+) \(GiB\)', message)[1])
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', str(limit))
  plan = planner.plan_run(config, hw)  # the suggested limit does fit
  assert plan.fits and 'host' in (plan.placement.params, plan.placement.opt_state,
                                   plan.placement.activations)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '6x4')
  with pytest.raises(ConfigError, match=r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='6x4' is not a whole"):
    planner.plan_run(config, hw)


def test_the_pinned_line_of_the_table_is_what_the_cap_is_checked_against(monkeypatch):
  """The table's `pinned / XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` line counted the process's own
  rows (runtime, programs: not pinned) that the check leaves out, so a plan that fits printed
  more than its cap (1,048.9 of 1,046.9 GB). It prints what the check compares."""
  monkeypatch.setattr(megatrain_jax, 'PINNED_LIMIT_FROM_USER', True)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', '975')
  config = config_lib.load_config('101b', hardware='h200')
  for field, value in dict(params='nvme', opt_state='host', activations='host',
                           optimizer_on='device').items():
    setattr(config.offload, field, value)
  hw = hardware.load_profile('h200')
  plan = planner.plan_run(config, hw)
  assert plan.fits
  line = next(l for l in planner.format_plan(plan, hw).splitlines()
              if l.startswith('host    pinned / XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'))
  used, cap = (float(x.replace(',', '')) for x in re.findall(r'[\d,]+\.\d+', line))
  pinned = planner.pinned_bytes(plan.rows) + sum(
      r.bytes for r in plan.rows if r.item == planner.POOL_ROW)
  assert used == pytest.approx(pinned / 1e9, abs=1e-3) and used <= cap, line


def _7b_on_128_gib(tier: str):
  """(config, profile): 7b on an H100 box with 128 GiB of RAM, its layers' weights and Adam state
  in `tier`, streamed one layer at a time with the optimizer on the device."""
  config = config_lib.load_config('7b', hardware='h100')
  for field, value in dict(params=tier, opt_state=tier, activations='host',
                           embed_head='device', optimizer_on='device', layers_per_group=1,
                           park_grads='device').items():
    setattr(config.offload, field, value)
  return config, dataclasses.replace(hardware.load_profile('h100'), host_memory_gb=128.0)


def test_the_pinned_pool_is_counted_as_xla_grows_it(monkeypatch):
  """XLA:GPU's pinned pool grows in regions that double and are never given back, up to
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, which the package raises to the RAM: 7b's 72.4 GiB of layer
  weights and Adam state in pinned memory take 2 + 4 + ... + 32 GiB, then the rest of a 128 GiB
  cap (an OOM kill on the GPU benchmark's machine). The plan counts that growth in its host rows;
  with the cap near the pinned rows it stops there, and the refusal names that cap."""
  gib = 2**30
  assert planner.pinned_pool_bytes(72.4 * gib, 128 * gib) == 128 * gib - 2**21  # 2 MiB ... 64 GiB
  assert planner.pinned_pool_bytes(72.4 * gib, 76 * gib) == 76 * gib  # ... 32 GiB, then the rest
  assert planner.pinned_pool_bytes(60 * gib, 512 * gib) == 64 * gib - 2**21
  config, hw = _7b_on_128_gib(tier='host')
  with pytest.raises(planner.NoPlacementFits) as refused:  # the RAM as the cap: 128 GiB pinned
    planner.plan_run(config, hw, suggest_presets=False)
  closest = refused.value.closest
  pinned = planner.pinned_bytes(closest.rows)
  pool = [r.bytes for r in closest.rows if r.item == planner.POOL_ROW]
  assert pool == [pytest.approx(128 * gib - pinned, rel=1e-3)] and pinned > 72 * gib
  cap = int(re.search(r'set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=(\d+) before starting',
                      str(refused.value))[1])
  assert pinned / gib < cap < 1.1 * pinned / gib + 2
  monkeypatch.setattr(megatrain_jax, 'PINNED_LIMIT_FROM_USER', True)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', str(cap))
  plan = planner.plan_run(config, hw, suggest_presets=False)
  assert plan.fits and sum(r.bytes for r in plan.rows if r.item == planner.POOL_ROW) <= (
      cap * gib - pinned)


def test_nvme_reads_staged_in_the_pinned_pool_are_counted(monkeypatch):
  """The NVMe tier's reads reach the device as device_put of numpy arrays, which XLA's GPU client
  copies into its pinned pool first (should_stage_host_to_device_transfers): the groups in
  flight there, their regions never given back. The pool row counts them (it counted the pinned
  rows only: none for 7b's layers all on NVMe), a cap below the pinned rows and the reads is
  refused, and the refusal's suggested cap leaves them room."""
  config, hw = _7b_on_128_gib(tier='nvme')
  plan = planner.plan_run(config, hw, suggest_presets=False)
  pinned = planner.pinned_bytes(plan.rows)
  staged = plan.staged_bytes  # two one-layer groups of weights and Adam state on their way
  per_layer = ModelConfig.from_config_dict(config.model).params_per_layer
  assert staged == 2 * 12 * per_layer
  config.offload.park_grads = 'weights'  # parked beside the weights, on NVMe: read back too
  assert planner.plan_run(config, hw, suggest_presets=False).staged_bytes == 2 * 16 * per_layer
  config.offload.park_grads = 'device'
  pool = sum(r.bytes for r in plan.rows if r.item == planner.POOL_ROW)
  assert plan.fits and staged > 2**30
  assert pool == pytest.approx(planner.pinned_pool_bytes(pinned + staged, 128 * 2**30) - pinned)
  assert pool >= staged
  gib = 2**30
  monkeypatch.setattr(megatrain_jax, 'PINNED_LIMIT_FROM_USER', True)
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', str(int((pinned + staged / 2) / gib)))
  with pytest.raises(planner.NoPlacementFits) as refused:
    planner.plan_run(config, hw, suggest_presets=False)
  assert planner.PINNED_ROW in refused.value.closest.over_budget()
  monkeypatch.setenv('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB',
                     str(math.ceil((pinned + staged) * 1.05 / gib) + 1))  # the refusal's hint
  assert planner.plan_run(config, hw, suggest_presets=False).fits


def test_device_budget_follows_the_jax_memory_fraction(monkeypatch):
  hw = hardware.load_profile('h100')
  offload = config_lib.load_config('tiny').offload
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.5')
  assert planner.budgets_for(hw, offload, 100.0)['device'] == pytest.approx(40 * _GB)
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '1.5')
  with pytest.raises(ConfigError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION='1.5' is not a fraction"):
    planner.budgets_for(hw, offload, 100.0)


@pytest.mark.parametrize('preset', [None, '96'])
def test_importing_megatrain_jax_raises_the_pinned_limit_unless_set(preset):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'}
  # This process imported megatrain_jax, which set the limit: its children see that as ours.
  inherited = subprocess.run([sys.executable, '-c', 'import megatrain_jax; print('
                              'megatrain_jax.PINNED_LIMIT_FROM_USER)'], capture_output=True,
                             text=True, check=True, cwd=REPO_ROOT).stdout
  assert inherited.split() == ['False']
  if preset:
    env['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'] = preset
  out = subprocess.run([sys.executable, '-c', 'import os, megatrain_jax; print(os.environ['
                        '"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"], megatrain_jax.PINNED_LIMIT_FROM_USER)'],
                       env=env, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
  ram_gib = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') // 2 ** 30
  assert out.split() == ([preset, 'True'] if preset else [str(ram_gib), 'False'])


def test_a_gpu_client_made_before_the_import_is_planned_with_xlas_defaults(monkeypatch, capsys):
  """A notebook that ran JAX on the GPU before importing megatrain_jax: XLA made its client with
  75% of GPU memory and a 64 GiB pinned cap, but the planner budgeted 90% and the RAM (a plan
  that then ran out of memory). The package notes that JAX came first (and leaves the variables
  alone, too late to matter), a GPU process says so, and the planner budgets XLA's defaults."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB', 'MEGATRAIN_JAX_PINNED_LIMIT_AUTO',
                      'XLA_PYTHON_CLIENT_MEM_FRACTION')}
  out = subprocess.run([sys.executable, '-c', 'import os, jax; jax.devices(); import megatrain_jax;'
                        ' print(megatrain_jax.JAX_STARTED_FIRST, megatrain_jax.XLA_DEFAULTS_IN_'
                        'FORCE, os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"))'],
                       env=env, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
  assert out.split() == ['True', 'False', 'None']  # on CPU: nothing XLA:GPU reads was in force
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert runtime.warn_if_gpu_started_first()
  assert '75% of GPU memory and a 64 GiB cap' in capsys.readouterr().err
  monkeypatch.setattr(megatrain_jax, 'XLA_DEFAULTS_IN_FORCE', True)
  monkeypatch.setattr(megatrain_jax, 'PINNED_LIMIT_FROM_USER', False)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  hw = hardware.load_profile('h100')
  budgets = planner.budgets_for(hw, config_lib.load_config('tiny').offload, 100.0)
  assert budgets['device'] == pytest.approx(0.75 * hw.device_memory_gb * _GB)
  assert budgets['_pinned'] == 64 * 2**30


@pytest.mark.parametrize('overrides, message', [
    (dict(hardware='tpu9000'), "hardware='tpu9000' is neither a preset"),
    (dict(hardware='/no/such/profile.json'), 'no such profile file'),
    (dict(offload__device_memory_gb=-1.0), 'offload.device_memory_gb=-1.0 must be a number of GB >= 0'),
    (dict(offload__host_memory_gb=float('nan')), 'offload.host_memory_gb: must be a finite number'),
    (dict(offload__host_memory_gb=-3.0), 'offload.host_memory_gb=-3.0 must be a number of GB >= 0'),
    (dict(offload__params='nvme', offload__layers_per_group=-2), 'offload.layers_per_group=-2'),
    (dict(offload__device_memory_gb=1e-4), 'fits no placement'),
], ids=['unknown-preset', 'missing-profile', 'device-budget', 'host-nan', 'host-budget', 'group', 'too-small'])
def test_planner_inputs_are_refused_before_anything_is_written(tmp_path, overrides, message):
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError) as e:
    train.train_and_evaluate(config_with(**overrides), str(workdir))
  assert message in str(e.value), str(e.value)
  assert not workdir.exists()


def test_unknown_hardware_is_refused():
  with pytest.raises(ConfigError, match='neither a preset'):
    hardware.load_profile('tpu9000')
  with pytest.raises(ConfigError, match='no such profile file'):
    hardware.load_profile('/nonexistent/profile.json')


def test_an_auto_detected_gpu_preset_plans_with_this_machines_sizes(monkeypatch, tmp_path):
  """config.hardware='' on a GPU with no calibration file: the preset's rates, but this
  machine's RAM, device memory and disk (the h100 preset's 2 TB of RAM and its drive planned a
  256 GB box for 1.7 TB of host memory); a preset named on purpose (planning another machine)
  keeps its sizes."""
  monkeypatch.setattr(hardware.layout, 'platform', lambda: 'gpu')
  monkeypatch.setattr(hardware.layout, 'device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  monkeypatch.setattr(hardware, 'device_memory_gb', lambda: 79.2)
  monkeypatch.setattr(hardware, 'PROFILE_CACHE', tmp_path / 'none.json')
  auto, named = hardware.load_profile(''), hardware.load_profile('h100')
  assert auto.name == 'h100' and auto.compute_tflops == named.compute_tflops
  assert auto.host_memory_gb == pytest.approx(hardware.machine_memory_gb())
  assert (auto.device_memory_gb, auto.disk_gb) == (79.2, 0.0)  # disk: offload.dir's, measured
  assert 'this machine' in auto.origin
  assert (named.host_memory_gb, named.device_memory_gb, named.disk_gb) == (2048.0, 80.0, 7_680)


@pytest.mark.parametrize('device_kind, preset, fp32', [
    ('NVIDIA H100 80GB HBM3', 'h100', 67.0), ('NVIDIA H100 PCIe', 'h100-pcie', 51.0),
    ('NVIDIA H100 NVL', 'h100-nvl', 60.0), ('NVIDIA H200', 'h200', 67.0),
    ('NVIDIA H200 NVL', 'h200-nvl', 60.0), ('NVIDIA GH200 480GB', 'gh200', 67.0),
    ('NVIDIA A100-SXM4-80GB', 'a100', 19.5), ('NVIDIA GeForce RTX 4090', 'rtx4090', 82.6)])
def test_each_gpu_is_planned_and_its_mfu_taken_from_its_own_datasheet(device_kind, preset, fp32):
  """A PCIe or NVL card of the H100/H200 chip, or a Grace Hopper, is its own preset: perf/mfu's
  peak and the planner's rates are that card's (an H100 PCIe's 51 FP32 TFLOP/s, not the SXM's 67:
  its MFU read 24% low), and a GH200's host link is NVLink-C2C (360 GB/s planned), not PCIe."""
  assert hardware.preset_for(device_kind) == preset
  assert hardware.datasheet_peak_tflops(device_kind, 'float32', 'highest') == fp32
  profile = hardware.load_profile(preset)
  assert profile.device_kind == device_kind
  assert profile.h2d_gbps == (360.0 if preset == 'gh200' else
                              25.6 if preset in ('a100', 'rtx4090') else 51.2)


def test_bad_profile_file_is_refused(tmp_path):
  bad = tmp_path / 'p.json'
  bad.write_text('{"name": 1')
  with pytest.raises(ConfigError, match='not a valid profile'):
    hardware.load_profile(str(bad))


# --- the process's own memory (issue 10) ---------------------------------------------------------

def _runtime_rows(plan) -> dict:
  return {r.item: r for r in plan.rows if r.item in (planner.RUNTIME_ROW, planner.PROGRAMS_ROW)}


def test_runtime_baseline_is_measured_for_this_machine_and_the_profile_plans_another(monkeypatch):
  """A plan for this machine's own profile counts this process's RSS at plan time as the runtime
  baseline (a run holds it all before its state); a plan for another machine takes the
  profile's runtime_host_gb. Both add the profile's programs_host_gb, and both rows count in the
  predicted peak."""
  config = config_lib.load_config('tiny', hardware='cpu')
  cpu = hardware.load_profile('cpu')
  assert cpu.device_kind == jax.devices()[0].device_kind  # the CPU backend: this machine
  monkeypatch.setattr(runtime, 'process_rss_bytes', lambda: 123_000_000)
  own = planner.plan_run(config, cpu, disk_free_gb=100.0)
  rows = _runtime_rows(own)
  assert rows[planner.RUNTIME_ROW].bytes == 123_000_000
  assert 'measured' in rows[planner.RUNTIME_ROW].formula
  assert rows[planner.PROGRAMS_ROW].bytes == pytest.approx(cpu.programs_host_gb * _GB)
  monkeypatch.setattr(runtime, 'process_rss_bytes', lambda: 223_000_000)
  grown = planner.plan_run(config, cpu, disk_free_gb=100.0)
  assert grown.host_peak_bytes - own.host_peak_bytes == pytest.approx(100_000_000)
  # Another machine's profile: its figures, whatever this process holds.
  for other in (hardware.load_profile('h100'),
                dataclasses.replace(cpu, device_kind='some other cpu')):
    plan = planner.plan_run(config, other, disk_free_gb=100.0)
    rows = _runtime_rows(plan)
    assert rows[planner.RUNTIME_ROW].bytes == pytest.approx(other.runtime_host_gb * _GB)
    assert rows[planner.RUNTIME_ROW].formula == 'hardware profile: runtime_host_gb'
    assert rows[planner.PROGRAMS_ROW].bytes == pytest.approx(other.programs_host_gb * _GB)
  # A refusal's presets are other machines: planned with their figures (through make_plan).
  assert planner.runtime_rows(hardware.PRESETS['h200'])[0].bytes == pytest.approx(
      hardware.PRESETS['h200'].runtime_host_gb * _GB)


def test_runtime_baseline_of_a_multi_process_run_is_the_profile_figure(monkeypatch):
  """Processes of one run must reach the same plan: their RSS differs, so none is measured."""
  cpu = hardware.load_profile('cpu')
  assert planner.measured_baseline_bytes(cpu) > 0.1 * _GB  # this process: Python + JAX at least
  monkeypatch.setattr(planner.jax, 'process_count', lambda: 2)
  assert planner.measured_baseline_bytes(cpu) is None


# --- predicted vs measured (loose: the ±25% figures are in BENCHMARKS.md) -------------------------

@pytest.fixture(scope='module')
def calibrated_profile(tmp_path_factory):
  """`launch.py --calibrate` writes a loadable profile in under 60 s, and leaves no directory
  behind for its disk probe (<workdir>/offload/.calibrate)."""
  out = tmp_path_factory.mktemp('profile') / 'hw.json'
  started = time.perf_counter()
  result = subprocess.run([sys.executable, 'launch.py', '--calibrate', f'--profile_out={out}',
                           f'--workdir={out.parent / "run"}'], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=180)
  elapsed = time.perf_counter() - started
  assert result.returncode == 0, result.stderr[-3000:]
  assert elapsed < 60, elapsed
  assert not (out.parent / 'run').exists()
  profile = hardware.load_profile(str(out))
  assert profile.disk_read_gbps > 0 and profile.compute_tflops
  assert profile.calibration_version == hardware.CALIBRATION_VERSION
  assert 'earlier version' not in profile.origin
  return out


@pytest.mark.timing
@pytest.mark.parametrize('placement', [
    {},
    dict(offload__params='host', offload__opt_state='host', offload__layers_per_group=1),
    dict(offload__params='nvme', offload__opt_state='nvme', offload__layers_per_group=2),
], ids=['resident', 'host', 'nvme'])
def test_predicted_step_time_within_factor_two(tmp_path, calibrated_profile, placement):
  fixed = dict(offload__params='device', offload__opt_state='device',
               offload__activations='device', offload__embed_head='device',
               offload__optimizer_on='device', offload__layers_per_group=1,
               offload__prefetch_depth=1)
  config = config_with(hardware=str(calibrated_profile), train__steps=6, train__log_every=1,
                       train__eval_every=0, checkpoint__every=-1, **{**fixed, **placement})
  train.train_and_evaluate(config, str(tmp_path / 'run'))
  rows = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  timed = [r for r in rows if 'perf/step_time_s' in r and r['step'] >= 3]
  # The fastest step after warm-up: the calibration measured this machine unloaded, and a step
  # that shared the cores with another process (a loaded CI runner) says nothing of the model.
  measured = float(np.min([r['perf/step_time_s'] for r in timed]))
  predicted = timed[-1]['perf/predicted_step_time_s']
  assert 0.5 <= predicted / measured <= 2.0, (predicted, measured)


def _fixed_plan(model: str, grad_clip: float, **offload):
  config = config_lib.load_config(model, hardware='h100')
  config.train.grad_clip = grad_clip
  for field, value in offload.items():
    setattr(config.offload, field, value)
  return planner.plan_run(config, hardware.load_profile('h100'))


def test_a_host_refusal_names_what_would_shrink_its_host_rows():
  """101B on an RTX 4090 box: the closest plan has its state on NVMe already, and its host
  overflow is the layer inputs of 16 microbatches waiting there. The fix names fewer microbatches
  (8 fit), not moving the state to disk, which it had named."""
  config = config_lib.load_config('101b', hardware='rtx4090')
  with pytest.raises(planner.NoPlacementFits) as refused:
    planner.plan_run(config, hardware.load_profile('rtx4090'), suggest_presets=False)
  host_fix = [h for h in str(refused.value).split('; ') if h.endswith('(host memory)')]
  assert len(host_fix) == 1 and 'lower train.microbatches (now 16' in host_fix[0], host_fix
  assert 'move state to disk' not in host_fix[0]
  config.train.microbatches = 8
  assert planner.plan_run(config, hardware.load_profile('rtx4090')).microbatches == 8


def test_the_planner_counts_the_attention_the_layers_execute():
  """A layer's forward executes its attention scores and values against all S keys (the causal
  mask is applied after): ModelConfig.layer_forward_flops, which the planner's step time and
  --calibrate count, is XLA's own count of the compiled layer (unchunked: XLA's cost analysis
  counts a loop's body once). The causal half it counted put a 32k-token step at 1/1.53 of the
  compute it runs. (In query blocks the masked keys are skipped: test_model.py's
  test_attention_scores_the_keys_the_planner_counts.)"""
  from megatrain_jax import model as model_lib  # pylint: disable=import-outside-toplevel
  cfg = ModelConfig(vocab_size=256, d_model=256, num_layers=1, num_heads=4, num_kv_heads=2,
                    d_ff=640, max_seq_len=2048, attention_chunk=0)
  params = model_lib.init_layers(cfg, jax.random.key(0), 0, 1)
  x = np.zeros((1, 2048, 256), np.float32)
  positions = model_lib.default_positions(np.zeros((1, 2048), np.int32))
  cost = jax.jit(lambda p, h: model_lib.apply_group(cfg, p, h, positions)).lower(
      params, x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert cost['flops'] == pytest.approx(2048 * cfg.layer_forward_flops(2048), rel=0.05)
  assert planner.forward_flops(cfg, 2, 3, 2048) == 2 * 3 * 2048 * cfg.layer_forward_flops(2048)


def test_clipped_updates_are_priced_beside_the_next_forward():
  """With exact clipping the layer updates run in the next step's forward (engine/updates.py), so
  a step pays for their transfers and disk I/O only where the forward's compute cannot cover
  them: never less than the unclipped step, less than compute plus all the update's I/O after
  it (101B on one H100 with its Adam state on NVMe, where the updates carry all the disk
  traffic); and where they fit under the forward (7B, everything in host RAM), nothing."""
  fixed = dict(params='host', opt_state='nvme', activations='host', embed_head='device',
               optimizer_on='host', layers_per_group=1, prefetch_depth=1)
  clipped, unclipped = _fixed_plan('101b', 1.0, **fixed), _fixed_plan('101b', 0.0, **fixed)
  times = clipped.times
  assert times['disk'] > 0.2 * times['compute']
  assert unclipped.step_time_s <= clipped.step_time_s < times['compute'] + times['disk']
  # The forward's phase is bound by the updates' disk I/O (all of the step's), the rest by the
  # compute after the forward.
  cfg = ModelConfig.from_config_dict(config_lib.load_config('101b').model)
  micro, batch, seq = clipped.microbatches, clipped.batch_size, clipped.seq_len
  forward = (planner.forward_flops(cfg, micro, batch, seq)
             / planner.step_flops(cfg, clipped.placement, micro, batch, seq)[0])
  assert clipped.step_time_s >= times['disk'] + (1 - forward) * times['compute']
  # Its bottleneck names both phases' bounds (it read 'compute', from the whole-step totals).
  assert clipped.bottleneck == 'compute (disk in the forward phase)', clipped.bottleneck
  fixed = dict(params='host', opt_state='host', activations='host', embed_head='device',
               optimizer_on='device', layers_per_group=1, prefetch_depth=1, park_grads='device')
  clipped, unclipped = _fixed_plan('7b', 1.0, **fixed), _fixed_plan('7b', 0.0, **fixed)
  assert clipped.step_time_s == pytest.approx(unclipped.step_time_s, rel=1e-9)
  assert clipped.bottleneck == 'compute'  # both phases compute-bound
