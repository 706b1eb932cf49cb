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
the global batch its own devices hold (Layout.put_batch). They share the workdir (a cluster
filesystem): process 0 (`is_main`) writes the metrics and the console; a checkpoint is written by
all of them, each its own shards, and committed by process 0 (checkpoint.py); an NVMe tier keeps
each process's shards in its own `process_dir` of offload.dir (a local disk of its machine). If a
process dies, the others learn it from the coordination service's heartbeat (HEARTBEAT_S) or from
the failed collective, and stop with an error (train.py names the processes that are gone).
"""

from __future__ import annotations

import contextlib
import pathlib
import typing

import jax
from jax.experimental import multihost_utils
import numpy as np

from megatrain_jax.errors import ConfigError, ProcessLostError
from megatrain_jax.layout import Layout, platform

if typing.TYPE_CHECKING:  # annotations only: the engines import this module, and the GPU image
  import ml_collections  # that runs bench/gpu_host_tier.py has no ml_collections


# A process that sends no heartbeat for this long is declared dead and the others stop (JAX's
# default, 100 s, is longer than a user waits to learn that a run is over). Heartbeats come from a
# thread of their own: a long step does not miss them.
HEARTBEAT_S = 20


def initialize(coordinator_address: str = '', num_processes: int = 0,
               process_id: int = -1) -> None:
  """Joins this process to a multi-process run (jax.distributed.initialize); must come before
  anything touches a jax device. Empty arguments leave them to JAX's cluster auto-detection
  (SLURM, ...). On CPU the collectives between processes go through gloo."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU only; GPUs use NCCL
  kwargs = {'coordinator_address': coordinator_address or None,
            'num_processes': num_processes or None,
            'process_id': process_id if process_id >= 0 else None}
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=HEARTBEAT_S)


def is_main() -> bool:
  """Process 0: the one that writes the run's shared files (metrics, console, the commit of a
  checkpoint) into the shared workdir."""
  return jax.process_index() == 0


def process_dir(directory) -> pathlib.Path:
  """Where this process keeps its own files under `directory` (an NVMe tier's offload.dir, a
  local disk of its machine): `directory` itself with one process, its process-<i> subdirectory
  with several (processes on one machine may share offload.dir)."""
  directory = pathlib.Path(directory)
  return directory if jax.process_count() == 1 else directory / f'process-{jax.process_index()}'


def barrier(name: str) -> None:
  """Waits until every process has reached `barrier(name)` (a no-op with one process). `name`
  must be the same in every process, and the barriers passed in the same order."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def share() -> tuple[int, int]:
  """(this process's index, the process count): the share of a job the processes split between
  them (checkpoint.py's verification); (0, 1) with one process."""
  return jax.process_index(), jax.process_count()


def processes_where(flag: bool) -> list[int]:
  """The processes whose `flag` is true (every process calls it, in the same order, and gets the
  same list): how processes that each checked a share of something agree on the whole. One
  process: [0] or []."""
  if jax.process_count() == 1:
    return [0] if flag else []
  flags = multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))
  return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def from_main(values: list[int]) -> list[int]:
  """Process 0's `values` (non-negative ints) in every process (every process calls it, in the
  same order): a list each process would read for itself (a directory's checkpoints) may differ
  between them while another run writes there. One process: `values`."""
  if jax.process_count() == 1:
    return list(values)
  count = int(multihost_utils.broadcast_one_to_all(np.asarray(len(values), np.int64)))
  padded = np.zeros(max(count, 1), np.int64)  # the others' part of the broadcast: ignored
  if jax.process_index() == 0:
    padded[:count] = values
  return [int(v) for v in multihost_utils.broadcast_one_to_all(padded)[:count]]


@contextlib.contextmanager
def lost_process_error(checkpointer):
  """Turns a failed collective across processes (another process died or lost its connection:
  this one cannot go on without its shards) into ProcessLostError, naming the last checkpoint of
  `checkpointer` to resume from. One process: errors pass unchanged."""
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    if jax.process_count() == 1:
      raise
    steps = checkpointer.steps()
    raise lost_process(error, steps[-1] if steps else None) from error


def lost_process(error: Exception, resume_from: int | None) -> ProcessLostError:
  """The error to stop with when a collective across processes fails (`error`)."""
  me, count = jax.process_index(), jax.process_count()
  others = ', '.join(str(i) for i in range(count) if i != me)
  cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  resume = (f'they resume from the last checkpoint (step {resume_from})' if resume_from
            else 'no checkpoint has been committed yet, so they start over')
  return ProcessLostError(
      f'process {me} of {count} lost contact with the other process{"es" if count > 2 else ""} '
      f'({others}): a collective across processes failed ({cause}). One of them stopped or lost '
      f'its connection; look at its log for why. Then rerun all {count} processes with the same '
      f'command: {resume}.')


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

