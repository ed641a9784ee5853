"""When the catalog's work is due, and the loops that do it: probes of Triton feed the state
machine (engine_state.py), which says which load is due; the planner (planner.py) says when a
compaction is; loads.py carries each out; the catalog (catalog.py) keeps the names. Also the
facts GET /catalog and the gauges are built from (status.py).

A reload is an outage for every tenant with `unload-first`, so it happens only when a generation
runs low on spares, in the quiet window, when asked, or when the engine is lost anyway.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..config import Settings, TritonReload
from ..core.metrics import Metrics
from . import status
from .catalog import Catalog
from .compaction import RETRY_AFTER_FAILURE_S, CompactionReason
from .engine_state import EngineState, EngineTracker, LoadKind, LoadOutcome, Probe, Transition
from .loads import DiskView, Loads
from .name_state import NameState
from .planner import CompactionPlanner
from .serving import Serving
from .triton_control import ModelControl, TritonControl

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 2.0


class Reloads:
    """`start()` once the store has recovered, then `run()` as a background task. `serving`
    is what naming.py asks."""

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
        self._catalog = catalog
        self._metrics = metrics
        self._disk = disk
        self._control: ModelControl | None = None
        if settings.triton_url is not None:
            self._control = control or TritonControl(
                settings.triton_url, probe_timeout_s=settings.triton_probe_timeout_s)
        self._reloads = (
            self._control is not None and settings.triton_reload is not TritonReload.NEVER
        )
        self._clock = clock
        self._wall = wall
        self._lock = asyncio.Lock()  # one render-and-load at a time (held across a load)
        self._wake = asyncio.Event()
        self._tracker = EngineTracker(clock=clock)
        self._planner = CompactionPlanner(settings, self._tracker, reloads=self._reloads,
                                          registry_ids=registry_ids, wake=self._wake.set,
                                          clock=clock, wall=wall)
        self._serving = Serving(settings, catalog, self._tracker, self._planner,
                                reloads=self._reloads, render_error=self._render_error,
                                wake=self._wake.set, on_change=self._show)
        self._loads = Loads(settings, catalog, metrics, disk, self._tracker, self._planner,
                            control=self._control, reloads=self._reloads,
                            on_serving_changed=self._serving.notify, wall=wall)

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    @property
    def serving(self) -> Serving:
        return self._serving

    @property
    def planner(self) -> CompactionPlanner:
        return self._planner

    async def start(self, registry_listed: asyncio.Event | None = None) -> None:
        """The catalog's start-up (loads.py), once the store has recovered."""
        await self._loads.start(registry_listed)
        self._show()

    def catalog_changed(self) -> None:
        """The catalog's `on_change`: something to save, or a plan to free."""
        self._show()
        self._wake.set()

    def request_compaction(self) -> dict[str, Any]:
        """POST /catalog/compact: plan one now (rate-limited like every reload)."""
        self._planner.ask(CompactionReason.REQUESTED)
        return {"planned": status.plan_view(self._planner.facts(), self._wall())}

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
        planner = self._planner
        candidates = [planner.compaction_in_s(),
                      planner.reload_in_s(self._catalog.catalog_journal.current),
                      planner.window_in_s()]
        retire = [at - self._wall() for at in self._catalog.retire_times()]
        if self._reloads and self._tracker.state in (EngineState.ABSENT,
                                                     EngineState.UNCONFIRMED):
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
        if not self._reloads or self._control is None:
            return
        tracker = self._tracker
        loads = tracker.loads_started
        probe, detail = await self._control.probe(self._settings.triton_model)
        if loads != tracker.loads_started or tracker.state is EngineState.LOADING:
            return  # asked about an engine a load has replaced since: the answer is stale
        transition = tracker.on_probe(probe, detail)
        if probe is not Probe.READY and transition is not None:
            log.debug("catalog: probe %s (%s): %s", probe.value, detail, transition.value)
        if transition is not None and transition is not Transition.PROBE_BLIP:
            self._serving.notify()
            self._wake.set()

    async def sync(self) -> None:
        """One step: probe Triton, render and (re)load if that is due, retire what is past
        its grace."""
        if self._tracker.state is not EngineState.LOADING:
            await self.probe()
        async with self._lock:
            catalog = self._catalog
            await catalog.save_if_dirty()
            self._planner.check_window(self._dirty)
            if catalog.current() is None:
                await self._loads.render(None)
            if self._reloads:
                await self._reload_if_due()
            elif self._planner.compaction_in_s() == 0.0:
                plan = self._planner.take()
                await self._loads.render(plan.reason if plan else None)
            journal = catalog.catalog_journal
            live = {journal.current} if not self._reloads else {journal.current, journal.loaded}
            await catalog.retire({n for n in live if n is not None})
            self._show()

    async def _reload_if_due(self) -> None:
        tracker, loads, planner = self._tracker, self._loads, self._planner
        mode = self._settings.triton_reload
        state = tracker.state
        journal = self._catalog.catalog_journal
        if state is EngineState.UNCONFIRMED:
            if journal.current is not None and journal.loaded == journal.current:
                tracker.confirm(journal.current)
                self._serving.notify()
                return
            outcome = await loads.load(LoadKind.TAKEOVER)
            if outcome is LoadOutcome.REFUSED and mode is TritonReload.UNLOAD_FIRST:
                await loads.load(LoadKind.UNLOAD_FIRST)
            return
        if state is EngineState.ABSENT:
            if self._last_load_too_recent():
                return
            current = self._catalog.current()
            if current is not None:
                # The engine died or Triton restarted: a name whose link was tampered with
                # behind the sidecar's back must not kill the fresh engine too.
                self._catalog.repair(current, self._disk.digest_of)
            if planner.plan is not None or self._names_dangle():
                plan = planner.take()
                await loads.render(plan.reason if plan else CompactionReason.ENGINE_LOST)
            await loads.load(LoadKind.LOAD)
            return
        if state not in (EngineState.SERVING, EngineState.SUSPECT):
            return
        if planner.compaction_in_s() == 0.0:
            plan = planner.take()
            await loads.render(plan.reason if plan else None)
        if planner.reload_in_s(journal.current) == 0.0:
            await loads.load(LoadKind.RELOAD if mode is TritonReload.ON_CHANGE
                             else LoadKind.UNLOAD_FIRST)

    def _last_load_too_recent(self) -> bool:
        """A failed load of an absent model is retried no sooner than RETRY_AFTER_FAILURE_S."""
        last = self._tracker.last_restart_at
        return (self._tracker.last_load_failed and last is not None
                and self._clock() - last < RETRY_AFTER_FAILURE_S)

    def _names_dangle(self) -> bool:
        """Whether the current generation has a name with nothing to lead to (parked without
        a no-op: the base model's shapes were unknown): a fresh engine must not load it."""
        current = self._catalog.current()
        return current is not None and self._catalog.noop is None and any(
            e.state is not NameState.BOUND for e in current.names.values())

    def _dirty(self) -> bool:
        """Whether a new generation would differ: a name given, parked or burnt, or the
        adapters on disk are not the ones listed by their own names."""
        current = self._catalog.current()
        if current is None:
            return True
        counts = current.counts
        if counts.bound or counts.parked or counts.burnt:
            return True
        on_disk = {v.adapter_id for v in self._disk.versions()}
        return on_disk != current.own_ids()

    # ---- what it shows --------------------------------------------------------------------

    def _render_error(self) -> str | None:
        return self._loads.error

    def _facts(self) -> status.CatalogFacts:
        catalog, tracker, settings = self._catalog, self._tracker, self._settings
        naming = self._serving.naming_or_none()
        rendered = catalog.catalog_journal.current
        engine = None
        if self._reloads:
            engine = status.EngineFacts(
                tracker.state, tracker.loaded, tracker.serving(),
                rendered if rendered != tracker.loaded else None,
                self._planner.reload_in_s(rendered), self._loads.last_reload_at,
                tracker.last_error)
        adapter_bytes, max_bytes = self._disk.budget()
        window = settings.compaction_window
        return status.CatalogFacts(
            path=catalog.path, current=catalog.current(), naming=naming,
            generations=list(catalog.catalog_journal.generations.values()),
            error=self._loads.error, spares_on=catalog.spares_on,
            reads_watched=catalog.reads.available, spares_off=catalog.spares_off,
            noop_from=catalog.noop_from,
            noop_bytes=catalog.noop.size_bytes if catalog.noop else 0,
            watched_noops=catalog.reads.watched,
            compact_below=self._planner.compact_below(naming) if naming else None,
            adapter_bytes=adapter_bytes, max_bytes=max_bytes,
            catalog_bytes=catalog.disk_bytes, plan=self._planner.facts(),
            window=window.text if window else None, triton_url=settings.triton_url,
            model=settings.triton_model,
            reload=settings.triton_reload.value if self._control else "never",
            engine=engine, wall=self._wall())

    def _show(self) -> None:
        """Every change ends here: the gauges follow the facts."""
        status.show_gauges(self._metrics, self._facts())

    def status(self) -> dict[str, Any]:
        """GET /catalog's body."""
        return status.status(self._facts())

    def problem(self) -> str | None:
        """Why the sidecar is not ready on the catalog's account, if it is not."""
        return status.problem(self._catalog.path, self._catalog.current(), self._loads.error)

    async def close(self) -> None:
        self._catalog.close()
        await self._loads.close()
