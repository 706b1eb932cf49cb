"""The resident engine: params, gradients and optimizer state all live in device memory.

This is the fast path for models that fit, and the reference every streamed engine must match.
One optimizer step = gradient accumulation over M microbatches (a `lax.scan`), exact global-norm
clipping, then the AdamW update, all in one jitted function over the plain state pytree:

    state = {'step': int32[], 'params': <model params>, 'opt_state': <optax AdamW state>,
             'rng': uint32[2]}   # rng: reserved for stochastic layers; carried and checkpointed
"""

import functools

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import faults
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.engine.functions import step_inputs
from megatrain_jax.model import ModelConfig


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> dict:
  """Fresh train state. Param init depends only on `seed` (see model.init_params)."""
  init_key, rng = jax.random.split(jax.random.key(seed))
  params = model_lib.init_params(model_cfg, init_key)
  return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params),
          'rng': jax.random.key_data(rng)}


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int = 0):
  """ShapeDtypeStructs of the train state, without allocating it."""
  return jax.eval_shape(functools.partial(init_state, model_cfg, tx), seed)


def accumulate_gradients(loss_and_grad, params, batch, weights=None):
  """Mean loss and gradient over the microbatches of `batch` [M, B, S+1].

  Gradients are summed in float32 over microbatches (a scan, so one microbatch's activations
  are live at a time) and divided by M: for equal-sized microbatches this is the gradient of the
  mean loss over the whole M*B batch. With `weights` [M, B, S] (model.token_weights of a loss
  mask, normalised over the whole step) each microbatch's loss is Σ w·nll and the same mean is
  the whole step's masked mean.
  """
  num_micro = batch.shape[0]
  if num_micro == 1:
    if weights is None:
      return loss_and_grad(params, batch[0])
    return loss_and_grad(params, batch[0], weights[0])

  def add_microbatch(carry, microbatch):
    loss_sum, grad_sum = carry
    loss, grads = loss_and_grad(params, *microbatch)
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  xs = (batch,) if weights is None else (batch, weights)
  (loss_sum, grad_sum), _ = jax.lax.scan(add_microbatch, (jnp.zeros((), jnp.float32), zeros), xs)
  return loss_sum / num_micro, jax.tree.map(lambda g: g / num_micro, grad_sum)


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, grad_clip: float,
                    schedule: optax.Schedule):
  """Returns jitted `step(state, batch[M, B, S+1] int32, weights[M, B, S] float32 or None) ->
  (state, metrics)`; donates `state`. `weights`: engine/functions.step_inputs of a masked batch."""
  loss_and_grad = jax.value_and_grad(functools.partial(model_lib.loss_fn, model_cfg))

  def train_step(state, batch, weights=None):
    params = state['params']
    loss, grads = accumulate_gradients(loss_and_grad, params, batch, weights)
    grads, grad_norm = optim.clip_by_global_norm(grads, grad_clip)
    updates, opt_state = tx.update(grads, state['opt_state'], params)
    new_state = {'step': state['step'] + 1, 'params': optax.apply_updates(params, updates),
                 'opt_state': opt_state, 'rng': state['rng']}
    metrics = {'learning/loss': loss, 'learning/grad_norm': grad_norm,
               'learning/lr': schedule(state['step'])}
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(model_cfg: ModelConfig):
  """Returns jitted `eval_step(params, batch[B, S+1], weights[B, S] or None) -> mean loss`."""
  return jax.jit(functools.partial(model_lib.loss_fn, model_cfg))


class ResidentEngine:
  """The resident step behind the engine interface the training loop uses (shared with
  engine/streamed.py): `train_step(batch)`, `eval_losses(batches)`, `export_state()`, `step`."""

  def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_clip: float, state: dict | None = None,
               seed: int = 0):
    if state is None:
      state = jax.jit(init_state, static_argnums=(0, 1))(model_cfg, tx, seed)
    self.state = state
    self.step = int(state['step'])
    self._train_step = make_train_step(model_cfg, tx, grad_clip, schedule)
    self._eval_step = make_eval_step(model_cfg)

  def train_step(self, batch) -> dict:
    """One step on `batch`: int32 [M, B, S+1], or a data.Batch with its loss mask."""
    tokens, weights = step_inputs(batch)
    faults.point('forward')
    self.state, metrics = self._train_step(self.state, jnp.asarray(tokens),
                                           None if weights is None else jnp.asarray(weights))
    faults.point('backward')  # the step is in flight: old state donated, new one not yet ready
    self.step += 1
    return metrics

  def eval_losses(self, batches) -> list[float]:
    """Loss of each batch ([B, S+1], or a data.Batch: the mean over its learned targets, 0 if
    none)."""
    out = []
    for batch in batches:
      tokens, weights = step_inputs(batch)
      out.append(float(self._eval_step(self.state['params'], jnp.asarray(tokens),
                                       None if weights is None else jnp.asarray(weights))))
    return out

  def export_state(self) -> dict:
    return self.state

  def close(self) -> None:
    """Nothing to release: the state is ordinary device arrays."""
