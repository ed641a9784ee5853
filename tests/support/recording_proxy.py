"""A forward HTTP proxy that forwards nothing: run as its own process, it appends the request
line of every request it receives to a log file and answers 502. Tests point http_proxy and
friends at it to prove a call never went through a proxy.

    python -m tests.support.recording_proxy LOG_FILE PORT_FILE
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.proxy_process import ProxyProcess

_lock = threading.Lock()


class RecordingProxy(ProxyProcess):
    """This script as a child process: `url`, `requests()` seen so far, `stop()`."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(__name__, workdir, "proxy-requests.log", "recording proxy")

    def environment(self, no_proxy: str | None = None) -> dict[str, str]:
        """Every proxy variable pointing at this proxy, and no no_proxy: a corporate container."""
        return super().environment(no_proxy)

    def requests(self) -> list[str]:
        return self.lines()


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
