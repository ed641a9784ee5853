"""What the router adds, in a real Triton with the CPU stand-in for vLLM: latency over a direct
vllm_model call (sequential calls, adapter already cached), and throughput by router instance
count while vLLM takes a fixed time per request.

Usage: python -m benchmarks.router_overhead [--calls 300] [--instances 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import TINY_LLAMA
from tests.triton.harness import (
    ROUTER,
    VLLM_MODEL,
    TritonServer,
    free_port,
    import_router,
    router_config,
)

ADAPTER_ID = "bench-v1"
PROMPT = "Summarise the incident report in one line."


def _bytes(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
    return tensor


class DirectCaller:
    """vllm_model over a gRPC stream (it is decoupled), as the router's BLS call reaches it."""

    def __init__(self, url: str, lora_name: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)
        self._answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._answers.put((result,
                                                                                     error)))
        sampling = json.dumps({"temperature": 0, "max_tokens": 256, "lora_name": lora_name})
        exclude = grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")
        exclude.set_data_from_numpy(np.array([True]))
        self._inputs = [_bytes("text_input", PROMPT), _bytes("sampling_parameters", sampling),
                        exclude]

    def __call__(self) -> None:
        self._client.async_stream_infer(VLLM_MODEL, self._inputs)
        _result, error = self._answers.get(timeout=60)
        if error is not None:
            raise RuntimeError(f"vllm_model: {error}")

    def close(self) -> None:
        self._client.stop_stream()
        self._client.close()


class RouterCaller:
    def __init__(self, url: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)
        self._inputs = [_bytes("prompt", PROMPT), _bytes("adapter_id", ADAPTER_ID)]

    def __call__(self) -> None:
        self._client.infer(ROUTER, self._inputs, client_timeout=60)

    def close(self) -> None:
        self._client.close()


class SidecarRoundTrip:
    """The router's two sidecar calls alone (/stage on a hit, /release), with its own code."""

    def __init__(self, sidecar_url: str) -> None:
        routing = import_router()
        self._client = routing.SidecarClient(routing.RouterSettings(sidecar_url=sidecar_url))

    def lora_name(self) -> str:
        """The name vllm_model knows the adapter by (a spare name bound to it, or its id)."""
        lease = self._client.stage(ADAPTER_ID)
        self._client.release(lease, print)
        return str(lease.lora_name)

    def __call__(self) -> None:
        lease = self._client.stage(ADAPTER_ID)
        self._client.release(lease, print)


def latencies_ms(paths: dict[str, Callable[[], None]], calls: int,
                 warmup: int = 20) -> dict[str, list[float]]:
    """Sequential calls, the paths taking turns, so each sees the same background load."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for n in range(warmup + calls):
        for name, call in paths.items():
            started = time.perf_counter()
            call()
            if n >= warmup:
                samples[name].append((time.perf_counter() - started) * 1000)
    return samples


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def throughput(url: str, clients: int, requests_per_client: int) -> float:
    """Requests per second with `clients` threads each calling the router in turn."""
    callers = [RouterCaller(url) for _ in range(clients)]
    errors: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def work(caller: RouterCaller) -> None:
        start.wait()
        try:
            for _ in range(requests_per_client):
                caller()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in callers]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    for caller in callers:
        caller.close()
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed: {errors[0]}")
    return clients * requests_per_client / elapsed


@contextmanager
def node(workdir: Path, delay_s: float) -> Iterator[tuple[TritonServer, str]]:
    """Triton (stand-in delay `delay_s`) and a sidecar process on a local registry, with the
    catalog loaded by Triton."""
    workdir.mkdir(parents=True)
    registry, cache = workdir / "registry", workdir / "cache"
    write_adapter(registry / ADAPTER_ID, seed=1)
    cache.mkdir()
    server = TritonServer.start(workdir, cache / "multi_lora.json",
                                env={"STANDIN_VLLM_DELAY_S": str(delay_s)})
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}
    # The base model's shapes: the adapter, staged by the first call, is served under a spare
    # catalog name with no engine reload.
    base_config = workdir / "base-model-config.json"
    base_config.write_text(json.dumps(TINY_LLAMA.to_config()))
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "serve", "--registry", str(registry),
         "--cache-root", str(cache), "--port", str(port), "--triton-url", server.http_url,
         "--triton-reload-min-interval", "0", "--base-model-config", str(base_config),
         "--log-level", "WARNING"],
        env=env,
    )
    sidecar_url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_catalog(sidecar_url)
        yield server, sidecar_url
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=30)
        server.stop()


def _wait_for_catalog(sidecar_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(sidecar_url + "/catalog", timeout=2) as response:
                catalog = json.loads(response.read())
            if catalog["generation"] and (
                catalog["triton"]["loaded_generation"] == catalog["generation"]
            ):
                return
        except OSError:
            pass
        time.sleep(0.1)  # polling another process's state: nothing to wait on
    raise TimeoutError("the sidecar's catalog was not loaded by Triton")


def measure_overhead(workdir: Path, calls: int) -> dict[str, float]:
    with node(workdir, delay_s=0.0) as (server, sidecar_url):
        server.load(ROUTER, router_config(sidecar_url, instances=1))
        routed, sidecar = RouterCaller(server.grpc_url), SidecarRoundTrip(sidecar_url)
        routed()  # the cold stage happens here, outside the measurement
        direct = DirectCaller(server.grpc_url, sidecar.lora_name())
        try:
            samples = latencies_ms({"direct": direct, "router": routed, "sidecar": sidecar},
                                   calls)
        finally:
            direct.close()
            routed.close()
    result = {}
    for name, values in samples.items():
        result[f"{name}_median_ms"] = statistics.median(values)
        result[f"{name}_p99_ms"] = percentile(values, 0.99)
    result["overhead_median_ms"] = result["router_median_ms"] - result["direct_median_ms"]
    result["overhead_p99_ms"] = result["router_p99_ms"] - result["direct_p99_ms"]
    return result


def threads_per_instance() -> int:
    """The router's max_concurrent_requests as checked in: each instance's requests in progress."""
    config = json.loads(router_config("http://127.0.0.1:1"))
    return int(config["parameters"]["max_concurrent_requests"]["string_value"])


def measure_instances(workdir: Path, counts: list[int], delay_s: float, clients: int,
                      requests_per_client: int) -> dict[int, float]:
    rates = {}
    with node(workdir, delay_s=delay_s) as (server, sidecar_url):
        for count in counts:
            server.load(ROUTER, router_config(sidecar_url, instances=count))
            RouterCaller(server.grpc_url)()  # warm: the stage and the stand-in's adapter cache
            rates[count] = throughput(server.grpc_url, clients, requests_per_client)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per path")
    parser.add_argument("--instances", default="1,2,4,8", help="router instance counts")
    parser.add_argument("--delay", type=float, default=0.1,
                        help="stand-in generation time per request, seconds")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="requests per client")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        overhead = measure_overhead(Path(tmp) / "overhead", args.calls)
        counts = [int(n) for n in args.instances.split(",")]
        rates = measure_instances(Path(tmp) / "instances", counts, args.delay, args.clients,
                                  args.requests)
    print(f"latency over {args.calls} sequential calls each (hit path, stand-in answers at "
          "once; the three paths take turns):")
    labels = {"direct": "vllm_model direct", "router": "multilora_router",
              "sidecar": "  of which /stage+/release"}
    for name, label in labels.items():
        print(f"  {label:26s} median {overhead[f'{name}_median_ms']:6.2f} ms   "
              f"p99 {overhead[f'{name}_p99_ms']:6.2f} ms")
    print(f"  {'added by the router':26s} median {overhead['overhead_median_ms']:6.2f} ms   "
          f"p99 {overhead['overhead_p99_ms']:6.2f} ms")
    print(f"throughput, {args.clients} clients, vLLM stand-in {args.delay * 1000:.0f} ms/request:")
    threads = threads_per_instance()
    for count, rate in rates.items():
        # Each instance hands a request to one of its threads: the clients are the bound.
        ceiling = min(count * threads, args.clients) / args.delay
        print(f"  {count:2d} router instances: {rate:6.1f} req/s (ceiling {ceiling:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
