"""The streamed engine's jitted pieces: pure functions of arrays, compiled once per shape.

Shapes: B batch, S sequence, D d_model, V vocab. `outer` arguments are piece params at their
full-state paths (partition.py): embed {'embed': ...}, norm {'head': {'final_norm': ...}}, head
weights {'head': {'lm_head': ...}} or, tied, the embed piece.

Arithmetic mirrors engine/resident.py (sum of microbatch gradients, / M, then * clip scale, then
the same optax update), so both engines train to the same numbers within float32 rounding.

On N devices (`Layout`) the inputs arrive sharded: weights, gradients and Adam state by the
layout's per-leaf specs, tokens and activations along B. The functions that return train-state-
shaped trees (gradient sums, updated weights and Adam state) hold them to those specs
(`Layout.constrain`, or `out_shardings` for the host update), so what goes back to a store is
already in its shards; XLA (GSPMD) adds the all-gathers and reduce-scatters in between.

A batch with a loss mask (data.Batch) is learned through per-token weights (`step_inputs`,
model.token_weights): each microbatch's loss is Σ w·nll with w = mask·M / (learned tokens of the
whole step), so the same mean over microbatches gives the full batch's masked mean.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.layout import Layout
from megatrain_jax.model import ModelConfig
from megatrain_jax.model import decoder
from megatrain_jax.model import head_chunks


def step_inputs(batch) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
  """(tokens [..., S+1] int32, per-token loss weights [..., S] float32 or None, where documents
  begin [..., S+1] uint8 or None) of a batch.

  `batch` is a token array (every target learned: weights None, the engines' plain mean) or a
  data.Batch (tokens, loss_mask, starts): weights = model.token_weights(loss_mask), the same
  host numbers for every engine; starts as the data gives them (model.token_positions). A
  leading microbatch axis M (train steps) spreads the normalisation over the whole step; an
  eval batch [B, S+1] is one batch of its own."""
  mask = getattr(batch, 'loss_mask', None)
  if mask is None:
    return batch, None, None
  return batch.tokens, model_lib.token_weights(mask), batch.starts


def tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def mean_sum_of_squares(grad_sum, num_micro: int):
  """Sum of squares of the mean gradient (grad_sum / M), as the resident engine's norm sees it."""
  return optim.sum_of_squares(jax.tree.map(lambda g: g / num_micro, grad_sum)
                              if num_micro > 1 else grad_sum)


def adamw_update(tx, grad_sum, opt_state, params, scale, num_micro: int):
  """(sum of M microbatch grads) -> mean -> clip scale -> optax update. Same order as resident."""
  grads = jax.tree.map(lambda g: g / num_micro, grad_sum) if num_micro > 1 else grad_sum
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _sharded_outputs(name: str, fn, state=(), batch=(), stacked=()):
  """`fn`, named `name`, with its outputs at the indices in `state` (train-state-shaped trees)
  held to the layout's per-leaf specs, those in `batch` (activations [B, S, ...]) split along B
  and those in `stacked` (per-layer activations [K, B, S, ...]) split along B too (axis 1); `fn`
  takes the layout as its first argument. Applied inside jit: sharding constraints."""
  def constrained(layout, *args):
    out = fn(*args)
    single = not isinstance(out, tuple)
    out = [out] if single else list(out)
    for i in state:
      out[i] = layout.constrain(out[i])
    for i in batch:
      out[i] = layout.constrain_batch(out[i])
    for i in stacked:
      out[i] = jax.lax.with_sharding_constraint(out[i], layout.split_along(1, 'device'))
    return out[0] if single else tuple(out)
  constrained.__name__ = constrained.__qualname__ = name
  return constrained


@functools.lru_cache(maxsize=8)
def stage_functions(cfg: ModelConfig, tx: optax.GradientTransformation,
                    layout: Layout) -> 'StageFunctions':
  """The StageFunctions of (cfg, tx, layout), shared by every engine built with the same three
  (optim.make_optimizer returns one transformation per set of hyperparameters): a jitted
  function keeps its traces and executables, so a second engine (an evaluation engine, a rerun
  notebook cell, a test) starts without tracing and lowering each stage again."""
  return StageFunctions(cfg, tx, layout)


class StageFunctions:
  """One jitted function per stage step; see schedule.py for the order they run in. Engines
  take theirs from `stage_functions`."""

  def __init__(self, cfg: ModelConfig, tx: optax.GradientTransformation, layout: Layout):
    self.tx, self.layout = tx, layout
    # Programs named by stage, as profiles show them: PjitFunction(group_backward), not the wrapper.
    on = lambda name, fn, **where: functools.partial(_sharded_outputs(name, fn, **where), layout)
    # On N devices each layer gathers its weights whole and keeps its input split along B.
    shard = layout.shard_layer if layout.num_devices > 1 else None
    self._chunk_functions(cfg, on)
    self.group_forward = jax.jit(on(
        'group_forward',
        lambda group, x, positions: model_lib.apply_group(cfg, group['layers'], x, positions,
                                                          shard),
        batch=[0]))
    # offload.keep_layer_inputs (K > 1): the forward also returns the K layer inputs [K, B, S, D]
    # for the backward, which then recomputes each layer once (not the whole group first).
    self.group_forward_keeping_inputs = jax.jit(on(
        'group_forward_keeping_inputs',
        lambda group, x, positions: decoder.apply_group_keeping_inputs(cfg, group['layers'], x,
                                                                       positions, shard),
        batch=[0], stacked=[1]))
    # A microbatch's positions [B, S] (model.token_positions: with a document mask, each
    # document's own, and its segments) with their RoPE tables, computed once for every group
    # program.
    self.token_positions = jax.jit(functools.partial(model_lib.token_positions, cfg))
    self.final_norm = jax.jit(functools.partial(model_lib.final_norm, cfg))
    self.final_norm_backward = jax.jit(on('final_norm_backward',
                                          functools.partial(_final_norm_backward, cfg),
                                          state=[0], batch=[1]))
    # A group's backward for one microbatch: (grad_sum, dx, squares). The first microbatch's
    # gradient starts the sum (grad_sum None: no zeros to fill and add), and the last one also
    # returns the sum of squares of the mean gradient (`squares_of` = M; None: squares None),
    # so neither costs a pass over the group's gradient of its own.
    self.group_backward = jax.jit(
        on('group_backward', _with_squares(functools.partial(_group_backward, cfg, shard)),
           state=[0], batch=[1]),
        donate_argnums=(2, 4), static_argnums=5)
    self.group_backward_from_inputs = jax.jit(
        on('group_backward_from_inputs',
           _with_squares(functools.partial(_group_backward_from_inputs, cfg, shard)), state=[0],
           batch=[1]), donate_argnums=(2, 4), static_argnums=5)
    self.add = jax.jit(on('add_gradients', tree_add, state=[0]), donate_argnums=(0,))
    self.sum_of_squares = jax.jit(mean_sum_of_squares, static_argnums=1)
    # The step's global norm and clip scale from the pieces' sums of squares, in one program (a
    # Python sum of them would dispatch one add per piece: hundreds at a real vocabulary).
    self.global_norm = jax.jit(_global_norm, static_argnums=1)
    # Donates the Adam state and the weights (the new ones reuse their buffers); the gradient has
    # no output of its shape left to alias, so it is freed rather than donated.
    self.device_update = jax.jit(on('device_update', functools.partial(adamw_update, tx),
                                    state=[0, 1]),
                                 static_argnums=4, donate_argnums=(1, 2))
    self._host_updates = {}  # (tree structure, leaf shapes, M) -> jitted host update

  def _chunk_functions(self, cfg: ModelConfig, on) -> None:
    """The vocabulary chunks' functions. `start` (the chunk's first id) is traced, so chunks of
    one length share one compiled function; pieces are trees at full-state paths
    (partition.py)."""
    self.embed_chunk = jax.jit(on('embed_chunk', functools.partial(_embed_chunk, cfg), batch=[0]))
    self.embed_chunk_add = jax.jit(on('embed_chunk_add', functools.partial(_embed_chunk_add, cfg),
                                      batch=[0]), donate_argnums=(3,))
    self.lse_init = jax.jit(head_chunks.lse_init)
    self.lse_update = jax.jit(functools.partial(_lse_update, cfg))
    self.lse_finish = jax.jit(head_chunks.lse_finish)
    # Both also return the sum of squares of the chunk's mean gradient when given `squares_of`
    # (M: the last microbatch's call; else None), as group_backward does: no program of its own.
    self.head_chunk_backward = jax.jit(on('head_chunk_backward',
                                          functools.partial(_head_chunk_backward, cfg),
                                          state=[0], batch=[1]), static_argnums=8)
    self.embed_chunk_backward = jax.jit(on('embed_chunk_backward',
                                           functools.partial(_embed_chunk_backward, cfg),
                                           state=[0]), static_argnums=(0, 5))  # shape, M

  def host_update(self, grad_sum, opt_state, params, scale, num_micro: int):
    """AdamW on the host (compute_on 'device_host') of pinned-host trees: (new params, new Adam
    state), each leaf back in pinned host memory in its own layout sharding (1/N of it per
    device). The output shardings depend on the trees' structure (a whole piece or one update
    band of it), so one jitted function is kept per structure."""
    outputs = (params, opt_state)
    key = (jax.tree.structure(outputs), tuple(np.shape(x) for x in jax.tree.leaves(outputs)),
           num_micro)
    if key not in self._host_updates:
      self._host_updates[key] = jax.jit(
          functools.partial(_host_update, self.tx), static_argnums=4,
          out_shardings=self.layout.shardings(outputs, 'pinned_host'))
    return self._host_updates[key](grad_sum, opt_state, params, scale, num_micro)


def _weight(cfg, piece):
  """The head's weight in a vocabulary piece: embedding rows [Vc, D] (tied) or kernel [D, Vc]."""
  return piece['embed']['embedding'] if cfg.tie_embeddings else piece['head']['lm_head']['kernel']


def _embed_chunk(cfg, piece, tokens, start):
  return head_chunks.embed_chunk(cfg, piece['embed']['embedding'], tokens, start)


def _embed_chunk_add(cfg, piece, tokens, start, hidden):
  return hidden + head_chunks.embed_chunk(cfg, piece['embed']['embedding'], tokens, start)


def _lse_update(cfg, piece, normed, targets, start, carry):
  return head_chunks.lse_update(cfg, normed, _weight(cfg, piece), targets, start, carry)


def _global_norm(squares: list, grad_clip: float):
  """(global norm, clip scale) from the pieces' sums of squares, summed in their order."""
  norm = jnp.sqrt(sum(squares))
  return norm, optim.clip_scale(norm, grad_clip)


def _head_chunk_backward(cfg, piece, normed, targets, start, lse, grad_sum, d_normed,
                         weights=None, squares_of=None):
  """Adds one microbatch's gradients from one vocabulary chunk: (piece grad, d normed, sum of
  squares of piece grad / `squares_of` or None); `weights` [B, S] the microbatch's per-token
  loss weights (None: the mean)."""
  d_n, d_w = head_chunks.chunk_backward(cfg, normed, _weight(cfg, piece), targets, start, lse,
                                        weights)
  grad = (jax.tree.map(jnp.zeros_like, piece) if grad_sum is None else grad_sum)
  leaf = ['embed', 'embedding'] if cfg.tie_embeddings else ['head', 'lm_head', 'kernel']
  grad = jax.tree_util.tree_map_with_path(
      lambda p, g: g + d_w if [k.key for k in p] == leaf else g, grad)
  return grad, d_n if d_normed is None else d_normed + d_n, _squares(grad, squares_of)


def _embed_chunk_backward(cfg, piece_shape, tokens, start, dx, grad_sum, squares_of=None):
  """(grad_sum + this microbatch's rows of the chunk, its sum of squares / `squares_of` or
  None)."""
  rows = head_chunks.embed_chunk_backward(cfg, piece_shape, tokens, start, dx)
  grad = {'embed': {'embedding': rows if grad_sum is None
                    else grad_sum['embed']['embedding'] + rows}}
  return grad, _squares(grad, squares_of)


def _squares(grad_sum, squares_of):
  """The sum of squares of grad_sum / `squares_of` (M), or None when `squares_of` is None."""
  return None if squares_of is None else mean_sum_of_squares(grad_sum, squares_of)


def _final_norm_backward(cfg, norm, x, d_normed):
  """(d norm, dx [B, S, D]) of the final norm, recomputed from its input x; d_normed summed in
  float32 over the head's chunks comes back to the compute dtype first (as in model/vocab.py)."""
  normed, vjp = jax.vjp(lambda p, h: model_lib.final_norm(cfg, p, h), norm, x)
  return vjp(d_normed.astype(normed.dtype))


def _with_squares(backward):
  """`backward(group_params, x, dy, positions, grad_sum)` -> (grad_sum, dx) as a function that
  also takes `squares_of` (M, or None) and returns (grad_sum, dx, the sum of squares of
  grad_sum / M, or None), computed in the same program."""
  def with_squares(group_params, x, dy, positions, grad_sum, squares_of=None):
    grad_sum, dx = backward(group_params, x, dy, positions, grad_sum)
    return grad_sum, dx, _squares(grad_sum, squares_of)
  return with_squares


def _add_or_start(grad_sum, grad):
  """grad_sum + grad, or grad itself when the sum starts here (grad_sum None)."""
  return grad if grad_sum is None else tree_add(grad_sum, grad)


def _group_backward(cfg, shard_layer, group_params, x, dy, positions, grad_sum):
  """Adds the group's weight gradient to grad_sum (None: starts it); returns (grad_sum, dx).
  `shard_layer`: see model.apply_group."""
  # The vjp recomputes the group's forward from its saved input x. For a one-layer group that
  # recompute *is* the layer checkpoint, so per-layer remat would run the layer's forward a
  # third time for nothing: keep its residuals instead (forward runs 2x per step, as in the
  # resident engine). Larger groups apply model.remat per layer to bound their memory (a third
  # forward per layer; offload.keep_layer_inputs avoids it: _group_backward_from_inputs).
  layers = jax.tree.leaves(group_params)[0].shape[0]
  layer_cfg = cfg.replace(remat='none') if layers == 1 else cfg
  _, vjp = jax.vjp(
      lambda p, h: model_lib.apply_group(layer_cfg, p['layers'], h, positions, shard_layer),
      group_params, x)
  d_params, dx = vjp(dy)
  return _add_or_start(grad_sum, d_params), dx


def _group_backward_from_inputs(cfg, shard_layer, group_params, inputs, dy, positions, grad_sum):
  """`_group_backward` from every layer's saved input (inputs [K, B, S, D], from
  decoder.apply_group_keeping_inputs): a reverse scan over (layer params, layer input, the
  layer's slice of grad_sum) carrying dy [B, S, D]. Each step is the vjp of one layer, whose
  recompute from its input is the layer checkpoint (remat off): each layer's forward runs twice
  per step, as with K = 1, instead of three times. Returns (grad_sum, dx); grad_sum None: the
  sum starts here."""
  layer_cfg = cfg.replace(remat='none')
  layer = decoder.layer_body(layer_cfg, shard_layer)

  def layer_backward(d_out, xs):
    layer_params, x, grad = xs  # one layer's slice: leaves [...], x [B, S, D]; grad None: starts
    _, vjp = jax.vjp(lambda p, h: layer(p['layers'], h, positions), layer_params, x)
    d_params, dx = vjp(d_out)
    return dx, _add_or_start(grad, d_params)

  dx, grad_sum = jax.lax.scan(layer_backward, dy, (group_params, inputs, grad_sum), reverse=True)
  return grad_sum, dx


def _host_update(tx, grad_sum, opt_state, params, scale, num_micro):
  # adamw_update's arithmetic in one pass over each leaf (optim.apply_adamw), on the host.
  return optim.host_adamw(tx, grad_sum, opt_state, params, num_micro, scale)
