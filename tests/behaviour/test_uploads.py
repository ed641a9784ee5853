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

from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings
from tests.support.waiting import eventually

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def age(folder: Path, seconds: float) -> None:
    """Make a folder's files look uploaded `seconds` ago."""
    then = time.time() - seconds
    for path in folder.iterdir():
        os.utime(path, (then, then))


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
