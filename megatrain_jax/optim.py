"""The optimizer, shared by every engine: AdamW (FP32) with warmup + cosine, and exact clipping.

Clipping is not part of the optax chain: the global gradient norm needs *every* gradient, which a
streaming engine only has after the whole backward pass, while AdamW itself is elementwise and can
run group by group. So engines call `clip_by_global_norm` themselves (one formula for all of them,
hence identical numbers), then `tx.update` on whatever slice of the tree they hold.
"""

import jax
import jax.numpy as jnp
import optax

# Leaves that get weight decay: matrices and the embedding; never norm scales or biases.
_DECAYED_LEAVES = ('kernel', 'embedding')


def lr_schedule(train) -> optax.Schedule:
  """Linear warmup 0 -> lr over warmup_steps, then cosine decay to lr * min_lr_ratio at `steps`."""
  warmup = min(train.warmup_steps, train.steps - 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.lr, warmup_steps=warmup,
      decay_steps=max(train.steps, warmup + 1), end_value=train.lr * train.min_lr_ratio)


def weight_decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in _DECAYED_LEAVES, params)


def make_optimizer(train) -> optax.GradientTransformation:
  """AdamW without clipping (see module docstring). All state is float32 like the params.

  `train` is the `config.train` section (any object with its attributes: lr, b1, b2, ...).
  """
  return optax.adamw(lr_schedule(train), b1=train.b1, b2=train.b2, eps=train.eps,
                     weight_decay=train.weight_decay, mask=weight_decay_mask)


def sum_of_squares(tree) -> jax.Array:
  """Sum of squares of every leaf, accumulated in float32 (engines that hold the gradient in
  pieces add these up, then take the root)."""
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def global_norm(tree) -> jax.Array:
  """sqrt(sum of squares of every leaf), accumulated in float32."""
  return jnp.sqrt(sum_of_squares(tree))


def clip_scale(norm, max_norm: float):
  """Factor applied to every gradient: 1 if norm <= max_norm (or clipping is off), else max/norm."""
  if not max_norm:
    return jnp.ones((), jnp.float32)
  return jnp.where(norm <= max_norm, 1.0, max_norm / norm).astype(jnp.float32)


def clip_by_global_norm(grads, max_norm: float):
  """Returns (clipped grads, pre-clip global norm). max_norm = 0 turns clipping off."""
  norm = global_norm(grads)
  scale = clip_scale(norm, max_norm)
  return jax.tree.map(lambda g: g * scale, grads), norm
