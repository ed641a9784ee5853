"""Triton's model-repository API over HTTP (explicit model control), as far as the catalog needs
it: load, unload, and a readiness probe with its own short timeout that says whether Triton
itself reports the model unavailable or merely failed to answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from ..core.net import hide_password
from .engine_state import Probe

# A vLLM engine can take minutes to load (weights, CUDA graphs); Triton answers the load
# request only once the new instance is ready.
TRITON_LOAD_TIMEOUT_S = 1800.0
CONNECT_TIMEOUT_S = 5.0
_ANSWER_LIMIT_BYTES = 1024 * 1024


class ReloadFailed(Exception):
    """Triton could not be asked, or refused, to (re)load the vLLM model. `reached` is false
    when the request never got an answer from Triton (nothing can have been restarted)."""

    def __init__(self, message: str, *, reached: bool) -> None:
        super().__init__(message)
        self.reached = reached


class ModelControl(Protocol):
    async def load(self, model: str) -> None: ...
    async def unload(self, model: str) -> None: ...
    async def probe(self, model: str) -> tuple[Probe, str]: ...
    async def close(self) -> None: ...


class TritonControl:
    """ModelControl over Triton's HTTP endpoint. Never through a proxy: the variables
    http_proxy/HTTPS_PROXY are ignored (aiohttp's default), Triton is a neighbour."""

    def __init__(self, url: str, *, load_timeout_s: float = TRITON_LOAD_TIMEOUT_S,
                 probe_timeout_s: float) -> None:
        self._url = url.rstrip("/")
        self._shown = hide_password(self._url)
        self._load_timeout_s = load_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # built on first use: it belongs to the running loop
            self._session = aiohttp.ClientSession(trust_env=False)
        return self._session

    async def _request(self, method: str, path: str, timeout_s: float,
                       body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or None). OSError/TimeoutError/aiohttp errors when no answer."""
        timeout = aiohttp.ClientTimeout(total=None, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        async with asyncio.timeout(timeout_s):
            async with self._client().request(
                method, self._url + path, timeout=timeout,
                data=None if body is None else json.dumps(body),
            ) as response:
                raw = await response.content.read(_ANSWER_LIMIT_BYTES)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return response.status, parsed

    async def _repository(self, action: str, model: str) -> None:
        path = f"/v2/repository/models/{quote(model, safe='')}/{action}"
        try:
            status, body = await self._request("POST", path, self._load_timeout_s, {})
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:
            raise ReloadFailed(f"Triton at {self._shown} did not answer the {action} of "
                               f"{model} ({type(exc).__name__}: {exc})", reached=False) from exc
        if status != 200:
            error = body.get("error") if isinstance(body, dict) else None
            raise ReloadFailed(f"Triton refused to {action} {model}: "
                               f"{error or f'HTTP {status}'}", reached=True)

    async def load(self, model: str) -> None:
        await self._repository("load", model)

    async def unload(self, model: str) -> None:
        await self._repository("unload", model)

    async def probe(self, model: str) -> tuple[Probe, str]:
        """Whether the model is ready, with a detail for the log. A non-ready answer is checked
        against Triton's repository index, so only Triton's own word counts as NOT_LOADED: a
        503 from something in between, or a timeout, is FAILED."""
        try:
            status, _ = await self._request(
                "GET", f"/v2/models/{quote(model, safe='')}/ready", self._probe_timeout_s)
            if status == 200:
                return Probe.READY, "ready"
            index_status, index = await self._request(
                "POST", "/v2/repository/index", self._probe_timeout_s, {})
        except TimeoutError:
            return Probe.FAILED, f"no answer within {self._probe_timeout_s:g}s"
        except (OSError, aiohttp.ClientError) as exc:
            return Probe.FAILED, f"{type(exc).__name__}: {exc}"
        if index_status != 200 or not isinstance(index, list):
            return Probe.FAILED, f"ready answered HTTP {status}, the index HTTP {index_status}"
        entries = [e for e in index if isinstance(e, dict) and e.get("name") == model]
        states = {str(e.get("state", "")) for e in entries}
        if "READY" in states:
            return Probe.FAILED, f"ready answered HTTP {status} but the index says READY"
        reasons = "; ".join(str(e.get("reason", "")) for e in entries if e.get("reason"))
        shown = ", ".join(sorted(states)) or "not in the repository index"
        return Probe.NOT_LOADED, shown + (f": {reasons}" if reasons else "")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
