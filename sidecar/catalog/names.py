"""What every catalogued name points at, kept true on disk: the live generations and their
journal, spare names bound (once, never re-pointed to other bytes), names of adapters that
left the disk pointed at a no-op or given kept files, and spares someone read before they were
bound (never bound). `catalog.py` decides when a generation is rendered and loaded; this module
renders it and keeps its names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from ..cache.store import AdapterStore
from ..config import Settings
from ..errors import CatalogPending
from ..logs import fields
from ..validation.validate import Rules, validate_adapter
from .generations import (
    CATALOG_DIR,
    NOOP_DIR,
    RETIRED,
    GenerationRecord,
    Journal,
    NoopAdapter,
    adapter_target,
    bind_link,
    create_generation,
    generation_dir,
    keep_bound_files,
    kept_target,
    link_target,
    noop_target,
    point_link,
    read_journal,
    remove_generation,
    remove_strays,
    render_text,
    spare_name,
    write_atomically,
    write_journal,
)
from .read_watch import Key, ReadWatch

log = logging.getLogger(__name__)

CATALOG_FILE = "multi_lora.json"


class Names:
    """`prepare()` then `recover()` (both blocking), `watch()` on the loop; then `render()`,
    `bind()` under `lock`, and the store's hooks `before_evict()` / `after_forget()`.
    `on_change` is called (on the loop) when something needs saving or may free a plan."""

    def __init__(self, settings: Settings, store: AdapterStore, rules: Rules,
                 wall: Callable[[], float]) -> None:
        self._settings = settings
        self._store = store
        self._rules = rules
        self._wall = wall
        self.root = settings.cache_root
        self.path = settings.cache_root / CATALOG_FILE
        self.journal = Journal()
        self.noop: NoopAdapter | None = None
        self.spares_off: str | None = None  # why spare names are off, when they are
        self.reads = ReadWatch()
        self.lock = asyncio.Lock()  # journal changes: short, never across a load
        self.dirty = False  # changed on the loop by a hook; saved by the catalog's next step
        self.on_change: Callable[[], None] = lambda: None
        self._orphans: dict[int, float] = {}  # generation folders no journal names -> delete at

    @property
    def spares_on(self) -> bool:
        return self.noop is not None and self.spares_off is None

    def current(self) -> GenerationRecord | None:
        number = self.journal.current
        return self.journal.generations.get(number) if number is not None else None

    # ---- start ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Blocking. The no-op adapter (none without the base model's shapes), checked by the
        same gate as every adapter, and why spare names are off when they are."""
        shapes = self._rules.shapes
        if shapes is None:
            self.spares_off = ("spare names need --base-model-config (the base model's "
                               "config.json): the no-op adapter an unbound spare points at must "
                               "fit the model")
            return
        try:
            noop = NoopAdapter.for_model(shapes, self._rules.allowed_target_modules)
        except ValueError as exc:
            self.spares_off = str(exc)
            return
        probe = self.root / CATALOG_DIR / f".noop-check.{os.getpid()}"
        try:
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
        self.noop = noop
        if self._settings.spare_names == 0:
            self.spares_off = "--spare-names is 0"

    def recover(self) -> None:
        """Blocking. Take the journal if multi_lora.json is still its current generation;
        tidy every name whose link a crash left behind. Folders of generations no journal
        names are deleted after the retire grace (an engine may still read them)."""
        (self.root / CATALOG_DIR).mkdir(parents=True, exist_ok=True)
        try:
            journal = read_journal(self.root)
        except ValueError as exc:
            log.warning("catalog: the journal cannot be used (%s); a new generation is "
                        "rendered", exc)
            journal = Journal()
        current = journal.generations.get(journal.current) if journal.current else None
        if current is not None:
            try:
                on_disk = self.path.read_text(encoding="utf-8")
            except OSError:
                on_disk = None
            if on_disk != render_text(current, self._settings.triton_root) or not (
                generation_dir(self.root, current.number).is_dir()
            ):
                log.warning("catalog: %s is not generation %d of the journal; a new "
                            "generation is rendered", self.path.name, current.number)
                journal = Journal(generations={})
        self.journal = journal
        for record in journal.generations.values():
            self.repair(record)
        grace_at = self._wall() + self._settings.lease_ttl_s
        for entry in (self.root / CATALOG_DIR).iterdir():
            if (entry.name.startswith("g") and entry.name[1:].isdigit()
                    and int(entry.name[1:]) not in journal.generations):
                self._orphans[int(entry.name[1:])] = grace_at
        remove_strays(self.root, keep=[*journal.generations, *self._orphans])
        if journal.generations:
            write_journal(self.root, journal)  # with the repairs
        carried = self.current()
        if carried is not None:
            log.info("catalog: carrying on with generation %d (%d adapters, %d bound spare "
                     "names)", carried.number, len(carried.adapter_ids), len(carried.bound))

    def watch(self) -> None:
        """On the loop: watch every unbound spare's no-op for reads."""
        if self.noop is not None and not self.reads.available:
            log.warning("catalog: %s: a direct call to vllm_model with an unbound spare name "
                        "could make the adapter bound to it later answer like the base model",
                        self.reads.problem)
        for record in self.journal.generations.values():
            self._watch_unbound(record)
        if self.reads.fd is not None:
            asyncio.get_running_loop().add_reader(self.reads.fd,
                                                  self.reads.on_readable(self.on_reads))

    def close(self) -> None:
        if self.reads.fd is not None:
            asyncio.get_running_loop().remove_reader(self.reads.fd)
        self.reads.close()

    # ---- keeping every name true --------------------------------------------------------

    def repair(self, record: GenerationRecord) -> None:
        """Make every name's link agree with the journal (after a crash, or tampering before a
        load). A binding journaled but never linked, or linked but never journaled, was never
        handed out: that spare goes back to its no-op, burnt. A name whose adapter left
        adapters/ unkept goes to a no-op (never dangling: that would kill the engine) and is
        never handed out again. A few system calls per name."""
        adapters = self._store.adapters_dir
        noops = generation_dir(self.root, record.number) / NOOP_DIR
        if self.noop is not None and noops.is_dir():
            # A no-op removed behind the sidecar's back is written again: a name pointing at
            # it must resolve. (The bytes are the same: nothing is re-pointed.)
            for name in (RETIRED, *record.spares):
                if not (noops / name / "adapter_model.safetensors").is_file():
                    shutil.rmtree(noops / name, ignore_errors=True)
                    self.noop.write(noops / name)
                    log.warning("catalog: the no-op adapter of %s in generation %d was gone; "
                                "written again", name, record.number)
        for adapter_id in record.adapter_ids:
            target = link_target(self.root, record.number, adapter_id)
            if target == noop_target(RETIRED):
                record.retire_own(adapter_id)
            elif not (adapters / adapter_id).is_dir() and (noops / RETIRED).is_dir():
                point_link(self.root, record.number, adapter_id, noop_target(RETIRED))
                record.retire_own(adapter_id)
        kept = generation_dir(self.root, record.number) / "kept"
        for spare in record.spares:
            target = link_target(self.root, record.number, spare)
            bound_id = record.bound.get(spare)
            if spare in record.burnt:
                if target not in (noop_target(spare), kept_target(spare)):
                    self.burn(record, spare, "it is burnt")
            elif bound_id is None:
                if target != noop_target(spare):
                    self.burn(record, spare, f"its link pointed at {target}")
            elif target == kept_target(spare):
                if (kept / spare).is_dir():
                    record.kept.add(spare)
                else:
                    self.burn(record, spare, "its kept files are gone")
            elif target != adapter_target(bound_id):
                self.burn(record, spare, "the binding was journaled but never linked")
            elif not (adapters / bound_id).is_dir():
                if (kept / spare).is_dir():
                    point_link(self.root, record.number, spare, kept_target(spare))
                    record.kept.add(spare)
                else:
                    self.burn(record, spare, f"{bound_id} left the disk and was not kept")

    def burn(self, record: GenerationRecord, spare: str, why: str) -> None:
        """Point a spare at its no-op and never hand it out again (a few system calls). The
        journal is saved by the catalog's next step."""
        point_link(self.root, record.number, spare, noop_target(spare))
        self.reads.unwatch((record.number, spare))
        record.retire_name(spare)
        self.dirty = True
        log.warning("catalog: spare name %s of generation %d is never handed out again (%s)",
                    spare, record.number, why)

    def _watch_unbound(self, record: GenerationRecord) -> None:
        for spare in record.free_spares():
            folder = generation_dir(self.root, record.number) / NOOP_DIR / spare
            self.reads.watch((record.number, spare), folder)

    def on_reads(self, read: set[Key]) -> None:
        """Spares whose no-op someone opened: the engine may cache it under that name."""
        for number, spare in sorted(read):
            record = self.journal.generations.get(number)
            if record is None or spare in record.burnt:
                continue
            if spare in record.bound:
                why = f"its no-op was read while it was being bound to {record.bound[spare]}"
            else:
                why = "its no-op adapter was read before it was bound (a direct call to " \
                      "vllm_model?)"
            self.burn(record, spare, why)
        if read:
            self.on_change()

    # ---- binding -------------------------------------------------------------------------

    async def bind(self, record: GenerationRecord, adapter_id: str) -> str | None:
        """One attempt, under `lock`, with a free spare left: the spare bound (journal, then
        link, then handed out), or None when its no-op turned out read meanwhile."""
        # Random: which spare is bound next cannot be guessed by a direct caller.
        spare = random.choice(record.free_spares())
        record.bind(spare, adapter_id)
        try:
            await asyncio.to_thread(write_journal, self.root, self.journal)
            await asyncio.to_thread(bind_link, self.root, record.number, spare, adapter_id)
        except OSError as exc:
            record.unbind_failed(spare)
            raise CatalogPending(f"could not bind a spare name to adapter {adapter_id}: "
                                 f"{exc.strerror or exc}", adapter_id=adapter_id) from exc
        # Every open of the no-op queued before the link moved is in the queue now.
        self.on_reads(self.reads.drain())
        if spare in record.burnt:
            return None
        self.reads.unwatch((record.number, spare))
        if self._store.get(adapter_id) is None:
            # Evicted by force while the link was being made: never hand out a name that
            # could dangle.
            self.burn(record, spare, f"{adapter_id} was evicted while it was being bound")
            raise CatalogPending(f"adapter {adapter_id} left the disk while a spare name was "
                                 "bound to it; stage it again", adapter_id=adapter_id)
        record.publish(spare)
        return spare

    # ---- the store's hooks (on the loop) ---------------------------------------------------

    def before_evict(self, adapter_id: str, folder: Path) -> None:
        """An adapter's folder is about to leave adapters/. Where a generation lists it by its
        own name, that name points at a no-op from now on and is never handed out again (a
        re-stage binds a spare); where a spare is bound to it, the spare keeps hard links to
        its files until the generation retires. No catalogued name ever dangles."""
        for record in list(self.journal.generations.values()):
            if adapter_id in record.own:
                self._retire_own(record, adapter_id, "it left the disk")
            spare = record.by_adapter.get(adapter_id)
            if spare is None or spare in record.kept:
                continue
            try:
                keep_bound_files(self.root, record.number, spare, folder)
            except OSError as exc:
                self.burn(record, spare, f"{adapter_id}'s files could not be kept: "
                          f"{exc.strerror or exc}")
                continue
            record.kept.add(spare)
            log.info("catalog: spare name %s keeps the files of evicted adapter %s until "
                     "generation %d retires", spare, adapter_id, record.number)
        self.on_change()

    def after_forget(self, adapter_id: str) -> None:
        """An adapter's folder vanished or changed outside the sidecar: its names that still
        lead to adapters/<id> point at a no-op and are never handed out again."""
        for record in list(self.journal.generations.values()):
            if adapter_id in record.own:
                self._retire_own(record, adapter_id, "it was removed or changed outside the "
                                 "sidecar")
            spare = record.by_adapter.get(adapter_id)
            if spare is not None and spare not in record.kept:
                self.burn(record, spare, f"{adapter_id} was removed or changed outside the "
                          "sidecar")
        self.on_change()

    def _retire_own(self, record: GenerationRecord, adapter_id: str, why: str) -> None:
        if not (generation_dir(self.root, record.number) / NOOP_DIR / RETIRED).is_dir():
            return  # no no-op without --base-model-config: the name dangles, as it always did
        try:
            point_link(self.root, record.number, adapter_id, noop_target(RETIRED))
        except OSError as exc:
            log.warning("catalog: cannot point %s of generation %d at a no-op: %s", adapter_id,
                        record.number, exc.strerror or exc)
            return
        record.retire_own(adapter_id)
        self.dirty = True
        log.info("catalog: the name %s of generation %d answers like the base model from now "
                 "on (%s); the adapter's next stage binds a spare name", adapter_id,
                 record.number, why)

    # ---- generations -----------------------------------------------------------------------

    async def render(self, adapter_ids: Iterable[str]) -> GenerationRecord:
        """A new generation, made current: the given adapters by their own names, and fresh
        spare names. Its folder and the journal first, multi_lora.json last."""
        number = await asyncio.to_thread(self.journal.next_number, self.root)
        ids = frozenset(adapter_ids)
        spares = tuple(spare_name(number, i) for i in range(1, self._settings.spare_names + 1)
                       ) if self.spares_on else ()
        record = GenerationRecord(number, ids, spares, self._wall())
        await asyncio.to_thread(create_generation, self.root, record, self.noop)
        self._watch_unbound(record)
        async with self.lock:
            self.journal.generations[number] = record
            self.journal.current = number
            await self.save()
        text = render_text(record, self._settings.triton_root)
        await asyncio.to_thread(write_atomically, self.path, text.encode("utf-8"))
        return record

    async def save(self) -> None:
        """Write the journal (the caller holds `lock`, or is the only writer)."""
        self.dirty = False
        await asyncio.to_thread(write_journal, self.root, self.journal)

    def retire_times(self) -> list[float]:
        times = [r.retire_at for r in self.journal.generations.values() if r.retire_at]
        return [*times, *self._orphans.values()]

    async def retire(self, live: set[int]) -> None:
        """Mark generations not in `live` for deletion after the grace (an old engine finishing
        its requests may still read them); delete those past it."""
        journal = self.journal
        now = self._wall()
        changed = False
        for record in journal.generations.values():
            if record.number in live:
                if record.retire_at is not None:
                    record.retire_at, changed = None, True
            elif record.retire_at is None:
                record.retire_at, changed = now + self._settings.lease_ttl_s, True
        gone = [r.number for r in journal.generations.values()
                if r.retire_at is not None and r.retire_at <= now]
        orphans = [n for n, at in self._orphans.items() if at <= now]
        if not (gone or orphans or changed):
            return
        async with self.lock:
            for number in gone:
                for spare in journal.generations[number].spares:
                    self.reads.unwatch((number, spare))
                del journal.generations[number]
            await self.save()
        for number in [*gone, *orphans]:
            self._orphans.pop(number, None)
            await asyncio.to_thread(remove_generation, self.root, number)
            log.info("catalog: generation %d retired (its folder is deleted)", number,
                     extra=fields(event="retired", generation=number))
