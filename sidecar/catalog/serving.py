"""Which generation names requests now (the one the serving engine loaded, or without reloads the
one rendered), and what a request is told while none can name its adapter; `changed` is set when
that may have changed, for a request held until it does (naming.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..config import Settings
from ..core.errors import CatalogPending, CatalogReloading
from .catalog import Catalog
from .compaction import CompactionReason
from .engine_state import EngineState, EngineTracker
from .generation import Generation
from .planner import CompactionPlanner
from .status import waits_for


class Serving:
    """Asked by naming.py; told (`notify()`) by reloads.py and loads.py when what serves may
    have changed."""

    def __init__(self, settings: Settings, catalog: Catalog, tracker: EngineTracker,
                 planner: CompactionPlanner, *, reloads: bool,
                 render_error: Callable[[], str | None], wake: Callable[[], None],
                 on_change: Callable[[], None]) -> None:
        self._settings = settings
        self._catalog = catalog
        self._tracker = tracker
        self._planner = planner
        self._reloads = reloads
        self._render_error = render_error
        self._wake = wake
        self._on_change = on_change  # the gauges
        self._changed = asyncio.Event()

    @property
    def model(self) -> str:
        """Triton's vLLM model, as messages name it."""
        return self._settings.triton_model

    @property
    def reloads(self) -> bool:
        """Whether the sidecar reloads Triton's model (else the operator does)."""
        return self._reloads

    @property
    def changed(self) -> asyncio.Event:
        """Set (and replaced) when what serves may have changed: take it before asking."""
        return self._changed

    def notify(self) -> None:
        self._on_change()
        self._changed.set()
        self._changed = asyncio.Event()

    def engine_refused(self) -> None:
        """The engine refused a name it was given: probe it now rather than at the next tick."""
        self._wake()

    def naming_generation(self) -> Generation:
        """The generation whose names requests use now: the one the serving engine loaded,
        or without reloads the one rendered. CatalogPending/CatalogReloading when none."""
        generation = self.naming_or_none()
        if generation is not None:
            return generation
        if self._reloads and self._tracker.serving() is None:
            raise self._not_serving()
        raise CatalogPending(f"no catalog is rendered yet ({self._render_error() or 'starting'})")

    def naming_or_none(self) -> Generation | None:
        """`naming_generation`, or None when there is none (the hit path asks this, without an
        exception to raise and catch)."""
        number = (self._tracker.serving() if self._reloads
                  else self._catalog.catalog_journal.current)
        return None if number is None else self._catalog.generation(number)

    def _not_serving(self) -> CatalogPending | CatalogReloading:
        tracker, model, url = self._tracker, self.model, self._settings.triton_url
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
        current = self._catalog.current()
        if self._tracker.state is not EngineState.LOADING and (
                current is None or current is generation or adapter_id not in current.own_ids()):
            self._planner.ask(CompactionReason.EXHAUSTED)
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
        self._planner.check_spares(generation, self._catalog.spares_on)
        self._on_change()

    def _when_compaction(self) -> str:
        due = self._planner.compaction_in_s()
        if due is None:
            return "once the load in progress ends"
        if due <= 0:
            return "now"
        plan = self._planner.facts()
        return f"in {due:.0f}s ({waits_for(plan) if plan else None})"

    def _reload_wait(self) -> str:
        tracker = self._tracker
        if tracker.state is EngineState.LOADING:
            return f"Triton is loading generation {tracker.target}; retry in a moment"
        due = self._planner.reload_in_s(self._catalog.catalog_journal.current) or 0.0
        if tracker.last_load_failed:
            return f"the last reload failed ({tracker.last_error}); retrying in {due:.0f}s"
        return f"the reload waits {due:.0f}s for --triton-reload-min-interval"
