"""Files another party gives (a downloaded checkpoint's tokenizer files, a dataset, a prompts
file) are read in bounded memory and refused with a named error, not a traceback."""

import json
import random

import numpy as np
import pytest
import zstandard

from megatrain_jax.data import documents as documents_module
from megatrain_jax.data import (ByteTokenizer, document_format, formats, load_tokenizer,
                                 prepare_dataset)
from megatrain_jax.data import tokenizer as tokenizer_module
from megatrain_jax.errors import ConfigError
from megatrain_jax.hf import format as hf_format
from test_data_formats import _Recording, documents, tokenizer_dir  # noqa: F401  (fixtures)


def test_a_prompts_file_larger_than_it_may_be_is_refused_unread(tmp_path):
  """sample.prompts was read whole (a .zst of a few KB decompressed to any size in memory):
  more than MAX_PROMPTS_BYTES is refused, naming the file, its size and the limit."""
  limit = formats.MAX_PROMPTS_BYTES
  big = tmp_path / 'prompts.txt'
  big.write_bytes(b'a' * (limit + 1))
  with pytest.raises(ConfigError, match=rf'sample\.prompts: {big} is {limit + 1:,} bytes, more '
                     rf'than the {limit:,} read at most; prompts are read whole'):
    formats.read_prompts(big)
  bomb = tmp_path / 'prompts.txt.zst'
  bomb.write_bytes(zstandard.ZstdCompressor().compress(b'a' * (limit + 1)))
  with pytest.raises(ConfigError, match=rf'{bomb} is [\d,]+ bytes \(more decompressed\), more '
                     rf'than the {limit:,} read at most'):
    formats.read_prompts(bomb)
  small = tmp_path / 'ok.txt'
  small.write_text('Once\nupon\n')
  assert formats.read_prompts(small) == ['Once', 'upon']


def test_a_tokenizer_config_larger_than_it_may_be_is_refused_unread(tmp_path, tokenizer_dir):
  """tokenizer_config.json (of a downloaded checkpoint) was read whole, whatever its size: more
  than MAX_TOKENIZER_CONFIG_BYTES is refused, naming the file, its size and the limit."""
  limit = documents_module.MAX_TOKENIZER_CONFIG_BYTES
  directory = tmp_path / 'tok'
  directory.mkdir()
  (directory / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  config = json.dumps({'eos_token': '<|endoftext|>', 'pad': 'a' * limit})
  (directory / 'tokenizer_config.json').write_text(config)
  tok = load_tokenizer(str(directory))
  with pytest.raises(ConfigError, match=rf'data\.tokenizer: .*tokenizer_config\.json is '
                     rf'{len(config):,} bytes, more than the {limit:,} read at most'):
    documents_module.read_tokenizer_config(tok)


def test_metadata_json_larger_than_it_may_be_is_refused_unread(tmp_path, tokenizer_dir,
                                                               monkeypatch):
  """A checkpoint's config.json, its weight index and generation_config.json were read whole,
  whatever their size: more than fs.MAX_METADATA_BYTES is refused naming the file, its size and
  the limit (each is KB to a few MB)."""
  from megatrain_jax import fs  # pylint: disable=import-outside-toplevel
  from megatrain_jax.data import generation  # pylint: disable=import-outside-toplevel
  limit = 4096
  monkeypatch.setattr(fs, 'MAX_METADATA_BYTES', limit)
  big = json.dumps({'architectures': ['LlamaForCausalLM'], 'pad': 'a' * limit})
  model = tmp_path / 'model'
  model.mkdir()
  (model / 'config.json').write_text(big)
  refused = rf'{{}} is {len(big):,} bytes, more than the {limit:,} read at most'
  with pytest.raises(ConfigError, match=refused.format(r'.*config\.json')):
    hf_format.read_hf_config(model)
  (model / 'config.json').write_text('{}')
  (model / 'model.safetensors.index.json').write_text(big)
  with pytest.raises(ConfigError, match=refused.format(r'.*model\.safetensors\.index\.json')):
    hf_format._weight_files(model)  # pylint: disable=protected-access
  tok_dir = tmp_path / 'tok'
  tok_dir.mkdir()
  (tok_dir / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  (tok_dir / 'generation_config.json').write_text(big)
  with pytest.raises(ConfigError, match=refused.format(r'--sample: .*generation_config\.json')):
    generation.read_generation_config(load_tokenizer(str(tok_dir)))


class _RecordingOffsets(_Recording):
  def encodings(self, texts):
    self.longest = max([self.longest] + [len(t) for t in texts])
    return self.tokenizer.encodings(texts)


def test_a_long_record_is_tokenized_in_pieces_to_the_ids_of_the_whole(tokenizer_dir, documents,
                                                                     monkeypatch):
  """A record (up to 256 MB) was tokenized whole, ~190 bytes of memory a character (a 16 MB
  record: 3.2 GB; 256 MB: ~50 GB): a long text, or a long document of several parts (a prompt
  and its completion, tokenized joined), is tokenized in pieces cut where the ids do not change,
  to the ids and loss mask of the whole, its ids kept an array."""
  text = '\n'.join(documents[:60])
  docs = [[(text, True)], [('Question: ', False), (text[:-1], True), ('.', False)],
          [('short', True)]]
  tok = load_tokenizer(str(tokenizer_dir))
  fmt = document_format(tok)
  whole = documents_module.encode_documents(docs, tok, fmt, np.int32)
  assert whole[1] is not None and 0 < whole[1].sum() < len(whole[1])  # a mask to compare
  assert whole[0][:whole[2][0] - 1].tolist() == tok.encode(text).tolist()
  monkeypatch.setattr(tokenizer_module, 'PIECE_CHARS', 2000)
  assert len(text) > 20 * tokenizer_module.PIECE_CHARS
  recording = _RecordingOffsets(tok)
  pieces = documents_module.encode_documents(docs, recording, fmt, np.int32)
  assert recording.longest < 3 * tokenizer_module.PIECE_CHARS  # pieces, not the whole record
  for got, want in zip(pieces, whole):
    assert np.array_equal(got, want)


def test_a_tokenizer_whose_regex_makes_the_library_panic_is_named(tmp_path, tokenizer_dir):
  """A Split pattern that backtracks past Oniguruma's retry limit makes the tokenizers library
  panic on some texts: pyo3's PanicException, a BaseException, went past every `except
  Exception` as a Rust traceback. It is a ConfigError naming the tokenizer file and why."""
  spec = json.loads((tokenizer_dir / 'tokenizer.json').read_text())
  spec['pre_tokenizer'] = {'type': 'Split', 'pattern': {'Regex': r'(\w+\s?)*$'},
                           'behavior': 'Isolated', 'invert': False}
  directory = tmp_path / 'tok'
  directory.mkdir()
  (directory / 'tokenizer.json').write_text(json.dumps(spec))
  (directory / 'tokenizer_config.json').write_bytes(
      (tokenizer_dir / 'tokenizer_config.json').read_bytes())
  tok = load_tokenizer(str(directory))
  assert tok.encode('fine text').size  # texts that do not backtrack are encoded
  source = tmp_path / 'panic.jsonl'
  source.write_text(json.dumps({'text': 'aaaa ' * 20 + '!'}) + '\n')
  with pytest.raises(ConfigError, match=rf'data\.tokenizer: {directory}/tokenizer\.json failed on '
                     r'a text: the tokenizers library panicked \(.*retry-limit'):
    prepare_dataset(tmp_path / 'out', tok, train_sources=[source], doc_format=document_format(tok))


def test_random_or_damaged_bytes_named_arrow_are_refused_naming_the_file(tmp_path):
  """Random bytes named .arrow raised pyarrow's OSError ('Invalid IPC stream: negative
  continuation token') as a traceback, and a damaged string (not UTF-8) a UnicodeDecodeError:
  both are ConfigErrors naming the file (and the rows)."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet  # pylint: disable=import-outside-toplevel,unused-import
  noise = tmp_path / 'noise.arrow'
  noise.write_bytes(random.Random(0).randbytes(4096))
  with pytest.raises(ConfigError, match=rf'data\.path: {noise} is not a readable Arrow IPC file'):
    prepare_dataset(tmp_path / 'o1', ByteTokenizer(), train_sources=[noise])
  table = pa.table({'text': [f'record {i} ' * 5 for i in range(100)]})
  good = tmp_path / 'good.arrow'
  with pa.ipc.new_stream(str(good), table.schema) as writer:
    for batch in table.to_batches(max_chunksize=50):
      writer.write_batch(batch)
  damaged = tmp_path / 'damaged.arrow'
  data = good.read_bytes()
  damaged.write_bytes(data.replace(b'record 60 ', b'\xffecord 60 ', 1))
  with pytest.raises(ConfigError, match=rf'data\.path: {damaged}: rows 50 to 99 cannot be read '
                     r'\(.*UTF8.*\); the file is damaged'):
    prepare_dataset(tmp_path / 'o2', ByteTokenizer(), train_sources=[damaged])
  # Given as the validation data, the option named is that one (it said data.path).
  with pytest.raises(ConfigError, match=rf'data\.val_path: {damaged}: rows 50 to 99 cannot be '
                     r'read .*remove it from data\.val_path\.'):
    prepare_dataset(tmp_path / 'o3', ByteTokenizer(), train_sources=[good],
                    val_sources=[damaged])
  parquet = tmp_path / 'damaged.parquet'
  pa.parquet.write_table(table, parquet, compression='none', row_group_size=50)
  parquet.write_bytes(parquet.read_bytes().replace(b'record 60 ', b'\xffecord 60 ', 1))
  with pytest.raises(ConfigError, match=rf'data\.val_path: {parquet}: rows 50 to 99 cannot be '
                     r'read .*remove it from data\.val_path\.'):
    prepare_dataset(tmp_path / 'o4', ByteTokenizer(), train_sources=[good],
                    val_sources=[parquet])


def test_json_nested_deeper_than_python_reads_is_named(tmp_path, tokenizer_dir):
  """200,000 nested '[' raised RecursionError (a traceback) from json.loads in a JSONL record,
  a tokenizer_config.json or a config.json; a record nested a little less deep, from reading
  it. Each is malformed JSON or a bad record, named."""
  deep = '[' * 200_000 + ']' * 200_000
  source = tmp_path / 'deep.jsonl'
  source.write_text(f'{{"text": "ok"}}\n{{"text": {deep}}}\n')
  with pytest.raises(ConfigError, match=rf'bad record {source}:2: malformed JSON \(nested deeper '
                     r'than Python reads JSON'):
    prepare_dataset(tmp_path / 'o1', ByteTokenizer(), train_sources=[source])
  nested = []
  for _ in range(5000):  # parsed where the stack was shallower, read deeper
    nested = [nested]
  with pytest.raises(documents_module.BadRecord, match='nested too deep to read'):
    documents_module.record_parts({'text': 'a', 'm': nested}, document_format(ByteTokenizer()))
  directory = tmp_path / 'model'
  directory.mkdir()
  (directory / 'tokenizer.json').write_bytes((tokenizer_dir / 'tokenizer.json').read_bytes())
  (directory / 'tokenizer_config.json').write_text(f'{{"eos_token": "<|endoftext|>", "x": {deep}}}')
  with pytest.raises(ConfigError, match=r'data\.tokenizer: .*tokenizer_config\.json is not valid '
                     r'JSON \(nested deeper than Python reads JSON'):
    document_format(load_tokenizer(str(directory)))
  (directory / 'config.json').write_text(deep)
  with pytest.raises(ConfigError, match=r'cannot parse .*config\.json: nested deeper than Python'):
    hf_format.read_hf_config(directory)
