"""An HTTP proxy that tests put between the sidecar and the S3 server: it records every
request the server receives and can inject faults (errors, resets, short bodies, stalls).

It runs its own event loop in a thread, so a fault that stalls cannot stall the test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from email.utils import format_datetime, parsedate_to_datetime

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
    peer: tuple[str, int] | None = None  # the client's address and port: its connection


Fault = Callable[[web.Request, Seen], Awaitable[web.StreamResponse | None]]
"""Called for every request; return a response to answer instead of the server, or None to
forward. Body faults use `BodyFault` instead."""

BodyProgress = Callable[[Seen, int, int | None], None]
"""Called on the proxy's loop after each chunk of a response body is sent: (request, bytes
sent so far, Content-Length)."""


@dataclass(slots=True)
class BodyFault:
    """Damage the body of matching responses: stop after `after_bytes` and then reset the
    connection, end the body early (shorter than its Content-Length), or stall (send nothing
    more until the test releases stalls or resets the proxy); or "flip" the byte at
    `after_bytes` and send the rest (a body corrupted in transit, its length intact)."""

    matches: Callable[[Seen], bool]
    after_bytes: int
    mode: str  # "reset", "short", "stall" or "flip"
    times: int = 1


def s3_error(status: int, code: str, message: str = "injected by the test proxy") -> web.Response:
    """An S3-style XML error answer."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>")
    return web.Response(status=status, body=body.encode(), content_type="application/xml")


def is_object_get(seen: Seen) -> bool:
    """A GET of an object (not a listing)."""
    return seen.method == "GET" and "list-type" not in seen.query


@dataclass(slots=True)
class FailTimes:
    """A fault: answer the first `times` matching requests with an S3 error, then forward.
    `fired` counts the errors sent."""

    matches: Callable[[Seen], bool]
    status: int
    code: str
    times: int
    fired: int = 0

    async def __call__(self, request: web.Request, seen: Seen) -> web.StreamResponse | None:
        if self.fired >= self.times or not self.matches(seen):
            return None
        self.fired += 1
        return s3_error(self.status, self.code)


async def drop_connection(request: web.Request, seen: Seen) -> web.StreamResponse | None:
    """A fault: reset every connection without an answer, as a server that is down."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=503)  # never reaches the client: the connection is gone


class S3Proxy:
    """`keepalive_timeout_s` closes a client's connection once it has idled that long, as S3
    front ends do; `host` is the address to listen on."""

    def __init__(self, upstream: str, *, keepalive_timeout_s: float = 3630.0,
                 host: str = "127.0.0.1") -> None:
        self.upstream = upstream.rstrip("/")
        self.keepalive_timeout_s = keepalive_timeout_s
        self.host = host
        self.seen: list[Seen] = []
        self.fault: Fault | None = None
        self.body_faults: list[BodyFault] = []
        self.throttle_bytes_per_s: float | None = None
        self.body_progress: BodyProgress | None = None
        # Added to the Date of every answer: a registry whose clock runs behind (negative) or
        # ahead of the times it stamps on objects, as a gateway with a drifting clock answers.
        self.date_shift_s = 0.0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._released: asyncio.Event | None = None  # set when stalled requests may go on
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
        self.body_progress = None
        self.date_shift_s = 0.0
        self.release_stalls()

    def release_stalls(self) -> None:
        """Let every stalled request go on (thread-safe); later stalls stall again."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._release_in_loop)

    def _release_in_loop(self) -> None:
        if self._released is not None:
            self._released.set()
        self._released = asyncio.Event()

    async def stall(self) -> None:
        """For faults (on the proxy's loop): wait until the test releases stalls."""
        if self._released is None:
            self._released = asyncio.Event()
        await self._released.wait()

    async def open_connections(self) -> int:
        """How many client connections the proxy holds open now (from any event loop)."""

        async def count() -> int:
            server = self._runner.server if self._runner is not None else None
            return 0 if server is None else len(server.connections)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(count(), self._loop))

    def gets(self, key_part: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == "GET" and key_part in s.path
                    and "list-type" not in s.query]

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     keepalive_timeout=self.keepalive_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen = Seen(request.method, request.path, request.query_string,
                    request.headers.get("Range"), tuple(peer[:2]) if peer else None)
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
            if self.date_shift_s and "Date" in upstream.headers:
                answered = parsedate_to_datetime(upstream.headers["Date"])
                response.headers["Date"] = format_datetime(
                    answered + timedelta(seconds=self.date_shift_s), usegmt=True)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            fault = self._take_body_fault(seen)
            sent = 0
            async for chunk in upstream.content.iter_chunked(64 * 1024):
                if fault is not None and fault.mode == "flip" and (
                        sent <= fault.after_bytes < sent + len(chunk)):
                    at = fault.after_bytes - sent
                    chunk = chunk[:at] + bytes([chunk[at] ^ 0x01]) + chunk[at + 1:]
                elif fault is not None and fault.mode != "flip" and (
                        sent + len(chunk) >= fault.after_bytes):
                    await response.write(chunk[: fault.after_bytes - sent])
                    if fault.mode == "stall":
                        await self.stall()
                    transport = request.transport
                    if fault.mode == "reset" and transport is not None:
                        transport.abort()  # RST: the client sees a reset mid-body
                    elif transport is not None:
                        transport.close()  # FIN: the body just ends early
                    return response
                await response.write(chunk)
                sent += len(chunk)
                if self.body_progress is not None:
                    self.body_progress(seen, sent, upstream.content_length)
                if self.throttle_bytes_per_s:
                    # A slow registry: time passing is the point.
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
