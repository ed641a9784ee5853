"""A forward HTTP proxy, run as its own process, that carries requests to their servers and
appends each request line it carried ("GET http://host:port/path") to a log file. Tests point
http_proxy and friends at it to see which calls went through a proxy and which did not.

    python -m tests.support.forward_proxy LOG_FILE PORT_FILE
"""

from __future__ import annotations

import http.client
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.proxy_process import ProxyProcess

HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "proxy-authorization",
               "proxy-authenticate", "te", "trailer", "transfer-encoding", "upgrade"}
_lock = threading.Lock()


class ForwardProxy(ProxyProcess):
    """This script as a child process: `url`, `carried()` so far, `stop()`."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(__name__, workdir, "proxy-carried.log", "forward proxy")

    def carried(self) -> list[str]:
        return self.lines()


class _Forwarder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive with clients, as a real proxy
    log_file: Path

    def _forward(self) -> None:
        target = urllib.parse.urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self.send_error(400, "absolute http:// URI expected")
            return
        with _lock, self.log_file.open("a", encoding="utf-8") as log:
            log.write(f"{self.command} {self.path}\n")
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=30)
        try:
            path = target.path + (f"?{target.query}" if target.query else "")
            upstream.request(self.command, path or "/", body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        except OSError as exc:
            self.send_error(502, f"forward proxy: {exc}")
            return
        finally:
            upstream.close()
        self.send_response(answer.status, answer.reason)
        for key, value in answer.getheaders():
            if key.lower() not in HOP_HEADERS and key.lower() != "content-length":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _forward

    def do_CONNECT(self) -> None:
        with _lock, self.log_file.open("a", encoding="utf-8") as log:
            log.write(f"CONNECT {self.path}\n")
        self.send_error(501, "this test proxy carries plain HTTP only")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str]) -> None:
    log_file, port_file = Path(argv[0]), Path(argv[1])
    log_file.touch()
    _Forwarder.log_file = log_file
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Forwarder)
    server.daemon_threads = True
    port_file.write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
