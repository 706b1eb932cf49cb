"""kill -9 fault injection: named points in the training loop where a test can SIGKILL the process.

A fault point is one line in the code it instruments, `faults.point('backward')`. It does nothing
unless the environment variable MEGATRAIN_FAULT names it:

    MEGATRAIN_FAULT=backward:5     # SIGKILL this process the 5th time it passes 'backward'

    MEGATRAIN_FAULT=backward:5:raise   # raise InjectedFault there instead: an error in this
                                       # process (a bug, a full disk), not a dead machine

Counting starts at 1 in each process. The kill is `os.kill(os.getpid(), SIGKILL)`: no Python
cleanup, no `finally`, no flush of buffered files, no atexit, background threads (orbax's async
checkpoint writer, the NVMe write-behind) stopped wherever they are. That is what a crash, an
OOM kill or a preempted machine looks like, and what resume must survive without losing data.

The points (and how often each is passed per training step, with G layer groups):

  forward     streamed: once per group in the forward loop (G per step), after the group's
              forward is dispatched; resident: before the jitted step is dispatched (1 per step).
  backward    streamed: once per group in the backward loop (G per step), after the group's
              backward is dispatched; resident: right after the step is dispatched, while it runs
              (the old state is donated, the new one not yet materialised) (1 per step).
  optimizer   streamed: between writing a group's new weights and its new Adam state to their
              stores (a torn group update; G per step), and after the embedding/head update (1).
              With exact clipping a step's G group passes come in the next step's forward (or in
              the flush before a checkpoint): still G + 1 per step over a run.
  checkpoint  twice per save (checkpoint.py): in `save`, right after the background write is
              submitted, and on the background writer once the in-memory leaves are written but
              before meta.json, the manifest and the commit rename (files partly written).

Tests pick the n-th pass from these counts (`passes_per_step`). A kill at a random wall-clock time
from outside (the other fault kind) needs no hook: see `kill_after`. megatrain_jax/reliability.py
runs launch.py processes under both kinds and compares what they leave.
"""

import os
import signal
import threading

ENV = 'MEGATRAIN_FAULT'
PHASES = ('forward', 'backward', 'optimizer', 'checkpoint')
CHECKPOINT_PASSES_PER_SAVE = 2

_counts: dict[str, int] = {}
_lock = threading.Lock()  # the checkpoint point may be passed from a background thread


class InjectedFault(RuntimeError):
  """What a `PHASE:N:raise` fault point raises."""


def _target() -> tuple[str, int, str] | None:
  """(phase, n, action) from $MEGATRAIN_FAULT ('kill' or 'raise'), or None. Read at each pass:
  cheap, and tests may set it."""
  spec = os.environ.get(ENV)
  if not spec:
    return None
  phase, n, *action = spec.split(':')
  if (phase not in PHASES or not n.isdigit() or int(n) < 1
      or action not in ([], ['kill'], ['raise'])):
    # A typo must not silently turn a fault test into a clean run.
    raise ValueError(f'{ENV}={spec!r}: expected PHASE:N or PHASE:N:raise with PHASE one of '
                     f'{", ".join(PHASES)} and N >= 1')
  return phase, int(n), action[0] if action else 'kill'


def point(phase: str) -> None:
  """Passes the fault point `phase`; SIGKILLs the process (or raises InjectedFault) if this is the
  pass $MEGATRAIN_FAULT names. A no-op (one dict lookup) when the variable is unset."""
  target = _target()
  if target is None or target[0] != phase:
    return
  with _lock:
    _counts[phase] = _counts.get(phase, 0) + 1
    hit = _counts[phase] == target[1]
  if hit and target[2] == 'raise':
    raise InjectedFault(f'injected fault at {phase} pass {target[1]} ({ENV})')
  if hit:
    # Unbuffered, so the parent can see where the run died; then no cleanup of any kind.
    os.write(2, f'\nfaults: SIGKILL at {phase} pass {target[1]}\n'.encode())
    os.kill(os.getpid(), signal.SIGKILL)


def passes_per_step(phase: str, *, streamed: bool, groups: int) -> int:
  """How many times a training step passes `phase` (see the module docstring); 0 if never."""
  if phase == 'checkpoint':
    return 0  # per save, not per step: see CHECKPOINT_PASSES_PER_SAVE
  if not streamed:
    return 1 if phase in ('forward', 'backward') else 0
  return groups + 1 if phase == 'optimizer' else groups


def kill_after(process, seconds: float) -> threading.Timer:
  """SIGKILLs the child `process` (a subprocess.Popen) after `seconds` of wall-clock time, unless
  it has exited by then: the random-time fault, independent of any fault point. Returns the
  started timer (cancel it if the process is waited on another way)."""

  def kill():
    if process.poll() is None:
      process.send_signal(signal.SIGKILL)

  timer = threading.Timer(seconds, kill)
  timer.daemon = True
  timer.start()
  return timer
