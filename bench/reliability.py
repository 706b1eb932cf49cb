"""Reliability benchmark (issue 6): kill -9, checkpoint corruption and full disks, per placement.

For each placement (resident; host: params + Adam state in pinned host RAM; nvme: both on NVMe)
it trains the tiny model of tests/test_reliability.py uninterrupted, then runs a chain of faulty
runs in one workdir, each resuming whatever the previous one left:

  kill        SIGKILL at a fault point drawn by a seeded RNG (megatrain_jax/faults.py: forward,
              backward, optimizer write-back, checkpoint save), or from outside after a random
              delay: into the training ('external') or into the start-up ('startup': imports,
              data, checkpoint restore and verification, NVMe live-store rebuild);
  corrupt     one byte flipped in a random file of the newest checkpoint, then a run that is
              itself killed at a random fault point (so the chain goes on);
  disk-full   the workdir's filesystem (a tmpfs; needs root, else skipped) filled to
              --disk_full_leave_kb free, then a run, then the ballast removed;

and finally a run that completes. Prints one row per placement:

  faults injected   kills + corruptions + full disks;
  detected          kill: the next run resumed from the newest checkpoint committed before the
                    kill (partial saves and torn metric rows ignored); corrupt: a warning naming
                    the damaged file and a fallback to the previous checkpoint; disk-full: the
                    run stopped with DiskFullError naming the disk;
  runs resumed      runs that started from a checkpoint ('resumed from ...');
  data lost         final metric rows (learning/*, eval/*) that differ from the uninterrupted
                    run's (bitwise), + 1 if the final checkpoint's state differs, + kills after
                    which a checkpoint known committed was missing. Must be 0.

  python bench/reliability.py --kills 10 --corruptions 2 --disk_full 1
"""

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import pathlib
import random
import re
import shutil
import signal
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

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / 'shared' / 'data'
JAX_CACHE_DIR = os.environ.get('MEGATRAIN_TEST_JAX_CACHE',
                               os.path.expanduser('~/.cache/megatrain_jax/jax-tests'))

# ------------------------------------------------------------------------------------------------
# The harness: a copy of tests/test_reliability.py's (bench/ imports only the package), less its
# kill_chain, which scenario() below extends with corruptions and full disks.
# ------------------------------------------------------------------------------------------------

STEPS, EVERY, LAYERS = 12, 3, 2
# The small model of the tests (tests/helpers.py: small_config), with checkpoints every 3 of 12
# steps (4 saves, so a kill can land before the first, between any two, or during the last one).
FIELDS = dict(model__d_model=64, model__num_layers=LAYERS, model__num_heads=4,
              model__num_kv_heads=2, model__d_ff=172, model__max_seq_len=128,
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


# Running launch.py.

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
  `kill_from_start`). `at_loop_start()` is called once the training loop starts (scenario()
  fills the disk there)."""
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


# Kill plans.

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


# ------------------------------------------------------------------------------------------------
# Faults beyond kills, and the scenario.
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(megabytes: int):
  """A small filesystem of its own for the chain's workdir (root only), else None."""
  if os.geteuid() != 0:
    yield None
    return
  path = pathlib.Path(tempfile.mkdtemp(prefix='megatrain_reliability_fs_'))
  subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={megabytes}m', 'tmpfs', str(path)],
                 check=True)
  try:
    yield path
  finally:
    subprocess.run(['umount', str(path)], check=True)
    path.rmdir()


def fill(directory: pathlib.Path, leave_bytes: int) -> pathlib.Path:
  """A ballast file that leaves about `leave_bytes` free on `directory`'s filesystem (allocated
  at once, so a running trainer meets a full disk within milliseconds)."""
  ballast = directory / 'ballast'
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


def committed_steps(workdir: pathlib.Path) -> list[int]:
  directory = workdir / 'checkpoints'
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def flip_a_byte(workdir: pathlib.Path, rng: random.Random) -> tuple[int, pathlib.Path]:
  """Flips one bit of a random byte of a random file of the newest checkpoint."""
  step = committed_steps(workdir)[-1]
  files = sorted(p for p in (workdir / 'checkpoints' / str(step)).rglob('*')
                 if p.is_file() and p.stat().st_size)
  target = rng.choice(files)
  data = bytearray(target.read_bytes())
  data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
  target.write_bytes(bytes(data))  # in place: a hard-linked NVMe chunk is damaged everywhere
  return step, target


def resumed_from(output: str) -> int | None:
  match = re.search(r'^resumed from .* \(step (\d+),', output, re.M)
  return int(match.group(1)) if match else None


def scenario(placement: str, root: pathlib.Path, args) -> dict:
  fields = placement_fields(placement)
  rng = random.Random(f'{args.seed}-{placement}')
  started = time.monotonic()
  reference = launch(root / 'reference', fields)
  assert reference.returncode == 0, reference.output[-3000:]
  disk_full = args.disk_full if os.geteuid() == 0 else 0
  plan = kill_plan(rng, placement, args.kills)
  extra = ['corrupt'] * args.corruptions + ['disk-full'] * disk_full
  for kind in extra:  # never first: a run must have prepared the data and saved a checkpoint
    plan.insert(rng.randint(1, len(plan)), kind)
  counts = dict(injected=0, detected=0, resumed=0, lost=0)
  kinds = {}
  log = []
  with tmpfs(args.tmpfs_mb) if disk_full else contextlib.nullcontext() as disk:
    workdir = (disk or root) / 'chain'
    deferred = 0
    while plan:
      kind = plan.pop(0)
      start = latest_checkpoint(workdir, fields)
      if start >= STEPS:
        log.append('(the run had finished: nothing left to fault)')
        break  # an external kill came too late
      if kind == 'corrupt' and (len(committed_steps(workdir)) < 2 or
                                committed_steps(workdir)[-1] != start):
        # A fallback needs an older intact checkpoint: corrupt later, after more progress; if
        # nothing else is left, make that progress with a kill in the run's last save (every
        # earlier save is committed by then).
        if deferred < len(plan):
          plan.append(kind)
          deferred += 1
          continue
        plan.insert(0, kind)
        last_save = faults.CHECKPOINT_PASSES_PER_SAVE * len(save_steps(start)) - 1
        kind, forced = 'checkpoint', f'checkpoint:{last_save}'
      else:
        forced = None
      if kind == 'corrupt':
        step, target = flip_a_byte(workdir, rng)
        start = latest_checkpoint(workdir, fields)  # the fallback a rerun will take
        phase = rng.choice(phases_for(placement))
        fault = plan_fault(rng, phase, start, placement)
        run = launch(workdir, fields, fault=fault)
        detected = (f'warning: checkpoint step {step} in' in run.output and 'is damaged' in
                    run.output and resumed_from(run.output) == start)
        log.append(f'corrupt {target.relative_to(workdir)} of step {step}, then {fault}: '
                   f'rc {run.returncode}, resumed from {resumed_from(run.output)}')
      elif kind == 'disk-full':
        # Filled once training runs (a full disk at start-up is refused up front, which
        # tests/test_nvme.py covers): the next checkpoint or NVMe write-back meets it.
        ballast = []
        run = launch(workdir, fields, at_loop_start=lambda: ballast.append(
            fill(disk, args.disk_full_leave_kb << 10)))
        for path in ballast:
          path.unlink()
        full = [line for line in run.output.splitlines() if 'is full' in line]
        detected = run.returncode not in (0, -signal.SIGKILL) and bool(full)
        log.append(f'disk-full ({args.disk_full_leave_kb} KB left free): rc {run.returncode}, '
                   f'{(full or ["no disk-full message"])[-1][:200]}')
      else:
        if forced:
          fault, run = forced, launch(workdir, fields, fault=forced)
        else:
          fault, run = run_killed(workdir, placement, kind, rng, start, reference)
        last_logged = max((r['step'] for r in read_rows(workdir)), default=0)
        resumed_at = latest_checkpoint(workdir, fields)
        lost = resumed_at < known_committed(last_logged, start)
        counts['lost'] += lost
        detected = run.returncode == -signal.SIGKILL and not lost
        log.append(f'kill {fault}: rc {run.returncode}, trained {start}->{last_logged}, '
                   f'next run resumes at {resumed_at}')
      counts['injected'] += 1
      label = kind if kind in ('corrupt', 'disk-full', *EXTERNAL) else 'fault point'
      kinds[label] = kinds.get(label, 0) + 1
      counts['detected'] += bool(detected)
      counts['resumed'] += resumed_from(run.output) is not None
    final = launch(workdir, fields)
    assert final.returncode == 0, final.output[-3000:]
    counts['resumed'] += resumed_from(final.output) is not None
    got = learning_rows(read_rows(workdir))
    want = learning_rows(read_rows(root / 'reference'))
    counts['lost'] += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    counts['lost'] += not states_equal(final_state(workdir, fields),
                                           final_state(root / 'reference', fields))
  return dict(counts, placement=placement, log=log, kinds=kinds,
              seconds=time.monotonic() - started)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--kills', type=int, default=10, help='kill -9 faults per placement')
  parser.add_argument('--corruptions', type=int, default=2, help='flipped checkpoint bytes')
  parser.add_argument('--disk_full', type=int, default=1, help='full-disk runs (root only)')
  parser.add_argument('--disk_full_leave_kb', type=int, default=64)
  parser.add_argument('--tmpfs_mb', type=int, default=48)
  parser.add_argument('--placements', default='resident,host,nvme')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--verbose', action='store_true', help='print each fault and its outcome')
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory(prefix='megatrain_reliability_') as tmp:
    for placement in args.placements.split(','):
      row = scenario(placement, pathlib.Path(tmp) / placement, args)
      rows.append(row)
      if args.verbose:
        print(f'{placement} ({row["seconds"]:.0f} s):', *row['log'], sep='\n  ', flush=True)
  print('| placement | faults injected | detected | runs resumed | data lost | faults |')
  print('|---|---:|---:|---:|---:|---|')
  for row in rows:
    kinds = ', '.join(f'{n} {kind}' for kind, n in sorted(row['kinds'].items()))
    print(f'| {row["placement"]} | {row["injected"]} | {row["detected"]} | {row["resumed"]} | '
          f'{row["lost"]} | {kinds} |')
  if any(row['lost'] for row in rows):
    sys.exit('data lost')


if __name__ == '__main__':
  main()
