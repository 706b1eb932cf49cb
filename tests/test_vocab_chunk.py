"""The chunked-vocabulary loss (model/vocab.py) is the full-logits cross-entropy without the logits.

Loss and gradients (w.r.t. the normed hidden state and the head weight) are checked against a
float64 numpy reference of the same math, for tied and untied heads, chunks that divide the
vocabulary and chunks that do not, with and without a token mask; the whole model's gradient is
checked against the full-logits loss through the resident engine's microbatch accumulation; and
the compiled forward + backward is checked not to hold an [N, V] buffer.
"""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import model as model_lib
from megatrain_jax.engine import resident
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig, chunked_logits_loss

B, S, D, V = 2, 24, 32, 1000
RTOL = 1e-6


def _rel(got, want):
  """Norm-wise relative error of `got` against the float64 `want`."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _inputs(tied, seed=0):
  k_x, k_w, k_t, k_m = jax.random.split(jax.random.key(seed), 4)
  normed = jax.random.normal(k_x, (B, S, D), jnp.float32)
  weight = 0.3 * jax.random.normal(k_w, (V, D) if tied else (D, V), jnp.float32)
  targets = jax.random.randint(k_t, (B, S), 0, V)
  mask = (jax.random.uniform(k_m, (B, S)) < 0.7).astype(jnp.int32)
  return normed, weight, targets, mask


def _reference(normed, weight, targets, tied, mask=None):
  """(loss, d normed, d weight) in float64: softmax cross-entropy and its analytic gradient."""
  x = np.asarray(normed, np.float64).reshape(-1, D)
  w = np.asarray(weight, np.float64)
  w_vd = w if tied else w.T  # [V, D]
  t = np.asarray(targets).reshape(-1)
  m = np.ones(t.shape) if mask is None else np.asarray(mask, np.float64).reshape(-1)
  weights = m / max(m.sum(), 1.0)
  logits = x @ w_vd.T
  lse = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  nll = lse - logits[np.arange(len(t)), t]
  d_logits = np.exp(logits - lse[:, None])
  d_logits[np.arange(len(t)), t] -= 1
  d_logits *= weights[:, None]
  d_w = d_logits.T @ x  # [V, D]
  return (weights * nll).sum(), (d_logits @ w_vd).reshape(B, S, D), d_w if tied else d_w.T


def _chunked(normed, weight, targets, tied, chunk, mask=None):
  fn = functools.partial(chunked_logits_loss, targets=targets, tied=tied, chunk=chunk,
                         precision='highest', mask=mask)
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(normed, weight)


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
@pytest.mark.parametrize('chunk', [256, 1000, 7, 4096])
@pytest.mark.parametrize('masked', [False, True], ids=['all', 'mask'])
def test_chunked_loss_matches_float64_reference(tied, chunk, masked):
  normed, weight, targets, mask = _inputs(tied)
  mask = mask if masked else None
  loss, (d_normed, d_weight) = _chunked(normed, weight, targets, tied, chunk, mask)
  ref_loss, ref_d_normed, ref_d_weight = _reference(normed, weight, targets, tied, mask)
  errors = (abs(float(loss) - ref_loss) / abs(ref_loss), _rel(d_normed, ref_d_normed),
            _rel(d_weight, ref_d_weight))
  print(f'tied={tied} chunk={chunk} masked={masked}: relative errors loss, d_normed, d_weight = '
        + ', '.join(f'{e:.2e}' for e in errors))
  assert loss.dtype == jnp.float32 and d_normed.shape == normed.shape
  assert d_weight.shape == weight.shape
  assert max(errors) <= RTOL, errors


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_chunked_loss_matches_full_logits_path(tied):
  """The float32 full-logits loss the model used before (cross_entropy of layers' logits), via
  decoder.logits_loss with a vocab_chunk that leaves a ragged last block."""
  cfg = ModelConfig(vocab_size=V, d_model=D, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=48,
                    tie_embeddings=tied, vocab_chunk=300)
  normed, weight, targets, _ = _inputs(tied, seed=1)
  params = {'embed': {'embedding': weight}} if tied else {'head': {'lm_head': {'kernel': weight}}}

  def full(p, n):
    return model_lib.cross_entropy(model_lib.logits(cfg, p, n), targets)

  def chunked(p, n):
    return model_lib.logits_loss(cfg, p, n, targets)

  want, want_grads = jax.jit(jax.value_and_grad(full, argnums=(0, 1)))(params, normed)
  got, got_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(params, normed)
  np.testing.assert_allclose(got, want, rtol=RTOL)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert _rel(a, b) <= RTOL


def test_fully_masked_batch_is_zero_not_nan():
  normed, weight, targets, _ = _inputs(True)
  loss, grads = _chunked(normed, weight, targets, True, 256, jnp.zeros((B, S)))
  assert float(loss) == 0.0
  assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)


def test_bfloat16_compute_dtype():
  """bfloat16 normed: each block's matmul is in bfloat16 like the head's; d_normed comes back in
  bfloat16; the loss is close to the float32 one."""
  normed, weight, targets, _ = _inputs(False)
  loss, (d_normed, d_weight) = _chunked(normed.astype(jnp.bfloat16), weight, targets, False, 256)
  ref_loss, ref_d_normed, _ = _reference(normed, weight, targets, False)
  assert d_normed.dtype == jnp.bfloat16 and d_weight.dtype == jnp.float32
  assert abs(float(loss) - ref_loss) / ref_loss < 1e-2
  assert _rel(d_normed, ref_d_normed) < 3e-2


# ----------------------------------------------------------------------------------------------
# The whole model through the resident engine's microbatch accumulation.
# ----------------------------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
                   max_seq_len=64, init_std=0.2, vocab_chunk=10)


def _full_logits_loss(cfg, params, batch):
  """loss_fn as it was before the chunked loss: cross_entropy of the whole logits."""
  return model_lib.cross_entropy(model_lib.forward(cfg, params, batch[:, :-1]), batch[:, 1:])


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
@pytest.mark.parametrize('num_micro', [1, 2])
def test_resident_accumulation_matches_full_logits(tied, num_micro):
  cfg = TINY.replace(tie_embeddings=tied)
  params = model_lib.init_params(cfg, jax.random.key(0))
  batch = jax.random.randint(jax.random.key(1), (num_micro, 2, 17), 0, cfg.vocab_size)

  def run(loss):
    loss_and_grad = jax.value_and_grad(functools.partial(loss, cfg))
    return jax.jit(lambda p, b: resident.accumulate_gradients(loss_and_grad, p, b))(params, batch)

  loss, grads = run(model_lib.loss_fn)
  ref_loss, ref_grads = run(_full_logits_loss)
  assert abs(float(loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
  flat, ref_flat = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
                    for t in (grads, ref_grads))
  error = _rel(flat, ref_flat)
  print(f'tied={tied} M={num_micro}: whole-model gradient relative error {error:.2e}')
  assert error <= RTOL
  for path, g, r in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                        jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert _rel(g, r) <= 1e-5, path[0]


# ----------------------------------------------------------------------------------------------
# Memory: no [N, V] buffer in the compiled forward + backward.
# ----------------------------------------------------------------------------------------------

def _largest_intermediate(jaxpr) -> int:
  """Elements of the largest value any equation (including nested scans) produces."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      largest = max(largest, int(np.prod(getattr(var.aval, 'shape', ()), dtype=np.int64)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      largest = max(largest, _largest_intermediate(sub))
  return largest


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_compiled_loss_holds_no_token_by_vocab_buffer(tied):
  n, vocab, d, chunk = 512, 32000, 64, 1024  # 32000 % 1024 != 0: the ragged block is covered
  normed = jax.ShapeDtypeStruct((1, n, d), jnp.float32)
  weight = jax.ShapeDtypeStruct((vocab, d) if tied else (d, vocab), jnp.float32)
  targets = jax.ShapeDtypeStruct((1, n), jnp.int32)
  fn = jax.value_and_grad(lambda x, w, t: chunked_logits_loss(
      x, w, t, tied=tied, chunk=chunk, precision='highest'), argnums=(0, 1))
  largest = _largest_intermediate(jax.make_jaxpr(fn)(normed, weight, targets).jaxpr)
  assert largest < n * vocab, largest  # the weight and its gradient (V * D) are the largest
  memory = jax.jit(fn).lower(normed, weight, targets).compile().memory_analysis()
  if memory is not None:
    full_logits = 4 * n * vocab
    print(f'tied={tied}: temp {memory.temp_size_in_bytes / 1e6:.2f} MB, '
          f'[N, V] float32 {full_logits / 1e6:.2f} MB')
    assert memory.temp_size_in_bytes < full_logits / 8


def test_vocab_chunk_config():
  cfg = TINY.replace(vocab_chunk=0)
  assert cfg.resolved_vocab_chunk == 97
  assert cfg.replace(vocab_size=128256).resolved_vocab_chunk == 8192
  assert TINY.resolved_vocab_chunk == 10
  with pytest.raises(ConfigError, match='model.vocab_chunk=-1'):
    TINY.replace(vocab_chunk=-1)
  with pytest.raises(ConfigError, match=r'model.vocab_chunk=98 is larger than model.vocab_size=97'):
    TINY.replace(vocab_chunk=98)
  with pytest.raises(ValueError, match='chunk'):
    chunked_logits_loss(jnp.zeros((1, 2, 4)), jnp.zeros((8, 4)), jnp.zeros((1, 2), jnp.int32),
                        tied=True, chunk=0, precision='highest')
