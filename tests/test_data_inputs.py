"""Tests for how user data files are read (a review of the readers): a learned character a
byte-level BPE splits into several tokens, a glob that picks up a dataset card, JSON nulls, a
damaged Arrow stream or Parquet page, invalid UTF-8 that decodes to a surrogate, the prepare
step's memory, sample.prompts with a BOM, compressed names, NUL offsets, and a chat template
that rewrites earlier turns (Qwen3's thinking).

Everything is written under pytest's tmp_path; the tokenizers are trained here (no download).
The fixtures and writers are test_data_formats.py's.
"""

import dataclasses
import gzip
import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megatrain_jax.data import (ByteTokenizer, TokenStream, check_data_config, document_format,
                                load_data, load_tokenizer, prepare_dataset, read_prompts)
from megatrain_jax.data import documents as documents_module
from megatrain_jax.data import formats
from megatrain_jax.data import prepare as prepare_module
from megatrain_jax.data import shards as shards_module
from megatrain_jax.errors import ConfigError

from helpers import QWEN3_TEMPLATE_HEAD
from test_data_formats import (CONVERSATION, EOS, _data_config, _prepared_chat, _stream,
                               _tokenizer_with, _tool_chat_tokenizer, _write_jsonl, documents,
                               tokenizer_dir)  # noqa: F401  (fixtures)


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


# --- sources: a glob that matches a dataset card ------------------------------------------------


def test_a_file_a_directory_reaches_by_two_names_is_read_once(tmp_path):
  """A symlink beside its target (latest.jsonl -> 2024-05.jsonl) in a directory or a pattern's
  matches is one file, read once in its first place; a file named twice in data.path is read
  twice, as asked."""
  from megatrain_jax.data import formats  # pylint: disable=import-outside-toplevel
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  _write_jsonl(corpus / '2024-05.jsonl', [{'text': 'may'}])
  _write_jsonl(corpus / '2024-06.jsonl', [{'text': 'june'}])
  (corpus / 'latest.jsonl').symlink_to('2024-06.jsonl')
  want = [corpus / '2024-05.jsonl', corpus / '2024-06.jsonl']
  assert formats.expand_sources([corpus], 'data.path') == want
  assert formats.expand_sources([f'{corpus}/*.jsonl'], 'data.path') == want
  twice = formats.expand_sources([corpus / 'latest.jsonl', corpus / '2024-06.jsonl'], 'data.path')
  assert twice == [corpus / '2024-06.jsonl'] * 2


def test_a_pattern_matching_records_and_text_is_refused_as_a_directory_is(tmp_path):
  """A Hub repository's files matched by 'D/*' (README.md, .gitattributes, train.jsonl): the
  card would run, as raw text, into the first record, as with data.path=D, so the pattern is
  refused the same way, in every field that reads sources (eval.path too), before anything is
  written; the records' own pattern, or data.text_documents, reads."""
  from megatrain_jax import evaluate  # pylint: disable=import-outside-toplevel
  hub = tmp_path / 'hub'
  hub.mkdir()
  (hub / 'README.md').write_text('---\nlicense: mit\n---\n# A dataset card\n')
  (hub / '.gitattributes').write_text('*.jsonl filter=lfs\n')
  _write_jsonl(hub / 'train.jsonl', [{'text': 'hello'}, {'text': 'world'}])
  (tmp_path / 'x.txt').write_text('x' * 100)
  for pattern in (f'{hub}/*', f'{tmp_path}/**/*[dl]'):
    for field in ('path', 'val_path', 'mixture'):
      value = f'1:{pattern}' if field == 'mixture' else pattern
      other = {'path': str(tmp_path / 'x.txt')} if field == 'val_path' else {}
      with pytest.raises(ConfigError, match=rf'data.{field}: the pattern .* mixes record files '
                         r'\(train.jsonl\) with text files \(README.md\).*'
                         r"point data\.\w+ at the records, e.g. '.*/hub/\*.jsonl'.*"
                         r'data.text_documents=True'):
        check_data_config(_data_config(**{field: value}, **other))
    with pytest.raises(ConfigError, match=r'data.path: the pattern .* mixes record files'):
      load_data(_data_config(path=pattern, cache_dir=str(tmp_path / 'out')), tmp_path)
    with pytest.raises(ConfigError, match=r'eval.path: the pattern .* mixes record files.*move '
                       r'the text files out\.$'):
      evaluate.read_eval_data(pattern, ByteTokenizer())
  assert not (tmp_path / 'out').exists()
  info, _ = load_data(_data_config(path=f'{hub}/*.jsonl', cache_dir=str(tmp_path / 'o1'),
                                   val_fraction=0.5), tmp_path)
  assert bytes(_stream(info).astype(np.uint8)) == b'hello\0world\0'
  info, _ = load_data(_data_config(path=f'{hub}/*', cache_dir=str(tmp_path / 'o2'),
                                   text_documents=True, val_fraction=0.5), tmp_path)
  assert info.stats['documents'] == 3


# --- JSON nulls: a JSON line reads as its Parquet row -------------------------------------------


def test_json_lines_with_nulls_read_as_their_parquet_rows(tmp_path, tokenizer_dir):
  """`Dataset.to_json()` and pandas write every column of a mixed dataset into every line,
  null where the record has none (`{"text": null, "messages": [...]}`), and a chat turn's
  absent tool_calls as `"tool_calls": null`: those lines read as the same rows of Parquet do
  (they were bad records); a null that leaves nothing to read says it is null, in both."""
  tok = _tool_chat_tokenizer(tmp_path, tokenizer_dir)
  records = [{'messages': [{'role': 'user', 'content': 'weather?'},
                           {'role': 'assistant', 'content': '',
                            'tool_calls': [{'name': 'get_weather'}]}],
              'tools': [{'name': 'get_weather'}]},
             {'text': 'a plain text record'},
             {'messages': [{'role': 'user', 'content': 'hi'},
                           {'role': 'assistant', 'content': 'hello'}]},
             {'prompt': 'Q: 2+2?', 'completion': ' 4'}]
  columns = dict.fromkeys(k for r in records for k in r)  # from_pylist: the first row's only
  table = pa.table({k: [r.get(k) for r in records] for k in columns})
  rows = table.to_pylist()  # every column in every row, nulls where a record has none
  assert rows[1]['messages'] is None and rows[2]['messages'][1]['tool_calls'] is None
  (tmp_path / 'mixed.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  pq.write_table(table, tmp_path / 'mixed.parquet')
  want = [_prepared_chat(tmp_path, tok, r, name=f'one{i}') for i, r in enumerate(records)]
  for ext in ('.jsonl', '.parquet'):
    info = prepare_dataset(tmp_path / f'o{ext}', tok, val_fraction=0.5,
                           train_sources=[tmp_path / f'mixed{ext}'])
    whole = TokenStream(info.splits['train'] + info.splits['val'], info.dtype)
    assert whole[:].tolist() == [t for tokens, _ in want for t in tokens.tolist()], ext
    assert whole.mask(slice(0, len(whole))).tolist() == [
        m for _, mask in want for m in mask.tolist()], ext
  pq.write_table(pa.table({'text': ['fine', None]}), tmp_path / 'null.parquet')
  (tmp_path / 'null.jsonl').write_text('{"text": "fine"}\n{"text": null}\n')
  for name, where in (('null.parquet', r'null.parquet: row 1'), ('null.jsonl', r'null.jsonl:2')):
    with pytest.raises(ConfigError, match=rf"{where}: field 'text' is null, not a string\. "
                       'Fix the data, or set data.skip_bad_records=True'):
      load_data(_data_config(path=str(tmp_path / name), cache_dir=str(tmp_path / 'c')), tmp_path)


# --- damaged files: named, before anything is written where the up-front check reads them -------


def test_a_truncated_arrow_stream_is_named_as_a_truncated_arrow_file_is(tmp_path):
  """`save_to_disk`'s stream format cut short (a copy interrupted) read as far as its last whole
  record batch, then raised pyarrow's bare OSError ('Expected to be able to read ... bytes for
  message body'); it is refused naming the file and the batch, by the up-front check, before
  anything is written, as a truncated Arrow file-format file is."""
  from megatrain_jax import evaluate  # pylint: disable=import-outside-toplevel
  table = pa.table({'text': [f'record {i} ' * 20 for i in range(300)]})
  whole = tmp_path / 'whole.arrow'
  with pa.OSFile(str(whole), 'wb') as sink, pa.ipc.new_stream(sink, table.schema) as writer:
    for batch in table.to_batches(max_chunksize=50):
      writer.write_batch(batch)
  cut = tmp_path / 'cut.arrow'
  cut.write_bytes(whole.read_bytes()[:whole.stat().st_size * 2 // 3])
  message = (r'{field}: .*cut.arrow is not a readable Arrow IPC file \(record batch 4: .*\); it '
             r'is truncated or damaged: save or download it again, or remove it from {field}\.')
  with pytest.raises(ConfigError, match=message.format(field='data.path')):
    check_data_config(_data_config(path=str(cut)))
  with pytest.raises(ConfigError, match=message.format(field='data.path')):
    load_data(_data_config(path=str(cut), cache_dir=str(tmp_path / 'out')), tmp_path)
  assert not (tmp_path / 'out').exists()
  with pytest.raises(ConfigError, match=message.format(field='eval.path')):
    evaluate.read_eval_data(str(cut), ByteTokenizer())
  info, _ = load_data(_data_config(path=str(whole), cache_dir=str(tmp_path / 'ok')), tmp_path)
  assert info.stats['documents'] == 300


def test_a_damaged_parquet_page_is_named_and_leaves_nothing(tmp_path, monkeypatch):
  """A Parquet file whose footer is intact (the up-front check reads only it) but a data page
  is damaged (200 bytes flipped in its middle) crashed the prepare with pyarrow's 'OSError:
  Corrupt snappy compressed data.', naming nothing, and left an empty data directory; it is a
  ConfigError naming the file and the row group, in a worker process too, and the prepare
  leaves nothing behind: the data directory it made is gone, and a rerun on the mended file
  prepares it."""
  monkeypatch.setattr(prepare_module, '_POOL_MIN_BYTES', 0)
  rng = np.random.default_rng(0)
  rows = [f'record {i} ' + rng.bytes(48).hex() for i in range(8000)]
  good = tmp_path / 'good.parquet'
  pq.write_table(pa.table({'text': rows}), good, row_group_size=2000, compression='snappy')
  data = bytearray(good.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 200] = bytes(b ^ 0xff for b in data[middle:middle + 200])
  source = tmp_path / 'data.parquet'
  source.write_bytes(bytes(data))
  assert pq.ParquetFile(source).metadata.num_row_groups == 4  # the footer reads
  check_data_config(_data_config(path=str(source)))
  for workers in (1, 2):
    config = _data_config(path=str(source), cache_dir=str(tmp_path / 'run' / 'data'),
                          num_workers=workers)
    with pytest.raises(ConfigError, match=r'data.path: .*data.parquet: row group 2 \(rows from '
                       r'4000\) cannot be read \(OSError: .*\); the file is damaged: download or '
                       r'write it again, or remove it from data.path\.'):
      load_data(config, tmp_path / 'run')
    assert not (tmp_path / 'run').exists(), workers
  source.write_bytes(good.read_bytes())
  info, _ = load_data(config, tmp_path / 'run')
  assert info.stats['documents'] == len(rows)


def test_invalid_utf8_that_encodes_a_surrogate_is_a_bad_record(tmp_path, tokenizer_dir):
  """Bytes ED A0 80 are not UTF-8 (they encode half of a UTF-16 pair), but json.loads of bytes
  decodes them to a lone '\\ud800' (surrogatepass), which crashed the tokenizers (a
  UnicodeEncodeError, a TypeError), skip_bad_records or not: such a line is a bad record, named
  by its line, like other invalid UTF-8, and skipped with skip_bad_records."""
  source = tmp_path / 'sur.jsonl'
  source.write_bytes(b'{"text":"ok"}\n{"text":"bad \xed\xa0\x80"}\n{"text":"fine"}\n')
  other = tmp_path / 'latin1.jsonl'
  other.write_bytes(b'{"text":"ok"}\n{"text":"caf\xe9"}\n')
  for tok in (ByteTokenizer(), load_tokenizer(str(tokenizer_dir))):
    for path in (source, other):
      with pytest.raises(ConfigError, match=rf'{path.name}:2: not UTF-8 text \(byte 0x(ed|e9) at '
                         r'byte \d+ of the line: .*\); convert the file to UTF-8\. Fix the data'):
        prepare_dataset(tmp_path / 'o', tok, train_sources=[path])
    fmt = dataclasses.replace(document_format(tok), skip_bad_records=True)
    info = prepare_dataset(tmp_path / f'o-{tok.name[-8:]}', tok, train_sources=[source],
                           doc_format=fmt)
    assert info.stats['skipped_records'] == 1 and info.stats['documents'] == 2


# --- the prepare step's memory ------------------------------------------------------------------


def _census_by_hand(masks: list, ends: list, bos: bool) -> dict:
  """The mask census of shards (each a 0/1 mask, or None for all learned, and the shard-local
  ends of the documents ending in it), document by document."""
  stream = np.concatenate([np.ones(n, np.uint8) if m is None else m for m, n in masks])
  offsets = np.cumsum([0] + [n for _, n in masks])
  cuts = np.concatenate([np.asarray(e, np.int64) + o for e, o in zip(ends, offsets)])
  nothing = whole = 0
  for start, end in zip(np.concatenate([[0], cuts[:-1]]), cuts):
    learned, length = int(stream[start:end - 1].sum()), end - start - 1
    nothing += learned == 0
    whole += learned >= length - int(bos) and learned > 0
  return {'documents_learning_nothing': nothing, 'documents_learned_whole': whole}


def test_the_mask_census_reads_a_shard_in_bounded_memory(tmp_path, monkeypatch):
  """The census of what documents learn (prepare's warning, documents_learning_nothing) summed
  each shard's mask with np.add.reduceat in int64, a copy of 8 bytes a token (829 MB for a
  100 MB JSONL, 1.07 GB for a full default shard; the mask of text records is no file at all):
  it gives the counts a document-by-document count gives, in blocks, documents longer than a
  block and across shards included, and allocates a small part of the shard."""
  import tracemalloc  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)

  def shards(specs):
    records, masks, ends = [], [], []
    for index, (tokens, masked, cut) in enumerate(specs):
      mask = (rng.random(tokens) < 0.5).astype(np.uint8) if masked else None
      if masked and index % 2:
        mask[: tokens // 3] = 0  # a long document learning nothing
      doc_ends = np.unique(rng.integers(1, tokens + 1, cut)) if cut else np.array([], np.int64)
      (tmp_path / f'{index}.ends').write_bytes(doc_ends.astype(np.int64).tobytes())
      if masked:
        mask.tofile(tmp_path / f'{index}.mask')
      records.append({'tokens': tokens, 'ends': f'{index}.ends',
                      'mask': f'{index}.mask' if masked else None})
      masks.append((mask, tokens))
      ends.append(doc_ends)
    return {'streams': {'train': {'shards': records}}}, masks, ends

  monkeypatch.setattr(prepare_module, '_CENSUS_BLOCK_TOKENS', 500, raising=False)
  progress, masks, ends = shards([(3000, True, 40), (2000, False, 30), (4000, True, 3),
                                  (1000, True, 0), (3000, True, 200), (500, False, 5)])
  census = prepare_module._mask_census  # pylint: disable=protected-access
  for bos in (False, True):
    assert census(tmp_path, progress, bos) == _census_by_hand(masks, ends, bos)
  monkeypatch.undo()
  size = 16 << 20
  for masked in (False, True):
    progress, _, _ = shards([(size, masked, size // 200)])
    tracemalloc.start()
    census(tmp_path, progress, False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * size, (masked, peak)  # the int64 copy was 8 bytes a token


# --- smaller things: sample.prompts' BOM, compressed forms, NUL offsets ---------------------------


def test_a_prompts_file_with_a_bom_reads_as_without(tmp_path):
  """A UTF-8 BOM (Windows editors write one) is the file's encoding mark, not text: the first
  prompt of a text file did not start with '\\ufeff' any more than in training, and a .jsonl or
  .json file of prompts with one was refused as not JSON."""
  bom = b'\xef\xbb\xbf'
  cases = {'p.txt': (b'Once upon\n\nA time\n', ['Once upon', 'A time']),
           'p.jsonl': (b'{"prompt": "x"}\n{"prompt": "y"}\n', ['x', 'y']),
           'lines.json': (b'{"prompt": "x"}\n', ['x']),
           'array.json': (b'[{"prompt": "x"}, {"prompt": "y"}]', ['x', 'y'])}
  for name, (data, want) in cases.items():
    (tmp_path / name).write_bytes(bom + data)
    assert read_prompts(tmp_path / name) == want, name


def test_compressed_json_is_read_and_other_compressed_files_are_refused_naming_the_forms(
    tmp_path):
  """A .json.gz / .json.zst (an array of records, or lines) was read as text and refused as
  binary, with advice for UTF-16 text: it is read decompressed, as .json is (sample.prompts
  too); a compressed file of another kind (.txt.gz) is refused naming the forms read
  compressed, in data.path, a directory and eval.path, before anything is written."""
  from megatrain_jax import evaluate  # pylint: disable=import-outside-toplevel
  records = [{'instruction': f'Say {i}.', 'output': f'{i} said.'} for i in range(300)]
  array = json.dumps(records, indent=2).encode()
  lines = b''.join(json.dumps(r).encode() + b'\n' for r in records)
  (tmp_path / 'plain.json').write_bytes(array)
  want = _stream(prepare_dataset(tmp_path / 'o', ByteTokenizer(),
                                 train_sources=[tmp_path / 'plain.json']))
  for name, data in (('a.json.gz', gzip.compress(array)), ('l.json.gz', gzip.compress(lines)),
                     ('a.json.zst', zstandard.ZstdCompressor().compress(array)),
                     ('l.json.zst', zstandard.ZstdCompressor().compress(lines))):
    (tmp_path / name).write_bytes(data)
    got = prepare_dataset(tmp_path / f'o-{name}', ByteTokenizer(), train_sources=[tmp_path / name])
    assert np.array_equal(_stream(got), want), name
  assert len(read_prompts(tmp_path / 'a.json.gz')) == 300
  packed = gzip.compress(array)
  (tmp_path / 'cut.json.gz').write_bytes(packed[:len(packed) // 2])
  with pytest.raises(ConfigError, match=r'cut.json.gz: cannot read past line \d+ .*truncated'):
    prepare_dataset(tmp_path / 'o-cut', ByteTokenizer(), train_sources=[tmp_path / 'cut.json.gz'])
  text = tmp_path / 'texts'
  text.mkdir()
  (text / 'book.txt.gz').write_bytes(gzip.compress(b'Once upon a time. ' * 200))
  message = (r'{field}: .*book.txt.gz is compressed, and only JSON records are read compressed '
             r'\(.jsonl, .ndjson or .json, each .gz or .zst\); decompress it \(gunzip a .txt.gz '
             r'to .txt\), or remove it from {field}\.')
  for path in (text / 'book.txt.gz', text):
    with pytest.raises(ConfigError, match=message.format(field='data.path')):
      check_data_config(_data_config(path=str(path)))
    with pytest.raises(ConfigError, match=message.format(field='data.path')):
      load_data(_data_config(path=str(path), cache_dir=str(tmp_path / 'out')), tmp_path)
    with pytest.raises(ConfigError, match=message.format(field='eval.path')):
      evaluate.read_eval_data(str(path), ByteTokenizer())
  assert not (tmp_path / 'out').exists()


def test_a_nul_in_text_is_named_by_its_byte_offset_and_line(tmp_path):
  """A NUL past the checked head was named by its offset in characters, as if in bytes (40004
  for byte 80004 after 40000 two-byte characters): its byte offset and line, wherever it is."""
  late = tmp_path / 'late.txt'
  late.write_bytes('é'.encode() * 40000 + b'\nabc\0 tail\n')
  early = tmp_path / 'early.txt'
  early.write_bytes('é'.encode() * 10 + b'\n\nx\0y')
  for path, offset, line in ((late, 80004, 2), (early, 23, 3)):
    with pytest.raises(ConfigError, match=rf'{path.name} looks like a binary file, not text \(a '
                       rf'NUL character at offset {offset} \(line {line}\)\)'):
      prepare_dataset(tmp_path / 'o', ByteTokenizer(), train_sources=[path])


# --- chat templates that rewrite earlier turns ----------------------------------------------------


# A Qwen3-like template as its tokenizer_config.json has it (without the tool branches): an
# assistant turn's '<think>...</think>' is split off its content, and written back only for a turn
# after the last user message that is the last turn or has reasoning; so an earlier turn renders
# as its answer alone once a user turn follows it. GEN_OPEN / GEN_CLOSE: where transformers'
# `{% generation %}` version marks what an assistant turn learns.
QWEN3_THINKING = QWEN3_TEMPLATE_HEAD + (
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}GEN_OPEN"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}"
    "{%- else %}{{- content }}{%- endif %}"
    "{%- else %}{{- content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}GEN_CLOSE{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_drops_earlier_turns_thinking_learns_what_transformers_marks(
    tmp_path, tokenizer_dir):
  """Qwen3's template writes an assistant turn's thinking only while no user turn follows it,
  so a conversation cut after an earlier turn renders that turn otherwise than the whole does:
  such records were refused ('cannot be located'). Each turn is learned as the whole
  conversation renders it (an earlier one without its thinking, the last with it), token for
  token the mask transformers' apply_chat_template(return_assistant_tokens_mask=True) gives with
  the `{% generation %}` version of the template, and a conversation without thinking as before."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  template = QWEN3_THINKING.replace('GEN_OPEN', '').replace('GEN_CLOSE', '')
  marked = QWEN3_THINKING.replace('GEN_OPEN', '{% generation %}').replace(
      'GEN_CLOSE', '{% endgeneration %}')
  tok = _tokenizer_with(tmp_path / 'qwen3', tokenizer_dir, {'eos_token': EOS,
                                                            'chat_template': template})
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(tokenizer_dir / 'tokenizer.json'), eos_token=EOS, chat_template=marked)
  think = lambda reasoning, answer: f'<think>\n{reasoning}\n</think>\n\n{answer}'
  conversations = [
      [{'role': 'system', 'content': 'Be brief.'},
       {'role': 'user', 'content': 'Capital of France?'},
       {'role': 'assistant', 'content': think('France: Paris.', 'Paris.')},
       {'role': 'user', 'content': 'And Italy?'},
       {'role': 'assistant', 'content': think('Italy: Rome.', 'Rome.')},
       {'role': 'user', 'content': 'Spain?'},
       {'role': 'assistant', 'content': think('Spain: Madrid.', 'Madrid 😀')}],
      [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': think('hm', 'Hello.')},
       {'role': 'user', 'content': 'Bye'}, {'role': 'assistant', 'content': 'Bye.'}],
      [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello.'},
       {'role': 'user', 'content': 'Bye'}, {'role': 'assistant', 'content': 'Bye.'}]]
  for n, messages in enumerate(conversations):
    tokens, mask = _prepared_chat(tmp_path, tok, {'messages': messages}, name=f'c{n}')
    theirs = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert tokens.tolist() == theirs['input_ids'] + [tok.token_id(EOS)], n
    assert mask.tolist() == theirs['assistant_masks'] + [1], n
  tokens, mask = _prepared_chat(tmp_path, tok, {'messages': conversations[0]}, name='again')
  assert tok.decode(tokens[mask == 1]) == (
      'Paris.<|im_end|>\nRome.<|im_end|>\n<think>\nSpain: Madrid.\n</think>\n\nMadrid 😀'
      '<|im_end|>\n' + EOS)


# Mistral-7B-Instruct-v0.3's chat template as its tokenizer_config.json has it, without the tool
# branches: the system message goes into the last user turn only (GEN_* mark the reply for
# transformers' return_assistant_tokens_mask).
MISTRAL_V03_THINKING = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "GEN_OPEN{{- ' ' + message['content']|trim + eos_token }}GEN_CLOSE"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}"
    "{%- endif %}{%- endfor %}")


def test_a_template_that_writes_the_system_message_into_the_last_turn_only(tmp_path,
                                                                         tokenizer_dir, caplog):
  """Mistral v0.3's template writes the system message into the last user turn only, so a
  conversation cut before a reply renders otherwise than the whole (which ends with a reply, and
  so holds no system message): such records were refused, any with a system message. Each
  reply is found after the message before it, token for token the mask transformers'
  apply_chat_template(return_assistant_tokens_mask=True) gives with the `{% generation %}`
  version, and prepare warns that the system message is left out."""
  import transformers  # pylint: disable=import-outside-toplevel  (a dev dependency)
  template = MISTRAL_V03_THINKING.replace('GEN_OPEN', '').replace('GEN_CLOSE', '')
  marked = MISTRAL_V03_THINKING.replace('GEN_OPEN', '{% generation %}').replace(
      'GEN_CLOSE', '{% endgeneration %}')
  tok = _tokenizer_with(tmp_path / 'v03', tokenizer_dir, {
      'eos_token': EOS, 'bos_token': '<s>', 'add_bos_token': True, 'chat_template': template})
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(tokenizer_dir / 'tokenizer.json'), eos_token=EOS, bos_token='<s>',
      chat_template=marked)
  conversations = [CONVERSATION, CONVERSATION[:3], CONVERSATION[1:]]
  for n, messages in enumerate(conversations):
    caplog.clear()
    with caplog.at_level('WARNING'):
      tokens, mask = _prepared_chat(tmp_path, tok, {'messages': messages}, name=f'c{n}')
    assert any('Mistral v0.3' in r.getMessage() for r in caplog.records)
    theirs = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert tokens.tolist() == theirs['input_ids'], n
    assert mask.tolist() == theirs['assistant_masks'], n
  assert tok.decode(tokens[mask == 1]) == f' Paris.{EOS} Rome.{EOS}'
  caplog.clear()  # data prepared already: nothing read, nothing said
  with caplog.at_level('WARNING'):
    prepare_dataset(tmp_path / 'c2-out', tok, train_sources=[tmp_path / 'c2.jsonl'],
                    val_fraction=0.5)
  assert not any('Mistral v0.3' in r.getMessage() for r in caplog.records)
  # A template that keeps the system message in a whole conversation gives no warning.
  assert not documents_module.drops_system_message(document_format(
      _tokenizer_with(tmp_path / 'kept', tokenizer_dir, {'eos_token': EOS, 'chat_template':
                                                         marked.replace('loop.last and ', '')})))


# --- untrusted files: memory bounded whatever a file holds --------------------------------------


def test_a_large_parquet_row_group_is_cut_into_tasks_of_bounded_size(tmp_path, monkeypatch):
  """pandas and pyarrow write up to a million rows in one row group, and a row group was one
  task, its rows all held as documents (1M rows of 1 KB: >8 GB). A row group is read a batch at
  a time and cut into tasks of about CHUNK_BYTES, which give the tokens row groups of 100 rows
  give, in a worker process too."""
  monkeypatch.setattr(formats, 'CHUNK_BYTES', 16 << 10)
  monkeypatch.setattr(prepare_module, '_POOL_MIN_BYTES', 0)
  rows = [f'row {i} ' + 'x' * (100 + i % 200) for i in range(3000)]  # ~600 KB
  one, many = tmp_path / 'one.parquet', tmp_path / 'many.parquet'
  pq.write_table(pa.table({'text': rows, 'id': list(range(3000))}), one, row_group_size=3000)
  pq.write_table(pa.table({'text': rows}), many, row_group_size=100)
  assert pq.ParquetFile(one).metadata.num_row_groups == 1
  tasks = list(formats.record_tasks(one, document_format(ByteTokenizer()), 'data.path'))
  assert len(tasks) >= 20
  first, done = 0, 0
  for task, position in tasks:
    assert sum(batch.nbytes for batch in task.batches) < 2 * formats.CHUNK_BYTES
    assert task.first_row == first and position >= done
    first += sum(batch.num_rows for batch in task.batches)
    done = position
  assert first == len(rows) and done <= one.stat().st_size
  expected = _stream(prepare_dataset(tmp_path / 'many', ByteTokenizer(), train_sources=[many]))
  assert expected.size > len(''.join(rows))
  for workers in (1, 2):
    info = prepare_dataset(tmp_path / f'one{workers}', ByteTokenizer(), train_sources=[one],
                           num_workers=workers)
    np.testing.assert_array_equal(_stream(info), expected)
  # An interrupted prepare of an earlier version counted one task per row group: its resume
  # point is not taken (the shards it recorded are written again); this version's is.
  commit = shards_module.ShardWriter._commit  # pylint: disable=protected-access

  def dying_commit(self, *args):
    commit(self, *args)
    if len(self.shards) == 3:
      raise KeyboardInterrupt

  for version, rewritten in ((prepare_module._TASKS_VERSION, False), (None, True)):  # pylint: disable=protected-access
    out = tmp_path / f'killed{version}'
    monkeypatch.setattr(shards_module.ShardWriter, '_commit', dying_commit)
    with pytest.raises(KeyboardInterrupt):
      prepare_dataset(out, ByteTokenizer(), train_sources=[one], shard_tokens=20000)
    monkeypatch.setattr(shards_module.ShardWriter, '_commit', commit)
    progress = json.loads((out / 'prepare.json').read_text())
    progress['tasks'] = version
    (out / 'prepare.json').write_text(json.dumps(progress))
    before = (out / 'train-00000.bin').stat().st_mtime_ns
    np.testing.assert_array_equal(_stream(prepare_dataset(
        out, ByteTokenizer(), train_sources=[one], shard_tokens=20000)), expected)
    assert ((out / 'train-00000.bin').stat().st_mtime_ns != before) == rewritten, version


def test_a_zstd_stream_is_decompressed_a_bounded_piece_at_a_time(tmp_path):
  """A few KB of zstd may hold gigabytes: each 1 MB of input was decompressed whole and the rest
  copied on every read (a 131 KB .jsonl.zst of 4 GiB: >6 GB, in the up-front check too). The
  decompressor is fed a block at a time: the check and a whole read hold a few MB, and give the
  same bytes, multi-frame streams and checksums included."""
  import tracemalloc  # pylint: disable=import-outside-toplevel
  line = json.dumps({'text': 'a' * 1000}).encode() + b'\n'
  compressor = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj()
  parts = [compressor.compress(line * 1024) for _ in range(64)]  # 64 MB
  path = tmp_path / 'bomb.jsonl.zst'
  path.write_bytes(b''.join(parts) + compressor.flush() + zstandard.ZstdCompressor().compress(
      b'{"text": "last"}\n'))
  assert path.stat().st_size < (1 << 20)
  tracemalloc.start()
  try:
    assert formats.check_head(path, document_format(ByteTokenizer()), 'data.path') == -1
    head_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    total, tail = 0, b''
    with open(path, 'rb') as raw:
      stream = formats.open_decompressed(path, raw)
      while block := stream.read1(1 << 20):
        total += len(block)
        tail = (tail + block)[-2000:]
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert total == 64 * 1024 * len(line) + 17 and tail.endswith(line + b'{"text": "last"}\n')
  assert head_peak < (8 << 20) and peak < (8 << 20), (head_peak, peak)


def test_a_text_line_longer_than_a_chunk_is_read_in_pieces(tmp_path, tokenizer_dir):
  """f.readlines(chunk) read a line whole: a text without newlines (text8: 100 MB on one line)
  was held whole (2.76 GB; 600 MB: >8 GB). A line longer than a chunk comes in pieces of one,
  cut where the ids do not change; a file of shorter lines is chunked as readlines chunked it."""
  import tracemalloc  # pylint: disable=import-outside-toplevel
  tok = load_tokenizer(str(tokenizer_dir))
  line = ' '.join(f'word{i % 97} é' for i in range(40000))  # one line, ~400K characters
  flat = tmp_path / 'text8.txt'
  flat.write_text(line, encoding='utf-8')
  tracemalloc.start()
  try:  # the chunks are hashed as they come: a list of them would hold the file
    whole, sizes = hashlib.sha256(), []
    for task, _ in formats.text_tasks(flat, 'data.path', 16 << 10, tok):
      whole.update(task.text.encode('utf-8'))
      sizes.append(len(task.text))
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert whole.digest() == hashlib.sha256(line.encode('utf-8')).digest() and len(sizes) > 8
  assert max(sizes) <= 2 * (16 << 10) and peak < len(line), peak
  chunks = [task.text for task, _ in formats.text_tasks(flat, 'data.path', 16 << 10, tok)]
  pieces = np.concatenate([tok.encode(c) for c in chunks])
  np.testing.assert_array_equal(pieces, tok.encode(line))
  lines = tmp_path / 'lines.txt'
  lines.write_text(''.join(f'line {i} ' + 'x' * (i % 3000) + '\n' for i in range(300)))
  with open(lines, encoding='utf-8', newline='') as f:
    expected = [''.join(part) for part in iter(lambda: f.readlines(16 << 10), [])]
  assert [task.text for task, _ in formats.text_tasks(lines, 'data.path', 16 << 10)] == expected


def test_a_jsonl_line_longer_than_a_record_may_be_is_a_bad_record(tmp_path, monkeypatch):
  """readline() read a JSONL line whole: 4 GiB without a newline (a 4 MB .jsonl.gz) took >6 GB
  in the worker. A line longer than a record may be is a bad record naming its line, passed over
  a piece at a time, and skipped with skip_bad_records."""
  monkeypatch.setattr(formats, '_MAX_RECORD_CHARS', 4000)
  body = (b'{"text": "one"}\n' + b'{"text": "' + b'y' * 70000 + b'"}\n' +  # past the sniff
          b'{"text": "three"}\n' + b'z' * 9000)
  for name, data in (('long.jsonl', body), ('long.jsonl.gz', gzip.compress(body))):
    path = tmp_path / name
    path.write_bytes(data)
    tasks = [task for task, _ in formats.jsonl_tasks(path, 'data.path')]
    assert sum(len(task.data) for task in tasks) < 100
    fmt = document_format(ByteTokenizer())
    result = formats.run_task(tasks[0], ByteTokenizer(), fmt, np.dtype(np.uint16))
    assert result.documents == 2 and result.skipped == 2
    assert result.bad == [f'{path}:2: a line of more than 0 MB, longer than a record may be '
                          '(is the file one JSON record per line?)',
                          f'{path}:4: a line of more than 0 MB, longer than a record may be '
                          '(is the file one JSON record per line?)']
    run = tmp_path / f'run-{name}'
    config = _data_config(path=str(path), cache_dir=str(run / 'data'))
    with pytest.raises(ConfigError, match=rf'data.path: bad record {path}:2: a line of more '
                       r'than 0 MB.* \(and 1 more\)\. Fix the data, or set '
                       r'data.skip_bad_records=True'):
      load_data(config, run)
    config.skip_bad_records = True
    info, _ = load_data(config, run)
    assert info.stats['documents'] == 2 and info.stats['skipped_records'] == 2


def test_a_saved_datasets_state_json_naming_files_elsewhere_is_refused(tmp_path):
  """A saved dataset's state.json (save_to_disk) naming ../private.txt, an absolute path, or a
  file linked out of its directory had that file read as training data; it is refused, naming
  state.json and the fix. Its own files read as before."""
  saved = tmp_path / 'saved'
  saved.mkdir()
  table = pa.table({'text': ['a record']})
  with pa.ipc.new_stream(saved / 'data-00000-of-00001.arrow', table.schema) as writer:
    writer.write_table(table)
  private = tmp_path / 'private.txt'
  private.write_text('not data\n')
  (saved / 'link.arrow').symlink_to(private)
  state = saved / 'state.json'
  state.write_text(json.dumps({'_data_files': [{'filename': 'data-00000-of-00001.arrow'}]}))
  assert formats.expand_sources([saved], 'data.path') == [saved / 'data-00000-of-00001.arrow']
  for name in ('../private.txt', str(private), 'link.arrow'):
    state.write_text(json.dumps({'_data_files': [{'filename': name}]}))
    with pytest.raises(ConfigError, match=r'data.path: .*saved/state.json lists a file outside '
                       r'.*saved \(.*\), and a saved dataset holds its own files only; save the '
                       r'dataset again'):
      formats.expand_sources([saved], 'data.path')


@pytest.mark.parametrize('template, why', [
    ("{{ 'a' * 10**9 }}", r'\* would make a value of 1,000,000,000 characters'),
    ('{% set ns = namespace(s="ab") %}{% for i in range(26) %}{% set ns.s = ns.s + ns.s %}'
     '{% endfor %}{{ ns.s|length }}', r'\+ would make a value of'),
    ('{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
     r'its ranges hold more than 1,[0-9,]+ items in all'),
    ('{% for i in range(100) %}{{ messages }}{% endfor %}', r'renders more than 1,[0-9,]+ '
     'characters of this record'),
    ('{% set ns = namespace(x="") %}{% for i in range(1000) %}{% for j in range(1000) %}'
     '{% set ns.x = ns.x + "a" %}{% endfor %}{% endfor %}{{ ns.x|length }}',
     r'makes more than [0-9,]+ characters \(or items\) in all .* \(a loop that grows a value\?\)')],
                         ids=['multiply', 'doubling', 'nested-loops', 'output', 'growing'])
def test_a_chat_template_makes_nothing_much_larger_than_its_record(tmp_path, template, why):
  """A chat template comes with a downloaded checkpoint, and jinja2's sandbox bounds neither
  memory nor time: '{{ "a" * 10**10 }}' took 13.5 GB, nested range loops ran until killed (in
  the check before anything is written), a loop growing a string by `+` (each value within the
  budget, their sum quadratic) took 15 s a rendering. Values, output, ranges and what a rendering
  makes in all are bounded by the record's size: such a record is a bad record, named, and a
  real conversation renders as before."""
  import signal  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'chat_template.jinja'
  path.write_text(template)
  fmt = document_format(ByteTokenizer(), chat_template=str(path))
  record = {'messages': [{'role': 'user', 'content': 'x' * 20000},
                         {'role': 'assistant', 'content': 'ok'}]}

  def too_slow(*_):
    raise TimeoutError('the template ran on')

  previous = signal.signal(signal.SIGALRM, too_slow)
  signal.alarm(20)  # without the bounds: a failure, not a hang
  try:
    with pytest.raises(documents_module.BadRecord, match='chat template: ' + why):
      documents_module.record_parts(record, fmt)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize('template, why', [
    ("{{ ' '|center(10**8) }}", r"the filter 'center' would make a value of 100,000,000 "),
    ("{% set big = 'x' * 1000000 %}{{ ([big] * 100)|join }}", r"the filter 'join' would make"),
    ("{{ ('a\n' * 100000)|indent(1000) }}", r"the filter 'indent' would make"),
    ("{{ '%100000000s'|format('a') }}", r"the filter 'format' would make"),
    ("{{ '%100000000s' % 'a' }}", r'% would make'),
    ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='y' * 1000) }}", r"the filter 'wordwrap' would"),
    ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", r"the filter 'replace' would make"),
    ("{{ 'a'.center(10**8) }}", r'\.center\(\) would make'),
    ("{{ '{:>100000000}'.format('a') }}", r'\.format\(\) would make'),
    ("{% set big = 'x' * 1000000 %}{{ [big] * 100 }}", r'\{\{ \.\.\. \}\} would make'),
    ("{% set big = 'x' * 1000000 %}{{ (big ~ big)|length }}", r'~ would make'),
    ("{% macro m() %}{% for i in range(1000) %}{{ messages[0]['content'] }}{% endfor %}"
     '{% endmacro %}{{ m()|length }}', r'a macro or block would make')],
                         ids=['center', 'join', 'indent', 'format', 'percent', 'wordwrap',
                              'replace', 'str-method', 'str-format', 'output', 'tilde', 'macro'])
def test_a_chat_templates_filters_methods_and_joins_make_nothing_much_larger(tmp_path, template,
                                                                              why):
  """Filters, str methods, `%`, `~` and macro bodies are bounded as +, * and ranges are: each
  of these made its value whole (10**10 characters: 10 GB and more) before the output's check
  saw it. Now the value's size is known from the arguments first, and the record is a bad
  record, named, with nothing made."""
  path = tmp_path / 'chat_template.jinja'
  path.write_text(template)
  fmt = document_format(ByteTokenizer(), chat_template=str(path))
  record = {'messages': [{'role': 'user', 'content': 'x' * 20000},
                         {'role': 'assistant', 'content': 'ok'}]}
  with pytest.raises(documents_module.BadRecord, match='chat template: ' + why):
    documents_module.record_parts(record, fmt)


def test_a_chat_templates_bounded_filters_render_as_jinja2_renders_them(tmp_path):
  """Within the bounds the filters, methods and joins give what jinja2's own sandbox gives."""
  import jinja2.sandbox  # pylint: disable=import-outside-toplevel
  template = ("{% for m in messages %}{{ m['role']|center(12) }}{{ m['content']|indent(2) }}"
              "{{ '%s:%5d' % (m['role'], loop.index) }}{{ [m['role'], m.content]|join(', ') }}"
              "{{ m|tojson(indent=2) }}{{ m.content|replace('o', '0')|wordwrap(3) }}"
              "{{ '{:>8}'.format(m.role) ~ m.role.ljust(10) }}{{ m.content|format }}"
              '{% endfor %}')
  path = tmp_path / 'chat_template.jinja'
  path.write_text(template)
  fmt = document_format(ByteTokenizer(), chat_template=str(path))
  messages = [{'role': 'user', 'content': 'hello there\nhow are you'},
              {'role': 'assistant', 'content': 'fine, thanks'}]
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters['tojson'] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  expected = env.from_string(template).render(messages=messages)  # transformers' tojson
  parts = documents_module.record_parts({'messages': messages}, fmt)
  assert ''.join(text for text, _ in parts) == expected
