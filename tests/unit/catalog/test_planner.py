"""planner.py: the compaction in force and when it, or a reload, may start, fed a real engine
state machine and clocks the tests move; no catalog, no I/O. The rules alone:
test_compaction.py; carried out: test_reloads.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sidecar.catalog.compaction import CompactionReason
from sidecar.catalog.engine_state import EngineTracker, LoadKind, LoadOutcome
from sidecar.catalog.generation import Generation
from sidecar.catalog.name_state import NameEvent, Version
from sidecar.catalog.planner import CompactionPlanner
from sidecar.config import CompactionWindow
from tests.support.catalog_world import Clock
from tests.support.settings import make_settings

DAY = 1_800_000_000.0 - 1_800_000_000.0 % 86400  # a UTC midnight


class Planned:
    """A planner on a serving engine, and how often it woke the loop."""

    def __init__(self, tmp_path: Path, *, reloads: bool = True, **settings: Any) -> None:
        self.clock, self.wall = Clock(), Clock(DAY + 12 * 3600)
        self.registry: frozenset[str] | None = None
        self.wakes = 0
        self.tracker = EngineTracker(clock=self.clock)
        self.planner = CompactionPlanner(
            make_settings(tmp_path, **{"triton_reload_min_interval_s": 60.0, **settings}),
            self.tracker, reloads=reloads, registry_ids=lambda: self.registry,
            wake=self._woken, clock=self.clock, wall=self.wall)

    def _woken(self) -> None:
        self.wakes += 1

    def serve(self, number: int) -> None:
        self.tracker.start_load(number, LoadKind.LOAD)
        self.tracker.load_done(LoadOutcome.OK)


def with_free_spares(free: int, spares: int = 8) -> Generation:
    generation = Generation.render(1, [], spares, DAY)
    for n in range(1, spares - free + 1):
        generation.apply(f"_spare-g1-{n:04d}", NameEvent.BIND, "staged",
                         Version(f"a{n}", f"sha256:{n}"))
    return generation


def test_a_plan_is_made_once_wakes_the_loop_and_is_taken_when_carried_out(
    tmp_path: Path,
) -> None:
    planned = Planned(tmp_path)
    planner = planned.planner

    planner.ask(CompactionReason.REQUESTED)
    planner.ask(CompactionReason.WINDOW)  # one is planned already, no later

    assert planner.plan is not None and planner.plan.reason is CompactionReason.REQUESTED
    assert planned.wakes == 1 and planner.compaction_in_s() == 0.0
    taken = planner.take()
    assert taken is not None and taken.reason is CompactionReason.REQUESTED
    assert planner.plan is None and planner.compaction_in_s() is None


def test_after_a_reload_a_compaction_waits_for_the_minimum_interval(tmp_path: Path) -> None:
    planned = Planned(tmp_path)
    planned.serve(1)
    planned.clock.now_s += 10

    planned.planner.ask(CompactionReason.REQUESTED)

    facts = planned.planner.facts()
    assert facts is not None and facts.in_s == 50.0 and not facts.for_window
    assert planned.planner.reload_in_s(2) == 50.0  # generation 2 rendered, 1 loaded
    assert planned.planner.reload_in_s(1) is None  # nothing pending
    planned.clock.now_s += 50
    assert planned.planner.compaction_in_s() == 0.0 and planned.planner.reload_in_s(2) == 0.0


def test_low_spares_wait_for_the_quiet_window_and_none_left_does_not(tmp_path: Path) -> None:
    planned = Planned(tmp_path, compact_below=2,
                      compaction_window=CompactionWindow(2 * 60, 4 * 60))
    planner = planned.planner

    planner.check_spares(with_free_spares(3), spares_on=True)
    assert planner.plan is None  # above --compact-below
    planner.check_spares(with_free_spares(2), spares_on=True)
    facts = planner.facts()
    assert facts is not None and facts.reason is CompactionReason.SPARES_LOW
    assert facts.for_window and facts.in_s == 14 * 3600  # noon to 02:00

    planner.check_spares(with_free_spares(0), spares_on=True)
    assert planner.compaction_in_s() == 0.0  # none left: it cannot wait for the night


def test_without_reloads_nothing_is_planned_ahead_of_need(tmp_path: Path) -> None:
    planned = Planned(tmp_path, reloads=False, compact_below=2)

    planned.planner.check_spares(with_free_spares(1), spares_on=True)
    assert planned.planner.plan is None
    planned.planner.ask(CompactionReason.EXHAUSTED)
    assert planned.planner.plan is not None


def test_a_load_settles_a_plan_for_spares_unless_the_new_generation_is_low_too(
    tmp_path: Path,
) -> None:
    planned = Planned(tmp_path, compact_below=2)
    planner = planned.planner
    planner.ask(CompactionReason.EXHAUSTED)

    planner.loaded(with_free_spares(8), spares_on=True)
    assert planner.plan is None

    planner.ask(CompactionReason.REQUESTED)
    planner.loaded(with_free_spares(8), spares_on=True)
    assert planner.plan is not None  # asked for: a load does not settle it
    planner.take()
    planner.ask(CompactionReason.SPARES_LOW)
    planner.loaded(with_free_spares(1), spares_on=True)
    assert planner.plan is not None and planner.plan.reason is CompactionReason.SPARES_LOW


def test_the_quiet_window_plans_one_compaction_and_only_when_something_changed(
    tmp_path: Path,
) -> None:
    planned = Planned(tmp_path, compaction_window=CompactionWindow(2 * 60, 4 * 60))
    planner = planned.planner
    planner.check_window(lambda: True)
    assert planner.plan is None  # noon: outside the window
    assert planner.window_in_s() == 14 * 3600

    planned.wall.now_s = DAY + 86400 + 2 * 3600 + 60
    planner.check_window(lambda: False)
    assert planner.plan is None  # nothing to tidy
    planner.check_window(lambda: True)
    assert planner.take() is not None
    planned.clock.now_s += 600
    planned.wall.now_s += 600
    planner.check_window(lambda: True)
    assert planner.plan is None  # this window compacted already


def test_spares_are_sized_from_the_registry_as_it_is_listed_now(tmp_path: Path) -> None:
    planned = Planned(tmp_path, spare_names=None)

    assert planned.planner.spares_wanted(set()) == 256  # not listed yet
    planned.registry = frozenset(f"t{n}" for n in range(40))
    assert planned.planner.spares_wanted({"t1"}) == 39 + 10
