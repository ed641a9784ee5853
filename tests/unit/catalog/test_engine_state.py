"""The reload state machine on its own: every named transition, from every state it leaves, and
the events each state ignores. The catalog's use of it is in test_catalog.py, and real faults
(Triton late, a probe answered 503, a hung probe) in tests/triton/test_faults_triton.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from sidecar.catalog.engine_state import (
    LOST_AFTER_FAILURES,
    LOST_WINDOW_S,
    EngineState,
    EngineTracker,
    LoadKind,
    LoadOutcome,
    Probe,
    Transition,
)

S = EngineState


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def tracker_in(state: EngineState, *, loaded: int | None = 1) -> tuple[EngineTracker, Clock]:
    """A tracker brought to `state` through its own transitions."""
    clock = Clock()
    tracker = EngineTracker(clock=clock)
    if state is S.STARTING:
        return tracker, clock
    if state is S.UNREACHABLE:
        tracker.on_probe(Probe.FAILED, "refused")
    elif state is S.ABSENT:
        tracker.on_probe(Probe.NOT_LOADED, "UNAVAILABLE")
    elif state is S.UNCONFIRMED:
        tracker.on_probe(Probe.READY)
    elif state in (S.SERVING, S.SUSPECT, S.LOADING):
        tracker.on_probe(Probe.NOT_LOADED, "UNAVAILABLE")
        tracker.start_load(loaded or 1, LoadKind.LOAD)
        tracker.load_done(LoadOutcome.OK)
        if state is S.SUSPECT:
            tracker.on_probe(Probe.FAILED, "timeout")
        if state is S.LOADING:
            tracker.start_load((loaded or 1) + 1, LoadKind.RELOAD)
    assert tracker.state is state
    return tracker, clock


@dataclass(frozen=True)
class Case:
    start: EngineState
    event: Callable[[EngineTracker, Clock], Transition | None]
    transition: Transition | None
    end: EngineState
    serving: int | None


def probe(verdict: Probe) -> Callable[[EngineTracker, Clock], Transition | None]:
    return lambda tracker, clock: tracker.on_probe(verdict, "detail")


def failures_over_the_window(tracker: EngineTracker, clock: Clock) -> Transition | None:
    last = None
    for _ in range(LOST_AFTER_FAILURES - 1):  # SUSPECT has seen one failure already
        clock.now_s += LOST_WINDOW_S / (LOST_AFTER_FAILURES - 1)
        last = tracker.on_probe(Probe.FAILED, "timeout")
    return last


def many_failures_too_fast(tracker: EngineTracker, clock: Clock) -> Transition | None:
    last = None
    for _ in range(LOST_AFTER_FAILURES * 3):
        clock.now_s += 0.01
        last = tracker.on_probe(Probe.FAILED, "HTTP 503")
    return last


def load(kind: LoadKind, outcome: LoadOutcome) -> Callable[[EngineTracker, Clock],
                                                          Transition | None]:
    def run(tracker: EngineTracker, clock: Clock) -> Transition | None:
        if tracker.state is not S.LOADING:
            tracker.start_load(2, kind)
        else:
            tracker.kind = kind
        return tracker.load_done(outcome, None if outcome is LoadOutcome.OK else "it failed")

    return run


CASES = {
    "starting, Triton ready": Case(S.STARTING, probe(Probe.READY), Transition.FOUND_READY,
                                   S.UNCONFIRMED, None),
    "starting, model absent": Case(S.STARTING, probe(Probe.NOT_LOADED),
                                   Transition.FOUND_ABSENT, S.ABSENT, None),
    "starting, no answer": Case(S.STARTING, probe(Probe.FAILED), Transition.FOUND_UNREACHABLE,
                                S.UNREACHABLE, None),
    "unreachable, answers ready": Case(S.UNREACHABLE, probe(Probe.READY),
                                       Transition.FOUND_READY, S.UNCONFIRMED, None),
    "unreachable, answers absent": Case(S.UNREACHABLE, probe(Probe.NOT_LOADED),
                                        Transition.FOUND_ABSENT, S.ABSENT, None),
    "unreachable, still no answer": Case(S.UNREACHABLE, probe(Probe.FAILED), None,
                                         S.UNREACHABLE, None),
    "absent, loaded by someone": Case(S.ABSENT, probe(Probe.READY), Transition.FOUND_READY,
                                      S.UNCONFIRMED, None),
    "absent, probe fails": Case(S.ABSENT, probe(Probe.FAILED), None, S.ABSENT, None),
    "unconfirmed, confirmed unchanged": Case(
        S.UNCONFIRMED, lambda tracker, clock: tracker.confirm(1), Transition.CONFIRMED,
        S.SERVING, 1),
    "unconfirmed, model gone": Case(S.UNCONFIRMED, probe(Probe.NOT_LOADED),
                                    Transition.MODEL_GONE, S.ABSENT, None),
    "serving, probe ok": Case(S.SERVING, probe(Probe.READY), None, S.SERVING, 1),
    "serving, one blip": Case(S.SERVING, probe(Probe.FAILED), Transition.PROBE_BLIP,
                              S.SUSPECT, 1),
    "serving, Triton says gone": Case(S.SERVING, probe(Probe.NOT_LOADED),
                                      Transition.MODEL_GONE, S.ABSENT, None),
    "suspect, answers again": Case(S.SUSPECT, probe(Probe.READY), Transition.PROBE_OK,
                                   S.SERVING, 1),
    "suspect, more blips within the window": Case(S.SUSPECT, many_failures_too_fast,
                                                  Transition.PROBE_BLIP, S.SUSPECT, 1),
    "suspect, failures over the window": Case(S.SUSPECT, failures_over_the_window,
                                              Transition.DECLARED_LOST, S.UNREACHABLE, None),
    "suspect, Triton says gone": Case(S.SUSPECT, probe(Probe.NOT_LOADED),
                                      Transition.MODEL_GONE, S.ABSENT, None),
    "loading ignores probes": Case(S.LOADING, probe(Probe.NOT_LOADED), None, S.LOADING, 1),
    "absent, load starts": Case(S.ABSENT, lambda tracker, clock: tracker.start_load(
        2, LoadKind.LOAD), Transition.LOAD_STARTED, S.LOADING, None),
    "serving, on-change reload starts": Case(S.SERVING, lambda tracker, clock: tracker.start_load(
        2, LoadKind.RELOAD), Transition.LOAD_STARTED, S.LOADING, 1),
    "serving, unload-first starts": Case(S.SERVING, lambda tracker, clock: tracker.start_load(
        2, LoadKind.UNLOAD_FIRST), Transition.LOAD_STARTED, S.LOADING, None),
    "unconfirmed, takeover starts": Case(S.UNCONFIRMED, lambda tracker, clock: tracker.start_load(
        2, LoadKind.TAKEOVER), Transition.LOAD_STARTED, S.LOADING, None),
    "load done": Case(S.LOADING, load(LoadKind.RELOAD, LoadOutcome.OK), Transition.LOAD_DONE,
                      S.SERVING, 2),
    "reload refused, old serves": Case(S.LOADING, load(LoadKind.RELOAD, LoadOutcome.REFUSED),
                                       Transition.LOAD_REFUSED_OLD_SERVES, S.SERVING, 1),
    "load refused": Case(S.ABSENT, load(LoadKind.LOAD, LoadOutcome.REFUSED),
                         Transition.LOAD_REFUSED, S.ABSENT, None),
    "takeover refused": Case(S.UNCONFIRMED, load(LoadKind.TAKEOVER, LoadOutcome.REFUSED),
                             Transition.LOAD_REFUSED, S.UNCONFIRMED, None),
    "load unreachable": Case(S.ABSENT, load(LoadKind.LOAD, LoadOutcome.UNREACHABLE),
                             Transition.LOAD_UNREACHABLE, S.UNREACHABLE, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_each_transition(case: Case) -> None:
    tracker, clock = tracker_in(case.start)

    taken = case.event(tracker, clock)

    assert taken is case.transition
    assert tracker.state is case.end
    assert tracker.serving() == case.serving


def test_every_named_transition_has_a_case() -> None:
    assert {c.transition for c in CASES.values()} - {None} == set(Transition)


def test_only_a_load_that_reached_triton_starts_the_minimum_interval() -> None:
    tracker, clock = tracker_in(S.ABSENT)
    tracker.start_load(1, LoadKind.LOAD)
    tracker.load_done(LoadOutcome.UNREACHABLE, "connection refused")
    assert tracker.last_restart_at is None  # nothing was restarted: no wait when Triton is up

    tracker.on_probe(Probe.NOT_LOADED, "UNAVAILABLE")
    clock.now_s += 3
    tracker.start_load(1, LoadKind.LOAD)
    tracker.load_done(LoadOutcome.REFUSED, "out of memory")
    assert tracker.last_restart_at == clock.now_s
    assert tracker.last_load_failed


def test_a_takeover_does_not_start_the_minimum_interval() -> None:
    tracker, _ = tracker_in(S.UNCONFIRMED)
    tracker.start_load(1, LoadKind.TAKEOVER)
    tracker.load_done(LoadOutcome.OK)

    assert tracker.state is S.SERVING and tracker.loaded == 1
    assert tracker.last_restart_at is None


def test_a_ready_probe_clears_the_failures_counted_so_far() -> None:
    tracker, clock = tracker_in(S.SUSPECT)
    tracker.on_probe(Probe.READY)
    clock.now_s += LOST_WINDOW_S * 2
    tracker.on_probe(Probe.FAILED, "timeout")

    assert tracker.state is S.SUSPECT  # one failure again, not the old ones plus this one
