"""The calibration probe: measures this machine for the planner (`python launch.py --calibrate`).

It times what the engines run (scanned decoder layers with remat, copies between memory kinds,
AdamW on the device and on the host, TensorStore reads and writes, one jitted call, and with more
than one device visible the all-gather that gathers a sharded group) and returns a
`hardware.HardwareProfile` whose figures the planner uses instead of a preset's.
"""

import os
import pathlib
import shutil
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from megatrain_jax import model as model_lib
from megatrain_jax import layout as layout_lib
from megatrain_jax import optim
from megatrain_jax.hardware import (CALIBRATION_VERSION, PRESETS, HardwareProfile,
                                    device_memory_gb, machine_memory_gb, preset_for)
from megatrain_jax.runtime import process_rss_bytes
from megatrain_jax.tiers import codecs, nvme

_GB = 1e9


def _best_time(fn, repeats: int, budget_s: float) -> float:
  """Fastest of `repeats` runs (after one warm-up), stopping early past `budget_s`."""
  fn()
  best, spent = float('inf'), 0.0
  for _ in range(repeats):
    started = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - started
    best, spent = min(best, elapsed), spent + elapsed
    if spent > budget_s:
      break
  return best


def _layer_tflops(d_model: int, tokens: int) -> float:
  """Achieved TFLOP/s of decoder layers as the engines run them: a scanned group of 2 layers,
  full remat, forward + backward (float32, precision highest), counting the recomputed forward
  (4 x the layer forward FLOPs, as planner.step_flops does). Timing remat'd, scanned layers rather
  than one bare layer matters: on XLA:CPU the bare layer reads ~15% slower per FLOP."""
  seq, layers = 256, 2
  cfg = model_lib.ModelConfig(vocab_size=256, d_model=d_model, num_layers=layers,
                              num_heads=max(1, d_model // 64), num_kv_heads=max(1, d_model // 128),
                              d_ff=int(8 * d_model / 3) // 64 * 64, max_seq_len=seq, remat='full')
  params = model_lib.init_layers(cfg, jax.random.key(0), 0, layers)
  x = jax.random.normal(jax.random.key(1), (tokens // seq, seq, d_model), jnp.float32)
  positions = model_lib.default_positions(x[..., 0].astype(jnp.int32))

  @jax.jit
  def fwd_bwd(p, h):
    return jax.grad(lambda p, h: jnp.sum(model_lib.apply_group(cfg, p, h, positions)),
                    argnums=(0, 1))(p, h)

  seconds = _best_time(lambda: jax.block_until_ready(fwd_bwd(params, x)), 5, 3.0)
  # The forward the layers execute, 4 times: forward, backward (2x) and the remat'd forward.
  flops = tokens * layers * cfg.layer_forward_flops(seq) * 4
  return flops / seconds / 1e12


def _adam_gparams(memory_kind: str, n: int) -> float:
  """AdamW as the engines run it, jitted with donated state, on `n` float32 params: on the device
  (optim.apply_adamw: one pass over p, g, m, v where XLA fuses it), or of pinned-host trees on the
  host CPU (`memory_kind` 'pinned_host': optim.host_adamw, the engine's host update, its outputs
  pinned). The state is made on the device and moved: optax's init of pinned-host params made
  device buffers under a pinned-host sharding, which JAX refuses."""
  tx = optim.make_optimizer(types.SimpleNamespace(lr=1e-3, warmup_steps=1, steps=1000,
                                                  min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                                                  weight_decay=0.1))
  params = {'kernel': jnp.ones((n,), jnp.float32)}  # a decayed leaf
  grads = {'kernel': jnp.full((n,), 1e-3, jnp.float32)}
  sharding = layout_lib.Layout.single_device().sharding(memory_kind)
  state = jax.device_put([params, tx.init(params)], sharding)
  grads = jax.device_put(grads, sharding)
  if memory_kind == 'device':
    update = jax.jit(lambda p, s, g: optim.apply_adamw(tx, g, s, p), donate_argnums=(0, 1))
  else:
    update = jax.jit(lambda p, s, g: optim.host_adamw(tx, g, s, p), donate_argnums=(0, 1),
                     out_shardings=jax.tree.map(lambda _: sharding, tuple(state)))

  def run():
    state[0], state[1] = update(state[0], state[1], grads)
    jax.block_until_ready(state[0])
  return n / _best_time(run, 5, 3.0) / 1e9


def _copy_gbps(src_kind: str, dst_kind: str, nbytes: int) -> float:
  src = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32),
                       layout_lib.Layout.single_device().sharding(src_kind))
  dst = layout_lib.Layout.single_device().sharding(dst_kind)
  return nbytes / _best_time(lambda: jax.block_until_ready(jax.device_put(src, dst)), 5, 2.0) / _GB


def _interconnect_gbps(nbytes: int, devices=None) -> float | None:
  """Bus bandwidth (GB/s per device and direction) of an all-gather over `devices` (default: this
  process's), as the engines' jitted group functions run one: a float32 array of `nbytes` split
  over the devices (Layout.split_along), gathered whole onto every device (GSPMD inserts the
  all-gather). A ring moves (N - 1)/N of the bytes into each device, so that over the time is the
  rate the planner divides by. None with one device: there is nothing to gather."""
  devices = list(jax.local_devices() if devices is None else devices)
  n = len(devices)
  if n < 2:
    return None
  layout = layout_lib.Layout.for_devices(devices)
  x = jax.device_put(jnp.ones((n * max(1, nbytes // 4 // n),), jnp.float32), layout.split_along(0))
  gather = jax.jit(lambda a: a * 1.0, out_shardings=layout.replicated())  # [n·k] -> whole on all
  seconds = _best_time(lambda: jax.block_until_ready(gather(x)), 5, 2.0)
  return (n - 1) / n * x.nbytes / seconds / _GB


def _dispatch_s() -> float:
  add = jax.jit(lambda a: a + 1)
  x = jnp.ones((8,), jnp.float32)
  jax.block_until_ready(add(x))
  started = time.perf_counter()
  for _ in range(200):
    x = add(x)
  jax.block_until_ready(x)
  return (time.perf_counter() - started) / 200


def _drop_cached_pages(directory: pathlib.Path) -> None:
  """Evicts the files' clean pages (posix_fadvise DONTNEED; no root needed)."""
  for path in directory.rglob('*'):
    if path.is_file():
      fd = os.open(path, os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _disk_gbps(directory: pathlib.Path, nbytes: int) -> tuple[float, float, float, float]:
  """(write + fsync, cold read, cached read, cached write) GB/s of the NVMe tier's own layout
  (tiers/codecs.py)."""
  layers = 8
  layer = np.random.default_rng(0).standard_normal((nbytes // layers // 4 // 1024, 1024),
                                                   dtype=np.float32)
  path = directory / 'probe'
  spec = codecs.array_spec(str(path), (layers, *layer.shape))
  array = ts.open(spec, create=True, delete_existing=True, context=nvme.live_context()).result()
  def write_all():
    for w in [array[i:i + 1].write(layer[None]) for i in range(layers)]:
      w.result()
  started = time.perf_counter()
  write_all()
  _drop_cached_pages(path)  # fsync: what the disk sustains once the page cache must flush
  write_s = time.perf_counter() - started

  def read_all(in_flight=2):
    for i in range(0, layers, in_flight):
      for f in [array[j:j + 1].read() for j in range(i, min(i + in_flight, layers))]:
        f.result()
  started = time.perf_counter()
  read_all()
  cold_s = time.perf_counter() - started
  cached_s = _best_time(read_all, 3, 2.0)
  cached_write_s = _best_time(write_all, 3, 2.0)
  shutil.rmtree(path, ignore_errors=True)
  actual = layers * layer.nbytes
  return tuple(actual / s / _GB for s in (write_s, cold_s, cached_s, cached_write_s))


# What the disk probe writes into offload.dir (removed afterwards): enough to outrun a disk cache.
DISK_PROBE_BYTES = 256 << 20


def _remove_probe(probe_dir: pathlib.Path, made: list) -> None:
  """Removes the disk probe's directory and the directories made for it (`made`, innermost
  first) while they are empty: a calibration leaves no <workdir>/offload behind."""
  shutil.rmtree(probe_dir, ignore_errors=True)
  for path in made[1:]:
    try:
      path.rmdir()
    except OSError:  # not empty: something else is there now
      break


def calibrate(directory: str, log=print) -> HardwareProfile:
  """Measures this machine (about 30-60 s) and returns its profile. `directory`: where the disk
  probe writes (the NVMe tier's directory; ~256 MB, removed afterwards)."""
  device = layout_lib.default_devices()[0]
  cpu = device.platform == 'cpu'
  # This process before any probe allocates: the runtime baseline a plan for another machine
  # reads from the profile (a plan on this machine measures its own process instead).
  baseline = process_rss_bytes()
  known = PRESETS['cpu'] if cpu else PRESETS.get(preset_for(device.device_kind) or '')
  probe_dir = pathlib.Path(directory).expanduser() / '.calibrate'
  # The directories mkdir makes (innermost first), removed again if empty: a calibration leaves
  # no <workdir>/offload behind.
  made = [path for path in (probe_dir, *probe_dir.parents) if not path.exists()]
  probe_dir.mkdir(parents=True, exist_ok=True)
  started = time.perf_counter()
  try:
    compute = {f'float32@{d}': _layer_tflops(d, tokens=2048) for d in (256, 512, 1024)}
    log('  decoder layer fwd+bwd (float32, highest): '
        + ', '.join(f'd={k.split("@")[1]}: {v:.3f} TFLOP/s' for k, v in compute.items()))
    h2d = _copy_gbps('pinned_host', 'device', 256 << 20)
    d2h = _copy_gbps('device', 'pinned_host', 256 << 20)
    log(f'  host->device {h2d:.1f} GB/s, device->host {d2h:.1f} GB/s')
    device_adam = _adam_gparams('device', 32 << 20)
    host_adam = device_adam if cpu else _adam_gparams('pinned_host', 32 << 20)
    log(f'  AdamW: device {device_adam:.2f} Gparam/s, host {host_adam:.2f} Gparam/s')
    write, cold, cached, cached_write = _disk_gbps(probe_dir, DISK_PROBE_BYTES)
    log(f'  disk at {directory}: write + fsync {write:.2f} GB/s, read cold {cold:.2f} GB/s; '
        f'through the page cache: read {cached:.2f} GB/s, write {cached_write:.2f} GB/s')
    dispatch = _dispatch_s()
    log(f'  dispatch {dispatch * 1e6:.0f} us per jitted call')
    interconnect = _interconnect_gbps(256 << 20)
    log(f'  all-gather over {jax.local_device_count()} devices: {interconnect:.1f} GB/s per device'
        if interconnect else '  interconnect: one device visible, not measured (the planner '
        'assumes the host link for more)')
  finally:
    _remove_probe(probe_dir, made)
  profile = HardwareProfile(
      name=f'calibrated-{device.device_kind}', device_kind=device.device_kind,
      calibration_version=CALIBRATION_VERSION,
      device_memory_gb=machine_memory_gb() if cpu else device_memory_gb(),
      host_memory_gb=machine_memory_gb(), disk_gb=0.0, compute_tflops=compute,
      h2d_gbps=h2d, d2h_gbps=d2h, disk_read_gbps=cold, disk_write_gbps=write, disks=1,
      device_adam_gparams=device_adam, host_adam_gparams=host_adam, dispatch_s=dispatch,
      overlap=not cpu, unified_memory=cpu, disk_read_cached_gbps=cached,
      disk_write_cached_gbps=cached_write, host_cores=len(os.sched_getaffinity(0)),
      interconnect_gbps=interconnect,
      **({'runtime_host_gb': round(baseline / 1e9, 3)} if baseline else {}),
      # Not measured by the probe (it needs a training run): the preset's figure for this kind.
      **({'programs_host_gb': known.programs_host_gb} if known else {}),
      interconnect=f'all-gather over {jax.local_device_count()} devices' if interconnect else '',
      # MFU stays relative to the datasheet peak on known accelerators, not to the measured rate.
      peak_tflops=(dict(PRESETS[preset_for(device.device_kind)].peak_tflops)
                   if preset_for(device.device_kind) else {}),
      source=f'calibrated on {os.uname().nodename} at {time.strftime("%Y-%m-%d %H:%M:%S")} '
             f'in {time.perf_counter() - started:.0f} s')
  return profile
