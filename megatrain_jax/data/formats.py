"""Source formats of `data.path` / `data.val_path` and how they are read, in bounded memory.

A source is a file, a directory (its non-hidden files, sorted) or a glob pattern (`*`, `?`, `[`;
`**` recurses), expanded to a sorted list of files. Each file's format comes from its name:

  *.jsonl, *.jsonl.zst, *.jsonl.gz   one JSON record per line (zstd / gzip streams decompressed
                                     on the fly; a truncated stream is an error)
  *.json (.zst, .gz)                 records: one JSON array of them, or one per line
  *.parquet                          one record per row, read a few batches at a time (pyarrow)
  *.arrow                            one record per row: Arrow IPC files as Hugging Face
                                     `datasets` writes them (`save_to_disk`: the stream format;
                                     the file format too), memory-mapped, a few batches at a time
  anything else                      UTF-8 text, a continuous stream (no documents); a
                                     compressed one (.txt.gz, .parquet.zst, ...) is refused

A directory that `datasets.Dataset.save_to_disk` wrote (state.json beside .arrow files) means its
.arrow files, in state.json's order; a DatasetDict's (dataset_dict.json) is refused naming its
splits, one of which to point at.

Reading is cut into *tasks* (about `CHUNK_BYTES` of lines, rows or record batches), in a fixed
order that depends only on the files: the prepare step tokenizes tasks in parallel and resumes
from a task index. `run_task` (the worker side) turns a task into tokens and a loss mask.
"""

import codecs
import dataclasses
import glob
import gzip
import io
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import zstandard

from megatrain_jax import fs
from megatrain_jax.data import documents
from megatrain_jax.data.documents import BadRecord, DocumentFormat
from megatrain_jax.data.tokenizer import Tokenizer, cut_point, encode_text
from megatrain_jax.errors import ConfigError

TEXT, JSONL, JSON, PARQUET, ARROW = 'text', 'jsonl', 'json', 'parquet', 'arrow'
_JSONL_SUFFIXES = ('.jsonl', '.jsonl.zst', '.jsonl.zstd', '.jsonl.gz', '.ndjson', '.ndjson.zst',
                   '.ndjson.zstd', '.ndjson.gz')
_JSON_SUFFIXES = ('.json', '.json.zst', '.json.zstd', '.json.gz')
# Names of compressed files: only JSON records are read decompressed (open_decompressed).
_COMPRESSED_SUFFIXES = ('.gz', '.zst', '.zstd', '.bz2', '.xz', '.lz4', '.lzma', '.zip', '.7z',
                        '.tgz')
# Bytes of input per task: large enough that a task amortises its trip to a worker, small enough
# that (workers x in-flight tasks) of them stay well within the memory bound.
CHUNK_BYTES = 4 << 20
# Characters of text per task (text_tasks; `--eval` reads text files in the same chunks).
TEXT_CHUNK_CHARS = 8 << 20
# Bytes of each source read during validation (before anything is written).
SNIFF_BYTES = 64 << 10
# Rows per Arrow batch inside a Parquet row group.
_PARQUET_BATCH_ROWS = 4096
# The longest record read (a JSONL line in bytes, a JSON array's record in characters): the
# readers hold one whole.
_MAX_RECORD_CHARS = 256 << 20
# Bad records quoted in an error or a skip report.
MAX_BAD_QUOTED = 3
# The most a sample.prompts file holds (decompressed), read whole: a few prompts are KB.
MAX_PROMPTS_BYTES = 64 << 20


def source_format(path: Path) -> str:
  name = path.name.lower()
  if name.endswith('.parquet'):
    return PARQUET
  if name.endswith(_JSONL_SUFFIXES):
    return JSONL
  if name.endswith('.arrow'):
    return ARROW
  if name.endswith(_JSON_SUFFIXES):
    return JSON
  return TEXT


def _check_compressed(path: Path, field: str) -> None:
  """Refuses a compressed file the readers do not decompress (a .txt.gz): read as text, its
  bytes were refused as binary, with advice for UTF-16 text."""
  if path.name.lower().endswith(_COMPRESSED_SUFFIXES) and source_format(path) == TEXT:
    raise ConfigError(f'{field}: {path} is compressed, and only JSON records are read '
                      'compressed (.jsonl, .ndjson or .json, each .gz or .zst); decompress it '
                      f'(gunzip a .txt.gz to .txt), or remove it from {field}.')


def _has_glob(text: str) -> bool:
  return any(c in text for c in '*?[')


def expand_sources(sources, field: str) -> list[Path]:
  """Resolves sources (files, directories, glob patterns) to absolute files, without reading.

  Directories mean their non-hidden regular files, sorted; a pattern its matches, sorted.

  Raises:
    ConfigError: (naming `field`) if a source does not exist, or a directory or pattern has no
      files.
  """
  files = []
  for source in sources:
    path = Path(source).expanduser()
    if _has_glob(str(source)) and not path.exists():
      matches = _pattern_files(path)
      if not matches:
        raise ConfigError(f'{field}: the pattern {source} matches no files; fix the pattern or '
                          f'point {field} at a file or directory.')
      files.extend(_unique_files(matches))
    elif not path.exists():
      raise ConfigError(f'{field}: {path} does not exist; set {field} to an existing file '
                        '(.txt, .jsonl, .jsonl.zst, .jsonl.gz, .parquet, .arrow), a directory or a '
                        'glob pattern.')
    elif path.is_dir():
      children = _saved_dataset_files(path, field)
      if children is None:
        children = _directory_files(path, field)
      if not children:
        raise ConfigError(f'{field}: directory {path} contains no (non-hidden) files; put data '
                          f'files in it or point {field} at a file.')
      files.extend(_unique_files(children))
    else:
      files.append(path.resolve())
  for file in files:
    _check_compressed(file, field)
  return files


def _unique_files(paths: list[Path]) -> list[Path]:
  """`paths` resolved, each file once in its first place: a directory or pattern may reach one
  file by two names (a symlink beside its target, as `latest.jsonl -> 2024-05.jsonl`), which would
  be read twice. A file named twice in `data.path` itself is read twice, as asked."""
  return list(dict.fromkeys(p.resolve() for p in paths))


def _pattern_files(pattern: Path) -> list[Path]:
  """The non-hidden files a glob pattern matches, sorted (`**` recurses)."""
  matches = sorted(Path(p) for p in glob.glob(str(pattern), recursive=True))
  return [p for p in matches if p.is_file() and not p.name.startswith('.')]


def _directory_files(path: Path, field: str) -> list[Path]:
  """A directory's non-hidden files, sorted, refusing what would be misread: record files beside
  text files (a Hub repository's README.md would be one more document of raw text), or a top level
  without record files whose subdirectories (not read) hold some (a Hub repository's data/)."""
  children, records, texts = _directory_children(path)
  corpus = [c for c in texts if not _is_repository_file(c)]  # text that is data
  nested = [] if records or corpus else _nested_record_files(path)
  if nested:
    only = f' (only {_names(texts)})' if texts else ''
    raise ConfigError(f'{field}: directory {path} holds no record files at its top level{only}, '
                      f'but its subdirectories do ({_names(nested)}), and they are not read; '
                      f'point {field} at {nested[0].parent} or at a pattern such as '
                      f"'{path}/**/*{nested[0].suffix}'.")
  return children


def _directory_children(path: Path) -> tuple[list[Path], list[Path], list[Path]]:
  """(the non-hidden files of directory `path`, sorted; those of them that are records; those
  that are text)."""
  children = sorted(c for c in path.iterdir() if c.is_file() and not c.name.startswith('.'))
  return (children, [c for c in children if source_format(c) != TEXT],
          [c for c in children if source_format(c) == TEXT])


def _is_repository_file(path: Path) -> bool:
  """A file a dataset repository holds beside its data, not data: README.md, LICENSE, ...."""
  name = path.name.lower()
  return name.startswith(('readme', 'license', 'licence', 'citation', 'changelog')) or \
      path.suffix.lower() in ('.md', '.cff', '.gitattributes')


def check_directories(sources, text_documents: bool, field: str) -> None:
  """Refuses a directory source, or a glob pattern, whose files mix record files with text
  files, unless each text file is a document (`text_documents`: data.text_documents): the text
  would run, as raw text without an EOS, into the next record (a Hub repository's README.md
  beside its train.jsonl, matched by 'D/*' as by 'D').

  Raises:
    ConfigError: (naming `field`, the files and the fix).
  """
  if text_documents:
    return
  for source in sources:
    path = Path(source).expanduser()
    if _has_glob(str(source)) and not path.exists():
      what, files = f'the pattern {source}', _pattern_files(path)
    elif path.is_dir() and not (path / 'state.json').is_file():
      what, files = f'directory {path}', _directory_children(path)[0]
    else:
      continue
    records = [f for f in files if source_format(f) != TEXT]
    texts = [f for f in files if source_format(f) == TEXT]
    if records and texts:
      raise ConfigError(f'{field}: {what} mixes record files ({_names(records)}) with '
                        f'text files ({_names(texts)}), which would be read as raw text running '
                        f'into the records; point {field} at the records, e.g. '
                        f"'{records[0].parent}/*{records[0].suffix}', or move the text files out"
                        + (' (or set data.text_documents=True to read each text file as a '
                           'document).' if field.startswith('data.') else '.'))


def _names(files: list[Path]) -> str:
  return ', '.join(f.name for f in files[:3]) + (f' and {len(files) - 3} more'
                                                  if len(files) > 3 else '')


def _nested_record_files(path: Path, limit: int = 3) -> list[Path]:
  """Up to `limit` record files in the non-hidden subdirectories of `path`, in walk order."""
  found = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    if Path(root) != path:
      found += [Path(root) / n for n in sorted(names)
                if not n.startswith('.') and source_format(Path(n)) != TEXT]
    if len(found) >= limit:
      break
  return found[:limit]


def _saved_dataset_files(path: Path, field: str) -> list[Path] | None:
  """The .arrow files of a directory `datasets.Dataset.save_to_disk` wrote (its state.json
  lists them in order), or None if it is not one. A DatasetDict's directory is refused."""
  if (path / 'dataset_dict.json').is_file():
    try:
      splits = json.loads((path / 'dataset_dict.json').read_text())['splits']
    except (OSError, ValueError, KeyError, TypeError):
      splits = sorted(p.name for p in path.iterdir() if (p / 'state.json').is_file())
    raise ConfigError(f'{field}: {path} is a Hugging Face DatasetDict (splits: '
                      f'{", ".join(splits)}); point {field} at one split\'s directory, e.g. '
                      f'{path / splits[0] if splits else path / "train"}.')
  if not (path / 'state.json').is_file():
    return None
  try:
    names = [f['filename'] for f in json.loads((path / 'state.json').read_text())['_data_files']]
  except (OSError, ValueError, KeyError, TypeError):
    names = sorted(p.name for p in path.glob('*.arrow'))
  for name in names:
    fs.inside_or_refuse(path, name, f'{field}: {path}/state.json lists a file outside {path} '
                        '({reason}), and a saved dataset holds its own files only; save the '
                        'dataset again (save_to_disk) or copy it whole.')
  missing = [n for n in names if not (path / n).is_file()]
  if missing:
    raise ConfigError(f'{field}: {path}/state.json lists {", ".join(missing)}, which is not '
                      'there; save the dataset again (save_to_disk) or copy it whole.')
  return [path / n for n in names]


# --- text --------------------------------------------------------------------------------------


def binary_error(path: Path, field: str, head: bytes | None = None) -> ConfigError:
  """The error for a file holding a NUL: the first one's byte offset and line, in `head` (the
  file's first bytes, decompressed where the file is), else found in the file again (text read
  decoded, whose character offsets are not byte offsets)."""
  if head is None:
    offset, line = _first_nul(path)
  else:
    offset = head.index(b'\0')
    line = head.count(b'\n', 0, offset) + 1
  where = ' of its decompressed bytes' if path.name.lower().endswith(_COMPRESSED_SUFFIXES) else ''
  return ConfigError(f'{field}: {path} looks like a binary file, not text (a NUL character at '
                     f'offset {offset}{where} (line {line})); point {field} at UTF-8 text '
                     f'(convert UTF-16 text to UTF-8), or remove the file from {field}.')


def _first_nul(path: Path) -> tuple[int, int]:
  """(byte offset, line) of the first NUL byte of `path` ((-1, -1) if none)."""
  done, lines = 0, 1
  with open(path, 'rb') as f:
    while block := f.read(1 << 20):
      at = block.find(b'\0')
      if at >= 0:
        return done + at, lines + block.count(b'\n', 0, at)
      done += len(block)
      lines += block.count(b'\n')
  return -1, -1


def not_utf8_error(path: Path, field: str, error: UnicodeDecodeError) -> ConfigError:
  """The error for a file that is not UTF-8; `error`'s position is within the block decoded, so
  the first bad byte's offset and line in the file are found again."""
  where = _first_bad_utf8(path) or str(error)
  return ConfigError(f'{field}: {path} is not UTF-8 text ({where}); convert it to UTF-8 or '
                     f'remove it from {field}.')


def _first_bad_utf8(path: Path) -> str | None:
  """Where the first byte of `path` that is not UTF-8 is ('byte 0xe9 at offset 100003 (line
  12): invalid continuation byte'), or None."""
  decoder, done, lines = codecs.getincrementaldecoder('utf-8')(), 0, 1
  with open(path, 'rb') as f:
    while block := f.read(1 << 20):
      try:
        decoder.decode(block)
      except UnicodeDecodeError as e:
        # The decoder holds back an unfinished character's bytes: `e.start` counts from them.
        at = done - (len(e.object) - len(block)) + e.start
        line = lines + e.object[:e.start].count(b'\n')
        return f'byte 0x{e.object[e.start]:02x} at offset {at} (line {line}): {e.reason}'
      done += len(block)
      lines += block.count(b'\n')
  return None


def check_text_head(path: Path, field: str) -> None:
  """Refuses `path` if its first `SNIFF_BYTES` are not UTF-8 text or hold a NUL."""
  with open(path, 'rb') as f:
    head = f.read(SNIFF_BYTES)
  if b'\0' in head:
    raise binary_error(path, field, head)
  try:
    # final=False: the sniffed prefix may end inside a multi-byte character.
    codecs.getincrementaldecoder('utf-8')().decode(head, final=len(head) < SNIFF_BYTES)
  except UnicodeDecodeError as e:
    raise not_utf8_error(path, field, e) from e


@dataclasses.dataclass(frozen=True)
class TextTask:
  """A chunk of whole lines of a text file, already decoded (the reader checks UTF-8 and NUL);
  `first` / `last`: the file's first / last chunk (with data.text_documents the file is one
  document: BOS before its first chunk, EOS after its last)."""
  text: str
  first: bool = False
  last: bool = False


def text_tasks(path: Path, field: str, chunk_chars: int, tokenizer: Tokenizer | None = None,
               exact: bool = False) -> Iterator[tuple[TextTask, int]]:
  """(task, bytes of the file read so far) for chunks of about `chunk_chars`: whole lines, or
  with `tokenizer`, cut where its ids do not change (tokenizer.cut_point), so the chunks encode
  to the ids of the whole file; where no cut passes (a tokenizer that prepends '▁' to every
  text), at whole lines, or with `exact` (`--eval`, which promises the ids of the whole file)
  not at all: the chunk grows until a cut passes. A UTF-8 BOM is not text: dropped."""
  held = None  # each chunk is yielded once the next is read: is it the last?
  for text, done in _text_chunks(path, field, chunk_chars, tokenizer, exact):
    if held is not None:
      yield held
    held = TextTask(text, first=held is None), done
  if held is not None:
    yield dataclasses.replace(held[0], last=True), held[1]


def _text_chunks(path: Path, field: str, chunk_chars: int, tokenizer: Tokenizer | None,
                 exact: bool) -> Iterator[tuple[str, int]]:
  offset, carry = 0, ''  # carry: the text after the last cut, which starts the next chunk
  # newline='' keeps '\r\n' as is, so a byte tokenizer stores the file's exact bytes.
  with open(path, encoding='utf-8', newline='') as f:
    while True:
      try:
        lines = _read_lines(f, chunk_chars)
      except UnicodeDecodeError as e:
        raise not_utf8_error(path, field, e) from e
      new = ''.join(lines)
      if '\0' in new:
        raise binary_error(path, field)  # its byte offset: `new` is characters
      if offset == 0 and not carry and new.startswith('\ufeff'):
        new = new[1:]  # a BOM marks the encoding (JSONL's reader drops it too)
      text, carry = carry + new, ''
      if len(new) >= chunk_chars and tokenizer is not None:  # more follows: cut the text
        at = cut_point(tokenizer, text, len(text) - len(text) // 4)
        if at > 0:
          text, carry = text[:at], text[at:]
        elif exact:  # no cut keeps the ids: read on
          carry = text
          continue
      if not text:
        break
      yield text, f.buffer.tell()
      offset += len(text)


def _read_lines(f, hint: int) -> list[str]:
  """f.readlines(hint): lines until they hold more than `hint` characters, except that a line
  longer than `hint` comes in pieces of `hint`, each a chunk (readlines read a line whole: a
  600 MB text without a newline took >8 GB). Shorter lines are the chunks readlines gave."""
  lines, length = [], 0
  while line := f.readline(hint):
    lines.append(line)
    piece = len(line) == hint and line[-1] not in '\r\n'  # of a line longer than `hint`
    if len(line) > hint - length or piece:
      break
    length += len(line)
  return lines


# --- JSONL -------------------------------------------------------------------------------------


class TruncatedError(ValueError):
  """A compressed stream ended before its end marker."""


# What one feed of the zstd decompressor gathers (a block's at most more) before a read takes it.
_ZSTD_FEED_OUTPUT = 1 << 20


class _ZstdReader(io.RawIOBase):
  """A zstd stream decompressed on the fly (multi-frame files included); unlike
  zstandard's stream_reader it raises TruncatedError when the input ends inside a frame.

  The decompressor is fed one part of the stream at a time (a frame header, a block, found from
  their headers here), so a feed's output is bounded: a block decompresses to 128 KB at most,
  and a few KB of input may hold gigabytes (a 131 KB file of 4 GiB was decompressed whole)."""

  def __init__(self, raw):
    super().__init__()
    self._raw = raw
    self._dobj = zstandard.ZstdDecompressor().decompressobj()
    self._input, self._at = b'', 0  # input not fed yet: self._input[self._at:]
    self._pending, self._done = b'', 0  # output not read yet: self._pending[self._done:]
    self._in_frame = False
    # The stream part at self._at ('frame', 'block' or 'checksum'), the bytes left of the part
    # being fed, and whether the frame ends with a checksum.
    self._part, self._left, self._checksum = 'frame', 0, False

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    while self._done == len(self._pending):
      if not self._feed():
        if self._in_frame:
          raise TruncatedError('the zstd stream ends inside a frame (truncated file)')
        return 0
    n = min(len(buffer), len(self._pending) - self._done)
    buffer[:n] = memoryview(self._pending)[self._done:self._done + n]
    self._done += n
    return n

  def _read_input(self) -> bool:
    block = self._raw.read(1 << 20)
    self._input, self._at = self._input[self._at:] + block, 0
    return bool(block)

  def _feed(self) -> bool:
    """Decompresses the next parts into _pending, about _ZSTD_FEED_OUTPUT at most; False at
    the end of the input."""
    out, size = [], 0
    while size < _ZSTD_FEED_OUTPUT:
      if self._at == len(self._input) and not self._read_input():
        break
      if self._left == 0:
        self._left = self._part_size()
        if self._left == 0:  # its header is not all read yet
          if not self._read_input():  # a header cut short: fed as it is (a truncated frame)
            self._left = len(self._input) - self._at
          continue
      chunk = self._input[self._at:self._at + self._left]
      self._at += len(chunk)
      self._left -= len(chunk)
      while chunk:
        self._in_frame = True
        out.append(self._dobj.decompress(chunk))
        size += len(out[-1])
        if not self._dobj.eof:
          break
        self._in_frame = False
        chunk = self._dobj.unused_data
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
    self._pending, self._done = b''.join(out), 0
    return size > 0

  def _part_size(self) -> int:
    """Bytes of the stream part at _at (RFC 8878: a frame's magic and header, a block with its
    header, a checksum, a skippable frame), noting the part after it; 0 while its header is not
    all read. Bytes that are no zstd frame are the decompressor's to refuse."""
    data, at = self._input, self._at
    if self._part == 'checksum':
      self._part = 'frame'
      return 4
    if self._part == 'block':
      if len(data) - at < 3:
        return 0
      header = int.from_bytes(data[at:at + 3], 'little')
      if header & 1:  # the frame's last block
        self._part = 'checksum' if self._checksum else 'frame'
      return 3 + (1 if header >> 1 & 3 == 1 else header >> 3)  # an RLE block holds one byte
    if len(data) - at < 8:
      return 0
    if int.from_bytes(data[at:at + 4], 'little') >> 4 == 0x184D2A5:  # a skippable frame
      return 8 + int.from_bytes(data[at + 4:at + 8], 'little')
    descriptor = data[at + 4]
    single = descriptor >> 5 & 1
    self._part, self._checksum = 'block', bool(descriptor >> 2 & 1)
    return (5 + (not single) + (0, 1, 2, 4)[descriptor & 3] +
            (single, 2, 4, 8)[descriptor >> 6])


class _Read1(io.RawIOBase):
  """A buffered stream read as raw: each read returns what is decompressed so far, so the lines
  before a truncated end are read (GzipFile.read(n) raises, losing up to n bytes read)."""

  def __init__(self, stream):
    super().__init__()
    self._stream = stream

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    data = self._stream.read1(len(buffer))
    buffer[:len(data)] = data
    return len(data)


def open_decompressed(path: Path, raw) -> io.BufferedReader:
  """The decompressed byte stream of `raw` (an open file of `path`), by extension."""
  name = path.name.lower()
  if name.endswith(('.zst', '.zstd')):
    return io.BufferedReader(_ZstdReader(raw), 1 << 20)
  if name.endswith('.gz'):
    return io.BufferedReader(_Read1(gzip.GzipFile(fileobj=raw, mode='rb')), 1 << 20)
  return io.BufferedReader(raw, 1 << 20) if not isinstance(raw, io.BufferedReader) else raw


_STREAM_ERRORS = (TruncatedError, EOFError, OSError, zlib.error, zstandard.ZstdError)


def stream_error(path: Path, field: str, line: int, error: Exception) -> ConfigError:
  return ConfigError(f'{field}: {path}: cannot read past line {line} ({type(error).__name__}: '
                     f'{error}); the file is truncated or corrupt: download or compress it again, '
                     f'or remove it from {field}.')


@dataclasses.dataclass(frozen=True)
class JsonlTask:
  """Whole lines of a JSONL file: `data` (bytes, decompressed), its first line number (1-based);
  or records of a JSON array, one a line, with the line each starts at in the file (`lines`)."""
  file: str
  first_line: int
  data: bytes
  lines: tuple[int, ...] = ()
  too_long: tuple[int, ...] = ()  # lines longer than _MAX_RECORD_CHARS, not read (blank here)


def jsonl_tasks(path: Path, field: str,
                chunk_bytes: int | None = None) -> Iterator[tuple[JsonlTask, int]]:
  """(task, compressed bytes read so far): whole lines, about `chunk_bytes` (default
  CHUNK_BYTES) per task."""
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  line = 1
  with open(path, 'rb') as raw:
    stream = open_decompressed(path, raw)
    while True:
      lines, size, too_long = [], 0, []
      try:  # line by line, so a truncated stream is reported after the last whole line read
        while size < chunk_bytes and (text := stream.readline(_MAX_RECORD_CHARS + 1)):
          if len(text) > _MAX_RECORD_CHARS:  # a bad record, passed over a piece at a time
            while not text.endswith(b'\n') and (text := stream.readline(1 << 20)):
              pass
            too_long.append(line + len(lines))
            text = b'\n'
          lines.append(text)
          size += len(text)
      except _STREAM_ERRORS as e:
        raise stream_error(path, field, line - 1 + len(lines), e) from e
      if not lines:
        return
      yield JsonlTask(str(path), line, b''.join(lines), too_long=tuple(too_long)), raw.tell()
      line += len(lines)


def _jsonl_documents(task: JsonlTask, fmt: DocumentFormat, bad: list) -> list:
  docs = []
  for index, raw_line in enumerate(task.data.splitlines()):
    number = task.lines[index] if task.lines else task.first_line + index
    if number in task.too_long:
      bad.append(f'{task.file}:{number}: a line of more than {_MAX_RECORD_CHARS >> 20} MB, '
                 'longer than a record may be (is the file one JSON record per line?)')
      continue
    if not raw_line.strip():
      continue
    try:
      try:
        # Decoded strictly here: json.loads(bytes) decodes with 'surrogatepass', so invalid
        # UTF-8 that encodes a surrogate (bytes ED A0 80) became a lone '\ud800' in the text.
        record = fs.json_loads(raw_line.decode('utf-8-sig'))
      except UnicodeDecodeError as e:
        raise BadRecord(f'not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start} of '
                        f'the line: {e.reason}); convert the file to UTF-8') from e
      except ValueError as e:
        raise BadRecord(f'malformed JSON ({e})') from e
      parts = documents.record_parts(record, fmt)
      if _SURROGATE_ESCAPE.search(raw_line):  # rare: look for what the escape decoded to
        _check_no_lone_surrogate(parts)
      docs.append(parts)
    except BadRecord as e:
      bad.append(f'{task.file}:{number}: {e}')
  return docs


# JSON may escape half of a UTF-16 surrogate pair alone ("\ud800"): json.loads makes it a code
# point that no UTF-8 text holds, which the tokenizers cannot encode (a TypeError in Hugging
# Face's).
_SURROGATE_ESCAPE = re.compile(rb'\\u[dD][89a-fA-F]')
_LONE_SURROGATE = re.compile('[\ud800-\udfff]')


def _check_no_lone_surrogate(parts: list) -> None:
  for text, _ in parts:
    found = _LONE_SURROGATE.search(text)
    if found:
      raise BadRecord(f'a lone surrogate escape \\u{ord(found.group()):04x} (half of a UTF-16 '
                      'pair, not a character) in a text; write the character itself, or the '
                      'whole pair')


# --- JSON (.json): one array of records, or JSON lines ------------------------------------------


def json_is_array(path: Path) -> bool:
  """Whether a .json(.gz/.zst) file holds a JSON array (its first non-blank character is '['),
  not lines."""
  head = b''
  with open(path, 'rb') as raw:
    stream = open_decompressed(path, raw)
    try:
      while (len(head) < SNIFF_BYTES and not head.removeprefix(codecs.BOM_UTF8).strip() and
             (block := stream.read1(SNIFF_BYTES))):
        head += block
    except _STREAM_ERRORS:
      pass  # a truncated stream: its reader names it
  return head.removeprefix(codecs.BOM_UTF8).lstrip().startswith(b'[')


_DECODER = json.JSONDecoder()
_BLANK = re.compile(r'[ \t\r\n]*')  # JSON's whitespace


class _JsonArray:
  """The records of a file holding one JSON array, read a block at a time (bounded memory):
  each as one line of JSON (its text, the newlines between its tokens made spaces)."""

  def __init__(self, path: Path, field: str, raw):
    self.path, self.field, self.raw = path, field, raw  # raw: the file, read decompressed
    self.stream = open_decompressed(path, raw)
    self.buf, self.pos, self.line, self.eof = '', 0, 1, False  # line: the line at buf[pos]
    self._utf8 = codecs.getincrementaldecoder('utf-8-sig')()

  def _more(self) -> bool:
    try:
      block = self.stream.read(1 << 20)
    except _STREAM_ERRORS as e:
      raise stream_error(self.path, self.field, self.line, e) from e
    try:
      text = self._utf8.decode(block, final=not block)
    except UnicodeDecodeError as e:
      raise not_utf8_error(self.path, self.field, e) from e
    self.buf, self.pos, self.eof = self.buf[self.pos:] + text, 0, not block
    return bool(block)

  def _advance(self, to: int) -> None:
    self.line += self.buf.count('\n', self.pos, to)
    self.pos = to

  def _next_char(self) -> str:
    """The next non-blank character (not consumed), '' at the end of the file."""
    while True:
      self._advance(_BLANK.match(self.buf, self.pos).end())
      if self.pos < len(self.buf):
        return self.buf[self.pos]
      if not self._more():
        return ''

  def error(self, what: str) -> ConfigError:
    return ConfigError(f'{self.field}: {self.path} line {self.line}: {what}; a .json file holds '
                       'one JSON array of records ([{...}, ...]) or one record per line: fix it, '
                       'or write it as JSON lines (.jsonl).')

  def _record(self) -> str:
    while True:
      try:
        _, end = _DECODER.raw_decode(self.buf, self.pos)
        if end < len(self.buf) or self.eof:  # else a number might go on in the next block
          return self.buf[self.pos:end]
      except RecursionError as e:  # fs.json_loads' case: deeper than Python parses
        raise self.error(f'malformed JSON (nested deeper than Python reads JSON: {e})') from e
      except ValueError as e:
        if self.eof or len(self.buf) - self.pos > _MAX_RECORD_CHARS:
          raise self.error(f'malformed JSON ({e})') from e
      self._more()

  def records(self) -> Iterator[tuple[bytes, int, int]]:
    """(record as one line, the line it starts at, bytes of the file read so far)."""
    if self._next_char() != '[':
      raise self.error("expected '['")
    self._advance(self.pos + 1)
    char = self._next_char()
    while char != ']':
      text, line = self._record(), self.line
      self._advance(self.pos + len(text))
      yield text.replace('\n', ' ').replace('\r', ' ').encode('utf-8'), line, self.raw.tell()
      char = self._next_char()
      if char == ',':
        self._advance(self.pos + 1)
        self._next_char()
      elif char != ']':
        raise self.error("expected ',' or ']' after a record")
    self._advance(self.pos + 1)
    if self._next_char():
      raise self.error('more after the array')


def json_array_tasks(path: Path, field: str,
                     chunk_bytes: int | None = None) -> Iterator[tuple[JsonlTask, int]]:
  """(task, bytes read so far) of a file holding a JSON array: about `chunk_bytes` (default
  CHUNK_BYTES) of records per task."""
  chunk_bytes = chunk_bytes or CHUNK_BYTES
  lines, numbers, size, number = [], [], 0, 1
  with open(path, 'rb') as raw:
    for record, line, done in _JsonArray(path, field, raw).records():
      lines.append(record)
      numbers.append(line)
      size += len(record)
      if size >= chunk_bytes:
        yield JsonlTask(str(path), number, b'\n'.join(lines), tuple(numbers)), done
        number, lines, numbers, size = number + len(lines), [], [], 0
    if lines:
      yield JsonlTask(str(path), number, b'\n'.join(lines), tuple(numbers)), raw.tell()


# --- Parquet -----------------------------------------------------------------------------------


def parquet_columns(path: Path, fmt: DocumentFormat, field: str) -> list[str]:
  """The columns a Parquet file's records are read from, by the same rule as JSON records.

  Raises:
    ConfigError: (naming `field` and the file) if it is not Parquet or has none of them.
  """
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (only Parquet needs it)
  try:
    names = pq.ParquetFile(path).schema_arrow.names
  except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
    raise ConfigError(f'{field}: {path} is not a readable Parquet file ({e}).') from e
  return _record_columns(names, path, fmt, field)


# The columns a record may be read from besides data.text_field / prompt_field / completion_field
# (documents.record_parts: chat, its tools, ShareGPT, Alpaca and Dolly): every one a table holds
# is read, so a row is the record its JSONL line would be.
_RECORD_COLUMNS = (documents.MESSAGES_FIELD, documents.SHAREGPT_FIELD, documents.TOOLS_FIELD,
                   documents.ALPACA_INSTRUCTION, *documents.ALPACA_OUTPUT,
                   *documents.ALPACA_INPUT, 'system')


def _record_columns(names: list[str], path: Path, fmt: DocumentFormat, field: str) -> list[str]:
  """Of a table's column `names`: those its records are read from (`parquet_columns`)."""
  wanted = (fmt.text_field, fmt.prompt_field, fmt.completion_field, *_RECORD_COLUMNS)
  columns = [name for name in names if name in wanted]
  has = set(columns)
  if not ({fmt.prompt_field, fmt.completion_field} <= has or has & {
      fmt.text_field, documents.MESSAGES_FIELD, documents.SHAREGPT_FIELD} or (
          documents.ALPACA_INSTRUCTION in has and has & set(documents.ALPACA_OUTPUT))):
    raise ConfigError(f'{field}: {path} has no column {fmt.text_field!r} (nor '
                      f'{fmt.prompt_field!r}+{fmt.completion_field!r}, '
                      f'{documents.MESSAGES_FIELD!r}, {documents.SHAREGPT_FIELD!r} or '
                      f'{documents.ALPACA_INSTRUCTION!r}+{documents.ALPACA_OUTPUT[0]!r}); its '
                      f'columns: {", ".join(names[:12])}. Set data.text_field to the column '
                      'holding the text.')
  return columns


@dataclasses.dataclass(frozen=True)
class ParquetTask:
  """Rows of one Parquet row group, read by `parquet_tasks`: `batches`, pyarrow record batches
  of the record columns; `first_row` is their first row's index in the file."""
  file: str
  row_group: int
  first_row: int
  columns: tuple[str, ...]
  batches: tuple = ()
  field: str = 'data.path'  # the option that named the file (an error names it)


def parquet_tasks(path: Path, fmt: DocumentFormat,
                  field: str) -> Iterator[tuple[ParquetTask, int]]:
  """(task, bytes of the file read so far): the rows of each row group, read here a batch at a
  time and cut into tasks of about CHUNK_BYTES. A row group is not one task: pandas and pyarrow
  write up to a million rows in one (1M rows of 1 KB held as documents took >8 GB).

  Raises:
    ConfigError: (naming `field`, the file and the row group) where a row group cannot be read:
      a damaged page (its footer, read up front, may be intact), or a file cut short.
  """
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  columns = tuple(parquet_columns(path, fmt, field))
  # buffer_size: a column chunk is read a page at a time, not whole.
  file = pq.ParquetFile(path, buffer_size=1 << 20)
  metadata = file.metadata
  groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
  scale = path.stat().st_size / max(sum(g.total_byte_size for g in groups), 1)
  row, done = 0, 0.0
  for group, info in enumerate(groups):
    first, held, size = row, [], 0
    for batch in _row_group_batches(file, path, group, columns, row, field):
      held.append(batch)
      size += batch.nbytes
      row += batch.num_rows
      if size >= CHUNK_BYTES:
        done += scale * info.total_byte_size * (row - first) / max(info.num_rows, 1)
        yield ParquetTask(str(path), group, first, columns, tuple(held), field), int(done)
        first, held, size = row, [], 0
    if held:
      done += scale * info.total_byte_size * (row - first) / max(info.num_rows, 1)
      yield ParquetTask(str(path), group, first, columns, tuple(held), field), int(done)


def _row_group_batches(file, path: Path, group: int, columns: tuple[str, ...], first_row: int,
                       field: str):
  """The record batches of one row group of `file` (a pq.ParquetFile of `path`), of about
  CHUNK_BYTES at most (fewer rows than _PARQUET_BATCH_ROWS where the rows are long); a read error a
  ConfigError naming the row group."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  info = file.metadata.row_group(group)
  rows = CHUNK_BYTES * info.num_rows // max(info.total_byte_size, 1)
  try:
    yield from file.iter_batches(batch_size=max(1, min(_PARQUET_BATCH_ROWS, rows)),
                                 row_groups=[group], columns=list(columns))
  except (pa.ArrowException, OSError) as e:  # pyarrow's OSError: 'Corrupt snappy compressed data.'
    raise ConfigError(f'{field}: {path}: row group {group} (rows from {first_row}) cannot be '
                      f'read ({type(e).__name__}: {e}); the file is damaged: download or write it '
                      f'again, or remove it from {field}.') from e


def _parquet_documents(task: ParquetTask, fmt: DocumentFormat, bad: list) -> list:
  """The documents of a task's rows."""
  docs, row = [], task.first_row
  for batch in task.batches:
    row = _batch_documents(batch, task, row, fmt, docs, bad)
  return docs


def _batch_documents(batch, task, row: int, fmt: DocumentFormat, docs: list, bad: list) -> int:
  """Appends the documents of an Arrow record batch's rows (the columns of `task`, a
  ParquetTask or ArrowTask) to `docs`, a bad record's 'file: row N: why' to `bad`; returns the
  next row's index.

  Raises:
    ConfigError: (naming the task's field, the file and rows) a batch whose strings are not
      UTF-8 or whose offsets run outside its buffers (a damaged file: reading checks neither).
  """
  columns, file, field = task.columns, task.file, task.field
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  try:
    batch.validate(full=True)
  except pa.ArrowInvalid as e:
    raise ConfigError(f'{field}: {file}: rows {row} to {row + batch.num_rows - 1} cannot be '
                      f'read ({e}); the file is damaged: download or write it again, or remove '
                      f'it from {field}.') from e
  values = [batch.column(name).to_pylist() for name in columns]
  for record_values in zip(*values):
    try:
      docs.append(documents.record_parts(dict(zip(columns, record_values)), fmt))
    except BadRecord as e:
      bad.append(f'{file}: row {row}: {e}')
    row += 1
  return row


# --- Arrow IPC (Hugging Face datasets' save_to_disk) -------------------------------------------


def _arrow_batches(path: Path, field: str):
  """(schema, iterator of the record batches) of an Arrow IPC file, stream or file format,
  memory-mapped: a batch is read only when reached, and not copied.

  Raises:
    ConfigError: (naming `field` and the file) if it is neither, or, while iterating, where a
      batch cannot be read (a truncated or damaged file).
  """
  import pyarrow as pa  # pylint: disable=g-import-not-at-top  (only Arrow and Parquet need it)
  source = pa.memory_map(str(path))
  try:
    reader = pa.ipc.open_stream(source)
    return reader.schema, _checked_batches(path, field, iter(reader))
  except (pa.ArrowException, OSError):  # random bytes: 'negative continuation token', an OSError
    pass
  try:
    reader = pa.ipc.open_file(source)
  except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
    raise ConfigError(f'{field}: {path} is not a readable Arrow IPC file ({e}).') from e
  return reader.schema, _checked_batches(
      path, field, (reader.get_batch(i) for i in range(reader.num_record_batches)))


def _checked_batches(path: Path, field: str, batches):
  """`batches`, a reader's error (a stream cut short: 'Expected to be able to read 2552 bytes
  for message body, got 2512') a ConfigError naming the file and the batch."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  index = 0
  try:
    for batch in batches:
      yield batch
      index += 1
  except (pa.ArrowException, OSError) as e:
    raise ConfigError(f'{field}: {path} is not a readable Arrow IPC file (record batch {index}: '
                      f'{e}); it is truncated or damaged: save or download it again, or remove '
                      f'it from {field}.') from e


@dataclasses.dataclass(frozen=True)
class ArrowTask:
  """Record batches first_batch .. first_batch + batches - 1 of an Arrow file; `first_row` is the
  first one's first row's index in the file."""
  file: str
  first_batch: int
  batches: int
  first_row: int
  columns: tuple[str, ...]
  field: str = 'data.path'  # the option that named the file (an error names it)


def arrow_tasks(path: Path, fmt: DocumentFormat, field: str) -> Iterator[tuple[ArrowTask, int]]:
  """(task, bytes of the records' columns so far): consecutive batches of about CHUNK_BYTES."""
  schema, batches = _arrow_batches(path, field)
  columns = tuple(_record_columns(schema.names, path, fmt, field))
  first = count = row = first_row = done = size = 0
  for count, batch in enumerate(batches, 1):
    size += sum(batch.column(name).nbytes for name in columns)
    row += batch.num_rows
    if size >= CHUNK_BYTES:
      done += size
      yield ArrowTask(str(path), first, count - first, first_row, columns, field), done
      first, first_row, size = count, row, 0
  if count > first:
    yield ArrowTask(str(path), first, count - first, first_row, columns, field), done + size


def _arrow_documents(task: ArrowTask, fmt: DocumentFormat, bad: list) -> list:
  docs, row = [], task.first_row
  _, batches = _arrow_batches(Path(task.file), task.field)
  for index, batch in enumerate(batches):
    if index >= task.first_batch + task.batches:
      break
    if index >= task.first_batch:
      row = _batch_documents(batch, task, row, fmt, docs, bad)
  return docs


def record_tasks(path: Path, fmt: DocumentFormat, field: str) -> Iterator[tuple[Any, int]]:
  """(task, input bytes so far) of a record file: JSONL(.zst/.gz), Parquet or Arrow."""
  kind = source_format(path)
  if path.stat().st_size == 0:  # an empty file holds no records, whatever its format
    return iter(())
  if kind == JSONL or (kind == JSON and not json_is_array(path)):
    return jsonl_tasks(path, field)
  if kind == JSON:
    return json_array_tasks(path, field)
  if kind == PARQUET:
    return parquet_tasks(path, fmt, field)
  return arrow_tasks(path, fmt, field)


# --- the worker side -----------------------------------------------------------------------------


@dataclasses.dataclass
class TaskResult:
  tokens: np.ndarray
  mask: np.ndarray | None  # None: every token is learned
  ends: np.ndarray | None  # [documents] int64: where each document ends in `tokens`; None: text
  documents: int
  skipped: int
  bad: list[str]  # the first few bad records, 'file:line: why'
  text_bytes: int


def run_task(task: Any, tokenizer: Tokenizer, fmt: DocumentFormat | None,
             dtype: np.dtype) -> TaskResult:
  """Tokens (and mask) of one task. Bad records are counted and quoted, never raised: the
  caller decides (fail or skip)."""
  if isinstance(task, TextTask):
    ids = encode_text(tokenizer, task.text).astype(np.int64)  # in pieces: bounded memory
    document = fmt is not None and fmt.text_documents  # the file is one [BOS] text EOS
    if document:
      ids = np.concatenate([[fmt.bos] if task.first and fmt.bos is not None else [], ids,
                            [fmt.eos] if task.last else []]).astype(np.int64)
    tokens = ids.astype(dtype)
    documents.check_ids(tokens, tokenizer)
    ends = np.array([len(tokens)] if document and task.last else [], np.int64)
    return TaskResult(tokens, None, ends if document else None, int(document and task.last), 0,
                      [], len(task.text))
  bad: list[str] = []
  if isinstance(task, JsonlTask):
    docs, size = _jsonl_documents(task, fmt, bad), len(task.data)
  else:
    docs = (_parquet_documents(task, fmt, bad) if isinstance(task, ParquetTask) else
            _arrow_documents(task, fmt, bad))
    size = sum(len(text) for parts in docs for text, _ in parts)
  tokens, mask, ends = documents.encode_documents(docs, tokenizer, fmt, dtype)
  documents.check_ids(tokens, tokenizer)
  return TaskResult(tokens, mask, ends, len(docs), len(bad), bad[:MAX_BAD_QUOTED], size)


# --- validation before anything is written ----------------------------------------------------


def _check_jsonl_head(path: Path, fmt: DocumentFormat, field: str) -> int:
  """Parses the records in the first `SNIFF_BYTES` (the whole file if smaller, which also
  finds a truncated small file); returns how many were read, or -1 if the file is longer."""
  head = b''
  with open(path, 'rb') as raw:
    stream = open_decompressed(path, raw)
    try:  # in blocks, so a truncated stream is reported after the last whole line read
      while len(head) <= SNIFF_BYTES and (block := stream.read1(8192)):
        head += block
    except _STREAM_ERRORS as e:
      raise stream_error(path, field, head.count(b'\n'), e) from e
  head = head[:SNIFF_BYTES + 1]
  if b'\0' in head:  # UTF-16 (or binary): every line would be malformed JSON
    raise binary_error(path, field, head)
  complete = len(head) <= SNIFF_BYTES
  if not complete:
    head = head[:head.rfind(b'\n') + 1]
  bad: list[str] = []
  docs = _jsonl_documents(JsonlTask(str(path), 1, head), fmt, bad)
  if bad and not fmt.skip_bad_records:
    raise bad_records_error(bad, len(bad), field)
  return len(docs) if complete else -1


def _check_json_array_head(path: Path, fmt: DocumentFormat, field: str) -> int:
  """`_check_jsonl_head` for a JSON array: the records in its first `SNIFF_BYTES`."""
  task = next(json_array_tasks(path, field, SNIFF_BYTES), (None, 0))[0]
  if task is None:
    return 0
  bad: list[str] = []
  docs = _jsonl_documents(task, fmt, bad)
  if bad and not fmt.skip_bad_records:
    raise bad_records_error(bad, len(bad), field)
  return -1 if len(task.data) >= SNIFF_BYTES else len(docs)


def check_head(path: Path, fmt: DocumentFormat | None, field: str) -> int:
  """Checks what can be checked cheaply before writing: text is UTF-8, the first JSON records
  parse and hold the fields, a Parquet or Arrow file has the column. Returns the file's record
  count when known (a small JSONL file, any Parquet or Arrow file; the byte size for text), else
  -1."""
  kind = source_format(path)
  if kind == TEXT or path.stat().st_size == 0:  # an empty Parquet/Arrow file: empty, as JSONL
    check_text_head(path, field)
    return path.stat().st_size
  if fmt is None:
    raise ValueError('a document format is needed for record sources')
  if kind == JSONL or (kind == JSON and not json_is_array(path)):
    return _check_jsonl_head(path, fmt, field)
  if kind == JSON:
    return _check_json_array_head(path, fmt, field)
  if kind == ARROW:
    schema, batches = _arrow_batches(path, field)
    _record_columns(schema.names, path, fmt, field)
    return sum(batch.num_rows for batch in batches)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  parquet_columns(path, fmt, field)
  return pq.ParquetFile(path).metadata.num_rows


def bad_records_error(bad: list[str], count: int, field: str) -> ConfigError:
  """The error for `count` bad records, of which `bad` quotes the first few (one is shown)."""
  more = f' (and {count - 1} more)' if count > 1 else ''
  return ConfigError(f'{field}: bad record {bad[0]}{more}. Fix the data, or set '
                     'data.skip_bad_records=True to skip (and count) bad records.')


# --- prompts to continue (`--sample` with sample.prompts) ---------------------------------------

def read_prompts(path: str | Path, prompt_field: str = 'prompt') -> list:
  """The prompts of a `sample.prompts` file, in file order: a text file's non-blank lines (each
  one prompt), or a JSONL(.zst/.gz) file's records (or a .json file's: an array, or lines),
  each a prompt string in `prompt_field`, a chat `messages` list (continued as the assistant's
  next turn) or an Alpaca record (the dict, rendered as training renders it up to its output).

  Raises:
    ConfigError: (naming `sample.prompts`) a missing or unreadable file, a Parquet or Arrow file,
      a line that is not a JSON record, a record with none of those, or no prompts at all.
  """
  field, path = 'sample.prompts', Path(path).expanduser()
  kind = source_format(path)
  if not path.is_file() or kind in (PARQUET, ARROW):
    raise ConfigError(f'{field}={str(path)!r}: ' + ('not a file' if not path.is_file() else
                      'a Parquet/Arrow file') + '; give a text file (one prompt per line) or a '
                      f"JSONL file of records with {prompt_field!r}, 'messages' or Alpaca's "
                      "'instruction'.")
  try:
    with open(path, 'rb') as raw:
      # utf-8-sig: a BOM that starts the file is not part of the first prompt (as in training).
      lines = fs.read_at_most(path, MAX_PROMPTS_BYTES, field, 'prompts are read whole: give '
                              'fewer (split the file)', open_decompressed(path, raw)
                              ).decode('utf-8-sig').splitlines()
  except UnicodeDecodeError as e:
    raise not_utf8_error(path, field, e) from e
  except _STREAM_ERRORS as e:
    raise stream_error(path, field, 0, e) from e
  if kind == TEXT:
    prompts = [line for line in lines if line.strip()]
  elif kind == JSON and json_is_array(path):  # a JSON array of records: each one is a prompt
    try:
      records = fs.json_loads('\n'.join(lines))
    except ValueError as e:
      raise ConfigError(f'sample.prompts: {path} is not a JSON array of records ({e}).') from e
    prompts = [_prompt_of_record(record, f'record {number}', path, prompt_field)
               for number, record in enumerate(records, 1)]
  else:
    prompts = [_prompt_of_record(line, f'line {number}', path, prompt_field)
               for number, line in enumerate(lines, 1) if line.strip()]
  if not prompts:
    raise ConfigError(f'{field}: {path} holds no prompts.')
  return prompts


def _prompt_of_record(record: Any, where: str, path: Path, prompt_field: str):
  """The prompt of one record (a JSONL line, or a JSON array's record; `where` names it: 'line
  3'): its `prompt_field` string, its `messages` list, or the record itself where it is an Alpaca
  record (`instruction`)."""
  if isinstance(record, str):
    try:
      record = fs.json_loads(record)
    except ValueError as e:
      raise ConfigError(f'sample.prompts: {path} {where} is not JSON ({e}).') from e
  value = record.get(prompt_field, record.get('messages')) if isinstance(record, dict) else None
  if isinstance(value, str) or (isinstance(value, list) and value):
    return value
  if isinstance(record, dict) and 'instruction' in record:  # Alpaca: rendered as in training
    return record
  raise ConfigError(f'sample.prompts: {path} {where} has no string {prompt_field!r} '
                    "(data.prompt_field), no 'messages' list and no Alpaca 'instruction' to "
                    'continue.')
