"""The registry as production reaches it: a front end that closes idle keep-alive
connections, connections that idle too long, proxy variables (loopback never through a
proxy, no_proxy honoured), presigned URLs that outlive short-lived credentials, and an
endpoint that is not S3 at all."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import aiohttp
import pytest
from aiohttp import web

from sidecar.registry import httpranges
from sidecar.validation.shapes import ModelShapes
from tests.support.api import StartSidecar, call
from tests.support.forward_proxy import ForwardProxy
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.proxy_process import PROXY_VARIABLES
from tests.support.s3 import S3Registry
from tests.support.s3proxy import S3Proxy, Seen, is_object_get, s3_error
from tests.support.settings import make_settings, s3_settings
from tests.support.waiting import eventually

WEIGHTS = "adapter_model.safetensors"
# About 12 MB of weights: several ranged parts.
SHAPES = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=20, head_dim=128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PART_BYTES = 5 * 1024**2


def put_adapters(s3: S3Registry, *adapter_ids: str) -> None:
    for seed, adapter_id in enumerate(adapter_ids):
        s3.put_adapter(adapter_id, seed=seed, rank=16, shapes=SHAPES, target_modules=MODULES)


# ---- a front end that closes idle connections ---------------------------------------------


@pytest.fixture
def idle_closing_front_end(moto_server: str) -> Iterator[S3Proxy]:
    """A real HTTP front end before moto that closes a connection idle for 1 s."""
    front_end = S3Proxy(moto_server, keepalive_timeout_s=1.0)
    front_end.start()
    yield front_end
    front_end.stop()


async def test_connections_a_front_end_closed_while_idle_never_fail_a_stage(
    tmp_path: Path, s3: S3Registry, idle_closing_front_end: S3Proxy,
    start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    put_adapters(s3, "warm-v1", "a-v1", "b-v1", "c-v1")
    sidecar = await start_sidecar(make_settings(
        tmp_path, registry=s3.registry, s3_endpoint_url=idle_closing_front_end.url,
        part_size_bytes=PART_BYTES))
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "warm-v1"})
    assert status == 200, body  # both pools now hold keep-alive connections
    first = {s.peer for s in idle_closing_front_end.seen}

    async def all_closed() -> bool:
        return await idle_closing_front_end.open_connections() == 0

    await eventually(all_closed, timeout_s=10, what="the front end closing every one of them")

    answers = await asyncio.gather(*(
        call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})
        for adapter_id in ("a-v1", "b-v1", "c-v1")))
    assert [status for status, _ in answers] == [200, 200, 200], answers
    later = [s for s in idle_closing_front_end.seen if s.peer not in first]
    assert any(is_object_get(s) and s.range for s in later)  # fresh connections, listing too
    assert any("list-type" in s.query for s in later)


async def test_a_connection_idle_longer_than_the_limit_is_not_reused(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A NAT or firewall that forgets an idle flow sends no FIN: only its age gives it away.
    monkeypatch.setattr(httpranges, "IDLE_MAX_S", 2.0)
    put_adapters(s3, "a-v1", "b-v1", "c-v1")
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=PART_BYTES))

    def ranged_peers(adapter_id: str) -> set[tuple[str, int] | None]:
        return {s.peer for s in s3.proxy.gets(s3.key(adapter_id, WEIGHTS))}

    for adapter_id in ("a-v1", "b-v1"):  # back to back: b reuses a's connections
        status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                  {"adapter_id": adapter_id})
        assert status == 200, body
    assert ranged_peers("b-v1") & ranged_peers("a-v1")
    # Time passing is the point: the pooled connections idle past IDLE_MAX_S.
    await asyncio.sleep(httpranges.IDLE_MAX_S + 1.0)
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "c-v1"})
    assert status == 200, body
    assert not ranged_peers("c-v1") & (ranged_peers("a-v1") | ranged_peers("b-v1"))


# ---- proxy variables ----------------------------------------------------------------------


def non_loopback_address() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            address = str(probe.getsockname()[0])
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to serve a registry on")
    return address


def proxied_environment(proxy: ForwardProxy, no_proxy: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in {*PROXY_VARIABLES, "no_proxy"}}
    return {**env, **proxy.environment(no_proxy)}


def sidecar_args(tmp_path: Path, registry: str, endpoint: str) -> list[str]:
    return ["--registry", registry, "--s3-endpoint-url", endpoint,
            "--cache-root", str(tmp_path / "cache"), "--min-free-disk", "0",
            "--part-size", str(PART_BYTES)]


def test_a_loopback_registry_is_never_reached_through_a_proxy(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    put_adapters(s3, "a-v1")
    proxy = ForwardProxy(tmp_path / "proxy")
    try:
        process = SidecarProcess(sidecar_args(tmp_path, s3.registry, s3.endpoint_url),
                                 tmp_path / "sidecar.log", env=proxied_environment(proxy, None))
        sidecar_processes.append(process)

        status, body = stage_blocking(process.url, "a-v1", 60)

        assert status == 200, body
        assert len(s3.proxy.gets(s3.key("a-v1", WEIGHTS))) > 1  # ranged parts, directly
        assert proxy.carried() == []
    finally:
        proxy.stop()


@pytest.fixture
def remote_registry(moto_server: str) -> Iterator[S3Proxy]:
    """moto behind a front end on this machine's non-loopback address."""
    front_end = S3Proxy(moto_server, host=non_loopback_address())
    front_end.start()
    yield front_end
    front_end.stop()


@pytest.mark.parametrize("excluded", [False, True], ids=["through-the-proxy", "no_proxy"])
def test_a_remote_registry_goes_through_the_proxy_unless_no_proxy_names_it(
    tmp_path: Path, s3: S3Registry, remote_registry: S3Proxy,
    sidecar_processes: list[SidecarProcess], excluded: bool,
) -> None:
    put_adapters(s3, "a-v1")
    proxy = ForwardProxy(tmp_path / "proxy")
    try:
        env = proxied_environment(proxy, f"example.com,{remote_registry.host}" if excluded
                                  else None)
        process = SidecarProcess(sidecar_args(tmp_path, s3.registry, remote_registry.url),
                                 tmp_path / "sidecar.log", env=env)
        sidecar_processes.append(process)

        status, body = stage_blocking(process.url, "a-v1", 60)

        assert status == 200, body
        carried = proxy.carried()
        if excluded:
            assert carried == []
            assert len(remote_registry.gets(s3.key("a-v1", WEIGHTS))) > 1
        else:
            base = f"{remote_registry.url}/{s3.bucket}/{s3.key('a-v1', '')}"
            parts = len(remote_registry.gets(s3.key("a-v1", WEIGHTS)))
            assert sum(line.startswith(f"GET {base}{WEIGHTS}?") for line in carried) == parts > 1
            assert any(line.startswith(f"HEAD {base}{WEIGHTS}") for line in carried)
            assert any("list-type=2" in line for line in carried)  # botocore's calls too
    finally:
        proxy.stop()


# ---- presigned URLs and short-lived credentials ---------------------------------------------


def signed_at(seen: Seen) -> datetime:
    stamp = parse_qs(seen.query)["X-Amz-Date"][0]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)


def expire_signatures_after(lifetime_s: float, status: int, code: str, message: str):  # type: ignore[no-untyped-def]
    """A fault standing in for S3's own check (moto has none): a ranged GET whose signature
    is older than `lifetime_s` is refused as S3 refuses an expired token or URL."""

    async def fault(request: web.Request, seen: Seen) -> web.StreamResponse | None:
        if not (is_object_get(seen) and "X-Amz-Date" in seen.query):
            return None
        age_s = (datetime.now(UTC) - signed_at(seen)).total_seconds()
        return s3_error(status, code, message) if age_s > lifetime_s else None

    return fault


async def test_a_url_that_expires_during_a_download_is_signed_again(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    # Credentials from STS or IRSA that last a second: a file's later parts start after the
    # signature made for its first one has expired.
    put_adapters(s3, "a-v1")
    s3.proxy.fault = expire_signatures_after(1.0, 400, "ExpiredToken",
                                             "The provided token has expired.")
    s3.proxy.throttle_bytes_per_s = 4e6  # about a second per part, one part at a time
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=PART_BYTES,
                                              download_concurrency=1))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a-v1"})

    assert status == 200, body
    gets = s3.proxy.gets(s3.key("a-v1", WEIGHTS))
    assert len({signed_at(s) for s in gets}) >= 2  # signed again, not once per file


async def test_a_signature_the_registry_always_calls_expired_is_not_blamed_on_permissions(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    put_adapters(s3, "a-v1")
    s3.proxy.fault = expire_signatures_after(-1.0, 403, "AccessDenied", "Request has expired")
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=PART_BYTES))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a-v1"})

    assert status == 502, body
    assert (body["error"], body["cause"]) == ("registry_error", "credentials_expired")
    assert "expired" in body["message"] and "clock" in body["message"]
    assert "permission" not in body["message"]


# ---- an endpoint that is not S3 -----------------------------------------------------------


@pytest.fixture
def not_s3_endpoint(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server that answers 404 to everything (a static server of an empty
    folder): what a mistyped --s3-endpoint-url often reaches."""
    empty = tmp_path / "empty"
    empty.mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(empty))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


async def test_an_endpoint_that_answers_404_without_an_s3_error_is_named_not_s3(
    tmp_path: Path, not_s3_endpoint: str, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="sidecar")
    sidecar = await start_sidecar(make_settings(tmp_path, registry="s3://adapters/lora",
                                                s3_endpoint_url=not_s3_endpoint))

    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "example-sql-v1"})

    assert status == 502, body
    assert (body["error"], body["cause"]) == ("registry_error", "not_s3")
    assert "answered 404 without an S3 error" in body["message"]
    assert "is it an S3 endpoint?" in body["message"]
    assert not_s3_endpoint in body["message"]

    async def not_ready_says_why() -> str | None:
        status, ready = await call(http, "GET", f"{sidecar.url}/readyz")
        text = str(ready)
        return text if status == 503 and "is it an S3 endpoint?" in text else None

    await eventually(not_ready_says_why, timeout_s=10, poll_s=0.2,
                     what="readyz naming the endpoint's fault")
    assert "changed or vanished" not in caplog.text
    assert "of None" not in caplog.text
