"""Processes the benchmark starts (S3 servers, the sidecar, the bare handler), and their end.

Every process is started in its own session and stopped, with its children, when the
benchmark ends for any reason.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import link
from .tools import Tools

HERE = Path(__file__).resolve().parent
S3_ACCESS_KEY = "S3RVER"  # s3rver's built-in account; moto accepts any key
S3_REGION = "us-east-1"


@contextlib.contextmanager
def holding(dest: Path) -> Iterator[None]:
    """The benchmark's work folder `dest` held for this run alone: each run empties it at its
    start and end, so a second run on the same folder would pull it from under the first.
    That second run stops at once, saying so (a lock file beside the folder)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f"{dest.name}.lock"
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another benchmark run is using {dest} (it holds {lock_path}): "
                             "wait for it to end, or give this one another --dest") from None
        yield


def add_compare_option(parser: argparse.ArgumentParser) -> None:
    """`--compare LABEL=PATH`, read back by `compared_checkouts`."""
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL=PATH",
                        help="also the sidecar package of another checkout (repeatable)")


def checkout_cases_parser(module: str, doc: str | None, *, quick: str, dest: Path,
                          writes: str) -> argparse.ArgumentParser:
    """The options of a benchmark that runs its cases in each checkout (`run_in_checkout`):
    `--quick`, `--compare` and `--dest` (where it `writes`, default tmpfs); it adds its own."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    add_compare_option(parser)
    parser.add_argument("--dest", type=Path, default=dest,
                        help=f"where the {writes} are written (default tmpfs)")
    return parser


def compared_checkouts(specs: Sequence[str]) -> list[tuple[str, Path]]:
    """`--compare LABEL=PATH` arguments as (label, the checkout's root)."""
    return [(label, Path(path)) for label, _, path in (spec.partition("=") for spec in specs)]


def run_in_checkout(source: Path, script: str, *args: str, folder: Path,
                    timeout_s: float = 900) -> dict[str, Any]:
    """`python -c script *args` with the sidecar package of the checkout `source`, in `folder`
    made empty for it and removed after; the JSON object its last line of output prints."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(source.resolve())}
    try:
        done = subprocess.run([sys.executable, "-P", "-c", script, *args], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"a benchmark case failed under {source}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


class Supervisor:
    """Starts processes with their output in log files; `stop_all` ends every one left."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._running: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as log_file:
            proc = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        self._running.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        if proc in self._running:
            self._running.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self._running)):
            self.stop(proc)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(
    host: str, port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}; see its log")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{what} did not listen on {host}:{port} within {timeout_s:.0f} s")


@dataclass(frozen=True, slots=True)
class S3Server:
    label: str
    endpoint_url: str
    proc: subprocess.Popen[bytes]


def start_s3rver(
    sup: Supervisor,
    tools: Tools,
    data_dir: Path,
    *,
    label: str,
    shaped: link.ShapedLink | None = None,
    delay_ms: int = 0,
) -> S3Server:
    data_dir.mkdir(parents=True, exist_ok=True)
    address = shaped.server_addr if shaped else "127.0.0.1"
    port = 9000 if shaped else free_port()  # a namespace of its own has every port free
    command = [tools.node, str(HERE / "s3rver.js"), "--directory", str(data_dir),
               "--address", address, "--port", str(port), "--delay-ms", str(delay_ms)]
    if shaped:
        command = link.in_namespace(command)
    env = {**os.environ, "NODE_PATH": str(tools.s3rver_modules)}
    proc = sup.start(label, command, env)
    wait_for_port(address, port, proc, label)
    return S3Server(label, f"http://{address}:{port}", proc)


def launch_moto(sup: Supervisor) -> S3Server:
    """moto's S3 server, started and not waited for (`wait_for_moto`): seconds of imports that
    can pass beside other work. Its access log is sup.log_dir / "moto.log"."""
    port = free_port()
    proc = sup.start("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                              "-p", str(port)])
    return S3Server("moto", f"http://127.0.0.1:{port}", proc)


def wait_for_moto(moto: S3Server) -> S3Server:
    port = urlsplit(moto.endpoint_url).port
    assert port is not None
    wait_for_port("127.0.0.1", port, moto.proc, "moto")
    return moto


def start_moto(sup: Supervisor) -> S3Server:
    return wait_for_moto(launch_moto(sup))


def s3_env(base: Mapping[str, str], work: Path) -> dict[str, str]:
    """The environment every S3 client gets: the servers' key, and no developer's settings."""
    env = {k: v for k, v in base.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID=S3_ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=S3_ACCESS_KEY,
        AWS_DEFAULT_REGION=S3_REGION,
        AWS_REGION=S3_REGION,
        AWS_CONFIG_FILE=str(work / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(work / "no-aws-credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env
