"""kill -9 at any point loses nothing: a chain of SIGKILLed runs in one workdir, then a run that
completes, reproduces the uninterrupted run bitwise (metrics and final checkpoint), per placement.

Each killed run is a real `python launch.py` process killed with SIGKILL, either from inside at a
fault point chosen by a seeded RNG (megatrain_jax/faults.py: forward, backward, optimizer
write-back, checkpoint save) or from outside at a random time (in the start-up: imports, data,
checkpoint restore, NVMe live-store rebuild; or in the training). Chaining the kills in one
workdir (each run resumes from whatever the previous one left) gives several kill points per
placement for the price of one extra process start each.

bench/reliability.py runs the same harness (its own copy: bench/ imports only the package) with
more kills, flipped checkpoint bytes and full disks.
"""

import dataclasses
import inspect
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from megatrain_jax import config as config_lib
from megatrain_jax import faults
from megatrain_jax import metrics
from megatrain_jax import optim
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine import resident

from helpers import JAX_CACHE_DIR, REPO_ROOT, SHARED_DATA, SMALL_MODEL

STEPS, EVERY, LAYERS = 12, 3, 2
# The small model of helpers.small_config, with checkpoints every 3 of 12 steps (4 saves, so a
# kill can land before the first, between any two, or during the last one).
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
  returncode: int
  output: str
  seconds: float
  loop_seconds: float | None  # from the 'model:' line (training loop starts) to exit
  train_seconds: float | None  # from the 'model:' line to the console line of the last step
  startup_seconds: float | None  # from the start of the process to the 'model:' line


def launch(workdir, fields: dict, *, fault: str | None = None, kill_after_s: float | None = None,
           kill_from_start: bool = False, at_loop_start=None, timeout: float = 300) -> Run:
  """Runs `python launch.py` on `fields`; SIGKILLed at fault point `fault` ('phase:n'), or from
  outside `kill_after_s` seconds after the training loop starts (after the process starts with
  `kill_from_start`). `at_loop_start()` is called once the training loop starts
  (bench/reliability.py fills the disk there)."""
  args = [f'--config.{k.replace("__", ".")}={v}' for k, v in fields.items()]
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  env.pop(faults.ENV, None)
  if fault:
    env[faults.ENV] = fault
  started = time.monotonic()
  process = subprocess.Popen([sys.executable, str(REPO_ROOT / 'launch.py'), '--config=tiny', *args,
                              f'--workdir={workdir}'], cwd=REPO_ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  if kill_after_s is not None and kill_from_start:
    faults.kill_after(process, kill_after_s)
  lines, loop_started = [], threading.Event()
  loop_start, last_step = [], []

  def read_output():
    for line in process.stdout:
      lines.append(line)
      if line.startswith('model:') and not loop_started.is_set():
        loop_start.append(time.monotonic())
        loop_started.set()
      if line.startswith(f'step {STEPS}/{STEPS} '):
        last_step.append(time.monotonic())

  reader = threading.Thread(target=read_output, daemon=True)
  reader.start()
  from_loop = kill_after_s is not None and not kill_from_start
  if (from_loop or at_loop_start) and loop_started.wait(timeout):
    if at_loop_start:
      at_loop_start()
    if from_loop:
      faults.kill_after(process, kill_after_s)
  try:
    process.wait(timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
  reader.join(10)
  ended = time.monotonic()
  return Run(process.returncode, ''.join(lines), ended - started,
             ended - loop_start[0] if loop_start else None,
             last_step[0] - loop_start[0] if loop_start and last_step else None,
             loop_start[0] - started if loop_start else None)


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
    if 'abstract_state' in inspect.signature(checkpointer.restore).parameters:  # orbax manager
      return checkpointer.latest_step() or 0
    config = config_lib.load_config('tiny', **fields)
    reader = checkpointer.restore(config_lib.validate(config))
    return reader.step if reader is not None else 0
  finally:
    checkpointer.close()


def final_state(workdir, fields: dict) -> dict:
  """The train state of the newest checkpoint, as numpy arrays (resident layout)."""
  config = config_lib.load_config('tiny', **fields)
  model_cfg = config_lib.validate(config)
  abstract = resident.abstract_state(model_cfg, optim.make_optimizer(config.train))
  checkpointer = Checkpointer(pathlib.Path(workdir), keep=fields['checkpoint__keep'])
  try:
    if 'abstract_state' in inspect.signature(checkpointer.restore).parameters:  # orbax manager
      state, _ = checkpointer.restore(checkpointer.latest_step(), abstract, model_cfg)
    else:  # restore(model_cfg) -> the newest intact checkpoint's reader
      state = checkpointer.restore(model_cfg).full_state(abstract)
  finally:
    checkpointer.close()
  return jax.tree.map(np.asarray, state)


def states_equal(a, b) -> bool:
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  return tree_a == tree_b and all(x.dtype == y.dtype and np.array_equal(x, y)
                                  for x, y in zip(leaves_a, leaves_b))


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
  kind: str  # a fault phase, or one of EXTERNAL
  fault: str  # 'phase:n' or 'external after 1.23 s'
  returncode: int
  start: int  # step the killed run resumed at
  last_logged: int  # newest metrics row it wrote
  resumed_at: int  # step the next run resumes at
  lost: bool  # a committed checkpoint went missing
  detail: str = ''


def external_delay(rng: random.Random, start: int, train_seconds: float) -> float:
  """A random time within the training of a run resumed at `start`: the uninterrupted run took
  `train_seconds` from the loop's start to its last step; a resumed run trains fewer steps, so
  scale by its share of them (an underestimate: the first step's compile is a fixed cost), and
  stop well short of the end (a run may be faster than the reference was), where a kill would
  find nothing left to train."""
  return rng.uniform(0.0, 0.6 * train_seconds * (STEPS - start) / STEPS)


def run_killed(workdir, placement: str, kind: str, rng: random.Random, start: int,
               reference: Run) -> tuple[str, Run]:
  """One run of the chain (resuming at `start`), killed by `kind`: a fault point or EXTERNAL."""
  fields = placement_fields(placement)
  if kind == 'external':
    delay = external_delay(rng, start, reference.train_seconds)
    return f'external after {delay:.2f} s', launch(workdir, fields, kill_after_s=delay)
  if kind == 'startup':
    delay = rng.uniform(0.0, reference.startup_seconds)
    return f'startup after {delay:.2f} s', launch(workdir, fields, kill_after_s=delay,
                                                   kill_from_start=True)
  fault = plan_fault(rng, kind, start, placement)
  return fault, launch(workdir, fields, fault=fault)


def kill_chain(workdir, placement: str, plan: list[str], rng: random.Random,
               reference: Run) -> list[Kill]:
  """Runs one killed process per entry of `plan` in `workdir`, each resuming the last."""
  fields = placement_fields(placement)
  kills = []
  for kind in plan:
    start = latest_checkpoint(workdir, fields)
    fault, run = run_killed(workdir, placement, kind, rng, start, reference)
    logged = [r['step'] for r in read_rows(workdir)]
    last_logged = max(logged, default=0)
    resumed_at = latest_checkpoint(workdir, fields)
    kills.append(Kill(kind, fault, run.returncode, start, last_logged, resumed_at,
                      lost=resumed_at < known_committed(last_logged, start),
                      detail=run.output[-3000:]))
  return kills


# ------------------------------------------------------------------------------------------------
# The test.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('placement', list(PLACEMENTS))
def test_kill_chain_resumes_bitwise(tmp_path, shared_data, placement):
  fields = placement_fields(placement)
  reference = launch(tmp_path / 'reference', fields)
  assert reference.returncode == 0, reference.output[-3000:]
  expected = learning_rows(read_rows(tmp_path / 'reference'))

  # This seed gives resident both EXTERNAL kills, host 'external', nvme 'startup'.
  rng = random.Random(f'issue-6-{placement}')
  plan = kill_plan(rng, placement, kills=5)
  kills = kill_chain(tmp_path / 'chain', placement, plan, rng, reference)
  for kill in kills:
    assert kill.returncode == -signal.SIGKILL, (kill.kind, kill.fault, kill.detail)
    if kill.kind not in EXTERNAL:  # died where it was told to, not somewhere else
      assert f'faults: SIGKILL at {kill.fault.replace(":", " pass ")}' in kill.detail, kill.detail
    assert not kill.lost, kill
  assert set(phases_for(placement)) <= {k.kind for k in kills}

  final = launch(tmp_path / 'chain', fields)
  assert final.returncode == 0, final.output[-3000:]
  got = learning_rows(read_rows(tmp_path / 'chain'))
  # Bitwise: every float compared with ==, every step 1..12 once, evals at 0, 4, 8, 12 once.
  assert got == expected, [k.fault for k in kills]
  assert [r['step'] for r in got if 'learning/loss' in r] == list(range(1, STEPS + 1))
  assert [r['step'] for r in got if 'eval/loss' in r] == [0, 4, 8, 12]
  assert states_equal(final_state(tmp_path / 'chain', fields),
                      final_state(tmp_path / 'reference', fields))


def test_a_fresh_start_drops_the_rows_of_a_killed_first_attempt(tmp_path):
  """A run killed before its first checkpoint leaves a step-0 eval row (and maybe more); the
  rerun starts from scratch and must not log step 0 twice."""
  (tmp_path / 'metrics.jsonl').write_text('{"step": 0, "eval/loss": 5.5}\n{"step": 1, "learning/loss": 5.4}\n')
  with metrics.MetricsWriter(tmp_path, total_steps=4, start_step=0, progress_bar=False) as writer:
    writer.write(0, {'eval/loss': 5.5}, console=False)
  assert read_rows(tmp_path) == [{'step': 0, 'eval/loss': 5.5}]
