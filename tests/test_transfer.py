"""transfer.py's positional writes: every byte lands at its offset even when the kernel takes
fewer bytes than offered (pwritev may write short; regular files rarely do, so it is forced)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sidecar import transfer


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
