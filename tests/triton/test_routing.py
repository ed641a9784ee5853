"""The router's logic without Triton: routing.py against a stub sidecar on a real socket."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from sidecar.core import errors
from sidecar.web import api
from tests.support.recording_proxy import RecordingProxy
from tests.support.waiting import eventually
from tests.triton.harness import import_router

routing = import_router()


@dataclass
class StubSidecar:
    """Answers /stage from a queue of (status, body) replies; records every call."""

    url: str = ""
    stage_replies: list[tuple[int, Any]] = field(default_factory=list)
    release_reply: tuple[int, Any] = (200, {"released": True, "adapter_id": "a1"})
    staged: list[dict[str, Any]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    stall: asyncio.Event | None = None

    async def stage(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.staged.append(body)
        if self.stall is not None:
            await self.stall.wait()
        status, reply = self.stage_replies.pop(0) if self.stage_replies else (200, None)
        if reply is None:
            reply = lease_body(body["adapter_id"])
        if isinstance(reply, str):
            return web.Response(status=status, text=reply)
        return web.json_response(reply, status=status)

    async def release(self, request: web.Request) -> web.Response:
        self.released.append((await request.json())["lease_id"])
        status, reply = self.release_reply
        return web.json_response(reply, status=status)


def lease_body(adapter_id: str, lora_name: str | None = None) -> dict[str, Any]:
    return {"adapter_id": adapter_id, "path": f"/lora-cache/adapters/{adapter_id}",
            "local_path": f"/cache/adapters/{adapter_id}", "size_bytes": 10,
            "lora_name": lora_name or adapter_id, "cached": False,
            "lease_id": f"lease-{adapter_id}", "lease_expires_at": "2030-01-01T00:00:00.000Z"}


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": code, "message": message, **extra}


@pytest.fixture
async def stub() -> AsyncIterator[StubSidecar]:
    sidecar = StubSidecar()
    app = web.Application()
    app.router.add_post("/stage", sidecar.stage)
    app.router.add_post("/release", sidecar.release)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    sidecar.url = f"http://127.0.0.1:{port}"
    yield sidecar
    if sidecar.stall is not None:
        sidecar.stall.set()
    await runner.cleanup()


@dataclass
class FakeVllm:
    """What the BLS call would do: record the request, yield pieces or fail (`errors` fail the
    first calls, one each, before `error` fails every later one)."""

    pieces: Iterable[str] = ("hello", " world")
    error: Exception | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)

    def __call__(self, prompt: str, sampling_json: str) -> Iterator[str]:
        self.calls.append((prompt, json.loads(sampling_json)))
        if self.errors:
            raise self.errors.pop(0)
        if self.error is not None:
            raise self.error
        yield from self.pieces


_OPEN_CLIENTS: list[Any] = []


def new_client(settings: Any, **kwargs: Any) -> Any:
    """A SidecarClient closed after the test (it keeps its connections open between calls)."""
    sidecar = routing.SidecarClient(settings, **kwargs)
    _OPEN_CLIENTS.append(sidecar)
    return sidecar


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


def client(stub: StubSidecar, **overrides: Any) -> Any:
    settings = routing.RouterSettings(sidecar_url=stub.url, **overrides)
    return new_client(settings)


async def route(stub: StubSidecar, vllm: FakeVllm, adapter_id: str = "a1",
                sampling: str | None = None, sidecar: Any = None,
                warn: Callable[[str], None] = lambda message: None) -> str:
    result: str = await asyncio.to_thread(
        routing.route, "Say hi", adapter_id, sampling, sidecar or client(stub), vllm, warn)
    return result


async def route_error(stub: StubSidecar, vllm: FakeVllm, **kwargs: Any) -> Any:
    with pytest.raises(routing.RouteError) as caught:
        await route(stub, vllm, **kwargs)
    return caught.value


# ---- the happy path ------------------------------------------------------------------------


async def test_route_stages_generates_joins_and_releases(stub: StubSidecar) -> None:
    vllm = FakeVllm(pieces=["one", " two", " three"])

    text = await route(stub, vllm)

    assert text == "one two three"
    assert stub.staged[0]["adapter_id"] == "a1"
    assert 0 < stub.staged[0]["timeout_s"] <= 300
    assert vllm.calls == [("Say hi", {"temperature": 0, "max_tokens": 256, "lora_name": "a1"})]
    assert stub.released == ["lease-a1"]


async def test_sampling_parameters_merge_over_the_defaults(stub: StubSidecar) -> None:
    vllm = FakeVllm()

    await route(stub, vllm, sampling=json.dumps({"max_tokens": 5, "top_p": 0.9, "stop": ["\n"]}))

    assert vllm.calls[0][1] == {"temperature": 0, "max_tokens": 5, "top_p": 0.9, "stop": ["\n"],
                                "lora_name": "a1"}


# ---- requests refused before anything is staged -------------------------------------------


@pytest.mark.parametrize(("sampling", "expected"), [
    ('{"max_token": 5}', "unknown key 'max_token'"),
    ('{"lora_name": "other"}', "lora_name is set by the router"),
    ('{"temperature": "hot"}', "temperature must be int or float"),
    ('{"max_tokens": true}', "max_tokens must be int, not a boolean"),
    ('{"max_tokens": 2.5}', "max_tokens must be int"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
async def test_bad_sampling_parameters_are_refused_before_staging(
    stub: StubSidecar, sampling: str, expected: str
) -> None:
    error = await route_error(stub, FakeVllm(), sampling=sampling)

    assert error.status == "INVALID_ARG"
    assert expected in error.message
    assert stub.staged == []


async def test_misspelt_key_error_lists_the_accepted_keys(stub: StubSidecar) -> None:
    error = await route_error(stub, FakeVllm(), sampling='{"temprature": 0.5}')

    assert "unknown key 'temprature'" in error.message
    assert "temperature" in error.message.split("accepted keys:")[1]


# ---- the sidecar's answers -------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    errors.AdapterNotFound("no adapter a1 in s3://b/p", adapter_id="a1"),
    errors.InvalidAdapterId("bad id"),
    errors.CatalogPending("not in the loaded catalog", adapter_id="a1"),
    errors.RegistryUnavailable("S3 did not answer", cause="timeout"),
    errors.RegistryError("access denied", cause="permission"),
    errors.InvalidAdapter("a1", [{"code": "rank_too_large", "file": "adapter_config.json",
                                  "message": "r=64 > 16"}]),
    errors.CacheFull("3 adapters are leased", retryable=True),
])
async def test_the_sidecars_error_is_passed_on_as_it_says(
    stub: StubSidecar, error: errors.SidecarError
) -> None:
    stub.stage_replies = [(api.status_of(error), error.to_json())]
    vllm = FakeVllm()

    caught = await route_error(stub, vllm)

    assert (caught.status, caught.message) == (error.triton_status, error.client_message())
    assert vllm.calls == [] and stub.released == []


@pytest.mark.parametrize(("http_status", "body", "expected"), [
    (404, {"error": "something_else", "message": "no such endpoint"}, "no such endpoint"),
    (500, "<html>proxy error</html>", "no JSON object"),
])
async def test_an_answer_that_says_no_status_is_internal(
    stub: StubSidecar, http_status: int, body: Any, expected: str
) -> None:
    stub.stage_replies = [(http_status, body)]

    error = await route_error(stub, FakeVllm())

    assert error.status == "INTERNAL" and expected in error.message


async def test_the_router_asks_the_sidecar_to_hold_for_its_hold_s(stub: StubSidecar) -> None:
    await route(stub, FakeVllm(), sidecar=client(stub, hold_s=120.0, stage_timeout_s=30.0))

    (asked,) = stub.staged
    assert asked["timeout_s"] == 30.0 and 119.0 < asked["hold_s"] <= 120.0
    assert asked["engine_refused"] is None


async def test_unreachable_sidecar_is_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = routing.RouterSettings(sidecar_url=f"http://127.0.0.1:{port}")
    vllm = FakeVllm()

    with pytest.raises(routing.RouteError) as caught:
        await asyncio.to_thread(routing.route, "p", "a1", None, new_client(settings), vllm)

    assert caught.value.status == "UNAVAILABLE"
    assert f"sidecar unreachable at http://127.0.0.1:{port}" in caught.value.message
    assert vllm.calls == []


async def test_a_sidecar_that_does_not_answer_times_out(stub: StubSidecar) -> None:
    stub.stall = asyncio.Event()
    sidecar = client(stub, stage_timeout_s=0.2, sidecar_timeout_s=0.2)

    error = await route_error(stub, FakeVllm(), sidecar=sidecar)

    assert error.status == "UNAVAILABLE"
    assert "timed out" in error.message


# ---- the engine's refusals, told to the sidecar ------------------------------------------------


async def test_the_name_the_sidecar_answers_is_the_lora_name_vllm_gets(
    stub: StubSidecar,
) -> None:
    stub.stage_replies = [(200, lease_body("a1", "_spare-g3-007"))]
    vllm = FakeVllm()

    assert await route(stub, vllm) == "hello world"

    assert vllm.calls[0][1]["lora_name"] == "_spare-g3-007"
    assert stub.staged[0]["adapter_id"] == "a1"


async def test_a_refused_name_is_told_in_the_next_stage_and_its_answer_used(
    stub: StubSidecar,
) -> None:
    # The sidecar answered a spare name of generation 3, then Triton loaded generation 4 (which
    # lists a1 by its own name) before the call reached vLLM.
    refusal = "LoRA _spare-g3-007 is not supported, we currently support ['a1']"
    stub.stage_replies = [(200, lease_body("a1", "_spare-g3-007")), (200, lease_body("a1"))]
    vllm = FakeVllm(errors=[routing.VllmError(refusal, "INTERNAL")])

    assert await route(stub, vllm) == "hello world"

    assert [call[1]["lora_name"] for call in vllm.calls] == ["_spare-g3-007", "a1"]
    assert stub.staged[1]["engine_refused"] == {"lora_name": "_spare-g3-007",
                                                "message": refusal, "code": "INTERNAL"}
    assert stub.released == ["lease-a1", "lease-a1"]


async def test_what_the_sidecar_decides_of_a_refusal_is_what_the_client_sees(
    stub: StubSidecar,
) -> None:
    decided = errors.EngineFailed("vllm_model failed on adapter a1: boom", adapter_id="a1")
    stub.stage_replies = [(200, lease_body("a1")), (502, decided.to_json())]
    vllm = FakeVllm(error=routing.VllmError("boom", "INTERNAL"))

    error = await route_error(stub, vllm)

    assert (error.status, error.message) == ("INTERNAL", decided.client_message())
    assert len(vllm.calls) == 1 and stub.released == ["lease-a1"]


async def test_a_failed_release_only_warns(stub: StubSidecar) -> None:
    stub.release_reply = (404, errors.LeaseNotFound("no lease lease-a1").to_json())
    warnings: list[str] = []

    text = await route(stub, FakeVllm(), warn=warnings.append)

    assert text == "hello world"
    assert len(warnings) == 1
    assert "could not release lease lease-a1 of a1" in warnings[0]


# ---- the connection to the sidecar -----------------------------------------------------------


async def test_token_file_is_sent_as_a_bearer_token(tmp_path: Path) -> None:
    seen: list[str | None] = []

    async def stage(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(lease_body("a1"))

    async def release(request: web.Request) -> web.Response:
        return web.json_response({"released": True})

    app = web.Application()
    app.router.add_post("/stage", stage)
    app.router.add_post("/release", release)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        settings = routing.RouterSettings.from_deployment({
            "sidecar_url": f"http://127.0.0.1:{runner.addresses[0][1]}",
            "sidecar_api_token_file": str(token_file),
        }, {})
        await asyncio.to_thread(routing.route, "p", "a1", None,
                                new_client(settings), FakeVllm())
    finally:
        await runner.cleanup()

    assert seen == ["Bearer s3cret"]


async def serve_sidecar(keepalive_timeout_s: float = 75.0) -> tuple[web.AppRunner, str,
                                                                      list[Any]]:
    """A sidecar stand-in on a real aiohttp server; records each request's client address."""
    peers: list[Any] = []

    async def stage(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.json_response(lease_body((await request.json())["adapter_id"]))

    async def release(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.json_response({"released": True})

    app = web.Application()
    app.router.add_post("/stage", stage)
    app.router.add_post("/release", release)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", peers


async def test_a_threads_calls_reuse_one_keep_alive_connection() -> None:
    runner, url, peers = await serve_sidecar()
    sidecar = new_client(routing.RouterSettings(sidecar_url=url))

    def twenty_requests() -> None:  # one worker thread, as a router thread answers in turn
        for _ in range(20):
            routing.route("p", "a1", None, sidecar, FakeVllm())

    try:
        await asyncio.to_thread(twenty_requests)
    finally:
        await runner.cleanup()

    assert len(peers) == 40  # a /stage and a /release per request
    assert len(set(peers)) == 1  # ...all over one TCP connection


async def test_a_connection_the_sidecar_closed_while_idle_is_replaced_without_an_error() -> None:
    # The server drops idle connections after 0.2 s; the router keeps them for longer, so its
    # next call meets a connection the server has closed.
    runner, url, peers = await serve_sidecar(keepalive_timeout_s=0.2)
    sidecar = new_client(routing.RouterSettings(sidecar_url=url))
    loop = asyncio.get_running_loop()
    # One thread, so its second call takes the connection the first left behind.
    with ThreadPoolExecutor(max_workers=1) as thread:
        try:
            first = await loop.run_in_executor(
                thread, routing.route, "p", "a1", None, sidecar, FakeVllm())
            await eventually(lambda: _no_connections(runner), timeout_s=10,
                             what="the sidecar closing its idle connection")
            second = await loop.run_in_executor(
                thread, routing.route, "p", "a1", None, sidecar, FakeVllm())
        finally:
            await runner.cleanup()

    assert first == second == "hello world"
    assert len(set(peers)) == 2


async def _no_connections(runner: web.AppRunner) -> bool:
    return runner.server is not None and not runner.server.connections


async def test_threads_share_the_client_and_each_gets_an_answer() -> None:
    runner, url, peers = await serve_sidecar()
    try:
        sidecar = new_client(routing.RouterSettings(sidecar_url=url))
        answers = await asyncio.gather(*(
            asyncio.to_thread(routing.route, "p", f"a{n}", None, sidecar, FakeVllm())
            for n in range(32)))
    finally:
        await runner.cleanup()

    assert answers == ["hello world"] * 32
    assert len(peers) == 64
    assert len(set(peers)) <= 32  # one connection per thread, never one per call


async def test_proxy_variables_never_divert_a_sidecar_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = RecordingProxy(tmp_path / "proxy")
    try:
        # The proxy is real and records: urllib, which honours the variables, reaches it.
        for name, value in proxy.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        # An opener of its own: urlopen's global one would keep this proxy for later tests.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler())
        with pytest.raises(urllib.error.HTTPError):
            await asyncio.to_thread(opener.open, "http://127.0.0.1:9/stage", timeout=5)
        assert len(proxy.requests()) == 1

        runner, url, peers = await serve_sidecar()
        try:
            text = await asyncio.to_thread(routing.route, "p", "a1", None,
                                           client_for(url), FakeVllm())
        finally:
            await runner.cleanup()
    finally:
        proxy.stop()

    assert text == "hello world"
    assert len(peers) == 2
    assert len(proxy.requests()) == 1  # only the urllib call above


def client_for(url: str) -> Any:
    return new_client(routing.RouterSettings(sidecar_url=url))
