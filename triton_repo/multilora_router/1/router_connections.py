"""Keep-alive HTTP connections to one address, shared by the router's threads. Plain
http.client, never urllib: a call goes straight to the configured address and never through a
proxy named by http_proxy/HTTP_PROXY, which urllib would honour.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable, Mapping

RESPONSE_LIMIT_BYTES = 1024 * 1024
# Idle connections are kept at most this long: aiohttp closes its side after 75 s, and a
# connection taken just as the server closes it costs a retry.
_IDLE_MAX_S = 30.0
_IDLE_CONNECTIONS_MAX = 64
# What a keep-alive connection the server closed while it sat idle fails with: the request
# never reached the server, so it is sent again on a fresh connection. (A timeout is not one of
# these: the server may be working on the request.)
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                     ConnectionAbortedError, http.client.BadStatusLine)


class Unreachable(Exception):
    """No answer came: the connection was refused, timed out or broken off (the message)."""


class Connections:
    """A call takes the most recently used idle connection, or opens one, and gives it back."""

    def __init__(self, url: str, clock: Callable[[], float]) -> None:
        parts = urllib.parse.urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._https else 80)
        self._clock = clock
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self.opened = 0  # for tests and benchmarks: how often a call had to connect

    def post(self, path: str, body: bytes, headers: Mapping[str, str],
             timeout_s: float) -> tuple[int, bytes]:
        """The answer's HTTP status and body (its first RESPONSE_LIMIT_BYTES); Unreachable."""
        while True:
            connection, reused = self._take(timeout_s)
            try:
                connection.request("POST", path, body=body, headers=headers)
                response = connection.getresponse()
                raw = response.read(RESPONSE_LIMIT_BYTES + 1)
            except _STALE_CONNECTION:
                connection.close()
                if reused:
                    continue  # it died while idle; the next one taken is fresher or new
                raise Unreachable("the connection was closed") from None
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            if response.will_close or len(raw) > RESPONSE_LIMIT_BYTES:
                connection.close()
            else:
                self._give_back(connection)
            return response.status, raw[:RESPONSE_LIMIT_BYTES]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()

    def _take(self, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """A connection and whether it was used before (then it may have died while idle)."""
        now = self._clock()
        with self._lock:
            while self._idle:
                connection, since = self._idle.pop()  # the most recently used: least stale
                if now - since <= _IDLE_MAX_S and connection.sock is not None:
                    connection.sock.settimeout(timeout_s)
                    return connection, True
                connection.close()
            self.opened += 1
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return kind(self._host, self._port, timeout=timeout_s), False

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _IDLE_CONNECTIONS_MAX:
                self._idle.append((connection, self._clock()))
                return
        connection.close()
