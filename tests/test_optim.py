"""optim.apply_adamw: the same numbers as optax's AdamW (make_optimizer), step after step."""

import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import optim


def _train(**kw):
  fields = dict(lr=3e-3, warmup_steps=3, steps=20, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                weight_decay=0.1)
  return types.SimpleNamespace(**{**fields, **kw})


def _tree(key):
  k = jax.random.split(key, 4)
  return {'embed': {'embedding': jax.random.normal(k[0], (16, 8))},
          'layers': {'attn': {'kernel': jax.random.normal(k[1], (3, 8, 8))},
                     'norm': {'scale': 1 + 0.1 * jax.random.normal(k[2], (3, 8))}},
          'head': {'bias': jax.random.normal(k[3], (5,))}}


def _optax_step(tx, grads, state, params):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


# pylint: disable=redefined-outer-name,unused-argument  (the `mof` fixture)
@pytest.fixture(params=[False, True], ids=['mof-off', 'mof-on'])
def mof(request, monkeypatch):
  """Both of _adamw_leaf's formulations: the plain one, and the one written for XLA:CPU's
  multi-output fusion (MEGATRAIN_JAX_XLA_CPU_MOF=1), whose outputs recompute m' and v' as other
  expressions with the same IEEE result. The flag itself is process-wide, so here only the
  formulation changes; test_apply_adamw_matches_optax_under_multi_output_fusion compiles it
  with the flag on."""
  monkeypatch.setattr(optim.runtime, 'multi_output_fusion', lambda: request.param)
  return request.param


@pytest.mark.parametrize('train', [_train(), _train(weight_decay=0.0, b2=0.999, warmup_steps=0),
                                   _train(lr_schedule='linear'), _train(lr_schedule='constant')],
                         ids=['cosine', 'cosine-no-decay', 'linear', 'constant'])
def test_apply_adamw_matches_optax(train, mof):
  tx = optim.make_optimizer(train)
  params = _tree(jax.random.key(0))
  ref = (params, tx.init(params))
  new = (params, tx.init(params))
  fused = jax.jit(lambda g, s, p: optim.apply_adamw(tx, g, s, p))
  plain = jax.jit(lambda g, s, p: _optax_step(tx, g, s, p))
  for step in range(8):
    grads = jax.tree.map(lambda x: x * (0.5 + step) * 1e-2, _tree(jax.random.key(step + 1)))
    ref = plain(grads, ref[1], ref[0])
    new = fused(grads, new[1], new[0])
  assert jax.tree.structure(new) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize('num_micro', [1, 3])
def test_apply_adamw_matches_the_engines_update(num_micro, mof):
  """With the gradient mean and clip scale folded in, as engine/functions._host_update calls it."""
  from megatrain_jax.engine import functions  # pylint: disable=import-outside-toplevel
  tx = optim.make_optimizer(_train())
  params = _tree(jax.random.key(0))
  ref = new = (params, tx.init(params))
  fused = jax.jit(lambda g, s, p, c: optim.apply_adamw(tx, g, s, p, num_micro, c))
  plain = jax.jit(lambda g, s, p, c: functions.adamw_update(tx, g, s, p, c, num_micro))
  for step in range(5):
    grads = jax.tree.map(lambda x: x * 1e-2, _tree(jax.random.key(step + 1)))
    scale = jnp.float32(0.5 + 0.1 * step)
    ref, new = plain(grads, ref[1], ref[0], scale), fused(grads, new[1], new[0], scale)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7 * max(1.0, float(np.abs(b).max())))


def test_apply_adamw_falls_back_to_optax_for_other_transformations():
  tx = optax.adam(1e-2)
  params = _tree(jax.random.key(0))
  grads = jax.tree.map(lambda x: 0.1 * x, params)
  got = optim.apply_adamw(tx, grads, tx.init(params), params)
  want = _optax_step(tx, grads, tx.init(params), params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('train', [_train(), _train(weight_decay=0.0, b2=0.999, warmup_steps=0),
                                   _train(lr_schedule='linear')])
def test_initial_state_is_zero_only_where_init_gives_zeros(train):
  """The NVMe stores register make_optimizer's initial state as zeros without writing it
  (tiers/nvme.py): every leaf of its init must be zero, and no other transformation is assumed."""
  tx = optim.make_optimizer(train)
  assert optim.initial_state_is_zero(tx)
  leaves = jax.tree.leaves(tx.init(_tree(jax.random.key(0))))
  assert leaves and all(not np.any(np.asarray(x)) for x in leaves)
  assert not optim.initial_state_is_zero(optax.adam(1e-2))


def _run_with_multi_output_fusion(code: str) -> str:
  """stdout of `code` run by a fresh CPU process with XLA:CPU's multi-output fusion on (an XLA
  flag is read once, when the backend starts)."""
  env = dict(os.environ, XLA_FLAGS='--xla_backend_extra_options=xla_cpu_use_multi_output_fusion',
             JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        check=True).stdout


def test_apply_adamw_is_one_loop_with_multi_output_fusion():
  """With XLA:CPU's multi-output fusion (runtime.py turns it on) a leaf's update compiles to one
  fusion with three outputs: p, g, m, v read once (optax's update compiles to more)."""
  code = (
      'import types, jax, jax.numpy as jnp\n'
      'from megatrain_jax import optim\n'
      'tx = optim.make_optimizer(types.SimpleNamespace(lr=1e-3, warmup_steps=1, steps=10, '
      'min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))\n'
      'p = {"kernel": jnp.ones((1 << 16,))}\n'
      'f = jax.jit(lambda g, s, p: optim.apply_adamw(tx, g, s, p), donate_argnums=(1, 2))\n'
      'text = f.lower(p, tx.init(p), p).compile().as_text()\n'
      'print(sum(1 for l in text.splitlines() if " fusion(" in l and "f32[65536]" in l.split("=")[1]'
      '.split("fusion(")[0]))\n')
  out = _run_with_multi_output_fusion(code)
  assert out.split()[-1] == '1', out


def test_apply_adamw_matches_optax_under_multi_output_fusion():
  """The update as the host optimizer compiles it with MEGATRAIN_JAX_XLA_CPU_MOF=1 (one loop per
  leaf, bench/host_adamw.py): within 1e-6 of optax's AdamW (the engines' adamw_update) for decayed
  and non-decayed leaves, the gradient mean over microbatches and a clip scale, step after step."""
  code = (
      'import json, types, jax, jax.numpy as jnp, numpy as np\n'
      'from megatrain_jax import optim, runtime\n'
      'from megatrain_jax.engine import functions\n'
      'assert runtime.multi_output_fusion()\n'
      'tx = optim.make_optimizer(types.SimpleNamespace(lr=3e-3, warmup_steps=2, steps=20, '
      'min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))\n'
      'k = jax.random.split(jax.random.key(0), 3)\n'
      'params = {"embed": {"embedding": jax.random.normal(k[0], (64, 32))}, '
      '"norm": {"scale": 1 + 0.1 * jax.random.normal(k[1], (4096,))}, '
      '"mlp": {"kernel": jax.random.normal(k[2], (32, 128)), "bias": jnp.zeros((128,))}}\n'
      'errors = {}\n'
      'for num_micro, clip in ((1, False), (1, True), (3, False), (3, True)):\n'
      '  fused = jax.jit(lambda g, s, p, c: optim.apply_adamw(tx, g, s, p, num_micro, c))\n'
      '  plain = jax.jit(lambda g, s, p, c: functions.adamw_update(tx, g, s, p, c, num_micro))\n'
      '  ref, new = (params, tx.init(params)), (params, tx.init(params))\n'
      '  worst = 0.0\n'
      '  for step in range(6):\n'
      '    grads = jax.tree.map(lambda x: x * (0.5 + step) * 1e-2 * num_micro, params)\n'
      '    grads = jax.tree.map(lambda g, n: g + 1e-3 * n, grads, jax.tree.map(jnp.sin, ref[0]))\n'
      '    scale = jnp.float32(0.5 + 0.1 * step)\n'
      '    ref = plain(grads, ref[1], ref[0], scale if clip else jnp.float32(1))\n'
      '    new = fused(grads, new[1], new[0], scale if clip else None)\n'
      '    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):\n'
      '      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)\n'
      '      tol = 1e-6 * np.abs(b) + 1e-7 * max(1.0, float(np.abs(b).max()))\n'
      '      worst = max(worst, float(np.max(np.abs(a - b) / tol)))\n'
      '  errors[f"{num_micro},{clip}"] = worst\n'
      'text = fused.lower(params, tx.init(params), params, jnp.float32(1)).compile().as_text()\n'
      'print(json.dumps({"errors": errors, "fusions": sum(1 for l in text.splitlines() '
      'if " fusion(" in l and "f32[4096]" in l.split("=")[1].split("fusion(")[0])}))\n')
  result = json.loads(_run_with_multi_output_fusion(code).strip().splitlines()[-1])
  # error / (1e-6 |optax| + 1e-7 max |optax|) <= 1: every leaf, every step, each case
  assert all(e <= 1.0 for e in result['errors'].values()), result
  assert result['fusions'] == 1, result  # the 4096-element norm scale: one loop, three outputs


@pytest.mark.parametrize('release', ['0.10', '0.11.2'])
def test_host_update_asks_compute_on_for_the_host_as_each_jax_release_spells_it(monkeypatch,
                                                                               release):
  """optim.on_host (the engines' host update, --calibrate's probe): jax 0.10's compute_on takes the compute type positionally (a
  context manager, also a decorator); 0.11.2's, the lent GPU image's, is a decorator with
  keyword-only compute_type and a required out_memory_spaces. CI runs 0.10 only, so 0.11.2's
  signature is stood in for here (the engine tests passed under the real 0.11.2, 2026-12-05)."""
  calls = []
  if release == '0.10':
    def compute_on(compute_type):
      calls.append((compute_type,))
      return lambda fn: fn
  else:
    def compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
      del f, compiler_options
      calls.append((compute_type, out_memory_spaces))
      return lambda fn: fn
  monkeypatch.setattr(optim.compute_on_lib, 'compute_on', compute_on)
  assert optim.on_host(lambda x: x + 1)(1) == 2
  want = ('device_host',) if release == '0.10' else ('device_host', jax.memory.Space.Host)
  assert calls == [want]


@pytest.mark.parametrize('kind', optim.LR_SCHEDULES)
def test_learning_rate_schedules(kind):
  """train.lr_schedule after a linear warmup of 4 steps (lr 0, 0.25, 0.5, 0.75): cosine and linear
  reach lr * min_lr_ratio at train.steps (linear in equal steps, as Hugging Face's Trainer with
  min_lr_ratio 0), constant holds lr; every engine takes the same function (make_optimizer)."""
  schedule = optim.lr_schedule(_train(lr=1.0, warmup_steps=4, steps=14, min_lr_ratio=0.2,
                                      lr_schedule=kind))
  lrs = np.array([float(schedule(i)) for i in range(16)])
  np.testing.assert_allclose(lrs[:5], [0.0, 0.25, 0.5, 0.75, 1.0], atol=1e-7)
  after = lrs[4:15]  # steps 4..14
  if kind == 'constant':
    np.testing.assert_allclose(after, 1.0)
  else:
    assert np.all(np.diff(after) < 0) and after[-1] == pytest.approx(0.2)
    steps = np.diff(after)
    if kind == 'linear':
      np.testing.assert_allclose(steps, -0.08, rtol=1e-5)
    else:  # cosine: slow, fast, slow
      assert abs(steps[0]) < abs(steps[5]) > abs(steps[-1])
  assert lrs[15] == pytest.approx(lrs[14])  # past train.steps: held
  # train.warmup_ratio: a fraction of the steps (rounded up) instead of warmup_steps.
  ratio = optim.lr_schedule(_train(lr=1.0, warmup_steps=50, steps=14, min_lr_ratio=0.2,
                                   warmup_ratio=0.25, lr_schedule=kind))
  np.testing.assert_allclose([float(ratio(i)) for i in range(16)], lrs, atol=1e-7)  # 4 steps
  assert optim.warmup_steps(_train(warmup_steps=50, steps=14)) == 13  # clamped to steps - 1
  # No warmup, linear to 0: Hugging Face's get_linear_schedule_with_warmup(0, 10).
  hf_like = optim.lr_schedule(_train(lr=1.0, warmup_steps=0, steps=10, min_lr_ratio=0.0,
                                     lr_schedule='linear'))
  np.testing.assert_allclose([float(hf_like(i)) for i in range(10)], 1.0 - np.arange(10) / 10,
                             atol=1e-7)


def test_warmup_ratio_counts_warmup_steps_as_the_trainer_does():
  """train.warmup_ratio gives the warmup of transformers' TrainingArguments (ceil(steps * ratio):
  70 steps at 0.03 warm up for 3, where rounding gave 2 and the lr differed by 33% of its peak
  on the way up)."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  for steps in (10, 50, 70, 100, 150, 1000, 4321):
    for ratio in (0.01, 0.03, 0.05, 0.07, 0.1, 0.25):
      trainer = transformers.TrainingArguments.get_warmup_steps(
          types.SimpleNamespace(warmup_steps=ratio), steps)
      assert optim.warmup_steps(_train(steps=steps, warmup_ratio=ratio)) == trainer, (steps, ratio)
  assert optim.warmup_steps(_train(steps=70, warmup_ratio=0.03)) == 3


def test_a_run_that_ends_inside_its_warmup_is_told():
  """optim.warmup_note: 50 warmup steps in a 30-step run (the tiny preset with a short
  train.steps) ends at the peak learning rate, and says so with the fix; a warmup that ends
  before the run, a warmup_ratio (always a fraction of the steps) and a one-step run say
  nothing."""
  note = optim.warmup_note(_train(lr=3e-3, warmup_steps=50, steps=30))
  assert note == ('note: train.warmup_steps=50 is not below train.steps=30: the learning rate '
                  'rises for 29 steps and the run ends at its peak, 0.003, with no decay. Lower '
                  'train.warmup_steps or set train.warmup_ratio (e.g. 0.03).')
  assert optim.warmup_note(_train(lr=3e-3, warmup_steps=30, steps=30)) is not None
  for quiet in (dict(warmup_steps=29, steps=30), dict(warmup_steps=50, steps=30,
                                                      warmup_ratio=0.1),
                dict(warmup_steps=50, steps=1)):
    assert optim.warmup_note(_train(lr=3e-3, **quiet)) is None


def test_calibrate_times_the_host_adamw_the_engines_run():
  """--calibrate's host AdamW probe (run on accelerators only) made optax's state of pinned-host
  params, device buffers under a pinned-host sharding: a ValueError before anything was measured
  (the CPU backend has the same memory kinds, so it shows here). It now times optim.host_adamw on
  pinned-host trees, as the engines run it."""
  from megatrain_jax import calibrate  # pylint: disable=import-outside-toplevel
  assert calibrate._adam_gparams('pinned_host', 1 << 16) > 0  # pylint: disable=protected-access
