"""`train_and_evaluate(config, workdir)`: the one entry point of a training run; and `dry_run`.

Order of work (each failure is reported before the next stage allocates or writes anything):
  1. validate the config, the data paths, the workdir and the tokenizer;
  2. lock the workdir (locks.py: a second run is refused here, before anything is written);
  3. find the newest intact checkpoint in <workdir>/checkpoints, and plan: `auto` fields resolved
     (a resumed run keeps the microbatches it started with), offload.dir checked (`resolve_plan`),
     and locked when an NVMe tier uses it;
  4. prepare the token files (cached in <workdir>/data), open the sampler and eval batches;
  5. build the engine the placement picks, from the checkpoint or a fresh initialisation;
  6. loop: batch -> step -> (log, eval, checkpoint) until `train.steps`, or until SIGTERM/SIGINT
     (preemption.py): then the step in flight finishes, its checkpoint is committed, and
     TrainingStopped is raised.

The data sampler is stateless given its position, and the position is saved with each checkpoint,
so a resumed run replays exactly the batches the uninterrupted run would have seen.
"""

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import sys
import time
from typing import Iterable

import jax
import ml_collections
import numpy as np

from megatrain_jax import calibrate as calibrate_lib
from megatrain_jax import checkpoint as checkpoint_lib
from megatrain_jax import config as config_lib
from megatrain_jax import data as data_lib
from megatrain_jax import distributed
from megatrain_jax import evaluate as evaluate_lib
from megatrain_jax import export as export_lib
from megatrain_jax import fs
from megatrain_jax import hf
from megatrain_jax import metrics as metrics_lib
from megatrain_jax import model as model_lib
from megatrain_jax import hardware
from megatrain_jax import layout as layout_lib
from megatrain_jax import locks
from megatrain_jax import optim
from megatrain_jax import planner
from megatrain_jax import preemption
from megatrain_jax import profiling
from megatrain_jax import runs
from megatrain_jax import runtime
from megatrain_jax import sample as sample_lib
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
from megatrain_jax.layout import Layout
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


def _disk_full_is_an_error(job):
  """`job` (a command's entry point) with a disk that runs full outside the checkpoint and store
  writes (which name theirs): the metrics, the prepared data, a lock's holder line, an export, an
  eval.json. It ends with DiskFullError naming the file's directory and what to do, not a
  traceback (the metrics' close, failing too, keeps quiet: metrics.MetricsWriter.close)."""
  @functools.wraps(job)
  def wrapped(config, workdir, *args, **kwargs):
    try:
      return job(config, workdir, *args, **kwargs)
    except OSError as error:
      if not fs.is_disk_full(error):
        raise
      where = pathlib.Path(error.filename).parent if error.filename else workdir
      raise DiskFullError(
          f'the disk of {where} is full ({error.strerror or error}): free space there, or point '
          '--workdir (data.cache_dir, offload.dir) at a larger disk, then rerun the same command: '
          'a run resumes from its last checkpoint, --prepare after its last finished shard.'
      ) from error
  return wrapped


def dry_run(config: ml_collections.ConfigDict, workdir: str | None = None,
            overrides: Iterable[str] | None = None) -> dict:
  """Validates `config`, prints its size, memory plan and predicted step time; allocates nothing.
  With init.from_hf, the model is the checkpoint's (read from its config.json and headers).

  The last line is `predicted_step_time_s: X` (for scripts)."""
  if config.init.from_hf:
    config = hf.config_from_checkpoint(config, hf.inspect_checkpoint(config.init.from_hf),
                                       overrides)
  elif config.init.from_run:
    source = runs.run_source(config.init.from_run, pathlib.Path(workdir or '').absolute(),
                             config.checkpoint.read)
    config = runs.config_from_run(config, source.directory, source.meta, overrides)
  model_cfg = config_lib.validate(config)
  Placement.from_config(config.offload, model_cfg, allow_auto=True)
  distributed.check_fields(config)  # not the devices: a dry run may plan for another machine
  sizes = state_bytes(model_cfg)
  gib = 1024 ** 3
  print(f'params: {sizes["params"]}')
  for part in ('params', 'grads', 'adam_m', 'adam_v'):
    nbytes = sizes[part + '_bytes']
    print(f'{part + "_bytes:":<16}{nbytes:>20,d}  ({nbytes / gib:,.1f} GiB)')
  total = sizes['total_bytes']
  print(f'{"state_bytes:":<16}{total:>20,d}  ({total / gib:,.1f} GiB, '
        'FP32 params + grads + Adam m, v)')
  try:
    hw, plan = plan_for(config, pathlib.Path(workdir) if workdir else None, dry_run=True)
  except planner.NoPlacementFits as refused:  # show where the bytes would have to go, then refuse
    print('\nno placement fits; the closest:')
    print(planner.format_plan(refused.closest, hardware.load_profile(config.hardware)))
    raise
  print()
  print(planner.format_plan(plan, hw))
  return {**sizes, 'plan': plan}


@_disk_full_is_an_error
def prepare(config: ml_collections.ConfigDict, workdir: str,
            overrides: Iterable[str] | None = None) -> data_lib.DatasetInfo:
  """--prepare: tokenizes config.data into <workdir>/data as the run in `workdir` will read it,
  with the tokenizer it will use (init.from_hf's, init.from_run's or its checkpoint's unless
  data.tokenizer is set, copied into the workdir as training copies it); prints the summary."""
  config, source = runs.resolve_init(config, workdir, overrides)
  path = config_lib.check_run_workdir(workdir)
  data_lib.check_data_config(config.data, config.train)
  path.mkdir(parents=True, exist_ok=True)
  config = runs.adopt_chat_template(runs.adopt_tokenizer(config, source, path), path)
  info, _ = data_lib.load_data(  # locks the data directory
      config.data, path, progress=metrics_lib.bar_visible(config.train.progress_bar))
  print(data_lib.prepare_summary(info), flush=True)
  return info


@_disk_full_is_an_error
def calibrate(config: ml_collections.ConfigDict, workdir: str, out: str = '') -> pathlib.Path:
  """Measures this machine, saves its hardware profile (default: hardware.PROFILE_CACHE). Where
  the probe writes (offload.dir) and where the profile goes are checked first: the measurement
  takes a minute, and a profile that cannot be saved is printed instead of lost."""
  enable_compilation_cache(config.jax_cache_dir)
  probe_dir = config.offload.dir or str(pathlib.Path(workdir) / 'offload')
  fs.check_writable(probe_dir, f'--calibrate: the disk probe in {probe_dir}',
                    'Point offload.dir at the disk the NVMe tier will use.',
                    needed_bytes=calibrate_lib.DISK_PROBE_BYTES + (16 << 20), what='the disk probe')
  path = pathlib.Path(out or hardware.PROFILE_CACHE).expanduser()
  fs.check_writable(path.parent, f'--profile_out={path}',
                    'Pass --profile_out=<a file on a disk you can write to>.',
                    needed_bytes=1 << 20, what='the profile')
  print(f'calibrating {layout_lib.device_kind()} (disk probe in {probe_dir}) ...')
  profile = calibrate_lib.calibrate(probe_dir)
  try:
    hardware.save_profile(profile, path)
  except OSError as error:
    print(profile.to_json(), flush=True)  # the measurement, not lost: save it as a file by hand
    raise (DiskFullError if fs.is_disk_full(error) else ConfigError)(
        f'--calibrate: the profile could not be saved to {path} ({error.strerror or error}); '
        'it is printed above: save it as a file and pass --config.hardware=<that file>, or '
        'free space there and calibrate again.') from error
  print(f'{profile.source}; saved {path}')
  return path


def _disk_free_gb(offload_dir: str, hw: hardware.HardwareProfile, dry_run: bool,
                  checkpoint_dir: pathlib.Path | None, **snapshots) -> float:
  """Disk the NVMe tier may use: a profile that states it (a preset) is believed for a dry run;
  a real run never plans for more than offload.dir's filesystem has free, counting what the run
  in the workdir holds there already (its stores and checkpoints: a resume plans as it started,
  and the checkpoints beyond a lowered keep are freed first: `snapshots`, _run_snapshots)."""
  existing = fs.nearest_existing(pathlib.Path(offload_dir).expanduser().absolute())
  if not dry_run and not os.access(existing, os.W_OK | os.X_OK):
    return 0.0  # nothing can be stored there
  held = nvme.held_by_run(offload_dir, checkpoint_dir, **snapshots)
  free = hardware.free_disk_gb(offload_dir) + held / 1e9
  if hw.disk_gb and dry_run:
    return hw.disk_gb
  return min(free, hw.disk_gb) if hw.disk_gb else free


def _param_bytes(model_cfg) -> tuple[int, int]:
  """(bytes of the layers' params, of the rest: embedding, head, final norm), float32."""
  layers = 4 * model_cfg.num_layers * model_cfg.params_per_layer
  return layers, 4 * model_cfg.num_params - layers


def _nvme_store_bytes(model_cfg, placement) -> int:
  """Bytes of the NVMe stores of `placement` (raw FP32)."""
  layer_bytes, outer_bytes = _param_bytes(model_cfg)
  return (nvme.nvme_bytes(layer_bytes, placement.params, placement.opt_state)
          + nvme.nvme_bytes(outer_bytes, placement.embed_head, placement.embed_head))


def _nvme_on_checkpoint_disk(config, model_cfg, placement, checkpoints: pathlib.Path) -> int:
  """Bytes the NVMe stores and the snapshots the kept checkpoints pin will add to the workdir's
  disk when offload.dir is on it (what check_offload_dir counts there, less what the run holds
  already), plus the write-behind's files being replaced: the start-up checks each compared their
  own need with the whole free space, so both passed a disk that held one or the other, and the run
  died at a later save."""
  if not placement.uses_nvme:
    return 0
  offload_dir = placement.dir or str(checkpoints.parent / 'offload')
  if not nvme.same_filesystem(offload_dir, checkpoints):
    return 0
  snapshots = _run_snapshots(config, checkpoints)
  held = nvme.held_by_run(offload_dir, checkpoints, **snapshots)
  return max(0, int(_nvme_store_bytes(model_cfg, placement) * (1 + snapshots['keep'])
                    + placement.write_budget_bytes(model_cfg)) - held)


def _check_offload_dir(config, model_cfg, workdir: pathlib.Path, placement) -> None:
  """offload.dir is writable and holds the NVMe stores plus what kept checkpoints pin."""
  offload_dir = placement.dir or str(workdir / 'offload')
  needed = _nvme_store_bytes(model_cfg, placement)
  nvme.check_offload_dir(offload_dir, needed, checkpoint_dir=workdir / 'checkpoints',
                         keep_best=config.checkpoint.keep_best,
                         **_run_snapshots(config, workdir / 'checkpoints'))


def _run_snapshots(config, checkpoints: pathlib.Path | None) -> dict:
  """What of `checkpoints` the NVMe disk checks count as the run's own (nvme.held_by_run's
  `keep`, `deleted` and `best`): the checkpoints kept, those a resume deletes first, the best."""
  return dict(keep=planner.kept_checkpoints(config.checkpoint),
              deleted=_deleted_at_resume(config, checkpoints),
              best=_best_kept(config, checkpoints))


def _deleted_at_resume(config, checkpoints: pathlib.Path | None) -> list[int]:
  """The checkpoints in `checkpoints` that a resume deletes before it writes (those beyond a
  lowered checkpoint.keep: `_resumed`): their disk is free for the run."""
  if checkpoints is None or config.checkpoint.every < 0:
    return []
  return checkpoint_lib.beyond_keep(checkpoints, None, config.checkpoint.keep,
                                    config.checkpoint.keep_best)


def _best_kept(config, checkpoints: pathlib.Path | None) -> int | None:
  """The checkpoint in `checkpoints` that checkpoint.keep_best keeps beyond checkpoint.keep (None
  without one): its NVMe snapshot is one of the copies the run's checks count (the `keep` + 1 of
  planner.kept_checkpoints), however old it is, not disk taken by something else."""
  if checkpoints is None or config.checkpoint.every < 0 or not config.checkpoint.keep_best:
    return None
  return checkpoint_lib.best_step(checkpoints)


def plan_for(config, workdir: pathlib.Path | None, dry_run: bool):
  """(hardware profile, plan) of `config` as it stands: `auto` fields resolved, NVMe tiers in
  offload.dir (default <workdir>/offload); refuses configs that fit nowhere."""
  hw = hardware.load_profile(config.hardware)
  offload_dir = config.offload.dir or str((workdir or pathlib.Path('runs/default')) / 'offload')
  checkpoints = workdir / 'checkpoints' if workdir is not None else None
  # A resume or a start from another checkpoint reads the state into place: no jitted init.
  resumes = checkpoints is not None and any(p.name.isdigit() for p in checkpoints.glob('*'))
  plan = planner.plan_run(
      config, hw, disk_free_gb=_disk_free_gb(offload_dir, hw, dry_run, checkpoints,
                                             **_run_snapshots(config, checkpoints)),
      fresh_init=not (resumes or config.init.from_hf or config.init.from_run),
      snapshots_copied=(checkpoints is not None
                        and not nvme.same_filesystem(offload_dir, checkpoints)))
  if plan.placement.uses_nvme:
    plan.placement = dataclasses.replace(plan.placement, dir=offload_dir)
  return hw, plan


def _note_gone_offload_dir(config, workdir: pathlib.Path) -> None:
  """Says so when the offload.dir this run kept its NVMe stores in (config.json's) is gone as it
  resumes (an unmounted drive, a cleaned /tmp): a rerun without --config then takes this
  machine's offload.dir instead (runs.recorded_config: <workdir>/offload by default), one with
  it makes the directory anew wherever its path now lands (an empty mount point's disk), and
  the stores were rebuilt there without a word, on a disk the user may not have meant to fill.
  Rebuilding loses nothing (a resume always rebuilds its stores from its checkpoint, which holds
  them whole), and the new place's room is checked before anything is written there (`plan_for`,
  `_check_offload_dir`): the note names the place, its disk and its free space."""
  recorded = runs.recorded_offload_dir(workdir)
  meta = runs.newest_checkpoint_meta(workdir)
  tiers = (config.offload.params, config.offload.opt_state, config.offload.embed_head)
  if (recorded is None or recorded.exists() or not (meta or {}).get('disk')
      or not {'nvme', 'auto'} & set(tiers) or not distributed.is_main()):
    return
  directory = pathlib.Path(config.offload.dir or workdir / 'offload').expanduser().absolute()
  disk = fs.nearest_existing(directory)
  where = 'there' if directory == recorded else f'in {directory}'
  back = ('If it was a drive\'s mount point, stop, mount the drive and rerun.'
          if directory == recorded else f'To keep them where they were, stop, make {recorded} '
          f'available again (mount its drive) and rerun with --config.offload.dir={recorded}.')
  print(f'note: offload.dir={recorded}, where this run kept its NVMe stores (its config.json), '
        f'is gone (an unmounted drive? a cleaned /tmp?). Its checkpoint (step {meta["step"]}) '
        f'holds them whole: those this resume keeps on NVMe are rebuilt from it {where}, on the '
        f'disk of {disk} ({fs.human_bytes(shutil.disk_usage(disk).free)} free, checked against '
        f'their need before anything is written there). {back}', flush=True)


def resolve_plan(config, model_cfg, workdir: pathlib.Path, checkpointer: Checkpointer):
  """(config, hardware profile, plan, restored checkpoint or None) of a real run in `workdir`, its
  `auto` fields resolved. A config that fits nowhere is refused before any checkpoint is read.

  `auto` microbatches (`train.microbatches=0`) are chosen once, when the run starts: a run resumed
  from a checkpoint keeps the M it records, even if the machine's free memory or disk has changed
  since; the config returned is then a copy with that M (the caller's config is theirs).
  offload.dir is checked for the final placement's NVMe tiers."""
  hw, plan = plan_for(config, workdir, dry_run=False)
  # The newest intact checkpoint (damaged ones are skipped with a warning). The live NVMe stores
  # are always rebuilt from it, never reused: a run killed mid-step may have written some layers
  # of the next step, and resume must not see a mix of steps.
  restored = checkpointer.restore(model_cfg)
  recorded = restored.meta.get('microbatches') if restored is not None else None
  if config.train.microbatches == 0 and recorded and recorded != plan.microbatches:
    config = ml_collections.ConfigDict(config.to_dict())
    config_lib.set_field(config, 'train.microbatches', int(recorded))
    hw, plan = plan_for(config, workdir, dry_run=False)
  if plan.placement.uses_nvme:
    _check_offload_dir(config, model_cfg, workdir, plan.placement)
  _check_checkpoint_room(config, model_cfg, plan.placement, checkpointer,
                         0 if restored is None else restored.step)
  return config, hw, plan, restored


# A checkpoint's files beyond its raw FP32 data, per leaf: its directories, zarr.json and the
# last partial block of its files (4 KiB blocks: about 28 KiB on ext4; measured 15 KiB on tmpfs),
# and 1% for the chunks' shard indexes, the manifest and meta.json. Without them the check was
# 1.6% low, and a disk it passed filled at the last checkpoint.
_LEAF_FILES_BYTES = 32 << 10


def _checkpoint_bytes(model_cfg, placement) -> int:
  """Bytes one checkpoint writes into the workdir: its in-memory leaves, raw FP32 (params and
  Adam's m and v, 12 B per parameter not on NVMe; NVMe leaves are links, checked with
  offload.dir), and their files' overhead (`_LEAF_FILES_BYTES`)."""
  layers, outer = _param_bytes(model_cfg)
  raw = (layers * ((placement.params != 'nvme') + 2 * (placement.opt_state != 'nvme'))
         + 3 * outer * (placement.embed_head != 'nvme'))
  leaves = 3 * len(jax.tree.leaves(model_lib.abstract_params(model_cfg))) + 4  # + step, rng, ...
  return int(raw * 1.01) + leaves * _LEAF_FILES_BYTES


def _checkpoints_peak(config, one: int, checkpointer: Checkpointer, step: int, steps: int,
                      keep: int) -> tuple[int, int, int]:
  """(checkpoints on the workdir's disk at their peak, bytes they add to it then, bytes a resume
  at `step` deletes first) of a run from `step` to `steps` with checkpoint.keep=`keep`: `keep`
  kept (and the best with keep_best), and the next one written before the oldest is deleted,
  counted from those kept now, `one` byte each at most (`_checkpoint_bytes`)."""
  ckpt = config.checkpoint
  beyond = checkpointer.beyond_keep(step, keep)
  kept = [s for s in checkpointer.steps() if s <= step and s not in beyond]
  written = planner.checkpoints_written(ckpt, steps, step)
  if ckpt.every_minutes > 0 and written:  # time-based saves: as many as the steps, at most
    written = max(written, steps - step)
  freed = sum(checkpointer.array_bytes(s) for s in beyond)
  if not written:
    return len(kept), 0, freed
  peak = min(keep + int(ckpt.keep_best) + 1, len(kept) + written)
  # Those kept now are on the disk already; a new one replaces one of them.
  held = sum(min(one, checkpointer.array_bytes(s)) for s in kept)
  return peak, max(0, peak * one - held), freed


def _check_checkpoint_room(config, model_cfg, placement, checkpointer: Checkpointer, step: int,
                           steps: int | None = None) -> None:
  """The workdir's disk holds the checkpoints the run writes at their peak (`_checkpoints_peak`),
  with what a resume at `step` deletes first (a lowered checkpoint.keep: `_resumed`). Checked
  before anything is written (the first save may be hours of training away, the last days), and
  again once the data is prepared (`steps`, which train.epochs sets then): on the same disk."""
  if config.checkpoint.every < 0:
    return
  prepared = steps is not None
  if steps is None:  # with train.epochs, known once the data is prepared: one save until then
    steps = step + 1 if config.train.epochs else config.train.steps
  one, keep = _checkpoint_bytes(model_cfg, placement), config.checkpoint.keep
  count, needed, freed = _checkpoints_peak(config, one, checkpointer, step, steps, keep)
  stores = _nvme_on_checkpoint_disk(config, model_cfg, placement,
                                    pathlib.Path(checkpointer.directory))
  disk_free = shutil.disk_usage(fs.nearest_existing(checkpointer.directory)).free - stores
  if disk_free + freed >= needed:
    return
  _, needed_1, freed_1 = _checkpoints_peak(config, one, checkpointer, step, steps, 1)
  lower = (f'lower checkpoint.keep (keep=1 needs {fs.human_bytes(needed_1)}, with '
           f'{fs.human_bytes(disk_free + freed_1)} free), ' if needed_1 - freed_1 < needed - freed
           else '')
  also = ' with the older checkpoints deleted' if freed else ''
  also += ', the prepared data written' if prepared else ''
  also += (f', the NVMe stores and their snapshots ({fs.human_bytes(stores)} more) on the same '
           'disk' if stores else '')
  best = ' and the best (keep_best)' if config.checkpoint.keep_best else ''
  many = (f'{count} at once, {fs.human_bytes(one)} each: checkpoint.keep={keep}{best} kept, and '
          'the next written before the oldest is deleted' if count > 1 else
          f'one checkpoint of {fs.human_bytes(one)}')
  raise ConfigError(
      f'checkpoint: the checkpoints of this run need {fs.human_bytes(needed)} more in '
      f'{checkpointer.directory} at their peak ({many}; params and Adam state off NVMe, raw '
      'FP32), and '
      f'{fs.human_bytes(disk_free + freed)} are free there{also}. Free space there, {lower}put '
      'the state on NVMe in another offload.dir, or use a --workdir on a larger disk '
      '(checkpoint.every=-1 saves none).')


# Where a placement keeps the state and how it steps (not its budgets, which follow free memory).
_PLACED = ('params', 'opt_state', 'activations', 'embed_head', 'layers_per_group', 'optimizer_on',
           'park_grads', 'keep_layer_inputs')


def _note_other_placement(restored, placement, offload) -> None:
  """Says so when the state goes elsewhere than the checkpoint's run had it (offload.* set so,
  or `auto` fields planned for the memory and disk free now): the same arithmetic in another
  order (equal within float32 rounding, not bit for bit), another placement's memory and speed."""
  if restored is None:
    return
  was, now = restored.meta.get('placement') or {}, dataclasses.asdict(placement)
  # A streamed placement cuts the embedding and head into vocabulary chunks of shard_mb.
  placed = _PLACED + (('shard_mb',) if placement.streamed else ())
  changed = [key for key in placed if key in was and was[key] != now[key]]
  if not changed:
    return
  planned = [key for key in changed if offload.get(key) in ('auto', 0)]  # layers_per_group 0
  chose = (f'the planner chose now (for the memory and disk free now, or as this version plans; '
           f'set offload.{", offload.".join(planned)} to keep the earlier one)')
  # The fields set are the user's; `auto` ones the planner's, which may move with them.
  why = ('as offload.* now asks' if not planned else f'which {chose}'
         if len(planned) == len(changed) else f'as offload.* now asks and {chose}')
  print(f'note: checkpoint step {restored.step} was written under another placement '
        f'({"; ".join(f"{key} {was[key]} -> {now[key]}" for key in changed)}); the run resumes '
        f'under this one, {why}: the same arithmetic, possibly in another order, so its numbers '
        'match the earlier placement\'s within float32 rounding, not necessarily bit for bit',
        flush=True)


def _build_engine(model_cfg, config, plan, restored, source, layout: Layout):
  """The engine on `layout`'s devices, filled from the run's checkpoint (`restored`), else from
  `source` (init.from_hf's checkpoint or init.from_run's run: its weights piece by piece into
  the planned tiers, Adam's state zero), else a fresh init."""
  train_cfg = config.train
  tx = optim.make_optimizer(train_cfg)
  with _init_reader(model_cfg, tx, train_cfg.seed, restored, source) as reader:
    started = time.perf_counter()
    engine = make_engine(model_cfg, tx, optim.lr_schedule(train_cfg), train_cfg, plan.placement,
                         restore_from=reader, layout=layout)
    if reader is not restored:
      for stores in getattr(engine, 'stores', {}).values():  # the NVMe tier's writes landed
        for store in stores.all():
          store.flush()
      seconds = time.perf_counter() - started
      if distributed.is_main():  # each process read its own shards: about 1/P of the weights
        share = f' (process 0 of {jax.process_count()})' if jax.process_count() > 1 else ''
        print(f'initialised from {reader.directory}: {fs.human_bytes(reader.bytes_read)} of '
              f'weights read into the planned tiers{share} in {seconds:.2f} s '
              f'({reader.bytes_read / 1e9 / max(seconds, 1e-9):.3f} GB/s)', flush=True)
  return engine


@contextlib.contextmanager
def _init_reader(model_cfg, tx, seed: int, restored, source):
  """The reader an engine is filled from: the run's own checkpoint (`restored`), else a fresh
  run's state with `source`'s weights (hf.HfReader; checkpoint.WeightsOnly of init.from_run's
  checkpoint: its newest or checkpoint.read's, held while it is read), else None (a fresh
  init)."""
  if restored is not None or source is None:
    yield restored
    return
  abstract = resident.abstract_state(model_cfg, tx)
  if not isinstance(source, runs.RunSource):
    yield hf.HfReader(source, abstract, seed=seed)
    return
  with checkpoint_lib.read_checkpoint(source.directory, model_cfg, source.read) as reader:
    if reader is None:  # deleted since runs.resolve_init saw it
      raise ConfigError(f'init.from_run: {source.directory} holds no checkpoint any more.')
    yield checkpoint_lib.WeightsOnly(reader, abstract, seed)


def make_engine(model_cfg, tx, schedule, train_cfg, placement: Placement, restore_from=None,
                layout: Layout | None = None):
  """The resident engine when everything stays on the device, else the streamed engine; filled
  from a checkpoint (`restore_from`, a CheckpointReader) or a fresh init; on `layout`'s devices
  (default: the first device)."""
  layout = layout or Layout.single_device()
  if placement.streamed:
    return StreamedEngine(model_cfg, tx, schedule, train_cfg.grad_clip, placement,
                          seed=train_cfg.seed, restore_from=restore_from, layout=layout)
  state = None
  if restore_from is not None:
    # Leaf by leaf, file by file into device buffers (each leaf into its shards): no whole host
    # copy of the state.
    state = restore_from.device_state(resident.abstract_state(model_cfg, tx), layout)
  return resident.ResidentEngine(model_cfg, tx, schedule, train_cfg.grad_clip, state,
                                 seed=train_cfg.seed, layout=layout)


def _validate(config, workdir: str) -> tuple[model_lib.ModelConfig, pathlib.Path]:
  """(model config, workdir path), once the config, the data paths, the workdir, the tokenizer
  and the directory of an NVMe tier the config names are checked. Allocates and writes nothing."""
  model_cfg = config_lib.validate(config)
  requested = Placement.from_config(config.offload, model_cfg, allow_auto=True)
  distributed.device_count(config)  # parallel.devices exist, train.batch_size splits over them
  data_lib.check_data_config(config.data, config.train)
  workdir = config_lib.check_run_workdir(workdir)
  _note_gone_offload_dir(config, workdir)  # before a refusal of the new place's room
  if requested.uses_nvme:
    _check_offload_dir(config, model_cfg, workdir, requested)  # named tiers: say what's wrong
  model_cfg, _ = _model_and_tokenizer(config, model_cfg)
  return model_cfg, workdir


def _model_and_tokenizer(config, model_cfg):
  """(model_cfg with its document mask, tokenizer): data.tokenizer checked against the model
  (`_check_tokenizer`), and model.document_mask resolved from it (`with_document_mask`)."""
  tokenizer = _check_tokenizer(config, model_cfg)
  return with_document_mask(config, model_cfg, tokenizer), tokenizer


@contextlib.contextmanager
def _weights_reader(config, model_cfg, path: pathlib.Path, meta, checkpoint):
  """(reader, source) of an --eval or --sample (`_eval_config`'s path, meta and checkpoint): the
  run's checkpoint (checkpoint.read) if it has one, held for the `with` block (`_run_checkpoint`),
  else the Hugging Face checkpoint, read as a fresh run's full state."""
  if meta is None:
    tx = optim.make_optimizer(config.train)
    yield (hf.HfReader(checkpoint, resident.abstract_state(model_cfg, tx)),
           str(checkpoint.directory))
    return
  with _run_checkpoint(config, path, model_cfg) as reader:
    yield reader, f'{reader.directory} (step {reader.meta["step"]})'


@contextlib.contextmanager
def _run_checkpoint(config, path: pathlib.Path, model_cfg):
  """The checkpoint of the run in `path` that checkpoint.read names (newest, best, a step), held
  for reading for the `with` block: a run training there keeps it meanwhile
  (checkpoint.read_checkpoint)."""
  with checkpoint_lib.read_checkpoint(path, model_cfg, config.checkpoint.read) as reader:
    if reader is None:  # its checkpoints were deleted since runs.newest_checkpoint_meta saw them
      raise ConfigError(f'{path} holds no checkpoint any more; pass the --workdir of a run that '
                        'has saved one (checkpoints/<step>/).')
    yield reader


def with_document_mask(config, model_cfg, tokenizer):
  """model_cfg, and with model.document_mask on, its document_eos_id set to the EOS the data
  stores after every document (data.eos_token, else the tokenizer's; data/documents.py): the id
  that ends each document of a packed row."""
  if not config.model.document_mask:
    return model_cfg
  eos = data_lib.document_format(tokenizer, eos_token=config.data.eos_token).eos
  return model_cfg.replace(document_eos_id=int(eos))


def _check_tokenizer(config, model_cfg):
  """The tokenizer of data.tokenizer (reads tokenizer.json, writes nothing), refused if its ids
  do not fit the model's vocabulary."""
  tokenizer = data_lib.load_tokenizer(config.data.tokenizer)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    given = pathlib.Path(config.data.tokenizer).expanduser()
    own = config.init.from_hf and runs.same_path(
        str(given if given.is_dir() else given.parent), config.init.from_hf)
    fix = ('the checkpoint\'s own tokenizer.json and its config.json disagree: it is not the '
           'tokenizer this model was trained with; set data.tokenizer to the one it was' if own
           else 'the checkpoint (init.from_hf) fixes the model\'s vocabulary: use its tokenizer '
           '(leave data.tokenizer unset) or one that fits' if config.init.from_hf else
           'Raise model.vocab_size or change data.tokenizer')
    raise ConfigError(f'model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer '
                      f'({config.data.tokenizer}: {tokenizer.vocab_size} ids). {fix}.')
  return tokenizer


def _workdir_data(config, source, workdir: pathlib.Path, microbatches: int,
                  document_eos: int, restored=None, held: contextlib.ExitStack | None = None):
  """(config, train sampler, eval batches): the tokenizer adopted (`runs.adopt_tokenizer`) and the
  data prepared and opened (`_open_data`), in process 0 first. The other processes then open
  what it prepared as it is where they see the same data directory (a shared workdir): each
  compared the sources' file times on its own machine, and a copy of the corpus there (cp, scp
  keep no times) had them delete process 0's files and tokenize the corpus again, at every
  start. All then check that they read the same data. `restored`: the checkpoint a resume
  starts from (train.epochs counts the steps left from its data position). `held`: the run's
  ExitStack, which holds the prepared directories for reading (`_open_data`)."""
  resumed_at = (0, 0) if restored is None else (restored.step, restored.meta['data_position'])

  def make(as_prepared: bool = False):
    adopted = runs.adopt_chat_template(runs.adopt_tokenizer(config, source, workdir), workdir)
    return _open_data(adopted, workdir, microbatches, document_eos,
                      _finding_documents(adopted, document_eos), as_prepared, resumed_at, held)

  if jax.process_count() == 1:
    return make()
  if distributed.is_main():
    made = make()
  distributed.barrier('workdir data')
  digest = list(data_lib.prepared_digest(config.data, workdir))
  same_directory = distributed.from_main(digest) == digest and bool(digest)  # a collective
  if not distributed.is_main():
    made = make(as_prepared=same_directory)
  _check_same_data(*made)
  return made


def _check_same_data(config, sampler, eval_data) -> None:
  """Every process of a run reads the same data (distributed.check_same_data): another corpus
  under data.path on one machine trained silently on a mix, or hung the processes in a
  collective (train.epochs counts the steps from the data)."""
  distributed.check_same_data(f'{sampler.n_windows:,} training windows, '
                              f'{config.train.steps:,} steps, {len(eval_data)} validation batches')


def _finding_documents(config, document_eos: int) -> str:
  """The settings that find documents ('model.document_mask and data.pack=...'), '' for none:
  by the ends the prepared data records, or in data prepared without them by their EOS."""
  return ' and '.join(name for name, on in (
      ('model.document_mask', document_eos >= 0),
      (f"data.pack='{config.data.pack}'", config.data.pack != 'stream')) if on)


def _open_data(config, workdir: pathlib.Path, microbatches: int, document_eos: int, uses: str,
               as_prepared: bool = False, resumed_at: tuple[int, int] = (0, 0),
               held: contextlib.ExitStack | None = None):
  """(config, train sampler, eval batches) over the token files prepared (or reused) in
  <workdir>/data; with train.epochs, the config's train.steps are the epochs' (`epoch_steps`,
  from `resumed_at`: a resume's (step, data position)). With `held` (a run's ExitStack), the
  prepared directories are held for reading until the run ends (locks.read_hold): a prepare of
  other data into one of them (a --prepare into the run's workdir, a run sharing its
  data.cache_dir) is refused instead of replacing the shards this run reads.
  `document_eos` (the model's document_eos_id, -1 without model.document_mask): the target after
  each document's first token is neither learned nor scored (data.unlearn_starts). `uses`: what
  finds documents (`_finding_documents`): in data prepared without their recorded ends (an older
  version's), by their EOS, whose count is checked. `as_prepared`: data_lib.load_data's."""
  train_cfg = config.train
  info, tokenizer = data_lib.load_data(config.data, workdir, as_prepared=as_prepared)
  for directory in data_lib.prepared_dirs(info) if held is not None else ():
    held.enter_context(locks.read_hold(directory))
  row_packing = data_lib.row_packing(config.data, tokenizer)  # data.pack: rows of whole documents
  if uses:
    fmt = data_lib.document_format(tokenizer, eos_token=config.data.eos_token)
    data_lib.check_document_ends(info, fmt.eos, fmt.eos_text, uses)
  if row_packing is not None and document_eos < 0 and distributed.is_main():
    print(f"note: data.pack='{row_packing.strategy}' without model.document_mask: the documents "
          'of a row attend to each other (set --config.model.document_mask=true to keep each '
          "to itself, as TRL's packing does)", flush=True)
  sampler = data_lib.BatchSampler(
      data_lib.load_split(info, 'train'), seq_len=train_cfg.seq_len,
      batch_size=train_cfg.batch_size, microbatches=microbatches, seed=train_cfg.seed,
      document_eos=document_eos, row_packing=row_packing, verifier=data_lib.verify_data(info),
      tokenizer=info.tokenizer)
  eval_data = data_lib.eval_batches(
      data_lib.load_split(info, 'val'), seq_len=train_cfg.seq_len,
      batch_size=train_cfg.batch_size, num_batches=train_cfg.eval_batches,
      document_eos=document_eos, row_packing=row_packing)
  if train_cfg.epochs:
    steps = epoch_steps(train_cfg.epochs, sampler.n_windows, sampler.samples_per_step,
                        *resumed_at)
    config = ml_collections.ConfigDict(config.to_dict())
    config_lib.set_field(config, 'train.steps', steps)
    if distributed.is_main():
      passes = sampler.source_passes(steps * sampler.samples_per_step)
      step, read = resumed_at
      print(f'train.epochs={train_cfg.epochs:g}: {steps:,} steps of {sampler.samples_per_step} '
            f'samples over {sampler.n_windows:,} windows of {train_cfg.seq_len + 1} tokens'
            + (f' ({steps - step:,} from step {step:,}, where {read:,} samples had been read)'
               if step else '')
            + (f' (the mixture\'s weights decide how often each source is read: '
               f'{", ".join(f"{p:.2f}" for p in passes)} passes over its sources)'
               if passes else ''), flush=True)
  if distributed.is_main() and (note := optim.warmup_note(config.train)):  # steps known now
    print(note, flush=True)
  return config, sampler, eval_data


def epoch_steps(epochs: float, windows: int, samples_per_step: int, step: int = 0,
                position: int = 0) -> int:
  """Steps that take `epochs` passes over `windows` training windows (the last step completes
  the last pass; at least one step), for a run at `step` that has read `position` samples (a
  resume): the samples left are counted at this run's `samples_per_step`, so a resume with
  another batch size ends at the same pass (counting every step at the new size, a larger batch
  had nothing to do and a smaller one read the data again)."""
  left = math.ceil(max(0.0, epochs * windows - position) / samples_per_step)
  return max(1, step + left)


def _open_run_log(config, model_cfg, hw, plan, workdir: pathlib.Path, samples_per_step: int,
                  start_step: int, position: int, checkpointer,
                  layout: Layout) -> metrics_lib.RunLog:
  """The run's log (metrics.jsonl, TensorBoard, console), once it has printed where the run
  resumed from, the model, the devices and processes, the engine, and the plan's prediction."""
  train_cfg = config.train
  tokens_per_step = samples_per_step * train_cfg.seq_len
  log = metrics_lib.RunLog(
      workdir, total_steps=train_cfg.steps, start_step=start_step, log_every=train_cfg.log_every,
      tokens_per_step=tokens_per_step,
      flops_per_step=model_cfg.flops_per_token(train_cfg.seq_len) * tokens_per_step,
      peak_tflops=_mfu_peak_tflops(model_cfg, layout),
      predicted_step_time_s=plan.step_time_s, checkpointer=checkpointer,
      progress_bar=train_cfg.progress_bar, writes=distributed.is_main())
  if start_step:
    log.print(f'resumed from {checkpointer.directory / str(start_step)} '
              f'(step {start_step}, data position {position})')
  log.print(f'model: {model_cfg.num_params:,} params, {tokens_per_step:,} tokens/step, '
            f'on {distributed.describe(layout)}, {plan.placement.describe(model_cfg.num_layers)}')
  each = ' each' if layout.num_devices > 1 else ''
  log.print(f'plan ({hw.name}: {hw.origin or "given profile"}): predicted '
            f'{plan.step_time_s:.3g} s/step, {plan.tokens_per_s:,.0f} tokens/s, bottleneck '
            f'{plan.bottleneck}; device {plan.used("device") / 1e9:,.2f} GB{each}, host '
            f'{plan.used("host") / 1e9:,.2f} GB, nvme {plan.used("nvme") / 1e9:,.2f} GB '
            '(`--dry_run` prints the table)')
  return log


def _mfu_peak_tflops(model_cfg, layout: Layout) -> float | None:
  """MFU's denominator: the dense datasheet peak of the run's devices, all of them (a step's
  FLOPs are the whole batch's), or None (no MFU) where no datasheet is known: the CPU, unlisted
  accelerators. Not hw.peak(): without a datasheet it falls back to the profile's measured layer
  rate, which a run can beat, and "mfu 100.4%" would read as a fraction of a peak."""
  peak = hardware.datasheet_peak_tflops(layout.devices[0].device_kind, model_cfg.dtype,
                                        model_cfg.matmul_precision)
  return peak * layout.num_devices if peak else None


def _evaluate(engine, batches) -> dict:
  """eval/loss: the mean over the eval batches' targets; for batches with a loss mask
  (data.Batch), over their learned targets only (each batch's masked mean weighted by its
  learned-token count, so the whole set's masked mean; 0 if no target is learned)."""
  losses = engine.eval_losses(batches)
  if batches and getattr(batches[0], 'loss_mask', None) is not None:
    counts = np.array([np.count_nonzero(b.loss_mask) for b in batches], np.float64)
    loss = float(np.dot(losses, counts) / counts.sum()) if counts.sum() else 0.0
  else:
    loss = float(np.mean(losses))
  return {'eval/loss': loss, 'eval/perplexity': math.exp(min(loss, 80.0))}


def _train(config, model_cfg, plan, engine, sampler, eval_data, checkpointer, log, position,
           early: metrics_lib.EarlyStopping, stop: preemption.StopSignals,
           profiler: profiling.StepProfiler) -> None:
  """Steps to `train.steps`: each step logged, evaluated and checkpointed when due (every
  `checkpoint.every` steps, once `checkpoint.every_minutes` have passed since the last checkpoint,
  at the end), and traced when `profiler` says. A stop request (`stop`: SIGTERM, SIGINT) is acted
  on once the step in flight is done: its checkpoint is committed and TrainingStopped raised.
  Once `early` says the evaluations stopped improving, the run ends there with a checkpoint."""
  train_cfg, every = config.train, config.checkpoint.every
  clock = preemption.CheckpointClock(config.checkpoint.every_minutes)
  for done in range(engine.step + 1, train_cfg.steps + 1):
    batch = sampler.batch(position)
    with profiler.step(done):
      scalars = log.timed_step(done, engine.train_step, batch)
    position += sampler.samples_per_step
    if scalars:  # a logging step
      scalars.update(data_lib.batch_scalars(batch, position, sampler.n_windows))
    ending = False
    if metrics_lib.due(done, train_cfg.eval_every, train_cfg.steps):
      scalars.update(_evaluate(engine, eval_data))
      ending = early.update(done, scalars['eval/loss'], last=done == train_cfg.steps)
    log.record(done, scalars)
    stopping, on_time = preemption.agreed(stop.requested and done < train_cfg.steps, clock.due())
    if every >= 0 and (metrics_lib.due(done, every, train_cfg.steps) or on_time or stopping
                       or ending):
      # Only the run's last checkpoint waits for the whole check of its data: a stop has a grace
      # period to keep, and the next start checks the data again from the first file.
      _check_data(sampler, wait=done == train_cfg.steps or ending)
      checkpointer.save(done, engine, data_position=position, model_cfg=model_cfg,
                        seed=train_cfg.seed, placement=plan.placement,
                        microbatches=plan.microbatches, eval_loss=scalars.get('eval/loss'),
                        extra_meta={'data': _data_record(config, sampler, position),
                                    'early_stopping': early.state()})
      clock.reset()
      if not (stopping or ending) and done < train_cfg.steps:  # a signal during the save
        stopping, = preemption.agreed(stop.requested)
    if stopping:
      raise _stopped(log, checkpointer, done, stop.received, saved=every >= 0)
    if ending:
      log.print(f'{early.message(done)}; ' + ('checkpoint saved.' if every >= 0 else
                                              'no checkpoint (checkpoint.every=-1).'))
      return


def _check_data(sampler, wait: bool) -> None:
  """Raises StoreCorruptionError before a checkpoint if the check of the prepared data
  (`sampler.check_data`, `wait`: until every file is read) found a damaged file in any process:
  each reads the files at its own pace, and all must stop at the same step."""
  try:
    sampler.check_data(wait)
    damaged = None
  except StoreCorruptionError as error:
    damaged = error
  found = distributed.processes_where(damaged is not None)
  if found:
    damaged = damaged or StoreCorruptionError(
        f'process {found[0]} found a file of the prepared data damaged (its log names it): '
        'delete the prepared data and prepare it again, then rerun the same command.')
    damaged.everyone = True
    raise damaged


def _stopped(log, checkpointer, step: int, signal_name: str | None, saved: bool):
  """TrainingStopped at `step`, once its checkpoint is committed and the console says so.
  `signal_name`: what this process received (None: nothing; another process was signalled).
  With several processes, only those signalled know which signal it was and the console is
  process 0's: every process calls this at the same step, and they agree on the signals (one
  small all-gather per stop signal, once) to name them and the processes they went to."""
  by = signal_name
  if jax.process_count() > 1:
    sent = [(name, distributed.processes_where(signal_name == name))
            for name in (s.name for s in preemption.STOP_SIGNALS)]
    sent = [(name, ranks) for name, ranks in sent if ranks]
    by = ' and '.join(f'{name} to process{"es" * (len(ranks) > 1)} '
                      f'{", ".join(map(str, ranks))}' for name, ranks in sent) or 'a signal'
    signal_name = signal_name or (sent[0][0] if sent else None)
  if saved:
    checkpointer.wait()  # committed (or its error raised) before the message says so
    message = (f'stopped at step {step} by {by}; checkpoint saved; rerun the same '
               'command to resume')
  else:
    message = f'stopped at step {step} by {by}; no checkpoint saved (checkpoint.every=-1)'
  log.print(message)
  return preemption.TrainingStopped(message, step, signal_name, saved)


@_disk_full_is_an_error
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       overrides: Iterable[str] | None = None) -> dict:
  """Trains (or resumes) the run in `workdir` to `config.train.steps`; returns the last metrics
  row it wrote ({} when the newest checkpoint is already at train.steps: nothing to do).

  The workdir (and an NVMe tier's offload.dir) is locked for the run's whole life: a second run
  on either is refused (locks.py). SIGTERM or SIGINT during training stop the run after the step
  in flight, with a checkpoint, by raising preemption.TrainingStopped. With init.from_hf or
  init.from_run a fresh run starts from the weights of that Hugging Face checkpoint or run
  (`runs.resolve_init`; `overrides`: the config keys set on the command line)."""
  runtime.configure(config)  # before the run allocates (the package applied the default at import)
  config, source = runs.resolve_init(config, workdir, overrides)
  model_cfg, workdir = _validate(config, workdir)
  main = distributed.is_main()
  with contextlib.ExitStack() as locked:
    stop, checkpointer = _hold_run(locked, config, workdir)
    config, hw, plan, restored = resolve_plan(config, model_cfg, workdir, checkpointer)
    distributed.check_same_plan(f'{plan.placement.summary()}, M={plan.microbatches}')
    if not config.train.epochs and _finished(restored, config, main):  # a finished run, rerun
      return {}
    if main:
      _print_start(config, plan, workdir, restored)
    # A streamed run's heap is trimmed above the plan's host peak (runtime.trim_limit).
    runtime.configure(config, streamed=plan.placement.streamed,
                      host_peak_bytes=plan.host_peak_bytes)
    _hold_offload_dir(locked, config, plan.placement, workdir, checkpointer)  # before the stores
    enable_compilation_cache(config.jax_cache_dir)
    workdir.mkdir(parents=True, exist_ok=True)
    # Process 0 copies the tokenizer and prepares the data; the others then read what it wrote.
    config, sampler, eval_data = _workdir_data(config, source, workdir, plan.microbatches,
                                               model_cfg.document_eos_id, restored, locked)
    if config.train.epochs and _finished(restored, config, main):  # its steps: counted just now
      return {}
    _check_checkpoint_room(config, model_cfg, plan.placement, checkpointer,  # the data took room
                           0 if restored is None else restored.step, config.train.steps)
    layout = distributed.run_layout(config)
    engine = _build_engine(model_cfg, config, plan, restored, source, layout)
    locked.push(_closing(engine.close))  # before the checkpointer's: waits for write-behind
    start_step = engine.step
    position, early = _resumed(restored, config, sampler, main, workdir, checkpointer)
    del restored
    if main:
      fs.write_json_atomic(workdir / 'config.json', json.loads(config.to_json_best_effort()))
    stop.arm()
    with _open_run_log(config, model_cfg, hw, plan, workdir, sampler.samples_per_step,
                       start_step, position, checkpointer, layout) as log:
      if start_step == 0:  # the baseline every later eval is compared with
        log.write(0, _evaluate(engine, eval_data))
      with profiling.StepProfiler(config.profile.start_step, config.profile.steps, workdir,
                                  log.print) as profiler:
        _train(config, model_cfg, plan, engine, sampler, eval_data, checkpointer, log,
               position, early, stop, profiler)
    return log.last


def _hold_run(locked: contextlib.ExitStack, config, workdir: pathlib.Path):
  """(stop signals, checkpointer) of a run, held in `locked` (its ExitStack) for its life.
  Several processes (distributed.py) share the workdir: process 0 locks it, writes its files and
  prints; every process computes, and checkpoints its own shards (checkpoint.py)."""
  if distributed.is_main():
    locked.enter_context(locks.hold_workdir(workdir))  # before anything is written
  # SIGTERM / SIGINT stop training once it starts (`arm`), and until the last commit is done.
  stop = locked.enter_context(preemption.StopSignals(saves=config.checkpoint.every >= 0,
                                                     armed=False))
  checkpointer = Checkpointer(workdir, keep=config.checkpoint.keep,
                              keep_best=config.checkpoint.keep_best)
  # Closed last, however the run ends: commits the checkpoint in flight.
  locked.push(_closing(checkpointer.close))
  # From here every process runs collectives (start-up's too): one that fails is one line.
  locked.enter_context(distributed.lost_process_error(checkpointer))
  return stop, checkpointer


def _hold_offload_dir(locked: contextlib.ExitStack, config, placement, workdir,
                      checkpointer: Checkpointer) -> None:
  """Locks this process's part of offload.dir for the run (`locked`: its ExitStack) when the
  placement has NVMe stores, until `checkpointer`'s last commit is done (it may copy a staged
  snapshot of the stores from there). Without them (a resume that left NVMe, by choice or by
  plan), and in the offload.dir the run last trained with when it moved (config.json's), it
  deletes the stores a run there left, unless another run holds the directory: the full FP32
  state, never read again (a run rebuilds its stores from its checkpoint's own snapshot)."""
  directory = pathlib.Path(config.offload.dir or workdir / 'offload').expanduser().absolute()
  unused = [] if placement.uses_nvme else [directory]
  previous = runs.recorded_offload_dir(workdir)  # before this run rewrites config.json
  if previous is not None and previous != directory:
    unused.append(previous)
  for stale_dir in unused:
    _delete_unused_stores(stale_dir, workdir)
  if placement.uses_nvme:
    locked.enter_context(locks.hold_offload_dir(distributed.process_dir(placement.dir), workdir))
    locked.push(_closing(checkpointer.wait))  # unwound before the lock is given back


def _delete_unused_stores(directory: pathlib.Path, workdir: pathlib.Path) -> None:
  """Deletes the NVMe stores in this process's part of `directory` (`_hold_offload_dir`), unless
  another run holds it, and says so."""
  stale = nvme.store_dirs(directory)
  if not stale:
    return
  try:
    with locks.hold_offload_dir(distributed.process_dir(directory), workdir):
      held = nvme.bytes_held(stale)
      nvme.remove_other_stores(directory, set())
  except locks.DirectoryInUseError:
    return
  if distributed.is_main():
    print(f'note: deleted the NVMe stores this run no longer uses in {directory} '
          f'({fs.human_bytes(held)})', flush=True)


def _closing(close):
  """An ExitStack exit callback that runs `close`, whose own error is raised only when the run
  is not already ending with one: a run stopped by a lost process or a full disk reports that
  (one line), not the write-behind or commit that failed along with it (a traceback)."""
  def exit_callback(exc_type, exc, traceback) -> bool:
    del exc_type, traceback
    try:
      close()
    except Exception as error:  # pylint: disable=broad-except
      if exc is None:
        raise
      print(f'note: while the run stopped, closing failed too: {type(error).__name__}: '
            f'{" ".join(str(error).split())[:300]}', file=sys.stderr, flush=True)
    return False  # the run's own error, if any, goes on
  return exit_callback


def _data_fields(config) -> dict:
  """The config fields that decide which samples a data position names (checkpoint meta)."""
  fields = {f'data.{name}': value for name, value in config.data.to_dict().items()
            if name not in ('num_workers', 'shard_tokens')}  # how it is prepared, not what
  fields.update({'train.seq_len': config.train.seq_len, 'train.seed': config.train.seed,
                 'model.document_mask': config.model.document_mask})
  return fields


def _data_record(config, sampler, position: int) -> dict:
  """What a checkpoint records of its data: a digest of the next step's samples (those from
  `position` on), the fields that decide them and the tokenizer whose ids they are (its content
  hash), which `_resumed` compares."""
  return {'next_samples': sampler.digest(position, sampler.samples_per_step),
          'samples': sampler.samples_per_step, 'fields': _data_fields(config),
          'tokenizer': sampler.tokenizer}


def _resumed(restored, config, sampler, main: bool, workdir: pathlib.Path,
             checkpointer: Checkpointer) -> tuple[int, metrics_lib.EarlyStopping]:
  """(data position, early stopping) to train on from: the checkpoint's (`restored`), else 0
  and none yet. A resume whose data no longer gives the checkpoint's next samples (another
  data.path, data.pack, train.seq_len, seed, or changed files) goes on from that position of the
  data as it is now; process 0 says so, naming the fields that changed, and names the settings
  that differ from those the run trained with in `workdir` (`_note_changed_settings`). Process 0
  deletes the checkpoints beyond a lowered checkpoint.keep now, not at the next commit: a run
  stopped by a full disk is rerun with a lower keep to make room for that commit."""
  early = metrics_lib.EarlyStopping.resumed(
      config.train.early_stopping_patience, config.train.early_stopping_threshold,
      None if restored is None else restored.meta.get('early_stopping'))
  if restored is None:
    return 0, early
  if main:
    _note_changed_settings(config, workdir, restored.step)  # before config.json is rewritten
    if deleted := checkpointer.delete_beyond_keep(restored.step):
      print(f'note: deleted checkpoint(s) {", ".join(map(str, deleted))} beyond '
            f'checkpoint.keep={config.checkpoint.keep}', flush=True)
  position, recorded = restored.meta['data_position'], restored.meta.get('data')
  _refuse_another_tokenizer(recorded, sampler, config, restored.step)
  # Records before 2026-12-07 digest 4 samples; since, the whole next step's.
  if main and recorded and recorded['next_samples'] != sampler.digest(
      position, recorded.get('samples', 4)):
    now = _data_fields(config)
    changed = [f'{name} {recorded["fields"].get(name)!r} -> {value!r}'
               for name, value in now.items() if recorded['fields'].get(name) != value]
    print(f'warning: checkpoint step {restored.step} was trained on other data: '
          f'{"; ".join(changed) or _SAME_CONFIG_OTHER_DATA}. Training goes on from sample '
          f'{position:,} of the data as it is now, so the batches from here on are not those of '
          'an uninterrupted run'
          f'{" (set those fields back to resume exactly)" if changed else ""}.', flush=True)
  return position, early


_SAME_CONFIG_OTHER_DATA = ('the same config, but the data as prepared now differs (the files it '
                           'reads changed, or this version prepares them otherwise: a note above '
                           'says why the data was prepared again)')


def _refuse_another_tokenizer(recorded: dict | None, sampler, config, step: int) -> None:
  """Refuses a resume whose tokenizer is not the one checkpoint `step` trained with (another
  tokenizer.json at the same data.tokenizer path): its ids would name other tokens to the
  checkpoint's embedding rows. Records before 2026-12-07 hold no tokenizer."""
  was = (recorded or {}).get('tokenizer')
  if was and sampler.tokenizer and was != sampler.tokenizer:
    raise ConfigError(
        f'data.tokenizer={config.data.tokenizer} is not the tokenizer checkpoint step {step} '
        f'trained with (its content was {was}, now {sampler.tokenizer}): its ids would name other '
        'tokens to the checkpoint\'s embeddings. Put back the tokenizer.json the run trained '
        'with, or start a new run.')


# The settings a resume may change that change the steps ahead (model shapes are refused, data
# changes are named by _resumed, placements resume the same math): the model's function and
# numerics, the schedule, AdamW, clipping, the tokens per step.
RESUME_SETTINGS = ('model.document_mask', 'model.matmul_precision', 'model.dtype',
                   'model.rope_theta', 'model.norm_eps', 'model.sliding_window',
                   *(f'model.rope_scaling.{field}' for field in (
                       'type', 'factor', 'low_freq_factor', 'high_freq_factor', 'original_max_len',
                       'beta_fast', 'beta_slow', 'attention_factor', 'truncate')),
                   'train.steps', 'train.epochs', 'train.batch_size', 'train.microbatches',
                   'train.lr', 'train.warmup_steps', 'train.warmup_ratio', 'train.lr_schedule',
                   'train.min_lr_ratio', 'train.weight_decay', 'train.b1', 'train.b2',
                   'train.eps', 'train.grad_clip')


def _note_changed_settings(config, workdir: pathlib.Path, step: int) -> None:
  """Says which RESUME_SETTINGS differ from those the run last trained with (its config.json):
  a resume takes them, so its steps from here are not those of the run as it was (train.steps,
  say, stretches the learning-rate schedule)."""
  try:
    before = json.loads((workdir / 'config.json').read_text())
  except (OSError, ValueError):
    return
  changed, recorded = [], config_lib.flatten(before)
  for key in RESUME_SETTINGS:
    was, now = recorded.get(key), config_lib.get_field(config, key)
    if was is not None and was != now:
      changed.append(f'{key} {was!r} -> {now!r}')
  if changed:
    print(f'note: resuming from step {step} with {"; ".join(changed)} (the run trained with the '
          'values on the left): the steps from here differ from those of the run as it was',
          flush=True)


def _finished(restored, config, main: bool) -> bool:
  """Whether the run's newest checkpoint (`restored`) is already at train.steps, or ended the run
  early (train.early_stopping_patience); said by process 0."""
  if restored is not None and (restored.meta.get('early_stopping') or {}).get('stopped'):
    if main:
      print(f'nothing to do: the run stopped early at step {restored.step} (its evaluations '
            'had stopped improving); to train on from it, start a new --workdir with '
            f'--config.init.from_run={restored.directory.parent.parent}', flush=True)
    return True
  if restored is None or restored.step < config.train.steps:
    return False
  if main:
    print(metrics_lib.nothing_to_do(restored.step, config.train.steps,
                                    'train.epochs' if config.train.epochs else 'train.steps'),
          flush=True)
  return True


def _print_start(config, plan, workdir: pathlib.Path, restored) -> None:
  """What a starting run writes where, and a resume's change of placement, if any."""
  print(metrics_lib.describe_workdir(
      workdir, checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
      checkpoint_best=config.checkpoint.keep_best,
      checkpoint_minutes=config.checkpoint.every_minutes, data_dir=config.data.cache_dir,
      nvme_dir=plan.placement.dir if plan.placement.uses_nvme else None), flush=True)
  _note_other_placement(restored, plan.placement, config.offload)


# ------------------------------------------------------------------------------------------------
# Perplexity (`launch.py --eval`) and export (`launch.py --export_hf`).
# ------------------------------------------------------------------------------------------------

def _eval_config(config, workdir: str, overrides, job: str = '--eval'):
  """(config, workdir path, run checkpoint meta or None, HF checkpoint or None) of an --eval or a
  --sample (`job`): the run's newest checkpoint if it has one (its shape, its tokenizer and its
  model.document_mask), else init.from_hf. --sample writes nothing there; --eval its result."""
  path = (_check_eval_workdir(workdir) if job == '--eval'
          else config_lib.check_run_readable(workdir))
  meta = runs.newest_checkpoint_meta(path)
  if meta is not None:
    runs.check_same_start(config, path, meta)
    config = runs.config_from_run(config, path, meta, overrides)
    # A run trained with model.document_mask is read with it, unless the command line says not.
    if (meta['model_config'].get('document_eos_id', -1) >= 0 and not config.model.document_mask
        and 'model.document_mask' not in (overrides or ())):
      config_lib.set_field(config, 'model.document_mask', True)
    return config, path, meta, None
  if not config.init.from_hf:
    also = (f' (init.from_run starts a training run; to read {config.init.from_run}, pass it as '
            '--workdir)' if config.init.from_run else '')
    raise ConfigError(f'{job}: {path} holds no checkpoint and init.from_hf is not set, so there '
                      f'is no model to {"evaluate" if job == "--eval" else "sample"}. Pass the '
                      '--workdir of a run, or '
                      f'--config.init.from_hf=<Hugging Face model directory>{also}.')
  checkpoint = hf.inspect_checkpoint(config.init.from_hf)
  return hf.config_from_checkpoint(config, checkpoint, overrides), path, None, checkpoint


_EVAL_ELSEWHERE = ('To evaluate a run you cannot write to, export it (--export_hf=<dir>) and run '
                   '--eval with --config.init.from_hf=<dir> and a --workdir of your own.')


def _check_eval_workdir(workdir: str) -> pathlib.Path:
  """The --eval workdir, where eval.json and evals.jsonl go: writable, with room for them (1 MB),
  checked before the evaluation (minutes to hours) computes what would be lost."""
  path = config_lib.check_workdir(workdir, writes='--eval writes eval.json there',
                                  fix=_EVAL_ELSEWHERE)
  return fs.check_writable(path, f'--workdir={workdir}', _EVAL_ELSEWHERE, needed_bytes=1 << 20,
                           what='--eval\'s eval.json')


def _write_eval(path: pathlib.Path, result: dict) -> None:
  """eval.json (the newest) and evals.jsonl (every one) in `path`; a full disk is one line that
  says the result printed above is the record (`evaluate` prints it first)."""
  try:
    path.mkdir(parents=True, exist_ok=True)
    _keep_earlier_eval(path)
    fs.write_json_atomic(path / 'eval.json', result)
    metrics_lib.append_row(path / 'evals.jsonl', {**result, 'eval/finished': time.strftime(
        '%Y-%m-%dT%H:%M:%S%z')})
  except OSError as error:
    if not fs.is_disk_full(error):
      raise
    raise DiskFullError(
        f'--eval: the disk of {path} is full ({error.strerror or error}): eval.json and '
        'evals.jsonl were not written; the result printed above is the evaluation\'s record. '
        'Free space there and rerun --eval to record it, or evaluate with another --workdir.'
    ) from error


def _evaluator(config, model_cfg, workdir: pathlib.Path, reader) -> evaluate_lib.Evaluator:
  """The --eval Evaluator of `reader`'s weights, reading the pieces of the planned placement (one
  group of every layer when it is resident); K = 1 if no placement fits the training run (an
  evaluation needs no Adam state, gradients or saved activations). Its forward calls compute
  within eval.working_gb."""
  try:
    _, plan = plan_for(config, workdir, dry_run=False)
    placement = plan.placement
  except planner.NoPlacementFits:
    placement = Placement(params='host', layers_per_group=1, prefetch_depth=1,
                          shard_mb=config.offload.shard_mb)
  groups = (placement.group_slices(model_cfg.num_layers) if placement.streamed
            else [(0, model_cfg.num_layers)])
  return evaluate_lib.Evaluator(reader, model_cfg, groups, placement.vocab_slices(model_cfg),
                                placement.prefetch_depth or 1,
                                working_bytes=int(config.eval.working_gb * 1e9))


def _eval_memory(config, memory: evaluate_lib.EvalMemory, max_len: int, batch_size: int) -> None:
  """Prints how --eval runs its windows and what it holds, refuses what the device cannot hold
  (evaluate.memory_line), and trims the 'tuned' heap above the predicted host peak, as a streamed
  run's (runtime.trim_limit; untrimmed, the heap's holes between the calls' temporaries put a
  152k-vocabulary evaluation at up to 2x): the runtime (planner.runtime_rows, measured here) plus
  the pieces read (host numpy before their copy to the device), or all of `memory` on a CPU
  backend, whose device memory is the host's."""
  hw = hardware.load_profile(config.hardware)
  budget = planner.budgets_for(hw, config.offload, None)['device']
  host_peak = sum(r.bytes for r in planner.runtime_rows(hw, planner.measured_baseline_bytes(hw)))
  host_peak += memory.total if hw.unified_memory else memory.weights
  print(evaluate_lib.memory_line(memory, max_len, batch_size, budget, host_peak), flush=True)
  runtime.configure(config, streamed=True, host_peak_bytes=host_peak)


def _keep_earlier_eval(path: pathlib.Path) -> None:
  """Starts evals.jsonl with the eval.json an earlier version wrote alone (before evals.jsonl
  kept every evaluation), so the next one does not overwrite the only record of it."""
  if (path / 'eval.json').is_file() and not (path / 'evals.jsonl').exists():
    try:
      earlier = json.loads((path / 'eval.json').read_text())
    except (OSError, ValueError):  # unreadable: nothing to keep
      return
    if isinstance(earlier, dict):
      metrics_lib.append_row(path / 'evals.jsonl', earlier)


@_disk_full_is_an_error
def evaluate(config: ml_collections.ConfigDict, workdir: str,
             overrides: Iterable[str] | None = None) -> dict:
  """Perplexity of the newest checkpoint in `workdir` (or of init.from_hf when it has none) on
  eval.path, with sliding windows (evaluate.py); prints it and writes <workdir>/eval.json.
  Forward only: weights are read group by group from the checkpoint; nothing else is written."""
  config, path, meta, checkpoint = _eval_config(config, workdir, overrides)
  model_cfg = config_lib.validate(config)
  max_len = config.eval.max_len or config.train.seq_len
  if max_len > model_cfg.max_seq_len:
    raise ConfigError(f'eval.max_len: {max_len} is longer than the model maximum '
                      f'model.max_seq_len={model_cfg.max_seq_len}; lower eval.max_len.')
  model_cfg, tokenizer = _model_and_tokenizer(config, model_cfg)
  data = evaluate_lib.read_eval_data(config.eval.path, tokenizer, config.data,
                                     document_eos=model_cfg.document_eos_id)
  enable_compilation_cache(config.jax_cache_dir)
  stride = config.eval.stride or max_len
  batch_size = config.eval.batch_size or config.train.batch_size
  with _weights_reader(config, model_cfg, path, meta, checkpoint) as (reader, source):
    evaluator = _evaluator(config, model_cfg, path, reader)
    try:
      _eval_memory(config, evaluator.memory(max_len, batch_size, len(
          evaluate_lib.windows(data.tokens.size, max_len, stride))), max_len, batch_size)
      result = evaluate_lib.perplexity(
          evaluator, data.tokens, max_len, stride, batch_size,
          progress=config.train.progress_bar, mask=data.mask, starts=data.starts)
    finally:
      evaluator.close()
    result = {**result, 'eval/source': source, 'eval/path': str(config.eval.path),
              'eval/document_mask': bool(config.model.document_mask)}
    # Printed before it is written: a write that fails loses no result.
    print(f'eval/loss {result["eval/loss"]:.6f} | eval/perplexity '
          f'{result["eval/perplexity"]:.4f} | eval/tokens {result["eval/tokens"]} | {source} | '
          f'{result["eval/seconds"]:.2f} s '
          f'({result["eval/tokens"] / max(result["eval/seconds"], 1e-9):,.0f} tokens/s)',
          flush=True)
    _write_eval(path, result)
  return result


@_disk_full_is_an_error
def sample(config: ml_collections.ConfigDict, workdir: str,
           overrides: Iterable[str] | None = None) -> dict:
  """Continues sample.prompt with the newest checkpoint in `workdir` (or init.from_hf when it has
  none; sample.py): prints the prompt and its continuation, returns {'sample/prompt',
  'sample/text', 'sample/tokens', 'sample/source'}. Or, with sample.prompts, each prompt of that
  file, written to sample.out as JSONL (`_write_samples`). Reads the weights whole."""
  config, path, meta, checkpoint = _eval_config(config, workdir, overrides, '--sample')
  settings = config.sample
  model_cfg = config_lib.validate(config)
  _check_sample_settings(settings)
  model_cfg, tokenizer = _model_and_tokenizer(config, model_cfg)
  fmt = data_lib.data_format(config.data, tokenizer)
  texts = ([settings.prompt] if settings.prompt else
           data_lib.read_prompts(settings.prompts, config.data.prompt_field))
  prompts = [data_lib.prompt_ids(text, tokenizer, fmt, settings.chat, settings.system)
             for text in texts]
  stops = data_lib.stop_ids(tokenizer, fmt)
  sampling = _sampling(config, tokenizer, overrides)
  longest = sample_lib.check_request(model_cfg, prompts, settings.max_new_tokens,
                                     sampling['top_p'], sampling['repetition_penalty'])
  rows = min(settings.batch_size, len(prompts))
  weights_gb = sample_lib.device_bytes(model_cfg, longest, rows) / 1e9
  device_gb = hardware.load_profile(config.hardware).device_memory_gb
  if weights_gb > 0.8 * device_gb:
    raise ConfigError(f'--sample holds the weights whole in device memory, with its key/value '
                      f'cache: {weights_gb:.1f} GB of {device_gb:.0f} GB '
                      f'({config.hardware or "this machine"}). Export the model (--export_hf) '
                      'and generate with a serving stack instead.')
  with _weights_reader(config, model_cfg, path, meta, checkpoint) as (reader, source):
    # Built on the device leaf by leaf (one host piece at a time), as a restore builds them.
    params = reader.device_state({'params': model_lib.abstract_params(model_cfg)})['params']
  outputs = sample_lib.generate_all(model_cfg, params, prompts,
                                    max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                                    eos_id=stops, batch_size=rows, **sampling)
  completions = [_completion(tokenizer, prompt, ids, stops)
                 for prompt, ids in zip(prompts, outputs)]
  if settings.prompts:
    return _write_samples(settings.out, texts, completions, source)
  text, tokens, stopped = completions[0]
  # A chat prompt is the user's turn and the text the assistant's reply: not one running text.
  print(f'{settings.prompt}{chr(10) * settings.chat}{text}', flush=True)
  # What ended it: a continuation that is empty or short reads as a failure without this line.
  end = (f'the model wrote {tokenizer.decode(outputs[0][-1:])!r}, a stop id' if stopped else
         f'sample.max_new_tokens={settings.max_new_tokens}')
  print(f'[{tokens - stopped} new token{"s" * (tokens - stopped != 1)}; {end}]', flush=True)
  return {'sample/prompt': settings.prompt, 'sample/text': text, 'sample/tokens': tokens,
          'sample/source': source}


def _completion(tokenizer, prompt: list, ids: np.ndarray, stops) -> tuple[str, int, bool]:
  """(text, tokens, stopped) of `ids` generated after `prompt`: the text without the stop id
  that ended it, as it reads after the prompt's (data.decode_continuation)."""
  stopped = bool(ids.size and ids[-1] in stops)
  text = data_lib.decode_continuation(tokenizer, prompt, ids[:-1] if stopped else ids)
  return text, int(ids.size), stopped


def _check_sample_settings(settings) -> None:
  """The sample section's own checks, before anything is read or loaded."""
  if bool(settings.prompt) == bool(settings.prompts):
    raise ConfigError('sample.prompt and sample.prompts: set one, the text to continue '
                      '(--config.sample.prompt="...") or a file of prompts (one per line, or '
                      'JSONL records).' if settings.prompt else
                      'sample.prompt is empty: pass --config.sample.prompt="<text to continue>" '
                      '(or sample.prompts, a file of them).')
  if settings.system and not settings.chat:
    raise ConfigError('sample.system is a chat turn: set sample.chat=True too (or put the text '
                      'into sample.prompt).')
  if settings.prompts and not settings.out:
    raise ConfigError('sample.prompts needs sample.out: the JSONL file to write the '
                      'continuations to (--config.sample.out=samples.jsonl).')
  if settings.prompts and not pathlib.Path(settings.out).expanduser().absolute().parent.is_dir():
    raise ConfigError(f'sample.out={settings.out!r}: its directory does not exist; create it or '
                      'write elsewhere.')
  if settings.prompts:  # before the generation, whose output would be lost
    fs.check_writable(pathlib.Path(settings.out).expanduser().absolute().parent,
                      f'sample.out={settings.out!r}', 'Write it elsewhere.', needed_bytes=1 << 20,
                      what='sample.out')
  for field in ('temperature', 'top_k'):
    if settings[field] < 0:
      raise ConfigError(f'sample.{field}={settings[field]} must be >= 0.')
  if settings.batch_size < 1:
    raise ConfigError(f'sample.batch_size={settings.batch_size} must be >= 1.')
  if not 0 < settings.top_p <= 1:
    raise ConfigError(f'sample.top_p={settings.top_p} must be in (0, 1] (1 = off).')
  if not settings.repetition_penalty > 0:
    raise ConfigError(f'sample.repetition_penalty={settings.repetition_penalty} must be > 0 '
                      '(1 = off).')


SAMPLING_FIELDS = ('temperature', 'top_k', 'top_p', 'repetition_penalty')


def _sampling(config, tokenizer, overrides) -> dict:
  """{field: value} of SAMPLING_FIELDS as --sample applies them, as transformers' `generate`
  does: those set on the command line (`overrides`; None: those that differ from
  configs/default.py), the rest from a generation_config.json beside the tokenizer
  (data.sampling_defaults), else the config's. Printed with where they came from."""
  settings = config.sample
  if overrides is not None:
    chosen = {key.split('.', 1)[1] for key in overrides if key.startswith('sample.')}
  else:
    default = config_lib.load_config('default').sample
    chosen = {field for field in SAMPLING_FIELDS if settings[field] != default[field]}
  adopted, path = data_lib.sampling_defaults(tokenizer, chosen)
  values = {field: adopted.get(field, settings[field]) for field in SAMPLING_FIELDS}
  shown = ['temperature'] + [field for field in SAMPLING_FIELDS[1:3] if values['temperature']]
  shown += ['repetition_penalty'] * (values['repetition_penalty'] != 1)
  described = ', '.join(f'{field} {values[field]:g}' for field in shown)
  if values['temperature'] == 0:
    described = described.replace('temperature 0', 'greedy')
  from_file = [field for field in shown if field in adopted]  # the rest: command line or config
  source = (f' ({", ".join(from_file)} as {path} asks, where the command line is silent)'
            if from_file else '')
  print(f'sampling: {described}{source}', flush=True)
  return values


def _write_samples(out: str, prompts: list, completions: list, source: str) -> dict:
  """sample.out (atomically): a JSON line per prompt, in order: {"prompt" (its text or
  messages), "completion", "tokens" (written, a stop id included), "stopped" (at a stop id, not
  at sample.max_new_tokens)}."""
  rows = [{'prompt': prompt, 'completion': text, 'tokens': tokens, 'stopped': stopped}
          for prompt, (text, tokens, stopped) in zip(prompts, completions)]
  path = pathlib.Path(out).expanduser()
  text = ''.join(json.dumps(row, ensure_ascii=False) + '\n' for row in rows)
  try:
    fs.write_text_atomic(path, text)
  except OSError as error:
    print(text, end='', flush=True)  # the continuations, which took the whole generation
    raise (DiskFullError if fs.is_disk_full(error) else ConfigError)(
        f'sample.out={out!r}: {path} could not be written ({error.strerror or error}); its JSON '
        'lines are printed above. Free space there, or write it elsewhere.') from error
  total = sum(row['tokens'] for row in rows)
  print(f'--sample: {len(rows)} prompts continued, {total:,} tokens written -> {path}', flush=True)
  return {'sample/prompts': len(rows), 'sample/tokens': total, 'sample/out': str(path),
          'sample/source': source}


@_disk_full_is_an_error
def export_hf(config: ml_collections.ConfigDict, workdir: str, out_dir: str) -> list:
  """Writes the newest checkpoint in `workdir` as a Hugging Face checkpoint in `out_dir` (new or
  empty; export.py): sharded safetensors, config.json, the run's tokenizer files. Returns the
  files written."""
  config_lib.validate(config)  # the export section
  out = export_lib.check_destination(out_dir)
  path = config_lib.check_run_readable(workdir)  # it writes nothing there
  meta = runs.newest_checkpoint_meta(path)
  if meta is None:
    raise ConfigError(f'--export_hf: {path} holds no checkpoint to export. Pass the --workdir of '
                      'a run that has saved one (checkpoints/<step>/).')
  model_cfg = model_lib.ModelConfig(**meta['model_config'])
  export_lib.check_destination(out_dir, export_lib.export_bytes(model_cfg, config.export.dtype))
  tokenizer = runs.run_data_field(path, 'tokenizer') or 'byte'
  if tokenizer != 'byte' and not pathlib.Path(tokenizer).exists():
    raise ConfigError(f'--export_hf: the run\'s tokenizer {tokenizer} (data.tokenizer in '
                      f'{path / "config.json"}) does not exist any more, and an export without it '
                      'cannot be read: put it back there, then export again.')
  with _run_checkpoint(config, path, model_cfg) as reader:
    files = export_lib.export(reader, model_cfg, out, dtype=config.export.dtype,
                              max_shard_bytes=int(config.export.max_shard_gb * 1e9),
                              tokenizer=tokenizer,
                              chat_template=runs.run_data_field(path, 'chat_template') or '',
                              eos_token=runs.run_data_field(path, 'eos_token') or '')
  print(f'exported step {reader.meta["step"]} of {path} to {out}: '
        f'{", ".join(f.name for f in files)}', flush=True)
  return files
