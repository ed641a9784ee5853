"""The sidecar as a child process (`python -m sidecar serve`), for tests that kill it, read its
log, or need it on its own core."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tests.support.waiting import eventually_blocking


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SidecarProcess:
    """`python -m sidecar serve` in a child process, started and answering /healthz, and
    (unless `wait_recovered` is false) done re-indexing its cache: `GET /adapters` waits for
    that, while /healthz answers from the moment the port is bound."""

    def __init__(self, args: list[str], log_path: Path,
                 env: Mapping[str, str] | None = None, port: int | None = None, *,
                 wait_recovered: bool = True, cwd: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env), cwd=cwd,
        )

        def answering() -> bool:
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1).close()
                if wait_recovered:
                    urllib.request.urlopen(f"{self.url}/adapters", timeout=30).close()
                return True
            except OSError:
                if self.process.poll() is not None:
                    raise AssertionError(f"sidecar exited; see {log_path}") from None
                return False

        try:
            eventually_blocking(answering, timeout_s=30, poll_s=0.05, what="sidecar answering")
        except AssertionError:
            self.stop()
            raise AssertionError(f"sidecar did not start; see {log_path}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def stage_blocking(url: str, adapter_id: str, timeout_s: float,
                   **fields: object) -> tuple[int, dict[str, object]]:
    return post_blocking(url, "/stage", {"adapter_id": adapter_id, **fields}, timeout_s)


def post_blocking(url: str, path: str, body: Mapping[str, object],
                  timeout_s: float = 30) -> tuple[int, dict[str, object]]:
    """One JSON POST; (status, parsed answer), error statuses included."""
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_blocking(url: str, path: str, timeout_s: float = 30) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def http_status(url: str, timeout_s: float = 2) -> int:
    """The status a GET answers; 0 when nothing answers (a process starting or gone)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
