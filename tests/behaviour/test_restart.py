"""Restarting safely: what a crash leaves behind is cleaned up, published adapters are
re-indexed from their records, anything else is quarantined."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from sidecar.validation.shapes import ModelShapes
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.s3 import S3Registry
from tests.support.settings import local_registry_adapter, make_settings
from tests.support.waiting import eventually


async def test_restart_reindexes_records_and_cleans_staging_and_trash(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    settings = make_settings(tmp_path)
    first = await start_sidecar(settings)
    for adapter_id in ("a", "b"):
        status, _ = await call(http, "POST", f"{first.url}/stage",
                               {"adapter_id": adapter_id, "lease": False})
        assert status == 200
    await first.stop()

    cache = tmp_path / "cache"
    (cache / ".staging" / "c.abc123").mkdir()
    (cache / ".staging" / "c.abc123" / "adapter_model.safetensors").write_bytes(b"partial")
    (cache / ".trash" / "old.123").mkdir()
    # A folder without a record: copied in by hand, or a crash of some other tool.
    stray = cache / "adapters" / "stray"
    local_registry_adapter(tmp_path, "stray")
    stray.mkdir()
    for p in (tmp_path / "registry" / "stray").iterdir():
        (stray / p.name).write_bytes(p.read_bytes())
    # A folder whose files no longer match its record.
    (cache / "adapters" / "b" / "adapter_model.safetensors").write_bytes(b"truncated")

    second = await start_sidecar(settings)
    status, listing = await call(http, "GET", f"{second.url}/adapters")
    assert [a["adapter_id"] for a in listing["adapters"]] == ["a"]
    assert list((cache / ".staging").iterdir()) == []
    assert list((cache / ".trash").iterdir()) == []
    assert sorted(p.name for p in (cache / "adapters").iterdir()) == ["a"]
    quarantined = sorted(p.name.split(".")[0] for p in (cache / ".quarantine").iterdir())
    assert quarantined == ["b", "stray"]
    status, body = await call(http, "POST", f"{second.url}/stage", {"adapter_id": "a"})
    assert body["cached"] is True


async def test_restart_enforces_a_smaller_budget(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for i, adapter_id in enumerate(("a", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=i)
    first = await start_sidecar(make_settings(tmp_path))
    for adapter_id in ("a", "b", "c"):
        await call(http, "POST", f"{first.url}/stage", {"adapter_id": adapter_id, "lease": False})
    await first.stop()

    second = await start_sidecar(make_settings(tmp_path, max_adapters=2))
    assert sorted(a.adapter_id for a in second.store.adapters()) == ["b", "c"]
    assert sorted(p.name for p in (tmp_path / "cache" / "adapters").iterdir()) == ["b", "c"]


# ---- SIGKILL part-way through a download ----------------------------------------------------


async def test_sigkill_during_a_large_download_leaves_nothing_partial(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    shapes = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                         num_key_value_heads=8, num_hidden_layers=16, head_dim=128)
    files = s3.put_adapter("big", rank=16, shapes=shapes,
                           target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"))
    weights_size = len(files["adapter_model.safetensors"])
    # Two GETs in flight: the ~10 MB of weights come as two 5 MiB ranges, each about 20 s long
    # at this rate, so the kill below always lands part-way through the download.
    s3.proxy.throttle_bytes_per_s = 256 * 1024
    cache = tmp_path / "cache"
    args = ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
            "--cache-root", str(cache), "--part-size", "5MiB", "--download-concurrency", "2",
            "--min-free-disk", "0"]
    first = SidecarProcess(args, tmp_path / "sidecar.log")
    sidecar_processes.append(first)

    stage = asyncio.create_task(asyncio.to_thread(stage_blocking, first.url, "big", 60))

    def some_bytes_on_disk() -> Path | None:
        written = [p for p in (cache / ".staging").glob("big.*/adapter_model.safetensors")]
        if written and 0 < os.stat(written[0]).st_blocks * 512 and s3.proxy.gets("big/adapter"):
            return written[0]
        return None

    # Until some but not all bytes are on disk.
    await eventually(some_bytes_on_disk, timeout_s=10, poll_s=0.025,
                     what="the download started")
    first.kill()
    with pytest.raises(OSError):
        await stage
    assert not (cache / "adapters" / "big").exists()
    assert any((cache / ".staging").iterdir())  # the crash did leave a partial download

    s3.proxy.throttle_bytes_per_s = None
    second = SidecarProcess(args, tmp_path / "sidecar.log")
    sidecar_processes.append(second)
    assert list((cache / ".staging").iterdir()) == []
    assert list((cache / "adapters").iterdir()) == []
    status, body = await asyncio.to_thread(stage_blocking, second.url, "big", 60)
    assert status == 200, body
    published = cache / "adapters" / "big" / "adapter_model.safetensors"
    assert published.read_bytes() == files["adapter_model.safetensors"]
    assert published.stat().st_size == weights_size
    second.stop()
