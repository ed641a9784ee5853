"""The watcher: keeps the index true to `adapters/` when someone else removes a folder or copies
one in. Watchdog's thread only forwards events to the loop; each adapter id is then judged on
the loop by comparing its folder with the index, so the sidecar's own renames need no special case.
A folder copied in is adopted holding what a stage would have published: the entries the engine
never reads (validation/files.py) are deleted from it first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from ..core.filehash import hash_fd
from ..core.ids import is_valid_adapter_id
from ..core.logs import fields
from ..core.metrics import Metrics
from ..validation.files import WEIGHTS_FILE, listed, plan_folder
from ..validation.problem import Problem
from ..validation.signatures import SignatureVerdict, verify_folder
from ..validation.validate import Rules, judge_adapter
from ..validation.values import ValueReport, ValueScan
from .admission import Passed, admit_in_place
from .lru import CachedAdapter
from .records import RECORD_NAME, FileRecord
from .store import AdapterStore

log = logging.getLogger(__name__)

COALESCE_S = 0.15  # the events of one burst are gathered this long, then each id is judged once
SETTLE_S = 1.0  # a folder copied in is judged only after this long without a change
ADOPT_CONCURRENCY = 2  # folders hashed and validated at once: the stager needs threads too
OBSERVER_POLL_S = 0.2  # how long watchdog's thread waits between checks for a stop
ADOPTED_SOURCE = "adopted"  # `source` of the record written for a folder copied in

# Writes and namespace changes only: reads (vLLM loading an adapter, our own hashing) must
# neither wake the loop nor look like a copy still in progress.
_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent,
    FileMovedEvent, DirMovedEvent, FileModifiedEvent, FileClosedEvent,
]

_Snapshot = dict[str, tuple[int, int, int]]  # file name -> (mode, size, mtime_ns)


class _Forward(FileSystemEventHandler):
    """Runs on watchdog's thread: hands each event to the loop and touches nothing else."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 queue: asyncio.Queue[FileSystemEvent]) -> None:
        self._loop = loop
        self._queue = queue
        self.closed = False  # set by Watcher.stop: whatever comes after goes nowhere

    def on_any_event(self, event: FileSystemEvent) -> None:
        if self.closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop closed while the observer was stopping
            pass


@dataclass(frozen=True, slots=True)
class _Inspection:
    files: dict[str, FileRecord]
    problems: list[Problem]
    ignored: tuple[str, ...]  # entries to delete before adopting (a sub-folder as `name/`)
    signature: SignatureVerdict


class Watcher:
    """`await start()` after recovery, run `run()` as a background task, `await stop()` first
    at shutdown (then cancel `run()`)."""

    def __init__(
        self,
        store: AdapterStore,
        rules: Rules,
        metrics: Metrics,
        *,
        settle_s: float = SETTLE_S,
        coalesce_s: float = COALESCE_S,
    ) -> None:
        self._store = store
        self._rules = rules
        self._metrics = metrics
        self._settle_s = settle_s
        self._coalesce_s = coalesce_s
        self._root = str(store.adapters_dir) + os.sep
        self._queue: asyncio.Queue[FileSystemEvent] = asyncio.Queue()
        self._observer: BaseObserver | None = None
        self._forward: _Forward | None = None
        self._stopping: threading.Thread | None = None  # watchdog's own stop, see stop()
        self._changes: dict[str, int] = {}  # adapter id -> events seen while it is judged
        self._last_change: dict[str, float] = {}  # adapter id -> loop time of its last event
        self._judging: dict[str, asyncio.Task[None]] = {}
        self._adopting: set[str] = set()
        self._leaving_out: dict[str, frozenset[str]] = {}  # adapter id -> entries deleted
        self._limit = asyncio.Semaphore(ADOPT_CONCURRENCY)

    @property
    def pending(self) -> list[str]:
        """Adapter ids being judged now (waiting for a copy to settle, hashing, validating)."""
        return sorted(i for i, task in self._judging.items() if not task.done())

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        observer = Observer(timeout=OBSERVER_POLL_S)
        self._forward = _Forward(loop, self._queue)
        observer.schedule(self._forward, str(self._store.adapters_dir),
                          recursive=True, event_filter=_EVENTS)
        try:
            # Starting adds one inotify watch per folder: a directory walk, so off the loop.
            await asyncio.to_thread(observer.start)
        except OSError as exc:
            log.error("cannot watch %s (%s): folders removed or copied in by others are "
                      "noticed only at the next start", self._store.adapters_dir,
                      exc.strerror or exc)
            return
        self._observer = observer

    async def stop(self) -> None:
        """Stop forwarding events at once. Watchdog's own stop joins its reading thread, which
        may be sleeping out the 0.5 s it gives a moved file to meet its other half (after any
        rename in the tree, ours included): it runs in a daemon thread of its own, not awaited,
        and every watchdog thread ends by itself within that half second."""
        observer, self._observer = self._observer, None
        if observer is None:
            return
        if self._forward is not None:
            self._forward.closed = True
        self._stopping = threading.Thread(target=observer.stop, name="watcher-stop",
                                          daemon=True)
        self._stopping.start()

    async def run(self) -> None:
        """Judge what changed before the observer started, then every burst of events."""
        async with asyncio.TaskGroup() as group:
            for adapter_id in await self._out_of_step():
                self._note(adapter_id)
                self._judge_later(group, adapter_id)
            while True:
                for adapter_id in await self._next_burst():
                    self._judge_later(group, adapter_id)

    # ---- events -> adapter ids ---------------------------------------------------------

    async def _out_of_step(self) -> set[str]:
        names = await asyncio.to_thread(_list_names, self._store.adapters_dir)
        indexed = {a.adapter_id for a in self._store.adapters()}
        return (names - indexed) | (indexed - names)

    async def _next_burst(self) -> set[str]:
        ids = self._ids_of(await self._queue.get())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._coalesce_s
        while (left_s := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(left_s):
                    event = await self._queue.get()
            except TimeoutError:
                break
            ids |= self._ids_of(event)
        return ids

    def _ids_of(self, event: FileSystemEvent) -> set[str]:
        ids = set()
        for raw in (event.src_path, event.dest_path):
            path = os.fsdecode(raw)
            if not path.startswith(self._root):
                continue  # adapters/ itself, or a move's far end in .trash/ or .staging/
            name, _, rest = path[len(self._root):].partition(os.sep)
            if not name or (name in self._adopting and (
                    rest == RECORD_NAME
                    or rest.partition(os.sep)[0] in self._leaving_out.get(name, ()))):
                continue  # the record the watcher writes, the entries it deletes: no copying
            self._note(name)
            ids.add(name)
        return ids

    def _note(self, adapter_id: str) -> None:
        self._changes[adapter_id] = self._changes.get(adapter_id, 0) + 1
        self._last_change[adapter_id] = asyncio.get_running_loop().time()

    def _judge_later(self, group: asyncio.TaskGroup, adapter_id: str) -> None:
        running = self._judging.get(adapter_id)
        if running is not None and not running.done():
            return  # it sees the change count move and looks again
        task = group.create_task(self._judge(adapter_id), name=f"watch:{adapter_id}")
        self._judging[adapter_id] = task

        def done(_: asyncio.Task[None]) -> None:
            if self._judging.get(adapter_id) is task:
                del self._judging[adapter_id]

        task.add_done_callback(done)

    # ---- judging one adapter id ----------------------------------------------------------

    async def _judge(self, adapter_id: str) -> None:
        try:
            while True:
                seen = self._changes.get(adapter_id, 0)
                await self._judge_once(adapter_id)
                if self._changes.get(adapter_id, 0) == seen:
                    self._changes.pop(adapter_id, None)
                    self._last_change.pop(adapter_id, None)
                    return
        except Exception:
            log.exception("watcher: judging adapter folder %r failed", adapter_id)

    async def _judge_once(self, adapter_id: str) -> None:
        store = self._store
        folder = store.adapters_dir / adapter_id
        # The index is read and the folder looked at in one loop step: the sidecar's own
        # publish and evict change both in one step too, so they always agree here.
        adapter = store.get(adapter_id)
        if adapter is not None:
            if _lstat(folder) is None:
                store.forget(adapter_id)  # logs and counts the `external` eviction
                return
            if not await self._damaged(adapter_id, adapter, folder):
                return
        if _lstat(folder) is None:
            return
        await self._settle(adapter_id)
        async with self._limit:
            await self._take_in(adapter_id, folder)

    async def _damaged(self, adapter_id: str, adapter: CachedAdapter, folder: Path) -> bool:
        """Whether an indexed folder no longer matches its record; if so it is forgotten."""
        try:
            await asyncio.to_thread(self._store.read_record, folder)
            return False
        except ValueError as exc:
            why = str(exc)
        except OSError as exc:  # the folder or a file of it went while it was read
            why = f"cannot read it: {exc.strerror or exc}"
        # Evicted or restaged by the sidecar meanwhile: that explains it, nothing is wrong.
        if self._store.get(adapter_id) is not adapter or _lstat(folder) is None:
            return False
        log.warning("adapter folder changed outside the sidecar adapter_id=%s (%s); it is no "
                    "longer served and is judged again as a new copy", adapter_id, why,
                    extra=fields(event="external_change", adapter_id=adapter_id, reason=why))
        self._store.forget(adapter_id, changed=True)
        return True

    async def _settle(self, adapter_id: str) -> None:
        """Wait until the folder has had no event for `settle_s` (a copy may be in progress)."""
        loop = asyncio.get_running_loop()
        while True:
            quiet_s = loop.time() - self._last_change.get(adapter_id, -math.inf)
            if quiet_s >= self._settle_s:
                return
            await asyncio.sleep(self._settle_s - quiet_s)

    async def _take_in(self, adapter_id: str, folder: Path) -> None:
        """Validate a folder copied in and adopt it, or quarantine it; never serve it half-way."""
        store = self._store
        seen = self._changes.get(adapter_id, 0)
        started = time.perf_counter()
        before = _lstat(folder)
        if before is None or store.get(adapter_id) is not None:
            return
        if not is_valid_adapter_id(adapter_id):
            self._quarantine(adapter_id, folder, before, "not a valid adapter id", [])
            return
        if not stat.S_ISDIR(before.st_mode):
            self._quarantine(adapter_id, folder, before, "not a folder", [])
            return
        self._adopting.add(adapter_id)
        try:
            inspection = await self._inspect(adapter_id, folder)
            if inspection is None or self._changes.get(adapter_id, 0) != seen:
                return  # still being written: judged again once it settles
            outcome = inspection.signature.outcome
            if outcome is not None:
                self._metrics.signature_verifications.labels(outcome=outcome).inc()
            if inspection.problems:
                reason = "; ".join(f"{p.code} {p.file}" for p in inspection.problems)
                self._quarantine(adapter_id, folder, before, f"not valid: {reason}",
                                 inspection.problems)
                return
            leave_out = frozenset(name.removesuffix("/") for name in inspection.ignored
                                  if name != RECORD_NAME)
            self._leaving_out[adapter_id] = leave_out
            passed = Passed(adapter_id, ADOPTED_SOURCE, inspection.files, inspection.signature)
            try:
                record = await admit_in_place(
                    store, folder, passed, validated=before, leave_out=leave_out,
                    still_ours=lambda: self._changes.get(adapter_id, 0) == seen
                    and self._unindexed(adapter_id, folder, before))
            except OSError as exc:
                log.warning("cannot write the record of adapter folder %s, so it is not "
                            "adopted: %s", adapter_id, exc.strerror or exc)
                return
            if record is None:
                return
        finally:
            self._adopting.discard(adapter_id)
            self._leaving_out.pop(adapter_id, None)
        elapsed_s = time.perf_counter() - started
        left_out = (f"; deleted {len(inspection.ignored)} entries the engine never reads: "
                    f"{listed(inspection.ignored)}" if inspection.ignored else "")
        log.info("adopted adapter_id=%s bytes=%d files=%d in %.2fs (copied in by someone "
                 "else)%s", adapter_id, record.size_bytes, len(record.files), elapsed_s, left_out,
                 extra=fields(event="adopted", adapter_id=adapter_id,
                              size_bytes=record.size_bytes, duration_s=round(elapsed_s, 3),
                              ignored=list(inspection.ignored)))

    async def _inspect(self, adapter_id: str, folder: Path) -> _Inspection | None:
        """Hash and validate a folder (in threads), and check its signature by the digests
        just computed; None if it changed while being read."""
        before = await asyncio.to_thread(_snapshot, folder)
        try:
            plan = await asyncio.to_thread(plan_folder, folder)
        except OSError:
            return None  # gone or replaced meanwhile: its events have it judged again
        files: dict[str, FileRecord] = {}
        scanned: dict[str, ValueReport] = {}  # values checked in the hashing pass
        problems: list[Problem] = []
        for name in plan.fetched:  # only what the engine reads is hashed and kept
            if not stat.S_ISREG(before.get(name, (0, 0, 0))[0]):
                continue  # validation names it
            try:
                size_bytes, crc32, sha256, report = await asyncio.to_thread(
                    _hash_file, folder / name, name == WEIGHTS_FILE)
            except OSError as exc:
                problems.append(Problem("read_error", name, f"cannot read it: {exc}"))
                continue
            files[name] = FileRecord(size_bytes, "", crc32, sha256)
            if report is not None:
                scanned[name] = report
        digests = {name: f.sha256 for name, f in files.items() if f.sha256}
        verdict = await asyncio.to_thread(judge_adapter, folder, self._rules, sha256=digests,
                                          scanned=scanned)
        signature = await asyncio.to_thread(
            verify_folder, folder, adapter_id, self._rules.signing.rule_for(adapter_id),
            {name: f.sha256 for name, f in files.items()})
        # A copy made in one long system call (copy_file_range, a reflink) sends no event
        # until it ends; growing sizes or times still show it is not finished.
        if await asyncio.to_thread(_snapshot, folder) != before:
            return None
        return _Inspection(files, problems + verdict.problems + list(signature.problems),
                           verdict.ignored, signature)

    def _unindexed(self, adapter_id: str, folder: Path, before: os.stat_result) -> bool:
        """Still the same folder, and the sidecar did not stage the id meanwhile."""
        now = _lstat(folder)
        return (self._store.get(adapter_id) is None and now is not None
                and (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino))

    def _quarantine(self, adapter_id: str, folder: Path, before: os.stat_result, reason: str,
                    problems: list[Problem]) -> None:
        if not self._unindexed(adapter_id, folder, before):
            return
        try:
            self._store.quarantine(folder, reason)  # logs the one line of this change
        except OSError as exc:
            log.warning("cannot quarantine adapter folder %r: %s", adapter_id,
                        exc.strerror or exc)
            return
        for code in sorted({p.code for p in problems}):
            self._metrics.validation_failures.labels(reason=code).inc()


# ---- blocking helpers (run in threads) ---------------------------------------------------


def _lstat(path: Path) -> os.stat_result | None:
    """One system call, cheap enough for the loop: it must share a step with the index read."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _list_names(folder: Path) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(folder)}
    except FileNotFoundError:
        return set()


def _snapshot(folder: Path) -> _Snapshot:
    shot: _Snapshot = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return shot
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        shot[entry.name] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return shot


def _hash_file(path: Path, scan_values: bool) -> tuple[int, str, str, ValueReport | None]:
    """(bytes read, CRC-32 hex, SHA-256 hex, and the tensor values' check when asked) of a
    regular file, in one pass, never following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        scan = ValueScan(os.fstat(fd).st_size) if scan_values else None
        digests = hash_fd(fd, feed=scan.stream(0) if scan is not None else None)
        report = scan.finish(fd) if scan is not None else None
    finally:
        os.close(fd)
    return digests.size_bytes, digests.crc32, digests.sha256, report
