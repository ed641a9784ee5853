"""The router's logic as plain functions: check the request, stage the adapter through the
sidecar, generate through vLLM, release the lease. Standard library only: Triton's container
has no aiohttp, and this file is tested without Triton.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

DEFAULT_SAMPLING: Mapping[str, Any] = {"temperature": 0, "max_tokens": 256}

# The stock backend turns every key of `sampling_parameters` into a keyword of vLLM's
# SamplingParams; one it does not know fails the request with an opaque "'NoneType' object has
# no attribute 'lora_name'". So the router accepts only these, each with the JSON types vLLM
# takes. `n`/`best_of` are left out: the router answers one generated_text.
_NUMBER = (int, float)
SAMPLING_KEYS: Mapping[str, tuple[type, ...]] = {
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "seed": (int,),
    "max_tokens": (int,),
    "min_tokens": (int,),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "bad_words": (list,),
    "ignore_eos": (bool,),
    "include_stop_str_in_output": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "logprobs": (int,),
    "prompt_logprobs": (int,),
    "truncate_prompt_tokens": (int,),
    "logit_bias": (dict,),
    "allowed_token_ids": (list,),
    "structured_outputs": (str,),
}
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0
# What says no engine serves a catalog that names the adapter yet (a reload in progress, a
# generation being loaded, the engine restarting): held, not failed, up to `hold_s`.
_HOLD_CODES = frozenset({"catalog_reloading", "catalog_pending"})
_RESPONSE_LIMIT_BYTES = 1024 * 1024
# Idle keep-alive connections to the sidecar are kept at most this long: aiohttp closes its
# side after 75 s, and a connection taken just as the server closes it costs a retry.
_IDLE_CONNECTION_MAX_S = 30.0
_IDLE_CONNECTIONS_MAX = 64
_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


class Status(Enum):
    """Triton error codes the router answers with (names of pb_utils.TritonError's codes)."""

    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class RouteError(Exception):
    """A request the router cannot answer; `status` becomes the Triton error code."""

    def __init__(self, status: Status, message: str, code: str | None = None,
                 retryable: bool = False, holdable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # the sidecar's error code, when the sidecar refused
        self.retryable = retryable  # worth asking again before the stage deadline
        self.holdable = holdable  # no engine serves it now, one will: held up to hold_s


class VllmError(Exception):
    """vllm_model answered with an error; `code` is the Triton error code's name if known."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# The sidecar's stable error codes, and what each means to a Triton client. UNAVAILABLE is the
# one status a routing proxy retries on another node, so it is kept for what another node can
# help with (this node's cache cannot fit the adapter, is not ready, its engine has not loaded
# the catalog yet or is down); what is wrong with the adapter or the request itself is never
# UNAVAILABLE, since every node would answer the same.
_STATUS_BY_CODE: Mapping[str, Status] = {
    "adapter_not_found": Status.NOT_FOUND,
    "invalid_adapter_id": Status.INVALID_ARG,
    "invalid_request": Status.INVALID_ARG,
    "invalid_adapter": Status.INVALID_ARG,
    "registry_unavailable": Status.UNAVAILABLE,
    "registry_object_changed": Status.UNAVAILABLE,
    "catalog_pending": Status.UNAVAILABLE,
    "catalog_reloading": Status.UNAVAILABLE,
    "not_ready": Status.UNAVAILABLE,
    "stage_timeout": Status.UNAVAILABLE,
    "cache_full": Status.UNAVAILABLE,
    "cache_not_writable": Status.UNAVAILABLE,
    "registry_error": Status.INTERNAL,
    "unauthorized": Status.INTERNAL,
    "request_too_large": Status.INTERNAL,
}


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The router model's config.pbtxt parameters."""

    sidecar_url: str = "http://127.0.0.1:8500"
    stage_timeout_s: float = 300.0
    sidecar_timeout_s: float = 5.0
    vllm_model: str = "vllm_model"
    api_token: str | None = None
    adapter_id_header: str = "x-adapter-id"
    max_concurrent_requests: int = 128
    hold_s: float = 180.0  # longest a request waits for an engine to serve (a reload)
    max_held_requests: int = 128  # held at once per instance; past it, UNAVAILABLE at once

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> RouterSettings:
        """From config.pbtxt `parameters` (key -> string_value); ValueError lists every problem."""
        problems: list[str] = []
        default = cls()
        url = parameters.get("sidecar_url", default.sidecar_url).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            problems.append(f"sidecar_url {url!r}: use http://host:port")
        timeouts: dict[str, float] = {}
        for name in ("stage_timeout_s", "sidecar_timeout_s", "hold_s"):
            raw = parameters.get(name, str(getattr(default, name)))
            try:
                timeouts[name] = float(raw)
            except ValueError:
                timeouts[name] = -1.0
            least = 0.0 if name == "hold_s" else math.nextafter(0.0, 1.0)
            if not (math.isfinite(timeouts[name]) and timeouts[name] >= least):
                problems.append(f"{name} {raw!r}: must be a number of seconds "
                                + ("0 or more" if name == "hold_s" else "greater than 0"))
        vllm_model = parameters.get("vllm_model", default.vllm_model).strip()
        if not vllm_model:
            problems.append("vllm_model must name the vLLM model")
        header = parameters.get("adapter_id_header", default.adapter_id_header).strip().lower()
        if not _HEADER_NAME.fullmatch(header):
            problems.append(f"adapter_id_header {header!r}: use a lower-case header name such "
                            "as x-adapter-id (gRPC metadata keys are lower-case)")
        raw = parameters.get("max_concurrent_requests", str(default.max_concurrent_requests))
        try:
            concurrency = int(raw)
        except ValueError:
            concurrency = 0
        if not 1 <= concurrency <= 4096:
            problems.append(f"max_concurrent_requests {raw!r}: must be a whole number "
                            "from 1 to 4096")
        raw = parameters.get("max_held_requests", str(default.max_held_requests))
        try:
            held = int(raw)
        except ValueError:
            held = -1
        if held < 0:
            problems.append(f"max_held_requests {raw!r}: must be a whole number, 0 or more")
        token: str | None = None
        token_file = parameters.get("sidecar_api_token_file", "").strip()
        if token_file:
            try:
                token = Path(token_file).read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                problems.append(f"sidecar_api_token_file {token_file}: {exc.strerror}")
        if problems:
            raise ValueError("multilora_router parameters: " + "; ".join(problems))
        return cls(url, timeouts["stage_timeout_s"], timeouts["sidecar_timeout_s"], vllm_model,
                   token, header, concurrency, timeouts["hold_s"], held)

    @classmethod
    def from_deployment(cls, parameters: Mapping[str, str],
                        env: Mapping[str, str]) -> RouterSettings:
        """The parameters, overridden by the container's LORA_SIDECAR_URL,
        LORA_SIDECAR_API_TOKEN_FILE and LORA_SIDECAR_API_TOKEN: a deployment (compose) points
        the router at its sidecar without editing config.pbtxt, which it mounts read-only."""
        merged = dict(parameters)
        for variable, key in (("LORA_SIDECAR_URL", "sidecar_url"),
                              ("LORA_SIDECAR_API_TOKEN_FILE", "sidecar_api_token_file")):
            if env.get(variable, "").strip():
                merged[key] = env[variable]
        settings = cls.from_parameters(merged)
        token = env.get("LORA_SIDECAR_API_TOKEN", "").strip()
        return replace(settings, api_token=token) if token else settings


@dataclass(frozen=True, slots=True)
class Lease:
    adapter_id: str
    lease_id: str
    path: str
    cached: bool
    lora_name: str  # the name vllm_model knows the adapter by: its id, or a spare catalog name
    # Which bytes answer (`sha256:` of the files' SHA256SUMS text) and who signed them, when the
    # sidecar's signing policy verified a signature: on the router's response and in its log.
    content_digest: str | None = None
    signer: str | None = None
    signer_identity: str | None = None


PROVENANCE = ("content_digest", "signer", "signer_identity")


def provenance(lease: Lease) -> dict[str, str]:
    """What the router's response says of the adapter bytes that answered (response parameters,
    and output tensors of the same names): "" where the sidecar said nothing (no signature)."""
    return {"content_digest": lease.content_digest or "", "signer": lease.signer or "",
            "signer_identity": lease.signer_identity or ""}


def provenance_line(request_id: str, lease: Lease) -> str:
    """The router's log line for an answered request: the request id with those facts."""
    facts = provenance(lease)
    return (f"multilora_router answered request_id={request_id or '-'} "
            f"adapter_id={lease.adapter_id} lora_name={lease.lora_name} "
            + " ".join(f"{key}={facts[key] or '-'}" for key in PROVENANCE))


def requested_adapter_id(input_value: str | None, parameters_json: str | None,
                         header: str = "x-adapter-id") -> str:
    """The adapter a request asks for: the `header` Triton forwarded as a request parameter
    (what a routing proxy hashed on), else the `adapter_id` input. Both given and different is
    refused: the proxy would have sent the request to the node of the other adapter."""
    from_header = _header_parameter(parameters_json, header)
    given_input = input_value if input_value is not None and input_value.strip() else None
    if from_header is not None and given_input is not None and from_header != given_input:
        raise RouteError(
            Status.INVALID_ARG,
            f"the {header} header ({from_header!r}) and the adapter_id input "
            f"({given_input!r}) name different adapters; send one, or the same in both",
        )
    adapter_id = from_header if from_header is not None else input_value
    if adapter_id is None:
        raise RouteError(Status.INVALID_ARG,
                         f"no adapter named: send the {header} header or the adapter_id input")
    return adapter_id


def _header_parameter(parameters_json: str | None, header: str) -> str | None:
    """The forwarded header's value among the request's parameters. Triton keeps an HTTP
    header's spelling (X-Adapter-Id), so names are compared without case."""
    if not parameters_json:
        return None
    try:
        parameters = json.loads(parameters_json)
    except ValueError:
        return None
    if not isinstance(parameters, dict):
        return None
    values = [v for k, v in parameters.items() if isinstance(k, str) and k.lower() == header]
    if not values:
        return None
    if len(values) > 1 or not isinstance(values[0], str):
        raise RouteError(Status.INVALID_ARG,
                         f"the {header} header must be given once, as a string")
    value: str = values[0].strip()
    return value


def sampling_parameters(text: str | None, adapter_id: str) -> str:
    """The caller's JSON merged over the defaults, with `lora_name`; the JSON for vllm_model."""
    given: Any = {}
    if text is not None and text.strip():
        try:
            given = json.loads(text)
        except ValueError as exc:
            raise RouteError(Status.INVALID_ARG,
                             f"sampling_parameters is not valid JSON: {exc}") from exc
    if not isinstance(given, dict):
        raise RouteError(Status.INVALID_ARG, "sampling_parameters must be a JSON object")
    problems = []
    for key, value in given.items():
        if key == "lora_name":
            problems.append("lora_name is set by the router from adapter_id")
        elif key not in SAMPLING_KEYS:
            problems.append(f"unknown key {key!r}")
        elif isinstance(value, bool) and bool not in SAMPLING_KEYS[key]:
            problems.append(f"{key} must be {_type_names(SAMPLING_KEYS[key])}, not a boolean")
        elif not isinstance(value, SAMPLING_KEYS[key]):
            problems.append(f"{key} must be {_type_names(SAMPLING_KEYS[key])}")
    if problems:
        raise RouteError(
            Status.INVALID_ARG,
            "sampling_parameters refused: " + "; ".join(problems)
            + f" (accepted keys: {', '.join(sorted(SAMPLING_KEYS))})",
        )
    return json.dumps({**DEFAULT_SAMPLING, **given, "lora_name": adapter_id})


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", bool: "true or false"}
    if types == _NUMBER:
        return "a number"
    return " or ".join(names[t] for t in types)


class _Connections:
    """Keep-alive connections to the sidecar, shared by the router's threads. Plain
    http.client, never urllib: a sidecar call goes straight to the configured address and
    never through a proxy named by http_proxy/HTTP_PROXY, which urllib would honour."""

    def __init__(self, url: str, clock: Callable[[], float]) -> None:
        parts = urllib.parse.urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._clock = clock
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def take(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """A connection and whether it was used before (then it may have died while idle)."""
        now = self._clock()
        with self._lock:
            while self._idle:
                connection, since = self._idle.pop()  # the most recently used: least stale
                if now - since <= _IDLE_CONNECTION_MAX_S and connection.sock is not None:
                    connection.sock.settimeout(timeout_s)
                    return connection, True
                connection.close()
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout_s), False

    def give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _IDLE_CONNECTIONS_MAX:
                self._idle.append((connection, self._clock()))
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()


# What a keep-alive connection the server closed while it sat idle fails with: the request
# never reached the server, so it is sent again on a fresh connection. (A timeout is not one of
# these: the sidecar may be working on the request.)
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                     ConnectionAbortedError, http.client.BadStatusLine)


class SidecarClient:
    """POST /stage and /release to the sidecar over keep-alive HTTP, each call bounded in time.
    Safe to share between threads."""

    def __init__(self, settings: RouterSettings,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self._clock = clock
        self._pause = pause
        self._connections = _Connections(settings.sidecar_url, time.monotonic)
        self.connections_opened = 0  # for tests and benchmarks: how often a call had to connect

    def stage(self, adapter_id: str) -> Lease:
        """Stage `adapter_id`, waiting out a cache full of leased adapters until the deadline."""
        deadline = self._clock() + self.settings.stage_timeout_s
        delay_s = _RETRY_FIRST_S
        while True:
            remaining_s = max(deadline - self._clock(), 0.001)
            try:
                # The sidecar's own timeout runs out first, so a slow download is answered
                # with its stage_timeout error rather than with a socket timeout here.
                body = self._post("/stage", {"adapter_id": adapter_id, "timeout_s": remaining_s},
                                  timeout_s=remaining_s + self.settings.sidecar_timeout_s)
            except RouteError as exc:
                # A cache full of leased adapters clears as soon as a lease is released.
                if not exc.retryable or self._clock() + delay_s >= deadline:
                    raise
                self._pause(delay_s * random.uniform(0.5, 1.0))
                delay_s = min(delay_s * 2, _RETRY_MAX_S)
                continue
            try:
                return Lease(str(body["adapter_id"]), str(body["lease_id"]), str(body["path"]),
                             bool(body.get("cached", False)),
                             str(body.get("lora_name") or body["adapter_id"]),
                             _text_or_none(body.get("content_digest")),
                             _text_or_none(body.get("signer")),
                             _text_or_none(body.get("signer_identity")))
            except KeyError as exc:
                raise RouteError(Status.INTERNAL,
                                 f"sidecar's /stage answer has no {exc.args[0]!r}") from exc

    def release(self, lease_id: str) -> None:
        self._post("/release", {"lease_id": lease_id}, timeout_s=self.settings.sidecar_timeout_s)

    def close(self) -> None:
        self._connections.close()

    def _post(self, path: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.settings.api_token:
            headers["Authorization"] = f"Bearer {self.settings.api_token}"
        data = json.dumps(payload).encode()
        while True:
            connection, reused = self._connections.take(timeout_s)
            if not reused:
                self.connections_opened += 1
            try:
                connection.request("POST", path, body=data, headers=headers)
                response = connection.getresponse()
                raw = response.read(_RESPONSE_LIMIT_BYTES + 1)
            except _STALE_CONNECTION:
                connection.close()
                if reused:
                    continue  # it died while idle; the next one taken is fresher or new
                raise self._unreachable(path, "the connection was closed") from None
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                raise self._unreachable(path, str(exc) or type(exc).__name__) from exc
            if response.will_close or len(raw) > _RESPONSE_LIMIT_BYTES:
                connection.close()
            else:
                self._connections.give_back(connection)
            body = _json_object(raw[:_RESPONSE_LIMIT_BYTES])
            if response.status >= 400:
                raise _sidecar_error(response.status, body, payload.get("adapter_id"))
            return body

    def _unreachable(self, path: str, reason: str) -> RouteError:
        return RouteError(
            Status.UNAVAILABLE,
            f"sidecar unreachable at {self.settings.sidecar_url} ({path}): {reason}; "
            "check that lora-sidecar is running and the router's sidecar_url",
        )


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        snippet = raw[:200].decode("utf-8", "replace")
        raise RouteError(Status.INTERNAL, f"sidecar answered something not JSON: {snippet!r}")
    return value


def _sidecar_error(http_status: int, body: Mapping[str, Any], adapter_id: Any) -> RouteError:
    code = str(body.get("error", "unknown"))
    message = str(body.get("message", "")) or f"HTTP {http_status}"
    status = _STATUS_BY_CODE.get(code)
    if status is None:
        # A code this router predates: judged by the HTTP status, the way a proxy would.
        status = Status.UNAVAILABLE if http_status in (503, 504, 507) else (
            Status.INVALID_ARG if 400 <= http_status < 500 else Status.INTERNAL)
    problems = body.get("problems")
    if code == "invalid_adapter" and isinstance(problems, list) and problems:
        listed = "; ".join(
            f"{p.get('file', '?')}: {p.get('message', '?')} [{p.get('code', '?')}]"
            for p in problems if isinstance(p, dict)
        )
        message = f"adapter {adapter_id} was refused by validation: {listed}"
    if "cause" in body:
        message += f" [cause: {body['cause']}]"
    # cache_full is retried unless the sidecar says waiting cannot help (an adapter larger
    # than the whole budget).
    retryable = code == "cache_full" and body.get("retryable") is not False
    return RouteError(status, f"{message} ({code})", code, retryable, code in _HOLD_CODES)


# What the stock backend and vLLM say when the engine died (the request that killed it, the
# next ones until the backend's health check unloads the model, and that check's own answer):
# the sidecar loads the model again, so a client retries.
_DEAD_ENGINE = ("EngineDeadError", "EngineCore encountered an issue", "Engine loop is not running",
                "unhealthy vLLM engine", "engine is dead")


def _not_listed(exc: VllmError) -> bool:
    return exc.message.startswith("LoRA ") and "is not supported" in exc.message


def _vllm_error(exc: VllmError, adapter_id: str, vllm_model: str) -> RouteError:
    message = exc.message if len(exc.message) <= 300 else exc.message[:300] + "..."
    if any(sign in exc.message for sign in _DEAD_ENGINE):
        return RouteError(Status.UNAVAILABLE, f"{vllm_model}'s engine is down and is being "
                          f"restarted; retry with backoff (vLLM: {message})", holdable=True)
    if _not_listed(exc):
        # The adapter is on disk, but the catalog vllm_model loaded predates it.
        return RouteError(
            Status.UNAVAILABLE,
            f"{vllm_model} has not loaded a catalog that lists adapter {adapter_id} yet; "
            f"retry after the sidecar's next catalog reload (vLLM: {message})", holdable=True,
        )
    if exc.code in ("UNAVAILABLE", "NOT_FOUND") or "not ready" in exc.message:
        # Unloaded for a reload (unload-first), or not loaded yet.
        return RouteError(Status.UNAVAILABLE, f"{vllm_model} is not available: {message}",
                          holdable=True)
    return RouteError(Status.INTERNAL,
                      f"{vllm_model} failed on adapter {adapter_id}: {message}")


Generate = Callable[[str, str], Iterable[str]]


class Holds:
    """Requests held while no engine serves them (a reload, a catalog not loaded yet, an engine
    restarting): each waits with backoff up to `hold_s`, and at most `max_held_requests` wait at
    once; past either bound the request fails with the retryable error it got. Thread-safe."""

    def __init__(self, settings: RouterSettings, clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> None:
        self._hold_s = settings.hold_s
        self._max = settings.max_held_requests
        self._clock = clock
        self._pause = pause
        self._lock = threading.Lock()
        self.held = 0  # requests waiting now

    def start(self) -> Hold:
        return Hold(self)

    def _take(self) -> bool:
        with self._lock:
            if self.held >= self._max:
                return False
            self.held += 1
            return True

    def _give_back(self) -> None:
        with self._lock:
            self.held -= 1


class Hold:
    """One request's hold: `wait(error)` sleeps before the next attempt, or raises `error`."""

    def __init__(self, holds: Holds) -> None:
        self._holds = holds
        self._since: float | None = None
        self._taken = False
        self._delay_s = _RETRY_FIRST_S
        self.waits = 0

    def wait(self, error: RouteError) -> None:
        holds = self._holds
        now = holds._clock()
        if self._since is None:
            self._since = now
            self._taken = holds._hold_s > 0 and holds._take()
            if not self._taken:
                raise error  # holding is off, or enough requests wait already
        if now + self._delay_s - self._since > holds._hold_s:
            error.message += f" (held {now - self._since:.1f}s, the router's hold_s)"
            raise error
        holds._pause(self._delay_s * random.uniform(0.5, 1.0))
        self._delay_s = min(self._delay_s * 2, _RETRY_MAX_S)
        self.waits += 1

    @property
    def held_s(self) -> float:
        return 0.0 if self._since is None else self._holds._clock() - self._since

    def end(self) -> None:
        if self._taken:
            self._taken = False
            self._holds._give_back()


def route(
    prompt: str,
    adapter_id: str,
    sampling_json: str | None,
    sidecar: SidecarClient,
    generate: Generate,
    vllm_model: str = "vllm_model",
    warn: Callable[[str], None] = lambda message: None,
    holds: Holds | None = None,
    info: Callable[[str], None] = lambda message: None,
    on_lease: Callable[[Lease], None] = lambda lease: None,
) -> str:
    """Generated text for `prompt` with `adapter_id`; RouteError says why not.

    `generate(prompt, sampling_parameters_json)` yields text pieces (a decoupled BLS call in
    Triton) and raises VllmError. The lease is released whatever happens after staging. While
    no engine serves the adapter (a reload) the request is held (`holds`), then answered.
    `on_lease` hears each lease before its generation (the last one heard answered).
    """
    if not adapter_id.strip():
        raise RouteError(Status.INVALID_ARG, "adapter_id is empty")
    sampling_parameters(sampling_json, adapter_id)  # refused before anything is staged
    hold = (holds or Holds(replace(sidecar.settings, hold_s=0.0))).start()
    retried = False
    try:
        while True:
            try:
                lease = sidecar.stage(adapter_id)
            except RouteError as exc:
                if not exc.holdable:
                    raise
                hold.wait(exc)
                continue
            on_lease(lease)
            try:
                text = "".join(generate(prompt, sampling_parameters(sampling_json,
                                                                    lease.lora_name)))
            except VllmError as exc:
                # vllm_model loaded another catalog generation between the stage and the call
                # (a spare name of the old one is unknown to the new engine): ask again, once.
                if not retried and _not_listed(exc):
                    retried = True
                    continue
                error = _vllm_error(exc, adapter_id, vllm_model)
                if not error.holdable:
                    raise error from exc
                hold.wait(error)
                continue
            finally:
                try:
                    sidecar.release(lease.lease_id)
                except RouteError as exc:
                    # The lease expires on its own (the sidecar's --lease-ttl); the answer stands.
                    warn(f"could not release lease {lease.lease_id} of {adapter_id}: "
                         f"{exc.message}")
            if hold.waits:
                info(f"{adapter_id}: answered after being held {hold.held_s:.2f}s while no "
                     "engine served it")
            return text
    finally:
        hold.end()
