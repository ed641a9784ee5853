"""triton_control.py: load, unload and the readiness probe over HTTP, against a real aiohttp
server on a free port that answers as Triton's repository API does, or (fault injection) as a
proxy in between, or not at all. The same against a real Triton: tests/triton/."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from sidecar.catalog.engine_state import Probe
from sidecar.catalog.triton_control import ReloadFailed, TritonControl

MODEL = "vllm_model"


@dataclass
class TritonApi:
    """Triton's answers: `ready` (GET .../ready), `index` (the repository index), `refuse` (a
    load's error), `status` (every answer's HTTP status when set: a proxy in between), `stall`
    (hold every answer until set)."""

    calls: list[str] = field(default_factory=list)
    ready: bool = False
    index: list[dict[str, Any]] = field(default_factory=list)
    refuse: str | None = None
    status: int | None = None
    stall: asyncio.Event | None = None
    url: str = ""

    async def answer(self, request: web.Request) -> web.Response:
        self.calls.append(f"{request.method} {request.path}")
        if self.stall is not None:
            await self.stall.wait()
        if self.status is not None:
            return web.Response(status=self.status, text="<html>bad gateway</html>")
        if request.path.endswith("/ready"):
            return web.Response(status=200 if self.ready else 400)
        if request.path == "/v2/repository/index":
            return web.json_response(self.index)
        if request.path.endswith("/load") and self.refuse is not None:
            return web.json_response({"error": self.refuse}, status=400)
        self.ready = request.path.endswith("/load")
        return web.json_response({})


@pytest.fixture
async def triton() -> AsyncIterator[TritonApi]:
    api = TritonApi()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", api.answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    api.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield api
    if api.stall is not None:
        api.stall.set()
    await runner.cleanup()


@pytest.fixture
async def control(triton: TritonApi) -> AsyncIterator[TritonControl]:
    made = TritonControl(triton.url, load_timeout_s=5.0, probe_timeout_s=0.5)
    yield made
    await made.close()


async def test_a_load_and_an_unload_are_asked_of_the_repository_api(
    triton: TritonApi, control: TritonControl,
) -> None:
    await control.load(MODEL)
    assert await control.probe(MODEL) == (Probe.READY, "ready")
    await control.unload(MODEL)

    assert triton.calls == [f"POST /v2/repository/models/{MODEL}/load",
                            f"GET /v2/models/{MODEL}/ready",
                            f"POST /v2/repository/models/{MODEL}/unload"]


async def test_a_refused_load_reached_triton_and_says_its_error(
    triton: TritonApi, control: TritonControl,
) -> None:
    triton.refuse = "failed to load 'vllm_model': CUDA out of memory"

    with pytest.raises(ReloadFailed, match="CUDA out of memory") as caught:
        await control.load(MODEL)

    assert caught.value.reached is True


async def test_a_load_nobody_answers_did_not_reach_triton() -> None:
    control = TritonControl("http://user:secret@127.0.0.1:1", load_timeout_s=2.0,
                            probe_timeout_s=0.5)
    try:
        with pytest.raises(ReloadFailed, match="did not answer the load") as caught:
            await control.load(MODEL)
    finally:
        await control.close()

    assert caught.value.reached is False and "secret" not in str(caught.value)


async def test_only_tritons_own_index_makes_a_model_not_loaded(
    triton: TritonApi, control: TritonControl,
) -> None:
    triton.index = [{"name": MODEL, "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert await control.probe(MODEL) == (Probe.NOT_LOADED, "UNAVAILABLE: unloaded")
    triton.index = []
    assert await control.probe(MODEL) == (Probe.NOT_LOADED, "not in the repository index")

    triton.index = [{"name": MODEL, "state": "READY"}]  # ready said no, the index says yes
    probe, detail = await control.probe(MODEL)
    assert probe is Probe.FAILED and "the index says READY" in detail

    triton.status = 503  # a proxy in between answers, not Triton
    probe, detail = await control.probe(MODEL)
    assert probe is Probe.FAILED and "HTTP 503" in detail


async def test_a_probe_that_gets_no_answer_in_time_failed(
    triton: TritonApi, control: TritonControl,
) -> None:
    triton.stall = asyncio.Event()

    assert await control.probe(MODEL) == (Probe.FAILED, "no answer within 0.5s")
