"""Resolving the `data` config section into a prepared dataset and its tokenizer.

Fields of the section:
  path: '' for the embedded default corpus, a text file, a directory of text files, or a directory
    already holding a prepared dataset (meta.json), which is then used as is.
  val_path: '' to split validation off the end of `path`, else a text file or directory.
  val_fraction: Share of the training stream held out when `val_path` is ''.
  tokenizer: 'byte', or a local Hugging Face tokenizer.json (or a directory containing one).
  cache_dir: Where prepared files go; '' means `<workdir>/data`.
"""

from pathlib import Path
from typing import Any

from megatrain_jax.data.corpus import default_corpus_text
from megatrain_jax.data.loader import check_split_sizes
from megatrain_jax.data.prepare import (META_FILE, DatasetInfo, check_text_head, check_val_fraction,
                                        expand_sources, prepare_dataset, read_dataset_info)
from megatrain_jax.data.tokenizer import Tokenizer, check_tokenizer_spec, load_tokenizer
from megatrain_jax.errors import ConfigError

_STR_FIELDS = ('path', 'val_path', 'tokenizer', 'cache_dir')


def _field(data_config: Any, name: str) -> Any:
  try:
    return data_config[name]
  except KeyError as e:
    raise ConfigError(f'data.{name}: missing from the config; add it to the data section.') from e


def _is_prepared(path: Path) -> bool:
  return path.is_dir() and (path / META_FILE).is_file()


def _check_cache_dir(cache_dir: Path, path: str) -> None:
  """Rejects a cache_dir that is a file, or that is the raw-text directory being prepared."""
  cache_dir = cache_dir.expanduser().resolve()
  if cache_dir.exists() and not cache_dir.is_dir():
    raise ConfigError(f'data.cache_dir: {cache_dir} is a file; point data.cache_dir at a '
                      "directory (created if missing), or set it to '' for <workdir>/data.")
  # Prepared files written into the text directory would be read back as training text.
  if path and Path(path).expanduser().resolve() == cache_dir:
    raise ConfigError(f'data.cache_dir: {cache_dir} is also data.path (a directory of text '
                      "files); set data.cache_dir to another directory or to ''.")


def _check_texts(source: str, field: str) -> list[Path]:
  """Expands `source` (naming `field`) and sniffs every file; returns the files.

  Raises:
    ConfigError: for a missing source, a binary or non-UTF-8 file, or no text at all (0 bytes).
  """
  files = expand_sources([source], field)
  for file in files:
    check_text_head(file, field)
  if not sum(file.stat().st_size for file in files):
    raise ConfigError(f'{field}: {source} is empty (0 bytes of text); point {field} at a file or '
                      'directory that holds text.')
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
  are known without tokenizing: a prepared directory, or the byte tokenizer (a token per byte)."""
  if prepared is not None:
    train_tokens, val_tokens = prepared.train_tokens, prepared.val_tokens
  elif _field(data_config, 'tokenizer') == 'byte':
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
    return  # another tokenizer: the counts are known after the prepare step
  check_split_sizes(train_tokens, val_tokens, seq_len=train_config.seq_len,
                    batch_size=train_config.batch_size)


def _validate(data_config: Any, train_config: Any = None) -> DatasetInfo | None:
  """Checks the data config without writing; returns the DatasetInfo if `path` is prepared."""
  for name in _STR_FIELDS:
    value = _field(data_config, name)
    if not isinstance(value, str):
      raise ConfigError(f'data.{name}: got {value!r}; it must be a string.')
  path, val_path = _field(data_config, 'path'), _field(data_config, 'val_path')
  check_val_fraction(_field(data_config, 'val_fraction'))
  check_tokenizer_spec(_field(data_config, 'tokenizer'))
  if _field(data_config, 'cache_dir'):
    _check_cache_dir(Path(_field(data_config, 'cache_dir')), path)

  prepared = train_files = val_files = None
  if path and _is_prepared(Path(path).expanduser()):
    if val_path:
      raise ConfigError(f'data.val_path: data.path {path} is a prepared dataset, which already '
                        "holds its validation split; set data.val_path to ''.")
    prepared = read_dataset_info(path, 'data.path')
    # Reads tokenizer.json (as the trainer does next anyway); writes nothing.
    _check_prepared_tokenizer(prepared, load_tokenizer(_field(data_config, 'tokenizer')))
  elif path:
    train_files = _check_texts(path, 'data.path')
  if val_path:
    val_files = _check_texts(val_path, 'data.val_path')
  if train_config is not None:
    _check_sizes(data_config, train_config, prepared, train_files, val_files)
  return prepared


def check_data_config(data_config: Any, train_config: Any = None) -> None:
  """Checks every path and value of the data config, writing nothing.

  Args:
    data_config: The `data` section (ml_collections.ConfigDict or mapping).
    train_config: The `train` section, optional. With it, splits too short for one sequence of
      `train.seq_len + 1` tokens or one eval batch are refused here too, where the token counts
      are known without tokenizing (a prepared directory, or the byte tokenizer).

  Raises:
    ConfigError: Naming the offending `data.*` (or `train.*`) field.
  """
  _validate(data_config, train_config)


def load_data(data_config: Any, workdir: str | Path) -> tuple[DatasetInfo, Tokenizer]:
  """Returns the prepared dataset and tokenizer for `data_config`, preparing it if needed.

  Args:
    data_config: The `data` section (ml_collections.ConfigDict or mapping).
    workdir: The run directory; prepared files go to `<workdir>/data` unless `data.cache_dir` is
      set.

  Raises:
    ConfigError: Naming the offending `data.*` field, before anything is written.
  """
  prepared = _validate(data_config)
  tokenizer = load_tokenizer(_field(data_config, 'tokenizer'))
  if prepared is not None:
    _check_prepared_tokenizer(prepared, tokenizer)
    return prepared, tokenizer

  path, val_path = _field(data_config, 'path'), _field(data_config, 'val_path')
  cache_dir = Path(_field(data_config, 'cache_dir') or Path(workdir) / 'data')
  _check_cache_dir(cache_dir, path)
  info = prepare_dataset(cache_dir, tokenizer,
                         train_sources=[path] if path else [],
                         val_sources=[val_path] if val_path else [],
                         val_fraction=_field(data_config, 'val_fraction'))
  return info, tokenizer
