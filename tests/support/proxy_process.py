"""A test proxy script run as its own process: started with a log file and a port file, it
writes its port once listening and appends one line per request it sees. Shared by
forward_proxy.py (carries requests) and recording_proxy.py (carries nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO
from tests.support.waiting import eventually_blocking

PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY")


class ProxyProcess:
    """`python -m module` as a child process: `url`, `lines()` logged so far, `stop()`."""

    def __init__(self, module: str, workdir: Path, log_name: str, what: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_file = workdir / log_name
        port_file = workdir / "proxy-port"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", module, str(self.log_file),
                                         str(port_file)], cwd=REPO)

        def port_written() -> bool:
            if port_file.exists() and port_file.read_text():
                return True
            if self.process.poll() is not None:
                raise RuntimeError(f"the {what} exited")
            return False

        try:
            eventually_blocking(port_written, timeout_s=20, what=f"the {what}'s port")
        except (AssertionError, RuntimeError):
            self.stop()
            raise RuntimeError(f"the {what} did not start") from None
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def environment(self, no_proxy: str | None = None) -> dict[str, str]:
        """Every proxy variable pointing at this proxy; no_proxy only if given."""
        env = dict.fromkeys(PROXY_VARIABLES, self.url)
        if no_proxy is not None:
            env["no_proxy"] = env["NO_PROXY"] = no_proxy
        return env

    def lines(self) -> list[str]:
        return self.log_file.read_text(encoding="utf-8").splitlines()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
