"""Checkpoints in <workdir>/checkpoints/<step>/: one format for every placement, streamed for NVMe.

A checkpoint holds the full train state as the resident engine shapes it ({'step', 'params',
'opt_state', 'rng'}, layer leaves stacked [L, ...]); every leaf is addressed by its tree path in
that state, so a checkpoint written under any placement restores under any other. Layout:

  meta.json      step, data_position, seed, model_config, placement, and for each leaf path where
                 it is: `memory` (a name in state/) or `disk` (a directory in nvme/)
  state/         orbax PyTree checkpoint of the leaves that were in memory, flat {name: array}: the
                 whole state for resident and host runs; for NVMe runs the embedding/head and their
                 Adam state, step counts, rng, and any layers kept on host or device
  nvme/<leaf>/   NVMe runs: each disk-resident layer leaf as the live store's zarr3 array [L, ...]
                 (one file per layer): hard links to the live files, or copies where links fail
  manifest.json  the size of every file, and a crc32 of every file except the zarr chunk files
                 (those carry a crc32c per inner chunk, verified on read). Orbax verifies nothing:
                 a flipped byte in its array data restores silently as a wrong number (tested with
                 orbax-checkpoint 0.12.8), hence the manifest.

Why a hard-link snapshot of the live NVMe store is a consistent checkpoint: TensorStore's file
kvstore never modifies a file in place; it writes `<file>.__lock` and renames it over `<file>`
(seen with strace, tensorstore 0.1.86). Once the write-behind queue is flushed at a step boundary,
linking the live files captures exactly that step, and later writes replace the live directory
entries, never the linked inodes. A snapshot costs metadata operations only: no data is read or
written and no RAM is needed, whatever the model size. Each kept checkpoint pins one full copy of
the NVMe state once the live store has rewritten every layer (the trainer's up-front disk check
counts it). When offload.dir is on another filesystem than the workdir (os.link would fail with
EXDEV), the snapshot is linked into offload.dir/.checkpoint-snapshot-<step> instead, and copied
into the checkpoint on the background thread (training goes on; the staging links pin the old
files until the copy is done, so offload.dir then needs room for a second copy). Restore is the
mirror image: the snapshot's files are linked (or copied) into a fresh live store, which is safe
for the same reason.

Commit: a checkpoint is written into checkpoints/.tmp-<step>, its files fsynced, then renamed to
<step> and the parent directory fsynced, so a checkpoint is complete or ignored (leftover .tmp
directories are deleted). The in-memory leaves are copied to host numpy before `save` returns;
writing them, the manifest and the commit run on a background thread while training continues
(the next save, `wait` and `close` wait for it and raise its error). The oldest checkpoints beyond
`keep` are deleted only after a new one is committed.

Restore takes the newest checkpoint that verifies: manifest (every file present, sizes, crc32s),
the orbax restore, and a read of every NVMe layer (its crc32c). A damaged one is reported with a
warning naming its step and the bad file, and the next older one is tried; if none is intact the
error names the directory and the fix.
"""

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from megatrain_jax import faults
from megatrain_jax import fs
from megatrain_jax import partition
from megatrain_jax.errors import ConfigError, DiskFullError, StoreCorruptionError
from megatrain_jax.model import ModelConfig
from megatrain_jax.tiers import codecs

FORMAT = 2
_TMP_PREFIX = '.tmp-'
_SNAPSHOT_PREFIX = '.checkpoint-snapshot-'  # in offload.dir, when the workdir is elsewhere
_SHAPE_FIELDS = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'd_ff',
                 'head_dim', 'qkv_bias', 'tie_embeddings')


def _host_copy(x) -> np.ndarray:
  """An owned numpy copy: np.asarray of a CPU jax array can alias a buffer the next step donates."""
  return np.array(x, copy=True)


def _is_chunk_file(relative: str) -> bool:
  """zarr3 chunk files (nvme/<leaf>/c/...): integrity comes from their own crc32c."""
  parts = relative.split('/')
  return len(parts) > 3 and parts[0] == 'nvme' and parts[2] == 'c'


class DamagedCheckpoint(Exception):
  """A checkpoint that cannot be used: `file` is the first bad file found, `reason` why."""

  def __init__(self, file, reason: str):
    super().__init__(f'{file}: {reason}')
    self.file, self.reason = file, reason


class CheckpointReader:
  """One committed checkpoint: its meta, its in-memory leaves, and layer-by-layer disk reads."""

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    meta_file = directory / 'meta.json'
    if not meta_file.exists() and (directory / 'meta').is_dir():
      raise DamagedCheckpoint(directory, 'written in the layout of earlier versions (an orbax '
                              'CheckpointManager step, no meta.json), which this version does not '
                              'read')
    try:
      self.meta = json.loads(meta_file.read_text())
      self.step = int(self.meta['step'])
      self._memory_names = dict(self.meta['memory'])
      self._disk_names = dict(self.meta['disk'])
    except (OSError, ValueError, KeyError, TypeError) as error:
      raise DamagedCheckpoint(meta_file,
                              f'not a readable checkpoint meta.json ({error})') from error
    self._memory = None
    self._disk = {}
    self._context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})

  def check_model(self, model_cfg: ModelConfig) -> None:
    saved, current = self.meta['model_config'], dataclasses.asdict(model_cfg)
    changed = [f'model.{k}: checkpoint {saved.get(k)!r}, config {current[k]!r}'
               for k in _SHAPE_FIELDS if saved.get(k) != current[k]]
    if changed:
      raise ConfigError(f'the checkpoint at {self.directory} was written for other model shapes '
                        f'({"; ".join(changed)}). Use the config it was trained with, or a new '
                        '--workdir to start fresh.')

  def verify(self) -> None:
    """Raises DamagedCheckpoint naming the first bad file; loads the in-memory leaves."""
    manifest_file = self.directory / 'manifest.json'
    try:
      manifest = json.loads(manifest_file.read_text())
    except (OSError, ValueError) as error:
      raise DamagedCheckpoint(manifest_file, f'unreadable ({error})') from error
    for relative, entry in sorted(manifest.items()):
      path = self.directory / relative
      try:
        size = path.stat().st_size
      except OSError:
        raise DamagedCheckpoint(path, 'missing') from None
      if size != entry['size']:
        raise DamagedCheckpoint(path, f'{size} bytes, {entry["size"]} when written (truncated?)')
      if 'crc32' in entry and fs.crc32(path) != entry['crc32']:
        raise DamagedCheckpoint(path, 'crc32 differs from when it was written (bit rot?)')
    try:
      restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray)
                      for name in self._memory_names.values()}
      self._memory = ocp.PyTreeCheckpointer().restore(
          self.directory / 'state', args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as error:  # pylint: disable=broad-except  orbax raises many types
      raise DamagedCheckpoint(self.directory / 'state',
                              f'orbax restore failed ({error})') from error
    for path, name in self._disk_names.items():
      array = self._open(path)
      for layer in range(array.shape[0]):  # one layer at a time: bounded RAM
        try:
          array[layer:layer + 1].read().result()
        except ValueError as error:
          raise DamagedCheckpoint(codecs.chunk_file(str(self.directory / name), layer, array.ndim),
                                  f'layer {layer} of {name} fails its checksum or is missing '
                                  f'({error})') from error

  def _open(self, path: str) -> ts.TensorStore:
    if path not in self._disk:
      spec = {'driver': 'zarr3', 'fill_missing_data_reads': False,
              'kvstore': {'driver': 'file', 'path': str(self.directory / self._disk_names[path])}}
      try:
        self._disk[path] = ts.open(spec, open=True, read=True, context=self._context).result()
      except ValueError as error:
        raise DamagedCheckpoint(self.directory / self._disk_names[path] / 'zarr.json',
                                f'cannot open the array ({error})') from error
    return self._disk[path]

  def snapshot_dir(self, path: str) -> pathlib.Path | None:
    """The zarr3 array directory of a disk-resident leaf, or None if the leaf is in state/."""
    name = self._disk_names.get(path)
    return None if name is None else self.directory / name

  def read(self, path: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """Leaf `path` of the full state (layers [start:stop] of a stacked leaf), as host numpy."""
    if path not in self._memory_names and path not in self._disk_names:
      raise ConfigError(f'the checkpoint at {self.directory} has no leaf {path}: it was written '
                        'for another model or optimizer structure. Use the config it was trained '
                        'with, or a new --workdir to start fresh.')
    if path in self._memory_names:
      leaf = self._memory[self._memory_names[path]]
      return leaf if start is None else leaf[start:stop]
    array = self._open(path)
    start, stop = (0, array.shape[0]) if start is None else (start, stop)
    out = np.empty((stop - start, *array.shape[1:]), array.dtype.numpy_dtype)
    for layer in range(start, stop):  # layer by layer: no second whole-array buffer
      out[layer - start] = array[layer].read().result()
    return out

  def full_state(self, abstract_state):
    """The whole state as host numpy arrays shaped like `abstract_state` (resident layout)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: self.read(jax.tree_util.keystr(p)), abstract_state)


def _engine_parts(engine_or_state) -> tuple[dict, dict]:
  """({path: host copy} of in-memory leaves, {path: live zarr array dir} of disk leaves)."""
  if hasattr(engine_or_state, 'checkpoint_parts'):
    return engine_or_state.checkpoint_parts()
  if hasattr(engine_or_state, 'export_state'):
    engine_or_state = engine_or_state.export_state()
  return {p: _host_copy(x) for p, x in partition.by_path(engine_or_state).items()}, {}


class Checkpointer:
  """Saves and restores train states in `<workdir>/checkpoints`, keeping the `keep` newest."""

  def __init__(self, workdir: pathlib.Path, keep: int):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.keep = keep
    self._committer = concurrent.futures.ThreadPoolExecutor(1, 'checkpoint-commit')
    self._pending = None
    if self.directory.is_dir():  # a save interrupted before its commit: never a checkpoint
      for leftover in self.directory.glob(_TMP_PREFIX + '*'):
        shutil.rmtree(leftover, ignore_errors=True)

  def steps(self) -> list[int]:
    """Committed checkpoints, oldest first."""
    if not self.directory.is_dir():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

  def latest_step(self) -> int | None:
    self.wait()
    steps = self.steps()
    return steps[-1] if steps else None

  # --- saving ----------------------------------------------------------------------------------

  def save(self, step: int, engine, *, data_position: int, model_cfg: ModelConfig, seed: int = 0,
           placement=None, microbatches: int | None = None) -> None:
    """Checkpoints `engine` (or a full state dict) at `step`. Returns once the state may change:
    in-memory leaves copied to host, NVMe files linked (or copied); the rest is written behind."""
    self.wait()  # one checkpoint in flight; raises the previous one's error
    memory, disk = _engine_parts(engine)
    names = [fs.leaf_name(p) for p in [*memory, *disk]]
    if len(set(names)) != len(names):  # never expected: tree paths map to distinct names
      raise ValueError(f'two state leaves share a checkpoint file name: {sorted(names)}')
    tmp = self.directory / f'{_TMP_PREFIX}{step}'
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {'format': FORMAT, 'step': step, 'data_position': int(data_position), 'seed': seed,
            'model_config': dataclasses.asdict(model_cfg),
            'placement': dataclasses.asdict(placement) if placement is not None else None,
            'microbatches': microbatches,
            'memory': {p: fs.leaf_name(p) for p in memory},
            'disk': {p: f'nvme/{fs.leaf_name(p)}' for p in disk}}
    needed = sum(x.nbytes for x in memory.values())
    copies = {}  # staging snapshot on offload.dir's filesystem -> its place in the checkpoint
    try:
      for path, live in disk.items():
        live = pathlib.Path(live)
        if os.stat(live).st_dev == os.stat(tmp).st_dev:
          fs.link_tree(live, tmp / meta['disk'][path])
          continue
        # Another filesystem (EXDEV): snapshot by links beside the live store now, copy it into
        # the checkpoint on the background thread while training goes on.
        staging = live.parent.parent / f'{_SNAPSHOT_PREFIX}{step}'
        if not copies:
          for stale in live.parent.parent.glob(_SNAPSHOT_PREFIX + '*'):  # of a killed run
            shutil.rmtree(stale, ignore_errors=True)
        fs.link_tree(live, staging / fs.leaf_name(path))
        copies[staging / fs.leaf_name(path)] = tmp / meta['disk'][path]
    except OSError as error:
      shutil.rmtree(tmp, ignore_errors=True)
      _remove_staging(copies)
      self._raise_disk_full(step, error, needed + sum(_tree_bytes(d) for d in disk.values()))
      raise
    needed += sum(_tree_bytes(d) for d in copies)
    self._pending = self._committer.submit(self._write_and_commit, step, tmp, meta, memory, needed,
                                           copies)
    faults.point('checkpoint')  # files being written in the background, nothing committed

  def _write_and_commit(self, step: int, tmp: pathlib.Path, meta: dict, memory: dict,
                        needed: int, copies: dict) -> None:
    try:
      for staging, dest in copies.items():
        fs.link_tree(staging, dest)  # copies: another filesystem
      _remove_staging(copies)
      ocp.PyTreeCheckpointer().save(tmp / 'state', args=ocp.args.PyTreeSave(
          {meta['memory'][p]: x for p, x in memory.items()}))
      faults.point('checkpoint')  # kill -9 tests: state/ written, nothing committed
      (tmp / 'meta.json').write_text(json.dumps(meta, indent=1, sort_keys=True))
      manifest = {}
      for root, _, files in os.walk(tmp):
        for name in files:
          path = pathlib.Path(root) / name
          relative = str(path.relative_to(tmp))
          entry = {'size': path.stat().st_size}
          if not _is_chunk_file(relative):
            entry['crc32'] = fs.crc32(path)
          manifest[relative] = entry
          fs.fsync(path)  # linked chunk files too: their data must be on disk before the commit
      (tmp / 'manifest.json').write_text(json.dumps(manifest, indent=0, sort_keys=True))
      fs.fsync(tmp / 'manifest.json')
      for root, _, _ in os.walk(tmp):
        fs.fsync(pathlib.Path(root), directory=True)
    except BaseException as error:
      shutil.rmtree(tmp, ignore_errors=True)
      _remove_staging(copies)
      self._raise_disk_full(step, error, needed)
      raise
    final = self.directory / str(step)
    if final.exists():  # a damaged checkpoint of this step that the run fell back past
      stale = self.directory / f'{_TMP_PREFIX}stale-{step}'
      os.rename(final, stale)
      shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
    fs.fsync(self.directory, directory=True)
    for old in self.steps()[:-self.keep]:  # only now that the new one is complete
      doomed = self.directory / f'{_TMP_PREFIX}delete-{old}'  # a kill mid-delete leaves no
      os.rename(self.directory / str(old), doomed)            # half checkpoint behind
      shutil.rmtree(doomed, ignore_errors=True)

  def _raise_disk_full(self, step: int, error: BaseException, needed: int) -> None:
    """Raises DiskFullError (naming the directory, the bytes and the fix) if `error` is ENOSPC."""
    if not fs.is_disk_full(error):
      return
    steps = [s for s in self.steps() if s != step]
    previous = (f'The previous checkpoint (step {steps[-1]}) is intact: a rerun with the same '
                '--workdir resumes from it.' if steps else 'No earlier checkpoint exists.')
    free = shutil.disk_usage(self.directory).free
    raise DiskFullError(
        f'checkpoint step {step}: the disk holding {self.directory} is full (the checkpoint needs '
        f'about {fs.human_bytes(needed)}, {fs.human_bytes(free)} are free). {previous} Free space '
        'there, lower checkpoint.keep, or use a --workdir on a larger disk.') from error

  def wait(self) -> None:
    """Waits for the checkpoint being written; raises its error (DiskFullError when full)."""
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._committer.shutdown(wait=True)

  # --- restoring -------------------------------------------------------------------------------

  def restore(self, model_cfg: ModelConfig) -> CheckpointReader | None:
    """The newest intact checkpoint (verified), or None if there is none. A damaged one is
    reported on stderr and skipped; a checkpoint of other model shapes is a ConfigError."""
    self.wait()
    steps = self.steps()
    damaged = []
    for step in reversed(steps):
      try:
        reader = CheckpointReader(self.directory / str(step))
        reader.check_model(model_cfg)
        reader.verify()
        return reader
      except DamagedCheckpoint as error:
        damaged.append(step)
        older = [s for s in steps if s < step]
        then = (f'trying the previous one (step {older[-1]})' if older else 'no older one is left')
        print(f'warning: checkpoint step {step} in {self.directory} is damaged: {error.file}: '
              f'{error.reason}; {then}.', file=sys.stderr, flush=True)
    if damaged:
      raise StoreCorruptionError(
          f'every checkpoint in {self.directory} is damaged (steps '
          f'{", ".join(map(str, sorted(damaged)))}; see the warnings above for the bad files). '
          f'Delete {self.directory} to start training from scratch, or use a new --workdir.')
    return None


def _remove_staging(copies: dict) -> None:
  for staging_root in {p.parent for p in copies}:
    shutil.rmtree(staging_root, ignore_errors=True)


def _tree_bytes(directory) -> int:
  return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)
