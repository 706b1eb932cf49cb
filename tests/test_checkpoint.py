"""Checkpoints: NVMe snapshots without the state in RAM, portability between placements, crash
consistency of the live NVMe state, damaged checkpoints, and full disks."""

import os
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
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
                                             first, second, linked):
  """Losses within float32 rounding of an uninterrupted resident run (placements differ only in
  the order of float32 operations), at every step before and after the move."""
  want = reference_rows(data, tmp_path_factory)
  run_until_crash(monkeypatch, config(data, **first), tmp_path, crash_after_checkpoint=4)
  links = spy_on_linking(monkeypatch)
  train.train_and_evaluate(config(data, **second), str(tmp_path))
  assert links == linked
  assert_rows_match(tmp_path, want, 8, exact=False)


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


def orbax_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  """The largest file of the orbax part: array data."""
  return max((p for p in (step_dir / 'state').rglob('*') if p.is_file()),
             key=lambda p: p.stat().st_size)


def nvme_chunk_file(step_dir: pathlib.Path) -> pathlib.Path:
  array = step_dir / 'nvme' / 'opt_state.0.mu.layers.mlp.down_proj.kernel'
  return pathlib.Path(codecs.chunk_file(str(array), 1, 3))


@pytest.mark.parametrize('placement, how, bad_file', [
    (RESIDENT, 'flip', orbax_data_file),
    (RESIDENT, 'delete', orbax_data_file),
    (NVME, 'flip', nvme_chunk_file),
    (NVME, 'truncate', nvme_chunk_file),
    (NVME, 'delete', nvme_chunk_file),
    (NVME, 'flip', lambda d: d / 'meta.json'),
], ids=['orbax-flip', 'orbax-delete', 'nvme-flip', 'nvme-truncate', 'nvme-delete', 'meta-flip'])
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
  damage(orbax_data_file(tmp_path / 'checkpoints' / '4'), 'flip')
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
@pytest.mark.parametrize('placement', [RESIDENT, NVME], ids=['orbax', 'nvme-copy'])
# orbax's failed save leaves a callback for its closed event loop: noise, not an error
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
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


# ------------------------------------------------------------------------------------------------
# The up-front disk check counts what checkpoints pin.
# ------------------------------------------------------------------------------------------------

@AS_ROOT
def test_free_space_check_counts_kept_checkpoints(tmp_path):
  with tmpfs(8) as disk:  # 8 MiB; the stores need 3 MB
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=1)
    with pytest.raises(ConfigError, match=r'offload.dir=.*stores and their checkpoints need '
                                          r'0\.01 GB .*checkpoint.keep=3 pins one more copy.*'
                                          r'lower checkpoint.keep'):
      nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=3)
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=disk / 'run', keep=0)
    # checkpoints on another filesystem are copies of a staging snapshot in offload.dir
    with pytest.raises(ConfigError, match=r'offload.dir=.*stores need 0\.01 GB .*5\.00 MB|'
                                          r'offload.dir=.*stores need 0\.01 GB .*0\.01 GB live, '
                                          r'and as much for the snapshot a checkpoint copies'):
      nvme.check_offload_dir(str(disk / 'offload'), 5_000_000, checkpoint_dir=tmp_path, keep=1)
    nvme.check_offload_dir(str(disk / 'offload'), 3_000_000, checkpoint_dir=tmp_path, keep=1)
    # ... and kept + 1 being written must fit where the checkpoints are
    with pytest.raises(ConfigError, match=r'checkpoint.keep=3: .*cannot be hard links.*need '
                                          r'0\.01 GB \(3 kept \+ 1 being written\)'):
      nvme.check_offload_dir(str(tmp_path), 3_000_000, checkpoint_dir=disk / 'run', keep=3)


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
