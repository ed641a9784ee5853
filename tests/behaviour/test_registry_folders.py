"""Registry folders that cannot be adapters (a name that is not an id, a symbolic link) are
never served, and never silently: one log line each time the set of them changes, and a gauge
with their number, for the local and the S3 registry."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import aiohttp
import pytest

from sidecar.process.app import Sidecar
from tests.support.api import StartSidecar, call
from tests.support.observing import scrape
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually

GAUGE = "lora_sidecar_registry_skipped_folders"


async def listings(http: aiohttp.ClientSession, url: str, count: int) -> None:
    """Wait until the registry has been listed `count` more times (GET /catalog shows when it
    was last listed)."""
    seen: list[object] = []

    async def listed() -> bool:
        _, body = await call(http, "GET", f"{url}/catalog")
        listed_at = body["registry"]["listed_at"]
        if not seen or listed_at != seen[-1]:
            seen.append(listed_at)
        return len(seen) > count

    await eventually(listed, timeout_s=30, what=f"{count} listings")


async def gauge_is(http: aiohttp.ClientSession, url: str, value: int) -> None:
    async def reached() -> bool:
        m = await scrape(http, url)
        samples = m.families[GAUGE]
        assert [s.labels for s in samples] == [{}]  # never an adapter id as a label
        return samples[0].value == value

    await eventually(reached, timeout_s=30, what=f"{GAUGE} == {value}")


async def test_a_local_registry_logs_skipped_folders_once_per_change(
    tmp_path: Path, sidecar_processes: list[SidecarProcess], http: aiohttp.ClientSession
) -> None:
    registry = tmp_path / "registry"
    local_registry_adapter(tmp_path, "good")
    (registry / "bad id").mkdir()
    os.symlink(registry / "good", registry / "linked")
    (registry / "notes.txt").write_text("a file is not a folder")
    process = SidecarProcess(["--registry", str(registry), "--cache-root", str(tmp_path / "c"),
                              "--catalog-refresh", "0.2"], tmp_path / "sidecar.log")
    sidecar_processes.append(process)

    await gauge_is(http, process.url, 2)
    await listings(http, process.url, 4)
    lines = [line for line in process.log_text().splitlines() if "skipping" in line]
    assert len(lines) == 1, lines
    assert "'bad id'" in lines[0] and "'linked (a symbolic link, never followed)'" in lines[0]
    assert "notes.txt" not in lines[0]
    _, catalog = await call(http, "GET", f"{process.url}/catalog")
    # Listed (not staged yet, so not in the catalog); the skipped folders are not.
    assert catalog["registry"]["adapters"] == 1
    assert catalog["registry"]["not_staged"] == ["good"]

    (registry / "also bad!").mkdir()
    await gauge_is(http, process.url, 3)
    await listings(http, process.url, 3)
    lines = [line for line in process.log_text().splitlines() if "skipping" in line]
    assert len(lines) == 2
    assert "'also bad!'" in lines[1] and "'bad id'" in lines[1]

    for name in ("bad id", "also bad!", "linked"):
        path = registry / name
        path.unlink() if path.is_symlink() else shutil.rmtree(path)
    await gauge_is(http, process.url, 0)
    await listings(http, process.url, 3)
    assert process.log_text().count("no folder is skipped any more") == 1


async def test_an_s3_registry_logs_skipped_folders_once_per_change(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    s3.put_adapter("good")
    s3.put_object(f"{s3.prefix}/bad id/adapter_config.json", b"{}")
    sidecar: Sidecar = await start_sidecar(
        dataclasses.replace(s3_settings(tmp_path, s3), catalog_refresh_s=0.2))

    await gauge_is(http, sidecar.url, 1)
    await listings(http, sidecar.url, 4)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    assert "'bad id'" in skipped[0] and s3.registry in skipped[0]

    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/bad id/adapter_config.json")
    await gauge_is(http, sidecar.url, 0)
    await listings(http, sidecar.url, 2)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    assert sum("no folder is skipped any more" in r.getMessage() for r in caplog.records) == 1


async def test_a_registry_without_odd_folders_logs_nothing_about_them(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar")
    local_registry_adapter(tmp_path, "good")
    sidecar = await start_sidecar(make_settings(tmp_path, catalog_refresh_s=0.2))
    await listings(http, sidecar.url, 3)
    await gauge_is(http, sidecar.url, 0)
    assert not [r for r in caplog.records if "skipp" in r.getMessage()]
