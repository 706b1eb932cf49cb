"""The resident engine: params, gradients and optimizer state all live in device memory.

This is the fast path for models that fit, and the reference every streamed engine must match.
One optimizer step = gradient accumulation over M microbatches (a `lax.scan`), exact global-norm
clipping, then the AdamW update, all in one jitted function over the plain state pytree:

    state = {'step': int32[], 'params': <model params>, 'opt_state': <optax AdamW state>,
             'rng': uint32[2]}   # rng: reserved for stochastic layers; carried and checkpointed

On N devices (a `Layout` over them) every leaf of the state is split over the devices by the
layout's `leaf_spec` (ZeRO-3 / FSDP: each device keeps 1/N of the weights, gradients and Adam
moments) and the batch [M, B, S+1] along B. The step is jitted with those in/out shardings, and
XLA's SPMD partitioner (GSPMD) adds the collectives: all-gathers of the weights where a
computation needs them whole, and reduce-scatters that turn each device's gradient of its B/N
sequences into its shard of the gradient of the whole batch.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import faults
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax.engine.functions import step_inputs
from megatrain_jax.layout import Layout, place
from megatrain_jax.model import ModelConfig


def init_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int) -> dict:
  """Fresh train state. Param init depends only on `seed` (see model.init_params)."""
  init_key, rng = model_lib.run_keys(seed)
  params = model_lib.init_params(model_cfg, init_key)
  return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params),
          'rng': jax.random.key_data(rng)}


def abstract_state(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed: int = 0):
  """ShapeDtypeStructs of the train state, without allocating it."""
  return jax.eval_shape(functools.partial(init_state, model_cfg, tx), seed)


def accumulate_gradients(loss_and_grad, params, batch, weights=None, constrain=lambda t: t,
                         starts=None):
  """Mean loss and gradient over the microbatches of `batch` [M, B, S+1].

  Gradients are summed in float32 over microbatches (a scan, so one microbatch's activations
  are live at a time) and divided by M: for equal-sized microbatches this is the gradient of the
  mean loss over the whole M*B batch. With `weights` [M, B, S] (model.token_weights of a loss
  mask, normalised over the whole step) each microbatch's loss is Σ w·nll and the same mean is
  the whole step's masked mean. `constrain`: holds the gradient sum to the state's sharding
  (Layout.constrain) so that on N devices each keeps 1/N of it through the scan. `starts`
  [M, B, S+1]: where documents begin (data.Batch.starts).
  """
  num_micro = batch.shape[0]
  given = (batch, weights, starts)
  while given[-1] is None:  # loss_and_grad(params, batch[, weights[, starts]]): no trailing Nones
    given = given[:-1]
  if num_micro == 1:
    return loss_and_grad(params, *(None if a is None else a[0] for a in given))

  def add_microbatch(carry, microbatch):
    loss_sum, grad_sum = carry
    loss, grads = loss_and_grad(params, *microbatch)
    return (loss_sum + loss, constrain(jax.tree.map(jnp.add, grad_sum, grads))), None

  zeros = constrain(jax.tree.map(jnp.zeros_like, params))
  xs = given
  (loss_sum, grad_sum), _ = jax.lax.scan(add_microbatch, (jnp.zeros((), jnp.float32), zeros), xs)
  return loss_sum / num_micro, jax.tree.map(lambda g: g / num_micro, grad_sum)


# Cached, as engine/functions.stage_functions is: engines of the same model, optimizer and layout
# share one jitted step and its traces.
@functools.lru_cache(maxsize=8)
def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, grad_clip: float,
                    schedule: optax.Schedule, layout: Layout | None = None):
  """Returns jitted `step(state, batch[M, B, S+1] int32, weights[M, B, S] float32 or None,
  starts[M, B, S+1] or None) -> (state, metrics)`; donates `state`. `weights`, `starts`:
  engine/functions.step_inputs of a masked batch.
  With `layout`, the state goes in and comes out with its per-leaf shardings, the batch split
  along B, the metrics whole on every device."""
  several = layout is not None and layout.num_devices > 1
  loss_and_grad = jax.value_and_grad(functools.partial(
      model_lib.loss_fn, model_cfg, shard_layer=layout.shard_layer if several else None))
  constrain = layout.constrain if layout is not None else (lambda t: t)

  def train_step(state, batch, weights=None, starts=None):
    params = state['params']
    loss, grads = accumulate_gradients(loss_and_grad, params, batch, weights, constrain, starts)
    grads, grad_norm = optim.clip_by_global_norm(grads, grad_clip)
    updates, opt_state = tx.update(grads, state['opt_state'], params)
    new_state = {'step': state['step'] + 1, 'params': optax.apply_updates(params, updates),
                 'opt_state': opt_state, 'rng': state['rng']}
    metrics = {'learning/loss': loss, 'learning/grad_norm': grad_norm,
               'learning/lr': schedule(state['step'])}
    return new_state, metrics

  if layout is None:
    return jax.jit(train_step, donate_argnums=0)
  state = layout.shardings(abstract_state(model_cfg, tx))
  batch = layout.split_along(1)  # tokens, starts [M, B, S+1], weights [M, B, S]: along B
  return jax.jit(train_step, donate_argnums=0, in_shardings=(state, batch, batch, batch),
                 out_shardings=(state, layout.replicated()))


@functools.lru_cache(maxsize=8)
def make_eval_step(model_cfg: ModelConfig, layout: Layout | None = None):
  """Returns jitted `eval_step(params, batch[B, S+1], weights[B, S] or None, starts[B, S+1] or
  None) -> mean loss`; with `layout`, params in their per-leaf shardings and the batch split
  along B."""
  loss = functools.partial(model_lib.loss_fn, model_cfg)
  if layout is None:
    return jax.jit(loss)
  abstract_params = model_lib.abstract_params(model_cfg)
  batch = layout.split_along(0)  # tokens, starts [B, S+1], weights [B, S]
  return jax.jit(loss, in_shardings=(layout.shardings(abstract_params), batch, batch, batch),
                 out_shardings=layout.replicated())


class ResidentEngine:
  """The resident step behind the engine interface the training loop uses (shared with
  engine/streamed.py): `train_step(batch)`, `eval_losses(batches)`, `export_state()`, `step`."""

  def __init__(self, model_cfg: ModelConfig, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_clip: float, state: dict | None = None,
               seed: int = 0, layout: Layout | None = None):
    """`state`: a full train state (host or device arrays), placed on the layout's devices;
    None: a fresh one from `seed`, initialised straight into its shards."""
    self.layout = layout or Layout.single_device()
    shardings = self.layout.shardings(abstract_state(model_cfg, tx, seed))
    if state is None:
      state = jax.jit(init_state, static_argnums=(0, 1), out_shardings=shardings)(
          model_cfg, tx, seed)
    self.state = jax.tree.map(place, state, shardings)  # a no-op for leaves already in place
    self.step = int(self.state['step'])
    self._train_step = make_train_step(model_cfg, tx, grad_clip, schedule, self.layout)
    self._eval_step = make_eval_step(model_cfg, self.layout)

  def train_step(self, batch) -> dict:
    """One step on `batch`: int32 [M, B, S+1], or a data.Batch with its loss mask."""
    tokens, weights, starts = step_inputs(batch)
    faults.point('forward')
    put = self.layout.put_batch
    self.state, metrics = self._train_step(self.state, put(tokens), put(weights), put(starts))
    faults.point('backward')  # the step is in flight: old state donated, new one not yet ready
    self.step += 1
    return metrics

  def eval_losses(self, batches) -> list[float]:
    """Loss of each batch ([B, S+1], or a data.Batch: the mean over its learned targets, 0 if
    none)."""
    out = []
    for batch in batches:
      tokens, weights, starts = step_inputs(batch)
      put = self.layout.put_batch
      out.append(float(self._eval_step(self.state['params'], put(tokens), put(weights),
                                       put(starts))))
    return out

  def export_state(self) -> dict:
    return self.state

  def close(self) -> None:
    """Nothing to release: the state is ordinary device arrays."""
