"""The router's settings: its config.pbtxt parameters, and the container's environment
variables that point a deployment's router at its sidecar.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
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
        default = cls()
        problems: list[str] = []

        def number(name: str, parse: Callable[[str], float], ok: Callable[[float], bool],
                   rule: str) -> float:
            raw = parameters.get(name, str(getattr(default, name)))
            try:
                value = parse(raw)
            except ValueError:
                value = math.nan  # fails every `ok`
            if not ok(value):
                problems.append(f"{name} {raw!r}: must be {rule}")
            return value

        url = parameters.get("sidecar_url", default.sidecar_url).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            problems.append(f"sidecar_url {url!r}: use http://host:port")
        seconds = "a number of seconds greater than 0"
        stage_timeout_s = number("stage_timeout_s", float, _positive, seconds)
        sidecar_timeout_s = number("sidecar_timeout_s", float, _positive, seconds)
        hold_s = number("hold_s", float, lambda s: _positive(s) or s == 0,
                        "a number of seconds 0 or more")
        vllm_model = parameters.get("vllm_model", default.vllm_model).strip()
        if not vllm_model:
            problems.append("vllm_model must name the vLLM model")
        header = parameters.get("adapter_id_header", default.adapter_id_header).strip().lower()
        if not _HEADER_NAME.fullmatch(header):
            problems.append(f"adapter_id_header {header!r}: use a lower-case header name such "
                            "as x-adapter-id (gRPC metadata keys are lower-case)")
        concurrency = number("max_concurrent_requests", int, lambda n: 1 <= n <= 4096,
                             "a whole number from 1 to 4096")
        held = number("max_held_requests", int, lambda n: n >= 0, "a whole number, 0 or more")
        token: str | None = None
        token_file = parameters.get("sidecar_api_token_file", "").strip()
        if token_file:
            try:
                token = Path(token_file).read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                problems.append(f"sidecar_api_token_file {token_file}: {exc.strerror}")
        if problems:
            raise ValueError("multilora_router parameters: " + "; ".join(problems))
        return cls(url, stage_timeout_s, sidecar_timeout_s, vllm_model, token, header,
                   int(concurrency), hold_s, int(held))

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


def _positive(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0
