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
    wrk: str, url: str, server_pid: int, adapter_id: str, clients: int, seconds: float,
    authorization: str | None = None,
) -> LoadResult:
    argv = ["taskset", "-c", LOADGEN_CPU, wrk, "-t1", f"-c{clients}", f"-d{seconds:g}s",
            "-s", str(HERE / "stage.lua"), url + "/stage"]
    env = {**os.environ, "LSBENCH_ADAPTER_ID": adapter_id}
    if authorization is not None:
        env["LSBENCH_AUTHORIZATION"] = authorization
    cpu_before = process_cpu_s(server_pid)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
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


ROUTER_TOKEN = "hitpath-router-token-0123456789"


def write_tenants(path: Path, count: int) -> None:
    """A --tenants file of `count` tenants and the router's token, which the load sends."""
    entries = [f'[[tenants]]\nname = "t{i}"\nprefix = "t{i}-"\ntoken = "tenant-{i}-token-abcdef"\n'
               for i in range(count)]
    path.write_text(f'[router]\ntoken = "{ROUTER_TOKEN}"\n\n' + "\n".join(entries))


def compare(rounds: int, seconds: float, clients_list: list[int], dest: Path,
            compared: list[tuple[str, Path]], tenants: int | None = None) -> str:
    """This checkout's sidecar (and others') beside the bare handler on the small adapter from
    a local folder: rounds alternate which server goes first; medians of each figure. With
    `tenants`, each sidecar runs with a --tenants file of that many and the load sends the
    router's token (the bare handler checks none)."""
    import shutil
    import sys

    from .bench import REPO
    from .miss import local_sidecar, small_adapter
    from .servers import Supervisor, free_port, s3_env, wait_for_port

    work = REPO / "benchmarks" / ".work"
    sup = Supervisor(work / "logs")
    small = small_adapter(work / "adapters")
    shutil.rmtree(dest, ignore_errors=True)
    targets: dict[str, tuple[str, int]] = {}
    extra: tuple[str, ...] = ()
    authorization = None
    if tenants is not None:
        dest.mkdir(parents=True, exist_ok=True)
        write_tenants(dest / "tenants.toml", tenants)
        extra, authorization = ("--tenants", str(dest / "tenants.toml")), f"Bearer {ROUTER_TOKEN}"
    try:
        response = None
        for label, source in [("sidecar", REPO), *compared]:
            env = s3_env(os.environ, work)
            env["PYTHONPATH"] = str(source.resolve())
            sidecar = local_sidecar(sup, [sys.executable, "-P", "-m", "sidecar"],
                                    work / "adapters", dest / f"cache-{label}", env, extra)
            response = sidecar.stage(small.adapter_id)
            name = label if label == "sidecar" else f"sidecar ({label})"
            targets[name] = (f"http://127.0.0.1:{sidecar.port}", sidecar.pid)
        responses = dest / "bare-responses.json"
        responses.write_text(json.dumps({small.adapter_id: response}))
        port = free_port()
        bare = sup.start("bare-aiohttp", [sys.executable, "-m", "benchmarks.bare_server",
                                          str(port), str(responses)])
        wait_for_port("127.0.0.1", port, bare, "the bare handler")
        targets["bare aiohttp"] = (f"http://127.0.0.1:{port}", bare.pid)
        for _, pid in targets.values():
            pin_to_server_cpu(pid)
        runs: dict[tuple[str, int], list[LoadResult]] = {}
        load_before = os.getloadavg()
        for round_index in range(rounds):
            order = list(targets.items())
            shift = round_index % len(order)
            for clients in clients_list:
                for name, (url, pid) in order[shift:] + order[:shift]:
                    runs.setdefault((name, clients), []).append(run_wrk(
                        "wrk", url, pid, small.adapter_id, clients, seconds, authorization))
        load_after = os.getloadavg()
    finally:
        sup.stop_all()
        shutil.rmtree(dest, ignore_errors=True)
    load = " / ".join(" ".join(f"{x:.2f}" for x in avg) for avg in (load_before, load_after))
    who = "" if tenants is None else f", the router's token among {tenants} tenants"
    lines = [f"\nPOST /stage hits{who}, {rounds} alternating rounds of {seconds:g} s (medians); "
             f"load average 1/5/15 min at the start / the end: {load}\n",
             "| server | clients | req/s | / bare | CPU µs/req | / bare CPU | p99 ms | "
             "CPU µs/req, runs |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for clients in clients_list:
        bare_cell = median_of(runs[("bare aiohttp", clients)])
        for name in targets:
            cell = runs[(name, clients)]
            m = median_of(cell)
            lines.append(
                f"| {name} | {clients} | {m.requests_per_s:.0f} | "
                f"{m.requests_per_s / bare_cell.requests_per_s:.0%} | "
                f"{m.cpu_us_per_request:.1f} | "
                f"{bare_cell.cpu_us_per_request / m.cpu_us_per_request:.2f} | "
                f"{m.p99_ms:.2f} | {', '.join(f'{r.cpu_us_per_request:.0f}' for r in cell)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .servers import add_compare_option, compared_checkouts, holding

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hitpath",
        description="POST /stage hits on a small adapter from a local folder, this sidecar "
        "beside the bare aiohttp handler (and --compare checkouts), alternating rounds (the "
        "full hit phase is `benchmarks/run.sh --phases hit`). Needs wrk and taskset.")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="of load per cell")
    parser.add_argument("--clients", type=int, action="append", default=[],
                        help="keep-alive clients per cell (repeatable; default 8 and 64)")
    parser.add_argument("--dest", type=Path, default=Path("/dev/shm/lsbench-hit"))
    parser.add_argument("--tenants", type=int, metavar="N",
                        help="run the sidecars with a --tenants file of N tenants, the load "
                        "sending the router's token")
    add_compare_option(parser)
    args = parser.parse_args(argv)
    compared = compared_checkouts(args.compare)

    with holding(args.dest):
        print(compare(args.rounds, args.seconds, args.clients or [8, 64], args.dest, compared,
                      args.tenants))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
