"""Text from a model: `launch.py --sample` (train.sample), to see what a run has learned.

`generate` continues a prompt one token at a time, greedily (temperature 0, the argmax) or by
sampling the softmax of logits / temperature, optionally among the top_k logits and then the
smallest set of them whose probability reaches top_p (transformers' order of its warpers), the
logits of the ids so far first divided by a repetition penalty (multiplied where negative, as
transformers does), and stops after any of the stop ids (the data's EOS, generation_config.json's)
or max_new_tokens.

It decodes with a key/value cache (model.extend): one [1, L] buffer (L = prompt + max_new_tokens,
at most model.max_seq_len) runs through the layers once, filling the cache [layers, 1, KV, C, Dh]
with the prompt's keys and values (the slots after the prompt hold placeholders until their
tokens are drawn; causality keeps every query from seeing them), then each new token runs the
layers alone against the cache: one token's work per step instead of the L tokens a rerun of the
whole buffer costs. The cache has C = L slots, or under a sliding window W < L only W
(model.kv_cache_slots: a ring of the last W tokens, all a query can see). One program
compiles per L and the whole loop runs inside it (`lax.while_loop`), vmapped over the rows of a
batch of prompts (`generate_all`: a step reads the weights once for all). The weights are held
whole in device memory: meant for models that fit there (a 1B model in FP32 needs 4 GB); export
larger ones (`--export_hf`) to a serving stack.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import model as model_lib
from megatrain_jax.errors import ConfigError


def generate(cfg: model_lib.ModelConfig, params, prompt, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             repetition_penalty: float = 1.0, seed: int = 0, eos_id=()) -> np.ndarray:
  """The token ids [<= max_new_tokens] that follow `prompt` ([N] ids), ending with one of the
  stop ids `eos_id` (an int or several; -1 or () = none) if the model produced it.

  Raises:
    ConfigError: (naming `sample.*`) as `check_request`.
  """
  return generate_all(cfg, params, [prompt], max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p,
                      repetition_penalty=repetition_penalty, seed=seed, eos_id=eos_id)[0]


def generate_all(cfg: model_lib.ModelConfig, params, prompts, *, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int = 0, eos_id=(),
                 batch_size: int = 8) -> list:
  """`generate` of each of `prompts` (lists of ids), prompt i drawn with seed + i: the tokens
  each alone gives. They are decoded `batch_size` at a time (the loop vmapped over the rows: a
  step reads the weights once for all of them, and decoding is bound by reading the weights),
  in one compiled program: every buffer has the longest prompt's length + max_new_tokens slots,
  a short last batch is filled up with copies of its first prompt (dropped), and each prompt
  stops after its own max_new_tokens or stop id.

  Raises:
    ConfigError: as `check_request`.
  """
  prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
  if not prompts:
    return []
  length = check_request(cfg, prompts, max_new_tokens, top_p, repetition_penalty)
  stop_ids = tuple(sorted({int(i) for i in np.atleast_1d(eos_id) if int(i) >= 0}))
  # A prompt is one document, as transformers' generate reads it: a chat prompt holds the EOS of
  # its earlier turns where a chat template ends every turn with it (model.document_mask then
  # learned documents as the data recorded them, not as that id would cut them).
  cfg = cfg.replace(document_eos_id=-1)
  loop = _generation_loop(cfg, float(temperature), min(int(top_k), cfg.vocab_size),
                          float(top_p), float(repetition_penalty), stop_ids)
  rows = max(1, min(int(batch_size), len(prompts)))
  out = []
  for first in range(0, len(prompts), rows):
    batch = prompts[first:first + rows]
    filled = batch + [batch[0]] * (rows - len(batch))
    buffers = np.zeros((rows, 1, length), np.int32)  # [rows, 1, L]: each row a [1, L] buffer
    for row, prompt in enumerate(filled):
      buffers[row, 0, :prompt.size] = prompt
    starts = np.array([p.size for p in filled], np.int32)
    keys = jax.vmap(jax.random.key)(jnp.arange(first, first + rows) + seed)
    tokens, ends = loop(params, jnp.asarray(buffers), jnp.asarray(starts),
                        jnp.asarray(starts + max_new_tokens), keys)
    tokens, ends = np.asarray(tokens), np.asarray(ends)
    out += [tokens[row, 0, starts[row]:ends[row]] for row in range(len(batch))]
  return out


def check_request(cfg: model_lib.ModelConfig, prompts: list, max_new_tokens: int,
                  top_p: float = 1.0, repetition_penalty: float = 1.0) -> int:
  """The buffer length `generate_all` needs for `prompts` (lists of ids): the longest prompt +
  max_new_tokens.

  Raises:
    ConfigError: (naming `sample.*`, and of several prompts the one, 1-based) an empty prompt,
      one that leaves no room for max_new_tokens within model.max_seq_len, max_new_tokens < 1, a
      top_p outside (0, 1] or a repetition_penalty <= 0.
  """
  sizes = [len(p) for p in prompts]
  name = 'sample.prompt' if len(sizes) == 1 else 'sample.prompts'
  for i, size in enumerate(sizes):
    if not size:
      raise ConfigError(f'{name}: {"it" if len(sizes) == 1 else f"prompt #{i + 1}"} encodes '
                        'to no tokens; give some text to continue.')
  if max_new_tokens < 1:
    raise ConfigError(f'sample.max_new_tokens={max_new_tokens} must be >= 1.')
  if not 0 < top_p <= 1:
    raise ConfigError(f'sample.top_p={top_p} must be in (0, 1] (1 = off).')
  if not repetition_penalty > 0:
    raise ConfigError(f'sample.repetition_penalty={repetition_penalty} must be > 0 (1 = off).')
  longest = max(range(len(sizes)), key=sizes.__getitem__)
  length = sizes[longest] + max_new_tokens
  if length > cfg.max_seq_len:
    which = '' if len(sizes) == 1 else f' #{longest + 1}'
    raise ConfigError(f'{name}{which} ({sizes[longest]} tokens) + sample.max_new_tokens '
                      f'({max_new_tokens}) = {length} tokens exceed model.max_seq_len='
                      f'{cfg.max_seq_len}; shorten the prompt or lower sample.max_new_tokens.')
  return length


def device_bytes(cfg: model_lib.ModelConfig, length: int, rows: int = 1) -> int:
  """What `generate_all` holds in device memory for `rows` buffers of `length` slots: the
  float32 weights and the key/value caches (two [rows, L, 1, KV, C, Dh] arrays in the compute
  dtype, C = model.kv_cache_slots: `length`, or the sliding window where shorter)."""
  slots = model_lib.kv_cache_slots(cfg, length)
  cache = 2 * rows * cfg.num_layers * cfg.num_kv_heads * slots * cfg.head_dim
  return 4 * cfg.num_params + cache * jnp.dtype(cfg.dtype).itemsize


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
  """logits [V] float32 with those outside the top_k (0 = all) and then outside the smallest
  most-likely set whose softmax reaches top_p (1 = all; the most likely token always stays) set
  to -inf: transformers' TopKLogitsWarper then TopPLogitsWarper. Each cut is a threshold found
  by bisection (`_smallest_key`: 32 passes over V), not a sort of the vocabulary: at V=151,936
  XLA:CPU's top_k and argsort took 218 and 290 ms a step for 8 rows, 15x the model's step."""
  keys = _order_keys(logits)
  if top_k:  # the k-th largest logit: fewer than k above it (ties at it stay, as in transformers)
    kth = _smallest_key(keys, lambda t: jnp.sum(keys > t) < top_k)
    logits = jnp.where(keys < kth, -jnp.inf, logits)
  if top_p < 1.0:
    # A token goes when the tokens less likely than it, itself included, hold at most 1 - top_p
    # of the probability (transformers' cumulative sum in ascending order); the most likely
    # token always stays.
    probs = jax.nn.softmax(logits)
    first = _smallest_key(
        keys, lambda t: jnp.sum(jnp.where(keys <= t, probs, 0.0)) > 1.0 - top_p)
    logits = jnp.where(keys < first, -jnp.inf, logits)
  return logits


def _order_keys(x):
  """uint32 keys of float32 `x` in the floats' order (-inf lowest): a threshold bisected over
  them is one of the floats, exactly."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _smallest_key(keys, holds):
  """The smallest t in [min(keys), max(keys)] for which `holds(t)` (false below it, true from it
  on, true at the max): a bisection over the uint32 range, 32 steps."""
  def step(_, bounds):
    low, high = bounds
    middle = low + (high - low) // 2
    ok = holds(middle)
    return jnp.where(ok, low, middle + jnp.uint32(1)), jnp.where(ok, middle, high)
  return jax.lax.fori_loop(0, 32, step, (jnp.min(keys), jnp.max(keys)))[1]


@functools.lru_cache(maxsize=8)
def _generation_loop(cfg: model_lib.ModelConfig, temperature: float, top_k: int, top_p: float,
                     penalty: float, stop_ids: tuple):
  """jit(vmap(run)): (params, buffers [R, 1, L], n [R], limit [R], keys [R]) -> (buffers, end
  [R]): in each row, tokens n.. written until a stop id or slot `limit` (<= L), each from the
  logits of the token before it. Under vmap the while loop runs until every row is done."""
  stops = jnp.asarray(stop_ids or (-1,), jnp.int32)

  def choose(logits, seen, key):  # logits [V], seen [V] (the ids so far) -> a token id
    if penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor, greedy or not
      logits = jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)
    if temperature == 0.0:
      return jnp.argmax(logits).astype(jnp.int32)
    logits = filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(key, logits).astype(jnp.int32)

  def after(params, buffer, n, cache):  # the token at slot n through the layers -> logits [V]
    token = jax.lax.dynamic_slice_in_dim(buffer, n, 1, axis=1)
    x, cache = model_lib.extend(cfg, params, token, n, model_lib.token_positions(cfg, buffer),
                                cache)
    return model_lib.head(cfg, params, x)[0, 0], cache

  def step(params, carry):
    buffer, n, key, _, logits, seen, cache = carry
    key, draw = jax.random.split(key)
    token = choose(logits, seen, draw)
    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token.reshape(1, 1), n, axis=1)
    logits, cache = after(params, buffer, n, cache)
    return buffer, n + 1, key, jnp.any(token == stops), logits, seen.at[token].set(True), cache

  def run(params, buffer, n, limit, key):
    # The prefill: the whole buffer at once, for the logits after the prompt's last token; the
    # placeholders from slot n on are not cached (a windowed ring keeps the prompt's last keys).
    cache = model_lib.init_kv_cache(cfg, 1, buffer.shape[1])
    x, cache = model_lib.extend(cfg, params, buffer, 0, model_lib.token_positions(cfg, buffer),
                                cache, end=n)
    logits = model_lib.head(cfg, params, jax.lax.dynamic_slice_in_dim(x, n - 1, 1, axis=1))
    more = lambda carry: (carry[1] < limit) & ~carry[3]
    # The ids of the prompt (the slots before n) [V]: what a repetition penalty applies to.
    seen = jnp.zeros(cfg.vocab_size, bool).at[buffer[0]].max(jnp.arange(buffer.shape[1]) < n)
    carry = (buffer, n, key, jnp.bool_(False), logits[0, 0], seen, cache)
    buffer, n, *_ = jax.lax.while_loop(more, functools.partial(step, params), carry)
    return buffer, n

  return jax.jit(jax.vmap(run, in_axes=(None, 0, 0, 0, 0)))
