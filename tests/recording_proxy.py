"""A forward HTTP proxy that forwards nothing: run as its own process, it appends the request
line of every request it receives to a log file and answers 502. Tests point http_proxy and
friends at it to prove a call never went through a proxy.

    python tests/recording_proxy.py LOG_FILE PORT_FILE
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_lock = threading.Lock()
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY")


class RecordingProxy:
    """This script as a child process: `url`, `requests()` seen so far, `stop()`."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_file = workdir / "proxy-requests.log"
        port_file = workdir / "proxy-port"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, __file__, str(self.log_file),
                                         str(port_file)])
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def environment(self) -> dict[str, str]:
        """Every proxy variable pointing at this proxy, and no no_proxy: a corporate container."""
        return dict.fromkeys(PROXY_VARIABLES, self.url)

    def requests(self) -> list[str]:
        return self.log_file.read_text(encoding="utf-8").splitlines()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


class _Recorder(BaseHTTPRequestHandler):
    log_file: Path

    def _record(self) -> None:
        with _lock, self.log_file.open("a", encoding="utf-8") as log:
            log.write(self.requestline + "\n")
        self.send_response(502, "recording proxy: nothing is forwarded")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = do_CONNECT = _record

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str]) -> None:
    log_file, port_file = Path(argv[0]), Path(argv[1])
    log_file.touch()
    _Recorder.log_file = log_file
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
