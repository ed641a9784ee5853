"""The store on its own: lease expiry in the order leases were granted, claims, and the room a
download reserves (given in the order asked, waited for within a deadline)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.records import AdapterRecord, FileRecord
from sidecar.cache.store import AdapterStore
from sidecar.core.errors import CacheFull, LeaseNotFound
from sidecar.core.metrics import Metrics
from tests.support.waiting import eventually


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
    with store.claim("c"), store.claim("b"):
        store.admit(record("b"))  # one adapter over the budget: a is leased, b about to be
        assert sorted(a.adapter_id for a in store.adapters()) == ["a", "b"]

        store.release(lease.lease_id)
        assert [a.adapter_id for a in store.adapters()] == ["b"]
        store.admit(record("c"))
        assert sorted(a.adapter_id for a in store.adapters()) == ["b", "c"]
        # b's claim ends first (the inner block), c's after: b goes at once, c stays.
    assert [a.adapter_id for a in store.adapters()] == ["c"]
    assert not (tmp_path / "adapters" / "a").exists()  # moved to .trash/, not left behind


def leased_store(tmp_path: Path, clock: Clock) -> tuple[AdapterStore, str]:
    """A store of one adapter in a budget of one, that adapter leased: no room for another."""
    store = AdapterStore(tmp_path, max_bytes=10**9, max_adapters=1, min_free_bytes=0,
                         lease_ttl_s=60.0, max_leases=100,
                         metrics=Metrics(CollectorRegistry(), process=False),
                         clock=clock, monotonic=clock)
    store.prepare()
    (tmp_path / "adapters" / "a").mkdir()
    store.install([AdapterRecord("a", "test", clock(), {"w": FileRecord(10, "e", "0" * 64)})])
    return store, store.lease("a").lease_id


async def test_downloads_waiting_for_room_get_it_in_the_order_they_asked(tmp_path: Path) -> None:
    store, lease_id = leased_store(tmp_path, Clock())
    order: list[str] = []

    async def download(adapter_id: str) -> None:
        async with store.staging(adapter_id) as staging:
            assert staging.path.is_dir() and staging.path.parent == store.staging_dir
            await staging.reserve(10, wait_s=30)
            order.append(adapter_id)
            await asyncio.sleep(0)  # hold the room for a step: the next one still waits
        assert not staging.path.exists()  # the folder goes with the block

    def waiting(count: int) -> Callable[[], bool]:
        return lambda: store.waiting_for_room == count

    tasks = []
    for adapter_id in ("b", "c", "d"):  # one after another: each makes its folder in a thread
        tasks.append(asyncio.create_task(download(adapter_id)))
        await eventually(waiting(len(tasks)), timeout_s=10, what=f"{adapter_id} waiting for room")
    assert order == []
    store.release(lease_id)  # a is evicted; the room passes from one download to the next
    await asyncio.gather(*tasks)

    assert order == ["b", "c", "d"]
    assert store.waiting_for_room == 0


async def test_a_download_that_waits_past_its_time_is_cache_full_and_retryable(
    tmp_path: Path,
) -> None:
    store, _ = leased_store(tmp_path, Clock())

    async with store.staging("b") as staging:
        with pytest.raises(CacheFull) as raised:
            await staging.reserve(10, wait_s=0.05)

    assert raised.value.retryable and "waited" in raised.value.message
    assert store.waiting_for_room == 0 and list(store.staging_dir.iterdir()) == []
    assert store.get("a") is not None  # nothing was evicted for it


async def test_pinned_room_is_cache_full_at_once_without_waiting(tmp_path: Path) -> None:
    store, lease_id = leased_store(tmp_path, Clock())
    store.pin("a")
    store.release(lease_id)

    async with store.staging("b") as staging:
        with pytest.raises(CacheFull) as raised:
            await staging.reserve(10, wait_s=30)

    assert not raised.value.retryable and store.waiting_for_room == 0


def test_an_adapter_larger_than_the_budget_is_refused_before_any_room_is_made(
    tmp_path: Path,
) -> None:
    store = store_with_adapter(tmp_path, Clock())
    with pytest.raises(CacheFull) as raised:
        store.fits_budget("huge", 10**9 + 1)
    assert not raised.value.retryable and store.get("a") is not None


async def test_room_is_held_at_once_only_when_nothing_need_be_evicted(tmp_path: Path) -> None:
    clock = Clock()
    store = AdapterStore(tmp_path, max_bytes=100, max_adapters=2, min_free_bytes=0,
                         lease_ttl_s=60.0, metrics=Metrics(CollectorRegistry(), process=False),
                         max_leases=100, clock=clock, monotonic=clock)
    store.prepare()
    (tmp_path / "adapters" / "a").mkdir()
    store.install([AdapterRecord("a", "test", clock(), {"w": FileRecord(60, "e", "0" * 64)})])

    assert store.reserve_free("big", 41) is None  # only with "a" evicted
    held = store.reserve_free("small", 40)
    assert held is not None and store.get("a") is not None
    assert store.reserve_free("next", 1) is None  # the budget is full with the room held
    async with store.staging("small", reserved=held) as staging:
        assert staging.reservation is held and store.room_bytes() == 60
    assert store.room_bytes() == 100 and list((tmp_path / ".staging").iterdir()) == []
    # Two adapters at most: "a" and one download.
    assert store.reserve_free("two", 20) is not None and store.reserve_free("three", 1) is None
