"""The watcher: folders removed from or copied into `adapters/` by someone else are noticed,
and the index, the API and the gauges follow; the sidecar's own renames change nothing."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from pathlib import Path

import aiohttp

from sidecar.cache.records import RECORD_NAME
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.broken_adapters import CORPUS
from tests.support.observing import scrape
from tests.support.settings import local_registry_adapter, make_settings
from tests.support.waiting import eventually

TRUNCATED = next(case for case in CORPUS if case.name == "truncated_file")


async def _listed(http: aiohttp.ClientSession, sidecar: Sidecar) -> list[str]:
    status, body = await call(http, "GET", f"{sidecar.url}/adapters")
    assert status == 200
    return sorted(a["adapter_id"] for a in body["adapters"])


def _quarantined(sidecar: Sidecar) -> list[str]:
    folder = sidecar.store.quarantine_dir
    return sorted(p.name.split(".")[0] for p in folder.iterdir()) if folder.is_dir() else []


async def _settled(sidecar: Sidecar) -> bool:
    return not sidecar.watcher.pending


async def test_folder_removed_by_hand_leaves_index_and_gauges_within_two_seconds(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sizes = {i: local_registry_adapter(tmp_path, i, seed=n) for n, i in enumerate(("a", "b"))}
    sidecar = await start_sidecar(make_settings(tmp_path))
    await stage_ok(http, sidecar, "a", lease=False)
    await stage_ok(http, sidecar, "b")  # leased: an operator's rm wins over a lease
    b_bytes = sum(p.stat().st_size for p in sizes["b"].iterdir())

    removed_at = time.monotonic()
    shutil.rmtree(sidecar.store.path_of("a"))

    async def gone() -> bool:
        return await _listed(http, sidecar) == ["b"]

    await eventually(gone, timeout_s=2, what="a leaves /adapters")
    metrics = await scrape(http, sidecar.url)
    assert time.monotonic() - removed_at < 2
    assert metrics.value("lora_sidecar_cache_adapters") == 1
    assert metrics.value("lora_sidecar_cache_bytes") == b_bytes
    assert metrics.value("lora_sidecar_evictions_total", reason="external") == 1

    shutil.rmtree(sidecar.store.path_of("b"))

    async def empty() -> bool:
        return await _listed(http, sidecar) == []

    await eventually(empty, timeout_s=2, what="b leaves /adapters")
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_evictions_total", reason="external") == 2
    assert metrics.value("lora_sidecar_active_leases") == 0  # its lease went with it
    # Staged again on demand, from the registry.
    assert (await stage_ok(http, sidecar, "a"))["cached"] is False


async def test_valid_folder_copied_in_is_adopted_with_a_record_and_served_as_a_hit(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    # Not in the registry at all: a hit can only come from the copy.
    provisioned = tmp_path / "provisioning" / "copied-v1"
    size_bytes = write_adapter(provisioned, seed=7)
    shutil.copytree(provisioned, sidecar.store.path_of("copied-v1"))

    async def adopted() -> bool:
        return await _listed(http, sidecar) == ["copied-v1"]

    await eventually(adopted, timeout_s=5, what="the copy is adopted")
    record = json.loads((sidecar.store.path_of("copied-v1") / RECORD_NAME).read_text())
    assert record["adapter_id"] == "copied-v1"
    assert record["size_bytes"] == size_bytes
    assert {name: f["sha256"] for name, f in record["files"].items()} == {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in provisioned.iterdir()
    }
    body = await stage_ok(http, sidecar, "copied-v1")
    assert body["cached"] is True
    assert body["size_bytes"] == size_bytes
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_cache_adapters") == 1
    assert metrics.value("lora_sidecar_cache_bytes") == size_bytes
    assert metrics.value("lora_sidecar_download_bytes_total") == 0


async def test_copy_in_progress_is_judged_only_once_it_is_quiet(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    source = tmp_path / "provisioning" / "slow"
    write_adapter(source, seed=3)
    weights = (source / "adapter_model.safetensors").read_bytes()
    target = sidecar.store.path_of("slow")
    target.mkdir()
    shutil.copy(source / "adapter_config.json", target)
    # The scenario is a slow writer (the sleeps are its pauses, not a synchronisation):
    # pauses shorter than the watcher's quiet period, and a file half-written meanwhile.
    await asyncio.sleep(0.4)
    (target / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    await asyncio.sleep(0.4)
    (target / "adapter_model.safetensors").write_bytes(weights)

    async def adopted() -> bool:
        return await _listed(http, sidecar) == ["slow"]

    await eventually(adopted, timeout_s=5, what="the finished copy is adopted")
    assert _quarantined(sidecar) == []


async def test_broken_folder_copied_in_is_quarantined_and_never_served(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "in-registry", seed=5)
    sidecar = await start_sidecar(make_settings(tmp_path))
    TRUNCATED.write(sidecar.store.path_of("in-registry"))
    TRUNCATED.write(sidecar.store.path_of("not-in-registry"))
    (sidecar.store.adapters_dir / "bad id!").mkdir()

    async def all_moved_aside() -> bool:
        return _quarantined(sidecar) == ["bad id!", "in-registry", "not-in-registry"]

    await eventually(all_moved_aside, timeout_s=5, what="three folders quarantined")
    assert await _listed(http, sidecar) == []
    metrics = await scrape(http, sidecar.url)
    failures = metrics.value("lora_sidecar_validation_failures_total",
                             reason="safetensors_length_mismatch")
    assert failures == 2
    assert metrics.value("lora_sidecar_quarantined_total") == 3
    # Asked for, it is downloaded afresh from the registry, or unknown.
    body = await stage_ok(http, sidecar, "in-registry")
    assert body["cached"] is False
    registry_weights = tmp_path / "registry" / "in-registry" / "adapter_model.safetensors"
    staged_weights = Path(str(body["local_path"])) / "adapter_model.safetensors"
    assert staged_weights.read_bytes() == registry_weights.read_bytes()
    status, error = await call(http, "POST", f"{sidecar.url}/stage",
                               {"adapter_id": "not-in-registry"})
    assert (status, error["error"]) == (404, "adapter_not_found")


async def test_file_removed_from_a_cached_folder_stops_it_being_served(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "a", seed=1)
    sidecar = await start_sidecar(make_settings(tmp_path))
    await stage_ok(http, sidecar, "a", lease=False)
    (sidecar.store.path_of("a") / "adapter_config.json").unlink()

    async def moved_aside() -> bool:
        return _quarantined(sidecar) == ["a"]

    await eventually(moved_aside, timeout_s=5, what="the damaged folder is quarantined")
    assert await _listed(http, sidecar) == []
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_evictions_total", reason="external") == 1
    assert (await stage_ok(http, sidecar, "a"))["cached"] is False


async def test_own_stage_and_evict_cause_no_adoption_or_external_eviction(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for n, adapter_id in enumerate(("a", "b", "c", "d")):
        local_registry_adapter(tmp_path, adapter_id, seed=n)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=3))
    await stage_ok(http, sidecar, "a", lease=False)
    await stage_ok(http, sidecar, "b", lease=False)
    status, _ = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "b"})
    assert status == 200
    await stage_ok(http, sidecar, "b", lease=False)  # the same id again, right after
    await stage_ok(http, sidecar, "c", lease=False)
    await stage_ok(http, sidecar, "d", lease=False)  # over budget: a goes (lru)

    # A barrier: events arrive in order, so once this copy is adopted, the events of the
    # sidecar's own renames above have been judged too.
    write_adapter(sidecar.store.path_of("barrier"), seed=9)
    status, _ = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "c"})

    async def barrier_adopted() -> bool:
        return "barrier" in await _listed(http, sidecar)

    await eventually(barrier_adopted, timeout_s=5, what="the barrier copy is adopted")
    await eventually(lambda: _settled(sidecar), timeout_s=5, what="the watcher settles")
    assert await _listed(http, sidecar) == ["b", "barrier", "d"]
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_evictions_total", reason="external") == 0
    assert metrics.value("lora_sidecar_evictions_total", reason="manual") == 2
    assert metrics.value("lora_sidecar_evictions_total", reason="policy") == 1
    assert _quarantined(sidecar) == []
    records = {
        p.name: json.loads((p / RECORD_NAME).read_text())["source"]
        for p in sidecar.store.adapters_dir.iterdir()
    }
    assert records == {"b": str(tmp_path / "registry"), "d": str(tmp_path / "registry"),
                       "barrier": "adopted"}


async def test_a_folder_copied_in_private_is_published_with_a_stages_modes(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """A copy whose files were written 0600 in a 0700 folder (safetensors' own mode) is adopted
    with the modes a stage of the same adapter publishes, so the engine's user reads both."""
    local_registry_adapter(tmp_path, "staged-v1", seed=3)
    sidecar = await start_sidecar(make_settings(tmp_path))
    await stage_ok(http, sidecar, "staged-v1", lease=False)
    provisioned = tmp_path / "provisioning" / "copied-v1"
    write_adapter(provisioned, seed=7)
    for entry in provisioned.iterdir():
        entry.chmod(0o600)
    provisioned.chmod(0o700)
    shutil.copytree(provisioned, sidecar.store.path_of("copied-v1"))

    async def adopted() -> bool:
        return await _listed(http, sidecar) == ["copied-v1", "staged-v1"]

    await eventually(adopted, timeout_s=5, what="the copy is adopted")

    def modes(folder: Path) -> dict[str, int]:
        found = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        return {".": folder.stat().st_mode & 0o777, **found}

    staged = modes(sidecar.store.path_of("staged-v1"))
    copied = modes(sidecar.store.path_of("copied-v1"))
    assert copied.keys() == staged.keys()
    assert copied == staged, (copied, staged)
    assert all(mode & 0o044 == 0o044 for mode in copied.values())  # readable by the engine


async def test_events_watchdog_delivers_after_stop_reach_nothing(tmp_path: Path) -> None:
    """The watcher stops forwarding at once (watchdog's threads end on their own within half a
    second): an event its thread hands over after the stop never reaches the loop's queue."""
    from watchdog.events import DirCreatedEvent, FileSystemEvent

    from sidecar.cache.watcher import _Forward

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[FileSystemEvent] = asyncio.Queue()
    forward = _Forward(loop, queue)
    before, after = DirCreatedEvent(str(tmp_path / "a")), DirCreatedEvent(str(tmp_path / "b"))
    await asyncio.to_thread(forward.on_any_event, before)  # from a thread, as watchdog's
    forward.closed = True
    await asyncio.to_thread(forward.on_any_event, after)
    sentinel = DirCreatedEvent(str(tmp_path / "sentinel"))
    loop.call_soon_threadsafe(queue.put_nowait, sentinel)  # queued behind anything forwarded
    assert [await queue.get(), await queue.get()] == [before, sentinel]
