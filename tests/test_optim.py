"""optim.apply_adamw: the same numbers as optax's AdamW (make_optimizer), step after step."""

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


@pytest.mark.parametrize('train', [_train(), _train(weight_decay=0.0, b2=0.999, warmup_steps=0)])
def test_apply_adamw_matches_optax(train):
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
def test_apply_adamw_matches_the_engines_update(num_micro):
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
  env = dict(os.environ, XLA_FLAGS='--xla_backend_extra_options=xla_cpu_use_multi_output_fusion',
             JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                       check=True)
  assert out.stdout.split()[-1] == '1', out.stdout
