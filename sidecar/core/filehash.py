"""The one file hasher: CRC-32 and SHA-256 of a file on disk in one pass, never following a
link (the watcher's adoption, recovery's re-read, the SHA256SUMS check); and the CRC-32 every
download computes.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from isal.isal_zlib import crc32 as crc32  # as: re-exported for the downloads

CHUNK_BYTES = 1024 * 1024
# `crc32` is ISA-L's (the same CRC-32 as zlib.crc32 and S3's ChecksumCRC32, with carry-less
# multiplication): 0.008 s of CPU per 671 MB here against zlib's 0.145 s, which was a tenth of
# a 671 MB stage's CPU and all of a restart's CRC-only check of the cache.


@dataclass(frozen=True, slots=True)
class FileDigests:
    size_bytes: int  # bytes read
    crc32: str  # 8 hex digits
    sha256: str  # "" when not asked for


def open_regular(path: Path) -> int:
    """A descriptor of a regular file, opened without following a link swapped in since the
    folder was listed (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def hash_fd(fd: int, *, sha256: bool = True,
            feed: Callable[[int, memoryview], None] | None = None) -> FileDigests:
    """Hash an open file from its current offset to its end; `feed(offset, chunk)` sees each
    chunk last (it may overwrite it)."""
    digest = hashlib.sha256() if sha256 else None
    crc = 0
    size_bytes = 0
    buffer = bytearray(CHUNK_BYTES)
    while got := os.readv(fd, [buffer]):
        chunk = memoryview(buffer)[:got]
        if digest is not None:
            digest.update(chunk)
        crc = crc32(chunk, crc)
        if feed is not None:
            feed(size_bytes, chunk)
        size_bytes += got
    return FileDigests(size_bytes, f"{crc:08x}", "" if digest is None else digest.hexdigest())


def hash_file(path: Path, *, sha256: bool = True) -> FileDigests:
    """Hash a regular file (blocking: run in a thread)."""
    fd = open_regular(path)
    try:
        return hash_fd(fd, sha256=sha256)
    finally:
        os.close(fd)
