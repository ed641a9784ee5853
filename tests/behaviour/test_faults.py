"""Storage faults injected by the proxy between the sidecar and S3: server errors, resets and
short bodies mid-download, stalls, objects changed under a download. Each ends in a clear
answer and a clean cache, and the next stage succeeds once the fault is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
import pytest
from aiohttp import web

from sidecar.config import Settings
from sidecar.registry.transfer import BACKOFF_CAP_S, backoff_s
from sidecar.validation.shapes import ModelShapes
from sidecar.validation.validate import Rules
from tests.support.api import StartSidecar, call
from tests.support.cache_checks import check_cache, folder_bytes
from tests.support.s3 import S3Registry
from tests.support.s3proxy import BodyFault, FailTimes, Seen, is_object_get
from tests.support.settings import s3_settings

WEIGHTS = "adapter_model.safetensors"


def weights_get(adapter_id: str) -> Callable[[Seen], bool]:
    return lambda seen: is_object_get(seen) and seen.path.endswith(f"/{adapter_id}/{WEIGHTS}")


def listing_of(adapter_id: str) -> Callable[[Seen], bool]:
    return lambda seen: "list-type" in seen.query and f"prefix=lora/{adapter_id}/" in unquote(
        seen.query)


async def stage(http: aiohttp.ClientSession, url: str, adapter_id: str,
                **extra: Any) -> tuple[int, Any]:
    return await call(http, "POST", f"{url}/stage", {"adapter_id": adapter_id, **extra})


def assert_clean(settings: Settings, sources: dict[str, dict[str, bytes]]) -> None:
    """Nothing in .staging/ or .trash/; whatever is published is whole and the registry's."""
    check_cache(settings.cache_root, Rules.from_settings(settings),
                max_adapters=settings.max_adapters, max_bytes=settings.max_bytes,
                sources=sources)


async def assert_recovers(http: aiohttp.ClientSession, url: str, adapter_id: str,
                          files: dict[str, bytes], settings: Settings) -> None:
    """Once the fault is gone the same adapter stages, whole."""
    status, body = await stage(http, url, adapter_id)
    assert status == 200, body
    assert folder_bytes(Path(body["local_path"])) == files
    assert_clean(settings, {adapter_id: files})


def test_backoff_between_part_retries_is_capped_and_jittered() -> None:
    delays = [backoff_s(attempt) for attempt in range(1, 40) for _ in range(5)]
    assert all(0 <= d <= BACKOFF_CAP_S for d in delays)
    assert len(set(delays)) == len(delays)  # full jitter: no two retries in lockstep
    assert max(backoff_s(1) for _ in range(50)) <= 0.2  # the first retry comes quickly


# ---- server errors on the initial response: botocore's standard retries --------------------


@pytest.mark.parametrize("status, code", [(500, "InternalError"), (503, "SlowDown")])
@pytest.mark.parametrize("request_kind", ["listing", "object"])
async def test_server_errors_are_retried_then_the_stage_succeeds(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    status: int, code: str, request_kind: str,
) -> None:
    files = s3.put_adapter("flaky", seed=1)
    matches = listing_of("flaky") if request_kind == "listing" else weights_get("flaky")
    fault = FailTimes(matches, status, code, times=2)
    s3.proxy.fault = fault
    settings = s3_settings(tmp_path, s3, s3_max_attempts=3)
    sidecar = await start_sidecar(settings)

    answer, body = await stage(http, sidecar.url, "flaky")

    assert answer == 200, body
    assert fault.fired == 2
    assert folder_bytes(Path(body["local_path"])) == files
    if request_kind == "object":
        assert len(s3.proxy.gets(s3.key("flaky", WEIGHTS))) == 3  # two errors, one success
    assert_clean(settings, {"flaky": files})


async def test_server_errors_past_the_attempts_are_503_with_the_cause_and_leave_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    files = s3.put_adapter("down", seed=2)
    fault = FailTimes(weights_get("down"), 500, "InternalError", times=1000)
    s3.proxy.fault = fault
    settings = s3_settings(tmp_path, s3, s3_max_attempts=2)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "down")

    assert status == 503, body
    assert body["error"] == "registry_unavailable"
    assert body["cause"] == "server"
    assert "InternalError" in body["message"]
    assert len(s3.proxy.gets(s3.key("down", WEIGHTS))) == 2  # --s3-max-attempts, not squared
    assert not (settings.cache_root / "adapters" / "down").exists()
    assert_clean(settings, {})
    s3.proxy.fault = None
    await assert_recovers(http, sidecar.url, "down", files, settings)


# ---- faults in the middle of a body: the transfer's own per-part retries -------------------


@pytest.mark.parametrize("mode", ["reset", "short"])
async def test_a_body_cut_once_is_resumed_and_arrives_intact(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    mode: str,
) -> None:
    files = s3.put_adapter("cut", seed=3)
    s3.proxy.body_faults = [BodyFault(weights_get("cut"), after_bytes=3000, mode=mode)]
    settings = s3_settings(tmp_path, s3)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "cut")

    assert status == 200, body
    assert folder_bytes(Path(body["local_path"])) == files
    gets = s3.proxy.gets(s3.key("cut", WEIGHTS))
    assert len(gets) == 2
    assert gets[1].range is not None and gets[1].range.startswith("bytes=")
    assert_clean(settings, {"cut": files})


@pytest.mark.parametrize("mode", ["reset", "short"])
async def test_a_body_cut_on_every_attempt_is_503_and_leaves_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    mode: str,
) -> None:
    files = s3.put_adapter("cut", seed=4)
    s3.proxy.body_faults = [BodyFault(weights_get("cut"), after_bytes=3000, mode=mode,
                                      times=1000)]
    settings = s3_settings(tmp_path, s3, s3_max_attempts=2)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "cut")

    assert status == 503, body
    assert body["error"] == "registry_unavailable"
    assert body["cause"] in ("connection", "short_body")
    assert not (settings.cache_root / "adapters" / "cut").exists()
    assert_clean(settings, {})
    s3.proxy.body_faults = []
    await assert_recovers(http, sidecar.url, "cut", files, settings)


# ---- stalls: the read timeout fires ----------------------------------------------------------


@pytest.mark.parametrize("where", ["before_headers", "mid_body"])
async def test_a_stalled_registry_is_503_timeout_within_the_configured_bound(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    where: str,
) -> None:
    files = s3.put_adapter("stuck", seed=5)
    matches = weights_get("stuck")
    if where == "before_headers":
        async def stall(request: web.Request, seen: Seen) -> None:
            if matches(seen):
                await s3.proxy.stall()
            return None

        s3.proxy.fault = stall
    else:
        s3.proxy.body_faults = [BodyFault(matches, after_bytes=3000, mode="stall", times=1000)]
    read_timeout_s, attempts = 0.5, 2
    settings = s3_settings(tmp_path, s3, s3_read_timeout_s=read_timeout_s,
                           s3_max_attempts=attempts)
    sidecar = await start_sidecar(settings)

    started = time.monotonic()
    status, body = await stage(http, sidecar.url, "stuck", timeout_s=60)
    elapsed_s = time.monotonic() - started

    assert status == 503, body
    assert body["error"] == "registry_unavailable"
    assert body["cause"] == "timeout"
    assert "in time" in body["message"]
    # --s3-max-attempts attempts in all (botocore's before the headers, the transfer's per
    # part after them, never both multiplied), each ended by one read timeout.
    assert len(s3.proxy.gets(s3.key("stuck", WEIGHTS))) == attempts
    assert attempts * read_timeout_s <= elapsed_s < attempts * read_timeout_s + 2.0
    assert not (settings.cache_root / "adapters" / "stuck").exists()
    assert_clean(settings, {})
    s3.proxy.reset()  # releases the stalled requests; the registry answers again
    await assert_recovers(http, sidecar.url, "stuck", files, settings)


async def test_a_caller_deadline_shorter_than_the_stall_is_504_and_the_download_ends_clean(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    files = s3.put_adapter("stuck", seed=6)
    s3.proxy.body_faults = [BodyFault(weights_get("stuck"), after_bytes=3000, mode="stall",
                                      times=1000)]
    settings = s3_settings(tmp_path, s3, s3_read_timeout_s=0.5, s3_max_attempts=2)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "stuck", timeout_s=0.3)

    assert status == 504, body
    assert body["error"] == "stage_timeout"
    # The shared download goes on and gives up on its own, leaving nothing behind.
    download = next(t for t in asyncio.all_tasks() if t.get_name() == "stage:stuck")
    await asyncio.gather(download, return_exceptions=True)
    assert_clean(settings, {})
    s3.proxy.reset()
    await assert_recovers(http, sidecar.url, "stuck", files, settings)


# ---- an object replaced between the listing and the download --------------------------------


@pytest.mark.parametrize("size", ["small", "ranged"])
async def test_an_object_changed_after_listing_is_listed_again_and_the_new_one_staged(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    size: str,
) -> None:
    """A re-upload landing while the weights are fetched: the sidecar, which alone knows the
    object moved, lists the adapter again and answers with the new version, whole."""
    kwargs: dict[str, Any] = {}
    if size == "ranged":  # several 5 MiB ranged GETs, each of which must carry If-Match
        kwargs = {"rank": 16, "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"),
                  "shapes": ModelShapes(hidden_size=1024, intermediate_size=2816,
                                        num_attention_heads=8, num_key_value_heads=8,
                                        num_hidden_layers=12, head_dim=128)}
    s3.put_adapter("moving", seed=7, **kwargs)
    newer = s3.put_adapter("moving-next", seed=8, **kwargs)  # same shape, other bytes
    key = s3.key("moving", WEIGHTS)
    replaced = False
    listings = 0

    async def replace_then_forward(request: web.Request, seen: Seen) -> None:
        nonlocal replaced, listings
        listings += listing_of("moving")(seen)
        if not replaced and weights_get("moving")(seen):
            replaced = True
            await asyncio.to_thread(s3.put_object, key, newer[WEIGHTS])
        return None

    s3.proxy.fault = replace_then_forward
    settings = s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "moving")

    assert replaced
    assert status == 200, body
    assert listings >= 2  # listed again after the change, not fetched half old and half new
    assert folder_bytes(Path(body["local_path"])) == newer
    assert_clean(settings, {"moving": newer})


async def test_a_config_replaced_after_listing_is_caught_by_its_etag_before_it_is_judged(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    """The config is fetched into memory to be judged before room is reserved, with the same
    If-Match as every GET: a re-upload landing just then is listed again and staged whole."""
    s3.put_adapter("moving-config", seed=7, rank=4)
    newer = s3.put_adapter("moving-config-next", seed=8, rank=8)
    assert newer["adapter_config.json"] != s3.client.get_object(
        Bucket=s3.bucket, Key=s3.key("moving-config", "adapter_config.json"))["Body"].read()
    replaced = False
    listings = 0

    async def replace_then_forward(request: web.Request, seen: Seen) -> None:
        nonlocal replaced, listings
        listings += listing_of("moving-config")(seen)
        if not replaced and is_object_get(seen) and seen.path.endswith(
                "/moving-config/adapter_config.json"):
            replaced = True
            for name, data in newer.items():
                await asyncio.to_thread(s3.put_object, s3.key("moving-config", name), data)
        return None

    s3.proxy.fault = replace_then_forward
    settings = s3_settings(tmp_path, s3)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "moving-config")

    assert replaced
    assert status == 200, body
    assert listings >= 2  # listed again: the old config's GET was refused by its ETag
    assert folder_bytes(Path(body["local_path"])) == newer
    assert_clean(settings, {"moving-config": newer})


async def test_an_object_that_changes_on_every_fetch_is_refused_after_three_listings(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    versions = [s3.put_adapter("restless", seed=7), s3.put_adapter("restless-next", seed=8)]
    key = s3.key("restless", WEIGHTS)
    fetches = 0

    async def replace_every_time(request: web.Request, seen: Seen) -> None:
        nonlocal fetches
        if weights_get("restless")(seen):
            fetches += 1
            await asyncio.to_thread(s3.put_object, key, versions[fetches % 2][WEIGHTS])
        return None

    s3.proxy.fault = replace_every_time
    settings = s3_settings(tmp_path, s3)
    sidecar = await start_sidecar(settings)

    status, body = await stage(http, sidecar.url, "restless")

    assert status == 502, body
    assert body["error"] == "registry_object_changed"
    assert body["cause"] == "object_changed"
    assert fetches == 3  # one fetch per listing, three listings, then the answer
    assert not (settings.cache_root / "adapters" / "restless").exists()
    assert_clean(settings, {})
    s3.proxy.fault = None
    await assert_recovers(http, sidecar.url, "restless", versions[fetches % 2], settings)
