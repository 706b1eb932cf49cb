"""`hf.load_hf` + `model.forward` against transformers' own Llama, Qwen2, Qwen3 and Mistral.

Tiny randomly initialised transformers models (built from configs; nothing is downloaded) are
saved with `save_pretrained`, loaded with `load_hf` and run on the same random tokens: the logits
must agree to float32 rounding and give the same argmax everywhere. Weights use a large init std,
random norm scales and non-zero biases, so a swapped, dropped or untransposed tensor cannot hide
behind tiny activations. The rest checks the error paths and the `save_hf` round trip.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from megatrain_jax import hf
from megatrain_jax.errors import ConfigError, UnsupportedModelError
from megatrain_jax.hf.format import tensor_map
from megatrain_jax.model import abstract_params, forward, loss_fn
from megatrain_jax.model.config import rope_attention_factor, rope_inverse_frequencies

VOCAB, BATCH, SEQ = 256, 2, 24
LOGIT_TOL = 1e-4

# One compile per distinct ModelConfig; cases sharing a config (sharded vs single file) reuse it.
_forward = jax.jit(forward, static_argnums=0)

_LLAMA = (transformers.LlamaConfig, transformers.LlamaForCausalLM)
_QWEN2 = (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
_QWEN3 = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
_MISTRAL = (transformers.MistralConfig, transformers.MistralForCausalLM)
_PHI3 = (transformers.Phi3Config, transformers.Phi3ForCausalLM)

# name -> (transformers classes, config overrides, ModelConfig fields the mapping must produce).
CASES = {
    'llama_mha_untied': (_LLAMA, dict(num_key_value_heads=4, tie_word_embeddings=False),
                         dict(num_kv_heads=4, tie_embeddings=False, rope_scaling_type='none')),
    'llama_gqa_tied': (_LLAMA, dict(num_key_value_heads=2, tie_word_embeddings=True),
                       dict(num_kv_heads=2, tie_embeddings=True)),
    # original_max_position_embeddings=64 with head_dim 16 and theta 5e5 puts one frequency in
    # each llama3 band (kept, smoothed, divided by factor), so every branch is exercised.
    'llama3_rope': (_LLAMA, dict(num_key_value_heads=2, rope_parameters={
        'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0, 'low_freq_factor': 1.0,
        'high_freq_factor': 4.0, 'original_max_position_embeddings': 64}),
                    dict(rope_scaling_type='llama3', rope_theta=500000.0, rope_scaling_factor=8.0,
                         rope_original_max_len=64)),
    'llama_linear_rope': (_LLAMA, dict(rope_parameters={'rope_type': 'linear',
                                                        'rope_theta': 10000.0, 'factor': 4.0}),
                          dict(rope_scaling_type='linear', rope_scaling_factor=4.0)),
    # YaRN as Qwen2.5 / Qwen3 model cards add it: original length 32 with head_dim 16 and theta
    # 1e4 puts pair 0 below the blended band, pair 1 in it and the rest above (divided by factor);
    # the attention factor is the derived 0.1 ln(4) + 1.
    'qwen2_yarn': (_QWEN2, dict(num_key_value_heads=2, rope_parameters={
        'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
        'original_max_position_embeddings': 32}),
                   dict(rope_scaling_type='yarn', rope_scaling_factor=4.0, rope_original_max_len=32,
                        rope_attention_factor=0.0, rope_beta_fast=32.0, rope_beta_slow=1.0)),
    'qwen2_bias': (_QWEN2, dict(num_key_value_heads=2, tie_word_embeddings=False),
                   dict(qkv_bias=True, num_kv_heads=2, sliding_window=0)),
    # q_norm / k_norm over head_dim 32 (!= d_model / num_heads, as Qwen3's 128 is for most sizes),
    # tied as Qwen3's small models are.
    'qwen3_qk_norm': (_QWEN3, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
                      dict(qk_norm=True, qkv_bias=False, head_dim=32, tie_embeddings=True)),
    # A window of 8 < SEQ makes it matter; head_dim 32 != d_model / num_heads tests that path.
    'mistral_window': (_MISTRAL, dict(num_key_value_heads=2, head_dim=32, sliding_window=8),
                       dict(sliding_window=8, head_dim=32, num_kv_heads=2)),
    # Mistral v0.2 / v0.3: no window; it still exports as MistralForCausalLM (hf_architecture).
    'mistral_no_window': (_MISTRAL, dict(num_key_value_heads=2, sliding_window=None),
                          dict(sliding_window=0, num_kv_heads=2,
                               hf_architecture='MistralForCausalLM')),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, and Phi-3-mini's window (2047 there). No
    # pad_token_id: transformers' nn.Embedding(padding_idx) would keep that row's gradient zero.
    'phi3_window': (_PHI3, dict(num_key_value_heads=2, sliding_window=8, pad_token_id=None),
                    dict(sliding_window=8, num_kv_heads=2, qkv_bias=False, qk_norm=False)),
}


def _torch_model(case: str, **extra) -> transformers.PreTrainedModel:
  (config_cls, model_cls), overrides, _ = CASES[case]
  config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                      initializer_range=0.2, attn_implementation='eager', **(overrides | extra))
  torch.manual_seed(0)
  model = model_cls(config).float().eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith('norm.weight'):  # all-ones norms would hide swapped or misplaced norms
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
      elif name.endswith('bias'):  # zero biases would hide dropped ones
        torch.nn.init.normal_(param, std=0.2)
  return model


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _our_logits(cfg, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(_forward(cfg, params, jnp.asarray(tokens, jnp.int32)))


def _max_err(ours: np.ndarray, theirs: np.ndarray) -> float:
  return float(np.max(np.abs(ours - theirs)))


def _assert_parity(label: str, ours: np.ndarray, theirs: np.ndarray) -> None:
  err = _max_err(ours, theirs)
  print(f'{label}: max abs logit error {err:.2e} (logit scale {np.abs(theirs).max():.1f})')
  assert err <= LOGIT_TOL, f'{label}: logits differ by {err:.3e} > {LOGIT_TOL}'
  np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1), err_msg=label)


@pytest.fixture(scope='module')
def tokens() -> np.ndarray:
  return np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """case -> (checkpoint directory, torch model), each saved once per module."""
  cache = {}

  def get(case):
    if case not in cache:
      model = _torch_model(case)
      directory = tmp_path_factory.mktemp(case)
      model.save_pretrained(directory)
      cache[case] = directory, model
    return cache[case]

  return get


@pytest.mark.parametrize('case', list(CASES))
def test_logits_match_transformers(case, saved, tokens):
  directory, model = saved(case)
  cfg, params = hf.load_hf(directory)
  for field, value in CASES[case][2].items():
    assert getattr(cfg, field) == value, field
  expected = abstract_params(cfg)
  assert jax.tree.structure(params) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
  _assert_parity(case, _our_logits(cfg, params, tokens), _torch_logits(model, tokens))


@pytest.mark.parametrize('case', ['qwen3_qk_norm', 'qwen2_bias', 'llama_mha_untied',
                                  'phi3_window'])
def test_loss_and_every_gradient_match_transformers(case, saved, tokens):
  """The mean next-token cross-entropy (model.loss_fn, the chunked head the engines train with)
  and its gradient with respect to every tensor of the checkpoint equal torch autograd's through
  transformers' model: Qwen3's q/k norms, Qwen2's biases, an untied head, Phi-3's fused
  projections (each leaf's rows of the fused tensor's gradient)."""
  directory, model = saved(case)
  cfg, params = hf.load_hf(directory)
  cfg = cfg.replace(vocab_chunk=100)  # the head in 3 vocabulary blocks
  loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, jnp.asarray(tokens, jnp.int32)))(
      params)
  model.zero_grad()
  batch = torch.from_numpy(tokens).long()
  logits = model(batch[:, :-1]).logits
  want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-5 * want.item()
  theirs = dict(model.named_parameters())
  for t in tensor_map(cfg, type(model).__name__):
    ours = grads
    for key in t.path:
      ours = ours[key]
    ours = np.asarray(ours if t.layer is None else ours[t.layer], np.float64)
    want_grad = theirs[t.hf_name].grad.double().numpy()
    if t.hf_rows is not None:
      want_grad = want_grad[t.hf_rows[0]:t.hf_rows[1]]
    want_grad = want_grad.T if t.transpose else want_grad
    err = np.linalg.norm(ours - want_grad) / np.linalg.norm(want_grad)
    assert err <= 1e-4, (t.hf_name, err)


def test_sharded_checkpoint(saved, tokens, tmp_path):
  _, model = saved('llama_mha_untied')
  model.save_pretrained(tmp_path, max_shard_size='20KB')
  index = json.loads((tmp_path / 'model.safetensors.index.json').read_text())
  assert len(set(index['weight_map'].values())) > 1
  assert not (tmp_path / 'model.safetensors').exists()
  cfg, params = hf.load_hf(tmp_path)
  _assert_parity('sharded', _our_logits(cfg, params, tokens), _torch_logits(model, tokens))
  # A stale index (one entry naming a shard that lacks the tensor) is named, not a traceback.
  name = 'model.layers.1.mlp.down_proj.weight'
  other = next(f for f in sorted(set(index['weight_map'].values()))
               if f != index['weight_map'][name])
  index['weight_map'][name] = other
  (tmp_path / 'model.safetensors.index.json').write_text(json.dumps(index))
  with pytest.raises(ConfigError, match=rf'index.json maps tensor {name} to {other}, which does '
                     'not hold it .*Copy model.safetensors.index.json again'):
    hf.load_hf(tmp_path)


def test_rope_scaling_and_window_are_exercised(saved, tokens):
  """Guards the test cases themselves: the features they cover must change the output. Each
  scaled RoPE case has pairs kept, pairs divided by its factor and pairs in the band between
  (llama3's smoothed, YaRN's blended)."""
  for case, factor in [('llama3_rope', 8.0), ('qwen2_yarn', 4.0)]:
    cfg, _ = hf.load_hf(saved(case)[0])
    scaled = rope_inverse_frequencies(cfg)
    plain = rope_inverse_frequencies(cfg.replace(rope_scaling_type='none'))
    kept, divided = np.isclose(scaled, plain), np.isclose(scaled, plain / factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any(), case
  assert rope_attention_factor(cfg) == pytest.approx(0.1 * np.log(4.0) + 1)  # YaRN's default
  _, windowed = saved('mistral_window')
  full = _torch_model('mistral_window', sliding_window=None)
  assert _max_err(_torch_logits(windowed, tokens), _torch_logits(full, tokens)) > 1e-2


@pytest.mark.parametrize('case, chunk', [('qwen2_bias', 0), ('mistral_window', 0),
                                         ('llama_gqa_tied', 5), ('qwen3_qk_norm', 5)])
def test_document_mask_packed_row_matches_each_document_alone_in_transformers(case, saved, chunk):
  """model.document_mask: each document of a packed row (ending with EOS; the last runs on past
  the row's end) gets the logits transformers gives it alone, from position 0; attention_chunk 5
  puts document boundaries inside and across query blocks, and Mistral's window of 8 applies
  within each document."""
  directory, model = saved(case)
  cfg, params = hf.load_hf(directory)
  eos = 7
  cfg = cfg.replace(document_eos_id=eos, attention_chunk=chunk)
  rng = np.random.default_rng(3)
  documents = [np.append(rng.integers(8, VOCAB, n), eos) for n in (2, 11, 0, 6)] + [
      rng.integers(8, VOCAB, 4)]  # an empty document (a lone EOS) and one cut off by the row
  row = np.concatenate(documents)[None]
  packed = _our_logits(cfg, params, row)[0]
  start = 0
  for document in documents:
    alone = _torch_logits(model, document[None])[0]
    _assert_parity(f'{case} document at {start}', packed[start:start + len(document)], alone)
    start += len(document)
  # Without the mask the later documents see the earlier ones.
  unmasked = _our_logits(cfg.replace(document_eos_id=-1), params, row)[0]
  assert _max_err(unmasked[len(documents[0]):], packed[len(documents[0]):]) > 1e-2


@pytest.mark.parametrize('changes', [dict(remat='none'), dict(scan_layers=False)])
def test_remat_and_unrolled_layers_give_same_logits(changes, saved, tokens):
  cfg, params = hf.load_hf(saved('llama_gqa_tied')[0])
  base = _our_logits(cfg, params, tokens)
  variant = _our_logits(cfg.replace(**changes), params, tokens)
  err = _max_err(variant, base)
  print(f'{changes}: max abs logit difference {err:.2e}')
  assert err <= 1e-5


def test_bfloat16_checkpoint(tmp_path):
  model = _torch_model('llama_gqa_tied').to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  _, params = hf.load_hf(tmp_path)
  want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(params['layers']['attn']['q_proj']['kernel'][1]), want)


@pytest.mark.parametrize('case', list(CASES))
def test_save_hf_round_trip(case, saved, tokens, tmp_path):
  directory, model = saved(case)
  cfg, params = hf.load_hf(directory)
  hf.save_hf(tmp_path, cfg, params)
  cfg2, params2 = hf.load_hf(tmp_path)
  assert cfg2.replace(hf_architecture=cfg.hf_architecture) == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  # transformers itself must read the export as the same model.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation='eager').eval()
  # Phi-3 is written unfused: the Mistral checkpoint (a window) of the same function.
  assert type(reloaded) is (transformers.MistralForCausalLM if case == 'phi3_window'
                            else type(model))
  assert cfg2.hf_architecture == type(reloaded).__name__
  assert _max_err(_torch_logits(reloaded, tokens), _torch_logits(model, tokens)) <= 1e-5


# case -> the top-level (rope_theta, rope_scaling) transformers 4.x reads from the export.
ROPE_4X = {
    'llama_gqa_tied': (10000.0, None),
    'llama3_rope': (500000.0, {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                               'high_freq_factor': 4.0, 'original_max_position_embeddings': 64}),
    'llama_linear_rope': (10000.0, {'rope_type': 'linear', 'factor': 4.0}),
    'qwen2_yarn': (10000.0, {'rope_type': 'yarn', 'factor': 4.0, 'beta_fast': 32.0,
                             'beta_slow': 1.0, 'truncate': True,
                             'original_max_position_embeddings': 32}),
}


@pytest.mark.parametrize('case', list(ROPE_4X))
def test_export_config_has_the_transformers4_rope_keys(case, saved, tmp_path):
  """transformers 4.x (vLLM, TGI, ...) ignores rope_parameters: without top-level rope_theta and
  rope_scaling it silently runs theta 10000 unscaled. transformers 5 must read both as one."""
  directory, _ = saved(case)
  cfg, params = hf.load_hf(directory)
  hf.save_hf(tmp_path, cfg, params)
  exported = json.loads((tmp_path / 'config.json').read_text())
  theta, scaling = ROPE_4X[case]
  assert (exported['rope_theta'], exported['rope_scaling']) == (theta, scaling)
  assert exported['rope_parameters'] == {'rope_type': 'default', 'rope_theta': theta} | (
      scaling or {})
  loaded = transformers.AutoConfig.from_pretrained(tmp_path)
  assert loaded.rope_parameters == exported['rope_parameters']
  # Our importer reads the 4.x keys alone (a config 4.x re-saved) as the same model.
  legacy = {k: v for k, v in exported.items() if k != 'rope_parameters'}
  assert hf.model_config_from_hf(legacy) == hf.model_config_from_hf(exported)


# config.json of meta-llama/Llama-3.2-1B as published (transformers 4.x layout).
LLAMA32_1B = {
    'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'bos_token_id': 128000, 'eos_token_id': 128001, 'head_dim': 64, 'hidden_act': 'silu',
    'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 8192,
    'max_position_embeddings': 131072, 'mlp_bias': False, 'model_type': 'llama',
    'num_attention_heads': 32, 'num_hidden_layers': 16, 'num_key_value_heads': 8,
    'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
    'rope_scaling': {'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
                     'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
    'rope_theta': 500000.0, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16',
    'transformers_version': '4.45.0.dev0', 'use_cache': True, 'vocab_size': 128256}


def test_llama32_rope_survives_import_and_export():
  """Llama-3.2-1B's 4.x config.json, imported and exported: the same 4.x keys, the
  rope_parameters transformers 5 makes of the original, and the same model read back."""
  cfg = hf.model_config_from_hf(LLAMA32_1B)
  exported = hf.hf_config_from_model_config(cfg)
  assert exported['rope_theta'] == LLAMA32_1B['rope_theta']
  assert exported['rope_scaling'] == LLAMA32_1B['rope_scaling']
  assert exported['rope_parameters'] == transformers.LlamaConfig(**LLAMA32_1B).rope_parameters
  assert hf.model_config_from_hf(exported).replace(hf_architecture=cfg.hf_architecture) == cfg


@pytest.mark.parametrize('rope_scaling', [
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 8192},
    {'type': 'linear', 'factor': 2.0}, None])
def test_edited_rope_scaling_is_read_as_transformers5_reads_it(rope_scaling):
  """An export whose rope_scaling a user replaced for a 4.x stack (as Qwen's model cards ask):
  we read what transformers 5 reads (a non-empty rope_scaling wins over rope_parameters)."""
  exported = hf.hf_config_from_model_config(hf.model_config_from_hf(LLAMA32_1B))
  edited = exported | {'rope_scaling': rope_scaling}
  want = hf.model_config_from_hf(_BASE | {'rope_parameters': transformers.LlamaConfig(
      **edited).rope_parameters, 'max_position_embeddings': 131072})
  got = hf.model_config_from_hf(edited)
  fields = ('rope_theta', 'rope_scaling_type', 'rope_scaling_factor', 'rope_original_max_len')
  assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
  assert got.rope_scaling_type == ('llama3' if rope_scaling is None else
                                   rope_scaling.get('rope_type', rope_scaling.get('type')))


# ----------------------------------------------------------------------------------------------
# Errors: raised before any tensor data is read, naming the problem.
# ----------------------------------------------------------------------------------------------

def test_unsupported_architecture(tmp_path):
  (tmp_path / 'config.json').write_text(json.dumps(
      {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'n_embd': 64}))
  # No weights at all: the architecture check must come first.
  with pytest.raises(UnsupportedModelError) as info:
    hf.load_hf(tmp_path)
  message = str(info.value)
  assert 'GPT2LMHeadModel' in message
  assert all(arch in message for arch in hf.SUPPORTED_ARCHITECTURES)


def test_missing_path_and_files(tmp_path):
  with pytest.raises(ConfigError, match='does not exist'):
    hf.load_hf(tmp_path / 'nope')
  with pytest.raises(ConfigError, match='no config.json'):
    hf.load_hf(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps(_BASE))
  with pytest.raises(ConfigError, match='model.safetensors'):
    hf.load_hf(tmp_path)


def _edited_copy(saved, tmp_path, edit, case='llama_mha_untied'):
  """A copy of the checkpoint of `case` whose tensors dict went through `edit`."""
  source, _ = saved(case)
  shutil.copy(source / 'config.json', tmp_path / 'config.json')
  tensors = safetensors.numpy.load_file(source / 'model.safetensors')
  edit(tensors)
  safetensors.numpy.save_file(tensors, tmp_path / 'model.safetensors', metadata={'format': 'pt'})
  return tmp_path


def test_wrong_shape_names_tensor(saved, tmp_path):
  name = 'model.layers.1.mlp.up_proj.weight'
  directory = _edited_copy(saved, tmp_path,
                           lambda t: t.update({name: np.zeros((100, 64), np.float32)}))
  with pytest.raises(ConfigError, match=rf'{name}.*\[100, 64\].*\[128, 64\]'):
    hf.load_hf(directory)


def test_missing_tensor_is_named(saved, tmp_path):
  name = 'model.layers.1.self_attn.k_proj.weight'
  directory = _edited_copy(saved, tmp_path, lambda t: t.pop(name))
  with pytest.raises(ConfigError, match=name):
    hf.load_hf(directory)


def test_unexpected_tensor_is_named_and_inv_freq_ignored(saved, tmp_path):
  extra = 'model.layers.0.self_attn.o_proj.bias'
  inv_freq = 'model.layers.0.self_attn.rotary_emb.inv_freq'
  directory = _edited_copy(saved, tmp_path, lambda t: t.update(
      {extra: np.zeros(64, np.float32), inv_freq: np.ones(8, np.float32)}))
  with pytest.raises(ConfigError, match=extra) as info:
    hf.load_hf(directory)
  assert inv_freq not in str(info.value)
  _edited_copy(saved, tmp_path, lambda t: t.update({inv_freq: np.ones(8, np.float32)}))
  hf.load_hf(directory)


def test_missing_head_means_tied(saved, tmp_path):
  directory = _edited_copy(saved, tmp_path, lambda t: t.pop('lm_head.weight'))
  cfg, params = hf.load_hf(directory)
  assert cfg.tie_embeddings and 'lm_head' not in params['head']


def test_tied_checkpoint_with_head_copy_loads(saved, tmp_path):
  def add_head(tensors):
    tensors['lm_head.weight'] = tensors['model.embed_tokens.weight']

  cfg, params = hf.load_hf(_edited_copy(saved, tmp_path, add_head, case='llama_gqa_tied'))
  assert cfg.tie_embeddings and 'lm_head' not in params['head']


# ----------------------------------------------------------------------------------------------
# model_config_from_hf on hand-written configs.
# ----------------------------------------------------------------------------------------------

_BASE = {'architectures': ['LlamaForCausalLM'], 'vocab_size': 32, 'hidden_size': 64,
         'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
         'max_position_embeddings': 128}


# config.json of microsoft/Phi-3-mini-4k-instruct and Qwen/Qwen2.5-7B-Instruct as published
# (transformers 4.x layout), Qwen's with the rope_scaling its model card adds past 32k tokens.
PHI3_MINI = {
    'architectures': ['Phi3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'bos_token_id': 1, 'embd_pdrop': 0.0, 'eos_token_id': 32000, 'hidden_act': 'silu',
    'hidden_size': 3072, 'initializer_range': 0.02, 'intermediate_size': 8192,
    'max_position_embeddings': 4096, 'model_type': 'phi3', 'num_attention_heads': 32,
    'num_hidden_layers': 32, 'num_key_value_heads': 32, 'original_max_position_embeddings': 4096,
    'pad_token_id': 32000, 'resid_pdrop': 0.0, 'rms_norm_eps': 1e-05, 'rope_scaling': None,
    'rope_theta': 10000.0, 'sliding_window': 2047, 'tie_word_embeddings': False,
    'torch_dtype': 'bfloat16', 'use_cache': True, 'vocab_size': 32064}
QWEN25_7B_YARN = {
    'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643,
    'eos_token_id': 151645, 'hidden_act': 'silu', 'hidden_size': 3584, 'initializer_range': 0.02,
    'intermediate_size': 18944, 'max_position_embeddings': 32768, 'max_window_layers': 28,
    'model_type': 'qwen2', 'num_attention_heads': 28, 'num_hidden_layers': 28,
    'num_key_value_heads': 4, 'rms_norm_eps': 1e-06, 'rope_theta': 1000000.0,
    'sliding_window': 131072, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
    'use_cache': True, 'use_sliding_window': False, 'vocab_size': 152064,
    'rope_scaling': {'factor': 4.0, 'original_max_position_embeddings': 32768, 'type': 'yarn'}}


def test_published_configs():
  """Phi-3-mini: its window, 32 heads of 96, no bias; Qwen2.5-7B with YaRN: 131,072 tokens."""
  cfg = hf.model_config_from_hf(PHI3_MINI)
  assert (cfg.sliding_window, cfg.head_dim, cfg.num_kv_heads, cfg.vocab_size, cfg.max_seq_len,
          cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_scaling_type) == (
              2047, 96, 32, 32064, 4096, False, False, 'none')
  assert cfg.num_params == 3_821_079_552  # Phi-3-mini's parameter count
  cfg = hf.model_config_from_hf(QWEN25_7B_YARN)
  assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_original_max_len,
          cfg.max_seq_len, cfg.sliding_window, cfg.qkv_bias) == (
              'yarn', 4.0, 32768, 131072, 0, True)
  assert rope_attention_factor(cfg) == pytest.approx(0.1 * np.log(4.0) + 1)


def test_transformers4_rope_layout():
  cfg = hf.model_config_from_hf(_BASE | {'rope_theta': 500000.0, 'rope_scaling': {
      'type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0}})
  rope = (cfg.rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor)
  assert rope == (500000.0, 'llama3', 8.0)
  assert cfg.rope_original_max_len == 128  # defaults to max_position_embeddings, as in transformers
  assert cfg.num_kv_heads == 4 and cfg.head_dim == 16 and not cfg.tie_embeddings
  cfg = hf.model_config_from_hf(_BASE | {'rope_scaling': {'rope_type': 'linear', 'factor': 2.0}})
  rope = (cfg.rope_theta, cfg.rope_scaling_type, cfg.rope_scaling_factor)
  assert rope == (10000.0, 'linear', 2.0)
  assert hf.model_config_from_hf(_BASE | {'rope_scaling': None}).rope_scaling_type == 'none'


@pytest.mark.parametrize('rope', [
    {'factor': 4.0, 'original_max_position_embeddings': 32},
    {'factor': 8.0, 'original_max_position_embeddings': 64, 'beta_fast': 16, 'beta_slow': 2,
     'truncate': False},
    {'factor': 4.0, 'original_max_position_embeddings': 32, 'attention_factor': 1.3},
    {'factor': 40.0, 'original_max_position_embeddings': 16, 'mscale': 1.0,
     'mscale_all_dim': 0.707},  # DeepSeek's way of giving the attention factor
    {'factor': None, 'original_max_position_embeddings': 32},  # the factor: 128 / 32
    {'factor': 2.0},  # the original length: max_position_embeddings
])
def test_yarn_frequencies_and_attention_factor_match_transformers(rope):
  """YaRN's inverse frequencies and attention factor from config.json, against transformers'
  `_compute_yarn_parameters` for each way a config can give them."""
  from transformers.modeling_rope_utils import _compute_yarn_parameters
  config = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      rope_parameters={'rope_type': 'yarn', 'rope_theta': 10000.0} | rope)
  inv_freq, attention_factor = _compute_yarn_parameters(config)
  cfg = hf.model_config_from_hf(config.to_dict())
  np.testing.assert_array_equal(rope_inverse_frequencies(cfg), inv_freq.numpy())
  assert rope_attention_factor(cfg) == pytest.approx(attention_factor, rel=1e-12)
  # train.seq_len may reach the extended length (the original one times the factor).
  original = rope.get('original_max_position_embeddings', 128)
  assert cfg.max_seq_len == max(128, int((rope['factor'] or 128 / original) * original))


@pytest.mark.parametrize('extra, match', [
    ({'rope_parameters': {'rope_type': 'longrope', 'rope_theta': 1e4, 'factor': 4.0}},
     'longrope'),
    ({'rope_scaling': {'type': 'dynamic', 'factor': 2.0}}, 'dynamic'),
    ({'mlp_bias': True}, 'mlp_bias'),
    ({'attention_bias': True}, 'o_proj'),
    ({'architectures': ['Qwen3ForCausalLM'], 'attention_bias': True}, 'Qwen3ForCausalLM.*o_proj'),
    ({'hidden_act': 'gelu'}, 'gelu'),
])
def test_unsupported_features(extra, match):
  with pytest.raises(UnsupportedModelError, match=match):
    hf.model_config_from_hf(_BASE | extra)


def test_qwen2_sliding_window_follows_layer_types():
  qwen = _BASE | {'architectures': ['Qwen2ForCausalLM'], 'sliding_window': 8}
  assert hf.model_config_from_hf(qwen).sliding_window == 0  # use_sliding_window defaults off
  on = qwen | {'use_sliding_window': True}
  assert hf.model_config_from_hf(on | {'max_window_layers': 0}).sliding_window == 8
  assert hf.model_config_from_hf(on).sliding_window == 0  # default max_window_layers=28 > 2 layers
  with pytest.raises(UnsupportedModelError, match='some layers'):
    hf.model_config_from_hf(on | {'max_window_layers': 1})


@pytest.mark.parametrize('model_type', ['llama', 'mistral', 'qwen2', 'qwen3', 'phi3'])
def test_a_config_json_without_optional_keys_means_what_transformers_makes_of_it(model_type):
  """A hand-written or trimmed config.json holding only the shapes: each optional key we read
  takes that architecture's transformers default (MistralConfig's window of 4096 and its 8 KV
  heads, Phi3Config's rms_norm_eps of 1e-5), not one default for all (the window was 0: logits
  4.7 apart from position 4096 on)."""
  minimal = {'model_type': model_type, 'vocab_size': VOCAB, 'hidden_size': 512,
             'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 32,
             'max_position_embeddings': 8192}
  theirs = transformers.AutoConfig.for_model(**minimal)
  cfg = hf.model_config_from_hf(minimal)
  window = getattr(theirs, 'sliding_window', None) if getattr(theirs, 'use_sliding_window',
                                                              True) else None
  assert (cfg.norm_eps, cfg.sliding_window, cfg.num_kv_heads, cfg.tie_embeddings, cfg.init_std,
          cfg.rope_theta) == (theirs.rms_norm_eps, window or 0, theirs.num_key_value_heads,
                              theirs.tie_word_embeddings, theirs.initializer_range,
                              theirs.rope_parameters['rope_theta'])
  # An explicit null window is full attention (Mistral v0.3).
  assert hf.model_config_from_hf(minimal | {'sliding_window': None}).sliding_window == 0


def test_missing_shape_key_and_invalid_values():
  with pytest.raises(ConfigError, match='hidden_size'):
    hf.model_config_from_hf({k: v for k, v in _BASE.items() if k != 'hidden_size'})
  with pytest.raises(ConfigError, match='config.json.*num_heads'):
    hf.model_config_from_hf(_BASE | {'num_key_value_heads': 3})
