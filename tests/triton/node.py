"""A node of the Triton tier: a real Triton with the router loaded, whose vllm_model (the CPU
stand-in) reads the catalog of a cache the test's sidecar renders; and calls of the router and of
vllm_model as clients make them."""

from __future__ import annotations

import json
import queue
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcsync
import tritonclient.grpc.aio as grpcclient

from sidecar.process.app import Sidecar
from tests.support.recording_proxy import RecordingProxy
from tests.triton.harness import ROUTER, VLLM_MODEL, TritonServer, free_port, router_config


@dataclass
class TritonNode:
    server: TritonServer
    cache_root: Path  # where the catalog link of the server's vllm_model points
    sidecar_port: int  # where the router expects the sidecar
    fail_flag: Path  # while it exists, vllm_model fails to load (as out of GPU memory)
    proxy: RecordingProxy  # every proxy variable of Triton's environment points at it

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    def stop(self) -> None:
        self.server.stop()
        self.proxy.stop()


def start_triton_node(workdir: Path, *, env: dict[str, str] | None = None,
                      sidecar_port: int | None = None, http_port: int | None = None,
                      cache_root: Path | None = None, hold_s: float = 0.0) -> TritonNode:
    """A Triton with the router loaded, its vllm_model reading `cache_root`'s catalog. Proxy
    variables and no no_proxy in its environment, as in many corporate containers: the
    router's calls to the sidecar must still go straight to it. The router answers at once
    what it would otherwise hold (`hold_s` 0): these tests drive the catalog's reloads by
    hand; the hold itself is tested with its own router load."""
    workdir.mkdir(parents=True, exist_ok=True)
    cache_root = cache_root or workdir / "cache"
    cache_root.mkdir(exist_ok=True)
    fail_flag = workdir / "fail-vllm-load"
    proxy = RecordingProxy(workdir / f"proxy-{free_port()}")
    try:
        server = TritonServer.start(workdir / f"server-{free_port()}",
                                    cache_root / "multi_lora.json",
                                    env={"STANDIN_VLLM_FAIL_FLAG": str(fail_flag),
                                         **proxy.environment(), **(env or {})},
                                    http_port=http_port)
    except BaseException:
        proxy.stop()
        raise
    node = TritonNode(server, cache_root, sidecar_port or free_port(), fail_flag, proxy)
    try:
        server.load(ROUTER, router_config(node.sidecar_url, hold_s=f"{hold_s:g}"))
    except BaseException:
        node.stop()
        raise
    return node


# The `node_sidecar` fixture: the sidecar the router talks to, started with these overrides.
StartNodeSidecar = Callable[..., Awaitable[Sidecar]]


def _bytes_input(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=object))
    return tensor


async def ask(client: grpcclient.InferenceServerClient, adapter_id: str | None, prompt: str,
              sampling: dict[str, Any] | str | None = None,
              headers: dict[str, str] | None = None) -> str:
    """One call of the router; its error surfaces as InferenceServerException. No adapter_id
    input when `adapter_id` is None (the header names it then)."""
    inputs = [_bytes_input("prompt", prompt)]
    if adapter_id is not None:
        inputs.append(_bytes_input("adapter_id", adapter_id))
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(_bytes_input("sampling_parameters", text))
    result = await client.infer(ROUTER, inputs, client_timeout=120, headers=headers)
    answer = result.as_numpy("generated_text").reshape(-1)[0]
    return answer.decode("utf-8") if isinstance(answer, bytes) else str(answer)


def direct_call(url: str, prompt: str, sampling: dict[str, Any], *, exclude: bool = True,
                stream: bool = False) -> list[str]:
    """vllm_model over a gRPC stream, as the router's BLS call reaches it: every text_output
    piece until the final response; the backend's error raised as RuntimeError."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcsync.InferenceServerClient(url)
    inputs = []
    for name, value in (("text_input", prompt), ("sampling_parameters", json.dumps(sampling))):
        tensor = grpcsync.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
        inputs.append(tensor)
    for name, flag in (("exclude_input_in_output", exclude), ("stream", stream)):
        tensor = grpcsync.InferInput(name, [1], "BOOL")
        tensor.set_data_from_numpy(np.array([flag]))
        inputs.append(tensor)
    pieces: list[str] = []
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(VLLM_MODEL, inputs, enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=30)
            if error is not None:
                raise RuntimeError(error.message())
            output = result.as_numpy("text_output")
            if output is not None:
                pieces.extend(p.decode() for p in output.reshape(-1))
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return pieces
    finally:
        client.stop_stream()
        client.close()
