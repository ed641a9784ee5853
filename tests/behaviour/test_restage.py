"""The same adapter evicted and staged again, over and over, with the folder watcher and the
catalog running: every stage answers 200 with the registry's bytes and a name, and nothing the
sidecar does itself is taken for a change made outside it. Also a catalog generation folder
removed outside the sidecar: a name link that cannot be written there must not stop evictions
or the stages after it."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from sidecar.cache import records
from sidecar.cache.records import AdapterRecord
from sidecar.process.app import Sidecar
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.settings import local_registry_adapter, make_settings
from tests.support.waiting import eventually

ADAPTER = "restaged"
CYCLES = 6
SLOW_READ_S = 0.3  # the watcher's record read spans an evict and the next publish


def external_evictions(sidecar: Sidecar) -> float:
    registry = sidecar.metrics.metrics_registry
    return registry.get_sample_value("lora_sidecar_evictions_total",
                                     {"reason": "external"}) or 0.0


def same_bytes(registry: Path, cached: Path) -> bool:
    files = sorted(p.name for p in registry.iterdir())
    return all((registry / name).read_bytes() == (cached / name).read_bytes() for name in files)


async def evict_forced(http: aiohttp.ClientSession, sidecar: Sidecar, adapter_id: str) -> None:
    status, body = await call(http, "POST", f"{sidecar.url}/evict",
                              {"adapter_id": adapter_id, "force": True})
    assert status == 200, body
    trash = sidecar.store.root / ".trash"
    await eventually(lambda: not any(trash.iterdir()), timeout_s=10,
                     what="the evicted folder deleted from .trash")


async def cycle(http: aiohttp.ClientSession, sidecar: Sidecar, source: Path) -> None:
    body = await stage_ok(http, sidecar, ADAPTER)
    assert body["lora_name"], body
    assert same_bytes(source, sidecar.store.root / "adapters" / ADAPTER)
    status, released = await call(http, "POST", f"{sidecar.url}/release",
                                  {"lease_id": body["lease_id"]})
    assert status == 200, released
    await evict_forced(http, sidecar, ADAPTER)


async def test_evicted_and_staged_again_with_a_slow_watcher_is_never_an_external_change(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = local_registry_adapter(tmp_path, ADAPTER)
    sidecar = await start_sidecar(make_settings(tmp_path))
    read_record = sidecar.store.read_record

    def slow_read(folder: Path) -> AdapterRecord:  # run in a thread by the watcher
        time.sleep(SLOW_READ_S)
        return read_record(folder)

    monkeypatch.setattr(sidecar.store, "read_record", slow_read)
    for _ in range(CYCLES):
        await cycle(http, sidecar, source)
        # Stage again at once, while the watcher still judges the last burst of events.
    await asyncio.sleep(SLOW_READ_S * 2)
    body = await stage_ok(http, sidecar, ADAPTER)
    assert same_bytes(source, sidecar.store.root / "adapters" / ADAPTER)
    assert body["lora_name"]
    assert external_evictions(sidecar) == 0


async def test_a_generation_folder_removed_outside_does_not_poison_evictions_or_stages(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    source = local_registry_adapter(tmp_path, ADAPTER)
    sidecar = await start_sidecar(make_settings(tmp_path))
    await cycle(http, sidecar, source)
    await stage_ok(http, sidecar, ADAPTER, lease=False)
    catalog = sidecar.store.root / "catalog"
    for generation in catalog.glob("g*"):
        shutil.rmtree(generation)  # as a wipe of the cache root by someone else does

    await evict_forced(http, sidecar, ADAPTER)
    for _ in range(3):
        status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                  {"adapter_id": ADAPTER, "hold_s": 10})
        assert status == 200, body
        assert body["lora_name"]
        assert same_bytes(source, sidecar.store.root / "adapters" / ADAPTER)
        status, released = await call(http, "POST", f"{sidecar.url}/release",
                                      {"lease_id": body["lease_id"]})
        assert status == 200, released
        await evict_forced(http, sidecar, ADAPTER)


async def test_a_folder_evicted_while_the_watcher_reads_its_record_is_no_failure(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher reads a published folder's record (in a thread) while the sidecar evicts
    it: the folder goes between the record file's read and the listing of its files. That is
    the sidecar's own eviction, not a failure and not a change made outside."""
    caplog.set_level(logging.INFO, logger="sidecar")
    source = local_registry_adapter(tmp_path, ADAPTER)
    sidecar = await start_sidecar(make_settings(tmp_path))
    folder = sidecar.store.root / "adapters" / ADAPTER
    listing = threading.Event()
    real_os = records.os

    def scandir(path: Any) -> Any:  # the record read, halfway: wait for the eviction
        if Path(path) == folder and not listing.is_set():
            listing.set()
            deadline = time.monotonic() + 10
            while folder.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # polled in the watcher's thread, which the eviction must pass
        return real_os.scandir(path)

    monkeypatch.setattr(records, "os", SimpleNamespace(**{**vars(real_os), "scandir": scandir}))
    await stage_ok(http, sidecar, ADAPTER, lease=False)
    await eventually(listing.is_set, timeout_s=10, what="the watcher reading the record")
    await evict_forced(http, sidecar, ADAPTER)
    await asyncio.sleep(0.5)  # the watcher's judging ends

    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert failures == []
    assert external_evictions(sidecar) == 0
    body = await stage_ok(http, sidecar, ADAPTER)  # and the watcher and the stage carry on
    assert same_bytes(source, folder) and body["lora_name"]
