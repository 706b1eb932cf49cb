"""Checkpoints: NVMe snapshots without the state in RAM, portability between placements, crash
consistency of the live NVMe state, damaged checkpoints, and full disks."""

import dataclasses
import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import threading
import time
import types

import jax
import numpy as np
import pytest

from megatrain_jax import checkpoint, locks, partition, runs, train
from megatrain_jax import config as config_lib
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.engine.streamed import StreamedEngine
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
from megatrain_jax.partition import split_axis
from megatrain_jax.placement import Placement
from megatrain_jax.tiers import codecs
from megatrain_jax.tiers import nvme
from megatrain_jax.tiers.nvme import NvmeStore

from helpers import (AS_ROOT, CFG, batches, make_tx, read_rows, run_until_crash, small_config,
                     streamed_run, tmpfs)

RESIDENT = {}
HOST = dict(offload__params='host', offload__opt_state='host', offload__layers_per_group=1)
NVME = dict(offload__params='nvme', offload__opt_state='nvme', offload__layers_per_group=1)


def fill(directory: pathlib.Path, leave_bytes: int = 0) -> pathlib.Path:
  """Writes a ballast file until `directory`'s filesystem has about `leave_bytes` free."""
  ballast = directory / 'ballast'
  with open(ballast, 'wb') as f:
    try:
      while shutil.disk_usage(directory).free > leave_bytes + (1 << 16):
        f.write(b'\0' * (1 << 16))
        f.flush()
    except OSError:
      pass
  return ballast


def config(data, steps=8, **overrides):
  return small_config(data, train__steps=steps, **overrides)


@pytest.fixture(scope='module')
def data(shared_data):
  return shared_data / 'wikitext-2' / 'valid.txt'


_REFERENCE = {}


def reference_rows(data, tmp_path_factory, steps=8, **placement):
  """Learning rows of an uninterrupted run (cached per placement and length)."""
  key = (steps, tuple(sorted(placement.items())))
  if key not in _REFERENCE:
    workdir = tmp_path_factory.mktemp('reference')
    train.train_and_evaluate(config(data, steps, **placement), str(workdir))
    _REFERENCE[key] = numbers(read_rows(workdir))
  return _REFERENCE[key]


def numbers(rows):
  """{step: learning and eval metrics} (timing and I/O rates differ between any two runs)."""
  return {r['step']: {k: v for k, v in r.items() if k.startswith(('learning/', 'eval/'))}
          for r in rows}


def assert_rows_match(got_dir, want, steps, exact):
  got = numbers(read_rows(got_dir))
  assert sorted(got) == sorted(want) == list(range(steps + 1))
  for step in range(1, steps + 1):
    if exact:
      assert got[step] == want[step], step
    else:
      np.testing.assert_allclose(got[step]['learning/loss'], want[step]['learning/loss'],
                                 rtol=1e-5)
  np.testing.assert_allclose(got[steps]['eval/loss'], want[steps]['eval/loss'],
                             rtol=0 if exact else 1e-5)


def chunk_files(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in directory.rglob('*') if p.is_file() and '/c/' in str(p))


# ------------------------------------------------------------------------------------------------
# The NVMe snapshot itself.
# ------------------------------------------------------------------------------------------------

def test_nvme_snapshot_is_hard_links_that_later_writes_leave_intact(tmp_path, monkeypatch):
  engine, _, _ = streamed_run(1, 1.0, params='nvme', opt_state='nvme', layers_per_group=2,
                              dir=str(tmp_path / 'offload'))
  want = engine.export_state()
  reads = []
  original_read = NvmeStore._read
  monkeypatch.setattr(NvmeStore, '_read', lambda self, key: reads.append(key) or
                      original_read(self, key))
  checkpointer = Checkpointer(tmp_path / 'run', keep=2)
  checkpointer.save(5, engine, data_position=10, model_cfg=CFG)
  checkpointer.wait()
  assert reads == []  # no layer went through RAM
  live = tmp_path / 'offload' / 'params' / 'layers.attn.q_proj.kernel'
  saved = tmp_path / 'run' / 'checkpoints' / '5' / 'nvme' / 'params.layers.attn.q_proj.kernel'
  live_files, saved_files = chunk_files(live), chunk_files(saved)
  assert len(saved_files) == CFG.num_layers
  assert [p.stat().st_ino for p in saved_files] == [p.stat().st_ino for p in live_files]
  monkeypatch.undo()

  for batch in batches(1)[:2]:  # rewrites every layer of the live store
    engine.train_step(batch)
  engine.close()
  assert all(a.stat().st_ino != b.stat().st_ino for a, b in zip(chunk_files(live), saved_files))
  reader = checkpointer.restore(CFG)
  assert reader.step == 5 and reader.meta['data_position'] == 10
  tx, _, _ = make_tx(1.0)
  from megatrain_jax.engine import resident  # pylint: disable=g-import-not-at-top
  got = reader.full_state(resident.abstract_state(CFG, tx))
  jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, want))
  checkpointer.close()


def test_keep_deletes_the_oldest_only_after_a_new_commit(tmp_path):
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=2)
  for step in (1, 2, 3):
    checkpointer.save(step, engine, data_position=step, model_cfg=CFG)
    checkpointer.wait()
    assert checkpointer.steps() == [max(1, step - 1), step][-min(step, 2):]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '3']  # no leftover temp dirs
  checkpointer.close()


def test_keep_counts_no_checkpoint_newer_than_the_one_committed(tmp_path):
  """A resume that fell back past a damaged checkpoint (8) commits older steps (7) with it still
  there: keep counts the checkpoints up to the committed step, so the intact ones it keeps are
  not deleted for the damaged one (keep=1 kept only step 8, and the next start found every
  checkpoint damaged)."""
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=1)
  checkpointer.save(8, engine, data_position=8, model_cfg=CFG)
  checkpointer.wait()
  for step in (6, 7):  # the resumed run, from step 5
    checkpointer.save(step, engine, data_position=step, model_cfg=CFG)
    checkpointer.wait()
  assert checkpointer.steps() == [7, 8]
  checkpointer.save(8, engine, data_position=8, model_cfg=CFG)  # step 8 again: rewritten
  checkpointer.wait()
  assert checkpointer.steps() == [8]
  checkpointer.close()


def test_a_resume_with_a_lower_keep_deletes_the_checkpoints_beyond_it_first(tmp_path, data,
                                                                             monkeypatch, capsys):
  """A run stopped by a full disk, rerun with a lower checkpoint.keep (the error's advice): the
  checkpoints beyond it are deleted before the first save, which needs the room; they were
  deleted only after that save's commit, so the rerun failed the same way."""
  train.train_and_evaluate(config(data, steps=6, checkpoint__every=2, checkpoint__keep=3),
                           str(tmp_path))
  assert Checkpointer(tmp_path, keep=3).steps() == [2, 4, 6]
  there = []
  save = Checkpointer.save
  monkeypatch.setattr(Checkpointer, 'save', lambda self, step, *a, **k: there.append(
      self.steps()) or save(self, step, *a, **k))
  capsys.readouterr()
  train.train_and_evaluate(config(data, steps=8, checkpoint__every=2, checkpoint__keep=1),
                           str(tmp_path))
  assert there[0] == [6]
  assert 'note: deleted checkpoint(s) 2, 4 beyond checkpoint.keep=1' in capsys.readouterr().out
  assert Checkpointer(tmp_path, keep=1).steps() == [8]


LEAF = "['params']['layers']['attn']['q_proj']['kernel']"


def test_a_checkpoint_being_read_is_kept_until_its_reader_is_done(tmp_path):
  """read_checkpoint (--eval, --sample, --export_hf beside a run) holds the checkpoint it reads: the
  run's commits delete the others beyond checkpoint.keep but keep it, and the first commit after
  the reader is done deletes it. Opening it deletes no unfinished save of the run."""
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=1)
  checkpointer.save(1, engine, data_position=1, model_cfg=CFG)
  checkpointer.wait()
  in_flight = tmp_path / 'checkpoints' / '.tmp-2'  # the run's next save, being written
  in_flight.mkdir()
  with checkpoint.read_checkpoint(tmp_path, CFG) as reader:
    assert reader.step == 1 and in_flight.is_dir()
    in_flight.rmdir()
    want = reader.read(LEAF)
    for step in (2, 3):
      checkpointer.save(step, engine, data_position=step, model_cfg=CFG)
      checkpointer.wait()
      assert checkpointer.steps() == [1, step]
    np.testing.assert_array_equal(reader.read(LEAF), want)
  checkpointer.save(4, engine, data_position=4, model_cfg=CFG)
  checkpointer.wait()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['4']
  checkpointer.close()


def test_a_reader_that_locks_a_checkpoint_as_it_is_deleted_takes_the_newest_again(
    tmp_path, monkeypatch):
  """The race read_checkpoint closes: the run renames the checkpoint away (to delete it) between the
  reader's open and its lock. The reader sees another inode at the path and walks again."""
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=2)
  for step in (1, 2):
    checkpointer.save(step, engine, data_position=step, model_cfg=CFG)
  checkpointer.close()
  flock = locks.fcntl.flock
  deleted = []

  def deleted_first(fd, operation):
    if not deleted:  # the first lock: checkpoint 2, renamed away just before it is taken
      os.rename(tmp_path / 'checkpoints' / '2', tmp_path / 'checkpoints' / '.tmp-delete-2')
      deleted.append(True)
    return flock(fd, operation)

  monkeypatch.setattr(locks.fcntl, 'flock', deleted_first)
  with checkpoint.read_checkpoint(tmp_path, CFG) as reader:
    assert deleted and reader.step == 1


def test_keep_best_keeps_the_lowest_eval_loss_beside_the_newest(tmp_path):
  """checkpoint.keep_best: the commits keep the newest `keep` and the checkpoint whose meta.json
  records the lowest eval_loss (the earliest of equal ones); a checkpoint without one (a
  time-based save) is never the best. read_checkpoint reads 'best' or a step number."""
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=1, keep_best=True)
  losses = {1: 3.0, 2: 2.0, 3: None, 4: 2.0, 5: 2.5}
  kept = {1: [1], 2: [2], 3: [2, 3], 4: [2, 4], 5: [2, 5]}
  for step, loss in losses.items():
    checkpointer.save(step, engine, data_position=step, model_cfg=CFG, eval_loss=loss)
    checkpointer.wait()
    assert checkpointer.steps() == kept[step], step
  assert checkpoint.best_step(tmp_path / 'checkpoints') == 2
  with checkpoint.read_checkpoint(tmp_path, CFG, 'best') as reader:
    assert reader.step == 2 and reader.meta['eval_loss'] == 2.0
  with checkpoint.read_checkpoint(tmp_path, CFG, '5') as reader:
    assert reader.step == 5
  with pytest.raises(ConfigError, match=r'checkpoint.read=4: .* has no checkpoint of step 4 '
                                        r'\(it has 2, 5\); pass one of those.'):
    with checkpoint.read_checkpoint(tmp_path, CFG, '4'):
      pass
  checkpointer.save(6, engine, data_position=6, model_cfg=CFG, eval_loss=1.5)
  checkpointer.wait()
  assert checkpointer.steps() == [6]
  checkpointer.close()
  without = Checkpointer(tmp_path / 'plain', keep=1)
  without.save(1, engine, data_position=1, model_cfg=CFG)
  without.close()
  with pytest.raises(ConfigError, match='checkpoint.read=best: no checkpoint in .* records an '
                                        'eval/loss'):
    with checkpoint.read_checkpoint(tmp_path / 'plain', CFG, 'best'):
      pass


def test_a_run_with_keep_best_evaluates_and_exports_its_best_step(tmp_path, data, monkeypatch):
  """A run with checkpoint.keep_best whose validation loss is lowest at step 4 of 8 (the losses
  set here) keeps checkpoints 4 and 8 with keep=1; --eval and --export_hf with checkpoint.read
  read the best, or a step, and a deleted step is refused naming those there are."""
  losses = iter([5.0, 3.0, 1.0, 4.0, 6.0])  # steps 0, 2, 4, 6, 8
  def evaluate(engine, batches):
    loss = next(losses)
    return {'eval/loss': loss, 'eval/perplexity': np.exp(loss)}

  monkeypatch.setattr(train, '_evaluate', evaluate)
  run = config(data, steps=8, train__eval_every=2, checkpoint__every=2, checkpoint__keep=1,
               checkpoint__keep_best=True)
  train.train_and_evaluate(run, str(tmp_path))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['4', '8']
  # Which checkpoint is read is the point, not the score: 8 KB of the validation text will do.
  (tmp_path / 'eval.txt').write_text(data.read_text(encoding='utf-8')[:8000], encoding='utf-8')
  run.eval.path, run.eval.max_len = str(tmp_path / 'eval.txt'), 32
  run.checkpoint.read = 'best'
  assert train.evaluate(run, str(tmp_path))['eval/source'].endswith('checkpoints/4 (step 4)')
  run.checkpoint.read = '8'
  assert train.evaluate(run, str(tmp_path))['eval/source'].endswith('checkpoints/8 (step 8)')
  run.checkpoint.read = 'best'
  train.export_hf(run, str(tmp_path), str(tmp_path / 'hf'))
  model_cfg = train._validate(run, str(tmp_path))[0]  # pylint: disable=protected-access
  with checkpoint.read_checkpoint(tmp_path, model_cfg, '4') as reader:
    exported = reader.read(LEAF)
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  weights = {}
  for f in (tmp_path / 'hf').glob('*.safetensors'):
    weights.update(load_file(f))
  np.testing.assert_array_equal(weights['model.layers.0.self_attn.q_proj.weight'],
                                exported[0].T)
  run.checkpoint.read = '2'
  with pytest.raises(ConfigError, match=r'no checkpoint of step 2 \(it has 4, 8\)'):
    train.export_hf(run, str(tmp_path), str(tmp_path / 'other'))


def test_keep_best_needs_an_eval_at_every_checkpoint(tmp_path):
  for fields, message in [
      (dict(checkpoint__every=3, train__eval_every=2), 'checkpoint.every=3 is not a multiple of '
                                                       'train.eval_every=2'),
      (dict(checkpoint__every=4, train__eval_every=0), 'not a multiple of train.eval_every=0'),
      (dict(checkpoint__every=-1), 'checkpoint.every=-1 writes none')]:
    with pytest.raises(ConfigError, match=f'checkpoint.keep_best: .*{re.escape(message)}'):
      train.train_and_evaluate(small_config('', checkpoint__keep_best=True, **fields),
                               str(tmp_path / 'run'))
    assert not (tmp_path / 'run').exists()
  with pytest.raises(ConfigError, match="checkpoint.read: 'last' is not 'newest', 'best' or a "
                                        'step number.'):
    train.train_and_evaluate(small_config('', checkpoint__read='last'), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


# ------------------------------------------------------------------------------------------------
# Any placement's checkpoint restores into any other.
# ------------------------------------------------------------------------------------------------

def spy_on_linking(monkeypatch) -> list[bool]:
  """Records what each NvmeStore.link_arrays returned (True: snapshot files linked back)."""
  linked = []
  original = NvmeStore.link_arrays
  monkeypatch.setattr(NvmeStore, 'link_arrays',
                      lambda self, sources: linked.append(original(self, sources)) or linked[-1])
  return linked


@pytest.mark.parametrize('first, second, linked', [
    (NVME, RESIDENT, []), (RESIDENT, NVME, []), (NVME, HOST, []), (HOST, NVME, []),
    (NVME, dict(NVME, offload__layers_per_group=2), [True, True]),  # files are per layer
    (dict(NVME, offload__codec='zstd'), NVME, [False, False]),  # another layout: rewritten
    (dict(offload__params='nvme', offload__opt_state='host'),
     dict(offload__params='host', offload__opt_state='nvme'), []),
], ids=['nvme-resident', 'resident-nvme', 'nvme-host', 'host-nvme', 'nvme-nvme_k2',
        'nvme_zstd-nvme', 'params_nvme-opt_nvme'])
def test_checkpoints_move_between_placements(tmp_path, tmp_path_factory, data, monkeypatch,
                                             capsys, first, second, linked):
  """Losses within float32 rounding of an uninterrupted resident run (placements differ only in
  the order of float32 operations), at every step before and after the move; the console says
  where the state moved (not for a codec: the same placement, stored otherwise)."""
  want = reference_rows(data, tmp_path_factory)
  run_until_crash(monkeypatch, config(data, **first), tmp_path, crash_after_checkpoint=4)
  links = spy_on_linking(monkeypatch)
  capsys.readouterr()
  train.train_and_evaluate(config(data, **second), str(tmp_path))
  assert links == linked
  assert_rows_match(tmp_path, want, 8, exact=False)
  notes = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith('note: checkpoint step 4 was written under another placement')]
  if first == NVME and second == RESIDENT:  # `auto` fields: the planner's choice
    assert len(notes) == 1 and 'params nvme -> device; opt_state nvme -> device' in notes[0]
    assert ('which the planner chose now (for the memory and disk free now, or as this version '
            'plans; set offload.params, ') in notes[0]
  if first == NVME and second == HOST:  # the user's (the note blamed the planner)
    assert len(notes) == 1 and 'under this one, as offload.* now asks' in notes[0], notes
    assert 'the same arithmetic, possibly in another order' in notes[0], notes
    assert 'not necessarily bit for bit' in notes[0], notes
    # The planner's `auto` fields that moved with them are named as its choice.
    auto = [key for key in ('optimizer_on', 'park_grads', 'keep_layer_inputs')
            if f'{key} ' in notes[0].split('); the run resumes')[0]]
    assert ('and the planner chose now' in notes[0]) == bool(auto), notes
  if 'offload__codec' in first:
    assert notes == []
  # The stores of the pieces that left NVMe are deleted (the full state, never read again).
  stores = sorted(p.name for p in (tmp_path / 'offload').iterdir()) if 'nvme' in str(first) else []
  if 'nvme' not in str(second):
    assert stores == []
  if second.get('offload__params') == 'host':
    assert 'params' not in stores


def test_a_resume_keeps_the_runs_offload_dir_or_cleans_the_one_it_left(tmp_path, data,
                                                                       monkeypatch, capsys):
  """An NVMe run in its own offload.dir (a fast drive): a rerun without --config (the run's
  config.json; offload.dir is each machine's field) keeps it there, where it built a second full
  copy of the state in <workdir>/offload and left the first behind; a resume told another
  offload.dir deletes the stores in the one it left (the full FP32 state, never read again) and
  says so."""
  first, second, workdir = tmp_path / 'nvme_a', tmp_path / 'nvme_b', tmp_path / 'run'
  run_until_crash(monkeypatch, config(data, **NVME, offload__dir=str(first)), workdir,
                  crash_after_checkpoint=4)
  assert nvme.store_dirs(first)
  command = config_lib.load_config('default')  # `launch.py --workdir run --config.train.steps=8`
  assert runs.recorded_config(workdir, command, ['train.steps']).offload.dir == str(first)
  capsys.readouterr()
  train.train_and_evaluate(config(data, **NVME, offload__dir=str(second)), str(workdir))
  assert nvme.store_dirs(first) == [] and nvme.store_dirs(second)
  assert f'note: deleted the NVMe stores this run no longer uses in {first} (' in (
      capsys.readouterr().out)


def test_a_streamed_resume_under_another_shard_mb_says_it_is_not_bit_for_bit(capsys):
  """offload.shard_mb cuts a streamed run's embedding and head into other vocabulary chunks (the
  same arithmetic in another order): a resume under another one says so, as for a placement; a
  resident run, which cuts nothing by it, says nothing."""
  offload = small_config('').offload
  for placement, note in ((Placement(params='host', opt_state='host', layers_per_group=1,
                                     shard_mb=64.0), True),
                          (Placement(shard_mb=64.0), False)):
    was = dataclasses.asdict(dataclasses.replace(placement, shard_mb=512.0))
    train._note_other_placement(  # pylint: disable=protected-access
        types.SimpleNamespace(step=4, meta={'placement': was}), placement, offload)
    out = capsys.readouterr().out
    assert ('shard_mb 512.0 -> 64.0' in out and 'not necessarily bit for bit' in out) == note, out


# ------------------------------------------------------------------------------------------------
# Crash consistency: resume never sees a mix of steps in the live NVMe store.
# ------------------------------------------------------------------------------------------------

def test_run_killed_mid_step_resumes_to_identical_results(tmp_path, tmp_path_factory, data,
                                                          monkeypatch):
  """The crash lands after group 1's new weights and Adam state reached the live store but before
  group 0's: the store holds a mix of steps 5 and 6. Resume rebuilds it from checkpoint 4 (by
  linking the snapshot's files) and reproduces the uninterrupted run bitwise."""
  from megatrain_jax.engine.streamed import StreamedEngine  # pylint: disable=g-import-not-at-top
  want = reference_rows(data, tmp_path_factory, **NVME)
  writes = {'armed': False, 'count': 0}
  original_write, original_step = NvmeStore._write, StreamedEngine.train_step

  def failing_write(self, *args):
    if writes['armed']:
      writes['count'] += 1
      if writes['count'] > 2:
        raise RuntimeError('simulated crash mid-step')
    return original_write(self, *args)

  def step(self, batch):
    writes['armed'] |= self.step == 5  # step 6
    return original_step(self, batch)

  monkeypatch.setattr(NvmeStore, '_write', failing_write)
  monkeypatch.setattr(StreamedEngine, 'train_step', step)
  with pytest.raises(RuntimeError, match='simulated crash'):
    train.train_and_evaluate(config(data, **NVME), str(tmp_path))
  monkeypatch.undo()
  assert writes['count'] > 2 and Checkpointer(tmp_path, keep=3).latest_step() == 4

  linked = spy_on_linking(monkeypatch)
  train.train_and_evaluate(config(data, **NVME), str(tmp_path))
  assert linked == [True, True]  # params and Adam state restored by linking, not rewriting
  assert_rows_match(tmp_path, want, 8, exact=True)


# ------------------------------------------------------------------------------------------------
# A damaged checkpoint: a warning naming it, then the previous one.
# ------------------------------------------------------------------------------------------------

def damage(path: pathlib.Path, how: str) -> None:
  data = bytearray(path.read_bytes())
  if how == 'flip':
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
  elif how == 'truncate':
    path.write_bytes(bytes(data[:len(data) // 2]))
  else:
    path.unlink()


def array_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The largest file of the in-memory leaves' arrays: a chunk file of array data."""
  return max((p for p in (step_dir / 'arrays').rglob('*') if p.is_file()),
             key=lambda p: p.stat().st_size)


def nvme_chunk_file(step_dir: pathlib.Path) -> pathlib.Path:
  array = step_dir / 'nvme' / 'opt_state.0.mu.layers.mlp.down_proj.kernel'
  return pathlib.Path(codecs.chunk_file(str(array), 1, 3))


@pytest.mark.parametrize('placement, how, bad_file', [
    (RESIDENT, 'flip', array_data_file),
    (RESIDENT, 'delete', array_data_file),
    (NVME, 'flip', nvme_chunk_file),
    (NVME, 'truncate', nvme_chunk_file),
    (NVME, 'delete', nvme_chunk_file),
    (NVME, 'flip', lambda d: d / 'meta.json'),
], ids=['array-flip', 'array-delete', 'nvme-flip', 'nvme-truncate', 'nvme-delete', 'meta-flip'])
def test_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, tmp_path_factory, data,
                                                           capfd, monkeypatch, placement, how,
                                                           bad_file):
  want = reference_rows(data, tmp_path_factory, steps=12, **placement)
  run_until_crash(monkeypatch, config(data, steps=12, **placement), tmp_path,
                  crash_after_checkpoint=8)
  assert Checkpointer(tmp_path, keep=3).steps() == [4, 8]
  bad = bad_file(tmp_path / 'checkpoints' / '8')
  damage(bad, how)
  capfd.readouterr()
  train.train_and_evaluate(config(data, steps=12, **placement), str(tmp_path))
  err = capfd.readouterr().err
  assert f'warning: checkpoint step 8 in {tmp_path / "checkpoints"} is damaged: {bad}' in err, err
  assert 'trying the previous one (step 4)' in err
  assert_rows_match(tmp_path, want, 12, exact=True)  # resumed from step 4, bitwise
  assert Checkpointer(tmp_path, keep=3).steps() == [4, 8, 12]  # step 8 rewritten intact


def test_every_checkpoint_damaged_is_an_error_naming_the_directory(tmp_path, data, monkeypatch):
  run_until_crash(monkeypatch, config(data, steps=12, **NVME), tmp_path, crash_after_checkpoint=8)
  damage(nvme_chunk_file(tmp_path / 'checkpoints' / '8'), 'flip')
  damage(array_data_file(tmp_path / 'checkpoints' / '4'), 'flip')
  with pytest.raises(StoreCorruptionError,
                     match=r'every checkpoint in .*checkpoints is damaged \(steps 4, 8;.*Delete '
                           r'.*checkpoints to start training from scratch, or use a new --workdir'):
    train.train_and_evaluate(config(data, steps=12, **NVME), str(tmp_path))


# ------------------------------------------------------------------------------------------------
# Full disks: a clear error, the previous checkpoint intact and resumable.
# ------------------------------------------------------------------------------------------------

def fill_after_checkpoint(monkeypatch, step: int, directory: pathlib.Path, leave_bytes: int):
  """Fills `directory`'s filesystem once checkpoint `step` is committed."""
  original_save = Checkpointer.save
  ballast = []

  def save_then_fill(self, done, *args, **kwargs):
    original_save(self, done, *args, **kwargs)
    if done == step:
      self.wait()
      ballast.append(fill(directory, leave_bytes))

  monkeypatch.setattr(Checkpointer, 'save', save_then_fill)
  return ballast


@AS_ROOT
@pytest.mark.parametrize('placement', [RESIDENT, NVME], ids=['arrays', 'nvme-copy'])
def test_disk_full_during_a_checkpoint(tmp_path, tmp_path_factory, data, monkeypatch, placement):
  want = reference_rows(data, tmp_path_factory, **placement)
  with tmpfs(16) as disk:
    workdir = disk / 'run'
    overrides = dict(placement, data__cache_dir=str(tmp_path / 'data'))
    if placement:  # the live store elsewhere: the checkpoint copies it (EXDEV)
      overrides['offload__dir'] = str(tmp_path / 'offload')
    ballast = fill_after_checkpoint(monkeypatch, 4, disk, leave_bytes=256 << 10)
    with pytest.raises(DiskFullError) as error:
      train.train_and_evaluate(config(data, **overrides), str(workdir))
    monkeypatch.undo()
    message = str(error.value)
    assert f'checkpoint step 8: the disk holding {workdir / "checkpoints"} is full' in message
    assert 'The previous checkpoint (step 4) is intact' in message and 'Free space' in message
    assert 'checkpoint.keep' not in message  # one checkpoint: a lower keep frees nothing
    assert sorted(os.listdir(workdir / 'checkpoints')) == ['4']  # no half-written step 8
    if placement:  # copies, made from a staging snapshot that is gone once copied
      assert all(p.stat().st_nlink == 1 for p in chunk_files(workdir / 'checkpoints' / '4'))
      assert not list((tmp_path / 'offload').glob('.checkpoint-snapshot-*'))
    ballast[0].unlink()
    train.train_and_evaluate(config(data, **overrides), str(workdir))
    assert_rows_match(workdir, want, 8, exact=True)


@AS_ROOT
def test_disk_full_during_nvme_write_back(tmp_path, tmp_path_factory, data, monkeypatch):
  want = reference_rows(data, tmp_path_factory, **NVME)
  with tmpfs(8) as disk:
    overrides = dict(NVME, offload__dir=str(disk / 'offload'))
    ballast = fill_after_checkpoint(monkeypatch, 4, disk, leave_bytes=0)
    with pytest.raises(DiskFullError) as error:
      train.train_and_evaluate(config(data, **overrides), str(tmp_path))
    monkeypatch.undo()
    message = str(error.value)
    # params, Adam state or the parked gradients (clipping): whichever write-back came first
    assert re.search(rf"NVMe store '(\w+)': the disk holding {disk / 'offload'}/\1 is full while "
                     r'writing back layers \d\.\.\d \(0\.\d+ MB for this group, 0\.\d+ MB free\)',
                     message), message
    assert 'the last checkpoint is intact' in message
    assert 'rerun with the same --workdir' in message
    assert Checkpointer(tmp_path, keep=3).steps() == [4]
    ballast[0].unlink()
    train.train_and_evaluate(config(data, **overrides), str(tmp_path))
    assert_rows_match(tmp_path, want, 8, exact=True)


@AS_ROOT
def test_a_workdir_without_room_for_a_checkpoint_is_refused_at_the_start(tmp_path, data):
  """A workdir whose disk cannot hold one checkpoint (its params and Adam state off NVMe, 12 B a
  parameter, and its files' overhead: 2.51 MB here) is refused before training, naming the bytes
  and the fixes, instead of failing at the first save (hours of training later)."""
  with tmpfs(8) as disk:
    workdir = disk / 'run'
    ballast = fill(disk, leave_bytes=600 << 10)  # room for a quarter of a checkpoint
    with pytest.raises(ConfigError, match=r'the checkpoints of this run need 2\.51 MB more in '
                                          rf'{workdir / "checkpoints"} at their peak \(one '
                                          r'checkpoint of 2\.51 MB;.*, and .* are free there\. '
                                          'Free space there, put'):
      train.train_and_evaluate(config(data, steps=2, data__cache_dir=str(tmp_path / 'data')),
                               str(workdir))
    assert not (workdir / 'checkpoints').exists() and not (workdir / 'metrics.jsonl').exists()
    ballast.unlink()


@AS_ROOT
def test_the_start_up_check_counts_every_checkpoint_kept_and_the_data(tmp_path, data):
  """The start-up check made room for the first checkpoint only: a disk that held two passed it
  with checkpoint.keep=3, and the run died at its third save (a run keeps `keep` and writes the
  next before it deletes the oldest: 4 at once); and the data, prepared after the check on the
  same disk, filled one that held a checkpoint at the first save. Both are refused before any
  training, with the bytes; a lower keep is offered where it would help, and only there."""
  model_cfg = config_lib.validate(config(data))
  one = train._checkpoint_bytes(model_cfg, Placement())
  assert one == 2_513_231  # 1.29 MB raw FP32 + 1%, 37 leaves x 32 KiB
  with tmpfs(16) as disk:
    workdir = disk / 'run'
    ballast = fill(disk, leave_bytes=int(2.5 * one))
    with pytest.raises(ConfigError) as error:
      train.train_and_evaluate(config(data, checkpoint__every=2, data__cache_dir=str(
          tmp_path / 'data')), str(workdir))
    assert (f'need {one * 4 / 1e6:.2f} MB more in {workdir / "checkpoints"} at their peak (4 at '
            f'once, {one / 1e6:.2f} MB each: checkpoint.keep=3 kept, and the next written '
            'before the oldest is deleted' in str(error.value)), error.value
    assert f'lower checkpoint.keep (keep=1 needs {one * 2 / 1e6:.2f} MB' in str(error.value)
    assert not (workdir / 'checkpoints').exists()
    with pytest.raises(ConfigError) as error:  # the best kept too: one more, named (not keep=4)
      train.train_and_evaluate(config(data, steps=10, checkpoint__every=2, train__eval_every=2,
                                      checkpoint__keep_best=True, data__cache_dir=str(
                                          tmp_path / 'data')), str(workdir))
    assert ('(5 at once, ' in str(error.value) and 'checkpoint.keep=3 and the best (keep_best) '
            'kept, and the next written' in str(error.value)), error.value
    ballast.unlink()
    # Room for the one checkpoint of keep=1, but not beside the data prepared into the workdir
    ballast = fill(disk, leave_bytes=one + (1 << 20))  # the data: 2.25 MB
    with pytest.raises(ConfigError, match=r'need 2\.51 MB more .*\(one checkpoint .* are free '
                                          r'there, the prepared data written\. Free space there, '
                                          'put'):
      train.train_and_evaluate(config(data, steps=2, checkpoint__keep=1), str(workdir))
    assert not (workdir / 'checkpoints').exists() and (workdir / 'data').is_dir()
    ballast.unlink()


@AS_ROOT
def test_the_stores_and_the_checkpoints_on_one_disk_are_counted_together(tmp_path, data):
  """offload.dir on the workdir's disk: the NVMe stores with their checkpoint snapshots, and the
  checkpoints' own arrays, were each checked against the whole free space, so a disk that held
  either passed both checks (a 135 MB disk for the tiny config with keep=3 died at its step-7
  save, 157 MB used at the peak). The sum is checked at the start now, naming the stores' share:
  here the stores twice and one checkpoint's arrays are free, where keep=1 needs two of those."""
  nvme_only = dict(NVME, offload__activations='device', offload__embed_head='device',
                   offload__optimizer_on='device', checkpoint__keep=1, checkpoint__every=2,
                   data__cache_dir=str(tmp_path / 'data'))
  hw, plan = train.plan_for(config(data, **nvme_only), tmp_path / 'sized', dry_run=True)
  model_cfg = config_lib.validate(config(data))
  stores = train._nvme_store_bytes(model_cfg, plan.placement)
  one = train._checkpoint_bytes(model_cfg, plan.placement)
  assert 2 * stores + one >= 2 * one  # the checkpoints' room alone passes (keep + the next)
  with tmpfs((3 * stores + 4 * one) / 2**20) as disk:
    ballast = fill(disk, leave_bytes=2 * stores + one)  # the stores twice, one checkpoint's arrays
    nvme.check_offload_dir(str(disk / 'run' / 'offload'), stores, disk / 'run' / 'checkpoints',
                           keep=1)  # passes alone, as the checkpoints' room alone would
    with pytest.raises(ConfigError, match=r'checkpoint: the checkpoints of this run need .* the '
                                          r'NVMe stores and their snapshots \(.* more\) on the '
                                          'same disk'):
      train.train_and_evaluate(config(data, **nvme_only), str(disk / 'run'))
    assert not (disk / 'run' / 'checkpoints').exists()
    ballast.unlink()


@AS_ROOT
def test_a_full_disk_outside_checkpoints_is_one_error(tmp_path, data):
  """The workdir's disk full as a run resumes (its lock's holder line), or data.cache_dir's as
  the data is prepared: DiskFullError naming the directory and the rerun, not an OSError's
  traceback; the lock is given back (the rerun in this process is not refused as 'in use')."""
  with tmpfs(8) as disk:
    workdir = disk / 'run'
    workdir.mkdir()
    ballast = fill(disk)
    with open(ballast, 'ab', buffering=0) as f:  # to the last page: no new file's write fits
      try:
        while True:
          f.write(b'\0' * 4096)
      except OSError:
        pass
    with pytest.raises(DiskFullError, match=rf'the disk of {workdir} is full \(No space left on '
                                            r'device\): free space there.*rerun the same command'):
      train.train_and_evaluate(config(data, steps=2, data__cache_dir=str(tmp_path / 'data')),
                               str(workdir))
    with pytest.raises(DiskFullError, match=rf'the disk of {disk / "cache"} is full'):
      train.prepare(config(data, data__cache_dir=str(disk / 'cache')), str(tmp_path / 'prep'))
    ballast.unlink()
    train.train_and_evaluate(config(data, steps=2, data__cache_dir=str(tmp_path / 'data')),
                             str(workdir))
    assert [row['step'] for row in read_rows(workdir) if 'learning/loss' in row] == [1, 2]


@AS_ROOT
def test_a_gone_offload_dir_is_rebuilt_with_a_note(tmp_path, data, capsys):
  """A run's offload.dir on a drive that is gone as it resumes (unmounted; a cleaned /tmp): a
  rerun without --config took <workdir>/offload instead (runs.recorded_config), and one with it
  made the directory anew on the disk of the empty mount point, both without a word. The
  checkpoint holds the stores whole, so they are rebuilt, with a note naming the old place, the
  new one and its disk's free space; and a new place without room for them is refused before
  anything is written there."""
  workdir = tmp_path / 'run'
  nvme_run = dict(NVME, checkpoint__every=2, data__cache_dir=str(tmp_path / 'data'))
  with tmpfs(1) as root:  # a small disk with the drive's mount point
    mount_point = root / 'nvme'
    mount_point.mkdir()
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=16m', 'tmpfs', str(mount_point)],
                   check=True)
    on_drive = config(data, steps=2, offload__dir=str(mount_point / 'offload'), **nvme_run)
    try:
      train.train_and_evaluate(on_drive, str(workdir))
    finally:
      subprocess.run(['umount', str(mount_point)], check=True)
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r'offload.dir=.*free') as error:  # same: no room
      train.train_and_evaluate(config(data, steps=3, offload__dir=str(mount_point / 'offload'),
                                      **nvme_run), str(workdir))
    assert (f'note: offload.dir={mount_point / "offload"}, where this run kept its NVMe stores '
            '(its config.json), is gone (an unmounted drive? a cleaned /tmp?). Its checkpoint '
            '(step 2) holds them whole: those this resume keeps on NVMe are rebuilt from it '
            f'there, on the disk of {mount_point} (' in capsys.readouterr().out), error.value
    assert not (mount_point / 'offload').exists(), error.value
  # Without --config (launch.py): this machine's offload.dir, <workdir>/offload
  resumed = runs.recorded_config(workdir, config(data, steps=3), ['train.steps'])
  assert resumed.offload.dir == ''
  train.train_and_evaluate(resumed, str(workdir))
  out = capsys.readouterr().out
  assert re.search(rf'rebuilt from it in {workdir / "offload"}, on the disk of {workdir} '
                   r'\([\d.,]+ [GM]B free, checked against their need before anything is written '
                   rf'there\)\. To keep them where they were, .* --config.offload.dir='
                   rf'{root / "nvme" / "offload"}\.\n', out), out
  assert [row['step'] for row in read_rows(workdir) if 'learning/loss' in row] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# The up-front disk check counts what checkpoints pin.
# ------------------------------------------------------------------------------------------------

@AS_ROOT
def test_free_space_check_counts_kept_checkpoints(tmp_path):
  with tmpfs(8) as disk:  # 8 MiB; the stores need 3 MB
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=1)
    with pytest.raises(ConfigError, match=r'offload.dir=.*stores and their checkpoints need '
                                          r'12\.00 MB .*checkpoint.keep=3 pins one more copy.*'
                                          r'lower checkpoint.keep'):
      nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=3)
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=0)
    # checkpoints on another filesystem are copies of a staging snapshot in offload.dir
    with pytest.raises(ConfigError, match=r'offload.dir=.*stores need 10\.00 MB .*5\.00 MB '
                                          r'live, and as much for the snapshot a checkpoint '
                                          r'copies'):
      nvme.check_offload_dir(str(disk / 'offload'), 5_000_000, checkpoint_dir=tmp_path, keep=1)
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=tmp_path, keep=1)
    # ... and kept + 1 being written must fit where the checkpoints are
    with pytest.raises(ConfigError, match=r'checkpoint.keep=3: .*cannot be hard links.*need '
                                          r'12\.00 MB \(3 kept \+ 1 being written\).*'
                                          r'lower checkpoint.keep'):
      nvme.check_offload_dir(str(tmp_path), 3_000_000, checkpoint_dir=disk / 'run', keep=3)


@AS_ROOT
def test_the_planner_counts_one_snapshot_where_checkpoints_are_on_another_disk(tmp_path, data):
  """offload.dir on a disk of its own (the layout placement.md advises: a local NVMe drive),
  the workdir elsewhere: the checkpoints copy the stores from one snapshot there, not a
  hard-linked copy each. The planner counted checkpoint.keep copies on offload.dir all the same
  and refused (or, under auto, left NVMe) what fits; on one disk it still counts them, and names
  checkpoint.keep in its fix where lowering it would help."""
  nvme_only = dict(NVME, offload__activations='device', offload__embed_head='device',
                   offload__optimizer_on='device', checkpoint__keep=3, checkpoint__every=2)
  _, plan = train.plan_for(config(data, **nvme_only), tmp_path / 'sized', dry_run=True)
  live = sum(r.bytes for r in plan.rows if r.tier == 'nvme' and 'snapshot' not in r.item)
  with tmpfs(2.6 * live / 2**20) as disk:  # two copies of the stores, not four
    offload = dict(nvme_only, offload__dir=str(disk / 'offload'))
    _, plan = train.plan_for(config(data, **offload), tmp_path / 'run', dry_run=False)
    snapshot = [r for r in plan.rows if r.tier == 'nvme' and 'snapshot' in r.item]
    assert [(r.item, r.bytes) for r in snapshot] == [
        ("checkpoint snapshot (copied to the workdir's filesystem)", live)]
    with pytest.raises(ConfigError, match=r'nvme: .* needed(.|\n)*lower checkpoint\.keep \(each '
                                          r'kept checkpoint pins a copy'):
      train.plan_for(config(data, **offload), disk / 'run', dry_run=False)
    train.plan_for(config(data, **dict(offload, checkpoint__keep=1)), disk / 'run',
                   dry_run=False)  # the stores and one checkpoint's copy of them
  with tmpfs(1.6 * live / 2**20) as disk:  # keep=1 does not fit either: no advice to lower it
    offload = dict(nvme_only, offload__dir=str(disk / 'offload'), checkpoint__keep=1)
    with pytest.raises(ConfigError, match=r'nvme: .* needed') as refused:
      train.plan_for(config(data, **offload), disk / 'run', dry_run=False)
    assert 'checkpoint.keep' not in str(refused.value)


@AS_ROOT
def test_the_disk_a_run_holds_counts_as_free_for_it(tmp_path, monkeypatch):
  """A resume (a rerun after a kill) plans with the disk its own stores and the snapshots of the
  checkpoints it keeps hold: they are rebuilt or kept, not added. Before, a 1B run killed
  mid-checkpoint came back under another placement with 2.4x the RAM, its own 20 GB counted as
  taken. Nothing else in offload.dir counts: another program's files, symbolic links, the
  snapshots of checkpoints beyond checkpoint.keep unless named (those a resume deletes), a
  directory of a store's name that holds anything but arrays (a user's own, in a shared
  offload.dir: the engine deletes the stores it does not use)."""
  with tmpfs(12) as disk:  # 12 MiB
    stores, checkpoints = disk / 'offload', disk / 'run' / 'checkpoints'
    layer = stores / 'params' / 'layers.w' / 'c'
    layer.mkdir(parents=True)
    (layer / '0').write_bytes(b'\1' * 3_000_000)
    (layer.parent / 'zarr.json').write_text('')
    other = stores / 'process-1' / 'opt_state' / 'm' / 'c'  # a run of 2 processes before
    other.mkdir(parents=True)
    (other / '0').write_bytes(b'\3' * 500_000)
    (other.parent / 'zarr.json').write_text('')
    staged = stores / '.checkpoint-snapshot-6' / 'params.w' / 'c'  # a killed copy's staging
    staged.mkdir(parents=True)
    (staged / '0').write_bytes(b'\7' * 100_000)
    (staged.parent / 'zarr.json').write_text('')
    (stores / 'datasets').mkdir()  # not the run's
    (stores / 'datasets' / 'corpus').write_bytes(b'\4' * 2_000_000)
    (stores / 'elsewhere').symlink_to(stores / 'datasets')  # a link: not followed
    for step in (2, 4):
      (checkpoints / str(step) / 'nvme').mkdir(parents=True)
    os.link(layer / '0', checkpoints / '4' / 'nvme' / 'linked')  # counted once
    (checkpoints / '4' / 'nvme' / 'own').write_bytes(b'\2' * 1_000_000)
    (checkpoints / '2' / 'nvme' / 'older').write_bytes(b'\5' * 1_000_000)  # beyond keep=1
    assert nvme.held_by_run(str(stores), checkpoints, keep=1) == 4_600_000
    assert nvme.held_by_run(str(stores), checkpoints, keep=2) == 5_600_000
    ballast = fill(disk, leave_bytes=2_000_000)
    # 3 MB of stores and one checkpoint's 3 MB: 6 MB, of which the run holds 4.6 (2 free)
    nvme.check_offload_dir(str(stores), 3_000_000, checkpoint_dir=checkpoints, keep=1)
    with pytest.raises(ConfigError, match=r'need 9\.00 MB .* MB are free there \(with the 4\.60 '
                                          r'MB the run holds\)'):
      nvme.check_offload_dir(str(stores), 4_500_000, checkpoint_dir=checkpoints, keep=1)
    monkeypatch.setattr(train.hardware, 'free_disk_gb', lambda directory: 0.0)
    free = train._disk_free_gb(str(stores), train.hardware.PRESETS['cpu'], False, checkpoints,
                               keep=1)
    assert free == 4_600_000 / 1e9
    ballast.unlink()
    # The run's stores that no store of its placement rebuilds go; what is not the run's stays.
    (stores / 'head_params').mkdir()  # named as a store, a user's file in it (refused by
    (stores / 'head_params' / 'notes.txt').write_bytes(b'\6' * 100_000)  # check_offload_dir)
    nvme.remove_other_stores(str(stores), {'opt_state'})
    assert sorted(p.name for p in stores.iterdir()) == ['datasets', 'elsewhere', 'head_params']
    assert (stores / 'datasets' / 'corpus').read_bytes() == b'\4' * 2_000_000
    assert (stores / 'head_params' / 'notes.txt').read_bytes() == b'\6' * 100_000


@AS_ROOT
def test_a_rerun_with_a_lower_keep_counts_the_nvme_checkpoints_it_deletes(tmp_path, data):
  """An NVMe run stopped by a full disk with checkpoints 2, 4 and 6, rerun with checkpoint.keep=1
  as docs/checkpoints.md says, was refused: the check counted the newest checkpoint's snapshot as
  the run's, not those of 2 and 4, which the rerun deletes before it writes. They count now; a
  lower keep is offered only where one would help, and the bytes read in MB, not '0.00 GB'."""
  model_cfg = config_lib.validate(config(data, **NVME))
  layers, _ = train._param_bytes(model_cfg)
  stores = nvme.nvme_bytes(layers, 'nvme', 'nvme')  # 1.09 MB
  placement = Placement(params='nvme', opt_state='nvme')
  with tmpfs(16) as disk:
    workdir, offload = disk / 'run', disk / 'offload'
    for step in (2, 4, 6):  # each pins a copy of the stores, rewritten since
      (workdir / 'checkpoints' / str(step) / 'nvme').mkdir(parents=True)
      (workdir / 'checkpoints' / str(step) / 'nvme' / 'own').write_bytes(b'\1' * stores)
    ballast = fill(disk, leave_bytes=stores // 2)

    def check(keep):
      run_config = config(data, **NVME, checkpoint__keep=keep, offload__dir=str(offload))
      train._check_offload_dir(run_config, model_cfg, workdir, dataclasses.replace(
          placement, dir=str(offload)))

    check(keep=1)  # the stores and a checkpoint: 2.18 MB, 3.27 MB held, 0.5 MB free
    with pytest.raises(ConfigError, match=rf'need {4 * stores / 1e6:.2f} MB .* but only 3\.8\d MB '
                                          r'are free there \(with the 3\.27 MB the run holds\)\. '
                                          r'.* on host, or lower checkpoint.keep\.'):
      check(keep=3)
    shutil.rmtree(workdir / 'checkpoints' / '4')
    shutil.rmtree(workdir / 'checkpoints' / '6')
    ballast.unlink()
    ballast = fill(disk, leave_bytes=stores // 2)
    with pytest.raises(ConfigError, match=r'the run holds\)\. Free space, point offload.dir at a '
                                          r'larger disk, or keep offload.opt_state \(2/3 of it\) '
                                          r'on host\.$'):  # keep=1: none lower
      check(keep=1)
    ballast.unlink()


@AS_ROOT
def test_the_best_checkpoint_kept_is_the_runs_own_disk(tmp_path, data):
  """checkpoint.keep_best keeps the best checkpoint however old: an NVMe run with keep=2 and its
  best at step 2 (of 2, 4 and 6), rerun with keep=1 after a full disk, deletes 4 and keeps 2 and
  6. The checks counted the snapshots of the newest keep + 1 (4, 6) and of those deleted (4) as
  the run's, and the best's as disk taken by something else, while counting its copy as needed
  too: a disk with room was refused, where the checkpoints hard-link the stores and where they
  copy them. The best's snapshot is the run's now; and a refusal names checkpoint.keep as set,
  not with the best added, and offers no lower keep than 1."""
  model_cfg = config_lib.validate(config(data, **NVME))
  layers, _ = train._param_bytes(model_cfg)
  stores = nvme.nvme_bytes(layers, 'nvme', 'nvme')  # 1.09 MB
  for same_disk in (True, False):
    with tmpfs(16) as disk:
      workdir = disk / 'run'
      offload = disk / 'offload' if same_disk else tmp_path / 'offload'
      for step, loss in ((2, 1.0), (4, 3.0), (6, 2.0)):  # each pins a copy of the stores
        snapshot = workdir / 'checkpoints' / str(step) / 'nvme'
        snapshot.mkdir(parents=True)
        (snapshot / 'own').write_bytes(b'\1' * stores)
        (snapshot.parent / 'meta.json').write_text(json.dumps({'step': step, 'eval_loss': loss}))
      ballast = fill(disk, leave_bytes=stores // 2)
      run_config = config(data, **NVME, checkpoint__keep=1, checkpoint__keep_best=True,
                          offload__dir=str(offload))
      check = functools.partial(train._check_offload_dir, run_config, model_cfg, workdir,
                                Placement(params='nvme', opt_state='nvme', dir=str(offload)))
      assert train._deleted_at_resume(run_config, workdir / 'checkpoints') == [4]
      check()  # 3 copies needed (the stores, or the next copy, and 2 and 6), 3 held, 0.5 free
      # The best alone, refused: named as set (it read checkpoint.keep=2), no lower keep offered
      shutil.rmtree(workdir / 'checkpoints' / '4')
      shutil.rmtree(workdir / 'checkpoints' / '6')
      ballast.unlink()
      ballast = fill(disk, leave_bytes=stores // 2)
      with pytest.raises(ConfigError, match='checkpoint.keep=1 and the best') as refused:
        check()
      assert 'lower checkpoint.keep' not in str(refused.value) and 'keep=2' not in str(
          refused.value)
      ballast.unlink()


def test_the_offload_dir_lock_outlives_the_last_commit(tmp_path, data, monkeypatch):
  """The run's last checkpoint commits in the background while the run closes; offload.dir's
  lock was given back before that commit was done, and a second run taking the directory then
  deleted the staged snapshot it was copying from (another filesystem). Its lock is held until
  the commit is done."""
  offload = tmp_path / 'offload'
  original_commit = Checkpointer._commit
  free_during_commit = []

  def commit(self, step, *args):
    if step == 8:  # the last: the run is closing meanwhile
      time.sleep(1.0)
      try:
        with locks.hold_offload_dir(offload, tmp_path / 'other'):
          free_during_commit.append(step)
      except locks.DirectoryInUseError:
        pass
    return original_commit(self, step, *args)

  monkeypatch.setattr(Checkpointer, '_commit', commit)
  train.train_and_evaluate(config(data, **NVME, offload__dir=str(offload)), str(tmp_path / 'run'))
  assert free_during_commit == [] and Checkpointer(tmp_path / 'run', keep=3).steps() == [4, 8]


@AS_ROOT
def test_a_staged_snapshot_deleted_before_its_copy_is_not_committed(tmp_path, data, monkeypatch):
  """A checkpoint of NVMe stores on another filesystem copies a staged snapshot from offload.dir;
  deleted before the copy (by anything), the commit found nothing to copy and committed a
  checkpoint without its NVMe arrays. It is refused, and the previous checkpoint stays the one
  a rerun resumes from."""
  original_commit = Checkpointer._commit

  def commit(self, step, tmp, meta, needed, copies):
    if step == 8:
      for staging in copies:
        shutil.rmtree(staging)
    return original_commit(self, step, tmp, meta, needed, copies)

  monkeypatch.setattr(Checkpointer, '_commit', commit)
  with tmpfs(64) as disk:
    run_config = config(data, **NVME, offload__dir=str(disk / 'offload'))
    with pytest.raises(StoreCorruptionError, match=r'checkpoint step 8: the snapshot of the NVMe '
                       r'stores staged at .*\.checkpoint-snapshot-8/.* was deleted before it was '
                       r'copied .*this checkpoint is not committed'):
      train.train_and_evaluate(run_config, str(tmp_path / 'run'))
    assert Checkpointer(tmp_path / 'run', keep=3).steps() == [4]


def test_an_engine_that_fails_to_start_stops_its_store_threads(tmp_path, data, monkeypatch):
  """A streamed engine failing as it fills its stores left their writer threads running (writing
  into an offload.dir whose lock the run gave back) until garbage collection."""
  original_put = StreamedEngine._put_initial_opt_state
  puts = []

  def out_of_memory_later(self, *args):
    puts.append(args[1])
    if len(puts) == 3:  # stores have written by now: their writer threads run
      raise MemoryError('RESOURCE_EXHAUSTED (the test)')
    original_put(self, *args)

  monkeypatch.setattr(StreamedEngine, '_put_initial_opt_state', out_of_memory_later)
  # This run's threads: an earlier test's crashed run (run_until_crash) may still hold its own
  # until garbage collection, later on a loaded machine (seen once in a full suite).
  before = set(threading.enumerate())
  with pytest.raises(MemoryError):
    train.train_and_evaluate(config(data, **NVME), str(tmp_path / 'run'))
  alive = [t.name for t in set(threading.enumerate()) - before
           if t.name.startswith(('params-', 'opt_state-'))]
  assert alive == []


@pytest.mark.parametrize('name', ['params', 'head_params'])
def test_a_users_directory_of_a_stores_name_is_refused_not_deleted(tmp_path, data, name):
  """offload.dir shared with files of the user's own, one directory of which has a store's
  name: the run is refused before anything is written, naming it (a run replaces its stores'
  directories: it deleted the user's files in it)."""
  offload = tmp_path / 'scratch'
  (offload / name).mkdir(parents=True)
  (offload / name / 'weights.bin').write_bytes(b'mine')
  nvme_config = config(data, **dict(NVME, offload__embed_head='nvme'), offload__dir=str(offload))
  with pytest.raises(ConfigError, match=rf'offload.dir=.*scratch/{name} is not an NVMe store of a '
                                        r'run \(it holds other files\).*would delete it'):
    train.train_and_evaluate(nvme_config, str(tmp_path / 'run'))
  assert (offload / name / 'weights.bin').read_bytes() == b'mine'
  assert not (tmp_path / 'run').exists()
  with pytest.raises(ConfigError, match='is not an NVMe store of a run'):
    NvmeStore(name, None, directory=str(offload), slices=[(0, 1)])
  assert (offload / name / 'weights.bin').read_bytes() == b'mine'


def test_an_uncommitted_save_is_ignored_and_cleaned_up(tmp_path):
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=3)
  checkpointer.save(1, engine, data_position=1, model_cfg=CFG)
  checkpointer.close()
  partial = tmp_path / 'checkpoints' / '.tmp-2'  # what a kill before the commit rename leaves
  shutil.copytree(tmp_path / 'checkpoints' / '1', partial)
  (partial / 'manifest.json').unlink()
  checkpointer = Checkpointer(tmp_path, keep=3)
  assert checkpointer.latest_step() == 1 and not partial.exists()
  assert checkpointer.restore(CFG).step == 1
  checkpointer.close()


def test_a_checkpoint_of_the_old_orbax_manager_layout_is_named_as_such(tmp_path, capfd):
  (tmp_path / 'checkpoints' / '4' / 'meta').mkdir(parents=True)  # <step>/{state, meta}, no meta.json
  (tmp_path / 'checkpoints' / '4' / 'state').mkdir()
  with pytest.raises(StoreCorruptionError, match=r'every checkpoint in .* is damaged \(steps 4;'):
    Checkpointer(tmp_path, keep=3).restore(CFG)
  assert 'layout of earlier versions' in capfd.readouterr().err


# ------------------------------------------------------------------------------------------------
# Never gathered: leaves are written and read in pieces (format 3).
# ------------------------------------------------------------------------------------------------

# A subprocess holding a ~400 MB state (a 100k x 1000 "embedding", a quarter-size "moment", step
# counts) saves it, or restores it onto the device, in pieces of 32 MB. It prints how many bytes
# of peak RSS the save added over the peak before it, or the restore over the state's own size.
_MEMORY_SCRIPT = r'''
import json, pathlib, sys
import jax, jax.numpy as jnp
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.model import ModelConfig

def status(field):  # VmRSS: now; VmHWM: the peak since reset_peak()
  for line in open('/proc/self/status'):
    if line.startswith(field):
      return int(line.split()[1]) * 1024

def reset_peak():
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')

mode, workdir, cfg = sys.argv[1], pathlib.Path(sys.argv[2]), ModelConfig(**json.loads(sys.argv[3]))
abstract = {'step': jax.ShapeDtypeStruct((), jnp.int32),
            'params': {'embed': jax.ShapeDtypeStruct((100_000, 1000), jnp.float32)},
            'opt_state': [jax.ShapeDtypeStruct((25_000, 1000), jnp.float32),
                          jax.ShapeDtypeStruct((), jnp.int32)]}
state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
checkpointer = Checkpointer(workdir, keep=1, piece_mb=32)
if mode == 'save':
  state = jax.tree.map(lambda x: jnp.full(x.shape, 1.5, x.dtype), abstract)
  jax.block_until_ready(state)
  before = status('VmRSS')
  reset_peak()
  checkpointer.save(1, state, data_position=0, model_cfg=cfg)
  checkpointer.wait()
  added = status('VmHWM') - before
else:
  jax.device_put(jnp.zeros(1)).block_until_ready()  # the runtime's own start-up is not a restore
  before = status('VmRSS')
  reset_peak()
  state = checkpointer.restore(cfg).device_state(abstract)
  jax.block_until_ready(state)
  added = status('VmHWM') - before - state_bytes
  assert float(state['params']['embed'][-1, -1]) == 1.5
print(json.dumps({'added': added, 'before': before}))
checkpointer.close()
'''


def run_memory_script(mode: str, workdir: pathlib.Path) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  result = subprocess.run(
      [sys.executable, '-c', _MEMORY_SCRIPT, mode, str(workdir),
       json.dumps(dataclasses.asdict(CFG))],
      env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_save_and_restore_of_a_resident_state_add_at_most_a_piece_or_two(tmp_path):
  """Format 2 copied the whole state to host and handed it to orbax: +400 MB or more here (the
  bench measures 3x the state). A save now holds at most one 32 MB piece (on CPU the piece is a
  view of the device buffer and TensorStore encodes it 8 MB at a time: measured +13-16 MB); a
  restore the file being read and TensorStore's buffer of it (measured +64-67 MB), the state's own
  buffers filled in place."""
  piece = 32 * 2**20
  saved = run_memory_script('save', tmp_path)
  assert saved['added'] <= piece + 16 * 2**20, saved
  arrays = tmp_path / 'checkpoints' / '1' / 'arrays'
  assert len(chunk_files(arrays / 'params.embed')) == 12  # 400 MB in 32 MB files
  restored = run_memory_script('restore', tmp_path)
  assert restored['added'] <= 2 * piece + 32 * 2**20, restored


def test_streamed_in_memory_tiers_hand_over_their_own_pieces(tmp_path):
  """A checkpoint of the host tier takes each layer group's and vocabulary chunk's leaves as the
  stores hold them, one piece at a time: every piece handed over is the store's own array (no
  copy, no concatenation of the whole leaf), and the pieces tile each full-state leaf."""
  from helpers import streamed_run  # pylint: disable=g-import-not-at-top
  engine, _, state = streamed_run(1, 1.0, params='host', opt_state='host', embed_head='host',
                                  layers_per_group=3, shard_mb=0.004)  # 4 layers: groups of 3, 1
  leaves, pieces, disk = engine.checkpoint_pieces(32 * 2**20)
  assert not disk
  stored = {id(x) for kind in engine.kinds for store in engine.stores[kind].all()[:2]
            for key in range(len(engine.kind_slices[kind])) for x in jax.tree.leaves(store.get(key))}
  covered = {}
  for path, start, stop, piece in pieces:
    layout = leaves[path]
    if split_axis(path) is not None:  # a split leaf: one store piece, never the whole leaf
      assert id(piece) in stored and piece.shape[layout.axis] == stop - start < layout.extent
    covered.setdefault(path, []).append((start, stop))
  full = {p: np.shape(x) for p, x in partition.by_path(state).items()}
  for path, spans in covered.items():
    layout = leaves[path]
    assert tuple(layout.shape) == full[path], path
    assert sorted(spans)[0][0] == 0 and sorted(spans)[-1][1] == layout.extent, (path, spans)
  assert set(covered) == set(full)


class PiecesEngine:
  """An engine with the `checkpoint_pieces` interface: a [4, 10] leaf cut along axis 1 into files
  of 3 columns, handed over last piece first; a 0-d step; a small leaf in one piece."""

  def __init__(self, full: np.ndarray, pieces=None):
    self.full = full
    self.pieces = pieces or [(9, 10), (6, 9), (0, 3), (3, 6)]
    self.drawn = []

  def checkpoint_pieces(self, piece_bytes):
    from megatrain_jax.checkpoint import LeafLayout  # pylint: disable=g-import-not-at-top
    del piece_bytes
    leaves = {"['head']": LeafLayout((4, 10), np.float32, axis=1, chunk=3),
              "['step']": LeafLayout((), np.int32),
              "['rng']": LeafLayout((2,), np.uint32)}

    def pieces():
      for start, stop in self.pieces:
        self.drawn.append((start, stop))
        yield "['head']", start, stop, jax.numpy.asarray(self.full[:, start:stop])
      yield "['step']", 0, 1, np.int32(7)
      yield "['rng']", 0, 2, np.array([1, 2], np.uint32)

    return leaves, pieces(), {}


def test_engine_pieces_along_any_axis_round_trip_bitwise(tmp_path):
  full = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
  engine = PiecesEngine(full)
  checkpointer = Checkpointer(tmp_path, keep=2)
  checkpointer.save(3, engine, data_position=5, model_cfg=CFG)
  assert engine.drawn == engine.pieces  # all drawn before save returned
  reader = checkpointer.restore(CFG)
  assert reader.meta['format'] == 3 and reader.step == 3
  np.testing.assert_array_equal(reader.read("['head']"), full)
  np.testing.assert_array_equal(reader.read("['head']", 2, 7, axis=1), full[:, 2:7])
  np.testing.assert_array_equal(reader.read("['head']", 1, 3), full[1:3])
  assert reader.file_indices("['head']", axis=1) == 3
  step = reader.read("['step']")
  assert step.shape == () and step.dtype == np.int32 and step == 7
  assert reader.read("['rng']").tolist() == [1, 2]
  assert len(chunk_files(tmp_path / 'checkpoints' / '3' / 'arrays' / 'head')) == 4

  bad = PiecesEngine(full, pieces=[(0, 3), (3, 6), (6, 9)])  # column 9 never handed over
  with pytest.raises(ValueError, match=r"pieces of \['head'\] cover .* not \[0, 10\) exactly"):
    checkpointer.save(4, bad, data_position=6, model_cfg=CFG)
  with pytest.raises(ValueError, match=r'does not cover whole files of 3 indices'):
    checkpointer.save(4, PiecesEngine(full, pieces=[(0, 2)]), data_position=6, model_cfg=CFG)
  assert checkpointer.steps() == [3] and sorted(os.listdir(tmp_path / 'checkpoints')) == ['3']
  checkpointer.close()


def test_device_pieces_and_device_restore_are_bitwise(tmp_path, monkeypatch):
  """The accelerator paths, forced on CPU: pieces sliced on the device before the copy to host,
  and leaves rebuilt on the device by in-place (donated) updates, one file at a time."""
  from megatrain_jax import checkpoint  # pylint: disable=g-import-not-at-top
  from megatrain_jax.engine import resident  # pylint: disable=g-import-not-at-top
  tx, _, _ = make_tx(1.0)
  state = resident.init_state(CFG, tx, seed=3)
  calls = []
  for name in ('_device_rows', '_update_rows'):
    monkeypatch.setattr(checkpoint, name, lambda *a, f=getattr(checkpoint, name), n=name:
                        calls.append(n) or f(*a))
  for host_is_device in (True, False):
    monkeypatch.setattr(checkpoint, '_host_is_device', lambda _, v=host_is_device: v)
    checkpointer = Checkpointer(tmp_path / str(host_is_device), keep=1,
                                piece_mb=10 * 32 * 4 / 2**20)
    checkpointer.save(1, state, data_position=0, model_cfg=CFG)
    reader = checkpointer.restore(CFG)
    embed = reader.meta['arrays']["['params']['embed']['embedding']"]
    assert len(chunk_files(tmp_path / str(host_is_device) / 'checkpoints' / '1' /
                           embed['dir'])) == 10  # 97 rows of 32 floats in files of 10 rows
    got = reader.device_state(resident.abstract_state(CFG, tx))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, state)
    checkpointer.close()
    assert ('_device_rows' in calls and '_update_rows' in calls) == (not host_is_device), calls


def test_a_flipped_byte_in_an_array_is_detected_and_named(tmp_path, capfd):
  state = {'step': np.int32(2), 'params': {'w': np.arange(4000, dtype=np.float32).reshape(40, 100)}}
  checkpointer = Checkpointer(tmp_path, keep=3, piece_mb=4000 / 2**20)  # 10 rows per file
  checkpointer.save(2, state, data_position=0, model_cfg=CFG)
  checkpointer.wait()
  bad = tmp_path / 'checkpoints' / '2' / 'arrays' / 'params.w' / 'c' / '2' / '0'
  damage(bad, 'flip')
  capfd.readouterr()
  with pytest.raises(StoreCorruptionError, match=r'every checkpoint in .* is damaged \(steps 2;'):
    checkpointer.restore(CFG)
  err = capfd.readouterr().err
  assert f'checkpoint step 2 in {tmp_path / "checkpoints"} is damaged: {bad}: chunk (2, 0) of ' \
         'params.w fails its checksum' in err, err
  checkpointer.close()


def test_readers_of_the_weights_verify_the_weights_only(tmp_path, capfd):
  """read_checkpoint (--eval, --sample, --export_hf, init.from_run) verifies the params' chunks,
  not Adam's (2/3 of the bytes at scale): a flipped byte in Adam's state stops a resume, not a
  reader of the weights; one in the weights stops both."""
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=2)
  checkpointer.save(1, engine, data_position=1, model_cfg=CFG)
  checkpointer.close()
  arrays = tmp_path / 'checkpoints' / '1' / 'arrays'

  def chunk_of(pattern):
    return max((p for d in arrays.glob(pattern) for p in (d / 'c').rglob('*') if p.is_file()),
               key=lambda p: p.stat().st_size)

  damage(chunk_of('*mu*q_proj*'), 'flip')
  with checkpoint.read_checkpoint(tmp_path, CFG) as reader:
    assert reader.step == 1 and reader.read(LEAF).shape[0] == CFG.num_layers
  with pytest.raises(StoreCorruptionError):
    Checkpointer(tmp_path, keep=2).restore(CFG)
  damage(chunk_of("params*q_proj*"), 'flip')
  capfd.readouterr()
  with pytest.raises(StoreCorruptionError, match='every checkpoint in .* is damaged'):
    with checkpoint.read_checkpoint(tmp_path, CFG):
      pass
  assert 'q_proj' in capfd.readouterr().err


def test_a_checkpoint_of_a_newer_format_is_refused_by_name(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from megatrain_jax.checkpoint import CheckpointReader  # pylint: disable=g-import-not-at-top
  checkpointer = Checkpointer(tmp_path, keep=3)
  checkpointer.save(1, {'step': np.int32(1)}, data_position=0, model_cfg=CFG)
  checkpointer.wait()
  step_dir = tmp_path / 'checkpoints' / '1'
  meta = json.loads((step_dir / 'meta.json').read_text())
  (step_dir / 'meta.json').write_text(json.dumps(dict(meta, format=4)))
  rewrite_manifest(step_dir, lambda relative: True)
  with pytest.raises(ConfigError, match=r'is format 4, written by a newer megatrain_jax; this '
                                        r'version reads formats 2, 3'):
    checkpointer.restore(CFG)
  assert CheckpointReader(step_dir).format == 4
  checkpointer.close()


def test_manifest_and_meta_entries_naming_files_elsewhere_are_damage(tmp_path, monkeypatch):
  """A tampered manifest.json or meta.json named files outside the checkpoint: an entry
  '../../dev/zero' of size 0 passed the size check and its crc32 read forever (so would a
  FIFO's), an entry that is not an object raised a TypeError, and meta.json's array `dir` read
  another run's arrays. Each is damage naming the file (the previous checkpoint is tried)."""
  import json  # pylint: disable=g-import-not-at-top
  from megatrain_jax.checkpoint import CheckpointReader, DamagedCheckpoint  # pylint: disable=g-import-not-at-top
  checkpointer = Checkpointer(tmp_path, keep=3)
  state = {'step': np.int32(1), 'params': {'w': np.ones((4, 4), np.float32)}}
  checkpointer.save(1, state, data_position=0, model_cfg=CFG)
  checkpointer.close()
  step_dir = tmp_path / 'checkpoints' / '1'
  crc32 = checkpoint.fs.crc32

  def checked_crc32(path):  # the hang, as an error
    assert path.resolve().is_relative_to(step_dir) and path.is_file(), path
    return crc32(path)

  monkeypatch.setattr(checkpoint.fs, 'crc32', checked_crc32)
  os.mkfifo(step_dir / 'fifo')
  (step_dir / 'zero').symlink_to('/dev/zero')
  manifest = json.loads((step_dir / 'manifest.json').read_text())
  CheckpointReader(step_dir).verify_files()
  zero = {'size': 0, 'crc32': 1}
  for name, entry, match in (('../' * 8 + 'dev/zero', zero, r'manifest.json: lists a file '
                              r'outside the checkpoint \(.*absolute, or with "\.\."\)'),
                             ('/dev/zero', zero, 'lists a file outside the checkpoint'),
                             ('zero', zero, r'zero is a link to /dev/zero, outside'),
                             ('fifo', zero, 'fifo: not a regular file'),
                             ('params.w', [], r'manifest.json: unreadable \(not an object'),
                             ('params.w', {'crc32': 1}, 'manifest.json: unreadable')):
    (step_dir / 'manifest.json').write_text(json.dumps({**manifest, name: entry}))
    with pytest.raises(DamagedCheckpoint, match=match):
      CheckpointReader(step_dir).verify_files()
  (step_dir / 'manifest.json').write_text(json.dumps(manifest))
  meta = json.loads((step_dir / 'meta.json').read_text())
  leaf = next(iter(meta['arrays']))
  for elsewhere in ('../../../other/arrays/params.w', str(tmp_path / 'other')):
    arrays = {**meta['arrays'], leaf: {**meta['arrays'][leaf], 'dir': elsewhere}}
    (step_dir / 'meta.json').write_text(json.dumps({**meta, 'arrays': arrays}))
    with pytest.raises(DamagedCheckpoint, match='not a readable checkpoint meta.json'):
      CheckpointReader(step_dir)


# ------------------------------------------------------------------------------------------------
# Format 2 (orbax state/ of the in-memory leaves) still resumes.
# ------------------------------------------------------------------------------------------------

def rewrite_manifest(step_dir: pathlib.Path, has_crc) -> None:
  """manifest.json as the checkpointer writes it: sizes, and crc32s where `has_crc(relative)`."""
  import json  # pylint: disable=g-import-not-at-top
  from megatrain_jax import fs  # pylint: disable=g-import-not-at-top
  (step_dir / 'manifest.json').unlink()
  manifest = {}
  for path in sorted(p for p in step_dir.rglob('*') if p.is_file()):
    relative = str(path.relative_to(step_dir))
    manifest[relative] = {'size': path.stat().st_size}
    if has_crc(relative):
      manifest[relative]['crc32'] = fs.crc32(path)
  (step_dir / 'manifest.json').write_text(json.dumps(manifest))


def as_format_2(step_dir: pathlib.Path) -> None:
  """Rewrites a format-3 checkpoint as format 2 wrote it (megatrain_jax before issue 10): the
  in-memory leaves in an orbax PyTree checkpoint state/ {leaf name: array}, meta.json's `memory`
  {path: leaf name}, a crc32 in the manifest for every file but the NVMe chunk files."""
  import json  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from megatrain_jax import fs  # pylint: disable=g-import-not-at-top
  from megatrain_jax.checkpoint import CheckpointReader  # pylint: disable=g-import-not-at-top
  reader = CheckpointReader(step_dir)
  leaves = {fs.leaf_name(p): reader.read(p) for p in reader.meta['arrays']}
  ocp.PyTreeCheckpointer().save(step_dir / 'state', args=ocp.args.PyTreeSave(leaves))
  shutil.rmtree(step_dir / 'arrays')
  meta = dict(reader.meta, format=2, memory={p: fs.leaf_name(p) for p in reader.meta['arrays']})
  del meta['arrays']
  (step_dir / 'meta.json').write_text(json.dumps(meta, indent=1, sort_keys=True))
  rewrite_manifest(step_dir, lambda r: not (r.startswith('nvme/') and r.split('/')[2:3] == ['c']))


@pytest.mark.parametrize('placement', [RESIDENT, NVME], ids=['resident', 'nvme'])
def test_a_format_2_checkpoint_resumes_bitwise(tmp_path, tmp_path_factory, data, monkeypatch,
                                               placement):
  want = reference_rows(data, tmp_path_factory, **placement)
  run_until_crash(monkeypatch, config(data, **placement), tmp_path, crash_after_checkpoint=4)
  step_dir = tmp_path / 'checkpoints' / '4'
  as_format_2(step_dir)
  assert not (step_dir / 'arrays').exists() and (step_dir / 'state').is_dir()
  train.train_and_evaluate(config(data, **placement), str(tmp_path))
  assert_rows_match(tmp_path, want, 8, exact=True)
  from megatrain_jax.checkpoint import CheckpointReader  # pylint: disable=g-import-not-at-top
  assert CheckpointReader(tmp_path / 'checkpoints' / '8').format == 3  # the next one is format 3


def test_a_checkpoint_from_before_qk_norm_reads_as_without_it(tmp_path):
  """A meta.json written before model.qk_norm existed (no such key) restores as qk_norm=False, and
  --eval / --sample / --export_hf take the model shape from it (hf.model_fields)."""
  import json  # pylint: disable=g-import-not-at-top
  from megatrain_jax import hf  # pylint: disable=g-import-not-at-top
  engine, _, _ = streamed_run(1, 1.0, layers_per_group=2)
  checkpointer = Checkpointer(tmp_path, keep=1)
  checkpointer.save(1, engine, data_position=1, model_cfg=CFG)
  checkpointer.close()
  step_dir = tmp_path / 'checkpoints' / '1'
  meta = json.loads((step_dir / 'meta.json').read_text())
  del meta['model_config']['qk_norm']
  (step_dir / 'meta.json').write_text(json.dumps(meta))
  is_chunk = checkpoint._is_chunk_file  # pylint: disable=protected-access
  rewrite_manifest(step_dir, lambda relative: not is_chunk(relative))
  assert Checkpointer(tmp_path, keep=1).restore(CFG).step == 1
  assert hf.model_fields(meta['model_config'])['model.qk_norm'] is False
  with pytest.raises(ConfigError, match='model.qk_norm: checkpoint False, config True'):
    Checkpointer(tmp_path, keep=1).restore(CFG.replace(qk_norm=True, head_dim=8))
