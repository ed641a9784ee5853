"""The index of cached adapters: least recently used first, and its bytes in all kept as
adapters come, are replaced and go, whichever way they go."""

from __future__ import annotations

from sidecar.cache.lru import CachedAdapter, LruIndex, eviction_order
from sidecar.cache.records import AdapterRecord, FileRecord


def cached(adapter_id: str, size_bytes: int) -> CachedAdapter:
    record = AdapterRecord(adapter_id, "test", 0.0, {"w": FileRecord(size_bytes, "e", "0" * 8)})
    return CachedAdapter(record, 0.0)


def test_size_bytes_follows_every_change_of_the_index() -> None:
    index = LruIndex()
    index.add_newest(cached("a", 100))
    index.add_newest(cached("b", 20))
    index.add_oldest(cached("c", 3))
    assert index.size_bytes == 123
    index.add_newest(cached("a", 50))  # restaged with other bytes: replaced, not added
    assert index.size_bytes == 73
    removed = index.remove("b")
    assert removed is not None and removed.size_bytes == 20
    assert index.remove("b") is None
    del index["c"]
    assert index.size_bytes == 50 == sum(a.size_bytes for a in index.values())
    index.remove("a")
    assert index.size_bytes == 0 and not index


def test_the_order_is_least_recently_used_first_and_skips_the_protected() -> None:
    index = LruIndex()
    for adapter_id in ("a", "b", "c"):
        index.add_newest(cached(adapter_id, 1))
    index.add_oldest(cached("new-copy", 1))
    index.touch("a")
    order = [a.adapter_id for a in eviction_order(index, lambda i: i == "b")]
    assert order == ["new-copy", "c", "a"]
