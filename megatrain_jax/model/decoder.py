"""The decoder as pure functions over a plain params pytree.

Params (all float32; L = num_layers; every leaf under 'layers' has a leading layer axis):

    {'embed':  {'embedding': [V, D]},
     'layers': {'attn_norm': {'scale': [L, D]},
                'attn': {'q_proj': {'kernel': [L, D, H*Dh], 'bias': [L, H*Dh]},  # bias: qkv_bias
                         'k_proj': {'kernel': [L, D, KV*Dh], 'bias': [L, KV*Dh]},
                         'v_proj': {'kernel': [L, D, KV*Dh], 'bias': [L, KV*Dh]},
                         'o_proj': {'kernel': [L, H*Dh, D]},
                         'q_norm': {'scale': [L, Dh]}, 'k_norm': {'scale': [L, Dh]}},  # qk_norm
                'mlp_norm': {'scale': [L, D]},
                'mlp': {'gate_proj': {'kernel': [L, D, F]}, 'up_proj': {'kernel': [L, D, F]},
                        'down_proj': {'kernel': [L, F, D]}}},
     'head':   {'final_norm': {'scale': [D]}, 'lm_head': {'kernel': [D, V]}}}  # no lm_head if tied

The model is cut into stages so that a streaming engine can run it from weights that arrive one
piece at a time: `embed` -> `apply_group` over consecutive K-slices of 'layers' (or
`apply_group_keeping_inputs`, which also returns each layer's input) -> `final_norm` ->
`logits`/`logits_loss` (`head` and `head_loss` chain the last two). `forward` and `loss_fn` chain
them over the whole stack (the resident path).

`logits_loss` (and so `head_loss` and `loss_fn`, i.e. every engine's training and eval loss) runs
the head over vocabulary blocks (model/vocab.py) without materialising the [B, S, V] logits;
`logits`, `head` and `forward` still return whole logits (HF parity, evaluation by logits).

The NNX modules in layers.py define the parameters and the math; here each stage rebuilds its
module from a cached graph definition and the plain params (`nnx.merge`), so every function is
pure and jittable over ordinary dicts of arrays.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.model import layers as layers_lib
from megatrain_jax.model.config import ModelConfig
from megatrain_jax.model.vocab import chunked_logits_loss

_MODULES = {'layer': layers_lib.DecoderLayer, 'embed': layers_lib.Embedder,
            'head': layers_lib.Head}


@functools.lru_cache(maxsize=None)
def _module_def(cfg: ModelConfig, kind: str):
  """(graphdef, abstract state) of one module; built once per config without allocating."""
  module = nnx.eval_shape(lambda: _MODULES[kind](cfg, nnx.Rngs(0)))
  return nnx.split(module)


def _merge(cfg: ModelConfig, kind: str, params):
  graphdef, abstract_state = _module_def(cfg, kind)
  state = jax.tree.map(lambda x: x, abstract_state)  # a fresh copy: replace_by_pure_dict mutates
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _pure(module):
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


# ----------------------------------------------------------------------------------------------
# Initialisation. Layer i's params depend only on (key, i), so initialising the stack group by
# group (as the NVMe tier does for models larger than RAM) gives exactly the whole-stack init.
# ----------------------------------------------------------------------------------------------

def init_layer(cfg: ModelConfig, key) -> dict:
  return _pure(layers_lib.DecoderLayer(cfg, nnx.Rngs(key)))


def init_layers(cfg: ModelConfig, key, start: int, count: int) -> dict:
  """Stacked params of layers [start, start + count): leaves [count, ...]."""
  # `start` may be traced: one compiled init serves every group of the same size.
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(start + jnp.arange(count))
  return jax.vmap(lambda k: init_layer(cfg, k))(keys)


def param_keys(key):
  """Splits the model seed into (embed, layers, head) keys."""
  return jax.random.split(key, 3)


def run_keys(seed: int):
  """(params init key, the train state's rng key) of a fresh run of train.seed `seed`: every
  engine's init and every reader that serves a fresh run's state (an imported checkpoint's)."""
  init_key, rng = jax.random.split(jax.random.key(seed))
  return init_key, rng


def fresh_rng(seed: int) -> np.ndarray:
  """The train state's ['rng'] leaf of a fresh run of `seed` (host uint32 key data)."""
  return np.asarray(jax.random.key_data(run_keys(seed)[1]))


def init_outer(cfg: ModelConfig, key) -> dict:
  """The params outside the layer stack: {'embed': ..., 'head': ...}."""
  k_embed, _, k_head = param_keys(key)
  return {'embed': _pure(layers_lib.Embedder(cfg, nnx.Rngs(k_embed))),
          'head': _pure(layers_lib.Head(cfg, nnx.Rngs(k_head)))}


def init_outer_piece(cfg: ModelConfig, key, kind: str, start=0, count: int = 0) -> dict:
  """partition.piece_of(init_outer(cfg, key), kind, start, start + count) computing only that
  piece: `count` vocabulary rows from `start` (which may be traced: one program per chunk size)
  of the embedding ('embed') or of the untied head ('head'), drawn alone (layers.vocab_normal),
  or the final norm ('final_norm'). Same keys as init_outer."""
  k_embed, _, k_head = param_keys(key)
  if kind == 'embed':
    rows = layers_lib.vocab_normal(nnx.Rngs(k_embed).params(), cfg.init_std, cfg.d_model, start,
                                   count, cfg.vocab_size)
    return {'embed': {'embedding': rows}}
  if kind == 'head':
    columns = layers_lib.vocab_normal(nnx.Rngs(k_head).params(), cfg.init_std, cfg.d_model,
                                      start, count, cfg.vocab_size, head=True)
    return {'head': {'lm_head': {'kernel': columns}}}
  if kind == 'final_norm':
    norm = layers_lib.RMSNorm(cfg.d_model, cfg.norm_eps, layers_lib.compute_dtype(cfg))
    return {'head': {'final_norm': _pure(norm)}}
  raise ValueError(f'no outer piece of kind {kind!r}')


def init_params(cfg: ModelConfig, key) -> dict:
  return {**init_outer(cfg, key), 'layers': init_layers(cfg, param_keys(key)[1], 0, cfg.num_layers)}


def abstract_params(cfg: ModelConfig) -> dict:
  """ShapeDtypeStructs of every param, by abstract evaluation: allocates nothing."""
  return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------------------------
# Stages.
# ----------------------------------------------------------------------------------------------

def default_positions(tokens):
  """[B, S] int tokens -> [B, S] int32 positions 0..S-1."""
  b, s = tokens.shape
  return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))


def document_positions(tokens, eos_id: int):
  """[B, S] int tokens of packed rows -> (positions, segments), each [B, S] int32.

  A row is a window of the token stream, where every document ends with `eos_id` (the row's
  first document may have begun before it and its last may go on after). segments numbers the
  row's documents 0, 1, ... (an EOS belongs to the document it ends); positions counts from 0 at
  each document's first token in the row. E.g. eos 0, tokens [5 6 0 7 0 8] -> segments
  [0 0 0 1 1 2], positions [0 1 2 0 1 0]."""
  return start_positions(jnp.pad(tokens[:, :-1] == eos_id, ((0, 0), (1, 0))))


def start_positions(starts):
  """[B, S] where documents begin (nonzero: a document's first token; data.Batch.starts of the
  inputs) -> (positions, segments), each [B, S] int32, as `document_positions` numbers them."""
  index = jnp.broadcast_to(jnp.arange(starts.shape[1], dtype=jnp.int32), starts.shape)
  starts = starts.astype(bool) & (index > 0)  # a row's first token begins its first document
  segments = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # its document's first index
  return index - first, segments


def token_positions(cfg: ModelConfig, tokens, starts=None) -> layers_lib.RopePositions:
  """The layers' positions of [B, S] tokens: 0..S-1, or, where documents are kept apart, each
  document's own positions and the segments that keep attention inside it (RoPE tables once).
  The documents are those `starts` [B, S] marks (data.Batch.starts of the inputs: as the data
  records them), else, with `cfg.document_eos_id` >= 0, those its EOS ends."""
  if starts is not None:
    return layers_lib.rope_positions(cfg, *start_positions(starts))
  if cfg.document_eos_id < 0:
    return layers_lib.rope_positions(cfg, default_positions(tokens))
  return layers_lib.rope_positions(cfg, *document_positions(tokens, cfg.document_eos_id))


def positions_of_batches(cfg: ModelConfig, tokens: list, positions_fn, starts=None) -> list:
  """positions_fn(t) (a jitted token_positions) of each [B, S] tokens t of a list, for programs
  that run several batches by the same weights; given `starts` (each batch's [B, S]
  data.Batch.starts of the inputs), positions_fn(t, s). Without a document mask all are
  0..S-1: the first batch's object serves all (its RoPE tables [B, S, Dh] held once)."""
  if starts is not None and starts[0] is not None:
    return [positions_fn(t, s) for t, s in zip(tokens, starts, strict=True)]
  if cfg.document_eos_id < 0:
    return [positions_fn(tokens[0])] * len(tokens)
  return [positions_fn(t) for t in tokens]


def embed(cfg: ModelConfig, params, tokens):
  """tokens [B, S] -> hidden [B, S, D] in the compute dtype."""
  return _merge(cfg, 'embed', params['embed'])(tokens)


def apply_layer(cfg: ModelConfig, layer_params, x, positions):
  """One decoder layer as a pure function of one slice of the stack: [B, S, D] -> [B, S, D]."""
  return _merge(cfg, 'layer', layer_params)(x, positions)


def _remat(cfg: ModelConfig, fn, prevent_cse: bool):
  """Wraps a layer function in jax.checkpoint according to `cfg.remat`.

  full:    save only the layer input; recompute everything in the backward pass.
  minimal: also save the named matmul outputs (cheap elementwise work is recomputed).
  offload: save the named projection outputs in pinned host memory instead of device memory.
  """
  if cfg.remat == 'none':
    return fn
  if cfg.remat == 'full':
    policy = jax.checkpoint_policies.nothing_saveable
  elif cfg.remat == 'minimal':
    policy = jax.checkpoint_policies.save_only_these_names(*layers_lib.MATMUL_OUTPUT_NAMES)
  else:  # 'offload'
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(layers_lib.OFFLOAD_NAMES),
        offload_src='device', offload_dst='pinned_host')
  return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def layer_body(cfg: ModelConfig, shard_layer):
  """apply_layer(cfg, ...), its weights and input first placed by `shard_layer` when given."""
  if shard_layer is None:
    return functools.partial(apply_layer, cfg)
  return lambda layer_params, x, positions: apply_layer(cfg, *shard_layer(layer_params, x),
                                                        positions)


def apply_group(cfg: ModelConfig, group_params, x, positions, shard_layer=None):
  """K consecutive layers: group_params leaves have a leading axis K; [B, S, D] -> [B, S, D].
  `positions`: [B, S] int32, or a layers.RopePositions (their RoPE tables computed once for
  every group of a step; see there).

  With `cfg.scan_layers` the layers run as a `lax.scan` over the K-slice (one compiled layer body);
  otherwise as an unrolled Python loop (same math, longer compile). `shard_layer(layer params,
  x) -> (layer params, x)`: on several devices, places each layer's weights and input inside its
  body (Layout.shard_layer: the weights gathered whole, the input split along B), inside the
  remat so the backward gathers the weights again rather than keeping them.
  """
  num = jax.tree.leaves(group_params)[0].shape[0]
  body = layer_body(cfg, shard_layer)
  if cfg.scan_layers:
    # Inside a scan the CSE that prevent_cse guards against cannot happen (JAX docs).
    layer = _remat(cfg, body, prevent_cse=False)
    # Without remat the backward needs every intermediate of every layer. A rolled scan stacks
    # each into an [K, ...] buffer in the forward and slices it back out in the backward; unrolled
    # (still one scan in the jaxpr), XLA keeps them as separate buffers and fuses around them. On
    # the tiny config (XLA:CPU, bench/host_allocator.py --vary remat) the rolled scan made `none`
    # 1.12x slower than `full` and 2.0x its peak RSS; unrolled, 0.95x and 1.13x.
    x, _ = jax.lax.scan(lambda h, p: (layer(p, h, positions), None), x, group_params,
                        unroll=cfg.remat == 'none')
    return x
  layer = _remat(cfg, body, prevent_cse=True)
  for i in range(num):
    x = layer(jax.tree.map(lambda a, i=i: a[i], group_params), x, positions)
  return x


def apply_group_keeping_inputs(cfg: ModelConfig, group_params, x, positions, shard_layer=None):
  """`apply_group` that also returns every layer's input: [B, S, D] -> ([B, S, D] output,
  [K, B, S, D] inputs, inputs[i] the input of layer i; inputs[0] = x).

  For a forward whose backward starts from the saved layer inputs (engine/functions.py) rather
  than recomputing the group to find them. Not differentiated, so no remat: the same layer math
  as `apply_group`, layer after layer.
  """
  layer = layer_body(cfg, shard_layer)
  if cfg.scan_layers:
    return jax.lax.scan(lambda h, p: (layer(p, h, positions), h), x, group_params)
  inputs = []
  for i in range(jax.tree.leaves(group_params)[0].shape[0]):
    inputs.append(x)
    x = layer(jax.tree.map(lambda a, i=i: a[i], group_params), x, positions)
  return x, jnp.stack(inputs)


def head(cfg: ModelConfig, params, x):
  """hidden [B, S, D] -> logits [B, S, V] float32. Needs params['head'] (and 'embed' if tied)."""
  embedding = params['embed']['embedding'] if cfg.tie_embeddings else None
  return _merge(cfg, 'head', params['head'])(x, embedding)


def final_norm(cfg: ModelConfig, params, x):
  """The final RMSNorm alone: hidden [B, S, D] -> normed [B, S, D]. Needs
  params['head']['final_norm']."""
  scale = params['head']['final_norm']['scale']
  return layers_lib.rms_norm(x, scale, cfg.norm_eps, layers_lib.compute_dtype(cfg))


def logits(cfg: ModelConfig, params, normed):
  """The LM head alone: normed [B, S, D] -> logits [B, S, V] float32. Needs
  params['head']['lm_head'] or, with tied embeddings, params['embed']. `head` =
  logits(final_norm(x)), the same ops."""
  if cfg.tie_embeddings:
    return layers_lib.tied_logits(cfg, normed, params['embed']['embedding'])
  return layers_lib.untied_logits(cfg, normed, params['head']['lm_head']['kernel'])


def logits_loss(cfg: ModelConfig, params, normed, targets, weights=None):
  """Mean cross-entropy of the LM head applied to the final norm's output [B, S, D].

  Computed over vocabulary blocks of `cfg.resolved_vocab_chunk` columns (model/vocab.py): equals
  `cross_entropy(logits(...), targets)` to float32 rounding without the [B, S, V] logits or their
  gradient. Needs params['head']['lm_head'] or, with tied embeddings, params['embed']. `weights`
  [B, S] float32 (vocab.token_weights of a loss mask) makes it Σ weights·nll (the engines' masked
  loss).
  """
  if cfg.tie_embeddings:
    weight = params['embed']['embedding']
  else:
    weight = params['head']['lm_head']['kernel']
  return chunked_logits_loss(normed, weight, targets, tied=cfg.tie_embeddings,
                             chunk=cfg.resolved_vocab_chunk, precision=cfg.matmul_precision,
                             weights=weights)


def cross_entropy(logits, targets):
  """Mean token cross-entropy of whole logits [B, S, V] float32, targets [B, S] int (the
  reference that `logits_loss` matches; training goes through the chunked `logits_loss`)."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def head_loss(cfg: ModelConfig, params, x, targets, weights=None):
  """Mean cross-entropy of `head` on hidden x [B, S, D]: final norm, then the chunked loss."""
  return logits_loss(cfg, params, final_norm(cfg, params, x), targets, weights)


def forward(cfg: ModelConfig, params, tokens):
  """tokens [B, S] int -> logits [B, S, V] float32, all layers in one scan."""
  x = embed(cfg, params, tokens)
  x = apply_group(cfg, params['layers'], x, token_positions(cfg, tokens))
  return head(cfg, params, x)


def loss_fn(cfg: ModelConfig, params, batch, weights=None, starts=None, shard_layer=None):
  """batch [B, S + 1] int tokens -> mean next-token cross-entropy (inputs [:, :-1], targets
  [:, 1:]).

  The same stages as `forward`, but the head and loss run over vocabulary blocks (`logits_loss`),
  so the [B, S, V] logits are never materialised. `weights` [B, S] float32 (per target; from
  vocab.token_weights of a loss mask): the loss is Σ weights·nll instead of the mean. `starts`
  [B, S + 1] (data.Batch.starts): where documents begin (`token_positions`).
  `shard_layer`: see apply_group.
  """
  tokens, targets = batch[:, :-1], batch[:, 1:]
  x = embed(cfg, params, tokens)
  # RoPE tables once per batch.
  positions = token_positions(cfg, tokens, None if starts is None else starts[:, :-1])
  x = apply_group(cfg, params['layers'], x, positions, shard_layer)
  return head_loss(cfg, params, x, targets, weights=weights)


# ----------------------------------------------------------------------------------------------
# Incremental decoding (sample.py): each new token runs the layers once, against the keys and
# values of the tokens before it kept in a cache, instead of rerunning the whole sequence.
# ----------------------------------------------------------------------------------------------

def kv_cache_slots(cfg: ModelConfig, length: int) -> int:
  """The slots of a key/value cache for a buffer of `length` slots: all of them, or under a
  sliding window W shorter than the buffer W (a ring: Attention.extend): no query sees a key W or
  more slots back, so the cache need not hold it (Mistral-7B at 32k tokens: 0.5 GB instead of
  4.3 GB in float32)."""
  window = cfg.sliding_window
  return min(length, window) if window else length


def init_kv_cache(cfg: ModelConfig, batch: int, length: int) -> tuple:
  """An empty key/value cache for a buffer of `length` slots: (k, v), each [L, B, KV, C, Dh]
  zeros in the compute dtype (layer-major, as params['layers']), C = kv_cache_slots."""
  shape = (cfg.num_layers, batch, cfg.num_kv_heads, kv_cache_slots(cfg, length), cfg.head_dim)
  zeros = jnp.zeros(shape, layers_lib.compute_dtype(cfg))
  return zeros, zeros


def extend(cfg: ModelConfig, params, tokens, start, where, cache, end=None):
  """Runs tokens [B, S], the slots [start, start + S) of a buffer of T slots, through the layers
  against `cache` (init_kv_cache(cfg, B, T); their keys and values are written into it).
  `where`: token_positions of the whole buffer [B, T] as it stands (a slot's position depends
  only on the tokens before it, so the slots not yet written do not change those before them).
  `end` (default start + S): the slots from it on are placeholders, not to be cached: a ring
  (under a sliding window) would let them displace the keys of the slots before them that the
  next token needs. Calls must run the buffer's slots in order.
  -> (hidden [B, S, D] after the last layer (head() gives the logits), the updated cache).

  Equals `forward` on the buffer at those slots (before `end`): the same layer math, the keys
  and values of the earlier slots read from the cache rather than recomputed."""
  x = embed(cfg, params, tokens)

  def layer(h, xs):
    layer_params, *layer_cache = xs
    return _merge(cfg, 'layer', layer_params).extend(h, where, tuple(layer_cache), start, end)

  x, cache = jax.lax.scan(layer, x, (params['layers'], *cache))
  return x, cache
