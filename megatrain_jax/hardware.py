"""Hardware profiles: the sizes and rates the planner (planner.py) predicts a run from.

A profile is either a preset (datasheet figures of a known machine, plus stated assumptions) or
a file written by the calibration probe (`python launch.py --calibrate`), which measures this
machine. `config.hardware` picks one: a preset name, a path to a profile JSON, or '' (auto: the
calibrated profile in ~/.cache/megatrain_jax/hardware.json if it was made on this kind of device,
else the preset matching the device, else the CPU preset).

Units: bytes and seconds; rates in GB/s (1e9 B/s), TFLOP/s (1e12) and Gparam/s (1e9 params/s).

Where a preset's figure is not a datasheet number it is an assumption, and says so:
  * `compute_tflops` is what whole decoder layers achieve (forward + backward), taken as 70% of
    the dense datasheet peak for the precision. Calibrated profiles measure it on real layers.
  * host<->device copies from pinned memory reach ~80% of the PCIe link (Gen5 x16: 64 GB/s,
    Gen4 x16: 32 GB/s per direction).
  * `disk_*` are per drive (PCIe Gen4 data-centre NVMe, e.g. 6.8 GB/s read, 4.0 GB/s write);
    `disks` drives are striped (RAID-0 or one store per drive), so rates add.
  * `interconnect_gbps` is the device-to-device link the collectives of N > 1 devices use
    (all-gather of weights, reduce-scatter of gradients), per device and direction, at 80% of the
    datasheet link rate (as for PCIe copies). Datasheets give NVLink as the total of both
    directions per GPU: H100 SXM5 and H200 SXM NVLink 4, 900 GB/s (450 each way); A100 SXM4
    NVLink 3, 600 GB/s (300 each way). The RTX 4090 has no NVLink (and GeForce cards no PCIe
    peer-to-peer): its collectives go through host memory over the same PCIe Gen4 x16 link
    (32 GB/s each way) as the host copies, so the planner adds them to that link's time.
  * AdamW moves 28 B/param (reads weight, grad, m, v; writes weight, m, v): the optimizer rate is
    the memory bandwidth it can use / 28 B; on the host we assume ~100 GB/s usable by XLA:CPU
    (a two-socket server streams 300+ GB/s; XLA:CPU's elementwise loops use a fraction of it).
"""

import dataclasses
import json
import os
import pathlib
import shutil

from megatrain_jax import fs
from megatrain_jax import layout
from megatrain_jax import runtime
from megatrain_jax.errors import ConfigError

PROFILE_CACHE = pathlib.Path('~/.cache/megatrain_jax/hardware.json')
_GB = 1e9
ADAM_BYTES_PER_PARAM = 28


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One machine: accelerator, host and disks. See the module docstring for units."""
  name: str
  device_kind: str  # jax device_kind this profile describes ('cpu' for the CPU backend)
  device_memory_gb: float  # accelerator memory
  host_memory_gb: float  # host RAM
  disk_gb: float  # free space for the NVMe tier; 0 = measure offload.dir when planning
  # Achieved TFLOP/s of decoder layers (forward + backward), by compute precision:
  # 'float32' (precision highest), 'tf32' (float32, precision default/high), 'bfloat16'.
  # Calibrated profiles measure float32 at three widths: keys 'float32@256', '@512', '@1024' (the
  # planner interpolates in log(d_model)).
  compute_tflops: dict
  h2d_gbps: float  # pinned host -> device copy rate
  d2h_gbps: float  # device -> pinned host copy rate
  disk_read_gbps: float  # per drive, through the NVMe tier's TensorStore read path, cold
  disk_write_gbps: float  # per drive, written and fsynced
  disks: int  # drives the NVMe tier is striped over
  device_adam_gparams: float  # AdamW update rate on the device (Gparam/s)
  host_adam_gparams: float  # AdamW update rate on the host (compute_on device_host)
  # Seconds of host-side overhead per jitted call the engines dispatch (Python + runtime); it
  # matters only for small models, where a step is many short calls.
  dispatch_s: float = 20e-6
  # True on accelerators: compute, copies and disk I/O run on separate engines and overlap. False
  # on the CPU backend, where "device" compute, copies and the I/O threads share the same cores.
  overlap: bool = True
  # True when "device" and "host" memory are the same RAM (the CPU backend): the planner then
  # checks device + host bytes against one pool.
  unified_memory: bool = False
  # Disk reads of data the page cache still holds (just written, RAM to spare) run at this rate.
  disk_read_cached_gbps: float = 0.0
  # Writes the page cache absorbs (no fsync: the NVMe tier's write-backs don't sync; the kernel
  # flushes them at disk_write_gbps in the background) run at this rate while RAM holds them.
  disk_write_cached_gbps: float = 0.0
  # Host RAM the process holds before any train state, when it plans: Python, the JAX/XLA runtime
  # with its backend up, the libraries the package imports (TensorBoard's writer imports torch when
  # it is installed: ~0.19 GB of it on CPU). A plan for this machine measures it instead (the
  # planning process's own RSS, planner.measured_baseline_bytes); this figure plans another
  # machine's run. CPU: 0.49, measured (launch.py on the 2-core CI VM once it has planned: 0.48-0.49
  # GB in every run; 0.17 of it is jax with its backend, 0.19 torch). GPU presets: not measured
  # (the CUDA client maps more host memory), a guess until a GPU run measures it.
  runtime_host_gb: float = 1.5
  # What a run adds to that baseline besides its planned rows: compiled executables, XLA's thread
  # pools, the data pipeline, the eval batches, the metrics writers; with a cold compilation
  # cache also the compiler's heap, which the resident runs' 'tuned' allocator keeps
  # (runtime.py). CPU: 0.15, from bench/memory_accuracy.py runs on the tiny config, whose state is
  # a few MB: RSS after 2 steps less the planning process's RSS and the planned state, 0.10-0.17
  # GB streamed (host, nvme; warm and cold cache alike), 0.08 resident with a warm cache and 0.28
  # with a cold one (the compiler's heap of the whole step, kept). GPU presets: a guess (their
  # former 2 GB runtime total, split).
  programs_host_gb: float = 0.5
  host_cores: int = 0  # CPU cores (0 = this machine's, filled when loaded)
  source: str = ''  # what the figures are: datasheet + assumptions, or 'calibrated on <host> ...'
  # Datasheet dense peak TFLOP/s (same keys as compute_tflops), the denominator of MFU. Empty for
  # the CPU and for calibrated profiles of unknown devices: MFU is then relative to the measured
  # layer rate.
  peak_tflops: dict = dataclasses.field(default_factory=dict)
  # Per-device bandwidth of the collectives between devices (GB/s each way, the "bus bandwidth"
  # of NCCL's tests): a ring all-gather or reduce-scatter of X whole bytes over N devices takes
  # (N - 1)/N · X / interconnect_gbps. None: not known (a calibration with one device visible);
  # the planner then assumes the host link (h2d_gbps) and says so.
  interconnect_gbps: float | None = None
  interconnect: str = ''  # the link in words, for the plan ('NVLink 4', ...)
  # True when the collectives cross the same link as the host<->device copies (no peer link).
  interconnect_shares_host_link: bool = False
  # The CALIBRATION_VERSION of the `--calibrate` that wrote this profile; 0: a preset, a profile
  # written by hand, or a calibration of an earlier version (load_profile says so).
  calibration_version: int = 0
  # Where this profile came from (a preset named by config.hardware, auto-detected, or a file and
  # its path): set by load_profile, printed with the plan, never saved (not a measured figure).
  origin: str = ''

  # --- derived ---

  def tflops(self, dtype: str, precision: str, d_model: int) -> float:
    """Achieved layer TFLOP/s for this compute dtype and matmul precision at width d_model."""
    if dtype == 'bfloat16':
      key = 'bfloat16'
    else:
      key = 'float32' if precision == 'highest' else 'tf32'
    sized = sorted((int(k.split('@')[1]), v) for k, v in self.compute_tflops.items()
                   if k.startswith(key + '@'))
    if sized:
      return _log_interpolate(sized, d_model)
    for fallback in (key, 'float32'):
      if fallback in self.compute_tflops:
        return self.compute_tflops[fallback]
    raise ConfigError(f'hardware profile {self.name!r} has no compute rate for {key} '
                      f'(it has {", ".join(self.compute_tflops)}). Re-run --calibrate.')

  def peak(self, dtype: str, precision: str, d_model: int) -> float:
    """The MFU denominator: datasheet peak where known, else the achieved layer rate."""
    key = 'bfloat16' if dtype == 'bfloat16' else ('float32' if precision == 'highest' else 'tf32')
    if key in self.peak_tflops:
      return self.peak_tflops[key]
    return self.tflops(dtype, precision, d_model)

  def to_json(self) -> str:
    fields = dataclasses.asdict(self)
    del fields['origin']  # where it is loaded from is not part of the profile
    return json.dumps(fields, indent=2, sort_keys=True)

  def describe(self) -> str:
    """'h100 (preset, config.hardware='h100'): datasheet figures; ...': the profile, where it came
    from (a calibration file in ~/.cache changes every prediction of an empty config.hardware,
    so its path is named) and what its figures are."""
    return f'{self.name} ({self.origin}): {self.source}' if self.origin else (
        f'{self.name}: {self.source}')

  def link_gbps(self) -> tuple[float, str]:
    """(GB/s of the collectives between devices, the link in words): the profile's
    interconnect, or the host link when the profile has none (a one-device calibration)."""
    if self.interconnect_gbps:
      return self.interconnect_gbps, self.interconnect or 'the interconnect'
    return self.h2d_gbps, 'the host link (assumed: the profile has no interconnect_gbps)'


def _log_interpolate(points: list[tuple[int, float]], x: float) -> float:
  """Piecewise-linear in log(x) through `points`, constant beyond the ends."""
  import math
  if x <= points[0][0]:
    return points[0][1]
  for (x0, y0), (x1, y1) in zip(points, points[1:]):
    if x <= x1:
      t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
      return y0 + t * (y1 - y0)
  return points[-1][1]


# The GPU presets' NVMe tier: one PCIe Gen4 data-centre drive of 7.68 TB (the rates below are
# its datasheet's); bench/projection.py stripes 2 and 4 of them. A machine with more is planned
# with its own sizes: auto-detected on it, or a profile JSON (`disk_gb`, `disks`) elsewhere.
DRIVE_GB = 7_680.0


def _gpu(name, kind, memory_gb, host_gb, fp32, tf32, bf16, hbm_gbps, pcie_gbps, link_gbps,
         link, via_host=False, host_adam_gbps=100.0):
  efficiency = 0.7
  return HardwareProfile(
      name=name, device_kind=kind, device_memory_gb=memory_gb, host_memory_gb=host_gb,
      disk_gb=DRIVE_GB,
      compute_tflops={'float32': efficiency * fp32, 'tf32': efficiency * tf32,
                      'bfloat16': efficiency * bf16},
      h2d_gbps=0.8 * pcie_gbps, d2h_gbps=0.8 * pcie_gbps,
      disk_read_gbps=6.8, disk_write_gbps=4.0, disks=1,
      device_adam_gparams=0.7 * hbm_gbps / ADAM_BYTES_PER_PARAM,
      host_adam_gparams=host_adam_gbps / ADAM_BYTES_PER_PARAM,
      dispatch_s=20e-6, overlap=True, unified_memory=False, disk_read_cached_gbps=0.0,
      peak_tflops={'float32': fp32, 'tf32': tf32, 'bfloat16': bf16},
      interconnect_gbps=0.8 * link_gbps, interconnect=link, interconnect_shares_host_link=via_host,
      source='datasheet figures; assumptions in megatrain_jax/hardware.py')


# Datasheet: dense (no sparsity) TFLOP/s for FP32, TF32 and BF16; HBM GB/s; PCIe GB/s per
# direction; the device-to-device link in GB/s per direction (NVIDIA's H100, H200 and A100
# datasheets: NVLink 900, 900 and 600 GB/s, both directions together; the RTX 4090 has none).
PRESETS = {
    'h100': _gpu('h100', 'NVIDIA H100 80GB HBM3', 80.0, 2048.0, 67.0, 494.7, 989.4, 3350.0, 64.0,
                 450.0, 'NVLink 4'),
    'h200': _gpu('h200', 'NVIDIA H200', 141.0, 2048.0, 67.0, 494.7, 989.4, 4800.0, 64.0,
                 450.0, 'NVLink 4'),
    'a100': _gpu('a100', 'NVIDIA A100-SXM4-80GB', 80.0, 1024.0, 19.5, 156.0, 312.0, 2039.0, 32.0,
                 300.0, 'NVLink 3'),
    'rtx4090': _gpu('rtx4090', 'NVIDIA GeForce RTX 4090', 24.0, 256.0, 82.6, 82.6, 165.2, 1008.0,
                    32.0, 32.0, 'PCIe Gen4 x16 through host memory (no NVLink)', via_host=True),
    # The PCIe cards of the same chips (NVIDIA's H100 PCIe, H100 NVL and H200 NVL datasheets):
    # lower clocks (FP32 51 and 60 TFLOP/s, the tensor rates halved from the datasheets' "with
    # sparsity" figures), PCIe Gen5 x16 to the host, an NVLink bridge between pairs or fours
    # (600, 600 and 900 GB/s both directions together).
    'h100-pcie': _gpu('h100-pcie', 'NVIDIA H100 PCIe', 80.0, 1024.0, 51.0, 378.0, 756.0, 2000.0,
                      64.0, 300.0, 'NVLink bridge'),
    'h100-nvl': _gpu('h100-nvl', 'NVIDIA H100 NVL', 94.0, 1024.0, 60.0, 417.5, 835.5, 3900.0,
                     64.0, 300.0, 'NVLink bridge'),
    'h200-nvl': _gpu('h200-nvl', 'NVIDIA H200 NVL', 141.0, 1024.0, 60.0, 417.5, 835.5, 4800.0,
                     64.0, 450.0, 'NVLink bridge'),
    # Grace Hopper (GH200 480GB: an H100-class GPU with 96 GB of HBM3, and a Grace CPU with 480 GB
    # of LPDDR5X at up to 512 GB/s): host and device are joined by NVLink-C2C, 900 GB/s both
    # directions together, in place of PCIe; the host AdamW is assumed to run at 350 GB/s of
    # Grace's memory bandwidth (an assumption, as the 100 GB/s of the x86 hosts above).
    'gh200': _gpu('gh200', 'NVIDIA GH200 480GB', 96.0, 480.0, 67.0, 494.7, 989.4, 4000.0, 450.0,
                  450.0, 'NVLink 4', host_adam_gbps=350.0),
    # The CPU backend: "device" and host are the same RAM. Rates are those measured on the 2-core
    # CI VMs (BENCHMARKS.md); run --calibrate for a real machine. Sizes are read at plan time.
    'cpu': HardwareProfile(
        name='cpu', device_kind='cpu', device_memory_gb=0.0, host_memory_gb=0.0, disk_gb=0.0,
        # `python bench/planner_accuracy.py`'s calibration, 2026-12-07, idle VM. The engines'
        # layers run ~3x faster per FLOP than at the 2026-12-03 calibration (0.085, 0.112, 0.132
        # TFLOP/s: token-major linears, RoPE tables once per step, head-major attention, keys
        # skipped where masked), which the preset still held: the default job was predicted at
        # 0.77 s/step and ran at 0.2.
        compute_tflops={'float32@256': 0.328, 'float32@512': 0.351, 'float32@1024': 0.321,
                        'bfloat16': 0.02},
        h2d_gbps=15.7, d2h_gbps=15.7, disk_read_gbps=0.42, disk_write_gbps=0.48, disks=1,
        device_adam_gparams=1.99, host_adam_gparams=1.99, dispatch_s=4e-6, overlap=False,
        # disk_write_cached_gbps: into the page cache, the live stores not fsyncing each write
        # (tiers/nvme.live_context).
        unified_memory=True, disk_read_cached_gbps=3.39, disk_write_cached_gbps=1.52,
        runtime_host_gb=0.49, programs_host_gb=0.15,
        source='`--calibrate` on a 2-core CI VM, 2026-12-07; run it on this machine'),
}
ALIASES = {'h100-80gb': 'h100', 'h200-141gb': 'h200', 'a100-80gb': 'a100', '4090': 'rtx4090',
           'rtx-4090': 'rtx4090'}
# device_kind substrings -> preset, for auto-detection.
# The most specific first: 'NVIDIA H100 PCIe' is no SXM H100, 'NVIDIA GH200 480GB' no H200.
_DETECT = (('GH200', 'gh200'), ('H200 NVL', 'h200-nvl'), ('H100 NVL', 'h100-nvl'),
           ('H100 PCIe', 'h100-pcie'), ('H200', 'h200'), ('H100', 'h100'), ('A100', 'a100'),
           ('4090', 'rtx4090'))


def preset_for(device_kind: str) -> str | None:
  """The GPU preset describing this jax device_kind, if any."""
  return next((preset for needle, preset in _DETECT if needle in device_kind), None)


def datasheet_peak_tflops(device_kind: str, dtype: str, precision: str) -> float | None:
  """Dense datasheet peak of a known accelerator (presets), for MFU; None when not known."""
  preset = preset_for(device_kind)
  return PRESETS[preset].peak(dtype, precision, 0) if preset else None


def machine_memory_gb() -> float:
  return runtime.physical_memory_bytes() / _GB


def _fill_sizes(profile: HardwareProfile) -> HardwareProfile:
  """Zero sizes mean "this machine's": RAM from sysconf; CPU "device" memory = the same RAM."""
  changes = {}
  if not profile.host_cores:
    changes['host_cores'] = len(os.sched_getaffinity(0))
  if not profile.host_memory_gb:
    changes['host_memory_gb'] = machine_memory_gb()
  if not profile.device_memory_gb:
    changes['device_memory_gb'] = (machine_memory_gb() if profile.unified_memory
                                   else device_memory_gb())
  return dataclasses.replace(profile, **changes) if changes else profile


def device_memory_gb() -> float:
  stats = layout.device_memory_stats()
  return stats.get('bytes_limit', 0) / _GB


def _detect_preset() -> str:
  if layout.platform() == 'cpu':
    return 'cpu'
  return preset_for(layout.device_kind()) or 'cpu'


def load_profile(spec: str) -> HardwareProfile:
  """`spec`: a preset name (PRESETS: h100, h200, a100, rtx4090, ...), a profile JSON path, or ''
  (auto).
  The profile's `origin` says which of these it is, with the file's path: an empty spec picks up
  a calibration file in ~/.cache silently otherwise."""
  if not spec:
    cached = PROFILE_CACHE.expanduser()
    kind, preset = layout.device_kind(), _detect_preset()
    if cached.is_file():
      profile = _read_profile(cached)
      if profile.device_kind == kind:
        return _fill_sizes(_origin(profile, (
            f'calibration file {cached}, used because config.hardware is empty and it was made '
            f'on this device kind; config.hardware={preset} plans with the preset instead')))
      why = f'the calibration file {cached} is for {profile.device_kind!r}, not {kind!r}'
    else:
      why = f'no calibration file at {cached}'
    # This machine's sizes, not the preset's: its rates describe the device, but a preset's RAM
    # (2 TB for h100) and drive (7.68 TB) are a machine's that this one may not be (a 256 GB box
    # would be planned 1.7 TB of host memory). Disk 0: offload.dir's free space, measured.
    return _fill_sizes(dataclasses.replace(
        PRESETS[preset], host_memory_gb=0.0, device_memory_gb=0.0, disk_gb=0.0, host_cores=0,
        origin=f'preset auto-detected for this {kind} device (its rates, this machine\'s RAM, '
               f'device memory and disk): config.hardware is empty and {why}'))
  name = ALIASES.get(spec.lower(), spec.lower())
  if name in PRESETS:
    return _fill_sizes(dataclasses.replace(PRESETS[name],
                                           origin=f'preset, config.hardware={spec!r}'))
  path = pathlib.Path(spec).expanduser()
  if path.suffix == '.json' or path.exists():
    if not path.is_file():
      raise ConfigError(f'hardware={spec!r}: no such profile file. Write one with '
                        '`python launch.py --calibrate`, or use a preset: '
                        f'{", ".join(PRESETS)}.')
    return _fill_sizes(_origin(
        _read_profile(path), f'profile file {path.absolute()}, named by config.hardware'))
  raise ConfigError(f'hardware={spec!r} is neither a preset ({", ".join(PRESETS)}) nor a profile '
                    'file. Use a preset name, a path to a JSON profile written by '
                    '`python launch.py --calibrate`, or leave it empty to auto-detect.')


# Raised when a calibration's figures change meaning, so a profile calibrated before is named as
# such with the plan (load_profile). 1 (2026-12-07): layer rates over the FLOPs the layers
# execute, all of attention (the causal half before: rates 2-9% low at widths 1024-256), and
# programs_host_gb recorded.
CALIBRATION_VERSION = 1
_CALIBRATED = 'calibrated-'  # the name --calibrate gives its profiles


def _read_profile(path: pathlib.Path) -> HardwareProfile:
  """The profile in `path` (load_profile gives it its origin, `_origin`, which names one an
  earlier version's --calibrate wrote)."""
  try:
    fields = json.loads(path.read_text())
    fields.pop('origin', None)  # set by whoever loads it, never trusted from the file
    profile = HardwareProfile(**fields)
  except (json.JSONDecodeError, TypeError, AttributeError) as e:
    raise ConfigError(f'hardware profile {path} is not a valid profile ({e}). Re-create it with '
                      '`python launch.py --calibrate`.') from e
  return profile


def _origin(profile: HardwareProfile, origin: str) -> HardwareProfile:
  """`profile` with `origin`, and a note where an earlier version's --calibrate wrote it."""
  if profile.name.startswith(_CALIBRATED) and profile.calibration_version < CALIBRATION_VERSION:
    origin += ('; calibrated by an earlier version of megatrain_jax, whose layer rates count half '
               'the attention and which may lack programs_host_gb: rerun --calibrate')
  return dataclasses.replace(profile, origin=origin)


def save_profile(profile: HardwareProfile, path: pathlib.Path = PROFILE_CACHE) -> pathlib.Path:
  path = pathlib.Path(path).expanduser()
  path.parent.mkdir(parents=True, exist_ok=True)
  fs.write_text_atomic(path, profile.to_json())
  return path


def free_disk_gb(directory: str) -> float:
  existing = fs.nearest_existing(pathlib.Path(directory).expanduser().absolute())
  return shutil.disk_usage(existing).free / _GB
