"""Prepare step: tokenize sources once into memory-mapped token shards.

A prepared directory holds

  train-00000.bin ...  raw little-endian token ids of the `data.path` stream, in source order,
                       at most `shard_tokens` per shard (formats.py: what a source is);
  train-00000.mask     for a shard holding tokens that are not learned (instruction data), one
                       uint8 per token, 1 = learned (documents.py: the rule);
  val-00000.bin ...    the same for `data.val_path`, when set;
  meta.json            dtype, vocab size, tokenizer, token counts, the shards of each split in
                       order, sources and a fingerprint.

Without `data.val_path`, the validation split is the last `val_fraction` of the train stream's
tokens (contiguous, so no window straddles both; for records, from the end of the document the
cut falls in, so both splits hold whole documents): `meta.json` lists each split as segments
(file, mask, first token, count). `meta.json` is the commit marker, written last; while a prepare
runs, `prepare.json` records each committed shard, so an interrupted prepare resumes (shards.py).
A directory of the older layout (train.bin, val.bin, format 1) still loads as a prepared dataset.

The work is cut into tasks (formats.py) tokenized by `num_workers` processes (1: in this process),
with a bounded number in flight, so memory stays bounded whatever the corpus size.
"""

import collections
from concurrent import futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import numbers
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import tqdm

from megatrain_jax import fs
from megatrain_jax import locks
from megatrain_jax.data import formats, shards
from megatrain_jax.data.corpus import DEFAULT_CORPUS_NAME, default_corpus_text
from megatrain_jax.data.documents import (LEARNED_RULES_FIELD, DocumentFormat, document_format,
                                          drops_system_message)
from megatrain_jax.data.tokenizer import Tokenizer
from megatrain_jax.errors import ConfigError

META_FILE = 'meta.json'
# Bumped whenever the on-disk layout or the tokenization procedure changes, so old caches are
# re-prepared instead of being misread. 1: train.bin/val.bin. 2: shards, documents, masks.
_FORMAT_VERSION = 2
# Text files are tokenized in chunks of about this many characters, cut where the tokenizer's ids
# do not change (formats.text_tasks), each encoded a piece at a time (tokenizer.encode_text).
_CHUNK_CHARS = formats.TEXT_CHUNK_CHARS
# How sources are cut into tasks (formats.py), which an interrupted prepare's resume point counts:
# progress recorded under another cut starts over. 2: a Parquet row group is several tasks.
_TASKS_VERSION = 2
DEFAULT_SHARD_TOKENS = 1 << 27
# Inputs below this many bytes are tokenized in this process: starting workers costs more.
_POOL_MIN_BYTES = 32 << 20
_LOG = logging.getLogger(__name__)
_OUR_FILES = ('train-*.bin', 'train-*.mask', 'train-*.ends', 'val-*.bin', 'val-*.mask',
              'val-*.ends', 'train.bin', 'val.bin',
              '.train-*.tmp', '.val-*.tmp', '.train.bin.*.tmp', '.val.bin.*.tmp',
              shards.PROGRESS_FILE)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Describes a prepared dataset (a directory, or a mixture of them).

  Attributes:
    dir: The directory holding the shards and meta.json (a mixture: its cache root).
    dtype: numpy dtype name of the stored ids ('uint16' or 'uint32').
    vocab_size: Vocabulary size of the tokenizer that produced the ids.
    train_tokens: Number of tokens in the training split.
    val_tokens: Number of tokens in the validation split.
    tokenizer: The tokenizer's `name` (its identity).
    splits: {'train': segments, 'val': segments}, each (token file, mask file or None, first
      token, count) with absolute paths, in stream order.
    has_mask: Whether some token is not learned (a loss mask is stored).
    document_ends: Whether every shard records where its documents end (shards.py): documents
      are then known as they were; else (plain text, or a prepare of an older version) by
      their EOS. A mixture's: its validation split's (each source says its own).
    mixture: For a mixture, ((weight, DatasetInfo of the source), ...); else ().
    checksums: {absolute path: crc32} of the files the prepare step wrote (none from a prepare
      of an older version): shards.ShardVerifier.
    stats: What the prepare run that produced it measured (not compared).
  """
  dir: Path
  dtype: str
  vocab_size: int
  train_tokens: int
  val_tokens: int
  tokenizer: str
  splits: dict = dataclasses.field(default_factory=dict, hash=False)
  has_mask: bool = False
  document_ends: bool = False
  mixture: tuple = ()
  checksums: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
  stats: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


def token_dtype(vocab_size: int) -> str:
  """Returns the narrowest unsigned dtype name that can hold every id below `vocab_size`."""
  return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


def check_val_fraction(val_fraction: Any) -> None:
  """Raises ConfigError (naming `data.val_fraction`) unless it is a number in (0, 0.5]."""
  # `not (0 < x <= 0.5)` rather than `x <= 0 or x > 0.5` so that NaN is rejected too.
  if (isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real) or
      not 0 < val_fraction <= 0.5):
    raise ConfigError(f'data.val_fraction: got {val_fraction!r}; it must be a number in (0, 0.5], '
                      'the share of the training token stream held out for validation '
                      '(e.g. 0.05).')


def check_shard_tokens(shard_tokens: Any) -> None:
  if (isinstance(shard_tokens, bool) or not isinstance(shard_tokens, numbers.Integral) or
      shard_tokens < 1):
    raise ConfigError(f'data.shard_tokens: got {shard_tokens!r}; it must be an integer >= 1 '
                      f'(tokens per shard file, e.g. {DEFAULT_SHARD_TOKENS}).')


def needs_documents(files: Sequence[Path]) -> bool:
  """Whether any file holds records (so EOS must be known)."""
  return any(formats.source_format(f) != formats.TEXT for f in files)


def check_sources(files: Sequence[Path], fmt: DocumentFormat | None, field: str) -> None:
  """Checks each file's head (formats.check_head) and refuses a source known to be empty.

  Raises:
    ConfigError: (naming `field` and the file) for bad input found, or no data at all.
  """
  counts = [formats.check_head(path, fmt, field) for path in files]
  if files and all(count == 0 for count in counts):
    raise ConfigError(f'{field}: {", ".join(str(f) for f in files[:3])} is empty (0 bytes of '
                      f'text), or holds no records; point {field} at a file or directory with '
                      'data.')


def read_dataset_info(directory: str | Path, field: str = 'data.path') -> DatasetInfo:
  """Reads the DatasetInfo of a prepared directory and checks its token files are complete.

  Raises:
    ConfigError: (naming `field`) if meta.json is missing or malformed, or a token file is
      missing or has the wrong size.
  """
  directory = Path(directory).expanduser().resolve()
  meta = _read_meta(directory)
  if meta is None:
    raise ConfigError(f'{field}: {directory} has no readable {META_FILE}, so it is not a prepared '
                      'dataset; point it at data files or a directory written by the prepare '
                      'step.')
  if not _token_files_complete(directory, meta):
    raise ConfigError(f'{field}: the token files in {directory} do not match its {META_FILE} '
                      '(missing or truncated); delete the directory and prepare it again.')
  return _info_from_meta(directory, meta)


@dataclasses.dataclass
class _Job:
  """One prepare: what to read and how."""
  out_dir: Path
  tokenizer: Tokenizer
  fmt: DocumentFormat | None
  dtype: str
  streams: dict  # name -> list of files ([] with default_text: the embedded corpus)
  default_text: str | None
  val_fraction: float | None
  shard_tokens: int
  num_workers: int
  progress: bool | None


def prepare_dataset(out_dir: str | Path,
                    tokenizer: Tokenizer,
                    *,
                    train_sources: Sequence[str | Path],
                    val_sources: Sequence[str | Path] = (),
                    val_fraction: float | None = 0.05,
                    doc_format: DocumentFormat | None = None,
                    shard_tokens: int = DEFAULT_SHARD_TOKENS,
                    num_workers: int = 1,
                    progress: bool | None = False,
                    as_prepared: bool = False) -> DatasetInfo:
  """Tokenizes sources into `out_dir`, reuses what is there if nothing changed, or resumes an
  interrupted prepare of the same sources.

  Args:
    out_dir: Directory for the shards and meta.json (created if missing).
    tokenizer: Turns text into ids.
    train_sources: Files, directories or glob patterns (formats.py), read in order; empty means
      the embedded default corpus.
    val_sources: Like `train_sources`, for a separate validation split. Empty means the validation
      split is the last `val_fraction` of the tokenized training stream.
    val_fraction: Share of the training stream held out when `val_sources` is empty; in (0, 0.5].
      None: no validation split (a mixture source whose validation comes from data.val_path).
    doc_format: EOS/BOS and record fields; None resolves the tokenizer's defaults when a source
      holds records.
    shard_tokens: The most tokens per shard file.
    num_workers: Tokenizing processes; 0 = every core; 1 = this process.
    progress: Progress bar on stderr (None: only on a terminal).
    as_prepared: Complete prepared files in `out_dir` are taken as they are, whatever the
      sources' sizes and file times here: another process of the run prepared them just now,
      from the same config, on a machine whose copy of the sources may carry other file times.

  Raises:
    ConfigError: For bad arguments, a missing or unreadable source, or a bad record (naming the
      file and line or row), found before anything is written where the head of each file
      shows it, else when the prepare reaches it (and the partial output is removed).
  """
  job = _plan(out_dir, tokenizer, train_sources, val_sources, val_fraction, doc_format,
              shard_tokens, num_workers, progress)
  identity = _source_identity(job)
  fingerprint = _fingerprint(identity)
  meta = _read_meta(job.out_dir)
  if (meta is not None and (as_prepared or meta.get('fingerprint') in
                            (fingerprint, _fingerprint_before_learned_rules(identity, meta))) and
      _token_files_complete(job.out_dir, meta)):
    return _info_from_meta(job.out_dir, meta)
  if meta is not None:  # a run resumed on the new data is told its batches changed: this is why
    _LOG.warning('prepare: preparing %s again: %s', job.out_dir, _why_again(meta, identity))
  started = time.monotonic()
  # One prepare at a time per directory (a second one would delete the first's unfinished
  # shards): two --prepare runs, or runs sharing a data.cache_dir. The lock makes the directory,
  # and removes it again if bad input found by the prepare leaves it empty (_run).
  with locks.hold(job.out_dir, 'data directory', 'point data.cache_dir at another directory'):
    meta = _run(job, {**identity, 'fingerprint': fingerprint})
  info = _info_from_meta(job.out_dir, meta)
  seconds = time.monotonic() - started
  return dataclasses.replace(info, stats={**meta['stats'], 'seconds': seconds})


def _plan(out_dir, tokenizer, train_sources, val_sources, val_fraction, doc_format,
          shard_tokens, num_workers, progress) -> _Job:
  """Checks every argument and the head of every source; writes nothing."""
  if val_fraction is not None:
    check_val_fraction(val_fraction)
  check_shard_tokens(shard_tokens)
  train_files = formats.expand_sources(train_sources, 'data.path')
  val_files = formats.expand_sources(val_sources, 'data.val_path')
  out_dir = Path(out_dir).expanduser().resolve()
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f'data.cache_dir: {out_dir} is a file; point data.cache_dir at a directory '
                      '(it is created if missing).')
  if doc_format is None and needs_documents(train_files + val_files):
    doc_format = document_format(tokenizer)
  text_documents = doc_format is not None and doc_format.text_documents
  formats.check_directories(train_sources, text_documents, 'data.path')
  formats.check_directories(val_sources, text_documents, 'data.val_path')
  check_sources(train_files, doc_format, 'data.path')
  check_sources(val_files, doc_format, 'data.val_path')
  streams = {'train': train_files}
  if val_files:
    streams['val'] = val_files
  workers = num_workers if num_workers > 0 else (os.cpu_count() or 1)
  total = sum(f.stat().st_size for f in train_files + val_files)
  if total < _POOL_MIN_BYTES:
    workers = 1
  return _Job(out_dir, tokenizer, doc_format, token_dtype(tokenizer.vocab_size), streams,
              None if train_files else default_corpus_text(),
              None if val_files else val_fraction, shard_tokens, workers, progress)


def _source_identity(job: _Job) -> dict[str, Any]:
  """What decides the prepared files' contents (its hash is the fingerprint)."""
  if job.default_text is None:
    train_desc = _describe_files(job.streams['train'])
  else:
    encoded = job.default_text.encode('utf-8')
    # Content-addressed: the embedded corpus changes with the Python version.
    train_desc = [{'path': DEFAULT_CORPUS_NAME, 'size': len(encoded),
                   'sha256': hashlib.sha256(encoded).hexdigest()}]
  return {
      'format': _FORMAT_VERSION,
      'train_sources': train_desc,
      'val_sources': _describe_files(job.streams.get('val', [])),
      'tokenizer': job.tokenizer.name,
      'vocab_size': job.tokenizer.vocab_size,
      'documents': None if job.fmt is None else job.fmt.identity(),
      'shard_tokens': job.shard_tokens,
      # Only meaningful when the split is carved from the training stream.
      'val_fraction': None if job.val_fraction is None else float(job.val_fraction),
  }


def _describe_files(files: Sequence[Path]) -> list[dict[str, Any]]:
  """Returns the path/size/mtime records that identify a source file's version."""
  records = []
  for path in files:
    stat = path.stat()
    records.append({'path': str(path), 'size': stat.st_size, 'mtime_ns': stat.st_mtime_ns})
  return records


def _fingerprint(identity: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode('utf-8')).hexdigest()


# What each part of a prepare's identity (_source_identity) is, for the note of a prepare again.
_IDENTITY_NAMES = {'format': 'this version stores prepared data otherwise',
                   'train_sources': "data.path's files changed (their sizes or times)",
                   'val_sources': "data.val_path's files changed (their sizes or times)",
                   'tokenizer': 'another tokenizer', 'vocab_size': 'another vocabulary size',
                   'shard_tokens': 'data.shard_tokens changed',
                   'val_fraction': 'data.val_fraction changed'}
# Parts of the documents' identity that are this version's rules, not the user's settings.
_RULES = ('records_version', 'chat_rendering', LEARNED_RULES_FIELD)


def _why_again(meta: dict[str, Any], identity: dict[str, Any]) -> str:
  """Why data prepared before (`meta`) is prepared again for `identity`: the parts that
  differ, this version's rules for records named as such (a run resumed on the new data is told
  its batches changed; this says why)."""
  reasons = [_IDENTITY_NAMES.get(key, key) for key in identity
             if key != 'documents' and meta.get(key) != identity[key]]
  was, now = meta.get('documents') or {}, identity.get('documents') or {}
  rules = [f'{key} {was.get(key)} -> {now.get(key)}' for key in _RULES
           if key in now and was.get(key) != now.get(key)]
  if rules:
    reasons.append(f'this version reads records otherwise ({", ".join(rules)})')
  settings = sorted(key for key in set(was) | set(now)
                    if key not in _RULES and was.get(key) != now.get(key))
  if settings:
    reasons.append(f'other document settings ({", ".join(settings)})')
  return '; '.join(reasons) or 'its files are incomplete'


def _fingerprint_before_learned_rules(identity: dict[str, Any], meta: dict[str, Any]) -> str | None:
  """The fingerprint these sources had before documents.LEARNED_RULES_VERSION was part of it,
  where the data prepared then has no loss mask: every token is learned, so the rules that find
  the learned ones changed nothing in it (a corpus of JSONL text is not tokenized again)."""
  documents = identity.get('documents')
  if meta.get('has_mask', True) or not documents or LEARNED_RULES_FIELD not in documents:
    return None
  before = {k: v for k, v in documents.items() if k != LEARNED_RULES_FIELD}
  return _fingerprint({**identity, 'documents': before})


# --- running a prepare ---------------------------------------------------------------------------


def _remove_ours(out_dir: Path, keep_progress: bool) -> None:
  """Removes this step's files (never anything else in the directory), meta.json first."""
  (out_dir / META_FILE).unlink(missing_ok=True)
  for pattern in _OUR_FILES:
    for path in out_dir.glob(pattern):
      if keep_progress and path.name == shards.PROGRESS_FILE:
        continue
      path.unlink(missing_ok=True)
  fs.fsync(out_dir, directory=True)


def _run(job: _Job, identity: dict[str, Any]) -> dict[str, Any]:
  """Tokenizes every stream (resuming recorded shards), then commits meta.json."""
  progress = shards.read_progress(job.out_dir, identity['fingerprint'])
  if progress.get('tasks') != _TASKS_VERSION:  # its task indices count other tasks: start over
    progress = {}
  kept = {s['file'] for st in progress.get('streams', {}).values() for s in st['shards']}
  kept |= {s.get(kind) for st in progress.get('streams', {}).values() for s in st['shards']
           for kind in ('mask', 'ends')}
  (job.out_dir / META_FILE).unlink(missing_ok=True)
  for pattern in _OUR_FILES:  # stale shards of another prepare, or beyond the recorded ones
    for path in job.out_dir.glob(pattern):
      if path.name not in kept and path.name != shards.PROGRESS_FILE:
        path.unlink(missing_ok=True)
  progress = {'fingerprint': identity['fingerprint'], 'dtype': job.dtype,
              'tasks': _TASKS_VERSION, 'streams': progress.get('streams', {})}
  if job.fmt is not None and drops_system_message(job.fmt):  # said as the records are read
    _LOG.warning('prepare: the chat template writes a system message into a prompt but leaves '
                 'it out of a whole conversation (it writes it into the last user turn only, '
                 'as Mistral v0.3\'s does), so conversations with one are learned without it, '
                 'as transformers\' apply_chat_template renders them; set data.chat_template '
                 'to a template that keeps it to learn with it')
  try:
    stats = _tokenize_streams(job, progress)
  except ConfigError:
    _remove_ours(job.out_dir, keep_progress=False)  # bad input: nothing to resume
    raise
  stats.update(_mask_census(job.out_dir, progress, job.fmt is not None and
                            job.fmt.bos is not None))
  if nothing := stats['documents_learning_nothing']:
    _LOG.warning('prepare: %d of %d documents learn no token but the EOS that ends them (a chat '
                 'without an assistant turn, an empty completion): check that the records\' '
                 'roles and fields are the ones data.* names', nothing, stats['documents'])
  # Only what the data decides goes to meta.json (a resumed prepare writes the same bytes).
  meta = {**identity, 'dtype': job.dtype, **_splits(job, progress),
          'stats': {k: stats[k] for k in ('input_bytes', 'documents', 'skipped_records',
                                          'documents_learning_nothing',
                                          'documents_learned_whole')}}
  fs.write_json_atomic(job.out_dir / META_FILE, meta)
  (job.out_dir / shards.PROGRESS_FILE).unlink(missing_ok=True)
  return {**meta, 'stats': stats}


def _mask_census(out_dir: Path, progress: dict[str, Any], bos: bool) -> dict[str, int]:
  """{documents_learning_nothing, documents_learned_whole} of masked data: the documents whose
  loss mask learns none of their tokens but the EOS that ends them (a chat without an assistant
  turn, an empty completion: records the format reads otherwise than their author meant), and
  those it learns whole (text records among pairs or chats: a mix of kinds). A shard without a
  mask file learns every token; with `bos` a masked document's first token (its BOS) is never
  learned. Zeros for data without recorded ends; a shard at a time, memory-mapped, its mask read
  a block at a time (`_learned_tokens`)."""
  nothing = whole = 0
  for stream in progress['streams'].values():
    carried = np.zeros(2, np.int64)  # (learned, length) of the document a shard ended inside
    for shard in stream['shards']:
      if shard.get('ends') is None:
        carried[:] = 0
        continue
      # None: every token learned (no mask file), counted from the ends alone.
      mask = np.memmap(out_dir / shard['mask'], np.uint8, 'r') if shard.get('mask') else None
      ends = np.fromfile(out_dir / shard['ends'], np.int64)  # shard-local, increasing
      if ends.size:
        starts = np.concatenate([[0], ends[:-1]])
        length = ends - starts - 1  # without the EOS
        learned = (length.copy() if mask is None else
                   _learned_tokens(mask, starts, ends) - mask[ends - 1])
        learned[0] += carried[0]
        length[0] += carried[1]
        nothing += int(np.count_nonzero(learned == 0))
        whole += int(np.count_nonzero((learned >= length - int(bos)) & (learned > 0)))
        carried[:] = 0
      tail = int(ends[-1]) if ends.size else 0  # where the document the next shard ends begins
      carried += (shard['tokens'] - tail if mask is None else np.count_nonzero(mask[tail:]),
                  shard['tokens'] - tail)
  return {'documents_learning_nothing': nothing, 'documents_learned_whole': whole}


# Tokens of a mask summed at a time by _learned_tokens (8 bytes each while summed).
_CENSUS_BLOCK_TOKENS = 1 << 22


def _learned_tokens(mask: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
  """[documents] int64: the learned tokens of mask[starts[i]:ends[i]] (a 0/1 uint8 mask), a
  block of documents spanning about _CENSUS_BLOCK_TOKENS at a time: np.add.reduceat with an
  int64 sum casts its whole input, 8 bytes a token (1.07 GB for a full default shard); a
  document longer than a block is counted alone (count_nonzero, which copies nothing)."""
  out = np.empty(len(ends), np.int64)
  first = 0
  while first < len(ends):
    last = max(first + 1, int(np.searchsorted(ends, starts[first] + _CENSUS_BLOCK_TOKENS,
                                              'right')))
    if last == first + 1:
      out[first] = np.count_nonzero(mask[starts[first]:ends[first]])
    else:
      out[first:last] = np.add.reduceat(mask[starts[first]:ends[last - 1]],
                                        starts[first:last] - starts[first], dtype=np.int64)
    first = last
  return out


def _tokenize_streams(job: _Job, progress: dict[str, Any]) -> dict[str, Any]:
  total = sum(f.stat().st_size for files in job.streams.values() for f in files)
  if job.default_text is not None:
    total += len(job.default_text.encode('utf-8'))
  bar = tqdm.tqdm(total=total, unit='B', unit_scale=True, desc='prepare', dynamic_ncols=True,
                  disable=(None if job.progress is None else not job.progress), leave=True,
                  smoothing=0.1)
  executor = _Executor(job)
  stats = {'input_bytes': total, 'text_bytes': 0, 'documents': 0, 'skipped_records': 0}
  try:
    for name, files in job.streams.items():
      state = progress['streams'].setdefault(name, {'shards': [], 'done': False})
      stream_stats = _tokenize_stream(job, name, files, state, progress, executor, bar)
      for key, value in stream_stats.items():
        stats[key] += value
  finally:
    executor.close()
    bar.close()
  if stats['skipped_records']:
    _LOG.warning('prepare: skipped %d bad records (data.skip_bad_records=True)',
                 stats['skipped_records'])
  return stats


def _stream_tasks(job: _Job, name: str, files: Sequence[Path]) -> Iterator[tuple[Any, int]]:
  """(task, input bytes it accounts for) of one stream, in order."""
  field = 'data.path' if name == 'train' else 'data.val_path'
  if not files and job.default_text is not None:
    yield formats.TextTask(job.default_text), len(job.default_text.encode('utf-8'))
    return
  for path in files:
    kind, done = formats.source_format(path), 0
    if kind == formats.TEXT:
      tasks = formats.text_tasks(path, field, _CHUNK_CHARS, job.tokenizer)
    elif kind != formats.ARROW:  # read as they go (a Parquet task holds its rows): not listed
      tasks = formats.record_tasks(path, job.fmt, field)
    else:
      tasks = _scaled_progress(path, job.fmt, field)
    for task, position in tasks:
      yield task, position - done
      done = position
    yield None, path.stat().st_size - done  # the rest of the file (compression framing)


def _scaled_progress(path: Path, fmt, field: str) -> Iterator[tuple[Any, int]]:
  """Arrow tasks with progress scaled to the file's size on disk."""
  size = path.stat().st_size
  tasks = list(formats.record_tasks(path, fmt, field))
  uncompressed = max(tasks[-1][1], 1) if tasks else 1
  for task, done in tasks:
    yield task, min(size, done * size // uncompressed)


def _tokenize_stream(job: _Job, name: str, files: Sequence[Path], state: dict[str, Any],
                     progress: dict[str, Any], executor: '_Executor', bar) -> dict[str, int]:
  """Tokenizes one stream into its shards, from the recorded resume point."""
  field = 'data.path' if name == 'train' else 'data.val_path'

  def record():
    state['shards'] = writer.shards
    fs.write_json_atomic(job.out_dir / shards.PROGRESS_FILE, progress)

  writer = shards.ShardWriter(job.out_dir, name, job.dtype, job.shard_tokens, state, record,
                              record_ends=job.fmt is not None)
  text_bytes = 0
  if state.get('done'):
    bar.update(sum(f.stat().st_size for f in files) if files else bar.total)
    return {'text_bytes': 0, 'documents': writer.documents, 'skipped_records': writer.skipped}
  resume_task, resume_skip = writer.resume
  try:
    index = 0
    for task, size, result in executor.map(_resumed(_stream_tasks(job, name, files), resume_task)):
      bar.update(size)
      if result is None:
        continue
      if result.bad and not (job.fmt and job.fmt.skip_bad_records):
        raise formats.bad_records_error(result.bad, result.skipped, field)
      skip = resume_skip if task == resume_task else 0
      writer.write(result.tokens, result.mask, task, skip, result.documents, result.skipped,
                   result.ends)
      text_bytes += result.text_bytes
      index = task + 1
    writer.finish(max(index, resume_task))
  except BaseException:
    writer.abort()
    raise
  _check_not_empty(writer, files, field)
  state['done'] = True
  record()
  return {'text_bytes': text_bytes, 'documents': writer.documents,
          'skipped_records': writer.skipped}


def _resumed(tasks: Iterable[tuple[Any, int]], resume_task: int) -> Iterator[tuple[int, Any, int]]:
  """(task index, task or None to skip, bytes): tasks before the resume point are not run."""
  index = 0
  for task, size in tasks:
    if task is None:
      yield -1, None, size
      continue
    yield index, (task if index >= resume_task else None), size
    index += 1


def _check_not_empty(writer: shards.ShardWriter, files: Sequence[Path], field: str) -> None:
  if writer.tokens == 0:
    skipped = f' ({writer.skipped} bad records skipped)' if writer.skipped else ''
    raise ConfigError(f'{field}: {", ".join(str(f) for f in files[:3])} holds no tokens after '
                      f'reading every record{skipped}: the dataset is empty; point {field} at '
                      'data.')


def _splits(job: _Job, progress: dict[str, Any]) -> dict[str, Any]:
  """meta.json's token counts and split segments (validation carved from the train tail)."""
  streams = progress['streams']
  train_shards = streams['train']['shards']
  total = sum(s['tokens'] for s in train_shards)
  if 'val' in streams:
    val_shards = streams['val']['shards']
    val_tokens = sum(s['tokens'] for s in val_shards)
    splits = {'train': shards.split_segments(train_shards, 0, total),
              'val': shards.split_segments(val_shards, 0, val_tokens)}
    train_tokens = total
  else:
    train_tokens = total - int(total * (job.val_fraction or 0))
    if job.fmt is not None and 0 < train_tokens < total:  # documents: val starts at one
      train_tokens = _document_boundary(job, train_shards, train_tokens)
    val_tokens = total - train_tokens
    splits = {'train': shards.split_segments(train_shards, 0, train_tokens),
              'val': shards.split_segments(train_shards, train_tokens, total)}
  has_mask = any(s['mask'] for st in streams.values() for s in st['shards'])
  checksums = {name: crc for st in streams.values() for s in st['shards']
               for name, crc in s.get('crc32', {}).items()}  # none from an older prepare
  return {'train_tokens': train_tokens, 'val_tokens': val_tokens, 'checksums': checksums,
          'splits': {k: [list(seg) for seg in v] for k, v in splits.items()},
          'has_mask': bool(has_mask),
          'document_ends': _records_ends(s for st in streams.values() for s in st['shards'])}


def _records_ends(shard_list: Iterable[dict[str, Any]]) -> bool:
  """Whether every shard records where its documents end (shards.py); a prepare of an older
  version resumed by this one may have shards without."""
  return all(s.get('ends') is not None for s in shard_list)


def _document_boundary(job: _Job, train_shards: list, cut: int) -> int:
  """The end of the document the cut before token `cut` falls in (just past its EOS; `cut`
  itself when a document ends there), or `cut` when no document ends before the stream's last
  token (the validation split would be empty). Where the shards record their documents' ends,
  those; else the first EOS."""
  total = sum(s['tokens'] for s in train_shards)
  if _records_ends(train_shards):
    ends = shards.TokenStream([(str(job.out_dir / f), None, start, n) for f, _, start, n in
                               shards.split_segments(train_shards, 0, total)], job.dtype,
                              document_ends=True).document_ends()
    after = ends[(ends >= cut) & (ends < total)]
    return int(after[0]) if after.size else cut
  tail = shards.TokenStream([(str(job.out_dir / f), None, start, n) for f, _, start, n in
                             shards.split_segments(train_shards, cut - 1, total)], job.dtype)
  for first in range(0, len(tail) - 1, _BOUNDARY_SCAN):
    block = tail[first:min(first + _BOUNDARY_SCAN, len(tail) - 1)]
    eos = np.flatnonzero(block == job.fmt.eos)
    if eos.size:
      return cut + first + int(eos[0])
  return cut


# Tokens read at a time looking for the document boundary after the validation cut.
_BOUNDARY_SCAN = 1 << 20


# --- workers -------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Tokenizer, fmt: DocumentFormat | None, dtype: str) -> None:
  # One thread per worker: the workers are the parallelism (no oversubscribed Rayon pools).
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _WORKER.update(tokenizer=tokenizer, fmt=fmt, dtype=np.dtype(dtype))


def _work(task: Any) -> formats.TaskResult:
  return formats.run_task(task, _WORKER['tokenizer'], _WORKER['fmt'], _WORKER['dtype'])


class _Executor:
  """Runs tasks in order, in this process (1 worker) or a pool, with a bounded number in flight
  (Pool.imap would read the whole input ahead)."""

  def __init__(self, job: _Job):
    self._job = job
    self._pool = None
    if job.num_workers > 1:
      # spawn: no fork of a threaded (JAX, Rayon) parent. A ProcessPoolExecutor, not a Pool: a
      # worker that dies (OOM kill) fails the prepare (BrokenProcessPool) instead of hanging it.
      self._pool = futures.ProcessPoolExecutor(
          job.num_workers, mp_context=multiprocessing.get_context('spawn'),
          initializer=_init_worker, initargs=(job.tokenizer, job.fmt, job.dtype))
    self._window = 2 * job.num_workers + 1

  def map(self, items: Iterable[tuple[int, Any, int]]) -> Iterator[tuple[int, int, Any]]:
    """(task index, bytes, TaskResult or None) for each item, in order."""
    dtype = np.dtype(self._job.dtype)
    if self._pool is None:
      for index, task, size in items:
        result = None if task is None else formats.run_task(task, self._job.tokenizer,
                                                            self._job.fmt, dtype)
        yield index, size, result
      return
    pending = collections.deque()
    for index, task, size in items:
      pending.append((index, size, None if task is None else self._pool.submit(_work, task)))
      while len(pending) > self._window:
        index_, size_, handle = pending.popleft()
        yield index_, size_, handle if handle is None else handle.result()
    while pending:
      index_, size_, handle = pending.popleft()
      yield index_, size_, handle if handle is None else handle.result()

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)


# --- meta.json -----------------------------------------------------------------------------------


def _read_meta(directory: Path) -> dict[str, Any] | None:
  """Returns the parsed meta.json of `directory`, or None if it is absent or unreadable."""
  try:
    meta = json.loads((directory / META_FILE).read_text(encoding='utf-8'))
  except (OSError, ValueError):
    # A corrupt marker means "not prepared": the caller re-prepares or reports that.
    return None
  return meta if isinstance(meta, dict) else None


def _meta_splits(meta: dict[str, Any]) -> dict[str, list]:
  """Split segments of meta.json; format 1 (train.bin, val.bin) as one segment each."""
  if 'splits' in meta:
    return meta['splits']
  return {'train': [['train.bin', None, 0, meta['train_tokens']]],
          'val': [['val.bin', None, 0, meta['val_tokens']]]}


def _token_files_complete(directory: Path, meta: dict[str, Any]) -> bool:
  """Whether meta.json has every field and the token files hold the segments it lists (and,
  where it says the documents' ends are recorded, their files exist)."""
  required = ('dtype', 'vocab_size', 'train_tokens', 'val_tokens', 'tokenizer')
  if not all(name in meta for name in required):
    return False
  try:
    itemsize = np.dtype(meta['dtype']).itemsize
    for name, segments in _meta_splits(meta).items():
      if sum(seg[3] for seg in segments) != meta[f'{name}_tokens']:
        return False
      for file, mask, start, count in segments:
        if (directory / file).stat().st_size < (start + count) * itemsize:
          return False
        if mask is not None and (directory / mask).stat().st_size < start + count:
          return False
        if meta.get('document_ends') and not (directory / shards.ends_name(file)).is_file():
          return False
    return True
  except (KeyError, TypeError, ValueError, OSError):
    return False


def _info_from_meta(directory: Path, meta: dict[str, Any]) -> DatasetInfo:
  splits = {name: tuple((str(directory / f), None if m is None else str(directory / m), s, n)
                        for f, m, s, n in segments)
            for name, segments in _meta_splits(meta).items()}
  return DatasetInfo(dir=directory, dtype=meta['dtype'], vocab_size=meta['vocab_size'],
                     train_tokens=meta['train_tokens'], val_tokens=meta['val_tokens'],
                     tokenizer=meta['tokenizer'], splits=splits,
                     has_mask=bool(meta.get('has_mask', False)),
                     document_ends=bool(meta.get('document_ends', False)),
                     checksums={str(directory / name): crc
                                for name, crc in meta.get('checksums', {}).items()},
                     stats=meta.get('stats', {}))
