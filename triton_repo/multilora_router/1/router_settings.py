"""The router's settings: its config.pbtxt parameters, and the container's environment
variables that point a deployment's router at its sidecar.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

_HEADER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


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

