"""The compaction planned (at most one) and when it, and a reload of a generation rendered since
the last load, may start: compaction.py's pure rules, fed the engine's state, the settings and
the time. reloads.py carries out what is due.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config import Settings
from ..core.logs import fields
from . import compaction
from .compaction import CompactionReason, Plan
from .engine_state import EngineState, EngineTracker
from .generation import Generation
from .status import PlanFacts

log = logging.getLogger(__name__)


class CompactionPlanner:
    """`ask()` plans a compaction (and wakes the loop given as `wake`); `take()` hands it over
    when it is carried out."""

    def __init__(self, settings: Settings, tracker: EngineTracker, *, reloads: bool,
                 registry_ids: Callable[[], frozenset[str] | None],
                 wake: Callable[[], None], clock: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        self._settings = settings
        self._tracker = tracker
        self._reloads = reloads
        self._registry_ids = registry_ids
        self._wake = wake
        self._clock = clock
        self._wall = wall
        self._plan: Plan | None = None
        self._window_done: float | None = None  # monotonic start of the window last compacted

    @property
    def plan(self) -> Plan | None:
        return self._plan

    def ask(self, reason: CompactionReason, not_before: float | None = None) -> None:
        plan = compaction.replan(self._plan, reason, self._clock(), not_before, self._reloads)
        if plan is None:
            return
        self._plan = plan
        level = logging.INFO if self._reloads or reason is CompactionReason.REQUESTED else (
            logging.DEBUG)
        log.log(level, "catalog: compaction planned (%s)", reason.value,
                extra=fields(event="compaction_planned", reason=reason.value))
        self._wake()

    def take(self) -> Plan | None:
        """The plan, which is carried out now: none is planned after."""
        plan, self._plan = self._plan, None
        return plan

    def loaded(self, generation: Generation, spares_on: bool) -> None:
        """`generation` was just loaded: its fresh spares settle a plan for the lack of them."""
        if self._plan is not None and self._plan.reason in compaction.SETTLED_BY_A_LOAD:
            self._plan = None
            self.check_spares(generation, spares_on)

    def compact_below(self, generation: Generation) -> int:
        return compaction.compact_below(self._settings.compact_below, generation.spare_count())

    def check_spares(self, generation: Generation, spares_on: bool) -> None:
        if not spares_on:
            return
        free = generation.free_count()
        if free > self.compact_below(generation):
            return
        self.ask(CompactionReason.SPARES_LOW, compaction.spares_low_not_before(
            free, self._settings.compaction_window, self._clock(), self._wall()))

    def check_window(self, dirty: Callable[[], bool]) -> None:
        """In a quiet window not compacted yet, plan one if a new generation would differ."""
        started = compaction.window_started(self._settings.compaction_window, self._clock(),
                                            self._wall(), self._window_done)
        if started is not None and dirty():
            self._window_done = started
            self.ask(CompactionReason.WINDOW)

    def spares_wanted(self, own: set[str]) -> int:
        """Spares for a new generation listing `own` by their own names."""
        settings = self._settings
        return compaction.spares_wanted(settings.spare_names, self._registry_ids(), own,
                                        settings.spare_names_max)

    # ---- when ------------------------------------------------------------------------------

    def compaction_in_s(self) -> float | None:
        return compaction.starts_in_s(self._plan, self._tracker.state is EngineState.LOADING,
                                      self._rate_limit_until(), self._clock())

    def reload_in_s(self, rendered: int | None) -> float | None:
        """Seconds until the pending reload of generation `rendered` (the current one) may
        start (a failed one is retried); None when there is none."""
        tracker = self._tracker
        if not self._reloads or tracker.state not in (EngineState.SERVING, EngineState.SUSPECT):
            return None
        if rendered is None or rendered == tracker.loaded:
            return None
        return max(self._rate_limit_until() - self._clock(), 0.0)

    def window_in_s(self) -> float | None:
        window = self._settings.compaction_window
        return None if window is None else window.seconds_until_start(self._wall())

    def _rate_limit_until(self) -> float:
        if not self._reloads:
            return -float("inf")
        return compaction.rate_limit_until(self._tracker.last_restart_at,
                                           self._settings.triton_reload_min_interval_s,
                                           self._tracker.last_load_failed)

    def facts(self) -> PlanFacts | None:
        if self._plan is None:
            return None
        return PlanFacts(self._plan.reason, self.compaction_in_s(),
                         self._plan.not_before > self._clock())
