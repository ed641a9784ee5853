"""The hit path under load: wrk (one thread, pinned to its own core) posting /stage for a
cached adapter over keep-alive connections, against the sidecar and the bare handler."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOADGEN_CPU = "1"  # the server under test is pinned to CPU 0


@dataclass(frozen=True, slots=True)
class LoadResult:
    clients: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_us_per_request: float  # the server's CPU time over the requests it answered


def pin_to_server_cpu(pid: int) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", "0", str(pid)], check=True,
                   capture_output=True)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(
    wrk: str, url: str, server_pid: int, adapter_id: str, clients: int, seconds: float
) -> LoadResult:
    argv = ["taskset", "-c", LOADGEN_CPU, wrk, "-t1", f"-c{clients}", f"-d{seconds:g}s",
            "-s", str(HERE / "stage.lua"), url + "/stage"]
    cpu_before = process_cpu_s(server_pid)
    done = subprocess.run(argv, capture_output=True, text=True, check=True,
                          env={**os.environ, "LSBENCH_ADAPTER_ID": adapter_id})
    cpu_s = process_cpu_s(server_pid) - cpu_before
    line = done.stdout.strip().splitlines()[-1]
    result = json.loads(line)
    if result["socket_errors"] or result["status_errors"]:
        raise RuntimeError(f"wrk saw errors against {url}: {result}")
    return LoadResult(
        clients=clients,
        requests_per_s=result["requests"] / (result["duration_us"] / 1e6),
        p50_ms=result["p50_us"] / 1000,
        p99_ms=result["p99_us"] / 1000,
        cpu_us_per_request=cpu_s / max(result["requests"], 1) * 1e6,
    )


def median_of(results: list[LoadResult]) -> LoadResult:
    """Each figure's median over repeated runs of one cell."""
    return LoadResult(
        clients=results[0].clients,
        requests_per_s=statistics.median(r.requests_per_s for r in results),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        cpu_us_per_request=statistics.median(r.cpu_us_per_request for r in results),
    )
