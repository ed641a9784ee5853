"""One command, one table: cold stages against the alternatives (loopback s3rver, moto, and a
shaped link), the hit path against a bare aiohttp handler, and the sidecar's peak memory.

Run it as `benchmarks/run.sh [--quick]` (root: the shaped link needs network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from . import adapters as adapters_mod
from . import hitpath, link, miss
from .adapters import Adapter
from .clients import (
    Boto3Stager,
    CommandStager,
    CrtStager,
    SidecarStager,
    Stager,
    aws_cli,
    s3_client,
    s5cmd,
    tuned_boto3,
)
from .options import parse_args
from .servers import (
    S3Server,
    Supervisor,
    free_port,
    holding,
    launch_moto,
    s3_env,
    start_s3rver,
    wait_for_moto,
    wait_for_port,
)
from .tools import Tools, ensure_tools

REPO = Path(__file__).resolve().parent.parent
SHAPED_MBIT = 200
SHAPED_DELAY_MS = 20
HIT_CLIENTS = (1, 8, 64)
# --quick: the other benchmarks that need no engine, each in a small mode, after the table;
# (title, arguments of `python -m`). A benchmark's breakage fails the quick run.
# The routing simulator counts simulated hits (no clock): it runs beside the set-up.
# The eviction policies' curves go to a file of this run's own, not the README's image.
POLICY_SVG = Path(tempfile.gettempdir()) / f"lsbench-policy-curves-{os.getpid()}.svg"
QUICK_SIMULATED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("routing simulator", ("benchmarks.routing_sim", "--nodes", "4", "--cache", "10",
                           "--requests", "2000")),
    ("eviction policies", ("benchmarks.policy", "--quick", "--requests", "3000", "--seeds", "1",
                           "--svg", str(POLICY_SVG))),
)
QUICK_TIMED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("restart cost", ("benchmarks.restart", "--adapters", "2", "--size-mb", "2", "--runs", "1")),
    ("warm restart", ("benchmarks.warm_restart", "--adapters", "5", "--runs", "1")),
    ("lease journal", ("benchmarks.lease_journal", "--quick")),
    ("catalog journal", ("benchmarks.catalog_journal", "--quick")),
    ("hit path with tenants", ("benchmarks.hitpath", "--rounds", "1", "--seconds", "1",
                               "--clients", "8", "--tenants", "100")),
)
# --quick on moto and the shaped link: the clients whose every fetch starts a process of its
# own (seconds each on a loaded machine) run on loopback s3rver only.
QUICK_LOOPBACK_ONLY = frozenset({"aws s3 cp", "awscrt + the sidecar's checks"})
# The engine's benchmarks need vLLM and Triton (minutes each): --quick imports them and
# parses their options, which catches a moved name or a broken option.
ENGINE_BENCHMARKS = ("churn", "name_cost", "new_adapter", "triton_faults", "router_overhead",
                     "router_cold_stall")


@dataclass
class Results:
    machine: dict[str, Any] = field(default_factory=dict)
    # phase -> adapter label -> stager name -> seconds of each run
    cold: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    # the same, CPU seconds the client used during each run
    cold_cpu: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    ceiling_mb_s: dict[str, float] = field(default_factory=dict)
    hit: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    miss: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Context:
    args: argparse.Namespace
    tools: Tools
    sup: Supervisor
    work: Path
    dest: Path
    env: dict[str, str]
    adapters: list[Adapter]
    signing_policy: Path | None = None  # --signing: the policy of 'sidecar (signing on)'
    # what the untimed warm-up fetches: --quick, the small adapter of the miss phase (imports
    # and connections warmed without the seconds of a large fetch on a slow server)
    warm_up: Adapter | None = None
    skip_clients: frozenset[str] = frozenset()  # --quick on the slow servers
    moto: S3Server | None = None  # started beside the set-up, when a phase needs it


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed_fetch(stager: Stager, adapter: Adapter) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the client) of one cold fetch, checked and undone."""
    cpu_before = stager.cpu_s()
    started = time.perf_counter()
    folder = stager.fetch(adapter.adapter_id)
    elapsed = time.perf_counter() - started
    cpu = stager.cpu_s() - cpu_before
    adapters_mod.verify(adapter, folder)
    stager.reset(adapter.adapter_id)
    return elapsed, cpu


def run_cold(
    ctx: Context, phase: str, stagers: list[Stager], results: Results, runs: int
) -> None:
    """Rounds of every adapter by every stager, the order rotated each round."""
    table = results.cold.setdefault(phase, {})
    cpu_table = results.cold_cpu.setdefault(phase, {})
    warm_up = ctx.warm_up or ctx.adapters[0]
    for stager in stagers:  # warm-up, untimed: imports, connections, page cache
        if ctx.args.quick and isinstance(stager, CommandStager):
            continue  # a new process each fetch: --quick leaves it nothing worth warming
        stager.reset(warm_up.adapter_id)
        timed_fetch(stager, warm_up)
        stager.reset(warm_up.adapter_id)
    for round_index in range(runs):
        for adapter in ctx.adapters:
            shift = round_index % len(stagers)
            for stager in stagers[shift:] + stagers[:shift]:
                seconds, cpu = timed_fetch(stager, adapter)
                table.setdefault(adapter.label, {}).setdefault(stager.name, []).append(seconds)
                cpu_table.setdefault(adapter.label, {}).setdefault(stager.name, []).append(cpu)
                log(f"{phase}: {adapter.label} {stager.name}: {seconds:.2f} s, CPU {cpu:.2f} s")


def curl_ceiling(ctx: Context, server: S3Server, limit_bytes: int | None) -> float:
    """Median MB/s of one plain GET of the largest object (or its first `limit_bytes`) to
    /dev/null."""
    biggest = ctx.adapters[-1]
    key = f"{adapters_mod.PREFIX}/{biggest.adapter_id}/adapter_model.safetensors"
    url = s3_client(server.endpoint_url).generate_presigned_url(
        "get_object", Params={"Bucket": adapters_mod.BUCKET, "Key": key}, ExpiresIn=3600)
    speeds = []
    for _ in range(max(ctx.args.runs, 1)):
        done = subprocess.run(
            [ctx.tools.curl, "-sSf", "-o", "/dev/null", "-w", "%{size_download} %{time_total}",
             *(["-r", f"0-{limit_bytes - 1}"] if limit_bytes else []), url],
            capture_output=True, text=True, check=True)
        size, seconds = done.stdout.split()
        speeds.append(int(size) / float(seconds) / 1e6)
    return statistics.median(speeds)


def alternatives(ctx: Context, server: S3Server) -> list[Stager]:
    dest = ctx.dest / server.label
    every: list[Stager] = [
        Boto3Stager("reference (boto3)", server, dest / "reference"),
        tuned_boto3(server, dest / "tuned"),
        aws_cli(ctx.tools.aws, server, ctx.env, dest / "aws"),
        s5cmd(ctx.tools.s5cmd, server, ctx.env, dest / "s5cmd"),
        s5cmd(ctx.tools.s5cmd, server, ctx.env, dest / "s5cmd-tuned", tuned=True),
        CrtStager(ctx.tools.crt_python, server, ctx.env, dest / "awscrt",
                  {a.adapter_id: [(f"{adapters_mod.PREFIX}/{a.adapter_id}/{p.name}",
                                   p.stat().st_size) for p in a.files()]
                   for a in ctx.adapters}),
    ]
    return [stager for stager in every if stager.name not in ctx.skip_clients]


def start_sidecar(ctx: Context, server: S3Server, source: Path | None = None,
                  label: str | None = None, extra_args: tuple[str, ...] = ()) -> SidecarStager:
    """The sidecar of this checkout, of `--sidecar-src`, or of `source` (a compared one)."""
    env = dict(ctx.env)
    source = source or ctx.args.sidecar_src
    if source is None:
        command = [str(REPO / ".venv" / "bin" / "lora-sidecar")]
    else:  # another checkout's package, run with this venv's dependencies
        command = [sys.executable, "-P", "-m", "sidecar"]  # -P: not this folder's copy
        env["PYTHONPATH"] = str(source.resolve())
    name = "sidecar" if label is None else f"sidecar ({label})"
    cache = ctx.dest / ("sidecar-cache" if label is None else f"sidecar-cache-{label}")
    return SidecarStager(ctx.sup, command, server, cache, env,
                         (*ctx.args.sidecar_arg, *extra_args), name=name)


def compared_sidecars(ctx: Context, server: S3Server) -> list[SidecarStager]:
    """One sidecar per `--compare LABEL=PATH`, staged in the same rounds as this one."""
    stagers = []
    for spec in ctx.args.compare:
        label, _, path = spec.partition("=")
        stagers.append(start_sidecar(ctx, server, Path(path), label))
    if ctx.signing_policy is not None:
        stagers.append(start_sidecar(ctx, server, label="signing on", extra_args=(
            "--signing-policy", str(ctx.signing_policy))))
    return stagers


def cold_phase(
    ctx: Context, phase: str, server: S3Server, results: Results, *, runs: int,
    ceiling_bytes: int | None = None, sidecar: SidecarStager | None = None,
) -> None:
    """`sidecar`: this checkout's, started on `server` by the caller and left running (shared
    with the phases after); None: none (--no-sidecar)."""
    log(f"{phase}: curl ceiling")
    results.ceiling_mb_s[phase] = curl_ceiling(ctx, server, ceiling_bytes)
    if sidecar is None:
        run_cold(ctx, phase, alternatives(ctx, server), results, runs)
        return
    compared = compared_sidecars(ctx, server)
    try:
        others = [] if ctx.args.sidecars_only else alternatives(ctx, server)
        run_cold(ctx, phase, [sidecar, *compared, *others], results, runs)
    finally:
        for stager in compared:
            stager.close()


def read_kib(path: Path, field_name: str) -> int:
    """A `Name:  123 kB` line of /proc/<pid>/status or /proc/meminfo."""
    for line in path.read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def memory_and_hit_phase(ctx: Context, server: S3Server, results: Results) -> None:
    """A fresh sidecar stages the largest adapter (peak RSS), then serves the hit path. A
    sidecar of its own: one that evicted and staged the same adapter again under load saw
    its watcher take the new folder for one removed behind its back (the hit then answered
    503)."""
    biggest = ctx.adapters[-1]
    sidecar = start_sidecar(ctx, server)
    try:
        status = Path(f"/proc/{sidecar.pid}/status")
        idle_kib = read_kib(status, "VmRSS")
        sidecar.fetch(biggest.adapter_id)
        results.memory = {
            "adapter_mb": biggest.size_bytes / 1e6,
            "idle_rss_mb": idle_kib * 1024 / 1e6,
            "peak_rss_mb": read_kib(status, "VmHWM") * 1024 / 1e6,
        }
        log(f"memory: {results.memory}")
        if "hit" in ctx.args.phases:
            hit_phase(ctx, sidecar, biggest, results)
    finally:
        sidecar.close()


def hit_phase(ctx: Context, sidecar: SidecarStager, adapter: Adapter, results: Results) -> None:
    response = sidecar.stage(adapter.adapter_id)
    if not response["cached"]:
        raise RuntimeError("the hit-path adapter is not cached")
    responses = ctx.work / "bare-responses.json"
    responses.write_text(json.dumps({adapter.adapter_id: response}))
    port = free_port()
    bare = ctx.sup.start("bare-aiohttp", [sys.executable, "-m", "benchmarks.bare_server",
                                          str(port), str(responses)])
    try:
        wait_for_port("127.0.0.1", port, bare, "the bare handler")
        hitpath.pin_to_server_cpu(bare.pid)
        hitpath.pin_to_server_cpu(sidecar.pid)
        targets = {"sidecar": (f"http://127.0.0.1:{sidecar.port}", sidecar.pid),
                   "bare aiohttp": (f"http://127.0.0.1:{port}", bare.pid)}
        runs: dict[tuple[str, int], list[hitpath.LoadResult]] = {}
        for repeat in range(ctx.args.hit_runs):
            for clients in HIT_CLIENTS:
                order = list(targets.items())
                if (repeat + clients) % 2:  # neither server always goes first
                    order.reverse()
                for name, (url, pid) in order:
                    result = hitpath.run_wrk(ctx.tools.wrk, url, pid, adapter.adapter_id,
                                             clients, ctx.args.hit_seconds)
                    runs.setdefault((name, clients), []).append(result)
                    log(f"hit: {name} x{clients}: {result}")
        for (name, _), cell in runs.items():
            results.hit.setdefault(name, []).append(asdict(hitpath.median_of(cell)))
    finally:
        ctx.sup.stop(bare)


def miss_phase(ctx: Context, results: Results, moto: S3Server, uploaded: set[str],
               sidecar: SidecarStager) -> None:
    """A small adapter and the largest (--quick: the smallest of the run), staged cold from
    moto (`uploaded`: the ids it holds already; `sidecar`: this checkout's on it, left
    running) and from a local folder, each beside the same listing and ranged GETs made bare
    (benchmarks/miss.py)."""
    small = miss.small_adapter(ctx.work / "adapters")
    chosen = [small, ctx.adapters[0] if ctx.args.quick else ctx.adapters[-1]]
    policy = miss._policy()
    runs = ctx.args.runs if ctx.args.quick else max(ctx.args.runs, 5)
    log("miss: uploading to moto")
    adapters_mod.upload(s3_client(moto.endpoint_url),
                        [a for a in chosen if a.adapter_id not in uploaded])
    bare = miss.BareS3(moto, ctx.dest / "miss-bare-moto", policy)
    try:
        # moto copies the whole object for every ranged GET: the largest adapter gets
        # --moto-runs rounds, as in the moto phase.
        found = miss.measure("moto", sidecar, bare, chosen[:1], runs, log)
        found += miss.measure("moto", sidecar, bare, chosen[1:], ctx.args.moto_runs, log)
    finally:
        bare.close()
    results.miss += [asdict(r) for r in found]
    command = ([str(REPO / ".venv" / "bin" / "lora-sidecar")] if ctx.args.sidecar_src is None
               else [sys.executable, "-P", "-m", "sidecar"])
    env = dict(ctx.env)
    if ctx.args.sidecar_src is not None:
        env["PYTHONPATH"] = str(ctx.args.sidecar_src.resolve())
    local = miss.local_sidecar(ctx.sup, command, ctx.work / "adapters",
                               ctx.dest / "miss-cache-local", env, tuple(ctx.args.sidecar_arg))
    bare_local = miss.BareLocal(ctx.work / "adapters", ctx.dest / "miss-bare-local", policy)
    try:
        found = miss.measure("local folder", local, bare_local, chosen, runs, log)
    finally:
        local.close()
        bare_local.close()
    results.miss += [asdict(r) for r in found]


# ---- report ---------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    mem_kib = read_kib(Path("/proc/meminfo"), "MemTotal")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem_kib * 1024 / 1e9, 1),
            "kernel": os.uname().release, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def render(results: Results, adapters: list[Adapter]) -> str:
    sizes = {a.label: a.size_bytes for a in adapters}
    out = []
    for phase, by_size in results.cold.items():
        ceiling = results.ceiling_mb_s.get(phase)
        out.append(f"\n### Cold stage, {phase}"
                   + (f" (curl, one GET: {ceiling:.0f} MB/s)" if ceiling else ""))
        out.append("\n| adapter | client | median s | MB/s | time / sidecar's | CPU s | "
                   "runs (s) |")
        out.append("|---|---|---:|---:|---:|---:|---|")
        for label, by_stager in by_size.items():
            base = statistics.median(by_stager["sidecar"]) if "sidecar" in by_stager else None
            for name, runs in by_stager.items():
                median = statistics.median(runs)
                cpu = statistics.median(results.cold_cpu[phase][label][name])
                ratio = f"{median / base:.2f}" if base else "-"
                shown = ", ".join(f"{r:.2f}" for r in runs)
                out.append(f"| {label} | {name} | {median:.2f} | "
                           f"{sizes[label] / median / 1e6:.0f} | {ratio} | {cpu:.2f} | {shown} |")
    if results.hit:
        out.append("\n### Hit path: POST /stage on a cached adapter, keep-alive clients "
                   "(median of the runs)")
        out.append("\n| clients | sidecar req/s | bare aiohttp req/s | sidecar / bare | "
                   "sidecar p50 ms | sidecar p99 ms | bare p50 ms | bare p99 ms | "
                   "sidecar CPU µs/req | bare CPU µs/req |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for side, bare in zip(results.hit["sidecar"], results.hit["bare aiohttp"],
                              strict=True):
            out.append(
                f"| {side['clients']} | {side['requests_per_s']:.0f} | "
                f"{bare['requests_per_s']:.0f} | "
                f"{side['requests_per_s'] / bare['requests_per_s']:.0%} | "
                f"{side['p50_ms']:.2f} | {side['p99_ms']:.2f} | {bare['p50_ms']:.2f} | "
                f"{bare['p99_ms']:.2f} | {side['cpu_us_per_request']:.0f} | "
                f"{bare['cpu_us_per_request']:.0f} |")
    if results.miss:
        out.append(miss.render([miss.MissResult(**r) for r in results.miss]))
    if results.memory:
        m = results.memory
        out.append(f"\n### Memory\n\nPeak RSS (VmHWM) of a fresh sidecar staging the "
                   f"{m['adapter_mb']:.0f} MB adapter: **{m['peak_rss_mb']:.0f} MB** "
                   f"(idle: {m['idle_rss_mb']:.0f} MB).")
    facts = results.machine
    out.append(f"\nMachine: {facts['cpu']}, {facts['cores']} cores, {facts['memory_gb']} GB, "
               f"Linux {facts['kernel']}, Python {facts['python']}; {facts['date']}.")
    return "\n".join(out) + "\n"


# ---- main -----------------------------------------------------------------------------


@contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM ends the run through the same `finally` blocks as Ctrl-C."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous: Callable[..., Any] | int | None = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = REPO / "benchmarks" / ".work"
    work.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(work / "logs")
    untimed: list[tuple[str, subprocess.Popen[str]]] = []
    with holding(args.dest):
        try:
            with terminated_as_exit():
                # --quick: what measures no time runs beside the set-up, and is waited for
                # before the first timed phase
                if args.quick:
                    untimed = start_untimed_others()
                # moto imports for seconds: it starts beside the set-up (--quick: the warm
                # restart uses it too)
                moto = (launch_moto(sup) if args.quick or args.phases & {"moto", "miss"}
                        else None)
                report = set_up_and_run(args, work, sup, untimed, moto)
        finally:
            for _, proc in untimed:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            sup.stop_all()
            link.tear_down()
            shutil.rmtree(args.dest, ignore_errors=True)
    print(report)
    return 0


def set_up_and_run(args: argparse.Namespace, work: Path, sup: Supervisor,
                   untimed: list[tuple[str, subprocess.Popen[str]]],
                   moto: S3Server | None) -> str:
    """Tools, adapters, every phase; the report, also kept under work/results."""
    log("installing tools (first run only)")
    tools = ensure_tools(work)
    log("generating adapters (first run only)")
    specs = adapters_mod.QUICK if args.quick else adapters_mod.FULL
    if args.only:
        specs = tuple(s for s in specs if s.adapter_id in args.only.split(","))
    adapters = adapters_mod.generate(specs, work / "adapters")
    policy = adapters_mod.sign(adapters, work / "signing", signing=args.signing)
    adapters = adapters_mod.generate(specs, work / "adapters")  # sizes with model.sig
    shutil.rmtree(args.dest, ignore_errors=True)
    ctx = Context(args, tools, sup, work, args.dest, s3_env(os.environ, work), adapters,
                  policy, miss.small_adapter(work / "adapters") if args.quick else None,
                  moto=moto)
    os.environ.update(ctx.env)  # boto3 in this process reads the same credentials
    results = Results(machine=machine_facts())
    others = ""

    def before_timed() -> None:
        nonlocal others
        others = finish_untimed_others(untimed)

    run_phases(ctx, results, before_timed)
    if args.quick:
        assert moto is not None
        others += quick_timed_others(wait_for_moto(moto), sup.log_dir / "moto.log",
                                     args.dest)
    report = render(results, adapters) + others
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (work / "results").mkdir(exist_ok=True)
    (work / "results" / f"{stamp}.json").write_text(json.dumps(asdict(results), indent=1))
    (work / "results" / f"{stamp}.md").write_text(report)
    return report


def on_slow_server(ctx: Context) -> Context:
    """--quick: the slow servers (moto, the shaped link) stage the smallest adapter only,
    without the clients that start a process per fetch (they run on loopback)."""
    if not ctx.args.quick:
        return ctx
    return replace(ctx, adapters=ctx.adapters[:1], skip_clients=QUICK_LOOPBACK_ONLY)


ENGINE_CHECK = ("import importlib, sys\n"
                f"for name in '{','.join(ENGINE_BENCHMARKS)}'.split(','):\n"
                "    module = importlib.import_module('benchmarks.' + name)\n"
                "    try:\n"
                "        module.main(['--help'])\n"
                "    except SystemExit as done:\n"
                "        assert done.code == 0, (name, done.code)\n")


def start_untimed_others() -> list[tuple[str, subprocess.Popen[str]]]:
    """--quick: the routing simulator and the engine's benchmarks (imported, their options
    parsed), started at once: neither measures time, so they may share the CPU."""
    started = []
    for title, arguments in QUICK_SIMULATED:
        log(f"quick: {title} (beside the set-up)")
        started.append((title, subprocess.Popen(
            [sys.executable, "-m", *arguments], cwd=REPO, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    log("quick: the engine's benchmarks, imported and their options parsed (beside the set-up)")
    started.append(("engine", subprocess.Popen(
        [sys.executable, "-c", ENGINE_CHECK], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    return started


def finish_untimed_others(started: list[tuple[str, subprocess.Popen[str]]]) -> str:
    """Waits for what `start_untimed_others` started (a failure stops the run); their
    tables, for the report."""
    out = []
    for title, proc in started:
        stdout, stderr = proc.communicate(timeout=300)
        for curves in (POLICY_SVG, POLICY_SVG.with_suffix(".png")):
            curves.unlink(missing_ok=True)
        if title == "engine":
            if proc.returncode != 0:
                raise SystemExit(f"an engine benchmark does not import or parse its options:\n"
                                 f"{stderr}")
            out.append(f"\nImported, options parsed: {', '.join(ENGINE_BENCHMARKS)}.")
            continue
        arguments = dict(QUICK_SIMULATED)[title]
        if proc.returncode != 0:
            raise SystemExit(f"benchmark {title} (python -m {' '.join(arguments)}) failed "
                             f"with status {proc.returncode}:\n{stdout}{stderr}")
        out.append(f"\n### {title}: python -m {' '.join(arguments)}\n\n{stdout.strip()}")
    return "\n".join(out) + "\n" if out else ""


def quick_timed_others(moto: S3Server, moto_log: Path, dest: Path) -> str:
    """The restart and lease journal benchmarks in their small modes, one after the other
    once the table's phases are done (a failure stops the run), the warm restart on the run's
    moto (idle by then), the others each in a folder beside `dest` (this run's, not
    another's); their tables, for the report."""
    out = []
    for title, arguments in QUICK_TIMED:
        log(f"quick: {title}")
        shared = (("--moto-url", moto.endpoint_url, "--moto-log", str(moto_log))
                  if arguments[0] == "benchmarks.warm_restart"
                  else ("--dest", f"{dest}-{arguments[0].rsplit('.', 1)[1]}"))
        done = subprocess.run([sys.executable, "-m", *arguments, *shared], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"benchmark {title} (python -m {' '.join(arguments)}) failed "
                             f"with status {done.returncode}:\n{done.stdout}{done.stderr}")
        out.append(f"\n### {title}: python -m {' '.join(arguments)}\n\n{done.stdout.strip()}")
    return "\n".join(out) + "\n"


def run_phases(ctx: Context, results: Results,
               before_timed: Callable[[], None] = lambda: None) -> None:
    """`before_timed`: called once the first server holds the adapters, before anything is
    timed."""
    phases = ctx.args.phases
    data_dir = ctx.work / "s3rver-data"
    s3rver = start_s3rver(ctx.sup, ctx.tools, data_dir, label="s3rver")
    warm_up = [] if ctx.warm_up is None else [ctx.warm_up]
    moto_ctx = on_slow_server(ctx)
    moto_adapters = [*warm_up, *(moto_ctx.adapters if "moto" in phases else [])]
    with ThreadPoolExecutor(2) as pool:  # both uploads before anything is timed
        if phases & {"moto", "miss"}:
            assert ctx.moto is not None
            moto = wait_for_moto(ctx.moto)  # one moto, and one sidecar on it, for both phases
            log("uploading to moto")
            to_moto = pool.submit(adapters_mod.upload, s3_client(moto.endpoint_url),
                                  moto_adapters)
        log("uploading to s3rver")
        adapters_mod.upload(s3_client(s3rver.endpoint_url), [*warm_up, *ctx.adapters])
        if phases & {"moto", "miss"}:
            to_moto.result()
    before_timed()
    if "loopback" in phases:
        sidecar = None if ctx.args.no_sidecar else start_sidecar(ctx, s3rver)
        try:
            cold_phase(ctx, "loopback, s3rver", s3rver, results, runs=ctx.args.runs,
                       sidecar=sidecar)
        finally:
            if sidecar is not None:
                sidecar.close()
    if phases & {"memory", "hit"}:
        memory_and_hit_phase(ctx, s3rver, results)
    ctx.sup.stop(s3rver.proc)
    if phases & {"moto", "miss"}:
        sidecar = None
        try:
            uploaded = {a.adapter_id for a in moto_adapters}
            sidecar = None if ctx.args.no_sidecar else start_sidecar(ctx, moto)
            if "moto" in phases:
                # moto copies the whole object for every ranged GET
                cold_phase(moto_ctx, "loopback, moto", moto, results, runs=ctx.args.moto_runs,
                           sidecar=sidecar)
            if "miss" in phases and sidecar is not None:
                miss_phase(ctx, results, moto, uploaded, sidecar)
        finally:
            if sidecar is not None:
                sidecar.close()
    if "shaped" in phases:
        shaped = link.set_up(SHAPED_MBIT)
        try:
            server = start_s3rver(ctx.sup, ctx.tools, data_dir, label="s3rver-shaped",
                                  shaped=shaped, delay_ms=SHAPED_DELAY_MS)
            phase = (f"shaped link, s3rver ({SHAPED_MBIT} Mbit/s per connection, "
                     f"+{SHAPED_DELAY_MS} ms per response)")
            sidecar = None
            try:
                sidecar = None if ctx.args.no_sidecar else start_sidecar(ctx, server)
                # One stream at 200 Mbit/s would take half a minute for the whole object.
                ceiling = (20 if ctx.args.quick else 100) * 1000**2
                cold_phase(on_slow_server(ctx), phase, server, results, runs=ctx.args.runs,
                           ceiling_bytes=ceiling, sidecar=sidecar)
            finally:
                if sidecar is not None:
                    sidecar.close()
                ctx.sup.stop(server.proc)
        finally:
            link.tear_down()


if __name__ == "__main__":
    sys.exit(main())
