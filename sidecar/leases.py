"""The lease journal: `<cache_root>/.leases`, so leases outlive the process that granted them.

A lease protects an adapter folder that a reader (vLLM) may be loading. A sidecar restarted in
the middle must not evict that folder, so every grant is appended here and a restart reads
the leases back. One line per event, text, append-only, rewritten (compacted) to the live
leases when it has grown to several times their size:

    # lora-sidecar leases 1 boot=<kernel boot id>
    G <digest> <adapter_id> <ttl_s> <unix_s> <monotonic_s>      a grant
    E <digest>                                                  a release (or broken lease)

Durability is sized to what a lease protects. A grant is one `write()` before /stage answers:
in the page cache it survives a crash or SIGKILL of the process, which is the restart that
matters. It is not fsynced each time: a machine crash also ends the reader the lease was
protecting. Releases are written in batches (with the next grant, or within a second): losing
the last ones keeps an adapter protected until its lease expires, never less. The file is kept
open only while leases are being granted and closed after a second without a write, so an idle
sidecar holds nothing open for writing on the volume (which can then be remounted read-only).

Only a digest of each lease id is written: the id is the secret that lets a caller release
its lease, and the cache volume is readable by the model server's container.

Expiry uses the monotonic clock; the wall clock can step (NTP) while the process runs. A
restart on the same boot measures the time a lease has aged with the monotonic clock too;
after a reboot (another boot id) only the wall clock is comparable, and the remaining time is
clamped between zero and the lease's own TTL, so a clock step can end a lease early but never
extend one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .config import is_valid_adapter_id
from .logs import fields

log = logging.getLogger(__name__)

JOURNAL_NAME = ".leases"
FORMAT_LINE = "# lora-sidecar leases 1"
COMPACT_MIN_BYTES = 1024 * 1024
COMPACT_FACTOR = 4  # compacted once appended bytes exceed this many times the live set's
FLUSH_INTERVAL_S = 1.0  # the longest a release waits in memory
IDLE_CLOSE_S = 1.0  # the descriptor is closed after this long without a write
_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
_WARN_EVERY_S = 60.0


def lease_digest(lease_id: str) -> str:
    """What the journal keeps of a lease id: 128 bits of its SHA-256."""
    return hashlib.sha256(lease_id.encode()).hexdigest()[:32]


def read_boot_id() -> str:
    try:
        return _BOOT_ID_FILE.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@dataclass(frozen=True, slots=True)
class JournalLease:
    """A live lease as read back from the journal."""

    digest: str
    adapter_id: str
    remaining_s: float


@dataclass(frozen=True, slots=True)
class _Grant:
    adapter_id: str
    ttl_s: float
    unix_s: float
    monotonic_s: float


class LeaseJournal:
    """Blocking file I/O, small and bounded per call: `load()` and `compact()` at start-up,
    one `write()` per grant, `sync()` from a thread."""

    def __init__(
        self,
        path: Path,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        boot_id: str | None = None,
    ) -> None:
        self.path = path
        self._wall = wall
        self._monotonic = monotonic
        self._boot_id = read_boot_id() if boot_id is None else boot_id
        self._fd: int | None = None  # open for appending while grants come in
        self._last_write = 0.0  # monotonic
        self._pending: list[str] = []  # release lines not written yet
        self._pending_since = 0.0
        self._appended_bytes = 0
        self._live_bytes = 0  # size of the journal right after its last compaction
        self._dirty = False  # written since the last sync
        self._warned_at = -_WARN_EVERY_S
        self.failed = False  # the last write failed; leases granted since may not survive

    # ---- start-up -------------------------------------------------------------------------

    def load(self, max_ttl_s: float) -> list[JournalLease]:
        """The leases still live in the journal left by the previous process, soonest to
        expire first; torn or unknown lines are skipped."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return []
        lines = raw.decode("utf-8", "replace").split("\n")
        lines.pop()  # after the last newline: empty, or a line torn by a crash
        boot_id = ""
        grants: dict[str, _Grant] = {}
        for line in lines:
            parts = line.split(" ")
            if line.startswith(FORMAT_LINE):
                boot_id = line.partition("boot=")[2].strip()
            elif parts[0] == "G" and len(parts) == 6 and is_valid_adapter_id(parts[2]):
                try:
                    ttl_s, unix_s, mono_s = float(parts[3]), float(parts[4]), float(parts[5])
                except ValueError:
                    continue
                grants[parts[1]] = _Grant(parts[2], ttl_s, unix_s, mono_s)
            elif parts[0] == "E" and len(parts) == 2:
                grants.pop(parts[1], None)
        same_boot = bool(boot_id) and boot_id == self._boot_id and boot_id != "unknown"
        now_unix, now_mono = self._wall(), self._monotonic()
        live = []
        for digest, grant in grants.items():
            aged_s = now_mono - grant.monotonic_s if same_boot else now_unix - grant.unix_s
            # A clock stepped back makes the age negative: never longer than the lease's TTL.
            remaining_s = min(grant.ttl_s - max(aged_s, 0.0), grant.ttl_s, max_ttl_s)
            if remaining_s > 0:
                live.append(JournalLease(digest, grant.adapter_id, remaining_s))
        live.sort(key=lambda lease: lease.remaining_s)
        return live

    def compact(self, live: Iterable[tuple[str, str, float]]) -> None:
        """Rewrite the journal to `live` (digest, adapter_id, remaining seconds) and append to
        the new file from now on. One rename: a crash leaves the old journal or the new one."""
        now_unix, now_mono = self._wall(), self._monotonic()
        body = [f"{FORMAT_LINE} boot={self._boot_id}\n"]
        body += [f"G {digest} {adapter_id} {remaining_s:.3f} {now_unix:.3f} {now_mono:.3f}\n"
                 for digest, adapter_id, remaining_s in live if remaining_s > 0]
        data = "".join(body).encode()
        temp = self.path.with_name(f"{self.path.name}.new")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        self._close()  # appends go to the new file from now on
        os.replace(temp, self.path)
        self._pending.clear()  # ended leases are not in `live`
        self._appended_bytes = 0
        self._live_bytes = len(data)
        self._dirty = True

    @property
    def due_for_compaction(self) -> bool:
        return self._appended_bytes > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * self._live_bytes)

    # ---- the hit path ---------------------------------------------------------------------

    def granted(self, digest: str, adapter_id: str, ttl_s: float, unix_s: float,
                monotonic_s: float) -> None:
        line = f"G {digest} {adapter_id} {ttl_s:.3f} {unix_s:.3f} {monotonic_s:.3f}\n"
        if self._pending:
            line = "".join(self._pending) + line
            self._pending.clear()
        self._append(line)

    def ended(self, digest: str) -> None:
        if not self._pending:
            self._pending_since = self._monotonic()
        self._pending.append(f"E {digest}\n")

    def flush_due(self) -> bool:
        return bool(self._pending) and (
            self._monotonic() - self._pending_since >= FLUSH_INTERVAL_S)

    def flush(self) -> None:
        if self._pending:
            lines = "".join(self._pending)
            self._pending.clear()
            self._append(lines)

    def _append(self, text: str) -> None:
        data = text.encode()
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                   | os.O_CLOEXEC, 0o600)
            _write_all(self._fd, data)
        except OSError as exc:
            self.failed = True
            now = self._monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                log.warning("cannot write the lease journal %s (%s): leases granted now would "
                            "not survive a restart of the sidecar", self.path,
                            exc.strerror or exc, extra=fields(event="lease_journal_error"))
            return
        self.failed = False
        self._last_write = self._monotonic()
        self._appended_bytes += len(data)
        self._dirty = True

    def close_if_idle(self) -> None:
        if self._fd is not None and self._monotonic() - self._last_write >= IDLE_CLOSE_S:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # ---- durability and shutdown ------------------------------------------------------------

    def sync(self) -> None:
        """fsync the journal and its folder (blocking: from a thread, after a compaction).
        Through descriptors of its own, so the loop may append or close meanwhile."""
        if not self._dirty:
            return
        self._dirty = False
        try:
            for path, flags in ((self.path, os.O_RDONLY), (self.path.parent, os.O_DIRECTORY)):
                fd = os.open(path, flags | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            log.warning("cannot fsync the lease journal %s: %s", self.path, exc.strerror or exc)

    def close(self) -> None:
        """At shutdown: what is pending written, the file closed and synced."""
        self.flush()
        self._close()
        self.sync()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
