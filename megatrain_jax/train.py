"""`train_and_evaluate(config, workdir)`: the one entry point of a training run; and `dry_run`.

Order of work (each failure is reported before the next stage allocates or writes anything):
  1. validate the config, the data paths and the workdir;
  2. prepare the token files (cached in <workdir>/data), open the sampler and eval batches;
  3. build the optimizer, then restore the newest checkpoint in <workdir>/checkpoints or
     initialise a fresh state;
  4. loop: batch -> step -> (log, eval, checkpoint) until `train.steps`.

The data sampler is stateless given its position, and the position is saved with each checkpoint,
so a resumed run replays exactly the batches the uninterrupted run would have seen.
"""

import dataclasses
import json
import math
import os
import pathlib
import time

import jax
import ml_collections
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import data as data_lib
from megatrain_jax import metrics as metrics_lib
from megatrain_jax import model as model_lib
from megatrain_jax import hardware
from megatrain_jax import optim
from megatrain_jax import planner
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError, TrainingDivergedError
from megatrain_jax.placement import Placement
from megatrain_jax.tiers import nvme


def enable_compilation_cache(cache_dir: str) -> None:
  """Persistent XLA compile cache: a re-run skips most compile time."""
  if cache_dir:
    jax.config.update('jax_compilation_cache_dir', os.path.expanduser(cache_dir))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)


def state_bytes(model_cfg: model_lib.ModelConfig) -> dict:
  """Bytes of the FP32 train state by part, from shapes alone (nothing is allocated)."""
  params = model_lib.abstract_params(model_cfg)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  per_part = 4 * n  # float32 params; grads, Adam m and v have the same shapes
  return {'params': n, 'params_bytes': per_part, 'grads_bytes': per_part,
          'adam_m_bytes': per_part, 'adam_v_bytes': per_part, 'total_bytes': 4 * per_part}


def dry_run(config: ml_collections.ConfigDict, workdir: str | None = None) -> dict:
  """Validates `config`, prints its size, memory plan and predicted step time; allocates nothing.

  The last line is `predicted_step_time_s: X` (for scripts)."""
  model_cfg = config_lib.validate(config)
  Placement.from_config(config.offload, model_cfg, allow_auto=True)
  sizes = state_bytes(model_cfg)
  gib = 1024 ** 3
  print(f'params: {sizes["params"]}')
  for part in ('params', 'grads', 'adam_m', 'adam_v'):
    print(f'{part + "_bytes:":<16}{sizes[part + "_bytes"]:>20,d}  ({sizes[part + "_bytes"] / gib:,.1f} GiB)')
  print(f'{"state_bytes:":<16}{sizes["total_bytes"]:>20,d}  ({sizes["total_bytes"] / gib:,.1f} GiB, '
        'FP32 params + grads + Adam m, v)')
  try:
    hw, plan = make_plan(config, pathlib.Path(workdir) if workdir else None, dry_run=True)
  except planner.NoPlacementFits as refused:  # show where the bytes would have to go, then refuse
    print('\nno placement fits; the closest:')
    print(planner.format_plan(refused.closest, hardware.load_profile(config.hardware)))
    raise
  print()
  print(planner.format_plan(plan, hw))
  return {**sizes, 'plan': plan}


def calibrate(config: ml_collections.ConfigDict, workdir: str, out: str = '') -> pathlib.Path:
  """Measures this machine, saves its hardware profile (default: hardware.PROFILE_CACHE)."""
  enable_compilation_cache(config.jax_cache_dir)
  probe_dir = config.offload.dir or str(pathlib.Path(workdir) / 'offload')
  print(f'calibrating {jax.devices()[0].device_kind} (disk probe in {probe_dir}) ...')
  profile = hardware.calibrate(probe_dir)
  path = hardware.save_profile(profile, pathlib.Path(out) if out else hardware.PROFILE_CACHE)
  print(f'{profile.source}; saved {path}')
  return path


def _disk_free_gb(offload_dir: str, hw: hardware.HardwareProfile, dry_run: bool) -> float:
  """Disk the NVMe tier may use: a profile that states it (a preset) is believed for a dry run;
  a real run never plans for more than offload.dir's filesystem has free."""
  existing = nvme.nearest_existing(pathlib.Path(offload_dir).expanduser().absolute())
  if not dry_run and not os.access(existing, os.W_OK | os.X_OK):
    return 0.0  # nothing can be stored there
  free = hardware.free_disk_gb(offload_dir)
  if hw.disk_gb and dry_run:
    return hw.disk_gb
  return min(free, hw.disk_gb) if hw.disk_gb else free


def _check_offload_dir(config, model_cfg, workdir: pathlib.Path, placement) -> None:
  """offload.dir is writable and holds the NVMe stores plus what kept checkpoints pin."""
  layer_bytes = 4 * model_cfg.num_layers * model_cfg.params_per_layer
  offload_dir = placement.dir or str(workdir / 'offload')
  nvme.check_offload_dir(offload_dir, nvme.nvme_bytes(layer_bytes, placement.params,
                                                      placement.opt_state),
                         checkpoint_dir=workdir / 'checkpoints',
                         keep=config.checkpoint.keep if config.checkpoint.every >= 0 else 0)


def make_plan(config, workdir: pathlib.Path | None, dry_run: bool):
  """(hardware profile, plan): `auto` fields resolved; refuses configs that fit nowhere."""
  hw = hardware.load_profile(config.hardware)
  offload_dir = config.offload.dir or str((workdir or pathlib.Path('runs/default')) / 'offload')
  plan = planner.plan_run(config, hw, disk_free_gb=_disk_free_gb(offload_dir, hw, dry_run))
  if 'nvme' in (plan.placement.params, plan.placement.opt_state):
    plan.placement = dataclasses.replace(plan.placement, dir=offload_dir)
  return hw, plan


def describe(placement: Placement, model_cfg) -> str:
  if not placement.streamed:
    return 'resident engine (all state in device memory)'
  groups = len(placement.group_slices(model_cfg.num_layers))
  return (f'streamed engine: params on {placement.params}, Adam state on {placement.opt_state}, '
          f'activations on {placement.activations}, embedding/head on {placement.embed_head}, '
          f'{groups} groups of {placement.layers_per_group} layers, prefetch depth '
          f'{placement.prefetch_depth}, optimizer on {placement.optimizer_on}')


def _write_json_atomic(path: pathlib.Path, obj) -> None:
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
  os.replace(tmp, path)


def make_engine(model_cfg, tx, schedule, train_cfg, placement: Placement, state=None,
                restore_from=None):
  """The resident engine when everything stays on the device, else the streamed engine; filled
  from `state`, a checkpoint (`restore_from`, a CheckpointReader) or a fresh init."""
  if placement.streamed:
    return StreamedEngine(model_cfg, tx, schedule, train_cfg.grad_clip, placement, state,
                          seed=train_cfg.seed, restore_from=restore_from)
  if restore_from is not None:
    state = jax.device_put(restore_from.full_state(resident.abstract_state(model_cfg, tx)),
                           jax.devices()[0])
  return resident.ResidentEngine(model_cfg, tx, schedule, train_cfg.grad_clip, state,
                                 seed=train_cfg.seed)


def _evaluate(engine, batches) -> dict:
  loss = float(np.mean(engine.eval_losses(batches)))
  return {'eval/loss': loss, 'eval/perplexity': math.exp(min(loss, 80.0))}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) the run in `workdir` to `config.train.steps`; returns the last metrics."""
  # 1. Validate everything before any allocation or write.
  model_cfg = config_lib.validate(config)
  requested = Placement.from_config(config.offload, model_cfg, allow_auto=True)
  data_lib.check_data_config(config.data, config.train)
  workdir = config_lib.check_workdir(workdir)
  if 'nvme' in (requested.params, requested.opt_state):
    _check_offload_dir(config, model_cfg, workdir, requested)  # named tiers: say what's wrong
  hw, plan = make_plan(config, workdir, dry_run=False)
  placement, microbatches = plan.placement, plan.microbatches
  if 'nvme' in (placement.params, placement.opt_state):
    _check_offload_dir(config, model_cfg, workdir, placement)
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer)  # reads tokenizer.json, writes nothing
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ConfigError(f'model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer '
                      f'({tokenizer.name}: {tokenizer.vocab_size} ids). Raise model.vocab_size or '
                      'change data.tokenizer.')
  enable_compilation_cache(config.jax_cache_dir)

  # 2. The newest intact checkpoint (damaged ones are skipped with a warning). The live NVMe
  # stores are always rebuilt from it, never reused: a run killed mid-step may have written some
  # layers of the next step, and resume must not see a mix of steps.
  workdir.mkdir(parents=True, exist_ok=True)
  checkpointer = Checkpointer(workdir, keep=config.checkpoint.keep)
  restored = checkpointer.restore(model_cfg)
  recorded = restored.meta.get('microbatches') if restored is not None else None
  if config.train.microbatches == 0 and recorded and recorded != microbatches:
    # `auto` chooses M once, when the run starts: a resumed run keeps its tokens per step even if
    # the machine's free memory or disk has changed since.
    config = ml_collections.ConfigDict(config.to_dict())  # a copy: the caller's config is theirs
    config_lib.set_field(config, 'train.microbatches', int(recorded))
    hw, plan = make_plan(config, workdir, dry_run=False)
    placement, microbatches = plan.placement, plan.microbatches
    if 'nvme' in (placement.params, placement.opt_state):
      _check_offload_dir(config, model_cfg, workdir, placement)
  train_cfg = config.train

  # 3. Data.
  info, _ = data_lib.load_data(config.data, workdir)
  sampler = data_lib.BatchSampler(
      data_lib.load_split(info, 'train'), seq_len=train_cfg.seq_len,
      batch_size=train_cfg.batch_size, microbatches=microbatches, seed=train_cfg.seed)
  eval_data = data_lib.eval_batches(
      data_lib.load_split(info, 'val'), seq_len=train_cfg.seq_len,
      batch_size=train_cfg.batch_size, num_batches=train_cfg.eval_batches)

  # 4. State: from the checkpoint, or fresh, in the engine the placement picks.
  tx = optim.make_optimizer(train_cfg)
  schedule = optim.lr_schedule(train_cfg)
  position = restored.meta['data_position'] if restored is not None else 0
  engine = make_engine(model_cfg, tx, schedule, train_cfg, placement, restore_from=restored)
  del restored
  start_step = engine.step
  _write_json_atomic(workdir / 'config.json', json.loads(config.to_json_best_effort()))

  tokens_per_step = sampler.samples_per_step * train_cfg.seq_len
  flops_per_step = model_cfg.flops_per_token(train_cfg.seq_len) * tokens_per_step
  peak = hw.peak(model_cfg.dtype, model_cfg.matmul_precision, model_cfg.d_model)

  # 5. The loop.
  last = {}
  try:
    with metrics_lib.MetricsWriter(workdir, total_steps=train_cfg.steps, start_step=start_step,
                                   progress_bar=train_cfg.progress_bar) as writer:
      if start_step:
        writer.print(f'resumed from {checkpointer.directory / str(start_step)} '
                     f'(step {start_step}, data position {position})')
      writer.print(f'model: {model_cfg.num_params:,} params, {tokens_per_step:,} tokens/step, '
                   f'on {jax.devices()[0].device_kind}, {describe(placement, model_cfg)}')
      writer.print(f'plan ({hw.name}): predicted {plan.step_time_s:.3g} s/step, '
                   f'{plan.tokens_per_s:,.0f} tokens/s, bottleneck {plan.bottleneck}; '
                   f'device {plan.used("device") / 1e9:,.2f} GB, host {plan.used("host") / 1e9:,.2f}'
                   f' GB, nvme {plan.used("nvme") / 1e9:,.2f} GB (`--dry_run` prints the table)')
      if start_step == 0:  # the baseline every later eval is compared with
        writer.write(0, _evaluate(engine, eval_data))
      timed_steps, timed_seconds = 0, 0.0
      for step in range(start_step, train_cfg.steps):
        batch = sampler.batch(position)
        started = time.perf_counter()
        step_metrics = engine.train_step(batch)
        loss = float(step_metrics['learning/loss'])  # waits for the step
        elapsed = time.perf_counter() - started
        position += sampler.samples_per_step
        done = step + 1
        if not math.isfinite(loss):
          newest = checkpointer.latest_step()
          where = (f'The newest checkpoint is step {newest} in {checkpointer.directory}; a rerun '
                   'resumes from it.' if newest is not None else 'No checkpoint was written yet.')
          raise TrainingDivergedError(
              f'loss is {loss} at step {done}: training diverged. {where} Lower train.lr, lengthen '
              'train.warmup_steps or set train.grad_clip (e.g. 1.0).')
        if step > start_step:  # the first step of a process includes compilation
          timed_steps, timed_seconds = timed_steps + 1, timed_seconds + elapsed
        writer.advance(1, loss)

        scalars = {}
        if done % train_cfg.log_every == 0 or done == train_cfg.steps:
          step_time = timed_seconds / timed_steps if timed_steps else elapsed
          scalars = {k: float(v) for k, v in step_metrics.items()}
          scalars.update({'perf/step_time_s': step_time,
                          'perf/tokens_per_sec': tokens_per_step / step_time,
                          'perf/tflops': flops_per_step / step_time / 1e12})
          scalars['perf/mfu'] = flops_per_step / step_time / 1e12 / peak
          scalars['perf/predicted_step_time_s'] = plan.step_time_s
          timed_steps, timed_seconds = 0, 0.0
        if (train_cfg.eval_every and done % train_cfg.eval_every == 0) or done == train_cfg.steps:
          scalars.update(_evaluate(engine, eval_data))
        if scalars:
          writer.write(done, scalars)
          last = {'step': done, **scalars}
        every = config.checkpoint.every
        if every >= 0 and ((every and done % every == 0) or done == train_cfg.steps):
          checkpointer.save(done, engine, data_position=position, model_cfg=model_cfg,
                            seed=train_cfg.seed, placement=placement, microbatches=microbatches)
  finally:
    try:
      engine.close()  # waits for write-behind, stops I/O threads
    finally:
      checkpointer.close()  # commits the checkpoint in flight, even when the loop failed
  return last
