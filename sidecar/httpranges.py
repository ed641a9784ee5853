"""Ranged GETs of a presigned S3 URL over plain keep-alive HTTP, read in worker threads.

The bytes of an adapter bypass botocore: per request it costs the event loop more than the
transfer itself, and a blocking socket read into a reused buffer costs one copy. Listing,
HEAD and signing stay with botocore in `source.py`.
"""

from __future__ import annotations

import http.client
import io
import logging
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable

from .errors import SidecarError, SourceChanged, SourceError, SourceUnavailable

log = logging.getLogger(__name__)

ERROR_BODY_MAX_BYTES = 64 * 1024
RECV_LOWAT_BYTES = 256 * 1024
_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class ConnectionPool:
    """Idle keep-alive connections per host, shared by the worker threads."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_idle: int) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, scheme: str, host: str, port: int) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it was idle in the pool (and may have gone stale)."""
        with self._lock:
            idle = self._idle.get((scheme, host, port))
            if idle:
                return idle.pop(), True
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return cls(host, port, timeout=self._connect_timeout_s), False

    def give_back(self, scheme: str, host: str, port: int,
                  conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault((scheme, host, port), [])
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def connect(self, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:
            conn.connect()
            sock: socket.socket = conn.sock  # type: ignore[assignment]  # set by connect()
            sock.settimeout(self._read_timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()


class RangeReader:
    """Opens ranged reads of one object: `open(start, end)` is transfer.OpenRange."""

    def __init__(self, pool: ConnectionPool, url: str, etag: str, size_bytes: int,
                 describe: str, adapter_id: str, on_error: Callable[[], None]) -> None:
        parts = urllib.parse.urlsplit(url)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._target = parts.path + ("?" + parts.query if parts.query else "")
        self._pool = pool
        self._etag = etag
        self._size_bytes = size_bytes
        self._describe = describe  # the object, for messages: never the signed URL
        self._adapter_id = adapter_id
        self._on_error = on_error

    def open(self, start: int, end: int) -> _HttpRangeStream:
        headers = {"Range": f"bytes={start}-{end - 1}", "If-Match": self._etag,
                   "Accept-Encoding": "identity"}
        for _ in range(2):
            conn, reused = self._pool.take(self._scheme, self._host, self._port)
            try:
                self._pool.connect(conn)
                conn.request("GET", self._target, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if reused and not isinstance(exc, TimeoutError):
                    continue  # the server closed an idle connection: not the registry's fault
                raise self.fault(exc) from exc
            return self._check(conn, response, start, end)
        raise AssertionError("unreachable")

    def _check(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse,
               start: int, end: int) -> _HttpRangeStream:
        if response.status == 206:
            match = _CONTENT_RANGE.fullmatch(response.getheader("Content-Range", ""))
            total = match.group(3) if match else ""
            if (response.length != end - start or match is None
                    or int(match.group(1)) != start or total != str(self._size_bytes)):
                conn.close()
                raise SourceChanged(
                    f"{self._describe}: the registry answered bytes "
                    f"{response.getheader('Content-Range')} for {start}-{end - 1} of "
                    f"{self._size_bytes}; the object changed",
                    adapter_id=self._adapter_id, cause="size_changed",
                )
            return _HttpRangeStream(self, conn, response)
        try:
            body = response.read(ERROR_BODY_MAX_BYTES)
        except (OSError, http.client.HTTPException):
            body = b""
        conn.close()
        self._on_error()
        found = _CODE.search(body)
        code = found.group(1).decode() if found else ""
        status = response.status
        where = f"{self._describe} ({code or status})"
        if status in (412, 404) or code in ("PreconditionFailed", "NoSuchKey"):
            raise SourceChanged(f"{where} changed or vanished in the registry while it was "
                                "being fetched", adapter_id=self._adapter_id,
                                cause="object_changed")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                    "InvalidToken", "TokenRefreshRequired"):
            raise SourceError(f"the registry refused the credentials for {where}: check the "
                              "AWS credential chain", adapter_id=self._adapter_id,
                              cause="credentials")
        if status == 403:
            raise SourceError(f"access denied to {where}: check the credentials' permissions "
                              "on the bucket", adapter_id=self._adapter_id, cause="permission")
        if status >= 500 or status == 429 or code == "SlowDown":
            raise SourceUnavailable(f"the registry failed on {where}",
                                    adapter_id=self._adapter_id, cause="server")
        raise SourceError(f"the registry refused a ranged GET of {where}",
                          adapter_id=self._adapter_id, cause="refused")

    def fault(self, exc: BaseException) -> SidecarError:
        """The registry fault that an error of the connection or the HTTP layer means."""
        self._on_error()
        if isinstance(exc, TimeoutError):
            return SourceUnavailable(f"the registry did not answer in time for "
                                     f"{self._describe}", adapter_id=self._adapter_id,
                                     cause="timeout")
        if isinstance(exc, http.client.IncompleteRead):
            return SourceUnavailable(f"the registry sent a body shorter than its Content-Length "
                                     f"for {self._describe}", adapter_id=self._adapter_id,
                                     cause="short_body")
        if isinstance(exc, ConnectionRefusedError | socket.gaierror):
            return SourceUnavailable(f"cannot connect to the registry endpoint "
                                     f"{self._host}:{self._port}: {exc}",
                                     adapter_id=self._adapter_id, cause="endpoint")
        return SourceUnavailable(f"the connection to the registry failed while fetching "
                                 f"{self._describe} ({type(exc).__name__}: {exc})",
                                 adapter_id=self._adapter_id, cause="connection")

    def release(self, conn: http.client.HTTPConnection) -> None:
        self._pool.give_back(self._scheme, self._host, self._port, conn)


class _HttpRangeStream:
    def __init__(self, reader: RangeReader, conn: http.client.HTTPConnection,
                 response: http.client.HTTPResponse) -> None:
        self._reader = reader
        self._conn = conn
        self._response = response
        self._lowat = 1

    def readinto(self, buffer: memoryview) -> int:
        try:
            self._wait_for_more(len(buffer))
            return self._response.readinto(buffer)
        except (OSError, http.client.HTTPException) as exc:
            raise self._reader.fault(exc) from exc

    def _wait_for_more(self, wanted: int) -> None:
        """Have each socket read wake up only once RECV_LOWAT_BYTES have arrived: on a slow
        link a wake-up per packet cost more CPU (and GIL hand-offs) than the copying.

        A read waits for that many bytes (or all it asked for), so the mark must never
        exceed what the body still owes beyond this buffer, less what http.client's reader
        may hold already: the reads that fill this buffer, its own small refills included,
        could otherwise wait for bytes that never come. The body's last buffer reads with
        no mark.
        """
        remaining = self._response.length
        if remaining is None:
            return
        beyond = remaining - wanted - io.DEFAULT_BUFFER_SIZE
        lowat = max(1, min(RECV_LOWAT_BYTES, wanted, beyond))
        sock = self._conn.sock
        if lowat != self._lowat and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def close(self) -> None:
        if self._response.isclosed() and not self._response.will_close:
            if self._lowat != 1 and self._conn.sock is not None:
                self._conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self._reader.release(self._conn)  # the whole body was read: keep it alive
        else:
            self._conn.close()

    def abort(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in another thread
            except OSError:
                pass
        self._conn.close()

