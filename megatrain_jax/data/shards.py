"""Token shards: writing them resumably, and reading a split that spans several of them.

A stream (the tokens of `data.path`, or of `data.val_path`) is written as shards
`<stream>-00000.bin`, `<stream>-00001.bin`, ... of at most `shard_tokens` little-endian ids each,
and, for a shard holding a token that is not learned, a loss mask `<stream>-00000.mask` (one
uint8 per token, 1 = learned). A stream of documents (records, or text files with
data.text_documents) also records where each document ends: `<stream>-00000.ends`, the offsets
in the shard just past each document's last token (little-endian int64, increasing; a document
that goes on into the next shard ends there), so that documents are known as they were, not by
an id that may also occur inside them. Each shard is written to a hidden temp file and renamed
into place once complete and fsynced; then `prepare.json` (atomically replaced) records it, with
the input position (task index, tokens of that task already stored) the next shard starts from.
A prepare killed at any point resumes from the last recorded shard and rewrites the same bytes.
"""

import json
import os
from pathlib import Path
import threading
from typing import Any, Sequence
import zlib

import numpy as np

from megatrain_jax import fs
from megatrain_jax.errors import ConfigError, StoreCorruptionError

PROGRESS_FILE = 'prepare.json'
_ONES = np.ones(1 << 20, dtype=np.uint8)


def shard_name(stream: str, index: int, suffix: str = 'bin') -> str:
  return f'{stream}-{index:05d}.{suffix}'


def ends_name(token_file: str) -> str:
  """The document ends file of a shard's token file (`train-00000.bin` -> `train-00000.ends`)."""
  return str(Path(token_file).with_suffix('.ends'))


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
    if shard.get('ends') is not None and (
        (out_dir / shard['ends']).stat().st_size != 8 * shard['ends_count']):
      return False
    return shard['mask'] is None or (out_dir / shard['mask']).stat().st_size == shard['tokens']
  except (OSError, KeyError, TypeError):
    return False


class ShardWriter:
  """Appends tokens (and masks) of one stream into shards, committing each when full.

  Attributes:
    shards: The committed shards: {'file', 'mask' (name or None), 'tokens', 'next': [task,
      skip], 'documents', 'skipped', 'crc32': {file name: crc32 of its bytes}}, and with
      `record_ends` 'ends' (name) and 'ends_count'.
    resume: (task index, tokens of that task already stored) to continue from.
  """

  def __init__(self, out_dir: Path, stream: str, dtype: str, shard_tokens: int,
               state: dict[str, Any], on_commit, record_ends: bool = False):
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
    self._record_ends = record_ends
    self._file = self._mask = self._ends = None
    self._tmp = self._mask_tmp = self._ends_tmp = None
    self._count = self._ends_count = 0
    self._crc = {}  # handle -> crc32 of the bytes written so far: the shard's checksums

  def _put(self, handle, data: bytes) -> None:
    """Writes `data` to one of the shard's files, keeping its crc32 (ShardVerifier)."""
    handle.write(data)
    self._crc[handle] = zlib.crc32(data, self._crc.get(handle, 0))

  def _open(self) -> None:
    index = len(self.shards)
    self._tmp = fs.new_temp(self._dir, shard_name(self._stream, index))
    self._file = open(self._tmp, 'wb')
    self._count = self._ends_count = 0
    if self._record_ends:
      self._ends_tmp = fs.new_temp(self._dir, shard_name(self._stream, index, 'ends'))
      self._ends = open(self._ends_tmp, 'wb')

  def _open_mask(self) -> None:
    """Starts the shard's mask at its first unlearned token: the tokens before it are learned."""
    self._mask_tmp = fs.new_temp(self._dir, shard_name(self._stream, len(self.shards), 'mask'))
    self._mask = open(self._mask_tmp, 'wb')
    left = self._count
    while left:
      n = min(left, _ONES.size)
      self._put(self._mask, _ONES[:n].tobytes())
      left -= n

  def write(self, tokens: np.ndarray, mask: np.ndarray | None, task: int, skip: int,
            documents: int, skipped: int, ends: np.ndarray | None = None) -> None:
    """Stores task `task`'s tokens from its `skip`-th on (`ends`: where its documents end in
    `tokens`, None: none does); `documents`/`skipped` count the task's records (added once the
    whole task is stored)."""
    with fs.naming(self._dir / shard_name(self._stream, len(self.shards))):  # a full disk
      self._write(tokens, mask, task, skip, documents, skipped, ends)

  def _write(self, tokens, mask, task, skip, documents, skipped, ends) -> None:
    done = skip
    while done < len(tokens):
      if self._file is None:
        self._open()
      n = min(len(tokens) - done, self._shard_tokens - self._count)
      piece_mask = None if mask is None else mask[done:done + n]
      if self._mask is None and piece_mask is not None and not piece_mask.all():
        self._open_mask()
      self._put(self._file, tokens[done:done + n].astype(self._stored, copy=False).tobytes())
      if self._mask is not None:
        self._put(self._mask, (_ONES[:n] if piece_mask is None else piece_mask).tobytes())
      if self._ends is not None and ends is not None:  # those in (done, done + n], shard-local
        inside = ends[(ends > done) & (ends <= done + n)]
        self._put(self._ends, (inside - done + self._count).astype('<i8').tobytes())
        self._ends_count += inside.size
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
    crc32 = {name: self._crc.get(self._file, 0)}
    _close_durably(self._file)
    os.replace(self._tmp, self._dir / name)
    if self._mask is not None:
      mask_name = shard_name(self._stream, index, 'mask')
      crc32[mask_name] = self._crc.get(self._mask, 0)
      _close_durably(self._mask)
      os.replace(self._mask_tmp, self._dir / mask_name)
    recorded = {}
    if self._ends is not None:
      recorded = {'ends': shard_name(self._stream, index, 'ends'), 'ends_count': self._ends_count}
      crc32[recorded['ends']] = self._crc.get(self._ends, 0)
      _close_durably(self._ends)
      os.replace(self._ends_tmp, self._dir / recorded['ends'])
    fs.fsync(self._dir, directory=True)
    self.documents += documents
    self.skipped += skipped
    self.tokens += self._count
    self.shards.append({'file': name, 'mask': mask_name, 'tokens': self._count,
                        'next': list(next_pos), 'documents': self.documents,
                        'skipped': self.skipped, 'crc32': crc32, **recorded})
    self._crc = {}
    self._file = self._mask = self._ends = self._tmp = self._mask_tmp = self._ends_tmp = None
    self._count = self._ends_count = 0
    self._on_commit()

  def finish(self, tasks: int) -> None:
    """Commits the last, partial shard (the stream ended after `tasks` tasks)."""
    if self._file is not None:
      self._commit((tasks, 0), 0, 0)

  def abort(self) -> None:
    """Removes the shard being written (after an error)."""
    for handle, path in ((self._file, self._tmp), (self._mask, self._mask_tmp),
                         (self._ends, self._ends_tmp)):
      if handle is not None:
        handle.close()
        path.unlink(missing_ok=True)
    self._file = self._mask = self._ends = None
    self._crc = {}


def _close_durably(f) -> None:
  f.flush()
  os.fsync(f.fileno())
  f.close()


# --- reading --------------------------------------------------------------------------------------

# A piece of a split: (token file, mask file or None, first token, token count), files absolute.
Segment = tuple[str, str | None, int, int]


class ShardVerifier:
  """Reads every token, mask and ends file of a prepared dataset whose crc32 the prepare step
  recorded (`checksums`: {path: crc32}), on a thread of its own, and compares: a damaged file (a
  flipped bit, a file replaced) trained silently on other tokens. `check` raises
  StoreCorruptionError naming the first bad file once it is found (`wait`: once every file is
  read). A run checks before each checkpoint and waits before its last: fine-tuning data is read
  long before the first; a corpus too large for that is read beside the steps."""

  def __init__(self, checksums: dict[str, int], directory: Path):
    self._checksums, self._directory = dict(checksums), directory
    self._bad: tuple[str, str] | None = None
    self._thread = threading.Thread(target=self._verify, name='shard-verify', daemon=True)
    self._thread.start()

  def _verify(self) -> None:
    for path, want in self._checksums.items():
      try:
        got = fs.crc32(Path(path))
      except OSError as error:
        self._bad = (path, f'unreadable: {error.strerror}')
        return
      if got != want:
        self._bad = (path, f'its crc32 is {got:08x}, the prepare step wrote {want:08x}')
        return

  def check(self, wait: bool = True) -> None:
    if wait:
      self._thread.join()
    if self._bad is not None:
      path, reason = self._bad
      raise StoreCorruptionError(
          f'prepared data {path} is damaged ({reason}): the batches read from it are not the '
          f'data as prepared. Delete {self._directory} and prepare it again (a run prepares '
          'its data.cache_dir itself; a prepared data.path with --prepare), then rerun the same '
          'command: the run resumes from its last checkpoint, written before this start.')


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


def _read_ends(path: Path, tokens: int) -> np.ndarray:
  """A shard's document ends ([n] int64), checked: increasing offsets in 1..`tokens` (the
  shard's length). A damaged file is refused, naming the fix, rather than misplacing documents."""
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise ConfigError(f'{path}: cannot read where the documents of {path.parent} end ({e}); '
                      'delete that directory to prepare the data again.') from e
  ends = np.frombuffer(raw[:len(raw) // 8 * 8], dtype='<i8').astype(np.int64)
  if len(raw) % 8 or (ends.size and (ends[0] < 1 or ends[-1] > tokens or
                                     np.any(np.diff(ends) <= 0))):
    raise ConfigError(f'{path} is damaged: it does not hold increasing document ends within '
                      f'its shard of {tokens:,} tokens. Delete {path.parent} to prepare the data '
                      'again.')
  return ends


class TokenStream:
  """One split as a 1-D array-like over one or more shard segments, with its loss mask.

  Supports `len`, integer-array and slice indexing (returning plain arrays), `np.asarray`.

  Attributes:
    dtype: The stored dtype.
    has_mask: Whether any segment has a loss mask (segments without one are all learned).
    has_document_ends: Whether the shards record where their documents end (`document_ends`).
  """

  def __init__(self, segments: Sequence[Segment], dtype: str, document_ends: bool = False):
    self._segments = list(segments)
    self.has_document_ends = document_ends
    self._ends = None
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

  def _slice(self, parts, index: slice, dtype, fill) -> np.ndarray | None:
    """parts' values at `index` copied part by part, for a slice of step 1 (None otherwise:
    gathered by index instead)."""
    start, stop, step = index.indices(self._len)
    if step != 1:
      return None
    out = np.empty(max(0, stop - start), dtype=dtype)
    k = int(np.searchsorted(self._starts, start, side='right')) - 1
    at = start
    while at < stop:
      end = min(stop, int(self._starts[k + 1]))
      base = int(self._starts[k])
      out[at - start:end - start] = fill if parts[k] is None else parts[k][at - base:end - base]
      at, k = end, k + 1
    return out

  def _at(self, parts, index, dtype, fill) -> np.ndarray:
    """parts' values at `index` (an int array or slice; `fill` where a part is None)."""
    if isinstance(index, slice):
      sliced = self._slice(parts, index, dtype, fill)
      if sliced is not None:
        return sliced
      index = np.arange(*index.indices(self._len))
    return self._gather(parts, index, dtype, fill)

  def __getitem__(self, index) -> np.ndarray:
    return self._at(self._parts, index, self.dtype, 0)

  def mask(self, index) -> np.ndarray:
    """The loss mask (uint8, 1 = learned) at `index` (an int array or slice)."""
    return self._at(self._masks, index, np.uint8, 1)

  def document_ends(self) -> np.ndarray:
    """The stream offsets just past each document's last token ([n] int64, increasing), read
    from the shards' `.ends` files (the segments' parts of them), once; the stream's last token
    ends a document too."""
    if not self.has_document_ends:
      raise ValueError('these shards do not record where their documents end')
    if self._ends is None:
      parts = []
      for (file, _, start, count), offset in zip(self._segments, self._starts[:-1].tolist()):
        local = _read_ends(Path(ends_name(file)), Path(file).stat().st_size // self.dtype.itemsize)
        inside = local[(local > start) & (local <= start + count)]
        parts.append(inside - start + offset)
      ends = np.concatenate(parts + [np.zeros(0, np.int64)]).astype(np.int64)
      if self._len and (not ends.size or ends[-1] != self._len):
        ends = np.append(ends, np.int64(self._len))
      self._ends = ends
    return self._ends

  def __array__(self, dtype=None, copy=None):
    del copy
    return self[:].astype(dtype) if dtype is not None else self[:]
