"""What a catalogued name costs, measured with the real engine (vLLM on CPU behind the stock
Triton backend, the engine tier's node): the engine's load time and memory with 32, 1,000 and
4,000 names in multi_lora.json; a request's time through the router with a name at the end of
such a catalog (the stock backend finds a name by a linear scan of the list); and the sidecar's
side (the time to render a generation, its files, its inotify watches, its bytes on disk).

Usage: python -m benchmarks.name_cost [--names 32,1000,4000] [--requests 100]
Needs the engine environment (make engine-env, or LORA_ENGINE_VENV) and the stock backend.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import timeit
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from benchmarks.engine_bench import engine_bench
from tests.engine.harness import EngineAssets
from tests.engine.node import EngineNode, start_node


@dataclass
class Row:
    names: int
    load_s: float
    memory_bytes: int
    request_p50_s: float
    request_p90_s: float
    render_s: float
    files: int
    watches: int
    catalog_bytes: int
    catalog_file_bytes: int


def render_seconds(node: EngineNode) -> float:
    """From the sidecar's start to its first generation rendered (its log)."""
    times = {}
    for line in node.sidecar.log_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("event") == "cache_locked" and "start" not in times:
            times["start"] = datetime.fromisoformat(entry["ts"]).timestamp()
        if entry.get("event") == "rendered" and "rendered" not in times:
            times["rendered"] = datetime.fromisoformat(entry["ts"]).timestamp()
    return times.get("rendered", 0.0) - times.get("start", 0.0)


def measure(names: int, requests: int, work: Path, moto_url: str, backend: Path,
            assets: EngineAssets) -> Row:
    print(f"{names} names: starting a node", flush=True)
    node = start_node(assets, work / f"n{names}", moto_url, backend,
                      adapters={"steady": assets.adapter("tenant-0")},
                      sidecar_args=["--log-format", "json", "--spare-names", str(names),
                                    "--spare-names-max", str(max(names, 1))])
    try:
        memory = node.sample_memory()
        # The adapter gets a spare at a random place in the list; the backend's scan of the
        # whole list is timed on its own below.
        expected = assets.text("tenant-0")
        assert node.ask("steady") == expected
        timings = []
        for _ in range(requests):
            started = time.perf_counter()
            assert node.ask("steady") == expected
            timings.append(time.perf_counter() - started)
        catalog = node.sidecar_json("/catalog")
        files = sum(len(f) + len(d) for _, d, f in os.walk(node.cache_root / "catalog"))
        return Row(names, node.engine_load_s, memory, statistics.median(timings),
                   sorted(timings)[int(0.9 * len(timings))], render_seconds(node), files,
                   catalog["disk"]["watched_noops"], catalog["disk"]["catalog_bytes"],
                   (node.cache_root / "multi_lora.json").stat().st_size)
    finally:
        node.stop()


def scan_cost(names: int) -> float:
    """Seconds the stock backend's `supported_loras.index(name)` takes for the last name."""
    listed = [f"_spare-g1-{n:04d}" for n in range(names)]
    last = listed[-1]
    runs = 2000
    return timeit.timeit(lambda: listed.index(last), number=runs) / runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", default="32,1000,4000",
                        help="spare names per run, comma-separated (default 32,1000,4000)")
    parser.add_argument("--requests", type=int, default=100,
                        help="router requests timed per run (default 100)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.names.split(",")]
    rows = []
    with engine_bench() as bench, tempfile.TemporaryDirectory(prefix="name-cost-") as scratch:
        for count in counts:
            rows.append(measure(count, args.requests, Path(scratch), bench.moto_url,
                                bench.backend, bench.assets))
    print()
    print("What a catalogued name costs: vLLM 0.13 on CPU behind the stock backend (tiny "
          "Llama), one adapter served through a spare name")
    header = ("names", "engine load s", "memory (Triton + sidecar)", "request p50 / p90 s",
              "backend scan of the last name", "render s", "catalog files", "watches",
              "catalog bytes", "multi_lora.json bytes")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print(f"| {row.names} | {row.load_s:.1f} | {row.memory_bytes / 2**30:.2f} GiB | "
              f"{row.request_p50_s:.3f} / {row.request_p90_s:.3f} | "
              f"{scan_cost(row.names) * 1e6:.1f} µs | {row.render_s:.2f} | {row.files} | "
              f"{row.watches} | {row.catalog_bytes} | {row.catalog_file_bytes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
