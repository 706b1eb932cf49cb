"""Which devices (and processes) a run uses: `parallel.devices` checked, then turned into the run's
`Layout` (layout.py: one mesh axis 'data' over the devices, each leaf of the train state split
over it ZeRO-3 style, the batch split along B).

A run is one process driving N local devices: the first N of `jax.devices()` (parallel.devices =
N, 0 = all). The global batch is train.batch_size x train.microbatches on any device count: each
device computes train.batch_size / N sequences of every microbatch, so train.batch_size must be a
multiple of N. Both are checked here, with a ConfigError naming the field and the fix, before
anything is allocated.

Several processes (`initialize`, from launch.py's --coordinator_address, --num_processes,
--process_id, checked by `check_process_flags`) join their devices into one mesh through
jax.distributed, each feeding the rows of the global batch its own devices hold
(Layout.put_batch). They must run the same config (`check_same_config`, right after joining)
on every device of every process (`device_count`). They share the workdir (a cluster
filesystem): process 0 (`is_main`) writes the metrics and the console; a checkpoint is written by
all of them, each its own shards, and committed by process 0 (checkpoint.py); an NVMe tier keeps
each process's shards in its own `process_dir` of offload.dir (a local disk of its machine). If a
process dies, the others learn it from the coordination service's heartbeat (HEARTBEAT_S) or from
the failed collective, and stop with an error (train.py names the processes that are gone).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import re
import socket
import sys
import threading
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


# JAX's own deadline for the processes to join is this much later than ours (`initialize`): at
# its deadline it aborts the process with a page of C++ stack instead of raising.
_JAX_GRACE_S = 30


def check_process_flags(coordinator_address: str, num_processes: int | None,
                        process_id: int | None, auto: bool, timeout_s: int = 300) -> None:
  """launch.py's multi-process flags (None: not given), checked before jax.distributed sees them
  (it raises a bare ValueError from deep inside, or waits minutes for a rank that never comes):
  without `auto` (--distributed: JAX's cluster auto-detection finds what is not given) all three
  are given together, and the rank is one of the process count's."""
  fix = ('a run of several processes needs --coordinator_address=HOST:PORT (process 0\'s '
         'machine), --num_processes=N and --process_id=I (0..N-1, its own on each process), or '
         '--distributed on a cluster JAX detects (SLURM, ...)')
  given = {'--coordinator_address': coordinator_address, '--num_processes': num_processes,
           '--process_id': process_id}
  missing = [name for name, value in given.items() if value in ('', None)]
  if missing and not auto:
    raise ConfigError(f'{" and ".join(missing)} not given: {fix}.')
  if timeout_s < 1:
    raise ConfigError(f'--initialization_timeout={timeout_s}: seconds to wait for every process '
                      'to join, >= 1 (default 300).')
  port = coordinator_address.rsplit(':', 1)[-1]
  if coordinator_address and not (re.fullmatch(r'\S+:\d+', coordinator_address)
                                  and 0 < int(port) < 65536):
    raise ConfigError(f'--coordinator_address={coordinator_address}: must be HOST:PORT of '
                      'process 0 (e.g. node0:29500; a port 1-65535), the same on every process.')
  if num_processes is not None and num_processes < 1:
    raise ConfigError(f'--num_processes={num_processes}: must be >= 1; {fix}.')
  if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
    count = f'--num_processes={num_processes}' if num_processes else 'the process count'
    last = num_processes - 1 if num_processes else 'N-1'
    raise ConfigError(f'--process_id={process_id} is not a rank of {count}: give each process '
                      f'its own --process_id, 0 to {last}.')


def initialize(coordinator_address: str = '', num_processes: int = 0,
               process_id: int = -1, timeout_s: int = 300) -> None:
  """Joins this process to a multi-process run (jax.distributed.initialize); must come before
  anything touches a jax device. Empty arguments leave them to JAX's cluster auto-detection
  (SLURM, ...). On CPU the collectives between processes go through gloo.

  Says on stderr what it waits for. A coordinator that cannot start, or a cluster that cannot be
  detected, is a ConfigError naming the fix; when not every process has joined within
  `timeout_s`, the process ends (status 1) with one line saying so: JAX itself would abort it
  with a C++ stack trace, which no Python code can catch."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU only; GPUs use NCCL
  kwargs = {'coordinator_address': coordinator_address or None,
            'num_processes': num_processes or None,
            'process_id': process_id if process_id >= 0 else None}
  me = f'process {process_id} of {num_processes}' if process_id >= 0 else 'this process'
  at = (f'at {coordinator_address}' if coordinator_address else
        'at the coordinator that cluster auto-detection finds (--distributed)')
  if process_id == 0 and coordinator_address:
    _check_port_free(coordinator_address)
  print(f'{me}: waiting up to {timeout_s} s (--initialization_timeout) for '
        f'{f"all {num_processes} processes" if num_processes else "every process"} to join {at}',
        file=sys.stderr, flush=True)
  watchdog = threading.Timer(timeout_s, _not_joined, (
      f'error: {me}: not every process joined {at} within {timeout_s} s '
      '(--initialization_timeout). Start every process with the same --coordinator_address '
      '(process 0\'s host and a free port) and --num_processes, each with its own --process_id; '
      'check that process 0 runs and that the port is reachable from every machine.',))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(**kwargs, initialization_timeout=timeout_s + _JAX_GRACE_S,
                               heartbeat_timeout_seconds=HEARTBEAT_S)
  except (ValueError, jax.errors.JaxRuntimeError) as error:
    raise ConfigError(_start_error(error, coordinator_address)) from error
  finally:
    watchdog.cancel()


# How long a process that refuses a run waits for the others to reach the same refusal before it
# leaves (`stop_together`): they checked the same config, but a loaded machine may be seconds
# behind (importing, planning).
REFUSAL_WAIT_S = 30


def stop_together(timeout_s: float = REFUSAL_WAIT_S) -> bool:
  """Leaves jax.distributed together with the other processes, each on its way out with the same
  refusal (a ConfigError every process meets: they run one config). Process 0 runs the
  coordination service: gone first, it took the others down with it (an abort, status -6 and a
  page of C++ stack) while they were still on their way to the same one-line error. False when
  not every process came within `timeout_s` (the refusal was this process's own): exit at once."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  client = jax_distributed.global_state.client
  if client is None:
    return False
  try:
    client.wait_at_barrier('megatrain_jax_stop_together', int(timeout_s * 1000))
    jax.distributed.shutdown()  # every process is at its shutdown barrier: it passes at once
  except Exception:  # pylint: disable=broad-except  (a timeout, a process gone: exit anyway)
    return False
  return True


def _not_joined(message: str) -> None:
  """`initialize`'s deadline passed (a thread of its own: jax.distributed waits in C++)."""
  print(message, file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access  (the main thread is inside JAX's wait)


def _check_port_free(coordinator_address: str) -> None:
  """Process 0 listens on the port of `coordinator_address` (on every address, as JAX binds it):
  one already in use is a ConfigError, not the segfault or RPC error JAX meets it with."""
  port = int(coordinator_address.rsplit(':', 1)[1])
  for family, host in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      continue  # no IPv6 here: the IPv4 probe decides
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds
      try:
        probe.bind((host, port))
        return
      except OSError as error:
        if family == socket.AF_INET6 and error.errno != errno.EADDRINUSE:  # no IPv6: try IPv4
          continue
        raise ConfigError(
            f'--coordinator_address={coordinator_address}: process 0 cannot listen on port '
            f'{port} ({error.strerror}: another run\'s coordinator, or another program). Choose '
            'a free port, the same in every process\'s --coordinator_address.') from error


def _start_error(error: Exception, coordinator_address: str) -> str:
  """One line for jax.distributed.initialize's `error`, naming the fix."""
  cause = ' '.join(str(error).split()).rstrip('.') or type(error).__name__
  if not coordinator_address and 'coordinator_address' in cause:
    return (f'--distributed: JAX found no cluster to join ({cause}): it reads the variables of '
            'a SLURM job step, Open MPI, ... Outside one, give --coordinator_address=HOST:PORT '
            '--num_processes=N --process_id=I instead.')
  if 'RPC server' in cause or 'in use' in cause:
    return (f'--coordinator_address={coordinator_address}: process 0 could not start the '
            f'coordinator ({cause}); the port may be in use. Choose a free port, the same in '
            'every process\'s --coordinator_address.')
  return (f'jax.distributed.initialize failed ({cause}). Check --coordinator_address, '
          '--num_processes and --process_id (or what --distributed detects).')


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


def processes_on_this_machine() -> int:
  """How many of the run's processes share this machine (its host name), this one included:
  they share its RAM and drives (every process calls it, in the same order). One process: 1."""
  if jax.process_count() == 1:
    return 1
  # 31 bits of the name's hash: jax gathers int32 (int64 is cut to it without jax_enable_x64).
  digest = hashlib.sha256(socket.gethostname().encode()).digest()
  name = int.from_bytes(digest[:4], 'little') & 0x7FFFFFFF
  names = _gathered(np.asarray([name], np.int32)).reshape(-1)
  return int(np.count_nonzero(names == name))


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


# Config fields that name something of each machine's own (a local disk, its compile cache, how
# many of its cores tokenize): they may differ between the processes of a run.
LOCAL_FIELDS = ('offload.dir', 'jax_cache_dir', 'data.num_workers', 'train.progress_bar',
                'runtime.allocator', 'profile.start_step', 'profile.steps')


def check_same_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Every process of a run was started with the same config and --workdir (LOCAL_FIELDS
  aside): the processes compute one model together, so a field set on one process only (a
  train.steps, a train.lr) would hang them at the end or train silently wrong, and another
  --workdir fails at the first checkpoint. Every process calls it, right after `initialize` and
  before anything is written; if any differs, all of them raise the same ConfigError, naming the
  fields. The cost: an all-gather of a 32-byte digest (the configs themselves only if they
  differ). One process: nothing."""
  if jax.process_count() == 1:
    return
  fields = _flat(json.loads(config.to_json_best_effort()))
  for name in LOCAL_FIELDS:
    fields.pop(name, None)
  fields['--workdir'] = os.path.abspath(os.path.expanduser(workdir))
  everyone = texts_if_different(json.dumps(fields, sort_keys=True))
  if everyone is not None:
    raise ConfigError(_config_differences([json.loads(text) for text in everyone]))


def check_same_plan(summary: str) -> None:
  """Every process planned the same placement (`summary`: its placement and microbatches): each
  plans its `auto` fields for its own machine's memory and disk, and processes that stream
  differently would wait for each other's collectives forever. One process: nothing."""
  everyone = texts_if_different(summary) if jax.process_count() > 1 else None
  if everyone is not None:
    plans = '; '.join(f'process {i}: {text}' for i, text in enumerate(everyone))
    raise ConfigError(f'the processes planned different placements for their machines ({plans}). '
                      'Give every machine the same free memory and disk, or set the offload.* '
                      'fields and train.microbatches the plan of process 0 names.')


def check_same_data(summary: str) -> None:
  """Every process read the same data (`summary`: what it counted in it): a machine whose
  data.path holds other files trains on a mix, or waits for collectives the others never run.
  One process: nothing."""
  everyone = texts_if_different(summary) if jax.process_count() > 1 else None
  if everyone is not None:
    found = '; '.join(f'process {i}: {text}' for i, text in enumerate(everyone))
    raise ConfigError(f'the processes read different data ({found}): data.path (and '
                      'data.val_path) must hold the same files on every machine.')


def texts_if_different(text: str) -> list[str] | None:
  """Every process's `text` (in process order) when they are not all the same, else None: an
  all-gather of a 32-byte digest, and of the texts themselves only when the digests differ."""
  data = text.encode()
  digests = _gathered(np.frombuffer(hashlib.sha256(data).digest(), np.uint8))
  if (digests == digests[0]).all():
    return None
  lengths = _gathered(np.asarray([len(data)], np.int64)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = np.frombuffer(data, np.uint8)
  return [bytes(row[:n]).decode() for row, n in zip(_gathered(padded), lengths)]


def _gathered(values: np.ndarray) -> np.ndarray:
  """[process count, *values.shape]: every process's `values` (same shape and dtype in each)."""
  gathered = np.asarray(multihost_utils.process_allgather(values))
  return gathered.reshape(jax.process_count(), *values.shape)


def _flat(tree: dict, prefix: str = '') -> dict:
  """{'train.lr': 0.001, ...} of a config's nested dict."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f'{prefix}{key}.'))
    else:
      flat[prefix + key] = value
  return flat


def _config_differences(everyone: list[dict]) -> str:
  """`check_same_config`'s message: the fields where a process differs from process 0."""
  differences = []
  for key in sorted(set().union(*everyone)):
    values = [fields.get(key, '(unset)') for fields in everyone]
    others = [f'{value!r} on process {i}' for i, value in enumerate(values) if value != values[0]]
    if others:
      name = key if key == '--workdir' else f'config.{key}'
      differences.append(f'{name}: {values[0]!r} on process 0, {", ".join(others[:3])}'
                         + (f' (and {len(others) - 3} more processes)' if len(others) > 3 else ''))
  shown = '; '.join(differences[:5]) + (f'; and {len(differences) - 5} more fields'
                                         if len(differences) > 5 else '')
  return (f'the {len(everyone)} processes were not started with the same config ({shown}). Run '
          'the same command on every process, changing only --process_id.')


@contextlib.contextmanager
def lost_process_error(checkpointer):
  """Turns a failed collective across processes (another process died or lost its connection:
  this one cannot go on without its shards) into ProcessLostError, naming the last checkpoint of
  `checkpointer` to resume from (once the commit in flight, process 0's, is done). One
  process, or a device out of memory: errors pass unchanged."""
  try:
    yield
  except jax.errors.JaxRuntimeError as error:
    if jax.process_count() == 1 or 'RESOURCE_EXHAUSTED' in str(error):
      raise
    try:
      checkpointer.wait()  # it named the checkpoint before, committed a moment later
    except Exception:  # pylint: disable=broad-except  (its own error: the previous one stands)
      pass
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


def device_count(config: ml_collections.ConfigDict, available: int | None = None,
                 processes: int | None = None) -> int:
  """The number of devices the run uses (parallel.devices, 0 = all `available`; default: what
  jax sees, the devices of all `processes` (default: jax's count) together), once it and
  train.batch_size are checked against it. Allocates nothing. Several processes use every
  device: the first N of jax.devices() would leave some process without one (it fails to read
  what it cannot address)."""
  check_fields(config)
  available = jax.device_count() if available is None else available
  processes = jax.process_count() if processes is None else processes
  wanted = config.parallel.devices or available
  if processes > 1 and wanted > available:
    per_process = (f'; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count='
                   f'{wanted // processes} set before each process starts makes {wanted} in all '
                   '(the flag counts one process\'s devices)' if wanted % processes == 0 else '')
    raise ConfigError(
        f'parallel.devices={wanted} asks for more devices than the {processes} processes have '
        f'together ({available}: {platform()}). Set parallel.devices=0 (all {available})'
        f'{per_process}.')
  if processes > 1 and wanted != available:
    raise ConfigError(
        f'parallel.devices={wanted}: a run of {processes} processes uses every device of every '
        f'process ({available} {platform()} devices in all here); set parallel.devices=0 (all) '
        f'or {available}. To use fewer devices, start fewer processes or give each fewer.')
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

