"""Ranged GETs of a presigned S3 URL over keep-alive connections, read in worker threads.

The bytes of an adapter bypass botocore: per request it costs the event loop more than the
transfer itself. The connections are urllib3's (shared by the worker threads, one pool per
host, through the proxy the environment names, never for loopback): it drops a pooled
connection the server closed while it idled, and retries a request whose reused connection
died under it. Each body is read straight from the response into the download's reused
buffer. Listing, HEAD and signing stay with botocore in `s3_client.py`.

An object fetched in one GET is asked for whole (no Range) with `x-amz-checksum-mode`, so
that its answer carries the registry's full-object checksums: no HEAD is needed for them
(S3 does not promise them for a range of one).
"""

from __future__ import annotations

import http.client
import io
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ProxyError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.util.retry import Retry

from ..core.errors import RegistryError, RegistryObjectChanged, RegistryUnavailable, SidecarError
from .proxies import proxy_for
from .s3errors import s3_cause

log = logging.getLogger(__name__)

ERROR_BODY_MAX_BYTES = 64 * 1024
RECV_LOWAT_BYTES = 256 * 1024
# A connection idle this long is closed rather than reused. A front end that closes idle
# connections says so with a FIN, which the pool notices; a NAT or firewall that forgets the
# flow says nothing, and a request sent into it would wait for the read timeout.
IDLE_MAX_S = 30.0
# A presigned URL is signed again once it is this old. botocore refreshes expiring credentials
# at least 10 minutes before they expire, so a URL signed with them is good for longer.
RESIGN_AFTER_S = 300.0
_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,300})</Message>")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
# What a whole-object GET's answer says of the object, under the names of a HEAD's answer
# (botocore's), which is what the checksum comparison reads.
_ANSWER_FIELDS = {"ETag": "ETag", "ChecksumCRC32": "x-amz-checksum-crc32",
                  "ChecksumSHA256": "x-amz-checksum-sha256",
                  "ChecksumType": "x-amz-checksum-type"}


class _Idle:
    """Stamps a connection when it goes back to the pool, and reports it dropped once it has
    idled IDLE_MAX_S (urllib3 asks `is_connected` before reusing one)."""

    sock: socket.socket | None
    idle_since: float | None = None

    @property
    def is_connected(self) -> bool:
        since, self.idle_since = self.idle_since, None  # asked as it leaves the pool
        if since is not None and time.monotonic() - since > IDLE_MAX_S:
            return False
        return bool(super().is_connected)  # type: ignore[misc]  # urllib3's own check


class _Connection(_Idle, HTTPConnection):
    pass


class _TlsConnection(_Idle, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Connection


class _TlsPool(HTTPSConnectionPool):
    ConnectionCls = _TlsConnection


class _RetryDeadConnection(Retry):
    """One more try for a request whose connection broke before any answer: a keep-alive
    connection the server closed just as it was reused (urllib3 then takes or opens another,
    dropping any it finds closed). Timeouts, refused connections and the like are raised at
    once: the part's own retries, with backoff, handle those."""

    def increment(self, method: str | None = None, url: str | None = None,
                  response: Any = None, error: Exception | None = None,
                  _pool: Any = None, _stacktrace: Any = None) -> _RetryDeadConnection:
        if error is None or not isinstance(error, ProtocolError):
            raise error if error is not None else ProtocolError("no answer")
        return super().increment(method, url, response, error, _pool, _stacktrace)


_RETRY = _RetryDeadConnection(total=1, connect=0, read=1, redirect=0, status=0, other=0,
                              raise_on_redirect=False, raise_on_status=False)


class ConnectionPool:
    """Keep-alive connections for the ranged GETs, shared by the worker threads."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, max_idle: int) -> None:
        self._timeout = urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s)
        self._max_idle = max_idle
        self._managers: dict[str | None, urllib3.PoolManager] = {}  # by proxy URL
        self._lock = threading.Lock()

    def _manager(self, proxy: str | None) -> urllib3.PoolManager:
        with self._lock:
            manager = self._managers.get(proxy)
            if manager is None:
                options: dict[str, Any] = {"num_pools": 16, "maxsize": self._max_idle,
                                           "block": False, "timeout": self._timeout,
                                           "retries": _RETRY}
                manager = (urllib3.PoolManager(**options) if proxy is None
                           else urllib3.ProxyManager(proxy, **options))
                manager.pool_classes_by_scheme = {"http": _Pool, "https": _TlsPool}
                self._managers[proxy] = manager
            return manager

    def get(self, url: str, headers: dict[str, str]) -> urllib3.BaseHTTPResponse:
        """Send a GET and return the response with its body unread (urllib3 errors raised)."""
        return self._manager(proxy_for(url)).urlopen(
            "GET", url, headers=headers, preload_content=False, decode_content=False,
            redirect=False, retries=_RETRY)

    def close(self) -> None:
        with self._lock:
            managers, self._managers = list(self._managers.values()), {}
        for manager in managers:
            manager.clear()


class RangeReader:
    """Opens ranged reads of one object: `open(start, end)` is transfer.OpenRange.

    `sign()` returns a freshly presigned URL (blocking: it waits for the event loop); it is
    called when the URL is older than RESIGN_AFTER_S (from `signed_at`, by the monotonic
    clock; default: now) or the registry says it expired.

    `whole`: the object is read in one GET, asked for whole with the registry's checksums
    (the URL must be signed with `x-amz-checksum-mode`); `answered` then holds them, as a
    HEAD would, once a read has opened.
    """

    def __init__(self, pool: ConnectionPool, url: str, sign: Callable[[], str], etag: str,
                 size_bytes: int, describe: str, adapter_id: str,
                 on_error: Callable[[], None], *, whole: bool = False,
                 signed_at: float | None = None) -> None:
        self._pool = pool
        self._url = url
        self._signed_at = time.monotonic() if signed_at is None else signed_at
        self._sign = sign
        self._url_lock = threading.Lock()
        self._etag = etag
        self._size_bytes = size_bytes
        self._describe = describe  # the object, for messages: never the signed URL
        self._adapter_id = adapter_id
        self._on_error = on_error
        self._whole = whole
        self.answered: dict[str, str] = {}  # a whole GET's checksums, named as a HEAD's

    def _current_url(self, expired: str | None = None) -> str:
        """The URL to use, signed again if it is old or is the one that just expired."""
        with self._url_lock:
            if self._url == expired or time.monotonic() - self._signed_at > RESIGN_AFTER_S:
                self._url = self._sign()
                self._signed_at = time.monotonic()
            return self._url

    def open(self, start: int, end: int) -> _HttpRangeStream:
        whole = self._whole and (start, end) == (0, self._size_bytes)
        headers = {"If-Match": self._etag, "Accept-Encoding": "identity"}
        if whole:
            headers["x-amz-checksum-mode"] = "ENABLED"  # signed into the URL
        else:
            headers["Range"] = f"bytes={start}-{end - 1}"
        expired: str | None = None
        while True:
            url = self._current_url(expired)
            try:
                response = self._pool.get(url, headers)
            except (HTTPError, OSError, http.client.HTTPException) as exc:
                raise self.fault(exc) from exc
            if response.status == (200 if whole else 206):
                return self._check_range(response, start, end, whole=whole)
            code, message = _error_of(response)
            if expired is None and s3_cause(response.status, code, message) == (
                    "credentials_expired"):
                expired = url  # sign again and retry once
                log.info("the registry says the signature of %s expired (%s); signing again",
                         self._describe, code or response.status)
                continue
            raise self._refusal(response.status, code, message, after_resign=expired is not None)

    def _check_range(self, response: urllib3.BaseHTTPResponse, start: int, end: int, *,
                     whole: bool) -> _HttpRangeStream:
        """The answer is the range asked for (or, `whole`, the object of the listed size)."""
        if whole:
            answered = f"{response.length_remaining} bytes"
            intact = response.length_remaining == self._size_bytes
        else:
            answered = f"bytes {response.headers.get('Content-Range')}"
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", ""))
            intact = (response.length_remaining == end - start and match is not None
                      and int(match.group(1)) == start
                      and match.group(3) == str(self._size_bytes))
        if not intact:
            _discard(response)
            raise RegistryObjectChanged(
                f"{self._describe}: the registry answered {answered} for {start}-{end - 1} of "
                f"{self._size_bytes}; the object changed",
                adapter_id=self._adapter_id, cause="size_changed",
            )
        if whole:
            self.answered = {name: value for name, header in _ANSWER_FIELDS.items()
                             if (value := response.headers.get(header)) is not None}
        return _HttpRangeStream(self, response)

    def _refusal(self, status: int, code: str, message: str, *,
                 after_resign: bool) -> SidecarError:
        self._on_error()
        where = f"{self._describe} ({code or status})"
        cause = s3_cause(status, code, message)
        if cause == "object_changed" and (status != 404 or code == "NoSuchKey"):
            return RegistryObjectChanged(
                f"{where} changed or vanished in the registry while it was being fetched",
                adapter_id=self._adapter_id, cause="object_changed")
        if cause in ("object_changed", "bucket"):  # a 404 naming its code
            return RegistryObjectChanged(
                f"{where} vanished from the registry while it was being fetched",
                adapter_id=self._adapter_id, cause="object_changed")
        if cause == "server":
            return RegistryUnavailable(f"the registry failed on {where}",
                                       adapter_id=self._adapter_id, cause=cause)
        again = " although it was just signed again" if after_resign else ""
        refusals = {
            "not_s3": f"the endpoint answered 404 without an S3 error to a GET of "
                      f"{self._describe}: is it an S3 endpoint? Check --s3-endpoint-url",
            "credentials_expired": f"the registry says the signature or session token for "
                                   f"{where} expired{again} ({message or code}): check this "
                                   "machine's clock (NTP) and that the credential source "
                                   "renews short-lived credentials (STS, IRSA)",
            "clock": f"the registry refused {where}: this machine's clock differs too much from "
                     "the registry's; check NTP",
            "credentials": f"the registry refused the credentials for {where}: check the AWS "
                           "credential chain",
            "permission": f"access denied to {where}: check the credentials' permissions on the "
                          "bucket",
            "refused": f"the registry refused a ranged GET of {where}",
        }
        return RegistryError(refusals[cause], adapter_id=self._adapter_id, cause=cause)

    def fault(self, exc: BaseException) -> SidecarError:
        """The registry fault that an error of the connection or the HTTP layer means."""
        self._on_error()
        if isinstance(exc, MaxRetryError) and exc.reason is not None:
            exc = exc.reason
        if isinstance(exc, ProtocolError) and len(exc.args) > 1:
            exc = exc.args[1] if isinstance(exc.args[1], BaseException) else exc
        if isinstance(exc, ProxyError):
            return RegistryUnavailable(f"the HTTP proxy failed on {self._describe} ({exc}); "
                                       "check http_proxy/https_proxy and no_proxy",
                                       adapter_id=self._adapter_id, cause="proxy")
        # Before the timeouts: urllib3's NewConnectionError (refused, unresolved) is one.
        if isinstance(exc, NewConnectionError | ConnectionRefusedError | socket.gaierror):
            return RegistryUnavailable(f"cannot connect to the registry endpoint for "
                                       f"{self._describe}: {exc}",
                                       adapter_id=self._adapter_id, cause="endpoint")
        if isinstance(exc, TimeoutError | ReadTimeoutError | ConnectTimeoutError):
            return RegistryUnavailable(f"the registry did not answer in time for "
                                       f"{self._describe}", adapter_id=self._adapter_id,
                                       cause="timeout")
        if isinstance(exc, http.client.IncompleteRead):
            return RegistryUnavailable(f"the registry sent a body shorter than its Content-Length "
                                       f"for {self._describe}", adapter_id=self._adapter_id,
                                       cause="short_body")
        if isinstance(exc, SSLError):
            return RegistryUnavailable(f"TLS failed with the registry for {self._describe}: "
                                       f"{exc}", adapter_id=self._adapter_id, cause="tls")
        return RegistryUnavailable(f"the connection to the registry failed while fetching "
                                   f"{self._describe} ({type(exc).__name__}: {exc})",
                                   adapter_id=self._adapter_id, cause="connection")


def _error_of(response: urllib3.BaseHTTPResponse) -> tuple[str, str]:
    """The S3 error code and message of an error answer ("" when it has none); the
    connection is closed (a body of unknown size is not worth draining)."""
    try:
        body = response.read(ERROR_BODY_MAX_BYTES)
    except (HTTPError, OSError, http.client.HTTPException):
        body = b""
    _discard(response)
    code = _CODE.search(body)
    message = _MESSAGE.search(body)
    return (code.group(1).decode() if code else "",
            message.group(1).decode("utf-8", "replace") if message else "")


def _discard(response: urllib3.BaseHTTPResponse) -> None:
    """Close the response and its connection (never back to the pool)."""
    connection = getattr(response, "connection", None)
    response.close()
    if connection is not None:
        connection.close()


class _HttpRangeStream:
    def __init__(self, reader: RangeReader, response: urllib3.BaseHTTPResponse) -> None:
        self._reader = reader
        self._response = response
        self._connection: Any = response.connection  # one of ours: _Connection, _TlsConnection
        # The body is read straight into the caller's buffer through the standard library's
        # response under urllib3's (its own readinto reads into a new object, then copies).
        raw = getattr(response, "_fp", None)
        self._raw = raw if isinstance(raw, http.client.HTTPResponse) else None
        self._lowat = 1
        self._aborted = False

    def readinto(self, buffer: memoryview) -> int:
        try:
            if self._raw is None:
                return self._response.readinto(buffer)
            self._wait_for_more(len(buffer))
            return self._raw.readinto(buffer)
        except (HTTPError, OSError, http.client.HTTPException) as exc:
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
        assert self._raw is not None
        remaining = self._raw.length
        if remaining is None:
            return
        beyond = remaining - wanted - io.DEFAULT_BUFFER_SIZE
        lowat = max(1, min(RECV_LOWAT_BYTES, wanted, beyond))
        sock = self._connection.sock if self._connection is not None else None
        if lowat != self._lowat and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def close(self) -> None:
        """Done with the body: a connection whose body was read to its end goes back to the
        pool; any other (an aborted or unfinished read) is closed."""
        raw, connection = self._raw, self._connection
        finished = (raw.isclosed() and not raw.will_close if raw is not None
                    else self._response.length_remaining == 0)
        if self._aborted or not finished or connection is None:
            _discard(self._response)
            return
        sock = connection.sock
        if self._lowat != 1 and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        connection.idle_since = time.monotonic()
        self._response.release_conn()

    def abort(self) -> None:
        """Wake a read blocked in another thread (safe from any thread): the socket is shut
        down, not closed, so its descriptor cannot be reused under that read; `close()`
        closes it once the read has returned."""
        self._aborted = True
        sock = self._connection.sock if self._connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
