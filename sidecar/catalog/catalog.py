"""The catalog: which names Triton's vLLM model knows (multi_lora.json, one generation at a
time), which name a request must send for an adapter (its own, or a spare bound to it without
a reload), when a new generation is worth a reload (compaction), and the reloads themselves.

A generation lists every adapter validated and on disk when it is rendered, by its own name,
plus `--spare-names` spare names. A spare points at a no-op adapter until the first stage of an
adapter the generation does not list binds it (once, never re-pointed to other bytes). What
each name points at is kept by `names.py`; what Triton's model is doing, by `engine_state.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..cache.store import AdapterStore
from ..config import Settings, TritonReload
from ..errors import CatalogPending, CatalogReloading
from ..fsutil import iso_utc
from ..logs import fields
from ..metrics import Metrics
from ..validation.validate import Rules
from .engine_state import EngineState, EngineTracker, LoadKind, LoadOutcome, Probe, Transition
from .generations import GenerationRecord, kept_bytes
from .names import Names
from .triton_control import ModelControl, ReloadFailed, TritonControl

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 5.0
PROBE_INTERVAL_S = 2.0


class CompactionReason(Enum):
    EXHAUSTED = "exhausted"  # an adapter waits for a name and no spare is left
    SPARES_LOW = "spares_low"  # spares left at or below --compact-below
    WINDOW = "window"  # the quiet window, with something to tidy
    REQUESTED = "requested"  # POST /catalog/compact
    ENGINE_LOST = "engine_lost"  # a load is needed anyway and the generation names a gone path


@dataclass(slots=True)
class Plan:
    reason: CompactionReason
    since: float  # monotonic: when it was planned
    not_before: float  # monotonic: the earliest it may start (a quiet window's start)


class Catalog:
    """`start()` once the store has recovered, then `run()` as a background task. /stage asks
    `lora_name()` and, when it returns None, `bind()`; GET /catalog reads `status()`."""

    def __init__(
        self,
        settings: Settings,
        store: AdapterStore,
        rules: Rules,
        metrics: Metrics,
        *,
        control: ModelControl | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._store = store
        self._metrics = metrics
        self.names = Names(settings, store, rules, wall)
        self.names.on_change = self._names_changed
        self._model = settings.triton_model
        self._control: ModelControl | None = None
        if settings.triton_url is not None:
            self._control = control or TritonControl(
                settings.triton_url, probe_timeout_s=settings.triton_probe_timeout_s)
        self._reloads = (
            self._control is not None and settings.triton_reload is not TritonReload.NEVER
        )
        self._clock = clock
        self._wall = wall
        self._tracker = EngineTracker(clock=clock)
        self._plan: Plan | None = None
        self._window_done: float | None = None  # monotonic start of the window last compacted
        self._last_reload_at: float | None = None  # unix, for status
        self._error: str | None = None  # why no catalog could be rendered
        self._lock = asyncio.Lock()  # one render-and-load at a time (held across a load)
        self._wake = asyncio.Event()

    # ---- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Prepare the no-op adapter, carry on with the journaled generation if multi_lora.json
        is still its rendering, and render a first generation otherwise."""
        await asyncio.to_thread(self.names.prepare)
        if self.names.spares_off is not None and self._reloads:
            log.warning("catalog: spare names are off: %s; every adapter a loaded catalog does "
                        "not list costs a reload of %s", self.names.spares_off, self._model)
        elif self.names.spares_off is not None:  # no reload to cost anything: no warning
            log.info("catalog: spare names are off: %s; the sidecar asks Triton for no reload "
                     "here, and each new adapter is listed by a new generation of the catalog "
                     "file", self.names.spares_off)
        try:
            await asyncio.to_thread(self.names.recover)
        except OSError as exc:
            self._error = f"cannot read or tidy the catalog's folder: {exc.strerror or exc}"
            log.warning("catalog: %s", self._error)
        self.names.watch()
        if self.names.current() is None:
            await self._render_safely(None)
        else:
            self._update_gauges()

    def _names_changed(self) -> None:
        self._update_gauges()
        self._wake.set()

    # ---- names for /stage ----------------------------------------------------------------

    def lora_name(self, adapter_id: str) -> str | None:
        """The name a request must send vLLM for a staged adapter; None when a spare must be
        bound first (`bind()`). Raises CatalogPending/CatalogReloading when no engine serves.
        The hit path: a few lookups."""
        record = self._naming_generation()
        if adapter_id in record.own:
            return adapter_id
        return record.by_adapter.get(adapter_id)

    async def bind(self, adapter_id: str) -> str:
        """Bind an unused spare of the serving generation to a staged adapter. CatalogPending
        when none is left (a compaction is planned)."""
        names = self.names
        async with names.lock:
            while True:
                record = self._naming_generation()  # again: it may have changed meanwhile
                if adapter_id in record.own:
                    return adapter_id
                name = record.by_adapter.get(adapter_id)
                if name is not None:
                    return name
                if self._store.get(adapter_id) is None:
                    raise CatalogPending(f"adapter {adapter_id} left the disk before a spare "
                                         "name was bound to it; stage it again",
                                         adapter_id=adapter_id)
                names.on_reads(names.reads.drain())
                # Spares off by configuration: a generation journaled before the restart that
                # turned them off keeps its names, but binds none.
                if not record.free_spares() or not names.spares_on:
                    current = names.current()
                    # A generation being loaded has fresh spares: no second one is needed.
                    if (self._tracker.state is not EngineState.LOADING
                            and (current is None or adapter_id not in current.own)):
                        self._plan_compaction(CompactionReason.EXHAUSTED)
                    if not self._reloads:
                        return adapter_id  # the sidecar cannot know what Triton loaded
                    raise CatalogPending(self._no_spare_message(adapter_id, record),
                                         adapter_id=adapter_id)
                spare = await names.bind(record, adapter_id)
                if spare is not None:
                    break
        self._metrics.catalog_bindings.inc()
        left = len(record.free_spares())
        self._update_gauges()
        log.info("catalog: adapter %s served without a reload as %s (generation %d, %d spare "
                 "names left)", adapter_id, spare, record.number, left,
                 extra=fields(event="bound", adapter_id=adapter_id, lora_name=spare,
                              generation=record.number, spares_left=left))
        self._check_spares(record)
        return spare

    def _naming_generation(self) -> GenerationRecord:
        """The generation whose names requests use now: the one the serving engine loaded,
        or without reloads the one rendered."""
        if not self._reloads:
            number = self.names.journal.current
        else:
            number = self._tracker.serving()
            if number is None:
                raise self._not_serving()
        record = self.names.journal.generations.get(number) if number is not None else None
        if record is None:
            raise CatalogPending(f"no catalog is rendered yet ({self._error or 'starting'})")
        return record

    def _not_serving(self) -> CatalogPending | CatalogReloading:
        tracker, model, url = self._tracker, self._model, self._settings.triton_url
        state = tracker.state
        if state is EngineState.LOADING:
            return CatalogReloading(
                f"Triton is loading {model} with catalog generation {tracker.target} "
                f"({tracker.kind.value if tracker.kind else 'load'}); no engine serves until it "
                "is up; retry in a moment")
        why = {
            EngineState.STARTING: f"the sidecar has not heard from Triton at {url} yet",
            EngineState.UNREACHABLE: f"Triton at {url} does not answer"
                                     + (f" ({tracker.last_error})" if tracker.last_error else "")
                                     + "; adapters are servable as soon as it does",
            EngineState.ABSENT: f"Triton does not serve {model}; the sidecar loads it"
                                + (f" (the last load failed: {tracker.last_error}; retrying)"
                                   if tracker.last_load_failed else ""),
            EngineState.UNCONFIRMED: f"Triton serves {model} from a catalog the sidecar is "
                                     "confirming",
        }.get(state, f"Triton's {model} is {state.value}")
        return CatalogPending(f"no engine serves a catalog yet: {why}; retry in a moment")

    def _no_spare_message(self, adapter_id: str, record: GenerationRecord) -> str:
        current = self.names.current()
        if current is not None and current is not record and adapter_id in current.own:
            return (f"adapter {adapter_id} is in catalog generation {current.number}, but "
                    f"Triton serves generation {record.number}; {self._reload_wait()}")
        spares = ("no spare name is left" if self.names.spares_on
                  else f"spare names are off ({self.names.spares_off})")
        return (f"adapter {adapter_id} is on disk, but the catalog Triton serves (generation "
                f"{record.number}) does not list it and {spares}; a new generation listing it "
                f"is loaded {self._when_compaction()}; retry with backoff")

    def _when_compaction(self) -> str:
        due = self._compaction_in_s()
        if due is None:
            return "once the load in progress ends"
        if due <= 0:
            return "now"
        return f"in {due:.0f}s ({(self._plan_view() or {}).get('waits_for')})"

    def _reload_wait(self) -> str:
        tracker = self._tracker
        if tracker.state is EngineState.LOADING:
            return f"Triton is loading generation {tracker.target}; retry in a moment"
        due = self._reload_in_s() or 0.0
        if tracker.last_load_failed:
            return f"the last reload failed ({tracker.last_error}); retrying in {due:.0f}s"
        return f"the reload waits {due:.0f}s for --triton-reload-min-interval"

    # ---- compaction ---------------------------------------------------------------------

    def request_compaction(self) -> dict[str, Any]:
        """POST /catalog/compact: plan one now (rate-limited like every reload)."""
        self._plan_compaction(CompactionReason.REQUESTED)
        return {"planned": self._plan_view()}

    def _plan_compaction(self, reason: CompactionReason, not_before: float | None = None) -> None:
        if not self._reloads and reason in (CompactionReason.SPARES_LOW, CompactionReason.WINDOW):
            # The operator reloads Triton: a generation rendered ahead of need would only make
            # the names handed out differ from the ones the engine loaded.
            return
        now = self._clock()
        at = not_before if not_before is not None else now
        plan = self._plan
        if plan is not None and plan.not_before <= at and (
            reason is not CompactionReason.EXHAUSTED or plan.reason is reason
        ):
            return  # one is planned already, no later than this one would be
        if plan is not None:
            at = min(at, plan.not_before)  # an adapter now waits: say so, never later
        self._plan = Plan(reason, now, at)
        log.info("catalog: compaction planned (%s)", reason.value,
                 extra=fields(event="compaction_planned", reason=reason.value))
        self._wake.set()

    def _check_spares(self, record: GenerationRecord) -> None:
        low = self._settings.compact_below_spares
        if not self.names.spares_on or len(record.free_spares()) > low:
            return
        window = self._settings.compaction_window
        not_before = None
        if window is not None and len(record.free_spares()) > 0:
            # Low but not out: the outage a reload may cost waits for the quiet window.
            not_before = self._clock() + window.seconds_until_start(self._wall())
        self._plan_compaction(CompactionReason.SPARES_LOW, not_before)

    def _check_window(self) -> None:
        window = self._settings.compaction_window
        if window is None or not window.contains(self._wall()):
            return
        started = self._clock() - window.seconds_since_start(self._wall())
        if self._window_done is not None and abs(self._window_done - started) < 60:
            return  # compacted in this window already
        if self._dirty():
            self._window_done = started
            self._plan_compaction(CompactionReason.WINDOW)

    def _dirty(self) -> bool:
        """Whether a new generation would differ: a spare bound, or the adapters on disk are
        not the ones listed by their own names."""
        current = self.names.current()
        if current is None:
            return True
        on_disk = {a.adapter_id for a in self._store.adapters()}
        return bool(current.bound) or on_disk != current.own

    def _compaction_in_s(self) -> float | None:
        """Seconds until the planned compaction may start; None when none is planned or a
        load is in progress."""
        if self._plan is None:
            return None
        if self._tracker.state is EngineState.LOADING:
            return None
        start = max(self._plan.not_before, self._rate_limit_until())
        return max(start - self._clock(), 0.0)

    def _rate_limit_until(self) -> float:
        last = self._tracker.last_restart_at
        if last is None or not self._reloads:
            return -float("inf")
        gap_s = self._settings.triton_reload_min_interval_s
        if self._tracker.last_load_failed:
            gap_s = max(gap_s, RETRY_AFTER_FAILURE_S)
        return last + gap_s

    # ---- the background work -------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: probe Triton (its own task), render and reload when due, retire
        old generations. Errors are recorded in status() and logged, never raised."""
        probing = asyncio.create_task(self._probe_loop(), name="catalog-probe")
        try:
            while True:
                try:
                    await self.sync()
                except Exception:
                    log.exception("catalog: step failed")
                await self._sleep_until_due()
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)

    async def _sleep_until_due(self) -> None:
        wait_s = self._settings.catalog_refresh_s
        due = self._next_due_in_s()
        if due is not None:
            wait_s = min(wait_s, due)
        try:
            async with asyncio.timeout(max(wait_s, 0.0)):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    def _next_due_in_s(self) -> float | None:
        candidates = [self._compaction_in_s(), self._reload_in_s()]
        retire = [at - self._wall() for at in self.names.retire_times()]
        window = self._settings.compaction_window
        if window is not None:
            candidates.append(window.seconds_until_start(self._wall()))
        if self._reloads and self._tracker.state in (EngineState.ABSENT, EngineState.UNCONFIRMED):
            candidates.append(RETRY_AFTER_FAILURE_S)
        known = [c for c in [*candidates, *retire] if c is not None]
        return min(known) if known else None

    async def _probe_loop(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception:
                log.exception("catalog: probing Triton failed")
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def probe(self) -> None:
        """Ask Triton whether the model is ready (its own short timeout, never under the
        catalog's lock) and feed the answer to the state machine."""
        if not self._reloads or self._control is None:
            return
        loads = self._tracker.loads_started
        probe, detail = await self._control.probe(self._model)
        if loads != self._tracker.loads_started or self._tracker.state is EngineState.LOADING:
            return  # asked about an engine a load has replaced since: the answer is stale
        transition = self._tracker.on_probe(probe, detail)
        if probe is not Probe.READY and transition is not None:
            log.debug("catalog: probe %s (%s): %s", probe.value, detail, transition.value)
        if transition is not None and transition is not Transition.PROBE_BLIP:
            self._update_gauges()
            self._wake.set()

    async def sync(self) -> None:
        """One step: probe Triton, render and (re)load if that is due, retire what is past
        its grace."""
        if self._tracker.state is not EngineState.LOADING:
            await self.probe()
        async with self._lock:
            if self.names.dirty:
                async with self.names.lock:
                    await self.names.save()
            self._check_window()
            if self.names.current() is None:
                await self._render_safely(None)
            if self._reloads:
                await self._reload_if_due()
            elif self._compaction_in_s() == 0.0:
                plan, self._plan = self._plan, None
                await self._render_safely(plan.reason if plan else None)
            journal = self.names.journal
            live = {journal.current} if not self._reloads else {journal.current, journal.loaded}
            await self.names.retire({n for n in live if n is not None})
            self._update_gauges()

    def _reload_in_s(self) -> float | None:
        """Seconds until the pending reload of the current generation may start (a failed one
        is retried); None when there is none."""
        if not self._reloads or self._tracker.state not in (EngineState.SERVING,
                                                             EngineState.SUSPECT):
            return None
        current = self.names.journal.current
        if current is None or current == self._tracker.loaded:
            return None
        return max(self._rate_limit_until() - self._clock(), 0.0)

    async def _reload_if_due(self) -> None:
        tracker = self._tracker
        state = tracker.state
        if state is EngineState.UNCONFIRMED:
            journal = self.names.journal
            if journal.current is not None and journal.loaded == journal.current:
                tracker.confirm(journal.current)
                self._update_gauges()
                return
            outcome = await self._load(LoadKind.TAKEOVER)
            if outcome is LoadOutcome.REFUSED and self._mode is TritonReload.UNLOAD_FIRST:
                await self._load(LoadKind.UNLOAD_FIRST)
            return
        if state is EngineState.ABSENT:
            if self._last_load_too_recent():
                return
            current = self.names.current()
            if current is not None:
                # The engine died or Triton restarted: a name whose link was tampered with
                # behind the sidecar's back must not kill the fresh engine too.
                async with self.names.lock:
                    self.names.repair(current)
            if self._plan is not None or self._names_gone_path():
                reason = self._plan.reason if self._plan else CompactionReason.ENGINE_LOST
                self._plan = None
                await self._render_safely(reason)
            await self._load(LoadKind.LOAD)
            return
        if state not in (EngineState.SERVING, EngineState.SUSPECT):
            return
        if self._compaction_in_s() == 0.0:
            plan, self._plan = self._plan, None
            await self._render_safely(plan.reason if plan else None)
        if self._reload_in_s() == 0.0:
            await self._load(LoadKind.RELOAD if self._mode is TritonReload.ON_CHANGE
                             else LoadKind.UNLOAD_FIRST)

    @property
    def _mode(self) -> TritonReload:
        return self._settings.triton_reload

    def _last_load_too_recent(self) -> bool:
        """A failed load of an absent model is retried no sooner than RETRY_AFTER_FAILURE_S."""
        last = self._tracker.last_restart_at
        return (self._tracker.last_load_failed and last is not None
                and self._clock() - last < RETRY_AFTER_FAILURE_S)

    def _names_gone_path(self) -> bool:
        """Whether the current generation lists an adapter by its own name that is no longer on
        disk: a name a direct caller could kill a fresh engine with."""
        current = self.names.current()
        return current is not None and any(
            self._store.get(adapter_id) is None for adapter_id in current.own)

    async def _load(self, kind: LoadKind) -> LoadOutcome:
        assert self._control is not None
        record = self.names.current()
        if record is None:
            return LoadOutcome.REFUSED
        number = record.number
        self._tracker.start_load(number, kind)
        self._update_gauges()
        started = time.monotonic()
        log.info("catalog: %s of %s for generation %d (%d adapters, %d spare names)",
                 kind.value, self._model, number, len(record.adapter_ids), len(record.spares))
        error = None
        outcome = LoadOutcome.OK
        try:
            if kind is LoadKind.UNLOAD_FIRST:
                await self._control.unload(self._model)
            await self._control.load(self._model)
        except ReloadFailed as exc:
            error = str(exc)
            if kind is LoadKind.RELOAD:
                # The new engine loads beside the old one; on one GPU with vLLM's
                # gpu_memory_utilization above about half, it cannot fit.
                error += (" (on-change needs GPU memory for two engines at once; "
                          "--triton-reload unload-first needs one)")
            outcome = LoadOutcome.REFUSED if exc.reached else LoadOutcome.UNREACHABLE
        self._tracker.load_done(outcome, error)
        if outcome is LoadOutcome.OK:
            self._last_reload_at = self._wall()
            async with self.names.lock:
                self.names.journal.loaded = number
                await self.names.save()
            if self._plan is not None and self._plan.reason in (CompactionReason.EXHAUSTED,
                                                                CompactionReason.SPARES_LOW):
                self._plan = None  # the generation now serving has fresh spares
                self._check_spares(record)
            self._metrics.triton_reloads.labels(outcome="ok").inc()
            log.info("catalog: %s serves generation %d (%s took %.1fs)", self._model, number,
                     kind.value, time.monotonic() - started)
        elif outcome is LoadOutcome.REFUSED:
            self._metrics.triton_reloads.labels(outcome="error").inc()
            log.warning("catalog: %s of %s failed: %s", kind.value, self._model, error)
        else:
            log.warning("catalog: %s of %s did not reach Triton: %s", kind.value, self._model,
                        error)
        self._update_gauges()
        return outcome

    # ---- rendering ----------------------------------------------------------------------

    async def _render_safely(self, reason: CompactionReason | None) -> bool:
        try:
            await self._render(reason)
        except OSError as exc:
            self._error = f"cannot render generation: {exc.strerror or exc}"
            log.warning("catalog: %s", self._error)
            return False
        self._error = None
        return True

    async def _render(self, reason: CompactionReason | None) -> None:
        """A new generation: every adapter on disk by its own name, and fresh spare names."""
        record = await self.names.render(a.adapter_id for a in self._store.adapters())
        if reason is not None:
            self._metrics.catalog_compactions.labels(reason=reason.value).inc()
        self._update_gauges()
        log.info("catalog: generation %d lists %d adapters and %d spare names (%s)",
                 record.number, len(record.adapter_ids), len(record.spares),
                 f"compaction: {reason.value}" if reason else "first of this cache",
                 extra=fields(event="rendered", generation=record.number,
                              adapters=len(record.adapter_ids), spares=len(record.spares)))

    # ---- status ---------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the sidecar is not ready on the catalog's account: Triton's vLLM model cannot
        load before multi_lora.json exists."""
        if self.names.current() is not None:
            return None
        return f"catalog: {self.names.path.name} not rendered yet ({self._error or 'starting'})"

    def _update_gauges(self) -> None:
        current = self.names.current()
        naming = self._naming_or_none()
        self._metrics.catalog_adapters.set(len(current.adapter_ids) if current else 0)
        self._metrics.catalog_generation.set(current.number if current else 0)
        self._metrics.catalog_spares_left.set(len(naming.free_spares()) if naming else 0)
        if self._reloads:
            for state in EngineState:
                self._metrics.triton_model_state.labels(state=state.value).set(
                    1 if state is self._tracker.state else 0)

    def _naming_or_none(self) -> GenerationRecord | None:
        try:
            return self._naming_generation()
        except (CatalogPending, CatalogReloading):
            return None

    def _plan_view(self) -> dict[str, Any] | None:
        if self._plan is None:
            return None
        in_s = self._compaction_in_s()
        return {
            "reason": self._plan.reason.value,
            "in_s": None if in_s is None else round(in_s, 1),
            "at": None if in_s is None else iso_utc(self._wall() + in_s),
            "waits_for": None if in_s is None or in_s <= 0 else (
                "the quiet window" if self._plan.not_before > self._clock()
                else "--triton-reload-min-interval"),
        }

    def status(self) -> dict[str, Any]:
        current = self.names.current()
        naming = self._naming_or_none()
        window = self._settings.compaction_window
        ids = sorted(current.adapter_ids) if current else []
        body: dict[str, Any] = {
            "enabled": True,
            "path": str(self.names.path),
            "generation": current.number if current else 0,
            "rendered_at": iso_utc(current.rendered_at) if current else None,
            "rule": "adapters validated and on disk when the generation was rendered, by their "
                    "own names, plus spare names bound to adapters staged since",
            "adapter_ids": ids,
            "adapter_count": len(ids),
            "error": self._error,
            "retired": sorted(naming.retired) if naming else [],
            "spares": {
                "enabled": self.names.spares_on,
                "reads_watched": self.names.reads.available,
                "off_because": self.names.spares_off,
                "generation": naming.number if naming else None,
                "total": len(naming.spares) if naming else 0,
                "left": len(naming.free_spares()) if naming else 0,
                "bound": dict(sorted(naming.bound.items())) if naming else {},
                "kept": sorted(naming.kept) if naming else [],
                "burnt": sorted(naming.burnt) if naming else [],
                "compact_below": self._settings.compact_below_spares,
            },
            "next_compaction": self._plan_view(),
            "compaction_window": window.text if window else None,
            "generations": [
                {"generation": r.number, "adapters": len(r.adapter_ids),
                 "spares": len(r.spares), "bound": len(r.bound),
                 "kept_bytes": kept_bytes(self.names.root, r) if r.kept else 0,
                 "retire_at": iso_utc(r.retire_at) if r.retire_at else None}
                for r in sorted(self.names.journal.generations.values(), key=lambda r: r.number)
            ],
        }
        triton: dict[str, Any] = {
            "url": self._settings.triton_url,
            "model": self._model,
            "reload": self._mode.value if self._control else "never",
        }
        if self._reloads:
            tracker = self._tracker
            triton.update({
                "state": tracker.state.value,
                "loaded_generation": tracker.loaded,
                "serving_generation": tracker.serving(),
                "reloading": tracker.state is EngineState.LOADING,
                "pending": (self.names.journal.current
                            if self.names.journal.current != tracker.loaded else None),
                "next_reload_in_s": self._reload_in_s(),
                "last_reload_at": iso_utc(self._last_reload_at) if self._last_reload_at
                else None,
                "last_reload_error": tracker.last_error,
            })
        body["triton"] = triton
        return body

    async def close(self) -> None:
        self.names.close()
        if self._control is not None:
            await self._control.close()

