"""Padding of rows of whole documents: data.pack='documents' (stream order) vs 'best_fit'.

    python bench/packing.py [--seq_lens 512,1024,2048,4096] [--synthetic 1000000] [--batch_rows 64]

Documents are real text from ../shared/data, byte tokens (one per byte, as data.tokenizer='byte'
stores them), each ending with EOS (byte 0), in an order fixed by a seeded shuffle:
- 'speeches': tinyshakespeare's speeches (blocks between blank lines), short;
- 'paragraphs': WikiText-2 valid + test, one paragraph per line, short to long;
- 'mixed': both together, shuffled (an instruction mixture of short and long answers).
For each source and row length (seq_len + 1) it prints the rows each packing makes, the share of
row tokens that are padding (not learned: the steps per epoch spent on nothing), and the seconds
packing.RowPacking.rows took. `--synthetic N` adds N documents of log-normal lengths (median
245 tokens, the scale of chat turns) to time the packer at corpus scale, and the milliseconds
laying out a batch of `--batch_rows` of its rows takes (and marking where their documents begin).
"""

import argparse
import pathlib
import tempfile
import time

import numpy as np

from megatrain_jax.data import packing
from megatrain_jax.data import shards

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'


def _real_documents() -> dict[str, list[bytes]]:
  shakespeare = (SHARED / 'tinyshakespeare' / 'input.txt').read_bytes()
  speeches = [s.strip() for s in shakespeare.split(b'\n\n') if s.strip()]
  paragraphs = []
  for split in ('valid.txt', 'test.txt'):
    for line in (SHARED / 'wikitext-2' / split).read_bytes().splitlines():
      line = line.strip()
      if line and not line.startswith(b'='):  # skip blank lines and the section headings
        paragraphs.append(line)
  rng = np.random.default_rng(0)
  mixed = speeches + paragraphs
  return {'speeches': speeches, 'paragraphs': paragraphs,
          'mixed': [mixed[i] for i in rng.permutation(len(mixed))]}


def _stream(documents: list[bytes]) -> np.ndarray:
  return np.frombuffer(b''.join(d + b'\0' for d in documents), np.uint8)


def _synthetic(n: int) -> np.ndarray:
  """A stream whose documents have log-normal lengths (only their EOS positions matter)."""
  lengths = np.clip(np.random.default_rng(1).lognormal(5.5, 1.0, n).astype(np.int64), 2, 50_000)
  tokens = np.ones(int(lengths.sum()), np.uint8)
  tokens[np.cumsum(lengths) - 1] = 0
  return tokens


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--seq_lens', default='512,1024,2048,4096')
  parser.add_argument('--synthetic', type=int, default=1_000_000)
  parser.add_argument('--batch_rows', type=int, default=64)
  args = parser.parse_args()
  streams = {name: _stream(docs) for name, docs in _real_documents().items()}
  if args.synthetic:
    streams[f'synthetic {args.synthetic:,}'] = _synthetic(args.synthetic)
  print('| documents | count | median len | seq_len | rows: documents | rows: best_fit | '
        'padding: documents | padding: best_fit | rows saved | s: documents | s: best_fit |')
  print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  for name, tokens in streams.items():
    ends = packing.document_ends(tokens, 0)
    median = int(np.median(np.diff(ends, prepend=0)))
    for seq_len in (int(s) for s in args.seq_lens.split(',')):
      window = seq_len + 1
      out = {}
      for strategy in packing.STRATEGIES:
        start = time.perf_counter()
        rows = packing.RowPacking(strategy, 0).rows(tokens, window)
        seconds = time.perf_counter() - start
        assert rows.sizes().sum() == len(tokens) and rows.sizes().max() <= window
        out[strategy] = (len(rows), 1 - len(tokens) / (len(rows) * window), seconds)
      (greedy, greedy_pad, greedy_s), (best, best_pad, best_s) = out.values()
      print(f'| {name} | {len(ends):,} | {median} | {seq_len} | {greedy:,} | {best:,} | '
            f'{greedy_pad:.1%} | {best_pad:.2%} | {1 - best / greedy:.1%} | {greedy_s:.2f} | '
            f'{best_s:.2f} |', flush=True)
  if args.synthetic:
    _batch_assembly(streams[f'synthetic {args.synthetic:,}'], args.batch_rows)


def _batch_assembly(tokens: np.ndarray, batch_rows: int, repeats: int = 20) -> None:
  """Milliseconds to lay out a batch of `batch_rows` packed rows (gather_rows: tokens and loss
  mask) and, with the document mask over recorded ends, to mark where its documents begin
  (row_starts): host work the training loop does before every step. The tokens are read as
  prepared data is, from a shard file through a TokenStream."""
  ends = packing.document_ends(tokens, 0)
  shard = pathlib.Path(tempfile.mkdtemp()) / 'train-00000.bin'
  tokens.astype('<u2').tofile(shard)
  tokens = shards.TokenStream([(str(shard), None, 0, len(tokens))], 'uint16')
  print(f'\n| seq_len | strategy | ms: gather_rows ({batch_rows} rows) | ms: row_starts |')
  print('|---:|---|---:|---:|')
  for seq_len in (512, 2048):
    for strategy in packing.STRATEGIES:
      rows = packing.RowPacking(strategy, 0).rows(tokens, seq_len + 1)
      ids = np.random.default_rng(0).permutation(len(rows))[:batch_rows * repeats]
      times = {}
      for name, fn in (('gather', lambda b: packing.gather_rows(tokens, rows, b, seq_len + 1, 0)),
                       ('starts', lambda b: packing.row_starts(rows, b, seq_len + 1, ends))):
        if not hasattr(packing, 'row_starts') and name == 'starts':
          continue  # a checkout from before Batch.starts
        start = time.perf_counter()
        for batch in ids.reshape(repeats, batch_rows):
          fn(batch)
        times[name] = 1e3 * (time.perf_counter() - start) / repeats
      print(f"| {seq_len} | {strategy} | {times['gather']:.2f} | "
            f"{times.get('starts', float('nan')):.2f} |", flush=True)


if __name__ == '__main__':
  main()
