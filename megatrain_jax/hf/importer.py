"""Starting a run from a Hugging Face checkpoint (`init.from_hf`): its config.json becomes the
model section of the config, and its weights go into the engines' stores piece by piece.

`config_from_checkpoint` writes the checkpoint's shape fields (`MODEL_FIELDS`) into a copy of the
config; runtime fields (remat, dtype, matmul_precision, attention_chunk, vocab_chunk, scan_layers)
stay the config's. A shape field the user set that disagrees with config.json is a ConfigError.

`HfReader` reads the checkpoint the way `checkpoint.CheckpointReader` reads a run's checkpoint:
`read(full-state path, start, stop, axis=)` returns a slice of one leaf of the full train state
(partition.py's layout: layer leaves stacked [L, ...], the head kernel [D, V]), so the engines fill
their stores from it exactly as they restore a checkpoint (`train.make_engine(restore_from=...)`):
the streamed engine piece by piece (a layer group, a vocabulary chunk) straight into its tier, the
resident engine leaf by leaf onto the device. Each read opens the safetensors files it needs,
memory-maps them, copies the slices it wants (`safe_open(...).get_slice`, cast to float32 and
transposed from torch's [out, in] in the same copy) and unmaps them again, so the process holds
at most one piece of the model (plus the mapped pages of the tensors that piece is cut from).
With several processes each one reads only its own devices' shards of each piece (`read_box`,
partition.LazySlice): a process of P reads 1/P of the checkpoint.
Adam state and step counts read as zeros (what AdamW's `init` gives), the rng as a fresh run's.
"""

import contextlib
import functools
import shutil
import threading
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from megatrain_jax import config as config_lib
from megatrain_jax import fs
from megatrain_jax.data import ByteTokenizer
from megatrain_jax.data.documents import CHAT_TEMPLATE_FILE
from megatrain_jax.errors import ConfigError
from megatrain_jax.hf.format import HfCheckpoint, _open_safetensors
from megatrain_jax.layout import Layout, place, slices
from megatrain_jax.model import fresh_rng
from megatrain_jax.model.config import ModelConfig
from megatrain_jax.partition import LazySlice

# ModelConfig field -> its config key: what a Hugging Face checkpoint's config.json decides.
MODEL_FIELDS = {
    'vocab_size': 'model.vocab_size', 'd_model': 'model.d_model',
    'num_layers': 'model.num_layers', 'num_heads': 'model.num_heads',
    'num_kv_heads': 'model.num_kv_heads', 'd_ff': 'model.d_ff', 'head_dim': 'model.head_dim',
    'max_seq_len': 'model.max_seq_len', 'rope_theta': 'model.rope_theta',
    'rope_scaling_type': 'model.rope_scaling.type',
    'rope_scaling_factor': 'model.rope_scaling.factor',
    'rope_low_freq_factor': 'model.rope_scaling.low_freq_factor',
    'rope_high_freq_factor': 'model.rope_scaling.high_freq_factor',
    'rope_original_max_len': 'model.rope_scaling.original_max_len',
    'rope_beta_fast': 'model.rope_scaling.beta_fast',
    'rope_beta_slow': 'model.rope_scaling.beta_slow',
    'rope_attention_factor': 'model.rope_scaling.attention_factor',
    'rope_truncate': 'model.rope_scaling.truncate',
    'qkv_bias': 'model.qkv_bias', 'qk_norm': 'model.qk_norm',
    'tie_embeddings': 'model.tie_embeddings',
    'norm_eps': 'model.norm_eps', 'sliding_window': 'model.sliding_window',
    'init_std': 'model.init_std', 'hf_architecture': 'model.hf_architecture',
}
TOKENIZER_KEY = 'data.tokenizer'
BYTE_VOCAB = ByteTokenizer().vocab_size  # data.tokenizer='byte', the default
# Tokenizer files copied with a checkpoint (into a run, and by export); tokenizer.json is the one
# the data pipeline reads, the others let transformers' AutoTokenizer load the export.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'added_tokens.json', 'generation_config.json', CHAT_TEMPLATE_FILE,
                   # a slow tokenizer's own files (SentencePiece's model, a BPE's vocabulary and
                   # merges: what llama.cpp's converter and 4.x slow tokenizers read), and the chat
                   # template as transformers 4.4x saved it
                   'tokenizer.model', 'vocab.json', 'merges.txt', 'chat_template.json')
# Directories of tokenizer files copied with them: transformers 5 saves a tokenizer's named chat
# templates ({'default': ..., 'tool_use': ...}) as additional_chat_templates/<name>.jinja; without
# them apply_chat_template(chat_template='tool_use') renders the name as a template.
TOKENIZER_DIRS = ('additional_chat_templates',)
# A run's record of the special token ids its init.from_hf checkpoint's config.json gave
# (bos_token_id, eos_token_id: an id or a list, pad_token_id), kept with its tokenizer copy: an
# export falls back to them where the tokenizer's files name no such token (a Llama 3 repository
# with tokenizer.json alone), which transformers would otherwise fill with Llama's 1 and 2.
MODEL_TOKEN_IDS_FILE = 'model_token_ids.json'


def model_token_ids(config_json: dict) -> dict:
  """The bos/eos/pad ids a Hugging Face config.json gives, where they are ids (an eos list of
  them kept as a list)."""
  ids = {}
  is_id = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  for field in ('bos_token_id', 'eos_token_id', 'pad_token_id'):
    value = config_json.get(field)
    if is_id(value) or (isinstance(value, list) and value and all(map(is_id, value))):
      ids[field] = value
  return ids


# ----------------------------------------------------------------------------------------------
# The config.
# ----------------------------------------------------------------------------------------------

def _get(config, key: str):
  node = config
  for part in key.split('.'):
    node = node[part]
  return node


def set_fields(config, explicit: Iterable[str] | None) -> set[str]:
  """The config keys the user set: `explicit` (launch.py passes the --config.* overrides), or,
  when None (a config built in Python), every key whose value differs from configs/default.py."""
  if explicit is not None:
    return set(explicit)
  default = config_lib.load_config('default')
  keys = [*MODEL_FIELDS.values(), TOKENIZER_KEY]
  return {key for key in keys if _get(config, key) != _get(default, key)}


def _agrees(key: str, given, value) -> bool:
  if key == 'model.head_dim' and given == 0:  # 0 = d_model // num_heads, resolved from the rest
    return True
  return given == value


def apply_fields(config: ml_collections.ConfigDict, fields: dict[str, Any], source: str,
                 explicit: Iterable[str] | None = None,
                 tokenizer: str | None = None) -> ml_collections.ConfigDict:
  """A copy of `config` with `fields` ({config key: value}) set, and data.tokenizer set to
  `tokenizer` unless the user chose one.

  Raises:
    ConfigError: if a field the user set (`set_fields`) disagrees with `source`'s value.
  """
  chosen = set_fields(config, explicit)
  for key, value in fields.items():
    given = _get(config, key)
    if key in chosen and not _agrees(key, given, value):
      raise ConfigError(
          f'{key}={given!r} disagrees with {source}, which gives {value!r}: the model\'s shape '
          f'comes from it (init.from_hf, init.from_run). Drop the {key} override (or set it to '
          f'{value!r}); runtime fields such as model.remat or model.dtype may still be set.')
  out = ml_collections.ConfigDict(config.to_dict())
  for key, value in fields.items():
    config_lib.set_field(out, key, value)
  if tokenizer is not None and TOKENIZER_KEY not in chosen:
    config_lib.set_field(out, TOKENIZER_KEY, tokenizer)
  return out


def model_fields(cfg: ModelConfig | dict) -> dict[str, Any]:
  """{config key: value} of the shape fields of `cfg` (a ModelConfig, or its dataclasses.asdict
  as a checkpoint's meta.json records it)."""
  values = (ModelConfig.recorded(cfg) if isinstance(cfg, dict) else
            {f: getattr(cfg, f) for f in MODEL_FIELDS})
  return {key: values[field] for field, key in MODEL_FIELDS.items()}


def tokenizer_file(directory: Path) -> Path | None:
  """The checkpoint directory's tokenizer.json, if it has one."""
  path = Path(directory) / TOKENIZER_FILES[0]
  return path if path.is_file() else None


def config_from_checkpoint(config: ml_collections.ConfigDict, checkpoint: HfCheckpoint,
                           explicit: Iterable[str] | None = None) -> ml_collections.ConfigDict:
  """`config` with the model shape of `checkpoint` and, unless the user chose one, its
  tokenizer.json as data.tokenizer.

  Raises:
    ConfigError: if the checkpoint has no tokenizer.json and data.tokenizer is 'byte', and its
      vocabulary is not the byte tokenizer's 256 ids (an export of a byte-level run has no
      tokenizer files): the byte tokenizer's ids would name other tokens to its embeddings.
  """
  found = tokenizer_file(checkpoint.directory)
  if (found is None and checkpoint.cfg.vocab_size != BYTE_VOCAB and
      _get(config, TOKENIZER_KEY) == 'byte'):  # the default, or chosen: neither is the model's
    raise ConfigError(
        f'init.from_hf: {checkpoint.directory} has no {TOKENIZER_FILES[0]}, and the model\'s '
        f'{checkpoint.cfg.vocab_size:,} ids need its own tokenizer: save it there '
        '(AutoTokenizer.from_pretrained(...).save_pretrained(directory) writes tokenizer.json), '
        'or set data.tokenizer to the model\'s tokenizer.json.')
  return apply_fields(config, model_fields(checkpoint.cfg),
                      f'{checkpoint.directory}/config.json', explicit,
                      str(found) if found else None)


def copy_tokenizer(source: Path, dest: Path, run_files: bool = False) -> list[Path]:
  """Copies the tokenizer files (TOKENIZER_FILES, and those in TOKENIZER_DIRS) found beside
  `source` (a tokenizer.json or a directory holding one) into directory `dest`, with
  `run_files` a run's own record (MODEL_TOKEN_IDS_FILE) too; returns the copies.

  Raises:
    ConfigError: if one found beside `source` is a link out of its directory (other than into
      the Hugging Face cache's blobs/): its content would go into the run and its exports.
  """
  source = Path(source)
  directory = source if source.is_dir() else source.parent
  names = list(TOKENIZER_FILES) + [f'{d}/{f.name}' for d in TOKENIZER_DIRS
                                   if (directory / d).is_dir()
                                   for f in sorted((directory / d).iterdir())]
  names += [MODEL_TOKEN_IDS_FILE] if run_files else []  # another run's record, into this run
  files = []
  for name in names:
    named = name == TOKENIZER_FILES[0] and source.is_file()  # the file the user chose
    file = source if named else directory / name
    if file.is_file() and not named:
      fs.inside_or_refuse(directory, name, f'{file}: {{reason}}; tokenizer files are copied into '
                          'the run and its exports, so a link out of the directory is not '
                          'followed: replace it with the file itself, or remove it.')
    if file.is_file():
      files.append((file, dest / name))
  for file, copy in files:
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(file, copy)
  dest.mkdir(parents=True, exist_ok=True)
  return [copy for _, copy in files]


# ----------------------------------------------------------------------------------------------
# The weights.
# ----------------------------------------------------------------------------------------------

def _full_path(keys: tuple[str, ...]) -> str:
  return "['params']" + ''.join(f"['{k}']" for k in keys)


class HfReader:
  """A Hugging Face checkpoint read as a fresh run's full train state, one slice at a time: the
  reader interface of checkpoint.CheckpointReader (`read`, `snapshot_dir`, `device_state`,
  `meta`) that `train.make_engine(restore_from=...)` fills the engines from.

  Args:
    checkpoint: The inspected checkpoint (`inspect_checkpoint`).
    abstract_state: ShapeDtypeStructs of the full train state (resident.abstract_state).
    seed: train.seed: the rng a fresh run of this seed would carry.
  """

  def __init__(self, checkpoint: HfCheckpoint, abstract_state, seed: int = 0):
    self.checkpoint, self.directory = checkpoint, checkpoint.directory
    self.meta = {'step': 0, 'data_position': 0}
    # Of tensor data, in the checkpoint's dtype; with several processes the NVMe stores' writer
    # threads read too (partition.LazySlice): counted under a lock.
    self.bytes_read = 0
    self._count_lock = threading.Lock()
    self._leaves = {jax.tree_util.keystr(p): x
                    for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    self._tensors: dict[str, list] = {}
    for t in checkpoint.tensors:
      self._tensors.setdefault(_full_path(t.path), []).append(t)
    for tensors in self._tensors.values():
      tensors.sort(key=lambda t: -1 if t.layer is None else t.layer)
    self._rng = fresh_rng(seed)

  def snapshot_dir(self, path: str) -> None:
    """No leaf is an NVMe snapshot: the stores are written, never linked."""
    del path

  def known_zero(self, path: str) -> bool:
    """Whether leaf `path` is zeros without reading it: AdamW's state and step counts."""
    return path not in self._tensors and path != "['rng']"

  def shape(self, path: str) -> tuple:
    return tuple(self._leaf(path).shape)

  def _leaf(self, path: str):
    if path not in self._leaves:
      raise ConfigError(f'{self.checkpoint.directory}: the train state has no leaf {path}.')
    return self._leaves[path]

  def read(self, path: str, start: int | None = None, stop: int | None = None, *,
           axis: int = 0) -> np.ndarray:
    """Leaf `path` of the full state as host numpy: indices [start:stop] along `axis` (layers of
    a stacked leaf; vocabulary rows of the embedding, axis 0; columns of the head kernel, axis 1),
    the whole leaf if start is None. Params come from the safetensors files as float32, optimizer
    state and step counts are zero."""
    if path == "['rng']":
      return self._rng.copy()
    box = [(0, n) for n in self.shape(path)]
    if start is not None:
      box[axis] = (start, stop)
    return self.read_box(path, tuple(box))

  def read_box(self, path: str, box: tuple) -> np.ndarray:
    """`box` ((start, stop) per axis) of leaf `path` of the full state as host numpy (what one
    process reads of a leaf split over several: layout.place): of a layer leaf the box's layers
    are tensors of their own, the rest of the box is cut from each of them."""
    shape = tuple(b - a for a, b in box)
    if path not in self._tensors:  # AdamW's mu, nu and counts start at zero (optax init)
      return np.zeros(shape, self._leaf(path).dtype)
    tensors, out = self._tensors[path], np.empty(shape, np.float32)
    with contextlib.ExitStack() as stack:
      handles = {}

      def opened(t):
        file = self.checkpoint.files[t.hf_name]
        if file not in handles:
          handles[file] = stack.enter_context(_open_safetensors(file))
        return handles[file]

      if tensors[0].layer is None:
        out[...] = self._slice(opened(tensors[0]), tensors[0], box)
      else:
        (first, last), rest = box[0], box[1:]
        for i in range(first, last):
          out[i - first] = self._slice(opened(tensors[i]), tensors[i], rest)
    return out

  def _slice(self, f, t, box: tuple) -> np.ndarray:
    """`box` of tensor `t` in our layout (torch's [out, in] read transposed: the box reversed;
    of a fused tensor, its rows shifted to where `t`'s begin)."""
    hf_box = box[::-1] if t.transpose else box
    if t.hf_rows is not None:
      (first, last), offset = hf_box[0], t.hf_rows[0]
      hf_box = ((first + offset, last + offset),) + tuple(hf_box[1:])
    value = f.get_slice(t.hf_name)[slices(hf_box)]
    with self._count_lock:
      self.bytes_read += value.nbytes
    return value.T if t.transpose else value

  def device_state(self, abstract_state, layout: Layout | None = None):
    """The whole state on the device(s) of `layout`, leaf by leaf (one host copy of one leaf at a
    time; with several processes, of this process's shards of it); optimizer state and step
    counts are made as zeros on the device."""
    layout = layout or Layout.single_device()

    def leaf(key_path, abstract):
      path = jax.tree_util.keystr(key_path)
      sharding = layout.sharding('device', tuple(abstract.shape), path)
      if path == "['rng']":
        return place(self._rng, sharding)
      if path in self._tensors:
        return place(LazySlice(functools.partial(self.read_box, path), abstract.shape,
                               np.float32), sharding)
      return jnp.zeros(abstract.shape, abstract.dtype, device=sharding)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)
