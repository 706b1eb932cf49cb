"""Tests for megatrain_jax.data: tokenizers, prepare step, loaders, samplers and config checks.

Real text comes from the shared data directory beside the repository (../shared/data); every output
is written under pytest's tmp_path.
"""

import dataclasses
import json
import os
from pathlib import Path

import ml_collections
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatrain_jax.data import (BatchSampler, ByteTokenizer, HFTokenizer, check_data_config,
                                default_corpus_text, eval_batches, load_data, load_split,
                                load_tokenizer, open_tokens, prepare_dataset, read_dataset_info,
                                unlearn_document_starts)
from megatrain_jax.data import TokenStream, packing
from megatrain_jax.data import prepare as prepare_module
from megatrain_jax.errors import ConfigError

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'
SHAKESPEARE = SHARED_DATA / 'tinyshakespeare' / 'input.txt'
WIKITEXT_VALID = SHARED_DATA / 'wikitext-2' / 'valid.txt'


def _text(path: Path) -> str:
  # Exact file contents (no newline translation), as the prepare step reads them.
  return path.read_bytes().decode('utf-8')


def _data_config(**overrides) -> ml_collections.ConfigDict:
  fields = dict(path='', val_path='', val_fraction=0.05, tokenizer='byte', cache_dir='')
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def _tree(root: Path) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob('*'))


class _WideTokenizer:
  """A stub tokenizer with a vocabulary too large for uint16 ids."""

  name = 'wide-stub'
  vocab_size = 70_000

  def encode(self, text: str) -> np.ndarray:
    # Shift bytes past 65535 so a uint16 store would corrupt them.
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32) + 65_500

  def decode(self, ids) -> str:
    return bytes(int(i) - 65_500 for i in ids).decode('utf-8')


@pytest.fixture(scope='module')
def shakespeare_lines() -> list[str]:
  return _text(SHAKESPEARE).splitlines(keepends=True)


@pytest.fixture(scope='module')
def hf_tokenizer_file(tmp_path_factory, shakespeare_lines) -> Path:
  """A small byte-level BPE trained on a few hundred lines of Shakespeare (no download)."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(shakespeare_lines[:500], trainer=trainer)
  path = tmp_path_factory.mktemp('hf_tok') / 'tokenizer.json'
  tok.save(str(path))
  return path


@pytest.fixture(scope='module')
def small_text_file(tmp_path_factory, shakespeare_lines) -> Path:
  path = tmp_path_factory.mktemp('text') / 'small.txt'
  path.write_text(''.join(shakespeare_lines[:2000]), encoding='utf-8')
  return path


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip(shakespeare_lines):
  tok = ByteTokenizer()
  text = ''.join(shakespeare_lines[:200]) + 'naïve café — ✓'
  ids = tok.encode(text)
  assert tok.name == 'byte' and tok.vocab_size == 256
  assert ids.ndim == 1 and ids.min() >= 0 and ids.max() < 256
  assert len(ids) == len(text.encode('utf-8'))
  assert tok.decode(ids) == text
  # A multi-byte character cut in half decodes with a replacement character, not an error.
  assert tok.decode(tok.encode('é')[:1]) == '\ufffd'


def test_hf_tokenizer_round_trip(hf_tokenizer_file, shakespeare_lines):
  text = ''.join(shakespeare_lines[1000:1100])
  names = set()
  for spec in (hf_tokenizer_file, hf_tokenizer_file.parent):  # The file, or its directory.
    tok = load_tokenizer(str(spec))
    names.add(tok.name)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == tokenizers.Tokenizer.from_file(str(hf_tokenizer_file)).get_vocab_size()
    ids = tok.encode(text)
    assert ids.max() < tok.vocab_size
    assert len(ids) < len(text)  # BPE merges actually happened.
    assert tok.decode(ids) == text
  assert len(names) == 1 and names.pop().startswith('hf:')


def test_a_tokenizer_file_is_parsed_once_until_it_changes(tmp_path, hf_tokenizer_file):
  """load_tokenizer of the same file returns the tokenizer parsed the first time; the same path
  written again (another vocabulary) is parsed again, with its own identity."""
  path = tmp_path / 'tokenizer.json'
  path.write_bytes(hf_tokenizer_file.read_bytes())
  first = load_tokenizer(str(path))
  assert load_tokenizer(str(tmp_path)) is first  # the directory names the same file
  other = tokenizers.Tokenizer.from_file(str(path))
  other.add_special_tokens(['<|endoftext|>'])
  other.save(str(path))
  again = load_tokenizer(str(path))
  assert again is not first and again.name != first.name
  assert again.vocab_size == first.vocab_size + 1


def test_load_tokenizer_errors(tmp_path):
  assert isinstance(load_tokenizer('byte'), ByteTokenizer)
  with pytest.raises(ConfigError, match='data.tokenizer'):
    load_tokenizer(str(tmp_path / 'missing' / 'tokenizer.json'))
  with pytest.raises(ConfigError, match='data.tokenizer'):
    load_tokenizer(str(tmp_path))  # A directory without tokenizer.json.
  bad = tmp_path / 'tokenizer.json'
  bad.write_text('{not json', encoding='utf-8')
  with pytest.raises(ConfigError, match='data.tokenizer'):
    load_tokenizer(str(bad))


# --- default corpus -----------------------------------------------------------------------------


def test_default_corpus_is_large_and_deterministic():
  text = default_corpus_text()
  assert len(text.encode('utf-8')) > 300_000
  assert text == default_corpus_text()
  assert 'statement' in text  # It is English prose about Python.


# --- prepare ------------------------------------------------------------------------------------


def test_prepare_byte_dtype_counts_and_tail_split(tmp_path):
  tok = ByteTokenizer()
  info = prepare_dataset(tmp_path / 'out', tok, train_sources=[SHAKESPEARE], val_fraction=0.1)
  expected = tok.encode(_text(SHAKESPEARE))
  assert info.dtype == 'uint16' and info.vocab_size == 256 and info.tokenizer == 'byte'
  assert info.train_tokens + info.val_tokens == len(expected)
  assert info.val_tokens == int(len(expected) * 0.1)

  train, val = load_split(info, 'train'), load_split(tmp_path / 'out', 'val')
  assert train.dtype == np.dtype('<u2') and not train.flags.writeable
  # One shard holds the whole stream (2 bytes a token); the splits are views of it.
  shard = tmp_path / 'out' / 'train-00000.bin'
  assert shard.stat().st_size == 2 * len(expected)
  # Validation is the contiguous tail of the stream; train is everything before it.
  np.testing.assert_array_equal(train, expected[:info.train_tokens])
  np.testing.assert_array_equal(val, expected[info.train_tokens:])
  np.testing.assert_array_equal(open_tokens(shard)[info.train_tokens:], val)

  meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
  assert meta['dtype'] == 'uint16' and meta['train_tokens'] == info.train_tokens
  assert meta['train_sources'][0]['path'] == str(SHAKESPEARE.resolve())
  assert meta['train_sources'][0]['size'] == SHAKESPEARE.stat().st_size
  assert isinstance(meta['fingerprint'], str) and meta['fingerprint']
  assert read_dataset_info(tmp_path / 'out') == info
  # Only the committed files remain: no temp files or progress record left behind.
  assert _tree(tmp_path / 'out') == ['meta.json', 'train-00000.bin']


def test_prepare_chunked_reading_is_lossless(tmp_path, monkeypatch):
  # Force many small chunks; with '\r\n' line ends the stored bytes must still be exact.
  monkeypatch.setattr(prepare_module, '_CHUNK_CHARS', 4096)
  source = tmp_path / 'crlf.txt'
  source.write_bytes(SHAKESPEARE.read_bytes()[:200_000].replace(b'\n', b'\r\n'))
  info = prepare_dataset(tmp_path / 'out', ByteTokenizer(), train_sources=[source])
  tokens = np.concatenate([load_split(info, 'train'), load_split(info, 'val')])
  assert tokens.astype(np.uint8).tobytes() == source.read_bytes()


def test_prepare_wide_vocab_uses_uint32(tmp_path, small_text_file):
  tok = _WideTokenizer()
  info = prepare_dataset(tmp_path, tok, train_sources=[small_text_file])
  assert info.dtype == 'uint32'
  tokens = np.concatenate([load_split(info, 'train'), load_split(info, 'val')])
  np.testing.assert_array_equal(tokens, tok.encode(_text(small_text_file)))
  assert tokens.max() > 65_535


def test_prepare_separate_val_and_directory_sources(tmp_path, small_text_file):
  text_dir = tmp_path / 'texts'
  text_dir.mkdir()
  (text_dir / 'b.txt').write_text('second file\n', encoding='utf-8')
  (text_dir / 'a.txt').write_text('first file\n', encoding='utf-8')
  (text_dir / '.hidden').write_text('never read\n', encoding='utf-8')
  tok = ByteTokenizer()
  info = prepare_dataset(tmp_path / 'out', tok, train_sources=[text_dir, small_text_file],
                         val_sources=[WIKITEXT_VALID])
  expected_train = tok.encode('first file\nsecond file\n' + _text(small_text_file))
  np.testing.assert_array_equal(load_split(info, 'train'), expected_train)
  np.testing.assert_array_equal(load_split(info, 'val'), tok.encode(_text(WIKITEXT_VALID)))


def test_prepare_reuses_and_reprepares_on_change(tmp_path, shakespeare_lines):
  source = tmp_path / 'input.txt'
  source.write_text(''.join(shakespeare_lines[:3000]), encoding='utf-8')
  out = tmp_path / 'out'
  info = prepare_dataset(out, ByteTokenizer(), train_sources=[source])
  train_bin = out / 'train-00000.bin'
  mtime = train_bin.stat().st_mtime_ns
  os.utime(train_bin, ns=(mtime - 10**9, mtime - 10**9))  # Make any rewrite visible in mtime.
  mtime = train_bin.stat().st_mtime_ns

  assert prepare_dataset(out, ByteTokenizer(), train_sources=[source]) == info
  assert train_bin.stat().st_mtime_ns == mtime

  # A different val_fraction or tokenizer is a different dataset.
  assert prepare_dataset(out, ByteTokenizer(), train_sources=[source],
                         val_fraction=0.2).val_tokens > info.val_tokens
  assert prepare_dataset(out, _WideTokenizer(), train_sources=[source]).dtype == 'uint32'

  source.write_text(''.join(shakespeare_lines[:4000]), encoding='utf-8')
  changed = prepare_dataset(out, ByteTokenizer(), train_sources=[source])
  assert changed.train_tokens + changed.val_tokens == len(source.read_bytes())
  assert changed.train_tokens > info.train_tokens


def test_prepare_default_corpus(tmp_path):
  info = prepare_dataset(tmp_path, ByteTokenizer(), train_sources=[])
  assert info.train_tokens + info.val_tokens == len(default_corpus_text().encode('utf-8'))
  meta = json.loads((tmp_path / 'meta.json').read_text())
  assert meta['train_sources'][0]['path'].startswith('<embedded')


def test_prepare_errors(tmp_path):
  tok = ByteTokenizer()
  with pytest.raises(ConfigError, match='data.path'):
    prepare_dataset(tmp_path / 'out', tok, train_sources=[tmp_path / 'missing.txt'])
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ConfigError, match='data.path'):
    prepare_dataset(tmp_path / 'out', tok, train_sources=[tmp_path / 'empty'])
  with pytest.raises(ConfigError, match='data.val_path'):
    prepare_dataset(tmp_path / 'out', tok, train_sources=[SHAKESPEARE],
                    val_sources=[tmp_path / 'missing.txt'])
  for bad in (0, 0.0, 0.6, -0.1, float('nan'), True, '0.1'):
    with pytest.raises(ConfigError, match='data.val_fraction'):
      prepare_dataset(tmp_path / 'out', tok, train_sources=[SHAKESPEARE], val_fraction=bad)
  latin1 = tmp_path / 'latin1.txt'
  latin1.write_bytes('café\n'.encode('latin-1'))
  with pytest.raises(ConfigError, match='data.path'):
    prepare_dataset(tmp_path / 'out2', tok, train_sources=[latin1])
  # Every error above is found before anything is written.
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'out2').exists()


# --- samplers -----------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  return prepare_dataset(tmp_path_factory.mktemp('prepared'), ByteTokenizer(),
                         train_sources=[SHAKESPEARE])


def test_sampler_deterministic_and_shifted(prepared):
  tokens = load_split(prepared, 'train')
  kwargs = dict(seq_len=64, batch_size=4, microbatches=2)
  sampler = BatchSampler(tokens, seed=0, **kwargs)
  batch = sampler.batch(24)
  assert batch.shape == (2, 4, 65) and batch.dtype == np.int32
  assert sampler.samples_per_step == 8
  # A fresh sampler (as after a resume) gives bitwise the same batch for the same position.
  np.testing.assert_array_equal(BatchSampler(tokens, seed=0, **kwargs).batch(24), batch)
  np.testing.assert_array_equal(sampler.batch(24), batch)
  assert not np.array_equal(BatchSampler(tokens, seed=1, **kwargs).batch(24), batch)
  assert not np.array_equal(sampler.batch(32), batch)
  # Each row is a contiguous slice of the stream: targets are the inputs shifted by one.
  starts = sampler.window_starts(24)
  for m in range(2):
    for b in range(4):
      start = starts[m, b]
      np.testing.assert_array_equal(batch[m, b, :-1], tokens[start:start + 64])
      np.testing.assert_array_equal(batch[m, b, 1:], tokens[start + 1:start + 65])


def test_sampler_epochs_cover_every_window_once():
  seq_len, window = 7, 8
  tokens = np.arange(window * 50 + 5, dtype=np.uint32)  # 50 windows plus an unused remainder.
  sampler = BatchSampler(tokens, seq_len=seq_len, batch_size=3, microbatches=2, seed=5)
  assert sampler.n_windows == 50
  steps = 3 * 50 // sampler.samples_per_step + 1
  batches = np.concatenate(
      [sampler.batch(step * sampler.samples_per_step).reshape(-1, window) for step in range(steps)])
  assert np.all(np.diff(batches, axis=1) == 1)  # Windows are contiguous...
  windows = batches[:, 0] // window
  assert np.all(batches[:, 0] % window == 0)  # ...and aligned, never straddling two windows.
  for epoch in range(3):
    epoch_windows = windows[epoch * 50:(epoch + 1) * 50]
    assert sorted(epoch_windows) == list(range(50))
    np.testing.assert_array_equal(
        epoch_windows, np.random.default_rng([5, epoch]).permutation(50))
  assert not np.array_equal(windows[:50], windows[50:100])  # Each epoch reshuffles.


def test_sampler_position_in_later_epoch(prepared):
  tokens = load_split(prepared, 'train')
  sampler = BatchSampler(tokens, seq_len=128, batch_size=2, microbatches=1, seed=3)
  position = 2 * sampler.n_windows + 7
  batch = sampler.batch(position)
  perm = np.random.default_rng([3, 2]).permutation(sampler.n_windows)
  for b in range(2):
    start = perm[7 + b] * 129
    np.testing.assert_array_equal(batch[0, b], tokens[start:start + 129])
  # A step straddling the end of an epoch takes the next samples from the next epoch's order.
  straddle = sampler.batch(sampler.n_windows - 1)
  first = np.random.default_rng([3, 0]).permutation(sampler.n_windows)[-1]
  second = np.random.default_rng([3, 1]).permutation(sampler.n_windows)[0]
  np.testing.assert_array_equal(straddle[0, 0], tokens[first * 129:first * 129 + 129])
  np.testing.assert_array_equal(straddle[0, 1], tokens[second * 129:second * 129 + 129])


def test_eval_batches(prepared):
  val = load_split(prepared, 'val')
  batches = eval_batches(val, seq_len=32, batch_size=4, num_batches=3)
  assert len(batches) == 3
  assert all(b.shape == (4, 33) and b.dtype == np.int32 for b in batches)
  np.testing.assert_array_equal(np.stack(batches).reshape(-1), val[:3 * 4 * 33])
  again = eval_batches(val, seq_len=32, batch_size=4, num_batches=3)
  assert all(np.array_equal(a, b) for a, b in zip(batches, again))
  # The split runs out: only the full batches that fit come back.
  big = eval_batches(val, seq_len=1023, batch_size=8, num_batches=1000)
  assert len(big) == len(val) // (8 * 1024)


def test_document_eos_unlearns_the_target_after_each_eos():
  """With model.document_mask (document_eos), plain token batches come as Batch whose loss mask is
  0 exactly where the input is the EOS (its target starts the next document), at a row's first
  and last input too; eval batches alike. unlearn_document_starts keeps a given mask's zeros."""
  rng = np.random.default_rng(4)
  tokens = rng.integers(1, 9, 8 * 40).astype(np.uint16)
  tokens[rng.random(tokens.size) < 0.2] = 0  # EOS 0
  tokens[::8] = 0  # every window starts with an EOS input...
  tokens[6::8] = 0  # ...and ends with one (window 8 = 7 inputs, input 6 the last)
  sampler = BatchSampler(tokens, seq_len=7, batch_size=3, microbatches=2, seed=1, document_eos=0)
  plain = BatchSampler(tokens, seq_len=7, batch_size=3, microbatches=2, seed=1).batch(6)
  batch = sampler.batch(6)
  np.testing.assert_array_equal(batch.tokens, plain)
  assert batch.loss_mask.shape == (2, 3, 7) and batch.loss_mask.dtype == np.uint8
  np.testing.assert_array_equal(batch.loss_mask, plain[..., :-1] != 0)
  assert not batch.loss_mask[..., 0].any() and not batch.loss_mask[..., 6].any()
  for got, want in zip(eval_batches(tokens, seq_len=7, batch_size=3, num_batches=2,
                                    document_eos=0),
                       eval_batches(tokens, seq_len=7, batch_size=3, num_batches=2)):
    np.testing.assert_array_equal(got.tokens, want)
    np.testing.assert_array_equal(got.loss_mask, want[:, :-1] != 0)
  given = np.array([[0, 1, 1, 1]], np.uint8)
  np.testing.assert_array_equal(
      unlearn_document_starts(np.array([[5, 0, 7, 0, 8]]), given, 0), [[0, 0, 1, 0]])


def test_sampler_errors(prepared):
  short = np.arange(100, dtype=np.uint16)
  with pytest.raises(ConfigError, match='train.seq_len') as err:
    BatchSampler(short, seq_len=100, batch_size=1, microbatches=1, seed=0)
  assert '100 tokens' in str(err.value) and '101' in str(err.value)
  with pytest.raises(ConfigError, match='train.seq_len'):
    BatchSampler(load_split(prepared, 'train'), seq_len=0, batch_size=1, microbatches=1, seed=0)
  with pytest.raises(ConfigError, match='train.seed'):
    BatchSampler(short, seq_len=8, batch_size=1, microbatches=1, seed=-1)
  with pytest.raises(ConfigError) as err:
    eval_batches(short, seq_len=100, batch_size=4, num_batches=1)
  for field in ('data.val_path', 'data.val_fraction', 'train.seq_len + 1 = 101'):
    assert field in str(err.value)


@pytest.mark.parametrize('packed', [False, True])
def test_a_validation_split_shorter_than_a_batch_gives_one_padded_batch(packed):
  """100 tokens, windows of 33, batch_size 4: the 3 windows (or, packed, the rows of whole
  documents there are) and rows of zeros whose targets do not count; a split that fills a batch
  gives full batches only, as before."""
  short = np.arange(1, 101, dtype=np.uint16)
  short[[20, 50, 99]] = 0  # EOS ends three documents (for the packed rows)
  row_packing = packing.RowPacking('best_fit', 0) if packed else None
  (batch,) = eval_batches(short, seq_len=32, batch_size=4, num_batches=3, row_packing=row_packing)
  rows = 3 if not packed else len(row_packing.rows(short, 33))
  assert batch.tokens.shape == (4, 33) and batch.loss_mask.shape == (4, 32)
  assert not batch.tokens[rows:].any() and not batch.loss_mask[rows:].any()
  if not packed:
    np.testing.assert_array_equal(batch.tokens[:3].ravel(), short[:99])
    assert batch.loss_mask[:3].all()
  else:
    assert sorted(batch.tokens[:rows][batch.tokens[:rows] > 0]) == sorted(short[short > 0])
  full = eval_batches(np.arange(200, dtype=np.uint16), seq_len=32, batch_size=4, num_batches=3)
  assert len(full) == 1 and isinstance(full[0], np.ndarray)  # 6 windows: one full batch


# --- config resolution --------------------------------------------------------------------------


def test_load_data_default_and_prepared_dir(tmp_path):
  info, tok = load_data(_data_config(), tmp_path)
  assert info.dir == (tmp_path / 'data').resolve() and isinstance(tok, ByteTokenizer)
  assert info.train_tokens + info.val_tokens == len(default_corpus_text().encode('utf-8'))
  # A prepared directory is used as is, wherever the cache would go.
  again, _ = load_data(_data_config(path=str(info.dir)), tmp_path / 'elsewhere')
  assert again == info and not (tmp_path / 'elsewhere').exists()


def test_load_data_file_with_val_and_cache_dir(tmp_path, small_text_file, hf_tokenizer_file):
  config = _data_config(path=str(small_text_file), val_path=str(WIKITEXT_VALID),
                        tokenizer=str(hf_tokenizer_file), cache_dir=str(tmp_path / 'cache'))
  info, tok = load_data(config, tmp_path / 'run')
  assert info.dir == (tmp_path / 'cache').resolve() and isinstance(tok, HFTokenizer)
  assert info.tokenizer == tok.name and info.vocab_size == tok.vocab_size
  assert len(load_split(info, 'val')) == len(tok.encode(_text(WIKITEXT_VALID)))
  # Using the prepared dir with another tokenizer is refused.
  with pytest.raises(ConfigError, match='data.tokenizer'):
    load_data(_data_config(path=str(info.dir)), tmp_path)


def test_check_data_config_errors_and_writes_nothing(tmp_path, small_text_file):
  before = _tree(tmp_path)
  check_data_config(_data_config(path=str(small_text_file), cache_dir=str(tmp_path / 'cache')))
  check_data_config(_data_config())
  cases = {
      'data.path': _data_config(path=str(tmp_path / 'missing.txt')),
      'data.val_path': _data_config(val_path=str(tmp_path / 'missing.txt')),
      'data.tokenizer': _data_config(tokenizer=str(tmp_path / 'no_tokenizer.json')),
      'data.val_fraction': _data_config(val_fraction=0.9),
      'data.cache_dir': _data_config(cache_dir=str(small_text_file)),
  }
  for field, config in cases.items():
    with pytest.raises(ConfigError, match=field):
      check_data_config(config)
    with pytest.raises(ConfigError, match=field):
      load_data(config, tmp_path / 'run')
  with pytest.raises(ConfigError, match='data.tokenizer'):
    check_data_config(_data_config(tokenizer=''))
  with pytest.raises(ConfigError, match='data.cache_dir'):
    check_data_config(ml_collections.ConfigDict(
        dict(path='', val_path='', val_fraction=0.05, tokenizer='byte')))
  assert _tree(tmp_path) == before


def _documents(lengths, rng):
  """A stream of documents of these lengths (each ending with EOS 0, other ids 1..8)."""
  parts = [np.append(rng.integers(1, 9, n - 1), 0) for n in lengths]
  return np.concatenate(parts).astype(np.uint16), np.cumsum(lengths)


def test_rows_of_whole_documents():
  """data.pack='documents' (RowPacking 'documents'): rows in stream order cover it once; a
  document that fits in a row is never cut and rows start at document starts, except the pieces
  of a document longer than a row; each row is filled greedily (the next document did not fit)."""
  rng = np.random.default_rng(5)
  lengths = list(rng.integers(1, 12, 300)) + [30, 3, 25]  # some longer than the window
  tokens, ends = _documents(lengths, rng)
  window = 9
  rows = packing.RowPacking('documents', 0).rows(tokens, window)
  assert rows.offsets.tolist() == list(range(len(rows) + 1))  # one span per row
  starts, sizes = rows.starts, rows.sizes()
  assert starts[0] == 0 and np.all(starts[1:] == starts[:-1] + sizes[:-1])
  assert starts[-1] + sizes[-1] == len(tokens) and np.all((sizes >= 1) & (sizes <= window))
  doc_starts = np.concatenate([[0], ends[:-1]])
  long_doc = {int(s): int(e) for s, e in zip(doc_starts, ends) if e - s > window}
  for start, size in zip(starts.tolist(), sizes.tolist()):
    end = start + size
    inside = [(s, e) for s, e in zip(doc_starts.tolist(), ends.tolist()) if s < end and e > start]
    for s, e in inside:  # documents that fit in a row lie whole in one
      assert s in long_doc or (start <= s and e <= end), (start, end, s, e)
    nxt = np.searchsorted(doc_starts, end)
    if nxt < len(doc_starts) and doc_starts[nxt] == end and end - start < window:
      assert ends[nxt] - start > window  # the next document did not fit
  # A trailing document without EOS is a document too.
  rows = packing.RowPacking('documents', 0).rows(np.array([3, 4, 0, 5, 6], np.uint16), 4)
  assert rows.starts.tolist() == [0, 3] and rows.lengths.tolist() == [3, 2]


def test_token_stream_slices_equal_its_gather(tmp_path):
  """TokenStream's slices of step 1 are copied part by part (a packed row's spans, the scans of
  a split): the tokens and mask the same as gathered index by index, across segments of
  several shards (with and without a mask), empty and out-of-range bounds included."""
  rng = np.random.default_rng(2)
  segments, tokens, masks = [], [], []
  for i, (first, count) in enumerate([(3, 10), (0, 7), (29, 1), (5, 20)]):
    ids = rng.integers(0, 1000, 30).astype('<u2')
    ids.tofile(tmp_path / f'train-{i}.bin')
    mask = (rng.random(30) < 0.5).astype(np.uint8)
    mask.tofile(tmp_path / f'train-{i}.mask')
    segments.append((str(tmp_path / f'train-{i}.bin'),
                     str(tmp_path / f'train-{i}.mask') if i % 2 else None, first, count))
    tokens.append(ids[first:first + count])
    masks.append(mask[first:first + count] if i % 2 else np.ones(count, np.uint8))
  stream = TokenStream(segments, 'uint16')
  tokens, masks = np.concatenate(tokens), np.concatenate(masks)
  for a in range(len(tokens) + 2):
    for b in range(a, len(tokens) + 3):
      np.testing.assert_array_equal(stream[a:b], tokens[a:b])
      np.testing.assert_array_equal(stream.mask(slice(a, b)), masks[a:b])
  np.testing.assert_array_equal(stream[1::3], tokens[1::3])  # other steps: gathered


def _best_fit_loads(sizes, capacity):
  """The loads of the bins best-fit decreasing fills (a plain reference: the fullest open bin
  that holds each item, longest first). Which of several equally full bins takes an item does
  not change the loads, so any tie-break gives these."""
  loads = []
  for size in sorted(sizes, reverse=True):
    fits = [i for i, load in enumerate(loads) if load + size <= capacity]
    if fits:
      loads[max(fits, key=lambda i: loads[i])] += size
    else:
      loads.append(size)
  return loads


def test_rows_packed_best_fit(monkeypatch):
  """data.pack='best_fit': the rows hold every token of the stream once, each document whole in
  one row (a long one: row-sized pieces from its start, each a row, then its remainder), spans in
  stream order within a row; the rows of each block of documents have the loads best-fit
  decreasing gives, so fewer rows than in stream order."""
  block = 50
  monkeypatch.setattr(packing, 'BEST_FIT_BLOCK', block)  # several blocks
  rng = np.random.default_rng(11)
  lengths = list(rng.integers(1, 12, 230)) + [30, 3, 26] + list(rng.integers(1, 12, 20))
  tokens, ends = _documents(lengths, rng)
  tokens = tokens[:-1]  # the last document has no EOS (last in its row)
  ends[-1] -= 1
  window = 13
  rows = packing.RowPacking('best_fit', 0).rows(tokens, window)
  covered = np.zeros(len(tokens), int)
  for row in range(len(rows)):
    spans = rows.spans(row)
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    for start, length in spans:
      covered[start:start + length] += 1
  assert np.all(covered == 1) and rows.sizes().max() <= window
  spans = list(zip(rows.starts.tolist(), rows.lengths.tolist()))
  doc_starts = np.concatenate([[0], ends[:-1]]).tolist()
  want_loads = []
  for first in range(0, len(ends), block):
    packed = []  # what best-fit packs in this block: whole documents and remainders
    for start, end in zip(doc_starts[first:first + block], ends[first:first + block].tolist()):
      while end - start > window:  # a piece: a row of its own
        row = np.searchsorted(rows.offsets, spans.index((start, window)), 'right') - 1
        assert rows.spans(row) == [(start, window)]
        want_loads.append(window)
        start += window
      assert (start, end - start) in spans  # a document is one span: whole in one row
      packed.append(end - start)
    want_loads += _best_fit_loads(packed, window)
  assert sorted(rows.sizes().tolist()) == sorted(want_loads)
  assert len(rows) < len(packing.RowPacking('documents', 0).rows(tokens, window))


def _best_fit_bins(sizes, capacity):
  """Best-fit decreasing one item at a time (a plain reference with packing's tie-break): of the
  open bins that hold an item, the one with the least room, among those the one that came to that
  room last."""
  bins, rooms, since = [0] * len(sizes), [], []  # per open bin: room, when it got that room
  for clock, item in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
    fits = [b for b, room in enumerate(rooms) if room >= sizes[item]]
    if fits:
      b = min(fits, key=lambda b: (rooms[b], -since[b]))
    else:
      b = len(rooms)
      rooms.append(capacity)
      since.append(clock)
    bins[item] = b
    rooms[b] -= sizes[item]
    since[b] = clock
  return bins


@pytest.mark.parametrize('seed', range(6))
def test_best_fit_places_runs_of_one_size_as_one_at_a_time(seed):
  """packing places a run of equal sizes a group of bins at a time; the bins are those of one
  item at a time, exactly (bin numbers, ties), with many runs and bins of several rooms."""
  rng = np.random.default_rng(seed)
  capacity = int(rng.integers(2, 40))
  sizes = rng.integers(1, capacity + 1, int(rng.integers(1, 400)))
  if seed % 2:  # mostly small items: bins that take several of a run
    sizes = np.minimum(sizes, max(1, capacity // 5))
  got = packing._best_fit_decreasing(sizes.astype(np.int64), capacity)
  assert got.tolist() == _best_fit_bins(sizes.tolist(), capacity)


def test_best_fit_rows_are_not_longest_first():
  """Best-fit opens the rows of the longest documents first; validation batches are a split's
  first rows, so the rows come shuffled (fixed) to make those a fair sample of its documents."""
  rng = np.random.default_rng(3)
  lengths = [12] * 20 + list(rng.integers(1, 4, 200))  # 20 long documents, each fills a row
  rng.shuffle(lengths)
  tokens, _ = _documents(lengths, rng)
  rows = packing.RowPacking('best_fit', 0).rows(tokens, 13)
  holds_long = [any(n == 12 for _, n in rows.spans(row)) for row in range(len(rows))]
  assert sum(holds_long) == 20 and sum(holds_long[:20]) < 15
  again = packing.RowPacking('best_fit', 0).rows(tokens, 13)
  assert all(np.array_equal(a, b) for a, b in zip(dataclasses.astuple(rows),
                                                   dataclasses.astuple(again)))


@pytest.mark.parametrize('strategy', packing.STRATEGIES)
def test_row_starts_mark_spans_recorded_ends_and_padding(strategy):
  """packing.row_starts (Batch.starts of packed rows, documents as the stream records them): a
  row's marks are where each span after its first begins, where a recorded document end falls
  inside a span, and where its padding begins; nothing else (a plain walk over each row's
  spans, on rows whose spans straddle recorded ends)."""
  rng = np.random.default_rng(4)
  tokens, ends = _documents(list(rng.integers(1, 20, 300)), rng)
  rows = packing.RowPacking(strategy, 0).rows(tokens, 13)
  recorded = np.unique(np.concatenate([ends, rng.integers(1, len(tokens), 60)]))
  ids = rng.permutation(len(rows))[:40]
  got = packing.row_starts(rows, ids, 13, recorded)
  for i, row in enumerate(ids.tolist()):
    want, at = set(), 0
    for start, length in rows.spans(row):
      want |= {at} if at else set()
      want |= {at + e - start for e in recorded.tolist() if start < e < start + length}
      at += length
    want |= {at} if at < 13 else set()
    assert set(np.flatnonzero(got[i]).tolist()) == want, row


@pytest.mark.parametrize('strategy', packing.STRATEGIES)
def test_packed_sampler_and_eval_batches_pad_and_mask(strategy):
  """The sampler over rows of whole documents: each epoch visits every row once; a row is its
  documents then EOS padding, whose targets are not learned; eval batches are the rows in order."""
  rng = np.random.default_rng(7)
  tokens, _ = _documents(list(rng.integers(1, 8, 200)), rng)
  row_packing = packing.RowPacking(strategy, 0)
  rows = row_packing.rows(tokens, 9)
  row_of_start = {int(rows.starts[rows.offsets[r]]): r for r in range(len(rows))}

  def row_tokens(row):
    return np.concatenate([tokens[start:start + n] for start, n in rows.spans(row)])

  sampler = BatchSampler(tokens, seq_len=8, batch_size=4, microbatches=2, seed=2,
                         row_packing=row_packing)
  assert sampler.n_windows == len(rows) and sampler.has_mask
  seen = []
  for step in range(len(rows) // 8):
    batch = sampler.batch(step * 8)
    row_starts = sampler.window_starts(step * 8).reshape(-1)
    for i, start in enumerate(row_starts.tolist()):
      want = row_tokens(row_of_start[start])
      tok, mask = batch.tokens.reshape(-1, 9)[i], batch.loss_mask.reshape(-1, 8)[i]
      np.testing.assert_array_equal(tok[:len(want)], want)
      assert (tok[len(want):] == 0).all()
      assert mask.tolist() == [1] * (len(want) - 1) + [0] * (9 - len(want))
      seen.append(start)
  assert len(set(seen)) == len(seen)  # no row twice within the epoch
  evals = eval_batches(tokens, seq_len=8, batch_size=4, num_batches=3, row_packing=row_packing)
  for i, batch in enumerate(evals):
    for row in range(4):
      want = row_tokens(i * 4 + row)
      np.testing.assert_array_equal(batch.tokens[row, :len(want)], want)
      assert batch.loss_mask[row].sum() == len(want) - 1


def test_a_mixture_says_how_often_each_source_is_read():
  """With a mixture the weights, not the sources' sizes, decide how often each is read: one
  epoch of the whole (the windows of both) reads a small source weighted 3:1 many times over
  and a large one partly. source_passes says so, as the samples drawn count them."""
  from megatrain_jax.data import MixtureSplit  # pylint: disable=import-outside-toplevel
  from megatrain_jax.data import mixture  # pylint: disable=import-outside-toplevel
  small, large = np.arange(10 * 17, dtype=np.int32), np.arange(1000 * 17, dtype=np.int32)
  sampler = BatchSampler(MixtureSplit((3.0, 1.0), (small, large)), seq_len=16, batch_size=1,
                         microbatches=1, seed=0)
  assert sampler.n_windows == 1010
  sources, _ = sampler._locate(0, mixture.BLOCK)  # pylint: disable=protected-access
  drawn = np.bincount(sources, minlength=2) / np.array([10, 1000])
  assert sampler.source_passes(mixture.BLOCK) == pytest.approx(drawn.tolist())
  assert sampler.source_passes(sampler.n_windows) == pytest.approx([75.75, 0.2525])
  assert BatchSampler(small, seq_len=16, batch_size=1, microbatches=1,
                      seed=0).source_passes(10) == []
