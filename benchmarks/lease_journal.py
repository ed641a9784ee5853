"""The lease journal's compaction and read-back: what a merge (in a thread, holding the GIL for
most of it) and a restart's `load()` cost per journal line, for leases released as the router
releases them and for leases nobody releases (past --max-leases the cap ends the oldest, and
a merge is due once four times the live leases' bytes were appended). Every grant's line is
read once by a merge, so a merge's cost per line is part of a hit's cost.

    .venv/bin/python -m benchmarks.lease_journal
    .venv/bin/python -m benchmarks.lease_journal --compare before=/tmp/old-checkout
    .venv/bin/python -m benchmarks.lease_journal --quick     # small journals (run.sh --quick)

Each checkout's own `sidecar.cache.lease_journal` writes the journal (untimed) and then merges
it and reads it back in a process of its own; figures are process CPU seconds, the median of
--runs.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from .servers import checkout_cases_parser, compared_checkouts, holding, run_in_checkout

REPO = Path(__file__).resolve().parent.parent

# One case in a process: write the journal with this checkout's code, then time a merge and a
# restart's read-back of the same files (the read-back first: the merge replaces them).
_CASE = r"""
import json, os, sys, time
from pathlib import Path
from sidecar.cache.lease_journal import LeaseJournal, lease_digest

folder, grants, live = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
released = sys.argv[4] == "1"
journal = LeaseJournal(folder / ".leases", max_leases=live, boot_id="bench")
journal.reset([])
unix, mono = time.time(), time.monotonic()
for i in range(grants):
    digest = lease_digest(f"lease-{i}")
    journal.granted(digest, f"tenant-{i % 50}-adapter", 300.0, unix, mono)
    if released:
        journal.ended(digest)
journal.flush()
journal.close()
lines = sum(1 for _ in open(folder / ".leases")) - 1
reader = LeaseJournal(folder / ".leases", max_leases=live, boot_id="bench")
started = time.process_time()
kept = len(reader.load(600.0))
load_s = time.process_time() - started
assert journal.begin_compaction()
started = time.process_time()
journal.merge()
merge_s = time.process_time() - started
print(json.dumps({"lines": lines, "kept": kept, "load_s": load_s, "merge_s": merge_s}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = checkout_cases_parser("lease_journal", __doc__, quick="journals 20x smaller, one run",
                                   dest=Path("/dev/shm/lsbench-leases"), writes="journals")
    parser.add_argument("--runs", type=int, default=3, help="processes per cell (3)")
    args = parser.parse_args(argv)
    scale = 20 if args.quick else 1
    runs = 1 if args.quick else args.runs
    live = 100_000 // scale  # --max-leases' default
    cases = [  # (what, grants, live leases at most, released)
        (f"{200_000 // scale:,} leases, each released", 200_000 // scale, live, True),
        # The first merge at the cap is due after 4 x (live leases' lines) were appended.
        (f"{400_000 // scale:,} leases, none released (cap {live:,})", 400_000 // scale, live,
         False),
    ]
    sources = [("this checkout", REPO), *compared_checkouts(args.compare)]
    with holding(args.dest):
        print(f"Median of {runs} process(es) per cell; CPU seconds of the merge (a thread of "
              "the sidecar) and of a restart's read-back of the same files\n")
        print("| journal | checkout | lines | merge CPU s | µs per line | read-back CPU s |")
        print("|---|---|---:|---:|---:|---:|")
        for what, grants, cap, released in cases:
            for label, source in sources:
                results = [run_in_checkout(source, _CASE, str(args.dest / "journal"),
                                           str(grants), str(cap), "1" if released else "0",
                                           folder=args.dest / "journal")
                           for _ in range(runs)]
                lines = results[0]["lines"]
                merge = statistics.median(r["merge_s"] for r in results)
                load = statistics.median(r["load_s"] for r in results)
                print(f"| {what} | {label} | {lines:,} | {merge:.3f} | "
                      f"{merge / lines * 1e6:.2f} | {load:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
