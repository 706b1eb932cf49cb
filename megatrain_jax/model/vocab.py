"""The LM head's cross-entropy over vocabulary chunks: the [N, V] logits never exist whole.

`chunked_logits_loss` computes the same mean token cross-entropy as
`cross_entropy(logits(normed))` (decoder.py), but walks the vocabulary `chunk` columns at a time:

  forward   a `lax.scan` over chunks keeps, per token, the running max and sum of exponentials of
            the logits seen so far (an online logsumexp) and picks up the target's logit when its
            chunk goes by. Live memory: one [N, chunk] float32 block instead of [N, V].
  backward  a second scan recomputes each chunk's logits from the saved inputs, forms
            d_logits = (softmax - onehot) * g * w_token from the saved logsumexp, accumulates
            d_normed and emits the chunk's rows of d_weight. No [N, V] gradient either.

Each chunk's logits are the same matmul as layers.tied_logits / untied_logits (in the compute
dtype at `precision`, then cast to float32), so the result equals the full-logits loss to float32
rounding. When `chunk` does not divide V, the last block slides back to end at column V (no padded
copy of the weight): its columns that the previous block already covered are masked to -inf in the
forward (they add nothing to the sum) and get a zero gradient in the backward. Besides its inputs
and outputs the pair holds O(N * chunk) floats: the compiled forward + backward of N = 512 tokens,
V = 32000, D = 64, chunk = 1024 needs 4.2 MB of temporaries (XLA CPU) where the full logits need
262 MB.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

_AXES = {True: ((1,), (1,)), False: ((1,), (0,))}  # contract D: tied [c, D], untied [D, c]


def token_weights(mask) -> np.ndarray:
  """Per-token loss weights of one step from its loss mask (host numpy; both engines use it).

  mask  [M, B, S] (M microbatches) or [B, S] (one batch, M = 1), 1 = the target is learned.

  Returns float32 weights w = mask * M / T, T = the number of learned tokens of the whole step
  (all M microbatches). The engines average their M microbatch losses Σ w·nll (and gradients),
  so the step's loss is Σ_all mask·nll / T: the full batch's masked mean, not a mean of the
  microbatches' means (they differ when microbatches hold different numbers of learned tokens).
  A step with no learned token (T = 0) gets all-zero weights: loss 0 and zero gradients, never
  NaN. An all-ones mask gives w = M / (M·N) = 1/N rounded once, the unmasked path's weight.
  """
  mask = np.asarray(mask)
  num_micro = mask.shape[0] if mask.ndim == 3 else 1
  total = np.float32(max(int(np.count_nonzero(mask)), 1))
  return (mask != 0).astype(np.float32) * (np.float32(num_micro) / total)


def chunked_logits_loss(normed, weight, targets, *, tied: bool, chunk: int, precision,
                        mask=None, weights=None):
  """Mean cross-entropy of the LM head over the (unmasked) tokens, as a float32 scalar.

  normed  [B, S, D] in the compute dtype (the final norm's output).
  weight  the head: the embedding [V, D] if `tied`, else the lm_head kernel [D, V] (float32).
  targets [B, S] int token ids in [0, V).
  chunk   vocabulary columns per block (> 0; values >= V mean one block).
  precision  the matmul precision (ModelConfig.matmul_precision).
  mask    optional [B, S], 1 = the token counts: the loss is the mean over masked-in tokens
          (0 if none is). Default: every token counts (= jnp.mean, as decoder.cross_entropy).
  weights optional [B, S] float32 per-token weights (`token_weights`): the loss is
          Σ weights·nll. Overrides `mask`.
  """
  vocab = weight.shape[0] if tied else weight.shape[1]
  if not isinstance(chunk, int) or chunk <= 0:
    raise ValueError(f'chunk={chunk!r} must be a positive integer (vocabulary columns per block).')
  chunk = min(chunk, vocab)
  x = normed.reshape(-1, normed.shape[-1])
  flat_targets = targets.reshape(-1).astype(jnp.int32)
  if weights is not None:
    per_token = weights.reshape(-1).astype(jnp.float32)
  elif mask is None:
    per_token = jnp.full(flat_targets.shape, 1.0 / flat_targets.shape[0], jnp.float32)
  else:
    m = mask.reshape(-1).astype(jnp.float32)
    per_token = m / jnp.maximum(jnp.sum(m), 1.0)
  return _weighted_nll(tied, chunk, precision, x, weight, flat_targets, per_token)


def _block(x, weight, index, *, tied: bool, chunk: int, vocab: int, precision):
  """(start, valid [chunk] bool, weight block in the compute dtype, float32 logits [N, chunk]).

  Block `index` covers columns [index * chunk, (index + 1) * chunk). The last block of a vocabulary
  that `chunk` does not divide is slid back to end at V (start = V - chunk, no padded copy of the
  weight); its columns below index * chunk belong to the previous block and are masked to -inf.
  """
  start = jnp.minimum(index * chunk, vocab - chunk)
  w = jax.lax.dynamic_slice_in_dim(weight, start, chunk, axis=0 if tied else 1).astype(x.dtype)
  logits = jax.lax.dot_general(x, w, (_AXES[tied], ((), ())), precision=precision)
  logits = logits.astype(jnp.float32)  # exactly layers.tied_logits / untied_logits, per block
  valid = start + jnp.arange(chunk) >= index * chunk
  if vocab % chunk:
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
  return start, valid, w, logits


def lse_step(carry, logits, targets, start, first):
  """One block of the online logsumexp: carry (running max, sum of exp, target logit) [N] ->
  the carry after `logits` [N, c] float32 of ids [start, start + c), of which ids >= `first` are
  new (a slid-back last block repeats some columns, masked to -inf in `logits`)."""
  running_max, sum_exp, target_logit = carry
  size = logits.shape[-1]
  new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
  sum_exp = (sum_exp * jnp.exp(running_max - new_max)
             + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=-1))
  hit = (targets >= first) & (targets < start + size)
  local = jnp.clip(targets - start, 0, size - 1)
  picked = jnp.take_along_axis(logits, local[:, None], axis=-1)[:, 0]
  return new_max, sum_exp, target_logit + jnp.where(hit, picked, 0.0)


def block_grads(x, w, logits, targets, start, lse, scale, *, tied: bool, precision, valid=None):
  """(d x [N, D] float32, d w float32: tied [c, D], untied [D, c]) of one block: x [N, D] and w
  the block's weight in the compute dtype, logits [N, c] float32 of ids [start, start + c), lse
  [N] and scale [N, 1] (d loss / d nll per token); `valid` [c] masks repeated columns."""
  ids = start + jnp.arange(logits.shape[-1])
  onehot = targets[:, None] == ids[None, :]
  if valid is not None:
    onehot = onehot & valid[None, :]
  d_logits = ((jnp.exp(logits - lse[:, None]) - onehot) * scale).astype(x.dtype)
  axis = 0 if tied else 1
  d_x = jax.lax.dot_general(d_logits, w, (((1,), (axis,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
  d_w = jax.lax.dot_general(x, d_logits, (((0,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # [D, c]
  return d_x, (d_w.T if tied else d_w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _weighted_nll(tied, chunk, precision, x, weight, targets, token_weights):
  """sum_n token_weights[n] * (logsumexp(logits[n]) - logits[n, targets[n]])."""
  loss, _ = _weighted_nll_fwd(tied, chunk, precision, x, weight, targets, token_weights)
  return loss


def _weighted_nll_fwd(tied, chunk, precision, x, weight, targets, token_weights):
  vocab = weight.shape[0] if tied else weight.shape[1]
  block = functools.partial(_block, x, weight, tied=tied, chunk=chunk, vocab=vocab,
                            precision=precision)
  n = x.shape[0]

  def step(carry, index):
    start, _, _, logits = block(index)
    return lse_step(carry, logits, targets, start, index * chunk), None

  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
          jnp.zeros((n,), jnp.float32))
  (running_max, sum_exp, target_logit), _ = jax.lax.scan(step, init, jnp.arange(-(-vocab // chunk)))
  nll = running_max + jnp.log(sum_exp) - target_logit
  loss = jnp.sum(token_weights * nll)
  return loss, (x, weight, targets, token_weights, nll + target_logit, nll)


def _weighted_nll_bwd(tied, chunk, precision, residuals, g):
  x, weight, targets, token_weights, lse, nll = residuals
  vocab = weight.shape[0] if tied else weight.shape[1]
  block = functools.partial(_block, x, weight, tied=tied, chunk=chunk, vocab=vocab,
                            precision=precision)
  axis = 0 if tied else 1
  scale = (g * token_weights)[:, None]  # d loss / d nll[n]

  def step(carry, index):
    d_x, d_weight = carry
    start, valid, w, logits = block(index)
    block_d_x, d_w = block_grads(x, w, logits, targets, start, lse, scale, tied=tied,
                                 precision=precision, valid=valid)
    # d_x accumulates in float32 across blocks (a bfloat16 running sum would lose bits).
    d_x = d_x + block_d_x
    # The block's rows (tied [chunk, D]) or columns (untied [D, chunk]) of d_weight, added in
    # place: a slid-back last block adds zeros over the columns its predecessor wrote.
    d_w = d_w.astype(d_weight.dtype)
    old = jax.lax.dynamic_slice_in_dim(d_weight, start, chunk, axis=axis)
    d_weight = jax.lax.dynamic_update_slice_in_dim(d_weight, old + d_w, start, axis=axis)
    return (d_x, d_weight), None

  init = (jnp.zeros(x.shape, jnp.float32), jnp.zeros(weight.shape, weight.dtype))
  (d_x, d_weight), _ = jax.lax.scan(step, init, jnp.arange(-(-vocab // chunk)))
  return d_x.astype(x.dtype), d_weight, None, g * nll


_weighted_nll.defvjp(_weighted_nll_fwd, _weighted_nll_bwd)
