"""The disk cache: index of published adapters, pins and claims, budget, admit and evict.

State changes happen only on the event loop and only together with the one `rename()` that
makes them true on disk, so the index and the folder under `adapters/` never disagree. The store
keeps its own budget: every change that can free room or add bytes (an admission, a recovery's
install, a lease released or expired, an unpin, a claim dropped) trims it in the same step, and
the folders it evicts are deleted by the store alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path

from ..config import EvictionPolicyName, Settings
from ..core.errors import AdapterInUse, CacheFull, NotCached
from ..core.fsutil import remove_tree
from ..core.logs import fields
from ..core.metrics import Metrics
from ..core.units import format_size
from .eviction import EvictionPolicy, make_policy
from .frequency import FrequencySketch, load_sketch, save_sketch
from .lease_journal import LEASE_JOURNAL_NAME, JournalLease, LeaseJournal
from .leases import Lease, LeaseTable
from .lru import CachedAdapter, LruIndex
from .pins import Pins
from .records import (
    RECORD_NAME,
    AdapterRecord,
    RecordStale,
    read_record,
    reverified,
)

log = logging.getLogger(__name__)

FREQUENCY_SAVE_S = 30.0  # the request counts are written at most this often, and at shutdown


@dataclass(frozen=True, slots=True)
class Eviction:
    adapter_id: str
    freed_bytes: int
    reason: EvictReason
    broken_leases: list[str]


@dataclass(slots=True, eq=False)
class Reservation:
    adapter_id: str
    size_bytes: int


@dataclass(slots=True, eq=False)
class Staging:
    """A download's folder under `.staging/`, and the room it holds once `reserve()` is done.
    Handed out by `AdapterStore.staging()`, which gives both back on exit."""

    adapter_id: str
    path: Path
    _store: AdapterStore
    reservation: Reservation | None = None

    async def reserve(self, size_bytes: int, *, wait_s: float) -> None:
        """Hold room for the whole adapter (evicting what nothing protects), waiting up to
        `wait_s`, first come first served, for room that leases, claims or other downloads
        hold; then every evicted folder is deleted before this returns. CacheFull when it
        cannot fit, or still does not after waiting."""
        if self.reservation is not None:
            raise RuntimeError(f"room for {self.adapter_id} is reserved already")
        self.reservation = await self._store._reserve_in_turn(self.adapter_id, size_bytes,
                                                               wait_s)
        # Room made by evicting is on disk only once the evicted folders are deleted.
        await self._store.settle_trash()


@dataclass(slots=True, eq=False)
class _RoomWaiter:
    adapter_id: str
    woken: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class Installed:
    """What a recovery's install did: leases taken back, adapters evicted to the budget."""

    restored_leases: int
    evicted: int


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The cache's fill and budget at one moment."""

    cache_bytes: int
    cache_adapters: int
    capacity_bytes: int
    capacity_adapters: int
    pinned_adapters: int
    active_leases: int


class StoreListener:
    """Told of every published folder that leaves `adapters/` (the catalog parks the names
    that lead to it). Called on the loop, before the folder goes, in the same step."""

    def leaving(self, adapter_id: str) -> None:
        """The sidecar is about to move the folder out (evicted)."""

    def vanished(self, adapter_id: str, changed: bool) -> None:
        """The folder was removed (`changed` false) or changed in place (true) by someone else."""


class EvictReason(Enum):
    POLICY = "policy"  # chosen by the eviction policy to make room
    MANUAL = "manual"
    FORCED = "forced"
    EXTERNAL = "external"


class AdapterStore:
    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        max_adapters: int,
        min_free_bytes: int,
        lease_ttl_s: float,
        metrics: Metrics,
        max_leases: int,
        pinned: Iterable[str] = (),
        listener: StoreListener | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        eviction_policy: EvictionPolicyName | None = None,  # None: --eviction-policy's default
    ) -> None:
        self.root = root
        self.adapters_dir = root / "adapters"
        self.staging_dir = root / ".staging"
        self.trash_dir = root / ".trash"
        self.quarantine_dir = root / ".quarantine"
        self.max_bytes = max_bytes
        self.max_adapters = max_adapters
        self.min_free_bytes = min_free_bytes
        self.lease_ttl_s = lease_ttl_s
        self._metrics = metrics
        self._clock = clock  # the wall clock: staged_at, last_used, what callers read
        self._monotonic = monotonic  # lease expiry: immune to the wall clock being stepped
        self._index = LruIndex()
        self._policy_name = eviction_policy or Settings().eviction_policy
        self._policy = self._new_policy(FrequencySketch())
        self._frequency_saved = time.monotonic()
        self._frequency_saved_mark = (0, 0)  # the sketch's (halvings, since_halving) saved
        self._frequency_saving: asyncio.Future[None] | None = None
        self._leases = LeaseTable(lease_ttl_s, max_leases, metrics, clock, monotonic)
        self._claims: dict[str, int] = {}  # callers waiting to lease an adapter being staged
        self._reservations: list[Reservation] = []
        self._pins = Pins(pinned, max_adapters=max_adapters, on_disk=self._index.__contains__)
        # Downloads waiting for room that leases, claims or other downloads hold, in arrival
        # order: only the first tries again when room may have freed.
        self._room_waiters: deque[_RoomWaiter] = deque()
        self._trash_pending: list[Path] = []
        self._listener = listener or StoreListener()
        self._deleting: set[asyncio.Future[None]] = set()  # evicted folders being deleted
        self._admitted_stagings: set[Path] = set()  # renamed into adapters/, until staging() ends

    def _new_policy(self, sketch: FrequencySketch) -> EvictionPolicy:
        return make_policy(self._policy_name, max_bytes=self.max_bytes,
                           max_adapters=self.max_adapters, sketch=sketch)

    @property
    def eviction_policy(self) -> EvictionPolicyName:
        return self._policy_name

    @property
    def lease_journal_path(self) -> Path:
        return self.root / LEASE_JOURNAL_NAME

    # ---- start-up ----------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the layout and empty `.staging/` and `.trash/` (blocking: run in a thread)."""
        for folder in (self.adapters_dir, self.staging_dir, self.trash_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for folder in (self.staging_dir, self.trash_dir):
            for entry in list(folder.iterdir()):
                remove_tree(entry)
        own_probe = f".write-probe.{os.getpid()}"  # the health check's, running meanwhile
        for probe in self.root.glob(".write-probe.*"):  # left by a process killed mid-probe
            if probe.name != own_probe:
                probe.unlink(missing_ok=True)
        sketch = load_sketch(self.root)  # before install(): nothing is indexed yet
        if sketch is not None:
            self._policy = self._new_policy(sketch)

    def published_folders(self) -> list[Path]:
        """Every entry of `adapters/` (blocking: run in a thread)."""
        return sorted(self.adapters_dir.iterdir())

    def recover_folder(
        self, entry: Path, check: Callable[[Path, AdapterRecord], list[str]]
    ) -> AdapterRecord:
        """Read one published folder's record and check it (blocking: run in a thread).

        A record whose files keep their recorded sizes and times is trusted: the bytes passed
        their checksums before publication and nothing has written them since, so only
        `check` (the rules, from headers) runs. Files with other times are re-read once and
        compared with their recorded CRC-32s. A folder without a valid record, with other
        files, or with problems is quarantined (ValueError says why).
        """
        try:
            if entry.is_dir() and not entry.is_symlink():
                (entry / f"{RECORD_NAME}.new").unlink(missing_ok=True)  # a rewrite cut short
            try:
                record = self.read_record(entry)
            except RecordStale as stale:
                record = reverified(entry, stale)
            problems = check(entry, record)
            if problems:
                raise ValueError("; ".join(problems))
        except (ValueError, OSError) as exc:
            reason = str(exc) if isinstance(exc, ValueError) else (
                f"cannot read it: {exc.strerror or exc}")
            self.quarantine(entry, reason)
            raise ValueError(reason) from None
        return record

    def read_record(self, folder: Path) -> AdapterRecord:
        """The folder's record, checked against the files present (stat only, no hashing)."""
        return read_record(folder)

    def install(self, records: Iterable[AdapterRecord], *, leases: Iterable[JournalLease] = (),
                lease_journal: LeaseJournal | None = None) -> Installed:
        """Put recovered records into the index, oldest staged first (the recency order), take back
        the leases a previous process granted on them (before anything is trimmed) and the lease
        journal that records new ones, then trim to the budget."""
        for record in sorted(records, key=lambda r: r.staged_at):
            adapter = CachedAdapter(record, last_used=record.staged_at)
            self._index.add_newest(adapter)
            self._policy.admitted(adapter, newest=True)
        restored = self._leases.restore(
            lease for lease in leases if lease.adapter_id in self._index)
        if lease_journal is not None:
            self._leases.lease_journal = lease_journal
        return Installed(restored, len(self._restore_budget()))

    def quarantine(self, folder: Path, reason: str) -> Path:
        """Move a folder out of `adapters/` for an operator to inspect (blocking, a rename)."""
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        target = self.quarantine_dir / f"{folder.name}.{stamp}.{secrets.token_hex(3)}"
        os.rename(folder, target)
        self._metrics.quarantined.inc()
        log.warning("quarantined adapter folder %s -> %s: %s", folder.name, target, reason,
                    extra=fields(event="quarantined", adapter_id=folder.name, reason=reason))
        return target

    # ---- lookups -----------------------------------------------------------------------

    def get(self, adapter_id: str) -> CachedAdapter | None:
        return self._index.get(adapter_id)

    def standing(self, adapter_id: str) -> dict[str, int | str]:
        """What decides the adapter's turn to be evicted (its count, its queue)."""
        return self._policy.standing(adapter_id)

    def adapters(self) -> list[CachedAdapter]:
        """Every cached adapter, most recently used first."""
        return list(reversed(self._index.values()))

    def path_of(self, adapter_id: str) -> Path:
        return self.adapters_dir / adapter_id

    def is_pinned(self, adapter_id: str) -> bool:
        return adapter_id in self._pins

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(
            cache_bytes=self._index.size_bytes,
            cache_adapters=len(self._index),
            capacity_bytes=self.max_bytes,
            capacity_adapters=self.max_adapters,
            pinned_adapters=self._pins.on_disk(),
            active_leases=len(self._leases),
        )

    @property
    def total_bytes(self) -> int:
        return self._index.size_bytes

    # ---- hit path: lookup, touch (recency and count), lease ---------------------------

    def lease(self, adapter_id: str) -> Lease:
        """Touch and lease a cached adapter (KeyError if it is not cached). The grant is in
        the journal before this returns, so it outlives a crash of the process."""
        adapter = self._index[adapter_id]
        now = self._clock()
        adapter.last_used = now
        self._index.touch(adapter_id)
        self._policy.used(adapter_id)
        lease, unheld = self._leases.grant(adapter_id, now)
        if unheld:  # the cap ended an adapter's last lease: it may have to go
            self._restore_budget()
        return lease

    def touch(self, adapter_id: str) -> None:
        adapter = self._index[adapter_id]
        adapter.last_used = self._clock()
        self._index.touch(adapter_id)
        self._policy.used(adapter_id)

    def release(self, lease_id: str) -> Lease:
        lease = self._leases.release(lease_id)
        self._restore_budget()
        return lease

    def expire_leases(self) -> list[Lease]:
        expired = self._leases.expire()
        if expired:
            self._restore_budget()
        return expired

    def next_lease_expiry(self) -> float | None:
        """On the store's monotonic clock."""
        return self._leases.next_expiry()

    def seconds_to_next_expiry(self) -> float | None:
        first = self._leases.next_expiry()
        return None if first is None else first - self._monotonic()

    def lease_count(self, adapter_id: str) -> int:
        return self._leases.count_of(adapter_id)

    @property
    def live_lease_count(self) -> int:
        return len(self._leases)

    def live_leases(self) -> list[tuple[str, str, float]]:
        """(digest, adapter_id, remaining seconds) of every live lease, for the journal."""
        return self._leases.live()

    @property
    def max_leases(self) -> int:
        return self._leases.max_leases

    @property
    def lease_journal(self) -> LeaseJournal | None:
        """Where grants and releases are written; None until the recovery installs it."""
        return self._leases.lease_journal

    # ---- claims: a caller that will lease (or name) an adapter once its stage finishes ----

    @contextlib.contextmanager
    def claim(self, adapter_id: str) -> Iterator[None]:
        """Keep `adapter_id` from being evicted to make room while the block runs (it may not
        be cached yet): between its publication and the lease or name its caller takes."""
        self._claims[adapter_id] = self._claims.get(adapter_id, 0) + 1
        try:
            yield
        finally:
            left = self._claims.get(adapter_id, 0) - 1
            if left > 0:
                self._claims[adapter_id] = left
            else:
                self._claims.pop(adapter_id, None)
                self._restore_budget()

    def is_protected(self, adapter_id: str) -> bool:
        """Never evicted to make room: pinned, leased, or about to be leased."""
        return (
            adapter_id in self._pins
            or self._leases.holds(adapter_id)
            or adapter_id in self._claims
        )

    # ---- pins --------------------------------------------------------------------------

    def check_pin_room(self, adapter_id: str) -> None:
        """CacheFull, before anything is downloaded, when a new pin would fill the adapter
        budget with pinned adapters (see Pins.check_room)."""
        self._pins.check_room(adapter_id)

    def pin(self, adapter_id: str) -> None:
        self._pins.add(adapter_id)

    def unpin(self, adapter_id: str) -> bool:
        """Unpin (see Pins.remove) and trim what the pin kept over the budget."""
        was_pinned = self._pins.remove(adapter_id)
        self._restore_budget()
        return was_pinned

    def pin_problems(self) -> list[str]:
        """Why the sidecar is not ready on account of its pins (see Pins.problems)."""
        return self._pins.problems()

    async def keep_pins_staged(self, stage: Callable[[str], Awaitable[object]], *,
                               retry_refused_s: float) -> None:
        """Stage the pins given at start until each is in or unpinned (see Pins.keep_staged)."""
        await self._pins.keep_staged(stage, retry_refused_s=retry_refused_s)

    # ---- budget ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def staging(self, adapter_id: str, *,
                      reserved: Reservation | None = None) -> AsyncIterator[Staging]:
        """A fresh folder under `.staging/` for a download of `adapter_id`; no room is held
        until `Staging.reserve()`, unless `reserved` (from `reserve_free()`) is given. On exit
        the room is given back and the folder deleted, unless `admit()` renamed it into
        `adapters/` meanwhile."""
        try:
            # One mkdir, on the loop as admit()'s rename is: a worker thread's hand-off and
            # return cost a miss more than the call itself.
            path = self._new_staging_dir(adapter_id)
        except BaseException:
            if reserved is not None:
                self._unreserve(reserved)
            raise
        staging = Staging(adapter_id, path, self, reserved)
        try:
            yield staging
        finally:
            if staging.reservation is not None:
                self._unreserve(staging.reservation)
            if path in self._admitted_stagings:  # renamed into `adapters/`: nothing left
                self._admitted_stagings.discard(path)
            else:
                await asyncio.to_thread(remove_tree, path)

    def reserve_free(self, adapter_id: str, size_bytes: int) -> Reservation | None:
        """Room for a download held at once when it is free now: no download waits for room,
        no evicted folder waits to be deleted, and the adapter fits the budget and the disk
        beside every cached adapter and every other download without evicting anything. None
        otherwise, with nothing changed (`Staging.reserve()` then decides)."""
        if self._room_waiters or self._trash_pending or self._deleting:
            return None
        reserved_bytes = sum(r.size_bytes for r in self._reservations)
        if (self.total_bytes + reserved_bytes + size_bytes > self.max_bytes
                or len(self._index) + len(self._reservations) + 1 > self.max_adapters):
            return None
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return None
        if free - self.min_free_bytes < reserved_bytes + size_bytes:
            return None
        reservation = Reservation(adapter_id, size_bytes)
        self._reservations.append(reservation)
        return reservation

    def fits_budget(self, adapter_id: str, size_bytes: int) -> None:
        """CacheFull (not retryable) when an adapter of `size_bytes` could never fit the
        budget, whatever is evicted or released: judged from a listing, before any room is
        made."""
        if size_bytes > self.max_bytes:
            raise CacheFull(
                f"adapter {adapter_id} needs {format_size(size_bytes)}, more than all "
                f"of the {format_size(self.max_bytes)} budget (--max-bytes); nothing was evicted",
                adapter_id=adapter_id, retryable=False)

    def room_bytes(self) -> int:
        """Bytes a new adapter can have now, evicting what nothing protects: the budget's room
        or the disk's above --min-free-disk, whichever is smaller (the gauge of room left)."""
        protected = sum(a.size_bytes for a in self._index.values()
                        if self.is_protected(a.adapter_id))
        reserved = sum(r.size_bytes for r in self._reservations)
        budget_room = self.max_bytes - protected - reserved
        return max(0, min(budget_room, self.disk_room_bytes()))

    def disk_room_bytes(self) -> int:
        """Bytes the cache filesystem can take above the floor, evictable adapters counted as
        free (a statvfs: cheap enough for a scrape)."""
        evictable = sum(a.size_bytes for a in self._index.values()
                        if not self.is_protected(a.adapter_id))
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return 0
        return max(0, free - self.min_free_bytes + evictable)

    def disk_full(self) -> str | None:
        """Why no new adapter fits on the cache filesystem, whatever is evicted; None when
        one can."""
        if self.disk_room_bytes() > 0:
            return None
        return (f"the cache filesystem is full: no free space above the "
                f"{format_size(self.min_free_bytes)} floor (--min-free-disk) and nothing "
                "evictable; cached adapters still serve, new ones answer 507 until space frees")

    @property
    def waiting_for_room(self) -> int:
        """Downloads waiting for room that leases, claims or other downloads hold."""
        return len(self._room_waiters)

    async def _reserve_in_turn(self, adapter_id: str, size_bytes: int,
                               wait_s: float) -> Reservation:
        """reserve(), waiting in arrival order while the room is held by what will end
        (leases, claims, downloads in progress); at once when nobody waits before us."""
        refused = None
        if not self._room_waiters:
            try:
                return self._reserve(adapter_id, size_bytes)
            except CacheFull as exc:
                if wait_s <= 0 or not self._waiting_can_help(exc, size_bytes):
                    raise
                refused = exc
        elif wait_s <= 0:
            raise CacheFull(f"adapter {adapter_id} has no time left to wait for room, and "
                            f"{len(self._room_waiters)} download(s) wait for it before it",
                            adapter_id=adapter_id, retryable=True)
        waiter = _RoomWaiter(adapter_id)
        self._room_waiters.append(waiter)
        log.info("adapter_id=%s waits for room (%d download(s) waiting)", adapter_id,
                 len(self._room_waiters), extra=fields(event="room_wait", adapter_id=adapter_id,
                                                       waiting=len(self._room_waiters)))
        try:
            async with asyncio.timeout(wait_s):
                while True:
                    if self._room_waiters[0] is waiter:
                        try:
                            return self._reserve(adapter_id, size_bytes)
                        except CacheFull as exc:
                            if not self._waiting_can_help(exc, size_bytes):
                                raise
                            refused = exc
                    waiter.woken.clear()
                    await waiter.woken.wait()
        except TimeoutError:
            if refused is None:
                refused = CacheFull(
                    f"adapter {adapter_id} waited {wait_s:.1f}s for room behind "
                    f"{len(self._room_waiters) - 1} other download(s)",
                    adapter_id=adapter_id, retryable=True)
            raise CacheFull(f"{refused.message} (waited {wait_s:.1f}s for it to free)",
                            adapter_id=adapter_id, retryable=True) from None
        finally:
            self._room_waiters.remove(waiter)
            self._wake_first()

    def _waiting_can_help(self, refused: CacheFull, size_bytes: int) -> bool:
        """Whether what holds the room ends by itself (leases, claims, downloads): the budget
        is not held by pins (`retryable`), and the disk would take the adapter with every
        unpinned adapter gone. A disk filled by others, or by pins, is answered at once."""
        if not refused.retryable:
            return False
        unpinned = sum(a.size_bytes for a in self._index.values()
                       if a.adapter_id not in self._pins)
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return False
        return free - self.min_free_bytes + unpinned >= size_bytes

    def _wake_first(self) -> None:
        """Room may have freed: the first download waiting for it looks again."""
        if self._room_waiters:
            self._room_waiters[0].woken.set()

    def _reserve(self, adapter_id: str, size_bytes: int) -> Reservation:
        """Hold room for a download, evicting what nothing protects, or raise CacheFull
        saying why it cannot fit (`retryable` when leases, claims or other downloads hold
        the room: they end).

        Room is counted against the budget minus what can never be evicted (pinned or
        leased adapters) and minus other downloads in progress.
        """
        held = [a for a in self._index.values() if self.is_protected(a.adapter_id)]
        held_bytes = sum(a.size_bytes for a in held)
        others = [r for r in self._reservations if r.adapter_id != adapter_id]
        reserved_bytes = sum(r.size_bytes for r in others)
        room_bytes = self.max_bytes - held_bytes - reserved_bytes
        # Leases end and downloads finish; pins stay until an operator removes them.
        pinned = [a for a in self._index.values() if a.adapter_id in self._pins]
        pinned_bytes = sum(a.size_bytes for a in pinned)
        if size_bytes > room_bytes:
            raise CacheFull(
                f"adapter {adapter_id} needs {format_size(size_bytes)} but only "
                f"{format_size(max(room_bytes, 0))} of the {format_size(self.max_bytes)} budget "
                f"(--max-bytes) can be made free ({format_size(held_bytes)} are held by "
                f"{len(held)} pinned or leased adapters, {format_size(reserved_bytes)} by "
                "downloads in progress)",
                adapter_id=adapter_id,
                retryable=size_bytes <= self.max_bytes - pinned_bytes,
            )
        if len(held) + len(others) + 1 > self.max_adapters:
            raise CacheFull(
                f"adapter {adapter_id} cannot fit: the budget is {self.max_adapters} adapters "
                f"and {len(held)} are pinned or leased, {len(others)} more are downloading",
                adapter_id=adapter_id,
                retryable=len(pinned) < self.max_adapters,
            )
        self._make_budget_room(size_bytes + reserved_bytes, len(others) + 1)
        self._make_disk_room(adapter_id, size_bytes + reserved_bytes)
        reservation = Reservation(adapter_id, size_bytes)
        self._reservations.append(reservation)
        return reservation

    def _unreserve(self, reservation: Reservation) -> None:
        if reservation in self._reservations:
            self._reservations.remove(reservation)
        self._wake_first()

    def _make_budget_room(self, incoming_bytes: int, incoming_adapters: int) -> None:
        """Evict in eviction order until the downloads about to land fit the budget beside what
        stays: the bytes under the cache root never exceed --max-bytes, not even while a new
        adapter is written (reserve() checked that enough can be made free)."""
        while (self.total_bytes + incoming_bytes > self.max_bytes
               or len(self._index) + incoming_adapters > self.max_adapters):
            victim = next(self._policy.order(self._index, self.is_protected), None)
            if victim is None:
                break  # held by leases and pins; reserve() said they will be released
            self._evict_now(victim.adapter_id, EvictReason.POLICY)

    def _make_disk_room(self, adapter_id: str, needed_bytes: int) -> None:
        """Evict in eviction order until the disk holds `needed_bytes` above the free floor.

        An evicted folder frees its blocks only once it is deleted from `.trash/` (the caller
        awaits settle_trash() before writing), so free space is counted as measured plus what
        the victims hold. Nothing is evicted if even every candidate would not do.
        """
        free = shutil.disk_usage(self.root).free - self.min_free_bytes
        victims: list[str] = []
        freed = 0
        # Asked for a victim only when one is needed: choosing can move adapters between the
        # policy's queues (S3-FIFO, W-TinyLFU).
        candidates = self._policy.order(self._index, self.is_protected)
        while free + freed < needed_bytes:
            candidate = next(candidates, None)
            if candidate is None:
                break
            victims.append(candidate.adapter_id)
            freed += candidate.size_bytes
        if free + freed < needed_bytes:
            raise CacheFull(
                f"adapter {adapter_id} needs {format_size(needed_bytes)} on disk but the cache "
                f"filesystem has {format_size(max(free, 0))} free above the "
                f"{format_size(self.min_free_bytes)} floor (--min-free-disk), and evicting every "
                f"unpinned, unleased adapter would free only {format_size(freed)} more; nothing "
                "was evicted",
                adapter_id=adapter_id,
                retryable=needed_bytes <= shutil.disk_usage(self.root).total - self.min_free_bytes,
            )
        for victim in victims:
            self._evict_now(victim, EvictReason.POLICY)

    def _restore_budget(self) -> list[Eviction]:
        """Evict in eviction order until the cache is within its budget; the evicted folders
        are deleted off the loop. Called by every change that can free room or add bytes, in
        the same loop step: no request sees the cache over budget with an adapter nothing
        protects."""
        evicted = []
        while len(self._index) > self.max_adapters or self.total_bytes > self.max_bytes:
            victim = next(self._policy.order(self._index, self.is_protected), None)
            if victim is None:
                break  # what is left is pinned or leased; trimmed again on release
            evicted.append(self._evict_now(victim.adapter_id, EvictReason.POLICY))
        if evicted:
            self._purge_soon()
        self._wake_first()  # every change that can free room comes through here
        return evicted

    # ---- publish and evict -------------------------------------------------------------

    def _new_staging_dir(self, adapter_id: str) -> Path:
        path = self.staging_dir / f"{adapter_id}.{secrets.token_hex(6)}"
        path.mkdir(mode=0o755)
        return path

    def admit(self, record: AdapterRecord, *, staging: Path | None = None) -> CachedAdapter:
        """Index an adapter that passed validation (admission.py wrote its record), and trim.

        A download (`staging`: complete, sealed and fsynced; the caller fsyncs `adapters/`
        after) is renamed into place and is the most recently used; a folder someone else
        copied into `adapters/` is taken where it lies, first to go.
        """
        adapter = CachedAdapter(record, last_used=self._clock())
        self._policy.admitted(adapter, newest=staging is not None)
        if staging is None:
            self._index.add_oldest(adapter)
        else:
            final = self.path_of(record.adapter_id)
            if final.exists():
                # Left by someone else (an operator copy the watcher has not seen yet): ours
                # is validated; theirs goes to quarantine rather than being overwritten.
                self.quarantine(final, "replaced by a fresh stage")
            os.rename(staging, final)
            self._admitted_stagings.add(staging)
            self._index.add_newest(adapter)
        self._restore_budget()
        return adapter

    def evict(self, adapter_id: str, *, force: bool) -> Eviction:
        """Operator eviction: refused while pinned or leased unless forced."""
        if adapter_id not in self._index:
            raise NotCached(f"adapter {adapter_id} is not in the cache", adapter_id=adapter_id)
        leases = self._leases.ids_of(adapter_id)
        pinned = adapter_id in self._pins
        if (leases or pinned or adapter_id in self._claims) and not force:
            why = []
            if pinned:
                why.append("pinned")
            if leases:
                why.append(f"held by {len(leases)} live lease(s)")
            if adapter_id in self._claims:
                why.append("about to be leased")
            raise AdapterInUse(
                f"adapter {adapter_id} is {' and '.join(why)}; pass force=true to evict anyway",
                adapter_id=adapter_id, pinned=pinned, lease_ids=leases,
            )
        for lease_id in leases:
            self._leases.end(lease_id)
        if force and pinned:
            self.unpin(adapter_id)
        reason = EvictReason.FORCED if (leases or pinned) else EvictReason.MANUAL
        eviction = self._evict_now(adapter_id, reason)
        self._purge_soon()
        self._wake_first()
        return Eviction(adapter_id, eviction.freed_bytes, reason, leases)

    def forget(self, adapter_id: str, *, changed: bool = False) -> CachedAdapter | None:
        """The folder vanished (or, `changed`, was altered in place) outside the sidecar: drop
        it from the index."""
        adapter = self._index.remove(adapter_id)
        if adapter is None:
            return None
        self._policy.evicted(adapter_id)
        for lease_id in self._leases.ids_of(adapter_id):
            self._leases.end(lease_id)
        self._count_eviction(adapter, EvictReason.EXTERNAL)
        self._wake_first()
        self._listener.vanished(adapter_id, changed)  # last: the store is whole if it fails
        return adapter

    def _evict_now(self, adapter_id: str, reason: EvictReason) -> Eviction:
        # Told first: should the catalog fail, the adapter stays indexed and its folder where
        # it is, never a folder in adapters/ that the index no longer names.
        self._listener.leaving(adapter_id)
        adapter = self._index[adapter_id]
        self._index.remove(adapter_id)
        self._policy.evicted(adapter_id)
        target = self.trash_dir / f"{adapter_id}.{secrets.token_hex(6)}"
        try:
            # One rename: readers see the whole folder or nothing, never half of it.
            os.rename(self.path_of(adapter_id), target)
            self._trash_pending.append(target)
        except FileNotFoundError:
            reason = EvictReason.EXTERNAL
        self._count_eviction(adapter, reason)
        return Eviction(adapter_id, adapter.size_bytes, reason, [])

    def _count_eviction(self, adapter: CachedAdapter, reason: EvictReason) -> None:
        self._metrics.evictions.labels(reason=reason.value).inc()
        age_s = max(0.0, self._clock() - adapter.record.staged_at)
        self._metrics.age_at_eviction.observe(age_s)
        policy = self._policy_name.value if reason is EvictReason.POLICY else None
        log.info("evicted adapter_id=%s bytes=%d reason=%s%s age=%.1fs", adapter.adapter_id,
                 adapter.size_bytes, reason.value, f" policy={policy}" if policy else "", age_s,
                 extra=fields(event="evicted", adapter_id=adapter.adapter_id,
                              size_bytes=adapter.size_bytes, reason=reason.value,
                              policy=policy, age_s=round(age_s, 3)))

    def _take_trash(self) -> list[Path]:
        """Folders renamed into `.trash/` and not yet being deleted."""
        pending, self._trash_pending = self._trash_pending, []
        return pending

    def _purge_soon(self) -> None:
        """Delete evicted folders off the loop; the rename already hid them from readers."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a blocking caller: settle_trash() or the next start deletes them
        for folder in self._take_trash():
            task = loop.create_task(asyncio.to_thread(remove_tree, folder))
            self._deleting.add(task)
            task.add_done_callback(self._deleting.discard)

    async def settle_trash(self) -> None:
        """Every evicted folder deleted: room made by evicting is free on disk only then, so a
        download waits for this before it writes (the bytes under the cache root stay within
        the budget)."""
        pending = self._take_trash()
        if pending:
            await asyncio.to_thread(_remove_all, pending)
        if self._deleting:
            await asyncio.gather(*list(self._deleting), return_exceptions=True)

    # ---- the request counts on disk ----------------------------------------------------

    def frequency_save_due(self, every_s: float = FREQUENCY_SAVE_S) -> bool:
        sketch = self._policy.sketch
        return (self._frequency_saving is None
                and (sketch.halvings, sketch.since_halving) != self._frequency_saved_mark
                and time.monotonic() - self._frequency_saved >= every_s)

    async def save_frequencies(self) -> None:
        """Write the request counts whole (temporary file, fsync, rename), off the loop; a
        crash loses at most what was counted since the last save (FREQUENCY_SAVE_S)."""
        while self._frequency_saving is not None:  # one writer at a time
            await asyncio.wait({self._frequency_saving})
        sketch = self._policy.sketch
        data = sketch.to_bytes()  # a copy taken on the loop: consistent
        self._frequency_saved = time.monotonic()
        self._frequency_saved_mark = (sketch.halvings, sketch.since_halving)
        saving = asyncio.ensure_future(asyncio.to_thread(save_sketch, self.root, data))
        self._frequency_saving = saving
        try:
            await asyncio.shield(saving)
        except OSError as exc:
            log.warning("cannot save the request counts in %s (%s): a restart starts them "
                        "from the last save", self.root, exc.strerror or exc)
        finally:
            self._frequency_saving = None

    async def close(self) -> None:
        """At shutdown: every evicted folder deleted, the request counts saved, the lease
        journal flushed and closed."""
        await self.settle_trash()
        if self.adapters_dir.is_dir():  # a store never prepared has no counts worth keeping
            await self.save_frequencies()
        journal, self._leases.lease_journal = self._leases.lease_journal, None
        if journal is not None:
            await asyncio.to_thread(journal.close)


def _remove_all(folders: list[Path]) -> None:
    for folder in folders:
        remove_tree(folder)
