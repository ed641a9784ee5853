"""The lease journal: `<cache_root>/.leases*`, so leases outlive the process that granted them.

A lease protects an adapter folder that a reader (vLLM) may be loading. A sidecar restarted in
the middle must not evict that folder, so every grant is appended to the journal and a restart
reads the leases back. One line per event, text, append-only:

    # lora-sidecar leases 1 boot=<kernel boot id>
    G <digest> <adapter_id> <ttl_ms> <unix_ms> <monotonic_ms>   a grant (times in ms)
    E <digest>                                                  a release (or broken lease)

Three files, read in this order: `.leases.base` (the live leases at the last compaction),
`.leases.compacting` (appends being merged into the base) and `.leases` (appends since).
Compaction costs the event loop one rename: the appends so far become `.leases.compacting`,
new ones start a fresh `.leases`, and a thread merges the base and the compacting file into a
new base (live grants only, at most --max-leases of them) before deleting the compacting file.
A crash at any point leaves files whose reading in that order gives the same leases.

Durability is sized to what a lease protects. A grant is one `write()` before /stage answers:
in the page cache it survives a crash or SIGKILL of the process, which is the restart that
matters. It is not fsynced each time: a machine crash also ends the reader the lease was
protecting. Releases are written in batches (with the next grant, or within a second): losing
the last ones keeps an adapter protected until its lease expires, never less. Leases that end
by expiry or by the --max-leases cap need no line: a restart works them out. The file is kept
open only while leases are granted and closed after a second without a write, so an idle
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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..core.fsutil import fsync_dir, write_all
from ..core.ids import is_valid_adapter_id
from ..core.logs import fields

log = logging.getLogger(__name__)

LEASE_JOURNAL_NAME = ".leases"
FORMAT_LINE = "# lora-sidecar leases 1"
COMPACT_MIN_BYTES = 1024 * 1024
COMPACT_FACTOR = 4  # compacted once appends exceed this many times the live leases' lines
LINE_BYTES = 100  # about one grant line
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
    boot_id: str  # of the process that wrote it
    line: str

    @classmethod
    def parse(cls, line: str, boot_id: str) -> _Grant:
        """A line `_read_lines` found well formed."""
        _, _, adapter_id, ttl_ms, unix_ms, mono_ms = line[:-1].split(" ")
        return cls(adapter_id, int(ttl_ms) / 1000, int(unix_ms) / 1000, int(mono_ms) / 1000,
                   boot_id, line)


class LeaseJournal:
    """`load()` and `reset()` at start-up (blocking, from a thread); on the loop one `write()`
    per grant and `begin_compaction()`; `merge()` from a thread."""

    def __init__(
        self,
        path: Path,
        *,
        max_leases: int,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        boot_id: str | None = None,
    ) -> None:
        self.path = path
        self.base_path = path.with_name(f"{path.name}.base")
        self.compacting_path = path.with_name(f"{path.name}.compacting")
        self._max_leases = max_leases
        self._wall = wall
        self._monotonic = monotonic
        self._boot_id = read_boot_id() if boot_id is None else boot_id
        self._fd: int | None = None  # open for appending while grants come in
        self._last_write = 0.0  # monotonic
        self._pending: list[str] = []  # release lines not written yet
        self._pending_since = 0.0
        self._appended_bytes = 0
        self._base_bytes = 0
        self._merging = False
        self._warned_at = -_WARN_EVERY_S
        self.failed = False  # the last write failed; leases granted since may not survive

    # ---- start-up -------------------------------------------------------------------------

    def load(self, max_ttl_s: float) -> list[JournalLease]:
        """The leases still live in the journal left by the previous process, soonest to
        expire first; torn or unknown lines are skipped."""
        grants = self._replay(self.base_path, self.compacting_path, self.path)
        now_unix, now_mono = self._wall(), self._monotonic()
        live = []
        for digest, grant in grants.items():
            same_boot = grant.boot_id == self._boot_id and grant.boot_id not in ("", "unknown")
            aged_s = now_mono - grant.monotonic_s if same_boot else now_unix - grant.unix_s
            # A clock stepped back makes the age negative: never longer than the lease's TTL.
            remaining_s = min(grant.ttl_s - max(aged_s, 0.0), grant.ttl_s, max_ttl_s)
            if remaining_s > 0:
                live.append(JournalLease(digest, grant.adapter_id, remaining_s))
        live.sort(key=lambda lease: lease.remaining_s)
        return live

    def reset(self, live: Iterable[tuple[str, str, float]]) -> None:
        """Start this process's journal from `live` (digest, adapter_id, remaining seconds):
        one new base, the other files gone. Crash-safe: the base is replaced by a rename."""
        now_unix, now_mono = self._wall(), self._monotonic()
        lines = [_grant_line(digest, adapter_id, remaining_s, now_unix, now_mono)
                 for digest, adapter_id, remaining_s in live if remaining_s > 0]
        self._write_base(lines)
        for stale in (self.compacting_path, self.path):
            stale.unlink(missing_ok=True)
        fsync_dir(self.path.parent)
        self._appended_bytes = 0
        self._merging = False

    # ---- the hit path ---------------------------------------------------------------------

    def granted(self, digest: str, adapter_id: str, ttl_s: float, unix_s: float,
                monotonic_s: float) -> None:
        line = _grant_line(digest, adapter_id, ttl_s, unix_s, monotonic_s)
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
                if os.fstat(self._fd).st_size == 0:
                    data = f"{FORMAT_LINE} boot={self._boot_id}\n".encode() + data
            written = os.write(self._fd, data)  # whole, but for a short write (hit path)
            if written < len(data):
                write_all(self._fd, data[written:])
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

    def close_if_idle(self) -> None:
        if self._fd is not None and self._monotonic() - self._last_write >= IDLE_CLOSE_S:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # ---- compaction -----------------------------------------------------------------------

    def compaction_due(self, live_leases: int) -> bool:
        live_bytes = max(self._base_bytes, live_leases * LINE_BYTES)
        return not self._merging and self._appended_bytes > max(
            COMPACT_MIN_BYTES, COMPACT_FACTOR * live_bytes)

    def begin_compaction(self) -> bool:
        """On the loop, between two appends: the appends so far become the compacting file
        and later ones go to a fresh file. True when `merge()` should run next."""
        if self._merging:
            return False
        self.flush()
        self._close()
        self._appended_bytes = 0  # on failure too: tried again after as many appends
        try:
            if not self.compacting_path.exists():  # else a merge that failed: retried
                os.rename(self.path, self.compacting_path)
        except OSError as exc:
            log.warning("cannot compact the lease journal %s: %s", self.path,
                        exc.strerror or exc)
            return False
        self._merging = True
        return True

    def merge(self) -> None:
        """From a thread: the base and the compacting file into a new base holding the live
        grants only; then the compacting file goes. Failures are logged and retried later."""
        try:
            grants = self._replay(self.base_path, self.compacting_path)
            now_mono = self._monotonic()
            # Every grant here was written by this process (the start-up rewrote the others):
            # its age is on this process's monotonic clock.
            self._write_base([grant.line for grant in grants.values()
                              if grant.ttl_s - (now_mono - grant.monotonic_s) > 0])
            self.compacting_path.unlink()
            fsync_dir(self.path.parent)
        except OSError as exc:
            log.warning("cannot compact the lease journal %s: %s", self.path,
                        exc.strerror or exc)
        finally:
            self._merging = False

    # ---- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """At shutdown (blocking): what is pending written, then the file synced and closed."""
        self.flush()
        fd = self._fd
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError as exc:
                log.warning("cannot fsync the lease journal %s: %s", self.path,
                            exc.strerror or exc)
        self._close()

    # ---- files -------------------------------------------------------------------------------

    def _replay(self, *paths: Path) -> dict[str, _Grant]:
        """Live grants after reading the files in order, oldest first, at most --max-leases
        (the newest: the cap ends the oldest, as it did in the process that granted them).

        A merge reads every line appended since the last one, so a line costs a split and two
        dict operations; only the survivors are parsed. An OrderedDict: ending the oldest is
        O(1) (a dict finds its first key past every key deleted before it, which made a merge
        at the cap quadratic: 13 s for 400,000 lines; benchmarks/lease_journal.py)."""
        lines: OrderedDict[str, tuple[str, str]] = OrderedDict()  # digest -> (line, boot id)
        for path in paths:
            for digest, line in _read_lines(path):
                lines.pop(digest, None)  # ended, or a duplicate that moves to the end
                if line is not None:
                    lines[digest] = line
                    if len(lines) > self._max_leases:
                        lines.popitem(last=False)
        return {digest: _Grant.parse(*line) for digest, line in lines.items()}

    def _write_base(self, lines: list[str]) -> None:
        data = "".join([f"{FORMAT_LINE} boot={self._boot_id}\n", *lines]).encode()
        temp = self.base_path.with_name(f"{self.base_path.name}.new")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, self.base_path)
        self._base_bytes = len(data)


def _read_lines(path: Path) -> Iterator[tuple[str, tuple[str, str] | None]]:
    """(digest, the grant's line and the boot id of its writer, or None for a release) per
    well-formed line of one journal file; a line torn by a crash (no newline) and anything
    unknown are skipped."""
    try:
        f = open(path, encoding="utf-8", errors="replace", newline="\n")
    except FileNotFoundError:
        return
    valid_ids: set[str] = set()  # a journal names few adapters, each many times
    with f:
        boot_id = ""
        for line in f:
            if not line.endswith("\n"):
                return
            parts = line[:-1].split(" ")
            if parts[0] == "G" and len(parts) == 6:
                if parts[2] not in valid_ids:
                    if not is_valid_adapter_id(parts[2]):
                        continue
                    valid_ids.add(parts[2])
                numbers = parts[3] + parts[4] + parts[5]  # each a whole number of ms
                if parts[3] and parts[4] and parts[5] and numbers.isascii() and numbers.isdecimal():
                    yield parts[1], (line, boot_id)
            elif parts[0] == "E" and len(parts) == 2:
                yield parts[1], None
            elif line.startswith(FORMAT_LINE):
                boot_id = line.partition("boot=")[2].strip()


def _grant_line(digest: str, adapter_id: str, ttl_s: float, unix_s: float,
                monotonic_s: float) -> str:
    # Whole milliseconds: formatting floats was a measurable share of a grant's cost.
    return (f"G {digest} {adapter_id} {int(ttl_s * 1000)} {int(unix_s * 1000)} "
            f"{int(monotonic_s * 1000)}\n")
