"""One sidecar per cache root. A second one would empty the first one's `.staging/` and
`.trash/` at its start (deleting downloads in flight), and two budgets would evict from under
each other; so the start takes an exclusive lock on `<cache_root>/.lock`, held for the
process's life (the kernel drops it when the process dies, SIGKILL included).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from .config import option_for
from .errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


def lock_cache_root(root: Path) -> int | None:
    """The open, locked lock file; ConfigError when another process holds it. None when the
    cache root cannot be written at all: readiness reports that, and nothing can be staged."""
    path = root / LOCK_NAME
    try:
        root.mkdir(parents=True, exist_ok=True)
        # Read-only: a descriptor open for writing would keep the volume from being remounted
        # read-only (flock needs no write access).
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        log.warning("cannot create %s (%s): the cache root is not locked", path,
                    exc.strerror or exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning("cannot lock %s (%s): the cache root is not locked", path,
                        exc.strerror or exc)
            return None
        option = option_for("cache_root")
        raise ConfigError([
            f"{option.flag} ({option.env_var}) = {str(root)!r}: another lora-sidecar "
            f"({holder}) is using this cache root; one sidecar per cache root: stop that one, "
            f"or give this one another {option.flag}"
        ]) from None
    try:  # who holds it, for the message a second sidecar prints
        path.write_text(f"{os.getpid()}\n", encoding="ascii")
    except OSError as exc:
        log.warning("cannot write the pid into %s (%s)", path, exc.strerror or exc)
    return fd


def unlock_cache_root(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the lock


def _holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "a process that holds its lock"
