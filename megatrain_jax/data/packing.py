"""Rows of whole documents (data.pack = 'documents').

By default a training row is a window of the token stream: it starts wherever the previous one
ended, so most documents are cut in two, and with instruction or chat data the second half of a
conversation is learned without the question before it (model.document_mask cannot give back a
context the row does not hold). With data.pack = 'documents' every row starts at a document's
first token and holds whole documents, as many as fit in `seq_len + 1` tokens, in stream order;
the rest of the row is padding (the EOS id), whose targets are not learned. A document longer
than a row is cut into row-sized pieces, each a row of its own (the only rows that start inside a
document). Documents are the spans the prepared stream ends with EOS (data/documents.py); a
trailing span without one is the last document.

The rows are found once per stream, scanning the token ids for EOS a block at a time (a memmap
or the shards of a TokenStream: bounded memory), and kept as two arrays: each row's start in the
stream and its length, 16 bytes per row.
"""

import numpy as np

# Token ids scanned for EOS at a time.
SCAN_TOKENS = 1 << 24


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


def document_rows(tokens, eos: int, window: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts [R] int64, lengths [R] int64) of the rows of whole documents of at most `window`
  tokens each (module docstring), in stream order."""
  ends = document_ends(tokens, eos)
  starts, lengths = [], []
  row_start = row_end = 0  # the row being filled: [row_start, row_end)
  doc_start = 0
  for doc_end in ends.tolist():
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
  if row_end > row_start:
    starts.append(row_start)
    lengths.append(row_end - row_start)
  return np.asarray(starts, np.int64), np.asarray(lengths, np.int64)


def gather_rows(tokens, starts: np.ndarray, lengths: np.ndarray, window: int, pad: int,
                stored_mask=None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [n, window] int32, mask [n, window - 1] uint8 of the targets) of rows (`starts`,
  `lengths`): each row's tokens, then `pad` to `window`; a target is learned (1) when it is one
  of the row's own tokens and, given `stored_mask` (the stream's `.mask(index)`), learned there.
  """
  n = len(starts)
  out = np.full((n, window), pad, np.int32)
  mask = np.zeros((n, window - 1), np.uint8)
  for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
    out[i, :length] = tokens[start:start + length]
    if length > 1:
      mask[i, :length - 1] = (1 if stored_mask is None else
                              stored_mask(np.arange(start + 1, start + length)))
  return out, mask
