"""The prefetch pipeline: keeps the next `depth` groups' transfers in flight ahead of the compute.

    for key, tree in Prefetcher(store.fetch, order=[0, 1, 2, ...], depth=1):
      compute(tree)   # while group key+1's weights are already on their way

Before yielding group g, the transfer of the group `depth` places later is issued, so with
depth d the device holds at most d + 1 groups' weights. `fetch(key)` returns a pytree whose leaves
are arrays (transfers JAX runs asynchronously), Futures (reads on a disk tier's threads) or None;
the engine routes every read it issues ahead of use through here, the weights for the forward and
backward and an update's inputs alike. `wait_s` accumulates the time spent waiting for a transfer
that had not finished when its group was needed (a pipeline stall).
"""

import collections
import time
from typing import Callable, Hashable, Iterable

import jax

from megatrain_jax.tiers.base import resolve


class Prefetcher:

  def __init__(self, fetch: Callable, order: Iterable[Hashable], depth: int):
    if depth < 1:
      raise ValueError(f'prefetch depth must be >= 1, got {depth}')
    self._fetch = fetch
    self._order = iter(order)
    self._in_flight = collections.deque()
    self.wait_s = 0.0
    for _ in range(depth):
      self._issue_next()

  def _issue_next(self) -> None:
    key = next(self._order, None)
    if key is not None:
      self._in_flight.append((key, self._fetch(key)))

  def __iter__(self):
    while self._in_flight:
      key, tree = self._in_flight.popleft()
      self._issue_next()  # the next transfer starts before this group computes
      started = time.perf_counter()
      tree = jax.tree.map(resolve, tree)  # a disk tier hands out Futures from its reader threads
      jax.block_until_ready(tree)
      self.wait_s += time.perf_counter() - started
      yield key, tree
