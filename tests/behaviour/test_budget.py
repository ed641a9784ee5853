"""The cache budget: LRU order, byte and count limits, pins, leases and their expiry,
operator eviction."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import aiohttp
from aiohttp import web

from sidecar.cache.stager import JUDGE_FIRST_MAX
from sidecar.process.app import Sidecar
from tests.support.api import StartSidecar, call, readiness, stage_ok
from tests.support.cache_checks import budget_bytes
from tests.support.s3 import S3Registry
from tests.support.s3proxy import Seen, drop_connection, is_object_get
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually


def cached_ids(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "cache" / "adapters").iterdir()}


async def release(http: aiohttp.ClientSession, sidecar: Sidecar, lease_id: object) -> None:
    status, body = await call(http, "POST", f"{sidecar.url}/release", {"lease_id": lease_id})
    assert status == 200, body


async def test_count_budget_evicts_least_recently_used(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=2))

    for adapter_id in ("a", "b"):
        await stage_ok(http, sidecar, adapter_id, lease=False)
    await stage_ok(http, sidecar, "a", lease=False)  # a is now more recent than b
    await stage_ok(http, sidecar, "c", lease=False)

    assert cached_ids(tmp_path) == {"a", "c"}
    status, listing = await call(http, "GET", f"{sidecar.url}/adapters")
    assert status == 200
    assert [a["adapter_id"] for a in listing["adapters"]] == ["c", "a"]
    assert listing["cache"]["adapters"] == 2


async def test_byte_budget_evicts_until_it_fits(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    size = sum(p.stat().st_size for p in (tmp_path / "registry" / "a").iterdir())
    sidecar = await start_sidecar(make_settings(tmp_path, max_bytes=2 * size + size // 2))

    for adapter_id in ("a", "b", "c"):
        await stage_ok(http, sidecar, adapter_id, lease=False)

    assert cached_ids(tmp_path) == {"b", "c"}
    assert sidecar.store.total_bytes <= 2 * size + size // 2


async def test_leased_adapter_is_not_evicted_and_a_stage_with_no_time_to_wait_is_507(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=1))

    leased = await stage_ok(http, sidecar, "a")
    # A deadline of a second leaves no time to wait for the lease to end.
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "b", "timeout_s": 1})
    assert status == 507
    assert body["error"] == "cache_full"
    assert body["retryable"] is True  # the lease will end
    assert cached_ids(tmp_path) == {"a"}
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []

    await release(http, sidecar, leased["lease_id"])
    await stage_ok(http, sidecar, "b")
    assert cached_ids(tmp_path) == {"b"}


async def test_a_stage_waits_for_room_a_lease_holds_and_is_staged_once_it_is_released(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=1))
    leased = await stage_ok(http, sidecar, "a")

    waiting = asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                       {"adapter_id": "b", "timeout_s": 60}))
    await eventually(lambda: sidecar.store.waiting_for_room == 1, timeout_s=10,
                     what="the stage of b waiting for room")
    assert sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_stages_waiting_for_room") == 1
    assert cached_ids(tmp_path) == {"a"}
    await release(http, sidecar, leased["lease_id"])

    status, body = await waiting
    assert status == 200, body
    assert cached_ids(tmp_path) == {"b"}
    assert sidecar.store.waiting_for_room == 0


async def test_release_of_unknown_lease_is_404(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await call(http, "POST", f"{sidecar.url}/release", {"lease_id": "nope"})
    assert status == 404
    assert body["error"] == "lease_not_found"


async def test_lease_expires_after_its_ttl_and_the_adapter_becomes_evictable(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path, lease_ttl_s=0.3))
    answer = await stage_ok(http, sidecar, "a")
    status, body = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a"})
    assert status == 409

    # The expiry task runs every second at most.
    await eventually(lambda: sidecar.store.snapshot().active_leases == 0, timeout_s=5,
                     what="the lease expired")
    status, body = await call(http, "POST", f"{sidecar.url}/release",
                              {"lease_id": answer["lease_id"]})
    assert status == 404
    status, body = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a"})
    assert status == 200, body
    assert body["reason"] == "manual"
    assert cached_ids(tmp_path) == set()


async def test_evicting_a_leased_adapter_is_409_unless_forced(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))
    first = await stage_ok(http, sidecar, "a")
    second = await stage_ok(http, sidecar, "a")

    status, body = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a"})
    assert status == 409
    assert body["error"] == "adapter_in_use"
    assert body["leases"] == 2
    assert cached_ids(tmp_path) == {"a"}

    status, body = await call(http, "POST", f"{sidecar.url}/evict",
                              {"adapter_id": "a", "force": True})
    assert status == 200
    assert body["reason"] == "forced"
    assert sorted(body["broken_leases"]) == sorted([first["lease_id"], second["lease_id"]])
    assert body["freed_bytes"] == first["size_bytes"]
    assert cached_ids(tmp_path) == set()
    status, _ = await call(http, "POST", f"{sidecar.url}/release", {"lease_id": first["lease_id"]})
    assert status == 404


async def test_evicting_an_uncached_adapter_is_404(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a"})
    assert status == 404
    assert body["error"] == "not_cached"


async def test_eviction_moves_the_folder_to_trash_and_deletes_it(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a")
    sidecar = await start_sidecar(make_settings(tmp_path))
    await stage_ok(http, sidecar, "a", lease=False)
    folder = tmp_path / "cache" / "adapters" / "a"
    trash = tmp_path / "cache" / ".trash"
    # The folder itself, followed wherever it goes: the kernel names an open directory by its
    # path now, " (deleted)" once it is gone. An rmtree in place would leave it under adapters/.
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        status, _ = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a"})
        assert status == 200
        assert not folder.exists()

        async def deleted() -> str | None:
            where = os.readlink(f"/proc/self/fd/{fd}")
            return where if where.endswith(" (deleted)") else None

        where = await eventually(deleted, timeout_s=5, what="the evicted folder deleted")
    finally:
        os.close(fd)
    assert Path(where.removesuffix(" (deleted)")).parent == trash.resolve()
    assert Path(where).name.startswith("a.")
    assert list(trash.iterdir()) == []


async def test_pinned_adapters_are_staged_at_start_and_never_evicted(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("pinned", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=2, pin=("pinned",)))
    await readiness(http, sidecar.url, status=200, timeout_s=10)
    assert cached_ids(tmp_path) == {"pinned"}

    await stage_ok(http, sidecar, "b", lease=False)
    await stage_ok(http, sidecar, "c", lease=False)
    assert cached_ids(tmp_path) == {"pinned", "c"}

    status, body = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "pinned"})
    assert status == 409
    assert body["pinned"] is True


async def test_pin_and_unpin_through_the_api(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=1))

    status, body = await call(http, "POST", f"{sidecar.url}/pin", {"adapter_id": "a"})
    assert status == 200, body
    assert body["pinned"] is True
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "b"})
    assert status == 507  # the only slot is pinned
    assert body["retryable"] is False  # waiting cannot help while the pin stands

    status, body = await call(http, "POST", f"{sidecar.url}/unpin", {"adapter_id": "a"})
    assert status == 200
    assert body["was_pinned"] is True
    await stage_ok(http, sidecar, "b", lease=False)
    assert cached_ids(tmp_path) == {"b"}


async def test_readyz_waits_for_a_pin_while_the_registry_cannot_be_asked(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # A registry that does not answer at start cannot say whether a pin exists: the sidecar
    # starts, not ready, and stages the pin once the registry is back.
    s3.proxy.fault = drop_connection
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, pin=("later",)))
    status, body = await call(http, "GET", f"{sidecar.url}/readyz")
    assert status == 503
    assert "later" in body["message"]

    s3.put_adapter("later")
    s3.proxy.fault = None
    await readiness(http, sidecar.url, status=200, timeout_s=30)
    assert cached_ids(tmp_path) == {"later"}


async def test_thirty_warm_ups_with_room_for_five_are_all_answered_with_a_name(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    ids = [f"warm-{i:02d}" for i in range(30)]
    for i, adapter_id in enumerate(ids):
        local_registry_adapter(tmp_path, adapter_id, seed=i, rank=4)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=5))

    answers = await asyncio.gather(*(
        call(http, "POST", f"{sidecar.url}/stage",
             {"adapter_id": adapter_id, "lease": False, "timeout_s": 120})
        for adapter_id in ids))

    failed = [(adapter_id, status, body)
              for adapter_id, (status, body) in zip(ids, answers, strict=True) if status != 200]
    assert failed == []  # neither catalog_pending (evicted before its name) nor cache_full
    assert all(body["lora_name"] for _, body in answers)
    assert len(cached_ids(tmp_path)) == 5


async def test_thirty_leased_stages_with_room_for_five_wait_their_turn_and_none_is_507(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    ids = [f"turn-{i:02d}" for i in range(30)]
    for i, adapter_id in enumerate(ids):
        local_registry_adapter(tmp_path, adapter_id, seed=i, rank=4)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=5))

    async def request(adapter_id: str) -> tuple[int, object]:
        """A client: stage, use the adapter, release the lease."""
        status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                  {"adapter_id": adapter_id, "timeout_s": 120})
        if status == 200:
            await release(http, sidecar, body["lease_id"])
        return status, body

    answers = await asyncio.gather(*(request(adapter_id) for adapter_id in ids))

    assert [(i, a) for i, a in zip(ids, answers, strict=True) if a[0] != 200] == []
    assert sidecar.store.waiting_for_room == 0
    assert len(cached_ids(tmp_path)) <= 5


async def test_stages_judging_new_adapters_at_once_never_put_the_cache_over_its_budget(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # The cache holds exactly its budget; as many new adapters as may be judged at once are
    # staged together, their configs' GETs held at the registry so that all are being judged
    # at the same moment. The bytes under the cache root never exceed the budget: the files
    # judged before room is reserved are held in memory, written only within the room.
    cached = [f"full-{n}" for n in range(JUDGE_FIRST_MAX)]
    new = [f"new-{n}" for n in range(JUDGE_FIRST_MAX)]
    sizes = {adapter_id: sum(len(data) for data in s3.put_adapter(
        adapter_id, seed=n, rank=4).values()) for n, adapter_id in enumerate(cached + new)}
    budget = sum(sizes[adapter_id] for adapter_id in cached)
    assert all(sizes[adapter_id] <= budget for adapter_id in new)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, max_bytes=budget))
    root = sidecar.store.root
    for adapter_id in cached:
        await stage_ok(http, sidecar, adapter_id, lease=False)
    await sidecar.store.settle_trash()
    assert budget_bytes(root) == budget  # exactly full: every new adapter needs an eviction

    held: list[Seen] = []

    async def hold_config_gets(request: web.Request, seen: Seen) -> web.StreamResponse | None:
        if is_object_get(seen) and seen.path.endswith("/adapter_config.json"):
            held.append(seen)
            await s3.proxy.stall()  # until the test has looked at the disk
        return None

    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):  # a sample every few ms, as a disk sampler takes them
            samples.append(budget_bytes(root))

    sampler = threading.Thread(target=sample, name="budget-sampler")
    s3.proxy.fault = hold_config_gets
    sampler.start()
    try:
        stages = [asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                           {"adapter_id": adapter_id, "lease": False}))
                  for adapter_id in new]
        await eventually(lambda: len(held) == len(new), timeout_s=30,
                         what=lambda: f"config GETs held: {held}")
        judging = budget_bytes(root)
        staging_while_judging = os.listdir(root / ".staging")
        s3.proxy.fault = None
        s3.proxy.release_stalls()
        answers = await asyncio.gather(*stages)
    finally:
        stop.set()
        sampler.join()
        s3.proxy.release_stalls()

    assert judging <= budget, f"{judging - budget} bytes over the budget while judging"
    assert staging_while_judging == []  # not even a folder before room is reserved
    assert [status for status, _ in answers] == [200] * len(new), answers
    assert samples and max(samples) <= budget, (max(samples) - budget, len(samples))
    assert cached_ids(tmp_path) == set(new)
