"""The engine's refusal of a name the sidecar gave, as the router reports it in its next /stage,
and what it means: whether what refused it will end (a reload, a restart), and what a client
should read. Judged here, beside the catalog that gave the name; the router only carries it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import BadRequest, EngineFailed, EngineUnavailable

MESSAGE_MAX_CHARS = 300  # of the engine's own message, quoted to the client

# What the stock backend and vLLM say when the engine died (the request that killed it, the
# next ones until the backend's health check unloads the model, and that check's own answer):
# the sidecar loads the model again.
_DEAD_ENGINE = ("EngineDeadError", "EngineCore encountered an issue", "Engine loop is not running",
                "unhealthy vLLM engine", "engine is dead")


@dataclass(frozen=True, slots=True)
class EngineRefusal:
    """The name the engine refused, its message, and its Triton error code's name if any."""

    lora_name: str
    message: str
    code: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> EngineRefusal:
        """From /stage's `engine_refused` field; BadRequest says what is wrong with it."""
        if not isinstance(body, Mapping):
            raise BadRequest("engine_refused must be an object")
        unknown = sorted(set(body) - {"lora_name", "message", "code"})
        if unknown:
            raise BadRequest(f"engine_refused: unknown field(s) {', '.join(unknown)[:200]}; "
                             "expected lora_name, message, code")
        lora_name, message, code = body.get("lora_name"), body.get("message"), body.get("code")
        if not isinstance(lora_name, str) or not isinstance(message, str) or not (
                code is None or isinstance(code, str)):
            raise BadRequest("engine_refused needs lora_name and message as strings, and code "
                             "as a string or null")
        return cls(lora_name, message, code)


def judge(refusal: EngineRefusal, adapter_id: str, model: str
          ) -> EngineUnavailable | EngineFailed:
    """EngineUnavailable when the engine will serve the adapter once what refused it ends,
    EngineFailed when it failed on the request itself."""
    quoted = refusal.message
    if len(quoted) > MESSAGE_MAX_CHARS:
        quoted = quoted[:MESSAGE_MAX_CHARS] + "..."
    if any(sign in refusal.message for sign in _DEAD_ENGINE):
        return EngineUnavailable(f"{model}'s engine is down and is being restarted; retry with "
                                 f"backoff (vLLM: {quoted})", adapter_id=adapter_id)
    if refusal.message.startswith("LoRA ") and "is not supported" in refusal.message:
        # The adapter is on disk, but the catalog the engine loaded predates it.
        return EngineUnavailable(
            f"{model} has not loaded a catalog that lists adapter {adapter_id} yet; retry after "
            f"the sidecar's next catalog reload (vLLM: {quoted})", adapter_id=adapter_id)
    if refusal.code in ("UNAVAILABLE", "NOT_FOUND") or "not ready" in refusal.message:
        # Unloaded for a reload (unload-first), or not loaded yet.
        return EngineUnavailable(f"{model} is not available: {quoted}", adapter_id=adapter_id)
    return EngineFailed(f"{model} failed on adapter {adapter_id}: {quoted}",
                        adapter_id=adapter_id)
