"""Restart cost: how long a sidecar takes to answer /healthz and to finish re-indexing its cache
(GET /adapters answers once it has), and how many bytes it read, with N adapters of a given
size that ship a SHA256SUMS file. Compares this checkout with another (`--sidecar-src`).

    .venv/bin/python -m benchmarks.restart --adapters 8 --size-mb 40
    .venv/bin/python -m benchmarks.restart --sidecar-src ../main      # side by side

Not part of the test suite; the cache lives under --dest (tmpfs by default: the disk would
be measured otherwise) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import ModelShapes

from .servers import holding

REPO = Path(__file__).resolve().parent.parent
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Restart:
    healthz_s: float  # from exec to the first /healthz answer
    recovered_s: float  # from exec to the first GET /adapters answer
    read_mb: float  # rchar when recovered


def shapes_for(size_mb: float) -> ModelShapes:
    """Llama-like layers of about 10 MB each at rank 16 (float16), as many as the size needs."""
    layers = max(1, round(size_mb * 1e6 / 10.1e6 * 16))
    return ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                       num_key_value_heads=8, num_hidden_layers=layers, head_dim=128)


def make_registry(registry: Path, count: int, size_mb: float) -> int:
    total = 0
    for i in range(count):
        folder = registry / f"bench-{i}"
        write_adapter(folder, rank=16, shapes=shapes_for(size_mb), target_modules=MODULES,
                      seed=i)
        files = sorted(folder.iterdir())
        (folder / "SHA256SUMS").write_text("".join(
            f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files))
        total += sum(p.stat().st_size for p in folder.iterdir())
    return total


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(src: Path | None, registry: Path, cache: Path, log: Path) -> tuple[
    subprocess.Popen[bytes], str, float
]:
    port = free_port()
    env = dict(os.environ)
    if src is None:
        command = [sys.executable, "-m", "sidecar"]
    else:
        command = [sys.executable, "-P", "-m", "sidecar"]
        env["PYTHONPATH"] = str(src.resolve())
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [*command, "serve", "--port", str(port), "--registry", str(registry),
             "--cache-root", str(cache), "--min-free-disk", "0", "--max-bytes", "1TiB"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}", time.monotonic()


def wait_for(url: str, process: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=timeout_s).close()
            return
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the sidecar exited while waiting for {url}") from None
            time.sleep(0.005)
    raise RuntimeError(f"no answer from {url}")


def rchar_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def restart_once(src: Path | None, registry: Path, cache: Path, log: Path) -> Restart:
    process, url, started = start(src, registry, cache, log)
    try:
        wait_for(f"{url}/healthz", process)
        healthz_s = time.monotonic() - started
        wait_for(f"{url}/adapters", process)
        return Restart(healthz_s, time.monotonic() - started, rchar_mb(process.pid))
    finally:
        process.terminate()
        process.wait(30)


def stage_all(src: Path | None, registry: Path, cache: Path, log: Path, count: int) -> None:
    process, url, _ = start(src, registry, cache, log)
    try:
        wait_for(f"{url}/adapters", process)
        for i in range(count):
            request = urllib.request.Request(
                f"{url}/stage", method="POST", headers={"Content-Type": "application/json"},
                data=f'{{"adapter_id": "bench-{i}", "lease": false}}'.encode())
            urllib.request.urlopen(request, timeout=600).close()
    finally:
        process.terminate()
        process.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=8, help="adapters in the cache (8)")
    parser.add_argument("--size-mb", type=float, default=40.0, help="MB per adapter (40)")
    parser.add_argument("--runs", type=int, default=3, help="restarts measured per checkout")
    parser.add_argument("--sidecar-src", type=Path, action="append", default=[],
                        help="another checkout to measure beside this one (repeatable)")
    parser.add_argument("--dest", type=Path, default=Path("/dev/shm/lsbench-restart"))
    args = parser.parse_args(argv)
    with holding(args.dest):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    try:
        registry = args.dest / "registry"
        total = make_registry(registry, args.adapters, args.size_mb)
        print(f"{args.adapters} adapters with SHA256SUMS, {total / 1e6:.0f} MB in all; "
              f"median of {args.runs} restarts\n")
        print("| checkout | /healthz after s | recovered after s | MB read by then |")
        print("|---|---:|---:|---:|")
        for src in [None, *args.sidecar_src]:
            name = "this checkout" if src is None else str(src)
            cache = args.dest / f"cache-{abs(hash(name))}"
            log = args.dest / f"{cache.name}.log"
            stage_all(src, registry, cache, log, args.adapters)
            runs = sorted((restart_once(src, registry, cache, log) for _ in range(args.runs)),
                          key=lambda r: r.recovered_s)
            mid = runs[len(runs) // 2]
            print(f"| {name} | {mid.healthz_s:.2f} | {mid.recovered_s:.2f} | "
                  f"{mid.read_mb:.0f} |")
    finally:
        shutil.rmtree(args.dest, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
