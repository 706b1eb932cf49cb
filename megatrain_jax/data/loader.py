"""Reading prepared token files, and the deterministic training and evaluation samplers.

The training sampler is stateless: batch `position` (a global sample counter the trainer stores in
its checkpoints) always maps to the same windows, so resuming from a checkpoint replays exactly
the batches an uninterrupted run would have seen.
"""

import hashlib
import operator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from megatrain_jax.data import packing, shards
from megatrain_jax.data.mixture import MIXTURE_STREAM, MixtureSchedule
from megatrain_jax.data.prepare import DatasetInfo, read_dataset_info
from megatrain_jax.data.shards import TokenStream, memmap
from megatrain_jax.errors import ConfigError

SPLITS = ('train', 'val')


class Batch(NamedTuple):
  """A batch of a dataset with a loss mask (instruction or chat data).

  Attributes:
    tokens: int32 [..., seq_len + 1], exactly the array a dataset without a mask yields.
    loss_mask: uint8 [..., seq_len], aligned to the targets `tokens[..., 1:]`: loss_mask[..., j]
      is 1 when target tokens[..., j + 1] is learned, 0 when it is not (a prompt or a
      non-assistant turn).
    starts: With model.document_mask, uint8 [..., seq_len + 1], aligned to `tokens`: 1 where a
      document begins (never at 0): the model keeps each document to itself by them
      (model.token_positions). None: the model finds documents by their EOS itself, or there is
      no document mask.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  starts: np.ndarray | None = None


def eos_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
  """Batch.starts of tokens [..., S + 1] whose documents each end with `eos_id`: 1 at each
  token after an EOS."""
  starts = np.zeros(tokens.shape, np.uint8)
  starts[..., 1:] = tokens[..., :-1] == eos_id
  return starts


def unlearn_starts(starts: np.ndarray, target_mask: np.ndarray | None) -> np.ndarray:
  """target_mask [..., S] (None: every target learned) with 0 at each target that begins a
  document (Batch.starts [..., S + 1]): under model.document_mask a document sees only itself,
  so the next one's first token is not its to predict."""
  keep = 1 - starts[..., 1:]
  return keep if target_mask is None else (target_mask * keep).astype(np.uint8)


def unlearn_document_starts(tokens: np.ndarray, target_mask: np.ndarray | None,
                            eos_id: int) -> np.ndarray:
  """target_mask [..., S] (None: every target learned) with 0 at each target whose input is the
  EOS `eos_id` in tokens [..., S + 1]: under model.document_mask the EOS sees only its own
  document, so the next document's first token is not its to predict (as transformers'
  DataCollatorWithFlattening and MaxText's packed targets leave it out). E.g. eos 0, tokens
  [5 0 7 8] -> mask [1 0 1]; the EOS itself stays a target."""
  return unlearn_starts(eos_starts(tokens, eos_id), target_mask)


def open_tokens(path: str | Path) -> np.ndarray:
  """Opens a prepared token file (a shard, or format 1's `<split>.bin`) read-only, with the dtype
  from the meta.json beside it."""
  path = Path(path).expanduser().resolve()
  return memmap(path, read_dataset_info(path.parent).dtype)


def _segments_stream(segments, dtype: str,
                     document_ends: bool = False) -> np.ndarray | TokenStream:
  """One segment without a mask or document ends as a plain read-only memmap (slicing views
  the file); anything else as a TokenStream."""
  if len(segments) == 1 and segments[0][1] is None and not document_ends:
    file, _, start, count = segments[0]
    return memmap(Path(file), dtype)[start:start + count]
  return TokenStream(segments, dtype, document_ends)


def load_split(info_or_dir: DatasetInfo | str | Path, split: str):
  """Returns the tokens of one split of a prepared dataset.

  Args:
    info_or_dir: A DatasetInfo (of a directory or a mixture), or a prepared directory.
    split: 'train' or 'val'.

  Returns:
    A read-only 1-D memmap when the split is one shard without a loss mask or recorded
    document ends (as before shards existed); a TokenStream (1-D array-like over the shards,
    with `.mask` and `.document_ends()`) for several shards, a mask or document ends; for the
    training split of a mixture, a MixtureSplit. BatchSampler and eval_batches accept all
    three.
  """
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  info = (info_or_dir if isinstance(info_or_dir, DatasetInfo) else
          read_dataset_info(info_or_dir))
  if info.mixture and split == 'train':
    return MixtureSplit(tuple(w for w, _ in info.mixture),
                        tuple(load_split(source, 'train') for _, source in info.mixture))
  return _segments_stream(info.splits[split], info.dtype, info.document_ends)


def verify_data(info: DatasetInfo) -> shards.ShardVerifier:
  """Starts reading every file of `info` (a mixture: of each source) whose crc32 its prepare
  recorded, beside training (shards.ShardVerifier)."""
  checksums = dict(info.checksums)
  for _, source in info.mixture:
    checksums.update(source.checksums)
  return shards.ShardVerifier(checksums, info.dir)


class MixtureSplit(NamedTuple):
  """The training split of a mixture: each source's tokens and its weight."""
  weights: tuple
  sources: tuple


def _check_int(field: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ConfigError(f'{field}: got {value!r}; it must be an integer >= {minimum}.')
  return int(value)


def _train_too_short(tokens: int, seq_len: int) -> ConfigError:
  return ConfigError(
      f'train.seq_len: the training split has {tokens} tokens, but one sequence needs '
      f'seq_len + 1 = {seq_len + 1}; lower train.seq_len or train on more text (data.path).')


def _val_too_short(tokens: int, seq_len: int) -> ConfigError:
  return ConfigError(
      f'data.val_path / data.val_fraction: the validation split has {tokens} tokens, but one '
      f'eval sequence needs train.seq_len + 1 = {seq_len + 1}; use a longer data.val_path, raise '
      'data.val_fraction, or lower train.seq_len.')


def check_split_sizes(train_tokens: int, val_tokens: int, *, seq_len: int) -> None:
  """Raises the ConfigError BatchSampler / eval_batches would raise for splits of these sizes.

  Lets the trainer refuse too little text before anything is written, when the token counts are
  known up front (a prepared directory, or the byte tokenizer: one token per byte).
  """
  if train_tokens < seq_len + 1:
    raise _train_too_short(train_tokens, seq_len)
  if val_tokens < seq_len + 1:
    raise _val_too_short(val_tokens, seq_len)


# Tokens per read of `check_document_ends`' scan (uint32: 256 MB).
_SCAN_TOKENS = 1 << 26


def check_document_ends(info: DatasetInfo, eos: int, eos_text: str, uses: str) -> None:
  """Refuses data prepared without the ends of its documents (an older version's prepare step)
  whose EOS also occurs inside its documents, where `uses` (model.document_mask, data.pack) would
  find the documents by that id: a chat template that ends every turn with it (Qwen2.5
  Instruct's '<|im_end|>', Llama 3 Instruct's '<|eot_id|>', Mistral Instruct's '</s>') would
  have each conversation cut at its turns, an answer no longer seeing its question. Counts the
  EOS ids of each such prepared directory (a scan of its token files) against the documents it
  holds. Data that records its documents' ends (DatasetInfo.document_ends) is not looked at.

  Raises:
    ConfigError: (naming data.eos_token and `uses`) more EOS ids than documents.
  """
  for part in [part for _, part in info.mixture] or [info]:
    documents = part.stats.get('documents') or 0
    if not documents or part.document_ends:  # nothing to cut, or cut where the records end
      continue
    count = 0
    for split in SPLITS:
      tokens = load_split(part, split)
      for start in range(0, len(tokens), _SCAN_TOKENS):
        count += int(np.count_nonzero(tokens[start:start + _SCAN_TOKENS] == eos))
    if count > documents:
      raise ConfigError(
          f'data.eos_token: {eos_text!r} (id {eos}) ends each document of {part.dir} and also '
          f'occurs inside them ({count:,} of it in {documents:,} documents: a chat template '
          'that ends every turn with it), and that directory was prepared without recording '
          f'where its documents end (an older version). {uses} '
          f'{"find" if " and " in uses else "finds"} its documents by that id, so each '
          'conversation would be cut at its turns, an answer apart from its question. Prepare '
          f'it again (delete {part.dir}: this version records where each document ends), or '
          "set data.eos_token to a token the documents do not hold (Qwen: '<|endoftext|>', "
          "Llama 3: '<|end_of_text|>'), or turn off what finds documents "
          "(model.document_mask=false, data.pack='stream').")


class _Windows:
  """The windows of one token stream (or, given a `row_packing`, its rows of whole documents:
  packing.py) and their per-epoch permutations. A window is named by its index."""

  def __init__(self, tokens, seq_len: int, seed: int, source: int | None,
               row_packing: packing.RowPacking | None = None):
    self.tokens = tokens
    self.stored_mask = bool(getattr(tokens, 'has_mask', False))
    self.window = seq_len + 1
    self._packing = row_packing
    self._rows = None
    if len(tokens) < self.window:
      raise _train_too_short(len(tokens), seq_len)
    if row_packing is not None:  # rows of whole documents: their spans of the stream
      self._rows = row_packing.rows(tokens, self.window)
      self.n_windows = len(self._rows)
    else:
      self.n_windows = len(tokens) // self.window
    # Packed rows are padded, and the padding's targets are not learned: a loss mask always.
    self.has_mask = self.stored_mask or self._rows is not None
    # A lone stream keeps the seeding it always had; mixture sources each get their own.
    self._key = [seed] if source is None else [seed, MIXTURE_STREAM, source]
    # Permutations of the epochs the latest batch touched: consecutive steps hit the cache, and
    # at most one step's worth of epochs is ever held.
    self._perms: dict[int, np.ndarray] = {}

  def windows(self, samples: np.ndarray) -> np.ndarray:
    """The windows (indices) of these sample indices (of this stream)."""
    epochs = samples // self.n_windows
    perms = {}
    for epoch in np.unique(epochs):
      epoch = int(epoch)
      perms[epoch] = self._perms.get(epoch)
      if perms[epoch] is None:
        perms[epoch] = np.random.default_rng(self._key[:1] + [epoch] + self._key[1:]).permutation(
            self.n_windows)
    self._perms = perms
    windows = np.empty_like(samples)
    for epoch, perm in perms.items():
      in_epoch = epochs == epoch
      windows[in_epoch] = perm[samples[in_epoch] % self.n_windows]
    return windows

  def starts(self, windows: np.ndarray) -> np.ndarray:
    """Stream offsets of these windows' first tokens."""
    if self._rows is None:
      return windows * self.window
    return self._rows.starts[self._rows.offsets[windows]]

  def gather(self, windows: np.ndarray, with_mask: bool, document_eos: int = -1):
    """(tokens [n, window] int32, mask [n, window - 1] uint8 of the targets or None, and with
    `document_eos` >= 0 (model.document_mask) Batch.starts [n, window] uint8, else None)."""
    if self._rows is not None:
      tokens, mask = packing.gather_rows(self.tokens, self._rows, windows, self.window,
                                         self._packing.eos,
                                         self.tokens.mask if self.stored_mask else None)
      return tokens, mask, self._document_starts(tokens, windows, document_eos)
    index = self.starts(windows)[:, None] + np.arange(self.window)
    # np.array (not asarray) so the result is a plain in-memory ndarray, not a memmap view.
    tokens = np.array(self.tokens[index], dtype=np.int32)
    mask = None
    if with_mask:
      mask = (self.tokens.mask(index[:, 1:]) if self.stored_mask else
              np.ones((len(windows), self.window - 1), dtype=np.uint8))
    return tokens, mask, self._document_starts(tokens, windows, document_eos)

  def _document_starts(self, tokens: np.ndarray, windows: np.ndarray,
                       document_eos: int) -> np.ndarray | None:
    """Batch.starts of these windows' `tokens`: where documents begin as the stream records them,
    else after each `document_eos`; None without a document mask (`document_eos` < 0)."""
    if document_eos < 0:
      return None
    ends = packing.recorded_ends(self.tokens)
    if ends is None:
      return eos_starts(tokens, document_eos)
    if self._rows is not None:
      return packing.row_starts(self._rows, windows, self.window, ends)
    return window_starts(ends, self.starts(windows), self.window)


def window_starts(ends: np.ndarray, first: np.ndarray, window: int) -> np.ndarray:
  """Batch.starts [n, window] of the stream windows beginning at offsets `first` [n], of a
  stream whose documents end at `ends` (TokenStream.document_ends): 1 at each offset inside a
  window (not its first) where a document ends and so the next begins."""
  starts = np.zeros((len(first), window), np.uint8)
  packing.mark_ends_inside(starts, ends, np.arange(len(first)), first,
                           np.full(len(first), window), np.zeros(len(first), np.int64))
  return starts


class BatchSampler:
  """Deterministic training batches from a token stream, or a mixture of several.

  One stream is cut into non-overlapping windows of `seq_len + 1` tokens (inputs plus the targets
  shifted by one); a trailing remainder shorter than a window is never used. Every epoch visits
  all windows once, in the order of a permutation drawn from `np.random.default_rng([seed,
  epoch])`. Global sample `i` is window `perm[i // n_windows][i % n_windows]`.

  A mixture (MixtureSplit) first assigns global sample `i` to a source and an index within that
  source (mixture.MixtureSchedule, a pure function of `i`), then takes that source's window as
  above, with its own permutations (`default_rng([seed, epoch, MIXTURE_STREAM, source])`).

  `batch(position)` depends on nothing but `position` (and the constructor's arguments): resuming
  from the `data_position` a checkpoint stores replays the batches exactly, mixture included.
  """

  def __init__(self, tokens, *, seq_len: int, batch_size: int, microbatches: int, seed: int,
               document_eos: int = -1, row_packing: packing.RowPacking | None = None,
               verifier: shards.ShardVerifier | None = None, tokenizer: str = ''):
    """Creates the sampler.

    Args:
      tokens: A split from `load_split`: 1-D token ids, a TokenStream, or a MixtureSplit.
      seq_len: Model sequence length; each sample holds `seq_len + 1` tokens.
      batch_size: Sequences per microbatch.
      microbatches: Microbatches per step (gradient accumulation).
      seed: Shuffle seed, >= 0.
      document_eos: With model.document_mask, the EOS id that ends every document (-1: none):
        batches then carry where documents begin (Batch.starts: as the stream records them,
        TokenStream.document_ends, else after each EOS) and a loss mask without the targets
        that begin one (`unlearn_starts`).
      row_packing: With data.pack = 'documents' or 'best_fit' (None: windows of the stream):
        samples are rows of whole documents, padded with its EOS (packing.py); a loss mask
        always.
      verifier: The check of the prepared files `tokens` are read from (`verify_data`), which
        `check_data` waits for.
      tokenizer: The name of the tokenizer whose ids `tokens` are (DatasetInfo.tokenizer: for a
        tokenizer.json, a hash of its content), which a checkpoint records.

    Raises:
      ConfigError: If an argument is out of range, or (naming `train.seq_len`) if a stream is too
        short to hold a single window.
    """
    self._seq_len = _check_int('train.seq_len', seq_len, 1)
    self._batch_size = _check_int('train.batch_size', batch_size, 1)
    self._microbatches = _check_int('train.microbatches', microbatches, 1)
    # SeedSequence rejects negative entropy; say so in config terms instead.
    self._seed = _check_int('train.seed', seed, 0)
    if isinstance(tokens, MixtureSplit):
      self._streams = [_Windows(t, self._seq_len, self._seed, s, row_packing)
                       for s, t in enumerate(tokens.sources)]
      self._mixture = MixtureSchedule(list(tokens.weights), self._seed)
    else:
      self._streams = [_Windows(tokens, self._seq_len, self._seed, None, row_packing)]
      self._mixture = None
    self._document_eos = document_eos
    self.has_mask = any(stream.has_mask for stream in self._streams) or document_eos >= 0
    self._verifier = verifier
    self.tokenizer = tokenizer

  def check_data(self, wait: bool = True) -> None:
    """Raises StoreCorruptionError if the `verifier` (reading every prepared file the batches
    come from once, beside training) found one damaged; `wait`: until it has read them all."""
    if self._verifier is not None:
      self._verifier.check(wait)

  @property
  def n_windows(self) -> int:
    """Number of distinct training windows (samples per epoch; a mixture: of all sources)."""
    return sum(stream.n_windows for stream in self._streams)

  def source_passes(self, samples: int) -> list[float]:
    """Passes `samples` training samples make over each source of a mixture ([] for one
    stream): the weights decide each source's share of the samples, whatever its size, so one
    epoch of the whole (train.epochs=1) passes over a small, heavily weighted source several
    times and over a large one partly."""
    if self._mixture is None:
      return []
    shares = self._mixture.counts / self._mixture.counts.sum()
    return [float(samples * share / stream.n_windows)
            for share, stream in zip(shares, self._streams)]

  @property
  def samples_per_step(self) -> int:
    """Samples one `batch` call consumes; advance `position` by this much per step."""
    return self._microbatches * self._batch_size

  def _locate(self, position: int, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(source, window index within it) of samples `position .. position + count - 1` (default:
    batch `position`'s), flat."""
    position = operator.index(position)
    if position < 0:
      raise ValueError(f'position must be >= 0, got {position}')
    count = self.samples_per_step if count is None else count
    samples = position + np.arange(count, dtype=np.int64)
    if self._mixture is None:
      return np.zeros_like(samples), self._streams[0].windows(samples)
    sources, local = self._mixture.assign(samples)
    windows = np.empty_like(samples)
    for source in np.unique(sources):
      sel = sources == source
      windows[sel] = self._streams[int(source)].windows(local[sel])
    return sources, windows

  def window_starts(self, position: int) -> np.ndarray:
    """Returns the stream offsets of the windows of batch `position` (of a row of whole
    documents: of its first token), [microbatches, batch_size] (for a mixture, offsets within
    each sample's source: see `window_sources`)."""
    sources, windows = self._locate(position)
    starts = np.empty_like(windows)
    for source in np.unique(sources):
      sel = sources == source
      starts[sel] = self._streams[int(source)].starts(windows[sel])
    return starts.reshape(self._microbatches, self._batch_size)

  def window_sources(self, position: int) -> np.ndarray:
    """The source index of each sample of batch `position`, [microbatches, batch_size]."""
    return self._locate(position)[0].reshape(self._microbatches, self._batch_size)

  def batch(self, position: int):
    """Returns samples `position .. position + samples_per_step - 1`, microbatch-major.

    Returns:
      Without a loss mask (`has_mask` False): int32 array [microbatches, batch_size,
      seq_len + 1]; `[..., :-1]` are the inputs and `[..., 1:]` the targets. With one: a Batch
      (tokens as above, loss_mask uint8 [microbatches, batch_size, seq_len] aligned to the
      targets; with `document_eos`, starts uint8 [microbatches, batch_size, seq_len + 1]).
    """
    tokens, mask, starts = self._samples(position, self.samples_per_step)
    shape = (self._microbatches, self._batch_size)
    tokens = tokens.reshape(*shape, self._seq_len + 1)
    if mask is None:
      return tokens
    return Batch(tokens, mask.reshape(*shape, self._seq_len),
                 None if starts is None else starts.reshape(tokens.shape))

  def digest(self, position: int, count: int = 4) -> str:
    """A hash of samples `position .. position + count - 1` (tokens and loss mask), whatever
    the batch shape: a checkpoint records the next one, and a resume whose data gives another
    is told that its batches are no longer those of an uninterrupted run."""
    tokens, mask, _ = self._samples(position, count)  # the mask holds what starts changes
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=8)
    if mask is not None:
      digest.update(mask.tobytes())
    return digest.hexdigest()

  def _samples(self, position: int, count: int) -> tuple:
    """(tokens [count, seq_len + 1] int32, loss mask [count, seq_len] uint8 or None, Batch.starts
    [count, seq_len + 1] uint8 or None) of samples `position ..`."""
    sources, windows = self._locate(position, count)
    window = self._seq_len + 1
    tokens = np.empty((len(windows), window), dtype=np.int32)
    mask = np.empty((len(windows), window - 1), dtype=np.uint8) if self.has_mask else None
    starts = np.empty_like(tokens, np.uint8) if self._document_eos >= 0 else None
    for source in np.unique(sources):
      sel = sources == source
      tokens[sel], source_mask, source_starts = self._streams[int(source)].gather(
          windows[sel], self.has_mask, self._document_eos)
      if mask is not None:
        mask[sel] = source_mask
      if starts is not None:
        starts[sel] = source_starts
    if starts is not None:
      mask = unlearn_starts(starts, mask)
    return tokens, mask, starts


def batch_scalars(batch, position: int, samples_per_epoch: int) -> dict:
  """The data/* scalars of a logged step: `data/epoch`, the passes over the training samples
  made once `position` samples are consumed (a mixture's: over all its sources' windows, as
  train.epochs counts them), and `data/learned_fraction`, the share of the step's targets
  (`batch`, BatchSampler's) that are learned: padding, prompts and other masked targets lower
  it (1 without a loss mask)."""
  mask = batch.loss_mask if isinstance(batch, Batch) else None
  return {'data/epoch': position / samples_per_epoch,
          'data/learned_fraction': 1.0 if mask is None else float(np.mean(mask))}


def eval_batches(tokens, *, seq_len: int, batch_size: int, num_batches: int,
                 document_eos: int = -1,
                 row_packing: packing.RowPacking | None = None) -> list:
  """Returns deterministic validation batches taken in order from the start of `tokens`.

  Windows of `seq_len + 1` tokens do not overlap. Fewer than `num_batches` batches are returned if
  the split runs out; only full batches are returned so that every batch has the same shape,
  except for a split too short to fill one: its windows (or rows) make one batch, filled up with
  rows no target of counts (`_padded`), so a small fine-tuning set is still evaluated.

  Returns:
    A list of int32 arrays [batch_size, seq_len + 1]; for a split with a loss mask, or with
    `document_eos` >= 0 (BatchSampler's), or shorter than a batch, of Batch (tokens as above,
    loss_mask uint8 [batch_size, seq_len] aligned to the targets). With a `row_packing`
    (BatchSampler's) the rows are the split's rows of whole documents, in order (packing.py),
    always with a mask.

  Raises:
    ConfigError: If an argument is out of range, or (naming `data.val_path`, `data.val_fraction`
      and `train.seq_len`) if `tokens` cannot fill a single window.
  """
  seq_len = _check_int('train.seq_len', seq_len, 1)
  batch_size = _check_int('train.batch_size', batch_size, 1)
  num_batches = _check_int('train.eval_batches', num_batches, 1)
  window = seq_len + 1
  if len(tokens) < window:
    raise _val_too_short(len(tokens), seq_len)
  split = _Windows(tokens, seq_len, 0, None, row_packing)  # its windows, or rows, in order
  with_mask = split.has_mask or document_eos >= 0
  out = []
  for i in range(min(num_batches, max(split.n_windows // batch_size, 1))):
    taken = np.arange(i * batch_size, min((i + 1) * batch_size, split.n_windows))
    batch, mask, starts = split.gather(taken, split.has_mask, document_eos)
    if starts is not None:
      mask = unlearn_starts(starts, mask)
    if taken.size < batch_size:
      out.append(_padded(batch, mask, batch_size, starts))
    else:
      out.append(Batch(batch, mask, starts) if with_mask else batch)
  return out


def _padded(batch, mask, batch_size: int, starts=None) -> Batch:
  """The rows there are, batch [R, S+1] and mask [R, S] (None: every target counts; and starts
  [R, S+1] or None), filled up to batch_size rows of zeros whose targets do not count: the eval
  step's shape, and the loss (a masked mean, weighted by learned targets across batches) that of
  the R rows alone."""
  pad = batch_size - batch.shape[0]
  mask = np.ones((batch.shape[0], batch.shape[1] - 1), np.uint8) if mask is None else mask
  zeros = lambda a: np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)])
  return Batch(zeros(batch), zeros(mask), None if starts is None else zeros(starts))
