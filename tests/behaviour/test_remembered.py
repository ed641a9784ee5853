"""Answers the sidecar remembers instead of asking again: a refusal says that it is remembered
and until when, holds only for the files it judged (a new upload is judged afresh), and `evict`
forgets it; an unknown id costs one registry listing per --not-found-ttl, not one per request.
(A pin still waiting, unpinned: tests/unit/cache/test_pins.py.)"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import aiohttp

from sidecar.cache.refusals import RELIST_REFUSED_S
from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.s3 import S3Registry
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually


def unix_of(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def test_a_remembered_refusal_holds_for_the_same_files_and_a_new_upload_is_judged_afresh(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    folder = local_registry_adapter(tmp_path, "bad", rank=32)  # above --max-lora-rank 16
    sidecar = await start_sidecar(make_settings(tmp_path, refusal_ttl_s=600.0))
    stage_url = f"{sidecar.url}/stage"
    before = time.time()
    status, fresh = await call(http, "POST", stage_url, {"adapter_id": "bad"})
    assert status == 422, fresh
    assert fresh["remembered"] is False
    until = unix_of(fresh["remembered_until"])
    assert before + 600 - 1 <= until <= time.time() + 600 + 1
    assert fresh["remembered_until"] in fresh["message"]

    # Time passing is the point: past the re-check, the same files are listed again.
    await asyncio.sleep(RELIST_REFUSED_S)
    status, again = await call(http, "POST", stage_url, {"adapter_id": "bad"})
    assert status == 422, again
    assert again["remembered"] is True
    assert again["remembered_until"] == fresh["remembered_until"]
    assert again["refused_at"] == fresh["refused_at"]
    assert "remembered" in again["message"] and fresh["remembered_until"] in again["message"]
    assert "a new upload of the adapter is judged afresh" in again["message"]
    assert again["problems"] == fresh["problems"]
    downloads = sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_download_bytes_total")

    shutil.rmtree(folder)
    write_adapter(folder, rank=8)  # fixed in the registry: nothing else to do
    fixed_at = time.monotonic()

    async def staged() -> dict[str, object] | None:
        status, body = await call(http, "POST", stage_url, {"adapter_id": "bad", "lease": False})
        return body if status == 200 else None

    body = await eventually(staged, timeout_s=10, what="the fixed upload is staged")
    assert body["cached"] is False
    assert time.monotonic() - fixed_at < RELIST_REFUSED_S + 2
    # The remembered verdict cost no download of the same files.
    assert downloads == sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_download_bytes_total") - body["size_bytes"]


async def test_evict_forgets_a_remembered_refusal(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "bad", rank=32)
    sidecar = await start_sidecar(make_settings(tmp_path, refusal_ttl_s=600.0))
    status, fresh = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "bad"})
    assert status == 422 and fresh["remembered"] is False

    status, forgot = await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "bad"})
    assert status == 200, forgot
    assert forgot["forgot_refusal"] is True and forgot["freed_bytes"] == 0
    status, judged = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "bad"})
    assert status == 422 and judged["remembered"] is False  # judged afresh at once
    status, nothing = await call(http, "POST", f"{sidecar.url}/evict",
                                 {"adapter_id": "never-asked"})
    assert status == 404 and nothing["error"] == "not_cached"


def test_lora_sidecar_evict_forgets_a_remembered_refusal(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    folder = local_registry_adapter(tmp_path, "bad", rank=32)
    process = SidecarProcess(["--registry", str(tmp_path / "registry"), "--cache-root",
                              str(tmp_path / "cache"), "--refusal-ttl", "600"],
                             tmp_path / "sidecar.log")
    sidecar_processes.append(process)
    assert stage_blocking(process.url, "bad", 30)[0] == 422
    write_adapter(folder, rank=8)
    status, body = stage_blocking(process.url, "bad", 30)
    assert status == 422 and body["remembered"] is True

    done = subprocess.run([sys.executable, "-m", "sidecar", "evict", "bad", "--url", process.url],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "forgot the remembered refusal of bad" in done.stdout
    status, body = stage_blocking(process.url, "bad", 30, lease=False)
    assert status == 200, body


def listings_of(s3: S3Registry, adapter_id: str) -> int:
    return sum(1 for seen in s3.proxy.seen
               if "list-type" in seen.query and f"prefix={s3.prefix}%2F{adapter_id}%2F" in
               seen.query.replace("/", "%2F"))


async def test_an_unknown_id_costs_one_listing_per_not_found_ttl_and_an_upload_is_found(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    ttl_s = 1.5
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, not_found_ttl_s=ttl_s))
    stage_url = f"{sidecar.url}/stage"
    for _ in range(20):  # a client retrying an id nobody uploaded yet
        status, body = await call(http, "POST", stage_url, {"adapter_id": "ghost"})
        assert status == 404 and body["error"] == "adapter_not_found", body
    assert listings_of(s3, "ghost") == 1

    s3.put_adapter("ghost")

    async def found() -> bool:
        status, body = await call(http, "POST", stage_url, {"adapter_id": "ghost"})
        assert status in (200, 404), body
        return status == 200

    await eventually(found, timeout_s=ttl_s + 1, poll_s=0.05, what="the upload found")
    assert listings_of(s3, "ghost") == 2  # listed again once the answer expired, not before
