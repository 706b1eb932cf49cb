"""Files another party gives (a downloaded checkpoint's tokenizer files, a dataset, a prompts
file) are read in bounded memory and refused with a named error, not a traceback."""

import json

import pytest
import zstandard

from megatrain_jax.data import documents as documents_module
from megatrain_jax.data import formats, load_tokenizer
from megatrain_jax.errors import ConfigError
from test_data_formats import documents, tokenizer_dir  # noqa: F401  (fixtures)


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
