"""Resolving the `data` config section into a prepared dataset and its tokenizer.

Fields of the section (configs/default.py documents each):
  path: '' for the embedded default corpus; a file, directory or glob pattern of .txt, .jsonl,
    .jsonl.zst, .jsonl.gz, .parquet, .arrow or a `datasets` save_to_disk directory (formats.py);
    or a directory already holding a prepared
    dataset (meta.json), which is then used as is.
  val_path: '' to split validation off the end of `path`, else like `path`.
  val_fraction: Share of the training stream held out when `val_path` is ''.
  tokenizer: 'byte', or a local Hugging Face tokenizer.json (or a directory containing one, and
    its tokenizer_config.json: EOS, BOS, chat template).
  cache_dir: Where prepared files go; '' means `<workdir>/data`.
  text_field, prompt_field, completion_field, eos_token, skip_bad_records: how records become
    documents (documents.py).
  mixture: '' or 'WEIGHT:SOURCE,...' (mixture.py); exclusive with `path`.
  num_workers: tokenizing processes of the prepare step (0 = every core).
  shard_tokens: the most tokens per shard file.
"""

import hashlib
from pathlib import Path
from typing import Any

from megatrain_jax.data import formats, packing
from megatrain_jax.data.corpus import default_corpus_text
from megatrain_jax.data.documents import DocumentFormat, document_format, read_chat_template
from megatrain_jax.data.loader import check_split_sizes
from megatrain_jax.data.mixture import block_counts, parse_mixture
from megatrain_jax.data.prepare import (DEFAULT_SHARD_TOKENS, META_FILE, DatasetInfo,
                                        check_shard_tokens, check_sources, check_val_fraction,
                                        needs_documents, prepare_dataset, read_dataset_info)
from megatrain_jax.data.tokenizer import Tokenizer, check_tokenizer_spec, load_tokenizer
from megatrain_jax.errors import ConfigError
from megatrain_jax.fs import check_writable

_STR_FIELDS = ('path', 'val_path', 'tokenizer', 'cache_dir')
# Fields added with the record formats: a data section written before them gets these defaults.
_DEFAULTS = {'text_field': 'text', 'prompt_field': 'prompt', 'completion_field': 'completion',
             'eos_token': '', 'mixture': '', 'num_workers': 0,
             'shard_tokens': DEFAULT_SHARD_TOKENS, 'skip_bad_records': False,
             'text_documents': False, 'pack': 'stream', 'chat_template': ''}


def _field(data_config: Any, name: str) -> Any:
  try:
    return data_config[name]
  except KeyError as e:
    if name in _DEFAULTS:
      return _DEFAULTS[name]
    raise ConfigError(f'data.{name}: missing from the config; add it to the data section.') from e


def _is_prepared(path: Path) -> bool:
  return path.is_dir() and (path / META_FILE).is_file()


def _check_cache_dir(cache_dir: Path, path: str) -> None:
  """Rejects a cache_dir that is a file, the raw-text directory being prepared, or one that
  cannot be written (a read-only mount)."""
  cache_dir = cache_dir.expanduser().resolve()
  if cache_dir.exists() and not cache_dir.is_dir():
    raise ConfigError(f'data.cache_dir: {cache_dir} is a file; point data.cache_dir at a '
                      "directory (created if missing), or set it to '' for <workdir>/data.")
  # Prepared files written into the text directory would be read back as training text.
  if path and Path(path).expanduser().resolve() == cache_dir:
    raise ConfigError(f'data.cache_dir: {cache_dir} is also data.path (a directory of text '
                      "files); set data.cache_dir to another directory or to ''.")
  # Prepared or not, the data is locked there (a lock file) before it is read.
  check_writable(cache_dir, f'data.cache_dir={cache_dir}', 'Point data.cache_dir at a directory '
                 "you can write to, or set it to '' for <workdir>/data.")


def _check_fields(data_config: Any) -> None:
  for name in _STR_FIELDS + ('text_field', 'prompt_field', 'completion_field', 'eos_token',
                             'mixture'):
    value = _field(data_config, name)
    if not isinstance(value, str):
      raise ConfigError(f'data.{name}: got {value!r}; it must be a string.')
  for name in ('text_field', 'prompt_field', 'completion_field'):
    if not _field(data_config, name):
      raise ConfigError(f'data.{name}: must name a record field, got an empty string.')
  workers = _field(data_config, 'num_workers')
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ConfigError(f'data.num_workers: got {workers!r}; it must be an integer >= 0 '
                      '(0 = every core).')
  check_shard_tokens(_field(data_config, 'shard_tokens'))
  for name in ('skip_bad_records', 'text_documents'):
    if not isinstance(_field(data_config, name), bool):
      raise ConfigError(f'data.{name}: must be True or False.')
  if _field(data_config, 'chat_template'):
    read_chat_template(_field(data_config, 'chat_template'))  # readable, a jinja2 template
  if _field(data_config, 'pack') not in PACKINGS:
    raise ConfigError(f"data.pack: got {_field(data_config, 'pack')!r}; it must be 'stream' "
                      "(rows are windows of the token stream), 'documents' (rows of whole "
                      "documents in stream order, padded) or 'best_fit' (rows of whole "
                      'documents packed best-fit, least padding).')


def data_format(data_config: Any, tokenizer: Tokenizer) -> DocumentFormat:
  """The DocumentFormat (documents.py: EOS, BOS, record fields, chat template) of a data section
  (a ConfigDict or mapping; fields added since a section was written take their defaults)."""
  return document_format(
      tokenizer, eos_token=_field(data_config, 'eos_token'),
      text_field=_field(data_config, 'text_field'),
      prompt_field=_field(data_config, 'prompt_field'),
      completion_field=_field(data_config, 'completion_field'),
      skip_bad_records=_field(data_config, 'skip_bad_records'),
      text_documents=_field(data_config, 'text_documents'),
      chat_template=_field(data_config, 'chat_template'))


# data.pack: rows as windows of the stream, or of whole documents (packing.py).
PACKINGS = ('stream',) + packing.STRATEGIES


def row_packing(data_config: Any, tokenizer: Tokenizer) -> packing.RowPacking | None:
  """How data.pack makes rows of whole documents (found by and padded with the EOS id), or None
  (windows of the stream)."""
  strategy = _field(data_config, 'pack')
  if strategy == 'stream':
    return None
  return packing.RowPacking(
      strategy, document_format(tokenizer, eos_token=_field(data_config, 'eos_token')).eos)


def _needs_format(data_config: Any, files: list[Path]) -> bool:
  """Whether preparing `files` needs the document format (EOS, BOS): they hold records, or
  data.text_documents makes each text file a document."""
  return needs_documents(files) or bool(files and _field(data_config, 'text_documents'))


class _Sources:
  """The files of each source of the config, checked (heads read), lazily with the tokenizer."""

  def __init__(self, data_config: Any):
    self._config = data_config
    self._fmt = None

  def fmt(self) -> DocumentFormat:
    if self._fmt is None:
      self._fmt = data_format(self._config, load_tokenizer(_field(self._config,
                                                                        'tokenizer')))
    return self._fmt

  def check(self, source: str, field: str) -> list[Path]:
    """Expands `source` (naming `field`) and checks every file's head, and a directory's mix of
    records and text (formats.check_directories); returns the files."""
    files = formats.expand_sources([source], field)
    formats.check_directories([source], _field(self._config, 'text_documents'), field)
    check_sources(files, self.fmt() if _needs_format(self._config, files) else None, field)
    return files


def _check_prepared_tokenizer(prepared: DatasetInfo, tokenizer: Tokenizer) -> None:
  if (prepared.tokenizer, prepared.vocab_size) != (tokenizer.name, tokenizer.vocab_size):
    raise ConfigError(
        f'data.tokenizer: {prepared.dir} was prepared with tokenizer {prepared.tokenizer!r} '
        f'(vocab {prepared.vocab_size}), but data.tokenizer gives {tokenizer.name!r} '
        f'(vocab {tokenizer.vocab_size}); set data.tokenizer to the tokenizer it was prepared '
        'with, or point data.path at the raw text.')


def _check_sizes(data_config: Any, train_config: Any, prepared: DatasetInfo | None,
                 train_files: list[Path] | None, val_files: list[Path] | None) -> None:
  """Refuses splits too short for one training sequence or one eval batch, when the token counts
  are known without tokenizing: a prepared directory, or the byte tokenizer over text files (a
  token per byte)."""
  if prepared is not None:
    train_tokens, val_tokens = prepared.train_tokens, prepared.val_tokens
  elif (_field(data_config, 'tokenizer') == 'byte' and
        not _needs_format(data_config, (train_files or []) + (val_files or []))):
    if train_files is None:
      total = len(default_corpus_text().encode('utf-8'))
    else:
      total = sum(file.stat().st_size for file in train_files)
    if val_files is not None:
      train_tokens, val_tokens = total, sum(file.stat().st_size for file in val_files)
    else:  # as prepare_dataset splits the stream
      val_tokens = int(total * _field(data_config, 'val_fraction'))
      train_tokens = total - val_tokens
  else:
    return  # records, or another tokenizer: the counts are known after the prepare step
  check_split_sizes(train_tokens, val_tokens, seq_len=train_config.seq_len)


def _check_mixture(data_config: Any, sources: _Sources) -> list[tuple[float, str]]:
  mixture = parse_mixture(_field(data_config, 'mixture'))
  if mixture and _field(data_config, 'path'):
    raise ConfigError("data.mixture: set either data.path or data.mixture, not both (set "
                      "data.path to '').")
  if mixture:
    block_counts([w for w, _ in mixture])
  for _, source in mixture:
    if _is_prepared(Path(source).expanduser()):
      raise ConfigError(f'data.mixture: {source} is a prepared directory; mixture sources must '
                        'be data files (they are prepared into data.cache_dir).')
    sources.check(source, 'data.mixture')
  return mixture


def _validate(data_config: Any, train_config: Any = None) -> DatasetInfo | None:
  """Checks the data config without writing; returns the DatasetInfo if `path` is prepared."""
  _check_fields(data_config)
  path, val_path = _field(data_config, 'path'), _field(data_config, 'val_path')
  check_val_fraction(_field(data_config, 'val_fraction'))
  check_tokenizer_spec(_field(data_config, 'tokenizer'))
  if _field(data_config, 'cache_dir'):
    _check_cache_dir(Path(_field(data_config, 'cache_dir')), path)
  sources = _Sources(data_config)
  mixture = _check_mixture(data_config, sources)

  prepared = train_files = val_files = None
  if path and _is_prepared(Path(path).expanduser()):
    if val_path:
      raise ConfigError(f'data.val_path: data.path {path} is a prepared dataset, which already '
                        "holds its validation split; set data.val_path to ''.")
    prepared = read_dataset_info(path, 'data.path')
    # Reads tokenizer.json (as the trainer does next anyway); writes nothing.
    _check_prepared_tokenizer(prepared, load_tokenizer(_field(data_config, 'tokenizer')))
  elif path:
    train_files = sources.check(path, 'data.path')
  if val_path:
    val_files = sources.check(val_path, 'data.val_path')
    _check_held_out(train_files or [], val_files)
  if train_config is not None and not mixture:
    _check_sizes(data_config, train_config, prepared, train_files, val_files)
  return prepared


def _check_held_out(train_files: list[Path], val_files: list[Path]) -> None:
  """Refuses validation files that are training files too (data.val_path = data.path, or globs
  that overlap): the validation loss would score text the run trains on."""
  shared = sorted({f.resolve() for f in train_files} & {f.resolve() for f in val_files})
  if shared:
    more = f' (and {len(shared) - 1} more)' if len(shared) > 1 else ''
    raise ConfigError(f'data.val_path: {shared[0]}{more} is in data.path too, so the validation '
                      'loss would score text the run trains on. Point data.val_path at held-out '
                      "files, or set it to '' to hold out data.val_fraction of data.path.")


def check_data_config(data_config: Any, train_config: Any = None) -> None:
  """Checks every path and value of the data config, writing nothing.

  Reads the head of every source file (formats.check_head): malformed records, missing fields
  and unreadable files found there are refused here; the rest when the prepare step reaches them.

  Args:
    data_config: The `data` section (ml_collections.ConfigDict or mapping).
    train_config: The `train` section, optional. With it, splits too short for one sequence of
      `train.seq_len + 1` tokens or one eval batch are refused here too, where the token counts
      are known without tokenizing (a prepared directory, or the byte tokenizer over text).

  Raises:
    ConfigError: Naming the offending `data.*` (or `train.*`) field.
  """
  _validate(data_config, train_config)


def _prepare(data_config: Any, tokenizer: Tokenizer, out_dir: Path, train: list, val: list,
             val_fraction: float | None, progress: bool | None,
             as_prepared: bool = False) -> DatasetInfo:
  fmt = (data_format(data_config, tokenizer)
         if _needs_format(data_config, formats.expand_sources(train, 'data.path') +
                          formats.expand_sources(val, 'data.val_path')) else None)
  return prepare_dataset(out_dir, tokenizer, train_sources=train, val_sources=val,
                         val_fraction=val_fraction, doc_format=fmt,
                         shard_tokens=_field(data_config, 'shard_tokens'),
                         num_workers=_field(data_config, 'num_workers'), progress=progress,
                         as_prepared=as_prepared)


def _load_mixture(data_config: Any, tokenizer: Tokenizer, cache_dir: Path,
                  progress: bool | None, as_prepared: bool) -> DatasetInfo:
  """Prepares each source into `<cache_dir>/mixture-<hash of the source>`; validation is
  data.val_path, else each source's held-out tail, one after the other."""
  val_path = _field(data_config, 'val_path')
  val_fraction = None if val_path else _field(data_config, 'val_fraction')
  parts = []
  for weight, source in parse_mixture(_field(data_config, 'mixture')):
    digest = hashlib.sha256(source.encode('utf-8')).hexdigest()[:12]
    parts.append((weight, _prepare(data_config, tokenizer, cache_dir / f'mixture-{digest}',
                                   [source], [], val_fraction, progress, as_prepared)))
  if val_path:
    val = _prepare(data_config, tokenizer, cache_dir / 'mixture-val', [val_path], [], None,
                   progress, as_prepared)
    val_segments, val_tokens = val.splits['train'], val.train_tokens
    val_ends = val.document_ends
  else:
    val_segments = tuple(seg for _, info in parts for seg in info.splits['val'])
    val_tokens = sum(info.val_tokens for _, info in parts)
    val_ends = all(info.document_ends for _, info in parts)
  first = parts[0][1]
  return DatasetInfo(
      dir=cache_dir.expanduser().resolve(), dtype=first.dtype, vocab_size=first.vocab_size,
      train_tokens=sum(info.train_tokens for _, info in parts), val_tokens=val_tokens,
      tokenizer=first.tokenizer, splits={'train': (), 'val': val_segments},
      has_mask=any(info.has_mask for _, info in parts), document_ends=val_ends,
      mixture=tuple(parts),
      stats=_sum_stats([info.stats for _, info in parts]))


def _sum_stats(stats: list[dict]) -> dict:
  out: dict = {}
  for one in stats:
    for key, value in one.items():
      if isinstance(value, (int, float)):
        out[key] = out.get(key, 0) + value
  return out


def load_data(data_config: Any, workdir: str | Path, progress: bool | None = None,
              as_prepared: bool = False) -> tuple[DatasetInfo, Tokenizer]:
  """Returns the prepared dataset and tokenizer for `data_config`, preparing it if needed.

  Args:
    data_config: The `data` section (ml_collections.ConfigDict or mapping).
    workdir: The run directory; prepared files go to `<workdir>/data` unless `data.cache_dir` is
      set.
    progress: The prepare step's progress bar (None: shown on a terminal only).
    as_prepared: Take the complete prepared files there as they are (prepare.prepare_dataset):
      process 0 of the run prepared them (`prepared_digest` says it is the same directory).

  Raises:
    ConfigError: Naming the offending `data.*` field: before anything is written for what the
      config and the head of each file show, else when the prepare step reaches a bad record (its
      partial output removed).
  """
  prepared = _validate(data_config)
  tokenizer = load_tokenizer(_field(data_config, 'tokenizer'))
  if prepared is not None:
    _check_prepared_tokenizer(prepared, tokenizer)
    return prepared, tokenizer

  path, val_path = _field(data_config, 'path'), _field(data_config, 'val_path')
  cache_dir = _cache_dir(data_config, workdir)
  _check_cache_dir(cache_dir, path)
  if _field(data_config, 'mixture'):
    return _load_mixture(data_config, tokenizer, cache_dir, progress, as_prepared), tokenizer
  info = _prepare(data_config, tokenizer, cache_dir, [path] if path else [],
                  [val_path] if val_path else [], _field(data_config, 'val_fraction'), progress,
                  as_prepared)
  return info, tokenizer


def _cache_dir(data_config: Any, workdir: str | Path) -> Path:
  """Where the data is prepared: data.cache_dir, else <workdir>/data."""
  return Path(_field(data_config, 'cache_dir') or Path(workdir) / 'data')


def prepared_dirs(info: DatasetInfo) -> list[Path]:
  """The directories whose shards `info` reads (each source's of a mixture)."""
  return sorted({Path(segment[0]).parent for segments in info.splits.values()
                 for segment in segments})


def prepared_digest(data_config: Any, workdir: str | Path) -> bytes:
  """A digest of the meta.json files of the data directory `load_data` prepares into (that of a
  mixture's sources too; b'' when there is none): processes that see the same digest after
  process 0 prepared see the same prepared files (a shared workdir or data.cache_dir)."""
  cache_dir = _cache_dir(data_config, workdir).expanduser()
  metas = [meta.read_bytes() for meta in sorted([cache_dir / META_FILE,
                                                 *cache_dir.glob(f'mixture-*/{META_FILE}')])
           if meta.is_file()]
  return hashlib.sha256(b'\0'.join(metas)).digest() if metas else b''


def prepare_summary(info: DatasetInfo) -> str:
  """What `launch.py --prepare` prints: token counts, documents and the throughput."""
  stats = info.stats
  lines = [f'prepared {info.dir}: {info.train_tokens:,} train tokens, {info.val_tokens:,} '
           f'validation tokens ({info.dtype}, tokenizer {info.tokenizer}, vocab '
           f'{info.vocab_size:,}){", with loss masks" if info.has_mask else ""}']
  if info.mixture:
    for weight, part in info.mixture:
      lines.append(f'  source weight {weight:g}: {part.train_tokens:,} train tokens in {part.dir}')
  if stats.get('documents') or stats.get('skipped_records'):
    lines.append(f'  {stats.get("documents", 0):,} documents, '
                 f'{stats.get("skipped_records", 0):,} bad records skipped')
    if stats.get('documents_learning_nothing'):
      lines.append(f'  warning: {stats["documents_learning_nothing"]:,} documents learn no token '
                   'but their EOS (a chat without an assistant turn, an empty completion): check '
                   "the records' roles and fields")
    part = (stats.get('documents', 0) - stats.get('documents_learned_whole', 0)
            - stats.get('documents_learning_nothing', 0))
    if stats.get('documents_learned_whole') and part > 0:
      lines.append(f'  note: {stats["documents_learned_whole"]:,} documents are learned whole '
                   f'(text records, or pairs whose whole prompt merges into the completion\'s '
                   f'first token) and {part:,} in part (prompt/completion pairs, chats): the '
                   'records may mix kinds')
  seconds = stats.get('seconds')
  if seconds:
    mb = stats.get('input_bytes', 0) / 1e6
    lines.append(f'  read {mb:,.1f} MB in {seconds:,.1f} s: {mb / seconds:,.2f} MB/s '
                 f'({(info.train_tokens + info.val_tokens) / seconds:,.0f} tokens/s)')
  else:
    lines.append('  (already prepared: nothing to do)')
  return '\n'.join(lines)
