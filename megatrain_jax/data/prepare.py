"""Prepare step: tokenize text once into memory-mapped token files.

A prepared directory holds

  train.bin  raw little-endian token ids of the training split,
  val.bin    the same for the validation split,
  meta.json  dtype, vocab size, tokenizer, token counts, sources and a fingerprint.

`meta.json` is the commit marker: it is removed before the token files are replaced and written
last, so a directory whose `meta.json` matches the requested fingerprint is always complete. Every
file is written atomically (temp file in the same directory, fsync, `os.replace`).
"""

import codecs
import dataclasses
import hashlib
import json
import numbers
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from megatrain_jax import fs
from megatrain_jax.data.corpus import DEFAULT_CORPUS_NAME, default_corpus_text
from megatrain_jax.data.tokenizer import Tokenizer
from megatrain_jax.errors import ConfigError

META_FILE = 'meta.json'
# Bumped whenever the on-disk layout or the tokenization procedure changes, so old caches are
# re-prepared instead of being misread.
_FORMAT_VERSION = 1
# Text is tokenized in chunks of about this many characters (whole lines) so memory stays bounded
# on multi-GB corpora; a chunk boundary always falls after a newline.
_CHUNK_CHARS = 8 << 20
_COPY_BUFFER_BYTES = 8 << 20
# Bytes of each source file read during validation (before anything is written), so that a binary
# file is refused up front; the prepare step still checks every byte.
_SNIFF_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """Describes a prepared dataset directory.

  Attributes:
    dir: The directory holding train.bin, val.bin and meta.json.
    dtype: numpy dtype name of the stored ids ('uint16' or 'uint32').
    vocab_size: Vocabulary size of the tokenizer that produced the ids.
    train_tokens: Number of tokens in train.bin.
    val_tokens: Number of tokens in val.bin.
    tokenizer: The tokenizer's `name` (its identity).
  """
  dir: Path
  dtype: str
  vocab_size: int
  train_tokens: int
  val_tokens: int
  tokenizer: str


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


def expand_sources(sources: Iterable[str | Path], field: str) -> list[Path]:
  """Resolves text sources to a sorted, absolute list of files, without reading them.

  Args:
    sources: Files, or directories meaning every non-hidden regular file directly inside them.
    field: The config field the sources came from, for error messages.

  Returns:
    The absolute file paths, directories expanded in sorted order.

  Raises:
    ConfigError: (naming `field`) if a source does not exist or is a directory with no files.
  """
  files = []
  for source in sources:
    path = Path(source).expanduser()
    if not path.exists():
      raise ConfigError(f'{field}: {path} does not exist; set {field} to an existing text file or '
                        'a directory of text files.')
    if path.is_dir():
      children = sorted(child for child in path.iterdir()
                        if child.is_file() and not child.name.startswith('.'))
      if not children:
        raise ConfigError(f'{field}: directory {path} contains no (non-hidden) files; put text '
                          f'files in it or point {field} at a text file.')
      files.extend(child.resolve() for child in children)
    else:
      files.append(path.resolve())
  return files


def _binary_error(path: Path, field: str, offset: int) -> ConfigError:
  return ConfigError(f'{field}: {path} looks like a binary file, not text (a NUL character at '
                     f'offset {offset}); point {field} at UTF-8 text (convert UTF-16 text to '
                     f'UTF-8), or remove the file from {field}.')


def _not_utf8_error(path: Path, field: str, error: UnicodeDecodeError) -> ConfigError:
  return ConfigError(f'{field}: {path} is not UTF-8 text ({error}); convert it to UTF-8 or '
                     f'remove it from {field}.')


def check_text_head(path: Path, field: str) -> None:
  """Refuses `path` if its first `_SNIFF_BYTES` are not UTF-8 text or hold a NUL, writing nothing.

  Raises:
    ConfigError: (naming `field`) for a binary or non-UTF-8 file.
  """
  with open(path, 'rb') as f:
    head = f.read(_SNIFF_BYTES)
  if b'\0' in head:
    raise _binary_error(path, field, head.index(b'\0'))
  try:
    # final=False: the sniffed prefix may end inside a multi-byte character.
    codecs.getincrementaldecoder('utf-8')().decode(head, final=len(head) < _SNIFF_BYTES)
  except UnicodeDecodeError as e:
    raise _not_utf8_error(path, field, e) from e


def read_dataset_info(directory: str | Path, field: str = 'data.path') -> DatasetInfo:
  """Reads the DatasetInfo of a prepared directory and checks its token files are complete.

  Args:
    directory: A directory written by `prepare_dataset`.
    field: The config field that named the directory, for error messages.

  Raises:
    ConfigError: (naming `field`) if meta.json is missing or malformed, or a token file is
      missing or has the wrong size.
  """
  directory = Path(directory).expanduser().resolve()
  meta = _read_meta(directory)
  if meta is None:
    raise ConfigError(f'{field}: {directory} has no readable {META_FILE}, so it is not a prepared '
                      'dataset; point it at a text file or a directory written by the prepare '
                      'step.')
  if not _token_files_complete(directory, meta):
    raise ConfigError(f'{field}: the token files in {directory} do not match its {META_FILE} '
                      '(missing or truncated); delete the directory and prepare it again.')
  return _info_from_meta(directory, meta)


def prepare_dataset(out_dir: str | Path,
                    tokenizer: Tokenizer,
                    *,
                    train_sources: Sequence[str | Path],
                    val_sources: Sequence[str | Path] = (),
                    val_fraction: float = 0.05) -> DatasetInfo:
  """Tokenizes text sources into `out_dir`, or reuses what is there if nothing changed.

  Args:
    out_dir: Directory for train.bin, val.bin and meta.json (created if missing).
    tokenizer: Turns text into ids.
    train_sources: Text files or directories of text files (see `expand_sources`), concatenated in
      order; empty means the embedded default corpus.
    val_sources: Like `train_sources`, for a separate validation split. Empty means the validation
      split is the last `val_fraction` of the tokenized training stream (contiguous, so no window
      straddles both splits).
    val_fraction: Share of the training stream held out when `val_sources` is empty; in (0, 0.5].

  Returns:
    The DatasetInfo of the prepared directory.

  Raises:
    ConfigError: For a bad val_fraction, a missing source (naming `data.path` or
      `data.val_path`), a source that is not UTF-8 text, or an `out_dir` that is a file.
  """
  check_val_fraction(val_fraction)
  train_files = expand_sources(train_sources, 'data.path')
  val_files = expand_sources(val_sources, 'data.val_path')
  out_dir = Path(out_dir).expanduser().resolve()
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f'data.cache_dir: {out_dir} is a file; point data.cache_dir at a directory '
                      '(it is created if missing).')

  default_text = None if train_files else default_corpus_text()
  identity = _source_identity(train_files, val_files, default_text, tokenizer, val_fraction)
  dtype = token_dtype(tokenizer.vocab_size)
  fingerprint = _fingerprint(identity)

  meta = _read_meta(out_dir)
  if (meta is not None and meta.get('fingerprint') == fingerprint and
      _token_files_complete(out_dir, meta)):
    return _info_from_meta(out_dir, meta)

  out_dir.mkdir(parents=True, exist_ok=True)
  train_texts = ([default_text] if default_text is not None else
                 (chunk for path in train_files for chunk in _text_chunks(path, 'data.path')))
  val_texts = ((chunk for path in val_files for chunk in _text_chunks(path, 'data.val_path'))
               if val_files else None)
  meta = _write_dataset(out_dir, train_texts, val_texts, tokenizer, dtype, val_fraction,
                        {**identity, 'fingerprint': fingerprint})
  return _info_from_meta(out_dir, meta)


def _source_identity(train_files: Sequence[Path], val_files: Sequence[Path],
                     default_text: str | None, tokenizer: Tokenizer,
                     val_fraction: float) -> dict[str, Any]:
  """What decides the prepared files' contents (its hash is the fingerprint): the format, each
  source's version, the tokenizer and, when the split is carved from the training stream, the
  share held out."""
  if default_text is None:
    train_desc = _describe_files(train_files)
  else:
    encoded = default_text.encode('utf-8')
    # Content-addressed: the embedded corpus changes with the Python version.
    train_desc = [{'path': DEFAULT_CORPUS_NAME, 'size': len(encoded),
                   'sha256': hashlib.sha256(encoded).hexdigest()}]
  return {
      'format': _FORMAT_VERSION,
      'train_sources': train_desc,
      'val_sources': _describe_files(val_files),
      'tokenizer': tokenizer.name,
      'vocab_size': tokenizer.vocab_size,
      # Only meaningful when the split is carved from the training stream.
      'val_fraction': None if val_files else float(val_fraction),
  }


def _write_dataset(out_dir: Path, train_texts: Iterable[str], val_texts: Iterable[str] | None,
                   tokenizer: Tokenizer, dtype: str, val_fraction: float,
                   identity: dict[str, Any]) -> dict[str, Any]:
  """Tokenizes into temp files beside the final ones, then commits them; returns the meta.json
  written. `val_texts` None: the validation split is the last `val_fraction` of the training
  stream. Partial output is removed after an error."""
  train_tmp = fs.new_temp(out_dir, 'train.bin')
  val_tmp = fs.new_temp(out_dir, 'val.bin')
  try:
    train_tokens = _tokenize_to_file(train_texts, tokenizer, dtype, train_tmp)
    if val_texts is not None:
      val_tokens = _tokenize_to_file(val_texts, tokenizer, dtype, val_tmp)
    else:
      val_tokens = int(train_tokens * val_fraction)
      train_tokens -= val_tokens
      _move_tail(train_tmp, val_tmp, train_tokens * np.dtype(dtype).itemsize)
    meta = {**identity, 'dtype': dtype, 'train_tokens': train_tokens, 'val_tokens': val_tokens}
    _commit(out_dir, train_tmp, val_tmp, meta)
  finally:
    # No-ops after a successful replace; removes partial output after an error.
    train_tmp.unlink(missing_ok=True)
    val_tmp.unlink(missing_ok=True)
  return meta


def _commit(out_dir: Path, train_tmp: Path, val_tmp: Path, meta: dict[str, Any]) -> None:
  """Moves the token files into place and writes meta.json, the commit marker, last."""
  # Drop the commit marker first: a crash between the two replaces below must not leave an old
  # meta.json vouching for a mix of old and new token files.
  (out_dir / META_FILE).unlink(missing_ok=True)
  fs.fsync(out_dir, directory=True)
  os.replace(train_tmp, out_dir / 'train.bin')
  os.replace(val_tmp, out_dir / 'val.bin')
  fs.write_json_atomic(out_dir / META_FILE, meta)


def _describe_files(files: Sequence[Path]) -> list[dict[str, Any]]:
  """Returns the path/size/mtime records that identify a source file's version."""
  records = []
  for path in files:
    stat = path.stat()
    records.append({'path': str(path), 'size': stat.st_size, 'mtime_ns': stat.st_mtime_ns})
  return records


def _fingerprint(identity: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode('utf-8')).hexdigest()


def _read_meta(directory: Path) -> dict[str, Any] | None:
  """Returns the parsed meta.json of `directory`, or None if it is absent or unreadable."""
  try:
    meta = json.loads((directory / META_FILE).read_text(encoding='utf-8'))
  except (OSError, ValueError):
    # A corrupt marker means "not prepared": the caller re-prepares or reports that.
    return None
  return meta if isinstance(meta, dict) else None


def _token_files_complete(directory: Path, meta: dict[str, Any]) -> bool:
  """Whether meta.json has every DatasetInfo field and the token files have the promised sizes."""
  required = [field.name for field in dataclasses.fields(DatasetInfo) if field.name != 'dir']
  if not all(name in meta for name in required):
    return False
  try:
    itemsize = np.dtype(meta['dtype']).itemsize
    expected = {'train.bin': meta['train_tokens'] * itemsize,
                'val.bin': meta['val_tokens'] * itemsize}
    return all((directory / name).stat().st_size == size for name, size in expected.items())
  except (KeyError, TypeError, OSError):
    return False


def _info_from_meta(directory: Path, meta: dict[str, Any]) -> DatasetInfo:
  return DatasetInfo(dir=directory, dtype=meta['dtype'], vocab_size=meta['vocab_size'],
                     train_tokens=meta['train_tokens'], val_tokens=meta['val_tokens'],
                     tokenizer=meta['tokenizer'])


def _text_chunks(path: Path, field: str) -> Iterator[str]:
  """Yields the text of `path` in chunks of whole lines of about `_CHUNK_CHARS` characters."""
  # newline='' keeps '\r\n' as is, so a byte tokenizer stores the file's exact bytes.
  offset = 0
  with open(path, encoding='utf-8', newline='') as f:
    while True:
      try:
        lines = f.readlines(_CHUNK_CHARS)
      except UnicodeDecodeError as e:
        raise _not_utf8_error(path, field, e) from e
      if not lines:
        return
      text = ''.join(lines)
      if '\0' in text:
        raise _binary_error(path, field, offset + text.index('\0'))
      offset += len(text)
      yield text


def _tokenize_to_file(texts: Iterable[str], tokenizer: Tokenizer, dtype: str, path: Path) -> int:
  """Appends the tokens of every text to `path` as little-endian `dtype`; returns their count."""
  stored = np.dtype(dtype).newbyteorder('<')
  count = 0
  with open(path, 'wb') as f:
    for text in texts:
      ids = np.asarray(tokenizer.encode(text))
      # Out-of-range ids would wrap silently in the narrow stored dtype.
      if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        raise ValueError(f'tokenizer {tokenizer.name!r} returned ids in [{ids.min()}, '
                         f'{ids.max()}], outside its vocab_size {tokenizer.vocab_size}')
      f.write(ids.astype(stored).tobytes())
      count += ids.size
    f.flush()
    os.fsync(f.fileno())
  return count


def _move_tail(src: Path, dst: Path, offset: int) -> None:
  """Moves the bytes of `src` from `offset` on into `dst` (overwriting it), truncating `src`."""
  with open(src, 'r+b') as fsrc, open(dst, 'wb') as fdst:
    fsrc.seek(offset)
    shutil.copyfileobj(fsrc, fdst, _COPY_BUFFER_BYTES)
    fdst.flush()
    os.fsync(fdst.fileno())
    fsrc.truncate(offset)
    fsrc.flush()
    os.fsync(fsrc.fileno())
