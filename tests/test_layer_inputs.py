"""offload.keep_layer_inputs: a group of K > 1 layers keeps every layer's input from the forward,
so its backward recomputes each layer once (as K = 1 does) instead of recomputing the group first
and each layer again inside its remat. The planner counts the kept inputs (L·M·B·S·D·c instead of
G·M·B·S·D·c) and the saved recompute, keeps them under 'auto' when they fit, and leaves K = 1
plans as they were. The parity with the resident engine is in test_streamed.py; the transfer
bytes against the engine's counters in test_planner.py's traffic cases."""

import functools

import jax
import jax.extend.core as jax_core
import numpy as np
import pytest

from megatrain_jax import config as config_lib
from megatrain_jax import hardware
from megatrain_jax import model as model_lib
from megatrain_jax import planner
from megatrain_jax import train
from megatrain_jax.engine import functions
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import decoder
from megatrain_jax.placement import Placement

from helpers import CFG, TRAIN

SIZES = planner.state_sizes(CFG, planner.train_key(TRAIN))
BIG = {'device': 1e15, 'host': 1e15, 'nvme': 1e15}
MICRO, BATCH, SEQ = 2, 2, 16


def _plan(placement, micro=MICRO):
  return planner.make_plan(CFG, SIZES, placement, hardware.PRESETS['h100'], micro=micro,
                           batch=BATCH, seq=SEQ, clipping=True, budgets=BIG)


def _placement(k, activations='device', keep=True):
  return Placement(params='host', opt_state='host', activations=activations, layers_per_group=k,
                   keep_layer_inputs=keep)


# --- the saving forward and the backward from the saved inputs -----------------------------------

@pytest.mark.parametrize('scan_layers', [True, False])
def test_forward_keeping_inputs_returns_each_layers_input(scan_layers):
  cfg = CFG.replace(scan_layers=scan_layers)
  layers = model_lib.init_layers(cfg, jax.random.key(0), 0, 3)
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, cfg.d_model))
  positions = model_lib.default_positions(np.zeros((BATCH, SEQ), np.int32))
  y, inputs = jax.jit(functools.partial(decoder.apply_group_keeping_inputs, cfg))(
      layers, x, positions)
  assert inputs.shape == (3, BATCH, SEQ, cfg.d_model)
  h = x
  for i in range(3):  # layer by layer: inputs[i] is what layer i received
    np.testing.assert_allclose(inputs[i], h, rtol=1e-5, atol=1e-5)
    h = model_lib.apply_layer(cfg, jax.tree.map(lambda a, i=i: a[i], layers), h, positions)
  np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y, model_lib.apply_group(cfg, layers, x, positions), rtol=1e-5,
                             atol=1e-5)


def _executed_dots(closed) -> int:
  """Matmuls a jaxpr executes: dot_generals, with scan bodies counted once per iteration."""
  count = 0
  for eqn in closed.jaxpr.eqns if hasattr(closed, 'jaxpr') else closed.eqns:
    times = eqn.params.get('length', 1) if eqn.primitive.name == 'scan' else 1
    count += eqn.primitive.name == 'dot_general'
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
          count += times * _executed_dots(sub)
  return count


def test_backward_from_inputs_recomputes_each_layer_once():
  """Matmuls of one group's backward (K = 2, remat full), counted in its program: from the layer
  inputs, exactly K times a one-layer group's backward (the K = 1 path: the layer's forward once,
  then its backward); from the group input, about one layer forward more per layer (the group's
  forward, then each layer's again inside its remat; JAX drops a matmul or two of the unused
  group output). Same gradients."""
  k = 2
  params = {'layers': model_lib.init_layers(CFG, jax.random.key(0), 0, k)}
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, CFG.d_model))
  positions = model_lib.default_positions(np.zeros((BATCH, SEQ), np.int32))
  dy = jax.random.normal(jax.random.key(2), x.shape)
  zeros = jax.tree.map(np.zeros_like, params)
  _, inputs = decoder.apply_group_keeping_inputs(CFG, params['layers'], x, positions)
  old = functools.partial(functions._group_backward, CFG, None)
  new = functools.partial(functions._group_backward_from_inputs, CFG, None)
  first = jax.tree.map(lambda a: a[:1], params)
  layer_forward = _executed_dots(jax.make_jaxpr(
      lambda p, h: model_lib.apply_layer(CFG, p, h, positions))(
          jax.tree.map(lambda a: a[0], params['layers']), x))
  one_layer_group = _executed_dots(jax.make_jaxpr(old)(first, x, dy, positions,
                                                       jax.tree.map(np.zeros_like, first)))
  from_group = _executed_dots(jax.make_jaxpr(old)(params, x, dy, positions, zeros))
  from_layers = _executed_dots(jax.make_jaxpr(new)(params, inputs, dy, positions, zeros))
  assert from_layers == k * one_layer_group
  assert from_group - from_layers >= 0.8 * k * layer_forward > 0, (from_group, from_layers)
  (g_old, dx_old), (g_new, dx_new) = (old(params, x, dy, positions, zeros),
                                      new(params, inputs, dy, positions, zeros))
  np.testing.assert_allclose(dx_new, dx_old, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g_new, g_old)


# --- the planner -----------------------------------------------------------------------------------

@pytest.mark.parametrize('k', [2, 3])
@pytest.mark.parametrize('activations', ['device', 'host'])
def test_kept_inputs_rows(k, activations):
  """The boundary row holds every layer's input (K per group; the last group of K = 3 has one);
  the group backward no longer holds the recomputed group's K inputs, only one layer's internals
  (+ the K inputs back from the host); every other row is as without them."""
  kept = {r.item: r for r in _plan(_placement(k, activations)).rows}
  not_kept = {r.item: r for r in _plan(_placement(k, activations, keep=False)).rows}
  hidden = planner.hidden_bytes(CFG, BATCH, SEQ)
  internals = planner.layer_internal_bytes(CFG, BATCH, SEQ)
  groups = -(-CFG.num_layers // k)
  boundary = f'boundary activations ({CFG.num_layers} layers × {MICRO} mb)'
  assert kept.pop(boundary).bytes == CFG.num_layers * MICRO * hidden
  old = not_kept.pop(f'boundary activations ({groups} groups × {MICRO} mb)')
  assert old.bytes == groups * MICRO * hidden and old.tier == activations
  assert kept.pop('group backward working set').bytes == (
      internals + k * hidden * (activations == 'host'))
  assert not_kept.pop('group backward working set').bytes == k * hidden + internals
  for rows in (kept, not_kept):  # XLA's pinned pool grows from each plan's own pinned rows
    rows.pop(planner.POOL_ROW, None)
  assert {i: r.bytes for i, r in kept.items()} == {i: r.bytes for i, r in not_kept.items()}


def test_k1_plans_are_unchanged():
  """A one-layer group's input is its layer's: nothing more to keep, the same plan either way."""
  for activations in ('device', 'host'):
    kept, not_kept = (_plan(_placement(1, activations, keep)) for keep in (True, False))
    assert kept.rows == not_kept.rows
    assert (kept.traffic, kept.times, kept.step_time_s) == (
        not_kept.traffic, not_kept.times, not_kept.step_time_s)
  assert _placement(1).summary() == _placement(1, keep=False).summary()


def test_kept_inputs_recompute_and_traffic():
  """Kept inputs cost K = 1's compute (each layer's forward twice), and on the host the L − G
  extra inputs cross to it and back."""
  flops = lambda p: planner.step_flops(CFG, p, MICRO, BATCH, SEQ)[0]
  assert flops(_placement(2)) == flops(_placement(1)) < flops(_placement(2, keep=False))
  hidden = planner.hidden_bytes(CFG, BATCH, SEQ)
  for k in (2, 3):
    extra = (CFG.num_layers - -(-CFG.num_layers // k)) * MICRO * hidden
    kept = planner.traffic(CFG, SIZES, _placement(k, 'host'), MICRO, BATCH, SEQ, True)
    not_kept = planner.traffic(CFG, SIZES, _placement(k, 'host', False), MICRO, BATCH, SEQ, True)
    assert kept == {**not_kept, 'h2d': not_kept['h2d'] + extra,
                    'd2h': not_kept['d2h'] + extra}
    assert planner.traffic(CFG, SIZES, _placement(k), MICRO, BATCH, SEQ, True) == (
        planner.traffic(CFG, SIZES, _placement(k, keep=False), MICRO, BATCH, SEQ, True))


# Gradients parked in the weights' tier: these plans vary the layer inputs alone (with
# offload.park_grads=auto a device budget between 'kept' and 'not kept' fits the inputs kept and
# the gradients on the host, which the planner prefers: test_planner covers that trade).
FIXED = dict(hardware='cpu', offload__params='host', offload__opt_state='host',
             offload__activations='device', offload__embed_head='device',
             offload__optimizer_on='device', offload__prefetch_depth=1, train__microbatches=2,
             offload__park_grads='weights')


def _plan_run(**overrides):
  config = config_lib.load_config('tiny', **{**FIXED, **overrides})
  return planner.plan_run(config, hardware.load_profile('cpu'), disk_free_gb=100.0)


def _planned_rows(plan):
  """A plan's rows but the runtime row, which is this process's RSS when it planned (it moves by
  a few pages from one plan to the next)."""
  return [row for row in plan.rows if row.item != planner.RUNTIME_ROW]


def test_auto_keeps_the_inputs_when_they_fit():
  auto = _plan_run(offload__layers_per_group=2)
  assert auto.placement.keep_layer_inputs is True and auto.placement.keeps_layer_inputs
  assert 'K=2 (layer inputs kept)' in auto.placement.summary()
  kept, not_kept = (_plan_run(offload__layers_per_group=2, offload__keep_layer_inputs=v)
                    for v in ('true', 'false'))
  assert _planned_rows(auto) == _planned_rows(kept)
  assert auto.step_time_s == kept.step_time_s < not_kept.step_time_s
  assert kept.used('device') > not_kept.used('device')
  # A device budget between the two: auto plans without them; 'true' is refused, and says so.
  budget = (kept.used('device') + not_kept.used('device')) / 2 / 1e9
  tight = _plan_run(offload__layers_per_group=2, offload__device_memory_gb=budget)
  assert tight.placement.keep_layer_inputs is False
  assert _planned_rows(tight) == _planned_rows(not_kept)
  assert 'K=2 (group inputs only)' in tight.placement.summary()
  with pytest.raises(ConfigError, match=r"offload.keep_layer_inputs='false'"):
    _plan_run(offload__layers_per_group=2, offload__device_memory_gb=budget,
              offload__keep_layer_inputs='true')
  # K = 1: nothing to keep; the plan is the one it always was.
  one = _plan_run(offload__layers_per_group=1)
  assert one.placement.keep_layer_inputs is False
  assert _planned_rows(one) == _planned_rows(
      _plan_run(offload__layers_per_group=1, offload__keep_layer_inputs='true'))


def test_dry_run_shows_the_kept_inputs(capsys):
  config = config_with_fixed(offload__layers_per_group=2)
  train.dry_run(config)
  out = capsys.readouterr().out
  assert 'K=2 (layer inputs kept)' in out
  row = next(line for line in out.splitlines() if 'boundary activations' in line)
  assert f'({config.model.num_layers} layers × 2 mb)' in row
  assert 'L·M·B·S·D·c (keep_layer_inputs: K per group)' in row


def config_with_fixed(**overrides):
  return config_lib.load_config('tiny', jax_cache_dir='', **{**FIXED, **overrides})


@pytest.mark.parametrize('value, want', [('auto', 'auto'), ('true', True), ('True', True),
                                         ('false', False), ('FALSE', False)])
def test_config_values(value, want):
  config = config_lib.load_config('tiny', offload__keep_layer_inputs=value)
  cfg = model_lib.ModelConfig.from_config_dict(config.model)
  assert Placement.from_config(config.offload, cfg, allow_auto=True).keep_layer_inputs == want


@pytest.mark.parametrize('value', ['yes', '1', ''])
def test_bad_config_value_is_refused(tmp_path, value):
  with pytest.raises(ConfigError, match=rf"offload.keep_layer_inputs='{value}': use true .*, "
                                        r'false .* or auto\.'):
    train.dry_run(config_with_fixed(offload__keep_layer_inputs=value))
