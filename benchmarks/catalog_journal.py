"""What naming a new adapter costs the event loop when the catalog lists many spare names:
a real sidecar (in process, local registry, tmpfs) stages a new adapter, which binds a spare
and saves the catalog's journal, then evicts it (its name is parked, the journal saved again),
round after round (at most half the spares: none runs out); the loop's time in the journal's
encoding and in picking the spare is timed per call.

    .venv/bin/python -m benchmarks.catalog_journal
    .venv/bin/python -m benchmarks.catalog_journal --compare before=/tmp/old-checkout
    .venv/bin/python -m benchmarks.catalog_journal --quick      # 32 and 512 spares, few rounds

Each checkout runs in a process of its own with its own sidecar package (the measurement wraps
`catalog.disk.catalog_journal_bytes` and `Catalog._pick`, which both have).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .servers import checkout_cases_parser, compared_checkouts, holding, run_in_checkout

REPO = Path(__file__).resolve().parent.parent

_CASE = r"""
import asyncio, json, shutil, sys, time
from pathlib import Path
from prometheus_client import CollectorRegistry
from sidecar.catalog import catalog as catalog_module
from sidecar.config import Settings
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import ATTENTION_MODULES, TINY_LLAMA

folder, spares, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
timed = {"encode": [], "pick": []}

def timing(key, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timed[key].append(time.perf_counter() - started)
    return wrapper

disk = catalog_module.disk
disk.catalog_journal_bytes = timing("encode", disk.catalog_journal_bytes)
catalog_module.Catalog._pick = timing("pick", catalog_module.Catalog._pick)

async def main():
    for number in range(rounds + 3):  # a new adapter each round: each binds a spare
        write_adapter(folder / "registry" / f"bench-{number}", rank=16,
                      target_modules=ATTENTION_MODULES, shapes=TINY_LLAMA, dtype="bfloat16",
                      seed=number)
    (folder / "base.json").write_text(json.dumps(TINY_LLAMA.to_config()))
    settings = Settings.from_values({
        "registry": str(folder / "registry"), "cache_root": str(folder / "cache"),
        "port": "0", "min_free_bytes": "0", "upload_settle_s": "0",
        "base_model_config": str(folder / "base.json"), "spare_names": str(spares),
        "spare_names_max": str(max(spares, 1)), "catalog_refresh_s": "3600"})
    sidecar = Sidecar(settings, CollectorRegistry())
    await sidecar.start()
    stages = []
    try:
        for number in range(rounds + 3):
            for values in timed.values():
                if number < 3:
                    values.clear()  # the first rounds warm up
            started = time.perf_counter()
            await sidecar.naming.stage(f"bench-{number}", timeout_s=60, lease=False)
            if number >= 3:
                stages.append(time.perf_counter() - started)
            sidecar.store.evict(f"bench-{number}", force=True)
            await sidecar.store.settle_trash()
            await asyncio.sleep(0.01)
    finally:
        await sidecar.stop()
    print(json.dumps({
        "stage_ms": 1000 * sorted(stages)[len(stages) // 2],
        "encode_ms": 1000 * sorted(timed["encode"])[len(timed["encode"]) // 2],
        "encodes": len(timed["encode"]),
        "pick_ms": 1000 * sorted(timed["pick"])[len(timed["pick"]) // 2] if timed["pick"] else 0.0,
        "journal_kb": (folder / "cache" / "catalog" / "journal.json").stat().st_size / 1024}))

asyncio.run(main())
"""


def main(argv: list[str] | None = None) -> int:
    parser = checkout_cases_parser("catalog_journal", __doc__, quick="32 and 512 spares, 10 rounds",
                                   dest=Path("/dev/shm/lsbench-catalog"), writes="caches")
    parser.add_argument("--rounds", type=int, default=60, help="stages per cell (60)")
    parser.add_argument("--spares", default="32,1000,4096",
                        help="spare names per generation, comma-separated (32,1000,4096)")
    args = parser.parse_args(argv)
    spare_counts = [32, 512] if args.quick else [int(n) for n in args.spares.split(",")]
    rounds = 10 if args.quick else args.rounds
    sources = [("this checkout", REPO), *compared_checkouts(args.compare)]
    with holding(args.dest):
        print(f"Medians over up to {rounds} stages of new adapters, each evicted after (its "
              "name parked), a spare bound at each stage; ms of the event loop per call\n")
        print("| spares | checkout | stage ms | journal KiB | journal encoding ms | "
              "picking a spare ms |")
        print("|---:|---|---:|---:|---:|---:|")
        for spares in spare_counts:
            for label, source in sources:
                r = run_in_checkout(source, _CASE, str(args.dest / "case"), str(spares),
                                    str(min(rounds, spares // 2 - 3)),
                                    folder=args.dest / "case")
                print(f"| {spares:,} | {label} | {r['stage_ms']:.2f} | {r['journal_kb']:.0f} | "
                      f"{r['encode_ms']:.3f} | {r['pick_ms']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
