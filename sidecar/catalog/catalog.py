"""The catalog: the one owner of the names vLLM knows. It keeps every live generation's names
(own names of the adapters on disk when it was rendered, and spare names), what version of which
adapter each belongs to, the links on the volume that make each name read what it should, the
journal that lets a restarted sidecar carry on, and the watch on every no-op the engine could
read. What a name may become is decided by name_state.py; when a generation is rendered and
loaded, by reloads.py (loads.py does it); the request's use case is naming.py.

The rules it keeps (../shared/LORA-CACHES.md): a name leads to one version's bytes for the life
of its generation, or to a no-op; never to a missing folder, never to other bytes. A version that
leaves the disk parks its name at the name's own no-op; the same bytes staged again take it back
unless the engine read the no-op meanwhile (burnt: that version takes a fresh spare).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ..cache.store import StoreListener
from ..core.errors import CatalogPending
from ..core.logs import fields
from ..core.metrics import Metrics
from ..validation.validate import Rules, validate_adapter
from . import disk
from .disk import NoopAdapter
from .generation import CatalogJournal, Entry, Generation
from .name_state import WATCHED, NameEvent, NameState, Version
from .read_watch import ReadWatch

log = logging.getLogger(__name__)


class NoNameLeft(Exception):
    """A version needs a name and its generation has no spare left to give (or spares are off)."""

    def __init__(self, generation: int, why: str) -> None:
        super().__init__(why)
        self.generation = generation
        self.why = why


@dataclass(frozen=True, slots=True)
class Change:
    """A name that changed, for the log and the metrics."""

    generation: int
    name: str
    event: NameEvent
    state: NameState
    version: Version | None
    why: str


class Catalog(StoreListener):
    """`prepare()` and `recover()` (blocking, in a thread), then `watch()` on the loop. The
    store tells it `leaving()` / `vanished()`; naming.py asks `serving_name()` (the hit
    path) and `name()`; loads.py asks `render()`, `mark_loaded()`; reloads.py `retire()`."""

    def __init__(self, root: Path, triton_root: Path, rules: Rules, metrics: Metrics, *,
                 lease_ttl_s: float, spares_wanted: bool = True,
                 on_change: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.root = root
        self.path = root / disk.CATALOG_FILE
        self._triton_root = triton_root
        self._rules = rules
        self._metrics = metrics
        self._grace_s = lease_ttl_s  # an old engine may still read a replaced generation
        self._spares_wanted = spares_wanted
        self._clock = clock
        self._wall = wall
        self.catalog_journal = CatalogJournal()
        self.noop: NoopAdapter | None = None
        self.noop_from = ""  # where the no-op's shapes came from
        self.spares_off: str | None = None  # why spare names are off, when they are
        self.reads = ReadWatch(clock)
        self._lock = asyncio.Lock()  # journal writes and name switches that await
        self.dirty = False  # changed by a synchronous hook; saved by save_if_dirty()
        self._on_change = on_change  # something to save or a plan to free
        self._orphans: dict[int, float] = {}  # folders no journal names -> delete after (unix)
        self.disk_bytes = 0  # the catalog's own bytes on the volume, as last measured
        self._judging: asyncio.TimerHandle | None = None
        self._unwatched_said = False
        self._gone_said: set[int] = set()  # generations whose folder vanished, said once
        self._changes = {event: metrics.catalog_name_changes.labels(change=change)
                         for event, change in ((NameEvent.BIND, "bound"),
                                               (NameEvent.LEAVE, "parked"),
                                               (NameEvent.RETURN, "returned"))}
        self._burnt = metrics.catalog_name_changes.labels(change="burnt")

    # ---- start ---------------------------------------------------------------------------

    @property
    def spares_on(self) -> bool:
        return self.noop is not None and self.spares_off is None

    def current(self) -> Generation | None:
        return self.catalog_journal.current_generation()

    def generation(self, number: int | None) -> Generation | None:
        return self.catalog_journal.generations.get(number) if number is not None else None

    def prepare(self) -> None:
        """Blocking. The no-op adapter from the base model's shapes (--base-model-config),
        checked by the same gate as every adapter; why spare names are off when they are."""
        shapes = self._rules.shapes
        if shapes is None:
            self.spares_off = (
                "the base model's shapes are unknown: give --base-model-config (the base "
                "model's config.json), or stage one adapter and the next generation takes its "
                "shapes; until then no name can be parked at a no-op, and a spare name cannot "
                "exist")
            return
        try:
            noop = NoopAdapter.for_model(shapes, self._rules.allowed_target_modules)
        except ValueError as exc:
            self.spares_off = str(exc)
            return
        self._check_noop(noop, "--base-model-config")

    def _check_noop(self, noop: NoopAdapter, source: str) -> None:
        probe = self.root / disk.CATALOG_DIR / f".noop-check.{os.getpid()}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(probe, ignore_errors=True)
            noop.write(probe)
            problems = validate_adapter(probe, self._rules)
        except OSError as exc:
            self.spares_off = f"cannot write the no-op adapter: {exc.strerror or exc}"
            return
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        if problems:
            self.spares_off = "the no-op adapter fails validation: " + "; ".join(
                f"{p.code} {p.message}" for p in problems)
            return
        self.noop, self.noop_from = noop, source
        self.spares_off = None if self._spares_wanted else "--spare-names is 0"

    def prepare_from(self, noop: NoopAdapter, source: str) -> None:
        """Blocking. A no-op whose shapes come from elsewhere than the base model's config
        (an adapter on disk), checked by the same gate."""
        self._check_noop(noop, source)

    def recover(self, on_disk: Callable[[str], str | None]) -> list[Change]:
        """Blocking. Take the journal if multi_lora.json is still its current generation, and
        make every name's link agree with it and with what is on disk (`on_disk(id)` is the
        digest of the version of `id` on disk, or None). Folders of generations no journal
        names are deleted after the grace (an engine may still read them)."""
        try:
            journal = disk.read_catalog_journal(self.root)
        except ValueError as exc:
            log.warning("catalog: the journal cannot be used (%s); a new generation is "
                        "rendered", exc)
            journal = CatalogJournal()
        current = journal.current_generation()
        if current is not None:
            try:
                on_file = self.path.read_text(encoding="utf-8")
            except OSError:
                on_file = None
            if on_file != disk.render_text(current, self._triton_root) or not (
                    disk.generation_dir(self.root, current.number).is_dir()):
                log.warning("catalog: %s is not generation %d of the journal; a new "
                            "generation is rendered", self.path.name, current.number)
                journal = CatalogJournal()
        self.catalog_journal = journal
        changes = [change for generation in journal.generations.values()
                   for change in self.repair(generation, on_disk)]
        grace_at = self._wall() + self._grace_s
        for number in disk.generation_numbers_on_disk(self.root) - set(journal.generations):
            self._orphans[number] = grace_at
        disk.remove_strays(self.root, keep=[*journal.generations, *self._orphans])
        if journal.generations:
            disk.write_catalog_journal(self.root, disk.catalog_journal_bytes(journal))
        self.disk_bytes = disk.disk_bytes(self.root)
        carried = self.current()
        if carried is not None:
            log.info("catalog: carrying on with generation %d (%d names: %s)", carried.number,
                     len(carried.names), carried.state_counts())
        return changes

    def watch(self) -> None:
        """On the loop: watch every no-op the engine could read now."""
        if self.noop is not None and not self.reads.available:
            log.warning("catalog: %s: a direct call to vllm_model with a name at a no-op could "
                        "make the adapter it is given later answer like the base model",
                        self.reads.problem)
        for generation in self.catalog_journal.generations.values():
            for name in generation.in_state(*WATCHED):
                self._watch(generation.number, name)
        if self.reads.fd is not None:
            asyncio.get_running_loop().add_reader(self.reads.fd, self.check_reads)

    def close(self) -> None:
        if self._judging is not None:
            self._judging.cancel()
        if self.reads.fd is not None:
            asyncio.get_running_loop().remove_reader(self.reads.fd)
        self.reads.close()

    # ---- keeping every name true --------------------------------------------------------

    def repair(self, generation: Generation,
               on_disk: Callable[[str], str | None]) -> list[Change]:
        """Make every name's link agree with the journal and the disk (after a crash, or
        tampering before a load). A few system calls per name.

        - bound, and its version is on disk: the link leads there;
        - bound, and its version is not on disk: parked (the link goes to its no-op);
        - bound in the journal but its link still at the no-op: a binding journaled but
          never linked, so never handed out, or a return never finished: burnt (the engine
          may have read the no-op meanwhile, unseen);
        - anything else not bound: at its no-op, never anywhere else.
        """
        changes = []
        number = generation.number
        for name, entry in generation.names.items():
            if entry.state is NameState.RETIRED:
                continue
            target = disk.link_target(self.root, number, name)
            version = entry.version
            if entry.state is NameState.BOUND and version is not None:
                at_adapter = target == disk.adapter_target(version.adapter_id)
                if not at_adapter and target is not None:
                    changes.append(self._switch(generation, name, NameEvent.FAIL,
                                                "its binding was journaled but never linked"))
                elif on_disk(version.adapter_id) != version.digest:
                    changes.append(self._switch(generation, name, NameEvent.LEAVE,
                                                f"{version} is no longer on disk"))
                elif target is None:
                    disk.point_link(self.root, number, name,
                                    disk.adapter_target(version.adapter_id))
                continue
            if entry.state in (NameState.UNBOUND, NameState.PARKED, NameState.BURNT):
                if entry.state is not NameState.BURNT and target not in (
                        None, disk.noop_target(name)):
                    changes.append(self._switch(generation, name, NameEvent.FAIL,
                                                f"its link pointed at {target}"))
                    continue
                disk.ensure_noop(self.root, number, name, self.noop)
                if target != disk.noop_target(name):
                    disk.point_link(self.root, number, name, disk.noop_target(name))
        for change in changes:
            self._note(change)
        return changes

    def _switch(self, generation: Generation, name: str, event: NameEvent, why: str,
                version: Version | None = None) -> Change:
        """Move a name through the state machine and point its link where its new state says
        (a few system calls: fits the loop). Its no-op is watched while the engine could read
        it. The journal is saved by the next save_if_dirty(), or by the caller."""
        number = generation.number
        entry = generation.apply(name, event, why, version)
        key = (number, name)
        if not self._folder_there(number):
            pass  # no link of it leads anywhere; none is written into a folder made anew
        elif entry.state is NameState.BOUND:
            assert entry.version is not None
            disk.point_link(self.root, number, name, disk.adapter_target(entry.version.adapter_id))
        elif entry.state is not NameState.RETIRED:
            # Never dangling: a no-op to lead to, where the model's shapes are known.
            disk.ensure_noop(self.root, number, name, self.noop)
            disk.point_link(self.root, number, name, disk.noop_target(name))
        if entry.state in WATCHED:
            self._watch(number, name)
        else:
            self.reads.unwatch(key)
        self.dirty = True
        return Change(number, name, event, entry.state, entry.version, why)

    def _folder_there(self, number: int) -> bool:
        """Whether generation `number`'s names/ folder exists (one stat). Removed outside the
        sidecar (a wipe of the cache root), its names cannot be linked: said once, and the
        journal keeps their states, so a move of a name there never fails an eviction."""
        if disk.names_dir(self.root, number).is_dir():
            return True
        if number not in self._gone_said:
            self._gone_said.add(number)
            log.error("catalog: the folder of generation %d was removed outside the sidecar; "
                      "its names lead nowhere and are no longer handed out (a new generation "
                      "lists the adapters)", number,
                      extra=fields(event="generation_gone", generation=number))
        return False

    def _watch(self, number: int, name: str) -> None:
        watched = self.reads.watch((number, name), disk.noop_dir(self.root, number, name))
        if not watched and self.reads.available and not self._unwatched_said:
            self._unwatched_said = True
            log.warning("catalog: %s; names whose no-op cannot be watched are not handed out "
                        "(fewer spares: lower --spare-names-max or raise the limit)",
                        self.reads.problem)

    def _note(self, change: Change) -> None:
        counter = self._changes.get(change.event)
        if counter is not None:
            counter.inc()
        if change.state is NameState.BURNT:
            self._burnt.inc()
        level = logging.WARNING if change.state is NameState.BURNT else logging.INFO
        version = change.version
        log.log(level, "catalog: name %s of generation %d %s: %s%s", change.name,
                change.generation, change.state.value, change.why,
                f" ({version})" if version and version.adapter_id not in change.why else "",
                extra=fields(event=f"name_{change.state.value}", lora_name=change.name,
                             generation=change.generation,
                             adapter_id=version.adapter_id if version else None,
                             digest=version.digest if version else None, why=change.why))

    # ---- reads of no-ops -----------------------------------------------------------------

    def check_reads(self) -> None:
        """Take what the read watch saw; burn every name the engine read at its no-op (on the
        loop: the reader callback, and before any switch of a name)."""
        self.reads.drain()
        read = self.reads.judge.judge(self._clock())
        burnt = False
        for number, name in sorted(read):
            generation = self.generation(number)
            if generation is None or name not in generation.names:
                continue
            entry = generation.names[name]
            if generation.is_pending(name):
                # Read while its link was being switched to a version: it may hold the no-op.
                self._note(self._switch(generation, name, NameEvent.FAIL,
                                        "its no-op was read while it was being switched"))
                burnt = True
                continue
            if entry.state not in WATCHED:
                continue
            why = ("its no-op was read before it was bound (a direct call to vllm_model?)"
                   if entry.state is NameState.UNBOUND else
                   f"its no-op was read while {entry.version} was off the disk")
            self._note(self._switch(generation, name, NameEvent.READ, why))
            burnt = True
        due = self.reads.judge.next_due(self._clock())
        if due is not None and self._judging is None:
            self._judging = asyncio.get_running_loop().call_later(due, self._judge_later)
        if burnt:
            self._on_change()

    def _judge_later(self) -> None:
        self._judging = None
        self.check_reads()

    # ---- names for a request -------------------------------------------------------------

    def serving_name(self, number: int, adapter_id: str, digest: str) -> str | None:
        """The name of this version in generation `number`, if it is bound (the hit path: two
        dict lookups)."""
        generation = self.catalog_journal.generations.get(number)
        return generation.serving_name(adapter_id, digest) if generation is not None else None

    async def name(self, number: int, version: Version,
                   still_on_disk: Callable[[], bool]) -> tuple[str, NameEvent | None]:
        """Give a staged version a name in generation `number`: the one it is parked under if
        the engine never read its no-op, else a fresh spare. Returns the name and how it was
        got (RETURN or BIND; None when another caller named it meanwhile). NoNameLeft when no
        spare is left; CatalogPending when the version left the disk meanwhile."""
        async with self._lock:
            while True:
                generation = self.generation(number)
                if generation is None:
                    raise CatalogPending(f"catalog generation {number} was retired meanwhile; "
                                         "stage it again", adapter_id=version.adapter_id)
                if not self._folder_there(number):
                    raise NoNameLeft(number, f"the folder of generation {number} was removed "
                                     "outside the sidecar")
                name = generation.serving_name(version.adapter_id, version.digest)
                if name is not None:
                    return name, None
                if not still_on_disk():
                    raise CatalogPending(f"adapter {version.adapter_id} left the disk before a "
                                         "name was given to it; stage it again",
                                         adapter_id=version.adapter_id)
                self.check_reads()
                name, event = self._pick(generation, version)
                entry = generation.apply(name, event, "staged again" if event is NameEvent.RETURN
                                         else "a version the generation did not list", version,
                                         pending=True)
                # Durable before the link moves: a restart knows whom the name belongs to.
                await self._save()
                if entry.state is not NameState.BOUND:
                    continue  # parked or burnt meanwhile: look again
                if not still_on_disk():
                    self._note(self._switch(generation, name, NameEvent.LEAVE,
                                            "its adapter left the disk while it was named"))
                    continue
                if not self._link(generation, name, entry):
                    continue
                if await self._linked_durably(generation, name, entry):
                    self._note(Change(number, name, event, NameState.BOUND, version, entry.why))
                    return name, event

    def _pick(self, generation: Generation, version: Version) -> tuple[str, NameEvent]:
        number = generation.number
        parked = generation.held_name(version)
        if parked is not None and self._clean((number, parked)):
            return parked, NameEvent.RETURN
        if not self.spares_on:
            raise NoNameLeft(number, f"spare names are off ({self.spares_off})")
        # Random: which spare is bound next cannot be guessed by a direct caller of vllm_model.
        # Drawn, then checked: a spare that is not clean is set aside and another drawn, so
        # each clean spare is as likely, and a binding checks a few spares, not thousands.
        free = generation.free_spares()
        while free:
            drawn = random.randrange(len(free))
            if self._clean((number, free[drawn])):
                return free[drawn], NameEvent.BIND
            free[drawn] = free[-1]
            free.pop()
        raise NoNameLeft(generation.number, "no spare name is left")

    def _clean(self, key: tuple[int, str]) -> bool:
        """Whether a name at a no-op can be handed out: nothing says the engine opened it, and
        a read would have been seen (a folder inotify could not watch, for want of watches,
        is never handed out)."""
        if self.reads.judge.maybe_engine(key):
            return False
        return not self.reads.available or self.reads.is_watched(key)

    def _link(self, generation: Generation, name: str, entry: Entry) -> bool:
        """Point a name just bound or returned at its version, then make sure the engine did
        not open its no-op before the switch (an open is queued before it returns). No await
        in between: nothing else can move the name meanwhile. False when it was burnt."""
        number, version = generation.number, entry.version
        assert version is not None
        key = (number, name)
        try:
            disk.point_link(self.root, number, name, disk.adapter_target(version.adapter_id),
                            durable=False)
        except OSError as exc:
            self._fail_link(generation, name, version, exc)
        self.reads.drain()
        if self.reads.judge.maybe_engine(key):
            self._note(self._switch(generation, name, NameEvent.FAIL,
                                    "its no-op was opened while it was being switched"))
            return False
        self.reads.unwatch(key)
        return True

    async def _linked_durably(self, generation: Generation, name: str, entry: Entry) -> bool:
        """The switched link made durable in a worker thread, not on the loop (an fsync can
        take milliseconds, and every hit would wait behind it); the name stays pending, so
        no caller is given it, until then. False when the name moved meanwhile (the caller
        looks again). A crash before the fsync leaves the binding journaled and the link at
        the no-op, which the start-up repair burns."""
        version = entry.version
        assert version is not None
        try:
            await asyncio.to_thread(disk.sync_names, self.root, generation.number)
        except OSError as exc:
            if self._still_pending(generation, name):
                self._fail_link(generation, name, version, exc)
            raise _no_name(version, exc) from exc
        if not self._still_pending(generation, name):
            return False  # parked, burnt or retired while the fsync ran
        generation.linked(name)
        return True

    def _still_pending(self, generation: Generation, name: str) -> bool:
        """Whether nothing moved a name since it was bound pending: every change of a name
        ends its pending state, and only `name` (under the lock) makes one pending."""
        return self.generation(generation.number) is generation and generation.is_pending(name)

    def _fail_link(self, generation: Generation, name: str, version: Version,
                   exc: OSError) -> NoReturn:
        self._note(self._switch(generation, name, NameEvent.FAIL,
                                f"its link could not be made: {exc.strerror or exc}"))
        raise _no_name(version, exc) from exc

    # ---- the store's hooks (on the loop) ---------------------------------------------------

    def leaving(self, adapter_id: str) -> None:
        """A version's folder is about to leave adapters/: every name bound to it is parked at
        its no-op first, so none ever leads to a missing folder or, later, to other bytes."""
        self._park_all(adapter_id, "its adapter left the disk; it returns if the same bytes "
                       "are staged")

    def vanished(self, adapter_id: str, changed: bool) -> None:
        """A published folder was removed by hand (its names are parked, as if evicted), or
        changed in place (burnt: the engine may have read whatever was there)."""
        if not changed:
            self._park_all(adapter_id, "its adapter's folder was removed outside the sidecar")
            return
        for generation in list(self.catalog_journal.generations.values()):
            name = generation.bound_name_of(adapter_id)
            if name is not None:
                self._note(self._switch(generation, name, NameEvent.FAIL,
                                        "its adapter's folder was changed outside the sidecar"))
        self._on_change()

    def _park_all(self, adapter_id: str, why: str) -> None:
        for generation in list(self.catalog_journal.generations.values()):
            name = generation.bound_name_of(adapter_id)
            if name is not None:
                self._note(self._switch(generation, name, NameEvent.LEAVE, why))
        self._on_change()

    # ---- generations -----------------------------------------------------------------------

    async def render(self, versions: Iterable[Version], spares: int,
                     on_disk: Callable[[str], str | None]) -> Generation:
        """A new generation, made current: the given versions by their own names, and
        `spares` spare names (none while spares are off). Its folder and the journal first,
        multi_lora.json last. `on_disk(id)` is the digest on disk now: a version that left
        while the folder was being made is parked before anything can name it."""
        async with self._lock:
            number = max({*self.catalog_journal.generations, *disk.generation_numbers_on_disk(
                self.root), *self._orphans}, default=0) + 1
            generation = Generation.render(number, versions, spares if self.spares_on else 0,
                                           self._wall())
            await asyncio.to_thread(disk.create_generation, self.root, generation, self.noop)
            self.catalog_journal.generations[number] = generation
            self.catalog_journal.current = number
            for name, entry in list(generation.names.items()):
                version = entry.version
                if version is not None and on_disk(version.adapter_id) != version.digest:
                    self._note(self._switch(generation, name, NameEvent.LEAVE,
                                            "its adapter left the disk while the generation "
                                            "was rendered"))
            await self._save()
            for name in generation.in_state(*WATCHED):
                self._watch(number, name)
            text = disk.render_text(generation, self._triton_root)
            await asyncio.to_thread(disk.write_atomically, self.path, text.encode("utf-8"))
        await self.measure()
        return generation

    async def mark_loaded(self, number: int) -> None:
        async with self._lock:
            self.catalog_journal.loaded = number
            await self._save()

    async def save_if_dirty(self) -> None:
        if self.dirty:
            async with self._lock:
                await self._save()

    async def _save(self) -> None:
        """Write the journal (the caller holds the lock)."""
        self.dirty = False
        await asyncio.to_thread(disk.write_catalog_journal, self.root,
                                disk.catalog_journal_bytes(self.catalog_journal))

    def retire_times(self) -> list[float]:
        times = [g.retire_at for g in self.catalog_journal.generations.values() if g.retire_at]
        return [*times, *self._orphans.values()]

    async def retire(self, live: set[int]) -> None:
        """Mark generations not in `live` for deletion after the grace (an old engine finishing
        its requests may still read them); delete those past it."""
        journal = self.catalog_journal
        now = self._wall()
        changed = False
        for generation in journal.generations.values():
            if generation.number in live:
                if generation.retire_at is not None:
                    generation.retire_at, changed = None, True
            elif generation.retire_at is None:
                generation.retire_at, changed = now + self._grace_s, True
        gone = [g for g in journal.generations.values()
                if g.retire_at is not None and g.retire_at <= now]
        orphans = [n for n, at in self._orphans.items() if at <= now]
        if not (gone or orphans or changed):
            return
        async with self._lock:
            for generation in gone:
                for name in list(generation.names):
                    self.reads.unwatch((generation.number, name))
                del journal.generations[generation.number]
            await self._save()
        for number in [*(g.number for g in gone), *orphans]:
            self._orphans.pop(number, None)
            await asyncio.to_thread(disk.remove_generation, self.root, number)
            log.info("catalog: generation %d retired (its folder is deleted)", number,
                     extra=fields(event="retired", generation=number))
        await self.measure()

    async def measure(self) -> None:
        self.disk_bytes = await asyncio.to_thread(disk.disk_bytes, self.root)


def _no_name(version: Version, exc: OSError) -> CatalogPending:
    """A name's link could not be made, or made durable."""
    return CatalogPending(f"could not give adapter {version.adapter_id} a name: "
                          f"{exc.strerror or exc}", adapter_id=version.adapter_id)
