"""Text from a model: `launch.py --sample` (train.sample), to see what a run has learned.

`generate` continues a prompt one token at a time, greedily (temperature 0, the argmax) or by
sampling the softmax of logits / temperature, optionally among the top_k logits, and stops after
the data's EOS or max_new_tokens. Every new token reruns the forward pass over one fixed
[1, L] buffer (L = prompt + max_new_tokens, at most model.max_seq_len; the positions after the
current one are masked out by causality), so one program compiles once and the whole loop runs
inside it (`lax.while_loop`): no KV cache, L forward passes of L tokens, the LM head on the one
position it needs. The weights are held whole in device memory: meant for models that fit there
(a 1B model in FP32 needs 4 GB); export larger ones (`--export_hf`) to a serving stack.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import model as model_lib
from megatrain_jax.errors import ConfigError


def generate(cfg: model_lib.ModelConfig, params, prompt, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             eos_id: int = -1) -> np.ndarray:
  """The token ids [<= max_new_tokens] that follow `prompt` ([N] ids), ending with `eos_id` if
  the model produced it.

  Raises:
    ConfigError: (naming `sample.*`) an empty prompt, or one that leaves no room for
      max_new_tokens within model.max_seq_len.
  """
  prompt = np.asarray(prompt, np.int32).reshape(-1)
  length = prompt.size + max_new_tokens
  if not prompt.size:
    raise ConfigError('sample.prompt: it encodes to no tokens; give some text to continue.')
  if max_new_tokens < 1:
    raise ConfigError(f'sample.max_new_tokens={max_new_tokens} must be >= 1.')
  if length > cfg.max_seq_len:
    raise ConfigError(f'sample.prompt ({prompt.size} tokens) + sample.max_new_tokens '
                      f'({max_new_tokens}) = {length} tokens exceed model.max_seq_len='
                      f'{cfg.max_seq_len}; shorten the prompt or lower sample.max_new_tokens.')
  buffer = np.zeros((1, length), np.int32)
  buffer[0, :prompt.size] = prompt
  loop = _generation_loop(cfg, float(temperature), min(int(top_k), cfg.vocab_size), int(eos_id))
  tokens, end = loop(params, jnp.asarray(buffer), jnp.int32(prompt.size), jax.random.key(seed))
  return np.asarray(tokens)[0, prompt.size:int(end)]


@functools.lru_cache(maxsize=8)
def _generation_loop(cfg: model_lib.ModelConfig, temperature: float, top_k: int, eos_id: int):
  """jit(params, buffer [1, L], n, key) -> (buffer, end): tokens n.. written until EOS or L."""

  def next_logits(params, buffer, n):  # the logits [V] of position n - 1
    x = model_lib.embed(cfg, params, buffer)
    x = model_lib.apply_group(cfg, params['layers'], x, model_lib.token_positions(cfg, buffer))
    last = jax.lax.dynamic_slice_in_dim(x, n - 1, 1, axis=1)  # [1, 1, D]
    return model_lib.head(cfg, params, last)[0, 0]

  def choose(logits, key):
    if temperature == 0.0:
      return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
      kth = jax.lax.top_k(logits, top_k)[0][-1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)

  def step(params, carry):
    buffer, n, key, _ = carry
    key, draw = jax.random.split(key)
    token = choose(next_logits(params, buffer, n), draw)
    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, token.reshape(1, 1), n, axis=1)
    return buffer, n + 1, key, token == eos_id

  def run(params, buffer, n, key):
    more = lambda carry: (carry[1] < buffer.shape[1]) & ~carry[3]
    buffer, n, _, _ = jax.lax.while_loop(more, functools.partial(step, params),
                                         (buffer, n, key, jnp.bool_(False)))
    return buffer, n

  return jax.jit(run)
