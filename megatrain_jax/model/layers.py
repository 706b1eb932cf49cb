"""Flax NNX modules of one Llama-family decoder layer, and the embedding and head pieces.

Notation in shape comments: B batch, S sequence, D d_model, H query heads, KV key/value heads,
G = H / KV query heads per key/value head, Dh head_dim, F d_ff, V vocab.

Params are float32 (`param_dtype`); activations and matmuls run in `cfg.dtype` with
`cfg.matmul_precision`. The numerics follow Hugging Face's LlamaForCausalLM (RMSNorm in float32,
rotate-half RoPE, softmax in float32) so that logits match it to float32 rounding.

Matmul outputs carry `checkpoint_name`s so remat policies can save (`minimal`) or offload them
(`offload`) by name.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megatrain_jax.model.config import ModelConfig, rope_attention_factor, rope_inverse_frequencies

# Names given to matmul outputs inside a layer (see remat policies in decoder.py).
MATMUL_OUTPUT_NAMES = ('q_proj', 'k_proj', 'v_proj', 'attn_out', 'o_proj', 'gate_proj', 'up_proj',
                       'down_proj')
# The layer input/outputs of each sub-block: what `offload` moves to host memory.
OFFLOAD_NAMES = ('q_proj', 'k_proj', 'v_proj', 'attn_out', 'gate_proj', 'up_proj')


def compute_dtype(cfg: ModelConfig):
  return jnp.dtype(cfg.dtype)


class TokenLinear(nnx.Linear):
  """nnx.Linear over x [..., D_in] -> [..., D_out], run as one [N, D_in] @ [D_in, D_out] matmul
  over the N = B*S tokens (a free reshape: the same products, summed by GEMMs of another shape;
  the same params as nnx.Linear).

  Why: given [B, S, D] activations, XLA:CPU lays out the weight-gradient dot of the backward
  (x^T @ dy, contracting B and S) with a transposed operand and fuses that transpose into the
  elementwise loop producing dy, which then reads its [B, S, F] inputs at a 4 KiB stride (the
  SwiGLU gate's gradient: ~150 ms of bench/streamed_vs_resident.py's 1.2 s step). With 2-D
  operands it runs plain GEMMs: that step 20-30% faster on CPU for both engines (BENCHMARKS.md).
  GPU compilers see the same reshape as a bitcast."""

  def __call__(self, x):
    y = super().__call__(x.reshape(-1, x.shape[-1]))
    return y.reshape(x.shape[:-1] + (y.shape[-1],))


def _linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs, use_bias: bool = False):
  """A decoder layer's projection (see TokenLinear)."""
  return TokenLinear(
      d_in, d_out, use_bias=use_bias, dtype=compute_dtype(cfg), param_dtype=jnp.float32,
      precision=cfg.matmul_precision, kernel_init=nnx.initializers.normal(cfg.init_std),
      bias_init=nnx.initializers.zeros_init(), rngs=rngs)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, statistics in float32 as in Hugging Face Llama."""

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):  # [..., D] -> [..., D]
    return rms_norm(x, self.scale[...], self.eps, self.dtype)


def rms_norm(x, scale, eps: float, dtype):
  """RMSNorm as a pure function: x [..., D], scale [D] -> [..., D] in `dtype`."""
  x32 = x.astype(jnp.float32)
  variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  normed = (x32 * jax.lax.rsqrt(variance + eps)).astype(dtype)
  return normed * scale.astype(dtype)


def rope_cos_sin(cfg: ModelConfig, positions):
  """positions [B, S] or [S] int -> cos, sin [..., S, Dh] (float32), rotate-half layout; scaled
  by YaRN's attention factor where the model has one."""
  inv_freq = jnp.asarray(rope_inverse_frequencies(cfg))  # [Dh/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., S, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # [..., S, Dh]
  scale = rope_attention_factor(cfg)
  if scale == 1.0:
    return jnp.cos(emb), jnp.sin(emb)
  return jnp.cos(emb) * scale, jnp.sin(emb) * scale


class RopePositions(NamedTuple):
  """Positions with their RoPE tables computed once (`rope_positions`): what the layers take in
  place of plain positions [B, S] when many layer programs share one batch. Given plain positions,
  each program computes cos/sin itself, and XLA:CPU fuses them into every consumer, evaluating
  the transcendentals once per head in the backward: 3.3 of a one-layer group's 52 ms backward
  and 0.9 of its 17 ms forward on bench/streamed_vs_resident.py's model. (A scan over the whole
  stack hoists them out of the loop.)"""
  ids: jax.Array  # [B, S] int32: causal masking, query blocks
  cos: jax.Array  # [B, S, Dh] float32
  sin: jax.Array  # [B, S, Dh] float32
  # [B, S] int32 document of each token in its packed row (decoder.document_positions), or None:
  # with it a query attends only to keys of its own document (model.document_mask).
  segments: jax.Array | None = None


def rope_positions(cfg: ModelConfig, positions, segments=None) -> RopePositions:
  """positions [B, S] int (and optional segments [B, S]) -> RopePositions (ids, their
  rope_cos_sin tables, segments)."""
  return RopePositions(positions, *rope_cos_sin(cfg, positions), segments)


def _ids_and_tables(cfg: ModelConfig, positions):
  """(ids [B, S], segments [B, S] or None, (cos, sin)) of plain positions or of a RopePositions."""
  if isinstance(positions, RopePositions):
    return positions.ids, positions.segments, (positions.cos, positions.sin)
  return positions, None, rope_cos_sin(cfg, positions)


def apply_rope(x, cos, sin):
  """x [B, S, N, Dh]; cos/sin [B or 1, S, Dh]. Rotates (x_i, x_{i+Dh/2}) pairs (HF convention)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal grouped-query attention with RoPE; optional q/k/v bias (Qwen2), RMSNorm of each
  head's q and k before RoPE (Qwen3) and sliding window."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hd = cfg.d_model, cfg.head_dim
    self.q_proj = _linear(cfg, d, cfg.num_heads * hd, rngs, cfg.qkv_bias)
    self.k_proj = _linear(cfg, d, cfg.num_kv_heads * hd, rngs, cfg.qkv_bias)
    self.v_proj = _linear(cfg, d, cfg.num_kv_heads * hd, rngs, cfg.qkv_bias)
    self.o_proj = _linear(cfg, cfg.num_heads * hd, d, rngs)
    if cfg.qk_norm:  # scales [Dh], shared by the heads (transformers' Qwen3 q_norm / k_norm)
      self.q_norm = RMSNorm(hd, cfg.norm_eps, compute_dtype(cfg))
      self.k_norm = RMSNorm(hd, cfg.norm_eps, compute_dtype(cfg))

  def __call__(self, x, positions):  # x [B, S, D], positions [B, S] / RopePositions -> [B, S, D]
    positions, segments, (cos, sin) = _ids_and_tables(self.cfg, positions)
    q, k, v = self._heads(x, cos, sin)
    where = (positions, segments)
    return self._output(_attend_blocks(self.cfg, q, k, v, where, where))

  def extend(self, x, where: RopePositions, cache, start, end=None):
    """Attention of S new tokens x [B, S, D], at slots [start, start + S) of a buffer of T
    slots, to the tokens before them held in a key/value cache (k, v) [B, KV, C, Dh]
    (decoder.extend); their k and v are written into it. `where`: the positions of all T slots
    (its ids, tables and segments [B, T, ...]); slots after a query's position are masked by
    causality, so what they hold does not matter. A cache of C < T slots is a ring
    (`_ring_extend`), where only the new slots before `end` (default start + S) are written.
    -> (out [B, S, D], the updated (k, v))."""
    s = x.shape[1]
    query = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, s, axis=1), where)
    q, k, v = self._heads(x, query.cos, query.sin)
    q_where = (query.ids, query.segments)
    if cache[0].shape[2] < where.ids.shape[1]:
      out, cache = _ring_extend(self.cfg, q, (k, v), q_where, where, cache, start,
                                start + s if end is None else end)
      return self._output(out), cache
    cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), start, axis=2)
                  for c, new in zip(cache, (k, v)))
    out = _attend_blocks(self.cfg, q, *cache, q_where, (where.ids, where.segments))
    return self._output(out), cache

  def _heads(self, x, cos, sin):
    """x [B, S, D], RoPE tables cos/sin [B, S, Dh] -> q [B, KV, G, S, Dh], k and v
    [B, KV, S, Dh]."""
    cfg = self.cfg
    b, s, _ = x.shape
    kv, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    q = checkpoint_name(self.q_proj(x), 'q_proj').reshape(b, s, cfg.num_heads, hd)
    k = checkpoint_name(self.k_proj(x), 'k_proj').reshape(b, s, kv, hd)
    v = checkpoint_name(self.v_proj(x), 'v_proj').reshape(b, s, kv, hd)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    # Head-major from here on (the transposes fuse into RoPE; v's is one copy): q [B, KV, G, S, hd],
    # k and v [B, KV, S, hd], so that both attention matmuls and their gradients contract the
    # minor dimensions of operands batched over (B, KV). In the [B, S, KV, ...] layout XLA:CPU
    # inserted transposing copies of the [B, KV, G, S, S] score gradients and probabilities for
    # dk and dv: the resident step of bench/streamed_vs_resident.py's model ran 7-13% slower.
    q = apply_rope(q, cos, sin).reshape(b, s, kv, g, hd).transpose(0, 2, 3, 1, 4)
    k = apply_rope(k, cos, sin).transpose(0, 2, 1, 3)
    return q, k, v.transpose(0, 2, 1, 3)

  def _output(self, out):
    """Attention output [B, KV, G, S, Dh] -> o_proj of its heads in q_proj's order, [B, S, D]."""
    b, _, _, s, _ = out.shape
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, self.cfg.num_heads * self.cfg.head_dim)
    out = checkpoint_name(out, 'attn_out')
    return checkpoint_name(self.o_proj(out), 'o_proj')


# The position a ring slot holding no key yet is given: after every query, so causality masks it.
_NO_KEY = jnp.iinfo(jnp.int32).max


def _ring_extend(cfg: ModelConfig, q, new, q_where, where: RopePositions, cache, start, end):
  """Attention.extend against a ring cache (k, v) [B, KV, C, Dh] of a buffer's T > C slots
  (decoder.init_kv_cache under a sliding window W: C = W): the keys and values of buffer slot i
  live in ring slot i mod C, and each query's mask reads the true positions of the slots the
  ring holds (`_ring_where`), so it sees what it sees in the whole buffer. q [B, KV, G, S, Dh]
  and new = its (k, v) [B, KV, S, Dh], at buffer slots [start, start + S). -> (out, cache).

  One token (a decoding step) is written first: the key it displaces is C = W slots back, out
  of its window. Several (a prefill, S up to T) attend to the ring as it was plus their own
  keys (C + S keys, one layer at a time: what a prefill needs beyond the ring), then the newest
  of them before `end` take their slots: a prefill of a buffer whose slots after the prompt hold
  placeholders keeps the prompt's last keys, not theirs."""
  slots = cache[0].shape[2]
  if new[0].shape[2] == 1:
    cache = tuple(jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), start % slots, axis=2)
                  for c, n in zip(cache, new))
    return _attend_blocks(cfg, q, *cache, q_where, _ring_where(where, start, slots)), cache
  k_where = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1),
                         _ring_where(where, start - 1, slots), q_where)
  keys, values = (jnp.concatenate([c, n.astype(c.dtype)], axis=2) for c, n in zip(cache, new))
  out = _attend_blocks(cfg, q, keys, values, q_where, k_where)
  held = _ring_slots(end - 1, slots)
  fresh = (held >= start)[:, None]  # [C, 1]: against the slots and head dims of [B, KV, C, Dh]
  taken = jnp.clip(held - start, 0, new[0].shape[2] - 1)
  return out, tuple(jnp.where(fresh, jnp.take(n, taken, axis=2).astype(c.dtype), c)
                    for c, n in zip(cache, new))


def _ring_slots(last, slots: int):
  """The buffer slot each of a ring's `slots` slots holds once buffer slots 0..last were written
  in order (int [C]; negative: none yet): the latest i <= last with i mod C equal to its own."""
  return last - jnp.mod(last - jnp.arange(slots), slots)


def _ring_where(where: RopePositions, last, slots: int):
  """(positions, segments or None) [B, C] of what a ring of `slots` slots holds once buffer
  slots 0..last were written: `where`'s of the slot each holds, _NO_KEY where none."""
  held = _ring_slots(last, slots)
  index = jnp.maximum(held, 0)
  ids = jnp.where(held >= 0, where.ids[:, index], _NO_KEY)
  return ids, None if where.segments is None else where.segments[:, index]


def _attend_blocks(cfg: ModelConfig, q, k, v, q_where, k_where):
  """`_attend` of q [B, KV, G, S, Dh] over k, v [B, KV, T, Dh], in blocks of
  `cfg.attention_chunk` queries when S is longer. q_where = (positions, segments or None) [B, S]
  of the queries, k_where the same [B, T] of the keys. -> [B, KV, G, S, Dh].

  Self-attention (k_where is q_where, the layers' own positions) skips the keys no query of a
  block may see (cfg.attention_bands): that needs positions that rise along the row within each
  document, as decoder.token_positions numbers them, so that a key after a query (or a window
  before it) in the row is after it (or out of the window) in positions too."""
  s = q.shape[3]
  chunk = cfg.attention_chunk
  if not chunk or s <= chunk:
    return _attend(cfg, q, k, v, q_where, k_where)
  if k_where is not q_where:  # a key/value cache (extend): every block against every slot
    return _query_blocks(cfg, q, q_where, lambda qc, wc, _: _attend(cfg, qc, k, v, wc, k_where))
  bands = cfg.attention_bands(s)
  band_of_block = jnp.asarray([b for b, (q_lo, q_hi, _, _) in enumerate(bands)
                               for _ in range(-(-(q_hi - q_lo) // chunk))], jnp.int32)
  banded = _banded_block(cfg, tuple((k_lo, k_hi) for _, _, k_lo, k_hi in bands))
  return _query_blocks(cfg, q, q_where, lambda qc, wc, i: banded(i, qc, wc, k, v, k_where),
                       band_of_block)


def _banded_block(cfg: ModelConfig, key_ranges: tuple):
  """attend(band, q block, its where, k, v, k_where): `_attend` of one query block against the keys
  [lo, hi) of key_ranges[band] only (lax.switch: one program per band, in one loop over the
  blocks). A custom VJP keeps only the inputs and recomputes the block in its backward (as
  jax.checkpoint would), inside the same switch: differentiated by JAX, a switch's forward would
  hand its backward the residuals of every branch (zeros but the taken one's), every band's
  scores at once."""
  def attend(band, qc, wc, k, v, k_where):
    lo, hi = key_ranges[band]
    keys = jax.tree.map(lambda a: a[:, lo:hi], k_where)
    return _attend(cfg, qc, k[:, :, lo:hi], v[:, :, lo:hi], wc, keys)

  def switch(band, fn, *args):
    return jax.lax.switch(band, [functools.partial(fn, b) for b in range(len(key_ranges))],
                          *args)

  def gradients(band, qc, wc, k, v, k_where, g):
    _, vjp = jax.vjp(lambda q_, k_, v_: attend(band, q_, wc, k_, v_, k_where), qc, k, v)
    return vjp(g)

  @jax.custom_vjp
  def block(band, qc, wc, k, v, k_where):
    return switch(band, attend, qc, wc, k, v, k_where)

  def forward(band, qc, wc, k, v, k_where):
    return block(band, qc, wc, k, v, k_where), (band, qc, wc, k, v, k_where)

  def backward(res, g):
    band, qc, wc, k, v, k_where = res
    dq, dk, dv = switch(band, gradients, qc, wc, k, v, k_where, g)
    return None, dq, None, dk, dv, None

  block.defvjp(forward, backward)
  return block


def _query_blocks(cfg: ModelConfig, q, q_where, attend, band_of_block=None):
  """attend(q block [B, KV, G, chunk, Dh], its (positions, segments) [B, chunk], its entry of
  band_of_block (int [blocks], default 0s)) of each block of `cfg.attention_chunk` queries of
  q [B, KV, G, S, Dh] in turn -> [B, KV, G, S, Dh]. Each block is recomputed in the backward
  (jax.checkpoint), so only one block's scores [B, KV, G, chunk, T] exist at a time instead of
  [B, KV, G, S, T]."""
  b, kv, g, s, hd = q.shape
  chunk = min(s, cfg.attention_chunk)
  blocks = -(-s // chunk)
  pad = blocks * chunk - s  # padded query rows repeat the last position; dropped below
  q_blocks = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
  q_blocks = jnp.moveaxis(q_blocks.reshape(b, kv, g, blocks, chunk, hd), 3, 0)
  # The blocks' positions and segments [blocks, B, chunk] (segments may be None).
  q_where = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, pad)), mode='edge').reshape(
      b, blocks, chunk).swapaxes(0, 1), q_where)
  if band_of_block is None:
    band_of_block = jnp.zeros((blocks,), jnp.int32)
  block = jax.checkpoint(lambda qc, wc, i: attend(qc, _tied_to(wc, qc), i))
  out = jax.lax.map(lambda xs: block(*xs), (q_blocks, q_where, band_of_block))
  return jnp.moveaxis(out, 0, 3).reshape(b, kv, g, blocks * chunk, hd)[:, :, :, :s]


def _tied_to(where, q):
  """`where` (positions, segments or None: int [B, Q]) plus a zero computed from `q`: the mask a
  block builds from them then depends on the differentiated q, so its backward recomputes it with
  the block's scores. Built from the positions alone, JAX computes it with the forward and keeps
  every block's mask for the backward: a bool [blocks, B, KV, G, Q, T], B·H·S² bytes a layer
  (2 GB at 8k tokens and 32 heads, 34 GB at 32k)."""
  zero = jnp.isfinite(q.reshape(-1)[0]).astype(jnp.int32) * 0  # 0 for a NaN q too
  return jax.tree.map(lambda a: a + zero, where)


def _attend(cfg: ModelConfig, q, k, v, q_where, k_where):
  """Causal (optionally windowed) softmax attention of queries q [B, KV, G, Q, hd] over keys and
  values k, v [B, KV, S, hd] -> [B, KV, G, Q, hd]. q_where = (positions [B, Q], segments [B, Q]
  or None) of the queries, k_where the same [B, S] of the keys: a query sees the keys at or
  before its position (within `sliding_window`) and, given segments, in its own document."""
  # scores [B, KV, G, Q, S], in float32 for a stable softmax.
  scores = jnp.einsum('bkgqd,bksd->bkgqs', q, k, precision=cfg.matmul_precision,
                      preferred_element_type=jnp.float32) * (cfg.head_dim ** -0.5)
  (q_positions, q_segments), (k_positions, k_segments) = q_where, k_where
  q_pos, k_pos = q_positions[:, :, None], k_positions[:, None, :]  # [B, Q, 1], [B, 1, S]
  allowed = k_pos <= q_pos
  if cfg.sliding_window:
    allowed &= (q_pos - k_pos) < cfg.sliding_window
  if q_segments is not None:
    # Positions restart in each document, so `k_pos <= q_pos` alone would let a query see the
    # first tokens of the row's other documents, later ones included; within one document it is
    # the causal order.
    allowed &= k_segments[:, None, :] == q_segments[:, :, None]
  scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum('bkgqs,bksd->bkgqd', probs, v, precision=cfg.matmul_precision)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); [B, S, D] -> [B, S, F] -> [B, S, D]."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    self.up_proj = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    self.down_proj = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

  def __call__(self, x):
    gate = checkpoint_name(self.gate_proj(x), 'gate_proj')
    up = checkpoint_name(self.up_proj(x), 'up_proj')
    return checkpoint_name(self.down_proj(jax.nn.silu(gate) * up), 'down_proj')


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dtype = compute_dtype(cfg)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions):
    h = x + self.attn(self.attn_norm(x), positions)
    return h + self.mlp(self.mlp_norm(h))

  def extend(self, x, where: RopePositions, cache, start, end=None):
    """The layer on new tokens x [B, S, D] against its key/value cache (Attention.extend) ->
    (out [B, S, D], the updated cache)."""
    attended, cache = self.attn.extend(self.attn_norm(x), where, cache, start, end)
    h = x + attended
    return h + self.mlp(self.mlp_norm(h)), cache


# Rows of the embedding [V, D] (and columns of an untied head [D, V]) are drawn in independently
# seeded blocks of this many vocabulary rows, so any row range can be drawn alone with the values
# the whole matrix has: the streamed engine initialises a 128k-vocabulary embedding chunk by chunk
# instead of holding the whole matrix (1 GB for Llama-3.2-1B) and XLA's RNG temporaries at once.
VOCAB_INIT_BLOCK = 8192


def vocab_normal(key, std: float, d: int, start, count: int, vocab: int, head: bool = False):
  """`count` vocabulary rows from `start` of a float32 normal(0, std) embedding [vocab, d] ([d,
  vocab] columns of a head kernel with `head`). A vocabulary of at most VOCAB_INIT_BLOCK rows is
  drawn at once, exactly as nnx's normal initializer draws the whole matrix; a larger one in
  blocks of VOCAB_INIT_BLOCK rows, block b from fold_in(key, b). Either way a slice equals the
  whole matrix's slice, for any split. `start` may be traced (`count` is static): one program
  draws every chunk of a size, wherever it starts."""
  block = VOCAB_INIT_BLOCK
  if vocab <= block:
    full = jax.random.normal(key, (d, vocab) if head else (vocab, d), jnp.float32)
    full = full * jnp.float32(std)
    return jax.lax.dynamic_slice_in_dim(full, start, count, axis=1 if head else 0)
  first = start // block
  if isinstance(start, int):  # the blocks these rows reach
    spanned = -(-(start + count) // block) - first
  else:  # traced: the most blocks `count` rows from any start reach
    spanned = -(-count // block) + 1
  draw = lambda b: jax.random.normal(jax.random.fold_in(key, b), (block, d), jnp.float32)
  rows = jax.vmap(draw)(first + jnp.arange(spanned)).reshape(spanned * block, d)
  rows = jax.lax.dynamic_slice_in_dim(rows, start - first * block, count) * jnp.float32(std)
  return rows.T if head else rows


class Embedder(nnx.Module):
  """Token embedding [V, D]."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.embedding = nnx.Param(vocab_normal(rngs.params(), cfg.init_std, cfg.d_model, 0,
                                            cfg.vocab_size, cfg.vocab_size))  # all rows
    self.dtype = compute_dtype(cfg)

  def __call__(self, tokens):  # [B, S] int -> [B, S, D]
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class Head(nnx.Module):
  """Final RMSNorm and the LM head; with tied embeddings the head is the embedding transposed."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, compute_dtype(cfg))
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=compute_dtype(cfg),
        param_dtype=jnp.float32, precision=cfg.matmul_precision, rngs=rngs,
        kernel_init=lambda key, shape, dtype: vocab_normal(key, cfg.init_std, shape[0], 0,
                                                           shape[1], shape[1], head=True))

  def __call__(self, x, embedding=None):  # x [B, S, D] -> logits [B, S, V] float32
    x = self.final_norm(x)
    if self.lm_head is None:
      return tied_logits(self.cfg, x, embedding)
    return self.lm_head(x).astype(jnp.float32)


def tied_logits(cfg: ModelConfig, x, embedding):
  """Logits of a tied head: normed x [B, S, D] against the embedding [V, D] -> [B, S, V] float32."""
  logits = jnp.einsum('bsd,vd->bsv', x, embedding.astype(x.dtype), precision=cfg.matmul_precision)
  return logits.astype(jnp.float32)


def untied_logits(cfg: ModelConfig, x, kernel):
  """Logits of an untied head, the same matmul nnx.Linear runs: x [B, S, D] @ kernel [D, V]."""
  logits = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                               precision=cfg.matmul_precision)
  return logits.astype(jnp.float32)
