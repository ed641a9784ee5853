"""An HTTP proxy that tests put between the sidecar and the S3 server: it records every
request the server receives and can inject faults (errors, resets, short bodies, stalls).

It runs its own event loop in a thread, so a fault that stalls cannot stall the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate", "content-length", "host"}


@dataclass(frozen=True, slots=True)
class Seen:
    method: str
    path: str  # without the query string
    query: str
    range: str | None


Fault = Callable[[web.Request, Seen], Awaitable[web.StreamResponse | None]]
"""Called for every request; return a response to answer instead of the server, or None to
forward. Body faults use `BodyFault` instead."""


@dataclass(slots=True)
class BodyFault:
    """Damage the body of matching responses: stop after `after_bytes` and then either reset
    the connection or end the body early (shorter than its Content-Length)."""

    matches: Callable[[Seen], bool]
    after_bytes: int
    mode: str  # "reset" or "short"
    times: int = 1


class S3Proxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.seen: list[Seen] = []
        self.fault: Fault | None = None
        self.body_faults: list[BodyFault] = []
        self.throttle_bytes_per_s: float | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def reset(self) -> None:
        with self._lock:
            self.seen.clear()
        self.fault = None
        self.body_faults = []
        self.throttle_bytes_per_s = None

    def gets(self, key_part: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == "GET" and key_part in s.path
                    and "list-type" not in s.query]

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.path, request.query_string,
                    request.headers.get("Range"))
        with self._lock:
            self.seen.append(seen)
        if self.fault is not None:
            answer = await self.fault(request, seen)
            if answer is not None:
                return answer
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + request.rel_url.raw_path_qs, headers=headers,
            data=body, allow_redirects=False,
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS:
                    response.headers[key] = value
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            fault = self._take_body_fault(seen)
            sent = 0
            async for chunk in upstream.content.iter_chunked(64 * 1024):
                if fault is not None and sent + len(chunk) >= fault.after_bytes:
                    await response.write(chunk[: fault.after_bytes - sent])
                    transport = request.transport
                    if fault.mode == "reset" and transport is not None:
                        transport.abort()  # RST: the client sees a reset mid-body
                    elif transport is not None:
                        transport.close()  # FIN: the body just ends early
                    return response
                await response.write(chunk)
                sent += len(chunk)
                if self.throttle_bytes_per_s:
                    await asyncio.sleep(len(chunk) / self.throttle_bytes_per_s)
            await response.write_eof()
            return response

    def _take_body_fault(self, seen: Seen) -> BodyFault | None:
        with self._lock:
            for fault in self.body_faults:
                if fault.times > 0 and fault.matches(seen):
                    fault.times -= 1
                    return fault
        return None
