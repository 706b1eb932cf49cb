"""Token shards: writing them resumably, and reading a split that spans several of them.

A stream (the tokens of `data.path`, or of `data.val_path`) is written as shards
`<stream>-00000.bin`, `<stream>-00001.bin`, ... of at most `shard_tokens` little-endian ids each,
and, for a shard holding a token that is not learned, a loss mask `<stream>-00000.mask` (one
uint8 per token, 1 = learned). Each shard is written to a hidden temp file and renamed into place
once complete and fsynced; then `prepare.json` (atomically replaced) records it, with the input
position (task index, tokens of that task already stored) the next shard starts from. A prepare
killed at any point resumes from the last recorded shard and rewrites the same bytes.
"""

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megatrain_jax import fs

PROGRESS_FILE = 'prepare.json'
_ONES = np.ones(1 << 20, dtype=np.uint8)


def shard_name(stream: str, index: int, suffix: str = 'bin') -> str:
  return f'{stream}-{index:05d}.{suffix}'


def read_progress(out_dir: Path, fingerprint: str) -> dict[str, Any]:
  """The recorded progress of an interrupted prepare of the same data, with every shard it lists
  checked to exist with its size (the list is cut at the first that does not); {} if none."""
  try:
    progress = json.loads((out_dir / PROGRESS_FILE).read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return {}
  if not isinstance(progress, dict) or progress.get('fingerprint') != fingerprint:
    return {}
  itemsize = np.dtype(progress.get('dtype', 'uint16')).itemsize
  for state in progress.get('streams', {}).values():
    good = []
    for shard in state.get('shards', []):
      if not _shard_complete(out_dir, shard, itemsize):
        state['done'] = False
        break
      good.append(shard)
    state['shards'] = good
  return progress


def _shard_complete(out_dir: Path, shard: dict[str, Any], itemsize: int) -> bool:
  try:
    if (out_dir / shard['file']).stat().st_size != shard['tokens'] * itemsize:
      return False
    return shard['mask'] is None or (out_dir / shard['mask']).stat().st_size == shard['tokens']
  except (OSError, KeyError, TypeError):
    return False


class ShardWriter:
  """Appends tokens (and masks) of one stream into shards, committing each when full.

  Attributes:
    shards: The committed shards: {'file', 'mask' (name or None), 'tokens', 'next': [task,
      skip], 'documents', 'skipped'}.
    resume: (task index, tokens of that task already stored) to continue from.
  """

  def __init__(self, out_dir: Path, stream: str, dtype: str, shard_tokens: int,
               state: dict[str, Any], on_commit):
    self._dir, self._stream = out_dir, stream
    self._stored = np.dtype(dtype).newbyteorder('<')
    self._shard_tokens = shard_tokens
    self._on_commit = on_commit  # called after each committed shard (records the progress)
    self.shards: list[dict[str, Any]] = list(state.get('shards', []))
    last = self.shards[-1] if self.shards else None
    self.resume = tuple(last['next']) if last else (0, 0)
    self.documents = last['documents'] if last else 0
    self.skipped = last['skipped'] if last else 0
    self.tokens = sum(s['tokens'] for s in self.shards)
    self._file = self._mask = None
    self._tmp = self._mask_tmp = None
    self._count = 0

  def _open(self) -> None:
    index = len(self.shards)
    self._tmp = fs.new_temp(self._dir, shard_name(self._stream, index))
    self._file = open(self._tmp, 'wb')
    self._count = 0

  def _open_mask(self) -> None:
    """Starts the shard's mask at its first unlearned token: the tokens before it are learned."""
    self._mask_tmp = fs.new_temp(self._dir, shard_name(self._stream, len(self.shards), 'mask'))
    self._mask = open(self._mask_tmp, 'wb')
    left = self._count
    while left:
      n = min(left, _ONES.size)
      self._mask.write(_ONES[:n].tobytes())
      left -= n

  def write(self, tokens: np.ndarray, mask: np.ndarray | None, task: int, skip: int,
            documents: int, skipped: int) -> None:
    """Stores task `task`'s tokens from its `skip`-th on; `documents`/`skipped` count the task's
    records (added once the whole task is stored)."""
    done = skip
    while done < len(tokens):
      if self._file is None:
        self._open()
      n = min(len(tokens) - done, self._shard_tokens - self._count)
      piece_mask = None if mask is None else mask[done:done + n]
      if self._mask is None and piece_mask is not None and not piece_mask.all():
        self._open_mask()
      self._file.write(tokens[done:done + n].astype(self._stored, copy=False).tobytes())
      if self._mask is not None:
        self._mask.write((_ONES[:n] if piece_mask is None else piece_mask).tobytes())
      self._count += n
      done += n
      if self._count == self._shard_tokens:
        finished = done == len(tokens)
        counts = (documents, skipped) if finished else (0, 0)
        self._commit((task + 1, 0) if finished else (task, done), *counts)
        if finished:
          return
    self.documents += documents
    self.skipped += skipped

  def _commit(self, next_pos: tuple[int, int], documents: int, skipped: int) -> None:
    index = len(self.shards)
    name, mask_name = shard_name(self._stream, index), None
    _close_durably(self._file)
    os.replace(self._tmp, self._dir / name)
    if self._mask is not None:
      mask_name = shard_name(self._stream, index, 'mask')
      _close_durably(self._mask)
      os.replace(self._mask_tmp, self._dir / mask_name)
    fs.fsync(self._dir, directory=True)
    self.documents += documents
    self.skipped += skipped
    self.tokens += self._count
    self.shards.append({'file': name, 'mask': mask_name, 'tokens': self._count,
                        'next': list(next_pos), 'documents': self.documents,
                        'skipped': self.skipped})
    self._file = self._mask = self._tmp = self._mask_tmp = None
    self._count = 0
    self._on_commit()

  def finish(self, tasks: int) -> None:
    """Commits the last, partial shard (the stream ended after `tasks` tasks)."""
    if self._file is not None:
      self._commit((tasks, 0), 0, 0)

  def abort(self) -> None:
    """Removes the shard being written (after an error)."""
    for handle, path in ((self._file, self._tmp), (self._mask, self._mask_tmp)):
      if handle is not None:
        handle.close()
        path.unlink(missing_ok=True)
    self._file = self._mask = None


def _close_durably(f) -> None:
  f.flush()
  os.fsync(f.fileno())
  f.close()


# --- reading --------------------------------------------------------------------------------------

# A piece of a split: (token file, mask file or None, first token, token count), files absolute.
Segment = tuple[str, str | None, int, int]


def split_segments(shards: Sequence[dict[str, Any]], start: int, stop: int) -> list[Segment]:
  """The segments covering tokens [start, stop) of a stream of `shards` (names relative)."""
  out, offset = [], 0
  for shard in shards:
    lo, hi = max(start, offset), min(stop, offset + shard['tokens'])
    if lo < hi:
      out.append((shard['file'], shard['mask'], lo - offset, hi - lo))
    offset += shard['tokens']
  return out


def memmap(path: Path, dtype: str) -> np.ndarray:
  stored = np.dtype(dtype).newbyteorder('<')
  # mmap cannot map an empty file; an empty split is legal here and rejected by the samplers.
  if Path(path).stat().st_size == 0:
    return np.empty(0, dtype=stored)
  return np.memmap(path, dtype=stored, mode='r')


class TokenStream:
  """One split as a 1-D array-like over one or more shard segments, with its loss mask.

  Supports `len`, integer-array and slice indexing (returning plain arrays), `np.asarray`.

  Attributes:
    dtype: The stored dtype.
    has_mask: Whether any segment has a loss mask (segments without one are all learned).
  """

  def __init__(self, segments: Sequence[Segment], dtype: str):
    self.dtype = np.dtype(dtype).newbyteorder('<')
    self._parts = [memmap(Path(f), dtype)[s:s + n] for f, _, s, n in segments]
    self._masks = [None if m is None else memmap(Path(m), 'uint8')[s:s + n]
                   for _, m, s, n in segments]
    self.has_mask = any(m is not None for m in self._masks)
    self._starts = np.cumsum([0] + [n for *_, n in segments])
    self._len = int(self._starts[-1])

  def __len__(self) -> int:
    return self._len

  def _gather(self, parts, index, dtype, fill) -> np.ndarray:
    index = np.asarray(index, dtype=np.int64)
    if index.size and (index.min() < 0 or index.max() >= self._len):
      raise IndexError(f'token index out of range [0, {self._len})')
    out = np.empty(index.shape, dtype=dtype)
    which = np.searchsorted(self._starts, index, side='right') - 1
    for k in np.unique(which):
      sel = which == k
      out[sel] = fill if parts[k] is None else parts[k][index[sel] - self._starts[k]]
    return out

  def __getitem__(self, index) -> np.ndarray:
    if isinstance(index, slice):
      index = np.arange(*index.indices(self._len))
    return self._gather(self._parts, index, self.dtype, 0)

  def mask(self, index) -> np.ndarray:
    """The loss mask (uint8, 1 = learned) at `index` (an int array or slice)."""
    if isinstance(index, slice):
      index = np.arange(*index.indices(self._len))
    return self._gather(self._masks, index, np.uint8, 1)

  def __array__(self, dtype=None, copy=None):
    del copy
    return self[:].astype(dtype) if dtype is not None else self[:]
