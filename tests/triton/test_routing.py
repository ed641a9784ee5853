"""The router's logic without Triton: routing.py against a stub sidecar on a real socket."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.recording_proxy import RecordingProxy
from tests.support.waiting import eventually
from tests.triton.harness import import_router

routing = import_router()
Status = routing.Status


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
        routing.route, "Say hi", adapter_id, sampling, sidecar or client(stub), vllm,
        "vllm_model", warn,
    )
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
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"max_tokens": true}', "max_tokens must be an integer, not a boolean"),
    ('{"max_tokens": 2.5}', "max_tokens must be an integer"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
])
async def test_bad_sampling_parameters_are_refused_before_staging(
    stub: StubSidecar, sampling: str, expected: str
) -> None:
    error = await route_error(stub, FakeVllm(), sampling=sampling)

    assert error.status is Status.INVALID_ARG
    assert expected in error.message
    assert stub.staged == []


async def test_misspelt_key_error_lists_the_accepted_keys(stub: StubSidecar) -> None:
    error = await route_error(stub, FakeVllm(), sampling='{"temprature": 0.5}')

    assert "unknown key 'temprature'" in error.message
    assert "temperature" in error.message.split("accepted keys:")[1]


async def test_empty_adapter_id_is_refused(stub: StubSidecar) -> None:
    error = await route_error(stub, FakeVllm(), adapter_id=" ")

    assert error.status is Status.INVALID_ARG
    assert stub.staged == []


# ---- the sidecar's refusals ------------------------------------------------------------------


@pytest.mark.parametrize(("http_status", "body", "status", "expected"), [
    (404, error_body("adapter_not_found", "no adapter a1 in s3://b/p"), Status.NOT_FOUND,
     "no adapter a1 in s3://b/p (adapter_not_found)"),
    (400, error_body("invalid_adapter_id", "bad id"), Status.INVALID_ARG, "bad id"),
    (503, error_body("catalog_pending", "not in the loaded catalog"), Status.UNAVAILABLE,
     "not in the loaded catalog (catalog_pending)"),
    (503, error_body("catalog_reloading", "Triton is reloading"), Status.UNAVAILABLE,
     "(catalog_reloading)"),
    (503, error_body("registry_unavailable", "S3 did not answer", cause="timeout"),
     Status.UNAVAILABLE, "S3 did not answer [cause: timeout] (registry_unavailable)"),
    (504, error_body("stage_timeout", "still downloading"), Status.UNAVAILABLE,
     "(stage_timeout)"),
    (502, error_body("registry_error", "access denied", cause="permission"), Status.INTERNAL,
     "access denied [cause: permission]"),
    (401, error_body("unauthorized", "token needed"), Status.INTERNAL, "(unauthorized)"),
    # A sidecar_url that reaches something else: not the client's request at fault.
    (404, error_body("not_found", "no such endpoint: /stage"), Status.INTERNAL,
     "no such endpoint: /stage (not_found)"),
    (418, error_body("something_new", "a code this router predates"), Status.INVALID_ARG,
     "a code this router predates (something_new)"),
    (500, "<html>proxy error</html>", Status.INTERNAL, "not JSON"),
])
async def test_sidecar_errors_become_triton_statuses(
    stub: StubSidecar, http_status: int, body: Any, status: Any, expected: str
) -> None:
    stub.stage_replies = [(http_status, body)]
    vllm = FakeVllm()

    error = await route_error(stub, vllm)

    assert error.status is status
    assert expected in error.message
    assert vllm.calls == []
    assert stub.released == []


async def test_invalid_adapter_lists_every_problem(stub: StubSidecar) -> None:
    problems = [
        {"code": "rank_too_large", "file": "adapter_config.json", "message": "r=64 > 16"},
        {"code": "pickle_file", "file": "adapter_model.bin", "message": "pickle is refused"},
    ]
    stub.stage_replies = [(422, error_body("invalid_adapter", "refused", adapter_id="a1",
                                           problems=problems))]

    error = await route_error(stub, FakeVllm())

    assert error.status is Status.INVALID_ARG
    assert "adapter a1 was refused by validation" in error.message
    assert "adapter_config.json: r=64 > 16 [rank_too_large]" in error.message
    assert "adapter_model.bin: pickle is refused [pickle_file]" in error.message


async def test_unreachable_sidecar_is_unavailable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = routing.RouterSettings(sidecar_url=f"http://127.0.0.1:{port}")
    vllm = FakeVllm()

    with pytest.raises(routing.RouteError) as caught:
        await asyncio.to_thread(routing.route, "p", "a1", None, new_client(settings),
                                vllm)

    assert caught.value.status is Status.UNAVAILABLE
    assert f"sidecar unreachable at http://127.0.0.1:{port}" in caught.value.message
    assert vllm.calls == []


async def test_a_sidecar_that_does_not_answer_times_out(stub: StubSidecar) -> None:
    stub.stall = asyncio.Event()
    sidecar = client(stub, stage_timeout_s=0.2, sidecar_timeout_s=0.2)

    error = await route_error(stub, FakeVllm(), sidecar=sidecar)

    assert error.status is Status.UNAVAILABLE
    assert "timed out" in error.message


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now_s += seconds


async def test_cache_full_of_leased_adapters_is_waited_out(stub: StubSidecar) -> None:
    full = (507, error_body("cache_full", "3 adapters are leased"))
    stub.stage_replies = [full, full]
    clock = FakeClock()
    sidecar = new_client(routing.RouterSettings(sidecar_url=stub.url),
                                    clock=clock, pause=clock.pause)

    text = await route(stub, FakeVllm(), sidecar=sidecar)

    assert text == "hello world"
    assert len(stub.staged) == 3
    assert len(clock.pauses) == 2
    assert stub.released == ["lease-a1"]


async def test_cache_full_past_the_stage_deadline_is_unavailable(stub: StubSidecar) -> None:
    stub.stage_replies = [(507, error_body("cache_full", "3 adapters are leased"))] * 100
    clock = FakeClock()
    settings = routing.RouterSettings(sidecar_url=stub.url, stage_timeout_s=2.0)
    sidecar = new_client(settings, clock=clock, pause=clock.pause)

    error = await route_error(stub, FakeVllm(), sidecar=sidecar)

    assert error.status is Status.UNAVAILABLE
    assert "(cache_full)" in error.message
    assert clock.now_s <= 2.0
    assert stub.staged[-1]["timeout_s"] < stub.staged[0]["timeout_s"]  # one shared deadline


async def test_cache_full_that_waiting_cannot_fix_is_answered_at_once(stub: StubSidecar) -> None:
    stub.stage_replies = [(507, error_body("cache_full", "larger than the budget",
                                           retryable=False))]

    error = await route_error(stub, FakeVllm())

    assert error.status is Status.UNAVAILABLE
    assert len(stub.staged) == 1


# ---- held while no engine serves -------------------------------------------------------------


async def held_route(stub: StubSidecar, vllm: FakeVllm, clock: FakeClock,
                     **settings: Any) -> tuple[str, Any, list[str]]:
    """route() with a router's Holds on a fake clock; the text, the holds and what it said."""
    config = routing.RouterSettings(sidecar_url=stub.url, **settings)
    holds = routing.Holds(config, clock=clock, pause=clock.pause)
    said: list[str] = []
    text: str = await asyncio.to_thread(
        routing.route, "Say hi", "a1", None, new_client(config), vllm, "vllm_model",
        lambda message: None, holds, said.append)
    return text, holds, said


@pytest.mark.parametrize("code", ["catalog_reloading", "catalog_pending"])
async def test_a_request_arriving_during_a_reload_is_held_and_answered(
    stub: StubSidecar, code: str,
) -> None:
    waiting = (503, error_body(code, "Triton is loading vllm_model"))
    stub.stage_replies = [waiting, waiting, waiting]
    clock = FakeClock()

    text, holds, said = await held_route(stub, FakeVllm(), clock)

    assert text == "hello world"
    assert len(stub.staged) == 4 and len(clock.pauses) == 3
    assert holds.held == 0  # given back
    assert stub.released == ["lease-a1"]
    assert "held" in said[0]


@pytest.mark.parametrize("message", [
    "Request for unknown model: 'vllm_model' is not found",  # unloaded: unload-first
    "Error generating stream: EngineCore encountered an issue.",  # restarted by the sidecar
    "LoRA _spare-g3-0007 is not supported, we currently support ['a1']",  # twice
])
async def test_a_request_the_engine_cannot_serve_yet_is_held_and_staged_again(
    stub: StubSidecar, message: str,
) -> None:
    vllm = FakeVllm(errors=[routing.VllmError(message, "NOT_FOUND")] * 3)
    clock = FakeClock()

    text, holds, _ = await held_route(stub, vllm, clock)

    assert text == "hello world"
    assert len(vllm.calls) == len(stub.staged) == 4
    assert stub.released == ["lease-a1"] * 4  # every lease given back
    assert holds.held == 0


async def test_past_hold_s_the_request_fails_with_the_retryable_error(
    stub: StubSidecar,
) -> None:
    stub.stage_replies = [(503, error_body("catalog_reloading", "Triton is loading"))] * 1000
    clock = FakeClock()

    with pytest.raises(routing.RouteError) as caught:
        await held_route(stub, FakeVllm(), clock, hold_s=20.0)

    assert caught.value.status is Status.UNAVAILABLE
    assert "(catalog_reloading)" in caught.value.message and "held" in caught.value.message
    assert 18.0 <= clock.now_s <= 20.0


async def test_past_max_held_requests_a_request_fails_at_once(stub: StubSidecar) -> None:
    stub.stage_replies = [(503, error_body("catalog_pending", "not loaded yet"))]
    clock = FakeClock()

    with pytest.raises(routing.RouteError) as caught:
        await held_route(stub, FakeVllm(), clock, max_held_requests=0)

    assert caught.value.status is Status.UNAVAILABLE
    assert clock.pauses == [] and len(stub.staged) == 1


# ---- vLLM's refusals -------------------------------------------------------------------------


async def test_lora_unknown_to_vllm_is_unavailable_and_the_lease_released(
    stub: StubSidecar,
) -> None:
    listed = [f"adapter-{n}" for n in range(500)]
    vllm = FakeVllm(error=routing.VllmError(
        f"LoRA a1 is not supported, we currently support {listed}", "INTERNAL"))

    error = await route_error(stub, vllm)

    assert error.status is Status.UNAVAILABLE
    assert "has not loaded a catalog that lists adapter a1" in error.message
    assert len(error.message) < 600  # the backend's list of every LoRA is cut short
    assert len(stub.staged) == len(vllm.calls) == 2  # staged again once: it may have reloaded
    assert stub.released == ["lease-a1", "lease-a1"]


async def test_the_name_the_sidecar_answers_is_the_lora_name_vllm_gets(
    stub: StubSidecar,
) -> None:
    stub.stage_replies = [(200, lease_body("a1", "_spare-g3-007"))]
    vllm = FakeVllm()

    assert await route(stub, vllm) == "hello world"

    assert vllm.calls[0][1]["lora_name"] == "_spare-g3-007"
    assert stub.staged[0]["adapter_id"] == "a1"


async def test_a_spare_name_the_reloaded_engine_does_not_know_is_staged_again_once(
    stub: StubSidecar,
) -> None:
    # The sidecar answered a spare name of generation 3, then Triton finished loading
    # generation 4 (which lists a1 by its own name) before the call reached vLLM.
    stub.stage_replies = [(200, lease_body("a1", "_spare-g3-007")), (200, lease_body("a1"))]
    vllm = FakeVllm(errors=[routing.VllmError(
        "LoRA _spare-g3-007 is not supported, we currently support ['a1']", "INTERNAL")])

    assert await route(stub, vllm) == "hello world"

    assert [call[1]["lora_name"] for call in vllm.calls] == ["_spare-g3-007", "a1"]
    assert stub.released == ["lease-a1", "lease-a1"]


@pytest.mark.parametrize(("message", "code", "status"), [
    ("Error generating stream: Loading lora a1 failed: No adapter found for /x", "INTERNAL",
     Status.INTERNAL),
    ("Request for unknown model: 'vllm_model' is not found", "NOT_FOUND", Status.UNAVAILABLE),
    ("Model is unavailable due to unhealthy vLLM engine", "UNAVAILABLE", Status.UNAVAILABLE),
    ("Error generating stream: EngineCore encountered an issue. See stack trace (above) for the "
     "root cause.", "INTERNAL", Status.UNAVAILABLE),
    ("Error generating stream: EngineDeadError", None, Status.UNAVAILABLE),
])
async def test_vllm_failures_keep_their_message_and_release_the_lease(
    stub: StubSidecar, message: str, code: str, status: Any
) -> None:
    error = await route_error(stub, FakeVllm(error=routing.VllmError(message, code)))

    assert error.status is status
    assert message in error.message
    assert stub.released == ["lease-a1"]


async def test_a_failed_release_only_warns(stub: StubSidecar) -> None:
    stub.release_reply = (404, error_body("lease_not_found", "no lease lease-a1"))
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
        settings = routing.RouterSettings.from_parameters({
            "sidecar_url": f"http://127.0.0.1:{runner.addresses[0][1]}",
            "sidecar_api_token_file": str(token_file),
        })
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


async def test_calls_reuse_one_keep_alive_connection() -> None:
    runner, url, peers = await serve_sidecar()
    try:
        sidecar = new_client(routing.RouterSettings(sidecar_url=url))
        for _ in range(20):
            await asyncio.to_thread(routing.route, "p", "a1", None, sidecar, FakeVllm())
    finally:
        await runner.cleanup()

    assert len(peers) == 40  # a /stage and a /release per request
    assert len(set(peers)) == 1  # ...all over one TCP connection
    assert sidecar.connections_opened == 1


async def test_a_connection_the_sidecar_closed_while_idle_is_replaced_without_an_error() -> None:
    # The server drops idle connections after 0.2 s; the router keeps them for longer, so its
    # next call meets a connection the server has closed.
    runner, url, peers = await serve_sidecar(keepalive_timeout_s=0.2)
    try:
        sidecar = new_client(routing.RouterSettings(sidecar_url=url))
        first = await asyncio.to_thread(routing.route, "p", "a1", None, sidecar, FakeVllm())
        await eventually(lambda: _no_connections(runner), timeout_s=10,
                         what="the sidecar closing its idle connection")
        second = await asyncio.to_thread(routing.route, "p", "a1", None, sidecar, FakeVllm())
    finally:
        await runner.cleanup()

    assert first == second == "hello world"
    assert sidecar.connections_opened == 2
    assert len(set(peers)) == 2


async def _no_connections(runner: web.AppRunner) -> bool:
    return runner.server is not None and not runner.server.connections


async def test_a_connection_idle_past_30_s_by_the_routers_clock_is_not_taken_again() -> None:
    clock = FakeClock()
    runner, url, peers = await serve_sidecar()
    try:
        sidecar = new_client(routing.RouterSettings(sidecar_url=url), clock=clock,
                             pause=clock.pause)
        await asyncio.to_thread(routing.route, "p", "a1", None, sidecar, FakeVllm())
        clock.now_s += 31.0  # no real wait: the pool reads the clock it was given
        await asyncio.to_thread(routing.route, "p", "a1", None, sidecar, FakeVllm())
    finally:
        await runner.cleanup()

    assert sidecar.connections_opened == 2
    assert len(set(peers)) == 2


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
    assert sidecar.connections_opened <= 32  # idle ones are taken again, never one per call


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


# ---- what a routing proxy may retry on another node -------------------------------------------


@pytest.mark.parametrize(("http_status", "code", "retry_elsewhere"), [
    (507, "cache_full", True),
    (503, "not_ready", True),
    (503, "catalog_pending", True),
    (503, "catalog_reloading", True),
    (503, "cache_not_writable", True),
    (503, "registry_unavailable", True),
    (503, "registry_transient", True),
    (504, "stage_timeout", True),
    (507, "a_future_storage_code", True),
    (404, "adapter_not_found", False),
    (422, "invalid_adapter", False),
    (400, "invalid_adapter_id", False),
    (502, "registry_error", False),
])
async def test_only_what_another_node_can_help_with_is_unavailable(
    stub: StubSidecar, http_status: int, code: str, retry_elsewhere: bool
) -> None:
    stub.stage_replies = [(http_status, error_body(code, "m", retryable=False))]

    error = await route_error(stub, FakeVllm())

    assert (error.status is Status.UNAVAILABLE) is retry_elsewhere
