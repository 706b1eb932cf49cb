"""Tests for the record formats of the data pipeline (issue 12): JSONL(.zst/.gz) and Parquet
documents with EOS, prompt/completion and chat loss masks, mixtures, the resumable sharded
prepare, and bad input.

Everything is written under pytest's tmp_path; the tokenizers are trained here (no download).
"""

import dataclasses
import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
import zstandard
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatrain_jax.data import (Batch, BatchSampler, ByteTokenizer, MixtureSplit, TokenStream,
                                check_data_config, document_format, eval_batches, load_data,
                                load_split, load_tokenizer, prepare_dataset, prepare_summary,
                                read_dataset_info)
from megatrain_jax.data import documents as documents_module
from megatrain_jax.data import formats
from megatrain_jax.data import prepare as prepare_module
from megatrain_jax.errors import ConfigError

from helpers import QWEN3_TEMPLATE_HEAD

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / 'shared' / 'data'
WIKITEXT_VALID = SHARED_DATA / 'wikitext-2' / 'valid.txt'
EOS = '<|endoftext|>'
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def _data_config(**overrides) -> ml_collections.ConfigDict:
  fields = dict(path='', val_path='', val_fraction=0.05, tokenizer='byte', cache_dir='',
                text_field='text', prompt_field='prompt', completion_field='completion',
                eos_token='', mixture='', num_workers=1, shard_tokens=1 << 27,
                skip_bad_records=False)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


@pytest.fixture(scope='module')
def documents() -> list[str]:
  """~400 documents: wikitext-2 articles (split at their ' = Title = ' headings)."""
  text = WIKITEXT_VALID.read_text(encoding='utf-8')
  docs, current = [], []
  for line in text.splitlines(keepends=True):
    if line.startswith(' = ') and not line.startswith(' = = ') and current:
      docs.append(''.join(current))
      current = []
    current.append(line)
  docs.append(''.join(current))
  # Also split long articles by paragraph, for more (and shorter) documents.
  out = [p for d in docs for p in d.split('\n \n') if p.strip()]
  return out[:400]


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory, documents) -> Path:
  """A byte-level BPE with an EOS token, a tokenizer_config.json naming it, a chat template."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOS, '<s>', '<|im_start|>',
                                                                '<|im_end|>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(documents[:200], trainer=trainer)
  directory = tmp_path_factory.mktemp('tokenizer')
  tok.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': EOS, 'bos_token': '<s>', 'chat_template': CHAT_TEMPLATE}))
  return directory


def _write_jsonl(path: Path, records, compress: str = '') -> Path:
  data = b''.join(json.dumps(r).encode('utf-8') + b'\n' for r in records)
  if compress == 'zst':
    # Two frames, as pzstd and concatenated shards write them.
    half = len(data) // 2
    data = (zstandard.ZstdCompressor().compress(data[:half]) +
            zstandard.ZstdCompressor().compress(data[half:]))
  elif compress == 'gz':
    data = gzip.compress(data)
  path.write_bytes(data)
  return path


def _write_parquet(path: Path, columns: dict, row_group_size: int = 64) -> Path:
  pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
  return path


def _stream(info, split=None) -> np.ndarray:
  if split is None:
    return np.concatenate([_stream(info, 'train'), _stream(info, 'val')])
  return np.asarray(load_split(info, split)).astype(np.int64)


# --- formats and documents ----------------------------------------------------------------------


def test_jsonl_zst_and_parquet_token_counts(tmp_path, documents, tokenizer_dir):
  reference = tokenizers.Tokenizer.from_file(str(tokenizer_dir / 'tokenizer.json'))
  eos = reference.token_to_id(EOS)
  expected = np.concatenate([
      np.array(reference.encode(doc, add_special_tokens=False).ids + [eos]) for doc in documents])
  assert len(expected) == sum(
      len(reference.encode(d, add_special_tokens=False).ids) + 1 for d in documents)
  tok = load_tokenizer(str(tokenizer_dir))
  sources = {
      'zst': _write_jsonl(tmp_path / 'docs.jsonl.zst', [{'text': d, 'meta': {}} for d in documents],
                          'zst'),
      'gz': _write_jsonl(tmp_path / 'docs.jsonl.gz', [{'text': d} for d in documents], 'gz'),
      'parquet': _write_parquet(tmp_path / 'docs.parquet', {'text': documents, 'id': list(
          range(len(documents)))}),
  }
  for name, source in sources.items():
    # Small shards: the stream spans several, the validation tail crosses a shard boundary.
    info = prepare_dataset(tmp_path / name, tok, train_sources=[source], shard_tokens=7000)
    assert info.train_tokens + info.val_tokens == len(expected), name
    np.testing.assert_array_equal(_stream(info), expected)
    assert len(info.splits['train']) > 1 and info.stats['documents'] == len(documents)
    assert not info.has_mask and isinstance(load_split(info, 'train'), TokenStream)


def _save_to_disk(directory: Path, columns: dict, shards: int = 2, batch_rows: int = 50) -> Path:
  """A directory as `datasets.Dataset.save_to_disk` writes one: data-0000k-of-0000n.arrow files
  in Arrow's IPC stream format, record batches of `batch_rows` rows (datasets' writer_batch_size),
  the features in the schema's 'huggingface' metadata; state.json listing the files (in an order
  other than their names', which is the one to follow), dataset_info.json."""
  directory.mkdir(parents=True)
  table = pa.table(columns).replace_schema_metadata({'huggingface': json.dumps({'info': {}})})
  rows = -(-table.num_rows // shards)
  names = [f'data-{k:05d}-of-{shards:05d}.arrow' for k in range(shards)]
  for k, name in enumerate(names):
    with pa.OSFile(str(directory / name), 'wb') as sink, \
        pa.ipc.new_stream(sink, table.schema) as writer:
      for batch in table.slice(k * rows, rows).to_batches(max_chunksize=batch_rows):
        writer.write_batch(batch)
  order = names if shards < 2 else [names[1], names[0], *names[2:]]
  (directory / 'state.json').write_text(json.dumps(
      {'_data_files': [{'filename': n} for n in order], '_fingerprint': 'f', '_split': 'train'}))
  (directory / 'dataset_info.json').write_text(json.dumps({'features': {}}))
  return directory


def test_arrow_files_of_datasets_save_to_disk(tmp_path, documents, tokenizer_dir, monkeypatch):
  """A `save_to_disk` directory (its shards in state.json's order, several batches per task and
  several tasks per file), and one Arrow file in the IPC file format, give the tokens of the
  same records in that order as JSONL gives them; prompt/completion columns their mask."""
  monkeypatch.setattr(formats, 'CHUNK_BYTES', 20_000)
  tok = load_tokenizer(str(tokenizer_dir))
  half = len(documents) // 2
  saved = _save_to_disk(tmp_path / 'saved', {'text': documents, 'id': list(range(len(documents)))},
                        batch_rows=10)
  in_order = documents[half:] + documents[:half]  # state.json lists shard 1 first
  want = prepare_dataset(tmp_path / 'want', tok, shard_tokens=7000,
                         train_sources=[_write_jsonl(tmp_path / 'docs.jsonl',
                                                     [{'text': d} for d in in_order])])
  tasks = [t for f in formats.expand_sources([saved], 'data.path')
           for t, _ in formats.arrow_tasks(f, document_format(tok), 'data.path')]
  assert len(tasks) > 2 and max(t.batches for t in tasks) > 1
  info = prepare_dataset(tmp_path / 'got', tok, train_sources=[saved], shard_tokens=7000)
  np.testing.assert_array_equal(_stream(info), _stream(want))
  assert info.stats['documents'] == len(documents) and not info.has_mask

  single = tmp_path / 'docs.arrow'  # the IPC file (random access) format
  with pa.OSFile(str(single), 'wb') as sink, pa.ipc.new_file(sink, pa.table(
      {'text': in_order}).schema) as writer:
    writer.write_table(pa.table({'text': in_order}), max_chunksize=30)
  info = prepare_dataset(tmp_path / 'file', tok, train_sources=[single], shard_tokens=7000)
  np.testing.assert_array_equal(_stream(info), _stream(want))

  records = [{'prompt': f'Q{i}:', 'completion': f' a{i}.'} for i in range(300)]
  sft = _save_to_disk(tmp_path / 'sft', {k: [r[k] for r in records] for k in records[0]},
                      shards=1)
  got = prepare_dataset(tmp_path / 'sft_got', ByteTokenizer(), train_sources=[sft])
  want = prepare_dataset(tmp_path / 'sft_want', ByteTokenizer(),
                         train_sources=[_write_jsonl(tmp_path / 'sft.jsonl', records)])
  assert got.has_mask
  a = TokenStream(got.splits['train'] + got.splits['val'], got.dtype)
  b = TokenStream(want.splits['train'] + want.splits['val'], want.dtype)
  np.testing.assert_array_equal(a[:], b[:])
  np.testing.assert_array_equal(a.mask(slice(0, len(a))), b.mask(slice(0, len(b))))


def test_arrow_bad_input_is_named(tmp_path):
  """A DatasetDict's directory is refused naming its splits; a .arrow file that is not Arrow, and
  one without a text column, are refused naming the file, before anything is written."""
  root = tmp_path / 'dict'
  _save_to_disk(root / 'train', {'text': ['a', 'b']}, shards=1)
  _save_to_disk(root / 'test', {'text': ['c']}, shards=1)
  (root / 'dataset_dict.json').write_text(json.dumps({'splits': ['train', 'test']}))
  with pytest.raises(ConfigError, match=r'data.path: .*/dict is a Hugging Face DatasetDict '
                                        r'\(splits: train, test\); point data.path at one '
                                        r'split.s directory, e.g. .*/dict/train\.'):
    check_data_config(_data_config(path=str(root)))
  fake = tmp_path / 'fake.arrow'
  fake.write_bytes(b'not arrow at all')
  with pytest.raises(ConfigError, match=r'data.path: .*fake.arrow is not a readable Arrow IPC '
                                        'file'):
    check_data_config(_data_config(path=str(fake)))
  other = _save_to_disk(tmp_path / 'other', {'body': ['x', 'y']}, shards=1)
  with pytest.raises(ConfigError, match=r"has no column 'text'.*its columns: body"):
    check_data_config(_data_config(path=str(other)))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['dict', 'fake.arrow', 'other']


def test_parallel_prepare_equals_single_process(tmp_path, documents, tokenizer_dir, monkeypatch):
  monkeypatch.setattr(prepare_module, '_POOL_MIN_BYTES', 0)
  monkeypatch.setattr(formats, 'CHUNK_BYTES', 20_000)  # many tasks (read at call time)
  source = _write_jsonl(tmp_path / 'docs.jsonl', [{'text': d} for d in documents])
  tok = load_tokenizer(str(tokenizer_dir))
  one = prepare_dataset(tmp_path / 'one', tok, train_sources=[source], shard_tokens=9000)
  two = prepare_dataset(tmp_path / 'two', tok, train_sources=[source], shard_tokens=9000,
                        num_workers=2)
  names = sorted(p.name for p in (tmp_path / 'one').iterdir())
  assert names == sorted(p.name for p in (tmp_path / 'two').iterdir())
  for name in names:
    assert (tmp_path / 'one' / name).read_bytes() == (tmp_path / 'two' / name).read_bytes(), name
  assert one.train_tokens == two.train_tokens


def test_text_files_stay_a_raw_stream_and_globs(tmp_path):
  (tmp_path / 'a.txt').write_text('first\n')
  (tmp_path / 'b.txt').write_text('second\n')
  _write_jsonl(tmp_path / 'c.jsonl', [{'text': 'third'}])
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(),
                         train_sources=[tmp_path / '*.txt', tmp_path / 'c.jsonl'],
                         val_sources=[tmp_path / 'a.txt'])
  # .txt bytes as they are; each record + EOS (the byte tokenizer's EOS is NUL).
  assert bytes(_stream(info, 'train').astype(np.uint8)) == b'first\nsecond\nthird\0'
  # One pattern matching both is refused, as a directory holding both is
  # (test_data_inputs.py::test_a_pattern_matching_records_and_text_is_refused_as_a_directory_is).
  with pytest.raises(ConfigError, match='mixes record files'):
    prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[tmp_path / '*.*'])
  with pytest.raises(ConfigError, match='matches no files'):
    prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[tmp_path / '*.parquet'])


def test_text_documents_make_each_text_file_one_document(tmp_path, tokenizer_dir, monkeypatch):
  """data.text_documents: each text file is [BOS] text EOS, however many chunks it is read in
  (BOS before the first, EOS after the last), beside records as before; through load_data the
  setting is part of the prepared data's identity (switching it prepares again)."""
  monkeypatch.setattr(prepare_module, '_CHUNK_CHARS', 8)  # several chunks per file
  texts = {'a.txt': 'first line\nsecond line\n', 'b.txt': 'another file\n', 'c.txt': 'x\n'}
  for name, text in texts.items():
    (tmp_path / name).write_text(text)
  _write_jsonl(tmp_path / 'd.jsonl', [{'text': 'a record'}])
  held_out = tmp_path / 'val' / 'c.txt'  # a copy: a file of data.path is refused as val_path
  held_out.parent.mkdir()
  held_out.write_text(texts['c.txt'])
  config = _data_config(path=str(tmp_path), val_path=str(held_out),
                        text_documents=True, cache_dir=str(tmp_path / 'cache'))
  info, _ = load_data(config, tmp_path / 'run')
  want = b''.join(t.encode() + b'\0' for t in texts.values()) + b'a record\0'
  assert bytes(_stream(info, 'train').astype(np.uint8)) == want
  assert bytes(_stream(info, 'val').astype(np.uint8)) == b'x\n\0'
  assert info.stats['documents'] == 5 and not info.has_mask  # 4 files, then c.txt for val
  # Where each document ends is recorded, whatever chunks a file was read in.
  ends = np.cumsum([len(t.encode()) + 1 for t in texts.values()] + [len(b'a record\0')])
  np.testing.assert_array_equal(load_split(info, 'train').document_ends(), ends)
  # Without it, the text would run into the record as raw text: that directory is refused, and
  # so is a pattern matching both.
  for path in (str(tmp_path), f'{tmp_path}/*.*'):
    with pytest.raises(ConfigError, match=r'mixes record files \(d.jsonl\) with text files'):
      load_data(_data_config(path=path, val_path=str(held_out),
                             cache_dir=str(tmp_path / 'cache')), tmp_path / 'run')
  # The same text files without it: prepared again, one raw stream.
  plain, _ = load_data(_data_config(path=f'{tmp_path}/*.txt', val_path=str(held_out),
                                    cache_dir=str(tmp_path / 'cache')), tmp_path / 'run')
  assert bytes(_stream(plain, 'train').astype(np.uint8)) == (
      b'first line\nsecond line\nanother file\nx\n')
  documents_again, _ = load_data(_data_config(path=f'{tmp_path}/*.txt', val_path=str(held_out),
                                              text_documents=True,
                                              cache_dir=str(tmp_path / 'cache')), tmp_path / 'run')
  assert bytes(_stream(documents_again, 'train').astype(np.uint8)) == (
      b''.join(t.encode() + b'\0' for t in texts.values()))
  # A tokenizer with a BOS: before the file's first chunk only.
  tok = load_tokenizer(str(tokenizer_dir))
  fmt = document_format(tok, text_documents=True)
  fmt = type(fmt)(**{**fmt.__dict__, 'bos': tok.token_id('<s>')})
  info = prepare_dataset(tmp_path / 'bpe', tok, train_sources=[tmp_path / 'a.txt'],
                         val_sources=[tmp_path / 'c.txt'], doc_format=fmt)
  stream = _stream(info, 'train')
  assert stream[0] == fmt.bos and stream[-1] == fmt.eos
  assert (stream == fmt.bos).sum() == 1 and (stream == fmt.eos).sum() == 1
  assert tok.decode(stream[1:-1]) == texts['a.txt']


def test_bos_from_tokenizer_config_and_eos_override(tmp_path, tokenizer_dir):
  bos_dir = tmp_path / 'tok'
  bos_dir.mkdir()
  (bos_dir / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  (bos_dir / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': {'content': EOS}, 'bos_token': '<s>', 'add_bos_token': True}))
  tok = load_tokenizer(str(bos_dir))
  fmt = document_format(tok)
  assert (fmt.bos, fmt.eos) == (tok.token_id('<s>'), tok.token_id(EOS))
  assert document_format(tok, eos_token='<|im_end|>').eos == tok.token_id('<|im_end|>')
  with pytest.raises(ConfigError, match='data.eos_token'):
    document_format(tok, eos_token='not-a-token')
  (bos_dir / 'tokenizer_config.json').unlink()
  with pytest.raises(ConfigError, match='data.eos_token'):
    document_format(load_tokenizer(str(bos_dir)))
  source = _write_jsonl(tmp_path / 'd.jsonl', [{'text': 'ab'}, {'text': 'c'}])
  info = prepare_dataset(tmp_path / 'out', tok, train_sources=[source], doc_format=fmt)
  ids = list(_stream(info))
  assert ids[0] == fmt.bos and ids.count(fmt.bos) == 2 and ids.count(fmt.eos) == 2
  assert ids[-1] == fmt.eos and not info.has_mask  # plain text: every token learned


# --- loss masks -----------------------------------------------------------------------------------


def test_val_fraction_of_records_splits_between_documents(tmp_path):
  """data.val_fraction over records: the cut moves to the end of the document it falls in (the
  training split ends with an EOS, the validation split starts at a document), across shards;
  plain text keeps the cut at the fraction; a cut inside the last document stays put."""
  rng = np.random.default_rng(0)
  records = [{'text': 'w' * int(n)} for n in rng.integers(5, 40, 60)]
  source = _write_jsonl(tmp_path / 'd.jsonl', records)
  fmt = document_format(ByteTokenizer())
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source],
                         doc_format=fmt, val_fraction=0.1, shard_tokens=64)
  train, val = load_split(info, 'train'), load_split(info, 'val')
  total = len(train) + len(val)
  nominal = total - int(total * 0.1)
  assert train[len(train) - 1:][0] == fmt.eos and val[:1][0] != fmt.eos
  assert nominal <= len(train) < nominal + 40  # at most the rest of one document moved
  assert fmt.eos not in train[nominal - 1:len(train) - 1]  # the first document end after the cut
  text = tmp_path / 'plain.txt'
  text.write_text(''.join(r['text'] + '\n' for r in records))
  plain = prepare_dataset(tmp_path / 'plain', ByteTokenizer(), train_sources=[text],
                          val_fraction=0.1)
  assert plain.val_tokens == int((plain.train_tokens + plain.val_tokens) * 0.1)
  one_long = _write_jsonl(tmp_path / 'long.jsonl', [{'text': 'a'}, {'text': 'b' * 50}])
  info = prepare_dataset(tmp_path / 'long', ByteTokenizer(), train_sources=[one_long],
                         doc_format=fmt, val_fraction=0.1)
  assert info.val_tokens == int((info.train_tokens + info.val_tokens) * 0.1)


def test_prompt_completion_mask_matches_hand_computed(tmp_path):
  records = [{'prompt': 'Q:2+2?', 'completion': ' 4'}, {'text': 'xy'},
             {'prompt': 'Hi', 'completion': '!'}]
  source = _write_jsonl(tmp_path / 'sft.jsonl', records * 40)
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source],
                         shard_tokens=100)
  assert info.has_mask
  # By hand, bytes: prompt (not learned), completion (learned), EOS=0 (learned); text all learned.
  one = (list(b'Q:2+2?') + list(b' 4') + [0] + list(b'xy') + [0] + list(b'Hi') + list(b'!') +
         [0])
  one_mask = [0] * 6 + [1] * 2 + [1] + [1, 1, 1] + [0, 0] + [1] + [1]
  stream = load_split(info, 'train')
  n = len(stream)
  whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
  np.testing.assert_array_equal(whole[:], np.array(one * 40))
  np.testing.assert_array_equal(whole.mask(slice(0, len(whole))), np.array(one_mask * 40))

  sampler = BatchSampler(stream, seq_len=8, batch_size=3, microbatches=2, seed=1)
  batch = sampler.batch(5)
  assert isinstance(batch, Batch) and batch.tokens.shape == (2, 3, 9)
  assert batch.loss_mask.shape == (2, 3, 8) and batch.loss_mask.dtype == np.uint8
  starts = sampler.window_starts(5)
  full_mask = np.array(one_mask * 40)
  for m in range(2):
    for b in range(3):
      s = starts[m, b]
      assert s + 9 <= n
      np.testing.assert_array_equal(batch.tokens[m, b], np.array(one * 40)[s:s + 9])
      # The mask is aligned to the targets tokens[..., 1:].
      np.testing.assert_array_equal(batch.loss_mask[m, b], full_mask[s + 1:s + 9])
  evals = eval_batches(load_split(info, 'val'), seq_len=4, batch_size=2, num_batches=2)
  assert all(isinstance(e, Batch) and e.loss_mask.shape == (2, 4) for e in evals)
  val_start = info.train_tokens
  np.testing.assert_array_equal(evals[0].loss_mask[0], full_mask[val_start + 1:val_start + 5])


def test_prompt_completion_with_bos_and_bpe(tmp_path, tokenizer_dir):
  tok = load_tokenizer(str(tokenizer_dir))
  fmt = document_format(tok)
  fmt = type(fmt)(**{**fmt.__dict__, 'bos': tok.token_id('<s>')})
  source = _write_jsonl(tmp_path / 'sft.jsonl', [{'prompt': 'The cat', 'completion': ' sat.'}])
  info = prepare_dataset(tmp_path / 'out', tok, train_sources=[source], doc_format=fmt,
                         val_fraction=0.5)
  whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
  prompt, completion = tok.encode('The cat'), tok.encode(' sat.')
  np.testing.assert_array_equal(
      whole[:], [fmt.bos, *prompt, *completion, fmt.eos])
  np.testing.assert_array_equal(whole.mask(slice(0, len(whole))),
                                [0] + [0] * len(prompt) + [1] * len(completion) + [1])


CONVERSATION = [{'role': 'system', 'content': 'Be brief.'},
                {'role': 'user', 'content': 'Capital of France?'},
                {'role': 'assistant', 'content': 'Paris.'},
                {'role': 'user', 'content': 'And Italy?'},
                {'role': 'assistant', 'content': 'Rome.'}]


def _tokenizer_with(directory: Path, tokenizer_dir: Path, config: dict):
  """tokenizer_dir's tokenizer.json with another tokenizer_config.json, in `directory`."""
  directory.mkdir()
  (directory / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  (directory / 'tokenizer_config.json').write_text(json.dumps(config))
  return load_tokenizer(str(directory))


def _prepared_chat(tmp_path: Path, tok, record=None, name='chat') -> tuple[np.ndarray,
                                                                           np.ndarray]:
  """(tokens, loss mask) of one record (CONVERSATION's messages by default) prepared with
  `tok`."""
  record = {'messages': CONVERSATION} if record is None else record
  source = _write_jsonl(tmp_path / f'{name}.jsonl', [record])
  info = prepare_dataset(tmp_path / f'{name}-out', tok, train_sources=[source],
                         val_fraction=0.5)
  whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
  return whole[:], whole.mask(slice(0, len(whole)))


def test_chat_template_learns_only_assistant_turns(tmp_path, tokenizer_dir):
  tok = load_tokenizer(str(tokenizer_dir))
  tokens, mask = _prepared_chat(tmp_path, tok)
  learned = tok.decode(tokens[mask == 1])
  # Each assistant turn as the template renders it after the generation prompt, then EOS.
  assert learned == 'Paris.<|im_end|>\nRome.<|im_end|>\n' + EOS
  assert tok.decode(tokens).startswith('<|im_start|>system\nBe brief.')
  # Without a chat template, messages records are bad records.
  plain = _tokenizer_with(tmp_path / 'plain', tokenizer_dir, {'eos_token': EOS})
  with pytest.raises(ConfigError, match='chat_template'):
    prepare_dataset(tmp_path / 'out2', plain, train_sources=[tmp_path / 'chat.jsonl'])


def _write_template(path: Path) -> Path:
  """A plain chat template ('role: content' lines) in file `path`."""
  path.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")
  return path


def test_an_eos_that_ends_every_chat_turn_keeps_each_conversation_whole(tmp_path,
                                                                        tokenizer_dir):
  """A tokenizer whose EOS is the template's turn end (Qwen2.5 Instruct's '<|im_end|>', Mistral
  Instruct's '</s>'): the prepared data records where each record ends (shard by shard, the
  validation split cut at one), so the document mask and rows of whole documents keep each
  conversation whole where finding documents by that id would cut it at its turns: batches mark
  each conversation's start (Batch.starts) and learn no target there, in windows of the stream
  and in packed rows. Data prepared without the ends (an older version) is refused as before,
  naming the fix; a run trains with the tokenizer's own EOS."""
  from megatrain_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import data as data_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import train  # pylint: disable=import-outside-toplevel
  from megatrain_jax.data import packing  # pylint: disable=import-outside-toplevel
  instruct = tmp_path / 'instruct'
  tok = _tokenizer_with(instruct, tokenizer_dir, {'eos_token': '<|im_end|>',
                                                  'chat_template': CHAT_TEMPLATE})
  eos = tok.token_id('<|im_end|>')
  source = _write_jsonl(tmp_path / 'chat.jsonl', [{'messages': CONVERSATION}] * 40)
  info = prepare_dataset(tmp_path / 'prepared', tok, train_sources=[source], val_fraction=0.1,
                         shard_tokens=97)  # documents run on across shards
  length = info.train_tokens // 36  # 40 equal conversations, the last 4 held out
  assert info.document_ends and info.train_tokens == 36 * length
  whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype, True)
  np.testing.assert_array_equal(whole.document_ends(), length * np.arange(1, 41))
  assert np.count_nonzero(whole[:] == eos) == 200  # five: every turn's end, the last the EOS
  train_split = data_lib.load_split(info, 'train')
  for row_packing in (None, packing.RowPacking('best_fit', eos)):
    sampler = BatchSampler(train_split, seq_len=64, batch_size=3, microbatches=2, seed=0,
                           document_eos=eos, row_packing=row_packing)
    batch = sampler.batch(0)
    starts, mask = batch.starts.reshape(6, 65), batch.loss_mask.reshape(6, 64)
    for row, first in enumerate(sampler.window_starts(0).reshape(-1).tolist()):
      if row_packing is None:  # a window of the stream: where its offsets pass a conversation
        want = [j for j in range(1, 65) if (first + j) % length == 0]
      else:  # whole conversations, then the padding
        fits = 65 // length
        want = [k * length for k in range(1, fits + 1) if k * length < 65]
      assert np.flatnonzero(starts[row]).tolist() == want, (row, first)
      assert all(mask[row, j - 1] == 0 for j in want)
    # Found by the id, the same rows would start a document after every turn.
    assert np.count_nonzero(data_lib.loader.eos_starts(batch.tokens, eos)) > np.count_nonzero(
        batch.starts)
  # The tokenizer's own EOS trains, with both ways of finding documents.
  config = config_lib.load_config(
      'tiny', data__path=str(source), data__tokenizer=str(instruct), model__vocab_size=600,
      model__document_mask=True, data__pack='best_fit', train__steps=1, train__seq_len=64,
      train__batch_size=2, train__eval_every=0, train__progress_bar=False, jax_cache_dir='')
  assert train.train_and_evaluate(config, str(tmp_path / 'run'))['learning/loss'] > 0
  # Prepared by an older version (no ends recorded): found by the id, so refused, naming the fix.
  meta = json.loads((tmp_path / 'prepared' / 'meta.json').read_text())
  (tmp_path / 'prepared' / 'meta.json').write_text(json.dumps(meta | {'document_ends': False}))
  old = read_dataset_info(tmp_path / 'prepared')
  with pytest.raises(ConfigError, match=r'\(200 of it in 40 documents: .*prepared without '
                     r'recording where its documents end .* model.document_mask finds its '
                     r'documents by that id.*Prepare it again'):
    data_lib.check_document_ends(old, eos, '<|im_end|>', 'model.document_mask')
  data_lib.check_document_ends(old, tok.token_id(EOS), EOS, 'model.document_mask')  # fine
  data_lib.check_document_ends(info, eos, '<|im_end|>', 'model.document_mask')  # ends recorded


def test_a_chat_whose_turn_end_is_the_eos_ends_at_it_once(tmp_path, tokenizer_dir, caplog):
  """Qwen2.5 Instruct's tokenizer: its EOS '<|im_end|>' is the turn end its template writes
  with a newline after every turn. A conversation is transformers' apply_chat_template without
  the newline after its last '<|im_end|>' (generation stops at that EOS), which is learned once,
  not '<|im_end|>\\n<|im_end|>' (the template's turn end, then the document's EOS); data
  prepared with that doubled EOS (documents.LEARNED_RULES_VERSION 1) is prepared again, while
  data learned whole (plain text) is kept as it was prepared."""
  import transformers  # pylint: disable=import-outside-toplevel
  instruct = tmp_path / 'instruct'
  tok = _tokenizer_with(instruct, tokenizer_dir, {'eos_token': '<|im_end|>',
                                                  'chat_template': CHAT_TEMPLATE})
  reference = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(instruct / 'tokenizer.json'), eos_token='<|im_end|>')
  reference.chat_template = CHAT_TEMPLATE
  want = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)['input_ids']
  assert reference.decode(want[-2:]) == '<|im_end|>\n'
  tokens, mask = _prepared_chat(tmp_path, tok)
  assert tokens.tolist() == want[:-1]
  assert tok.decode(tokens[mask == 1]) == 'Paris.<|im_end|>\nRome.<|im_end|>'
  # Prepared by the rules before: the conversation is prepared again; a text corpus is not.
  source = _write_jsonl(tmp_path / 'again.jsonl', [{'messages': CONVERSATION}] * 4)
  text = _write_jsonl(tmp_path / 'text.jsonl', [{'text': 'plain words'}] * 4)
  for path, name in ((source, 'chat'), (text, 'text')):
    out = tmp_path / f'{name}-before'
    with pytest.MonkeyPatch.context() as patch:  # the identity before the rules' version
      identity = documents_module.DocumentFormat.identity
      patch.setattr(documents_module.DocumentFormat, 'identity', lambda fmt: {
          k: v for k, v in identity(fmt).items() if k != documents_module.LEARNED_RULES_FIELD})
      prepare_dataset(out, tok, train_sources=[path], val_fraction=0.5)
    before = json.loads((out / 'meta.json').read_text())['fingerprint']
    caplog.clear()
    prepare_dataset(out, tok, train_sources=[path], val_fraction=0.5)
    after = json.loads((out / 'meta.json').read_text())['fingerprint']
    assert (after != before) == (name == 'chat'), name
    said = [r.getMessage() for r in caplog.records if 'again' in r.getMessage()]
    assert said == ([f'prepare: preparing {out} again: this version reads records otherwise '
                     '(learned_rules None -> 2)'] if name == 'chat' else []), said


def test_a_damaged_document_ends_file_is_refused(tmp_path, documents):
  """A shard's `.ends` cut short, or holding ends out of order, is refused naming the file and
  the fix when the documents are read, rather than misplacing them."""
  source = _write_jsonl(tmp_path / 'docs.jsonl', [{'text': d} for d in documents[:50]])
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source])
  assert len(load_split(info, 'train').document_ends()) >= 40
  ends_file = tmp_path / 'out' / 'train-00000.ends'
  good = ends_file.read_bytes()
  for damaged in (good[:-3], good[8:16] + good[:8] + good[16:]):
    ends_file.write_bytes(damaged)
    with pytest.raises(ConfigError, match=r'train-00000.ends is damaged: .* Delete .*out to '
                       'prepare the data again'):
      load_split(info, 'train').document_ends()


def test_eval_keeps_each_conversation_whole_and_reads_the_runs_eos(tmp_path, tokenizer_dir):
  """--eval of a run trained with model.document_mask keeps each record whole as training did,
  whatever ids it holds: told the tokenizer's own EOS ('<|im_end|>', every turn's end), its
  documents are the 40 conversations. A run trained with data.eos_token='<|endoftext|>' is
  evaluated with that EOS without being told again (it comes with the run's tokenizer)."""
  from megatrain_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import evaluate as evaluate_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import train  # pylint: disable=import-outside-toplevel
  instruct = tmp_path / 'instruct'
  tok = _tokenizer_with(instruct, tokenizer_dir, {'eos_token': '<|im_end|>',
                                                  'chat_template': CHAT_TEMPLATE})
  source = _write_jsonl(tmp_path / 'chat.jsonl', [{'messages': CONVERSATION}] * 40)
  data = evaluate_lib.read_eval_data(str(source), tok,
                                     document_eos=tok.token_id('<|im_end|>'))
  length = data.tokens.size // 40
  assert np.flatnonzero(data.starts).tolist() == [k * length for k in range(1, 40)]
  assert not data.mask[data.starts == 1].any()  # a conversation's first token is not scored
  # A text file's documents end at the EOS ids it holds, as training finds them in a text stream.
  (tmp_path / 'plain.txt').write_text(f'Capital of France?{EOS}Rome.{EOS}Paris.')
  plain = evaluate_lib.read_eval_data(str(tmp_path / 'plain.txt'), tok,
                                      document_eos=tok.token_id(EOS))
  after = np.flatnonzero(plain.tokens == tok.token_id(EOS)) + 1
  assert after.size == 2 and np.flatnonzero(plain.starts).tolist() == after.tolist()
  config = config_lib.load_config(
      'tiny', data__path=str(source), data__tokenizer=str(instruct), data__eos_token=EOS,
      model__vocab_size=600, model__document_mask=True, train__steps=1, train__seq_len=64,
      train__batch_size=2, train__eval_every=0, train__progress_bar=False, jax_cache_dir='')
  train.train_and_evaluate(config, str(tmp_path / 'run'))

  def evaluate(**fields):
    return train.evaluate(config_lib.load_config(
        'tiny', eval__path=str(source), eval__max_len=64, train__progress_bar=False,
        jax_cache_dir='', **fields), str(tmp_path / 'run'))

  told = evaluate(data__eos_token=EOS)
  assert evaluate()['eval/loss'] == told['eval/loss'] and told['eval/document_mask']
  own = evaluate(data__eos_token='<|im_end|>')  # other tokens (no <|endoftext|>), still whole
  assert own['eval/loss'] != told['eval/loss'] and np.isfinite(own['eval/loss'])


def test_sharegpt_and_conversational_prompt_completion(tmp_path, tokenizer_dir):
  """ShareGPT records ({"conversations": [{"from": "human", "value": ...}]}) are the same chat
  as their `messages`; TRL's conversational prompt-completion (both lists of messages) renders
  prompt + completion and learns only the completion's assistant turns; bad turns are named."""
  tok = load_tokenizer(str(tokenizer_dir))
  tokens, mask = _prepared_chat(tmp_path, tok)
  speaker = {'system': 'system', 'user': 'human', 'assistant': 'gpt'}
  sharegpt = {'conversations': [{'from': speaker[m['role']], 'value': m['content']}
                                for m in CONVERSATION]}
  conversational = {'prompt': CONVERSATION[:3], 'completion': CONVERSATION[3:]}
  parquet = tmp_path / 'sharegpt.parquet'
  pq.write_table(pa.table({'conversations': [sharegpt['conversations']]}), parquet)
  for name, record in (('sharegpt', sharegpt), ('conversational', conversational),
                       ('parquet', None)):
    source = parquet if record is None else _write_jsonl(tmp_path / f'{name}.jsonl', [record])
    info = prepare_dataset(tmp_path / name, tok, train_sources=[source], val_fraction=0.5)
    whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
    np.testing.assert_array_equal(whole[:], tokens)
    learned = whole.mask(slice(0, len(whole)))
    if name != 'conversational':
      np.testing.assert_array_equal(learned, mask)
    else:  # the prompt's assistant turn ('Paris.') is context
      assert tok.decode(whole[:][learned == 1]) == 'Rome.<|im_end|>\n' + EOS
  glaive = [{'from': 'human', 'value': 'Weather?'},
            {'from': 'function_call', 'value': '{"name": "weather"}'},
            {'from': 'observation', 'value': 'sunny'}, {'from': 'gpt', 'value': 'Sunny.'}]
  parts = documents_module.record_parts(
      {'conversations': glaive}, document_format(ByteTokenizer(), chat_template=str(
          _write_template(tmp_path / 'roles.jinja'))))
  assert [text for text, learned in parts if learned] == ['{"name": "weather"}\n', 'Sunny.\n']
  assert parts[0][0].startswith('user: Weather?\nassistant: ') and 'tool: sunny' in parts[2][0]
  bad = [{'conversations': [{'from': 'bot', 'value': 'hi'}]},
         {'conversations': [{'from': 'human'}]}, {'prompt': [], 'completion': 'x'}]
  messages = ['turn 0: "from": \'bot\' is not one of system, human', '"from": str, "value": str',
              "field 'prompt' is list, not a string"]
  for i, (record, message) in enumerate(zip(bad, messages)):
    source = _write_jsonl(tmp_path / f'bad{i}.jsonl', [record])
    with pytest.raises(ConfigError, match=re.escape(message)):
      prepare_dataset(tmp_path / f'bad{i}', tok, train_sources=[source])


def test_alpaca_records_are_chat_with_a_template_and_stanford_prompts_without(tmp_path,
                                                                            tokenizer_dir):
  """Alpaca records (instruction, input, output; Dolly's instruction, context, response): with a
  chat template the same tokens and mask as the conversation of a user turn (instruction, then
  the input after a blank line) and the output as the reply; without one, Stanford Alpaca's
  prompt (not learned) and the output (learned), as the prompt/completion record of that text.
  A record with a text field stays text."""
  tok = load_tokenizer(str(tokenizer_dir))
  chat = [{'role': 'system', 'content': 'Be brief.'},
          {'role': 'user', 'content': 'Capital of this country?\n\nFrance'},
          {'role': 'assistant', 'content': 'Paris.'}]
  want = _prepared_chat(tmp_path, tok, {'messages': chat}, 'want')
  alpaca = {'instruction': 'Capital of this country?', 'input': 'France', 'output': 'Paris.',
            'system': 'Be brief.'}
  dolly = {'instruction': 'Capital of this country?', 'context': 'France',
           'response': 'Paris.', 'category': 'open_qa', 'system': 'Be brief.'}
  for name, record in (('alpaca', alpaca), ('dolly', dolly)):
    got = _prepared_chat(tmp_path, tok, record, name)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
  byte = document_format(ByteTokenizer())
  no_input = {'instruction': 'Add 2 and 3.', 'input': '', 'output': '5'}
  assert documents_module.record_parts(no_input, byte) == [
      ('Below is an instruction that describes a task. Write a response that appropriately '
       'completes the request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:', False),
      ('5', True)]
  with_input = documents_module.record_parts({**alpaca, 'system': ''}, byte)
  assert with_input == [(documents_module.ALPACA_PROMPT.format(
      instruction='Capital of this country?', input='France'), False), ('Paris.', True)]
  assert '### Input:\nFrance\n\n### Response:' in with_input[0][0]
  plain = _tokenizer_with(tmp_path / 'plain', tokenizer_dir, {'eos_token': EOS})
  got = _prepared_chat(tmp_path, plain, no_input, 'plain')
  want = _prepared_chat(tmp_path, plain, {'prompt': documents_module.record_parts(
      no_input, byte)[0][0], 'completion': '5'}, 'plain-want')
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  assert documents_module.record_parts({**no_input, 'text': 'as is'}, byte) == [('as is', True)]
  with pytest.raises(documents_module.BadRecord, match="field 'input' is int, not a string"):
    documents_module.record_parts({**no_input, 'input': 3}, byte)


# A chat template with tools, in the manner of Qwen2.5's (shortened): the tools' schemas in the
# system turn, an assistant turn's tool calls as <tool_call> JSON, tool results as their turns.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{{- '\n' }}{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_tool_calls_and_tools_are_rendered_and_the_calls_learned(tmp_path, tokenizer_dir):
  """A conversation with `tools` and an assistant turn of `tool_calls` (content None), as
  transformers' apply_chat_template takes them: the schemas are rendered, the tool call and
  the final answer learned, the tool's result not; `tools` as a JSON string (Parquet) too."""
  tok = _tokenizer_with(tmp_path / 'tools_tokenizer', tokenizer_dir,
                        {'eos_token': EOS, 'chat_template': TOOLS_TEMPLATE})
  tools = [{'type': 'function', 'function': {'name': 'weather', 'parameters': {
      'type': 'object', 'properties': {'city': {'type': 'string'}}}}}]
  call = {'type': 'function', 'function': {'name': 'weather', 'arguments': {'city': 'Paris'}}}
  messages = [{'role': 'user', 'content': 'Weather in Paris?'},
              {'role': 'assistant', 'content': None, 'tool_calls': [call]},
              {'role': 'tool', 'content': 'sunny'},
              {'role': 'assistant', 'content': 'It is sunny.'}]
  for name, record_tools in (('list', tools), ('string', json.dumps(tools))):
    source = _write_jsonl(tmp_path / f'{name}.jsonl',
                          [{'messages': messages, 'tools': record_tools}])
    info = prepare_dataset(tmp_path / name, tok, train_sources=[source], val_fraction=0.5)
    whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
    tokens, mask = whole[:], whole.mask(slice(0, len(whole)))
    assert tok.decode(tokens[mask == 1]) == (
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
        'It is sunny.<|im_end|>\n' + EOS)
    context = tok.decode(tokens[mask == 0])
    assert '"name": "weather", "parameters"' in context and 'sunny<|im_end|>' in context
  bad = _write_jsonl(tmp_path / 'bad.jsonl', [{'messages': messages, 'tools': 'not json'}])
  with pytest.raises(ConfigError, match="'tools' is a string but not JSON"):
    prepare_dataset(tmp_path / 'bad', tok, train_sources=[bad])


def test_chat_template_file_beside_the_tokenizer_and_data_chat_template(tmp_path,
                                                                       tokenizer_dir):
  """The template in chat_template.jinja beside tokenizer.json (as transformers now saves it)
  is preferred to tokenizer_config.json's; data.chat_template replaces both, also for the byte
  tokenizer; a missing, empty or broken template file is refused before anything is written."""
  plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
  plain += "{% if add_generation_prompt %}assistant: {% endif %}"
  jinja_dir = _tokenizer_with(tmp_path / 'jinja', tokenizer_dir,
                              {'eos_token': EOS, 'chat_template': CHAT_TEMPLATE})
  (jinja_dir.path.parent / 'chat_template.jinja').write_text(plain)
  (tmp_path / 'a').mkdir()
  tokens, mask = _prepared_chat(tmp_path / 'a', jinja_dir)
  # 'assistant: Paris.': tokenized whole, ' Paris' is one token, learned (it holds the reply).
  assert jinja_dir.decode(tokens[mask == 1]) == ' Paris.\n Rome.\n' + EOS
  template = tmp_path / 'brackets.jinja'
  template.write_text(plain.replace(': ', ' > '))
  fmt = document_format(load_tokenizer(str(tokenizer_dir)), chat_template=str(template))
  assert fmt.chat_template == template.read_text()
  byte_fmt = document_format(ByteTokenizer(), chat_template=str(template))
  parts = documents_module.record_parts({'messages': CONVERSATION}, byte_fmt)
  assert ''.join(text for text, learned in parts if learned) == 'Paris.\nRome.\n'
  assert parts[0] == ('system > Be brief.\nuser > Capital of France?\nassistant > ', False)
  (tmp_path / 'empty.jinja').write_text(' ')
  (tmp_path / 'broken.jinja').write_text('{% for m in messages %}')
  for name, message in (('missing.jinja', 'cannot read'), ('empty.jinja', 'is empty'),
                        ('broken.jinja', 'not a valid jinja2 template')):
    with pytest.raises(ConfigError, match=f'data.chat_template: .*{message}'):
      check_data_config(_data_config(chat_template=str(tmp_path / name)))
  # A broken template beside the tokenizer is the tokenizer's; data.chat_template replaces it.
  (jinja_dir.path.parent / 'chat_template.jinja').write_text('{% if %}')
  with pytest.raises(ConfigError, match='data.tokenizer: .*not a valid jinja2 template'):
    document_format(jinja_dir)
  assert document_format(jinja_dir, chat_template=str(template)).chat_template == (
      template.read_text())


# A template with what transformers' environment adds to jinja2's: {% generation %} blocks (TRL's
# assistant-only templates), {% break %}, a namespace, tojson with its options.
TRANSFORMERS_ENV_TEMPLATE = (
    "{%- set ns = namespace(turns=0) %}"
    "{%- for message in messages %}{%- set ns.turns = ns.turns + 1 %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- generation %}{{- message.content + '<|im_end|>\n' }}{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- if ns.turns > 10 %}{%- break %}{%- endif %}{%- endfor %}"
    "{%- if tools %}{{- tools | tojson(sort_keys=True, separators=(',', ':')) }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def test_chat_templates_render_as_transformers_renders_them(tmp_path, tokenizer_dir):
  """The template environment is transformers' (generation blocks, loop controls, namespaces,
  tojson's options): a conversation renders exactly as apply_chat_template renders it, and the
  learned text is the assistant turns."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  tok = _tokenizer_with(tmp_path / 'env', tokenizer_dir,
                        {'eos_token': EOS, 'chat_template': TRANSFORMERS_ENV_TEMPLATE})
  fmt = document_format(tok)
  tools = [{'name': 'f', 'parameters': {'b': 1, 'a': 2}}]
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(tmp_path / 'env' / 'tokenizer.json'),
      chat_template=TRANSFORMERS_ENV_TEMPLATE)
  for generation_prompt in (False, True):
    assert documents_module._render(  # pylint: disable=protected-access
        CONVERSATION, fmt, generation_prompt, tools) == theirs.apply_chat_template(
            CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
  tokens, mask = _prepared_chat(tmp_path, tok)
  assert tok.decode(tokens[mask == 1]) == 'Paris.<|im_end|>\nRome.<|im_end|>\n' + EOS


# Mistral's (and Llama 2's) chat template: the rendering writes the BOS first and ends each reply
# with the EOS, which are also the tokens the prepare step puts around every document.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} "
    "[/INST]{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_template_that_writes_bos_and_eos_gives_each_once(tmp_path, tokenizer_dir):
  """A template that writes {{ bos_token }} and ends the last reply with {{ eos_token }}
  (Mistral, Llama 2; Llama 3 writes its BOS): the document holds each once, as transformers'
  apply_chat_template tokenizes the conversation (twice each before), the reply and its EOS
  learned; --sample's chat prompt starts with one BOS."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  config = {'eos_token': EOS, 'bos_token': '<s>', 'add_bos_token': True,
            'chat_template': MISTRAL_TEMPLATE}
  tok = _tokenizer_with(tmp_path / 'mistral', tokenizer_dir, config)
  conversation = CONVERSATION[1:]  # the template has no system turn
  tokens, mask = _prepared_chat(tmp_path, tok, {'messages': conversation})
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(tmp_path / 'mistral' / 'tokenizer.json'), bos_token='<s>',
      eos_token=EOS, chat_template=MISTRAL_TEMPLATE).apply_chat_template(conversation)
  theirs = theirs['input_ids'] if 'input_ids' in theirs else theirs
  assert tokens.tolist() == list(theirs)
  assert tokens.tolist().count(tok.token_id('<s>')) == 1
  assert tok.decode(tokens[mask == 1]) == f'Paris.{EOS}Rome.{EOS}'
  fmt = document_format(tok)
  ids = documents_module.prompt_ids('Hi', tok, fmt, chat=True)
  assert ids[:2] == [tok.token_id('<s>')] + tok.encode('[INST]').tolist()[:1]
  # Such data prepared before (BOS and EOS doubled) is prepared again; a ChatML template's is not.
  assert fmt.identity()['chat_rendering'] == documents_module.CHAT_RENDERING_VERSION
  assert 'chat_rendering' not in document_format(load_tokenizer(str(tokenizer_dir))).identity()


def test_a_bos_the_template_writes_is_tokenized_with_what_follows_it(tmp_path, documents):
  """A Metaspace tokenizer (prepend_scheme 'first', as Llama 2 and Mistral files exported by
  recent transformers have it) with a template that writes {{ bos_token }} first: the rendering is
  tokenized whole, as transformers' apply_chat_template does, so the text after the BOS gets no
  '▁' of its own (it got one when the rendering was tokenized without its BOS); so do --sample's
  chat prompts, and a text document still starts with one BOS."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme='first')
  tok.decoder = decoders.Metaspace(prepend_scheme='first')
  tok.train_from_iterator(documents[:100], trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<unk>', '<s>', '</s>'], initial_alphabet=list('[]/?'),
      show_progress=False))
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', tok.token_to_id('<s>'))])
  directory = tmp_path / 'metaspace'
  directory.mkdir()
  tok.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': '<s>', 'eos_token': '</s>', 'chat_template': MISTRAL_TEMPLATE}))
  ours = load_tokenizer(str(directory))
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(directory / 'tokenizer.json'), bos_token='<s>', eos_token='</s>',
      chat_template=MISTRAL_TEMPLATE)
  conversation = CONVERSATION[1:]
  want = theirs.apply_chat_template(conversation, tokenize=True, return_dict=True)['input_ids']
  assert theirs.convert_ids_to_tokens(want[:2]) == ['<s>', '['], want[:4]
  tokens, mask = _prepared_chat(tmp_path, ours, {'messages': conversation})
  assert tokens.tolist() == want and tokens.tolist().count(ours.token_id('<s>')) == 1
  assert ours.decode(tokens[mask == 1]) == 'Paris.</s>Rome.</s>'
  prompt = theirs.apply_chat_template(conversation[:1], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)['input_ids']
  assert documents_module.prompt_ids('Capital of France?', ours, document_format(ours),
                                     chat=True) == prompt
  assert documents_module.prompt_ids('Hello', ours, document_format(ours)) == theirs('Hello')[
      'input_ids']
  text, _ = _prepared_chat(tmp_path, ours, {'text': 'Hello there'}, name='text')
  assert text.tolist() == theirs('Hello there')['input_ids'] + [ours.token_id('</s>')]


# Phi-3-mini-4k-instruct's chat template: every turn ends '<|end|>\n'; the EOS ends only a
# conversation rendered without the generation prompt.
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def test_a_template_that_writes_the_eos_after_a_whole_conversation_only(tmp_path,
                                                                       tokenizer_dir):
  """Phi-3's template writes the EOS after the last turn only, so a conversation rendered up to
  an earlier reply ends with an EOS the whole one does not hold there: each reply ends at its
  '<|end|>\n' (multi-turn Phi-3 chats were refused as bad records), the tokens equal
  transformers' apply_chat_template, the EOS once."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  tok = _tokenizer_with(tmp_path / 'phi3', tokenizer_dir, {'eos_token': EOS,
                                                           'chat_template': PHI3_TEMPLATE})
  tokens, mask = _prepared_chat(tmp_path, tok)
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(tmp_path / 'phi3' / 'tokenizer.json'), eos_token=EOS,
      chat_template=PHI3_TEMPLATE)
  assert tokens.tolist() == theirs.apply_chat_template(CONVERSATION, tokenize=True,
                                                       return_dict=True)['input_ids']
  assert tok.decode(tokens[mask == 1]) == f'Paris.<|end|>\nRome.<|end|>\n{EOS}'


def test_a_template_that_renders_a_turn_otherwise_once_cut_names_the_fix(tmp_path,
                                                                        tokenizer_dir):
  """A template that renders a user turn otherwise once a reply follows it (here, upper-cased
  while it is the last) leaves the reply nowhere to be found: the records are refused naming
  why and the fix (data.chat_template), not with a bare "cannot be located"."""
  template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {% if loop.last %}"
              "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}[/INST]"
              "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}"
              "{% endfor %}")
  tok = _tokenizer_with(tmp_path / 'upper', tokenizer_dir, {'eos_token': EOS, 'chat_template':
                                                             template})
  source = _write_jsonl(tmp_path / 'chat.jsonl', [{'messages': CONVERSATION}] * 3)
  with pytest.raises(ConfigError, match=r"chat.jsonl:1: the chat template does not render .*"
                     r"set data.chat_template.*\(and 2 more\)"):
    prepare_dataset(tmp_path / 'out', tok, train_sources=[source])


def test_a_document_of_several_parts_is_tokenized_whole(tmp_path, tokenizer_dir, documents):
  """A prompt with its completion, or a rendered conversation, is tokenized whole, as
  transformers tokenizes it, a token learned where it holds learned text: 'Answer: ' + 'Paris'
  stores 'ĠParis' (learned), not 'Ġ' + 'Paris'; a Metaspace tokenizer (Mistral's, Llama 2's)
  gives a reply after '\n' no '▁' of its own (48 of 50 Zephyr-style chats differed)."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  tok = load_tokenizer(str(tokenizer_dir))
  tokens, mask = _prepared_chat(tmp_path, tok, {'prompt': 'Answer: ', 'completion': 'Paris'},
                                name='pair')
  assert tokens.tolist() == tok.encode('Answer: Paris').tolist() + [tok.token_id(EOS)]
  assert tok.decode(tokens[mask == 1]) == ' Paris' + EOS
  _whitespace_bpe(documents, False).save(str(tmp_path / 'metaspace.json'))
  template = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
  directory = tmp_path / 'zephyr'
  directory.mkdir()
  (directory / 'tokenizer.json').write_text((tmp_path / 'metaspace.json').read_text())
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': '<unk>', 'chat_template': template}))
  zephyr = load_tokenizer(str(directory))
  conversation = CONVERSATION[1:3]
  tokens, mask = _prepared_chat(tmp_path, zephyr, {'messages': conversation}, name='zephyr')
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(directory / 'tokenizer.json'), eos_token='<unk>', chat_template=template)
  ids = lambda out: list(out['input_ids'] if 'input_ids' in out else out)
  theirs = ids(hf_tok.apply_chat_template(conversation))
  # The template ends each turn with the EOS and a newline: the document ends at that EOS, once.
  assert theirs[-2] == zephyr.token_id('<unk>') and hf_tok.decode(theirs[-1:]).endswith('\n')
  assert tokens.tolist() == theirs[:-1]
  # Learned: the reply after the generation prompt through its EOS.
  prompt = ids(hf_tok.apply_chat_template(conversation[:1], add_generation_prompt=True))
  assert theirs[:len(prompt)] == prompt
  assert mask.tolist() == [0] * len(prompt) + [1] * (len(theirs) - 1 - len(prompt))


# Qwen3's chat template as its tokenizer_config.json has it, without the tool branches: an
# assistant turn after the last user message opens with a thinking block (empty without
# reasoning_content) and earlier ones do not, so a conversation cut after an assistant turn
# renders that turn differently than the whole conversation does.
QWEN3_TEMPLATE = QWEN3_TEMPLATE_HEAD + (
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_chat_template_that_renders_the_last_turn_differently(tmp_path, tokenizer_dir):
  """Qwen3's template: the learned text is each assistant turn as the whole conversation renders
  it (the first without a thinking block, the last with the empty one) and its end marker, not
  the longer rendering of the turn as the last one, which ran into the next user turn."""
  tok = _tokenizer_with(tmp_path / 'qwen3_tokenizer', tokenizer_dir,
                        {'eos_token': EOS, 'chat_template': QWEN3_TEMPLATE})
  tokens, mask = _prepared_chat(tmp_path, tok)
  assert tok.decode(tokens[mask == 1]) == (
      'Paris.<|im_end|>\n<think>\n\n</think>\n\nRome.<|im_end|>\n' + EOS)
  assert 'And Italy?' in tok.decode(tokens[mask == 0])


# --- mixtures -----------------------------------------------------------------------------------


def test_mixture_proportions_and_resume():
  sources = tuple(np.full(window * 64, value, dtype=np.uint16)
                  for value, window in ((1, 9), (2, 9), (3, 9)))
  weights = (0.6, 0.3, 0.1)
  sampler = BatchSampler(MixtureSplit(weights, sources), seq_len=8, batch_size=50,
                         microbatches=2, seed=7)
  draws = np.concatenate([sampler.batch(p)[..., 0].reshape(-1)
                          for p in range(0, 10_000, sampler.samples_per_step)])
  assert len(draws) == 10_000
  for value, weight in zip((1, 2, 3), weights):
    assert abs(np.mean(draws == value) - weight) < 0.01
  # Stateless in the position: a fresh sampler (a resumed run) gives the same batches.
  again = BatchSampler(MixtureSplit(weights, sources), seq_len=8, batch_size=50,
                       microbatches=2, seed=7)
  for position in (0, 4321, 9_900, 123_456):
    np.testing.assert_array_equal(again.batch(position), sampler.batch(position))
    np.testing.assert_array_equal(again.window_sources(position),
                                  sampler.window_sources(position))
  # Each source's samples walk its own epochs: 64 windows of source 0 are each used once first.
  sources_of = np.concatenate([sampler.window_sources(p).reshape(-1) for p in range(0, 300, 100)])
  starts_of = np.concatenate([sampler.window_starts(p).reshape(-1) for p in range(0, 300, 100)])
  first = starts_of[sources_of == 0][:64]
  assert sorted(first // 9) == list(range(64))


def test_mixture_from_config(tmp_path, documents):
  a = _write_jsonl(tmp_path / 'a.jsonl', [{'text': d} for d in documents[:100]])
  b = _write_parquet(tmp_path / 'b.parquet', {'text': documents[100:200]})
  config = _data_config(mixture=f'3:{a},1:{b}', cache_dir=str(tmp_path / 'cache'))
  check_data_config(config)
  info, _ = load_data(config, tmp_path)
  assert [w for w, _ in info.mixture] == [3.0, 1.0]
  assert info.train_tokens == sum(p.train_tokens for _, p in info.mixture)
  train = load_split(info, 'train')
  assert isinstance(train, MixtureSplit)
  val = load_split(info, 'val')
  assert len(val) == info.val_tokens == sum(p.val_tokens for _, p in info.mixture)
  sampler = BatchSampler(train, seq_len=32, batch_size=4, microbatches=1, seed=0)
  assert sampler.batch(0).shape == (1, 4, 33)
  # Reused, not re-prepared, on the next load.
  assert load_data(config, tmp_path)[0] == info
  # With data.val_path, validation is that file and the sources hold nothing out.
  val_config = _data_config(mixture=f'3:{a},1:{b}', cache_dir=str(tmp_path / 'cache2'),
                            val_path=str(WIKITEXT_VALID))
  with_val, _ = load_data(val_config, tmp_path)
  assert all(p.val_tokens == 0 for _, p in with_val.mixture)
  assert with_val.val_tokens == WIKITEXT_VALID.stat().st_size  # a .txt: one token per byte
  for spec, message in (('0:' + str(a), 'weight'), ('-1:' + str(a), 'weight'),
                        ('x:' + str(a), 'WEIGHT:SOURCE'), (f'1:{a},nan:{b}', 'weight')):
    with pytest.raises(ConfigError, match='data.mixture.*' + message):
      check_data_config(_data_config(mixture=spec))
  with pytest.raises(ConfigError, match='data.mixture'):
    check_data_config(_data_config(mixture=f'1:{a}', path=str(a)))


# --- resumable prepare --------------------------------------------------------------------------

_KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
from megatrain_jax.data import ByteTokenizer, formats, prepare_dataset, shards
formats.CHUNK_BYTES = 3000
commit = shards.ShardWriter._commit
count = [0]
def dying_commit(self, *args):
  commit(self, *args)
  count[0] += 1
  if count[0] == {kill_after}:
    os.kill(os.getpid(), signal.SIGKILL)
shards.ShardWriter._commit = dying_commit
prepare_dataset({out!r}, ByteTokenizer(), train_sources=[{source!r}], val_sources=[{val!r}],
                shard_tokens=2500)
"""


def test_prepare_killed_midway_resumes_to_identical_files(tmp_path, documents, monkeypatch):
  monkeypatch.setattr(formats, 'CHUNK_BYTES', 3000)
  records = [{'prompt': d[:40], 'completion': d[40:200]} if i % 3 == 0 else {'text': d}
             for i, d in enumerate(documents[:150])]
  source = _write_jsonl(tmp_path / 'src.jsonl.zst', records, 'zst')
  val = _write_parquet(tmp_path / 'val.parquet', {'text': documents[150:200]}, 10)
  clean = tmp_path / 'clean'
  prepare_dataset(clean, ByteTokenizer(), train_sources=[source], val_sources=[val],
                  shard_tokens=2500)
  resumed = tmp_path / 'resumed'
  script = _KILLER.format(repo=str(REPO), out=str(resumed), source=str(source), val=str(val),
                          kill_after=5)
  run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True)
  assert run.returncode == -signal.SIGKILL, run.stderr
  progress = json.loads((resumed / 'prepare.json').read_text())
  assert len(progress['streams']['train']['shards']) == 5
  assert not (resumed / 'meta.json').exists()
  # Resume: the recorded shards are kept (not rewritten), the rest is written.
  kept = {p.name: p.stat().st_mtime_ns for p in resumed.glob('train-0000[0-4].*')}
  prepare_dataset(resumed, ByteTokenizer(), train_sources=[source], val_sources=[val],
                  shard_tokens=2500)
  assert {p.name: p.stat().st_mtime_ns for p in resumed.glob('train-0000[0-4].*')} == kept
  names = sorted(p.name for p in clean.iterdir())
  assert names == sorted(p.name for p in resumed.iterdir())
  assert any(name.endswith('.mask') for name in names)
  assert any(name.endswith('.ends') for name in names)  # where each document ends, resumed too
  for name in names:
    assert (clean / name).read_bytes() == (resumed / name).read_bytes(), name
  assert read_dataset_info(resumed).splits['train'][0][0].endswith('train-00000.bin')


def test_format_1_directory_still_loads(tmp_path):
  out = tmp_path / 'old'
  out.mkdir()
  np.arange(100, dtype='<u2').tofile(out / 'train.bin')
  np.arange(20, dtype='<u2').tofile(out / 'val.bin')
  (out / 'meta.json').write_text(json.dumps(
      {'format': 1, 'dtype': 'uint16', 'vocab_size': 256, 'train_tokens': 100,
       'val_tokens': 20, 'tokenizer': 'byte', 'fingerprint': 'x'}))
  info, _ = load_data(_data_config(path=str(out)), tmp_path)
  np.testing.assert_array_equal(load_split(info, 'train'), np.arange(100))
  np.testing.assert_array_equal(load_split(info, 'val'), np.arange(20))
  # As a cache of another dataset, it is replaced (old files removed) by the new layout.
  text = tmp_path / 't.txt'
  text.write_text('hello world\n' * 10)
  info = prepare_dataset(out, ByteTokenizer(), train_sources=[text])
  assert sorted(p.name for p in out.iterdir()) == ['meta.json', 'train-00000.bin']


# --- bad input ----------------------------------------------------------------------------------


def _bad_cases(tmp_path):
  ok = json.dumps({'text': 'fine'})
  zst = zstandard.ZstdCompressor().compress((ok + '\n').encode() * 500)
  gz = gzip.compress((ok + '\n').encode() * 500)

  def write(name, data):
    (tmp_path / name).write_bytes(data)
    return tmp_path / name

  return {
      'malformed JSON': (write('a.jsonl', f'{ok}\n{{"text": "x"\n'.encode()), 'a.jsonl:2:',
                         'malformed JSON'),
      'no text field': (write('b.jsonl', f'{ok}\n{ok}\n{{"body": "x"}}\n'.encode()), 'b.jsonl:3:',
                        "without the text field 'text'"),
      'non-string': (write('c.jsonl', b'{"text": 5}\n'), 'c.jsonl:1:', 'int, not a string'),
      'truncated zst': (write('d.jsonl.zst', zst[:len(zst) // 2]), 'd.jsonl.zst', 'truncated'),
      'truncated gz': (write('e.jsonl.gz', gz[:len(gz) // 2]), 'e.jsonl.gz', 'truncated'),
      'parquet column': (_write_parquet(tmp_path / 'f.parquet', {'body': ['x']}), 'f.parquet',
                         "no column 'text'"),
      'empty jsonl': (write('g.jsonl', b'\n\n'), 'g.jsonl', 'is empty'),
      'empty parquet': (_write_parquet(tmp_path / 'h.parquet', {'text': pa.array([], pa.string())}),
                        'h.parquet', 'is empty'),
      'NUL with byte EOS': (write('i.jsonl', b'{"text": "a\\u0000b"}\n'), 'i.jsonl:1:', 'NUL'),
  }


def test_bad_input_is_refused_before_writing(tmp_path):
  for name, (source, where, what) in _bad_cases(tmp_path).items():
    out = tmp_path / f'out-{name.replace(" ", "_")}'
    config = _data_config(path=str(source), cache_dir=str(out))
    with pytest.raises(ConfigError, match='data.path') as err:
      check_data_config(config)
    assert where in str(err.value) and what in str(err.value), (name, str(err.value))
    with pytest.raises(ConfigError) as err:
      load_data(config, tmp_path)
    assert where in str(err.value) and what in str(err.value), (name, str(err.value))
    assert not out.exists(), name


def test_bad_record_deep_in_a_file_removes_partial_output(tmp_path, monkeypatch):
  monkeypatch.setattr(formats, 'CHUNK_BYTES', 2000)
  lines = [json.dumps({'text': f'record {i} ' * 20}) for i in range(600)]
  lines[550] = '{"text": broken'
  source = tmp_path / 'deep.jsonl'
  source.write_text('\n'.join(lines) + '\n')
  assert source.stat().st_size > formats.SNIFF_BYTES  # beyond what validation reads
  with pytest.raises(ConfigError, match='deep.jsonl:551: malformed JSON'):
    prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source], shard_tokens=5000)
  assert not (tmp_path / 'out').exists()  # no shards, no progress record, no empty directory
  info, _ = load_data(_data_config(path=str(source), cache_dir=str(tmp_path / 'out'),
                                   skip_bad_records=True), tmp_path)
  assert info.stats['skipped_records'] == 1 and info.stats['documents'] == 599


def test_skip_bad_records_counts_them(tmp_path, monkeypatch):
  """Skipped records are counted; data prepared while they were skipped is prepared again once
  the rules read more kinds of record (documents.RECORDS_VERSION)."""
  source = tmp_path / 'mixed.jsonl'
  source.write_text('{"text": "good"}\n{"text": 1}\nnot json\n{"other": "x"}\n{"text": "also"}\n')
  config = _data_config(path=str(source), cache_dir=str(tmp_path / 'out'), skip_bad_records=True,
                        val_fraction=0.5)
  check_data_config(config)
  info, _ = load_data(config, tmp_path)
  assert info.stats['skipped_records'] == 3 and info.stats['documents'] == 2
  assert bytes(_stream(info).astype(np.uint8)) == b'good\0also\0'
  fingerprint = json.loads((tmp_path / 'out' / 'meta.json').read_text())['fingerprint']
  load_data(config, tmp_path)
  assert json.loads((tmp_path / 'out' / 'meta.json').read_text())['fingerprint'] == fingerprint
  monkeypatch.setattr(documents_module, 'RECORDS_VERSION', documents_module.RECORDS_VERSION - 1)
  load_data(config, tmp_path)
  assert json.loads((tmp_path / 'out' / 'meta.json').read_text())['fingerprint'] != fingerprint


def test_documents_that_learn_nothing_or_everything_are_counted_and_named(tmp_path,
                                                                          tokenizer_dir):
  """Records the format reads otherwise than their author meant (an empty completion, a pair
  whose prompt holds everything) learn nothing but their EOS, and text records among pairs are
  learned whole (a mix of kinds): both counted exactly (a shard boundary between documents
  included) and named by the prepare summary, not trained on in silence."""
  records = [{'prompt': f'question {i} ', 'completion': f'answer {i}'} for i in range(40)]
  for i in (3, 17, 38):
    records[i]['completion'] = ''
  for i in (5, 6, 30, 31, 32):
    records[i] = {'text': f'a plain text record number {i}'}
  source = _write_jsonl(tmp_path / 'pairs.jsonl', records)
  info, _ = load_data(_data_config(path=str(source), cache_dir=str(tmp_path / 'out'),
                                   shard_tokens=97), tmp_path)
  assert info.stats['documents'] == 40 and info.stats['documents_learning_nothing'] == 3
  assert info.stats['documents_learned_whole'] == 5
  assert len(list((tmp_path / 'out').glob('train-*.ends'))) > 1
  summary = prepare_summary(info)
  assert 'warning: 3 documents learn no token but their EOS' in summary
  assert 'note: 5 documents are learned whole (text records, or pairs' in summary
  assert 'and 32 in part (prompt/completion pairs, chats): the records may mix kinds' in summary
  # With a tokenizer that adds a BOS (never learned), the same counts.
  _tokenizer_with(tmp_path / 'bos', tokenizer_dir, {'eos_token': EOS, 'bos_token': '<s>',
                                                    'add_bos_token': True})
  info, _ = load_data(_data_config(path=str(source), cache_dir=str(tmp_path / 'bos-out'),
                                   tokenizer=str(tmp_path / 'bos'), shard_tokens=97), tmp_path)
  assert (info.stats['documents_learning_nothing'], info.stats['documents_learned_whole']) == (3, 5)
  clean = _write_jsonl(tmp_path / 'clean.jsonl', [{'text': 'all learned'}] * 5)
  info, _ = load_data(_data_config(path=str(clean), cache_dir=str(tmp_path / 'clean')), tmp_path)
  assert info.stats['documents_learning_nothing'] == 0
  assert 'learn no token' not in prepare_summary(info) and 'mix' not in prepare_summary(info)


def test_launch_prepare_prints_counts_and_throughput(tmp_path, documents):
  source = _write_jsonl(tmp_path / 'docs.jsonl.zst', [{'text': d} for d in documents], 'zst')
  run = subprocess.run(
      [sys.executable, str(REPO / 'launch.py'), '--prepare', f'--workdir={tmp_path / "run"}',
       f'--config.data.path={source}', '--config.data.num_workers=1'],
      capture_output=True, text=True, cwd=REPO, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert run.returncode == 0, run.stderr[-2000:]
  assert 'train tokens' in run.stdout and 'MB/s' in run.stdout, run.stdout
  # Into a pipe (a job's log), no bar: each redraw appended a '\r'-joined copy of it.
  assert '\r' not in run.stderr and 'prepare:' not in run.stderr, run.stderr[-2000:]
  assert (tmp_path / 'run' / 'data' / 'meta.json').is_file()
  assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_prepare_needs_no_model_for_its_tokenizer(tmp_path, tokenizer_dir):
  """--prepare tokenizes (train.prepare): a tokenizer larger than the preset's model.vocab_size
  is the training run's concern (refused there), not the prepare's, as data.md's command
  shows it (no vocab_size)."""
  from megatrain_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import train  # pylint: disable=import-outside-toplevel
  source = _write_jsonl(tmp_path / 'docs.jsonl', [{'text': 'a short record'}] * 40)
  config = config_lib.load_config('tiny', data__path=str(source),
                                  data__tokenizer=str(tokenizer_dir))
  assert config.model.vocab_size < load_tokenizer(str(tokenizer_dir)).vocab_size
  info = train.prepare(config, str(tmp_path / 'run'))
  assert info.vocab_size == load_tokenizer(str(tokenizer_dir)).vocab_size and info.train_tokens


def test_document_mask_ends_documents_at_the_tokenizers_eos(tmp_path, tokenizer_dir):
  """model.document_mask with a Hugging Face tokenizer: documents end at the EOS its
  tokenizer_config.json names (or data.eos_token); without either the run is refused, naming
  data.eos_token, before anything is written."""
  from megatrain_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from megatrain_jax import train  # pylint: disable=import-outside-toplevel
  source = _write_jsonl(tmp_path / 'docs.jsonl', [{'text': 'a short record'}] * 4)
  config = config_lib.load_config('tiny', data__path=str(source), model__vocab_size=600,
                                  data__tokenizer=str(tokenizer_dir), model__document_mask=True)
  tokenizer = load_tokenizer(str(tokenizer_dir))
  model_cfg = config_lib.validate(config)
  assert train.with_document_mask(config, model_cfg, tokenizer).document_eos_id == (
      tokenizer.token_id(EOS))
  config.data.eos_token = '<|im_end|>'
  assert train.with_document_mask(config, model_cfg, tokenizer).document_eos_id == (
      tokenizer.token_id('<|im_end|>'))
  bare = tmp_path / 'bare'
  bare.mkdir()
  (bare / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  config.data.tokenizer, config.data.eos_token = str(bare), ''
  config.data.path = str(tmp_path / 'plain.txt')  # text needs no EOS: only the mask asks for one
  (tmp_path / 'plain.txt').write_text('a short text ' * 400)
  with pytest.raises(ConfigError, match='data.eos_token'):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
  config.model.document_mask = False
  validate = train._validate  # pylint: disable=protected-access
  assert validate(config, str(tmp_path / 'run'))[0].document_eos_id == -1  # fine without it


# --- text in bounded memory; .json / .ndjson; directories; Parquet records as JSON ones --------


SHAKESPEARE = SHARED_DATA / 'tinyshakespeare' / 'input.txt'


class _Recording:
  """A tokenizer that records the longest text it was given."""

  def __init__(self, tokenizer):
    self.tokenizer, self.longest = tokenizer, 0

  def __getattr__(self, name):
    return getattr(self.tokenizer, name)

  def encode_batch(self, texts):
    self.longest = max([self.longest] + [len(t) for t in texts])
    return self.tokenizer.encode_batch(texts)


def _whitespace_bpe(documents, prepend: bool) -> tokenizers.Tokenizer:
  """A Metaspace BPE, or (prepend) one whose normalizer puts '▁' before every text (Llama 2's
  tokenizer.json), which no cut leaves unchanged."""
  from tokenizers import normalizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  if prepend:
    tok.normalizer = normalizers.Sequence([normalizers.Prepend('▁'),
                                           normalizers.Replace(' ', '▁')])
  else:
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.train_from_iterator(documents[:100], trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<unk>'], show_progress=False))
  return tok


@pytest.mark.parametrize('corpus', [WIKITEXT_VALID, SHAKESPEARE], ids=['wikitext', 'shakespeare'])
def test_text_is_encoded_in_pieces_to_the_ids_of_the_whole_text(tmp_path, corpus, documents,
                                                                 tokenizer_dir, monkeypatch):
  """Text is encoded a piece at a time (a whole file at once took ~300x its size), cut only
  where the ids do not change: prepare (in chunks) and --eval give the whole text's ids."""
  from megatrain_jax import evaluate  # pylint: disable=g-import-not-at-top
  from megatrain_jax.data import (  # pylint: disable=g-import-not-at-top
      tokenizer as tokenizer_module)
  text = corpus.read_text(encoding='utf-8')
  tok = load_tokenizer(str(tokenizer_dir))
  whole = tok.encode(text)
  recording = _Recording(tok)
  assert np.array_equal(tokenizer_module.encode_text(recording, text, 5000), whole)
  assert recording.longest < 20000  # pieces, not the 1 MB text
  for hf in (_whitespace_bpe(documents, False), _whitespace_bpe(documents, True)):
    hf.save(str(tmp_path / 'ws.json'))
    other = load_tokenizer(str(tmp_path / 'ws.json'))
    assert np.array_equal(tokenizer_module.encode_text(other, text[:200_000], 5000),
                          other.encode(text[:200_000]))
  monkeypatch.setattr(prepare_module, '_CHUNK_CHARS', 50_000)  # 20+ chunks, cut by the reader
  monkeypatch.setattr(formats, 'TEXT_CHUNK_CHARS', 50_000)
  info = prepare_dataset(tmp_path / 'out', tok, train_sources=[corpus], val_fraction=0.1)
  assert np.array_equal(_stream(info), whole)
  assert np.array_equal(evaluate.read_eval_data(str(corpus), tok).tokens, whole)
  # --eval with a tokenizer no cut leaves unchanged (Llama 2's '▁' before every text): its
  # chunks grow rather than cut at lines, which would give each a '▁' of its own.
  _whitespace_bpe(documents, True).save(str(tmp_path / 'prepend.json'))
  prepend = load_tokenizer(str(tmp_path / 'prepend.json'))
  (tmp_path / 'head.txt').write_text(text[:200_000], encoding='utf-8')
  assert np.array_equal(evaluate.read_eval_data(str(tmp_path / 'head.txt'), prepend).tokens,
                        prepend.encode(text[:200_000]))


def test_a_text_files_bom_is_not_tokenized(tmp_path):
  source = tmp_path / 'bom.txt'
  source.write_bytes(b'\xef\xbb\xbfHello, world. ' * 1 + b'x' * 40)
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source])
  assert bytes(_stream(info).astype(np.uint8)) == b'Hello, world. ' + b'x' * 40


def test_json_arrays_and_ndjson_are_records(tmp_path, documents):
  """A .json file is records (a JSON array, as Stanford Alpaca's alpaca_data.json, or JSON
  lines) and .ndjson is JSON lines: the same documents as the .jsonl file."""
  records = [{'instruction': f'Say {i}.', 'output': d[:80]} for i, d in enumerate(documents[:60])]
  _write_jsonl(tmp_path / 'a.jsonl', records)
  (tmp_path / 'array.json').write_text(json.dumps(records, indent=4))
  (tmp_path / 'lines.json').write_text((tmp_path / 'a.jsonl').read_text())
  (tmp_path / 'b.ndjson').write_text((tmp_path / 'a.jsonl').read_text())
  want = _stream(prepare_dataset(tmp_path / 'o', ByteTokenizer(),
                                 train_sources=[tmp_path / 'a.jsonl']))
  for name in ('array.json', 'lines.json', 'b.ndjson'):
    got = prepare_dataset(tmp_path / f'o-{name}', ByteTokenizer(),
                          train_sources=[tmp_path / name])
    assert np.array_equal(_stream(got), want), name
  records[41]['output'] = 7
  (tmp_path / 'bad.json').write_text(json.dumps(records, indent=1))
  with pytest.raises(ConfigError, match=r'bad.json:\d+: field .output. is int'):
    prepare_dataset(tmp_path / 'o-bad', ByteTokenizer(), train_sources=[tmp_path / 'bad.json'])
  (tmp_path / 'broken.json').write_text('[\n{"text": "a"},\n{"text": }\n]')
  with pytest.raises(ConfigError, match='broken.json line 3: malformed JSON'):
    prepare_dataset(tmp_path / 'o-br', ByteTokenizer(), train_sources=[tmp_path / 'broken.json'])


def test_directories_that_would_be_misread_are_refused(tmp_path):
  """A Hub repository's layout: README.md beside train.jsonl, or data/*.parquet below it."""
  beside = tmp_path / 'beside'
  beside.mkdir()
  (beside / 'README.md').write_text('# A dataset card\n')
  _write_jsonl(beside / 'train.jsonl', [{'text': 'hello'}])
  with pytest.raises(ConfigError, match=r'mixes record files \(train.jsonl\) with text files '
                     r'\(README.md\).*beside/\*.jsonl'):
    prepare_dataset(tmp_path / 'o', ByteTokenizer(), train_sources=[beside])
  # ... and by the config check, before a run prints its start (or writes anything).
  for field in ('path', 'val_path', 'mixture'):
    value = f'1:{beside}' if field == 'mixture' else str(beside)
    other = {'path': str(tmp_path / 'x.txt')} if field == 'val_path' else {}
    (tmp_path / 'x.txt').write_text('x' * 100)
    with pytest.raises(ConfigError, match=rf'data.{field}: directory .*beside mixes record files'):
      check_data_config(_data_config(**{field: value}, **other))
  below = tmp_path / 'below'
  (below / 'data').mkdir(parents=True)
  (below / 'README.md').write_text('# A dataset card\n')
  _write_parquet(below / 'data' / 'train-00000-of-00001.parquet', {'text': ['hello']})
  with pytest.raises(ConfigError, match=r'no record files at its top level \(only README.md\), '
                     r'but its subdirectories do \(train-00000-of-00001.parquet\).*below/data'):
    formats.expand_sources([below], 'data.path')
  assert formats.expand_sources([below / 'data'], 'data.path')[0].name.endswith('.parquet')
  assert len(formats.expand_sources([f'{below}/**/*.parquet'], 'data.path')) == 1
  # A text corpus with its own metadata in a subdirectory is a text corpus.
  corpus = tmp_path / 'corpus'
  (corpus / 'meta').mkdir(parents=True)
  (corpus / 'a.txt').write_text('hello')
  (corpus / 'meta' / 'stats.json').write_text('{}')
  assert formats.expand_sources([corpus], 'data.path') == [corpus / 'a.txt']


def _tool_chat_tokenizer(tmp_path, tokenizer_dir):
  """A tokenizer whose chat template writes the record's tools and a turn's tool calls."""
  template = ("{% if tools %}tools: {{ tools|length }}\n{% endif %}{% for m in messages %}"
              "{{ m['role'] }}{% if 'tool_calls' in m %} calls {{ m['tool_calls'][0]['name'] }}"
              "{% endif %}: {{ m['content'] }}\n{% endfor %}")
  return _tokenizer_with(tmp_path / 'tok', tokenizer_dir, {'eos_token': EOS,
                                                           'chat_template': template})


def test_parquet_rows_read_as_their_json_records(tmp_path, tokenizer_dir):
  """Every column the record rules read (tools, Alpaca's), and no null Arrow adds: a Parquet
  row gives the tokens of its JSONL line."""
  tok = _tool_chat_tokenizer(tmp_path, tokenizer_dir)
  chats = [{'messages': [{'role': 'user', 'content': 'weather?'},
                         {'role': 'assistant', 'content': '',
                          'tool_calls': [{'name': 'get_weather'}]}],
            'tools': [{'name': 'get_weather'}]},
           {'messages': [{'role': 'user', 'content': 'hi'},
                         {'role': 'assistant', 'content': 'hello'}]}]
  alpaca = [{'instruction': 'Add.', 'input': '1 and 2', 'output': '3'},
            {'instruction': 'Greet.', 'output': 'Hello.'}]
  for name, records in (('chat', chats), ('alpaca', alpaca)):
    _write_jsonl(tmp_path / f'{name}.jsonl', records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / f'{name}.parquet')
    want, got = (_stream(prepare_dataset(tmp_path / f'o-{name}{ext}', tok, val_fraction=0.5,
                                         train_sources=[tmp_path / f'{name}{ext}']))
                 for ext in ('.jsonl', '.parquet'))
    assert np.array_equal(got, want), name


def test_empty_files_are_empty_in_every_format(tmp_path):
  _write_jsonl(tmp_path / 'a.jsonl', [{'text': 'hello'}])
  for name in ('b.parquet', 'c.arrow', 'd.jsonl', 'e.json'):
    (tmp_path / name).write_bytes(b'')
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[tmp_path])
  assert bytes(_stream(info).astype(np.uint8)) == b'hello\0'


def test_lone_surrogate_is_a_bad_record(tmp_path, tokenizer_dir):
  source = tmp_path / 'sur.jsonl'
  source.write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n'
                    '{"text": "pair \\ud83d\\ude00"}\n')
  for tok in (ByteTokenizer(), load_tokenizer(str(tokenizer_dir))):
    with pytest.raises(ConfigError, match=r'sur.jsonl:2: a lone surrogate escape \\ud800'):
      prepare_dataset(tmp_path / 'o', tok, train_sources=[source])
    fmt = document_format(tok)
    info = prepare_dataset(tmp_path / f'o-{tok.name}', tok, train_sources=[source],
                           doc_format=dataclasses.replace(fmt, skip_bad_records=True))
    assert info.stats['skipped_records'] == 1 and info.stats['documents'] == 2


def test_where_bad_input_is_reported(tmp_path):
  """Counts and positions: every bad record counted, a bad byte's offset in the file, the line
  a truncated stream ends after, UTF-16 JSONL named as such."""
  lines = [json.dumps({'text': 'x' * 100})] * 2000
  for i in range(800, 810):
    lines[i] = '{"text": 5}'
  (tmp_path / 'late.jsonl').write_text('\n'.join(lines) + '\n')
  (tmp_path / 'early.jsonl').write_text('{"text": 5}\n' * 10)
  for name, first in (('late', 801), ('early', 1)):
    with pytest.raises(ConfigError, match=rf'{name}.jsonl:{first}: .* \(and 9 more\)'):
      prepare_dataset(tmp_path / f'o-{name}', ByteTokenizer(),
                      train_sources=[tmp_path / f'{name}.jsonl'])
  (tmp_path / 'bad.txt').write_bytes(b'a' * 99 + b'\n' + b'b' * 100_000 + b'\xe9 tail\n')
  with pytest.raises(ConfigError, match=r'byte 0xe9 at offset 100100 \(line 2\)'):
    prepare_dataset(tmp_path / 'o-t', ByteTokenizer(), train_sources=[tmp_path / 'bad.txt'])
  data = ''.join(json.dumps({'text': f'record {i} ' * 10}) + '\n' for i in range(3000)).encode()
  for ext, packed in (('gz', gzip.compress(data)),
                      ('zst', zstandard.ZstdCompressor().compress(data))):
    (tmp_path / f'trunc.jsonl.{ext}').write_bytes(packed[:len(packed) * 2 // 3])
    with pytest.raises(ConfigError, match=r'cannot read past line (\d+)') as err:
      prepare_dataset(tmp_path / f'o-{ext}', ByteTokenizer(),
                      train_sources=[tmp_path / f'trunc.jsonl.{ext}'])
    assert 1000 < int(re.search(r'line (\d+)', str(err.value)).group(1)) < 3000, ext
  (tmp_path / 'u16.jsonl').write_bytes('{"text": "hello"}\n'.encode('utf-16'))
  with pytest.raises(ConfigError, match='convert UTF-16 text to UTF-8'):
    prepare_dataset(tmp_path / 'o-16', ByteTokenizer(), train_sources=[tmp_path / 'u16.jsonl'])
