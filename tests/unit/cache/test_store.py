"""The store on its own: lease expiry in the order leases were granted."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.records import AdapterRecord, FileRecord
from sidecar.cache.store import AdapterStore
from sidecar.core.errors import LeaseNotFound
from sidecar.core.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000_000.0

    def __call__(self) -> float:
        return self.now_s


def store_with_adapter(tmp_path: Path, clock: Clock, max_leases: int = 100) -> AdapterStore:
    store = AdapterStore(tmp_path, max_bytes=10**9, max_adapters=10, min_free_bytes=0,
                         lease_ttl_s=60.0, metrics=Metrics(CollectorRegistry(), process=False),
                         max_leases=max_leases, clock=clock, monotonic=clock)
    store.install([AdapterRecord("a", "test", clock(), {"w": FileRecord(10, "e", "0" * 64)})])
    return store


def test_expiry_drops_exactly_the_leases_past_their_ttl(tmp_path: Path) -> None:
    clock = Clock()
    store = store_with_adapter(tmp_path, clock)
    early = [store.lease("a") for _ in range(3)]
    clock.now_s += 30
    late = [store.lease("a") for _ in range(2)]
    store.release(early[1].lease_id)

    clock.now_s += 30  # the early ones are exactly at their expiry
    expired = store.expire_leases()

    assert sorted(lease.lease_id for lease in expired) == sorted(
        [early[0].lease_id, early[2].lease_id])
    assert store.lease_count("a") == 2
    assert store.next_lease_expiry() == late[0].expires_at
    assert store.is_protected("a")
    clock.now_s += 30
    assert len(store.expire_leases()) == 2
    assert not store.is_protected("a")
    assert store.next_lease_expiry() is None


def test_past_the_lease_cap_the_oldest_lease_ends_early(tmp_path: Path) -> None:
    clock = Clock()
    store = store_with_adapter(tmp_path, clock, max_leases=3)
    leases = [store.lease("a") for _ in range(5)]

    assert store.snapshot().active_leases == 3
    assert store.lease_count("a") == 3
    for dropped in leases[:2]:
        with pytest.raises(LeaseNotFound):
            store.release(dropped.lease_id)
    assert store.release(leases[4].lease_id).adapter_id == "a"
    assert store.lease_count("a") == 2


def test_the_store_trims_itself_when_a_release_or_an_unclaim_frees_room(tmp_path: Path) -> None:
    clock = Clock()
    store = AdapterStore(tmp_path, max_bytes=10**9, max_adapters=1, min_free_bytes=0,
                         lease_ttl_s=60.0, metrics=Metrics(CollectorRegistry(), process=False),
                         max_leases=100, clock=clock, monotonic=clock)
    store.prepare()
    for adapter_id in ("a", "b", "c"):
        (tmp_path / "adapters" / adapter_id).mkdir()

    def record(adapter_id: str) -> AdapterRecord:
        return AdapterRecord(adapter_id, "test", clock(), {"w": FileRecord(10, "e", "0" * 8)})

    store.install([record("a")])
    lease = store.lease("a")
    store.claim("b")
    store.admit(record("b"))  # one adapter over the budget: a is leased, b about to be
    assert sorted(a.adapter_id for a in store.adapters()) == ["a", "b"]

    store.release(lease.lease_id)
    assert [a.adapter_id for a in store.adapters()] == ["b"]
    store.claim("c")
    store.admit(record("c"))
    store.unclaim("b")
    assert [a.adapter_id for a in store.adapters()] == ["c"]
    assert not (tmp_path / "adapters" / "a").exists()  # moved to .trash/, not left behind
