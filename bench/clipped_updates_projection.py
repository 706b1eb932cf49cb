"""Projection: what running a clipped step's layer updates in the next forward buys, per plan.

    python bench/clipped_updates_projection.py      # ~1 min, no accelerator needed

With exact clipping (train.grad_clip > 0) no layer update may run before the global norm is known.
Until 2026-12-05 the streamed engine then ran every group's update as a phase of its own after the
backward; now each waits for the next step's forward and runs just ahead of its group there
(engine/updates.PendingUpdates), its transfers and disk I/O beside the forward's compute. For the
plan the planner chooses now (one H100 preset, host RAM and drives as in bench/projection.py,
every placement field auto, train.microbatches = 0, checkpoint.keep = 1), this prints:

  new engine  the planner's step time: two phases, the forward's (its share of the compute
              against its own and the updates' transfers, disk I/O and host optimizer) and the
              rest's (planner._step_time);
  old engine  the same plan with the updates as a serial phase after the backward, priced the
              same way from its own per-stage traffic: this tree's stages, plus what the change
              removed (the device optimizer's third fetch of the weights; the host optimizer's
              forward read of NVMe-resident weights, which now come from the update's output):
                max(compute, the other stages' h2d, d2h, disk)
                + max(optimizer, the update stage's h2d, d2h, disk) + fill + dispatch

Both are predictions from the presets in megatrain_jax/hardware.py, not measurements (no GPU has
run either engine yet: bench/gpu_host_tier.py is ready for one). Before this change the planner
priced the old engine's update phase as half of the step's copies and disk I/O whatever they were;
for the host optimizer with the Adam state on NVMe all of the disk traffic is the update's, so
that figure was optimistic (101b, 0.5 TB, 2 drives: 1,360 s predicted; 1,489 s per phase here).
"""

import dataclasses
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax import config as config_lib  # pylint: disable=wrong-import-position
from megatrain_jax import hardware  # pylint: disable=wrong-import-position
from megatrain_jax import planner  # pylint: disable=wrong-import-position
from megatrain_jax.model import ModelConfig  # pylint: disable=wrong-import-position
from megatrain_jax.schedule import StepSchedule, Traffic, hidden_bytes  # pylint: disable=wrong-import-position

_GB = 1e9
DRIVE_GB = 7680  # as bench/projection.py
# (model, host RAM in GB, drives): the rows of bench/projection.py where the NVMe tier carries
# the update's traffic.
CASES = [('70b', 512, 1), ('70b', 512, 2), ('101b', 512, 1), ('101b', 512, 2), ('101b', 512, 4),
         ('101b', 1024, 2), ('405b', 512, 2), ('405b', 512, 4)]


def old_engine_step(plan: planner.Plan, config, hw) -> float:
  """The step of `plan` with its clipped updates as a serial phase after the backward."""
  p, micro = plan.placement, plan.microbatches
  cfg = ModelConfig.from_config_dict(config.model)
  sizes = planner.state_sizes(cfg, planner.train_key(config.train))
  schedule = StepSchedule(p, cfg, micro, clipping=True)
  stages = schedule.traffic(sizes, hidden_bytes(cfg, plan.batch_size, plan.seq_len))
  weights = sizes.group_params(cfg.num_layers)
  on_disk = p.params == 'nvme'
  if not schedule.host_optimizer and p.params != 'device':  # the weights fetched a third time
    stages['update'] += Traffic(h2d=weights, read=weights * on_disk)
  if schedule.host_optimizer and on_disk:  # the forward read them from NVMe
    stages['forward'] += Traffic(read=weights)
  cached = planner._disk_cached(plan.rows, hw, plan.budgets, 1)  # pylint: disable=protected-access
  read_rate = planner._read_rate(hw, cached)  # pylint: disable=protected-access
  write_rate = planner._write_rate(hw, cached)  # pylint: disable=protected-access
  seconds = lambda t: max(t.h2d / (hw.h2d_gbps * _GB), t.d2h / (hw.d2h_gbps * _GB),
                          t.read / read_rate + t.write / write_rate)
  update = seconds(stages['update'])
  rest = seconds(sum((t for stage, t in stages.items() if stage != 'update'), Traffic()))
  group = sizes.group_params(p.layers_per_group)
  fill = 2 * (group / (hw.h2d_gbps * _GB) + (group / read_rate if on_disk else 0))
  times = plan.times
  return (max(times['compute'], rest) + max(times['optimizer'], update) + fill
          + times['dispatch'])


def main() -> None:
  print('| model | host RAM | drives | placement | M | old engine step (s) | new engine step (s) '
        '| old / new |')
  print('|---|---|---|---|---|---|---|---|')
  for model, ram, drives in CASES:
    config = config_lib.load_config(model, hardware='h100', train__microbatches=0,
                                    checkpoint__keep=1)
    hw = dataclasses.replace(hardware.load_profile('h100'), host_memory_gb=float(ram),
                             disks=drives, disk_gb=float(drives * DRIVE_GB))
    plan = planner.plan_run(config, hw, disk_free_gb=hw.disk_gb, devices=planner.Devices())
    old = old_engine_step(plan, config, hw)
    print(f'| {model} | {ram / 1024:g} TB | {drives} | {plan.placement.summary()} | '
          f'{plan.microbatches} | {old:,.0f} | {plan.step_time_s:,.0f} | '
          f'{old / plan.step_time_s:.2f} |', flush=True)


if __name__ == '__main__':
  main()
