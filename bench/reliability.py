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
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / 'tests'))
sys.path.insert(0, str(REPO_ROOT))

import test_reliability as rel  # pylint: disable=g-import-not-at-top,wrong-import-position
from megatrain_jax import faults  # pylint: disable=g-import-not-at-top,wrong-import-position


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
  fields = rel.placement_fields(placement)
  rng = random.Random(f'{args.seed}-{placement}')
  started = time.monotonic()
  reference = rel.launch(root / 'reference', fields)
  assert reference.returncode == 0, reference.output[-3000:]
  disk_full = args.disk_full if os.geteuid() == 0 else 0
  plan = rel.kill_plan(rng, placement, args.kills)
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
      start = rel.latest_checkpoint(workdir, fields)
      if start >= rel.STEPS:
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
        last_save = faults.CHECKPOINT_PASSES_PER_SAVE * len(rel.save_steps(start)) - 1
        kind, forced = 'checkpoint', f'checkpoint:{last_save}'
      else:
        forced = None
      if kind == 'corrupt':
        step, target = flip_a_byte(workdir, rng)
        start = rel.latest_checkpoint(workdir, fields)  # the fallback a rerun will take
        phase = rng.choice(rel.phases_for(placement))
        fault = rel.plan_fault(rng, phase, start, placement)
        run = rel.launch(workdir, fields, fault=fault)
        detected = (f'warning: checkpoint step {step} in' in run.output and 'is damaged' in
                    run.output and resumed_from(run.output) == start)
        log.append(f'corrupt {target.relative_to(workdir)} of step {step}, then {fault}: '
                   f'rc {run.returncode}, resumed from {resumed_from(run.output)}')
      elif kind == 'disk-full':
        # Filled once training runs (a full disk at start-up is refused up front, which
        # tests/test_nvme.py covers): the next checkpoint or NVMe write-back meets it.
        ballast = []
        run = rel.launch(workdir, fields, at_loop_start=lambda: ballast.append(
            fill(disk, args.disk_full_leave_kb << 10)))
        for path in ballast:
          path.unlink()
        full = [line for line in run.output.splitlines() if 'is full' in line]
        detected = run.returncode not in (0, -signal.SIGKILL) and bool(full)
        log.append(f'disk-full ({args.disk_full_leave_kb} KB left free): rc {run.returncode}, '
                   f'{(full or ["no disk-full message"])[-1][:200]}')
      else:
        if forced:
          fault, run = forced, rel.launch(workdir, fields, fault=forced)
        else:
          fault, run = rel.run_killed(workdir, placement, kind, rng, start, reference)
        last_logged = max((r['step'] for r in rel.read_rows(workdir)), default=0)
        resumed_at = rel.latest_checkpoint(workdir, fields)
        lost = resumed_at < rel.known_committed(last_logged, start)
        counts['lost'] += lost
        detected = run.returncode == -signal.SIGKILL and not lost
        log.append(f'kill {fault}: rc {run.returncode}, trained {start}->{last_logged}, '
                   f'next run resumes at {resumed_at}')
      counts['injected'] += 1
      label = kind if kind in ('corrupt', 'disk-full', *rel.EXTERNAL) else 'fault point'
      kinds[label] = kinds.get(label, 0) + 1
      counts['detected'] += bool(detected)
      counts['resumed'] += resumed_from(run.output) is not None
    final = rel.launch(workdir, fields)
    assert final.returncode == 0, final.output[-3000:]
    counts['resumed'] += resumed_from(final.output) is not None
    got = rel.learning_rows(rel.read_rows(workdir))
    want = rel.learning_rows(rel.read_rows(root / 'reference'))
    counts['lost'] += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    counts['lost'] += not rel.states_equal(rel.final_state(workdir, fields),
                                           rel.final_state(root / 'reference', fields))
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
