"""transfer.py's pure parts: how an object is cut into ranged GETs, positional writes that
land every byte at its offset even when the kernel takes fewer bytes than offered, and a small
object downloaded into memory."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import os
import random
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.core.errors import RegistryUnavailable
from sidecar.registry import transfer
from tests.support.waiting import eventually


def test_pwrite_all_finishes_after_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwritev = os.pwritev
    calls = []

    def short_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        # At most 5 bytes per call, so buffers are split and dropped at every boundary.
        calls.append(offset)
        remaining = 5
        taken = []
        for view in buffers:
            if remaining == 0:
                break
            taken.append(view[:remaining])
            remaining -= len(taken[-1])
        return real_pwritev(fd, taken, offset)

    monkeypatch.setattr(transfer.os, "pwritev", short_pwritev)
    chunks = [b"abc", b"", b"defghijk", b"l", b"mnopqrstuvwxyz"]
    dest = tmp_path / "f"
    fd = os.open(dest, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 30)
        written = transfer._pwrite_all(fd, chunks, 4)
    finally:
        os.close(fd)
    assert written == 26
    assert dest.read_bytes() == b"\0" * 4 + b"abcdefghijklmnopqrstuvwxyz"
    assert len(calls) == 6


def _part_sizes(size_bytes: int, concurrency: int) -> list[int]:
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), concurrency)
    starts = transfer.part_starts(size_bytes, policy)
    return [end - start for start, end in zip(starts, [*starts[1:], size_bytes], strict=True)]


def test_an_object_of_one_part_size_or_less_is_one_get() -> None:
    assert _part_sizes(0, 16) == [0]
    assert _part_sizes(1000, 16) == [1000]
    assert _part_sizes(8 << 20, 16) == [8 << 20]


def test_a_larger_object_fills_every_round_of_parallel_gets() -> None:
    # 27 MB: a dozen connections carry a 2 MiB share each, not 4 of them 8 MiB each.
    assert len(_part_sizes(27_000_000, 16)) == 27_000_000 // transfer.MIN_SPLIT_PART_BYTES == 12
    # 336 MB is 40 parts of 8 MiB: three rounds of 16, so 48 equal parts fill the third.
    sizes = _part_sizes(336_000_000, 16)
    assert len(sizes) == 48 and max(sizes) - min(sizes) <= 1
    # Just over one part size: no more parts than the smallest split allows.
    assert len(_part_sizes((8 << 20) + 1, 16)) == (8 << 20) // transfer.MIN_SPLIT_PART_BYTES
    # One GET at a time: as few parts as the part size allows, of equal size.
    sizes = _part_sizes(20 << 20, 1)
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1


@given(size_bytes=st.integers(0, 10**10), concurrency=st.integers(1, 64))
def test_parts_cover_the_object_once_and_never_exceed_the_part_size(
    size_bytes: int, concurrency: int
) -> None:
    sizes = _part_sizes(size_bytes, concurrency)
    assert sum(sizes) == size_bytes
    assert all(0 < s <= 8 << 20 for s in sizes) or sizes == [0]


class _OpenedRange:
    """A range stream that only records how it ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    def readinto(self, buffer: memoryview) -> int:
        raise AssertionError("a cancelled download must not read")

    def close(self) -> None:
        self.ended.append("closed")

    def abort(self) -> None:
        self.ended.append("aborted")


async def test_a_range_opened_after_its_download_was_cancelled_is_aborted(
    tmp_path: Path,
) -> None:
    # A worker thread cannot be interrupted: when the download is cancelled (another file
    # failed, the disk filled) while a thread is still connecting, whatever it opens must not
    # be left holding its connection.
    opening = asyncio.Event()
    proceed = threading.Event()
    opened: list[_OpenedRange] = []
    loop = asyncio.get_running_loop()

    def open_range(start: int, end: int) -> _OpenedRange:
        loop.call_soon_threadsafe(opening.set)
        assert proceed.wait(10)
        opened.append(_OpenedRange())
        return opened[-1]

    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(
        transfer.download(open_range, tmp_path / "f", 1000, policy))
    await asyncio.wait_for(opening.wait(), 10)
    download.cancel()
    proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await download
    # Aborted (never back to a pool half-read), then closed.
    assert [stream.ended for stream in opened] == [["aborted", "closed"]]


# ---- descriptors and worker threads: a thread cannot be cancelled ---------------------------


class _BytesRange:
    """A range of an in-memory object."""

    def __init__(self, data: bytes, start: int, end: int) -> None:
        self._data, self._offset, self._end = data, start, end

    def readinto(self, buffer: memoryview) -> int:
        n = min(len(buffer), self._end - self._offset)
        buffer[:n] = self._data[self._offset:self._offset + n]
        self._offset += n
        return n

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def _open_to(path: Path) -> list[int]:
    """This process's descriptors open on `path`."""
    found = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(entry) == str(path):
                found.append(int(entry.name))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
    return found


class _Gate:
    """Holds a worker thread inside a call until the test lets it go."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.entered = asyncio.Event()
        self.proceed = threading.Event()

    def hold(self) -> None:  # in the worker thread
        self._loop.call_soon_threadsafe(self.entered.set)
        assert self.proceed.wait(10)


def _cleaning_up(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a cancelled download's clean-up waits for its worker threads (`drain`)."""
    waiting = asyncio.Event()
    drain = transfer._Threads.drain

    async def noted_drain(threads: transfer._Threads) -> None:
        waiting.set()
        await drain(threads)

    monkeypatch.setattr(transfer._Threads, "drain", noted_drain)
    return waiting


async def test_a_file_opened_after_its_download_was_cancelled_is_closed_not_leaked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A slow filesystem: the worker thread is still creating the file when the download is
    # cancelled (another file of the adapter failed, the caller gave up).
    gate = _Gate(asyncio.get_running_loop())
    real_open = transfer._open_presized

    def slow_open(dest: Path, size_bytes: int) -> int:
        gate.hold()
        return real_open(dest, size_bytes)

    monkeypatch.setattr(transfer, "_open_presized", slow_open)
    dest = tmp_path / "f"
    data = os.urandom(1000)
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(transfer.download(
        lambda start, end: _BytesRange(data, start, end), dest, len(data), policy))
    await asyncio.wait_for(gate.entered.wait(), 10)
    download.cancel()
    gate.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await download

    await eventually(lambda: dest.exists() and not _open_to(dest), timeout_s=5, poll_s=0.01,
                     what="the file closed")


async def test_a_second_cancel_during_clean_up_never_closes_a_file_a_thread_still_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker thread is blocked in a write (a slow disk) when the download is cancelled;
    # while the clean-up waits for that thread, a second cancel arrives. The descriptor must
    # stay open until the thread is done: closed early, its number goes to the next file
    # opened, and the late write lands in that file.
    gate = _Gate(asyncio.get_running_loop())
    real_pwrite = transfer._pwrite_all

    def slow_write(fd: int, buffers: list[memoryview], offset: int) -> int:
        gate.hold()
        return real_pwrite(fd, buffers, offset)

    monkeypatch.setattr(transfer, "_pwrite_all", slow_write)
    cleaning_up = _cleaning_up(monkeypatch)
    dest = tmp_path / "f"
    data = os.urandom(100_000)
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(transfer.download(
        lambda start, end: _BytesRange(data, start, end), dest, len(data), policy))
    await asyncio.wait_for(gate.entered.wait(), 10)
    download.cancel()
    await asyncio.wait_for(cleaning_up.wait(), 10)  # it now waits for the blocked thread
    download.cancel()
    await asyncio.gather(download, return_exceptions=True)

    other = tmp_path / "another-file"
    fd = os.open(other, os.O_RDWR | os.O_CREAT, 0o644)  # the lowest free number
    try:
        gate.proceed.set()
        await eventually(lambda: not _open_to(dest), timeout_s=5, poll_s=0.01,
                         what="the file closed once the thread is done")
        assert os.fstat(fd).st_size == 0, "the late write landed in another file"
    finally:
        os.close(fd)
    assert dest.read_bytes()[:1000] == data[:1000]


async def test_a_descriptor_left_to_close_survives_a_job_that_ends_while_another_runs(
    tmp_path: Path,
) -> None:
    # A download's descriptor is closed once its last worker job ends; one job ending while
    # another still runs must neither close it nor forget it.
    threads = transfer._Threads(transfer.transfer_executor(2))
    first, second = threading.Event(), threading.Event()
    jobs = [threads.submit(first.wait, 10), threads.submit(second.wait, 10)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    threads.close_when_idle(fd)
    assert _open_to(path) == [fd]  # jobs run: not closed under them
    first.set()
    await asyncio.wrap_future(jobs[0])
    assert _open_to(path) == [fd]  # one job still runs
    second.set()
    await asyncio.wrap_future(jobs[1])
    await eventually(lambda: not _open_to(path), timeout_s=5, poll_s=0.01,
                     what="the file closed by the last job's end, not leaked")


def _record_read_back(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(offset, length) of every read of the downloaded file's bytes back for the hash."""
    reads: list[tuple[int, int]] = []
    real_read = transfer._FileReadBack.__call__

    def noted_read(self: transfer._FileReadBack, offset: int, length: int) -> memoryview:
        reads.append((offset, length))
        return real_read(self, offset, length)

    monkeypatch.setattr(transfer._FileReadBack, "__call__", noted_read)
    return reads


def _when_landed(total_bytes: int, then: Callable[[], None]) -> Callable[[int], None]:
    """An on_bytes that calls `then` once `total_bytes` have landed (written, and hashed as far
    as the prefix reached: a range reports its bytes after the hasher has seen them)."""
    landed = [0]

    def on_bytes(count: int) -> None:
        landed[0] += count
        if landed[0] == total_bytes:
            then()

    return on_bytes


async def test_the_hasher_never_closes_a_file_a_thread_still_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SHA-256 is asked for once every byte has landed, so the hasher reads them back; the
    # download is cancelled while that read is blocked (a slow disk). The descriptor must stay
    # open until the thread is done: closed early, its number goes to the next file opened.
    gate = _Gate(asyncio.get_running_loop())
    real_read = transfer._FileReadBack.__call__
    read_from: list[str] = []

    def slow_read(self: transfer._FileReadBack, offset: int, length: int) -> memoryview:
        gate.hold()
        read_from.append(os.readlink(f"/proc/self/fd/{self._fd}"))  # what the number means now
        return real_read(self, offset, length)

    monkeypatch.setattr(transfer._FileReadBack, "__call__", slow_read)
    cleaning_up = _cleaning_up(monkeypatch)
    dest = tmp_path / "f"
    data = os.urandom(100_000)
    wanted: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    policy = transfer.TransferPolicy(50_000, 1, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(transfer.download(
        lambda start, end: _BytesRange(data, start, end), dest, len(data), policy,
        _when_landed(len(data), lambda: wanted.set_result(True)), sha256=wanted))
    await asyncio.wait_for(gate.entered.wait(), 10)
    download.cancel()
    await asyncio.wait_for(cleaning_up.wait(), 10)  # the download now waits for the thread
    other = tmp_path / "another-file"
    fd = os.open(other, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        gate.proceed.set()
        await asyncio.gather(download, return_exceptions=True)
        await eventually(lambda: bool(read_from), timeout_s=5, poll_s=0.01,
                         what="the hasher's read")
    finally:
        os.close(fd)
    assert read_from == [str(dest)]
    await eventually(lambda: not _open_to(dest), timeout_s=5, poll_s=0.01, what="the file closed")


# ---- the SHA-256 over the contiguous prefix, in the range threads ------------------------


async def test_ranges_that_land_in_order_are_hashed_as_they_land_and_never_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _record_read_back(monkeypatch)
    data = os.urandom(1_000_000)
    # One range at a time: each chunk lands at the end of the hashed prefix.
    policy = transfer.TransferPolicy(150_000, 1, asyncio.Semaphore(1), 1)
    got = await transfer.download(lambda start, end: _BytesRange(data, start, end),
                                  tmp_path / "f", len(data), policy, sha256=True)
    assert len(transfer.part_starts(len(data), policy)) == 7
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert reads == []


class _HeldBack(_BytesRange):
    """A range whose reads wait for `release` (set from the loop) before the first byte."""

    def __init__(self, data: bytes, start: int, end: int, release: threading.Event) -> None:
        super().__init__(data, start, end)
        self._release = release

    def readinto(self, buffer: memoryview) -> int:
        assert self._release.wait(10)
        return super().readinto(buffer)


async def test_ranges_that_land_beyond_the_prefix_are_read_back_once_each_when_it_reaches_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _record_read_back(monkeypatch)
    data = os.urandom(300_000)
    policy = transfer.TransferPolicy(100_000, 1, asyncio.Semaphore(3), 3)
    starts = transfer.part_starts(len(data), policy)
    assert starts == [0, 100_000, 200_000]
    # The first range is held back until the other two have landed whole.
    first_may_read = threading.Event()

    def open_range(start: int, end: int) -> _BytesRange:
        if start == 0:
            return _HeldBack(data, start, end, first_may_read)
        return _BytesRange(data, start, end)

    got = await transfer.download(open_range, tmp_path / "f", len(data), policy,
                                  _when_landed(200_000, first_may_read.set), sha256=True)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    # The first range's thread hashed its own bytes from its buffer, then the other two's
    # from the file: in order, each byte once.
    assert reads[0][0] == 100_000
    assert all(offset + length == following
               for (offset, length), (following, _) in itertools.pairwise(reads))
    assert reads[-1][0] + reads[-1][1] == len(data)


async def test_ranges_wait_while_the_hash_is_more_than_its_lag_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hashing thread is held in a read-back (a slow disk, or a scheduler that gives it a
    # 33rd of the CPU beside 32 copying threads): the other ranges stop once the contiguous
    # bytes run HASH_LAG_BYTES ahead of it, rather than leave it all to hash after the last.
    monkeypatch.setattr(transfer, "HASH_LAG_BYTES", 200_000)
    loop = asyncio.get_running_loop()
    gate = _Gate(loop)
    owner_reads = threading.Event()
    real_read = transfer._FileReadBack.__call__

    def held_read(self: transfer._FileReadBack, offset: int, length: int) -> memoryview:
        if not gate.proceed.is_set():
            owner_reads.set()
            gate.hold()
        return real_read(self, offset, length)

    monkeypatch.setattr(transfer._FileReadBack, "__call__", held_read)
    waiting = asyncio.Event()
    real_keep_pace = transfer._PrefixHash._keep_pace

    def noted_keep_pace(self: transfer._PrefixHash) -> None:
        if self._lagging(transfer.HASH_LAG_BYTES):
            loop.call_soon_threadsafe(waiting.set)
        real_keep_pace(self)

    monkeypatch.setattr(transfer._PrefixHash, "_keep_pace", noted_keep_pace)
    data = os.urandom(3_000_000)
    first_may_read = threading.Event()

    # Two ranges at a time, in order: the second lands first; then the first, whose thread
    # hashes its own bytes and reads the second's back (held there); then the rest.
    def open_range(start: int, end: int) -> _BytesRange:
        if start == 0:
            return _HeldBack(data, start, end, first_may_read)
        if start >= 200_000:
            return _HeldBack(data, start, end, owner_reads)
        return _BytesRange(data, start, end)

    with transfer.transfer_executor(4) as executor:
        policy = transfer.TransferPolicy(100_000, 1, asyncio.Semaphore(2), 2, executor)
        reported = [0]

        def on_bytes(count: int) -> None:
            reported[0] += count
            if reported[0] == 100_000:
                first_may_read.set()

        download = asyncio.create_task(transfer.download(
            open_range, tmp_path / "f", len(data), policy, on_bytes, sha256=True))
        await asyncio.wait_for(gate.entered.wait(), 10)  # the hash is held at 100 KB
        await asyncio.wait_for(waiting.wait(), 10)  # and a range waits for it
        # The second range and the third (contiguous: 300 KB, 200 KB ahead) passed; the
        # fourth (300 KB ahead) waits, and nothing after it has started.
        assert reported[0] == 200_000
        gate.proceed.set()
        got = await download
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "f").read_bytes() == data


class _Jittery(_BytesRange):
    """A range that hands over a few random bytes at a time, yielding the GIL between reads,
    so the ranges' chunks land interleaved in an order that differs from run to run."""

    def __init__(self, data: bytes, start: int, end: int, rng: random.Random) -> None:
        super().__init__(data, start, end)
        self._rng = rng

    def readinto(self, buffer: memoryview) -> int:
        time.sleep(0)  # not a wait: gives the GIL to another range, as a socket read would
        return super().readinto(buffer[:self._rng.randint(1, 40_000)])


@pytest.mark.parametrize("seed", range(5))
async def test_the_sha256_is_of_every_byte_in_order_whatever_order_the_ranges_land_in(
    tmp_path: Path, seed: int,
) -> None:
    rng = random.Random(seed)
    data = os.urandom(rng.randint(500_000, 1_500_000))
    with transfer.transfer_executor(8) as executor:
        policy = transfer.TransferPolicy(60_000, 1, asyncio.Semaphore(8), 8, executor)
        got = await transfer.download(
            lambda start, end: _Jittery(data, start, end, random.Random(rng.random())),
            tmp_path / "f", len(data), policy, sha256=True)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.crc32 == zlib.crc32(data)
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("wanted", [True, False])
async def test_a_sha256_asked_for_once_the_bytes_have_landed_is_of_every_byte_or_none(
    tmp_path: Path, wanted: bool,
) -> None:
    data = os.urandom(300_000)
    answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    policy = transfer.TransferPolicy(100_000, 1, asyncio.Semaphore(2), 2)
    got = await transfer.download(
        lambda start, end: _BytesRange(data, start, end), tmp_path / "f", len(data), policy,
        _when_landed(len(data), lambda: answer.set_result(wanted)), sha256=answer)
    assert got.sha256 == (hashlib.sha256(data).hexdigest() if wanted else None)
    assert got.crc32 == zlib.crc32(data)


class _BreaksOnce(_BytesRange):
    """A range whose first read of a whole object ends early with a transient fault, after
    some bytes arrived: the retry resumes after them."""

    broken = False

    def readinto(self, buffer: memoryview) -> int:
        if not _BreaksOnce.broken and self._offset > 0:
            _BreaksOnce.broken = True
            raise RegistryUnavailable("the connection dropped", cause="connection")
        return super().readinto(buffer[:70_000])


@pytest.mark.parametrize("part_size", [8 << 20, 150_000], ids=["one range", "two ranges"])
async def test_the_sha256_is_of_every_byte_in_order_across_a_retry(
    tmp_path: Path, part_size: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_BreaksOnce, "broken", False)
    monkeypatch.setattr(transfer, "backoff_s", lambda attempt: 0.0)
    data = os.urandom(300_000)
    policy = transfer.TransferPolicy(part_size, 3, asyncio.Semaphore(2), 2)
    got = await transfer.download(lambda start, end: _BreaksOnce(data, start, end),
                                  tmp_path / "f", len(data), policy, sha256=True)
    assert _BreaksOnce.broken
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert got.crc32 == zlib.crc32(data)
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("part_size", [8 << 20, 150_000], ids=["one range", "two ranges"])
async def test_a_download_into_memory_has_every_byte_and_its_checksums_across_a_retry(
    tmp_path: Path, part_size: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_BreaksOnce, "broken", False)
    monkeypatch.setattr(transfer, "backoff_s", lambda attempt: 0.0)
    monkeypatch.chdir(tmp_path)
    data = os.urandom(300_000)
    policy = transfer.TransferPolicy(part_size, 3, asyncio.Semaphore(2), 2)
    got, digests = await transfer.download_bytes(
        lambda start, end: _BreaksOnce(data, start, end), len(data), policy)
    assert _BreaksOnce.broken
    assert got == data
    assert digests.sha256 == hashlib.sha256(data).hexdigest()
    assert digests.crc32 == zlib.crc32(data)
    assert os.listdir(tmp_path) == []  # nothing written anywhere


async def test_a_download_into_memory_closes_the_descriptors_it_was_handed(
    tmp_path: Path,
) -> None:
    source = tmp_path / "empty"
    source.write_bytes(b"")
    fd = os.open(source, os.O_RDONLY)
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1)
    got, digests = await transfer.download_bytes(
        lambda start, end: _BytesRange(b"", start, end), 0, policy, owned_fds=(fd,))
    assert (got, digests.crc32, digests.sha256) == (b"", 0, hashlib.sha256().hexdigest())
    await eventually(lambda: not _open_to(source), timeout_s=5, poll_s=0.01,
                     what="the handed descriptor closed")


# ---- an object of one part: one worker-thread job per attempt ------------------------------


class _CountingExecutor(concurrent.futures.ThreadPoolExecutor):
    """A transfer executor that counts the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__(2)
        self.jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


class _Seen:
    """An inspector that records, per byte offset, how often each chunk's bytes were seen."""

    def __init__(self) -> None:
        self.bytes = bytearray()

    def stream(self, offset: int) -> Callable[[int, memoryview], None]:
        def look(at: int, chunk: memoryview) -> None:
            assert at == len(self.bytes)  # in order, each byte once, across retries
            self.bytes += chunk
        return look


@pytest.mark.parametrize("into", ["file", "memory"])
async def test_an_object_of_one_part_is_fetched_by_one_worker_thread_job(
    tmp_path: Path, into: str,
) -> None:
    executor = _CountingExecutor()
    data = os.urandom(300_000)
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1, executor)
    landed: list[int] = []
    seen = _Seen()
    if into == "file":
        got = await transfer.download(lambda start, end: _BytesRange(data, start, end),
                                      tmp_path / "f", len(data), policy, landed.append,
                                      sha256=True, inspect=seen)
        assert (tmp_path / "f").read_bytes() == data
        assert seen.bytes == data
    else:
        body, got = await transfer.download_bytes(
            lambda start, end: _BytesRange(data, start, end), len(data), policy, landed.append)
        assert body == data
    assert executor.jobs == 1  # open, create, copy, hash, fsync: one hand-off
    assert (got.crc32, got.sha256) == (zlib.crc32(data), hashlib.sha256(data).hexdigest())
    assert sum(landed) == len(data)


async def test_an_object_of_one_part_resumes_after_a_fault_each_byte_hashed_and_seen_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_BreaksOnce, "broken", False)
    monkeypatch.setattr(transfer, "backoff_s", lambda attempt: 0.0)
    opened: list[tuple[int, int]] = []
    data = os.urandom(300_000)

    def open_range(start: int, end: int) -> _BreaksOnce:
        opened.append((start, end))
        return _BreaksOnce(data, start, end)

    seen = _Seen()
    policy = transfer.TransferPolicy(8 << 20, 3, asyncio.Semaphore(1), 1)
    got = await transfer.download(open_range, tmp_path / "f", len(data), policy, sha256=True,
                                  inspect=seen)
    assert _BreaksOnce.broken and len(opened) == 2
    assert opened[0] == (0, len(data)) and 0 < opened[1][0] < len(data)  # resumed, not redone
    assert seen.bytes == data
    assert (got.crc32, got.sha256) == (zlib.crc32(data), hashlib.sha256(data).hexdigest())
    assert (tmp_path / "f").read_bytes() == data


async def test_a_transient_fault_of_one_part_is_retried_only_as_often_as_the_policy_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transfer, "backoff_s", lambda attempt: 0.0)
    opened: list[int] = []

    def open_range(start: int, end: int) -> _BytesRange:
        opened.append(start)
        raise RegistryUnavailable("the registry did not answer in time", cause="timeout")

    policy = transfer.TransferPolicy(8 << 20, 3, asyncio.Semaphore(1), 1)
    with pytest.raises(RegistryUnavailable, match="in time"):
        await transfer.download(open_range, tmp_path / "f", 1000, policy, sha256=True)
    assert opened == [0, 0, 0]


class _HeldRange(_OpenedRange):
    """A range whose first read blocks until aborted (a stalled registry)."""

    def __init__(self, reading: threading.Event) -> None:
        super().__init__()
        self._reading = reading
        self._woken = threading.Event()

    def readinto(self, buffer: memoryview) -> int:
        self._reading.set()
        if not self._woken.wait(10):
            raise AssertionError("never aborted")
        raise RegistryUnavailable("the connection was shut down", cause="connection")

    def abort(self) -> None:
        super().abort()
        self._woken.set()


async def test_a_cancelled_object_of_one_part_wakes_its_read_and_returns_after_its_thread(
    tmp_path: Path,
) -> None:
    reading = threading.Event()
    ranges: list[_HeldRange] = []

    def open_range(start: int, end: int) -> _HeldRange:
        ranges.append(_HeldRange(reading))
        return ranges[-1]

    dest = tmp_path / "f"
    policy = transfer.TransferPolicy(8 << 20, 5, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(
        transfer.download(open_range, dest, 1000, policy, sha256=True))
    assert await asyncio.to_thread(reading.wait, 10)
    download.cancel()
    with pytest.raises(asyncio.CancelledError):
        await download
    # The blocked read was woken, the range closed (never back to a pool half-read) and the
    # file closed by its thread, all before the download returned; no retry after the cancel.
    assert [r.ended for r in ranges] == [["aborted", "closed"]]
    assert dest.exists() and not _open_to(dest)


async def test_a_cancelled_object_of_one_part_waits_for_the_thread_that_writes_it(
    tmp_path: Path,
) -> None:
    entered, release = threading.Event(), threading.Event()

    class Held:
        def stream(self, offset: int) -> Callable[[int, memoryview], None]:
            def look(at: int, chunk: memoryview) -> None:
                entered.set()
                release.wait(10)
            return look

    data = os.urandom(3000)
    dest = tmp_path / "f"
    policy = transfer.TransferPolicy(8 << 20, 1, asyncio.Semaphore(1), 1)
    download = asyncio.create_task(transfer.download(
        lambda start, end: _BytesRange(data, start, end), dest, len(data), policy,
        sha256=True, inspect=Held()))
    assert await asyncio.to_thread(entered.wait, 10)
    download.cancel()
    for _ in range(5):
        await asyncio.sleep(0)  # turns of the loop: the cancellation is seen meanwhile
    assert not download.done()  # the thread still writes: the stage's folder must stay
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await download
    assert dest.read_bytes() == data and not _open_to(dest)
