"""Where a run starts and what it keeps of its sources: a workdir with a checkpoint resumes from
it (its shape, its tokenizer and template copies, wherever the workdir now is); without one, a
run starts from init.from_hf (a Hugging Face checkpoint, inspected whole) or init.from_run
(another run's newest checkpoint), whose tokenizer is copied into the workdir. A resume asking
for other weights or another tokenizer is refused, not silently ignored. Reads config.json and
checkpoint meta.json files; writes only the tokenizer and template copies (adopt_*).
"""

import json
import pathlib
from typing import Iterable, NamedTuple

import ml_collections

from megatrain_jax import checkpoint as checkpoint_lib
from megatrain_jax import config as config_lib
from megatrain_jax import data as data_lib
from megatrain_jax import distributed
from megatrain_jax import fs
from megatrain_jax import hf
from megatrain_jax.data.documents import CHAT_TEMPLATE_FILE, read_chat_template
from megatrain_jax.errors import ConfigError


HF_TOKENIZER_DIR = 'hf_tokenizer'  # <workdir>/hf_tokenizer: the tokenizer files of init.from_hf


def newest_checkpoint_meta(workdir: pathlib.Path) -> dict | None:
  """meta.json of the newest committed checkpoint in <workdir>/checkpoints that has a readable
  one, or None; reads nothing else and writes nothing (the restore verifies the checkpoint)."""
  directory = pathlib.Path(workdir) / 'checkpoints'
  if not directory.is_dir():
    return None
  steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()),
                 reverse=True)
  for step in steps:
    try:
      meta = json.loads((directory / str(step) / 'meta.json').read_text())
    except (OSError, ValueError):
      continue
    if isinstance(meta, dict) and isinstance(meta.get('model_config'), dict):
      return meta
  return None


def recorded_config(workdir, given: ml_collections.ConfigDict,
                    overrides: Iterable[str]) -> ml_collections.ConfigDict | None:
  """The config a rerun without --config resumes the run in `workdir` with: the one it last
  trained with (its config.json, over configs/default.py's schema), with the fields set on the
  command line (`overrides`) and this machine's own (distributed.LOCAL_FIELDS) taken from `given`
  (the command's config). None when `workdir` holds no run. Without it, `launch.py --workdir
  runs/ft --config.train.steps=8` resumed a fine-tune with configs/default.py's lr, batch and
  data."""
  try:
    recorded = json.loads((pathlib.Path(workdir) / 'config.json').read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return None
  if not isinstance(recorded, dict) or not config_lib.is_run_config(recorded):
    return None
  config = config_lib.load_config('default')
  known = set(config_lib.flatten(config))
  for key, value in config_lib.flatten(recorded).items():
    if key in known:  # a field of an older version no longer in the schema is left out
      config_lib.set_field(config, key, tuple(value) if isinstance(value, list) else value)
  for key in (*overrides, *distributed.LOCAL_FIELDS):
    if key == 'offload.dir' and key not in overrides and _is_directory(config.offload.dir):
      continue  # the run's own NVMe directory, on this machine too: its stores stay there
    config_lib.set_field(config, key, config_lib.get_field(given, key))
  return config


def _is_directory(path: str) -> bool:
  return bool(path) and pathlib.Path(path).expanduser().is_dir()


def _recorded_field(workdir: pathlib.Path, section: str, name: str):
  """<section>.<name> as the run in `workdir` recorded it in its config.json; None when it has
  none, or no readable config.json."""
  try:
    return json.loads((workdir / 'config.json').read_text())[section][name]
  except (OSError, ValueError, KeyError, TypeError):
    return None


def recorded_offload_dir(workdir: pathlib.Path) -> pathlib.Path | None:
  """The offload.dir the run in `workdir` last trained with (its config.json; '' is
  <workdir>/offload), absolute; None when it recorded none."""
  value = _recorded_field(workdir, 'offload', 'dir')
  if not isinstance(value, str):
    return None
  return pathlib.Path(value or workdir / 'offload').expanduser().absolute()


def run_data_field(workdir: pathlib.Path, name: str) -> str | None:
  """data.<name> of the run in `workdir` (its config.json), if it recorded one. A file the run
  copied into its workdir (its tokenizer, its chat template) is read from `workdir`: config.json
  records the path it had when it was written, and the run may have been moved or copied since
  (a copy would otherwise read the original's files, a moved run find none)."""
  value = _recorded_field(workdir, 'data', name)
  if not isinstance(value, str) or not value:
    return value
  recorded = pathlib.Path(value)
  for copy in (pathlib.Path(HF_TOKENIZER_DIR, recorded.name), pathlib.Path(CHAT_TEMPLATE_FILE)):
    if recorded.parts[-len(copy.parts):] == copy.parts and (workdir / copy).is_file():
      return str(workdir / copy)
  if name == 'chat_template':  # a run keeps its own copy: another file would go into exports
    raise ConfigError(f'the run in {workdir} records data.chat_template={value}, which is not '
                      f'its own copy ({workdir / CHAT_TEMPLATE_FILE}, which a run writes), so it '
                      'is not read: set data.chat_template to the template to use, or copy '
                      f'the run\'s template to {workdir / CHAT_TEMPLATE_FILE}.')
  return value


def config_from_run(config, workdir: pathlib.Path, meta: dict, overrides):
  """`config` with the model shape of the run's checkpoint and, unless set, its tokenizer, chat
  template and EOS (data.eos_token: what ends each document, and with model.document_mask the
  id the model finds documents by, as it did in training)."""
  trained_with = run_data_field(workdir, 'tokenizer')
  config = hf.apply_fields(config, hf.model_fields(meta['model_config']),
                           f'the checkpoint in {workdir / "checkpoints"}', overrides, trained_with)
  _check_same_tokenizer(config.data.tokenizer, trained_with, workdir)
  for field in ('chat_template', 'eos_token'):
    value = run_data_field(workdir, field)
    if value and not config.data[field]:
      config_lib.set_field(config, f'data.{field}', value)
  return config


def _check_same_tokenizer(given: str, trained_with: str | None, workdir: pathlib.Path) -> None:
  """Refuses data.tokenizer `given` where its content differs from the tokenizer the run in
  `workdir` trained with: its ids would name other tokens to the checkpoint's embedding rows.
  The same file elsewhere is that tokenizer; a run whose tokenizer is gone is not compared."""
  if not trained_with or given == trained_with:
    return
  try:
    was = data_lib.load_tokenizer(trained_with).name
  except ConfigError:  # moved or deleted since: nothing to compare with
    return
  if data_lib.load_tokenizer(given).name != was:
    raise ConfigError(f'data.tokenizer={given} is not the tokenizer the run in {workdir} trained '
                      f'with ({trained_with}): its ids name other tokens to the checkpoint\'s '
                      'embeddings. Drop the data.tokenizer override to use the run\'s own.')


def check_same_start(config, workdir: pathlib.Path, meta: dict) -> None:
  """Refuses an init.from_hf or init.from_run that differs from the one the run in `workdir`
  recorded when it started: a run with a checkpoint resumes from it and never reads them, so a
  changed one would be silently ignored (the user asked for other weights)."""
  recorded = _recorded_init(workdir)
  for field in INIT_FIELDS:
    given, was = config.init[field], recorded[field]
    if given and given != was and not (was and same_path(given, was)):
      raise ConfigError(
          f'init.{field}={given}: {workdir} holds a run (checkpoint step {meta["step"]}) that '
          f'started from {was or "a fresh init"}; a workdir with a checkpoint resumes from it '
          f'(--eval and --sample read it), and init.{field} is read only where there is none. '
          f'Drop the init.{field} override, or pass a new --workdir to start from it.')


def same_path(a: str, b: str) -> bool:
  try:
    return pathlib.Path(a).expanduser().resolve() == pathlib.Path(b).expanduser().resolve()
  except OSError:
    return False


class RunSource(NamedTuple):
  """init.from_run: the run whose checkpoint's weights a new run starts from: its newest, or the
  one checkpoint.read names ('best', a step)."""
  directory: pathlib.Path
  meta: dict
  read: str = 'newest'


def resolve_init(config, workdir: str, overrides: Iterable[str] | None = None):
  """(config, source) of a run that may start from init.from_hf or init.from_run; the source is
  the inspected Hugging Face checkpoint, a RunSource, or None (a fresh init, or a resume). A run
  with a checkpoint in `workdir` resumes from it: the model shape (and the tokenizer) come from
  there, and the source is not read at all. Otherwise a Hugging Face directory is checked whole
  (config.json, shards, headers), a run's newest checkpoint's meta.json read, and its shape and
  tokenizer go into the config. `overrides`: the config keys set on the command line (None: the
  fields that differ from configs/default.py); one that disagrees with the source is an error."""
  init = config.init
  if not init.from_hf and not init.from_run:
    return _resumed_from_source(config, workdir, overrides), None
  if init.from_hf and init.from_run:
    raise ConfigError('init.from_hf and init.from_run are both set; a run starts from one of '
                      'them: clear the other.')
  path = config_lib.check_workdir(workdir)
  meta = newest_checkpoint_meta(path)
  if meta is not None:
    check_same_start(config, path, meta)
    return config_from_run(config, path, meta, overrides), None
  if init.from_hf:
    checkpoint = hf.inspect_checkpoint(init.from_hf)
    return hf.config_from_checkpoint(config, checkpoint, overrides), checkpoint
  source = run_source(init.from_run, path, config.checkpoint.read)
  return config_from_run(config, source.directory, source.meta, overrides), source


def _resumed_from_source(config, workdir: str, overrides):
  """`config` for a command without init.from_hf / init.from_run in a workdir whose run started
  from one (its config.json) and has a checkpoint: the model shape and tokenizer come from that
  checkpoint, as with the init field given again (the source is not read on a resume), so
  `launch.py --workdir runs/ft` resumes a fine-tune. Else `config` as it is."""
  path = config_lib.check_workdir(workdir)
  started = _recorded_init(path)
  meta = newest_checkpoint_meta(path) if any(started.values()) else None
  if meta is None:
    return config
  config = config_from_run(config, path, meta, overrides)
  for field in INIT_FIELDS:  # config.json keeps saying where the run started
    config_lib.set_field(config, f'init.{field}', started[field])
  return config


INIT_FIELDS = ('from_hf', 'from_run')


def _recorded_init(workdir: pathlib.Path) -> dict:
  """{from_hf, from_run} of the run in `workdir` as its config.json recorded them ('' each when
  it has none, or no readable config.json)."""
  return {field: _recorded_field(workdir, 'init', field) or '' for field in INIT_FIELDS}


def run_source(from_run: str, workdir: pathlib.Path, read: str = 'newest') -> RunSource:
  """init.from_run's run directory and its newest checkpoint's meta.json (the model's shape: any
  checkpoint's), refused by name if it is this run's own workdir or holds no checkpoint, or no
  checkpoint `read` (checkpoint.read: 'best' or a step) names."""
  directory = pathlib.Path(from_run).expanduser().absolute()
  if directory == workdir:
    raise ConfigError(f'init.from_run={from_run} is this run\'s own --workdir; a rerun there '
                      'resumes by itself. Point init.from_run at another run.')
  meta = newest_checkpoint_meta(directory)
  if meta is None:
    raise ConfigError(f'init.from_run: {directory} holds no checkpoint (checkpoints/<step>/); '
                      'pass the --workdir of a run that has saved one.')
  if read != 'newest':
    checkpoint_lib.chosen_step(directory / 'checkpoints', read)
  return RunSource(directory, meta, read)


def adopt_tokenizer(config, source, workdir: pathlib.Path):
  """With the tokenizer of init.from_hf (or of the init.from_run run, when it lies in that run's
  directory), copies its files into <workdir>/hf_tokenizer and points data.tokenizer there: a
  resumed run (and an export) no longer needs the source directory. The prepared data's key is
  the tokenizer's content, so the copy changes nothing else. A tokenizer of the user's own is
  pointed at by its absolute path: config.json's relative one would name another file (or none)
  from another directory (a resume, --eval or --export_hf run elsewhere)."""
  found = None
  if isinstance(source, RunSource):
    tokenizer = pathlib.Path(config.data.tokenizer)
    found = tokenizer if tokenizer.is_relative_to(source.directory) else None
  elif source is not None:
    found = hf.tokenizer_file(source.directory)
  if found is None or config.data.tokenizer != str(found):
    given = config.data.tokenizer
    if given == 'byte' or pathlib.Path(given).is_absolute():
      return config
    config = ml_collections.ConfigDict(config.to_dict())
    config_lib.set_field(config, 'data.tokenizer', str(pathlib.Path(given).expanduser().absolute()))
    return config
  copies = hf.copy_tokenizer(found, workdir / HF_TOKENIZER_DIR,
                             run_files=isinstance(source, RunSource))
  if not isinstance(source, RunSource):  # the ids the checkpoint's config.json gives
    fs.write_json_atomic(workdir / HF_TOKENIZER_DIR / hf.MODEL_TOKEN_IDS_FILE,
                         hf.model_token_ids(source.hf_config))
  config = ml_collections.ConfigDict(config.to_dict())
  config_lib.set_field(config, 'data.tokenizer', str(copies[0]))
  return config


def adopt_chat_template(config, workdir: pathlib.Path):
  """With data.chat_template, copies the file to <workdir>/chat_template.jinja (atomically) and
  points data.chat_template there: --eval, --sample and --export_hf of the run read the copy
  (config.json records it), wherever the original goes."""
  template = config.data.chat_template
  copy = workdir / CHAT_TEMPLATE_FILE  # the name transformers gives a tokenizer's template
  if not template or pathlib.Path(template) == copy:
    return config
  fs.write_text_atomic(copy, read_chat_template(template))
  config = ml_collections.ConfigDict(config.to_dict())
  config_lib.set_field(config, 'data.chat_template', str(copy))
  return config
