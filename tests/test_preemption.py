"""Preemption and concurrent use (issue 16): SIGTERM / SIGINT stop a run after the step in flight
with a checkpoint, checkpoint.every_minutes, and one run per workdir and offload.dir.

For each placement (resident, host, nvme) of the kill-chain harness's run (megatrain_jax/
reliability.py: 12 steps, a checkpoint every 3), against one uninterrupted in-process run of it
(`reference`, cached; in-process and launch.py runs of one config agree bitwise):

- `test_preemption_chain`, real launch.py processes in one workdir: a run paused (SIGSTOP) once
  training starts holds the locks, and a second run is refused naming its pid and host, without
  changing a file of the first; the first is then SIGKILLed while holding them, and the run
  started right after is not blocked; it gets SIGTERM at a random step and exits 0 with the
  checkpoint of the step it stopped at; the next resumes from it and gets SIGINT twice (exits at
  once; the committed checkpoints stay intact); the last completes and equals the reference
  bitwise (metrics and final state).
- `test_sigint_at_a_random_point_in_process`: SIGINT at a random time inside a random step of a
  train_and_evaluate call (library use): TrainingStopped, the checkpoint of the stop step, the
  signal handlers from before restored; the resumed run equals the reference bitwise.

And in process, once: a second SIGINT goes to the handler from before the run; handlers are only
installed from the main thread; every_minutes writes a checkpoint at every step when its period is
shorter than a step; and the bad-input rows (locked workdir, locked offload.dir, every_minutes<0).
"""

import contextlib
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from megatrain_jax import config as config_lib
from megatrain_jax import data as data_lib
from megatrain_jax import locks
from megatrain_jax import metrics
from megatrain_jax import preemption
from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.data import shards
from megatrain_jax.errors import ConfigError
from megatrain_jax.reliability import (LAUNCH_PY, PLACEMENTS, REPO_ROOT, STEPS, committed_steps,
                                       final_state, latest_checkpoint, learning_rows,
                                       placement_fields, read_rows, resumed_from, states_equal)

STOPPED = re.compile(r'^stopped at step (\d+) by (SIGTERM|SIGINT); checkpoint saved; rerun the '
                     r'same command to resume$', re.M)


def config_of(fields: dict, **overrides):
  return config_lib.load_config('tiny', **dict(fields, **overrides))


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """reference(placement) -> (learning rows, final state) of the uninterrupted run, in process;
  computed once per placement."""
  cache = {}

  def get(placement: str):
    if placement not in cache:
      workdir = tmp_path_factory.mktemp(f'reference-{placement}')
      fields = placement_fields(placement)
      train.train_and_evaluate(config_of(fields), str(workdir))
      cache[placement] = learning_rows(read_rows(workdir)), final_state(workdir, fields)
    return cache[placement]
  return get


def snapshot(root: pathlib.Path) -> dict:
  """Every file and directory under `root`: inode, size, modification time."""
  return {str(p): (s.st_ino, s.st_size, s.st_mtime_ns)
          for p in sorted(root.rglob('*')) for s in [p.lstat()]}


# ------------------------------------------------------------------------------------------------
# launch.py processes under signals.
# ------------------------------------------------------------------------------------------------

class Started:
  """A launch.py process of the harness's run, its output (stdout and stderr) read line by line
  on a thread; `pause_at_loop_start` SIGSTOPs it as its training loop starts (the 'model:' line),
  holding its locks."""

  def __init__(self, workdir, fields: dict, pause_at_loop_start: bool = False):
    args = [f'--config.{k.replace("__", ".")}={v}' for k, v in fields.items()]
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
    env.pop('MEGATRAIN_FAULT', None)
    self.process = subprocess.Popen(
        [sys.executable, str(LAUNCH_PY), '--config=tiny', *args, f'--workdir={workdir}'],
        cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    self.pid = self.process.pid
    self.lines = []
    self._changed = threading.Condition()
    self._pause = pause_at_loop_start
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stdout:
      if self._pause and line.startswith('model:'):
        self.process.send_signal(signal.SIGSTOP)
        self._pause = False
      with self._changed:
        self.lines.append(line)
        self._changed.notify_all()
    with self._changed:
      self.lines.append(None)  # end of output
      self._changed.notify_all()

  @property
  def output(self) -> str:
    return ''.join(line for line in self.lines if line is not None)

  def wait_for(self, prefix: str, timeout: float = 300) -> str:
    """The first output line that starts with `prefix`, once it is printed."""
    with self._changed:
      found = self._changed.wait_for(
          lambda: any(line is None or line.startswith(prefix) for line in self.lines), timeout)
      match = [line for line in self.lines if line is not None and line.startswith(prefix)]
    assert found and match, f'no line {prefix!r}:\n{self.output[-3000:]}'
    return match[0]

  def signal(self, signum: int) -> None:
    self.process.send_signal(signum)

  def wait_paused(self, timeout: float = 60) -> None:
    """Until every thread of the process is stopped: a thread inside a system call (a write, an
    fsync) finishes it first, and could change a file after SIGSTOP was sent."""
    deadline = time.monotonic() + timeout
    tasks = pathlib.Path(f'/proc/{self.pid}/task')
    while not all(_state(task) in 'Tt' for task in tasks.iterdir()):
      assert time.monotonic() < deadline, f'process {self.pid} did not stop'
      time.sleep(0.01)

  def finish(self, timeout: float = 300) -> int:
    try:
      self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()
    self._reader.join(10)
    return self.process.returncode


def _state(task: pathlib.Path) -> str:
  """A thread's state letter from /proc (R running, S sleeping, D in I/O, T stopped, ...)."""
  try:
    return (task / 'stat').read_text().rsplit(')', 1)[1].split()[0]
  except FileNotFoundError:
    return 'T'  # the thread has exited


def run_to_end(workdir, fields: dict) -> Started:
  run = Started(workdir, fields)
  run.finish()
  return run


def refuse_a_second_run(tmp_path, chain: pathlib.Path, placement: str, holder: Started):
  """While `holder` is paused in `chain`, a second run on its workdir (nvme: another workdir on
  its offload.dir) exits with status 1 naming the holder, and changes nothing of it."""
  fields = placement_fields(placement)
  before = snapshot(chain)
  if placement == 'nvme':
    other = tmp_path / 'other'
    second = run_to_end(other, dict(fields, offload__dir=str(chain / 'offload')))
    what = f'offload.dir {chain / "offload"}'
    assert not other.exists()  # its own workdir, created for its lock, removed again
  else:
    second = run_to_end(chain, fields)
    what = f'workdir {chain}'
  assert second.process.returncode == 1, second.output[-3000:]
  assert (f'error: {what} is in use by another run (pid {holder.pid} on host '
          f'{socket.gethostname()}, started ') in second.output, second.output[-3000:]
  assert 'wait for it, stop it, or' in second.output
  assert snapshot(chain) == before


@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_preemption_chain(tmp_path, shared_data, reference, placement):
  fields = placement_fields(placement)
  rng = random.Random(f'issue-16-{placement}')
  chain = tmp_path / 'chain'
  first = Started(chain, fields, pause_at_loop_start=True)
  expected_rows, expected_state = reference(placement)  # while `first` starts up
  first.wait_for('model:')
  first.wait_paused()
  refuse_a_second_run(tmp_path, chain, placement, first)
  first.signal(signal.SIGKILL)  # kill -9 while it holds the locks
  assert first.finish() == -signal.SIGKILL
  assert (chain / locks.LOCK_FILE).exists()  # left behind, and harmless:

  # Right after the kill: not blocked. SIGTERM at a random step.
  run = Started(chain, fields)
  step = rng.randint(2, 6)
  run.wait_for(f'step {step}/{STEPS} ')
  run.signal(signal.SIGTERM)
  assert run.finish() == 0, run.output[-3000:]
  stopped = STOPPED.search(run.output)
  assert stopped and stopped.group(2) == 'SIGTERM', run.output[-3000:]
  assert 'SIGTERM received: stopping after the step in flight, with a checkpoint; press Ctrl-C ' \
      '(SIGINT) to exit at once without it.' in run.output, run.output[-3000:]
  stop_step = int(stopped.group(1))
  assert step <= stop_step < STEPS and latest_checkpoint(chain, fields) == stop_step
  assert not (chain / locks.LOCK_FILE).exists()  # a clean exit removes it

  # Resumed from the stop step; SIGINT, then SIGINT again while it stops: out at once.
  run = Started(chain, fields)
  step = rng.randint(stop_step + 1, stop_step + 3)
  run.wait_for(f'step {step}/{STEPS} ')
  run.signal(signal.SIGINT)
  run.wait_for('SIGINT received: stopping after the step in flight, with a checkpoint; press '
               'Ctrl-C again')
  run.signal(signal.SIGINT)
  returncode = run.finish()
  assert resumed_from(run.output) == stop_step, run.output[-3000:]
  # -SIGINT: the second one ended it (almost always: it comes milliseconds into a step that then
  # still has to finish and save); 0 if the stop had already finished.
  assert returncode == -signal.SIGINT or (returncode == 0 and STOPPED.search(run.output)), (
      returncode, run.output[-3000:])
  newest = committed_steps(chain)[-1]
  assert newest >= stop_step and latest_checkpoint(chain, fields) == newest  # intact

  final = run_to_end(chain, fields)  # right after a death by signal: not blocked either
  assert final.process.returncode == 0, final.output[-3000:]
  assert resumed_from(final.output) == newest
  assert learning_rows(read_rows(chain)) == expected_rows  # bitwise
  assert states_equal(final_state(chain, fields), expected_state)


# ------------------------------------------------------------------------------------------------
# In process (library use).
# ------------------------------------------------------------------------------------------------

def signal_during_step(monkeypatch, step: int, delay_s: float | None, signum: int) -> None:
  """Sends `signum` to this process `delay_s` after step `step` starts (RunLog.timed_step), from
  a timer thread; with `delay_s=None` as the step starts, from the main thread."""
  original = metrics.RunLog.timed_step

  def timed_step(self, done, train_step, batch):
    if done == step and delay_s is None:
      os.kill(os.getpid(), signum)
    elif done == step:
      threading.Timer(delay_s, os.kill, (os.getpid(), signum)).start()
    return original(self, done, train_step, batch)

  monkeypatch.setattr(metrics.RunLog, 'timed_step', timed_step)


def _previous_int(signum, frame):
  raise AssertionError('the previous SIGINT handler was called')


@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_sigint_at_a_random_point_in_process(tmp_path, shared_data, reference, monkeypatch,
                                             placement):
  fields = placement_fields(placement)
  expected_rows, expected_state = reference(placement)
  rng = random.Random(f'issue-16-sigint-{placement}')
  step, delay_s = rng.randint(1, STEPS - 3), rng.uniform(0.0, 0.03)
  signal_during_step(monkeypatch, step, delay_s, signal.SIGINT)
  previous = signal.signal(signal.SIGINT, _previous_int), signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(preemption.TrainingStopped) as stopped:
      train.train_and_evaluate(config_of(fields), str(tmp_path))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == (
        _previous_int, previous[1])  # restored
  finally:
    signal.signal(signal.SIGINT, previous[0])
  monkeypatch.undo()
  assert stopped.value.signal_name == 'SIGINT' and stopped.value.saved
  assert step <= stopped.value.step < STEPS
  assert latest_checkpoint(tmp_path, fields) == stopped.value.step
  assert str(stopped.value) == (f'stopped at step {stopped.value.step} by SIGINT; checkpoint '
                                'saved; rerun the same command to resume')
  assert not (tmp_path / locks.LOCK_FILE).exists()
  train.train_and_evaluate(config_of(fields), str(tmp_path))
  assert learning_rows(read_rows(tmp_path)) == expected_rows
  assert states_equal(final_state(tmp_path, fields), expected_state)


class Aborted(Exception):
  """Raised by the test's SIGINT handler: the second SIGINT reached the handler from before."""


def test_a_second_sigint_goes_to_the_previous_handler(tmp_path, shared_data, monkeypatch):
  """The first SIGINT stops the run after its step; a second one, sent inside the stop's save
  (after its files are written, while its commit runs), reaches the handler installed before the
  run at once. The checkpoints committed before are intact and the run resumes."""
  fields = placement_fields('resident')
  signal_during_step(monkeypatch, 5, None, signal.SIGINT)
  original_save = Checkpointer.save
  saves = []

  def save(self, step, *args, **kwargs):
    original_save(self, step, *args, **kwargs)
    saves.append(step)
    if step == 5:  # the stop's save (the periodic ones are at 3, 6, 9, 12)
      os.kill(os.getpid(), signal.SIGINT)

  def abort(signum, frame):
    raise Aborted

  monkeypatch.setattr(Checkpointer, 'save', save)
  previous = signal.signal(signal.SIGINT, abort)
  try:
    with pytest.raises(Aborted):
      train.train_and_evaluate(config_of(fields), str(tmp_path))
    assert signal.getsignal(signal.SIGINT) is abort
  finally:
    signal.signal(signal.SIGINT, previous)
  monkeypatch.undo()
  assert saves == [3, 5]
  assert committed_steps(tmp_path)[0] == 3 and latest_checkpoint(tmp_path, fields) in (3, 5)
  assert not (tmp_path / locks.LOCK_FILE).exists()
  rerun = train.train_and_evaluate(config_of(fields, train__steps=6), str(tmp_path))
  assert rerun['step'] == 6


def test_a_stop_signal_during_a_save_stops_after_that_save(tmp_path, shared_data, monkeypatch):
  """A SIGTERM that lands while a periodic checkpoint is saved: the run stops right after that
  save, which holds every step taken (it trained one more step and saved again, a step and a
  checkpoint out of the grace period)."""
  fields = placement_fields('resident')
  original_save = Checkpointer.save
  saves = []

  def save(self, step, *args, **kwargs):
    original_save(self, step, *args, **kwargs)
    saves.append(step)
    if step == 3:  # the periodic ones are at 3, 6, 9, 12
      os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(Checkpointer, 'save', save)
  with pytest.raises(preemption.TrainingStopped) as stopped:
    train.train_and_evaluate(config_of(fields), str(tmp_path))
  assert saves == [3] and stopped.value.step == 3 and stopped.value.saved
  assert committed_steps(tmp_path) == [3]


def test_a_sigterm_after_the_last_step_waits_for_the_last_commit(tmp_path, shared_data,
                                                                   monkeypatch):
  """A SIGTERM that lands after the last step, while the checkpointer commits the final
  checkpoint (a scheduler's, as the run ends): the commit completes and the run ends normally.
  Before, the handlers were given back when the training loop ended, and the signal's earlier
  action (SIG_DFL under launch.py: exit 143) left the final checkpoint uncommitted."""
  fields = placement_fields('resident')
  original_close = Checkpointer.close

  def close(self):
    os.kill(os.getpid(), signal.SIGTERM)
    original_close(self)

  def abort(signum, frame):
    raise Aborted

  monkeypatch.setattr(Checkpointer, 'close', close)
  previous = signal.signal(signal.SIGTERM, abort)
  try:
    last = train.train_and_evaluate(config_of(fields), str(tmp_path))
    assert signal.getsignal(signal.SIGTERM) is abort  # given back once the commit is done
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert last['step'] == 12 and committed_steps(tmp_path)[-1] == 12


def test_a_stop_does_not_wait_for_the_whole_data_check(tmp_path, shared_data, monkeypatch):
  """The prepared data's check (shards.ShardVerifier, every file read beside training) can take
  hours on a large corpus: a stop's checkpoint did not wait for it, where a scheduler's grace
  period ended first and nothing was saved. The last checkpoint of a run still waits."""
  fields = placement_fields('resident')
  reading = threading.Event()
  monkeypatch.setattr(shards.ShardVerifier, '_verify', lambda self: reading.wait(120))
  signal_during_step(monkeypatch, 2, None, signal.SIGTERM)
  started = time.monotonic()
  try:
    with pytest.raises(preemption.TrainingStopped) as stopped:
      train.train_and_evaluate(config_of(fields), str(tmp_path))
    assert stopped.value.step == 2 and committed_steps(tmp_path) == [2]
    assert time.monotonic() - started < 60
  finally:
    reading.set()


def test_sigint_ends_a_prepare_at_once_and_keeps_its_shards(tmp_path, shared_data):
  """Ctrl-C during --prepare (one worker: the tokenizer runs in this process, where a
  KeyboardInterrupt could land in one of JAX's gc callbacks and be swallowed, and the prepare
  went on to the end) ends it within seconds, status 130, one line saying how to resume; the
  shards committed so far stay for the rerun."""
  from tokenizers import (  # pylint: disable=g-import-not-at-top
      Tokenizer, models, pre_tokenizers, trainers)
  text = (shared_data / 'wikitext-2' / 'valid.txt').read_text()
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.train_from_iterator([text], trainers.BpeTrainer(
      vocab_size=1000, special_tokens=['<eos>'], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(tmp_path / 'tokenizer.json'))
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(text * 10)  # ~11 MB: several seconds of tokenizing here
  workdir = tmp_path / 'run'
  process = subprocess.Popen(
      [sys.executable, str(LAUNCH_PY), '--prepare', f'--workdir={workdir}',
       f'--config.data.path={corpus}', f'--config.data.tokenizer={tmp_path / "tokenizer.json"}',
       '--config.data.eos_token=<eos>', '--config.model.vocab_size=1000',
       '--config.data.num_workers=1', '--config.data.shard_tokens=50000'],
      cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 120
  while not list((workdir / 'data').glob('train-00000.bin')) and time.monotonic() < deadline:
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  sent = time.monotonic()
  _, stderr = process.communicate(timeout=60)
  assert process.returncode == 130, stderr[-2000:]
  assert time.monotonic() - sent < 10
  assert 'prepare stopped by SIGINT: the shards written so far are kept; rerun the command to ' \
      'resume.' in stderr and 'Traceback' not in stderr, stderr[-2000:]
  assert (workdir / 'data' / 'train-00000.bin').is_file()
  assert not (workdir / 'data' / 'meta.json').exists()  # not finished: the rerun resumes


@pytest.mark.parametrize('saves', [True, False])
def test_a_stop_says_whether_it_saves(capfd, saves):
  """A run without checkpoints (checkpoint.every=-1) promised one on SIGTERM, then saved none."""
  with preemption.StopSignals(signals=(signal.SIGTERM,), saves=saves):
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
  err = capfd.readouterr().err
  if saves:
    assert 'stopping after the step in flight, with a checkpoint; press Ctrl-C' in err, err
    assert 'already stopping (saving the checkpoint of the step in flight).' in err, err
  else:
    assert ('stopping after the step in flight (no checkpoint: checkpoint.every=-1); press '
            'Ctrl-C (SIGINT) to exit at once.') in err and 'checkpoint of the' not in err, err


def test_stop_signals_in_the_main_thread_only():
  previous = signal.getsignal(signal.SIGTERM)
  with preemption.StopSignals() as stop:
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # again: noted, still running
    assert stop.received == 'SIGTERM'
  assert signal.getsignal(signal.SIGTERM) == previous
  seen = []

  def in_a_thread():
    with preemption.StopSignals() as stop:
      seen.append((signal.getsignal(signal.SIGTERM), stop.requested))

  thread = threading.Thread(target=in_a_thread)
  thread.start()
  thread.join()
  assert seen == [(previous, False)]


def test_checkpoint_clock():
  now = [100.0]
  clock = preemption.CheckpointClock(0.5, now=lambda: now[0])
  now[0] += 29.0
  assert not clock.due()
  now[0] += 1.0
  assert clock.due()
  clock.reset()
  assert not clock.due()
  assert not preemption.CheckpointClock(0.0, now=lambda: 1e9).due()  # 0 = off
  assert preemption.agreed(True, False) == (True, False)  # one process: its own decisions


def test_every_minutes_checkpoints_on_time(tmp_path, shared_data):
  """A period shorter than any step: a checkpoint after every step, none of them due by
  checkpoint.every (0: at the end only)."""
  config = config_of(placement_fields('resident'), train__steps=4, checkpoint__every=0,
                     checkpoint__every_minutes=1e-6, checkpoint__keep=4)
  train.train_and_evaluate(config, str(tmp_path))
  assert committed_steps(tmp_path) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------
# Locks, and the bad-input rows.
# ------------------------------------------------------------------------------------------------

def test_lock_names_its_holder_and_goes_away(tmp_path):
  directory = tmp_path / 'a' / 'b'
  with locks.hold_workdir(directory):
    with pytest.raises(locks.DirectoryInUseError) as refused:
      locks.DirectoryLock(directory, 'workdir', 'choose another --workdir').acquire()
    assert str(refused.value).startswith(
        f'workdir {directory} is in use by another run (pid {os.getpid()} on host '
        f'{socket.gethostname()}, started ')
    assert str(refused.value).endswith(f'workdir {directory}): wait for it, stop it, or choose '
                                       'another --workdir.')
    assert isinstance(refused.value, ConfigError)
  assert not (tmp_path / 'a').exists()  # created for the lock, removed with it
  with locks.hold_workdir(tmp_path):  # an existing directory stays
    with locks.hold_offload_dir(tmp_path, tmp_path):  # offload.dir = the workdir: held already
      pass
  assert list(tmp_path.iterdir()) == []


def test_a_deleted_lock_file_does_not_let_a_second_run_in(tmp_path):
  """A run's lock file deleted while it runs (a tmp cleaner, a 'stale lock' removed by hand): a
  second run was let in beside it (and the first died on a store file the second replaced)."""
  with locks.hold_workdir(tmp_path):
    (tmp_path / locks.LOCK_FILE).unlink()
    with pytest.raises(locks.DirectoryInUseError, match=(
        rf'workdir {tmp_path} is in use by another run: one reading it \(.*\), or one whose '
        r'.megatrain.lock was deleted while it ran, so it cannot be named: wait for it, stop it, '
        r'or ')):
      locks.DirectoryLock(tmp_path, 'workdir', 'choose another --workdir').acquire()
    assert not (tmp_path / locks.LOCK_FILE).exists()  # the refused one's is gone with it
  with locks.hold_workdir(tmp_path):  # given back: the next run takes it
    pass


def test_a_training_run_holds_its_prepared_data_against_another_prepare(tmp_path, shared_data):
  """A run holds the data directory it reads for its life: a prepare of other data into it (a
  --prepare into the run's workdir, a run sharing its data.cache_dir) is refused, where it
  replaced the shards the run was reading; the same data is read beside it, and once the run
  ends the prepare goes ahead."""
  text = shared_data / 'tinyshakespeare' / 'input.txt'
  other = tmp_path / 'other.txt'
  other.write_text(text.read_text()[:20_000])
  cache = tmp_path / 'cache'
  config = config_of({}, data__path=str(text), data__cache_dir=str(cache))
  with contextlib.ExitStack() as held:
    train._open_data(config, tmp_path / 'run', 1, -1, '', held=held)  # the run's data, held
    shards = sorted(p.name for p in cache.iterdir())
    data_lib.load_data(config.data, tmp_path / 'beside')  # the same data: read, not prepared
    with pytest.raises(locks.DirectoryInUseError, match=rf'data directory {cache} is in use by '
                                                        'another run: one reading it'):
      data_lib.load_data(dict(config.data, path=str(other)), tmp_path / 'w')
    assert sorted(p.name for p in cache.iterdir()) == shards
  info, _ = data_lib.load_data(dict(config.data, path=str(other)), tmp_path / 'w')
  assert info.train_tokens < 20_000


def test_a_filesystem_without_flock_warns_and_runs(tmp_path, monkeypatch, capfd):
  def no_locks(fd, operation):
    raise OSError(38, 'Function not implemented')

  monkeypatch.setattr(locks.fcntl, 'flock', no_locks)
  with locks.hold_workdir(tmp_path):
    pass
  err = capfd.readouterr().err
  assert f'warning: cannot lock workdir {tmp_path} (Function not implemented' in err
  assert 'running without protection against a second run' in err


def test_locked_workdir_is_refused_before_anything_is_written(tmp_path):
  workdir = tmp_path / 'run'
  with locks.hold_workdir(workdir):
    before = snapshot(tmp_path)
    with pytest.raises(locks.DirectoryInUseError,
                       match=rf'workdir {re.escape(str(workdir))} is in use by another run \(pid '
                             rf'{os.getpid()} on host .*choose another --workdir'):
      train.train_and_evaluate(config_lib.load_config('tiny', jax_cache_dir=''), str(workdir))
    assert snapshot(tmp_path) == before


def test_a_data_directory_being_prepared_is_refused_to_a_second_prepare(tmp_path, shared_data):
  """One prepare at a time per data directory: a second (another --prepare, or a run sharing
  data.cache_dir) is refused naming the holder, and its shards are left alone; once free, the
  prepare runs."""
  from megatrain_jax.data import (  # pylint: disable=g-import-not-at-top
      ByteTokenizer, prepare_dataset)
  out = tmp_path / 'cache'
  source = shared_data / 'tinyshakespeare' / 'input.txt'
  with locks.hold(out, 'data directory', 'point data.cache_dir at another directory'):
    (out / 'train-00000.bin').write_bytes(b'theirs')
    with pytest.raises(locks.DirectoryInUseError,
                       match=rf'data directory {re.escape(str(out))} is in use .*pid '
                             rf'{os.getpid()}.*point data.cache_dir at another directory'):
      prepare_dataset(out, ByteTokenizer(), train_sources=[source])
    assert (out / 'train-00000.bin').read_bytes() == b'theirs'
  assert prepare_dataset(out, ByteTokenizer(), train_sources=[source]).train_tokens > 0


def test_locked_offload_dir_is_refused_before_anything_is_written(tmp_path):
  stores = tmp_path / 'stores'
  config = config_lib.load_config('tiny', jax_cache_dir='', offload__params='nvme',
                                  offload__opt_state='nvme', offload__dir=str(stores))
  with locks.hold_offload_dir(stores, tmp_path / 'first'):
    before = snapshot(tmp_path)
    with pytest.raises(locks.DirectoryInUseError,
                       match=rf'offload.dir {re.escape(str(stores))} is in use by another run .*'
                             r'point offload.dir at another directory'):
      train.train_and_evaluate(config, str(tmp_path / 'run'))
    assert snapshot(tmp_path) == before  # the refused run's workdir is gone again


def test_every_minutes_below_zero_is_refused(tmp_path):
  config = config_lib.load_config('tiny', jax_cache_dir='', checkpoint__every_minutes=-1.0)
  with pytest.raises(ConfigError, match=r'checkpoint.every_minutes: must be >= 0 \(minutes '
                                        r'between time-based checkpoints; 0 = off\), got -1.0.'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()

