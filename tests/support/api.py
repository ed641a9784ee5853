"""The sidecar's HTTP API as the tests call it: one JSON request, a stage that must succeed,
readiness awaited, and every error code the API can answer."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from sidecar.config import Settings
from sidecar.core import errors
from sidecar.process.app import Sidecar
from sidecar.web import api
from tests.support.waiting import eventually

# The `start_sidecar` fixture: the real sidecar in the test's event loop, on a free port.
StartSidecar = Callable[[Settings], Awaitable[Sidecar]]


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One JSON request; returns (status, parsed body)."""
    data = None if body is None else json.dumps(body)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.request(method, url, data=data, headers=all_headers) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


async def stage_ok(http: aiohttp.ClientSession, sidecar: Sidecar, adapter_id: str,
                   **extra: object) -> dict[str, object]:
    """POST /stage that must answer 200; its body."""
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": adapter_id, **extra})
    assert status == 200, body
    assert isinstance(body, dict)
    return body


async def readiness(http: aiohttp.ClientSession, base_url: str, *, status: int | None = None,
                    mentioning: str = "", timeout_s: float = 10.0) -> tuple[int, Any]:
    """/readyz's (status, body) once the status is `status` (any, if None) and its message
    mentions `mentioning`: the health loop and the pins' retries run on their own timers."""
    last: list[tuple[int, Any]] = []

    async def answered() -> tuple[int, Any] | None:
        got, body = await call(http, "GET", f"{base_url}/readyz")
        last[:] = [(got, body)]
        message = body.get("message", "") if isinstance(body, dict) else ""
        return (got, body) if status in (None, got) and mentioning in message else None

    return await eventually(
        answered, timeout_s=timeout_s,
        what=lambda: f"/readyz {status or 'any'} mentioning {mentioning!r} (last {last})")


def api_error_codes() -> dict[str, int]:
    """Every code the API answers: each SidecarError (raised by the stager, the store, the
    catalog, the HTTP layer, or built by /readyz) with its status."""
    codes: dict[str, int] = {}
    pending: list[type[errors.SidecarError]] = [errors.SidecarError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        codes[cls.code] = api.STATUS.get(cls) or next(
            (api.STATUS[base] for base in cls.__mro__ if base in api.STATUS), 500)
    return codes
