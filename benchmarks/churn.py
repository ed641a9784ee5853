"""The ordinary day, measured: Zipf traffic through the router (vLLM on CPU behind the stock
Triton backend, the engine tier's node) over a registry of adapters, with the disk budget at a
quarter of the registry against a budget everything fits in, side by side in one run. Each
phase starts a fresh node on an empty volume and runs the same traffic for the same time.

The quarter-disk phase runs once per eviction policy (`--policies`, default LRU against the
default aged LFU), side by side; everything fitting needs no policy and runs once.

Usage: python -m benchmarks.churn [--adapters 24] [--seconds 600] [--clients 4] [--quick]
Needs the engine environment (make engine-env, or LORA_ENGINE_VENV) and the stock backend
(TRITON_VLLM_BACKEND_DIR, ../shared/vendor/vllm_backend, or a clone of its tag).
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_bench import CACHE, engine_bench, markdown_table
from tests.engine.harness import EngineAssets
from tests.engine.node import EngineNode, start_node
from tests.engine.surgery import variant
from tests.engine.traffic import Clients, DiskSampler, summary


@dataclass
class Result:
    name: str
    max_adapters: int
    policy: str
    seconds: float
    figures: dict[str, float]
    wrong: int
    reloads: float
    stages: tuple[float, float]  # hits, misses
    names: dict[str, float]
    max_adapter_bytes: int
    budget_bytes: int
    errors: Counter[str]


def metrics(node: EngineNode) -> dict[str, float]:
    with urllib.request.urlopen(node.sidecar.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lora_sidecar_") and " " in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def run_phase(name: str, max_adapters: int, folders: dict[str, Path], texts: dict[str, str],
              work: Path, moto_url: str, backend: Path, assets: EngineAssets, seconds: float,
              clients: int, budget_bytes: int, policy: str) -> Result:
    print(f"phase: {name} (--max-adapters {max_adapters}, --eviction-policy {policy}), "
          "starting a node", flush=True)
    node = start_node(assets, work / f"{name}-{policy}".replace(" ", "-"), moto_url, backend,
                      adapters=folders,
                      sidecar_args=["--max-adapters", str(max_adapters),
                                    "--max-bytes", str(budget_bytes),
                                    "--eviction-policy", policy])
    try:
        before = metrics(node)
        order = list(folders)
        sampler = DiskSampler(node.cache_root).start()
        traffic = Clients(node, lambda: order, clients).start()
        started = time.monotonic()
        time.sleep(seconds)
        answers = traffic.stop()
        elapsed = time.monotonic() - started
        sampler.stop()
        after = metrics(node)
    finally:
        node.stop()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    return Result(
        name, max_adapters, policy, elapsed, summary(answers, elapsed),
        sum(1 for a in answers if a.error is None and a.text != texts[a.adapter_id]),
        delta('lora_sidecar_triton_reloads_total{outcome="ok"}'),
        (delta('lora_sidecar_stage_requests_total{result="hit"}'),
         delta('lora_sidecar_stage_requests_total{result="miss"}')),
        {c: delta(f'lora_sidecar_catalog_name_changes_total{{change="{c}"}}')
         for c in ("bound", "parked", "returned", "burnt")},
        max(sampler.adapter_bytes, default=0), budget_bytes,
        Counter((a.error or "")[:160] for a in answers if a.error is not None))


def table(results: list[Result]) -> str:
    rows = [("disk budget", "policy", "requests", "req/s", "p50 s", "p99 s", "failed", "wrong",
             "reloads", "stage hits / misses (hit ratio)",
             "names bound / parked / returned / burnt", "adapter bytes max / budget")]
    for r in results:
        f = r.figures
        hits, misses = r.stages
        ratio = hits / (hits + misses) if hits + misses else 0.0
        rows.append((
            f"{r.name} ({r.max_adapters})", r.policy, f"{f['requests']:.0f}",
            f"{f['per_s']:.1f}", f"{f['p50_s']:.3f}", f"{f['p99_s']:.3f}", f"{f['failed']:.0f}",
            str(r.wrong), f"{r.reloads:.0f}", f"{hits:.0f} / {misses:.0f} ({ratio:.2f})",
            " / ".join(f"{r.names[c]:.0f}" for c in ("bound", "parked", "returned", "burnt")),
            f"{r.max_adapter_bytes} / {r.budget_bytes}"))
    return markdown_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=24, help="registry size (default 24)")
    parser.add_argument("--phases", default="quarter,fits",
                        help="which phases, in order: quarter, fits (default both)")
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="traffic per phase (default 600)")
    parser.add_argument("--clients", type=int, default=4, help="gRPC clients (default 4)")
    parser.add_argument("--policies", default="lru,lfu",
                        help="eviction policies of the quarter phase, side by side (default "
                             "lru,lfu)")
    parser.add_argument("--quick", action="store_true",
                        help="60 s per phase and the quarter phase only: the policies side by "
                             "side in a few minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.phases = min(args.seconds, 60.0), "quarter"
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = []
    # Kept (git-ignored) with the nodes' logs, to look into what failed.
    work = CACHE.parent / "churn" / time.strftime("%Y%m%dT%H%M%S")
    work.mkdir(parents=True)
    print(f"nodes' folders and logs: {work}", flush=True)
    with engine_bench() as bench:
        assets = bench.assets
        folders = {f"bench-{n:03d}": variant(assets.adapter(f"tenant-{n % 4}"),
                                             work / f"v{n}", lora_alpha=1.0 + 0.75 * n)
                   for n in range(args.adapters)}
        references = assets.references(folders)
        texts = {name: references[name].text or "" for name in folders}
        size = max(sum(p.stat().st_size for p in f.iterdir()) for f in folders.values())
        quarter = max(1, args.adapters // 4)
        phases = {"quarter": ("a quarter of the registry", quarter),
                  "fits": ("everything fits", args.adapters)}
        for phase in args.phases.split(","):
            name, count = phases[phase]
            for policy in policies if phase == "quarter" else policies[-1:]:
                results.append(run_phase(name, count, folders, texts, work, bench.moto_url,
                                         bench.backend, assets, args.seconds, args.clients,
                                         count * size, policy))
    print()
    print(f"Zipf (s=1.1) traffic through the router, {args.clients} gRPC clients without "
          f"retries, {args.adapters} adapters in the registry, {args.seconds:g} s per phase; "
          "vLLM 0.13 on CPU (tiny Llama)")
    print(table(results))
    for result in results:
        for error, count in result.errors.most_common(5):
            print(f"{result.name}: {count} x {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
