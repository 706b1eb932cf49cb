"""More than one device (issue 13, one process): 4 forced CPU devices train to the numbers of one.

The runs happen in a subprocess (tests/distributed_runs.py; XLA_FLAGS must give it 4 devices
before jax starts, and this worker's jax runs on one), once for the module: the resident engine
and the streamed engine with host and NVMe placements on a Layout over 4 devices, against the
resident engine on one device in the same process, M = 2 microbatches of 4 sequences, exact
clipping; then a 2-step train.train_and_evaluate with parallel.devices = 4. And the same
engines in 2 processes x 2 devices joined by jax.distributed (gloo), each process feeding its half
of every microbatch, against the same one-device losses.

Bad input for parallel.devices is checked here, in this one-device process.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, SHARED_DATA, config_with
from megatrain_jax import distributed, train
from megatrain_jax.errors import ConfigError

LOSS_RTOL = 1e-5
TIMEOUT_S = 600


RUNS_PY = REPO_ROOT / 'tests' / 'distributed_runs.py'
ENV = dict(os.environ, JAX_PLATFORMS='cpu',
           PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / 'tests')]))


def _report(stdout: str) -> dict:
  """tests/distributed_runs.py's JSON: its last stdout line (gloo prints lines of its own)."""
  return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
  """The one-process, 4-device runs."""
  tmp = tmp_path_factory.mktemp('distributed')
  result = subprocess.run(
      [sys.executable, str(RUNS_PY), str(tmp / 'offload'), str(tmp / 'run'),
       str(SHARED_DATA / 'tinyshakespeare' / 'input.txt')],
      cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-5000:]
  return _report(result.stdout)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def process_runs() -> list[dict]:
  """The 2-process x 2-device runs: each process's report."""
  coordinator = f'127.0.0.1:{_free_port()}'
  processes = [subprocess.Popen([sys.executable, str(RUNS_PY), '--process', str(i), coordinator],
                                cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in processes]
  finally:
    for p in processes:
      p.kill()
  for p, (_, stderr) in zip(processes, outputs):
    assert p.returncode == 0, stderr[-5000:]
  return [_report(stdout) for stdout, _ in outputs]


def _assert_losses_match(got: list, want: list) -> None:
  assert len(got) == len(want)
  for step, (a, b) in enumerate(zip(got, want)):
    assert abs(a - b) <= LOSS_RTOL * abs(b), (step, a, b)


@pytest.mark.parametrize('name', ['resident', 'host', 'nvme'])
def test_four_devices_train_like_one(runs, name):
  """Same losses (1e-5 relative) and final state (helpers.assert_states_match) as one device."""
  _assert_losses_match(runs[name]['losses'], runs['reference'])
  assert runs[name]['state_error'] is None, runs[name]['state_error']


@pytest.mark.parametrize('name', ['resident', 'host', 'nvme'])
def test_state_is_split_over_the_four_devices(runs, name):
  """Large leaves (weights, Adam moments; in device and pinned host memory) span the 4 devices
  with a PartitionSpec that splits them, ZeRO-3 style."""
  for leaf, split in runs[name]['splits'].items():
    assert split['devices'] == 4, (leaf, split)
    assert "'data'" in split['spec'], (leaf, split)


@pytest.mark.parametrize('name', ['resident', 'host'])
def test_two_processes_train_like_one_device(runs, process_runs, name):
  """2 processes x 2 devices, each feeding its half of every batch: the one-device losses, in
  both processes; the state split over the 4 devices of both."""
  assert [r['process'] for r in process_runs] == [0, 1]
  for report in process_runs:
    _assert_losses_match(report[name]['losses'], runs['reference'])
    for leaf, split in report[name]['splits'].items():
      assert split['devices'] == 4 and "'data'" in split['spec'], (leaf, split)


def test_trainer_refuses_several_processes(process_runs):
  """Not yet supported by train.py (workdir lock, data, metrics, checkpoints are per process):
  refused with a ConfigError before anything is written."""
  for report in process_runs:
    assert 'training across processes is not supported' in report['trainer_refusal']


def test_train_runs_on_four_devices(runs):
  """parallel.devices = 4 end to end: the startup line says so, the loss is finite."""
  (line,) = runs['train']['startup']
  assert 'on 4 x cpu devices, 1 process' in line, line
  assert 0 < runs['train']['loss'] < 10 and 0 < runs['train']['eval'] < 10, runs['train']


def test_batch_that_does_not_split_is_refused(runs):
  assert 'does not split' in runs['bad_batch'] and 'train.batch_size' in runs['bad_batch']


def test_more_devices_than_visible_is_refused(tmp_path):
  """This process sees one CPU device: asking for 2 is an error before anything is allocated,
  naming the field and the fix (on CPU: the XLA flag)."""
  config = config_with(parallel__devices=2)
  with pytest.raises(ConfigError, match=r'parallel\.devices=2 .*xla_force_host_platform'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_negative_parallel_devices_is_refused(tmp_path):
  with pytest.raises(ConfigError, match=r'parallel\.devices: must be an integer >= 0'):
    train.train_and_evaluate(config_with(parallel__devices=-1), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('value', [1.5, True])
def test_parallel_devices_must_be_an_integer(value):
  config = config_with()
  with config.parallel.ignore_type():  # as a Python caller could set it (the CLI checks types)
    config.parallel.devices = value
  with pytest.raises(ConfigError, match=r'parallel\.devices: must be an integer >= 0'):
    distributed.device_count(config)


def test_batch_size_must_split_over_the_devices():
  config = config_with(train__batch_size=6, parallel__devices=4)
  with pytest.raises(ConfigError, match=r'train\.batch_size=6 does not split over 4 devices.*'
                                        r'e\.g\. 4 or 8'):
    distributed.device_count(config, available=4)
  assert distributed.device_count(config_with(train__batch_size=8), available=4) == 4
