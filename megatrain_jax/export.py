"""A run's checkpoint as a Hugging Face checkpoint (`launch.py --export_hf=<dir> --workdir=<run>`).

Writes what transformers' `AutoModelForCausalLM.from_pretrained(<dir>)` loads: the weights as
safetensors files of at most `export.max_shard_gb` each (`model.safetensors`, or
`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` when there are several),
`config.json` in the transformers 5 layout with 4.x's rope keys beside it (rope_theta,
rope_scaling: 4.x readers would take theta 10000 and no scaling without them;
hf.hf_config_from_model_config: Llama, Qwen3 with q/k norms, Qwen2 with q/k/v biases, Mistral
with a window) and, when the run used a Hugging Face tokenizer, its tokenizer files.

Bounded memory whatever the placement the run trained under: every shard's header is known from
the shapes alone, so each file is written front to back, one tensor at a time, each read from the
checkpoint (`checkpoint.CheckpointReader.read` with ranges: a layer of a stacked leaf, rows of the
embedding, columns of the head kernel; a layer's tensor whole, the embedding and an untied head in
vocabulary-row slices of at most PIECE_BYTES), then transposed to torch's [out, in], cast to
`export.dtype` and written in slices of at most PIECE_BYTES before the next is read: the host
holds one layer tensor and one slice's copy (a 405B MLP matrix: 3.5 GB and 256 MB). The
safetensors layout (an 8-byte little-endian header length, a JSON header padded with spaces to 8
bytes, then the tensors back to back in header order) is the one `safetensors` itself writes.
"""

import dataclasses
import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from megatrain_jax import fs
from megatrain_jax import hf
from megatrain_jax import locks
from megatrain_jax import data as data_lib
from megatrain_jax.data import documents
from megatrain_jax.data.documents import CHAT_TEMPLATE_FILE
from megatrain_jax.errors import ConfigError, DiskFullError
from megatrain_jax.hf.format import tensor_map
from megatrain_jax.model import ModelConfig

PIECE_BYTES = 256 * 2**20  # largest slice of one tensor held at a time
_DTYPES = {'float32': (np.dtype(np.float32), 'F32'),
           'bfloat16': (np.dtype(ml_dtypes.bfloat16), 'BF16')}
_SINGLE_FILE = 'model.safetensors'
_INDEX_FILE = 'model.safetensors.index.json'
_STAGING = '.export-tmp'  # inside the destination: `export`


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One tensor of the export: its HF name and shape, and where it comes from."""
  name: str
  shape: tuple
  path: str  # full-state path of our leaf
  layer: int | None
  transpose: bool

  def nbytes(self, itemsize: int) -> int:
    return math.prod(self.shape) * itemsize


def check_destination(out_dir: str, needed_bytes: int = 0) -> Path:
  """The export directory (a symlink's target), refused (before anything is written) if it holds
  anything but hidden entries (a git clone's .git and .gitattributes), or if the directory it is
  in or made in cannot be written or lacks `needed_bytes` (`export_bytes`)."""
  if not out_dir:
    raise ConfigError('--export_hf is empty: give the directory to write the checkpoint to.')
  path = Path(out_dir).expanduser().absolute().resolve()
  if path.exists() and not path.is_dir():
    raise ConfigError(f'--export_hf={out_dir}: {path} is a file. Give a new or empty directory.')
  _check_empty(path, out_dir)
  return fs.check_writable(path, f'--export_hf={out_dir}',
                           'Export to a directory on a disk you can write to.',
                           needed_bytes=needed_bytes, what='the export')


def _check_empty(path: Path, out_dir: str) -> None:
  """Refuses `path` if it holds anything an export writes or would mix with: any name but hidden
  ones (an export writes none but its staging directory)."""
  if path.is_dir() and any(not p.name.startswith('.') for p in path.iterdir()):
    raise ConfigError(f'--export_hf={out_dir}: {path} is not empty; exporting there would mix '
                      'two checkpoints. Give a new or empty directory.')


def export_bytes(cfg: ModelConfig, dtype: str = 'float32') -> int:
  """Bytes of an export's safetensors files (their headers aside: under 1 MB, counted as 1 MB)."""
  return sum(e.nbytes(_DTYPES[dtype][0].itemsize) for e in _entries(cfg)) + (1 << 20)


def _entries(cfg: ModelConfig) -> list[_Entry]:
  return [_Entry(t.hf_name, t.hf_shape, "['params']" + ''.join(f"['{k}']" for k in t.path),
                 t.layer, t.transpose) for t in tensor_map(cfg)]


def _shards(entries: list[_Entry], itemsize: int, max_bytes: int) -> list[list[_Entry]]:
  """Consecutive tensors packed into files of at most `max_bytes` (a larger tensor alone)."""
  shards, size = [[]], 0
  for e in entries:
    n = e.nbytes(itemsize)
    if shards[-1] and size + n > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(e)
    size += n
  return shards


def _header(entries: list[_Entry], tag: str, itemsize: int) -> bytes:
  header, offset = {'__metadata__': {'format': 'pt'}}, 0
  for e in entries:
    header[e.name] = {'dtype': tag, 'shape': list(e.shape),
                      'data_offsets': [offset, offset + e.nbytes(itemsize)]}
    offset += e.nbytes(itemsize)
  text = json.dumps(header, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)
  return struct.pack('<Q', len(text)) + text


def _pieces(reader, e: _Entry) -> Iterator[np.ndarray]:
  """Tensor `e` in torch layout, as consecutive slices of its rows of at most PIECE_BYTES (float32;
  a vector whole), each cast and written before the next (_write_shard). A layer's tensor is read
  whole, once (its checkpoint file holds the layer: a slice of it would decode all of it), and
  sliced here; the embedding and an untied head are read slice by slice."""
  rows = e.shape[0]
  row_bytes = 4 * math.prod(e.shape[1:])
  step = rows if len(e.shape) == 1 else max(1, min(rows, PIECE_BYTES // max(row_bytes, 1)))
  if e.layer is not None:  # one layer of a stacked leaf
    value = reader.read(e.path, e.layer, e.layer + 1)[0]
    value = value.T if e.transpose else value
    for start in range(0, rows, step):
      yield value[start:start + step]
    return
  for start in range(0, rows, step):
    stop = min(rows, start + step)
    if e.transpose:  # the head kernel [D, V]: HF rows are our columns
      yield reader.read(e.path, start, stop, axis=1).T
    elif len(e.shape) == 1:
      yield reader.read(e.path)
    else:
      yield reader.read(e.path, start, stop)


def _write_shard(reader, file: Path, entries: list[_Entry], dtype: np.dtype, tag: str) -> None:
  with fs.naming(file), open(file, 'wb') as f:  # a full disk's error names the export's
    f.write(_header(entries, tag, dtype.itemsize))
    for e in entries:
      for piece in _pieces(reader, e):
        # One cast (or transposed) copy of the piece at a time, written from its buffer:
        # `tobytes` would copy it again.
        f.write(np.ascontiguousarray(piece, dtype=dtype).reshape(-1).view(np.uint8))
        del piece


def export(reader, cfg: ModelConfig, out_dir: Path, *, dtype: str = 'float32',
           max_shard_bytes: int = 5 * 10**9, tokenizer: str = 'byte',
           chat_template: str = '', eos_token: str = '') -> list[Path]:
  """Writes the params of `reader` (a checkpoint reader of a run of `cfg`) as a Hugging Face
  checkpoint in `out_dir` (new, or empty but for hidden entries: check_destination), all at once:
  the files are written and fsynced in a hidden directory inside it, then moved out into it,
  config.json last; returns the files written.

  Args:
    reader: `read(full-state path, start, stop, axis=)`, e.g. checkpoint.CheckpointReader.
    cfg: The model.
    out_dir: The directory (created).
    dtype: 'float32' or 'bfloat16'.
    max_shard_bytes: Largest safetensors file.
    tokenizer: The run's data.tokenizer: its tokenizer files are copied unless it is 'byte'.
    chat_template: The run's data.chat_template (a file), written with them as
      chat_template.jinja ('' = the tokenizer's own, copied with its files).
    eos_token: The run's data.eos_token ('' = the tokenizer's): config.json's eos_token_id.
  """
  # Staged inside out_dir, not beside it: out_dir may be a mount point (a container's volume,
  # which a rename cannot replace) or a directory whose owner and mode must stay. A killed export
  # leaves only the hidden staging directory, which the rerun deletes: from_pretrained finds no
  # config.json there until every shard is in place. The lock on out_dir refuses a second export
  # into it meanwhile.
  created = not out_dir.exists()
  out_dir.mkdir(parents=True, exist_ok=True)
  with locks.hold_export(out_dir):
    _check_empty(out_dir, str(out_dir))  # held now: no other export wrote there since the check
    staging = out_dir / _STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
      names = _write_files(reader, cfg, staging, dtype, max_shard_bytes, tokenizer,
                           chat_template, eos_token)
      for name in names:
        fs.fsync(staging / name)
    except Exception as error:  # a part-written export would only fill the disk (a kill's: the
      # rerun's rmtree above)
      shutil.rmtree(staging, ignore_errors=True)
      if created:
        out_dir.rmdir()
      if isinstance(error, OSError) and fs.is_disk_full(error):
        raise DiskFullError(
            f'--export_hf: the disk of {out_dir} is full ({error.strerror or error}); the partial '
            f'export was removed. It needs about {fs.human_bytes(export_bytes(cfg, dtype))}: '
            'free space there, or export to a larger disk.') from error
      raise
    # Top-level entries (a file, or a directory of tokenizer files), config.json last.
    for name in sorted({n.split('/')[0] for n in names}, key=lambda n: n == 'config.json'):
      os.rename(staging / name, out_dir / name)
    staging.rmdir()
    fs.fsync(out_dir, directory=True)
  return [out_dir / name for name in names]


def special_token_ids(tokenizer: str, eos_token: str = '') -> dict:
  """config.json's bos_token_id, eos_token_id and pad_token_id: the ids of the tokens the
  tokenizer's tokenizer_config.json names, where it names them, the EOS the run's `eos_token`
  (data.eos_token: what ended its documents) where set, else those the init.from_hf checkpoint's
  config.json gave (hf.MODEL_TOKEN_IDS_FILE beside the run's tokenizer copy). transformers'
  generate stops at config.json's eos_token_id where no generation_config.json says otherwise (a
  source without one exported without them would never stop)."""
  loaded = data_lib.load_tokenizer(tokenizer)
  names = {**documents.read_tokenizer_config(loaded), **({'eos_token': eos_token} if eos_token
                                                         else {})}
  ids = {}
  for field in ('bos_token', 'eos_token', 'pad_token'):
    text = documents.token_text(names.get(field))
    token = loaded.token_id(text) if text else None
    if token is not None:
      ids[f'{field}_id'] = int(token)
  recorded = Path(tokenizer).parent / hf.MODEL_TOKEN_IDS_FILE
  if recorded.is_file():
    ids = hf.model_token_ids(json.loads(recorded.read_text())) | ids
  return ids


def _write_files(reader, cfg: ModelConfig, out_dir: Path, dtype: str, max_shard_bytes: int,
                 tokenizer: str, chat_template: str, eos_token: str) -> list[str]:
  """`export`'s files written into `out_dir`; returns their names."""
  np_dtype, tag = _DTYPES[dtype]
  shards = _shards(_entries(cfg), np_dtype.itemsize, max_shard_bytes)
  names = ([_SINGLE_FILE] if len(shards) == 1 else
           [f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors' for k in range(len(shards))])
  for name, entries in zip(names, shards):
    _write_shard(reader, out_dir / name, entries, np_dtype, tag)
  written = list(names)
  if len(shards) > 1:
    index = {'metadata': {'total_size': sum(e.nbytes(np_dtype.itemsize) for s in shards
                                            for e in s)},
             'weight_map': {e.name: name for name, s in zip(names, shards) for e in s}}
    (out_dir / _INDEX_FILE).write_text(json.dumps(index, indent=2) + '\n')
    written.append(_INDEX_FILE)
  # transformers 5 reads `dtype`; 4.x (before 4.56) and the servers built on it read `torch_dtype`
  # and take a config without it for float32 weights of unknown width.
  config = hf.hf_config_from_model_config(cfg) | {'dtype': dtype, 'torch_dtype': dtype}
  if tokenizer != 'byte':
    config |= special_token_ids(tokenizer, eos_token)
  (out_dir / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  written.append('config.json')
  if tokenizer != 'byte':
    copies = hf.copy_tokenizer(Path(tokenizer), out_dir)
    written += [str(p.relative_to(out_dir)) for p in copies]
    if chat_template:  # the run's data.chat_template, which transformers prefers to the config's
      shutil.copyfile(chat_template, out_dir / CHAT_TEMPLATE_FILE)
      written += [] if CHAT_TEMPLATE_FILE in written else [CHAT_TEMPLATE_FILE]
  return written

