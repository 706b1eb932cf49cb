"""Files another party gives (a downloaded checkpoint's tokenizer files, a dataset, a prompts
file) are read in bounded memory and refused with a named error, not a traceback."""

import json

import numpy as np
import pytest
import zstandard

from megatrain_jax.data import documents as documents_module
from megatrain_jax.data import document_format, formats, load_tokenizer
from megatrain_jax.data import tokenizer as tokenizer_module
from megatrain_jax.errors import ConfigError
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
