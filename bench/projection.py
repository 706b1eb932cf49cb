"""Projection (issue 5): what the planner predicts for 7B-405B on one H100 or H200, in FP32.

For each model config (configs/7b.py ... 405b.py), GPU preset (hardware.py: datasheet figures,
70% of FP32 peak achieved, 80% of PCIe Gen5 x16, 6.8 GB/s read / 4.0 GB/s write per NVMe drive,
host AdamW at 100 GB/s) and machine (host RAM 0.5 / 1 / 2 TB, 1 / 2 / 4 drives of 7.68 TB striped),
the planner chooses the fastest placement that fits (offload.* = auto, train.microbatches = 0:
up to 64 microbatches of the config's batch_size x seq_len) and predicts its step time.
Assumptions stated in the output: precision 'highest' (true FP32 matmuls: no TF32), remat full,
checkpoint.keep = 1 (each kept checkpoint pins one copy of the NVMe stores), and the pinned host
limit raised to the RAM (megatrain_jax does this unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is set).

Then it works out, from the same formulas, what "1-2 iterations per second for 101B on one H100"
would require, and what 405B takes on 1, 2, 4 and 8 H100s / H200s (issue 13: the state sharded
over the GPUs ZeRO-3 style, one sequence per GPU per microbatch, collectives over NVLink at the
presets' 80% of 450 GB/s per direction), either all in one machine (one process: the GPUs share its
2 TB of RAM, its 4 drives and its CPU's host AdamW) or one GPU in each of N such machines (the
collectives then cross a 400 Gb/s InfiniBand adapter per GPU, at 80%: 40 GB/s).

  python bench/projection.py > projection.md     # ~12 min on the 2-core VM, no accelerator needed
  python bench/projection.py 405b                # only the named models
  python bench/projection.py --devices           # only 405B on 1-8 GPUs
"""

import argparse
import dataclasses
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatrain_jax import config as config_lib  # pylint: disable=wrong-import-position
from megatrain_jax import hardware  # pylint: disable=wrong-import-position
from megatrain_jax import planner  # pylint: disable=wrong-import-position
from megatrain_jax.model import ModelConfig  # pylint: disable=wrong-import-position

MODELS = ('7b', '13b', '70b', '101b', '405b')
GPUS = ('h100', 'h200')
RAM_GB = (512, 1024, 2048)
DRIVES = (1, 2, 4)
DRIVE_GB = 7680
DEVICE_COUNTS = (1, 2, 4, 8)
MACHINE_RAM_GB, MACHINE_DRIVES = 2048, 4  # each machine of the N-GPU rows
NIC_GBPS = 50.0  # GB/s each way of a 400 Gb/s InfiniBand NDR adapter, one per GPU (as DGX H100)


def short(plan: planner.Plan) -> str:
  p = plan.placement
  if not p.streamed:
    return 'resident'
  return (f'W:{p.params} A:{p.opt_state} act:{p.activations} opt:{p.optimizer_on} '
          f'K={p.layers_per_group}')


def project(model: str, gpu: str, ram: int, drives: int):
  config = config_lib.load_config(model, hardware=gpu, train__microbatches=0, checkpoint__keep=1)
  hw = dataclasses.replace(hardware.load_profile(gpu), host_memory_gb=float(ram), disks=drives,
                           disk_gb=float(drives * DRIVE_GB))
  try:
    return config, planner.plan_run(config, hw, disk_free_gb=hw.disk_gb,
                                    devices=planner.Devices())  # one GPU, whatever is visible
  except planner.NoPlacementFits as refused:
    return config, refused


def project_devices(gpu: str, n: int, one_machine: bool):
  """405B on `n` GPUs: one machine (one process drives them all) or one GPU per machine."""
  config = config_lib.load_config('405b', hardware=gpu, train__microbatches=0, checkpoint__keep=1,
                                  parallel__devices=n, train__batch_size=n)
  hw = dataclasses.replace(hardware.load_profile(gpu), host_memory_gb=float(MACHINE_RAM_GB),
                           disks=MACHINE_DRIVES, disk_gb=float(MACHINE_DRIVES * DRIVE_GB))
  if not one_machine:  # the collectives leave the machine: a 400 Gb/s NIC per GPU, at 80%
    hw = dataclasses.replace(hw, interconnect_gbps=0.8 * NIC_GBPS,
                             interconnect='InfiniBand NDR (400 Gb/s per GPU)')
  devices = planner.Devices(n, n if one_machine else 1)
  try:
    return planner.plan_run(config, hw, disk_free_gb=hw.disk_gb, devices=devices)
  except planner.NoPlacementFits as refused:
    return refused


def devices_table() -> list:
  """Markdown rows: 405B on 1, 2, 4, 8 H100 / H200, one machine or one GPU per machine."""
  lines = ['| GPUs | machines | placement | M | device GB per GPU | host GB per machine | NVMe GB '
           'per machine | step (s) | tokens/s | MFU | collectives (s) | bottleneck | days per 1B '
           'tokens |', '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for gpu in GPUS:
    for n in DEVICE_COUNTS:
      for one_machine in ((True,) if n == 1 else (True, False)):
        plan = project_devices(gpu, n, one_machine)
        cells = [f'{n} x {gpu.upper()}', '1' if one_machine else f'{n} (1 GPU each)']
        if isinstance(plan, planner.NoPlacementFits):
          over = ', '.join(f'{t} {a / 1e9:,.0f}/{b / 1e9:,.0f} GB'
                           for t, (a, b) in plan.closest.over_budget().items())
          cells += [f'fits nowhere (closest over: {over})'] + [''] * 10
        else:
          cells += [short(plan), str(plan.microbatches), f'{plan.used("device") / 1e9:,.1f}',
                    f'{plan.used("host") / 1e9:,.0f}', f'{plan.used("nvme") / 1e9:,.0f}',
                    f'{plan.step_time_s:,.1f}', f'{plan.tokens_per_s:,.1f}',
                    f'{100 * plan.mfu:.0f}%', f'{plan.times.get("interconnect", 0.0):,.1f}',
                    plan.bottleneck, f'{1e9 / plan.tokens_per_s / 86400:,.1f}']
        lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def requirements_for_101b(rates=(1.0, 2.0)) -> list:
  """What 1-2 it/s for 101B on one H100 needs, per resource, with the planner's own formulas."""
  config = config_lib.load_config('101b')
  cfg = ModelConfig.from_config_dict(config.model)
  h100 = hardware.PRESETS['h100']
  seq = config.train.seq_len
  lines = []
  params_gb = 4 * cfg.num_params / 1e9
  # Smallest iteration: one sequence (batch 1, one microbatch). Streaming K=1 with full remat.
  placement = planner.Placement(params='host', opt_state='host', layers_per_group=1)
  executed, model_flops = planner.step_flops(cfg, placement, 1, 1, seq)
  lines.append(f'101B = {cfg.num_params / 1e9:.1f}e9 params; FP32 weights {params_gb:,.0f} GB, '
               f'training state (weights, grads, Adam m, v) {4 * params_gb:,.0f} GB; one H100 '
               f'has {h100.device_memory_gb:.0f} GB, so every weight crosses PCIe at least twice '
               'per iteration (forward, backward).')
  lines.append('')
  lines.append('| per iteration of 1 sequence x 4096 tokens | needed at 1 it/s | at 2 it/s | '
               'one H100 (preset) | shortfall at 1 it/s |')
  lines.append('|---|---|---|---|---|')
  fp32 = h100.peak_tflops['float32']
  bf16 = h100.peak_tflops['bfloat16']
  rows = [
      ('FP32 compute (TFLOP/s; executed, with remat)', executed / 1e12, fp32,
       f'datasheet peak {fp32:g}; BF16 dense peak {bf16:g}'),
      ('host -> device weights (GB/s; 2 passes)', 2 * params_gb, h100.h2d_gbps, 'PCIe Gen5 x16'),
      ('AdamW over all params (Gparam/s)', cfg.num_params / 1e9, h100.host_adam_gparams,
       'host, 100 GB/s / 28 B'),
  ]
  for name, need, have, note in rows:
    lines.append(f'| {name} | {need * rates[0]:,.0f} | {need * rates[1]:,.0f} | {have:,.1f} '
                 f'({note}) | {need * rates[0] / have:,.0f}x |')
  lines.append('')
  lines.append(f'Model FLOPs alone (6·N·T + attention, no recompute) for one 4096-token sequence: '
               f'{model_flops / 1e15:.2f} PFLOP. At 1 it/s that is {model_flops / 1e12 / bf16:.1f}x '
               f'the H100\'s dense BF16 peak and {model_flops / 1e12 / fp32:.0f}x its FP32 peak, '
               'before any offloading cost.')
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('models', nargs='*', help=f'model configs (default: {", ".join(MODELS)})')
  parser.add_argument('--devices', action='store_true', help='only 405B on 1, 2, 4, 8 GPUs')
  args = parser.parse_args()
  started = time.perf_counter()
  if not args.devices:
    one_gpu_table(tuple(args.models) or MODELS)
    print()
    print('\n'.join(requirements_for_101b()))
    print()
  print('\n'.join(devices_table()))
  print(f'\n({time.perf_counter() - started:.0f} s)')


def one_gpu_table(models: tuple) -> None:
  print('| model | GPU | host RAM | NVMe drives | placement (W params, A Adam, act activations, '
        'opt optimizer on, K layers/group) | M | step (s) | tokens/s | MFU | bottleneck | '
        'days per 1B tokens |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for model in models:
    for gpu in GPUS:
      for ram in RAM_GB:
        for drives in DRIVES:
          config, plan = project(model, gpu, ram, drives)
          cells = [model, gpu.upper(), f'{ram / 1024:g} TB', str(drives)]
          if isinstance(plan, planner.NoPlacementFits):
            over = ', '.join(f'{t} {n / 1e9:,.0f}/{a / 1e9:,.0f} GB'
                             for t, (n, a) in plan.closest.over_budget().items())
            cells += [f'fits nowhere (closest over: {over})', '', '', '', '', '', '']
          else:
            days = 1e9 / plan.tokens_per_s / 86400
            cells += [short(plan), str(plan.microbatches), f'{plan.step_time_s:,.1f}',
                      f'{plan.tokens_per_s:,.0f}', f'{100 * plan.mfu:.0f}%', plan.bottleneck,
                      f'{days:,.1f}']
          print('| ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
  main()
