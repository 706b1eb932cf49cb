"""The optimizer, shared by every engine: AdamW (FP32) with warmup + cosine, linear or constant
learning rate, and exact clipping.

Clipping is not part of the optax chain: the global gradient norm needs *every* gradient, which a
streaming engine only has after the whole backward pass, while AdamW itself is elementwise and can
run group by group. So engines call `clip_by_global_norm` themselves (one formula for all of them,
hence identical numbers), then `tx.update` on whatever slice of the tree they hold.
"""

import functools
import inspect
import math
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import compute_on as compute_on_lib

from megatrain_jax import runtime

# Leaves that get weight decay: matrices and the embedding; never norm scales or biases.
_DECAYED_LEAVES = ('kernel', 'embedding')


def warmup_steps(train) -> int:
  """train.warmup_ratio of train.steps (rounded up, as Hugging Face's Trainer counts it:
  `math.ceil(steps * ratio)`, so 70 steps at 0.03 warm up for 3) when set, else
  train.warmup_steps; at most steps - 1, so that the run reaches its peak learning rate."""
  ratio = getattr(train, 'warmup_ratio', 0.0)
  warmup = math.ceil(train.steps * ratio) if ratio else train.warmup_steps
  return min(warmup, train.steps - 1)


def warmup_note(train) -> str | None:
  """A note for a run of 2 or more steps that ends inside its warmup (train.warmup_steps not
  below train.steps, as a short run keeping the default warmup has): its learning rate only
  rises and the last step runs at the peak, which is rarely what a short fine-tune wants. None
  otherwise."""
  if getattr(train, 'warmup_ratio', 0.0) or train.warmup_steps < train.steps or train.steps < 2:
    return None
  return (f'note: train.warmup_steps={train.warmup_steps} is not below train.steps='
          f'{train.steps}: the learning rate rises for {warmup_steps(train)} steps and the run '
          f'ends at its peak, {train.lr:g}, with no decay. Lower train.warmup_steps or set '
          'train.warmup_ratio (e.g. 0.03).')


# train.lr_schedule: what follows the linear warmup.
LR_SCHEDULES = ('cosine', 'linear', 'constant')


def lr_schedule(train) -> optax.Schedule:
  """Linear warmup 0 -> lr over `warmup_steps(train)`, then by `train.lr_schedule` ('cosine'
  when the object has none): cosine or linear decay to lr * min_lr_ratio at `steps`, or lr
  held. One function per set of values (see make_optimizer)."""
  return _schedule(getattr(train, 'lr_schedule', 'cosine'), float(train.lr), warmup_steps(train),
                   int(train.steps), float(getattr(train, 'min_lr_ratio', 0.0)))


@functools.lru_cache(maxsize=64)
def _schedule(kind: str, lr: float, warmup: int, steps: int,
              min_lr_ratio: float) -> optax.Schedule:
  if kind == 'cosine':
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
        end_value=lr * min_lr_ratio)
  if kind == 'constant':
    after = optax.constant_schedule(lr)
  else:  # 'linear' (config.validate refuses other names)
    after = optax.linear_schedule(lr, lr * min_lr_ratio, max(steps - warmup, 1))
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def weight_decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in _DECAYED_LEAVES, params)


def make_optimizer(train) -> optax.GradientTransformation:
  """AdamW without clipping (see module docstring). All state is float32 like the params.

  `train` is the `config.train` section (any object with its attributes: lr, b1, b2, ...). The
  hyperparameters are remembered against the returned transformation, so `apply_adamw` can run
  the same update as one pass over each leaf. The same hyperparameters give the same
  transformation object: engines key their jitted functions on it
  (engine/functions.stage_functions), so a second engine of a run reuses the first one's traces.
  """
  return _adamw(lr_schedule(train), float(train.b1), float(train.b2), float(train.eps),
                float(train.weight_decay))


@functools.lru_cache(maxsize=64)
def _adamw(schedule, b1: float, b2: float, eps: float,
           weight_decay: float) -> optax.GradientTransformation:
  tx = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                   mask=weight_decay_mask)
  _HYPERPARAMS[tx.update] = AdamWHyperparams(schedule, b1, b2, eps, weight_decay)
  return tx


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


class AdamWHyperparams(NamedTuple):
  schedule: optax.Schedule
  b1: float
  b2: float
  eps: float
  weight_decay: float


# make_optimizer's transformations (keyed by their update function; gone with it) -> hyperparams.
_HYPERPARAMS = weakref.WeakKeyDictionary()


def initial_state_is_zero(tx: optax.GradientTransformation) -> bool:
  """Whether `tx.init` gives all zeros (step counts, m and v): a `make_optimizer` AdamW. What a
  store may register instead of writing (tiers/nvme.py); other transformations are not assumed."""
  return tx.update in _HYPERPARAMS


def on_host(fn):
  """`fn` run on the host CPU, its outputs in host memory (jax.experimental.compute_on).

  jax 0.10 has a context manager (also a decorator) that takes the compute type positionally;
  0.11.2 (the lent GPU machines' image) has only a decorator, with keyword-only `compute_type`
  and a required `out_memory_spaces` (one value for every output here)."""
  parameters = inspect.signature(compute_on_lib.compute_on).parameters
  if 'compute_type' not in parameters:
    return compute_on_lib.compute_on('device_host')(fn)
  kwargs = {'compute_type': 'device_host'}
  if 'out_memory_spaces' in parameters:
    kwargs['out_memory_spaces'] = jax.memory.Space.Host
  return compute_on_lib.compute_on(**kwargs)(fn)


def host_adamw(tx: optax.GradientTransformation, grads, opt_state, params, num_micro: int = 1,
               scale=None):
  """`apply_adamw` on the host (`on_host`), of trees in pinned host memory: what the engines'
  host optimizer runs (engine/functions.StageFunctions.host_update) and --calibrate times,
  jitted with pinned-host out_shardings."""
  update = lambda g, s, p, c: apply_adamw(tx, g, s, p, num_micro, c)
  return on_host(update)(grads, opt_state, params, scale)


def apply_adamw(tx: optax.GradientTransformation, grads, opt_state, params, num_micro: int = 1,
                scale=None):
  """(new params, new opt_state): `tx.update` + `optax.apply_updates` of the gradient
  grads / num_micro * scale (each step only where given, as engine/functions.adamw_update does),
  to the same numbers; but for a `make_optimizer` transformation computed leaf by leaf as one
  elementwise expression per output (`_adamw_leaf`), so XLA:CPU reads p, g, m, v once and writes
  p, m, v once where it fuses the three outputs into one loop (runtime.multi_output_fusion;
  bench/host_adamw.py). Any other `tx` takes the optax path."""
  hp = _HYPERPARAMS.get(tx.update)
  if hp is None:
    grads = jax.tree.map(lambda g: _scaled(g, num_micro, scale), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  adam, masked, sched = opt_state  # optax.adamw's chain: scale_by_adam, masked decay, schedule
  count = optax.safe_increment(adam.count)
  # Scalars exactly as optax computes them (bias corrections at the incremented count, the
  # learning rate at the schedule's own count), outside the elementwise loop.
  bc1 = (1 - hp.b1 ** count).astype(jnp.float32)
  bc2 = (1 - hp.b2 ** count).astype(jnp.float32)
  neg_lr = jnp.asarray(-hp.schedule(sched.count), jnp.float32)
  decay = weight_decay_mask(params)
  leaf = functools.partial(_adamw_leaf, hp, bc1, bc2, neg_lr, num_micro, scale)
  out = jax.tree.map(leaf, params, grads, adam.mu, adam.nu, decay)
  is_out = lambda x: isinstance(x, tuple) and len(x) == 3 and not isinstance(x, dict)
  pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=is_out)
  new_state = (adam._replace(count=count, mu=pick(1), nu=pick(2)), masked,
               sched._replace(count=optax.safe_increment(sched.count)))
  return pick(0), new_state


def _scaled(g, num_micro: int, scale, sign=None):
  """g / num_micro * scale; `sign` rewrites g and scale (g -> -g with scale, or |g| with |scale|)
  without changing the product's bits, so the three expressions of a leaf share no intermediate."""
  if sign == 'neg':
    g = -g
  elif sign == 'abs':
    g, scale = jnp.abs(g), None if scale is None else jnp.abs(scale)
  g = g / num_micro if num_micro > 1 else g
  return g if scale is None else g * scale


def _adamw_leaf(hp, bc1, bc2, neg_lr, num_micro, scale, p, g, m, v, decayed: bool):
  """One leaf of AdamW: (p, m, v) new, each the expression optax evaluates, rounding included
  (G = g / num_micro * scale):
    m' = (1 - b1) G + b1 m;  v' = (1 - b2) G^2 + b2 v
    p' = p + (-lr) (m' / bc1 / (sqrt(v' / bc2) + eps) [+ wd p]).
  With multi-output fusion, v' and the update of p recompute what they need from g, m, v as
  differently written expressions with the same IEEE result ((-b1) m + (b1 - 1) G is exactly -m':
  products and sums round symmetrically; |g| |scale| is exactly |G|), so XLA shares no
  intermediate between them through a buffer: the outputs read only p, g, m, v, and XLA:CPU fuses
  them into one loop instead of a pass writing m', v' (and G) and another reading them back."""
  mof = runtime.multi_output_fusion()  # else one loop per output: recomputing would cost a read
  grad = _scaled(g, num_micro, scale)
  grad_abs = _scaled(g, num_micro, scale, 'abs') if mof else grad
  m_new = (1 - hp.b1) * grad + hp.b1 * m
  v_new = (1 - hp.b2) * (grad_abs * grad_abs) + hp.b2 * v
  m_again, v_again = m_new, v_new
  if mof:
    grad_neg = _scaled(g, num_micro, scale, 'neg')  # exactly -G
    m_again = -((-hp.b1) * m + (1 - hp.b1) * grad_neg)
    if scale is None and num_micro == 1:  # XLA would simplify (-g)(-g) to the g g of v'
      v_again = -((-hp.b2) * v + (1 - hp.b2) * (grad_neg * g))  # (-g) g is exactly -(g g)
    else:
      v_again = -((-hp.b2) * v + (hp.b2 - 1) * (grad_neg * grad_neg))
  update = (m_again / bc1) / (jnp.sqrt(v_again / bc2) + hp.eps)
  if decayed and hp.weight_decay:
    update = update + hp.weight_decay * p
  return p + neg_lr * update, m_new, v_new
