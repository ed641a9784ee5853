"""Download one object into a pre-sized file (or, a small one, into memory): parallel ranged
parts written with positional writes, a CRC-32 of each part computed from the bytes as they
land (combined into the file's), SHA-256 in order alongside when asked for, retries per part.
The SHA-256 advances in the worker threads over the object's contiguous prefix: a chunk that
lands at the hashed offset is hashed in the buffer it landed in; bytes that landed beyond the
prefix are read back once it reaches them (`_PrefixHash`). An object of one part is fetched
by one worker-thread job per attempt (`_OnePart`): its range opened, the file created, the bytes
copied, checked and hashed, the file fsynced.

Knows nothing of S3: the registry hands in `open_range`, which opens one ranged read. The bytes
move in worker threads (socket -> buffer -> file, the GIL released in each system call), so
the event loop only schedules them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..core.errors import RegistryUnavailable, SidecarError
from ..core.filehash import crc32
from .checksum import crc32_combine

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class RangeStream(Protocol):
    """The body of one ranged read, read from one worker thread at a time (blocking)."""

    def readinto(self, buffer: memoryview) -> int:
        """Bytes read into `buffer`; 0 once the body has ended. Raises RegistryUnavailable for
        a transient fault."""
        ...

    def close(self) -> None:
        """Done with it, from the thread that read it: a body read to its end lets its
        connection be reused; any other is closed."""
        ...

    def abort(self) -> None:
        """Give up part-way, from any thread: a read blocked in another thread ends (with an
        error); `close()` still follows once no thread reads."""
        ...


Write = Callable[[memoryview, int], None]
"""write(chunk, offset), from a worker thread: the chunk's bytes put at their offset (a file's
positional write, or a buffer in memory)."""

OpenRange = Callable[[int, int], RangeStream]
"""open_range(start, end) starts reading the object's bytes [start, end); blocking, run in a
worker thread. Raises RegistryUnavailable for transient faults (retried here unless marked not
retryable) and other SidecarErrors for final ones."""

CHUNK_BYTES = 1024 * 1024  # read into one buffer, then one pwrite: few system calls, small RAM
READ_BACK_BYTES = 1024 * 1024  # the hasher's one buffer for bytes read back from the file
# How far the contiguous bytes may run ahead of the SHA-256 before the other range threads
# wait for it: a fair scheduler gives the one hashing thread a 33rd of the CPU beside 32
# copying ones, and the hash, left to finish after the last byte, became the stage's tail.
HASH_LAG_BYTES = 32 * 1024 * 1024
# No finer ranges than this when spreading a file out. Each GET has a fixed cost at the server:
# against s3rver on loopback, 27 ranges of 1 MiB staged a 27 MB file in 0.11-0.13 s where 13
# of 2 MiB took 0.08-0.10 s, and on the shaped link both took 0.17 s (4 MiB: 0.26 s).
MIN_SPLIT_PART_BYTES = 2 * 1024 * 1024
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
DEFAULT_ATTEMPTS = 5  # per part, for a registry kind without a setting of its own (a folder)


@dataclass(frozen=True, slots=True)
class TransferPolicy:
    part_size_bytes: int
    attempts: int  # per part; each kind may set its own (S3: --s3-max-attempts)
    limiter: asyncio.Semaphore  # shared by every download of the process
    concurrency: int = 1  # the limiter's size: how many parts can stream at once
    # Threads that block on the network: the loop's default pool (a few threads on a small
    # machine) would cap parallel parts at its size and starve every other to_thread call.
    executor: concurrent.futures.ThreadPoolExecutor | None = None


def transfer_executor(concurrency: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="transfer")


_fallback: list[concurrent.futures.ThreadPoolExecutor] = []


def _shared_executor() -> concurrent.futures.ThreadPoolExecutor:
    """For a policy built without an executor (tools, tests)."""
    if not _fallback:
        _fallback.append(transfer_executor(16))
    return _fallback[0]


def part_starts(size_bytes: int, policy: TransferPolicy) -> list[int]:
    """Where each ranged GET of an object starts.

    An object up to one part size is one GET. A larger one is cut into equal parts of at most
    the part size, as many as fill every round of `concurrency` parallel GETs (never below
    MIN_SPLIT_PART_BYTES): 40 parts would leave the third of three rounds half idle, so 48
    are fetched; a 27 MB file becomes 12 parts of 2.25 MB rather than 4 of 8 MiB, so a link
    that limits each connection carries it three times as fast.
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
        self.crc32 = [0] * len(starts)  # of each part's bytes below done_upto

    def advance(self, part: int, offset: int) -> None:
        self.done_upto[part] = offset

    def whole_crc32(self) -> int:
        """The object's CRC-32, combined from its parts' once every part is done."""
        crc = self.crc32[0]
        for part in range(1, len(self.starts)):
            crc = crc32_combine(crc, self.crc32[part], self.ends[part] - self.starts[part])
        return crc


ReadBack = Callable[[int, int], memoryview]
"""read_back(offset, length): the object's bytes [offset, offset + length), already written,
as a view valid until the next call (from the file, or the buffer of a download into memory)."""


class _PrefixHash:
    """The SHA-256 of one download, advanced over the object's contiguous prefix by whichever
    worker thread extends it. The range thread whose chunk lands at the hashed offset hashes it
    in the buffer it landed in, and goes on over whatever other ranges wrote beyond it meanwhile
    (read back: they have left memory) until the prefix ends; a thread whose chunk lands beyond
    the prefix only records it, and waits while the hash is more than HASH_LAG_BYTES behind.
    So the digest follows the bytes as they arrive, and an object that arrives in order is
    never read back.

    One owner: `_lock` guards `_written`, `_frontier`, `_hashed`, `_enabled`, `_owner` and
    `_failed`; only the thread that set `_owner` (under the lock) feeds `_digest` and calls
    `_read_back`, over [_hashed, contiguous end) and nothing else, so each byte is hashed once
    and in order. A retried range resumes at the end of what it wrote, never rewriting a byte;
    a chunk is hashed after it is written and before the value check may overwrite it. A
    download whose bytes fail the registry's checksum is fetched again with a hasher of its own.
    """

    def __init__(self, starts: list[int], ends: list[int], read_back: ReadBack,
                 enabled: bool) -> None:
        self._lock = threading.Lock()
        self._caught_up = threading.Condition(self._lock)  # the owner hashed, let go or failed
        self._ends = ends
        self._written = list(starts)  # per part, the end of its bytes written so far
        self._frontier = 0  # the first part not entirely written (or the last part)
        self._hashed = 0
        self._enabled = enabled
        self._owner = False
        self._failed = False
        self._digest = hashlib.sha256()
        self._read_back = read_back

    def enable(self) -> None:
        """Start hashing (a SHA-256 wanted once the bytes already flow): the next chunk to
        land, or `finish`, catches up from the first byte."""
        with self._lock:
            self._enabled = True

    def landed(self, part: int, offset: int, chunk: memoryview) -> None:
        """From the range thread that has just written `chunk` at `offset` and still holds it."""
        with self._lock:
            self._written[part] = offset + len(chunk)
            start = self._claim()
            if start is None:
                self._keep_pace()
        if start is not None:
            self._advance(start, chunk, offset)

    def finish(self) -> str:
        """Once every range is written and no thread lands any more: hash what is left (all of
        it if the hash was enabled late) and return the digest."""
        with self._lock:
            self._enabled = True
            start = self._claim()
        if start is not None:
            self._advance(start, memoryview(b""), 0)
        with self._lock:
            if self._failed or self._owner or self._hashed != self._ends[-1]:
                raise RuntimeError(f"hashed {self._hashed} of {self._ends[-1]} bytes")
        return self._digest.hexdigest()

    def _contiguous_end(self) -> int:  # under the lock
        last = len(self._ends) - 1
        while self._frontier < last and self._written[self._frontier] == self._ends[self._frontier]:
            self._frontier += 1
        return self._written[self._frontier]

    def _keep_pace(self) -> None:  # under the lock, in a thread that is not the owner
        """Wait while the hash is more than HASH_LAG_BYTES behind the contiguous bytes. The
        owner never waits, and wakes every waiter once it is half that behind, lets go or
        fails; the bytes it hashes are written already, so it never waits for a waiter."""
        while self._lagging(HASH_LAG_BYTES):
            self._caught_up.wait()

    def _lagging(self, lag_bytes: int) -> bool:  # under the lock
        return (self._owner and not self._failed
                and self._contiguous_end() - self._hashed > lag_bytes)

    def _claim(self) -> int | None:  # under the lock
        """Become the owner if there is something to hash and no owner: where to start."""
        if (self._owner or self._failed or not self._enabled
                or self._contiguous_end() <= self._hashed):
            return None
        self._owner = True
        return self._hashed

    def _advance(self, hashed: int, chunk: memoryview, chunk_offset: int) -> None:
        """As the owner, from `hashed`: hash up to the contiguous end until it stops moving,
        then let go. After an error the hash has failed: the digest is unusable, the download
        fails."""
        chunk_end = chunk_offset + len(chunk)
        try:
            while True:
                with self._lock:
                    self._hashed = hashed
                    upto = self._contiguous_end()
                    if upto <= hashed:
                        self._owner = False
                        self._caught_up.notify_all()
                        return
                    if not self._lagging(HASH_LAG_BYTES // 2):
                        self._caught_up.notify_all()
                if chunk_offset <= hashed < chunk_end:  # still in this thread's buffer
                    piece = chunk[hashed - chunk_offset:min(upto, chunk_end) - chunk_offset]
                else:
                    stop = chunk_offset if hashed < chunk_offset < upto else upto
                    piece = self._read_back(hashed, min(stop - hashed, READ_BACK_BYTES))
                self._digest.update(piece)
                hashed += len(piece)
        except BaseException:
            with self._lock:
                self._failed = True
                self._caught_up.notify_all()
            raise


class _FileReadBack:
    """Reads written bytes back from the file, into one buffer made on first use (only the
    hasher's owner calls it: one call at a time)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer: memoryview | None = None

    def __call__(self, offset: int, length: int) -> memoryview:
        if self._buffer is None:
            self._buffer = memoryview(bytearray(READ_BACK_BYTES))
        view = self._buffer[:length]
        if os.preadv(self._fd, [view], offset) != length:
            raise OSError(f"short read at byte {offset} while hashing")
        return view


class _Threads:
    """Worker-thread jobs of one download. A thread cannot be cancelled, so a descriptor its
    jobs use is closed only once none is running (`close_when_idle`), and the download waits
    for every job it started before it returns."""

    def __init__(self, executor: concurrent.futures.ThreadPoolExecutor | None) -> None:
        self._executor = executor or _shared_executor()
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()  # done callbacks run in the worker threads
        self._to_close: list[int] = []

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        future = self._executor.submit(fn, *args)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._running.discard(future)
            if self._running:
                return  # the last job to end closes what waits for it
            closing, self._to_close = self._to_close, []
        for fd in closing:
            os.close(fd)

    def close_when_idle(self, fd: int) -> None:
        """Close `fd` now, or when the last running job ends if any is running."""
        with self._lock:
            if self._running:
                self._to_close.append(fd)
                return
        os.close(fd)

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def acquire(self, release: Callable[[_T], object], fn: Callable[..., _T],
                      *args: Any) -> _T:
        """`fn(*args)` in a worker thread, for something that must be released (a descriptor,
        a connection). When the caller is cancelled meanwhile, the thread still finishes and
        what it acquired is released then, never leaked."""
        future = self.submit(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(functools.partial(_release_acquired, release))
            raise

    async def drain(self) -> None:
        with self._lock:
            running = list(self._running)
        if running:
            await asyncio.to_thread(concurrent.futures.wait, running)


def _release_acquired(release: Callable[[_T], object],
                      future: concurrent.futures.Future[_T]) -> None:
    if not future.cancelled() and future.exception() is None:
        release(future.result())


def _discard(stream: RangeStream) -> None:
    """A range opened after its download was cancelled: nothing reads it."""
    stream.abort()
    stream.close()


async def open_in_thread(executor: concurrent.futures.ThreadPoolExecutor | None,
                         path: str | Path, flags: int) -> int:
    """os.open in a worker thread (a slow filesystem never blocks the loop); a descriptor
    opened after the caller was cancelled is closed, not leaked."""
    return await _Threads(executor).acquire(os.close, os.open, path, flags)


class Inspector(Protocol):
    """Something that looks at the bytes of one download as they land (the value check)."""

    def stream(self, offset: int) -> Callable[[int, memoryview], None]:
        """The callback of one sequential read starting at `offset`: called from one worker
        thread at a time with each chunk, once it is written and hashed; it may overwrite the
        chunk, which is scratch space by then."""
        ...


@dataclass(frozen=True, slots=True)
class Digests:
    crc32: int
    sha256: str | None  # computed only when asked for


async def download(
    open_range: OpenRange,
    dest: Path,
    size_bytes: int,
    policy: TransferPolicy,
    on_bytes: Callable[[int], None] = lambda _: None,
    *,
    sha256: asyncio.Future[bool] | bool = False,
    inspect: Inspector | None = None,
    owned_fds: tuple[int, ...] = (),
) -> Digests:
    """Write the object to `dest` (created, pre-sized) and return its checksums.

    `sha256` says whether to compute a SHA-256 too; it may be a future that answers while
    the bytes already flow (the hash then catches up from the first byte, read back).
    `inspect` sees every chunk in the worker thread that wrote it. `owned_fds` (descriptors
    the ranges read from) are closed here, once no worker thread uses them. The file is
    fsynced before returning. On any error the partial file is left for the caller to delete
    with its staging folder.
    """
    if _one_job(size_bytes, policy, sha256):
        one = _OnePart(open_range, size_bytes, sha256 is True, inspect, dest=dest)
        await _fetch_one_part(one, policy, on_bytes, owned_fds)
        return one.digests()
    threads = _Threads(policy.executor)
    try:
        fd = await threads.acquire(os.close, _open_presized, dest, size_bytes)
    except BaseException:
        for owned in owned_fds:
            os.close(owned)
        raise
    tasks: list[asyncio.Task[Any]] = []
    try:
        progress = _Progress(size_bytes, part_starts(size_bytes, policy))
        hasher = _PrefixHash(progress.starts, progress.ends, _FileReadBack(fd),
                             enabled=sha256 is True)
        if not isinstance(sha256, bool):
            sha256.add_done_callback(functools.partial(_enable_if_wanted, hasher))
        write = functools.partial(_write_at, fd)
        tasks.extend(
            asyncio.create_task(
                _fetch_part(open_range, write, i, progress, policy, threads, on_bytes, inspect,
                            hasher)
            )
            for i in range(len(progress.starts))
        )
        await asyncio.gather(*tasks)
        wanted = sha256 if isinstance(sha256, bool) else await sha256
        digest = await threads.run(hasher.finish) if wanted else None
        await threads.run(os.fsync, fd)
        return Digests(progress.whole_crc32(), digest)
    finally:
        await _wind_down(tasks, threads, (fd, *owned_fds))


async def download_bytes(
    open_range: OpenRange,
    size_bytes: int,
    policy: TransferPolicy,
    on_bytes: Callable[[int], None] = lambda _: None,
    *,
    owned_fds: tuple[int, ...] = (),
) -> tuple[bytes, Digests]:
    """The object into memory, with its CRC-32 and SHA-256: the same ranged parts, retries and
    checks as `download`, nothing written to disk. For the few small files judged before room
    is reserved; the caller bounds `size_bytes` (it is allocated at once)."""
    if _one_job(size_bytes, policy, True):
        one = _OnePart(open_range, size_bytes, True, None, buffer=bytearray(size_bytes))
        await _fetch_one_part(one, policy, on_bytes, owned_fds)
        return one.data(), one.digests()
    threads = _Threads(policy.executor)
    buffer = bytearray(size_bytes)
    view = memoryview(buffer)
    progress = _Progress(size_bytes, part_starts(size_bytes, policy))
    hasher = _PrefixHash(progress.starts, progress.ends,
                         lambda offset, length: view[offset:offset + length], enabled=True)
    write = functools.partial(_put, view)
    parts = [
        asyncio.create_task(
            _fetch_part(open_range, write, i, progress, policy, threads, on_bytes, None, hasher))
        for i in range(len(progress.starts))
    ]
    try:
        await asyncio.gather(*parts)
        digest = await threads.run(hasher.finish)
        return bytes(buffer), Digests(progress.whole_crc32(), digest)
    finally:
        await _wind_down(parts, threads, owned_fds)


async def _wind_down(tasks: list[asyncio.Task[Any]], threads: _Threads,
                     fds: tuple[int, ...]) -> None:
    """The end of every download, however it ended: its tasks cancelled and waited for, then
    its worker threads; `fds` closed once no thread uses them. A second cancellation may cut
    the waits short; the descriptors still outlive every thread that uses them."""
    for task in tasks:
        task.cancel()
    try:
        await asyncio.gather(*tasks, return_exceptions=True)
        await threads.drain()
    finally:
        for fd in fds:
            threads.close_when_idle(fd)


def _one_job(size_bytes: int, policy: TransferPolicy, sha256: asyncio.Future[bool] | bool) -> bool:
    """An object of one part whose hashing is decided already: one worker-thread job per
    attempt (each hand-off waits for the event loop: a few-KB file took four)."""
    return (size_bytes > 0 and isinstance(sha256, bool)
            and len(part_starts(size_bytes, policy)) == 1)


class _OnePart:
    """An object of one part, fetched by one worker-thread job per attempt (`attempt`): the
    range opened (its If-Match and checksum headers are the opener's), the file created on the
    first attempt and opened again on a retry, each chunk written, CRC-32'd, SHA-256'd in order,
    then handed to the inspector, the file fsynced and closed, all in that thread. A retry
    resumes after the bytes already landed, as a ranged part does; each byte is hashed and
    inspected once.

    `abort()` (from the loop, the caller cancelled) wakes a read blocked in the job and makes a
    range opened afterwards be aborted at once; the job still closes what it opened itself.
    """

    def __init__(self, open_range: OpenRange, size_bytes: int, sha256: bool,
                 inspect: Inspector | None, *, dest: Path | None = None,
                 buffer: bytearray | None = None) -> None:
        self._open_range = open_range
        self._size_bytes = size_bytes
        self._digest = hashlib.sha256() if sha256 else None
        self._inspect = inspect
        self._dest = dest
        self._buffer = buffer
        self._created = False
        self.reached = 0  # bytes landed, written and seen, in order from the first
        self._crc = 0
        self._lock = threading.Lock()  # guards _stream and _aborted
        self._stream: RangeStream | None = None
        self._aborted = False

    def digests(self) -> Digests:
        return Digests(self._crc, self._digest.hexdigest() if self._digest is not None else None)

    def data(self) -> bytes:
        assert self._buffer is not None
        return bytes(self._buffer)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            stream = self._stream
        if stream is not None:
            stream.abort()

    def attempt(self) -> None:
        """Worker thread: the rest of the object, from `reached`. Raises RegistryUnavailable
        for a transient fault (what landed before it stays). The range is opened before the
        file is created: a source that fails at once leaves nothing behind."""
        stream = self._open()
        try:
            fd = -1
            if self._dest is not None:
                if self._created:
                    fd = os.open(self._dest, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                else:
                    fd = _open_presized(self._dest, self._size_bytes)
                    self._created = True
        except BaseException:
            self._end(stream, failed=True)
            raise
        try:
            self._copy(stream, fd)
            if fd >= 0:
                os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)

    def _open(self) -> RangeStream:
        stream = self._open_range(self.reached, self._size_bytes)
        with self._lock:
            self._stream, aborted = stream, self._aborted
        if aborted:
            stream.abort()
            stream.close()
            raise RegistryUnavailable("the download was given up", cause="cancelled")
        return stream

    def _end(self, stream: RangeStream, *, failed: bool) -> None:
        with self._lock:
            self._stream, aborted = None, self._aborted
        if failed and not aborted:
            stream.abort()
        stream.close()

    def _copy(self, stream: RangeStream, fd: int) -> None:
        try:
            write = (functools.partial(_write_at, fd) if self._buffer is None
                     else functools.partial(_put, memoryview(self._buffer)))
            look = self._inspect.stream(self.reached) if self._inspect is not None else None
            reached, self._crc, error = _copy_range(
                stream, write, self.reached, self._size_bytes, self._crc, _ignore, look,
                self._hash)
            self.reached = reached
            if error is not None:
                raise error
            if reached < self._size_bytes:
                raise RegistryUnavailable(
                    f"the registry ended a range {self._size_bytes - reached} bytes short",
                    cause="short_body")
        except BaseException:
            self._end(stream, failed=True)
            raise
        self._end(stream, failed=False)

    def _hash(self, offset: int, chunk: memoryview) -> None:
        if self._digest is not None:
            self._digest.update(chunk)


def _ignore(offset_after: int, crc: int, count: int) -> None:
    return None


async def _fetch_one_part(one: _OnePart, policy: TransferPolicy,
                          on_bytes: Callable[[int], None], owned_fds: tuple[int, ...]) -> None:
    """`one`'s attempts, with the retries and backoff of a ranged part. The caller cancelled,
    the job's read is aborted and the job waited for (a thread cannot be cancelled: nothing
    writes into a stage's folder once the stage is gone)."""
    threads = _Threads(policy.executor)
    try:
        attempt = 0
        while True:
            attempt += 1
            before = one.reached
            try:
                async with policy.limiter:
                    await threads.run(one.attempt)
                return
            except RegistryUnavailable as exc:
                if attempt >= policy.attempts or not exc.retryable:
                    raise
                delay = backoff_s(attempt)
                log.debug("retrying an object of one part from byte %d in %.2fs: %s",
                          one.reached, delay, exc)
                await asyncio.sleep(delay)
            finally:
                on_bytes(one.reached - before)
    finally:
        one.abort()
        await _wind_down([], threads, owned_fds)


def _put(buffer: memoryview, chunk: memoryview, offset: int) -> None:
    buffer[offset:offset + len(chunk)] = chunk


def _enable_if_wanted(hasher: _PrefixHash, wanted: asyncio.Future[bool]) -> None:
    if not wanted.cancelled() and wanted.exception() is None and wanted.result():
        hasher.enable()


def _write_at(fd: int, chunk: memoryview, offset: int) -> None:
    _pwrite_all(fd, [chunk], offset)


def _open_presized(dest: Path, size_bytes: int) -> int:
    """Create the file at its full size, sparse: parts land at their offsets in any order (read
    and write: the hasher reads back what landed beyond the hashed prefix).

    Not posix_fallocate: on tmpfs it zeroes every page before the first GET (a fifth of a
    loopback stage), and glibc's emulation on filesystems without fallocate writes zeros
    that could race with the parts. Room is checked before the download (the store's
    reservation); a disk that fills up meanwhile fails a write with ENOSPC, answered 507.
    """
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, size_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def _fetch_part(
    open_range: OpenRange,
    write: Write,
    part: int,
    progress: _Progress,
    policy: TransferPolicy,
    threads: _Threads,
    on_bytes: Callable[[int], None],
    inspect: Inspector | None,
    hasher: _PrefixHash,
) -> None:
    end = progress.ends[part]
    attempt = 0
    while progress.done_upto[part] < end:
        attempt += 1
        try:
            async with policy.limiter:
                await _stream_part(open_range, write, part, progress, threads, on_bytes, inspect,
                                   hasher)
        except RegistryUnavailable as exc:
            if attempt >= policy.attempts or not exc.retryable:
                raise
            delay = backoff_s(attempt)
            log.debug("retrying part %d from byte %d in %.2fs: %s", part,
                      progress.done_upto[part], delay, exc)
            await asyncio.sleep(delay)


async def _stream_part(
    open_range: OpenRange,
    write: Write,
    part: int,
    progress: _Progress,
    threads: _Threads,
    on_bytes: Callable[[int], None],
    inspect: Inspector | None,
    hasher: _PrefixHash,
) -> None:
    """Read the rest of one part to disk in one worker-thread job (a job per chunk left the
    socket unread while each hop waited for the loop); what arrived before a fault stays,
    and the retry resumes after it."""
    offset, end = progress.done_upto[part], progress.ends[part]
    loop = asyncio.get_running_loop()

    def landed(offset_after: int, crc: int, count: int) -> None:  # on the loop
        progress.advance(part, offset_after)
        progress.crc32[part] = crc
        on_bytes(count)

    def report(offset_after: int, crc: int, count: int) -> None:  # from the worker thread
        loop.call_soon_threadsafe(landed, offset_after, crc, count)

    stream = await threads.acquire(_discard, open_range, offset, end)
    copy: concurrent.futures.Future[tuple[int, int, SidecarError | None]] | None = None
    try:
        look = inspect.stream(offset) if inspect is not None else None
        copy = threads.submit(
            _copy_range, stream, write, offset, end, progress.crc32[part], report, look,
            functools.partial(hasher.landed, part),
        )
        reached, crc, error = await asyncio.wrap_future(copy)
        # Reports queued by the thread run before this line; set the final state regardless.
        progress.advance(part, reached)
        progress.crc32[part] = crc
        if error is not None:
            raise error
        if reached < end:
            raise RegistryUnavailable(
                f"the registry ended a range {end - reached} bytes short", cause="short_body"
            )
    except BaseException:
        stream.abort()  # a read still blocked in the worker thread ends
        if copy is None:
            stream.close()
        else:  # closed once the thread is done with it, never under its read
            copy.add_done_callback(lambda _: stream.close())
        raise
    stream.close()


def _copy_range(
    stream: RangeStream, write: Write, offset: int, end: int, crc: int,
    report: Callable[[int, int, int], None], look: Callable[[int, memoryview], None] | None,
    land: Callable[[int, memoryview], None],
) -> tuple[int, int, SidecarError | None]:
    """Worker thread: copy [offset, end) from the stream to its destination a buffer at a time,
    with a running CRC-32, handing each chunk written to `land(offset, chunk)` (the SHA-256's
    prefix) and then to `look` (which may overwrite the buffer).
    Returns how far it got, the CRC of the part up to there, and the fault that stopped it
    early, if any; bytes that arrived before a fault are kept."""
    buffer = bytearray(min(CHUNK_BYTES, end - offset))
    view = memoryview(buffer)
    while offset < end:
        want = min(len(buffer), end - offset)
        got = 0
        error: SidecarError | None = None
        try:
            while got < want:
                n = stream.readinto(view[got:want])
                if n == 0:
                    break
                got += n
        except SidecarError as exc:
            error = exc
        if got:
            chunk = view[:got]
            write(chunk, offset)
            crc = crc32(chunk, crc)
            land(offset, chunk)
            if look is not None:
                look(offset, chunk)
            offset += got
            report(offset, crc, got)
        if error is not None or got < want:
            return offset, crc, error
    return offset, crc, None


def _pwrite_all(fd: int, buffers: list[bytes] | list[memoryview], offset: int) -> int:
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

