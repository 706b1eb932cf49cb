"""Reading prepared token files, and the deterministic training and evaluation samplers.

The training sampler is stateless: batch `position` (a global sample counter the trainer stores in
its checkpoints) always maps to the same windows, so resuming from a checkpoint replays exactly
the batches an uninterrupted run would have seen.
"""

import operator
from pathlib import Path
from typing import Any

import numpy as np

from megatrain_jax.data.prepare import DatasetInfo, read_dataset_info
from megatrain_jax.errors import ConfigError

SPLITS = ('train', 'val')


def open_tokens(path: str | Path) -> np.ndarray:
  """Opens a prepared `<split>.bin` read-only, with the dtype from the meta.json beside it."""
  path = Path(path).expanduser().resolve()
  return _memmap(path, read_dataset_info(path.parent).dtype)


def load_split(info_or_dir: DatasetInfo | str | Path, split: str) -> np.ndarray:
  """Returns the tokens of one split of a prepared dataset as a read-only memmap.

  Args:
    info_or_dir: A DatasetInfo, or a prepared directory (its meta.json is read).
    split: 'train' or 'val'.
  """
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  info = (info_or_dir if isinstance(info_or_dir, DatasetInfo) else
          read_dataset_info(info_or_dir))
  return _memmap(info.dir / f'{split}.bin', info.dtype)


def _memmap(path: Path, dtype: str) -> np.ndarray:
  stored = np.dtype(dtype).newbyteorder('<')
  # mmap cannot map an empty file; an empty split is legal here and rejected by the samplers,
  # which know which config field to blame.
  if path.stat().st_size == 0:
    return np.empty(0, dtype=stored)
  return np.memmap(path, dtype=stored, mode='r')


def _check_int(field: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ConfigError(f'{field}: got {value!r}; it must be an integer >= {minimum}.')
  return int(value)


def _train_too_short(tokens: int, seq_len: int) -> ConfigError:
  return ConfigError(
      f'train.seq_len: the training split has {tokens} tokens, but one sequence needs '
      f'seq_len + 1 = {seq_len + 1}; lower train.seq_len or train on more text (data.path).')


def _val_too_short(tokens: int, seq_len: int, batch_size: int) -> ConfigError:
  batch_tokens = batch_size * (seq_len + 1)
  return ConfigError(
      f'data.val_path / data.val_fraction: the validation split has {tokens} tokens, but '
      f'one eval batch needs train.batch_size * (train.seq_len + 1) = {batch_size} * '
      f'{seq_len + 1} = {batch_tokens}; use a longer data.val_path, raise data.val_fraction, or '
      'lower train.seq_len or train.batch_size.')


def check_split_sizes(train_tokens: int, val_tokens: int, *, seq_len: int, batch_size: int) -> None:
  """Raises the ConfigError BatchSampler / eval_batches would raise for splits of these sizes.

  Lets the trainer refuse too little text before anything is written, when the token counts are
  known up front (a prepared directory, or the byte tokenizer: one token per byte).
  """
  if train_tokens < seq_len + 1:
    raise _train_too_short(train_tokens, seq_len)
  if val_tokens < batch_size * (seq_len + 1):
    raise _val_too_short(val_tokens, seq_len, batch_size)


class BatchSampler:
  """Deterministic training batches from a token stream.

  The stream is cut into non-overlapping windows of `seq_len + 1` tokens (inputs plus the targets
  shifted by one); a trailing remainder shorter than a window is never used. Every epoch visits
  all windows once, in the order of a permutation drawn from `np.random.default_rng([seed,
  epoch])`. Global sample `i` is window `perm[i // n_windows][i % n_windows]`.
  """

  def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, microbatches: int,
               seed: int):
    """Creates the sampler.

    Args:
      tokens: 1-D token ids (typically `load_split(info, 'train')`).
      seq_len: Model sequence length; each sample holds `seq_len + 1` tokens.
      batch_size: Sequences per microbatch.
      microbatches: Microbatches per step (gradient accumulation).
      seed: Shuffle seed, >= 0.

    Raises:
      ConfigError: If an argument is out of range, or (naming `train.seq_len`) if `tokens` is too
        short to hold a single window.
    """
    self._seq_len = _check_int('train.seq_len', seq_len, 1)
    self._batch_size = _check_int('train.batch_size', batch_size, 1)
    self._microbatches = _check_int('train.microbatches', microbatches, 1)
    # SeedSequence rejects negative entropy; say so in config terms instead.
    self._seed = _check_int('train.seed', seed, 0)
    self._tokens = tokens
    window = self._seq_len + 1
    self._n_windows = len(tokens) // window
    if self._n_windows < 1:
      raise _train_too_short(len(tokens), self._seq_len)
    self._offsets = np.arange(window)
    # Permutations of the epochs the latest batch touched: consecutive steps hit the cache, and at
    # most one step's worth of epochs is ever held.
    self._perms: dict[int, np.ndarray] = {}

  @property
  def n_windows(self) -> int:
    """Number of distinct training windows (samples per epoch)."""
    return self._n_windows

  @property
  def samples_per_step(self) -> int:
    """Samples one `batch` call consumes; advance `position` by this much per step."""
    return self._microbatches * self._batch_size

  def _permutation(self, epoch: int) -> np.ndarray:
    perm = self._perms.get(epoch)
    if perm is None:
      perm = np.random.default_rng([self._seed, epoch]).permutation(self._n_windows)
    return perm

  def window_starts(self, position: int) -> np.ndarray:
    """Returns the stream offsets of the windows of batch `position`, [microbatches, batch_size]."""
    position = operator.index(position)
    if position < 0:
      raise ValueError(f'position must be >= 0, got {position}')
    samples = position + np.arange(self.samples_per_step, dtype=np.int64)
    epochs = samples // self._n_windows
    perms = {int(epoch): self._permutation(int(epoch)) for epoch in np.unique(epochs)}
    self._perms = perms
    windows = np.empty_like(samples)
    for epoch, perm in perms.items():
      in_epoch = epochs == epoch
      windows[in_epoch] = perm[samples[in_epoch] % self._n_windows]
    starts = windows * (self._seq_len + 1)
    return starts.reshape(self._microbatches, self._batch_size)

  def batch(self, position: int) -> np.ndarray:
    """Returns samples `position .. position + samples_per_step - 1`, microbatch-major.

    Returns:
      int32 array [microbatches, batch_size, seq_len + 1]; `[..., :-1]` are the inputs and
      `[..., 1:]` the targets.
    """
    index = self.window_starts(position)[..., None] + self._offsets
    # np.array (not asarray) so the result is a plain in-memory ndarray, not a memmap view.
    return np.array(self._tokens[index], dtype=np.int32)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int,
                 num_batches: int) -> list[np.ndarray]:
  """Returns deterministic validation batches taken in order from the start of `tokens`.

  Windows of `seq_len + 1` tokens do not overlap. Fewer than `num_batches` batches are returned if
  the split runs out; only full batches are returned so that every batch has the same shape.

  Returns:
    A list of int32 arrays [batch_size, seq_len + 1].

  Raises:
    ConfigError: If an argument is out of range, or (naming `data.val_path`, `data.val_fraction`
      and `train.seq_len`) if `tokens` cannot fill a single batch.
  """
  seq_len = _check_int('train.seq_len', seq_len, 1)
  batch_size = _check_int('train.batch_size', batch_size, 1)
  num_batches = _check_int('train.eval_batches', num_batches, 1)
  batch_tokens = batch_size * (seq_len + 1)
  available = len(tokens) // batch_tokens
  if available < 1:
    raise _val_too_short(len(tokens), seq_len, batch_size)
  return [
      np.array(tokens[i * batch_tokens:(i + 1) * batch_tokens], dtype=np.int32).reshape(
          batch_size, seq_len + 1) for i in range(min(num_batches, available))
  ]
