"""Which unbound spare names someone has read: inotify's IN_OPEN on each spare's no-op folder.

The engine caches an adapter under its name's int id the first time the name is used; a direct
call to vllm_model with an unbound spare name makes it cache the no-op, and an adapter bound to
that name later would be served as the no-op. A spare whose no-op was opened is never bound.
inotify sees opens through every mount of the filesystem (Triton's read-only one included), and
an open is queued before the opening call returns: draining the queue after a link is replaced
tells whether the no-op was opened before. Linux only; elsewhere `available` is False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_IN_ACCESS = 0x1
_IN_OPEN = 0x20
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)

Key = tuple[int, str]  # (generation, spare name)


class ReadWatch:
    def __init__(self) -> None:
        self._fd: int | None = None
        self._libc: ctypes.CDLL | None = None
        self._keys: dict[int, Key] = {}  # watch descriptor -> spare
        self._wds: dict[Key, int] = {}
        self.problem: str | None = None
        try:
            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        except (OSError, AttributeError) as exc:
            self.problem = f"inotify is not available ({exc})"
            return
        if fd < 0:
            self.problem = f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}"
            return
        self._libc, self._fd = libc, fd

    @property
    def available(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int | None:
        return self._fd

    def watch(self, key: Key, folder: Path) -> bool:
        """Watch a spare's no-op folder; False (with `problem` set) when it cannot be."""
        if self._libc is None or self._fd is None:
            return False
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _IN_OPEN | _IN_ACCESS)
        if wd < 0:
            code = ctypes.get_errno()
            hint = " (raise fs.inotify.max_user_watches)" if code == errno.ENOSPC else ""
            self.problem = f"cannot watch {folder}: {os.strerror(code)}{hint}"
            return False
        self._keys[wd] = key
        self._wds[key] = wd
        return True

    def unwatch(self, key: Key) -> None:
        wd = self._wds.pop(key, None)
        if wd is not None and self._libc is not None and self._fd is not None:
            self._keys.pop(wd, None)
            self._libc.inotify_rm_watch(self._fd, wd)

    def drain(self) -> set[Key]:
        """Every watched spare read since the last drain (a few system calls: fits the loop).
        An overflowed queue counts every watched spare as read."""
        if self._fd is None:
            return set()
        read: set[Key] = set()
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    log.warning("catalog: the read watch overflowed; every unbound spare name "
                                "counts as read")
                    read |= set(self._wds)
                elif mask & _IN_IGNORED:
                    key = self._keys.pop(wd, None)
                    if key is not None:
                        self._wds.pop(key, None)
                elif mask & (_IN_OPEN | _IN_ACCESS) and wd in self._keys:
                    read.add(self._keys[wd])
        return read

    def on_readable(self, callback: Callable[[set[Key]], None]) -> Callable[[], None]:
        """A reader for the event loop: drains and hands what was read to `callback`."""
        def ready() -> None:
            read = self.drain()
            if read:
                callback(read)

        return ready

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._keys.clear()
        self._wds.clear()
