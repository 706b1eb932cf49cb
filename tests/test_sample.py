"""`launch.py --sample` (sample.py, train.sample): greedy continuations (decoded with the
key/value cache) equal transformers' `generate` on tiny random models (nothing downloaded);
sampling follows softmax(logits / T) over the top k, and top k / top p keep what transformers'
warpers keep; EOS and generation_config.json's end ids stop it; the command reads a run's
checkpoint or a Hugging Face one and refuses bad settings by name."""

import dataclasses
import json

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatrain_jax import hardware
from megatrain_jax import hf
from megatrain_jax import model as model_lib
from megatrain_jax import sample
from megatrain_jax import train
from megatrain_jax.data import ByteTokenizer, decode_continuation, load_tokenizer
from megatrain_jax.errors import ConfigError

from helpers import config_with, small_config

PROMPT = np.array([5, 17, 99, 3, 42, 7])
_ARCHS = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=False)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    # A sliding window shorter than the prompt: the key/value cache is a ring of 4 slots.
    'mistral': (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(tie_word_embeddings=False, sliding_window=4)),
}


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """arch -> (Hugging Face directory, torch model): 2 layers, GQA, vocabulary 256."""
  out = {}
  for arch, (config_cls, model_cls, extra) in _ARCHS.items():
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, initializer_range=0.2,
                        attn_implementation='eager', **extra)
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    directory = tmp_path_factory.mktemp(arch)
    model.save_pretrained(directory)
    out[arch] = directory, model
  return out


@pytest.mark.parametrize('arch', list(_ARCHS))
def test_greedy_continuation_equals_transformers_generate(arch, checkpoints):
  directory, model = checkpoints[arch]
  cfg, params = hf.load_hf(directory)
  ours = sample.generate(cfg, params, PROMPT, max_new_tokens=24)
  with torch.no_grad():
    theirs = model.generate(torch.from_numpy(PROMPT[None]), max_new_tokens=24, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, PROMPT.size:].numpy()
  np.testing.assert_array_equal(ours, theirs)
  assert len(set(ours.tolist())) > 3  # not a degenerate repeat that any model would produce
  # top_k 1 at any temperature is greedy; EOS (here the 4th greedy token) ends the text with it.
  np.testing.assert_array_equal(
      sample.generate(cfg, params, PROMPT, max_new_tokens=24, temperature=1.5, top_k=1), ours)
  eos = int(ours[3])
  stopped = sample.generate(cfg, params, PROMPT, max_new_tokens=24, eos_id=eos)
  np.testing.assert_array_equal(stopped, ours[:list(ours).index(eos) + 1])
  # A repetition penalty, as transformers applies it to the prompt's ids and the new ones.
  penalised = sample.generate(cfg, params, PROMPT, max_new_tokens=24, repetition_penalty=1.5)
  with torch.no_grad():
    theirs = model.generate(torch.from_numpy(PROMPT[None]), max_new_tokens=24, do_sample=False,
                            repetition_penalty=1.5, eos_token_id=None,
                            pad_token_id=0)[0, PROMPT.size:].numpy()
  np.testing.assert_array_equal(penalised, theirs)
  assert not np.array_equal(penalised, ours)  # the penalty changed the text


def test_a_windowed_cache_holds_the_window_and_decodes_as_transformers(checkpoints):
  """Under a sliding window W the key/value cache is a ring of W slots: prompts shorter and
  longer than W, decoded together (rows of one program, each at its own slot), wrapping it
  several times, give transformers' greedy tokens; the memory check counts W slots, not L."""
  directory, model = checkpoints['mistral']
  cfg, params = hf.load_hf(directory)
  prompts = [PROMPT[:3], np.tile(PROMPT, 2)[:11]]
  ours = sample.generate_all(cfg, params, prompts, max_new_tokens=20)
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      theirs = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, prompt.size:].numpy()
    np.testing.assert_array_equal(got, theirs)
  assert cfg.sliding_window == 4 and model_lib.kv_cache_slots(cfg, 31) == 4
  whole = cfg.replace(sliding_window=0)
  per_slot = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, 2 rows
  assert sample.device_bytes(whole, 31, 2) - sample.device_bytes(cfg, 31, 2) == 27 * per_slot
  assert sample.device_bytes(cfg, 31, 2) == 4 * cfg.num_params + 4 * per_slot


def test_sampling_draws_from_the_top_k_softmax(checkpoints):
  """The first new token over 1500 seeds: its frequencies match softmax(logits / T) renormalised
  over transformers' top k logits (within 4 standard errors), and no token outside them."""
  directory, model = checkpoints['llama']
  cfg, params = hf.load_hf(directory)
  temperature, k, draws = 0.7, 5, 1500
  with torch.no_grad():
    logits = model(torch.from_numpy(PROMPT[None])).logits[0, -1].double().numpy()
  top = np.argsort(logits)[::-1][:k]
  want = np.exp((logits[top] - logits[top].max()) / temperature)
  want /= want.sum()
  got = np.array([sample.generate(cfg, params, PROMPT, max_new_tokens=1, temperature=temperature,
                                  top_k=k, seed=seed)[0] for seed in range(draws)])
  assert set(got.tolist()) <= set(top.tolist())
  freq = np.array([(got == t).mean() for t in top])
  np.testing.assert_array_less(np.abs(freq - want), 4 * np.sqrt(want * (1 - want) / draws) + 1e-9)
  # The same seed gives the same text; another seed another one.
  a, b, c = (sample.generate(cfg, params, PROMPT, max_new_tokens=16, temperature=1.0, seed=s)
             for s in (3, 3, 4))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize('top_k,top_p,vocab', [
    (0, 0.9, 256), (0, 0.3, 256), (20, 0.8, 256), (0, 0.999, 256), (7, 1.0, 256),
    (50, 0.9, 151_936), (0, 0.95, 151_936), (1000, 1.0, 128_256)])
def test_top_k_and_top_p_keep_what_transformers_warpers_keep(top_k, top_p, vocab):
  """sample.filter_logits equals transformers' TopKLogitsWarper then TopPLogitsWarper (the order
  `generate` applies them) on random logits: the same tokens kept, with their logits; at real
  vocabularies too (its thresholds are bisected, not sorted)."""
  rng = np.random.default_rng(top_k + int(100 * top_p))
  logits = rng.normal(0, 3, vocab).astype(np.float32)
  want = torch.from_numpy(logits[None])
  if top_k:
    want = transformers.TopKLogitsWarper(top_k)(None, want)
  if top_p < 1:
    want = transformers.TopPLogitsWarper(top_p)(None, want)
  got = np.asarray(sample.filter_logits(logits, top_k, top_p))
  np.testing.assert_array_equal(got, want[0].numpy())
  assert 1 < np.isfinite(got).sum() < vocab


def test_top_p_near_zero_is_greedy_and_stop_ids_end_at_the_first(checkpoints):
  """With top_p tiny only the most likely token is left: sampling at any temperature is greedy.
  Several stop ids: the text ends at whichever the model writes first."""
  cfg, params = hf.load_hf(checkpoints['qwen2'][0])
  greedy = sample.generate(cfg, params, PROMPT, max_new_tokens=20)
  np.testing.assert_array_equal(sample.generate(cfg, params, PROMPT, max_new_tokens=20,
                                                temperature=2.0, top_p=1e-6, seed=5), greedy)
  first, later = int(greedy[4]), int(greedy[9])
  assert first not in greedy[:4] and later not in greedy[:9]
  stopped = sample.generate(cfg, params, PROMPT, max_new_tokens=20, eos_id=(later, first))
  np.testing.assert_array_equal(stopped, greedy[:5])
  with pytest.raises(ConfigError, match=r'sample.top_p=0.0 must be in \(0, 1\]'):
    sample.generate(cfg, params, PROMPT, max_new_tokens=4, top_p=0.0)


def test_generate_refuses_prompts_without_room(checkpoints):
  cfg, params = hf.load_hf(checkpoints['llama'][0])
  with pytest.raises(ConfigError, match='sample.prompt: it encodes to no tokens'):
    sample.generate(cfg, params, [], max_new_tokens=4)
  with pytest.raises(ConfigError, match=r'= 70 tokens exceed model.max_seq_len=64'):
    sample.generate(cfg, params, PROMPT, max_new_tokens=64)


def test_sample_command_reads_a_run_or_a_hugging_face_checkpoint(checkpoints, tmp_path, capsys):
  """train.sample (`launch.py --sample`): the newest checkpoint of a run (here one trained step
  of the byte model), printed after the prompt and reproducible by seed; or init.from_hf in a
  workdir without one, greedily equal to generate() on load_hf's params."""
  workdir = tmp_path / 'run'
  config = small_config('', train__steps=1, checkpoint__every=1, train__eval_every=0,
                        train__batch_size=2, train__seq_len=32, sample__prompt='The ',
                        sample__max_new_tokens=20)
  train.train_and_evaluate(config, str(workdir))
  capsys.readouterr()
  first = train.sample(config, str(workdir))
  out = capsys.readouterr().out.splitlines()
  assert out[:2] == ['sampling: temperature 0.8, top_k 50, top_p 1', f"The {first['sample/text']}"]
  assert 0 < first['sample/tokens'] <= 20 and 'step 1' in first['sample/source']
  # The last line says what ended it: the token budget, or a stop id (then not in the text).
  assert out[2:] == ([f"[{first['sample/tokens'] - 1} new tokens; the model wrote '\\x00', a "
                      'stop id]'] if first['sample/tokens'] < 20 else
                     ['[20 new tokens; sample.max_new_tokens=20]'])
  assert train.sample(config, str(workdir)) == first
  config.sample.seed = 1
  assert train.sample(config, str(workdir))['sample/text'] != first['sample/text']

  directory, _ = checkpoints['llama']
  hf_config = config_with(init__from_hf=str(directory), train__seq_len=32, sample__prompt='ab',
                           sample__temperature=0.0, sample__max_new_tokens=10,
                           data__tokenizer='byte')
  got = train.sample(hf_config, str(tmp_path / 'empty'))
  cfg, params = hf.load_hf(directory)
  want = sample.generate(cfg, params, np.frombuffer(b'ab', np.uint8), max_new_tokens=10, eos_id=0)
  assert got['sample/tokens'] == want.size and got['sample/source'] == str(directory)
  assert not (tmp_path / 'empty').exists()  # a Hugging Face checkpoint needs no workdir


def _word_tokenizer(directory, generation_config, eos: str = 't0') -> str:
  """A word-level tokenizer of the checkpoints' 256 ids ('t0' .. 't255', EOS `eos`) with a
  generation_config.json; nothing downloaded."""
  vocab = {f't{i}': i for i in range(256)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='t1'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
  directory.mkdir()
  tok.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps({'eos_token': eos}))
  (directory / 'generation_config.json').write_text(json.dumps(generation_config))
  return str(directory)


def test_sample_command_stops_at_generation_config_eos_ids(checkpoints, tmp_path, capsys):
  """generation_config.json beside the tokenizer names more end ids (Llama 3 Instruct: three):
  `--sample` stops at the first the model writes and leaves it out of the text, as
  transformers' generate stops. A file that is not ids of the tokenizer is refused by name."""
  directory, _ = checkpoints['llama']
  cfg, params = hf.load_hf(directory)
  greedy = sample.generate(cfg, params, PROMPT, max_new_tokens=16)
  stop = next(int(t) for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i] and t)
  words = ' '.join(f't{i}' for i in PROMPT)
  config = config_with(init__from_hf=str(directory), train__seq_len=32, sample__prompt=words,
                       sample__temperature=0.0, sample__max_new_tokens=16,
                       data__tokenizer=_word_tokenizer(tmp_path / 'tok',
                                                       {'eos_token_id': [0, stop]}))
  got = train.sample(config, str(tmp_path / 'w'))
  end = list(greedy).index(stop)
  assert got['sample/tokens'] == end + 1
  assert got['sample/text'] == ''.join(f' t{i}' for i in greedy[:end])  # after the prompt's
  assert capsys.readouterr().out.splitlines() == [
      'sampling: greedy', words + got['sample/text'],
      f"[{end} new tokens; the model wrote 't{stop}', a "
      'stop id]']
  # An instruct tokenizer whose own EOS ends its chat turns, with data.eos_token ending the
  # documents instead (as the EOS-inside-documents refusal asks): both stop it.
  config.data.tokenizer = _word_tokenizer(tmp_path / 'own', {}, eos=f't{stop}')
  config.data.eos_token = 't0'
  assert train.sample(config, str(tmp_path / 'w'))['sample/tokens'] == end + 1
  config.data.tokenizer = _word_tokenizer(tmp_path / 'bad', {'eos_token_id': [0, 999]})
  with pytest.raises(ConfigError, match=r'generation_config.json has eos_token_id=\[0, 999\]'):
    train.sample(config, str(tmp_path / 'w'))


def test_sample_command_samples_as_generation_config_asks(checkpoints, tmp_path, capsys):
  """The sampling fields the command line leaves alone follow generation_config.json, as
  transformers' generate reads it (Qwen2.5 Instruct's values here); one set there wins, and a
  bad value the command line replaces is not read."""
  directory, _ = checkpoints['qwen2']
  cfg, params = hf.load_hf(directory)
  asks = {'do_sample': True, 'temperature': 0.7, 'top_k': 20, 'top_p': 0.8,
          'repetition_penalty': 1.05, 'eos_token_id': [0]}
  words = ' '.join(f't{i}' for i in PROMPT)
  config = config_with(init__from_hf=str(directory), train__seq_len=32, sample__prompt=words,
                       sample__max_new_tokens=12, sample__seed=4,
                       data__tokenizer=_word_tokenizer(tmp_path / 'tok', asks))
  got = train.sample(config, str(tmp_path / 'w'))
  want = sample.generate(cfg, params, PROMPT, max_new_tokens=12, temperature=0.7, top_k=20,
                         top_p=0.8, repetition_penalty=1.05, seed=4, eos_id=0)
  assert got['sample/tokens'] == want.size
  assert got['sample/text'] == ''.join(f' t{i}' for i in want[:want.size - (want[-1] == 0)])
  assert capsys.readouterr().out.startswith(
      'sampling: temperature 0.7, top_k 20, top_p 0.8, repetition_penalty 1.05 (temperature, '
      f'top_k, top_p, repetition_penalty as {tmp_path}/tok/generation_config.json asks, where the '
      'command line is silent)')
  # The command line's temperature (greedy) wins; the file's penalty still applies.
  config.sample.temperature = 0.0
  greedy = train.sample(config, str(tmp_path / 'w'), overrides=['sample.temperature'])
  want = sample.generate(cfg, params, PROMPT, max_new_tokens=12, repetition_penalty=1.05,
                         eos_id=0)
  assert greedy['sample/tokens'] == want.size and greedy['sample/text'].startswith(
      ''.join(f' t{i}' for i in want[:3]))
  assert capsys.readouterr().out.startswith(  # greedy came from the command line, not the file
      'sampling: greedy, repetition_penalty 1.05 (repetition_penalty as ')
  config.data.tokenizer = _word_tokenizer(tmp_path / 'bad', {**asks, 'top_p': 1.5})
  with pytest.raises(ConfigError, match=r'generation_config.json has top_p=1.5.*sample.top_p'):
    train.sample(config, str(tmp_path / 'w'))
  for field, value in (('repetition_penalty', float('nan')), ('top_k', float('inf'))):  # JSON's
    # NaN and Infinity: a NaN temperature sampled <s><s>... with no error, Infinity was an
    # OverflowError (the temperature is the command line's here)
    config.data.tokenizer = _word_tokenizer(tmp_path / field, {**asks, field: value})
    with pytest.raises(ConfigError, match=rf'generation_config.json has {field}=(nan|inf)'):
      train.sample(config, str(tmp_path / 'w'))
  config.data.tokenizer = str(tmp_path / 'bad')  # top_p=1.5, replaced below
  config.sample.top_p = 0.9  # set by the user: the file's value is not read
  train.sample(config, str(tmp_path / 'w'), overrides=['sample.top_p'])


def test_sample_command_continues_a_file_of_prompts(checkpoints, tmp_path, capsys):
  """sample.prompts: a text file's lines, or JSONL records (a prompt field, chat messages or an
  Alpaca record, rendered up to the assistant's turn), continued in one program and written to
  sample.out in order, sample.batch_size of them decoded together; each continuation equals
  generate() of that prompt alone with seed + its index (so a short prompt in the longest
  prompt's buffer still stops at its own max_new_tokens, and a batch's filler rows change
  nothing)."""
  directory, _ = checkpoints['llama']
  cfg, params = hf.load_hf(directory)
  lines = tmp_path / 'prompts.txt'
  lines.write_text('ab\n\nhello there, model\nx\n')
  records = tmp_path / 'prompts.jsonl'
  records.write_text(''.join(json.dumps(r) + '\n' for r in [
      {'prompt': 'ab'}, {'messages': [{'role': 'user', 'content': 'hi'}], 'id': 7},
      {'instruction': 'Say', 'input': 'hi', 'output': 'not read'}]))
  template = tmp_path / 'chat.jinja'
  template.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}"
                      "{% if add_generation_prompt %}>{% endif %}")
  for path, texts, temperature, batch in [
      (lines, [b'ab', b'hello there, model', b'x'], 0.0, 8),
      (lines, [b'ab', b'hello there, model', b'x'], 1.0, 2),  # the 2nd batch: 1 prompt, 1 filler
      (records, [b'ab', b'hi|>', b'Say\n\nhi|>'], 1.0, 8)]:
    out = tmp_path / f'{path.stem}-{temperature}-{batch}.jsonl'
    config = config_with(init__from_hf=str(directory), data__tokenizer='byte',
                         data__chat_template=str(template), train__seq_len=32,
                         sample__prompts=str(path), sample__out=str(out), sample__seed=3,
                         sample__temperature=temperature, sample__max_new_tokens=10,
                         sample__batch_size=batch)
    got = train.sample(config, str(tmp_path / 'w'))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert got['sample/prompts'] == len(rows) == len(texts)
    assert f'{len(rows)} prompts continued' in capsys.readouterr().out
    for i, (row, text) in enumerate(zip(rows, texts)):
      want = sample.generate(cfg, params, np.frombuffer(text, np.uint8), max_new_tokens=10,
                             temperature=temperature, top_k=config.sample.top_k, seed=3 + i,
                             eos_id=0)
      stopped = bool(want.size and want[-1] == 0)
      assert (row['tokens'], row['stopped']) == (want.size, stopped)
      assert row['completion'] == ByteTokenizer().decode(want[:want.size - stopped])
    assert sum(r['tokens'] for r in rows) == got['sample/tokens']
  assert rows[1]['prompt'] == [{'role': 'user', 'content': 'hi'}]
  # sample.chat with sample.system: a system turn, then the prompt as the user's.
  config = config_with(init__from_hf=str(directory), data__tokenizer='byte', train__seq_len=32,
                       data__chat_template=str(template), sample__prompt='hi', sample__chat=True,
                       sample__system='Be brief.', sample__temperature=0.0,
                       sample__max_new_tokens=6)
  want, without = (sample.generate(cfg, params, np.frombuffer(text, np.uint8), max_new_tokens=6,
                                   eos_id=0) for text in (b'Be brief.|hi|>', b'hi|>'))
  assert not np.array_equal(want, without)  # the system turn changes what follows
  capsys.readouterr()
  got = train.sample(config, str(tmp_path / 'w'))
  assert got['sample/text'] == ByteTokenizer().decode(want[:want.size - (want[-1] == 0)])
  assert capsys.readouterr().out.splitlines()[1:3] == ['hi', *got['sample/text'].splitlines()[:1]]


def test_sample_command_refuses_bad_settings(checkpoints, tmp_path):
  directory, _ = checkpoints['llama']
  base = dict(init__from_hf=str(directory), data__tokenizer='byte', train__seq_len=32)
  for overrides, message in [
      (dict(), 'sample.prompt is empty'),
      (dict(sample__prompt='x', sample__temperature=-1.0), 'sample.temperature=-1.0 must be >= 0'),
      (dict(sample__prompt='x', sample__top_p=1.5), r'sample.top_p=1.5 must be in \(0, 1\]'),
      (dict(sample__prompt='x', sample__repetition_penalty=0.0),
       'sample.repetition_penalty=0.0 must be > 0'),
      (dict(sample__prompt='x', sample__system='s'), 'sample.system is a chat turn'),
      (dict(sample__prompt='x', sample__batch_size=0), 'sample.batch_size=0 must be >= 1'),
      (dict(sample__prompts='p.txt'), 'sample.prompts needs sample.out'),
      (dict(sample__prompt='x', sample__prompts='p.txt'),
       'sample.prompt and sample.prompts: set one'),
      (dict(sample__prompts='p.txt', sample__out='/nonexistent/o.jsonl'),
       "sample.out='/nonexistent/o.jsonl': its directory does not exist"),
      (dict(sample__prompt='x', sample__chat=True), 'sample.chat: data.tokenizer has no chat '
       'template .*set data.chat_template to a template file'),
  ]:
    with pytest.raises(ConfigError, match=message):
      train.sample(config_with(**base, **overrides), str(tmp_path / 'w'))
  # Prompt files that say nothing usable, named by file and line before the weights are read.
  for name, content, message in [
      ('missing.txt', None, r"sample.prompts='.*missing.txt': not a file"),
      ('bad.jsonl', '{"prompt": "a"}\n{oops\n', 'bad.jsonl line 2 is not JSON'),
      ('no_field.jsonl', '{"text": "a"}\n', "line 1 has no string 'prompt'"),
      ('blank.txt', '\n  \n', 'holds no prompts'),
      ('chat.jsonl', '{"messages": [{"role": "user", "content": "a"}]}\n',
       r"a prompt of chat messages: .*no chat template"),
  ]:
    if content is not None:
      (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=message):
      train.sample(config_with(**base, sample__prompts=str(tmp_path / name),
                               sample__out=str(tmp_path / 'o.jsonl')), str(tmp_path / 'w'))
  assert not (tmp_path / 'o.jsonl').exists()
  small = dataclasses.replace(hardware.PRESETS['cpu'], name='small', device_memory_gb=1e-4)
  hardware.save_profile(small, tmp_path / 'small.json')
  with pytest.raises(ConfigError, match=r'holds the weights whole in device memory.*--export_hf'):
    train.sample(config_with(**base, sample__prompt='x', sample__max_new_tokens=8,
                             hardware=str(tmp_path / 'small.json')), str(tmp_path / 'w'))
  # A prompt too long for the model is refused before the weights are read, too.
  with pytest.raises(ConfigError, match=r'sample.prompt \(1 tokens\) \+ sample.max_new_tokens'):
    train.sample(config_with(**base, sample__prompt='x', hardware=str(tmp_path / 'small.json')),
                 str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


def test_a_json_file_of_prompts_is_an_array_or_lines(tmp_path):
  """sample.prompts may be a .json file as data.path may (Stanford Alpaca's alpaca_data.json: an
  array of records; or JSON lines): each record is a prompt, one without any is named by its
  place in the array."""
  from megatrain_jax.data import formats  # pylint: disable=import-outside-toplevel
  alpaca = {'instruction': 'Say hi', 'input': '', 'output': 'hi'}
  array = tmp_path / 'prompts.json'
  array.write_text(json.dumps([alpaca, {'prompt': 'Once'}, {'messages': [
      {'role': 'user', 'content': 'hi'}]}], indent=2))
  assert formats.read_prompts(array) == [alpaca, 'Once', [{'role': 'user', 'content': 'hi'}]]
  lines = tmp_path / 'lines.json'
  lines.write_text('{"prompt": "x"}\n\n{"prompt": "y"}\n')
  assert formats.read_prompts(lines) == ['x', 'y']
  (tmp_path / 'bad.json').write_text('[{"prompt": "x"}, {"text": "y"}]')
  with pytest.raises(ConfigError, match="bad.json record 2 has no string 'prompt'"):
    formats.read_prompts(tmp_path / 'bad.json')


def test_a_continuation_keeps_the_space_before_its_first_word(tmp_path):
  """--sample's text is the whole decoded, cut where the prompt's text ends (transformers'
  text-generation pipeline): a Metaspace tokenizer's decoder strips the first token's '▁' as a
  text's first, so the new ids decoded alone ran on from the prompt ('France isthe')."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
  tok.decoder = decoders.Metaspace(prepend_scheme='first')
  text = 'The capital of France is the city of Paris, and the capital of Italy is Rome. ' * 20
  tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=120, special_tokens=['<unk>'],
                                                      show_progress=False))
  tok.save(str(tmp_path / 'tokenizer.json'))
  ours = load_tokenizer(str(tmp_path))
  prompt = ours.encode('The capital of France is').tolist()
  whole = ours.encode('The capital of France is the city of Paris').tolist()
  assert whole[:len(prompt)] == prompt
  new = whole[len(prompt):]
  assert ours.decode(new) == 'the city of Paris'  # alone: the first word's space is gone
  assert decode_continuation(ours, prompt, np.array(new)) == ' the city of Paris'
  byte = ByteTokenizer()
  assert decode_continuation(byte, list(b'Hi'), np.array(list(b' there'))) == ' there'
