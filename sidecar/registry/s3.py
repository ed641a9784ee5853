"""The registry: where adapters come from. The `AdapterSource` protocol, and its S3
implementation (the only module that imports aiobotocore; botocore errors stop here).
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import re
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore import exceptions as bce

from ..config import Settings, hide_password
from ..errors import (
    AdapterNotFound,
    SidecarError,
    SourceChanged,
    SourceError,
    SourceUnavailable,
)
from ..ids import ADAPTER_ID_PATTERN, is_valid_adapter_id
from ..logs import fields
from .checksum import crc32_hex, s3_checksum_hex
from .httpranges import ConnectionPool, RangeReader
from .proxies import botocore_proxies
from .transfer import Inspector, TransferPolicy, download

log = logging.getLogger(__name__)

PRESIGNED_URL_TTL_S = 3600  # longer than any one file's download
_MULTIPART_ETAG = re.compile(r'-[0-9]+"?$')


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of an adapter as the registry lists it."""

    name: str  # plain file name inside the adapter folder
    size_bytes: int
    etag: str  # what must not change between listing and fetch
    locator: str  # S3 key or local path


@dataclass(frozen=True, slots=True)
class FetchedFile:
    crc32: str  # of the bytes written, 8 hex digits
    sha256: str | None  # of the bytes written, when the registry has a SHA-256 to check
    registry_crc32: str | None = None  # the registry's own full-object checksums, if kept
    registry_sha256: str | None = None


@dataclass(frozen=True, slots=True)
class Listing:
    files: list[RemoteFile]
    unsafe_names: list[str]  # keys that would leave the adapter folder: never fetched


class AdapterSource(Protocol):
    description: str

    async def list_adapter_ids(self) -> list[str]: ...

    async def list_files(self, adapter_id: str) -> Listing:
        """Raises AdapterNotFound when the registry has nothing under this id."""
        ...

    async def fetch(
        self, adapter_id: str, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None],
        *, inspect: Inspector | None = None, sha256: bool = False,
    ) -> FetchedFile:
        """Download one file; `inspect` sees its bytes as they land (the value check);
        `sha256` asks for their SHA-256 (to check a SHA256SUMS) even if the registry has none."""
        ...

    async def probe(self) -> None:
        """Raise a SidecarError if the registry cannot be used right now."""
        ...

    async def close(self) -> None: ...


SHOWN_SKIPPED = 20  # folder names quoted in one log line


class SkippedFolders:
    """Registry folders a listing leaves out (names that are not adapter ids): logged once
    each time the set changes, not at every listing, and counted in a gauge."""

    def __init__(self, description: str, on_count: Callable[[int], None] | None) -> None:
        self._description = description
        self._on_count = on_count
        self._last: frozenset[str] = frozenset()

    def note(self, skipped: list[str]) -> None:
        names = frozenset(skipped)
        if self._on_count is not None:
            self._on_count(len(names))
        if names == self._last:
            return
        self._last = names
        if not names:
            log.info("registry %s: no folder is skipped any more", self._description)
            return
        shown = ", ".join(repr(name[:100]) for name in sorted(names)[:SHOWN_SKIPPED])
        more = f" (+{len(names) - SHOWN_SKIPPED} more)" if len(names) > SHOWN_SKIPPED else ""
        log.warning("registry %s: skipping %d folder(s) that cannot be adapters (ids match "
                    "%s): %s%s", self._description, len(names), ADAPTER_ID_PATTERN.pattern,
                    shown, more, extra=fields(event="registry_folders_skipped",
                                              skipped=len(names)))


_NAME_RE = re.compile(r"^[A-Za-z0-9._-][A-Za-z0-9._ -]{0,254}$")


def is_safe_file_name(name: str) -> bool:
    """A plain name that stays inside its folder: no separators, no `..`, no absolute path."""
    return (
        bool(_NAME_RE.fullmatch(name))
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and posixpath.basename(name) == name
    )


class S3Source:
    """Adapters under s3://bucket/prefix/<adapter_id>/<file>."""

    def __init__(self, settings: Settings, policy: TransferPolicy, on_error: Callable[[str], None],
                 on_skipped: Callable[[int], None] | None = None):
        location = settings.registry.removeprefix("s3://")
        bucket, _, prefix = location.partition("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.description = f"s3://{bucket}/{self.prefix}"
        self._skipped = SkippedFolders(self.description, on_skipped)
        self._settings = settings
        self._policy = policy
        self._on_error = on_error
        self._stack = AsyncExitStack()
        self._client: Any = None
        self._pool = ConnectionPool(settings.s3_connect_timeout_s, settings.s3_read_timeout_s,
                                    max_idle=settings.download_concurrency)
        attempts = settings.s3_max_attempts
        # One call, botocore's own retries included, never waits longer than this.
        self._call_timeout_s = (
            (settings.s3_connect_timeout_s + settings.s3_read_timeout_s) * attempts + 20.0
        )

    async def open(self) -> None:
        session = get_session()
        region = self._settings.s3_region or session.get_config_variable("region") or "us-east-1"
        config = AioConfig(
            connect_timeout=self._settings.s3_connect_timeout_s,
            read_timeout=self._settings.s3_read_timeout_s,
            # botocore's "max_attempts" counts retries (one more attempt than asked);
            # "total_max_attempts" counts attempts, as --s3-max-attempts does.
            retries={"total_max_attempts": self._settings.s3_max_attempts, "mode": "standard"},
            max_pool_connections=8,  # listing, HEAD and signing only; bytes use self._pool
            response_checksum_validation="when_required",
            signature_version="s3v4",  # presigned URLs too (botocore may default to v2)
            # Never through a proxy for a loopback endpoint; else the usual variables.
            proxies=botocore_proxies(self._settings.s3_endpoint_url),
        )
        self._client = await self._stack.enter_async_context(
            session.create_client(
                "s3",
                region_name=region,
                endpoint_url=self._settings.s3_endpoint_url,
                config=config,
            )
        )

    async def close(self) -> None:
        await self._stack.aclose()
        self._pool.close()

    async def probe(self) -> None:
        await self._call("probe", None, self._client.list_objects_v2,
                         Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    async def list_adapter_ids(self) -> list[str]:
        ids: list[str] = []
        skipped: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix,
                                      "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call("list", None, self._client.list_objects_v2, **kwargs)
            for common in page.get("CommonPrefixes", []):
                adapter_id = common["Prefix"][len(self.prefix):].rstrip("/")
                if is_valid_adapter_id(adapter_id):
                    ids.append(adapter_id)
                else:
                    skipped.append(adapter_id)
            if not page.get("IsTruncated"):
                self._skipped.note(skipped)
                return sorted(ids)
            token = page.get("NextContinuationToken")

    async def list_files(self, adapter_id: str) -> Listing:
        folder = f"{self.prefix}{adapter_id}/"
        files: list[RemoteFile] = []
        unsafe: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": folder}
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call("list", adapter_id, self._client.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(folder):]
                if name == "" and obj["Size"] == 0:
                    continue  # a "folder marker" some tools create
                if not is_safe_file_name(name):
                    unsafe.append(name)
                    continue
                files.append(RemoteFile(name, int(obj["Size"]), obj["ETag"], obj["Key"]))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        if not files and not unsafe:
            raise AdapterNotFound(
                f"no adapter {adapter_id!r} in the registry {self.description} "
                f"(nothing under {folder})",
                adapter_id=adapter_id,
            )
        return Listing(sorted(files, key=lambda f: f.name), unsafe)

    async def fetch(
        self, adapter_id: str, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None],
        *, inspect: Inspector | None = None, sha256: bool = False,
    ) -> FetchedFile:
        # One signature for the ranges of the file, signed again when it grows old or the
        # registry says it expired (short-lived credentials); the ranges are plain HTTP.
        url = await self._presign(adapter_id, file)
        loop = asyncio.get_running_loop()

        def sign() -> str:  # from a worker thread: the loop signs
            signing = asyncio.run_coroutine_threadsafe(self._presign(adapter_id, file), loop)
            try:
                return signing.result(self._call_timeout_s)
            except TimeoutError:
                signing.cancel()
                raise SourceUnavailable(f"signing a URL for {file.locator} took longer than "
                                        f"{self._call_timeout_s:g}s", adapter_id=adapter_id,
                                        cause="timeout") from None

        reader = RangeReader(self._pool, url, sign, file.etag, file.size_bytes,
                             f"s3://{self.bucket}/{file.locator}", adapter_id,
                             lambda: self._on_error("get"))
        # The HEAD brings the registry's own checksums, if it keeps any, while the bytes flow;
        # a SHA-256 is computed only when there is one to compare with (CRC-32 always is).
        head_task = asyncio.create_task(self._call(
            "head", adapter_id, self._client.head_object, Bucket=self.bucket, Key=file.locator,
            IfMatch=file.etag, ChecksumMode="ENABLED"))
        wants_sha256: asyncio.Future[bool] = loop.create_future()

        def answer(head: asyncio.Task[Any]) -> None:
            if not wants_sha256.done():  # a cancelled download cancelled its waiter already
                wants_sha256.set_result(sha256 or (
                    not head.cancelled() and head.exception() is None
                    and _checksum(head.result(), "SHA256") is not None))

        head_task.add_done_callback(answer)
        try:
            digests = await download(reader.open, dest, file.size_bytes, self._policy, on_bytes,
                                     sha256=wants_sha256, inspect=inspect)
            head = await head_task
        finally:
            if not head_task.done():
                head_task.cancel()
                await asyncio.gather(head_task, return_exceptions=True)
        return FetchedFile(crc32_hex(digests.crc32), digests.sha256,
                           registry_crc32=_checksum(head, "CRC32"),
                           registry_sha256=_checksum(head, "SHA256"))

    async def _presign(self, adapter_id: str, file: RemoteFile) -> str:
        url: str = await self._call(
            "presign", adapter_id, self._client.generate_presigned_url,
            ClientMethod="get_object", Params={"Bucket": self.bucket, "Key": file.locator},
            ExpiresIn=PRESIGNED_URL_TTL_S)
        return url

    async def _call(
        self, operation: str, adapter_id: str | None, method: Any, **kwargs: Any
    ) -> Any:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                return await method(**kwargs)
        except (bce.BotoCoreError, bce.ClientError, TimeoutError, OSError) as exc:
            error = self._translate(exc, operation, adapter_id)
            if isinstance(error, SourceUnavailable):
                # botocore made --s3-max-attempts already; retrying the part on top of that
                # would multiply them (a stalled registry held a stage attempts^2 timeouts).
                error.retryable = False
            raise error from exc

    def _translate(
        self, exc: BaseException, operation: str, adapter_id: str | None
    ) -> SidecarError:
        self._on_error(operation)
        where = self.description
        if isinstance(exc, bce.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status == 404 and (not code or code.isdigit()) and operation != "head":
                # S3 answers every 404 but a HEAD's with an XML error naming its code; botocore
                # gives the bare status as the code when there is none.
                return SourceError(f"the endpoint {self._endpoint()} answered 404 without an "
                                   f"S3 error to a {operation} of {where}: is it an S3 "
                                   "endpoint? Check --s3-endpoint-url", adapter_id=adapter_id,
                                   cause="not_s3")
            if code in ("ExpiredToken", "TokenRefreshRequired", "RequestExpired"):
                return SourceError(f"the registry {where} says the credentials expired "
                                   f"({code}): check this machine's clock (NTP) and that the "
                                   "credential source renews short-lived credentials (STS, "
                                   "IRSA)", adapter_id=adapter_id, cause="credentials_expired")
            if code == "RequestTimeTooSkewed":
                return SourceError(f"the registry {where} refused the request: this machine's "
                                   "clock differs too much from the registry's; check NTP",
                                   adapter_id=adapter_id, cause="clock")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"):
                return SourceError(f"the registry {where} refused the credentials ({code}): "
                                   "check the AWS credential chain", adapter_id=adapter_id,
                                   cause="credentials")
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return SourceError(f"access denied to {where} ({code or status}): check the "
                                   "credentials' permissions on the bucket",
                                   adapter_id=adapter_id, cause="permission")
            if code == "NoSuchBucket":
                return SourceError(f"the bucket {self.bucket!r} does not exist at "
                                   f"{self._endpoint()}", adapter_id=adapter_id, cause="bucket")
            if code in ("PreconditionFailed", "NoSuchKey") or status in (404, 412):
                what = f"an object of {adapter_id}" if adapter_id else "an object"
                return SourceChanged(f"{what} changed or vanished in {where} while it was "
                                     f"being fetched ({code or status})",
                                     adapter_id=adapter_id, cause="object_changed")
            if status >= 500 or code in ("SlowDown", "InternalError", "ServiceUnavailable"):
                return SourceUnavailable(f"the registry {where} failed ({code or status}) "
                                         f"after {self._settings.s3_max_attempts} attempts",
                                         adapter_id=adapter_id, cause="server")
            return SourceError(f"the registry {where} refused {operation} ({code or status}): "
                               f"{exc}", adapter_id=adapter_id, cause="refused")
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return SourceError("no usable AWS credentials: set AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY, a profile, or an instance role",
                               adapter_id=adapter_id, cause="credentials")
        if isinstance(exc, bce.ConnectTimeoutError | bce.ReadTimeoutError | TimeoutError):
            return SourceUnavailable(f"the registry {where} at {self._endpoint()} did not answer "
                                     f"in time ({operation})", adapter_id=adapter_id,
                                     cause="timeout")
        if isinstance(exc, bce.EndpointConnectionError | bce.ConnectionClosedError):
            return SourceUnavailable(f"cannot connect to the registry endpoint "
                                     f"{self._endpoint()}: {exc}", adapter_id=adapter_id,
                                     cause="endpoint")
        if isinstance(exc, bce.IncompleteReadError | aiohttp.ClientPayloadError):
            return SourceUnavailable(f"the registry {where} sent a body shorter than its "
                                     f"Content-Length", adapter_id=adapter_id, cause="short_body")
        return SourceUnavailable(f"the connection to the registry {where} failed "
                                 f"({type(exc).__name__}: {exc})", adapter_id=adapter_id,
                                 cause="connection")

    def _endpoint(self) -> str:
        return hide_password(self._settings.s3_endpoint_url or "AWS S3")


def _checksum(response: dict[str, Any], algorithm: str) -> str | None:
    """The registry's full-object checksum of one algorithm, as hex, if it keeps one.

    A multipart upload's checksum is a checksum of its parts' checksums unless S3 says
    FULL_OBJECT; some S3-compatible servers return it without S3's "-N" suffix or a type, so
    a multipart ETag ("...-N") with no stated type is taken as composite, never compared.
    """
    checksum_type = response.get("ChecksumType")
    if _MULTIPART_ETAG.search(str(response.get("ETag", ""))) and checksum_type != "FULL_OBJECT":
        return None
    return s3_checksum_hex(response.get(f"Checksum{algorithm}"), checksum_type)
