"""The HTTP server the API runs on: aiohttp's runner with bounded requests, a port that cannot
be bound explained by the option that chose it, and aiohttp's own log of malformed requests
kept quiet.
"""

from __future__ import annotations

import errno
import logging
import socket

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..config import option_for

SHUTDOWN_GRACE_S = 10.0


def quiet_bad_requests() -> None:
    """Once per process, with the logging set-up: see _QuietBadRequests."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _QuietBadRequests) for f in server_log.filters):
        server_log.addFilter(_QuietBadRequests())


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every malformed request (oversized header, garbage request line) as an
    ERROR with a traceback: any local client could flood the log. They become one DEBUG line;
    the client already got its 4xx."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError) and 400 <= (error.code or 0) < 500:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.msg, record.args, record.exc_info = "rejected a malformed request: %s", (
                error.message,), None
        return True



async def serve_http(app: web.Application, host: str, port: int,
                     port_setting: str) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port; the runner and the port bound (port 0 picks one). A port
    that cannot be bound raises OSError saying which setting chose it."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=False,  # a client hanging up must not cancel a shared stage
        shutdown_timeout=SHUTDOWN_GRACE_S,
        max_line_size=8190,  # bounded request line and headers
        max_field_size=8190,
        max_headers=64,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, _bind_failure(exc, host, port, port_setting)) from exc
    sockets = getattr(site._server, "sockets", None) or []
    return runner, sockets[0].getsockname()[1] if sockets else port


def _bind_failure(exc: OSError, host: str, port: int, port_setting: str) -> str:
    chosen = option_for(port_setting)
    host_option = option_for("metrics_host" if port_setting == "metrics_port" else "host")
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another lora-sidecar, or another "
                f"program): stop it, or choose another port with {chosen.flag} "
                f"({chosen.env_var})")
    if exc.errno == errno.EACCES:
        return (f"binding {where} is not permitted (ports below 1024 need privileges): "
                f"choose another port with {chosen.flag} ({chosen.env_var})")
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (f"{host} is not an address of this machine: choose another with "
                f"{host_option.flag} ({host_option.env_var})")
    return (f"cannot listen on {where}: {exc.strerror or exc} ({chosen.flag}, "
            f"{host_option.flag})")
