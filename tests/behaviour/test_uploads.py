"""Uploads as they happen: files landing one by one, a re-upload under an old id while a stage
starts, and an upload still in progress when a client or a pin asks for it."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings, s3_settings
from tests.support.waiting import eventually

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def age(folder: Path, seconds: float) -> None:
    """Make a folder's files look uploaded `seconds` ago."""
    then = time.time() - seconds
    for path in folder.iterdir():
        os.utime(path, (then, then))


def listings_of(s3: S3Registry, adapter_id: str) -> int:
    """The registry's listings of one adapter's folder, as the S3 server saw them."""
    return sum(1 for seen in s3.proxy.seen
               if "list-type=2" in seen.query and f"/{adapter_id}/" in seen.query)


async def test_a_registry_stamping_objects_ahead_of_its_clock_stages_after_one_settle_period(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for seed, adapter_id in enumerate(("skewed-a", "skewed-b")):
        s3.put_adapter(adapter_id, seed=seed)
    # The registry's Date runs 120 s behind the times it stamps on objects: every object looks
    # stored in the future (a gateway with a drifting clock, a replicated object).
    s3.proxy.date_shift_s = -120.0
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, upload_settle_s=1.0))

    with caplog.at_level("DEBUG", logger="sidecar.cache.stager"):
        for adapter_id in ("skewed-a", "skewed-b"):
            status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                      {"adapter_id": adapter_id, "lease": False})
            assert status == 200, body
            # Listed, and once more a settle period later: the same listing is settled (not
            # 30 listings waiting for an age that never comes).
            assert listings_of(s3, adapter_id) == 2

    skew = [r for r in caplog.records if "registry clock skew" in r.getMessage()]
    assert [r.levelname for r in skew] == ["WARNING", "DEBUG"]  # said once, then quietly
    assert "skewed-a" in skew[0].getMessage()
    assert "the registry's own time" in skew[0].getMessage()
    assert not [r for r in caplog.records if "landed in the registry" in r.getMessage()]


async def test_files_of_one_upload_landing_a_moment_apart_are_staged_together(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    registry = tmp_path / "registry" / "tenant-a"
    write_adapter(registry, seed=1)
    age(registry, 60)
    sidecar = await start_sidecar(make_settings(tmp_path, upload_settle_s=1.0))
    status, first = await call(http, "POST", f"{sidecar.url}/stage",
                               {"adapter_id": "tenant-a", "lease": False})
    assert status == 200 and first["cached"] is False
    await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "tenant-a"})
    second = tmp_path / "v2"
    write_adapter(second, seed=2, rank=4)

    # Re-uploaded: the config lands, a stage starts, the weights land 0.4 s later.
    os.replace(second / CONFIG, registry / CONFIG)
    staging = asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                       {"adapter_id": "tenant-a", "lease": False}))
    await asyncio.sleep(0.4)  # time passing is the point: the upload's files land apart
    os.replace(second / WEIGHTS, registry / WEIGHTS)
    status, staged = await staging

    assert status == 200, staged
    published = Path(staged["local_path"])
    assert json.loads((published / CONFIG).read_text())["r"] == 4
    assert (published / WEIGHTS).read_bytes() == (registry / WEIGHTS).read_bytes()
    assert staged["content_digest"] != first["content_digest"]


def stage_now(url: str, adapter_id: str) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(f"{url}/stage", method="POST", data=json.dumps(
        {"adapter_id": adapter_id, "lease": False}).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_an_upload_in_progress_is_staged_a_moment_after_its_last_file_client_and_pin(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    files = {}
    for adapter_id in ("pinned-late", "asked-late"):
        folder = tmp_path / adapter_id
        write_adapter(folder, seed=len(adapter_id))
        files[adapter_id] = folder
        s3.put_object(s3.key(adapter_id, WEIGHTS), (folder / WEIGHTS).read_bytes())
    process = SidecarProcess(
        ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
         "--cache-root", str(tmp_path / "cache"), "--min-free-disk", "0",
         "--pin", "pinned-late"], tmp_path / "sidecar.log")
    sidecar_processes.append(process)
    # Only the weights are there: refused, for those files, by both.
    status, refused = await asyncio.to_thread(stage_now, process.url, "asked-late")
    assert status == 422 and "missing" in json.dumps(refused["problems"]), refused

    await asyncio.sleep(3)  # the config lands seconds later, as `aws s3 cp --recursive` does
    for adapter_id, folder in files.items():
        s3.put_object(s3.key(adapter_id, CONFIG), (folder / CONFIG).read_bytes())
    landed = time.monotonic()

    async def client_served() -> bool:
        return (await asyncio.to_thread(stage_now, process.url, "asked-late"))[0] == 200

    def pinned() -> bool:
        with urllib.request.urlopen(f"{process.url}/adapters", timeout=10) as response:
            listed = json.loads(response.read())["adapters"]
        return any(a["adapter_id"] == "pinned-late" and a["pinned"] for a in listed)

    async def pin_staged() -> bool:
        return await asyncio.to_thread(pinned)

    await eventually(client_served, timeout_s=10, what="the client's adapter is staged")
    client_s = time.monotonic() - landed
    await eventually(pin_staged, timeout_s=10, what="the pin is staged")
    pin_s = time.monotonic() - landed

    # The settle time (1 s, to the second on S3) and the re-check of the refusal (1 s).
    assert client_s < 4.0 and pin_s < 4.0, (client_s, pin_s)
