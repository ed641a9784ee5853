"""A local folder as the registry (the embedded default): `<root>/<adapter_id>/<file>`.

Files are copied with the same transfer code as S3 objects, so staging behaves the same (a
file of one part is opened, checked, copied, hashed and fsynced by the transfer's one
worker-thread job). Nothing outside the root is ever read, symbolic links included.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from ..core.errors import (
    AdapterNotFound,
    RegistryObjectChanged,
    RegistryUnavailable,
    SidecarError,
)
from ..core.fsutil import EntryKind, entry_kind
from ..core.ids import is_valid_adapter_id
from .base import Entry, FetchedFile, Listing, RemoteFile, SkippedFolders, is_safe_file_name
from .checksum import crc32_hex
from .transfer import (
    Inspector,
    OpenRange,
    TransferPolicy,
    download,
    download_bytes,
    part_starts,
)

log = logging.getLogger(__name__)

LOCATION = "a local folder"


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
        open_range, owned = await self._opener(adapter_id, file)
        # The download closes the registry file once no worker thread reads it.
        digests = await download(open_range, dest, file.size_bytes, self._policy, on_bytes,
                                 sha256=sha256, inspect=inspect, owned_fds=owned)
        return FetchedFile(crc32_hex(digests.crc32), digests.sha256)

    async def fetch_bytes(
        self, adapter_id: str, file: RemoteFile, on_bytes: Callable[[int], None],
    ) -> tuple[bytes, FetchedFile]:
        open_range, owned = await self._opener(adapter_id, file)
        data, digests = await download_bytes(open_range, file.size_bytes, self._policy,
                                             on_bytes, owned_fds=owned)
        return data, FetchedFile(crc32_hex(digests.crc32), digests.sha256)

    async def _opener(self, adapter_id: str, file: RemoteFile
                      ) -> tuple[OpenRange, tuple[int, ...]]:
        """How the transfer code opens the file's ranges, and the descriptors it must close.
        A file of one part is opened by the transfer's one worker-thread job itself (each
        hand-off waits for the event loop, and a file of a few KB took five); a larger one
        is opened here once and its ranges share the descriptor."""
        if len(part_starts(file.size_bytes, self._policy)) == 1:
            return functools.partial(_open_range, file, adapter_id), ()
        loop = asyncio.get_running_loop()
        async with self._policy.limiter:
            running = loop.run_in_executor(self._policy.executor, _open_listed, file,
                                           adapter_id)
            try:
                fd = await asyncio.shield(running)
            except asyncio.CancelledError:  # a thread cannot be cancelled: what it opened
                await asyncio.wait([running])  # is closed once it has
                if not running.cancelled() and running.exception() is None:
                    os.close(running.result())
                raise
        return functools.partial(_FileRange, fd, file.locator, adapter_id), (fd,)


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


def _open_range(file: RemoteFile, adapter_id: str, start: int, end: int) -> _FileRange:
    """Blocking: a range of the file as listed, on a descriptor of its own that the range
    closes (the one-part job's opener)."""
    return _FileRange(_open_listed(file, adapter_id), file.locator, adapter_id, start, end,
                      owns_fd=True)


class _FileRange:
    """A range of a registry file, read with pread (position-free, so ranges share the fd)."""

    def __init__(self, fd: int, locator: str, adapter_id: str, start: int, end: int, *,
                 owns_fd: bool = False) -> None:
        self._fd, self._offset, self._end, self._owns_fd = fd, start, end, owns_fd
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
        if self._owns_fd:
            self._owns_fd = False
            os.close(self._fd)

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
