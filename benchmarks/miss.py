"""What a miss costs beyond its bytes: a cold `POST /stage` against the same listing and ranged
GETs made bare (no validation, no hashing, no publishing), from moto (the tests' S3) and from a
local registry folder, for a small adapter (tens of KB) and the largest of the run.

The bare side makes exactly the requests the sidecar makes: one listing, then each file's
ranges as `part_starts` cuts them with the sidecar's default part size and parallelism, each
written at its offset in a file on the same filesystem (a local folder: each range read and
written the same way). What is left of the stage's time is the sidecar's own: its fsyncs,
validation, hashing, names and renames.

`python -m benchmarks.miss --compare before=PATH` runs the small adapter alone from a local
folder, many interleaved rounds, for a busy machine.
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sidecar.config import Settings
from sidecar.process.examples import write_adapter
from sidecar.registry.transfer import TransferPolicy, part_starts
from sidecar.validation.shapes import ATTENTION_MODULES, TINY_LLAMA

from .adapters import BUCKET, PREFIX, Adapter, AdapterSpec
from .clients import SidecarStager, s3_client
from .servers import S3Server, Supervisor, add_compare_option, compared_checkouts, holding

SMALL = AdapterSpec("miss-tiny-r16-qkvo", 16, ATTENTION_MODULES, 7)
COPY_CHUNK_BYTES = 1024 * 1024  # the sidecar's own buffer per range


@dataclass(frozen=True, slots=True)
class MissResult:
    registry: str  # "moto" or "local folder"
    adapter: str  # its id
    size_bytes: int
    stage_s: list[float]  # each cold POST /stage, as the client saw it
    bare_s: list[float]  # each bare listing + GETs of the same files

    @property
    def overhead_ms(self) -> float:
        return (statistics.median(self.stage_s) - statistics.median(self.bare_s)) * 1000


def small_adapter(root: Path) -> Adapter:
    """The small adapter (tiny-Llama shapes, rank 16 on q/k/v/o: 33 KB), written once."""
    folder = root / SMALL.adapter_id
    if not folder.is_dir():
        write_adapter(folder, rank=SMALL.rank, target_modules=SMALL.target_modules,
                      shapes=TINY_LLAMA, dtype="bfloat16", seed=SMALL.seed)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return Adapter(SMALL, folder, size)


def _policy() -> TransferPolicy:
    """The sidecar's default ranges and parallelism, from its own declarations."""
    settings = Settings.from_env({})
    return TransferPolicy(settings.part_size_bytes, 1, None,  # type: ignore[arg-type]
                          settings.download_concurrency)


class _Ranges:
    """Keep-alive HTTP connections, one per worker thread, for the bare ranged GETs."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, url: str, start: int, end: int, fd: int) -> None:
        parts = urlsplit(url)
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(parts.netloc, timeout=600)
            self._local.conn = conn
        conn.request("GET", f"{parts.path}?{parts.query}",
                     headers={"Range": f"bytes={start}-{end - 1}"})
        response = conn.getresponse()
        if response.status not in (200, 206):
            raise RuntimeError(f"bare GET answered {response.status}")
        buffer = memoryview(bytearray(min(COPY_CHUNK_BYTES, end - start)))
        offset = start
        while offset < end:
            got = response.readinto(buffer[:min(len(buffer), end - offset)])
            if not got:
                raise RuntimeError("bare GET ended short")
            os.pwrite(fd, buffer[:got], offset)
            offset += got
        response.read()


class _Bare:
    """What both bare fetchers share: the destination, the sidecar's part sizes, a pool of
    its width for the parts, and undoing a fetch."""

    def __init__(self, dest: Path, policy: TransferPolicy) -> None:
        self._dest = dest
        self._policy = policy
        self._pool = ThreadPoolExecutor(policy.concurrency)

    def _parts(self, size: int) -> list[tuple[int, int]]:
        starts = part_starts(size, self._policy)
        return list(zip(starts, [*starts[1:], size], strict=True))

    def reset(self, adapter_id: str) -> None:
        shutil.rmtree(self._dest / adapter_id, ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown()


class BareS3(_Bare):
    """The registry's own listing and the sidecar's ranged GETs, nothing else."""

    def __init__(self, server: S3Server, dest: Path, policy: TransferPolicy) -> None:
        super().__init__(dest, policy)
        self._client = s3_client(server.endpoint_url)
        self._ranges = _Ranges()

    def fetch(self, adapter_id: str) -> None:
        folder = self._dest / adapter_id
        folder.mkdir(parents=True)
        listed = self._client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/{adapter_id}/")
        jobs: list[Any] = []
        fds = []
        try:
            for obj in listed["Contents"]:
                url = self._client.generate_presigned_url(
                    "get_object", Params={"Bucket": BUCKET, "Key": obj["Key"]}, ExpiresIn=3600)
                fd = os.open(folder / obj["Key"].rsplit("/", 1)[1],
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fds.append(fd)
                size = int(obj["Size"])
                os.ftruncate(fd, size)
                jobs += [self._pool.submit(self._ranges.get, url, start, end, fd)
                         for start, end in self._parts(size)]
            for job in jobs:
                job.result()
        finally:
            for fd in fds:
                os.close(fd)


class BareLocal(_Bare):
    """A local registry's own listing (the folder's entries, stat'd) and the same ranges read
    and written, nothing else."""

    def __init__(self, root: Path, dest: Path, policy: TransferPolicy) -> None:
        super().__init__(dest, policy)
        self._root = root

    def fetch(self, adapter_id: str) -> None:
        folder = self._dest / adapter_id
        folder.mkdir(parents=True)
        files = [(e.name, e.stat().st_size) for e in os.scandir(self._root / adapter_id)
                 if e.is_file(follow_symlinks=False)]
        jobs: list[Any] = []
        fds = []
        try:
            for name, size in files:
                src = os.open(self._root / adapter_id / name, os.O_RDONLY)
                dst = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fds += [src, dst]
                os.ftruncate(dst, size)
                jobs += [self._pool.submit(_copy_range, src, dst, start, end)
                         for start, end in self._parts(size)]
            for job in jobs:
                job.result()
        finally:
            for fd in fds:
                os.close(fd)


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    buffer = memoryview(bytearray(min(COPY_CHUNK_BYTES, end - start)))
    offset = start
    while offset < end:
        got = os.preadv(src, [buffer[:min(len(buffer), end - offset)]], offset)
        if not got:
            raise RuntimeError("short read")
        os.pwrite(dst, buffer[:got], offset)
        offset += got


def interleaved(sides: dict[str, Any], adapter_id: str, rounds: int, log: Any = None, *,
                warm: bool = True) -> dict[str, list[float]]:
    """Each side's cold fetch of `adapter_id` (reset after each), in seconds, over `rounds`
    rounds whose order rotates (no side always first); `warm`: after one untimed fetch by
    each side (connections, imports, page cache)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values() if warm else ():
        side.fetch(adapter_id)
        side.reset(adapter_id)
    order = list(sides.items())
    for round_index in range(rounds):
        shift = round_index % len(order)
        for name, side in order[shift:] + order[:shift]:
            started = time.perf_counter()
            side.fetch(adapter_id)
            elapsed = time.perf_counter() - started
            side.reset(adapter_id)
            times[name].append(elapsed)
            if log is not None:
                log(f"miss: {adapter_id} {name}: {elapsed * 1000:.1f} ms")
    return times


def measure(
    registry: str, sidecar: SidecarStager, bare: BareS3 | BareLocal, adapters: list[Adapter],
    runs: int, log: Any,
) -> list[MissResult]:
    """Per adapter, the sidecar's cold stage beside the bare fetch, interleaved (the first
    adapter warms both up)."""
    results = []
    for adapter in adapters:
        times = interleaved({"sidecar": sidecar, "bare": bare}, adapter.adapter_id, runs, log,
                            warm=adapter is adapters[0])
        results.append(MissResult(registry, adapter.adapter_id, adapter.size_bytes,
                                  times["sidecar"], times["bare"]))
    return results


def render(results: list[MissResult]) -> str:
    out = ["\n### Miss overhead: a cold POST /stage against the same listing and ranged GETs "
           "made bare (medians)",
           "\n| registry | adapter | sidecar ms | bare list + GETs ms | overhead ms | "
           "sidecar runs (ms) | bare runs (ms) |",
           "|---|---|---:|---:|---:|---|---|"]
    for r in results:
        out.append(
            f"| {r.registry} | {_size(r.size_bytes)} | {statistics.median(r.stage_s) * 1000:.1f} | "
            f"{statistics.median(r.bare_s) * 1000:.1f} | {r.overhead_ms:.1f} | "
            f"{', '.join(f'{s * 1000:.1f}' for s in r.stage_s)} | "
            f"{', '.join(f'{s * 1000:.1f}' for s in r.bare_s)} |")
    return "\n".join(out)


def _size(size_bytes: int) -> str:
    return (f"{size_bytes / 1e3:.0f} KB" if size_bytes < 1e6 else f"{size_bytes / 1e6:.0f} MB")


def local_sidecar(sup: Supervisor, command: list[str], root: Path, cache_root: Path,
                  env: dict[str, str], extra_args: tuple[str, ...],
                  name: str = "sidecar") -> SidecarStager:
    """The sidecar with a local folder as its registry (the S3 flags are left unused)."""
    server = S3Server("local", "http://127.0.0.1:1", None)  # type: ignore[arg-type]
    return SidecarStager(sup, command, server, cache_root, env,
                         ("--registry", str(root), *extra_args), name=name)


def compare_small(rounds: int, dest: Path, compared: list[tuple[str, Path]],
                  registry: str = "local") -> str:
    """The small adapter's miss from a local folder (or moto), this checkout's sidecar beside
    others and the bare client, interleaved (the order rotates each round): the medians and
    quartiles of many rounds, for a machine too busy for one run's figure to mean much."""
    from . import adapters as adapters_mod
    from .bench import REPO
    from .servers import s3_env, start_moto

    work = REPO / "benchmarks" / ".work"
    sup = Supervisor(work / "logs")
    small = small_adapter(work / "adapters")
    shutil.rmtree(dest, ignore_errors=True)
    sides: dict[str, SidecarStager | BareLocal | BareS3] = {}
    try:
        moto = start_moto(sup) if registry == "moto" else None
        if moto is not None:
            os.environ.update(s3_env(os.environ, work))  # this process's own S3 clients
            adapters_mod.upload(s3_client(moto.endpoint_url), [small])
        for label, source in [("sidecar", REPO), *compared]:
            env = s3_env(os.environ, work)
            env["PYTHONPATH"] = str(source.resolve())
            command = [sys.executable, "-P", "-m", "sidecar"]
            name = label if label == "sidecar" else f"sidecar ({label})"
            sides[name] = (local_sidecar(sup, command, work / "adapters",
                                         dest / f"cache-{label}", env, (), name) if moto is None
                           else SidecarStager(sup, command, moto, dest / f"cache-{label}", env,
                                              name=name))
        sides["bare"] = (BareLocal(work / "adapters", dest / "bare", _policy()) if moto is None
                         else BareS3(moto, dest / "bare", _policy()))
        times = {name: [t * 1000 for t in ts]
                 for name, ts in interleaved(sides, small.adapter_id, rounds).items()}
    finally:
        bare = sides.get("bare")
        if isinstance(bare, BareLocal | BareS3):
            bare.close()
        sup.stop_all()
        shutil.rmtree(dest, ignore_errors=True)
    where = "a local folder" if registry == "local" else registry
    lines = [f"\n{_size(small.size_bytes)} adapter from {where}, {rounds} interleaved "
             f"rounds, on {dest.parent}:\n",
             "| client | median ms | quartiles ms |", "|---|---:|---|"]
    for name, values in times.items():
        low, _, high = statistics.quantiles(values, n=4)
        lines.append(f"| {name} | {statistics.median(values):.2f} | {low:.2f}-{high:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.miss",
        description="The small adapter's miss from a local folder (or moto) against the bare "
        "client, many interleaved rounds (the full miss phase is `benchmarks/run.sh --phases "
        "miss`).")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--registry", choices=("local", "moto"), default="local",
                        help="where the adapter comes from: a local folder, or moto (the "
                        "tests' S3) in a process of its own")
    parser.add_argument("--dest", type=Path, default=Path("/dev/shm/lsbench-miss"),
                        help="where the caches and copies go (default tmpfs; a folder on disk "
                        "adds the fsyncs' cost)")
    add_compare_option(parser)
    args = parser.parse_args(argv)
    compared = compared_checkouts(args.compare)
    with holding(args.dest):
        print(compare_small(args.rounds, args.dest, compared, args.registry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
