"""Stores: where a layer group's params or optimizer state live between uses, behind one interface.

A store holds named pytrees (key = layer group index, or the name of an outer piece: 'embed',
'final_norm', 'head'). `fetch(key)`
hands out a device-resident copy (a transfer for offloaded tiers, issued asynchronously);
`put(key, tree)` takes updated leaves back into the tier; `get(key)` returns them where they live
(for host-side compute and checkpoint export). Every transfer is counted in `TransferStats`.
"""

from megatrain_jax.tiers.base import Store, TransferStats
from megatrain_jax.tiers.memory import DeviceStore, HostStore, make_store

__all__ = ['DeviceStore', 'HostStore', 'Store', 'TransferStats', 'make_store']
