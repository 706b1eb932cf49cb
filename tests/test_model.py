"""Model invariants: remat policies and unrolled layers change nothing; layer groups compose to the
whole stack, from plain positions or precomputed RoPE tables alike; group-wise init equals whole
init; accumulation over M microbatches equals one batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import data as data_lib
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.engine import resident
from megatrain_jax.model import ModelConfig

CFG = ModelConfig(vocab_size=97, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48,
                  max_seq_len=64, qkv_bias=True, tie_embeddings=False, init_std=0.2)


@pytest.fixture(scope='module')
def params():
  return model_lib.init_params(CFG, jax.random.key(0))


def _batch(seed, shape):
  return jax.random.randint(jax.random.key(seed), shape, 0, CFG.vocab_size)


def _loss_and_grads(cfg, params, batch):
  return jax.jit(jax.value_and_grad(functools.partial(model_lib.loss_fn, cfg)))(params, batch)


def test_param_count_matches_formula(params):
  assert model_lib.count_params(params) == CFG.num_params
  tied = CFG.replace(tie_embeddings=True, qkv_bias=False)
  assert model_lib.count_params(model_lib.abstract_params(tied)) == tied.num_params
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert params['layers']['mlp']['up_proj']['kernel'].shape == (3, 32, 48)


@pytest.mark.parametrize('variant', [dict(remat='full'), dict(remat='minimal'),
                                     dict(remat='offload'), dict(scan_layers=False),
                                     dict(scan_layers=False, remat='none')])
def test_remat_and_unrolled_match_plain_scan(params, variant):
  batch = _batch(1, (2, 17))
  ref_loss, ref_grads = _loss_and_grads(CFG.replace(remat='none'), params, batch)
  loss, grads = _loss_and_grads(CFG.replace(**variant), params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
               ref_grads)


@pytest.mark.parametrize('seq, chunk, extra', [
    (32, 8, {}), (33, 8, {}), (33, 8, dict(sliding_window=5)), (33, 8, dict(remat='minimal')),
    (33, 8, dict(scan_layers=False, remat='none')),
    # 20 blocks in 10 bands of 2 (MAX_ATTENTION_BANDS 16): a band's key length rounded up
    (39, 2, {}), (39, 2, dict(sliding_window=5)),
    (39, 2, dict(sliding_window=3, document_eos_id=5)),
], ids=['divisible', 'ragged', 'window', 'minimal-remat', 'unrolled', 'bands', 'bands-window',
        'bands-window-documents'])
def test_chunked_attention_equals_whole_attention(params, seq, chunk, extra):
  """Query blocks (model.attention_chunk) compute the same loss and gradients as all queries at
  once, to float32 rounding, including a last block padded past the sequence."""
  batch = _batch(7, (2, seq + 1))
  whole = CFG.replace(attention_chunk=0, **extra)
  ref_loss, ref_grads = _loss_and_grads(whole, params, batch)
  loss, grads = _loss_and_grads(whole.replace(attention_chunk=chunk), params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
               ref_grads)


@pytest.mark.parametrize('seq, chunk, window', [(64, 8, 0), (64, 8, 12), (200, 8, 0), (63, 0, 0)],
                         ids=['causal', 'window', 'bands', 'unchunked'])
def test_attention_scores_the_keys_the_planner_counts(monkeypatch, seq, chunk, window):
  """A layer's query blocks are scored against only the keys their band may see (causality, the
  window), and that is the work ModelConfig.attended_keys counts for the planner (its compute
  time and `executed` FLOPs): 64 tokens in blocks of 8 score 36 of 64 key blocks a head; 200 in
  13 bands of 2 blocks. Each band's program is traced once (lax.switch), recording its keys."""
  from megatrain_jax.model import layers  # pylint: disable=import-outside-toplevel
  cfg = CFG.replace(attention_chunk=chunk, sliding_window=window, max_seq_len=seq)
  scored = []  # (queries, keys) of each program of _attend
  attend = layers._attend  # pylint: disable=protected-access

  def recording(cfg, q, k, v, q_where, k_where):
    scored.append((q.shape[3], k.shape[2]))
    return attend(cfg, q, k, v, q_where, k_where)

  monkeypatch.setattr(layers, '_attend', recording)
  layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                       model_lib.abstract_params(cfg)['layers'])
  x = jax.ShapeDtypeStruct((2, seq, cfg.d_model), jnp.float32)
  positions = model_lib.default_positions(jnp.zeros((2, seq), jnp.int32))
  jax.make_jaxpr(lambda p, h: model_lib.apply_layer(cfg, p, h, positions))(layer, x)
  bands = cfg.attention_bands(seq)
  assert [keys for _, keys in scored] == [hi - lo for _, _, lo, hi in bands]
  blocks = [-(-(q_hi - q_lo) // (chunk or seq)) for q_lo, q_hi, _, _ in bands]
  assert sum(blocks) == -(-seq // (chunk or seq))
  executed = sum(n * rows * keys for n, (rows, keys) in zip(blocks, scored))
  assert executed == pytest.approx(seq * cfg.attended_keys(seq), rel=1e-12)
  if chunk:  # about half of all keys, or fewer under the window
    assert executed < (0.6 if not window else 0.4) * seq * seq, (executed, seq * seq)


@pytest.mark.parametrize('segments', [False, True], ids=['positions', 'documents'])
def test_query_blocks_keep_no_mask_for_the_backward(params, segments):
  """A chunked layer's backward recomputes each query block's mask with its scores: no array of
  every block's mask (a bool [blocks, B, KV, G, Q, S], B·H·S² bytes a layer: 34 GB at 32k tokens
  and 32 heads) is kept from the forward, with or without documents; its gradients are as
  before (test_chunked_attention_equals_whole_attention)."""
  cfg = CFG.replace(attention_chunk=8, remat='none')
  x = jnp.ones((2, 32, CFG.d_model), jnp.float32)
  tokens = jnp.zeros((2, 32), jnp.int32)
  starts = jnp.zeros((2, 32), jnp.uint8).at[:, 12].set(1) if segments else None
  positions = model_lib.token_positions(cfg, tokens, starts)
  group = jax.tree.map(lambda a: a[:1], params['layers'])
  backward = jax.make_jaxpr(lambda p, h: jax.vjp(
      lambda p, h: model_lib.apply_group(cfg, p, h, positions), p, h)[1](h))(group, x)
  blocks = 32 // 8
  kept = [v.aval for eqn in backward.eqns for v in eqn.outvars
          if v.aval.dtype == jnp.bool_ and v.aval.shape[:1] == (blocks,)
          and np.prod(v.aval.shape) >= blocks * 2 * CFG.num_heads * 8 * 32]
  assert not kept, kept


def test_groups_compose_to_the_whole_stack(params):
  """embed -> apply_group over K-slices (with a remainder group) -> head equals forward."""
  tokens = _batch(2, (2, 16))
  positions = model_lib.default_positions(tokens)
  x = model_lib.embed(CFG, params, tokens)
  for start, size in ((0, 2), (2, 1)):
    group = jax.tree.map(lambda a: a[start:start + size], params['layers'])
    x = model_lib.apply_group(CFG, group, x, positions)
  np.testing.assert_allclose(model_lib.head(CFG, params, x),
                             model_lib.forward(CFG, params, tokens), rtol=1e-5, atol=1e-5)
  # and a single layer is a pure function of one slice of the stack
  layer0 = jax.tree.map(lambda a: a[0], params['layers'])
  one = model_lib.apply_layer(CFG, layer0, model_lib.embed(CFG, params, tokens), positions)
  first = model_lib.apply_group(CFG, jax.tree.map(lambda a: a[:1], params['layers']),
                                model_lib.embed(CFG, params, tokens), positions)
  np.testing.assert_allclose(one, first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('chunk', [0, 8], ids=['whole-attention', 'query-blocks'])
def test_rope_positions_equal_plain_positions(params, chunk):
  """A layer group given RopePositions (the tables computed once, as the streamed engine and the
  evaluator pass them) computes what it computes from plain positions, output and gradients, for
  positions with uneven gaps (RoPE is relative: a uniform shift would hide wrong tables) and with
  query blocks."""
  cfg = CFG.replace(attention_chunk=chunk)
  tokens = _batch(4, (2, 20))
  gaps = jax.random.randint(jax.random.key(5), tokens.shape, 1, 4)
  positions = jnp.cumsum(gaps, axis=1).astype(jnp.int32) - 1  # [B, S], increasing, uneven
  x = model_lib.embed(cfg, params, tokens)
  group = jax.tree.map(lambda a: a[:2], params['layers'])
  tables = model_lib.rope_positions(cfg, positions)
  assert tables.cos.shape == tables.sin.shape == (2, 20, cfg.head_dim)

  def run(pos):
    out, vjp = jax.vjp(lambda p, h: model_lib.apply_group(cfg, p, h, pos), group, x)
    return out, vjp(jnp.ones_like(out))

  (out, grads), (ref_out, ref_grads) = jax.jit(run)(tables), jax.jit(run)(positions)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
               ref_grads)


def test_groupwise_init_equals_whole_init(params):
  _, layers_key, _ = model_lib.param_keys(jax.random.key(0))
  init = jax.jit(model_lib.init_layers, static_argnums=(0, 3))
  whole = init(CFG, layers_key, 0, 3)
  parts = [init(CFG, layers_key, 0, 2), init(CFG, layers_key, 2, 1)]
  stitched = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), stitched,
               whole)
  assert not np.allclose(whole['attn']['q_proj']['kernel'][0], whole['attn']['q_proj']['kernel'][1])


def test_gradient_accumulation_equals_one_big_batch(params):
  big = _batch(3, (8, 17))
  loss_and_grad = jax.value_and_grad(functools.partial(model_lib.loss_fn, CFG))
  accumulate = jax.jit(functools.partial(resident.accumulate_gradients, loss_and_grad))
  loss_1, grads_1 = accumulate(params, big[None])  # M = 1, B = 8
  loss_4, grads_4 = accumulate(params, big.reshape(4, 2, 17))  # M = 4, B = 2
  np.testing.assert_allclose(loss_4, loss_1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_4,
               grads_1)


def test_bfloat16_compute_keeps_float32_params(params):
  cfg = CFG.replace(dtype='bfloat16', matmul_precision='default')
  tokens = _batch(4, (2, 16))
  logits = jax.jit(functools.partial(model_lib.forward, cfg))(params, tokens)
  ref = jax.jit(functools.partial(model_lib.forward, CFG))(params, tokens)
  assert logits.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(logits - ref))) < 0.1 * float(jnp.max(jnp.abs(ref)))
  _, grads = _loss_and_grads(cfg, params, jnp.concatenate([tokens, tokens[:, :1]], axis=1))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_clipping_is_exact():
  grads = {'a': jnp.array([3.0, 0.0]), 'b': jnp.array([[4.0]])}  # global norm 5
  clipped, norm = optim.clip_by_global_norm(grads, 1.0)
  assert float(norm) == 5.0
  np.testing.assert_allclose(clipped['a'], [0.6, 0.0], rtol=1e-7)
  unclipped, _ = optim.clip_by_global_norm(grads, 10.0)
  np.testing.assert_array_equal(unclipped['b'], grads['b'])
  off, _ = optim.clip_by_global_norm(grads, 0.0)
  np.testing.assert_array_equal(off['a'], grads['a'])


def test_sliding_window_limits_attention(params):
  """With a window of 4, the logits at position 10 ignore tokens 0..6."""
  cfg = CFG.replace(sliding_window=4)
  tokens = _batch(5, (1, 12))
  changed = tokens.at[0, 2].set((tokens[0, 2] + 1) % CFG.vocab_size)
  fwd = jax.jit(functools.partial(model_lib.forward, cfg))
  a, b = fwd(params, tokens), fwd(params, changed)
  # 3 layers x window 4 = receptive field 3*(4-1)=9 back: position 11 sees down to position 2.
  np.testing.assert_array_equal(a[0, :2], b[0, :2])
  assert not np.allclose(a[0, 11], b[0, 11])
  far = tokens.at[0, 1].set((tokens[0, 1] + 1) % CFG.vocab_size)
  np.testing.assert_array_equal(fwd(params, far)[0, 11], a[0, 11])


def test_document_positions_number_documents_and_restart_positions():
  tokens = np.array([[5, 6, 0, 7, 0, 8],   # two whole documents, then one running past the row
                     [0, 0, 3, 4, 4, 0],   # a lone EOS ends the row's first (cut) document
                     [9, 9, 9, 9, 9, 9]])  # no EOS: one document
  positions, segments = model_lib.document_positions(jnp.asarray(tokens), 0)
  np.testing.assert_array_equal(segments, [[0, 0, 0, 1, 1, 2], [0, 1, 2, 2, 2, 2],
                                           [0, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 2, 3],
                                            [0, 1, 2, 3, 4, 5]])
  assert positions.dtype == segments.dtype == jnp.int32
  # Without a document mask the layers get positions 0..S-1 and no segments.
  plain = model_lib.token_positions(CFG, jnp.asarray(tokens))
  assert plain.segments is None
  np.testing.assert_array_equal(plain.ids, model_lib.default_positions(tokens))


def _assert_equals_the_sum(value, grads, parts):
  """`value` and `grads` equal the sums of the (value, grads) `parts`: the value to 1e-6, the
  gradients leaf by leaf ||a - b|| / ||b|| <= 1e-5 (measured 2e-7..1.2e-6, one sum of parts
  against one program; a mask letting one document see another moves the logits by ~1e-1)."""
  np.testing.assert_allclose(value, sum(v for v, _ in parts), rtol=1e-6)
  summed = jax.tree.map(lambda *g: sum(g), *[g for _, g in parts])
  errors = jax.tree.map(lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)),
                        grads, summed)
  assert max(jax.tree.leaves(errors)) <= 1e-5, errors


@pytest.mark.parametrize('chunk', [0, 4], ids=['whole-attention', 'query-blocks'])
def test_document_mask_gradients_equal_each_document_alone(params, chunk):
  """The summed next-token log-likelihood of a packed row (documents ending with EOS 0), and its
  gradient, equal the sum over its documents run alone: nothing crosses a document boundary in
  the forward or the backward (also through query blocks that straddle one)."""
  cfg = CFG.replace(document_eos_id=0, attention_chunk=chunk)
  alone_cfg = cfg.replace(document_eos_id=-1)
  rng = np.random.default_rng(5)
  documents = [np.append(rng.integers(1, CFG.vocab_size, n), 0) for n in (3, 6, 1)]
  row = np.concatenate(documents + [rng.integers(1, CFG.vocab_size, 3)])  # the next one, cut
  inputs, targets = row[:-1], row[1:]

  def log_likelihood(cfg, params, tokens, targets):
    logp = jax.nn.log_softmax(model_lib.forward(cfg, params, jnp.asarray(tokens)[None]))
    return jnp.sum(jnp.take_along_axis(logp[0], jnp.asarray(targets)[:, None], axis=-1))

  value_and_grad = jax.jit(jax.value_and_grad(log_likelihood, argnums=1), static_argnums=0)
  packed, packed_grads = value_and_grad(cfg, params, inputs, targets)
  bounds = np.cumsum([0] + [len(d) for d in documents] + [2])  # the cut one: 3 tokens, 2 targets
  parts = [value_and_grad(alone_cfg, params, inputs[a:b], targets[a:b])
           for a, b in zip(bounds[:-1], bounds[1:])]
  _assert_equals_the_sum(packed, packed_grads, parts)
  unmasked, _ = value_and_grad(alone_cfg, params, inputs, targets)
  assert abs(float(unmasked) - float(packed)) > 1e-2


@pytest.mark.parametrize('chunk', [0, 4], ids=['whole-attention', 'query-blocks'])
def test_documents_the_data_marks_equal_each_document_alone(params, chunk):
  """Given where documents begin (data.Batch.starts: as the prepared data records them), the
  model keeps those documents apart whatever ids they hold: a row whose documents hold the EOS id
  inside them (a chat template that ends every turn with it) has the loss and the gradients of
  its documents run alone; found by that id, the documents would be cut at it."""
  cfg = CFG.replace(document_eos_id=0, attention_chunk=chunk)
  alone_cfg = cfg.replace(document_eos_id=-1)
  rng = np.random.default_rng(6)
  lengths = (5, 7, 5)
  row = rng.integers(1, CFG.vocab_size, sum(lengths)).astype(np.int32)
  row[1::3] = 0  # EOS ids inside the documents
  bounds = np.cumsum((0,) + lengths)
  starts = np.zeros(row.size, np.uint8)
  starts[bounds[1:-1]] = 1
  weights = jnp.asarray(data_lib.unlearn_starts(starts[None], None), jnp.float32)  # Σ w·nll

  def loss(cfg, params, tokens, weights, starts):
    return model_lib.loss_fn(cfg, params, jnp.asarray(tokens), weights, starts)

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
  marked, marked_grads = value_and_grad(cfg, params, row[None], weights, jnp.asarray(starts[None]))
  parts = [value_and_grad(alone_cfg, params, row[None, a:b], jnp.ones((1, b - a - 1)), None)
           for a, b in zip(bounds[:-1], bounds[1:])]
  _assert_equals_the_sum(marked, marked_grads, parts)
  by_id, _ = value_and_grad(cfg, params, row[None], weights, None)  # documents cut at every 0
  assert abs(float(by_id) - float(marked)) > 1e-2
  # The positions restart where the marks say, as document_positions numbers them.
  positions = model_lib.token_positions(cfg, jnp.asarray(row[None]), jnp.asarray(starts[None]))
  np.testing.assert_array_equal(positions.ids[0], np.concatenate([np.arange(n) for n in lengths]))
  np.testing.assert_array_equal(positions.segments[0], np.repeat(np.arange(3), lengths))


def _decoded(cfg, params, tokens, prompt: int, cache):
  """Logits [T, V] of tokens [1, T] by model.extend: a prefill of the buffer holding the first
  `prompt` of them (zeros after, as in sampling), then one token at a time against `cache`."""
  buffer = np.zeros_like(tokens)
  buffer[0, :prompt] = tokens[0, :prompt]
  step = jax.jit(functools.partial(model_lib.extend, cfg))
  x, cache = step(params, jnp.asarray(buffer), 0, model_lib.token_positions(cfg, buffer), cache,
                  prompt)
  got = [model_lib.head(cfg, params, x)[0, :prompt]]
  for n in range(prompt, tokens.shape[1]):
    buffer[0, n] = tokens[0, n]
    x, cache = step(params, jnp.asarray(buffer[:, n:n + 1]), n,
                    model_lib.token_positions(cfg, buffer), cache)
    got.append(model_lib.head(cfg, params, x)[0])
  return np.concatenate(got), cache


@pytest.mark.parametrize('extra, prompt, length', [
    (dict(), 9, 24), (dict(sliding_window=5, qk_norm=True), 9, 24),
    (dict(document_eos_id=3, attention_chunk=8), 9, 24),
    (dict(sliding_window=3, document_eos_id=3), 9, 24),
    (dict(sliding_window=8), 5, 35), (dict(sliding_window=8, attention_chunk=8), 13, 43)])
def test_cached_decoding_equals_the_whole_forward(extra, prompt, length):
  """model.extend (sample.py's key/value cache): a prefill of the buffer, then one token at a
  time against the cache, gives the logits `forward` gives each position of the finished
  sequence. The buffer's later slots hold zeros until written, as in sampling; with a document
  mask the prompt holds an EOS, so the positions restart inside it. Under a sliding window W
  shorter than the buffer the cache is a ring of W slots, with prompts shorter and longer than
  W and decoding that wraps it several times, and gives what a cache of every slot gives."""
  cfg = CFG.replace(**extra)
  params = model_lib.init_params(cfg, jax.random.key(1))
  tokens = np.array(_batch(7, (1, length)))
  tokens[0, 6] = 3  # an EOS (with document_eos_id=3) inside the prompt
  want = model_lib.forward(cfg, params, jnp.asarray(tokens))
  got, cache = _decoded(cfg, params, tokens, prompt, model_lib.init_kv_cache(cfg, 1, length))
  np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(want[0])).max() > 1.0  # logits of a size the tolerance can tell apart
  slots = min(cfg.sliding_window or length, length)
  assert cache[0].shape == (cfg.num_layers, 1, cfg.num_kv_heads, slots, cfg.head_dim)
  whole = model_lib.init_kv_cache(cfg.replace(sliding_window=0), 1, length)  # a slot per token
  np.testing.assert_allclose(_decoded(cfg, params, tokens, prompt, whole)[0], got, rtol=1e-5,
                             atol=1e-5)
