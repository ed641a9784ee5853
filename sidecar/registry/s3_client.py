"""The S3 registry's client: adapters under s3://bucket/prefix/<adapter_id>/<file> (the only
module that imports aiobotocore; botocore errors stop here). The kind itself, its options and
how it is opened, is s3.py.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import re
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore import exceptions as bce

from ..core.errors import (
    AdapterNotFound,
    RegistryError,
    RegistryObjectChanged,
    RegistryUnavailable,
    SidecarError,
)
from ..core.fsutil import EntryKind
from ..core.ids import is_valid_adapter_id
from ..core.net import hide_password
from .base import Entry, FetchedFile, Listing, RemoteFile, SkippedFolders, is_safe_file_name
from .checksum import crc32_hex, s3_checksum_hex
from .httpranges import RESIGN_AFTER_S, ConnectionPool, RangeReader
from .proxies import botocore_proxies
from .s3errors import NOT_READY_CAUSES, s3_cause
from .transfer import (
    Digests,
    Inspector,
    OpenRange,
    TransferPolicy,
    download,
    download_bytes,
    part_starts,
)

log = logging.getLogger(__name__)
_R = TypeVar("_R")

PRESIGNED_URL_TTL_S = 3600  # longer than any one file's download
# URLs signed while a listing is awaited, kept until their file's fetch takes them: at most
# this many (those of listings whose files were never fetched go first).
SIGNED_AHEAD_MAX = 64
_MULTIPART_ETAG = re.compile(r'-[0-9]+"?$')


@dataclass(frozen=True, slots=True)
class S3Client:
    """How the client talks to S3 (from the kind's options, s3.py)."""

    endpoint_url: str | None  # None: AWS S3
    region: str | None  # None: the AWS credential chain's, else us-east-1
    connect_timeout_s: float
    read_timeout_s: float
    max_attempts: int  # per request, botocore's retries included


class S3Registry:
    """Adapters under s3://bucket/prefix/<adapter_id>/<file>."""

    def __init__(self, location: str, client: S3Client, policy: TransferPolicy,
                 on_error: Callable[[str], None], on_skipped: Callable[[int], None] | None = None):
        bucket, _, prefix = location.removeprefix("s3://").partition("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.description = f"s3://{bucket}/{self.prefix}"
        self._skipped = SkippedFolders(self.description, on_skipped)
        self._s3 = client
        self._policy = policy
        self._on_error = on_error
        self._stack = AsyncExitStack()
        self._client: Any = None
        self._signed_ahead: dict[str, tuple[str, float]] = {}  # key -> URL, signed at
        self._pool = ConnectionPool(client.connect_timeout_s, client.read_timeout_s,
                                    max_idle=policy.concurrency)
        # One call, botocore's own retries included, never waits longer than this.
        self._call_timeout_s = (
            (client.connect_timeout_s + client.read_timeout_s) * client.max_attempts + 20.0
        )

    async def open(self) -> None:
        session = get_session()
        region = self._s3.region or session.get_config_variable("region") or "us-east-1"
        config = AioConfig(
            connect_timeout=self._s3.connect_timeout_s,
            read_timeout=self._s3.read_timeout_s,
            # botocore's "max_attempts" counts retries (one more attempt than asked);
            # "total_max_attempts" counts attempts, as --s3-max-attempts does.
            retries={"total_max_attempts": self._s3.max_attempts, "mode": "standard"},
            max_pool_connections=8,  # listing, HEAD and signing only; bytes use self._pool
            response_checksum_validation="when_required",
            signature_version="s3v4",  # presigned URLs too (botocore may default to v2)
            # Never through a proxy for a loopback endpoint; else the usual variables.
            proxies=botocore_proxies(self._s3.endpoint_url),
        )
        self._client = await self._stack.enter_async_context(
            session.create_client(
                "s3",
                region_name=region,
                endpoint_url=self._s3.endpoint_url,
                config=config,
            )
        )

    async def close(self) -> None:
        await self._stack.aclose()
        self._pool.close()

    async def probe(self) -> None:
        await self._call("probe", None, self._client.list_objects_v2,
                         Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)

    def makes_unready(self, error: SidecarError) -> bool:
        """Unreachable, or refusing what every call needs (credentials, the clock, the bucket,
        an endpoint that is not S3): not a fault of one adapter (s3errors.NOT_READY_CAUSES)."""
        return isinstance(error, RegistryUnavailable) or (
            isinstance(error, RegistryError) and error.cause in NOT_READY_CAUSES)

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

    async def list_files(self, adapter_id: str, *, likely: tuple[str, ...] = ()) -> Listing:
        folder = f"{self.prefix}{adapter_id}/"
        # The likely files' URLs are signed while the listing's answer is awaited: a
        # presign is 0.4-0.7 ms of botocore on the event loop, which is idle meanwhile.
        keys = [f"{folder}{name}" for name in likely if is_safe_file_name(name)]
        signing = asyncio.create_task(self._sign_ahead(keys)) if keys else None
        try:
            listing = await self._list_files(adapter_id, folder)
        except BaseException:
            if signing is not None:
                signing.cancel()
                await asyncio.gather(signing, return_exceptions=True)
            raise
        if signing is not None:
            await signing
        return listing

    async def _list_files(self, adapter_id: str, folder: str) -> Listing:
        files: list[RemoteFile] = []
        others: list[Entry] = []
        token: str | None = None
        listed_at: float | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": folder}
            if token:
                kwargs["ContinuationToken"] = token
            page = await self._call("list", adapter_id, self._client.list_objects_v2, **kwargs)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(folder):]
                if name == "" and obj["Size"] == 0:
                    continue  # a "folder marker" some tools create
                if not is_safe_file_name(name):  # a nested key, or one that would leave
                    others.append(Entry(name, EntryKind.FILE))
                    continue
                modified = obj.get("LastModified")
                files.append(RemoteFile(name, int(obj["Size"]), obj["ETag"], obj["Key"],
                                        modified.timestamp() if modified else None))
            listed_at = listed_at or _answered_at(page)
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        if not files and not others:
            raise AdapterNotFound(
                f"no adapter {adapter_id!r} in the registry {self.description} "
                f"(nothing under {folder})",
                adapter_id=adapter_id,
            )
        return Listing(sorted(files, key=lambda f: f.name), others, listed_at)

    async def fetch(
        self, adapter_id: str, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None],
        *, inspect: Inspector | None = None, sha256: bool = False,
    ) -> FetchedFile:
        async def to_file(open_range: OpenRange, hashed: asyncio.Future[bool] | bool) -> Digests:
            return await download(open_range, dest, file.size_bytes, self._policy, on_bytes,
                                  sha256=hashed, inspect=inspect)

        digests, answer = await self._transfer(adapter_id, file, to_file, sha256=sha256)
        return _fetched(digests, answer)

    async def fetch_bytes(
        self, adapter_id: str, file: RemoteFile, on_bytes: Callable[[int], None],
    ) -> tuple[bytes, FetchedFile]:
        async def to_memory(open_range: OpenRange,
                            hashed: asyncio.Future[bool] | bool) -> tuple[bytes, Digests]:
            return await download_bytes(open_range, file.size_bytes, self._policy, on_bytes)

        (data, digests), answer = await self._transfer(adapter_id, file, to_memory, sha256=True)
        return data, _fetched(digests, answer)

    async def _transfer(
        self, adapter_id: str, file: RemoteFile,
        run: Callable[[OpenRange, asyncio.Future[bool] | bool], Awaitable[_R]], *, sha256: bool,
    ) -> tuple[_R, dict[str, Any]]:
        """`run(open_range, hashed)` moves the bytes (to a file or into memory); returns what it
        returned and the registry's answer that brings its own checksums. `hashed` says whether
        a SHA-256 is wanted, possibly once the HEAD has answered."""
        # One signature for the ranges of the file, signed again when it grows old or the
        # registry says it expired (short-lived credentials); the ranges are plain HTTP.
        # A file of one GET, hashed anyway, is asked for whole with its checksums: its own
        # answer brings what a HEAD would (the bytes' checks are the same, a request less).
        whole = (sha256 and file.size_bytes > 0
                 and len(part_starts(file.size_bytes, self._policy)) == 1)
        ahead = self._signed_ahead.pop(file.locator, None)
        if whole and ahead is not None and time.monotonic() - ahead[1] < RESIGN_AFTER_S:
            url, signed_at = ahead
        else:
            url, signed_at = (await self._presign(adapter_id, file.locator, checksums=whole),
                              time.monotonic())
        loop = asyncio.get_running_loop()

        def sign() -> str:  # from a worker thread: the loop signs
            signing = asyncio.run_coroutine_threadsafe(
                self._presign(adapter_id, file.locator, checksums=whole), loop)
            try:
                return signing.result(self._call_timeout_s)
            except TimeoutError:
                signing.cancel()
                raise RegistryUnavailable(f"signing a URL for {file.locator} took longer than "
                                          f"{self._call_timeout_s:g}s", adapter_id=adapter_id,
                                          cause="timeout") from None

        reader = RangeReader(self._pool, url, sign, file.etag, file.size_bytes,
                             f"s3://{self.bucket}/{file.locator}", adapter_id,
                             lambda: self._on_error("get"), whole=whole, signed_at=signed_at)
        if whole:
            moved = await run(reader.open, True)
            return moved, dict(reader.answered)
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
            # Asked for outright, the hash need not wait for the HEAD's answer.
            moved = await run(reader.open, True if sha256 else wants_sha256)
            head: dict[str, Any] = await head_task
        finally:
            if not head_task.done():
                head_task.cancel()
                await asyncio.gather(head_task, return_exceptions=True)
        return moved, head

    async def _sign_ahead(self, keys: list[str]) -> None:
        """URLs of whole objects with their checksums, signed while their folder is listed;
        `_transfer` takes one if its file is fetched whole soon enough. A key that cannot be
        signed now is signed again when fetched, and its fault counted and reported then."""
        for key in keys:
            try:
                async with asyncio.timeout(self._call_timeout_s):
                    url: str = await self._client.generate_presigned_url(
                        ClientMethod="get_object", ExpiresIn=PRESIGNED_URL_TTL_S,
                        Params={"Bucket": self.bucket, "Key": key, "ChecksumMode": "ENABLED"})
            except (bce.BotoCoreError, bce.ClientError, TimeoutError, OSError) as exc:
                log.debug("signing %s ahead of its listing failed: %s", key, exc)
                return
            self._signed_ahead.pop(key, None)
            self._signed_ahead[key] = (url, time.monotonic())
            while len(self._signed_ahead) > SIGNED_AHEAD_MAX:
                del self._signed_ahead[next(iter(self._signed_ahead))]

    async def _presign(self, adapter_id: str | None, key: str, *, checksums: bool) -> str:
        params = {"Bucket": self.bucket, "Key": key}
        if checksums:
            params["ChecksumMode"] = "ENABLED"
        url: str = await self._call(
            "presign", adapter_id, self._client.generate_presigned_url,
            ClientMethod="get_object", Params=params, ExpiresIn=PRESIGNED_URL_TTL_S)
        return url

    async def _call(
        self, operation: str, adapter_id: str | None, method: Any, **kwargs: Any
    ) -> Any:
        try:
            async with asyncio.timeout(self._call_timeout_s):
                return await method(**kwargs)
        except (bce.BotoCoreError, bce.ClientError, TimeoutError, OSError) as exc:
            error = self._translate(exc, operation, adapter_id)
            if isinstance(error, RegistryUnavailable):
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
            message = str(exc.response.get("Error", {}).get("Message", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            cause = s3_cause(status, code, message, head=operation == "head")
            if cause == "object_changed":
                what = f"an object of {adapter_id}" if adapter_id else "an object"
                return RegistryObjectChanged(f"{what} changed or vanished in {where} while it was "
                                             f"being fetched ({code or status})",
                                             adapter_id=adapter_id, cause=cause)
            if cause == "server":
                return RegistryUnavailable(f"the registry {where} failed ({code or status}) "
                                           f"after {self._s3.max_attempts} attempts",
                                           adapter_id=adapter_id, cause=cause)
            refusals = {
                "not_s3": f"the endpoint {self._endpoint()} answered 404 without an S3 error to "
                          f"a {operation} of {where}: is it an S3 endpoint? Check "
                          "--s3-endpoint-url",
                "credentials_expired": f"the registry {where} says the credentials expired "
                                       f"({code}): check this machine's clock (NTP) and that "
                                       "the credential source renews short-lived credentials "
                                       "(STS, IRSA)",
                "clock": f"the registry {where} refused the request: this machine's clock "
                         "differs too much from the registry's; check NTP",
                "credentials": f"the registry {where} refused the credentials ({code}): check "
                               "the AWS credential chain",
                "permission": f"access denied to {where} ({code or status}): check the "
                              "credentials' permissions on the bucket",
                "bucket": f"the bucket {self.bucket!r} does not exist at {self._endpoint()}",
                "refused": f"the registry {where} refused {operation} ({code or status}): {exc}",
            }
            return RegistryError(refusals[cause], adapter_id=adapter_id, cause=cause)
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return RegistryError("no usable AWS credentials: set AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY, a profile, or an instance role",
                                 adapter_id=adapter_id, cause="credentials")
        if isinstance(exc, bce.ConnectTimeoutError | bce.ReadTimeoutError | TimeoutError):
            return RegistryUnavailable(f"the registry {where} at {self._endpoint()} did not answer "
                                       f"in time ({operation})", adapter_id=adapter_id,
                                       cause="timeout")
        if isinstance(exc, bce.EndpointConnectionError | bce.ConnectionClosedError):
            return RegistryUnavailable(f"cannot connect to the registry endpoint "
                                       f"{self._endpoint()}: {exc}", adapter_id=adapter_id,
                                       cause="endpoint")
        if isinstance(exc, bce.IncompleteReadError | aiohttp.ClientPayloadError):
            return RegistryUnavailable(f"the registry {where} sent a body shorter than its "
                                       f"Content-Length", adapter_id=adapter_id, cause="short_body")
        return RegistryUnavailable(f"the connection to the registry {where} failed "
                                   f"({type(exc).__name__}: {exc})", adapter_id=adapter_id,
                                   cause="connection")

    def _endpoint(self) -> str:
        return hide_password(self._s3.endpoint_url or "AWS S3")


def _answered_at(response: dict[str, Any]) -> float | None:
    """When the registry answered, by its own clock (the Date header, to the second)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        return None


def _fetched(digests: Digests, answer: dict[str, Any]) -> FetchedFile:
    """The file's own checksums beside the registry's (from a HEAD or the GET's answer)."""
    return FetchedFile(crc32_hex(digests.crc32), digests.sha256,
                       registry_crc32=_checksum(answer, "CRC32"),
                       registry_sha256=_checksum(answer, "SHA256"))


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
