"""The router's logic as plain functions: check the request, stage the adapter through the
sidecar, generate through vLLM, release the lease. Standard library only: Triton's container
has no aiohttp, and this file is tested without Triton.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import time
import urllib.error
import urllib.request
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
_RESPONSE_LIMIT_BYTES = 1024 * 1024


class Status(Enum):
    """Triton error codes the router answers with (names of pb_utils.TritonError's codes)."""

    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class RouteError(Exception):
    """A request the router cannot answer; `status` becomes the Triton error code."""

    def __init__(self, status: Status, message: str, code: str | None = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # the sidecar's error code, when the sidecar refused
        self.retryable = retryable  # worth asking again before the stage deadline


class VllmError(Exception):
    """vllm_model answered with an error; `code` is the Triton error code's name if known."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# The sidecar's stable error codes, and what each means to a Triton client.
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

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> RouterSettings:
        """From config.pbtxt `parameters` (key -> string_value); ValueError lists every problem."""
        problems: list[str] = []
        default = cls()
        url = parameters.get("sidecar_url", default.sidecar_url).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            problems.append(f"sidecar_url {url!r}: use http://host:port")
        timeouts: dict[str, float] = {}
        for name in ("stage_timeout_s", "sidecar_timeout_s"):
            raw = parameters.get(name, str(getattr(default, name)))
            try:
                timeouts[name] = float(raw)
            except ValueError:
                timeouts[name] = 0.0
            if not (math.isfinite(timeouts[name]) and timeouts[name] > 0):
                problems.append(f"{name} {raw!r}: must be a number of seconds greater than 0")
        vllm_model = parameters.get("vllm_model", default.vllm_model).strip()
        if not vllm_model:
            problems.append("vllm_model must name the vLLM model")
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
                   token)

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


class SidecarClient:
    """POST /stage and /release to the sidecar over plain HTTP, each call bounded in time."""

    def __init__(self, settings: RouterSettings,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> None:
        self._settings = settings
        self._clock = clock
        self._pause = pause

    def stage(self, adapter_id: str) -> Lease:
        """Stage `adapter_id`, waiting out a cache full of leased adapters until the deadline."""
        deadline = self._clock() + self._settings.stage_timeout_s
        delay_s = _RETRY_FIRST_S
        while True:
            remaining_s = max(deadline - self._clock(), 0.001)
            try:
                # The sidecar's own timeout runs out first, so a slow download is answered
                # with its stage_timeout error rather than with a socket timeout here.
                body = self._post("/stage", {"adapter_id": adapter_id, "timeout_s": remaining_s},
                                  timeout_s=remaining_s + self._settings.sidecar_timeout_s)
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
                             str(body.get("lora_name") or body["adapter_id"]))
            except KeyError as exc:
                raise RouteError(Status.INTERNAL,
                                 f"sidecar's /stage answer has no {exc.args[0]!r}") from exc

    def release(self, lease_id: str) -> None:
        self._post("/release", {"lease_id": lease_id}, timeout_s=self._settings.sidecar_timeout_s)

    def _post(self, path: str, payload: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        url = self._settings.sidecar_url + path
        headers = {"Content-Type": "application/json"}
        if self._settings.api_token:
            headers["Authorization"] = f"Bearer {self._settings.api_token}"
        request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return _json_object(response.read(_RESPONSE_LIMIT_BYTES))
        except urllib.error.HTTPError as exc:
            with exc:
                body = _json_object(exc.read(_RESPONSE_LIMIT_BYTES))
            raise _sidecar_error(exc.code, body, payload.get("adapter_id")) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RouteError(
                Status.UNAVAILABLE,
                f"sidecar unreachable at {self._settings.sidecar_url} ({path}): {reason}; "
                "check that lora-sidecar is running and the router's sidecar_url",
            ) from exc


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
        status = Status.UNAVAILABLE if http_status == 503 else (
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
    return RouteError(status, f"{message} ({code})", code, retryable)


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
                          f"restarted; retry with backoff (vLLM: {message})")
    if _not_listed(exc):
        # The adapter is on disk, but the catalog vllm_model loaded predates it.
        return RouteError(
            Status.UNAVAILABLE,
            f"{vllm_model} has not loaded a catalog that lists adapter {adapter_id} yet; "
            f"retry after the sidecar's next catalog reload (vLLM: {message})",
        )
    if exc.code in ("UNAVAILABLE", "NOT_FOUND") or "not ready" in exc.message:
        return RouteError(Status.UNAVAILABLE, f"{vllm_model} is not available: {message}")
    return RouteError(Status.INTERNAL,
                      f"{vllm_model} failed on adapter {adapter_id}: {message}")


Generate = Callable[[str, str], Iterable[str]]


def route(
    prompt: str,
    adapter_id: str,
    sampling_json: str | None,
    sidecar: SidecarClient,
    generate: Generate,
    vllm_model: str = "vllm_model",
    warn: Callable[[str], None] = lambda message: None,
) -> str:
    """Generated text for `prompt` with `adapter_id`; RouteError says why not.

    `generate(prompt, sampling_parameters_json)` yields text pieces (a decoupled BLS call in
    Triton) and raises VllmError. The lease is released whatever happens after staging.
    """
    if not adapter_id.strip():
        raise RouteError(Status.INVALID_ARG, "adapter_id is empty")
    sampling_parameters(sampling_json, adapter_id)  # refused before anything is staged
    retried = False
    while True:
        lease = sidecar.stage(adapter_id)
        try:
            return "".join(generate(prompt, sampling_parameters(sampling_json, lease.lora_name)))
        except VllmError as exc:
            # vllm_model loaded another catalog generation between the stage and the call
            # (a spare name of the old one is unknown to the new engine): ask again, once.
            if not retried and _not_listed(exc):
                retried = True
                continue
            raise _vllm_error(exc, adapter_id, vllm_model) from exc
        finally:
            try:
                sidecar.release(lease.lease_id)
            except RouteError as exc:
                # The lease expires on its own (the sidecar's --lease-ttl); the answer stands.
                warn(f"could not release lease {lease.lease_id} of {adapter_id}: {exc.message}")
