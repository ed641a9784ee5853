"""When a new catalog generation is worth a reload of Triton's vLLM model (compaction), how big
it is, and the reloads themselves: probes feed the state machine (engine_state.py), which says
which generation serves; the catalog (catalog.py) renders and keeps the names.

A generation lists every adapter validated and on disk when it is rendered, by its own name,
plus spare names sized from what the node can be asked for (the registry's listing, with
headroom for uploads). A reload is an outage for every tenant with `unload-first`, so it happens
only when a generation runs low on spares, in the quiet window, when asked, or when the engine is
lost anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import Settings, TritonReload
from ..core.errors import CatalogPending, CatalogReloading
from ..core.fsutil import iso_utc
from ..core.logs import fields
from ..core.metrics import Metrics
from . import compaction
from .catalog import Catalog
from .compaction import RETRY_AFTER_FAILURE_S, CompactionReason, Plan
from .disk import NoopAdapter
from .engine_state import EngineState, EngineTracker, LoadKind, LoadOutcome, Probe, Transition
from .generation import Generation
from .name_state import NameState, Version
from .triton_control import ModelControl, ReloadFailed, TritonControl

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0
FIRST_LISTING_WAIT_S = 10.0  # a first generation waits this long for the registry's listing


class DiskView(Protocol):
    """The adapters on disk, as the catalog needs them (naming.StoreView over the store)."""

    def versions(self) -> list[Version]: ...

    def digest_of(self, adapter_id: str) -> str | None: ...

    def noop_like(self) -> tuple[NoopAdapter, str] | None:
        """Blocking: a no-op shaped like an adapter on disk, and which one."""
        ...

    def budget(self) -> tuple[int, int]:
        """Bytes of the adapters on disk, and --max-bytes."""
        ...


class Reloads:
    """`start()` once the store has recovered, then `run()` as a background task."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        metrics: Metrics,
        disk: DiskView,
        *,
        registry_ids: Callable[[], frozenset[str] | None] = lambda: None,
        control: ModelControl | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self.catalog = catalog
        self._metrics = metrics
        self._disk = disk
        self._registry_ids = registry_ids
        self._model = settings.triton_model
        self._control: ModelControl | None = None
        if settings.triton_url is not None:
            self._control = control or TritonControl(
                settings.triton_url, probe_timeout_s=settings.triton_probe_timeout_s)
        self.reloads = (
            self._control is not None and settings.triton_reload is not TritonReload.NEVER
        )
        self._clock = clock
        self._wall = wall
        self.tracker = EngineTracker(clock=clock)
        self._plan: Plan | None = None
        self._window_done: float | None = None  # monotonic start of the window last compacted
        self._last_reload_at: float | None = None  # unix, for status
        self._error: str | None = None  # why no catalog could be rendered
        self._lock = asyncio.Lock()  # one render-and-load at a time (held across a load)
        self._wake = asyncio.Event()
        self.serving_changed = asyncio.Event()  # set (and replaced) when what serves changes

    # ---- start ---------------------------------------------------------------------------

    async def start(self, registry_listed: asyncio.Event | None = None) -> None:
        """Carry on with the journaled generation if multi_lora.json is still its rendering,
        and render a first generation otherwise (after the registry's first listing, which
        sizes its spares, or FIRST_LISTING_WAIT_S)."""
        catalog = self.catalog
        await asyncio.to_thread(catalog.prepare)
        if catalog.noop is None:
            await self._learn_noop()
        self._say_spares()
        try:
            await asyncio.to_thread(catalog.recover, self._disk.digest_of)
        except OSError as exc:
            self._error = f"cannot read or tidy the catalog's folder: {exc.strerror or exc}"
            log.warning("catalog: %s", self._error)
        catalog.watch()
        if catalog.current() is None:
            if registry_listed is not None:
                try:
                    async with asyncio.timeout(FIRST_LISTING_WAIT_S):
                        await registry_listed.wait()
                except TimeoutError:
                    pass
            await self._render_safely(None)
        self._update_gauges()

    def _say_spares(self) -> None:
        catalog = self.catalog
        if catalog.spares_off is None:
            return
        if self.reloads:
            log.warning("catalog: spare names are off: %s; every adapter a loaded catalog does "
                        "not list costs a reload of %s", catalog.spares_off, self._model)
        else:  # no reload to cost anything: no warning
            log.info("catalog: spare names are off: %s; the sidecar asks Triton for no reload "
                     "here, and each new adapter is listed by a new generation of the catalog "
                     "file", catalog.spares_off)

    async def _learn_noop(self) -> bool:
        """Without the base model's config, take the shapes of an adapter on disk (validated:
        its tensors fit the engine) for the no-op; True when spares became possible."""
        found = await asyncio.to_thread(self._disk.noop_like)
        if found is None:
            return False
        noop, source = found
        await asyncio.to_thread(self.catalog.prepare_from, noop, source)
        if self.catalog.noop is not None:
            log.info("catalog: the no-op adapter takes its shapes from %s (%s, rank 1)", source,
                     noop.module)
        return self.catalog.noop is not None

    @property
    def model(self) -> str:
        """Triton's vLLM model, as messages name it."""
        return self._model

    def engine_refused(self) -> None:
        """The engine refused a name it was given: probe it now rather than at the next tick."""
        self._wake.set()

    def catalog_changed(self) -> None:
        """The catalog's `on_change`: something to save, or a plan to free."""
        self._update_gauges()
        self._wake.set()

    # ---- which generation names requests -------------------------------------------------

    def naming_generation(self) -> Generation:
        """The generation whose names requests use now: the one the serving engine loaded,
        or without reloads the one rendered. CatalogPending/CatalogReloading when none."""
        journal = self.catalog.catalog_journal
        if not self.reloads:
            number = journal.current
        else:
            number = self.tracker.serving()
            if number is None:
                raise self._not_serving()
        generation = self.catalog.generation(number)
        if generation is None:
            raise CatalogPending(f"no catalog is rendered yet ({self._error or 'starting'})")
        return generation

    def _not_serving(self) -> CatalogPending | CatalogReloading:
        tracker, model, url = self.tracker, self._model, self._settings.triton_url
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

    def no_name_left(self, adapter_id: str, generation: Generation, why: str
                     ) -> CatalogPending:
        """An adapter the serving generation cannot name: plan the compaction that lists it
        (unless one is being loaded) and say when it comes."""
        current = self.catalog.current()
        if self.tracker.state is not EngineState.LOADING and (
                current is None or current is generation or adapter_id not in current.own_ids()):
            self._plan_compaction(CompactionReason.EXHAUSTED)
        if current is not None and current is not generation and adapter_id in current.own_ids():
            return CatalogPending(
                f"adapter {adapter_id} is in catalog generation {current.number}, but Triton "
                f"serves generation {generation.number}; {self._reload_wait()}",
                adapter_id=adapter_id)
        return CatalogPending(
            f"adapter {adapter_id} is on disk, but the catalog Triton serves (generation "
            f"{generation.number}) does not list it and {why}; a new generation listing it "
            f"is loaded {self._when_compaction()}; retry with backoff", adapter_id=adapter_id)

    def named(self, generation: Generation) -> None:
        """A name was just given in `generation`: plan a compaction if spares run low."""
        self._check_spares(generation)
        self._update_gauges()

    def _when_compaction(self) -> str:
        due = self._compaction_in_s()
        if due is None:
            return "once the load in progress ends"
        if due <= 0:
            return "now"
        return f"in {due:.0f}s ({(self._plan_view() or {}).get('waits_for')})"

    def _reload_wait(self) -> str:
        tracker = self.tracker
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
        plan = compaction.replan(self._plan, reason, self._clock(), not_before, self.reloads)
        if plan is None:
            return
        self._plan = plan
        level = logging.INFO if self.reloads or reason is CompactionReason.REQUESTED else (
            logging.DEBUG)
        log.log(level, "catalog: compaction planned (%s)", reason.value,
                extra=fields(event="compaction_planned", reason=reason.value))
        self._wake.set()

    def compact_below(self, generation: Generation) -> int:
        return compaction.compact_below(self._settings.compact_below,
                                        sum(1 for e in generation.names.values() if e.spare))

    def _check_spares(self, generation: Generation) -> None:
        if not self.catalog.spares_on:
            return
        free = len(generation.free_spares())
        if free > self.compact_below(generation):
            return
        self._plan_compaction(CompactionReason.SPARES_LOW, compaction.spares_low_not_before(
            free, self._settings.compaction_window, self._clock(), self._wall()))

    def _check_window(self) -> None:
        started = compaction.window_started(self._settings.compaction_window, self._clock(),
                                            self._wall(), self._window_done)
        if started is not None and self._dirty():
            self._window_done = started
            self._plan_compaction(CompactionReason.WINDOW)

    def _dirty(self) -> bool:
        """Whether a new generation would differ: a name given, parked or burnt, or the
        adapters on disk are not the ones listed by their own names."""
        current = self.catalog.current()
        if current is None:
            return True
        counts = current.counts
        if counts.bound or counts.parked or counts.burnt:
            return True
        on_disk = {v.adapter_id for v in self._disk.versions()}
        return on_disk != current.own_ids()

    def spares_wanted(self, own: set[str]) -> int:
        """Spares for a new generation listing `own` by their own names."""
        settings = self._settings
        return compaction.spares_wanted(settings.spare_names, self._registry_ids(), own,
                                        settings.spare_names_max)

    def _compaction_in_s(self) -> float | None:
        return compaction.starts_in_s(self._plan, self.tracker.state is EngineState.LOADING,
                                      self._rate_limit_until(), self._clock())

    def _rate_limit_until(self) -> float:
        if not self.reloads:
            return -float("inf")
        return compaction.rate_limit_until(self.tracker.last_restart_at,
                                           self._settings.triton_reload_min_interval_s,
                                           self.tracker.last_load_failed)

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
        retire = [at - self._wall() for at in self.catalog.retire_times()]
        window = self._settings.compaction_window
        if window is not None:
            candidates.append(window.seconds_until_start(self._wall()))
        if self.reloads and self.tracker.state in (EngineState.ABSENT, EngineState.UNCONFIRMED):
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
        lock) and feed the answer to the state machine."""
        if not self.reloads or self._control is None:
            return
        loads = self.tracker.loads_started
        probe, detail = await self._control.probe(self._model)
        if loads != self.tracker.loads_started or self.tracker.state is EngineState.LOADING:
            return  # asked about an engine a load has replaced since: the answer is stale
        transition = self.tracker.on_probe(probe, detail)
        if probe is not Probe.READY and transition is not None:
            log.debug("catalog: probe %s (%s): %s", probe.value, detail, transition.value)
        if transition is not None and transition is not Transition.PROBE_BLIP:
            self._serving_may_have_changed()
            self._wake.set()

    def _serving_may_have_changed(self) -> None:
        self._update_gauges()
        self.serving_changed.set()
        self.serving_changed = asyncio.Event()  # a request held for a name waits on it

    async def sync(self) -> None:
        """One step: probe Triton, render and (re)load if that is due, retire what is past
        its grace."""
        if self.tracker.state is not EngineState.LOADING:
            await self.probe()
        async with self._lock:
            catalog = self.catalog
            await catalog.save_if_dirty()
            self._check_window()
            if catalog.current() is None:
                await self._render_safely(None)
            if self.reloads:
                await self._reload_if_due()
            elif self._compaction_in_s() == 0.0:
                plan, self._plan = self._plan, None
                await self._render_safely(plan.reason if plan else None)
            journal = catalog.catalog_journal
            live = {journal.current} if not self.reloads else {journal.current, journal.loaded}
            await catalog.retire({n for n in live if n is not None})
            self._update_gauges()

    def _reload_in_s(self) -> float | None:
        """Seconds until the pending reload of the current generation may start (a failed one
        is retried); None when there is none."""
        if not self.reloads or self.tracker.state not in (EngineState.SERVING,
                                                          EngineState.SUSPECT):
            return None
        current = self.catalog.catalog_journal.current
        if current is None or current == self.tracker.loaded:
            return None
        return max(self._rate_limit_until() - self._clock(), 0.0)

    async def _reload_if_due(self) -> None:
        tracker = self.tracker
        state = tracker.state
        journal = self.catalog.catalog_journal
        if state is EngineState.UNCONFIRMED:
            if journal.current is not None and journal.loaded == journal.current:
                tracker.confirm(journal.current)
                self._serving_may_have_changed()
                return
            outcome = await self._load(LoadKind.TAKEOVER)
            if outcome is LoadOutcome.REFUSED and self._mode is TritonReload.UNLOAD_FIRST:
                await self._load(LoadKind.UNLOAD_FIRST)
            return
        if state is EngineState.ABSENT:
            if self._last_load_too_recent():
                return
            current = self.catalog.current()
            if current is not None:
                # The engine died or Triton restarted: a name whose link was tampered with
                # behind the sidecar's back must not kill the fresh engine too.
                self.catalog.repair(current, self._disk.digest_of)
            if self._plan is not None or self._names_dangle():
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
        last = self.tracker.last_restart_at
        return (self.tracker.last_load_failed and last is not None
                and self._clock() - last < RETRY_AFTER_FAILURE_S)

    def _names_dangle(self) -> bool:
        """Whether the current generation has a name with nothing to lead to (parked without
        a no-op: the base model's shapes were unknown): a fresh engine must not load it."""
        current = self.catalog.current()
        return current is not None and self.catalog.noop is None and any(
            e.state is not NameState.BOUND for e in current.names.values())

    async def _load(self, kind: LoadKind) -> LoadOutcome:
        assert self._control is not None
        generation = self.catalog.current()
        if generation is None:
            return LoadOutcome.REFUSED
        number = generation.number
        self.tracker.start_load(number, kind)
        self._serving_may_have_changed()
        started = time.monotonic()
        log.info("catalog: %s of %s for generation %d (%d names, %d of them spares)",
                 kind.value, self._model, number, len(generation.names),
                 sum(1 for e in generation.names.values() if e.spare))
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
        self.tracker.load_done(outcome, error)
        if outcome is LoadOutcome.OK:
            self._last_reload_at = self._wall()
            await self.catalog.mark_loaded(number)
            if self._plan is not None and self._plan.reason in compaction.SETTLED_BY_A_LOAD:
                self._plan = None  # the generation now serving has fresh spares
                self._check_spares(generation)
            self._metrics.triton_reloads.labels(outcome="ok").inc()
            log.info("catalog: %s serves generation %d (%s took %.1fs)", self._model, number,
                     kind.value, time.monotonic() - started)
        elif outcome is LoadOutcome.REFUSED:
            self._metrics.triton_reloads.labels(outcome="error").inc()
            log.warning("catalog: %s of %s failed: %s", kind.value, self._model, error)
        else:
            log.warning("catalog: %s of %s did not reach Triton: %s", kind.value, self._model,
                        error)
        self._serving_may_have_changed()
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
        catalog = self.catalog
        if catalog.noop is None and await self._learn_noop():
            self._say_spares()
        versions = self._disk.versions()
        spares = self.spares_wanted({v.adapter_id for v in versions})
        generation = await catalog.render(versions, spares, self._disk.digest_of)
        if reason is not None:
            self._metrics.catalog_compactions.labels(reason=reason.value).inc()
        self._serving_may_have_changed()  # without reloads, the rendered generation names
        spare_count = sum(1 for e in generation.names.values() if e.spare)
        log.info("catalog: generation %d lists %d adapters and %d spare names (%s)",
                 generation.number, len(generation.names) - spare_count, spare_count,
                 f"compaction: {reason.value}" if reason else "first of this cache",
                 extra=fields(event="rendered", generation=generation.number,
                              adapters=len(generation.names) - spare_count,
                              spares=spare_count))

    # ---- status ---------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the sidecar is not ready on the catalog's account: Triton's vLLM model cannot
        load before multi_lora.json exists."""
        if self.catalog.current() is not None:
            return None
        return (f"catalog: {self.catalog.path.name} not rendered yet "
                f"({self._error or 'starting'})")

    def _update_gauges(self) -> None:
        current = self.catalog.current()
        naming = self._naming_or_none()
        metrics = self._metrics
        metrics.catalog_adapters.set(len(current.own_ids()) if current else 0)
        metrics.catalog_generation.set(current.number if current else 0)
        metrics.catalog_spares_left.set(len(naming.free_spares()) if naming else 0)
        for state in NameState:
            metrics.catalog_names.labels(state=state.value).set(
                sum(1 for e in naming.names.values() if e.state is state) if naming else 0)
        metrics.catalog_disk_bytes.set(self.catalog.disk_bytes)
        if self.reloads:
            for engine_state in EngineState:
                metrics.triton_model_state.labels(state=engine_state.value).set(
                    1 if engine_state is self.tracker.state else 0)

    def _naming_or_none(self) -> Generation | None:
        try:
            return self.naming_generation()
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
        catalog = self.catalog
        current = catalog.current()
        naming = self._naming_or_none()
        window = self._settings.compaction_window
        own = sorted(current.own_ids()) if current else []
        bound_spares = {name: str(e.version) for name, e in naming.names.items()
                        if e.spare and e.state is NameState.BOUND and e.version} if naming else {}
        body: dict[str, Any] = {
            "enabled": True,
            "path": str(catalog.path),
            "generation": current.number if current else 0,
            "rendered_at": iso_utc(current.rendered_at) if current else None,
            "rule": "adapters validated and on disk when the generation was rendered, by their "
                    "own names, plus spare names given to adapter versions staged since; a "
                    "name whose adapter left the disk is parked at a no-op and returns when the "
                    "same bytes are staged again",
            "adapter_ids": own,
            "adapter_count": len(own),
            "error": self._error,
            "names": catalog.generation_view(naming) if naming else None,
            "spares": {
                "enabled": catalog.spares_on,
                "reads_watched": catalog.reads.available,
                "off_because": catalog.spares_off,
                "noop_from": catalog.noop_from or None,
                "generation": naming.number if naming else None,
                "total": sum(1 for e in naming.names.values() if e.spare) if naming else 0,
                "left": len(naming.free_spares()) if naming else 0,
                "bound": dict(sorted(bound_spares.items())),
                "parked": naming.in_state(NameState.PARKED) if naming else [],
                "burnt": naming.in_state(NameState.BURNT) if naming else [],
                "compact_below": self.compact_below(naming) if naming else None,
            },
            "disk": {
                "adapter_bytes": self._disk.budget()[0],
                "max_bytes": self._disk.budget()[1],
                "catalog_bytes": catalog.disk_bytes,
                "noop_bytes": catalog.noop.size_bytes if catalog.noop else 0,
                "watched_noops": catalog.reads.watched,
            },
            "next_compaction": self._plan_view(),
            "compaction_window": window.text if window else None,
            "generations": [catalog.generation_view(g) for g in sorted(
                catalog.catalog_journal.generations.values(), key=lambda g: g.number)],
        }
        triton: dict[str, Any] = {
            "url": self._settings.triton_url,
            "model": self._model,
            "reload": self._mode.value if self._control else "never",
        }
        if self.reloads:
            tracker = self.tracker
            triton.update({
                "state": tracker.state.value,
                "loaded_generation": tracker.loaded,
                "serving_generation": tracker.serving(),
                "reloading": tracker.state is EngineState.LOADING,
                "pending": (catalog.catalog_journal.current
                            if catalog.catalog_journal.current != tracker.loaded else None),
                "next_reload_in_s": self._reload_in_s(),
                "last_reload_at": iso_utc(self._last_reload_at) if self._last_reload_at
                else None,
                "last_reload_error": tracker.last_error,
            })
        body["triton"] = triton
        return body

    async def close(self) -> None:
        self.catalog.close()
        if self._control is not None:
            await self._control.close()
