"""Loading and validating ml_collections configs.

`validate` runs before anything is allocated or written. Each failure is a `ConfigError` that
names the field (`train.seq_len`, `model.num_heads`, ...) and says how to fix it.

The schema is `configs/default.py`: a key that it does not define is a typo, reported with the
closest known names.
"""

import difflib
import importlib
import importlib.resources
import importlib.util
import json
import math
import os
import pathlib
import sys

import ml_collections

from megatrain_jax import optim
from megatrain_jax.errors import ConfigError
from megatrain_jax import fs
from megatrain_jax.fs import nearest_existing
from megatrain_jax.model.config import ModelConfig

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Where bare config names ('tiny') resolve: configs/ beside the package in a checkout (or an
# editable install), else the copy that a wheel ships inside the package, megatrain_jax.configs
# (pyproject.toml maps that package onto configs/).
CONFIGS_DIR = (REPO_ROOT / 'configs' if (REPO_ROOT / 'configs' / 'default.py').is_file() else
               pathlib.Path(importlib.resources.files('megatrain_jax') / 'configs'))
# train.seed becomes a 32-bit signed jit argument (jax.random.key) on the default (x32) JAX.
MAX_SEED = 2**31 - 1


def resolve_config_path(name: str) -> pathlib.Path:
  """'tiny', 'tiny.py' or a path -> the config file. Bare names resolve to CONFIGS_DIR; a path (a
  name with a directory part, or an existing file) stays as it is."""
  spec, sep, arg = name.partition(':')  # config_flags' "file.py:arg" syntax
  path = pathlib.Path(spec).expanduser()
  if not path.is_file() and path.parent == pathlib.Path('.'):
    for candidate in (CONFIGS_DIR / spec, CONFIGS_DIR / f'{spec}.py'):
      if candidate.is_file():
        path = candidate
        break
  if not path.is_file():
    known = sorted(p.stem for p in CONFIGS_DIR.glob('*.py') if not p.stem.startswith('_'))
    raise ConfigError(f'--config={name!r}: no such config file. Give a path, or one of the names '
                      f'in {CONFIGS_DIR}: {", ".join(known)}.')
  return path.resolve()


def load_config(name: str = 'default', **overrides) -> ml_collections.ConfigDict:
  """Loads a config by name or path (for notebooks and tests); `overrides` use dotted keys
  written with '__' for '.', e.g. `load_config('tiny', train__steps=5)`."""
  path = resolve_config_path(name)
  _make_configs_importable()
  spec = importlib.util.spec_from_file_location(f'_megatrain_config_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for key, value in overrides.items():
    set_field(config, key.replace('__', '.'), value)
  return config


def _make_configs_importable() -> None:
  """Config files import the default as the presets do, `from configs import default`. In a
  checkout `configs` is REPO_ROOT/configs (REPO_ROOT goes on sys.path); from an installed wheel it
  is the shipped package megatrain_jax.configs, registered under the name `configs` as well."""
  if CONFIGS_DIR == REPO_ROOT / 'configs':
    if str(REPO_ROOT) not in sys.path:
      sys.path.insert(0, str(REPO_ROOT))
  else:
    sys.modules.setdefault('configs', importlib.import_module('megatrain_jax.configs'))


def set_field(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  """Sets config['a.b.c'] = value, refusing keys the schema does not know."""
  _check_known(dotted, flatten(config))  # an unknown section too, not just an unknown leaf
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    node = node[part]
  try:
    node[leaf] = value
  except TypeError as e:  # ml_collections refuses a value of another type than the default's
    raise ConfigError(_type_message(dotted, value, node[leaf])) from e


def _default_schema() -> ml_collections.ConfigDict:
  return load_config(str(CONFIGS_DIR / 'default.py'))


def flatten(config, prefix='') -> dict:
  """{'train.lr': 0.001, ...} of a ConfigDict, or of the nested dict of its JSON."""
  out = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      out.update(flatten(value, f'{name}.'))
    else:
      out[name] = value
  return out


def get_field(config: ml_collections.ConfigDict, dotted: str):
  """config['a.b.c']."""
  node = config
  for part in dotted.split('.'):
    node = node[part]
  return node


_DEFINE_IT = ('Every key must be defined in configs/default.py (which documents them all); fix '
              'the spelling or add the field there.')


def _unknown_key_message(name: str, known) -> str:
  """`known`: the names beside `name`'s leaf (its section's fields and subsections)."""
  leaf = name.rsplit('.', 1)[-1]
  names = sorted({k.rsplit('.', 1)[-1] for k in known})
  close = difflib.get_close_matches(leaf, names, n=3)
  if close:
    hint = f' Did you mean {", ".join(repr(c) for c in close)}?'
  else:  # nothing close: a newcomer still learns what the section holds
    section = repr(name.rsplit('.', 1)[0]) if '.' in name else 'the top level'
    hint = f' Keys in {section}: {", ".join(names)}.'
  return f'unknown config key {name!r}.{hint} {_DEFINE_IT}'


def _unknown_section_message(name: str, section: str, sections) -> str:
  close = difflib.get_close_matches(section, sections, n=3)
  hint = f' Did you mean {", ".join(repr(c) for c in close)}?' if close else ''
  return (f'unknown config key {name!r}: there is no section {section!r}.{hint} Sections: '
          f'{", ".join(sections)}. {_DEFINE_IT}')


def _section_message(name: str, fields) -> str:
  return (f'config key {name!r} is a section, not a field: override one of its fields, e.g. '
          f'--config.{name}.{fields[0]}=... (fields: {", ".join(fields)}).')


def _type_message(name: str, value, default) -> str:
  kind = {bool: 'a bool (true or false)', int: 'an integer', float: 'a number',
          str: 'a string'}.get(type(default), f'a {type(default).__name__}')
  return f'{name}: got {value!r}; it must be {kind}, like its default {default!r}.'


def _check_known(dotted: str, schema: dict) -> None:
  """Refuses a key `schema` (flattened: 'train.steps', ...) does not hold as a field: a section,
  an unknown field of a known section, a key under an unknown section or under a field."""
  if dotted in schema:
    return
  section = [k[len(dotted) + 1:] for k in schema if k.startswith(dotted + '.')]
  if section:
    raise ConfigError(_section_message(dotted, section))
  parent = dotted.rsplit('.', 1)[0] if '.' in dotted else ''
  if parent in schema:
    raise ConfigError(f'unknown config key {dotted!r}: {parent!r} is a field, not a section; set '
                      f'it with --config.{parent}=...')
  # The names one level below `parent` (fields and subsections), e.g. 'model.rope_scaling'.
  depth = parent.count('.') + 1 if parent else 0
  siblings = {'.'.join(k.split('.')[:depth + 1]) for k in schema
              if k.startswith(parent + '.' if parent else '')}
  if siblings:
    raise ConfigError(_unknown_key_message(dotted, siblings))
  sections = sorted({k.rsplit('.', 1)[0] for k in schema if '.' in k})
  missing = next(p for p in _prefixes(parent) if p not in sections)
  raise ConfigError(_unknown_section_message(dotted, missing, sections))


def _prefixes(dotted: str) -> list[str]:
  """'a.b.c' -> ['a', 'a.b', 'a.b.c']."""
  parts = dotted.split('.')
  return ['.'.join(parts[:i]) for i in range(1, len(parts) + 1)]


def check_override(dotted: str, value: str | None) -> None:
  """Refuses a command-line override `--config.<dotted>=<value>` whose key is unknown or whose
  value does not parse as the type of the field's default (with absl's own parsers)."""
  schema = flatten(_default_schema())
  _check_known(dotted, schema)
  default = schema[dotted]
  if value is None:
    return
  from absl import flags  # pylint: disable=g-import-not-at-top
  parser = {bool: flags.BooleanParser, int: flags.IntegerParser,
            float: flags.FloatParser}.get(type(default))
  if parser is None:
    return
  try:
    parser().parse(value)
  except ValueError as e:
    raise ConfigError(f'--config.{dotted}={value}: ' + _type_message(dotted, value, default)) from e


def check_keys(config: ml_collections.ConfigDict) -> None:
  schema = flatten(_default_schema())
  given = flatten(config)
  for name in given:
    _check_known(name, schema)
  for name, default in schema.items():
    if name not in given:
      raise ConfigError(f'config key {name!r} is missing. Build size configs from '
                        'configs/default.py (`config = default.get_config()`) and override fields.')
    value = given[name]
    if isinstance(default, bool) != isinstance(value, bool) or (
        isinstance(default, int) and not isinstance(value, int)) or (
            isinstance(default, float) and not isinstance(value, (int, float))) or (
                isinstance(default, str) and not isinstance(value, str)):
      raise ConfigError(_type_message(name, value, default))
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f'{name}: must be a finite number, got {value}.')


def _require(ok: bool, field: str, message: str) -> None:
  if not ok:
    raise ConfigError(f'{field}: {message}')


def _longer_context_fix(config: ml_collections.ConfigDict) -> str:
  """How to train beyond the model's maximum length: where the model's shape comes from."""
  if config.init.get('from_hf'):
    return ('extend the checkpoint\'s context in its config.json (init.from_hf fixes the model '
            'from it): raise max_position_embeddings, with the rope_scaling its model card gives '
            'for longer inputs (Qwen2.5: YaRN past 32,768 tokens).')
  if config.init.get('from_run'):
    return ('export the run (--export_hf) and start from the export with init.from_hf, its '
            'config.json extended (max_position_embeddings, rope_scaling): init.from_run keeps '
            'the run\'s model.')
  return ('raise model.max_seq_len (RoPE models may need model.rope_scaling to work beyond their '
          'trained length).')


def validate(config: ml_collections.ConfigDict) -> ModelConfig:
  """Checks every field; returns the ModelConfig. Allocates and writes nothing."""
  check_keys(config)
  model_cfg = ModelConfig.from_config_dict(config.model)
  t = config.train
  for name in ('steps', 'batch_size', 'seq_len', 'log_every', 'eval_batches'):
    _require(t[name] >= 1, f'train.{name}', f'must be >= 1, got {t[name]}.')
  _require(t.epochs >= 0, 'train.epochs',
           f'must be >= 0 (passes over the training data; 0 = train.steps), got {t.epochs}.')
  _require(t.microbatches >= 0, 'train.microbatches',
           f'must be >= 1, or 0 for auto (the planner chooses), got {t.microbatches}.')
  _require(t.seq_len <= model_cfg.max_seq_len, 'train.seq_len',
           f'{t.seq_len} is longer than the model maximum model.max_seq_len='
           f'{model_cfg.max_seq_len}. Lower train.seq_len, or {_longer_context_fix(config)}')
  _require(t.lr > 0, 'train.lr', f'must be > 0, got {t.lr}.')
  _require(t.warmup_steps >= 0, 'train.warmup_steps', f'must be >= 0, got {t.warmup_steps}.')
  _require(0 <= t.warmup_ratio < 1, 'train.warmup_ratio',
           f'must be in [0, 1) (a fraction of train.steps; 0 = train.warmup_steps), got '
           f'{t.warmup_ratio}.')
  _require(0 <= t.min_lr_ratio <= 1, 'train.min_lr_ratio',
           f'must be in [0, 1], got {t.min_lr_ratio}.')
  _require(t.lr_schedule in optim.LR_SCHEDULES, 'train.lr_schedule',
           f'must be one of {", ".join(optim.LR_SCHEDULES)}, got {t.lr_schedule!r}.')
  _require(t.weight_decay >= 0, 'train.weight_decay', f'must be >= 0, got {t.weight_decay}.')
  for name in ('b1', 'b2'):
    _require(0 <= t[name] < 1, f'train.{name}', f'must be in [0, 1), got {t[name]}.')
  _require(t.eps > 0, 'train.eps', f'must be > 0, got {t.eps}.')
  _require(t.grad_clip >= 0, 'train.grad_clip', f'must be >= 0 (0 = off), got {t.grad_clip}.')
  _require(t.eval_every >= 0, 'train.eval_every',
           f'must be >= 0 (0 = at the end), got {t.eval_every}.')
  _require(0 <= t.seed <= MAX_SEED, 'train.seed',
           f'must be in [0, 2**31 - 1] (it seeds a 32-bit PRNG key), got {t.seed}.')
  _validate_checkpoint(config.checkpoint, t.eval_every)
  _validate_early_stopping(t)
  _require(config.profile.start_step >= 0, 'profile.start_step',
           f'must be >= 0 (0 = off), got {config.profile.start_step}.')
  _require(config.profile.steps >= 1, 'profile.steps',
           f'must be >= 1, got {config.profile.steps}.')
  _require(0 < config.data.val_fraction <= 0.5, 'data.val_fraction',
           f'must be in (0, 0.5], got {config.data.val_fraction}.')
  _validate_eval_export(config)
  if config.jax_cache_dir:
    existing = nearest_existing(pathlib.Path(config.jax_cache_dir).expanduser().absolute())
    _require(existing.is_dir(), 'jax_cache_dir',
             f'{existing} is a file, not a directory. Point jax_cache_dir at a directory '
             "(created if missing), or set it to '' to turn the compile cache off.")
  return model_cfg


def _validate_early_stopping(t: ml_collections.ConfigDict) -> None:
  """train.early_stopping_*: it counts evaluations, so it needs some during the run."""
  _require(t.early_stopping_patience >= 0, 'train.early_stopping_patience',
           f'must be >= 0 (0 = off), got {t.early_stopping_patience}.')
  _require(t.early_stopping_threshold >= 0, 'train.early_stopping_threshold',
           f'must be >= 0, got {t.early_stopping_threshold}.')
  _require(not t.early_stopping_patience or t.eval_every > 0, 'train.early_stopping_patience',
           f'counts evaluations ({t.early_stopping_patience} without improvement end the run), '
           'but train.eval_every=0 evaluates only at the end; set train.eval_every to the steps '
           'between evaluations.')


def _validate_checkpoint(c: ml_collections.ConfigDict, eval_every: int) -> None:
  """The checkpoint section: a best checkpoint needs a validation loss at every checkpoint step."""
  _require(c.every >= -1, 'checkpoint.every',
           f'must be >= 0 (0 = at the end only) or -1 (never), got {c.every}.')
  _require(c.keep >= 1, 'checkpoint.keep', f'must be >= 1, got {c.keep}.')
  _require(c.every_minutes >= 0, 'checkpoint.every_minutes',
           'must be >= 0 (minutes between time-based checkpoints; 0 = off), got '
           f'{c.every_minutes}.')
  read = str(c.read)
  _require(read in ('newest', 'best') or read.isdigit(), 'checkpoint.read',
           f"{read!r} is not 'newest', 'best' or a step number.")
  if not c.keep_best:
    return
  _require(c.every >= 0, 'checkpoint.keep_best',
           'needs checkpoints, and checkpoint.every=-1 writes none; set checkpoint.every.')
  _require(c.every == 0 or (eval_every > 0 and c.every % eval_every == 0), 'checkpoint.keep_best',
           f'compares the eval/loss of each checkpoint step, but checkpoint.every={c.every} is '
           f'not a multiple of train.eval_every={eval_every} (0 = at the end only), so some '
           'checkpoints have none. Make checkpoint.every a multiple of train.eval_every.')


EXPORT_DTYPES = ('float32', 'bfloat16')


def _validate_eval_export(config: ml_collections.ConfigDict) -> None:
  """The eval and export sections (init.from_hf is checked where it is read: hf/importer.py)."""
  e = config.eval
  for name in ('max_len', 'stride', 'batch_size'):
    _require(e[name] >= 0, f'eval.{name}', f'must be >= 0 (0 = the default), got {e[name]}.')
  _require(e.working_gb > 0, 'eval.working_gb',
           f'must be > 0 (GB one forward call may compute in), got {e.working_gb}.')
  max_len = e.max_len or config.train.seq_len
  _require(e.stride <= max_len, 'eval.stride',
           f'{e.stride} is larger than the window (eval.max_len = {max_len}): tokens between '
           'windows would never be scored. Use a stride <= max_len (0 = max_len).')
  _require(config.export.dtype in EXPORT_DTYPES, 'export.dtype',
           f'{config.export.dtype!r} is not one of {", ".join(EXPORT_DTYPES)}.')
  _require(config.export.max_shard_gb > 0, 'export.max_shard_gb',
           f'must be > 0 (GB per safetensors file), got {config.export.max_shard_gb}.')


def is_run_config(recorded: dict) -> bool:
  """Whether `recorded` (a config.json read) is a run's: its sections, not another program's."""
  return {'model', 'train'} <= recorded.keys()


def check_run_workdir(workdir: str) -> pathlib.Path:
  """`check_workdir` for a job that writes a run there (training, --prepare): a directory holding
  another program's config.json (a Hugging Face model's, another trainer's output) is refused,
  since the run writes its own config.json over it. Writes nothing."""
  path = check_workdir(workdir)
  try:
    recorded = json.loads((path / 'config.json').read_text(encoding='utf-8'))
  except (OSError, ValueError):  # none (or unreadable: not this check's to judge)
    return path
  if not isinstance(recorded, dict) or is_run_config(recorded):
    return path
  whose = ''
  if 'architectures' in recorded or 'model_type' in recorded:
    whose = (f' (a Hugging Face model\'s: to start from that model, pass '
             f'--config.init.from_hf={workdir})')
  raise ConfigError(f'--workdir={workdir}: its config.json is not a run\'s{whose}, and a run '
                    'writes its own config.json there. Give the run a directory of its own, e.g. '
                    '--workdir=runs/<name>.')


def check_workdir(workdir: str, writes: str = '', fix: str = '') -> pathlib.Path:
  """Checks that `workdir` exists or can be created, and is writable, without writing anything.
  `writes`: what a job that reads a run there writes into it ('' : a training run's files), and
  `fix` what to do instead ('': choose another); a job that writes nothing there (--sample,
  --export_hf) passes `check_run_readable` instead."""
  path, _ = _workdir_directory(workdir, 'Choose another workdir.')
  why = f' ({writes})' if writes else ''
  fs.check_writable(path, f'--workdir={workdir}', fix or 'Choose a workdir you can write to.', why)
  return path


def check_run_readable(workdir: str) -> pathlib.Path:
  """`workdir` for a job that only reads the run there (--sample, --export_hf): a read-only one
  (a teammate's run, a read-only mount) is fine; one it cannot read or list is refused."""
  path, existing = _workdir_directory(workdir, 'Pass the --workdir of a run.')
  if not os.access(existing, os.R_OK | os.X_OK):
    raise ConfigError(f'--workdir={workdir}: {existing} is not readable. Fix its permissions, or '
                      'read the run as a user who may.')
  return path


def _workdir_directory(workdir: str, fix: str) -> tuple[pathlib.Path, pathlib.Path]:
  """(--workdir absolute, its nearest existing directory), or a ConfigError ending in `fix` for
  an empty --workdir or one under a file."""
  if not workdir:
    raise ConfigError('--workdir is empty: give a directory for checkpoints and metrics.')
  path = pathlib.Path(workdir).expanduser().absolute()
  existing = nearest_existing(path)
  if not existing.is_dir():
    raise ConfigError(f'--workdir={workdir}: {existing} is a file, not a directory. {fix}')
  return path, existing
