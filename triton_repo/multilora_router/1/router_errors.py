"""What each failure means to a Triton client: the sidecar's error codes and vLLM's failures
read into a Triton status, and into whether asking again can help.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


class Status(Enum):
    """Triton error codes the router answers with (names of pb_utils.TritonError's codes)."""

    NOT_FOUND = "NOT_FOUND"
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Retry(Enum):
    """What asking again can do for a refused request."""

    NEVER = "never"  # every attempt would be answered the same
    WHEN_ROOM = "when_room"  # a cache full of leased adapters: asked again until stage_timeout_s
    WHEN_SERVED = "when_served"  # no engine serves the adapter now, one will: held up to hold_s


class RouteError(Exception):
    """A request the router cannot answer; `status` becomes the Triton error code, `code` is the
    sidecar's error code (or the router's name for a vLLM failure)."""

    def __init__(self, status: Status, message: str, code: str | None = None,
                 retry: Retry = Retry.NEVER) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry = retry


class VllmError(Exception):
    """vllm_model answered with an error; `code` is the Triton error code's name if known."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# Every code the sidecar answers (each SidecarError's `code`, and its HTTP layer's own), and
# what it means to a Triton client; tests/triton/test_router_errors.py keeps the two in step.
# UNAVAILABLE is the one status a routing proxy retries on another node, so it is kept for what
# another node can help with; what is wrong with the adapter or the request itself is never
# UNAVAILABLE, since every node would answer the same.
STATUS_BY_CODE: Mapping[str, Status] = {
    "adapter_not_found": Status.NOT_FOUND,
    "invalid_adapter_id": Status.INVALID_ARG,
    "invalid_request": Status.INVALID_ARG,
    "invalid_adapter": Status.INVALID_ARG,
    # This node, now: its registry link, cache, catalog or engine.
    "registry_unavailable": Status.UNAVAILABLE,
    "registry_transient": Status.UNAVAILABLE,
    "registry_object_changed": Status.UNAVAILABLE,
    "catalog_pending": Status.UNAVAILABLE,
    "catalog_reloading": Status.UNAVAILABLE,
    "not_ready": Status.UNAVAILABLE,
    "stage_timeout": Status.UNAVAILABLE,
    "cache_full": Status.UNAVAILABLE,
    "cache_not_writable": Status.UNAVAILABLE,
    "request_timeout": Status.UNAVAILABLE,  # the router's request body was slow to arrive
    # The deployment, not the request: the registry's credentials, the router's token.
    "registry_error": Status.INTERNAL,
    "unauthorized": Status.INTERNAL,
    "request_too_large": Status.INTERNAL,
    "internal_error": Status.INTERNAL,
    # Never answered to /stage or /release: a sidecar_url that reaches something else.
    "not_found": Status.INTERNAL,
    "method_not_allowed": Status.INTERNAL,
    "not_cached": Status.INTERNAL,
    "lease_not_found": Status.INTERNAL,  # from /release, which only warns
    "adapter_in_use": Status.INTERNAL,
    "catalog_disabled": Status.INTERNAL,
}
# What says no engine serves a catalog that names the adapter yet (a reload in progress, a
# generation being loaded, the engine restarting): held, not failed, up to `hold_s`.
HOLD_CODES = frozenset({"catalog_reloading", "catalog_pending"})


def sidecar_error(http_status: int, body: Mapping[str, Any], adapter_id: Any) -> RouteError:
    """The sidecar's JSON error answer as a RouteError, with the sidecar's message."""
    code = str(body.get("error", "unknown"))
    message = str(body.get("message", "")) or f"HTTP {http_status}"
    status = STATUS_BY_CODE.get(code)
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
    retry = Retry.NEVER
    if code in HOLD_CODES:
        retry = Retry.WHEN_SERVED
    elif code == "cache_full" and body.get("retryable") is not False:
        retry = Retry.WHEN_ROOM  # unless waiting cannot help (larger than the whole budget)
    return RouteError(status, f"{message} ({code})", code, retry)


# What the stock backend and vLLM say when the engine died (the request that killed it, the
# next ones until the backend's health check unloads the model, and that check's own answer):
# the sidecar loads the model again, so a client retries.
_DEAD_ENGINE = ("EngineDeadError", "EngineCore encountered an issue", "Engine loop is not running",
                "unhealthy vLLM engine", "engine is dead")
# The router's name for vLLM refusing a lora_name it does not list (`route` asks again at once).
LORA_NOT_LISTED = "lora_not_listed"


def vllm_error(exc: VllmError, adapter_id: str, vllm_model: str) -> RouteError:
    """vllm_model's failure as a RouteError: what a reload or a restart will fix is held."""
    message = exc.message if len(exc.message) <= 300 else exc.message[:300] + "..."
    if any(sign in exc.message for sign in _DEAD_ENGINE):
        return RouteError(Status.UNAVAILABLE, f"{vllm_model}'s engine is down and is being "
                          f"restarted; retry with backoff (vLLM: {message})", "engine_down",
                          Retry.WHEN_SERVED)
    if exc.message.startswith("LoRA ") and "is not supported" in exc.message:
        # The adapter is on disk, but the catalog vllm_model loaded predates it.
        return RouteError(
            Status.UNAVAILABLE,
            f"{vllm_model} has not loaded a catalog that lists adapter {adapter_id} yet; "
            f"retry after the sidecar's next catalog reload (vLLM: {message})",
            LORA_NOT_LISTED, Retry.WHEN_SERVED,
        )
    if exc.code in ("UNAVAILABLE", "NOT_FOUND") or "not ready" in exc.message:
        # Unloaded for a reload (unload-first), or not loaded yet.
        return RouteError(Status.UNAVAILABLE, f"{vllm_model} is not available: {message}",
                          "engine_unavailable", Retry.WHEN_SERVED)
    return RouteError(Status.INTERNAL,
                      f"{vllm_model} failed on adapter {adapter_id}: {message}", "engine_failed")
