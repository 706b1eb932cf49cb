"""Issue 11: fine-tune from a Hugging Face checkpoint, export back, sliding-window perplexity.

Tiny random Llama, Qwen2, Mistral and Qwen3 checkpoints are made by transformers on CPU (nothing is
downloaded), with a byte-level BPE tokenizer trained here on tinyshakespeare. Checked:
- `init.from_hf` fills every engine (resident, host, NVMe) with exactly the checkpoint's weights
  and zero Adam state, piece by piece, and takes the model shape and tokenizer from the directory;
- `--eval` equals transformers' own loss (`labels=`) under the same window definition, for each
  architecture, with overlapping and non-overlapping windows, from the HF directory and from a
  run's checkpoint;
- the acceptance chain: fine-tune with params and Adam state on NVMe, resume after the HF
  directory is deleted (it is not read again), export, reload with transformers: logits equal
  ours, and `--eval` of the run equals transformers' perplexity of the export;
- bad input: each a clear error before anything is written.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from helpers import JAX_CACHE_DIR, REPO_ROOT, SHARED_DATA, read_rows
from megatrain_jax import config as config_lib
from megatrain_jax import evaluate as evaluate_lib
from megatrain_jax import export as export_lib
from megatrain_jax import hf
from megatrain_jax import model as model_lib
from megatrain_jax import optim
from megatrain_jax import runs
from megatrain_jax import train
from megatrain_jax.checkpoint import Checkpointer
from megatrain_jax.data import HFTokenizer
from megatrain_jax.engine import resident
from megatrain_jax.errors import ConfigError, UnsupportedModelError
from megatrain_jax.placement import Placement
from megatrain_jax.tiers.nvme import NvmeStore

VOCAB, TOKENIZER_VOCAB = 320, 300
TEXT = SHARED_DATA / 'tinyshakespeare' / 'input.txt'
ARCHS = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    'mistral': (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(tie_word_embeddings=False, sliding_window=12)),
    'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(tie_word_embeddings=True, head_dim=16)),
    'phi3': (transformers.Phi3Config, transformers.Phi3ForCausalLM,  # fused qkv / gate_up
             dict(tie_word_embeddings=False, sliding_window=12, pad_token_id=None,
                  bos_token_id=None, eos_token_id=None)),
}
TOL = 1e-4


def _tokenizer(directory):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([TEXT.read_text()[:100_000]], trainers.BpeTrainer(
      vocab_size=TOKENIZER_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.save(str(directory / 'tokenizer.json'))


def _hf_model(arch: str, **extra):
  config_cls, model_cls, overrides = ARCHS[arch]
  config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, initializer_range=0.1,
                      attn_implementation='eager', **(overrides | extra))
  torch.manual_seed(0)
  model = model_cls(config).float().eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith('norm.weight'):
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
      elif name.endswith('bias'):
        torch.nn.init.normal_(param, std=0.2)
  return model


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """{arch: directory}: llama sharded in 7 files, qwen2 and qwen3 tied single-file, mistral in
  bfloat16, phi3 with its fused projections."""
  root = tmp_path_factory.mktemp('hf')
  _tokenizer(root)
  out = {}
  for arch in ARCHS:
    model = _hf_model(arch)
    if arch == 'mistral':
      model = model.to(torch.bfloat16)
    model.save_pretrained(root / arch, max_shard_size='20KB' if arch == 'llama' else '5GB')
    shutil.copy(root / 'tokenizer.json', root / arch / 'tokenizer.json')
    out[arch] = root / arch
  return out


@pytest.fixture(scope='module')
def eval_text(tmp_path_factory):
  path = tmp_path_factory.mktemp('text') / 'eval.txt'
  path.write_text(TEXT.read_text()[200_000:202_000])
  return path


def _with_bos(checkpoint, directory):
  """A copy of `checkpoint` whose tokenizer.json prepends a BOS (id 300) to every text, as
  Llama 3's does (its tokenizer_config.json names it, without add_bos_token)."""
  shutil.copytree(checkpoint, directory)
  tokenizer = Tokenizer.from_file(str(directory / 'tokenizer.json'))
  tokenizer.add_special_tokens(['<|begin_of_text|>'])
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<|begin_of_text|> $A', special_tokens=[('<|begin_of_text|>', 300)])
  tokenizer.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps({'bos_token': '<|begin_of_text|>'}))
  return directory


def _config(**overrides):
  fields = dict(data__path=str(TEXT), train__seq_len=32, train__batch_size=4, train__steps=2,
                train__warmup_steps=1, train__log_every=1, train__eval_every=0,
                train__eval_batches=1, train__progress_bar=False, checkpoint__every=2,
                jax_cache_dir='')
  return config_lib.load_config('tiny', **(fields | overrides))


def _torch_perplexity(model, tokens: np.ndarray, max_len: int, stride: int) -> tuple[float, int]:
  """The definition with transformers' own shifted loss: window inputs t[b : b + max_len + 1]
  fed whole, labels masked (-100) up to the first token not scored yet."""
  ids, total, count, scored = torch.from_numpy(tokens.astype(np.int64)), 0.0, 0, 1
  model = model.float()
  for begin in range(0, tokens.size, stride):
    end = min(begin + max_len + 1, tokens.size)
    window = ids[begin:end]
    labels = window.clone()
    labels[:scored - begin] = -100
    with torch.no_grad():
      # transformers shifts the labels: position j predicts labels[j + 1]; the last position of
      # the max_len + 1 tokens fed predicts nothing (causal: it changes no earlier logit).
      loss = model(window[None], labels=labels[None]).loss
    n = int((labels[1:] != -100).sum())
    total, count, scored = total + float(loss) * n, count + n, end
    if end == tokens.size:
      break
  return total / count, count


# ------------------------------------------------------------------------------------------------
# Import: the engines hold exactly the checkpoint's weights.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('placement', [
    dict(), dict(params='host', opt_state='host', embed_head='host'),
    dict(params='nvme', opt_state='nvme', embed_head='nvme', shard_mb=0.004)])
def test_import_fills_every_tier_with_the_checkpoint(placement, checkpoints, tmp_path):
  checkpoint = hf.inspect_checkpoint(checkpoints['llama'])
  cfg = checkpoint.cfg
  train_cfg = _config().train
  tx = optim.make_optimizer(train_cfg)
  reader = hf.HfReader(checkpoint, resident.abstract_state(cfg, tx), seed=0)
  placement = Placement(**(dict(dir=str(tmp_path)) | placement))
  engine = train.make_engine(cfg, tx, optim.lr_schedule(train_cfg), train_cfg, placement,
                             restore_from=reader)
  try:
    state = jax.tree.map(np.asarray, engine.export_state())
    # AdamW's zeros are registered in the NVMe stores, not written (tiers/nvme.py)
    assert not [f for f in tmp_path.rglob('c/*') if 'opt_state' in str(f)]
    assert placement.params != 'nvme' or list(tmp_path.rglob('c/*'))
  finally:
    engine.close()
  _, want = hf.load_hf(checkpoints['llama'])
  jax.tree.map(np.testing.assert_array_equal, state['params'], jax.tree.map(np.asarray, want))
  zeros = jax.tree.map(np.asarray, tx.init(want))
  jax.tree.map(np.testing.assert_array_equal, state['opt_state'], zeros)
  fresh = jax.jit(resident.init_state, static_argnums=(0, 1))(cfg, tx, 0)
  np.testing.assert_array_equal(state['rng'], fresh['rng'])  # a fresh run's, seed 0
  assert int(state['step']) == 0
  if placement.params == 'nvme':  # vocabulary chunks of 32 rows: read as slices, not whole
    assert len(engine.vocab) > 1


def test_config_comes_from_the_checkpoint(checkpoints, tmp_path):
  config, found = runs.resolve_init(_config(**{'init__from_hf': str(checkpoints['qwen2']),
                                                'model__remat': 'none'}), str(tmp_path / 'w'))
  assert found.cfg.qkv_bias and found.cfg.tie_embeddings
  model_cfg = config_lib.validate(config)
  assert (model_cfg.vocab_size, model_cfg.d_model, model_cfg.num_layers, model_cfg.d_ff) == (
      VOCAB, 32, 2, 64)
  assert model_cfg.qkv_bias and model_cfg.tie_embeddings and model_cfg.remat == 'none'
  assert config.data.tokenizer == str(checkpoints['qwen2'] / 'tokenizer.json')
  # A value the user gives that agrees is fine; one set on the command line but equal to the
  # default is still checked.
  runs.resolve_init(_config(init__from_hf=str(checkpoints['qwen2']), model__d_model=32),
                     str(tmp_path / 'w'))
  with pytest.raises(ConfigError, match=r'model.num_layers=4 disagrees with .*config.json'):
    runs.resolve_init(_config(init__from_hf=str(checkpoints['qwen2'])), str(tmp_path / 'w'),
                       overrides=['model.num_layers'])
  assert not (tmp_path / 'w').exists()


# ------------------------------------------------------------------------------------------------
# --eval equals transformers.
# ------------------------------------------------------------------------------------------------

def test_windows_score_every_token_once():
  for n, max_len, stride in [(2, 4, 4), (10, 4, 4), (11, 4, 2), (9, 3, 1), (100, 16, 5)]:
    scored = []
    for w in evaluate_lib.windows(n, max_len, stride):
      assert w.begin + 1 <= w.first and w.end <= w.begin + max_len + 1
      scored += range(w.first, w.end)
    assert scored == list(range(1, n))


# llama: a streamed placement, so the evaluator reads 2 layer groups and 10 vocabulary chunks.
STREAMED = dict(offload__params='host', offload__opt_state='host', offload__embed_head='host',
                offload__layers_per_group=1, offload__shard_mb=0.004)


@pytest.mark.parametrize('arch, stride, placement', [
    ('llama', 16, STREAMED), ('qwen2', 32, {}), ('mistral', 10, {}), ('qwen3', 16, STREAMED),
    ('phi3', 16, STREAMED)])
def test_eval_equals_transformers(arch, stride, placement, checkpoints, eval_text, tmp_path):
  """--eval's loss over the tokens transformers' `tokenizer(text)` gives, the perplexity guide's
  definition: Llama's starts with its BOS (a tokenizer.json that prepends it, as Llama 3's
  does), so every token of the text is scored; the others add none."""
  source = checkpoints[arch]
  if arch == 'llama':
    source = _with_bos(checkpoints[arch], tmp_path / 'llama')
  config = _config(init__from_hf=str(source), eval__path=str(eval_text),
                   eval__max_len=32, eval__stride=stride, eval__batch_size=3, **placement)
  result = train.evaluate(config, str(tmp_path / 'w'))
  if placement:
    resolved, _ = runs.resolve_init(config, str(tmp_path / 'x'))
    evaluator = train._evaluator(resolved, config_lib.validate(resolved), tmp_path, None)
    assert (len(evaluator.groups), len(evaluator.vocab)) == (2, 10)
    evaluator.close()
  ids = np.asarray(transformers.AutoTokenizer.from_pretrained(source)(eval_text.read_text())[
      'input_ids'])
  plain = Tokenizer.from_file(str(source / 'tokenizer.json')).encode(
      eval_text.read_text(), add_special_tokens=False).ids
  assert list(ids) == ([300] if arch == 'llama' else []) + plain
  model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
  want, count = _torch_perplexity(model.eval(), ids, 32, stride)
  assert result['eval/tokens'] == count == ids.size - 1
  assert abs(result['eval/loss'] - want) <= TOL * want, (result['eval/loss'], want)
  assert json.loads((tmp_path / 'w' / 'eval.json').read_text())['eval/loss'] == result['eval/loss']
  if arch == 'qwen2':  # another --eval: eval.json holds the newest, evals.jsonl every one
    config.eval.stride = 16
    again = train.evaluate(config, str(tmp_path / 'w'))
    assert json.loads((tmp_path / 'w' / 'eval.json').read_text())['eval/stride'] == 16
    history = [json.loads(line) for line in (tmp_path / 'w' / 'evals.jsonl').read_text()
               .splitlines()]
    assert [(row['eval/loss'], row['eval/stride']) for row in history] == [
        (result['eval/loss'], 32), (again['eval/loss'], 16)]
    # An earlier version wrote eval.json alone: the next --eval keeps it as evals.jsonl's first.
    (tmp_path / 'w' / 'evals.jsonl').unlink()
    train.evaluate(config, str(tmp_path / 'w'))
    history = [json.loads(line) for line in (tmp_path / 'w' / 'evals.jsonl').read_text()
               .splitlines()]
    assert [row['eval/loss'] for row in history] == [again['eval/loss']] * 2
    assert 'eval/finished' not in history[0] and 'eval/finished' in history[1]


def test_an_export_keeps_the_sources_token_ids_and_tokenizer_files(checkpoints, tmp_path):
  """A checkpoint whose config.json gives the special ids (bos, an EOS list, pad) and whose
  tokenizer files name none (tokenizer.json alone, as many Llama 3 repositories): its export had
  no ids, so transformers took Llama's 1 and 2 and generate never stopped at the real EOS. The
  export falls back to the ids the source gave. The files a slow tokenizer and named chat
  templates need (tokenizer.model, additional_chat_templates/) come along too, from a run that
  started from this one as well (init.from_run)."""
  source = tmp_path / 'llama'
  shutil.copytree(checkpoints['llama'], source)
  config_json = json.loads((source / 'config.json').read_text())
  config_json.update(bos_token_id=5, eos_token_id=[6, 7], pad_token_id=8)
  (source / 'config.json').write_text(json.dumps(config_json))
  (source / 'tokenizer.model').write_bytes(b'\x0a\x05sp-model')  # only copied, not read
  (source / 'additional_chat_templates').mkdir()
  (source / 'additional_chat_templates' / 'tool_use.jinja').write_text('TOOLS{{ messages }}')
  workdir, again = tmp_path / 'run', tmp_path / 'again'
  train.train_and_evaluate(_config(init__from_hf=str(source)), str(workdir))
  train.train_and_evaluate(_config(init__from_run=str(workdir), train__steps=1,
                                   checkpoint__every=1), str(again))
  for run in (workdir, again):
    out = tmp_path / f'export-{run.name}'
    train.export_hf(_config(), str(run), str(out))
    exported = json.loads((out / 'config.json').read_text())
    assert (exported['bos_token_id'], exported['eos_token_id'], exported['pad_token_id']) == (
        5, [6, 7], 8)
    assert transformers.AutoConfig.from_pretrained(out).eos_token_id == [6, 7]
    for name in ('tokenizer.model', 'additional_chat_templates/tool_use.jinja'):
      assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / 'model_token_ids.json').exists()  # the run's record, not a model file


def test_a_chat_template_of_the_run_trains_and_is_exported(checkpoints, tmp_path):
  """data.chat_template on a base model whose tokenizer has none: its chat records train with it,
  the run keeps a copy (config.json names it; --eval and --sample of the run adopt it), and
  --export_hf writes it as chat_template.jinja, which transformers' apply_chat_template renders
  exactly as the run did."""
  source = tmp_path / 'llama'
  shutil.copytree(checkpoints['llama'], source)
  tokenizer = Tokenizer.from_file(str(source / 'tokenizer.json'))
  tokenizer.add_special_tokens(['<|end|>'])  # an EOS for the documents (id 300 < VOCAB)
  tokenizer.save(str(source / 'tokenizer.json'))
  (source / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|end|>'}))
  template = tmp_path / 'chat.jinja'
  template.write_text('{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}'
                      '{% if add_generation_prompt %}<assistant> {% endif %}')
  conversation = [{'role': 'user', 'content': 'Who wrote Hamlet?'},
                  {'role': 'assistant', 'content': 'Shakespeare.'}]
  data = tmp_path / 'chat.jsonl'
  data.write_text(''.join(json.dumps({'messages': conversation}) + '\n' for _ in range(200)))
  workdir, out = tmp_path / 'run', tmp_path / 'export'
  start = dict(init__from_hf=str(source), data__path=str(data), data__chat_template=str(template))
  # --prepare tokenizes with the checkpoint's tokenizer and the template, as training will.
  prepared = train.prepare(_config(**start), str(workdir))
  assert prepared.tokenizer == HFTokenizer(source / 'tokenizer.json').name
  meta_file = workdir / 'data' / 'meta.json'
  prepared_at = meta_file.stat().st_mtime_ns
  train.train_and_evaluate(_config(**start), str(workdir))
  assert meta_file.stat().st_mtime_ns == prepared_at  # training read what --prepare wrote
  copy = workdir / 'chat_template.jinja'
  assert copy.read_text() == template.read_text()
  assert json.loads((workdir / 'config.json').read_text())['data']['chat_template'] == str(copy)
  template.unlink()  # readers of the run use its copy
  # Moved, the run reads its own copies, not the paths config.json recorded before the move.
  moved = tmp_path / 'moved'
  workdir.rename(moved)
  meta = json.loads((moved / 'checkpoints' / '2' / 'meta.json').read_text())
  adopted = runs.config_from_run(_config(), moved, meta, [])
  assert adopted.data.chat_template == str(moved / 'chat_template.jinja')
  assert adopted.data.tokenizer == str(moved / 'hf_tokenizer' / 'tokenizer.json')
  train.export_hf(_config(), str(moved), str(out))
  assert (out / 'chat_template.jinja').read_text() == (moved / 'chat_template.jinja').read_text()
  assert (out / 'tokenizer.json').is_file()
  rendered = transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
      conversation, tokenize=False)
  assert rendered == '<user> Who wrote Hamlet?\n<assistant> Shakespeare.\n'
  # config.json names the EOS, which generate stops at where no generation_config.json says, and
  # the weights' width under transformers 5's key and 4.x's (vLLM, TGI on 4.x read torch_dtype).
  exported = json.loads((out / 'config.json').read_text())
  assert exported['eos_token_id'] == 300
  assert exported['dtype'] == exported['torch_dtype'] == 'float32'
  assert transformers.GenerationConfig.from_model_config(
      transformers.AutoConfig.from_pretrained(out)).eos_token_id == 300
  # A resume (or --eval) asking for other weights or another tokenizer is refused, not ignored.
  moved_start = dict(start, data__chat_template='', train__steps=4)
  for change, message in [
      (dict(init__from_hf=str(checkpoints['qwen2'])), 'holds a run .checkpoint step 2. that '
       f'started from {source}'),
      (dict(data__tokenizer=str(checkpoints['llama'] / 'tokenizer.json')),  # no <|end|>
       'data.tokenizer=.*llama/tokenizer.json is not the tokenizer the run in .* trained with'),
  ]:
    with pytest.raises(ConfigError, match=message):
      train.train_and_evaluate(_config(**moved_start | change), str(moved))
    with pytest.raises(ConfigError, match=message):
      train.evaluate(_config(**moved_start | change, eval__path=str(data)), str(moved))
  assert sorted(p.name for p in (moved / 'checkpoints').iterdir()) == ['2']
  # Without the init field the run resumes as it started (shape, tokenizer and template from its
  # checkpoint and copies), and config.json goes on naming where it started.
  train.train_and_evaluate(_config(**moved_start | dict(init__from_hf='', train__steps=3)),
                           str(moved))
  assert read_rows(moved)[-1]['step'] == 3
  assert json.loads((moved / 'config.json').read_text())['init']['from_hf'] == str(source)
  # An export whose tokenizer is gone is refused (it could not be read), before writing.
  shutil.rmtree(moved / 'hf_tokenizer')
  with pytest.raises(ConfigError, match=r"the run's tokenizer .* does not exist any more"):
    train.export_hf(_config(), str(moved), str(tmp_path / 'export2'))
  assert not (tmp_path / 'export2').exists()


# ------------------------------------------------------------------------------------------------
# Acceptance: fine-tune on NVMe, resume without the HF directory, export, reload.
# ------------------------------------------------------------------------------------------------

def test_finetune_on_nvme_resume_export_reload(checkpoints, eval_text, tmp_path):
  source = tmp_path / 'llama'
  shutil.copytree(checkpoints['llama'], source)
  workdir, out = tmp_path / 'run', tmp_path / 'export'
  nvme = dict(init__from_hf=str(source), offload__params='nvme', offload__opt_state='nvme',
              offload__embed_head='host', offload__layers_per_group=1)
  train.train_and_evaluate(_config(**nvme), str(workdir))
  first = read_rows(workdir)
  assert first[0]['step'] == 0 and abs(first[0]['eval/loss'] - np.log(VOCAB)) < 1.0
  shutil.rmtree(source)  # the resumed run must not read it
  source.mkdir()
  (source / 'config.json').write_text('not json')
  train.train_and_evaluate(_config(**nvme, train__steps=4), str(workdir))
  assert read_rows(workdir)[-1]['step'] == 4
  assert (workdir / 'hf_tokenizer' / 'tokenizer.json').is_file()

  # Export (three shards + index, the run's tokenizer) and reload with transformers.
  train.export_hf(_config(export__max_shard_gb=3e-5), str(workdir), str(out))
  names = sorted(p.name for p in out.iterdir())
  assert 'model.safetensors.index.json' in names and 'tokenizer.json' in names
  assert sum(n.endswith('.safetensors') for n in names) > 1
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  cfg = model_lib.ModelConfig(**json.loads(
      (workdir / 'checkpoints' / '4' / 'meta.json').read_text())['model_config'])
  reader = Checkpointer(workdir, keep=3).restore(cfg)
  params = reader.full_state(resident.abstract_state(cfg, optim.make_optimizer(
      _config().train)))['params']
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
  ours = np.asarray(jax.jit(model_lib.forward, static_argnums=0)(cfg, params, tokens))
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens)).logits.numpy()
  assert np.max(np.abs(ours - theirs)) <= TOL

  # --eval of the run (its checkpoint, its tokenizer) = transformers' perplexity of the export.
  result = train.evaluate(_config(eval__path=str(eval_text), eval__max_len=24, eval__stride=12),
                          str(workdir))
  tokenizer = Tokenizer.from_file(str(out / 'tokenizer.json'))
  ids = np.asarray(tokenizer.encode(eval_text.read_text(), add_special_tokens=False).ids)
  want, _ = _torch_perplexity(model, ids, 24, 12)
  assert abs(result['eval/perplexity'] - np.exp(want)) <= TOL * np.exp(want)
  assert 'checkpoints/4' in result['eval/source']

  # bfloat16 export: transformers reads bfloat16 tensors, the logits move by bf16 rounding only.
  train.export_hf(_config(export__dtype='bfloat16'), str(workdir), str(tmp_path / 'bf16'))
  bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'bf16').eval()
  assert next(bf16.parameters()).dtype == torch.bfloat16
  with torch.no_grad():
    rounded = bf16.float()(torch.from_numpy(tokens)).logits.numpy()
  assert 0 < np.max(np.abs(rounded - theirs)) <= 0.05 * np.max(np.abs(theirs))


NVME = dict(offload__params='nvme', offload__opt_state='nvme', offload__embed_head='host',
            offload__layers_per_group=1)


@pytest.mark.parametrize('first_placement, second', [({}, {}), ({}, STREAMED), (NVME, NVME)],
                         ids=['resident', 'streamed', 'nvme-linked'])
def test_a_run_starts_from_another_runs_weights(checkpoints, tmp_path, first_placement, second,
                                               monkeypatch):
  """init.from_run: a run (here fine-tuned from Qwen3 for 2 steps) hands its newest checkpoint's
  weights to a new run in another workdir, resident or streamed: the new run's step-0 eval/loss is
  the first run's last (same validation batches, same weights), its Adam state and step start at
  zero (its first learning rate is a fresh schedule's), the first run's tokenizer is copied in
  (hf_tokenizer/), and the new run resumes without the first run's directory. From NVMe to NVMe
  the layers' weights are hard-linked from the first run's checkpoint, which the new run's writes
  leave as it was."""
  first, branch = tmp_path / 'first', tmp_path / 'branch'
  train.train_and_evaluate(_config(init__from_hf=str(checkpoints['qwen3']), train__lr=3e-3,
                                   **first_placement), str(first))
  want = read_rows(first)[-1]
  assert want['step'] == 2
  source = first / 'checkpoints' / '2'
  before = {p: p.read_bytes() for p in source.rglob('*') if p.is_file()}
  link_arrays, linked = NvmeStore.link_arrays, []

  def spy(store, sources):
    linked.append(link_arrays(store, sources))
    return linked[-1]

  monkeypatch.setattr(NvmeStore, 'link_arrays', spy)
  train.train_and_evaluate(_config(init__from_run=str(first), train__lr=1e-3, **second),
                           str(branch))
  assert {p: p.read_bytes() for p in source.rglob('*') if p.is_file()} == before
  # NVMe: the layers' params store linked from the snapshot; Adam's state (zeros) not tried.
  assert linked == ([True] if second is NVME else [])
  rows = read_rows(branch)
  assert rows[0]['step'] == 0
  assert rows[0]['eval/loss'] == pytest.approx(want['eval/loss'], rel=1e-6)
  fresh = optim.lr_schedule(_config(train__lr=1e-3).train)
  assert rows[1]['learning/lr'] == pytest.approx(float(fresh(0)), rel=1e-6)
  meta = json.loads((branch / 'checkpoints' / '2' / 'meta.json').read_text())
  assert meta['model_config']['qk_norm'] and meta['data_position'] == 2 * 4
  assert (branch / 'hf_tokenizer' / 'tokenizer.json').is_file()
  shutil.rmtree(first)  # a resume reads only its own checkpoint
  train.train_and_evaluate(_config(init__from_run=str(first), train__steps=3, **second),
                           str(branch))
  assert read_rows(branch)[-1]['step'] == 3


def test_init_from_run_reads_the_checkpoint_checkpoint_read_names(checkpoints, tmp_path):
  """init.from_run with checkpoint.read = a step or 'best' starts from that checkpoint of the
  other run, not its newest (which it silently took); a step it does not have is refused before
  the new run's workdir is made."""
  first = tmp_path / 'first'
  train.train_and_evaluate(_config(init__from_hf=str(checkpoints['qwen3']), train__lr=3e-3,
                                   train__eval_every=1, checkpoint__every=1, checkpoint__keep=3),
                           str(first))
  losses = {row['step']: row['eval/loss'] for row in read_rows(first) if 'eval/loss' in row}
  best = min((1, 2), key=losses.get)
  for read, step in (('1', 1), ('best', best)):
    branch = tmp_path / f'from-{read}'
    train.train_and_evaluate(_config(init__from_run=str(first), checkpoint__read=read,
                                     train__steps=1), str(branch))
    assert read_rows(branch)[0]['eval/loss'] == pytest.approx(losses[step], rel=1e-6), read
  with pytest.raises(ConfigError, match=r'checkpoint.read=7: .* has no checkpoint of step 7 '
                                        r'\(it has 1, 2\)'):
    train.train_and_evaluate(_config(init__from_run=str(first), checkpoint__read='7'),
                             str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


def test_init_from_run_refusals(checkpoints, tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  for fields, match in [
      (dict(init__from_run=str(empty)), r'init.from_run: .*/empty holds no checkpoint'),
      (dict(init__from_run=str(tmp_path / 'w')), "init.from_run=.* is this run's own --workdir"),
      (dict(init__from_run=str(empty), init__from_hf=str(checkpoints['qwen3'])),
       'init.from_hf and init.from_run are both set')]:
    with pytest.raises(ConfigError, match=match):
      train.train_and_evaluate(_config(**fields), str(tmp_path / 'w'))
    assert not (tmp_path / 'w').exists()
  with pytest.raises(ConfigError, match=r'init.from_run starts a training run; to read .*/empty, '
                                        'pass it as --workdir'):
    train.evaluate(_config(init__from_run=str(empty), eval__path=str(TEXT)), str(tmp_path / 'w'))


def test_launch_eval_of_a_hugging_face_checkpoint(checkpoints, eval_text, tmp_path):
  """The command line: --eval of init.from_hf prints the result and writes eval.json."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  result = subprocess.run(
      [sys.executable, 'launch.py', '--eval', f'--workdir={tmp_path / "w"}',
       f'--config.init.from_hf={checkpoints["qwen2"]}', f'--config.eval.path={eval_text}',
       '--config.train.progress_bar=false', f'--config.jax_cache_dir={JAX_CACHE_DIR}'],
      cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'eval/perplexity' in result.stdout and (tmp_path / 'w' / 'eval.json').is_file()


# ------------------------------------------------------------------------------------------------
# Bad input: a clear error, nothing written.
# ------------------------------------------------------------------------------------------------

def _broken(checkpoints, tmp_path, edit, arch='llama'):
  copy = tmp_path / 'broken'
  shutil.copytree(checkpoints[arch], copy)
  edit(copy)
  return copy


def _truncate(path):
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


def _corrupt_header(path):
  data = bytearray(path.read_bytes())
  data[8:16] = b'\xff' * 8
  path.write_bytes(bytes(data))


def _bigger_tokenizer(path):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([TEXT.read_text()[:50_000]], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tok.save(str(path / 'tokenizer.json'))


def _edit_json(name, change):
  def edit(path):
    data = json.loads((path / name).read_text())
    change(data)
    (path / name).write_text(json.dumps(data))
  return edit


BAD_DIRECTORIES = {
    'no config.json': (lambda p: (p / 'config.json').unlink(), ConfigError, 'has no config.json'),
    'unsupported architecture': (_edit_json('config.json', lambda c: c.update(
        architectures=['GPT2LMHeadModel'], model_type='gpt2')), UnsupportedModelError,
                                 'GPT2LMHeadModel is not supported'),
    'missing shard': (lambda p: (p / 'model-00003-of-00007.safetensors').unlink(), ConfigError,
                      'missing from the directory: .*model-00003-of-00007.safetensors'),
    'truncated shard': (lambda p: _truncate(p / 'model-00002-of-00007.safetensors'), ConfigError,
                        'model-00002-of-00007.safetensors is not a complete safetensors file'),
    'corrupt shard': (lambda p: _corrupt_header(p / 'model-00005-of-00007.safetensors'),
                      ConfigError, 'model-00005-of-00007.safetensors is not a complete'),
    'shapes disagree with config.json': (_edit_json('config.json', lambda c: c.update(
        intermediate_size=48)), ConfigError, r'has shape \[64, 32\], but config.json implies'),
    'tokenizer vocab > model vocab': (_bigger_tokenizer, ConfigError,
                                      'model.vocab_size=320 is smaller than the tokenizer.*the '
                                      "checkpoint's own tokenizer.json and its config.json "
                                      'disagree'),
    # The byte tokenizer's ids would name other tokens to the model's 320 embedding rows.
    'no tokenizer.json': (lambda p: (p / 'tokenizer.json').unlink(), ConfigError,
                          "has no tokenizer.json, and the model's 320 ids need its own"),
    # Refused before anything is built per layer (10^9 layers took minutes and gigabytes).
    'more layers than the weights': (_edit_json('config.json', lambda c: c.update(
        num_hidden_layers=10**9)), ConfigError, r'num_hidden_layers=1000000000, but the weights '
                                               r'hold 2 layer\(s\) \(model.layers.0 to 1\)'),
    # Values of the wrong type are named, not a ValueError's or TypeError's traceback.
    'a string for a number': (_edit_json('config.json', lambda c: c.update(rms_norm_eps='abc')),
                              ConfigError, "rms_norm_eps='abc' is not a number"),
    'a string for rope_theta': (_edit_json('config.json', lambda c: c.update(rope_parameters={
        **c.get('rope_parameters', {}), 'rope_theta': 'x'}, rope_theta='x')), ConfigError,
                                'a rope or sliding_window value is not a number'),
    'architectures not names': (_edit_json('config.json', lambda c: c.update(architectures=[1])),
                                ConfigError, r'architectures=\[1\] is not a list of names'),
}


def test_a_tokenizer_named_by_a_relative_path_is_found_from_anywhere(checkpoints, tmp_path,
                                                                     monkeypatch):
  """data.tokenizer given relative to the directory a run started in is recorded by its
  absolute path: --export_hf (or a resume, --eval) run from another directory finds it (it was
  refused as gone, or read another file of the same name)."""
  (tmp_path / 'here').mkdir()
  shutil.copy(checkpoints['llama'].parent / 'tokenizer.json', tmp_path / 'here' / 'tok.json')
  monkeypatch.chdir(tmp_path / 'here')
  workdir = tmp_path / 'run'
  train.train_and_evaluate(_config(data__tokenizer='tok.json', model__vocab_size=VOCAB,
                                   train__steps=1), str(workdir))
  recorded = json.loads((workdir / 'config.json').read_text())['data']['tokenizer']
  assert recorded == str(tmp_path / 'here' / 'tok.json')
  monkeypatch.chdir(tmp_path)
  files = train.export_hf(_config(), str(workdir), str(tmp_path / 'export'))
  assert 'tokenizer.json' in [f.name for f in files]


def test_a_model_without_tokenizer_json_reads_the_tokenizer_the_config_names(checkpoints,
                                                                             tmp_path):
  """A model directory without tokenizer.json is refused only where nothing names its
  tokenizer: data.tokenizer set in a config file (not on the command line: `explicit` holds no
  key) is taken. The export's config.json names the EOS the run ended its documents with
  (data.eos_token) where tokenizer_config.json names none."""
  directory = _broken(checkpoints, tmp_path, lambda p: (p / 'tokenizer.json').rename(
      tmp_path / 'tokenizer.json'))
  config = _config(init__from_hf=str(directory), data__tokenizer=str(tmp_path / 'tokenizer.json'))
  adopted = hf.config_from_checkpoint(config, hf.inspect_checkpoint(directory), explicit=[])
  assert adopted.data.tokenizer == str(tmp_path / 'tokenizer.json')
  with pytest.raises(ConfigError, match='has no tokenizer.json'):
    hf.config_from_checkpoint(_config(init__from_hf=str(directory)),
                              hf.inspect_checkpoint(directory), explicit=[])
  eos = Tokenizer.from_file(str(tmp_path / 'tokenizer.json')).id_to_token(7)
  assert export_lib.special_token_ids(str(tmp_path / 'tokenizer.json')) == {}
  assert export_lib.special_token_ids(str(tmp_path / 'tokenizer.json'), eos) == {
      'eos_token_id': 7}


def _as_hub_cache(checkpoint, root):
  """`checkpoint` laid out as the Hugging Face cache holds a download: each file a link from
  snapshots/<rev>/ to ../../blobs/<hash>. Returns the snapshot."""
  snapshot = root / 'models--org--tiny' / 'snapshots' / 'abc123'
  blobs = root / 'models--org--tiny' / 'blobs'
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for index, file in enumerate(sorted(checkpoint.iterdir())):
    shutil.copy(file, blobs / f'{index:040x}')
    (snapshot / file.name).symlink_to(f'../../blobs/{index:040x}')
  return snapshot


def test_files_a_model_directory_names_or_links_outside_it_are_refused(checkpoints, tmp_path):
  """A model directory's files were read wherever they led: a weight_map naming
  ../../outside/x.safetensors or an absolute path, or a shard linked out of the directory, was
  loaded; a special_tokens_map.json linked to ~/private.txt was copied into the run's
  hf_tokenizer/ and from there into its export. Each is refused naming the file; the Hugging
  Face cache's layout (links into the repository's blobs/) reads as before."""
  snapshot = _as_hub_cache(checkpoints['llama'], tmp_path / 'hub')
  assert len(hf.inspect_checkpoint(snapshot).files) > 1
  copies = hf.copy_tokenizer(snapshot, tmp_path / 'copy')
  assert [p.name for p in copies] == ['tokenizer.json', 'generation_config.json']
  private = tmp_path / 'private.txt'
  private.write_text('{"secret": "the user\'s"}')
  (snapshot / 'special_tokens_map.json').symlink_to(private)
  with pytest.raises(ConfigError, match=r'special_tokens_map.json: special_tokens_map.json is a '
                     r'link to .*private.txt, outside .*; tokenizer files are copied into the '
                     r'run and its exports'):
    hf.copy_tokenizer(snapshot, tmp_path / 'copy2')
  assert not (tmp_path / 'copy2').exists()
  index = 'model.safetensors.index.json'
  shard = json.loads((checkpoints['llama'] / index).read_text())['weight_map']['lm_head.weight']
  outside = tmp_path / 'outside'
  outside.mkdir()
  shutil.copy(checkpoints['llama'] / shard, outside / shard)
  for name, edit in (
      ('relative', _edit_json(index, lambda i: i['weight_map'].update(
          {'lm_head.weight': f'../../outside/{shard}'}))),
      ('absolute', _edit_json(index, lambda i: i['weight_map'].update(
          {'lm_head.weight': str(outside / shard)}))),
      ('linked', lambda p: ((p / shard).unlink(), (p / shard).symlink_to(outside / shard)))):
    directory = _broken(checkpoints, tmp_path / name, edit)
    with pytest.raises(ConfigError, match=r'model.safetensors.index.json names a weights file '
                       r'outside .* a checkpoint reads its own files only'):
      hf.inspect_checkpoint(directory)


@pytest.mark.parametrize('case', list(BAD_DIRECTORIES))
def test_bad_checkpoint_directory(case, checkpoints, tmp_path):
  edit, error, match = BAD_DIRECTORIES[case]
  directory = _broken(checkpoints, tmp_path, edit)
  workdir = tmp_path / 'w'
  with pytest.raises(error, match=match):
    train.train_and_evaluate(_config(init__from_hf=str(directory)), str(workdir))
  with pytest.raises(error, match=match):
    train.evaluate(_config(init__from_hf=str(directory), eval__path=str(TEXT)), str(workdir))
  assert not workdir.exists()


def test_eval_without_a_model_and_export_into_a_non_empty_directory(tmp_path):
  workdir = tmp_path / 'w'
  with pytest.raises(ConfigError, match='--eval: .*holds no checkpoint and init.from_hf is not '
                     'set, so there is no model to evaluate'):
    train.evaluate(_config(eval__path=str(TEXT)), str(workdir))
  with pytest.raises(ConfigError, match='--sample: .*no model to sample'):
    train.sample(_config(sample__prompt='Once'), str(workdir))
  assert not workdir.exists()
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'keep.txt').write_text('mine')
  result = subprocess.run(
      [sys.executable, 'launch.py', f'--export_hf={out}', f'--workdir={workdir}'],
      cwd=REPO_ROOT, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=120)
  assert result.returncode == 1 and 'is not empty' in result.stderr, result.stderr[-2000:]
  assert sorted(p.name for p in out.iterdir()) == ['keep.txt'] and not workdir.exists()
  with pytest.raises(ConfigError, match='holds no checkpoint to export'):
    train.export_hf(_config(), str(workdir), str(tmp_path / 'new'))
  assert not (tmp_path / 'new').exists()
