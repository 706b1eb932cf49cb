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

from megatrain_jax.data.prepare import (META_FILE, DatasetInfo, check_val_fraction,
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


def _validate(data_config: Any) -> DatasetInfo | None:
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

  prepared = None
  if path and _is_prepared(Path(path).expanduser()):
    if val_path:
      raise ConfigError(f'data.val_path: data.path {path} is a prepared dataset, which already '
                        "holds its validation split; set data.val_path to ''.")
    prepared = read_dataset_info(path, 'data.path')
  elif path:
    expand_sources([path], 'data.path')
  if val_path:
    expand_sources([val_path], 'data.val_path')
  return prepared


def check_data_config(data_config: Any) -> None:
  """Checks every path and value of the data config, writing nothing.

  Args:
    data_config: The `data` section (ml_collections.ConfigDict or mapping).

  Raises:
    ConfigError: Naming the offending `data.*` field.
  """
  _validate(data_config)


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
    if (prepared.tokenizer, prepared.vocab_size) != (tokenizer.name, tokenizer.vocab_size):
      raise ConfigError(
          f'data.tokenizer: {prepared.dir} was prepared with tokenizer {prepared.tokenizer!r} '
          f'(vocab {prepared.vocab_size}), but data.tokenizer gives {tokenizer.name!r} '
          f'(vocab {tokenizer.vocab_size}); set data.tokenizer to the tokenizer it was prepared '
          'with, or point data.path at the raw text.')
    return prepared, tokenizer

  path, val_path = _field(data_config, 'path'), _field(data_config, 'val_path')
  cache_dir = Path(_field(data_config, 'cache_dir') or Path(workdir) / 'data')
  _check_cache_dir(cache_dir, path)
  info = prepare_dataset(cache_dir, tokenizer,
                         train_sources=[path] if path else [],
                         val_sources=[val_path] if val_path else [],
                         val_fraction=_field(data_config, 'val_fraction'))
  return info, tokenizer
