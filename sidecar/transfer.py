"""Download one object into a pre-sized file: parallel ranged parts written with positional
writes, SHA-256 computed in order while later parts still stream, retries per part.

Knows nothing of S3: the source hands in `fetch_range`, an async iterator of body chunks.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import random
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import SourceUnavailable

log = logging.getLogger(__name__)

FetchRange = Callable[[int, int], AsyncGenerator[bytes, None]]
"""fetch_range(start, end) yields the object's bytes [start, end) in chunks; it raises
SourceUnavailable for transient faults (retried here unless marked not retryable) and other
SidecarErrors for final ones."""

WRITE_CHUNK_BYTES = 1024 * 1024  # bytes gathered before one pwrite: few thread hops, small RAM
MAX_WRITE_BUFFERS = 256  # chunks in one pwritev, well under IOV_MAX (1024)
HASH_CHUNK_BYTES = 4 * 1024 * 1024
MIN_SPLIT_PART_BYTES = 1024 * 1024  # no finer ranges than this when spreading a file out
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class TransferPolicy:
    part_size_bytes: int
    attempts: int
    limiter: asyncio.Semaphore  # shared by every download of the process
    concurrency: int = 1  # the limiter's size: how many parts can stream at once


def part_starts(size_bytes: int, policy: TransferPolicy) -> list[int]:
    """Where each ranged GET of an object starts.

    An object up to one part size is one GET. A larger one is cut into equal parts of at most
    the part size, as many as fill every round of `concurrency` parallel GETs (never below
    MIN_SPLIT_PART_BYTES): 40 parts would leave the third of three rounds half idle, so 48
    are fetched; a 27 MB file becomes 16 parts of 1.7 MB rather than 4 of 8 MiB, so a link
    that limits each connection carries it four times as fast.
    """
    if size_bytes <= policy.part_size_bytes:
        return [0]
    count = -(-size_bytes // policy.part_size_bytes)
    rounds = -(-count // policy.concurrency)
    count = max(count, min(rounds * policy.concurrency, size_bytes // MIN_SPLIT_PART_BYTES))
    part = -(-size_bytes // count)
    return list(range(0, size_bytes, part))


def backoff_s(attempt: int) -> float:
    """Capped exponential backoff with full jitter (attempt counts from 1)."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1)))


class _Progress:
    """Which bytes are on disk: per part, how far its contiguous prefix reaches."""

    def __init__(self, size_bytes: int, starts: list[int]) -> None:
        self.starts = starts
        self.ends = [*starts[1:], size_bytes]
        self.done_upto = list(self.starts)
        self.changed = asyncio.Event()

    def advance(self, part: int, offset: int) -> None:
        self.done_upto[part] = offset
        self.changed.set()

    def contiguous_end(self) -> int:
        """Offset below which every byte is written."""
        for part, end in enumerate(self.ends):
            if self.done_upto[part] < end:
                return self.done_upto[part]
        return self.ends[-1]


async def download(
    fetch_range: FetchRange,
    dest: Path,
    size_bytes: int,
    policy: TransferPolicy,
    on_bytes: Callable[[int], None] = lambda _: None,
) -> str:
    """Write the object to `dest` (created, pre-sized) and return its SHA-256 hex digest.

    The file is fsynced before returning. On any error the partial file is left for the caller
    to delete with its staging folder.
    """
    fd = await asyncio.to_thread(_open_presized, dest, size_bytes)
    try:
        progress = _Progress(size_bytes, part_starts(size_bytes, policy))
        hasher = asyncio.create_task(_hash_in_order(dest, size_bytes, progress))
        parts = [
            asyncio.create_task(_fetch_part(fetch_range, fd, i, progress, policy, on_bytes))
            for i in range(len(progress.starts))
        ]
        try:
            await asyncio.gather(*parts)
            digest = await hasher
        finally:
            for task in (*parts, hasher):
                task.cancel()
            await asyncio.gather(*parts, hasher, return_exceptions=True)
        await asyncio.to_thread(os.fsync, fd)
        return digest
    finally:
        os.close(fd)


def _open_presized(dest: Path, size_bytes: int) -> int:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        if size_bytes > 0:
            try:
                # Reserves the blocks now: a full disk fails here, before any byte is fetched.
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _fetch_part(
    fetch_range: FetchRange,
    fd: int,
    part: int,
    progress: _Progress,
    policy: TransferPolicy,
    on_bytes: Callable[[int], None],
) -> None:
    start, end = progress.starts[part], progress.ends[part]
    offset = start
    attempt = 0
    while offset < end:
        attempt += 1
        try:
            async with policy.limiter:
                offset = await _stream_into(fetch_range, fd, part, offset, end, progress, on_bytes)
        except SourceUnavailable as exc:
            offset = progress.done_upto[part]
            if attempt >= policy.attempts or not exc.retryable:
                raise
            delay = backoff_s(attempt)
            log.debug("retrying part %d from byte %d in %.2fs: %s", part, offset, delay, exc)
            await asyncio.sleep(delay)
        else:
            if offset < end:  # a body that ended early without an error: resume the range
                if attempt >= policy.attempts:
                    raise SourceUnavailable(
                        f"the registry sent {offset - start} of {end - start} bytes of a range",
                        cause="short_body",
                    )


async def _stream_into(
    fetch_range: FetchRange,
    fd: int,
    part: int,
    offset: int,
    end: int,
    progress: _Progress,
    on_bytes: Callable[[int], None],
) -> int:
    """Stream [offset, end) to disk; return how far it got. Progress survives a failure."""
    # Chunks are kept as the socket delivered them and written with one pwritev: gathering
    # them into a buffer first cost two copies of every byte on the event loop's thread.
    pending: list[bytes] = []
    pending_bytes = 0
    chunks = fetch_range(offset, end)
    try:
        async for chunk in chunks:
            if offset + pending_bytes + len(chunk) > end:
                raise SourceUnavailable(
                    "the registry sent more bytes than the range asked for", cause="long_body"
                )
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes >= WRITE_CHUNK_BYTES or len(pending) >= MAX_WRITE_BUFFERS:
                offset = await _flush(fd, pending, offset, part, progress, on_bytes)
                pending_bytes = 0
    except SourceUnavailable:
        if pending:  # keep what arrived: the retry resumes after it
            await _flush(fd, pending, offset, part, progress, on_bytes)
        raise
    finally:
        await chunks.aclose()
    if pending:
        offset = await _flush(fd, pending, offset, part, progress, on_bytes)
    return offset


async def _flush(
    fd: int,
    pending: list[bytes],
    offset: int,
    part: int,
    progress: _Progress,
    on_bytes: Callable[[int], None],
) -> int:
    """Write and empty `pending`; return the offset after it."""
    written = await asyncio.to_thread(_pwrite_all, fd, pending, offset)
    pending.clear()
    offset += written
    progress.advance(part, offset)
    on_bytes(written)
    return offset


def _pwrite_all(fd: int, buffers: list[bytes], offset: int) -> int:
    views = [memoryview(b) for b in buffers if b]
    total = 0
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        total += written
        while views and written >= len(views[0]):  # drop what is written, trim a part-write
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return total


async def _hash_in_order(path: Path, size_bytes: int, progress: _Progress) -> str:
    """Hash bytes as soon as every byte before them is on disk (read back from the page
    cache), so the digest is ready moments after the last part lands."""
    digest = hashlib.sha256()
    hashed = 0
    # One buffer reused for every read: a fresh 4 MiB object per read left the allocator's
    # per-thread arenas holding tens of MB for the rest of the process's life.
    buffer = bytearray(HASH_CHUNK_BYTES)
    read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while hashed < size_bytes:
            ready = progress.contiguous_end()
            if ready <= hashed:
                progress.changed.clear()
                if progress.contiguous_end() <= hashed:
                    await progress.changed.wait()
                continue
            length = min(ready - hashed, HASH_CHUNK_BYTES)
            await asyncio.to_thread(_hash_range, read_fd, digest, buffer, hashed, length)
            hashed += length
    finally:
        os.close(read_fd)
    return digest.hexdigest()


def _hash_range(
    fd: int, digest: hashlib._Hash, buffer: bytearray, offset: int, length: int
) -> None:
    with memoryview(buffer)[:length] as view:
        if os.preadv(fd, [view], offset) != length:
            raise OSError(f"short read at byte {offset} while hashing")
        digest.update(view)
