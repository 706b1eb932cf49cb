"""Which devices (and processes) a run uses: `parallel.devices` checked, then turned into the run's
`Layout` (layout.py: one mesh axis 'data' over the devices, each leaf of the train state split
over it ZeRO-3 style, the batch split along B).

A run is one process driving N local devices: the first N of `jax.devices()` (parallel.devices =
N, 0 = all). The global batch is train.batch_size x train.microbatches on any device count: each
device computes train.batch_size / N sequences of every microbatch, so train.batch_size must be a
multiple of N. Both are checked here, with a ConfigError naming the field and the fix, before
anything is allocated.

Several processes (`initialize`, from launch.py's --coordinator_address, --num_processes,
--process_id) join their devices into one mesh through jax.distributed, each feeding the rows of
the global batch its own devices hold (Layout.put_batch). The engines run on such a mesh
(tests/test_distributed.py); the trainer does not yet (`check_single_process`).
"""

import jax
import ml_collections

from megatrain_jax.errors import ConfigError
from megatrain_jax.layout import Layout, platform


def initialize(coordinator_address: str = '', num_processes: int = 0,
               process_id: int = -1) -> None:
  """Joins this process to a multi-process run (jax.distributed.initialize); must come before
  anything touches a jax device. Empty arguments leave them to JAX's cluster auto-detection
  (SLURM, ...). On CPU the collectives between processes go through gloo."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU only; GPUs use NCCL
  kwargs = {'coordinator_address': coordinator_address or None,
            'num_processes': num_processes or None,
            'process_id': process_id if process_id >= 0 else None}
  jax.distributed.initialize(**kwargs)


def check_single_process() -> None:
  """The trainer's workdir lock, data preparation, metrics and checkpoints are per process today:
  a run of several processes is refused before it writes anything."""
  if jax.process_count() > 1:
    raise ConfigError(
        f'this is process {jax.process_index()} of {jax.process_count()}: training across '
        'processes is not supported by the trainer yet (the engines are; issue 13). Run one '
        'process per machine over its local devices (parallel.devices).')


def check_fields(config: ml_collections.ConfigDict) -> None:
  """parallel.* fields that need no devices to check (a `--dry_run` for a machine you don't
  have): their types and ranges."""
  devices = config.parallel.devices
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
    raise ConfigError(f'parallel.devices: must be an integer >= 0 (0 = every visible device), '
                      f'got {devices!r}.')


def device_count(config: ml_collections.ConfigDict, available: int | None = None) -> int:
  """The number of devices the run uses (parallel.devices, 0 = all `available`; default: what
  jax sees), once it and train.batch_size are checked against it. Allocates nothing."""
  check_fields(config)
  available = jax.device_count() if available is None else available
  wanted = config.parallel.devices or available
  if wanted > available:
    raise ConfigError(
        f'parallel.devices={wanted} asks for more devices than this process sees ({available}: '
        f'{platform()}). Lower parallel.devices (0 = all {available}); on CPU, '
        f'XLA_FLAGS=--xla_force_host_platform_device_count={wanted} set before the process '
        'starts makes that many devices.')
  check_batch(config, wanted)
  return wanted


def check_batch(config: ml_collections.ConfigDict, devices: int) -> None:
  """train.batch_size splits evenly over `devices` (each takes an equal share of every
  microbatch, and of every evaluation batch, which has the same size)."""
  batch = config.train.batch_size
  if batch % devices:
    lower, higher = batch // devices * devices, (batch // devices + 1) * devices
    options = f'{lower} or {higher}' if lower else f'{higher}'
    raise ConfigError(
        f'train.batch_size={batch} does not split over {devices} devices: each device takes '
        f'train.batch_size / {devices} sequences of every microbatch. Use a multiple of '
        f'{devices} (e.g. {options}; train.microbatches keeps the tokens per step if you lower '
        f'it), or set parallel.devices to a divisor of {batch}.')


def run_layout(config: ml_collections.ConfigDict) -> Layout:
  """The Layout of a run: a mesh over the first `device_count(config)` devices of jax."""
  return Layout.for_devices(jax.devices()[:device_count(config)])


def describe(layout: Layout) -> str:
  """'4 x cpu devices, 1 process' (the startup line's what-it-runs-on)."""
  n, processes = layout.num_devices, jax.process_count()
  kind = layout.devices[0].device_kind
  return (f'{n} x {kind} device{"s" if n > 1 else ""}, '
          f'{processes} process{"es" if processes > 1 else ""}')

