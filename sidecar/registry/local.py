"""A local folder as the registry (the embedded default): `<root>/<adapter_id>/<file>`.

A file larger than one part is copied with the same transfer code as S3 objects (parallel
ranges, retries); a smaller one is opened, checked, copied, hashed and fsynced by one
worker-thread job. Nothing outside the root is ever read, symbolic links included.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..core.errors import (
    AdapterNotFound,
    RegistryObjectChanged,
    RegistryUnavailable,
    SidecarError,
)
from ..core.filehash import crc32
from ..core.fsutil import EntryKind, entry_kind, write_all
from ..core.ids import is_valid_adapter_id
from .base import Entry, FetchedFile, Listing, RemoteFile, SkippedFolders, is_safe_file_name
from .checksum import crc32_hex
from .transfer import (
    CHUNK_BYTES,
    Digests,
    Inspector,
    TransferPolicy,
    download,
    download_bytes,
    part_starts,
)

log = logging.getLogger(__name__)

LOCATION = "a local folder"
_T = TypeVar("_T")


class LocalRegistry:
    def __init__(self, root: Path, policy: TransferPolicy,
                 on_skipped: Callable[[int], None] | None = None) -> None:
        self.root = root
        self.description = str(root)
        self._policy = policy
        self._skipped = SkippedFolders(str(root.absolute()), on_skipped)

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def probe(self) -> None:
        await asyncio.to_thread(self._check_root)

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise RegistryUnavailable(
                f"the registry folder {self.root} does not exist", cause="missing_folder"
            )

    def makes_unready(self, error: SidecarError) -> bool:
        return isinstance(error, RegistryUnavailable)

    async def list_adapter_ids(self) -> list[str]:
        await self.probe()
        ids, skipped = await asyncio.to_thread(self._scan_ids)
        self._skipped.note(skipped)
        return ids

    def _scan_ids(self) -> tuple[list[str], list[str]]:
        """The adapter ids, and the folders left out; plain files are not folders at all."""
        ids, skipped = [], []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_symlink() and entry.is_dir():
                    skipped.append(f"{entry.name} (a symbolic link, never followed)")
                elif not entry.is_dir(follow_symlinks=False):
                    continue
                elif is_valid_adapter_id(entry.name):
                    ids.append(entry.name)
                else:
                    skipped.append(entry.name)
        return sorted(ids), skipped

    async def list_files(self, adapter_id: str, *, likely: tuple[str, ...] = ()) -> Listing:
        return await asyncio.to_thread(self._scan_files, adapter_id)

    def _scan_files(self, adapter_id: str) -> Listing:
        """The probe and the listing, one worker-thread job."""
        self._check_root()
        folder = self.root / adapter_id
        try:
            mode = os.lstat(folder).st_mode
        except FileNotFoundError:
            mode = 0
        if not stat.S_ISDIR(mode):  # a symlinked adapter folder is not followed either
            raise AdapterNotFound(
                f"no adapter {adapter_id!r} in the registry folder {self.root}",
                adapter_id=adapter_id,
            )
        files: list[RemoteFile] = []
        others: list[Entry] = []
        with os.scandir(folder) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                kind = entry_kind(st.st_mode)
                # Sub-folders are not walked and links not followed: the listing names them,
                # and nothing below or behind them is ever read.
                if kind is not EntryKind.FILE or not is_safe_file_name(entry.name):
                    others.append(Entry(entry.name, kind))
                    continue
                files.append(
                    RemoteFile(entry.name, st.st_size, f"{st.st_mtime_ns}-{st.st_size}",
                               entry.path, st.st_mtime)
                )
        if not files and not others:
            raise AdapterNotFound(
                f"the registry folder {folder} is empty", adapter_id=adapter_id
            )
        return Listing(sorted(files, key=lambda f: f.name), sorted(others, key=lambda e: e.path),
                       time.time())

    async def fetch(
        self, adapter_id: str, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None],
        *, inspect: Inspector | None = None, sha256: bool = False,
    ) -> FetchedFile:
        if self._one_part(file):
            try:
                digests = await self._in_one_job(
                    _copy_listed, file, adapter_id, dest, inspect, sha256)
            except RegistryUnavailable:  # a read error of the registry's disk (the job deleted
                pass  # what it wrote): the ranged path below retries it
            else:
                on_bytes(file.size_bytes)
                return FetchedFile(crc32_hex(digests.crc32), digests.sha256)
        fd = await self._open_listed(adapter_id, file)
        # The download closes the registry file once no worker thread reads it.
        digests = await download(functools.partial(_FileRange, fd, file.locator, adapter_id),
                                 dest, file.size_bytes, self._policy, on_bytes, sha256=sha256,
                                 inspect=inspect, owned_fds=(fd,))
        return FetchedFile(crc32_hex(digests.crc32), digests.sha256)

    async def fetch_bytes(
        self, adapter_id: str, file: RemoteFile, on_bytes: Callable[[int], None],
    ) -> tuple[bytes, FetchedFile]:
        if self._one_part(file):
            try:
                data, digests = await self._in_one_job(_read_listed, file, adapter_id)
            except RegistryUnavailable:  # a read error of the registry's disk: retried as parts
                pass
            else:
                on_bytes(len(data))
                return data, FetchedFile(crc32_hex(digests.crc32), digests.sha256)
        fd = await self._open_listed(adapter_id, file)
        data, digests = await download_bytes(
            functools.partial(_FileRange, fd, file.locator, adapter_id), file.size_bytes,
            self._policy, on_bytes, owned_fds=(fd,))
        return data, FetchedFile(crc32_hex(digests.crc32), digests.sha256)

    def _one_part(self, file: RemoteFile) -> bool:
        """A file the transfer code would fetch as one range: copied by one job instead (each
        worker-thread hand-off waits for the event loop, and a file of a few KB took five)."""
        return len(part_starts(file.size_bytes, self._policy)) == 1

    async def _open_listed(self, adapter_id: str, file: RemoteFile) -> int:
        """A descriptor of the file as it was listed (see `_open_listed` below)."""
        return await self._in_one_job(_open_listed, file, adapter_id, release=os.close)

    async def _in_one_job(self, job: Callable[..., _T], *args: Any,
                          release: Callable[[_T], object] | None = None) -> _T:
        """`job(*args)` in a transfer thread, within the download limiter. A thread cannot be
        cancelled: a cancelled caller waits for it (nothing writes into a stage's folder once
        the stage is gone), then `release`s what it returned."""
        loop = asyncio.get_running_loop()
        async with self._policy.limiter:
            running = loop.run_in_executor(self._policy.executor, job, *args)
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                await asyncio.wait([running])
                if (not running.cancelled() and running.exception() is None
                        and release is not None):
                    release(running.result())
                raise


def _open_listed(file: RemoteFile, adapter_id: str) -> int:
    """Blocking: a descriptor of the file as it was listed (not a link, the same mtime and
    size)."""
    try:
        fd = os.open(file.locator, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistryObjectChanged(
            f"{file.locator} vanished or became a link before it was copied ({exc.strerror})",
            adapter_id=adapter_id, cause="object_changed",
        ) from exc
    try:
        st = os.fstat(fd)
        if f"{st.st_mtime_ns}-{st.st_size}" != file.etag:
            raise RegistryObjectChanged(
                f"{file.locator} changed between listing and copy", adapter_id=adapter_id,
                cause="object_changed",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_into(source: _FileRange, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += source.readinto(view[got:])


def _copy_listed(file: RemoteFile, adapter_id: str, dest: Path, inspect: Inspector | None,
                 sha256: bool) -> Digests:
    """Worker thread: the file as listed, copied to `dest` (created; fsynced) a buffer at a
    time with its CRC-32, its SHA-256 when asked for, and each chunk handed to `inspect` last
    (as the transfer code does). What it wrote is deleted if it fails."""
    fd = _open_listed(file, adapter_id)
    try:
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            source = _FileRange(fd, file.locator, adapter_id, 0, file.size_bytes)
            look = inspect.stream(0) if inspect is not None else None
            digest = hashlib.sha256() if sha256 else None
            buffer = memoryview(bytearray(min(CHUNK_BYTES, max(file.size_bytes, 1))))
            crc = offset = 0
            while offset < file.size_bytes:
                chunk = buffer[:min(len(buffer), file.size_bytes - offset)]
                _read_into(source, chunk)
                write_all(out, chunk)
                crc = crc32(chunk, crc)
                if digest is not None:
                    digest.update(chunk)
                if look is not None:
                    look(offset, chunk)
                offset += len(chunk)
            os.fsync(out)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return Digests(crc, digest.hexdigest() if digest is not None else None)


def _read_listed(file: RemoteFile, adapter_id: str) -> tuple[bytes, Digests]:
    """Worker thread: the file as listed, into memory, with its CRC-32 and SHA-256 (the caller
    bounds its listed size)."""
    fd = _open_listed(file, adapter_id)
    try:
        data = bytearray(file.size_bytes)
        _read_into(_FileRange(fd, file.locator, adapter_id, 0, file.size_bytes),
                   memoryview(data))
    finally:
        os.close(fd)
    return bytes(data), Digests(crc32(data), hashlib.sha256(data).hexdigest())


class _FileRange:
    """A range of a registry file, read with pread (position-free, so ranges share the fd)."""

    def __init__(self, fd: int, locator: str, adapter_id: str, start: int, end: int) -> None:
        self._fd, self._offset, self._end = fd, start, end
        self._locator, self._adapter_id = locator, adapter_id

    def readinto(self, buffer: memoryview) -> int:
        want = min(len(buffer), self._end - self._offset)
        if want == 0:
            return 0
        try:
            got = os.preadv(self._fd, [buffer[:want]], self._offset)
        except OSError as exc:  # an I/O error of the registry's disk: retried per part
            raise RegistryUnavailable(f"cannot read {self._locator} in the registry folder: "
                                      f"{exc.strerror or exc}", adapter_id=self._adapter_id,
                                      cause="read_error") from exc
        if got == 0:
            raise RegistryObjectChanged(f"{self._locator} shrank while it was copied",
                                        adapter_id=self._adapter_id, cause="object_changed")
        self._offset += got
        return got

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


def check_location(location: str) -> None:
    """Any path may name a folder; whether it exists is judged at start (folder_problem)."""


def open_registry(location: str, options: object, policy: TransferPolicy,
                  on_error: Callable[[str], None],
                  on_skipped: Callable[[int], None]) -> LocalRegistry:
    return LocalRegistry(Path(location).expanduser().absolute(), policy, on_skipped)


def folder_problem(location: str) -> str | None:
    """Why a folder cannot be the registry (it does not exist, is not a folder, cannot be
    read), or None. Blocking. An I/O error that may pass (a network file system that blinks) is
    logged, not a problem: readiness reports it if it lasts."""
    folder = Path(location).expanduser().absolute()
    try:
        with os.scandir(folder) as entries:
            next(entries, None)
    except FileNotFoundError:
        return (f"the folder {folder} does not exist; create it (`lora-sidecar examples "
                f"{location}` writes two example adapters into it), or name an existing folder "
                "or s3://bucket/prefix")
    except NotADirectoryError:
        return f"{folder} is not a folder (one sub-folder per adapter is expected)"
    except PermissionError:
        return f"the folder {folder} cannot be read (permission denied)"
    except OSError as exc:
        log.warning("cannot read the registry folder %s at start (%s); starting anyway",
                    folder, exc.strerror or exc)
    return None
