"""Reliability benchmark (issue 6): kill -9, checkpoint corruption and full disks, per placement.

For each placement (resident; host: params + Adam state in pinned host RAM; nvme: both on NVMe)
it trains the small model of megatrain_jax/reliability.py (the harness tests/test_reliability.py
runs too) uninterrupted, then runs a chain of faulty runs in one workdir, each resuming whatever
the previous one left:

  kill        SIGKILL at a fault point drawn by a seeded RNG (megatrain_jax/faults.py: forward,
              backward, optimizer write-back, checkpoint save), or from outside after a random
              delay: into the training ('external') or into the start-up ('startup': imports,
              data, checkpoint restore and verification, NVMe live-store rebuild);
  corrupt     one byte flipped in a random file of the newest checkpoint, then a run that is
              itself killed at a random fault point (so the chain goes on);
  disk-full   the workdir's filesystem (a tmpfs; needs root, else skipped) filled to
              --disk_full_leave_kb free, then a run, then the ballast removed;
  sigterm     SIGTERM from outside at a random time in the training (issue 16): the run must
              stop after the step in flight, exit 0 saying `stopped at step N by SIGTERM`, and
              leave the checkpoint of step N, which the next run resumes from;
  concurrent  a second run started while one trains (paused with SIGSTOP at a random time so
              that it surely holds its locks): on its workdir, or for NVMe another workdir on its
              offload.dir; it must be refused (status 1, naming the first run's pid) and change
              no file of the first, which then continues and is stopped with SIGTERM;

and finally a run that completes. Prints one row per placement, then one per placement and kind
of fault:

  faults injected   kills + corruptions + full disks;
  detected          kill: the next run resumed from the newest checkpoint committed before the
                    kill (partial saves and torn metric rows ignored); corrupt: a warning naming
                    the damaged file and a fallback to the previous checkpoint; disk-full: the
                    run stopped with DiskFullError naming the disk; sigterm, concurrent: above;
  runs resumed      runs that started from a checkpoint ('resumed from ...');
  data lost         final metric rows (learning/*, eval/*) that differ from the uninterrupted
                    run's (bitwise), + 1 if the final checkpoint's state differs, + kills after
                    which a checkpoint known committed was missing. Must be 0.

  python bench/reliability.py --kills 10 --corruptions 2 --disk_full 1 --sigterms 2 --concurrent 1
"""

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import sys
import tempfile
import threading
import time

from megatrain_jax import faults
from megatrain_jax import locks
from megatrain_jax.reliability import (EXTERNAL, STEPS, committed_steps, external_delay, fill,
                                       final_state, flip_a_byte, kill_once, kill_plan,
                                       latest_checkpoint, launch, learning_rows, phases_for,
                                       placement_fields, plan_fault, read_rows, resumed_from, Run,
                                       save_steps, states_equal, tmpfs)


@dataclasses.dataclass
class Outcome:
  """One injected fault: the run it ended, whether the fault was detected, whether a committed
  checkpoint went missing, and a line for --verbose."""
  run: Run
  detected: bool
  lost: bool
  log: str


def corrupt(workdir: pathlib.Path, placement: str, rng: random.Random) -> Outcome:
  """Flips a byte of the newest checkpoint, then runs until a random fault point: the run must
  warn about the damaged file and resume from the previous checkpoint."""
  fields = placement_fields(placement)
  step, target = flip_a_byte(workdir, rng)
  start = latest_checkpoint(workdir, fields)  # the fallback a rerun will take
  fault = plan_fault(rng, rng.choice(phases_for(placement)), start, placement)
  run = launch(workdir, fields, fault=fault)
  detected = (f'warning: checkpoint step {step} in' in run.output and 'is damaged' in run.output
              and resumed_from(run.output) == start)
  return Outcome(run, detected, False,
                 f'corrupt {target.relative_to(workdir)} of step {step}, then {fault}: '
                 f'rc {run.returncode}, resumed from {resumed_from(run.output)}')


def disk_full(workdir: pathlib.Path, disk: pathlib.Path, placement: str, leave_kb: int) -> Outcome:
  """Fills `disk` once training runs (a full disk at start-up is refused up front, which
  tests/test_nvme.py covers): the next checkpoint or NVMe write-back meets it, and the run must
  stop with an error naming the full disk."""
  ballast = []
  run = launch(workdir, placement_fields(placement),
               at_loop_start=lambda: ballast.append(fill(disk, leave_kb << 10)))
  for path in ballast:
    path.unlink()
  full = [line for line in run.output.splitlines() if 'is full' in line]
  detected = run.returncode not in (0, -signal.SIGKILL) and bool(full)
  return Outcome(run, detected, False, f'disk-full ({leave_kb} KB left free): rc {run.returncode}, '
                                       f'{(full or ["no disk-full message"])[-1][:200]}')


def kill(workdir: pathlib.Path, placement: str, kind: str, rng: random.Random, reference,
         fault: str | None = None) -> Outcome:
  """A killed run (see reliability.kill_once): detected when it died by SIGKILL and the next run
  resumes from every checkpoint known committed."""
  k = kill_once(workdir, placement, kind, rng, reference, fault=fault)
  return Outcome(k.run, k.returncode == -signal.SIGKILL and not k.lost, k.lost,
                 f'kill {k.fault}: rc {k.returncode}, trained {k.start}->{k.last_logged}, '
                 f'next run resumes at {k.resumed_at}')


def _holder(workdir: pathlib.Path) -> int:
  """The pid of the run that holds `workdir` (it writes it into its lock file)."""
  return int(json.loads((workdir / locks.LOCK_FILE).read_text())['pid'])


def _signal(pid: int, signum: int) -> None:
  try:
    os.kill(pid, signum)
  except ProcessLookupError:
    pass  # it had finished


def _stopped_at(output: str) -> int | None:
  match = re.search(r'^stopped at step (\d+) by SIGTERM; checkpoint saved; rerun the same command '
                    r'to resume$', output, re.M)
  return int(match.group(1)) if match else None


def _stop_outcome(run: Run, workdir: pathlib.Path, fields: dict,
                  what: str) -> tuple[bool, bool, str]:
  """(stopped cleanly, lost, words) of a run sent SIGTERM: exit 0, `stopped at step N`, and the
  checkpoint of N is the one the next run resumes from. A SIGTERM after the last step finds a
  completed run (exit 0, the final checkpoint), which is right too."""
  stopped, resumes_at = _stopped_at(run.output), latest_checkpoint(workdir, fields)
  completed = stopped is None and run.returncode == 0 and resumes_at == STEPS
  ok = run.returncode == 0 and (resumes_at == stopped or completed)
  return ok, stopped is not None and resumes_at != stopped, (
      f'{what}: rc {run.returncode}, stopped at {stopped if stopped else "(completed)"}, next run '
      f'resumes at {resumes_at}')


def sigterm(workdir: pathlib.Path, placement: str, rng: random.Random, reference) -> Outcome:
  """SIGTERM at a random time in the training (the delays of the 'external' kills)."""
  fields = placement_fields(placement)
  delay = external_delay(rng, latest_checkpoint(workdir, fields), reference.train_seconds)

  def send_later():
    threading.Timer(delay, _signal, (_holder(workdir), signal.SIGTERM)).start()

  run = launch(workdir, fields, at_loop_start=send_later)
  ok, lost, words = _stop_outcome(run, workdir, fields, f'sigterm after {delay:.2f} s')
  return Outcome(run, ok, lost, words)


def concurrent_start(workdir: pathlib.Path, placement: str, rng: random.Random,
                     reference) -> Outcome:
  """A second run while one trains: see the module docstring."""
  fields = placement_fields(placement)
  start = latest_checkpoint(workdir, fields)  # early in what is left to train: it must be running
  delay = rng.uniform(0.0, 0.3 * reference.train_seconds * (STEPS - start) / STEPS)
  seen = {}

  def second_run():
    time.sleep(delay)
    try:
      pid = seen['pid'] = _holder(workdir)
      os.kill(pid, signal.SIGSTOP)
      _wait_stopped(pid)
    except (FileNotFoundError, ProcessLookupError):
      return  # it had finished already
    before = _files(workdir)
    if placement == 'nvme':  # another workdir, the same offload.dir
      other = workdir.parent / f'{workdir.name}-other'
      seen['second'] = launch(other, dict(fields, offload__dir=str(workdir / 'offload')))
      seen['left'] = other.exists()
    else:
      seen['second'] = launch(workdir, fields)
      seen['left'] = False
    seen['unchanged'] = _files(workdir) == before
    os.kill(pid, signal.SIGTERM)  # delivered once it continues: keeps the chain going
    os.kill(pid, signal.SIGCONT)

  run = launch(workdir, fields, at_loop_start=second_run)
  if 'second' not in seen:
    return Outcome(run, False, False, f'concurrent start after {delay:.2f} s: too late, the run '
                                      'had finished')
  second = seen['second']
  refused = second.returncode == 1 and (
      f'is in use by another run (pid {seen["pid"]} on host' in second.output)
  ok, lost, words = _stop_outcome(run, workdir, fields, 'then the first')
  return Outcome(run, refused and seen['unchanged'] and not seen['left'] and ok,
                 lost or not seen['unchanged'] or second.returncode == 0,
                 f'concurrent start after {delay:.2f} s: second run rc {second.returncode}'
                 f'{" (refused)" if refused else ""}, first run\'s files '
                 f'{"unchanged" if seen["unchanged"] else "CHANGED"}; {words}')


def _wait_stopped(pid: int) -> None:
  """Until every thread of `pid` is stopped (one inside a write or fsync finishes it first)."""
  def state(task):
    try:
      return (task / 'stat').read_text().rsplit(')', 1)[1].split()[0]
    except FileNotFoundError:
      return 'T'  # exited
  tasks = pathlib.Path(f'/proc/{pid}/task')
  while not all(state(task) in 'Tt' for task in tasks.iterdir()):
    time.sleep(0.01)


def _files(root: pathlib.Path) -> dict:
  """Every file and directory under `root`: inode, size, modification time."""
  return {str(p): (st.st_ino, st.st_size, st.st_mtime_ns)
          for p in sorted(root.rglob('*')) for st in [p.lstat()]}


def chain_plan(rng: random.Random, placement: str, args, disk_fulls: int) -> list[str]:
  """The kills of reliability.kill_plan with the corruptions and full disks inserted at random
  places, never first (a run must have prepared the data and saved a checkpoint)."""
  plan = kill_plan(rng, placement, args.kills)
  for kind in (['corrupt'] * args.corruptions + ['disk-full'] * disk_fulls
               + ['sigterm'] * args.sigterms + ['concurrent'] * args.concurrent):
    plan.insert(rng.randint(1, len(plan)), kind)
  return plan


def next_fault(plan: list[str], workdir: pathlib.Path, start: int, deferred: int):
  """(kind, forced fault or None, deferred) for the next entry of `plan`. A corruption needs an
  older intact checkpoint to fall back to: without one it is moved to the end of the plan (once
  per entry left), and when nothing else is left, progress is made first by a kill in the run's
  last save (every earlier save is committed by then)."""
  kind = plan.pop(0)
  steps = committed_steps(workdir)
  if kind != 'corrupt' or (len(steps) >= 2 and steps[-1] == start):
    return kind, None, deferred
  if deferred < len(plan):
    plan.append(kind)
    return None, None, deferred + 1
  plan.insert(0, kind)
  last_save = faults.CHECKPOINT_PASSES_PER_SAVE * len(save_steps(start)) - 1
  return 'checkpoint', f'checkpoint:{last_save}', deferred


def inject(kind, forced, workdir, disk, placement, rng, reference, args) -> Outcome:
  """Injects one fault of `kind` ('corrupt', 'disk-full', or a kill: a fault phase or one of
  EXTERNAL; `forced` is a 'phase:n' that overrides the drawn one)."""
  if kind == 'corrupt':
    return corrupt(workdir, placement, rng)
  if kind == 'disk-full':
    return disk_full(workdir, disk, placement, args.disk_full_leave_kb)
  if kind == 'sigterm':
    return sigterm(workdir, placement, rng, reference)
  if kind == 'concurrent':
    return concurrent_start(workdir, placement, rng, reference)
  return kill(workdir, placement, kind, rng, reference, fault=forced)


def count_final(workdir: pathlib.Path, reference_dir: pathlib.Path, fields: dict, counts: dict):
  """Runs the chain to completion and counts lost data: metric rows that differ from the
  uninterrupted run's, + 1 if the final state differs."""
  final = launch(workdir, fields)
  assert final.returncode == 0, final.output[-3000:]
  counts['resumed'] += resumed_from(final.output) is not None
  got = learning_rows(read_rows(workdir))
  want = learning_rows(read_rows(reference_dir))
  counts['lost'] += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
  counts['lost'] += not states_equal(final_state(workdir, fields),
                                     final_state(reference_dir, fields))


def scenario(placement: str, root: pathlib.Path, args) -> dict:
  """The uninterrupted run, the chain of faults and the completing run, for one placement."""
  fields = placement_fields(placement)
  rng = random.Random(f'{args.seed}-{placement}')
  started = time.monotonic()
  reference = launch(root / 'reference', fields)
  assert reference.returncode == 0, reference.output[-3000:]
  disk_fulls = args.disk_full if os.geteuid() == 0 else 0  # mounting a tmpfs needs root
  plan = chain_plan(rng, placement, args, disk_fulls)
  counts, kinds, by_kind, log = dict(injected=0, detected=0, resumed=0, lost=0), {}, {}, []
  with tmpfs(args.tmpfs_mb) if disk_fulls else contextlib.nullcontext() as disk:
    workdir, deferred = (disk or root) / 'chain', 0
    while plan:
      start = latest_checkpoint(workdir, fields)
      if start >= STEPS:
        log.append('(the run had finished: nothing left to fault)')
        break  # an external kill came too late
      kind, forced, deferred = next_fault(plan, workdir, start, deferred)
      if kind is None:
        continue
      outcome = inject(kind, forced, workdir, disk, placement, rng, reference, args)
      log.append(outcome.log)
      counts['injected'] += 1
      label = (kind if kind in ('corrupt', 'disk-full', 'sigterm', 'concurrent', *EXTERNAL)
               else 'fault point')
      kinds[label] = kinds.get(label, 0) + 1
      per_kind = by_kind.setdefault(label, dict(injected=0, detected=0, lost=0))
      per_kind['injected'] += 1
      per_kind['detected'] += bool(outcome.detected)
      per_kind['lost'] += outcome.lost
      counts['detected'] += bool(outcome.detected)
      counts['lost'] += outcome.lost
      counts['resumed'] += resumed_from(outcome.run.output) is not None
    count_final(workdir, root / 'reference', fields, counts)
  return dict(counts, placement=placement, log=log, kinds=kinds, by_kind=by_kind,
              seconds=time.monotonic() - started)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--kills', type=int, default=10, help='kill -9 faults per placement')
  parser.add_argument('--corruptions', type=int, default=2, help='flipped checkpoint bytes')
  parser.add_argument('--disk_full', type=int, default=1, help='full-disk runs (root only)')
  parser.add_argument('--sigterms', type=int, default=2, help='runs stopped by SIGTERM')
  parser.add_argument('--concurrent', type=int, default=1,
                      help='second runs started on a running run\'s directories')
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
  print('\n| placement | fault | injected | detected | lost |')
  print('|---|---|---:|---:|---:|')
  for row in rows:
    for kind, n in sorted(row['by_kind'].items()):
      print(f'| {row["placement"]} | {kind} | {n["injected"]} | {n["detected"]} | {n["lost"]} |')
  if any(row['lost'] for row in rows):
    sys.exit('data lost')


if __name__ == '__main__':
  main()
