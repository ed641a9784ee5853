"""Filesystem helpers every part of the sidecar shares: timestamps, directory fsync, removal,
the kind of a folder entry."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import time
import tomllib
from enum import Enum
from pathlib import Path
from typing import Any


class EntryKind(Enum):
    """What an entry of an adapter folder is (an S3 object is always a FILE)."""

    FILE = "file"
    FOLDER = "folder"
    LINK = "symbolic link"
    OTHER = "special file"


def entry_kind(mode: int) -> EntryKind:
    """The kind of an entry from its `lstat` mode."""
    if stat.S_ISLNK(mode):
        return EntryKind.LINK
    if stat.S_ISDIR(mode):
        return EntryKind.FOLDER
    return EntryKind.FILE if stat.S_ISREG(mode) else EntryKind.OTHER


def iso_utc(unix_s: float) -> str:
    """`2026-12-02T14:28:52.178Z`"""
    return _iso_millis(int(unix_s * 1000))


@functools.lru_cache(maxsize=256)
def _iso_millis(millis: int) -> str:
    # Kept: under load many leases granted in the same millisecond expire in the same one,
    # and each /stage answer says when (hit path).
    return f"{_iso_seconds(millis // 1000)}.{millis % 1000:03d}Z"


@functools.lru_cache(maxsize=64)
def _iso_seconds(unix_s: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_s))


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Every byte of `data` written to `fd`, however short the writes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_synced(path: Path, data: bytes, flags: int) -> None:
    """`data` written whole into `path` opened with `flags` (besides write-only), and fsynced
    (blocking: run in a thread)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` as `path` whole, or leave the file that was there (blocking: run in a
    thread): written to `<name>.new` beside it, fsynced, renamed over it, the folder fsynced.
    A process killed meanwhile leaves at most that temporary file, for its reader to remove."""
    temporary = path.with_name(f"{path.name}.new")
    write_synced(temporary, data, os.O_CREAT | os.O_TRUNC)
    os.replace(temporary, path)
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a staging or trash folder, or a file (blocking: run in a thread)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def read_toml(path: Path, max_bytes: int) -> dict[str, Any]:
    """A small TOML file read whole, at most `max_bytes`; ValueError says what is wrong with it
    (unreadable, too large, not TOML) in words fit to follow the file's name."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"not valid TOML: {exc}") from None
