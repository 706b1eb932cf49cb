"""`ModelConfig`: the hashable description of one Llama-family decoder.

A frozen dataclass (not the ml_collections `config.model` it is built from) because it is passed
as a static argument to jitted functions and must be hashable, and because `hf.load_hf` returns
one too. `from_config_dict` validates and converts; every failure names the `model.*` field.
"""

import dataclasses
import math

from megatrain_jax.errors import ConfigError

REMAT_POLICIES = ('none', 'full', 'minimal', 'offload')
ROPE_SCALING_TYPES = ('none', 'linear', 'llama3', 'yarn')
COMPUTE_DTYPES = ('float32', 'bfloat16')
MATMUL_PRECISIONS = ('highest', 'high', 'default')
AUTO_VOCAB_CHUNK = 8192  # model.vocab_chunk = 0: see ModelConfig.resolved_vocab_chunk
# Query blocks run in at most this many bands (ModelConfig.attention_bands), each its own program
# of one key length: more bands skip more masked keys but compile more programs into each layer.
MAX_ATTENTION_BANDS = 16
# The transformers architectures a model is imported from and exported as (hf/format.py).
HF_ARCHITECTURES = ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM',
                    'MistralForCausalLM', 'Phi3ForCausalLM')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder. Field meanings are documented in configs/default.py."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  d_ff: int
  head_dim: int = 0  # 0 = d_model // num_heads (resolved in __post_init__)
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling_type: str = 'none'
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  # YaRN (rope_scaling_type 'yarn'): the band between beta_fast and beta_slow rotations over the
  # original length is blended from kept to divided by factor; cos and sin are multiplied by
  # attention_factor (0 = YaRN's 0.1 ln(factor) + 1). truncate rounds the band to whole pairs.
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0
  rope_truncate: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
  tie_embeddings: bool = False
  norm_eps: float = 1e-5
  sliding_window: int = 0  # 0 = full causal attention (Mistral uses a window)
  # The Hugging Face architecture it was imported as ('' = none): --export_hf writes that one
  # where it computes the same function (hf/format.hf_config_from_model_config).
  hf_architecture: str = ''
  attention_chunk: int = 512  # queries per attention block; 0 = all at once
  vocab_chunk: int = 0  # vocabulary columns per loss block; 0 = auto (resolved_vocab_chunk)
  init_std: float = 0.02
  dtype: str = 'float32'  # compute dtype; params are always float32
  matmul_precision: str = 'highest'
  remat: str = 'full'
  scan_layers: bool = True
  # >= 0: model.document_mask is on: attention stays inside each document of a packed row and
  # positions restart at each. Its documents are those the batch marks (data.Batch.starts, as
  # the prepared data records them), else those this token id (the data's EOS) ends. -1 = off.
  document_eos_id: int = -1

  def __post_init__(self):
    _check_positive(self, ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads',
                           'd_ff', 'max_seq_len'))
    _check_vocab_size(self.vocab_size)
    if self.head_dim == 0:
      if self.d_model % self.num_heads:
        raise ConfigError(
            f'model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}: '
            'each head needs d_model / num_heads features. Choose num_heads dividing d_model, or '
            'set model.head_dim explicitly.')
      object.__setattr__(self, 'head_dim', self.d_model // self.num_heads)
    elif self.head_dim < 0 or self.head_dim % 2:
      raise ConfigError(f'model.head_dim={self.head_dim} must be a positive even number (RoPE '
                        'rotates pairs of features), or 0 for d_model / num_heads.')
    if self.head_dim % 2:
      raise ConfigError(f'the head dimension d_model / num_heads = {self.head_dim} must be even '
                        '(RoPE rotates pairs of features): change model.d_model or '
                        'model.num_heads.')
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f'model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads='
          f'{self.num_kv_heads}: grouped-query attention shares each key/value head among '
          'num_heads / num_kv_heads query heads. Pick num_kv_heads dividing num_heads.')
    self._check_choices()
    # `not x > 0` rather than `x <= 0`: NaN fails every comparison and must be refused too.
    if not self.rope_theta > 0:
      raise ConfigError(f'model.rope_theta={self.rope_theta} must be > 0 (Llama uses 10000 or '
                        '500000).')
    if self.rope_scaling_type != 'none' and not self.rope_scaling_factor > 0:
      raise ConfigError(f'model.rope_scaling.factor={self.rope_scaling_factor} must be > 0.')
    if self.rope_scaling_type == 'llama3':
      low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
      if not 0 < low < high:
        raise ConfigError(
            f'model.rope_scaling.low_freq_factor={low} and high_freq_factor={high}: llama3 RoPE '
            'needs 0 < low_freq_factor < high_freq_factor (it blends the band between them; '
            'Llama 3.1 uses 1 and 4).')
    if self.rope_scaling_type == 'yarn':
      self._check_yarn()
    if self.rope_scaling_type in ('llama3', 'yarn'):
      if not isinstance(self.rope_original_max_len, int) or self.rope_original_max_len <= 0:
        raise ConfigError(f'model.rope_scaling.original_max_len={self.rope_original_max_len!r} '
                          'must be a positive integer (the pre-extension context length, e.g. '
                          '8192).')
    if not self.norm_eps > 0:
      raise ConfigError(f'model.norm_eps={self.norm_eps} must be > 0 (RMSNorm divides by '
                        'sqrt(mean(x^2) + norm_eps); Llama uses 1e-5 or 1e-6).')
    if not self.init_std > 0:
      raise ConfigError(f'model.init_std={self.init_std} must be > 0 (the std of the normal init; '
                        'Llama uses 0.02).')
    if self.sliding_window < 0:
      raise ConfigError(f'model.sliding_window={self.sliding_window} must be >= 0 (0 = off).')
    if self.attention_chunk < 0:
      raise ConfigError(f'model.attention_chunk={self.attention_chunk} must be >= 0 (queries per '
                        'attention block; 0 = all queries at once).')
    _check_vocab_chunk(self.vocab_chunk, self.vocab_size)
    if not -1 <= self.document_eos_id < self.vocab_size:
      raise ConfigError(f'document_eos_id={self.document_eos_id} is not a token id of the '
                        f'{self.vocab_size}-token vocabulary (-1 = no document mask): '
                        'model.document_mask takes it from data.eos_token.')

  def _check_choices(self) -> None:
    for field, value, choices in (
        ('remat', self.remat, REMAT_POLICIES),
        ('rope_scaling.type', self.rope_scaling_type, ROPE_SCALING_TYPES),
        ('dtype', self.dtype, COMPUTE_DTYPES),
        ('matmul_precision', self.matmul_precision, MATMUL_PRECISIONS),
        ('hf_architecture', self.hf_architecture, ('',) + HF_ARCHITECTURES)):
      _check_choice(f'model.{field}', value, choices)

  def _check_yarn(self) -> None:
    fast, slow = self.rope_beta_fast, self.rope_beta_slow
    if not 0 < slow < fast:
      raise ConfigError(f'model.rope_scaling.beta_fast={fast} and beta_slow={slow}: YaRN needs '
                        '0 < beta_slow < beta_fast (rotations over the original length that '
                        'bound the blended band; the paper and transformers use 32 and 1).')
    if not self.rope_attention_factor >= 0:
      raise ConfigError(f'model.rope_scaling.attention_factor={self.rope_attention_factor} must '
                        'be >= 0 (0 = 0.1 ln(factor) + 1, as YaRN and transformers default).')

  @classmethod
  def recorded(cls, saved: dict) -> dict:
    """A ModelConfig as a checkpoint's meta.json records it (dataclasses.asdict), each field
    missing from it (one newer than the checkpoint, e.g. qk_norm) at its default: what the
    checkpoint was written with."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    return {**defaults, **saved}

  @classmethod
  def from_config_dict(cls, model) -> 'ModelConfig':
    """Builds from the ml_collections `config.model` section (see configs/default.py)."""
    scaling = model.rope_scaling
    return cls(
        vocab_size=model.vocab_size, d_model=model.d_model, num_layers=model.num_layers,
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, d_ff=model.d_ff,
        head_dim=model.head_dim, max_seq_len=model.max_seq_len, rope_theta=model.rope_theta,
        rope_scaling_type=scaling.type, rope_scaling_factor=scaling.factor,
        rope_low_freq_factor=scaling.low_freq_factor,
        rope_high_freq_factor=scaling.high_freq_factor,
        rope_original_max_len=scaling.original_max_len, rope_beta_fast=scaling.beta_fast,
        rope_beta_slow=scaling.beta_slow, rope_attention_factor=scaling.attention_factor,
        rope_truncate=scaling.truncate, qkv_bias=model.qkv_bias,
        qk_norm=model.qk_norm, tie_embeddings=model.tie_embeddings, norm_eps=model.norm_eps,
        sliding_window=model.sliding_window, hf_architecture=model.hf_architecture,
        attention_chunk=model.attention_chunk,
        vocab_chunk=model.vocab_chunk,
        init_std=model.init_std, dtype=model.dtype,
        matmul_precision=model.matmul_precision, remat=model.remat,
        scan_layers=model.scan_layers)

  def replace(self, **changes) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)

  @property
  def resolved_vocab_chunk(self) -> int:
    """Vocabulary columns per block of the chunked loss (model/vocab.py).

    0 = auto = min(vocab_size, 8192): the loss holds a few [tokens, chunk] float32 blocks (logits,
    softmax, their gradient) instead of [tokens, vocab_size], so 8192 bounds them at 32 KiB per
    token each (4 GiB for 32k tokens) whatever the vocabulary, while each block's matmul stays
    large enough to run at full speed. Vocabularies up to 8192 are one block.
    """
    return self.vocab_chunk or min(self.vocab_size, AUTO_VOCAB_CHUNK)

  # --- Sizes, from the shapes alone (no arrays are created). ---

  @property
  def params_per_layer(self) -> int:
    d, hd = self.d_model, self.head_dim
    q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
    attn = d * q_out + 2 * d * kv_out + q_out * d
    if self.qkv_bias:
      attn += q_out + 2 * kv_out
    if self.qk_norm:
      attn += 2 * hd
    mlp = 3 * d * self.d_ff
    norms = 2 * d
    return attn + mlp + norms

  @property
  def num_params(self) -> int:
    embed = self.vocab_size * self.d_model
    head = 0 if self.tie_embeddings else self.d_model * self.vocab_size
    return embed + self.num_layers * self.params_per_layer + self.d_model + head

  def layer_forward_flops(self, seq_len: int) -> float:
    """FLOPs one layer's forward executes per token of a sequence of `seq_len`: 2 x its matmul
    params, plus 4 * keys * H * Dh for the scores and values of its query against the keys its
    band computes (attended_keys: all S unchunked; about S/2 in query blocks, the masked ones
    skipped band by band; the causal half `flops_per_token` counts is the work that matters)."""
    return (2.0 * (self.params_per_layer - 2 * self.d_model)
            + 4.0 * self.attended_keys(seq_len) * self.num_heads * self.head_dim)

  def attention_bands(self, seq_len: int) -> tuple:
    """How layers._attend_blocks cuts the causal self-attention of `seq_len` tokens:
    ((q_lo, q_hi, k_lo, k_hi), ...), queries [q_lo, q_hi) against keys [k_lo, k_hi) only.

    Keys after a band's last query are masked by causality, and keys `sliding_window` or more
    before its first query by the window, so they are not computed: the scores of S queries cost
    about S²/2 instead of S² (S·(W + band) under a window W). A band holds whole query blocks of
    `attention_chunk` rows (one at a time, as lax.map runs them), at most MAX_ATTENTION_BANDS
    bands (the blocks' key lengths rounded up to their band's). Unchunked (S <= attention_chunk
    or 0): one band of everything."""
    chunk = self.attention_chunk
    if not chunk or seq_len <= chunk:
      return ((0, seq_len, 0, seq_len),)
    blocks = -(-seq_len // chunk)
    per_band = -(-blocks // MAX_ATTENTION_BANDS)
    bands = []
    for first in range(0, blocks, per_band):
      q_lo, q_hi = first * chunk, min(seq_len, (first + per_band) * chunk)
      k_lo = max(0, q_lo - self.sliding_window + 1) if self.sliding_window else 0
      bands.append((q_lo, q_hi, k_lo, q_hi))
    return tuple(bands)

  def attended_keys(self, seq_len: int) -> float:
    """Keys each query is scored against on average, as attention_bands computes them (a band's
    last block padded to `attention_chunk` rows counts whole): the executed attention work is
    4 · attended_keys · H · Dh FLOPs a token and layer."""
    chunk = self.attention_chunk or seq_len
    rows_keys = [-(-(q_hi - q_lo) // chunk) * chunk * (k_hi - k_lo)
                 for q_lo, q_hi, k_lo, k_hi in self.attention_bands(seq_len)]
    return sum(rows_keys) / seq_len

  def largest_attention_block(self, seq_len: int) -> int:
    """Scores of the largest query block (queries x keys) attention_bands computes at a time:
    what one block's float32 scores, probabilities and gradient are counted by."""
    chunk = self.attention_chunk or seq_len
    return max(min(chunk, q_hi - q_lo) * (k_hi - k_lo)
               for q_lo, q_hi, k_lo, k_hi in self.attention_bands(seq_len))

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), excluding remat recompute.

    6 * (matmul params) plus causal attention scores and values: 6 * L * S * H * Dh
    (half of the 12 L S H Dh of full attention, because of the causal mask).
    """
    norms = 2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)
    matmul_params = self.num_layers * (self.params_per_layer - norms)
    matmul_params += self.d_model * self.vocab_size  # LM head (embedding lookup is free)
    attn = 6 * self.num_layers * seq_len * self.num_heads * self.head_dim
    return 6.0 * matmul_params + attn


def _check_positive(cfg, names):
  for name in names:
    value = getattr(cfg, name)
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(f'model.{name}={value!r} must be a positive integer.')


def _check_vocab_size(vocab_size: int) -> None:
  if vocab_size >= 2**31:  # a config.json's 10^12 ran minutes into the planner first
    raise ConfigError(f'model.vocab_size={vocab_size:,} is not a vocabulary: token ids are int32 '
                      '(at most 2^31 - 1 of them). Fix the vocab_size you set or that config.json '
                      'gives.')


def _check_vocab_chunk(chunk, vocab_size):
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    raise ConfigError(f'model.vocab_chunk={chunk!r} must be a non-negative integer (vocabulary '
                      'columns per block of the loss; 0 = auto).')
  if chunk > vocab_size:
    raise ConfigError(f'model.vocab_chunk={chunk} is larger than model.vocab_size={vocab_size}; '
                      f'use 0 (auto) or a value <= {vocab_size}.')


def _check_choice(field, value, choices):
  if value not in choices:
    raise ConfigError(f'{field}={value!r} is not one of '
                      f'{", ".join(choice or repr(choice) for choice in choices)}.')


def rope_inverse_frequencies(cfg: ModelConfig):
  """Per-pair rotation frequencies [head_dim // 2], float32, exactly as Hugging Face computes them.

  Llama-3 scaling keeps high frequencies, divides low frequencies by `factor`, and blends the band
  between (transformers `_compute_llama3_parameters`); YaRN blends linearly over the pairs
  between its two correction dimensions (`_compute_yarn_parameters`).
  """
  import numpy as np  # local: keeps this module import-light for the config layer
  dim = cfg.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
  inv_freq = 1.0 / (cfg.rope_theta ** exponents)
  inv_freq = inv_freq.astype(np.float32)
  if cfg.rope_scaling_type == 'linear':
    inv_freq = inv_freq / np.float32(cfg.rope_scaling_factor)
  elif cfg.rope_scaling_type == 'llama3':
    factor = cfg.rope_scaling_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_len
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
  elif cfg.rope_scaling_type == 'yarn':
    inv_freq = _yarn_inverse_frequencies(cfg)
  return inv_freq


def _yarn_inverse_frequencies(cfg: ModelConfig):
  """YaRN's frequencies: pair i keeps its frequency below the correction dimension of beta_fast
  rotations over the original length, is divided by factor above that of beta_slow, and is
  blended linearly between (float32, in transformers' order of operations)."""
  import numpy as np  # local, as in rope_inverse_frequencies
  dim, base = cfg.head_dim, cfg.rope_theta
  pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
  extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
  interpolation = (np.float32(1.0) / (np.float32(cfg.rope_scaling_factor) * pos_freqs))

  def correction_dim(rotations):  # the pair whose wavelength fits `rotations` times
    return dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as transformers: no division by zero
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  kept = np.float32(1) - ramp
  return (interpolation * (1 - kept) + extrapolation * kept).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention scale for a length `factor`: 0.1 mscale ln(factor) + 1, 1 for factor <= 1
  (transformers' `get_mscale`)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
  """What RoPE's cos and sin are multiplied by: YaRN's attention factor (`yarn_mscale` of the
  factor unless set), else 1."""
  if cfg.rope_scaling_type != 'yarn':
    return 1.0
  return float(cfg.rope_attention_factor or yarn_mscale(cfg.rope_scaling_factor))
