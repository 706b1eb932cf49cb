"""Mixtures: several sources sampled with weights, deterministically and resumably.

`data.mixture` is a string of comma-separated `WEIGHT:SOURCE` entries, e.g.

  '0.7:/data/web/*.jsonl.zst,0.3:/data/code.parquet'

(SOURCE as `data.path`: a file, directory or glob pattern; weights are relative, > 0). Each source
is prepared on its own; training samples are drawn from the sources in proportion to the weights.

The assignment of samples to sources is a pure function of the global sample index (the
`data_position` checkpoints already store), so resuming replays exactly the batches an
uninterrupted run would have seen, and no other state needs saving. Samples are grouped in blocks
of `BLOCK` samples; every block holds the same number of samples of each source (the weights
apportioned by largest remainder, so proportions are exact to 1/BLOCK), in an order shuffled per
block by `np.random.default_rng([seed, MIXTURE_STREAM, block])`. Sample `i` of source `s` is then
that source's `i`-th sample, taken from its own epoch permutation of windows.
"""

import math
from typing import Any

import numpy as np

from megatrain_jax.errors import ConfigError

BLOCK = 10_000
# Distinguishes the mixture's random stream from the per-source window permutations.
MIXTURE_STREAM = 0x6D6978


def parse_mixture(spec: Any) -> list[tuple[float, str]]:
  """`data.mixture` -> [(weight, source)]; [] for ''.

  Raises:
    ConfigError: (naming `data.mixture`) for a malformed entry or a weight that is not > 0.
  """
  if not isinstance(spec, str):
    raise ConfigError(f'data.mixture: got {spec!r}; it must be a string of WEIGHT:SOURCE entries '
                      "separated by commas, or ''.")
  out = []
  for entry in (e.strip() for e in spec.split(',') if e.strip()):
    weight_text, sep, source = entry.partition(':')
    try:
      weight = float(weight_text)
    except ValueError:
      weight = None
    if not sep or not source.strip() or weight is None:
      raise ConfigError(f'data.mixture: entry {entry!r} is not WEIGHT:SOURCE (e.g. '
                        "'0.7:/data/web.jsonl.zst,0.3:/data/code.parquet').")
    if not (math.isfinite(weight) and weight > 0):
      raise ConfigError(f'data.mixture: the weight of {source.strip()!r} is {weight_text}; every '
                        'weight must be a finite number > 0 (drop a source instead of giving it '
                        'weight 0).')
    out.append((weight, source.strip()))
  return out


def block_counts(weights: list[float]) -> np.ndarray:
  """Samples of each source per block: the weights' shares of BLOCK, by largest remainder."""
  shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * BLOCK
  counts = np.floor(shares).astype(np.int64)
  order = np.argsort(-(shares - counts), kind='stable')
  counts[order[:BLOCK - counts.sum()]] += 1
  if (counts == 0).any():
    raise ConfigError(f'data.mixture: a weight is below 1/{BLOCK} of the total, so its source '
                      'would never be sampled; raise it or drop the source.')
  return counts


class MixtureSchedule:
  """Maps global sample indices to (source, index within that source's samples)."""

  def __init__(self, weights: list[float], seed: int):
    self.counts = block_counts(weights)
    self._seed = seed
    self._labels = np.repeat(np.arange(len(self.counts)), self.counts)
    self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each slot, rank of the slot among its source's slots) of one block."""
    cached = self._cache.get(block)
    if cached is None:
      labels = np.random.default_rng([self._seed, MIXTURE_STREAM, block]).permutation(
          self._labels)
      ranks = np.empty(BLOCK, dtype=np.int64)
      for source in range(len(self.counts)):
        slots = labels == source
        ranks[slots] = np.arange(int(self.counts[source]))
      cached = (labels, ranks)
    return cached

  def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, local sample index) of each global sample index."""
    samples = np.asarray(samples, dtype=np.int64)
    blocks, slots = samples // BLOCK, samples % BLOCK
    sources = np.empty_like(samples)
    local = np.empty_like(samples)
    cache = {}
    for block in np.unique(blocks):
      labels, ranks = cache[int(block)] = self._block(int(block))
      sel = blocks == block
      sources[sel] = labels[slots[sel]]
      local[sel] = block * self.counts[labels[slots[sel]]] + ranks[slots[sel]]
    self._cache = cache  # the blocks of the latest call: consecutive steps hit it
    return sources, local
