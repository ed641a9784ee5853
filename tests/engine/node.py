"""A whole node with the real engine: moto S3 as the registry, the sidecar as a process, and
tritonserver running the project's triton_repo with the stock vLLM backend (vLLM on CPU); a gRPC
client calls the router as a user's client does."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.engine.harness import (
    ENGINE_ENV,
    MAX_TOKENS,
    PROMPT,
    EngineAssets,
    engine_args,
    engine_processes,
    tree_rss_bytes,
)
from tests.support.processes import SidecarProcess
from tests.support.waiting import eventually_blocking
from tests.triton.harness import ROUTER, VLLM_MODEL, TritonServer, router_config

PREFIX = "lora"
ROUTER_INSTANCES = 4
ENGINE_LOAD_TIMEOUT_S = 300.0
_NOT_SUPPORTED = re.compile(r"LoRA (?P<name>.*) is not supported, we currently support "
                            r"(?P<listed>\[.*\])", re.S)


def _bytes_input(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=object))
    return tensor


def _bool_input(name: str, value: bool) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def status_of(error: InferenceServerException) -> str:
    return str(error.status()).removeprefix("StatusCode.")


def _s3(moto_url: str) -> Any:
    return boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def upload_folder(moto_url: str, bucket: str, adapter_id: str, folder: Path,
                  only: Sequence[str] | None = None) -> None:
    """An adapter folder's files (or `only` these), into the registry under `adapter_id`
    (symlinks and sub-folders cannot be objects)."""
    client = _s3(moto_url)
    try:
        for path in sorted(folder.iterdir()):
            if only is not None and path.name not in only:
                continue
            if path.is_file() and not path.is_symlink():
                client.put_object(Bucket=bucket, Key=f"{PREFIX}/{adapter_id}/{path.name}",
                                  Body=path.read_bytes())
    finally:
        client.close()


@dataclass
class EngineNode:
    assets: EngineAssets
    server: TritonServer
    sidecar: SidecarProcess
    workdir: Path
    cache_root: Path
    moto_url: str
    bucket: str
    engine_load_s: float
    sidecar_args: list[str]
    sidecar_env: dict[str, str]
    triton_env: dict[str, str]
    vllm_backend: Path
    engine_args: dict[str, Any]
    triton_starts: int = 0
    memory_samples: list[int] = field(default_factory=list)

    # ---- the registry -------------------------------------------------------------------

    def upload(self, adapter_id: str, folder: Path, only: Sequence[str] | None = None) -> None:
        """Put an adapter folder's files (or `only` these) into the registry under
        `adapter_id`."""
        upload_folder(self.moto_url, self.bucket, adapter_id, folder, only)

    # ---- clients ----------------------------------------------------------------------

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.server.grpc_url)

    def ask(self, adapter_id: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS,
            client: grpcclient.InferenceServerClient | None = None) -> str:
        """One router call, as a client makes it; errors raise InferenceServerException."""
        own = client is None
        client = client or self.client()
        try:
            inputs = [_bytes_input("prompt", prompt), _bytes_input("adapter_id", adapter_id),
                      _bytes_input("sampling_parameters", json.dumps({"max_tokens": max_tokens}))]
            result = client.infer(ROUTER, inputs, client_timeout=300)
            answer = result.as_numpy("generated_text").reshape(-1)[0]
            return answer.decode("utf-8") if isinstance(answer, bytes) else str(answer)
        finally:
            if own:
                client.close()

    def ask_until_served(self, adapter_id: str, timeout_s: float = 240.0,
                         **kwargs: Any) -> tuple[str, float, int]:
        """Call the router until it stops answering UNAVAILABLE (what a client does while a new
        adapter becomes servable); returns (text, seconds, UNAVAILABLE answers)."""
        started = time.monotonic()
        unavailable = 0

        def answered() -> tuple[str] | None:
            nonlocal unavailable
            try:
                return (self.ask(adapter_id, **kwargs),)
            except InferenceServerException as exc:
                if status_of(exc) != "UNAVAILABLE":
                    raise
                unavailable += 1
                return None

        # A client's back-off between two calls: there is nothing to wait on.
        (text,) = eventually_blocking(answered, timeout_s=timeout_s, poll_s=0.25,
                                      what=f"{adapter_id} served")
        return text, time.monotonic() - started, unavailable

    def vllm_stream(self, lora_name: str | None, prompt: str = PROMPT, *,
                    max_tokens: int = MAX_TOKENS, stream: bool = False,
                    exclude_input: bool | None = None) -> list[str]:
        """A direct, decoupled call of vllm_model (what the router does through BLS, or what
        anyone who can reach Triton can do): every response's text_output, in order. An error
        response raises InferenceServerException."""
        sampling: dict[str, Any] = {"temperature": 0, "max_tokens": max_tokens}
        if lora_name is not None:
            sampling["lora_name"] = lora_name
        inputs = [_bytes_input("text_input", prompt), _bool_input("stream", stream),
                  _bytes_input("sampling_parameters", json.dumps(sampling))]
        if exclude_input is not None:
            inputs.append(_bool_input("exclude_input_in_output", exclude_input))
        import queue

        answers: queue.Queue[Any] = queue.Queue()
        client = self.client()
        try:
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
            client.async_stream_infer(VLLM_MODEL, inputs, enable_empty_final_response=True)
            texts: list[str] = []
            while True:
                result, error = answers.get(timeout=300)
                if error is not None:
                    raise error
                response = result.get_response()
                if response.outputs:
                    for text in result.as_numpy("text_output").reshape(-1):
                        texts.append(text.decode("utf-8") if isinstance(text, bytes)
                                     else str(text))
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return texts
        finally:
            client.stop_stream()
            client.close()

    def loaded_lora_names(self) -> list[str]:
        """The names the loaded vllm_model accepts, as the stock backend itself lists them to
        any caller of a name it does not know."""
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        try:
            self.vllm_stream(probe, max_tokens=1)
        except InferenceServerException as exc:
            match = _NOT_SUPPORTED.search(exc.message() or "")
            assert match and match["name"] == probe, exc.message()
            listed: list[str] = json.loads(match["listed"].replace("'", '"'))
            return listed
        raise AssertionError(f"vllm_model served an unknown LoRA name {probe}")

    # ---- the sidecar -------------------------------------------------------------------

    def sidecar_json(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """GET `path`, or POST `body` to it."""
        request = urllib.request.Request(
            self.sidecar.url + path, method="GET" if body is None else "POST",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def lora_name(self, adapter_id: str) -> str:
        """Stage the adapter and return the name vllm_model knows it by (the /stage answer's
        `lora_name`, the adapter id where the sidecar does not bind names); the lease is given
        back at once, the folder stays on disk until something else needs the room."""
        answer = self.sidecar_json("/stage", {"adapter_id": adapter_id})
        if answer.get("lease_id"):
            self.sidecar_json("/release", {"lease_id": answer["lease_id"]})
        return str(answer.get("lora_name") or adapter_id)

    def staged_at(self, adapter_id: str) -> float:
        """When the sidecar published an adapter (its log's `staged` line): the download's end."""
        for line in self.sidecar.log_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("event") == "staged" and entry.get("adapter_id") == adapter_id:
                    return datetime.fromisoformat(entry["ts"]).timestamp()
        raise AssertionError(f"the sidecar's log has no staged line for {adapter_id}")

    def wait_catalog_loaded(self, timeout_s: float = ENGINE_LOAD_TIMEOUT_S) -> float:
        """Until Triton has loaded the catalog the sidecar rendered last; returns the seconds."""
        started = time.monotonic()
        last: list[dict[str, Any]] = []

        def loaded() -> bool:  # another process's state: there is no event to wait on
            status = self.sidecar_json("/catalog")
            last[:] = [status]
            triton = status.get("triton", {})
            if (triton.get("loaded_generation") == status["generation"]
                    and status["generation"] > 0 and not triton.get("reloading")):
                return True
            self.sample_memory()
            return False

        try:
            eventually_blocking(loaded, timeout_s=timeout_s, poll_s=0.2,
                                what="Triton loading the catalog")
        except AssertionError:
            raise TimeoutError(f"Triton did not load the catalog: {last[-1]}\n"
                               + self.server.log_tail()) from None
        return time.monotonic() - started

    # ---- the engine's processes ---------------------------------------------------------

    def engine_pids(self) -> dict[int, str]:
        """vLLM's engine processes under Triton: pid -> name (VLLM::EngineCore)."""
        return engine_processes(self.server.process.pid)

    def sample_memory(self) -> int:
        rss = tree_rss_bytes([self.server.process.pid, self.sidecar.pid])
        self.memory_samples.append(rss)
        return rss

    def restart_sidecar(self, extra_args: Sequence[str] = ()) -> None:
        """Stop the sidecar and start it again on the same port and cache (the router keeps
        its URL); `extra_args` are added to its command line."""
        self.sidecar.stop()
        self.sidecar = SidecarProcess([*self.sidecar_args, *extra_args],
                                      self.workdir / "sidecar.log", env=self.sidecar_env,
                                      port=self.sidecar.port)

    def restart_triton(self) -> None:
        """Stop Triton (its engine processes killed) and start it again on the same ports and
        model repository settings; vllm_model is loaded again by the sidecar's next sync (or
        by the test), the router here."""
        ports = (self.server.http_port, self.server.grpc_port)
        self.server.stop()
        self.triton_starts += 1
        self.server = TritonServer.start(
            self.workdir / f"triton-{self.triton_starts}", self.cache_root / "multi_lora.json",
            env=self.triton_env, vllm_backend=self.vllm_backend,
            python_venv=self.assets.env.venv, engine_args=self.engine_args, ports=ports)

    def load_router(self) -> None:
        self.server.load(ROUTER, router_config(self.sidecar.url, instances=ROUTER_INSTANCES))

    def stop(self) -> None:
        self.sidecar.stop()
        self.server.stop()


def start_node(assets: EngineAssets, workdir: Path, moto_url: str, vllm_backend: Path, *,
               adapters: Mapping[str, Path], sidecar_args: Sequence[str] = (),
               engine_overrides: Mapping[str, Any] | None = None,
               triton_env: Mapping[str, str] | None = None) -> EngineNode:
    """Registry with `adapters` (id -> folder) uploaded, Triton with the real engine, the
    sidecar (with `sidecar_args` added to its command line) rendering the catalog and loading
    vllm_model, and the router loaded. Stop it with node.stop()."""
    cache_root = workdir / "cache"
    cache_root.mkdir(parents=True)
    bucket = f"engine-{uuid.uuid4().hex[:12]}"
    client = _s3(moto_url)
    client.create_bucket(Bucket=bucket)
    client.close()
    server_env = {**ENGINE_ENV, **(triton_env or {})}
    server_args = engine_args(assets.base, **(engine_overrides or {}))
    server = TritonServer.start(
        workdir / "triton", cache_root / "multi_lora.json", env=server_env,
        vllm_backend=vllm_backend, python_venv=assets.env.venv, engine_args=server_args)
    sidecar: SidecarProcess | None = None
    try:
        args = [
            "--registry", f"s3://{bucket}/{PREFIX}", "--s3-endpoint-url", moto_url,
            "--cache-root", str(cache_root), "--triton-url", server.http_url,
            "--triton-reload-min-interval", "0", "--catalog-refresh", "3600",
            "--min-free-disk", "0", "--base-model-config", str(assets.base_config),
            *sidecar_args,
        ]
        for adapter_id, folder in adapters.items():
            upload_folder(moto_url, bucket, adapter_id, folder)
        env = {**{k: v for k, v in os.environ.items()
                  if not k.startswith(("LORA_SIDECAR_", "AWS_"))},
               "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        sidecar = SidecarProcess(args, workdir / "sidecar.log", env=env)
        node = EngineNode(assets, server, sidecar, workdir, cache_root, moto_url, bucket, 0.0,
                          list(args), env, server_env, vllm_backend, server_args)
        node.engine_load_s = node.wait_catalog_loaded()
        node.load_router()
        return node
    except BaseException:
        if sidecar is not None:
            sidecar.stop()
        server.stop()
        raise
