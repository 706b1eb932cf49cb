"""Rows of whole documents (data.pack = 'documents' or 'best_fit').

By default a training row is a window of the token stream: it starts wherever the previous one
ended, so most documents are cut in two, and with instruction or chat data the second half of a
conversation is learned without the question before it (model.document_mask cannot give back a
context the row does not hold). With a packing of whole documents every row holds whole
documents, as many as fit in `seq_len + 1` tokens, then padding (the EOS id), whose targets are
not learned:

- 'documents': in stream order, greedily: a row takes the next documents until one does not fit,
  so a row is one contiguous span of the stream.
- 'best_fit': best-fit decreasing (TRL's 'bfd'), among the documents of each block of
  BEST_FIT_BLOCK in stream order: the longest first, each into the open row it fills most
  tightly. Less padding when short and long documents mix; a row is several spans, kept in
  stream order within the row; a block's rows come in a fixed shuffled order.

A document longer than a row is cut into row-sized pieces from its start, each a row of its own;
its remainder is then packed like a document (the only rows that start inside a document).
Documents are those the prepared stream records (TokenStream.document_ends: the records'
ends), or in a stream without them the spans it ends with EOS (data/documents.py); a trailing
span without an end is the last document (last in its row too, so the document mask never joins
it to another). With the document mask, `row_starts` marks where a row's documents begin.

The rows are found once per stream, scanning the token ids for EOS a block at a time (a memmap
or the shards of a TokenStream: bounded memory), and kept as Rows: each span's start in the
stream and its length, and where each row's spans begin (16 bytes per span and 8 per row: 24 per
row in stream order).
"""

import bisect
import dataclasses

import numpy as np

# Token ids scanned for EOS at a time.
SCAN_TOKENS = 1 << 24
# Documents packed best-fit together (in stream order, block by block): enough that a block's
# last, part-filled rows are a negligible share of its rows, few enough that a row's documents
# lie near each other in the stream and the packer's lists stay small.
BEST_FIT_BLOCK = 1 << 16
STRATEGIES = ('documents', 'best_fit')


@dataclasses.dataclass(frozen=True)
class Rows:
  """Rows of whole documents: row r is spans offsets[r]:offsets[r + 1], concatenated, span s
  being stream tokens [starts[s], starts[s] + lengths[s])."""
  starts: np.ndarray  # [S] int64
  lengths: np.ndarray  # [S] int64
  offsets: np.ndarray  # [R + 1] int64, offsets[0] = 0, offsets[R] = S

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def sizes(self) -> np.ndarray:
    """Tokens in each row ([R] int64)."""
    return np.add.reduceat(self.lengths, self.offsets[:-1]) if len(self) else np.zeros(0, np.int64)

  def spans(self, row: int) -> list[tuple[int, int]]:
    """(start, length) of row `row`'s spans, in row order."""
    span = slice(int(self.offsets[row]), int(self.offsets[row + 1]))
    return list(zip(self.starts[span].tolist(), self.lengths[span].tolist()))


@dataclasses.dataclass(frozen=True)
class RowPacking:
  """How rows of whole documents are made: `strategy` (STRATEGIES) over documents ending with
  `eos`, which also pads the rows."""
  strategy: str
  eos: int

  def rows(self, tokens, window: int) -> Rows:
    """The rows of at most `window` tokens of stream `tokens` (module docstring): its documents
    as it records them (TokenStream.document_ends), else as the EOS ends them."""
    ends = recorded_ends(tokens)
    if ends is None:
      ends = document_ends(tokens, self.eos)
    if self.strategy == 'documents':
      return _stream_order_rows(ends, window)
    if self.strategy == 'best_fit':
      return _best_fit_rows(ends, window)
    raise ValueError(f'packing strategy {self.strategy!r} is not one of {STRATEGIES}')


def _within(counts: np.ndarray) -> np.ndarray:
  """[sum(counts)] int64: each element's place in its group, of groups of `counts` laid end to
  end (counts [2, 3] -> [0 1 0 1 2])."""
  counts = np.asarray(counts, np.int64)
  return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def recorded_ends(tokens) -> np.ndarray | None:
  """The document ends a stream records (TokenStream.document_ends), None where it has none
  (plain text, data prepared by an older version): its documents are then found by their EOS."""
  return tokens.document_ends() if getattr(tokens, 'has_document_ends', False) else None


def document_ends(tokens, eos: int) -> np.ndarray:
  """The stream offsets just past each document ([n] int64, increasing; the last is len(tokens)
  when the stream does not end with EOS)."""
  n = len(tokens)
  ends = []
  for first in range(0, n, SCAN_TOKENS):
    block = np.asarray(tokens[first:min(first + SCAN_TOKENS, n)])
    ends.append(np.flatnonzero(block == eos).astype(np.int64) + first + 1)
  ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
  if n and (not ends.size or ends[-1] != n):
    ends = np.append(ends, np.int64(n))
  return ends


def _stream_order_rows(ends: np.ndarray, window: int) -> Rows:
  """'documents': rows filled greedily in stream order, each one contiguous span."""
  chunks = []  # (starts, lengths) arrays of the rows closed in each block of documents
  row_start = row_end = 0  # the row being filled: [row_start, row_end)
  doc_start = 0
  for first in range(0, len(ends), BEST_FIT_BLOCK):  # Python lists one block long at most
    starts, lengths = [], []
    for doc_end in ends[first:first + BEST_FIT_BLOCK].tolist():
      if doc_end - row_start <= window:  # the document fits in the row being filled
        row_end = doc_end
      else:
        if row_end > row_start:
          starts.append(row_start)
          lengths.append(row_end - row_start)
        # A document longer than a row: row-sized pieces, the last one starts the next row.
        row_start = doc_start
        while doc_end - row_start > window:
          starts.append(row_start)
          lengths.append(window)
          row_start += window
        row_end = doc_end
      doc_start = doc_end
    chunks.append((starts, lengths))
  if row_end > row_start:
    chunks.append(([row_start], [row_end - row_start]))
  starts, lengths = _concatenate(chunks, 2)
  return Rows(starts, lengths, np.arange(len(starts) + 1, dtype=np.int64))


def _concatenate(chunks: list[tuple], fields: int) -> list[np.ndarray]:
  """The int64 concatenations of the chunks' `fields` fields (lists or arrays)."""
  return [np.concatenate([np.asarray(chunk[field], np.int64) for chunk in chunks] or
                         [np.zeros(0, np.int64)]) for field in range(fields)]


def _best_fit_rows(ends: np.ndarray, window: int) -> Rows:
  """'best_fit': each block of BEST_FIT_BLOCK documents packed best-fit decreasing (the full
  pieces of its long documents rows of their own), the block's rows then in a fixed shuffled
  order: best-fit opens the rows of the longest documents first, and validation batches are a
  split's first rows, so in opening order they would score the longest documents only."""
  doc_starts = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
  chunks = []  # (starts, lengths, row sizes in spans) of each block's rows
  for first in range(0, len(ends), BEST_FIT_BLOCK):
    block = slice(first, first + BEST_FIT_BLOCK)
    starts, lengths = doc_starts[block], ends[block] - doc_starts[block]
    # A document longer than a row: its row-sized pieces from its start, each a row of its own
    # (in document order), then its remainder (1..window tokens) packed like a document.
    pieces = (lengths - 1) // window  # [n] full pieces before the remainder
    piece_starts = np.repeat(starts, pieces) + window * _within(pieces)
    items, sizes = starts + window * pieces, lengths - window * pieces
    bins = _best_fit_decreasing(sizes, window)
    packed = np.lexsort((np.arange(len(bins)), bins))  # by row, stream order within a row
    chunks.append(_shuffled_rows(
        np.concatenate([piece_starts, items[packed]]),
        np.concatenate([np.full(len(piece_starts), window, np.int64), sizes[packed]]),
        np.concatenate([np.ones(len(piece_starts), np.int64), np.bincount(bins)]), seed=first))
  starts, lengths, row_spans = _concatenate(chunks, 3)
  return Rows(starts, lengths, np.concatenate([np.zeros(1, np.int64), np.cumsum(row_spans)]))


def _shuffled_rows(starts: np.ndarray, lengths: np.ndarray, row_spans: np.ndarray,
                   seed: int) -> tuple:
  """(starts, lengths, row_spans) arrays of the rows (row r: the next row_spans[r] spans) in
  the order of a permutation drawn from `seed`, each row's spans kept in order."""
  row_spans = np.asarray(row_spans, np.int64)
  first_span = np.cumsum(row_spans) - row_spans
  order = np.random.default_rng(seed).permutation(len(row_spans))
  spans = row_spans[order]
  # Span k of the new order: its row's first span, plus its place within that row.
  index = np.repeat(first_span[order], spans) + _within(spans)
  return np.asarray(starts, np.int64)[index], np.asarray(lengths, np.int64)[index], spans


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> np.ndarray:
  """The bin of each item ([n] int64; bins numbered in order of opening, each of at most
  `capacity`): items longest first (ties in index order), each into the open bin with the least
  room that holds it, or a new one. Open bins are kept by their room: `rooms` (sorted,
  distinct) and `bins_with[room]` (the last one added takes the next item).

  Items of one size come in a run, and a run is placed a group of bins at a time with the same
  result as one item at a time: a bin with room r >= 2 * size takes r // size of them in turn (its
  room after each is still the least that holds the next); bins left with less than `size` never
  take another of the run, so every bin of the least room takes one."""
  order = np.argsort(-sizes, kind='stable')
  ordered = sizes[order]
  run_starts = np.flatnonzero(np.diff(ordered, prepend=-1))  # where each size's run begins
  placed = []  # the bin of each item in `order`
  opened = 0
  rooms: list[int] = []
  bins_with: dict[int, list[int]] = {}

  def add(bins: list[int], room: int) -> None:
    if room:
      if room not in bins_with:
        bins_with[room] = []
        bisect.insort(rooms, room)
      bins_with[room].extend(bins)

  for size, left in zip(ordered[run_starts].tolist(),
                        np.diff(run_starts, append=len(ordered)).tolist()):
    while left:
      at = bisect.bisect_left(rooms, size)
      room = capacity if at == len(rooms) else rooms[at]
      if room >= 2 * size:  # one bin takes several of the run
        if at == len(rooms):
          bin_id, opened = opened, opened + 1
        else:
          bin_id = _take(rooms, bins_with, at, 1)[0]
        taken = min(left, room // size)
        placed.extend([bin_id] * taken)
        add([bin_id], room - taken * size)
      elif at == len(rooms):  # each of the rest opens a bin of its own
        taken = left
        placed.extend(range(opened, opened + taken))
        add(list(range(opened, opened + taken)), room - size)
        opened += taken
      else:  # each of the bins with this room takes one, the last added first
        bins = _take(rooms, bins_with, at, left)
        taken = len(bins)
        placed.extend(bins)
        add(bins, room - size)
      left -= taken
  bins = np.empty(len(placed), np.int64)
  bins[order] = placed
  return bins


def _take(rooms: list[int], bins_with: dict[int, list[int]], at: int, most: int) -> list[int]:
  """Up to `most` of the bins with room rooms[at], the last added first, no longer open."""
  fitting = bins_with[rooms[at]]
  taken = fitting[:-most - 1:-1]
  del fitting[-most:]
  if not fitting:
    del bins_with[rooms[at]]
    del rooms[at]
  return taken


def _layout(rows: Rows, ids: np.ndarray) -> tuple[np.ndarray, ...]:
  """Where the spans of rows `ids` go (every row has one or more): (row of each span [k], its
  stream start [k], its length [k], its offset in its row [k]), rows in `ids` order and each
  row's spans in order."""
  ids = np.asarray(ids, np.int64).reshape(-1)
  first = rows.offsets[ids]
  counts = rows.offsets[ids + 1] - first
  before = np.cumsum(counts) - counts  # each row's first span among the k
  span = np.repeat(first, counts) + _within(counts)
  lengths = rows.lengths[span]
  offsets = np.cumsum(lengths) - lengths  # of each span among all the rows' tokens
  at = offsets - np.repeat(offsets[before], counts)
  return np.repeat(np.arange(ids.size), counts), rows.starts[span], lengths, at


def gather_rows(tokens, rows: Rows, ids: np.ndarray, window: int, pad: int,
                stored_mask=None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [n, window] int32, mask [n, window - 1] uint8 of the targets) of rows `ids` of
  `rows`: each row's spans, then `pad` to `window`; a target is learned (1) when it is one of the
  row's own tokens and, given `stored_mask` (the stream's `.mask(index)`), learned there."""
  out = np.full((len(ids), window), pad, np.int32)
  mask = np.zeros((len(ids), window - 1), np.uint8)
  for i, row in enumerate(np.asarray(ids).tolist()):
    spans = rows.spans(row)
    at = 0
    for start, length in spans:
      out[i, at:at + length] = tokens[start:start + length]
      at += length
    if at > 1 and stored_mask is None:
      mask[i, :at - 1] = 1
    elif at > 1:  # the stream positions of the row's tokens, the first one's dropped
      positions = np.concatenate([np.arange(start, start + length) for start, length in spans])
      mask[i, :at - 1] = stored_mask(positions[1:])
  return out, mask


def row_starts(rows: Rows, ids: np.ndarray, window: int, ends: np.ndarray) -> np.ndarray:
  """Batch.starts [n, window] uint8 of rows `ids` (as gather_rows lays them out) of a stream
  whose documents end at `ends` (TokenStream.document_ends): 1 where each span after a row's
  first begins (a span is a document, the rest of a long one, or for 'documents' a run of
  them), where a document ends inside a span and so the next begins, and where the padding
  begins."""
  starts = np.zeros((len(ids), window), np.uint8)
  row, start, length, at = _layout(rows, ids)
  starts[row[at > 0], at[at > 0]] = 1
  mark_ends_inside(starts, ends, row, start, length, at)
  size = np.bincount(row, weights=length, minlength=len(ids)).astype(np.int64)
  padded = (size > 0) & (size < window)
  starts[np.flatnonzero(padded), size[padded]] = 1
  return starts


def mark_ends_inside(starts: np.ndarray, ends: np.ndarray, row: np.ndarray, start: np.ndarray,
                     length: np.ndarray, at: np.ndarray) -> None:
  """Sets 1 in Batch.starts [n, window] where a document ends inside a span and so the next
  begins: spans of the stream [start, start + length) [k], each laid at offset `at` [k] of row
  `row` [k] (a stream window: one span per row, at 0); `ends` as TokenStream.document_ends."""
  lo = np.searchsorted(ends, start, 'right')
  count = np.searchsorted(ends, start + length, 'left') - lo  # the ends inside each span
  inside = np.repeat(lo, count) + _within(count)
  span = np.repeat(np.arange(count.size), count)
  starts[row[span], at[span] + ends[inside] - start[span]] = 1
