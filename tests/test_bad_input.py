"""The bad-input table of docs/bad-input.md, one test (or parametrized case) per row.

Every case runs in process (config_lib / train.train_and_evaluate / hf.load_hf) and asserts the
exception type, the words of the message that name the problem and the fix, and that nothing was
written: the workdir is not created and the tree of the test's directory is unchanged. A few
launch.py subprocess tests show that the command line prints `error: ...` without a traceback.
Rows covered by other test files are referenced from that table instead of repeated here.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from megatrain_jax import config as config_lib
from megatrain_jax import hf
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax import train
from megatrain_jax.data import ByteTokenizer, prepare_dataset
from megatrain_jax.errors import ConfigError

from helpers import REPO_ROOT, read_only_directory

TEXT = ('First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n'
        * 60)  # ~4.6 KB of text: enough for the small shapes below


def config_with(**overrides) -> ml_collections.ConfigDict:
  fields = dict(jax_cache_dir='', train__progress_bar=False, train__seq_len=16,
                train__batch_size=2, train__eval_batches=1, train__steps=1)
  fields.update(overrides)
  return config_lib.load_config('tiny', **fields)


def tree(root: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob('*'))


def write(path: pathlib.Path, data: bytes | str) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  if isinstance(data, str):
    data = data.encode('utf-8')
  path.write_bytes(data)
  return str(path)


def assert_refused(tmp_path: pathlib.Path, config, fragments, workdir=None) -> str:
  """train_and_evaluate raises a ConfigError holding every fragment, and writes nothing."""
  workdir = workdir or tmp_path / 'run'
  before = tree(tmp_path)
  with pytest.raises(ConfigError) as info:
    train.train_and_evaluate(config, str(workdir))
  message = str(info.value)
  for fragment in fragments:
    assert fragment in message, message
  assert not pathlib.Path(workdir).exists()
  assert tree(tmp_path) == before
  return message


def prepared_dir(directory: pathlib.Path) -> str:
  """A directory written by the prepare step (byte tokenizer) from TEXT."""
  source = write(directory / 'src' / 'text.txt', TEXT)
  return str(prepare_dataset(directory / 'prepared', ByteTokenizer(), train_sources=[source]).dir)


def small_hf_tokenizer(directory: pathlib.Path) -> str:
  """A word-level BPE (a few dozen ids) trained on TEXT; nothing downloaded."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator([TEXT], trainer=trainers.BpeTrainer(
      vocab_size=64, special_tokens=['[UNK]'], show_progress=False))
  path = directory / 'tokenizer.json'
  path.parent.mkdir(parents=True, exist_ok=True)
  tok.save(str(path))
  return str(path)


# ------------------------------------------------------------------------------------------------
# Config fields, through train_and_evaluate: refused before the workdir is created.
# Each case: overrides (or a function of an inputs directory returning them), message fragments.
# ------------------------------------------------------------------------------------------------

def _truncated_prepared(d):
  path = prepared_dir(d)
  with open(pathlib.Path(path) / 'train-00000.bin', 'r+b') as f:
    f.truncate(10)
  return dict(data__path=path)


def _prepared_other_tokenizer(d):
  return dict(data__path=prepared_dir(d), data__tokenizer=small_hf_tokenizer(d / 'tok'),
              model__vocab_size=512)


CONFIG_CASES = [
    # model.*
    ('model.vocab_size=0', dict(model__vocab_size=0), ['model.vocab_size=0', 'positive integer']),
    ('model.d_model<0', dict(model__d_model=-8), ['model.d_model=-8', 'positive integer']),
    ('model.num_layers=0', dict(model__num_layers=0), ['model.num_layers=0', 'positive integer']),
    ('model.num_heads=0', dict(model__num_heads=0), ['model.num_heads=0', 'positive integer']),
    ('model.num_kv_heads=0', dict(model__num_kv_heads=0), ['model.num_kv_heads=0']),
    ('model.d_ff=0', dict(model__d_ff=0), ['model.d_ff=0', 'positive integer']),
    ('model.max_seq_len=0', dict(model__max_seq_len=0), ['model.max_seq_len=0']),
    ('model.head_dim odd', dict(model__head_dim=3), ['model.head_dim=3', 'positive even number']),
    ('model.head_dim<0', dict(model__head_dim=-2), ['model.head_dim=-2', 'positive even number']),
    ('model.dtype', dict(model__dtype='float16'), ['model.dtype', 'float32, bfloat16']),
    ('model.matmul_precision', dict(model__matmul_precision='fast'),
     ['model.matmul_precision', 'highest, high, default']),
    ('model.rope_scaling.type', dict(model__rope_scaling__type='dynamic'),
     ['model.rope_scaling.type', 'none, linear, llama3, yarn']),
    ('model.rope_theta<=0', dict(model__rope_theta=0.0), ['model.rope_theta=0.0', 'must be > 0']),
    ('model.rope_scaling.factor<=0', dict(model__rope_scaling__type='linear',
                                          model__rope_scaling__factor=0.0),
     ['model.rope_scaling.factor=0.0', 'must be > 0']),
    ('model.rope_scaling low>=high', dict(model__rope_scaling__type='llama3',
                                          model__rope_scaling__factor=8.0,
                                          model__rope_scaling__low_freq_factor=4.0),
     ['low_freq_factor=4.0', 'high_freq_factor=4.0', '0 < low_freq_factor < high_freq_factor']),
    ('model.rope_scaling.original_max_len<=0', dict(model__rope_scaling__type='llama3',
                                                    model__rope_scaling__factor=8.0,
                                                    model__rope_scaling__original_max_len=0),
     ['model.rope_scaling.original_max_len=0', 'positive integer']),
    ('model.rope_scaling beta_slow>=beta_fast', dict(model__rope_scaling__type='yarn',
                                                    model__rope_scaling__factor=4.0,
                                                    model__rope_scaling__beta_slow=32.0),
     ['beta_fast=32.0', 'beta_slow=32.0', '0 < beta_slow < beta_fast']),
    ('model.rope_scaling.attention_factor<0', dict(model__rope_scaling__type='yarn',
                                                   model__rope_scaling__factor=4.0,
                                                   model__rope_scaling__attention_factor=-1.0),
     ['model.rope_scaling.attention_factor=-1.0', 'must be >= 0']),
    ('model.norm_eps<=0', dict(model__norm_eps=0.0), ['model.norm_eps=0.0', 'must be > 0']),
    ('model.hf_architecture', dict(model__hf_architecture='GPT2LMHeadModel'),
     ["model.hf_architecture='GPT2LMHeadModel' is not one of '', LlamaForCausalLM",
      'MistralForCausalLM']),
    ('model.init_std<=0', dict(model__init_std=-0.02), ['model.init_std=-0.02', 'must be > 0']),
    ('model.sliding_window<0', dict(model__sliding_window=-1),
     ['model.sliding_window=-1', 'must be >= 0']),
    ('model.attention_chunk<0', dict(model__attention_chunk=-1),
     ['model.attention_chunk=-1', 'must be >= 0']),
    ('vocab_size>=2^31', dict(model__vocab_size=10**12),
     ['model.vocab_size=1,000,000,000,000 is not a vocabulary', 'token ids are int32']),
    # train.*
    ('train.steps<1', dict(train__steps=-1), ['train.steps', 'must be >= 1, got -1']),
    ('train.batch_size=0', dict(train__batch_size=0), ['train.batch_size', 'must be >= 1']),
    ('train.seq_len=0', dict(train__seq_len=0), ['train.seq_len', 'must be >= 1']),
    ('train.log_every=0', dict(train__log_every=0), ['train.log_every', 'must be >= 1']),
    ('train.eval_batches=0', dict(train__eval_batches=0), ['train.eval_batches', 'must be >= 1']),
    ('train.lr<=0', dict(train__lr=0.0), ['train.lr', 'must be > 0']),
    ('train.eps<=0', dict(train__eps=0.0), ['train.eps', 'must be > 0']),
    ('train.b1>=1', dict(train__b1=1.0), ['train.b1', 'must be in [0, 1)']),
    ('train.b2<0', dict(train__b2=-0.1), ['train.b2', 'must be in [0, 1)']),
    ('train.min_lr_ratio>1', dict(train__min_lr_ratio=2.0), ['train.min_lr_ratio', '[0, 1]']),
    ('train.lr_schedule unknown', dict(train__lr_schedule='step'),
     ['train.lr_schedule', 'cosine, linear, constant', "'step'"]),
    ('train.warmup_steps<0', dict(train__warmup_steps=-1), ['train.warmup_steps', '>= 0']),
    ('train.epochs<0', dict(train__epochs=-1.0), ['train.epochs', '>= 0']),
    ('train.warmup_ratio>=1', dict(train__warmup_ratio=1.0), ['train.warmup_ratio', '[0, 1)']),
    ('train.weight_decay<0', dict(train__weight_decay=-0.1), ['train.weight_decay', '>= 0']),
    ('train.grad_clip<0', dict(train__grad_clip=-1.0), ['train.grad_clip', '>= 0 (0 = off)']),
    ('train.eval_every<0', dict(train__eval_every=-1), ['train.eval_every', '>= 0']),
    ('train.seed<0', dict(train__seed=-1), ['train.seed', '[0, 2**31 - 1]']),
    ('train.seed>=2**31', dict(train__seed=2**31), ['train.seed', '[0, 2**31 - 1]']),
    # any float field
    ('float inf', dict(train__lr=float('inf')), ['train.lr', 'finite number, got inf']),
    ('float nan', dict(model__rope_theta=float('nan')), ['model.rope_theta', 'finite number']),
    ('float nan offload', dict(offload__host_buffer_gb=float('nan')),
     ['offload.host_buffer_gb', 'finite number']),
    # checkpoint.*
    ('checkpoint.every<-1', dict(checkpoint__every=-2), ['checkpoint.every', 'or -1 (never)']),
    ('checkpoint.keep=0', dict(checkpoint__keep=0), ['checkpoint.keep', 'must be >= 1']),
    # offload.*
    ('offload.codec_level zstd', dict(offload__codec='zstd', offload__codec_level=23),
     ['offload.codec_level=23', "offload.codec='zstd'", '[-131072, 22]']),
    ('offload.codec_level blosc', dict(offload__codec='blosc', offload__codec_level=10),
     ['offload.codec_level=10', '[0, 9]']),
    ('offload.shard_mb<=0', dict(offload__shard_mb=0.0), ['offload.shard_mb=0.0', 'must be > 0']),
    ('offload.host_buffer_gb<=0', dict(offload__host_buffer_gb=-1.0),
     ['offload.host_buffer_gb=-1.0', 'must be > 0']),
    # jax_cache_dir
    ('jax_cache_dir file', lambda d: dict(jax_cache_dir=write(d / 'cache_file', 'x')),
     ['jax_cache_dir', 'is a file', "set it to ''"]),
    # data.*
    ('data.val_fraction', dict(data__val_fraction=0.9), ['data.val_fraction', '(0, 0.5]']),
    ('data.pack', dict(data__pack='rows'), ['data.pack', "got 'rows'", "'stream'", "'documents'",
                                                 "'best_fit'"]),
    ('data.path empty dir', lambda d: (d / 'empty_dir').mkdir() or dict(
        data__path=str(d / 'empty_dir')), ['data.path', 'contains no (non-hidden) files']),
    ('data.path empty file', lambda d: dict(data__path=write(d / 'empty.txt', b'')),
     ['data.path', 'is empty (0 bytes of text)']),
    ('data.path binary', lambda d: dict(data__path=write(d / 'model.bin', bytes(range(256)) * 4)),
     ['data.path', 'looks like a binary file', 'NUL character at offset 0']),
    ('data.path utf16', lambda d: dict(data__path=write(d / 'u16.txt', TEXT.encode('utf-16'))),
     ['data.path', 'binary', 'convert UTF-16 text to UTF-8']),
    ('data.path not utf8', lambda d: dict(data__path=write(d / 'latin1.txt',
                                                          'café\n'.encode('latin-1') * 900)),
     ['data.path', 'is not UTF-8 text', 'convert it to UTF-8']),
    ('data.path too short', lambda d: dict(data__path=write(d / 'short.txt', 'hello world\n')),
     ['train.seq_len', 'training split has 12 tokens', 'seq_len + 1 = 17']),
    ('data.val split too short', lambda d: dict(data__path=write(d / 'small.txt', 'x' * 200),
                                                train__batch_size=16),
     ['data.val_path / data.val_fraction', 'validation split has 10 tokens',
      'train.seq_len + 1 = 17']),
    ('data.val_path too short', lambda d: dict(data__val_path=write(d / 'val.txt', 'tiny')),
     ['validation split has 4 tokens']),
    ('data.val_path empty', lambda d: dict(data__val_path=write(d / 'val.txt', b'')),
     ['data.val_path', 'is empty']),
    ('data.val_path binary', lambda d: dict(data__val_path=write(d / 'val.bin', b'\0\1\2' * 9)),
     ['data.val_path', 'binary']),
    ('data.val_path is data.path', lambda d: dict(data__path=(same := write(d / 's.txt', TEXT)),
                                                   data__val_path=same),
     ['data.val_path', 's.txt is in data.path too', 'score text the run trains on']),
    ('data.path bad meta.json', lambda d: dict(data__path=write(d / 'p' / 'meta.json', '{oops')
                                               .rsplit('/', 1)[0]),
     ['data.path', 'has no readable meta.json', 'not a prepared dataset']),
    ('data.path truncated token files', _truncated_prepared,
     ['data.path', 'do not match its meta.json', 'delete the directory and prepare it again']),
    ('data.val_path with prepared path', lambda d: dict(data__path=prepared_dir(d),
                                                        data__val_path=write(d / 'v.txt', TEXT)),
     ['data.val_path', 'already holds its validation split', "set data.val_path to ''"]),
    ('data.tokenizer vs prepared', _prepared_other_tokenizer,
     ['data.tokenizer', "was prepared with tokenizer 'byte'", 'point data.path at the raw text']),
    ('data.tokenizer not json', lambda d: dict(data__tokenizer=write(d / 'tokenizer.json', '{x')),
     ['data.tokenizer', 'could not load', 'as a Hugging Face tokenizer.json', "'byte'"]),
    ('data.tokenizer json not a tokenizer', lambda d: dict(
        data__tokenizer=write(d / 'tokenizer.json', '{"a": 1}')),
     ['data.tokenizer', 'could not load']),
    ('data.tokenizer dir without one', lambda d: dict(data__tokenizer=str(d)),
     ['data.tokenizer', 'tokenizer.json does not exist']),
    ('data.cache_dir is data.path', lambda d: dict(
        data__path=str(pathlib.Path(write(d / 'texts' / 'a.txt', TEXT)).parent),
        data__cache_dir=str(d / 'texts')), ['data.cache_dir', 'is also data.path']),
    ('eval.working_gb=0', dict(eval__working_gb=0.0), ['eval.working_gb', 'must be > 0']),
]


@pytest.mark.parametrize('overrides, fragments',
                         [pytest.param(o, f, id=i) for i, o, f in CONFIG_CASES])
def test_config_value(tmp_path, overrides, fragments):
  inputs = tmp_path / 'inputs'
  inputs.mkdir()
  if callable(overrides):
    overrides = overrides(inputs)
  assert_refused(tmp_path, config_with(**overrides), fragments)


def test_a_read_only_data_cache_dir_is_refused_before_anything_is_written(tmp_path):
  """data.cache_dir on a read-only mount (a shared dataset cache): training and --prepare ended
  in an OSError's traceback from the data lock's mkdir; both are refused up front, naming it."""
  with read_only_directory() as locked:
    said = 'is on a read-only filesystem' if os.geteuid() == 0 else 'is not writable'
    config = config_with(data__cache_dir=str(locked / 'cache'))
    assert_refused(tmp_path, config, [f'data.cache_dir={locked}/cache: {locked} {said}',
                                      "Point data.cache_dir at a directory you can write to, or "
                                      "set it to '' for <workdir>/data"])
    with pytest.raises(ConfigError, match=rf'data.cache_dir={locked}/cache: {locked} {said}'):
      train.prepare(config, str(tmp_path / 'prep'))


def test_warmup_longer_than_the_run_is_accepted():
  """Not an error: warmup is clamped to steps - 1 (smoke runs shorten train.steps alone)."""
  config = config_with(train__steps=3, train__warmup_steps=50)
  config_lib.validate(config)
  schedule = optim.lr_schedule(config.train)
  lrs = [float(schedule(step)) for step in range(3)]
  assert lrs[0] == 0 and lrs[-1] == pytest.approx(config.train.lr)  # reaches the peak at the end


# ------------------------------------------------------------------------------------------------
# Data that the prepare step has to read in full: refused after tokenizing; the workdir then holds
# only what the prepare step wrote.
# ------------------------------------------------------------------------------------------------

def test_too_short_for_another_tokenizer_is_refused_after_the_prepare_step(tmp_path):
  config = config_with(data__path=write(tmp_path / 'short.txt', 'Speak, speak.\n'),
                       data__tokenizer=small_hf_tokenizer(tmp_path / 'tok'), model__vocab_size=512)
  with pytest.raises(ConfigError, match=r'train.seq_len: the training split has \d+ tokens'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert {p.split('/')[0] for p in tree(tmp_path / 'run')} == {'data'}


@pytest.mark.parametrize('tail, message', [(b'\xff', 'is not UTF-8 text'), (b'\0', 'NUL')],
                         ids=['not-utf8', 'nul'])
def test_bad_bytes_past_the_sniffed_head_are_refused_by_the_prepare_step(tmp_path, tail, message):
  source = write(tmp_path / 'late.txt', b'a' * (100 << 10) + tail + b'\n')
  with pytest.raises(ConfigError, match=message):
    train.train_and_evaluate(config_with(data__path=source), str(tmp_path / 'run'))
  assert tree(tmp_path / 'run' / 'data') == []  # no token file, no temp file left behind


# ------------------------------------------------------------------------------------------------
# Config loading and command-line overrides, in process.
# ------------------------------------------------------------------------------------------------

def test_override_of_the_wrong_type():
  with pytest.raises(ConfigError, match=r'train.steps: got 2.5; it must be an integer, like its '
                     r'default'):
    config_lib.load_config('tiny', train__steps=2.5)
  with pytest.raises(ConfigError, match=r'model.qkv_bias: got 1; it must be a bool'):
    config_lib.load_config('tiny', model__qkv_bias=1)
  with pytest.raises(ConfigError, match=r"--config.train.lr=fast: train.lr: got 'fast'; it must "
                     r'be a number'):
    config_lib.check_override('train.lr', 'fast')
  config_lib.check_override('train.steps', '0x10')  # what absl itself accepts passes
  config_lib.check_override('train.progress_bar', 'false')


def test_override_of_a_section():
  with pytest.raises(ConfigError, match=r"config key 'model' is a section, not a field.*d_model"):
    config_lib.load_config('tiny', model=3)
  with pytest.raises(ConfigError, match=r"'model.rope_scaling' is a section.*factor"):
    config_lib.check_override('model.rope_scaling', 'linear')


def test_config_file_with_a_wrong_type_or_a_missing_field(tmp_path):
  fields = config_with().to_dict()
  fields['train']['steps'] = 2.5
  with pytest.raises(ConfigError, match='train.steps: got 2.5; it must be an integer'):
    train.train_and_evaluate(ml_collections.ConfigDict(fields), str(tmp_path / 'run'))
  fields['train']['steps'] = 3
  del fields['train']['lr']
  with pytest.raises(ConfigError, match=r"config key 'train.lr' is missing.*default.get_config"):
    train.train_and_evaluate(ml_collections.ConfigDict(fields), str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_empty_workdir():
  with pytest.raises(ConfigError, match='--workdir is empty'):
    train.train_and_evaluate(config_with(), '')


def test_a_workdir_holding_another_programs_config_json_is_refused(tmp_path, hf_checkpoint):
  """--workdir pointed at a Hugging Face model's directory (or another trainer's output): the run
  wrote its own config.json over the model's. Training and --prepare are refused before anything
  is written, naming init.from_hf for the model."""
  model = tmp_path / 'model'
  shutil.copytree(hf_checkpoint, model)
  before, original = tree(tmp_path), (model / 'config.json').read_bytes()
  for job in (train.train_and_evaluate, train.prepare):
    with pytest.raises(ConfigError, match=(
        rf"--workdir={model}: its config.json is not a run's \(a Hugging Face model's: to start "
        rf"from that model, pass --config.init.from_hf={model}\), and a run writes its own")):
      job(config_with(train__steps=2), str(model))
  assert tree(tmp_path) == before
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'config.json').write_text('{"learning_rate": 0.1}')
  before = tree(tmp_path)
  with pytest.raises(ConfigError, match=r"its config.json is not a run's, and a run writes"):
    train.train_and_evaluate(config_with(train__steps=2), str(tmp_path / 'other'))
  assert tree(tmp_path) == before and (model / 'config.json').read_bytes() == original


# ------------------------------------------------------------------------------------------------
# Hugging Face directories (hf.load_hf).
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def hf_checkpoint(tmp_path_factory) -> pathlib.Path:
  cfg = model_lib.ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, d_ff=64, max_seq_len=64)
  directory = tmp_path_factory.mktemp('hf') / 'model'
  hf.save_hf(directory, cfg, model_lib.init_params(cfg, jax.random.key(0)))
  return directory


def _with_config(edit):
  def make(directory):
    path = directory / 'config.json'
    path.write_text(edit(json.loads(path.read_text())))
  return make


def _truncate(name, keep):
  def make(directory):
    path = directory / name
    path.write_bytes(path.read_bytes()[:keep])
  return make


def _sharded(directory, truncate=False):
  (directory / 'model.safetensors').rename(directory / 'part-1.safetensors')
  names = list(safetensors.numpy.load_file(directory / 'part-1.safetensors'))
  (directory / 'model.safetensors.index.json').write_text(
      json.dumps({'weight_map': {n: 'part-1.safetensors' for n in names}}))
  if truncate:
    _truncate('part-1.safetensors', -100)(directory)


def _int_tensor(directory):
  tensors = safetensors.numpy.load_file(directory / 'model.safetensors')
  tensors['model.norm.weight'] = tensors['model.norm.weight'].astype(np.int32)
  safetensors.numpy.save_file(tensors, directory / 'model.safetensors')


def _index(text):
  def make(directory):
    (directory / 'model.safetensors').unlink()
    (directory / 'model.safetensors.index.json').write_text(text)
  return make


HF_CASES = [
    ('config.json not json', _with_config(lambda c: '{oops'), ['cannot parse', 'config.json']),
    ('config.json not an object', _with_config(lambda c: '[1, 2]'),
     ['must hold a JSON object, found list']),
    ('config.json rms_norm_eps<=0', _with_config(lambda c: json.dumps(c | {'rms_norm_eps': -1})),
     ['config.json does not describe a valid LlamaForCausalLM', 'model.norm_eps=-1']),
    ('index lists a missing shard', _index('{"weight_map": {"model.norm.weight": "gone.st"}}'),
     ['lists shard(s) missing', 'gone.st', 'Copy the complete checkpoint']),
    ('index without weight_map', _index('{"metadata": {}}'),
     ['cannot read the weight_map', 'Re-export']),
    ('non-float tensor', _int_tensor, ['model.norm.weight', 'dtype I32', 'no quantized']),
    ('truncated safetensors', _truncate('model.safetensors', -100),
     ['model.safetensors is not a complete safetensors file', 'Copy the checkpoint again']),
    ('empty safetensors', _truncate('model.safetensors', 0),
     ['not a complete safetensors file']),
    ('truncated shard', lambda d: _sharded(d, truncate=True),
     ['part-1.safetensors is not a complete safetensors file']),
]


@pytest.mark.parametrize('damage, fragments', [pytest.param(d, f, id=i) for i, d, f in HF_CASES])
def test_hf_directory(hf_checkpoint, tmp_path, damage, fragments):
  directory = tmp_path / 'model'
  shutil.copytree(hf_checkpoint, directory)
  hf.load_hf(directory)  # the undamaged copy loads
  damage(directory)
  with pytest.raises(ConfigError) as info:
    hf.load_hf(directory)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def test_hf_path_is_a_file(hf_checkpoint):
  with pytest.raises(ConfigError, match='is a file; pass the Hugging Face model directory'):
    hf.load_hf(hf_checkpoint / 'config.json')


def test_a_seq_len_beyond_a_checkpoints_context_names_a_fix_that_works(tmp_path):
  """train.seq_len past init.from_hf's max_position_embeddings (64) names config.json as the
  place to extend it, not model.max_seq_len, which the next error refuses as an override of the
  checkpoint's shape; nothing is written."""
  cfg = model_lib.ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, d_ff=64, max_seq_len=64)
  hf_checkpoint = tmp_path / 'model'  # byte ids: the byte tokenizer reads its data
  hf.save_hf(hf_checkpoint, cfg, model_lib.init_params(cfg, jax.random.key(0)))
  config = config_lib.load_config('tiny', init__from_hf=str(hf_checkpoint), train__seq_len=128)
  with pytest.raises(ConfigError, match=r"train.seq_len: 128 is longer than the model maximum "
                     r"model.max_seq_len=64. Lower train.seq_len, or extend the checkpoint's "
                     r"context in its config.json .*max_position_embeddings"):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  with pytest.raises(ConfigError, match=r'model.max_seq_len=128 disagrees with .*config.json'):
    train.train_and_evaluate(config_lib.load_config(
        'tiny', init__from_hf=str(hf_checkpoint), train__seq_len=128, model__max_seq_len=128),
        str(tmp_path / 'run'), overrides=['model.max_seq_len'])
  assert not (tmp_path / 'run').exists()


# ------------------------------------------------------------------------------------------------
# The command line: `error: ...`, status 1, no traceback, no workdir.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('args, fragment', [
    (['--config.train.steps=abc'], "error: --config.train.steps=abc: train.steps: got 'abc'; it "
     'must be an integer'),
    (['--config.model=3'], "error: config key 'model' is a section"),
    (['--no_such_flag'], "error: Unknown command line flag 'no_such_flag'"),
    (['--config.train.lr=-1'], 'error: train.lr: must be > 0, got -1.0.'),
], ids=['bad-type', 'section', 'unknown-flag', 'bad-value'])
def test_launch_prints_error_without_traceback(tmp_path, args, fragment):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, str(REPO_ROOT / 'launch.py'), '--config', 'tiny', *args,
       f'--workdir={workdir}'], cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr
  assert fragment in result.stderr, result.stderr
  assert 'Traceback' not in result.stderr and 'FATAL' not in result.stderr
  assert not workdir.exists()


def test_launch_workdir_is_a_file(tmp_path):
  blocker = pathlib.Path(write(tmp_path / 'a_file', 'x'))
  result = subprocess.run(
      [sys.executable, str(REPO_ROOT / 'launch.py'), '--config', 'tiny', f'--workdir={blocker}'],
      cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  assert f'error: --workdir={blocker}: {blocker} is a file, not a directory' in result.stderr
  assert blocker.read_text() == 'x'


def test_a_chat_template_that_is_no_regular_file_or_another_runs_path_is_refused(tmp_path):
  """data.chat_template was read whole wherever it pointed: /dev/zero (from another run's
  config.json too, by --sample or init.from_run) grew until killed. It must be a regular file
  of at most MAX_TEMPLATE_CHARS. A run's recorded template is read only where it is the run's
  own copy (<workdir>/chat_template.jinja): any text file parses as jinja, and another path's
  file went into the new run and its --export_hf output."""
  from megatrain_jax import runs  # pylint: disable=g-import-not-at-top
  from megatrain_jax.data import documents  # pylint: disable=g-import-not-at-top
  big = tmp_path / 'big.jinja'
  big.write_text('{{ messages }}' * (documents.MAX_TEMPLATE_CHARS // 10))
  for path, why in (('/dev/zero', 'is not a regular file'), (tmp_path, 'is not a regular file'),
                    (big, f'more than {documents.MAX_TEMPLATE_CHARS:,} characters')):
    with pytest.raises(ConfigError, match=f'data.chat_template: cannot read {path} as a UTF-8 '
                       f'jinja file .*{why}'):
      documents.read_chat_template(path)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  private = tmp_path / 'notes.txt'
  private.write_text('private notes, valid jinja')
  for recorded in ('/dev/zero', str(private)):
    (workdir / 'config.json').write_text(json.dumps({'data': {'chat_template': recorded}}))
    with pytest.raises(ConfigError, match=rf'the run in {workdir} records data.chat_template='
                       rf'{recorded}, which is not its own copy .*set data.chat_template'):
      runs.run_data_field(workdir, 'chat_template')
  (workdir / 'chat_template.jinja').write_text('{{ messages }}')
  (workdir / 'config.json').write_text(json.dumps(
      {'data': {'chat_template': '/elsewhere/run/chat_template.jinja'}}))  # the run, moved
  assert runs.run_data_field(workdir, 'chat_template') == str(workdir / 'chat_template.jinja')
  config = ml_collections.ConfigDict({'data': {'chat_template': '/dev/zero'}})
  with pytest.raises(ConfigError, match='is not a regular file'):
    runs.adopt_chat_template(config, tmp_path / 'new')
