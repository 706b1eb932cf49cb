"""Tests for how user data files are read (a review of the readers): a learned character a
byte-level BPE splits into several tokens, a glob that picks up a dataset card, JSON nulls, a
damaged Arrow stream or Parquet page, invalid UTF-8 that decodes to a surrogate, the prepare
step's memory, and sample.prompts files.

Everything is written under pytest's tmp_path; the tokenizers are trained here (no download).
The fixtures and writers are test_data_formats.py's.
"""

import numpy as np
import pytest

from megatrain_jax.data import load_tokenizer
from test_data_formats import (EOS, _prepared_chat, documents,  # noqa: F401  (fixtures)
                               tokenizer_dir)


# --- learned tokens: every token of a learned character ---------------------------------------


def test_every_token_of_a_learned_character_is_learned(tmp_path, tokenizer_dir):
  """A byte-level BPE that has not seen an emoji (or a rare CJK character) splits it into its
  bytes' tokens; each of them holds the completion's text, so each is learned (the first only
  was), as transformers' offsets of the same text say."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  tok = load_tokenizer(str(tokenizer_dir))
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir /
                                                                   'tokenizer.json'))
  assert len(tok.encode('😀')) == 4 and len(tok.encode('鱻')) == 3
  pairs = [('Question: say thanks', ' Thanks 😀'), ('Q:', '😀 fine'), ('Q: 鱻', '鱻'),
           ('Say 😀 back:', ' 😀😀'), ('Rare: ', '鱻 and 😀.')]
  for i, (prompt, completion) in enumerate(pairs):
    tokens, mask = _prepared_chat(tmp_path, tok, {'prompt': prompt, 'completion': completion},
                                  name=f'pair{i}')
    theirs = hf_tok(prompt + completion, return_offsets_mapping=True)
    assert tokens.tolist() == theirs['input_ids'] + [tok.token_id(EOS)]
    want = [int(end > len(prompt)) for _, end in theirs['offset_mapping']] + [1]
    assert mask.tolist() == want, (prompt, completion)
    assert tok.decode(tokens[mask == 1]).endswith(completion + EOS)
