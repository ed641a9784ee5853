"""Which no-op folders the engine has read: inotify's IN_OPEN on each watched name's no-op folder,
and the rule that tells the engine from a walk over the volume.

The engine caches an adapter under its name the first time a request uses the name. A name at a
no-op (a spare not bound yet, a name whose adapter left the disk) that the engine read would
answer as the no-op from then on, so it is never handed out again. inotify sees opens through
every mount of the filesystem (Triton's read-only one included), and an open is queued before
the opening call returns: draining the queue after a link is switched tells whether the old
target was opened before. Each name's no-op folder holds hard links to one no-op: a directory
watch reports an open by the path it came through, so one name's read is told from another's.

What counts as the engine's read (`ReadJudge`): vLLM opens adapter_config.json, then
adapter_model.safetensors, by name, and never lists the folder or opens anything else. So:
- a listing of the folder (`du`, `find`, `ls -R`) opens no file and counts for nothing;
- a process that also opens the folder's README within DECOY_WINDOW_S (a backup, `cp -r`,
  `sha256sum *`) is walking the volume, not serving a request;
- one file alone (`cat adapter_config.json`) is not an adapter's read; both within the window,
  without the README, are.
While a name has an open it cannot judge yet it is `suspect` and never handed out. Linux only;
elsewhere `available` is False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_IN_OPEN = 0x20
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000
_IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)

DECOY_WINDOW_S = 2.0
ENGINE_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})
DECOY = "README"
OVERFLOW = "*overflow*"  # a file name no folder holds: the queue lost events

Key = tuple[int, str]  # (generation, name)


@dataclass(slots=True)
class _Opens:
    files: dict[str, float] = field(default_factory=dict)  # engine file -> last open
    decoy: float | None = None  # last open of the README


class ReadJudge:
    """Opens in, verdicts out: plain logic on a clock, no I/O."""

    def __init__(self, window_s: float = DECOY_WINDOW_S) -> None:
        self.window_s = window_s
        self._opens: dict[Key, _Opens] = {}

    def opened(self, key: Key, file: str, at: float) -> None:
        """One open in a watched folder (`file` "" for the folder itself: a listing)."""
        if file == OVERFLOW:
            self._opens[key] = _Opens({f: at for f in ENGINE_FILES})  # assume the worst
            return
        if file not in ENGINE_FILES and file != DECOY:
            return  # a listing of the folder, or a file the engine never reads
        opens = self._opens.setdefault(key, _Opens())
        if file == DECOY:
            opens.decoy = at
        else:
            opens.files[file] = at

    def suspect(self, key: Key) -> bool:
        """An engine file was opened and not yet judged: never hand the name out now."""
        opens = self._opens.get(key)
        return opens is not None and bool(opens.files)

    def maybe_engine(self, key: Key) -> bool:
        """An engine file was opened and nothing so far says a walker did it: what a switch
        of the name's link must not have straddled."""
        opens = self._opens.get(key)
        return opens is not None and bool(opens.files) and not self._walker(opens)

    def _walker(self, opens: _Opens) -> bool:
        if opens.decoy is None or not opens.files:
            return False
        first, last = min(opens.files.values()), max(opens.files.values())
        return first - self.window_s <= opens.decoy <= last + self.window_s

    def judge(self, now: float) -> set[Key]:
        """The keys the engine read, judged once the window after their opens has passed (they
        are forgotten then, as are the opens a walker made)."""
        read: set[Key] = set()
        for key, opens in list(self._opens.items()):
            if not opens.files:
                if opens.decoy is None or now - opens.decoy > self.window_s:
                    del self._opens[key]
                continue
            last = max(opens.files.values())
            if now - last <= self.window_s:
                continue  # the README may still come
            first = min(opens.files.values())
            both = len(opens.files) == len(ENGINE_FILES) and last - first <= self.window_s
            if both and not self._walker(opens):
                read.add(key)
            del self._opens[key]
        return read

    def forget(self, key: Key) -> None:
        self._opens.pop(key, None)

    def next_due(self, now: float) -> float | None:
        """Seconds until `judge` may have something new to say."""
        times = [max(o.files.values()) for o in self._opens.values() if o.files]
        return max(min(times) + self.window_s - now, 0.0) + 0.01 if times else None


class ReadWatch:
    """inotify on watched folders; `drain()` hands each open to a ReadJudge."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.judge = ReadJudge()
        self._fd: int | None = None
        self._libc: ctypes.CDLL | None = None
        self._keys: dict[int, Key] = {}  # watch descriptor -> key
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

    @property
    def watched(self) -> int:
        return len(self._wds)

    def watch(self, key: Key, folder: Path) -> bool:
        """Watch a no-op folder; False (with `problem` set) when it cannot be. A system call."""
        if self._libc is None or self._fd is None:
            return False
        if key in self._wds:
            return True
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _IN_OPEN)
        if wd < 0:
            code = ctypes.get_errno()
            hint = " (raise fs.inotify.max_user_watches)" if code == errno.ENOSPC else ""
            self.problem = f"cannot watch {folder}: {os.strerror(code)}{hint}"
            return False
        self._keys[wd] = key
        self._wds[key] = wd
        return True

    def unwatch(self, key: Key) -> None:
        self.judge.forget(key)
        wd = self._wds.pop(key, None)
        if wd is not None and self._libc is not None and self._fd is not None:
            self._keys.pop(wd, None)
            self._libc.inotify_rm_watch(self._fd, wd)

    def drain(self) -> None:
        """Hand every queued open to the judge (a few system calls: fits the loop). An
        overflowed queue counts every watched folder as read by the engine."""
        if self._fd is None:
            return
        now = self._clock()
        while True:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size: offset + _EVENT.size + length]
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    log.warning("catalog: the read watch overflowed; every watched no-op "
                                "counts as read by the engine")
                    for watched in self._wds:
                        self.judge.opened(watched, OVERFLOW, now)
                elif mask & _IN_IGNORED:
                    gone = self._keys.pop(wd, None)
                    if gone is not None:
                        self._wds.pop(gone, None)
                elif mask & _IN_OPEN and wd in self._keys:
                    file = "" if mask & _IN_ISDIR else os.fsdecode(raw.rstrip(b"\0"))
                    self.judge.opened(self._keys[wd], file, now)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._keys.clear()
        self._wds.clear()
