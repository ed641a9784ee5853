"""Does a warm adapter's request wait behind other adapters' downloads? In a real Triton with
the CPU stand-in for vLLM: 16 requests for 16 cold adapters whose downloads take seconds (the
S3 answers are held back by a proxy), and meanwhile one client calling the router for an
adapter already on disk. The table gives that client's latency with the router as checked in
and with an earlier one (a git revision), side by side.

    python -m benchmarks.router_cold_stall [--before 68f66dd] [--hold 4] [--calls 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import tritonclient.grpc as grpcclient
from moto.server import ThreadedMotoServer

from benchmarks.router_overhead import _wait_for_catalog, percentile
from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.s3proxy import S3Proxy, Seen
from tests.triton.harness import REPO_ROOT, ROUTER, TRITON_REPO, TritonServer, free_port
from tests.triton.harness import router_config as make_router_config

COLD = 16
WARM_ID = "warm-v1"
BUCKET = "bench"


def _bytes(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
    return tensor


def call(url: str, adapter_id: str) -> float:
    """One router call; seconds it took."""
    client = grpcclient.InferenceServerClient(url)
    try:
        started = time.perf_counter()
        client.infer(ROUTER, [_bytes("prompt", "hi"), _bytes("adapter_id", adapter_id)],
                     client_timeout=300)
        return time.perf_counter() - started
    finally:
        client.close()


def checkout(revision: str, dest: Path) -> Path:
    """triton_repo and the sidecar as they were at `revision` (a router sends what the
    sidecar of its time answers: the names it hands out changed since)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "triton_repo",
                              "sidecar"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def measure(label: str, tree: Path | None, workdir: Path, s3_url: str, proxy: S3Proxy,
            hold_s: float, calls: int) -> dict[str, Any]:
    """`tree`: a checkout of the router and the sidecar (None: the working tree)."""
    repository = TRITON_REPO if tree is None else tree / "triton_repo"
    cache = workdir / "cache"
    cache.mkdir(parents=True)
    server = TritonServer.start(workdir, cache / "multi_lora.json", source=repository)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    python = [sys.executable, "-m", "sidecar"]
    if tree is not None:
        python = [sys.executable, "-P", "-m", "sidecar"]
        env["PYTHONPATH"] = str(tree)
    # The base model's shapes: the catalog's spare names serve each cold adapter once it is on
    # disk, with no engine reload.
    base_config = workdir / "base-model-config.json"
    base_config.write_text(json.dumps(TINY_LLAMA.to_config()))
    sidecar = subprocess.Popen(
        [*python, "serve", "--registry", f"s3://{BUCKET}/lora",
         "--s3-endpoint-url", proxy.url, "--cache-root", str(cache), "--port", str(port),
         "--triton-url", server.http_url, "--triton-reload-min-interval", "0",
         "--base-model-config", str(base_config),
         "--min-free-disk", "0", "--log-level", "WARNING"], env=env)
    sidecar_url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_catalog(sidecar_url)
        server.load(ROUTER, make_router_config(sidecar_url, repository=repository))
        call(server.grpc_url, WARM_ID)  # now on disk, and in the stand-in's adapter cache
        idle = [call(server.grpc_url, WARM_ID) for _ in range(10)]
        cold_times: list[float] = []
        cold_threads = [threading.Thread(target=lambda n=n: cold_times.append(
            call(server.grpc_url, f"cold-{label}-{n}-v1"))) for n in range(COLD)]
        for thread in cold_threads:
            thread.start()
        time.sleep(0.5)  # the cold requests reach the sidecar and their downloads begin
        warm: list[float] = []
        began = time.perf_counter()
        while len(warm) < calls and time.perf_counter() - began < hold_s * 3:
            warm.append(call(server.grpc_url, WARM_ID))
            if time.perf_counter() - began > hold_s - 0.5:
                break  # only calls made while the downloads are held count
        for thread in cold_threads:
            thread.join()
        return {"label": label, "idle_p50": statistics.median(idle) * 1000,
                "warm_n": len(warm), "warm_p50": statistics.median(warm) * 1000,
                "warm_p99": percentile(warm, 0.99) * 1000, "warm_max": max(warm) * 1000,
                "cold_p50": statistics.median(cold_times)}
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=30)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="68f66dd",
                        help="git revision of the router (and its sidecar) to compare with "
                             "(default: the one that held an instance per request)")
    parser.add_argument("--hold", type=float, default=4.0,
                        help="seconds each cold adapter's download is held back")
    parser.add_argument("--calls", type=int, default=40,
                        help="most warm calls measured while the downloads are held")
    args = parser.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log, per request
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    proxy = S3Proxy(f"http://{host}:{port}")
    proxy.start()

    async def hold_cold(request: Any, seen: Seen) -> None:
        if seen.method == "GET" and "/cold-" in seen.path and seen.path.endswith(".safetensors"):
            await asyncio.sleep(args.hold)
        return None

    proxy.fault = hold_cold
    rows = []
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="router-cold-stall-") as tmp:
            ids = [WARM_ID] + [f"cold-{label}-{n}-v1" for label in ("before", "after")
                               for n in range(COLD)]
            for seed, adapter_id in enumerate(ids):
                folder = Path(tmp) / "adapters" / adapter_id
                write_adapter(folder, seed=seed)
                for path in folder.iterdir():
                    s3.put_object(Bucket=BUCKET, Key=f"lora/{adapter_id}/{path.name}",
                                  Body=path.read_bytes())
            before = checkout(args.before, Path(tmp) / "before")
            rows.append(measure("before", before, Path(tmp) / "run-before", proxy.url, proxy,
                                args.hold, args.calls))
            rows.append(measure("after", None, Path(tmp) / "run-after", proxy.url, proxy,
                                args.hold, args.calls))
    finally:
        proxy.stop()
        moto.stop()
    print(f"warm calls (one client, sequential) while {COLD} cold downloads are held back "
          f"{args.hold:g} s; before = router and sidecar at {args.before}, after = the working "
          "tree")
    print("| router | idle p50 ms | warm calls | warm p50 ms | warm p99 ms | warm max ms | "
          "cold p50 s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['label']} | {row['idle_p50']:.1f} | {row['warm_n']} | "
              f"{row['warm_p50']:.1f} | {row['warm_p99']:.1f} | {row['warm_max']:.1f} | "
              f"{row['cold_p50']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
