"""A real HTTP server playing Triton for the sidecar: it forwards every call to a real Triton's
HTTP port, counts the model-repository calls (loads, unloads), and injects the faults a
network or an overloaded server produces (one readiness probe answered 503, a probe that hangs,
a Triton that does not answer at all)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web


@dataclass
class TritonProxy:
    upstream: str  # http://127.0.0.1:<Triton's HTTP port>
    url: str = ""
    calls: list[str] = field(default_factory=list)  # "POST /v2/repository/models/m/load", ...
    ready_failures: int = 0  # answer this many readiness probes with 503
    hang_ready: asyncio.Event | None = None  # while set to an unset event, probes hang on it
    down: bool = False  # refuse every call by closing the connection
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self, port: int = 0) -> TritonProxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        if self.hang_ready is not None:
            self.hang_ready.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def repository_calls(self) -> list[str]:
        return [c for c in self.calls if c.endswith(("/load", "/unload"))]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(f"{request.method} {request.path}")
        if self.down:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if request.path.endswith("/ready") and request.path.startswith("/v2/models/"):
            if self.hang_ready is not None:
                await self.hang_ready.wait()
            if self.ready_failures > 0:
                self.ready_failures -= 1
                return web.Response(status=503, text="upstream busy")
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=await request.read(),
                                         timeout=aiohttp.ClientTimeout(total=600)) as answer:
            body = await answer.read()
            return web.Response(status=answer.status, body=body,
                                content_type=answer.content_type)


class ThreadedTritonProxy:
    """A TritonProxy on an event loop of its own thread, for synchronous tests (the engine
    tier): `start()`, then read `calls` / `repository_calls()`; `stop()` at the end."""

    def __init__(self, upstream: str) -> None:
        self.proxy = TritonProxy(upstream)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="triton-proxy",
                                        daemon=True)

    def start(self) -> ThreadedTritonProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout=30)
        return self

    @property
    def url(self) -> str:
        return self.proxy.url

    def repository_calls(self) -> list[str]:
        return list(self.proxy.repository_calls())

    def hold_probes(self) -> None:
        """Readiness probes hang from now on, until `release_probes()`."""
        async def hold() -> None:
            self.proxy.hang_ready = asyncio.Event()

        asyncio.run_coroutine_threadsafe(hold(), self._loop).result(timeout=30)

    def release_probes(self) -> None:
        async def release() -> None:
            held, self.proxy.hang_ready = self.proxy.hang_ready, None
            if held is not None:
                held.set()

        asyncio.run_coroutine_threadsafe(release(), self._loop).result(timeout=30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
