"""The cache volume misbehaving: a small filesystem of its own that fills up, one that turns
read-only, and storage that is down when the sidecar starts. The sidecar answers clearly,
leaves nothing partial, and keeps serving what it has."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import sidecar.process.app
from sidecar.config import Settings
from sidecar.process.app import Sidecar
from sidecar.validation.shapes import ModelShapes
from sidecar.validation.validate import Rules
from tests.support.api import StartSidecar, call, readiness
from tests.support.cache_checks import check_cache, folder_bytes
from tests.support.s3 import S3Registry
from tests.support.s3proxy import Seen, drop_connection, is_object_get
from tests.support.settings import s3_settings
from tests.support.waiting import eventually

# Adapters sized against the small filesystems below.
SHAPES = ModelShapes(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=4, head_dim=64)
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BIG: dict[str, Any] = {"rank": 16, "shapes": SHAPES, "target_modules": ALL_MODULES}  # ~1.26 MB
MEDIUM: dict[str, Any] = {"rank": 16, "shapes": SHAPES, "target_modules": ("q_proj", "v_proj")}
# MEDIUM is ~265 KB; the default TINY_LLAMA adapter is ~9 KB.

MountFs = Callable[[int], Path]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[MountFs]:
    """Mount a tmpfs of a given size (bytes) for the test; unmounted afterwards.

    Needs root (or CAP_SYS_ADMIN), as in CI; without it the test fails saying so, since a
    skipped disk-full test would hide exactly the failures it exists to find."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        target = tmp_path / f"volume{len(mounted)}"
        target.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(target)],
            capture_output=True, text=True, timeout=30,
        )
        if result.returncode != 0:
            pytest.fail(f"cannot mount a {size_bytes}-byte tmpfs at {target} (uid {os.getuid()}"
                        f"): {result.stderr.strip() or result.returncode}. The disk tests need "
                        "root or CAP_SYS_ADMIN to give the cache a filesystem of its own.")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def remount(target: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(target)], check=True,
                   capture_output=True, timeout=30)


@pytest.fixture
def fast_health(monkeypatch: pytest.MonkeyPatch) -> None:
    """Health checks (cache writable, registry reachable) every 0.1 s instead of every 2 s."""
    monkeypatch.setattr(sidecar.process.app, "HEALTH_INTERVAL_S", 0.1)


def fill(folder: Path) -> Path:
    """Write a file until the filesystem is full; return it."""
    filler = folder / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


async def stage(http: aiohttp.ClientSession, sidecar: Sidecar, adapter_id: str,
                **extra: Any) -> tuple[int, Any]:
    return await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id, **extra})


def assert_consistent(settings: Settings, sources: dict[str, dict[str, bytes]]) -> set[str]:
    return check_cache(settings.cache_root, Rules.from_settings(settings),
                       max_adapters=settings.max_adapters, max_bytes=settings.max_bytes,
                       sources=sources).ids


# ---- disk full ------------------------------------------------------------------------------


async def test_an_adapter_larger_than_the_volume_is_507_and_evicts_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    small_fs: MountFs,
) -> None:
    volume = small_fs(1024**2)
    small = s3.put_adapter("small", seed=1)
    s3.put_adapter("big", seed=2, **BIG)
    settings = s3_settings(tmp_path, s3, cache_root=volume / "cache")
    sidecar = await start_sidecar(settings)
    assert (await stage(http, sidecar, "small", lease=False))[0] == 200

    status, body = await stage(http, sidecar, "big")

    assert status == 507, body
    assert body["error"] == "cache_full"
    assert "big" in body["message"] and "filesystem" in body["message"]
    # Evicting `small` could never have made room: it must still be there, and served.
    assert assert_consistent(settings, {"small": small}) == {"small"}
    status, body = await stage(http, sidecar, "small")
    assert status == 200 and body["cached"] is True


async def test_a_volume_that_fills_during_a_stage_is_507_leaves_nothing_and_recovers(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    small_fs: MountFs,
) -> None:
    volume = small_fs(1024**2)
    small = s3.put_adapter("small", seed=1)
    medium = s3.put_adapter("medium", seed=3, **MEDIUM)
    filled: list[Path] = []

    async def fill_the_volume(request: web.Request, seen: Seen) -> None:
        # Someone else fills the volume after the sidecar checked its free space.
        if not filled and is_object_get(seen) and "/medium/" in seen.path:
            filled.append(await asyncio.to_thread(fill, volume))
        return None

    s3.proxy.fault = fill_the_volume
    settings = s3_settings(tmp_path, s3, cache_root=volume / "cache")
    sidecar = await start_sidecar(settings)
    assert (await stage(http, sidecar, "small", lease=False))[0] == 200

    status, body = await stage(http, sidecar, "medium")

    assert filled
    assert status == 507, body
    assert body["error"] == "cache_full"
    assert "ran out of space" in body["message"] and "nothing was published" in body["message"]
    assert assert_consistent(settings, {"small": small}) == {"small"}  # no partial file
    status, body = await stage(http, sidecar, "small")
    assert status == 200 and body["cached"] is True

    filled[0].unlink()
    status, body = await stage(http, sidecar, "medium")
    assert status == 200, body
    assert folder_bytes(Path(body["local_path"])) == medium
    assert assert_consistent(settings, {"small": small, "medium": medium}) == {"small", "medium"}


async def test_room_made_by_evicting_is_free_on_disk_before_the_download(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    small_fs: MountFs,
) -> None:
    volume = small_fs(1_900_000)  # three medium adapters, or two and the big one
    sources = {f"m{i}": s3.put_adapter(f"m{i}", seed=10 + i, **MEDIUM) for i in range(3)}
    sources["big"] = s3.put_adapter("big", seed=2, **BIG)
    settings = s3_settings(tmp_path, s3, cache_root=volume / "cache")
    sidecar = await start_sidecar(settings)
    for adapter_id in ("m0", "m1", "m2"):
        assert (await stage(http, sidecar, adapter_id, lease=False))[0] == 200

    # big fits only once the least recently used medium adapter is gone from the disk.
    status, body = await stage(http, sidecar, "big", lease=False)

    assert status == 200, body
    assert assert_consistent(settings, sources) == {"m1", "m2", "big"}


def room_gauge(sidecar: Sidecar) -> float | None:
    return sidecar.metrics.metrics_registry.get_sample_value("lora_sidecar_cache_room_bytes")


@pytest.mark.usefixtures("fast_health")
async def test_a_full_volume_shows_in_the_room_gauge_and_readyz_and_is_said_once_each_way(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    small_fs: MountFs, caplog: pytest.LogCaptureFixture,
) -> None:
    volume = small_fs(1024**2)
    s3.put_adapter("small", seed=1)
    s3.put_adapter("other", seed=2)
    settings = s3_settings(tmp_path, s3, cache_root=volume / "cache", min_free_bytes=128 * 1024)
    sidecar = await start_sidecar(settings)
    status, leased = await stage(http, sidecar, "small")  # leased: nothing can be evicted
    assert status == 200, leased
    assert (room_gauge(sidecar) or 0) > 0

    with caplog.at_level("WARNING", logger="sidecar.process.app"):
        filler = await asyncio.to_thread(fill, volume)

        async def named() -> Any:
            _, body = await call(http, "GET", f"{sidecar.url}/readyz")
            return body if body.get("notices") else None

        body = await eventually(named, timeout_s=10, what="/readyz naming the full volume")
        # Full, but ready: the cached adapter still serves.
        assert body["ready"] is True
        assert "cache filesystem is full" in body["notices"][0]
        assert room_gauge(sidecar) == 0
        status, hit = await stage(http, sidecar, "small")
        assert status == 200 and hit["cached"] is True
        # A disk full of other files: waiting for the lease would not make room, so the
        # answer comes at once rather than after the caller's minute.
        status, full = await stage(http, sidecar, "other", timeout_s=60)
        assert status == 507 and full["error"] == "cache_full", full
        assert "waited" not in full["message"] and sidecar.store.waiting_for_room == 0

        filler.unlink()

        async def cleared() -> Any:
            status, body = await call(http, "GET", f"{sidecar.url}/readyz")
            return status == 200 and body["notices"] == []

        await eventually(cleared, timeout_s=10, what="/readyz without the notice")
    assert (room_gauge(sidecar) or 0) > 0
    said = [r.getMessage() for r in caplog.records if "cache volume" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("cache volume full") and "room again" in said[1]


# ---- read-only volume -----------------------------------------------------------------------


@pytest.mark.usefixtures("fast_health")
async def test_a_read_only_cache_root_fails_readiness_with_the_reason_and_serves_hits(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    small_fs: MountFs,
) -> None:
    volume = small_fs(4 * 1024**2)
    small = s3.put_adapter("small", seed=1)
    other = s3.put_adapter("other", seed=2)
    settings = s3_settings(tmp_path, s3, cache_root=volume)
    sidecar = await start_sidecar(settings)
    assert (await stage(http, sidecar, "small", lease=False))[0] == 200
    await readiness(http, sidecar.url, status=200)

    remount(volume, "ro")
    try:
        _, body = await readiness(http, sidecar.url, status=503, mentioning="not writable")
        assert body["error"] == "not_ready"
        assert "not writable" in body["message"] and "Read-only file system" in body["message"]
        status, hit = await stage(http, sidecar, "small")
        assert status == 200 and hit["cached"] is True
        status, refused = await stage(http, sidecar, "other")
        assert status == 503, refused
        assert refused["error"] == "cache_not_writable"
        assert "Read-only file system" in refused["message"]
    finally:
        remount(volume, "rw")

    await readiness(http, sidecar.url, status=200)
    status, body = await stage(http, sidecar, "other")
    assert status == 200, body
    assert assert_consistent(settings, {"small": small, "other": other}) == {"small", "other"}


# ---- storage down at start-up ---------------------------------------------------------------


@pytest.mark.usefixtures("fast_health")
async def test_storage_down_at_start_up_serves_the_cache_and_recovers_without_a_restart(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    cached = s3.put_adapter("cached", seed=1)
    later = s3.put_adapter("later", seed=2)
    settings = s3_settings(tmp_path, s3, s3_max_attempts=2)
    first = await start_sidecar(settings)
    assert (await stage(http, first, "cached", lease=False))[0] == 200
    await first.stop()

    s3.proxy.fault = drop_connection  # every connection to the registry is reset
    sidecar = await start_sidecar(settings)

    status, hit = await stage(http, sidecar, "cached")
    assert status == 200 and hit["cached"] is True
    _, body = await readiness(http, sidecar.url, status=503, mentioning="registry:")
    assert s3.endpoint_url in body["message"]
    status, refused = await stage(http, sidecar, "later")
    assert status == 503, refused
    assert refused["error"] == "registry_unavailable"
    assert refused["cause"] in ("endpoint", "connection")

    s3.proxy.fault = None  # storage is back
    await readiness(http, sidecar.url, status=200)
    status, body = await stage(http, sidecar, "later")
    assert status == 200, body
    assert assert_consistent(settings, {"cached": cached, "later": later}) == {"cached", "later"}
