"""The Hugging Face checkpoint format: Llama, Qwen2, Qwen3, Mistral, Phi-3 safetensors <->
`ModelConfig`.

`load_hf` reads a local directory as written by transformers' `save_pretrained`: `config.json` and
either `model.safetensors` or `model.safetensors.index.json` with its shards. Nothing is
downloaded. The five architectures share one decoder layout (pre-norm RMSNorm, RoPE, grouped-query
attention, SwiGLU); they differ only in config fields, which `model_config_from_hf` maps, and in
how Phi-3 stores its weights: Qwen2's q/k/v projections always carry a bias, Qwen3 normalises each
head's q and k (RMSNorm over the head dimension, before RoPE) and has no bias, Mistral and Phi-3
may use a sliding attention window, Phi-3 (and Phi-4) stores q/k/v as one qkv_proj and gate/up as
one gate_up_proj, and any of them may use plain, linear, Llama-3 or YaRN RoPE scaling.

Every tensor goes through one explicit name map (`_tensor_map`): HF name (and, of a fused tensor,
its rows) -> our params path, the shape `ModelConfig` implies for it, and whether it is a linear
weight (torch stores `nn.Linear` weights [out, in]; our kernels are [in, out]). Names, shapes and
dtypes of the whole checkpoint are checked against that map from the safetensors headers before
any tensor data is read, so a mismatched config.json fails fast with the offending tensor named.

`save_hf` is the inverse, for exporting a trained model to transformers (>= 5 config layout): in
Llama's names, so a Phi-3 model is written as the Llama (or, with a window, Mistral) checkpoint
of the same function.
"""

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
# Registers bfloat16 with numpy: safetensors' numpy backend cannot read BF16 tensors (the usual
# dtype of released checkpoints) without it.
import ml_dtypes  # noqa: F401  pylint: disable=unused-import
import numpy as np
import safetensors
import safetensors.numpy

from megatrain_jax import fs
from megatrain_jax.errors import ConfigError, UnsupportedModelError
from megatrain_jax.model.config import HF_ARCHITECTURES, ModelConfig, yarn_mscale

SUPPORTED_ARCHITECTURES = HF_ARCHITECTURES
# `model_type` -> architecture, for config.json files without an `architectures` list.
_MODEL_TYPES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                'qwen3': 'Qwen3ForCausalLM', 'mistral': 'MistralForCausalLM',
                'phi3': 'Phi3ForCausalLM'}
# Architectures read but not written: Phi-3 and Phi-4 (Phi3ForCausalLM) are Llama decoders whose
# q/k/v and gate/up projections are stored fused (qkv_proj, gate_up_proj); an export writes them
# unfused as the Llama (or, with a window, Mistral) checkpoint of the same function.
_FUSED_ARCHITECTURES = ('Phi3ForCausalLM',)

_CONFIG_FILE = 'config.json'
_SINGLE_FILE = 'model.safetensors'
_INDEX_FILE = 'model.safetensors.index.json'

# config.json keys without a sensible default: they fix the shapes of the weights.
_REQUIRED_KEYS = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                  'num_attention_heads', 'max_position_embeddings')
# transformers' own defaults for these architectures, used when config.json omits the key.
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_INIT_STD = 0.02
# Qwen2: layers at index >= max_window_layers use the sliding window (transformers' default 28).
_DEFAULT_QWEN2_MAX_WINDOW_LAYERS = 28
# Where an architecture's transformers default differs from the ones above (MistralConfig's
# window of 4096, Phi3Config's rms_norm_eps of 1e-5): a config.json without the key (one written
# by hand, or trimmed) means what transformers makes of it. An explicit null stays null (Mistral
# v0.3's `"sliding_window": null` is full attention). Without num_key_value_heads, other than
# Mistral's, every query head has its own (Qwen2Config's default of 32 KV heads would be no model
# with fewer query heads).
_ARCHITECTURE_DEFAULTS = {'MistralForCausalLM': {'sliding_window': 4096, 'num_key_value_heads': 8},
                          'Phi3ForCausalLM': {'rms_norm_eps': 1e-5}}

# HF rope_type -> ModelConfig.rope_scaling_type.
_ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3', 'yarn': 'yarn'}

# Floating-point safetensors dtypes; anything else (int8, fp8 ...) is a quantized checkpoint.
_FLOAT_DTYPES = ('F16', 'BF16', 'F32', 'F64')
# How many names an error message lists before summarising the rest.
_MAX_LISTED = 8


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One checkpoint tensor and where it goes in our params.

  Attributes:
    hf_name: The safetensors name, e.g. 'model.layers.3.self_attn.q_proj.weight'.
    path: Keys of the params leaf, e.g. ('layers', 'attn', 'q_proj', 'kernel').
    hf_shape: The shape in the checkpoint (torch layout).
    transpose: True for linear weights: HF [out, in] <-> our kernel [in, out].
    layer: Index along the stacked layer axis of the leaf, or None for non-layer tensors.
    hf_rows: (start, stop) of the checkpoint tensor's rows (torch's out axis) that hold the leaf,
      for a leaf stored fused with others (Phi-3's qkv_proj: q, k, v); None: all of them.
  """
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  transpose: bool
  layer: int | None = None
  hf_rows: tuple[int, int] | None = None


def _tensor_map(cfg: ModelConfig, architecture: str = 'LlamaForCausalLM') -> list[_Tensor]:
  """Every tensor a checkpoint of `cfg` holds, with its shape as implied by `cfg`: named as
  `architecture` names them (Phi3ForCausalLM: fused projections; the others: Llama's names)."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  # (name after 'model.layers.{i}.', path under 'layers', HF shape, transpose[, HF rows])
  if architecture in _FUSED_ARCHITECTURES:
    qkv, gate_up = (q_out + 2 * kv_out, d), (2 * f, d)
    projections = [
        ('self_attn.qkv_proj.weight', ('attn', 'q_proj', 'kernel'), qkv, True, (0, q_out)),
        ('self_attn.qkv_proj.weight', ('attn', 'k_proj', 'kernel'), qkv, True,
         (q_out, q_out + kv_out)),
        ('self_attn.qkv_proj.weight', ('attn', 'v_proj', 'kernel'), qkv, True,
         (q_out + kv_out, q_out + 2 * kv_out)),
        ('mlp.gate_up_proj.weight', ('mlp', 'gate_proj', 'kernel'), gate_up, True, (0, f)),
        ('mlp.gate_up_proj.weight', ('mlp', 'up_proj', 'kernel'), gate_up, True, (f, 2 * f))]
  else:
    projections = [
        ('self_attn.q_proj.weight', ('attn', 'q_proj', 'kernel'), (q_out, d), True),
        ('self_attn.k_proj.weight', ('attn', 'k_proj', 'kernel'), (kv_out, d), True),
        ('self_attn.v_proj.weight', ('attn', 'v_proj', 'kernel'), (kv_out, d), True),
        ('mlp.gate_proj.weight', ('mlp', 'gate_proj', 'kernel'), (f, d), True),
        ('mlp.up_proj.weight', ('mlp', 'up_proj', 'kernel'), (f, d), True)]
  per_layer = [
      ('input_layernorm.weight', ('attn_norm', 'scale'), (d,), False),
      *projections,
      ('self_attn.o_proj.weight', ('attn', 'o_proj', 'kernel'), (d, q_out), True),
      ('post_attention_layernorm.weight', ('mlp_norm', 'scale'), (d,), False),
      ('mlp.down_proj.weight', ('mlp', 'down_proj', 'kernel'), (d, f), True),
  ]
  if cfg.qkv_bias:
    per_layer += [
        ('self_attn.q_proj.bias', ('attn', 'q_proj', 'bias'), (q_out,), False),
        ('self_attn.k_proj.bias', ('attn', 'k_proj', 'bias'), (kv_out,), False),
        ('self_attn.v_proj.bias', ('attn', 'v_proj', 'bias'), (kv_out,), False),
    ]
  if cfg.qk_norm:
    per_layer += [
        ('self_attn.q_norm.weight', ('attn', 'q_norm', 'scale'), (cfg.head_dim,), False),
        ('self_attn.k_norm.weight', ('attn', 'k_norm', 'scale'), (cfg.head_dim,), False),
    ]
  tensors = [_Tensor('model.embed_tokens.weight', ('embed', 'embedding'), (v, d), False),
             _Tensor('model.norm.weight', ('head', 'final_norm', 'scale'), (d,), False)]
  if not cfg.tie_embeddings:
    tensors.append(_Tensor('lm_head.weight', ('head', 'lm_head', 'kernel'), (v, d), True))
  for i in range(cfg.num_layers):
    tensors += [_Tensor(f'model.layers.{i}.{name}', ('layers',) + path, shape, transpose, i,
                        *rows) for name, path, shape, transpose, *rows in per_layer]
  return tensors


def tensor_map(cfg: ModelConfig, architecture: str = 'LlamaForCausalLM') -> list[_Tensor]:
  """Every tensor a checkpoint of `cfg` holds (name, params path, torch shape, transposed?,
  layer, rows of a fused tensor), as `architecture` names them; the embedding, the final norm and
  the head first, then the layers."""
  return _tensor_map(cfg, architecture)


def _is_ignorable(name: str, cfg: ModelConfig) -> bool:
  """Tensors some checkpoints carry that the model does not need."""
  # Old transformers versions saved the (recomputable) RoPE frequencies as a buffer.
  if name.endswith('rotary_emb.inv_freq'):
    return True
  # Tied checkpoints sometimes keep a copy of the embedding as the head; transformers ignores it.
  return cfg.tie_embeddings and name == 'lm_head.weight'


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------

def read_hf_config(path: str | Path) -> dict[str, Any]:
  """Reads `config.json` of a local Hugging Face model directory.

  Args:
    path: The model directory.

  Returns:
    The parsed config.json.

  Raises:
    ConfigError: if the directory or its config.json is missing or unreadable.
  """
  directory = Path(path)
  if not directory.exists():
    raise ConfigError(f'Hugging Face model directory {directory} does not exist. Pass a local '
                      'directory written by save_pretrained (nothing is downloaded).')
  if not directory.is_dir():
    raise ConfigError(f'{directory} is a file; pass the Hugging Face model directory that holds '
                      f'{_CONFIG_FILE} and the safetensors weights.')
  config_file = directory / _CONFIG_FILE
  if not config_file.is_file():
    raise ConfigError(f'{directory} has no {_CONFIG_FILE}: it is not a Hugging Face model '
                      'directory. Pass the directory written by save_pretrained.')
  try:
    hf_config = fs.read_json_at_most(config_file, 'the Hugging Face model',
                                     'a config.json is a few KB: copy the model\'s own')
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f'cannot parse {config_file}: {e}. Re-export it with save_pretrained.') from e
  if not isinstance(hf_config, dict):
    raise ConfigError(f'{config_file} must hold a JSON object, found {type(hf_config).__name__}.')
  return hf_config


_LAYER_NAME = re.compile(r'model\.layers\.(\d+)\.')  # every family's layer tensors


def _architecture(hf_config: dict[str, Any]) -> str:
  """The supported architecture named by config.json; UnsupportedModelError otherwise."""
  archs = hf_config.get('architectures') or []
  archs = [archs] if isinstance(archs, str) else archs  # one name, not a list of them
  if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
    raise ConfigError(f'config.json: architectures={archs!r} is not a list of names, e.g. '
                      '["LlamaForCausalLM"]. Fix config.json (save_pretrained writes a list).')
  if not archs and hf_config.get('model_type') in _MODEL_TYPES:
    archs = [_MODEL_TYPES[hf_config['model_type']]]
  for arch in archs:
    if arch in SUPPORTED_ARCHITECTURES:
      return arch
  found = ', '.join(archs) if archs else f'none (model_type={hf_config.get("model_type")!r})'
  raise UnsupportedModelError(
      f'Hugging Face architecture {found} is not supported. megatrain_jax loads '
      f'{", ".join(SUPPORTED_ARCHITECTURES)} checkpoints; convert the model to one of these or '
      'choose a supported one.')


def _required(hf_config: dict[str, Any], key: str):
  value = hf_config.get(key)
  if value is None:
    raise ConfigError(f'config.json lacks {key!r}, which fixes the shape of the weights. Add it '
                      '(save_pretrained always writes it).')
  return value


def _rope_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
  """RoPE settings as ModelConfig fields, from the transformers 5 or 4 config layout."""
  # transformers 5: everything in `rope_parameters`. 4.x: top-level `rope_theta` and an optional
  # `rope_scaling` dict whose type key is `rope_type` (newer) or `type` (older). Where a file has
  # both (our exports; one whose rope_scaling a user added or edited for a 4.x stack, as Qwen's
  # model cards ask), read them as transformers 5 does: a non-empty rope_scaling wins, and
  # a theta it lacks comes from the top-level rope_theta.
  params = dict(hf_config.get('rope_scaling') or hf_config.get('rope_parameters') or {})
  if any(isinstance(value, dict) for value in params.values()):
    raise UnsupportedModelError(f'config.json sets RoPE parameters per layer type '
                                f'({", ".join(params)}); only one RoPE for all layers is '
                                'supported.')
  params.setdefault('rope_theta', hf_config.get('rope_theta', _DEFAULT_ROPE_THETA))
  partial = params.get('partial_rotary_factor', hf_config.get('partial_rotary_factor'))
  if partial not in (None, 1, 1.0):
    raise UnsupportedModelError(f'partial_rotary_factor={partial} is not supported: RoPE rotates '
                                'the whole head dimension here.')
  rope_type = params.get('rope_type', params.get('type', 'default'))
  if rope_type not in _ROPE_TYPES:
    raise UnsupportedModelError(
        f'RoPE type {rope_type!r} is not supported; supported types: {", ".join(_ROPE_TYPES)}.')
  fields = {'rope_theta': float(params.get('rope_theta', _DEFAULT_ROPE_THETA)),
            'rope_scaling_type': _ROPE_TYPES[rope_type]}
  if rope_type in ('linear', 'llama3'):
    fields['rope_scaling_factor'] = float(_rope_param(params, 'factor', rope_type))
  if rope_type in ('llama3', 'yarn'):
    # As in transformers: without it, the model was trained at its full length.
    fields['rope_original_max_len'] = int(params.get('original_max_position_embeddings') or
                                          _required(hf_config, 'max_position_embeddings'))
  if rope_type == 'llama3':
    fields['rope_low_freq_factor'] = float(_rope_param(params, 'low_freq_factor', rope_type))
    fields['rope_high_freq_factor'] = float(_rope_param(params, 'high_freq_factor', rope_type))
  if rope_type == 'yarn':
    fields.update(_yarn_fields(params, hf_config, fields['rope_original_max_len']))
  return fields


def _yarn_fields(params: dict[str, Any], hf_config: dict[str, Any], original: int) -> dict:
  """YaRN's ModelConfig fields, with transformers' defaults (`_compute_yarn_parameters`): the
  factor from the lengths when absent, beta_fast 32 and beta_slow 1, and the attention factor of
  DeepSeek-style mscale / mscale_all_dim resolved to its value (0 = YaRN's own default)."""
  factor = params.get('factor')
  if factor is None:
    factor = _required(hf_config, 'max_position_embeddings') / original
  fields = {'rope_scaling_factor': float(factor),
            'rope_beta_fast': float(params.get('beta_fast') or 32),
            'rope_beta_slow': float(params.get('beta_slow') or 1),
            'rope_truncate': bool(params.get('truncate', True)),
            'rope_attention_factor': float(params.get('attention_factor') or 0.0)}
  mscale, mscale_all_dim = params.get('mscale'), params.get('mscale_all_dim')
  if params.get('attention_factor') is None and mscale and mscale_all_dim:
    fields['rope_attention_factor'] = yarn_mscale(factor, mscale) / yarn_mscale(factor,
                                                                                mscale_all_dim)
  return fields


def _rope_param(params: dict[str, Any], key: str, rope_type: str):
  if params.get(key) is None:
    raise ConfigError(f'config.json RoPE type {rope_type!r} needs {key!r} in rope_parameters '
                      '(or rope_scaling); add it.')
  return params[key]


def _sliding_window(arch: str, hf_config: dict[str, Any]) -> int:
  """The attention window (0 = full causal attention), as transformers applies it."""
  window = hf_config.get('sliding_window')
  if arch in ('MistralForCausalLM', 'Phi3ForCausalLM'):
    return int(window) if window else 0
  if (arch not in ('Qwen2ForCausalLM', 'Qwen3ForCausalLM')
      or not hf_config.get('use_sliding_window') or not window):
    return 0
  # Qwen2/3 window only the layers marked 'sliding_attention' (by default those at index >=
  # max_window_layers); our model applies one window to every layer, so a mix is unsupported.
  num_layers = hf_config['num_hidden_layers']
  layer_types = hf_config.get('layer_types') or [
      'sliding_attention'
      if i >= hf_config.get('max_window_layers', _DEFAULT_QWEN2_MAX_WINDOW_LAYERS)
      else 'full_attention' for i in range(num_layers)]
  sliding = {t == 'sliding_attention' for t in layer_types}
  if len(sliding) > 1:
    raise UnsupportedModelError(
        f'this {arch} config uses a sliding window on some layers only (layer_types / '
        'max_window_layers); only a window on all layers or on none is supported.')
  return int(window) if sliding.pop() else 0


def model_config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
  """Maps a Hugging Face config.json (transformers 4.x or 5.x layout) to a `ModelConfig`.

  Args:
    hf_config: The parsed config.json of a Llama, Qwen2, Qwen3, Mistral or Phi-3 causal LM.

  Returns:
    The ModelConfig with the checkpoint's shapes and numerics; training-only fields (dtype, remat,
    scan_layers, ...) keep their defaults.

  Raises:
    UnsupportedModelError: for another architecture or a feature the model lacks (MLP or output
      projection biases, an activation other than SiLU, other RoPE types, quantized weights).
    ConfigError: if a shape field is missing or the values do not form a valid ModelConfig.
  """
  arch = _architecture(hf_config)
  hf_config = {**_ARCHITECTURE_DEFAULTS.get(arch, {}), **hf_config}
  if hf_config.get('quantization_config'):
    raise UnsupportedModelError('quantized checkpoints are not supported; load the unquantized '
                                '(float16/bfloat16/float32) weights.')
  activation = hf_config.get('hidden_act', 'silu')
  if activation != 'silu':
    raise UnsupportedModelError(f'hidden_act={activation!r} is not supported: the MLP is SwiGLU '
                                '(silu).')
  if hf_config.get('mlp_bias'):
    raise UnsupportedModelError('mlp_bias=true is not supported: the MLP projections have no bias.')
  if arch in ('LlamaForCausalLM', 'Qwen3ForCausalLM') and hf_config.get('attention_bias'):
    # Llama's and Qwen3's attention_bias also put a bias on o_proj, which the model does not have.
    raise UnsupportedModelError(f'attention_bias=true is not supported for {arch}: it adds a '
                                'bias to o_proj too, and only q/k/v biases exist here.')
  shapes = {key: _required(hf_config, key) for key in _REQUIRED_KEYS}
  num_heads = shapes['num_attention_heads']
  try:
    rope = _rope_fields(hf_config)
    window = _sliding_window(arch, hf_config)
  except ConfigError:  # their own refusals (UnsupportedModelError too), as they are
    raise
  except (TypeError, ValueError, OverflowError) as e:  # a string where a number belongs
    raise ConfigError(f'config.json does not describe a valid {arch}: a rope or sliding_window '
                      f'value is not a number ({e}). Fix config.json.') from e
  try:
    return ModelConfig(
        vocab_size=shapes['vocab_size'], d_model=shapes['hidden_size'],
        num_layers=shapes['num_hidden_layers'], num_heads=num_heads,
        num_kv_heads=hf_config.get('num_key_value_heads') or num_heads,
        d_ff=shapes['intermediate_size'], head_dim=hf_config.get('head_dim') or 0,
        max_seq_len=_max_seq_len(shapes['max_position_embeddings'], rope),
        norm_eps=_number(hf_config, 'rms_norm_eps', _DEFAULT_RMS_NORM_EPS),
        tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
        init_std=_number(hf_config, 'initializer_range', _DEFAULT_INIT_STD),
        qkv_bias=arch == 'Qwen2ForCausalLM', qk_norm=arch == 'Qwen3ForCausalLM',
        sliding_window=window, hf_architecture=arch, **rope)
  except ConfigError as e:
    # ModelConfig names its own fields (model.*); say where the bad values came from.
    raise ConfigError(f'config.json does not describe a valid {arch}: {e}') from e


def _number(hf_config: dict[str, Any], key: str, default: float) -> float:
  """config.json's `key` as a float (`default` where absent); a ConfigError naming it where it is
  no number ("abc", a list: a ValueError's traceback before)."""
  value = hf_config.get(key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ConfigError(f'config.json: {key}={value!r} is not a number. Fix config.json '
                      f'(transformers writes it as one, e.g. {default}).')
  return float(value)


def _max_seq_len(max_position_embeddings: int, rope: dict[str, Any]) -> int:
  """The longest sequence the model is meant for: config.json's max_position_embeddings, or
  with YaRN the original length times the factor where that is longer (Qwen2.5's and Qwen3's
  model cards add rope_scaling to a config.json that keeps the original length; serving stacks
  such as vLLM derive the extended length the same way)."""
  if rope['rope_scaling_type'] != 'yarn':
    return max_position_embeddings
  return max(max_position_embeddings,
             int(rope['rope_scaling_factor'] * rope['rope_original_max_len']))


def _hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
  """transformers 5's `rope_parameters` of `cfg` (theta, type and the type's parameters)."""
  rope = {'rope_type': {v: k for k, v in _ROPE_TYPES.items()}[cfg.rope_scaling_type],
          'rope_theta': cfg.rope_theta}
  if cfg.rope_scaling_type != 'none':
    rope['factor'] = cfg.rope_scaling_factor
  if cfg.rope_scaling_type == 'llama3':
    rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  if cfg.rope_scaling_type == 'yarn':
    rope.update(original_max_position_embeddings=cfg.rope_original_max_len,
                beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                truncate=cfg.rope_truncate)
    if cfg.rope_attention_factor:
      rope['attention_factor'] = cfg.rope_attention_factor
  return rope


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json of `cfg` (read by transformers 5 and 4.x); inverse of `model_config_from_hf`.

  Qwen3 when the model has q/k norms, Qwen2 when it has q/k/v biases, Mistral when it has a
  sliding window or was imported as Mistral (model.hf_architecture: a Mistral without a window
  stays one), Llama otherwise.
  """
  if cfg.qk_norm and cfg.qkv_bias:
    raise UnsupportedModelError('model.qk_norm with model.qkv_bias has no transformers '
                                'architecture (Qwen3 puts a bias on o_proj too); export a model '
                                'with one of them.')
  if cfg.qk_norm:
    arch = 'Qwen3ForCausalLM'
  elif cfg.qkv_bias:
    arch = 'Qwen2ForCausalLM'
  elif cfg.sliding_window or cfg.hf_architecture == 'MistralForCausalLM':
    arch = 'MistralForCausalLM'
  else:
    arch = 'LlamaForCausalLM'
  rope = _hf_rope_parameters(cfg)
  hf_config = {
      'architectures': [arch], 'model_type': next(t for t, a in _MODEL_TYPES.items() if a == arch),
      'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model, 'intermediate_size': cfg.d_ff,
      'num_hidden_layers': cfg.num_layers, 'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads, 'head_dim': cfg.head_dim,
      'max_position_embeddings': cfg.max_seq_len, 'rms_norm_eps': cfg.norm_eps,
      'tie_word_embeddings': cfg.tie_embeddings, 'initializer_range': cfg.init_std,
      'hidden_act': 'silu', 'rope_parameters': rope,
      # transformers 4.x (and vLLM, TGI, llama.cpp's converter on it) ignores rope_parameters
      # and reads these, as Llama-3.2's config.json has them: without them it would run theta
      # 10000 unscaled, a wrong model with no error. transformers 5 builds the same
      # rope_parameters from them (rope_scaling with rope_theta added).
      'rope_theta': cfg.rope_theta,
      'rope_scaling': (None if cfg.rope_scaling_type == 'none' else
                       {k: v for k, v in rope.items() if k != 'rope_theta'}),
  }
  if arch == 'LlamaForCausalLM':
    hf_config.update(attention_bias=False, mlp_bias=False)
  elif arch == 'MistralForCausalLM':
    hf_config['sliding_window'] = cfg.sliding_window or None
  else:  # Qwen2, Qwen3
    if arch == 'Qwen3ForCausalLM':
      hf_config['attention_bias'] = False
    window = cfg.sliding_window or None
    hf_config.update(use_sliding_window=window is not None, sliding_window=window,
                     max_window_layers=0,
                     layer_types=[('sliding_attention' if window else 'full_attention')] *
                     cfg.num_layers)
  return hf_config


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _open_safetensors(file: Path):
  """safetensors.safe_open, with a truncated or corrupt file reported as a ConfigError.

  safe_open checks the header and that the data it describes covers the file exactly, so a file
  cut short by an interrupted download or copy fails here, before any tensor is read.
  """
  try:
    handle = safetensors.safe_open(file, framework='numpy')
  except (safetensors.SafetensorError, OSError) as e:
    raise ConfigError(f'{file} is not a complete safetensors file ({e}): it is truncated (an '
                      'interrupted download or copy?) or not safetensors at all. Copy the '
                      'checkpoint again.') from e
  with handle as f:
    yield f


def _weight_files(directory: Path) -> dict[str, Path]:
  """Tensor name -> the safetensors file holding it (single file or sharded index)."""
  single, index = directory / _SINGLE_FILE, directory / _INDEX_FILE
  if single.is_file():
    single = _inside(directory, _SINGLE_FILE, single)
    with _open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  if index.is_file():
    try:
      weight_map = fs.read_json_at_most(index, 'the Hugging Face model', 'an index is KB to a '
                                        'few MB: copy the model\'s own')['weight_map']
      if not isinstance(weight_map, dict) or not all(
          isinstance(v, str) for v in weight_map.values()):
        raise TypeError('not an object of tensor names to file names')
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise ConfigError(f'cannot read the weight_map of {index}: {e!r}. Re-export the model with '
                        'save_pretrained.') from e
    shards = {shard: _inside(directory, shard, index) for shard in set(weight_map.values())}
    files = {name: shards[shard] for name, shard in weight_map.items()}
    absent = sorted({str(p) for p in files.values() if not p.is_file()})
    if absent:
      raise ConfigError(f'{index} lists shard(s) missing from the directory: {_listing(absent)}. '
                        'Copy the complete checkpoint.')
    return files
  raise ConfigError(
      f'{directory} has neither {_SINGLE_FILE} nor {_INDEX_FILE}: only safetensors weights are '
      'read. Convert with model.save_pretrained(directory) (transformers writes safetensors).')


def _inside(directory: Path, name: str, source: Path) -> Path:
  """`directory / name` (fs.inside), a name `source` gives; a file elsewhere is refused."""
  return fs.inside_or_refuse(directory, name, f'{source} names a weights file outside {directory} '
                             '({reason}): a checkpoint reads its own files only. Copy the file '
                             'into the directory, or copy the complete checkpoint again.')


def _listing(names: Iterable[str]) -> str:
  names = list(names)
  shown = ', '.join(names[:_MAX_LISTED])
  more = len(names) - _MAX_LISTED
  return f'{shown} ... ({more} more)' if more > 0 else shown


def _check_layer_count(directory: Path, hf_config: dict, files: dict[str, Path]) -> None:
  """config.json's num_hidden_layers against the layers the weight files name (model.layers.<i>.),
  before anything is built per layer: a config.json claiming 10^9 layers took minutes and
  gigabytes to refuse (the per-layer tensor map, Qwen2's layer_types)."""
  layers = hf_config.get('num_hidden_layers')
  held = {int(m[1]) for m in map(_LAYER_NAME.match, files) if m}
  if isinstance(layers, int) and not isinstance(layers, bool) and layers > len(held):
    raise ConfigError(
        f'{directory}: config.json says num_hidden_layers={layers}, but the weights hold '
        f'{len(held)} layer(s){f" (model.layers.{min(held)} to {max(held)})" if held else ""}. '
        'The weights are incomplete or config.json does not belong to them.')


def _check_names(directory: Path, cfg: ModelConfig, tensors: list[_Tensor],
                 files: dict[str, Path]) -> None:
  expected = {t.hf_name for t in tensors}
  missing = sorted(expected - files.keys())
  if missing:
    raise ConfigError(
        f'{directory}: the checkpoint lacks {len(missing)} tensor(s) that its config.json implies: '
        f'{_listing(missing)}. The weights are incomplete or config.json does not belong to them '
        '(check num_hidden_layers, tie_word_embeddings).')
  unexpected = sorted(n for n in files.keys() - expected if not _is_ignorable(n, cfg))
  if unexpected:
    raise ConfigError(
        f'{directory}: the checkpoint has {len(unexpected)} tensor(s) this model has no place for: '
        f'{_listing(unexpected)}. config.json does not match the weights (check '
        'num_hidden_layers and the bias settings) or the checkpoint is not a plain decoder.')


def _check_headers(cfg: ModelConfig, tensors: list[_Tensor], files: dict[str, Path]) -> None:
  """Checks every shape and dtype from the safetensors headers, reading no tensor data."""
  for file, group in _by_file(tensors, files).items():
    with _open_safetensors(file) as f:
      held = set(f.keys())
      for t in group:
        if t.hf_name not in held:
          raise ConfigError(
              f'{_INDEX_FILE} maps tensor {t.hf_name} to {file.name}, which does not hold it (a '
              f'stale index: the shards were replaced, or the index edited). Copy '
              f'{_INDEX_FILE} again with its shards.')
        info = f.get_slice(t.hf_name)
        shape, dtype = tuple(info.get_shape()), info.get_dtype()
        if shape != t.hf_shape:
          raise ConfigError(
              f'tensor {t.hf_name} in {file.name} has shape {list(shape)}, but config.json implies '
              f'{list(t.hf_shape)} (d_model={cfg.d_model}, d_ff={cfg.d_ff}, '
              f'heads={cfg.num_heads}x{cfg.head_dim}, kv_heads={cfg.num_kv_heads}, '
              f'vocab={cfg.vocab_size}). config.json does not belong to these weights.')
        if dtype not in _FLOAT_DTYPES:
          raise ConfigError(f'tensor {t.hf_name} in {file.name} has dtype {dtype}; only '
                            f'{", ".join(_FLOAT_DTYPES)} weights can be loaded (no quantized '
                            'checkpoints).')


def _by_file(tensors: list[_Tensor], files: dict[str, Path]) -> dict[Path, list[_Tensor]]:
  groups: dict[Path, list[_Tensor]] = {}
  for t in tensors:
    groups.setdefault(files[t.hf_name], []).append(t)
  return groups


def _our_shape(t: _Tensor) -> tuple[int, ...]:
  shape = t.hf_shape if t.hf_rows is None else (t.hf_rows[1] - t.hf_rows[0],) + t.hf_shape[1:]
  return shape[::-1] if t.transpose else shape


def _hf_value(f, t: _Tensor) -> np.ndarray:
  """Tensor `t` read whole from the open safetensors file `f` (its rows of a fused tensor)."""
  if t.hf_rows is None:
    return f.get_tensor(t.hf_name)
  return f.get_slice(t.hf_name)[t.hf_rows[0]:t.hf_rows[1]]


def _set_leaf(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get_leaf(tree: dict, path: tuple[str, ...]):
  try:
    for key in path:
      tree = tree[key]
  except (KeyError, TypeError) as e:
    raise ConfigError(f'params have no leaf {"/".join(path)}, which the config implies: params '
                      'and cfg do not belong together.') from e
  return tree


@dataclasses.dataclass(frozen=True)
class HfCheckpoint:
  """A local Hugging Face checkpoint whose config.json, file list, tensor names, shapes and
  dtypes have been checked (`inspect_checkpoint`); no tensor data has been read.

  Attributes:
    directory: The model directory.
    hf_config: Its parsed config.json.
    cfg: The ModelConfig it describes (tied when the weights have no separate LM head).
    tensors: Every tensor the model needs (`_tensor_map(cfg)`).
    files: Tensor name -> the safetensors file holding it.
  """
  directory: Path
  hf_config: dict
  cfg: ModelConfig
  tensors: tuple
  files: dict


def inspect_checkpoint(path: str | Path) -> HfCheckpoint:
  """Checks a local Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Phi-3 checkpoint without
  reading its weights.

  Reads config.json, the shard index and every safetensors header (safe_open also checks that
  each file is as long as its header says, so a truncated shard is found here).

  Raises:
    UnsupportedModelError: for an architecture or feature the model does not implement.
    ConfigError: for a missing path or file, or weights that do not match config.json (missing,
      unexpected or wrongly shaped tensors and truncated or corrupt files are named).
  """
  directory = Path(path)
  hf_config = read_hf_config(directory)
  _architecture(hf_config)  # an unsupported model is named before its files are looked for
  files = _weight_files(directory)
  _check_layer_count(directory, hf_config, files)
  cfg = model_config_from_hf(hf_config)
  if 'lm_head.weight' not in files and not cfg.tie_embeddings:
    # Some exporters drop a head that equals the embedding without setting tie_word_embeddings.
    cfg = cfg.replace(tie_embeddings=True)
  tensors = _tensor_map(cfg, _architecture(hf_config))
  _check_names(directory, cfg, tensors, files)
  _check_headers(cfg, tensors, files)
  return HfCheckpoint(directory, hf_config, cfg, tuple(tensors), files)


def load_hf(path: str | Path) -> tuple[ModelConfig, dict]:
  """Loads a local Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Phi-3 checkpoint whole (for
  tests and small models; training imports piece by piece with `hf.HfReader`).

  Args:
    path: A directory with config.json and model.safetensors (or model.safetensors.index.json
      and its shards).

  Returns:
    (cfg, params): the ModelConfig and the params pytree in the layout of
    `megatrain_jax.model.decoder` (float32 jax arrays, layers stacked on a leading axis).

  Raises:
    UnsupportedModelError: for an architecture or feature the model does not implement.
    ConfigError: for a missing path or file, or weights that do not match config.json (missing,
      unexpected or wrongly shaped tensors are named).
  """
  checkpoint = inspect_checkpoint(path)
  cfg, tensors, files = checkpoint.cfg, list(checkpoint.tensors), checkpoint.files

  # Stacked layer leaves are filled slice by slice: one layer's tensors may span several shards.
  arrays: dict[tuple[str, ...], np.ndarray] = {}
  for t in tensors:
    if t.path not in arrays:
      shape = _our_shape(t) if t.layer is None else (cfg.num_layers,) + _our_shape(t)
      arrays[t.path] = np.empty(shape, np.float32)
  for file, group in _by_file(tensors, files).items():
    with _open_safetensors(file) as f:
      for t in group:
        value = _hf_value(f, t)
        target = arrays[t.path] if t.layer is None else arrays[t.path][t.layer]
        target[...] = value.T if t.transpose else value  # casts to float32 in the same copy
  params: dict = {}
  for leaf_path in list(arrays):
    _set_leaf(params, leaf_path, jnp.asarray(arrays.pop(leaf_path)))  # pop: free host copies early
  return cfg, params


def save_hf(path: str | Path, cfg: ModelConfig, params: dict) -> None:
  """Writes `params` as a float32 Hugging Face checkpoint (config.json + model.safetensors).

  transformers' `AutoModelForCausalLM.from_pretrained(path)` and `load_hf(path)` both read it.

  Args:
    path: The output directory (created if needed; existing files of the same name are replaced).
    cfg: The model's config.
    params: The params pytree (as returned by `load_hf` or `init_params`).

  Raises:
    ConfigError: if a params leaf does not have the shape `cfg` implies.
  """
  directory = Path(path)
  directory.mkdir(parents=True, exist_ok=True)
  host = jax.device_get(params)  # one transfer, not one per layer slice
  flat = {}
  for t in _tensor_map(cfg):
    leaf = np.asarray(_get_leaf(host, t.path), np.float32)
    expected = _our_shape(t) if t.layer is None else (cfg.num_layers,) + _our_shape(t)
    if leaf.shape != expected:
      raise ConfigError(f'params leaf {"/".join(t.path)} has shape {list(leaf.shape)}, but the '
                        f'config implies {list(expected)}: params and cfg do not belong together.')
    value = leaf if t.layer is None else leaf[t.layer]
    flat[t.hf_name] = np.ascontiguousarray(value.T if t.transpose else value)
  # transformers 4.x rejects safetensors files without a format tag; 'pt' = torch layout.
  safetensors.numpy.save_file(flat, directory / _SINGLE_FILE, metadata={'format': 'pt'})
  (directory / _CONFIG_FILE).write_text(json.dumps(hf_config_from_model_config(cfg), indent=2) +
                                        '\n')
