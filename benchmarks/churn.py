"""The ordinary day, measured: Zipf traffic through the router (vLLM on CPU behind the stock
Triton backend, the engine tier's node) over a registry of adapters, with the disk budget at a
quarter of the registry against a budget everything fits in, side by side in one run, and a
registry of 100+ adapters of mixed ranks with the disk at a quarter of its bytes. Each phase
starts a fresh node on an empty volume and runs the same traffic for the same time.

The quarter-disk and mixed phases run once per eviction policy (`--policies`, default LRU
against the default aged LFU), side by side; everything fitting needs no policy and runs once.

Usage: python -m benchmarks.churn [--adapters 24] [--mixed 120] [--seconds 600] [--clients 4]
       [--phases quarter,fits,mixed] [--quick]
Needs the engine environment (make engine-env, or LORA_ENGINE_VENV) and the stock backend
(TRITON_VLLM_BACKEND_DIR, ../shared/vendor/vllm_backend, or a clone of its tag).
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.engine_bench import CACHE, engine_bench, markdown_table
from sidecar.validation.files import FETCHED_FILES
from tests.engine.harness import MAX_LORA_RANK, EngineAssets, Reference
from tests.engine.node import EngineNode, start_node
from tests.engine.surgery import variant, with_rank
from tests.engine.traffic import Clients, DiskSampler, summary

# The mixed phase's ranks, in turn down the popularity order: every rank at every popularity.
MIXED_RANKS = (4, 8, 16)  # up to the engine's max_lora_rank (harness.MAX_LORA_RANK)
REFERENCE_BATCH = 40  # adapters per reference worker (each worker has its own time limit)


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
    downloaded: float  # bytes from the registry
    load: tuple[tuple[float, float, float], tuple[float, float, float]]  # start, end


def metrics(node: EngineNode) -> dict[str, float]:
    with urllib.request.urlopen(node.sidecar.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lora_sidecar_") and " " in line:
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def load_line(load: tuple[float, float, float]) -> str:
    return " ".join(f"{v:.2f}" for v in load)


def run_phase(phase: str, name: str, max_adapters: int, folders: dict[str, Path],
              texts: dict[str, str], work: Path, moto_url: str, backend: Path,
              assets: EngineAssets, seconds: float, clients: int, budget_bytes: int,
              policy: str) -> Result:
    print(f"phase: {name} (--max-adapters {max_adapters}, --max-bytes {budget_bytes}, "
          f"--eviction-policy {policy}), starting a node", flush=True)
    # A plain folder name: Triton's Python stub is started through a shell.
    node = start_node(assets, work / f"{phase}-{policy}", moto_url, backend,
                      adapters=folders,
                      sidecar_args=["--max-adapters", str(max_adapters),
                                    "--max-bytes", str(budget_bytes),
                                    "--eviction-policy", policy])
    try:
        before = metrics(node)
        order = list(folders)
        sampler = DiskSampler(node.cache_root).start()
        load_start = os.getloadavg()
        print(f"  {time.strftime('%H:%M:%S', time.gmtime())} UTC traffic for {seconds:g} s, "
              f"load average {load_line(load_start)}", flush=True)
        traffic = Clients(node, lambda: order, clients).start()
        started = time.monotonic()
        time.sleep(seconds)
        answers = traffic.stop()
        elapsed = time.monotonic() - started
        load_end = os.getloadavg()
        print(f"  {time.strftime('%H:%M:%S', time.gmtime())} UTC traffic done, "
              f"{len(answers)} requests, load average {load_line(load_end)}", flush=True)
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
        Counter((a.error or "")[:160] for a in answers if a.error is not None),
        delta("lora_sidecar_download_bytes_total"), (load_start, load_end))


def table(results: list[Result]) -> str:
    rows = [("disk budget", "policy", "requests", "req/s", "p50 s", "p99 s", "failed", "wrong",
             "reloads", "stage hits / misses (hit ratio)",
             "names bound / parked / returned / burnt", "adapter bytes max / budget",
             "bytes downloaded", "load 1/5/15 min, start / end")]
    for r in results:
        f = r.figures
        hits, misses = r.stages
        ratio = hits / (hits + misses) if hits + misses else 0.0
        rows.append((
            f"{r.name} ({r.max_adapters})", r.policy, f"{f['requests']:.0f}",
            f"{f['per_s']:.1f}", f"{f['p50_s']:.3f}", f"{f['p99_s']:.3f}", f"{f['failed']:.0f}",
            str(r.wrong), f"{r.reloads:.0f}", f"{hits:.0f} / {misses:.0f} ({ratio:.2f})",
            " / ".join(f"{r.names[c]:.0f}" for c in ("bound", "parked", "returned", "burnt")),
            f"{r.max_adapter_bytes} / {r.budget_bytes}", f"{r.downloaded:.0f}",
            f"{load_line(r.load[0])} / {load_line(r.load[1])}"))
    return markdown_table(rows)


def references(assets: EngineAssets, folders: dict[str, Path]) -> dict[str, str]:
    """The reference text of every adapter, in batches (each worker has its own time limit);
    kept by content, so a rerun costs nothing."""
    names = list(folders)
    found: dict[str, Reference] = {}
    for at in range(0, len(names), REFERENCE_BATCH):
        found.update(assets.references({n: folders[n] for n in names[at:at + REFERENCE_BATCH]}))
    unfit = [name for name, ref in found.items() if not ref.fits or ref.text is None]
    if unfit:
        raise SystemExit(f"adapters without a reference text: {unfit[:5]}: "
                         f"{found[unfit[0]].reason}")
    return {name: ref.text or "" for name, ref in found.items()}


def folder_bytes(folder: Path, only: tuple[str, ...] | None = None) -> int:
    """The bytes of an adapter folder's files (or of `only` these names)."""
    return sum(p.stat().st_size for p in folder.iterdir() if only is None or p.name in only)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=24,
                        help="registry size of the quarter and fits phases (default 24)")
    parser.add_argument("--mixed", type=int, default=120,
                        help="registry size of the mixed phase: adapters of ranks "
                             f"{', '.join(map(str, MIXED_RANKS))} in turn (at most the "
                             f"engine's max_lora_rank, {MAX_LORA_RANK}), the disk at a quarter "
                             "of their bytes (default 120)")
    parser.add_argument("--phases", default=None,
                        help="which phases, in order: quarter, fits, mixed (default all three; "
                             "quarter with --quick)")
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="traffic per phase (default 600)")
    parser.add_argument("--clients", type=int, default=4, help="gRPC clients (default 4)")
    parser.add_argument("--policies", default="lru,lfu",
                        help="eviction policies of the quarter and mixed phases, side by side "
                             "(default lru,lfu)")
    parser.add_argument("--quick", action="store_true",
                        help="60 s per phase and the quarter phase only (unless --phases names "
                             "others): the policies side by side in a few minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 60.0)
    phase_names = [p.strip() for p in
                   (args.phases or ("quarter" if args.quick else "quarter,fits,mixed")).split(",")
                   if p.strip()]
    unknown = sorted(set(phase_names) - {"quarter", "fits", "mixed"})
    if unknown:
        parser.error(f"--phases: unknown {', '.join(unknown)} (quarter, fits, mixed)")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = []
    # Kept (git-ignored) with the nodes' logs, to look into what failed.
    work = CACHE.parent / "churn" / time.strftime("%Y%m%dT%H%M%S")
    work.mkdir(parents=True)
    print(f"nodes' folders and logs: {work}", flush=True)
    distinct = ""
    with engine_bench() as bench:
        assets = bench.assets
        registries: dict[str, dict[str, Path]] = {}
        made = work / "registry"  # the adapters' folders, as uploaded
        if {"quarter", "fits"} & set(phase_names):
            registries["quarter"] = registries["fits"] = {
                f"bench-{n:03d}": variant(assets.adapter(f"tenant-{n % 4}"), made / f"v{n}",
                                          lora_alpha=1.0 + 0.75 * n)
                for n in range(args.adapters)}
        if "mixed" in phase_names:
            registries["mixed"] = {
                f"mixed-{n:03d}": with_rank(assets.adapter(f"tenant-{n % 4}"), made / f"m{n}",
                                            MIXED_RANKS[n % len(MIXED_RANKS)], seed=1000 + n)
                for n in range(args.mixed)}
        texts: dict[str, str] = {}
        for folders in registries.values():
            if not set(folders) <= set(texts):
                print(f"reference texts of {len(folders)} adapters (transformers + peft)",
                      flush=True)
                texts.update(references(assets, folders))
                distinct += (f"{len(folders)} adapters, {len(set(texts[n] for n in folders))} "
                             "distinct reference texts; ")
        for phase in phase_names:
            folders = registries[phase]
            if phase == "mixed":
                # The bytes the sidecar keeps: PEFT's README.md beside each is never fetched.
                name = "a quarter of the registry's bytes, mixed ranks"
                count = len(folders)
                budget = sum(folder_bytes(f, FETCHED_FILES) for f in folders.values()) // 4
            else:
                name, count = (("a quarter of the registry", max(1, len(folders) // 4))
                               if phase == "quarter" else ("everything fits", len(folders)))
                budget = count * max(folder_bytes(f) for f in folders.values())
            for policy in policies if phase != "fits" else policies[-1:]:
                results.append(run_phase(phase, name, count, folders, texts, work,
                                         bench.moto_url, bench.backend, assets, args.seconds,
                                         args.clients, budget, policy))
                # Each row as its phase ends: a long run cut short keeps what it measured.
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"Zipf (s=1.1) traffic through the router, {args.clients} gRPC clients without "
          f"retries, {args.adapters} adapters in the registry ({args.mixed} of ranks "
          f"{', '.join(map(str, MIXED_RANKS))} in the mixed phase), {args.seconds:g} s per "
          f"phase; vLLM 0.13 on CPU (tiny Llama); {distinct}load averages from os.getloadavg()")
    print(table(results))
    for result in results:
        for error, count in result.errors.most_common(5):
            print(f"{result.name} ({result.policy}): {count} x {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
