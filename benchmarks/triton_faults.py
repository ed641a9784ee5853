"""Triton late or blinking, before and after the reload state machine: a real Triton (the CPU
stand-in for vLLM, which takes --load-delay seconds to load, as an engine does) and the sidecar
as a process, for this working tree and for the sidecar at another revision (--before).

- Triton started --late seconds after the sidecar (compose's order), with the default
  --triton-reload-min-interval of 60 s: seconds from Triton answering ready to the first
  answer through the router.
- A blip while an engine serves: one readiness probe answered 503 by a proxy in front of
  Triton's HTTP port, or Triton refusing connections for 1 s, or one probe held 10 s. A client
  stages the adapter 10 times a second meanwhile: how many /stage calls failed (and the longest
  run of failures), and how many load/unload calls reached Triton.

Usage: python -m benchmarks.triton_faults [--before 183e423] [--late 8] [--load-delay 5]
Not part of the test suite (tests/triton/test_faults_triton.py holds the behaviour).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import TINY_LLAMA
from tests.triton.harness import REPO_ROOT, ROUTER, TritonServer, free_port, router_config
from tests.triton.triton_proxy import ThreadedTritonProxy

ADAPTER_ID = "steady-v1"
STAGE_EVERY_S = 0.1
BLIP_WINDOW_S = 20.0  # how long after a blip failed stages and reloads are counted


@dataclass
class Sidecar:
    process: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def checkout(revision: str, dest: Path) -> Path:
    """The sidecar package as it was at `revision`."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", revision, "sidecar"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def start_sidecar(tree: Path | None, workdir: Path, triton_url: str, *extra: str) -> Sidecar:
    """A sidecar process on a local registry holding ADAPTER_ID; `tree` None: this tree."""
    registry, cache = workdir / "registry", workdir / "cache"
    if not (registry / ADAPTER_ID).is_dir():
        write_adapter(registry / ADAPTER_ID, seed=1)
    cache.mkdir(parents=True, exist_ok=True)
    base_config = workdir / "base-model-config.json"
    base_config.write_text(json.dumps(TINY_LLAMA.to_config()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA_SIDECAR_")}
    python = [sys.executable, "-m", "sidecar"]
    if tree is not None:
        python = [sys.executable, "-P", "-m", "sidecar"]
        env["PYTHONPATH"] = str(tree)
    port = free_port()
    with open(workdir / "sidecar.log", "ab") as log:
        process = subprocess.Popen(
            [*python, "serve", "--registry", str(registry), "--cache-root", str(cache),
             "--port", str(port), "--triton-url", triton_url, "--base-model-config",
             str(base_config), "--min-free-disk", "0", *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    sidecar = Sidecar(process, f"http://127.0.0.1:{port}")
    wait_for(lambda: get(sidecar.url + "/healthz")[0] == 200, 60, "the sidecar's port")
    return sidecar


def get(url: str) -> tuple[int, dict[str, object]]:
    return request("GET", url, None)


def request(method: str, url: str, body: dict[str, object] | None) -> tuple[int, dict[str,
                                                                                   object]]:
    data = None if body is None else json.dumps(body).encode()
    call = urllib.request.Request(url, data=data, method=method,
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except OSError:
        return 0, {}


def stage(sidecar: Sidecar) -> int:
    return request("POST", sidecar.url + "/stage", {"adapter_id": ADAPTER_ID, "lease": False})[0]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)  # polling other processes: nothing to wait on
    raise TimeoutError(f"timed out waiting for {what}")


def ask(grpc_url: str) -> bool:
    """One router call; whether it answered."""
    client = grpcclient.InferenceServerClient(grpc_url)
    inputs = []
    for name, value in (("prompt", "hi"), ("adapter_id", ADAPTER_ID)):
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
        inputs.append(tensor)
    try:
        client.infer(ROUTER, inputs, client_timeout=30)
        return True
    except Exception:
        return False
    finally:
        client.close()


# ---- Triton late --------------------------------------------------------------------------


def triton_late(tree: Path | None, workdir: Path, late_s: float, load_delay_s: float) -> float:
    """Seconds from Triton answering ready to the router's first answer."""
    workdir.mkdir(parents=True)
    http_port = free_port()
    sidecar = start_sidecar(tree, workdir, f"http://127.0.0.1:{http_port}")
    server = None
    try:
        time.sleep(late_s)  # the sidecar tries to load the model meanwhile, and fails
        server = TritonServer.start(workdir / "triton", workdir / "cache" / "multi_lora.json",
                                    env={"STANDIN_VLLM_LOAD_DELAY_S": str(load_delay_s)},
                                    http_port=http_port)
        ready_at = time.monotonic()
        server.load(ROUTER, router_config(sidecar.url))
        while not ask(server.grpc_url):
            if time.monotonic() - ready_at > 300:
                return float("inf")
            time.sleep(0.2)
        return time.monotonic() - ready_at
    finally:
        sidecar.stop()
        if server is not None:
            server.stop()


# ---- blips --------------------------------------------------------------------------------


@dataclass
class Blip:
    failed: int = 0
    calls: int = 0
    longest_failing_s: float = 0.0
    repository_calls: int = 0


def blip(tree: Path | None, workdir: Path, mode: str, kind: str, load_delay_s: float) -> Blip:
    workdir.mkdir(parents=True)
    server = TritonServer.start(workdir / "triton", workdir / "cache" / "multi_lora.json",
                                env={"STANDIN_VLLM_LOAD_DELAY_S": str(load_delay_s)})
    proxy = ThreadedTritonProxy(server.http_url).start()
    # --catalog-refresh 2: the sidecar before the state machine probed only at each catalog
    # refresh (30 s by default); the one after probes every 2 s whatever this says.
    sidecar = start_sidecar(tree, workdir, proxy.url, "--triton-reload", mode,
                            "--catalog-refresh", "2")
    result = Blip()
    try:
        wait_for(lambda: stage(sidecar) == 200, 120, "the adapter servable")
        time.sleep(3)  # settled: a few probes answered ready
        before = len(proxy.repository_calls())
        probes = sum(1 for c in proxy.proxy.calls if c.endswith("/ready"))
        stop = threading.Event()
        outcomes: list[tuple[float, int]] = []

        def client() -> None:
            while not stop.is_set():
                outcomes.append((time.monotonic(), stage(sidecar)))
                stop.wait(STAGE_EVERY_S)

        thread = threading.Thread(target=client)
        thread.start()
        try:
            if kind == "503 once":
                proxy.proxy.ready_failures = 1
            elif kind == "down 1 s":
                proxy.proxy.down = True
                time.sleep(1.0)
                proxy.proxy.down = False
            elif kind == "probe held 10 s":
                proxy.hold_probes()
                wait_for(lambda: sum(1 for c in proxy.proxy.calls if c.endswith("/ready"))
                         > probes, 60, "a probe")
                time.sleep(10.0)
                proxy.release_probes()
            # The blip is over once a probe went through it; count from then on.
            wait_for(lambda: sum(1 for c in proxy.proxy.calls if c.endswith("/ready"))
                     > probes, 60, "a probe")
            time.sleep(BLIP_WINDOW_S)
        finally:
            stop.set()
            thread.join()
        result.calls = len(outcomes)
        result.failed = sum(1 for _, status in outcomes if status != 200)
        run_start = None
        for at, status in outcomes:
            if status != 200:
                run_start = at if run_start is None else run_start
                result.longest_failing_s = max(result.longest_failing_s, at - run_start)
            else:
                run_start = None
        result.repository_calls = len(proxy.repository_calls()) - before
        return result
    finally:
        sidecar.stop()
        proxy.stop()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="183e423",
                        help="git revision of the sidecar to compare with (default: the last "
                             "one before the reload state machine)")
    parser.add_argument("--late", type=float, default=8.0,
                        help="seconds Triton starts after the sidecar")
    parser.add_argument("--load-delay", type=float, default=5.0,
                        help="seconds the stand-in takes to load the model (an engine start)")
    parser.add_argument("--skip-blips", action="store_true")
    args = parser.parse_args(argv)
    late: dict[str, float] = {}
    blips: dict[tuple[str, str, str], Blip] = {}
    with tempfile.TemporaryDirectory(prefix="triton-faults-") as tmp:
        trees: dict[str, Path | None] = {"before": checkout(args.before, Path(tmp) / "before"),
                                         "after": None}
        for label, tree in trees.items():
            late[label] = triton_late(tree, Path(tmp) / f"late-{label}", args.late,
                                      args.load_delay)
            print(f"{label}: Triton late -> first answer {late[label]:.1f} s", flush=True)
        if not args.skip_blips:
            for kind in ("503 once", "down 1 s", "probe held 10 s"):
                for mode in ("unload-first", "on-change"):
                    for label, tree in trees.items():
                        workdir = Path(tmp) / f"blip-{label}-{mode}-{kind.replace(' ', '-')}"
                        blips[(kind, mode, label)] = blip(tree, workdir, mode, kind,
                                                          args.load_delay)
                        b = blips[(kind, mode, label)]
                        print(f"{label} {mode} {kind}: {b}", flush=True)
    print()
    print(f"Triton started {args.late:g} s after the sidecar (--triton-reload-min-interval 60, "
          f"model load {args.load_delay:g} s): seconds from Triton ready to the first answer "
          f"through the router; before = {args.before}, after = the working tree")
    print("| sidecar | Triton ready -> first answer, s |")
    print("|---|---|")
    for label, seconds in late.items():
        print(f"| {label} | {seconds:.1f} |")
    if blips:
        print()
        print(f"A blip while the engine serves; /stage every {STAGE_EVERY_S:g} s, counted for "
              f"{BLIP_WINDOW_S:g} s after the probe that met it")
        print("| blip | mode | sidecar | failed /stage (of calls) | longest failing, s | "
              "load/unload calls |")
        print("|---|---|---|---|---|---|")
        for (kind, mode, label), b in blips.items():
            print(f"| {kind} | {mode} | {label} | {b.failed} ({b.calls}) | "
                  f"{b.longest_failing_s:.1f} | {b.repository_calls} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
