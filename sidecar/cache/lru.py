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
    """Every cached adapter by id, least recently used first, and their bytes in all
    (`size_bytes`, kept as adapters come and go: the budget is checked on every release)."""

    # The C method itself: the hit path touches on every request.
    touch = OrderedDict.move_to_end

    def __init__(self) -> None:
        super().__init__()
        self.size_bytes = 0

    def __setitem__(self, adapter_id: str, adapter: CachedAdapter) -> None:
        replaced = self.get(adapter_id)
        super().__setitem__(adapter_id, adapter)
        self.size_bytes += adapter.size_bytes - (replaced.size_bytes if replaced else 0)

    def __delitem__(self, adapter_id: str) -> None:
        self.size_bytes -= self[adapter_id].size_bytes
        super().__delitem__(adapter_id)

    def remove(self, adapter_id: str) -> CachedAdapter | None:
        """The adapter taken out of the index, or None (OrderedDict's own pop would leave
        `size_bytes` behind: it does not go through __delitem__)."""
        adapter = self.get(adapter_id)
        if adapter is not None:
            del self[adapter_id]
        return adapter

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
