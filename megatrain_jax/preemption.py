"""Graceful stop on SIGTERM / SIGINT, and time-based checkpoints: when the training loop saves and
when it stops.

A preemptible machine is told before it goes away: a cloud spot instance, a SLURM job at its time
limit (or `scancel`), Kubernetes and systemd all send SIGTERM, then SIGKILL some seconds later; a
person at the keyboard sends SIGINT (Ctrl-C). `StopSignals` turns the first of either into a
request the training loop reads after each step: the step in flight finishes (for the streamed
engine, its write-backs land before the checkpoint links the stores), the checkpoint of that
step is saved and committed, and `train_and_evaluate` raises `TrainingStopped` (launch.py: exit
status 0, "rerun the same command to resume").

Afterwards:
  - SIGINT (the user insists) goes straight to the handler that was installed before the run,
    which the first signal puts back: Python's default raises KeyboardInterrupt, launch.py's
    (SIG_DFL) ends the process at once, even inside a long XLA call. The checkpoint being saved
    is then abandoned: saves are atomic (written to .tmp-<step>, renamed when complete), so the
    newest committed checkpoint stays intact.
  - a second SIGTERM is noted and ignored: schedulers resend it (SLURM's `--signal` warning and
    then the time limit), and the save in progress is what they are waiting for.

Library and notebook use: the handlers are installed only from the start of the training loop
until the run's last checkpoint is committed (a SIGTERM as the run ends waits for that commit),
only from the main thread (Python delivers signals there; elsewhere `StopSignals` does nothing),
and the previous handlers are restored then, however the run ends. Before the loop (validation,
data preparation, restore) the signals keep their usual effect: nothing trained is lost, and the
start-up is safe to kill at any point (tests/test_reliability.py kills it with SIGKILL).

The handler itself only records the signal and writes one line to stderr (`_say`).

Several processes (issue 13) must act on the same step: every decision a process takes from
local facts (a signal it received, its own clock) goes through `agreed`, the one place a
multi-process run makes collective.
"""

import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(KeyboardInterrupt):
  """The run stopped early on SIGTERM or SIGINT, after committing a checkpoint of `step` (unless
  checkpoints are off: `checkpoint.every=-1`). Rerunning the same command resumes from it.

  A KeyboardInterrupt, like the interrupt it answers: code that catches Exception does not
  swallow it, and a notebook cell shows as interrupted. launch.py exits with status 0."""

  def __init__(self, message: str, step: int, signal_name: str, saved: bool):
    super().__init__(message)
    self.step, self.signal_name, self.saved = step, signal_name, saved


def agreed(*local: bool) -> tuple[bool, ...]:
  """The values of per-process decisions (stop now; save now on time) that every process of the
  run acts on, at every step, in the same order on every process: each flag is true if it is in
  any process (one process: its own values), so all processes stop and save at the same step
  and their checkpoint is one. Several processes: one small all-gather over the processes."""
  flags = np.array([bool(flag) for flag in local])
  if jax.process_count() > 1:
    flags = np.asarray(multihost_utils.process_allgather(flags)).reshape(-1, len(flags)).any(0)
  return tuple(bool(flag) for flag in flags)


class StopSignals:
  """Context manager: while it is active, the first SIGTERM or SIGINT sets `received` (the
  signal's name) instead of ending the process; see the module docstring for later ones.

  `armed=False`: entering installs nothing until `arm()`. train_and_evaluate enters it before the
  checkpointer's close and arms it when training starts, so that it stays active until the last
  commit is done: a SIGTERM landing between the last step and that commit (a scheduler's, as
  the run ends) no longer ends the process with the final checkpoint uncommitted."""

  def __init__(self, signals=STOP_SIGNALS, saves: bool = True, armed: bool = True):
    self.signals = tuple(signals)
    self.saves = saves  # False: the run saves no checkpoints (checkpoint.every=-1)
    self.received: str | None = None
    self._previous = {}
    self._armed = armed
    self._entered = False

  @property
  def requested(self) -> bool:
    return self.received is not None

  def __enter__(self) -> 'StopSignals':
    self._entered = True
    if self._armed:
      self._install()
    return self

  def arm(self) -> None:
    """Installs the handlers now (entered with armed=False); once only."""
    if self._entered and not self._armed:
      self._armed = True
      self._install()

  def _install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return  # signal.signal works only in the main thread; signals are delivered there
    for signum in self.signals:
      previous = signal.getsignal(signum)
      if previous is None:  # a handler installed outside Python: leave it alone
        continue
      signal.signal(signum, self._handle)
      self._previous[signum] = previous

  def __exit__(self, *exc) -> None:
    self._entered = False
    self._restore()

  def _restore(self, signums=None) -> None:
    for signum in list(self._previous if signums is None else signums):
      if signum in self._previous:
        signal.signal(signum, self._previous.pop(signum))

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.received is not None:  # SIGTERM again (SIGINT is no longer ours)
      _say(f'{name} received again: already stopping' + (
          ' (saving the checkpoint of the step in flight).' if self.saves else '.'))
      return
    self.received = name
    # From now on SIGINT goes straight to the handler from before the run: the way out at once.
    self._restore([signal.SIGINT])
    again = ' again' if signum == signal.SIGINT else ' (SIGINT)'
    if self.saves:
      _say(f'{name} received: stopping after the step in flight, with a checkpoint; press Ctrl-C'
           f'{again} to exit at once without it.')
    else:
      _say(f'{name} received: stopping after the step in flight (no checkpoint: '
           f'checkpoint.every=-1); press Ctrl-C{again} to exit at once.')


def _say(line: str) -> None:
  """One line on stderr from a signal handler: os.write to its file descriptor, never through a
  buffered stream the interrupted main thread may be writing to (tqdm's bar is on stderr). A
  stderr without a descriptor (a notebook, a captured stream) is written as a Python stream."""
  text = f'\n{line}\n'
  try:
    fd = sys.stderr.fileno()
  except (AttributeError, OSError, ValueError):
    fd = None
  try:
    if fd is not None:
      os.write(fd, text.encode())
    else:
      sys.stderr.write(text)
      sys.stderr.flush()
  except (OSError, ValueError, RuntimeError):
    pass  # no stderr to write to: the stop still happens


class CheckpointClock:
  """`checkpoint.every_minutes`: due once that many minutes have passed since the last
  checkpoint (or since the training loop started); 0 = never. `now` is for tests."""

  def __init__(self, minutes: float, now=time.monotonic):
    self.seconds = 60.0 * minutes
    self._now = now
    self._last = now()

  def due(self) -> bool:
    return self.seconds > 0 and self._now() - self._last >= self.seconds

  def reset(self) -> None:
    """A checkpoint was just saved (on time or not): the next one is due `minutes` from now."""
    self._last = self._now()
