"""One process owns a cache root: an exclusive `flock` on `<cache_root>/.lock`, taken before
anything in the cache is touched and held for the life of the process, with the owner's pid,
host, port and start time written beside it (`.owner.json`) for the error a second one prints.

The lock file lives on the cache volume itself, so two containers sharing the volume exclude
each other as two processes do. The kernel drops the lock when its holder dies, SIGKILL
included: a crashed owner never blocks its successor.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import CacheOwned

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
OWNER_NAME = ".owner.json"
OWNER_MAX_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    host: str
    port: int | None
    started_at: float  # unix seconds

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "port": self.port,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)),
                "started_at_unix": self.started_at}

    def describe(self) -> str:
        port = "port not bound yet" if self.port is None else f"port {self.port}"
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        return f"pid {self.pid} on host {self.host}, {port}, running since {since}"


class CacheLock:
    """`acquire()` or raise CacheOwned naming the owner (OSError when the lock cannot be taken
    at all); `release()` at the very end of stop."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None
        self._owner: Owner | None = None
        self._created_root = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def path(self) -> Path:
        return self.root / LOCK_NAME

    def acquire(self, port: int | None) -> None:
        """Blocking but instant (a non-blocking flock): fine on the loop at start-up."""
        try:
            if not self.root.exists():
                self.root.mkdir(parents=True)
                self._created_root = True
            # Read-only: flock needs no more, and a descriptor open for writing would keep
            # the volume from being remounted read-only.
            fd = os.open(self.root / LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open the cache's lock file {self.root / LOCK_NAME}"
                          f" ({exc.strerror or exc}); check the cache volume and its "
                          "permissions") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(exc.errno, f"cannot lock {self.root / LOCK_NAME} "
                              f"({exc.strerror or exc}): the cache volume must support flock, "
                              "so that two sidecars never share a cache") from exc
            owner = read_owner(self.root)
            who = owner.describe() if owner is not None else "its owner has not recorded itself"
            raise CacheOwned(
                f"the cache root {self.root} is in use by another lora-sidecar ({who}); "
                "stop that one first, or give this one its own --cache-root",
                cache_root=self.root, owner=owner,
            ) from exc
        self._fd = fd
        self._owner = Owner(os.getpid(), socket.gethostname(), port, time.time())
        self._write_owner()

    def set_port(self, port: int) -> None:
        """Record the port once it is bound (it may have been 0, "any free one")."""
        if self._owner is not None and self._owner.port != port:
            self._owner = Owner(self._owner.pid, self._owner.host, port, self._owner.started_at)
            self._write_owner()

    def release(self, *, undo: bool = False) -> None:
        """Drop the lock. `undo`: the start was refused before anything else was written, so
        a cache root this lock created goes again (a refused start leaves nothing behind)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            (self.root / OWNER_NAME).unlink(missing_ok=True)
        except OSError:
            pass  # the next owner overwrites it
        if undo and self._created_root:
            try:
                (self.root / LOCK_NAME).unlink(missing_ok=True)
                self.root.rmdir()  # only if nothing else was written meanwhile
            except OSError:
                pass
        os.close(fd)  # drops the lock

    def _write_owner(self) -> None:
        """Written under the lock, through a rename: a reader sees an old record or the new
        one, never half of one. Only informative, so a failure is logged, not fatal."""
        assert self._owner is not None
        temp = self.root / f"{OWNER_NAME}.{os.getpid()}"
        try:
            temp.write_text(json.dumps(self._owner.to_json()) + "\n")
            os.replace(temp, self.root / OWNER_NAME)
        except OSError as exc:
            log.warning("cannot record the cache's owner in %s: %s", self.root / OWNER_NAME,
                        exc.strerror or exc)


def read_owner(root: Path) -> Owner | None:
    """The owner recorded beside the lock, or None when there is no readable record."""
    try:
        with open(root / OWNER_NAME, "rb") as f:
            data = json.loads(f.read(OWNER_MAX_BYTES))
        port = data.get("port")
        return Owner(int(data["pid"]), str(data["host"]),
                     None if port is None else int(port), float(data["started_at_unix"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
