"""The router, per request: ask the sidecar for the adapter, call the engine with the name the
sidecar gave, release the lease. The plumbing lives beside this file, one module per concern:
router_settings (config.pbtxt), router_request (what a request asks for), router_sidecar and
router_connections (the sidecar's API over keep-alive HTTP), router_retries (backoff, holds),
router_errors (what each failure means to a client).

Standard library only: Triton's container has no aiohttp, and these files are tested without
Triton. Triton's Python backend puts this folder on sys.path, so they import each other by
plain name; the `router_` prefix keeps those names clear of any package in Triton's Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from router_errors import LORA_NOT_LISTED, Retry, RouteError, Status, VllmError, vllm_error
from router_request import requested_adapter_id, sampling_parameters
from router_retries import Holds
from router_settings import RouterSettings
from router_sidecar import PROVENANCE, Lease, SidecarClient, provenance, provenance_line

__all__ = ["PROVENANCE", "Generate", "Holds", "Lease", "RouteError", "RouterSettings",
           "SidecarClient", "Status", "VllmError", "provenance", "provenance_line",
           "requested_adapter_id", "route"]

Generate = Callable[[str, str], Iterable[str]]


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
    asked_again = False
    with (holds or Holds.none()).start() as hold:
        while True:
            try:
                with sidecar.leased(adapter_id, warn) as lease:
                    on_lease(lease)
                    text = _call_engine(generate, prompt, sampling_json, lease.lora_name,
                                        adapter_id, vllm_model)
            except RouteError as exc:
                # A spare name handed out just before vllm_model loaded another catalog
                # generation is unknown to the new engine: ask the sidecar again, once, at once.
                if exc.code == LORA_NOT_LISTED and not asked_again:
                    asked_again = True
                    continue
                if exc.retry is not Retry.WHEN_SERVED:
                    raise
                hold.wait(exc)  # or raises it: held too long, or too many held
                continue
            if hold.waits:
                info(f"{adapter_id}: answered after being held {hold.held_s:.2f}s while no "
                     "engine served it")
            return text


def _call_engine(generate: Generate, prompt: str, sampling_json: str | None, lora_name: str,
                 adapter_id: str, vllm_model: str) -> str:
    try:
        return "".join(generate(prompt, sampling_parameters(sampling_json, lora_name)))
    except VllmError as exc:
        raise vllm_error(exc, adapter_id, vllm_model) from exc
