"""The LM head and its cross-entropy one vocabulary chunk at a time, for weights that arrive in
chunks (the streamed engine keeps the head and embedding in vocabulary-row chunks, schedule.py).

Shapes: normed [B, S, D] (compute dtype), targets [B, S] int (N = B·S tokens), a chunk of Vc
vocabulary entries starting at id `start`: the head kernel's columns [D, Vc], or with tied
embeddings the embedding's rows [Vc, D]. The arithmetic is model/vocab.py's, block for block, so
the streamed engine and the resident one agree to float32 rounding.

Forward, chunk after chunk, an online logsumexp per token (float32):
    m' = max(m, max_v logits)      s' = s·exp(m - m') + Σ_v exp(logits - m')
    t' = t + logits[target]        (the target falls in exactly one chunk)
    loss = mean(m + log s - t)        (with per-token weights w: Σ w·(m + log s - t))
Backward, chunk after chunk again (its logits recomputed): p = exp(logits - lse),
    d logits = (p - onehot(target)) / N  (or · w),  d normed += d logits · Wᵀ,
    d W = normedᵀ · d logits.
The weights w [B, S] are vocab.token_weights of a loss mask (the engines' masked loss).
The same numbers as `jax.grad` of the full-logits cross-entropy within float32 rounding; no
[B, S, V] array ever exists.
"""

import jax
import jax.numpy as jnp

from megatrain_jax.model import layers as layers_lib
from megatrain_jax.model import vocab
from megatrain_jax.model.config import ModelConfig


def _flat(normed):
  return normed.reshape(-1, normed.shape[-1])  # [N = B·S, D]


def chunk_logits(cfg: ModelConfig, normed, weight):
  """[N, Vc] float32 logits of one chunk for normed [B, S, D]: the same matmul as the whole head
  (layers.tied_logits / untied_logits) and as model/vocab.py's blocks."""
  x = _flat(normed)
  axes = ((1,), (1,)) if cfg.tie_embeddings else ((1,), (0,))  # contract D
  logits = jax.lax.dot_general(x, weight.astype(x.dtype), (axes, ((), ())),
                               precision=cfg.matmul_precision)
  return logits.astype(jnp.float32)


def lse_init(targets):
  """The carry before the first chunk: (running max, running sum of exp, target logit), [N]."""
  n = targets.size
  return (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
          jnp.zeros((n,), jnp.float32))


def lse_update(cfg: ModelConfig, normed, weight, targets, start, carry):
  """The carry after one more chunk of the vocabulary, ids [start, start + Vc)."""
  logits = chunk_logits(cfg, normed, weight)
  return vocab.lse_step(carry, logits, targets.reshape(-1), start, start)


def _weights(n: int, weights):
  """Per-token weights [N] float32: `weights` [B, S] flattened, or 1/N (the mean) if None."""
  if weights is None:
    return jnp.full((n,), 1.0 / n, jnp.float32)
  return weights.reshape(-1).astype(jnp.float32)


def lse_finish(carry, weights=None):
  """(loss, per-token logsumexp [N]) once every chunk has been seen (model/vocab.py's
  arithmetic: the loss is Σ nll / N, or Σ weights·nll with `weights` [B, S]; the logsumexp
  nll + target logit)."""
  running_max, running_sum, target_logit = carry
  nll = running_max + jnp.log(running_sum) - target_logit
  return jnp.sum(_weights(nll.shape[0], weights) * nll), nll + target_logit


def chunk_backward(cfg: ModelConfig, normed, weight, targets, start, lse, weights=None):
  """(d normed [B, S, D] float32, d weight) of the loss from one chunk (d loss = 1): the mean,
  or Σ weights·nll with `weights` [B, S] (as lse_finish)."""
  x = _flat(normed)
  flat = targets.reshape(-1)
  scale = _weights(flat.shape[0], weights)[:, None]
  d_x, d_w = vocab.block_grads(x, weight.astype(x.dtype), chunk_logits(cfg, normed, weight), flat,
                               start, lse, scale, tied=cfg.tie_embeddings,
                               precision=cfg.matmul_precision)
  return d_x.reshape(normed.shape), d_w.astype(weight.dtype)


def embed_chunk(cfg: ModelConfig, rows, tokens, start):
  """The embedding of `tokens` [B, S] from rows [Vc, D] of ids [start, start + Vc); tokens outside
  the chunk get zeros, so summing over all chunks gives the embedding (each token from one)."""
  local = tokens - start
  inside = (local >= 0) & (local < rows.shape[0])
  x = jnp.take(rows, jnp.clip(local, 0, rows.shape[0] - 1), axis=0)
  return jnp.where(inside[..., None], x, 0.0).astype(layers_lib.compute_dtype(cfg))


def embed_chunk_backward(cfg: ModelConfig, rows_shape, tokens, start, dx):
  """d rows [Vc, D] (float32) of `embed_chunk` given d x [B, S, D]."""
  zeros = jnp.zeros(rows_shape, jnp.float32)
  _, vjp = jax.vjp(lambda r: embed_chunk(cfg, r, tokens, start), zeros)
  return vjp(dx)[0]
