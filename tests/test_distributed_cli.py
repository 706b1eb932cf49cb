"""launch.py's multi-process command line (docs/distributed.md): what it refuses before
jax.distributed starts or anything is written, and what 2 local processes (2 CPU devices each,
gloo) agree on: the config they were started with, the devices they use, and the signal that
stopped them.

The refusals run launch.py once, in a process of its own, and read its one `error:` line; the
runs of 2 processes start launch.py twice, joined through a free local port, as a user does on
two machines (tests/test_distributed.py trains and kills such runs).
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

import jax
import pytest

from helpers import JAX_CACHE_DIR, REPO_ROOT, SHARED_DATA, SMALL_MODEL, config_with
from megatrain_jax import distributed, hardware
from megatrain_jax.errors import ConfigError, ProcessLostError

# A refusal comes within seconds; without it, a process waits for peers that never come (JAX
# waits 300 s): the test then fails on this timeout instead of hanging.
REFUSAL_TIMEOUT_S = 60
TRAIN_TIMEOUT_S = 300
ENV = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
TRAIN_DATA = str(SHARED_DATA / 'tinyshakespeare' / 'input.txt')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch(*args, env=None, timeout=REFUSAL_TIMEOUT_S) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO_ROOT / 'launch.py'), *args], cwd=REPO_ROOT,
                        env=env or ENV, capture_output=True, text=True, timeout=timeout)


def _one_error(result, fragment: str) -> str:
  """Exit status 1, no traceback, and one `error:` line on stderr holding `fragment`: that
  line (a process that started waiting for the others said so first)."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and fragment in errors[0], result.stderr[-3000:]
  return errors[0]


def _processes(coordinator: str = 'localhost:1', process_id: int = 1) -> list[str]:
  return [f'--coordinator_address={coordinator}', '--num_processes=2',
          f'--process_id={process_id}']


@pytest.mark.parametrize('job', ['--eval', '--sample', '--prepare', '--dry_run', '--calibrate',
                                 '--export_hf'])
def test_one_process_jobs_are_refused_with_process_flags(tmp_path, job):
  """--eval, --sample, --export_hf, --prepare, --dry_run and --calibrate run in one process:
  with the flags of a multi-process run they stop with one line naming the flags to drop,
  before jax.distributed starts (process 1 would wait for a process 0) or anything is written
  (each process used to run the whole job: both writing the export, eval.json, ...)."""
  workdir, out = tmp_path / 'run', tmp_path / 'export'
  args = [f'{job}={out}'] if job == '--export_hf' else [job]
  result = _launch('--config', 'tiny', f'--workdir={workdir}', *args, *_processes())
  line = _one_error(result, f'error: {job} runs in one process')
  assert ('run it once, without --coordinator_address, --num_processes and --process_id'
          in line), line
  assert not workdir.exists() and not out.exists()


def test_distributed_flag_is_refused_for_one_process_jobs_too(tmp_path):
  result = _launch('--eval', '--distributed', f'--workdir={tmp_path / "run"}')
  _one_error(result, 'error: --eval runs in one process (it reads a checkpoint written by any '
                     'number of processes): run it once, without --distributed.')


@pytest.mark.parametrize('flags, fragment', [
    (['--process_id=1'], '--coordinator_address and --num_processes not given'),
    (['--coordinator_address=localhost:1', '--num_processes=2'], '--process_id not given'),
    (_processes(process_id=5), '--process_id=5 is not a rank of --num_processes=2: give each '
                               'process its own --process_id, 0 to 1.'),
    (['--coordinator_address=localhost', '--num_processes=2', '--process_id=0'],
     '--coordinator_address=localhost: must be HOST:PORT'),
    (_processes('localhost:70000', process_id=0), '--coordinator_address=localhost:70000: must '
                                                   'be HOST:PORT'),
    ([*_processes(), '--initialization_timeout=0'], '--initialization_timeout=0: seconds'),
], ids=['rank-alone', 'no-rank', 'rank-out-of-range', 'no-port', 'port-out-of-range',
        'zero-timeout'])
def test_process_flags_are_checked_before_jax_distributed(tmp_path, flags, fragment):
  """Incomplete or out-of-range process flags: one line naming the fix (JAX's ValueError
  tracebacks before; --process_id alone trained one process as if it were not there), before
  anything starts."""
  workdir = tmp_path / 'run'
  result = _launch('--config', 'tiny', f'--workdir={workdir}', *flags)
  _one_error(result, fragment)
  assert 'waiting' not in result.stderr and not workdir.exists()


def test_one_process_by_its_flags_is_one_process(tmp_path):
  """--num_processes=1 --process_id=0 (a launcher's template for a one-machine job) is one
  process, as before: no jax.distributed, and one-process jobs run."""
  result = _launch('--config', 'tiny', '--dry_run', '--num_processes=1', '--process_id=0',
                   f'--workdir={tmp_path / "run"}', timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'waiting' not in result.stderr and 'predicted' in result.stdout


def test_distributed_outside_a_cluster_is_one_line(tmp_path):
  """--distributed where JAX detects no cluster: one line naming the explicit flags instead
  (JAX's 'coordinator_address should be defined' traceback before)."""
  env = {k: v for k, v in ENV.items() if not k.startswith(('SLURM_', 'OMPI_', 'PMI_', 'JAX_COORD'))}
  result = _launch('--config', 'tiny', '--distributed', f'--workdir={tmp_path / "run"}', env=env)
  line = _one_error(result, 'error: --distributed: JAX found no cluster to join')
  assert '--coordinator_address=HOST:PORT --num_processes=N --process_id=I' in line, line
  assert not (tmp_path / 'run').exists()


def test_a_coordinator_port_in_use_is_one_line(tmp_path):
  """Process 0 cannot listen on its coordinator's port: one line saying so and naming the fix
  (a segfault or JAX's 'Failed to start RPC server' traceback before)."""
  with socket.socket() as taken:
    taken.bind(('0.0.0.0', 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = _launch('--config', 'tiny', f'--workdir={tmp_path / "run"}',
                     *_processes(f'localhost:{port}', process_id=0))
  line = _one_error(result, f'process 0 cannot listen on port {port}')
  assert 'Choose a free port' in line, line
  assert not (tmp_path / 'run').exists()


def test_a_process_whose_peers_never_join_says_so_and_stops(tmp_path):
  """Process 1 alone: it says what it waits for, then after --initialization_timeout seconds
  stops with one line (JAX aborted it with a C++ stack after 300 s, silent until then)."""
  result = _launch('--config', 'tiny', f'--workdir={tmp_path / "run"}',
                   *_processes(f'localhost:{_free_port()}'), '--initialization_timeout=2')
  assert any(line.startswith('process 1 of 2: waiting up to 2 s (--initialization_timeout) for '
                             'all 2 processes to join at localhost:')
             for line in result.stderr.splitlines()), result.stderr
  _one_error(result, 'error: process 1 of 2: not every process joined at localhost:')
  assert not (tmp_path / 'run').exists()


def test_parallel_devices_of_several_processes_is_every_device():
  """With several processes parallel.devices is 0 or the devices of all of them; a count above
  that names the per-process XLA flag (not the global count)."""
  assert distributed.device_count(config_with(parallel__devices=0), 4, processes=2) == 4
  assert distributed.device_count(config_with(parallel__devices=4), 4, processes=2) == 4
  with pytest.raises(ConfigError, match='parallel.devices=2: a run of 2 processes uses every '
                                        'device of every process'):
    distributed.device_count(config_with(parallel__devices=2), 4, processes=2)
  with pytest.raises(ConfigError) as more:
    distributed.device_count(config_with(parallel__devices=8), 4, processes=2)
  assert 'more devices than the 2 processes have together (4' in str(more.value)
  assert 'xla_force_host_platform_device_count=4 set before each process' in str(more.value)
  assert distributed.device_count(config_with(parallel__devices=2), 4, processes=1) == 2


# Imported first by a process whose PYTHONPATH holds it: it imports megatrain_jax.train some
# seconds late, as a process on a loaded machine is late to a refusal the others already met.
_LATE_TRAIN_IMPORT = """
import importlib.abc, sys, time
class _Late(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == 'megatrain_jax.train':
      sys.meta_path.remove(self)
      time.sleep({seconds})
    return None
sys.meta_path.insert(0, _Late())
"""


def _late(directory, seconds: float) -> dict:
  """The environment of a process that imports megatrain_jax.train `seconds` late."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'sitecustomize.py').write_text(_LATE_TRAIN_IMPORT.format(seconds=seconds))
  return {'PYTHONPATH': os.pathsep.join([str(directory), os.environ.get('PYTHONPATH', '')])}


def _two(workdir, *args, process_1=(), steps: int = 4, homes=(None, None), env_1=None) -> list:
  """launch.py as processes 0 and 1 of 2 (2 CPU devices each) training the small model in
  `workdir`, `args` on both and `process_1` on process 1 only (later flags win); `homes`: each
  process's HOME (None: this one's); `env_1`: variables of process 1's environment."""
  fields = {**SMALL_MODEL, 'data__path': TRAIN_DATA, 'train__steps': steps,
            'train__batch_size': 4, 'train__seq_len': 64, 'train__log_every': 1,
            'train__eval_every': 0, 'train__progress_bar': False, 'checkpoint__every': 2,
            'jax_cache_dir': JAX_CACHE_DIR}
  config = [f'--config.{key.replace("__", ".")}={value}' for key, value in fields.items()]
  env = dict(ENV, XLA_FLAGS='--xla_force_host_platform_device_count=2')
  coordinator = f'127.0.0.1:{_free_port()}'
  return [subprocess.Popen(
      [sys.executable, str(REPO_ROOT / 'launch.py'), '--config', 'tiny', f'--workdir={workdir}',
       *config, *args, *_processes(coordinator, i), *(process_1 if i else ())],
      cwd=REPO_ROOT, env=dict(env, **({'HOME': str(homes[i])} if homes[i] else {}),
                              **(env_1 or {} if i else {})),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]


def _ended(processes, timeout=TRAIN_TIMEOUT_S) -> list[tuple[str, str]]:
  """Each process's (stdout, stderr) once it has ended."""
  try:
    return [p.communicate(timeout=timeout) for p in processes]
  finally:
    for p in processes:
      p.kill()


def test_processes_started_with_different_configs_stop_with_one_line(tmp_path):
  """train.lr, train.steps and --workdir set otherwise on process 1 (it trained silently wrong,
  hung at the end, failed at the first checkpoint): both processes stop at start-up with the
  same line naming those fields, before anything is written."""
  other = tmp_path / 'other'
  processes = _two(tmp_path / 'run', process_1=['--config.train.lr=0.002',
                                                '--config.train.steps=8', f'--workdir={other}'])
  outputs = _ended(processes, timeout=REFUSAL_TIMEOUT_S)
  lines = [_one_error(subprocess.CompletedProcess([], p.returncode, out, err),
                      'the 2 processes were not started with the same config')
           for p, (out, err) in zip(processes, outputs)]
  assert lines[0] == lines[1], lines
  for fragment in ('config.train.lr: 0.003 on process 0, 0.002 on process 1',
                   'config.train.steps: 4 on process 0, 8 on process 1',
                   f"--workdir: '{tmp_path / 'run'}' on process 0, '{other}' on process 1",
                   'Run the same command on every process, changing only --process_id.'):
    assert fragment in lines[0], lines[0]
  assert not (tmp_path / 'run').exists() and not other.exists()


def test_processes_that_plan_other_placements_stop_with_one_line(tmp_path):
  """The same config, but process 1's machine calibrated with little device memory: its plan
  streams the state where process 0's keeps it resident, and the two would wait for each other's
  collectives forever. Both stop with one line naming each plan and the fix."""
  homes = [tmp_path / 'home0', tmp_path / 'home1']
  # 1.53 MB a device (3.4 MB of "device" RAM, which the 2 processes of this one machine split,
  # at the budget's share): the small model's resident step (1.57 MB) no longer fits on each of
  # the 4 devices, the host placement with the embedding on the device (1.50 MB) does.
  small = dataclasses.replace(hardware.PRESETS['cpu'], device_memory_gb=0.0034)
  hardware.save_profile(small, homes[1] / '.cache' / 'megatrain_jax' / 'hardware.json')
  processes = _two(tmp_path / 'run', homes=homes)
  outputs = _ended(processes, timeout=REFUSAL_TIMEOUT_S)
  lines = [_one_error(subprocess.CompletedProcess([], p.returncode, out, err),
                      'the processes planned different placements for their machines')
           for p, (out, err) in zip(processes, outputs)]
  assert 'process 0: resident' in lines[0] and 'process 1: params' in lines[0], lines[0]
  assert lines[0] == lines[1]


def test_several_processes_refuse_a_subset_of_their_devices(tmp_path):
  """parallel.devices=2 of 2 processes x 2 devices (the first 2 are process 0's: process 1 failed
  on arrays it cannot address, after config.json and metrics were written): both stop with one
  line before anything is written. Process 1 comes to the refusal 5 s after process 0 (a loaded
  machine): process 0, gone at once, took it down with an abort (status -6, a C++ stack)."""
  processes = _two(tmp_path / 'run', '--config.parallel.devices=2',
                   env_1=_late(tmp_path / 'late', seconds=5))
  for p, (out, err) in zip(processes, _ended(processes, timeout=REFUSAL_TIMEOUT_S)):
    _one_error(subprocess.CompletedProcess([], p.returncode, out, err),
               'parallel.devices=2: a run of 2 processes uses every device of every process (4 '
               'cpu devices in all here)')
  assert not (tmp_path / 'run').exists()


def test_a_signal_to_one_process_is_named_by_process_0(tmp_path):
  """SIGTERM to process 1 mid-run: both stop at the same step with a checkpoint, and process 0's
  console names the signal and the process it went to (it said 'by None' before: only process 1
  knew)."""
  processes = _two(tmp_path / 'run', steps=400)
  main, other = processes
  try:
    for line in main.stdout:
      if line.startswith('step 3/'):  # both are in the training loop, their handlers installed
        break
    else:
      pytest.fail(f'process 0 ended before training: {main.stderr.read()[-3000:]}')
    other.send_signal(signal.SIGTERM)
    outputs = _ended(processes)
  finally:
    for p in processes:
      p.kill()
  assert [p.returncode for p in processes] == [0, 0], outputs[1][1][-3000:]
  stopped = [line for line in outputs[0][0].splitlines() if line.startswith('stopped at step')]
  assert len(stopped) == 1, outputs[0][0][-3000:]
  assert ' by SIGTERM to process 1; checkpoint saved; rerun the same command' in stopped[0]
  step = int(stopped[0].split()[3])
  assert (tmp_path / 'run' / 'checkpoints' / str(step)).is_dir()


def _copies_of_the_corpus(tmp_path, same_text: bool) -> list:
  """Two machines' HOMEs, each with its own copy of a corpus at ~/corpus.txt (the same path on
  both), process 1's made 100 s later (cp and scp keep no file times); with other text if not
  `same_text`."""
  text = (SHARED_DATA / 'tinyshakespeare' / 'input.txt').read_text()
  homes = [tmp_path / 'home0', tmp_path / 'home1']
  for i, home in enumerate(homes):
    home.mkdir()
    (home / 'corpus.txt').write_text(text[:60_000] if same_text or i == 0 else text[60_000:90_000])
  later = (home / 'corpus.txt').stat().st_mtime + 100
  os.utime(homes[1] / 'corpus.txt', (later, later))
  return homes


def test_processes_take_the_data_process_0_prepared_whatever_their_file_times(tmp_path):
  """Each machine holds a copy of the corpus with other file times: process 1 compared them with
  those process 0 prepared under, then deleted the shared data directory and tokenized the corpus
  again (every start, while process 0 waited in a collective). It takes the files process 0
  prepared as they are."""
  homes = _copies_of_the_corpus(tmp_path, same_text=True)
  processes = _two(tmp_path / 'run', '--config.data.path=~/corpus.txt', homes=homes)
  outputs = _ended(processes)
  assert [p.returncode for p in processes] == [0, 0], outputs[1][1][-3000:]
  meta = json.loads((tmp_path / 'run' / 'data' / 'meta.json').read_text())
  assert meta['train_sources'][0]['mtime_ns'] == (homes[0] / 'corpus.txt').stat().st_mtime_ns


def test_processes_reading_other_data_stop_with_one_line(tmp_path):
  """Another corpus under the same data.path on process 1's machine (with its own data.cache_dir
  there): the processes trained silently on a mix, or hung in a collective. Both stop at start-up
  with one line naming what each read."""
  homes = _copies_of_the_corpus(tmp_path, same_text=False)
  processes = _two(tmp_path / 'run', '--config.data.path=~/corpus.txt',
                   '--config.data.cache_dir=~/data', homes=homes)
  outputs = _ended(processes, timeout=TRAIN_TIMEOUT_S)
  lines = [_one_error(subprocess.CompletedProcess([], p.returncode, out, err),
                      'the processes read different data (process 0: ')
           for p, (out, err) in zip(processes, outputs)]
  assert lines[0] == lines[1] and 'must hold the same files on every machine' in lines[0]


def test_a_refusal_of_one_machine_only_is_one_line_on_every_process(tmp_path):
  """Process 1's offload.dir (a field of each machine's own) is a file: it refuses the run, and
  process 0, waiting in a start-up collective for it, printed a page of traceback (those
  collectives ran outside the lost-process handling). Both now end with one line each."""
  not_a_directory = tmp_path / 'offload-file'
  not_a_directory.write_text('')
  processes = _two(tmp_path / 'run', '--config.offload.params=nvme',
                   '--config.offload.opt_state=nvme',
                   process_1=[f'--config.offload.dir={not_a_directory}'])
  outputs = _ended(processes)
  refused, lost = ['offload.dir=', 'process 0 of 2 lost contact with the other process (1)']
  for p, (out, err), fragment in zip(processes, outputs, [lost, refused]):
    _one_error(subprocess.CompletedProcess([], p.returncode, out, err), fragment)


def test_a_lost_process_names_the_checkpoint_being_committed(monkeypatch):
  """Process 1 lost right after writing its part of a checkpoint: process 0's commit of it (on
  its own thread) is done a moment later, and the error told the user that no checkpoint had
  been committed, so they would start over."""
  class Committing:
    committed = []

    def wait(self):
      self.committed.append(4)

    def steps(self):
      return list(self.committed)

  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  with pytest.raises(ProcessLostError, match=r'they resume from the last checkpoint \(step 4\)'):
    with distributed.lost_process_error(Committing()):
      raise jax.errors.JaxRuntimeError('UNKNOWN: Gloo AllGather failed: Connection reset by peer')
  with pytest.raises(jax.errors.JaxRuntimeError, match='RESOURCE_EXHAUSTED'):  # not a lost one
    with distributed.lost_process_error(Committing()):
      raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 1 GB')
