"""The index of cached adapters in least-recently-used order, and LRU's eviction order.

The other policies (eviction.py) break ties by this order; which policy runs is
--eviction-policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .records import AdapterRecord


@dataclass(slots=True)
class CachedAdapter:
    record: AdapterRecord
    last_used: float

    @property
    def adapter_id(self) -> str:
        return self.record.adapter_id

    @property
    def size_bytes(self) -> int:
        return self.record.size_bytes


class LruIndex(OrderedDict[str, CachedAdapter]):
    """Every cached adapter by id, least recently used first."""

    # The C method itself: the hit path touches on every request.
    touch = OrderedDict.move_to_end

    def add_newest(self, adapter: CachedAdapter) -> None:
        """Last to go (an id already indexed keeps its place)."""
        self[adapter.adapter_id] = adapter

    def add_oldest(self, adapter: CachedAdapter) -> None:
        """First to go: an adapter nobody asked for yet (copied in by someone else)."""
        self[adapter.adapter_id] = adapter
        self.move_to_end(adapter.adapter_id, last=False)


def eviction_order(index: LruIndex, is_protected: Callable[[str], bool]) -> Iterator[CachedAdapter]:
    """The adapters that may be evicted, in the order they go: least recently used first."""
    return (adapter for adapter in index.values() if not is_protected(adapter.adapter_id))
