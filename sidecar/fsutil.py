"""Filesystem helpers every part of the sidecar shares: timestamps, directory fsync, removal."""

from __future__ import annotations

import functools
import os
import shutil
import time
from pathlib import Path


def iso_utc(unix_s: float) -> str:
    """`2026-12-02T14:28:52.178Z`"""
    millis = int(unix_s * 1000)
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


def remove_tree(path: Path) -> None:
    """Delete a staging or trash folder, or a file (blocking: run in a thread)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
