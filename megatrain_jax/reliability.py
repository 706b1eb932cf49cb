"""Run real launch.py processes under fault points and compare what they leave.

The harness behind tests/test_reliability.py (kill -9 at any point loses nothing) and
bench/reliability.py (kills, flipped checkpoint bytes and full disks, counted per placement). It
imports nothing of the training loop: each run is a real `python launch.py` process of this
checkout on the CPU, and everything is judged from what the run leaves in its workdir
(metrics.jsonl, checkpoints) and prints.

- The run: a small model, 12 steps with a checkpoint every 3 (`FIELDS`), under one of
  `PLACEMENTS` (resident; host: params + Adam state in pinned host RAM; nvme: both on NVMe).
- Running it: `launch` starts launch.py, optionally SIGKILLed at a fault point
  (megatrain_jax/faults.py: 'phase:n') or from outside after a delay, and times it (`Run`).
- Judging it: `read_rows` / `learning_rows` (the metrics that must be bitwise reproducible),
  `latest_checkpoint` (where a rerun resumes), `final_state` / `states_equal` (the newest
  checkpoint's train state, compared bitwise), `resumed_from` (what a run says it resumed from).
- Kill plans: `kill_plan` draws fault kinds with a seeded RNG, `plan_fault` turns one into a
  'phase:n' that lands inside the steps a run will train, `run_killed` runs one killed process,
  `kill_chain` a chain of them in one workdir (each resuming what the last left), and
  `known_committed` says which checkpoint a killed run must have left behind.
- Faults beyond kills: `flip_a_byte` (a damaged checkpoint), `tmpfs` and `fill` (a full disk).

Layering: this module is above `megatrain_jax.train` (it runs the command line) and nothing in
the package imports it.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import faults
from megatrain_jax import optim
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident

# ------------------------------------------------------------------------------------------------
# Paths, and the run every fault is injected into.
# ------------------------------------------------------------------------------------------------

# The checkout this package runs from: its launch.py is the process under test.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH_PY = REPO_ROOT / 'launch.py'
# The real text next to the checkout (../shared/data/<corpus>/...).
SHARED_DATA = REPO_ROOT.parent / 'shared' / 'data'
# JAX's persistent compilation cache for test and benchmark runs: outside the checkout, so that
# runs on a fresh clone reuse executables compiled earlier on the same machine.
JAX_CACHE_DIR = os.environ.get('MEGATRAIN_TEST_JAX_CACHE',
                               os.path.expanduser('~/.cache/megatrain_jax/jax-tests'))

# A small model so each run compiles and trains in seconds on 2 cores.
SMALL_MODEL = dict(model__d_model=64, model__num_layers=2, model__num_heads=4,
                   model__num_kv_heads=2, model__d_ff=172, model__max_seq_len=128)

STEPS, EVERY, LAYERS = 12, 3, 2
# Checkpoints every 3 of 12 steps (4 saves, so a kill can land before the first, between any two,
# or during the last one), a metrics row every step, an evaluation every 4.
FIELDS = dict(SMALL_MODEL, model__num_layers=LAYERS,
              data__path=str(SHARED_DATA / 'tinyshakespeare' / 'input.txt'), train__seq_len=64,
              train__batch_size=8, train__steps=STEPS, train__warmup_steps=2, train__log_every=1,
              train__eval_every=4, train__eval_batches=2, train__progress_bar=False,
              checkpoint__every=EVERY, checkpoint__keep=2, jax_cache_dir=JAX_CACHE_DIR)
STREAMED = dict(offload__layers_per_group=1)  # 2 groups: kills between groups, not only at ends
PLACEMENTS = {
    'resident': {},
    'host': dict(STREAMED, offload__params='host', offload__opt_state='host'),
    'nvme': dict(STREAMED, offload__params='nvme', offload__opt_state='nvme'),
}


def placement_fields(placement: str) -> dict:
  """`FIELDS` with the offload fields of `placement` (a key of `PLACEMENTS`)."""
  return dict(FIELDS, **PLACEMENTS[placement])


def phases_for(placement: str) -> list[str]:
  """Fault points a run of this placement passes ('optimizer' is a streamed-engine point)."""
  if placement == 'resident':
    return ['forward', 'backward', 'checkpoint']
  return list(faults.PHASES)


# ------------------------------------------------------------------------------------------------
# Running launch.py.
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
  """How one launch.py process ended: its exit status (-9 when SIGKILLed), its output (stdout
  and stderr interleaved) and timings."""
  returncode: int
  output: str
  seconds: float
  train_seconds: float | None  # from the 'model:' line to the console line of the last step
  startup_seconds: float | None  # from the start of the process to the 'model:' line


class _Output:
  """Reads a process's output on a thread, noting when the training loop starts (the 'model:'
  line) and when the last step's console line comes."""

  def __init__(self, process: subprocess.Popen, kill_at_step: tuple[int, float] | None = None,
               kill_at_loop_start: bool = False):
    """`kill_at_step` (step, seconds): SIGKILL the process that long after it logs that step;
    `kill_at_loop_start`: SIGKILL it when its training loop starts."""
    self.lines, self.loop_start, self.last_step = [], [], []
    self.loop_started = threading.Event()
    self._process = process
    self._kill_at_step = kill_at_step
    self._kill_at_loop_start = kill_at_loop_start
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self._process.stdout:
      self.lines.append(line)
      if line.startswith('model:') and not self.loop_started.is_set():
        self.loop_start.append(time.monotonic())
        self.loop_started.set()
        if self._kill_at_loop_start:
          self._process.kill()
      if self._kill_at_step and line.startswith(f'step {self._kill_at_step[0]}/{STEPS} '):
        faults.kill_after(self._process, self._kill_at_step[1])
      if line.startswith(f'step {STEPS}/{STEPS} '):
        self.last_step.append(time.monotonic())

  def run(self, started: float) -> Run:
    """The `Run`, once the process has exited."""
    self._thread.join(10)
    ended = time.monotonic()
    loop, last = self.loop_start[:1], self.last_step[:1]
    return Run(self._process.returncode, ''.join(self.lines), ended - started,
               last[0] - loop[0] if loop and last else None,
               loop[0] - started if loop else None)


def launch(workdir, fields: dict, *, fault: str | None = None, kill_after_s: float | None = None,
           kill_from_start: bool = False, kill_at_step: tuple[int, float] | None = None,
           at_loop_start=None, timeout: float = 300) -> Run:
  """Runs `python launch.py --config=tiny` with `fields` as overrides in `workdir`, on the CPU.

  SIGKILLed at fault point `fault` ('phase:n', see megatrain_jax/faults.py), or from outside
  `kill_after_s` seconds after the training loop starts (with `kill_from_start`: after the process
  starts, or when its training loop starts if that comes first, so a startup kill always lands
  before training even when this run starts faster than the one the delay was drawn from), or
  `kill_at_step` = (step, seconds) after it logs that step. `at_loop_start()` is called once the
  training loop starts (to fill the disk, say). A run still going after `timeout` seconds is
  killed.
  """
  args = [f'--config.{k.replace("__", ".")}={v}' for k, v in fields.items()]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  env.pop(faults.ENV, None)
  if fault:
    env[faults.ENV] = fault
  started = time.monotonic()
  process = subprocess.Popen([sys.executable, str(LAUNCH_PY), '--config=tiny', *args,
                              f'--workdir={workdir}'], cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  startup_kill = kill_after_s is not None and kill_from_start
  if startup_kill:
    faults.kill_after(process, kill_after_s)
  output = _Output(process, kill_at_step, kill_at_loop_start=startup_kill)
  from_loop = kill_after_s is not None and not kill_from_start
  if (from_loop or at_loop_start) and output.loop_started.wait(timeout):
    if at_loop_start:
      at_loop_start()
    if from_loop:
      faults.kill_after(process, kill_after_s)
  try:
    process.wait(timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
  return output.run(started)


# ------------------------------------------------------------------------------------------------
# What a run leaves.
# ------------------------------------------------------------------------------------------------

def read_rows(workdir) -> list[dict]:
  """metrics.jsonl rows; a torn last line (a kill mid-write) is skipped, as the trainer does."""
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  rows = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except ValueError:
        pass
  return rows


def learning_rows(rows) -> list[dict]:
  """What must be bitwise reproducible: learning/* and eval/* (perf/* and io/* are timings)."""
  return [{k: v for k, v in r.items() if k == 'step' or k.startswith(('learning/', 'eval/'))}
          for r in rows]


def latest_checkpoint(workdir, fields: dict = FIELDS) -> int:
  """The step a rerun resumes from (0 if none), by the trainer's own rule: the newest checkpoint
  that verifies (a damaged one is skipped, with a warning on stderr)."""
  checkpointer = Checkpointer(pathlib.Path(workdir), keep=fields['checkpoint__keep'])
  try:
    config = config_lib.load_config('tiny', **fields)
    reader = checkpointer.restore(config_lib.validate(config))
    return reader.step if reader is not None else 0
  finally:
    checkpointer.close()


def committed_steps(workdir) -> list[int]:
  """Steps of the committed checkpoints in `workdir`, oldest first, damaged or not."""
  directory = pathlib.Path(workdir) / 'checkpoints'
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def final_state(workdir, fields: dict) -> dict:
  """The train state of the newest intact checkpoint, as numpy arrays (resident layout)."""
  config = config_lib.load_config('tiny', **fields)
  model_cfg = config_lib.validate(config)
  abstract = resident.abstract_state(model_cfg, optim.make_optimizer(config.train))
  checkpointer = Checkpointer(pathlib.Path(workdir), keep=fields['checkpoint__keep'])
  try:
    state = checkpointer.restore(model_cfg).full_state(abstract)
  finally:
    checkpointer.close()
  return jax.tree.map(np.asarray, state)


def states_equal(a, b) -> bool:
  """Bitwise: the same tree, and every leaf of the same dtype with the same values."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  return tree_a == tree_b and all(x.dtype == y.dtype and np.array_equal(x, y)
                                  for x, y in zip(leaves_a, leaves_b))


def resumed_from(output: str) -> int | None:
  """The step a run says it resumed from ('resumed from ... (step N, ...'), or None."""
  match = re.search(r'^resumed from .* \(step (\d+),', output, re.M)
  return int(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------------
# Kill plans.
# ------------------------------------------------------------------------------------------------

def save_steps(start: int) -> list[int]:
  """Steps a run resumed at `start` checkpoints at."""
  return [s for s in range(start + 1, STEPS + 1) if s % EVERY == 0 or s == STEPS]


def plan_fault(rng: random.Random, phase: str, start: int, placement: str) -> str:
  """'phase:n' for a run resuming at `start`: the n-th pass lands in a step drawn from the steps
  this run will train (so the kill always happens, and anywhere from its first to last step)."""
  if phase == 'checkpoint':
    passes = faults.CHECKPOINT_PASSES_PER_SAVE * len(save_steps(start))
    return f'checkpoint:{rng.randint(1, passes)}'
  per_step = faults.passes_per_step(phase, streamed=placement != 'resident', groups=LAYERS)
  step = rng.randint(start + 1, STEPS)
  return f'{phase}:{(step - start - 1) * per_step + rng.randint(1, per_step)}'


# SIGKILL from outside at a random time: 'external' while the run trains, 'startup' from its
# start to its training loop (imports, data, restore and verify of the checkpoint, the NVMe live
# store rebuilt from it).
EXTERNAL = ('external', 'startup')


def kill_plan(rng: random.Random, placement: str, kills: int) -> list[str]:
  """`kills` fault kinds in a seeded random order: every fault point of the placement once, then
  the outside kills, then (as kills allow) the rest drawn at random."""
  points = phases_for(placement)
  plan = rng.sample(points, len(points)) + rng.sample(EXTERNAL, len(EXTERNAL))
  plan = plan[:kills] + [rng.choice(points + list(EXTERNAL)) for _ in range(kills - len(plan))]
  rng.shuffle(plan)
  return plan


def known_committed(last_logged: int, start: int) -> int:
  """The newest checkpoint a run that logged up to `last_logged` must have committed: a save
  waits for the previous one to commit before it starts, and a row after a save step means that
  save was called. Anything older than this missing after a kill is lost work."""
  saves = save_steps(start)
  committed = start
  for previous, following in zip(saves, saves[1:]):
    if last_logged > following:
      committed = previous
  return committed


@dataclasses.dataclass
class Kill:
  """One killed run of a chain, and what it left."""
  kind: str  # a fault phase, or one of EXTERNAL
  fault: str  # 'phase:n' or 'external {launch() arguments}'
  returncode: int
  start: int  # step the killed run resumed at
  last_logged: int  # newest metrics row it wrote
  resumed_at: int  # step the next run resumes at
  lost: bool  # a committed checkpoint went missing
  detail: str = ''  # the end of the run's output
  run: Run | None = dataclasses.field(default=None, repr=False)


def external_delay(rng: random.Random, start: int, train_seconds: float) -> float:
  """A random time within the training of a run resumed at `start`: the uninterrupted run took
  `train_seconds` from the loop's start to its last step; a resumed run trains fewer steps, so
  scale by its share of them, and stop well short of the end (bench/reliability.py's SIGTERMs;
  the tests' kills use `external_kill`, which follows the run's progress)."""
  return rng.uniform(0.0, 0.6 * train_seconds * (STEPS - start) / STEPS)


def external_kill(rng: random.Random, start: int, train_seconds: float) -> dict:
  """launch() arguments for a kill at a random time within the training of a run resumed at
  `start`, tied to its progress rather than to the clock alone (a loaded machine makes one run
  slower than another): a random fraction of a step (the uninterrupted run's `train_seconds` /
  STEPS) after it logs a step drawn from those it trains but the last two, so there is always
  training left to interrupt (one step left was not always enough: the last step of a run can be
  shorter than that fraction of the average); a run with two steps or fewer left, that fraction
  after its loop starts."""
  delay = rng.uniform(0.0, 0.5 * train_seconds / STEPS)
  if start + 2 >= STEPS:
    return dict(kill_after_s=delay)
  return dict(kill_at_step=(rng.randint(start + 1, STEPS - 2), delay))


def run_killed(workdir, placement: str, kind: str, rng: random.Random, start: int,
               reference: Run) -> tuple[str, Run]:
  """One run of the chain (resuming at `start`), killed by `kind`: a fault point or EXTERNAL;
  `reference` (an uninterrupted run) sets the range of the outside kills' delays. Returns the
  fault as words ('phase:n', 'external {launch() arguments}') and the run."""
  fields = placement_fields(placement)
  if kind == 'external':
    when = external_kill(rng, start, reference.train_seconds)
    return f'external {when}', launch(workdir, fields, **when)
  if kind == 'startup':
    delay = rng.uniform(0.0, reference.startup_seconds)
    return f'startup after {delay:.2f} s', launch(workdir, fields, kill_after_s=delay,
                                                   kill_from_start=True)
  fault = plan_fault(rng, kind, start, placement)
  return fault, launch(workdir, fields, fault=fault)


def kill_once(workdir, placement: str, kind: str, rng: random.Random, reference: Run, *,
              fault: str | None = None) -> Kill:
  """Runs one killed process in `workdir`, resuming whatever is there: killed by `kind` as
  `run_killed` draws it, or at the fault point `fault` ('phase:n') when given."""
  fields = placement_fields(placement)
  start = latest_checkpoint(workdir, fields)
  if start >= STEPS:  # an earlier kill of the chain missed: its run finished
    raise AssertionError(f'{workdir}: the run is finished (checkpoint of step {start}): the kill '
                         f'before this {kind!r} one did not land while it trained')
  if fault:
    run = launch(workdir, fields, fault=fault)
  else:
    fault, run = run_killed(workdir, placement, kind, rng, start, reference)
  last_logged = max((r['step'] for r in read_rows(workdir)), default=0)
  resumed_at = latest_checkpoint(workdir, fields)
  return Kill(kind, fault, run.returncode, start, last_logged, resumed_at,
              lost=resumed_at < known_committed(last_logged, start), detail=run.output[-3000:],
              run=run)


def kill_chain(workdir, placement: str, plan: list[str], rng: random.Random,
               reference: Run) -> list[Kill]:
  """Runs one killed process per entry of `plan` in `workdir`, each resuming the last."""
  kills = []
  for kind in plan:
    if kills and latest_checkpoint(workdir, placement_fields(placement)) >= STEPS:
      missed = kills[-1]
      raise AssertionError(f'{workdir}: kill {len(kills)} of {plan} ({missed.fault}) did not land '
                           f'while the run trained; it finished:\n{missed.detail}')
    kills.append(kill_once(workdir, placement, kind, rng, reference))
  return kills


# ------------------------------------------------------------------------------------------------
# Faults beyond kills: damaged checkpoints, full disks.
# ------------------------------------------------------------------------------------------------

def flip_a_byte(workdir, rng: random.Random) -> tuple[int, pathlib.Path]:
  """Flips one bit of a random byte of a random file of the newest checkpoint in `workdir`;
  returns (its step, the file)."""
  workdir = pathlib.Path(workdir)
  step = committed_steps(workdir)[-1]
  files = sorted(p for p in (workdir / 'checkpoints' / str(step)).rglob('*')
                 if p.is_file() and p.stat().st_size)
  target = rng.choice(files)
  data = bytearray(target.read_bytes())
  data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
  target.write_bytes(bytes(data))  # in place: a hard-linked NVMe chunk is damaged everywhere
  return step, target


@contextlib.contextmanager
def tmpfs(megabytes: float):
  """A fresh, empty tmpfs of the given size (mounting needs root): another filesystem than the
  caller's, and one that fills up."""
  path = pathlib.Path(tempfile.mkdtemp(prefix='megatrain_fs_'))
  subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={int(megabytes * 1024)}k', 'tmpfs',
                  str(path)], check=True)
  try:
    yield path
  finally:
    subprocess.run(['umount', str(path)], check=True)
    path.rmdir()


def fill(directory: pathlib.Path, leave_bytes: int) -> pathlib.Path:
  """A ballast file that leaves about `leave_bytes` free on `directory`'s filesystem (allocated
  at once, so a running trainer meets a full disk within milliseconds). Delete it to undo."""
  ballast = pathlib.Path(directory) / 'ballast'
  with open(ballast, 'wb') as f:
    try:
      os.posix_fallocate(f.fileno(), 0, max(shutil.disk_usage(directory).free - leave_bytes, 1))
    except OSError:
      pass
    while shutil.disk_usage(directory).free > leave_bytes + (1 << 16):  # no fallocate support
      try:
        f.write(b'\0' * (1 << 16))
        f.flush()
      except OSError:
        break
  return ballast
