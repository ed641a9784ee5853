"""Staging through the real HTTP API: hits, single-flight misses, errors, and what is left on
disk afterwards."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import zlib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.support.api import StartSidecar, call
from tests.support.s3 import S3Registry, set_moto_auth
from tests.support.s3proxy import Seen
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.name != ".sidecar.json"}


def leftovers(cache_root: Path) -> list[str]:
    return sorted(p.name for p in (cache_root / ".staging").iterdir())


async def test_local_registry_stages_then_hits(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    source = local_registry_adapter(tmp_path, "support-v1", seed=3)
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, first = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "support-v1"})
    assert status == 200, first
    assert first["cached"] is False
    assert first["path"] == str(tmp_path / "cache" / "adapters" / "support-v1")
    published = Path(first["local_path"])
    assert folder_digest(published) == folder_digest(source)
    assert first["size_bytes"] == sum(p.stat().st_size for p in source.iterdir())
    record = json.loads((published / ".sidecar.json").read_text())
    assert record["adapter_id"] == "support-v1"
    assert set(record["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    weights = (source / "adapter_model.safetensors").read_bytes()
    assert record["files"]["adapter_model.safetensors"]["crc32"] == f"{zlib.crc32(weights):08x}"
    assert record["files"]["adapter_model.safetensors"]["sha256"] == hashlib.sha256(
        weights).hexdigest()
    # The content digest is what `sha256sum` over the folder's files gives, hashed once more.
    sums = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                   for p in sorted(source.iterdir()))
    digest = f"sha256:{hashlib.sha256(sums.encode()).hexdigest()}"
    assert record["content_digest"] == first["content_digest"] == digest

    status, second = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "support-v1"})
    assert status == 200
    assert second["cached"] is True
    assert second["lease_id"] != first["lease_id"]
    assert leftovers(tmp_path / "cache") == []


async def test_fifty_concurrent_callers_share_one_download(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    files = s3.put_adapter("tenant-a", rank=16, target_modules=("q_proj", "k_proj", "v_proj"))
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    answers = await asyncio.gather(*(
        call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "tenant-a"}) for _ in range(50)
    ))

    assert [status for status, _ in answers] == [200] * 50
    assert {body["path"] for _, body in answers} == {
        str(tmp_path / "cache" / "adapters" / "tenant-a")}
    assert len({body["lease_id"] for _, body in answers}) == 50
    for name in files:
        fetched = s3.proxy.gets(s3.key("tenant-a", name))
        assert len(fetched) == 1, (name, fetched)
    on_disk = folder_digest(tmp_path / "cache" / "adapters" / "tenant-a")
    assert on_disk == {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}


async def test_other_adapters_download_in_parallel(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    s3.put_adapter("first", seed=1)
    s3.put_adapter("second", seed=2)
    second_started = threading.Event()

    async def hold_first_until_second(request: web.Request, seen: Seen) -> None:
        # The proxy's own loop: block `first` until a request for `second` arrives.
        if seen.method == "GET" and "/second/" in seen.path:
            second_started.set()
        if seen.method == "GET" and "/first/" in seen.path and "list-type" not in seen.query:
            await asyncio.to_thread(second_started.wait, 10)
        return None

    s3.proxy.fault = hold_first_until_second
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))
    first = asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                     {"adapter_id": "first"}))
    await eventually(lambda: "first" in sidecar.stager.inflight, timeout_s=10,
                     what="the stage of first under way")
    second = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "second"})
    assert second[0] == 200
    assert (await first)[0] == 200
    assert second_started.is_set()


async def test_large_adapter_uses_ranged_parts_and_arrives_intact(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    from sidecar.registry.transfer import TransferPolicy, part_starts
    from sidecar.validation.shapes import ModelShapes

    shapes = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                         num_key_value_heads=8, num_hidden_layers=20, head_dim=128)
    files = s3.put_adapter("big", rank=16, target_modules=("q_proj", "k_proj", "v_proj",
                                                           "o_proj", "gate_proj", "up_proj",
                                                           "down_proj"), shapes=shapes)
    weights = files["adapter_model.safetensors"]
    assert len(weights) > 10 * 1024**2  # more than one 5 MiB part
    settings = s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2)
    sidecar = await start_sidecar(settings)

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "big"})

    assert status == 200, body
    got = (Path(body["local_path"]) / "adapter_model.safetensors").read_bytes()
    assert hashlib.sha256(got).digest() == hashlib.sha256(weights).digest()
    gets = s3.proxy.gets(s3.key("big", "adapter_model.safetensors"))
    ranges = sorted(s.range or "" for s in gets)
    # Parts of at most the part size, as many as fill each round of parallel GETs.
    policy = TransferPolicy(settings.part_size_bytes, 1, asyncio.Semaphore(1),
                            settings.download_concurrency)
    expected_parts = len(part_starts(len(weights), policy))
    assert expected_parts >= -(-len(weights) // settings.part_size_bytes)
    assert len(ranges) == expected_parts
    assert len(set(ranges)) == expected_parts  # each part fetched once


@pytest.mark.parametrize("adapter_id", [
    "../x", "a/b", "", "x" * 129, ".", "..", "-leading-dash", "has space", "ünïcode", "a\\b",
])
async def test_invalid_ids_are_refused(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, adapter_id: str
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})
    assert status == 400
    assert body["error"] == "invalid_adapter_id"
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


async def test_longest_valid_id_is_accepted(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    adapter_id = "a" * 128
    local_registry_adapter(tmp_path, adapter_id)
    sidecar = await start_sidecar(make_settings(tmp_path))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})
    assert status == 200, body


async def test_unknown_adapter_is_404_and_leaves_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "missing"})
    assert status == 404
    assert body["error"] == "adapter_not_found"
    assert "missing" in body["message"]
    assert leftovers(tmp_path / "cache") == []
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_unreachable_registry_is_503_naming_the_endpoint(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    settings = make_settings(tmp_path, registry="s3://adapters/lora", s3_endpoint_url=endpoint,
                             s3_max_attempts=1)
    sidecar = await start_sidecar(settings)
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "any"})
    assert status == 503
    assert body["error"] == "registry_unavailable"
    assert body["cause"] == "endpoint"
    assert endpoint in body["message"]
    status, ready = await call(http, "GET", f"{sidecar.url}/readyz")
    assert status == 503
    assert "registry" in ready["message"]


async def test_wrong_credentials_are_502_naming_credentials(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3.put_adapter("tenant-a")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    # moto checks signatures against its IAM users once authentication is switched on.
    set_moto_auth(s3.moto_url, "0")
    try:
        sidecar = await start_sidecar(s3_settings(tmp_path, s3))
        status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "tenant-a"})
    finally:
        set_moto_auth(s3.moto_url, "inf")
    assert status == 502, body
    assert body["error"] == "registry_error"
    assert body["cause"] == "credentials"
    assert "AKIAWRONG" not in json.dumps(body)
    assert leftovers(tmp_path / "cache") == []


async def test_missing_bucket_is_502_naming_the_bucket(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    settings = make_settings(tmp_path, registry="s3://no-such-bucket/lora",
                             s3_endpoint_url=s3.endpoint_url)
    sidecar = await start_sidecar(settings)
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a"})
    assert status == 502
    assert body["cause"] == "bucket"
    assert "no-such-bucket" in body["message"]


async def test_caller_timeout_is_504_and_the_download_goes_on(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    s3.put_adapter("slow")
    released = threading.Event()

    async def stall_weights(request: web.Request, seen: Seen) -> None:
        # Runs on the proxy's own loop: wait for the test without blocking that loop.
        if seen.method == "GET" and seen.path.endswith("adapter_model.safetensors"):
            await asyncio.to_thread(released.wait, 30)
        return None

    s3.proxy.fault = stall_weights
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, s3_read_timeout_s=30.0))
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "slow", "timeout_s": 0.3})
    assert status == 504
    assert body["error"] == "stage_timeout"
    assert "slow" in sidecar.stager.inflight
    released.set()
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "slow"})
    assert status == 200
    assert len(s3.proxy.gets(s3.key("slow", "adapter_model.safetensors"))) == 1


async def test_a_small_adapter_with_free_room_fetches_its_weights_beside_its_config_once_each(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # Its room is free without evicting: the weights' GET is asked while the config's is
    # still unanswered (held at the registry), not one round trip after it.
    files = s3.put_adapter("small", rank=4)
    held: list[Seen] = []

    async def hold_config(request: web.Request, seen: Seen) -> None:
        if seen.method == "GET" and seen.path.endswith("adapter_config.json"):
            held.append(seen)
            await s3.proxy.stall()
        return None

    s3.proxy.fault = hold_config
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))
    try:
        staging = asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                           {"adapter_id": "small"}))
        await eventually(lambda: s3.proxy.gets(s3.key("small", "adapter_model.safetensors")),
                         timeout_s=30, what=lambda: f"object GETs: {s3.proxy.gets()}")
        assert len(held) == 1  # the config's answer had not come yet
    finally:
        s3.proxy.fault = None
        s3.proxy.release_stalls()
    status, body = await staging

    assert status == 200, body
    assert {name: len(s3.proxy.gets(s3.key("small", name))) for name in files} == {
        name: 1 for name in files}
    assert folder_digest(Path(str(body["local_path"]))) == {
        name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert leftovers(tmp_path / "cache") == []


async def test_stage_that_cannot_fit_the_budget_is_507(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "too-big", rank=16,
                           target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    sidecar = await start_sidecar(make_settings(tmp_path, max_bytes=1000))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "too-big"})
    assert status == 507
    assert body["error"] == "cache_full"
    assert "of the 1000 B budget (--max-bytes)" in body["message"]
    assert body["retryable"] is False  # larger than the whole budget
    assert leftovers(tmp_path / "cache") == []
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []


async def test_a_record_file_in_the_registry_is_ignored_and_ours_is_written(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    folder = local_registry_adapter(tmp_path, "copied-back")
    (folder / ".sidecar.json").write_text('{"adapter_id": "something-else"}')
    settings = make_settings(tmp_path)
    sidecar = await start_sidecar(settings)
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "copied-back"})
    assert status == 200, body
    record = json.loads((Path(body["local_path"]) / ".sidecar.json").read_text())
    assert record["adapter_id"] == "copied-back"
    assert ".sidecar.json" not in record["files"]
    await sidecar.stop()
    restarted = await start_sidecar(settings)  # the record must survive re-indexing
    assert restarted.store.get("copied-back") is not None
