"""catalog/compaction.py: when a compaction is planned and may start, as a pure plan (no I/O,
no clock): reasons, the quiet window, the spares threshold and sizing, the rate limit."""

from __future__ import annotations

import pytest

from sidecar.catalog.compaction import (
    RETRY_AFTER_FAILURE_S,
    SPARES_MIN,
    SPARES_UNKNOWN,
    CompactionReason,
    Plan,
    compact_below,
    rate_limit_until,
    replan,
    spares_low_not_before,
    spares_wanted,
    starts_in_s,
    window_started,
)
from sidecar.config import CompactionWindow

EXHAUSTED, LOW, WINDOW, REQUESTED = (CompactionReason.EXHAUSTED, CompactionReason.SPARES_LOW,
                                     CompactionReason.WINDOW, CompactionReason.REQUESTED)
DAY_S = 24 * 3600.0


def test_a_first_plan_starts_now_or_at_its_window() -> None:
    assert replan(None, REQUESTED, 100.0, None, reloads=True) == Plan(REQUESTED, 100.0, 100.0)
    assert replan(None, LOW, 100.0, 500.0, reloads=True) == Plan(LOW, 100.0, 500.0)


def test_a_plan_no_later_than_asked_stays() -> None:
    planned = Plan(REQUESTED, 10.0, 10.0)

    assert replan(planned, LOW, 100.0, 500.0, reloads=True) is None
    assert replan(planned, WINDOW, 100.0, None, reloads=True) is None


def test_an_adapter_waiting_brings_a_windowed_plan_forward_and_says_why() -> None:
    waiting = replan(Plan(LOW, 10.0, 500.0), EXHAUSTED, 100.0, None, reloads=True)

    assert waiting == Plan(EXHAUSTED, 100.0, 100.0)
    assert replan(waiting, EXHAUSTED, 120.0, None, reloads=True) is None


@pytest.mark.parametrize("reason", [LOW, WINDOW])
def test_without_reloads_nothing_is_planned_ahead_of_need(reason: CompactionReason) -> None:
    assert replan(None, reason, 100.0, None, reloads=False) is None
    assert replan(None, EXHAUSTED, 100.0, None, reloads=False) is not None


@pytest.mark.parametrize(("setting", "spares", "expected"), [
    (None, 256, 32), (None, 16, 4), (None, 8, 2), (None, 0, 0), (10, 256, 10)])
def test_the_spares_threshold(setting: int | None, spares: int, expected: int) -> None:
    assert compact_below(setting, spares) == expected


def test_spares_low_waits_for_the_window_unless_out() -> None:
    window = CompactionWindow(2 * 60, 4 * 60)
    at_midnight = 0.0  # 1970-01-01T00:00Z

    assert spares_low_not_before(3, window, 50.0, at_midnight) == 50.0 + 2 * 3600
    assert spares_low_not_before(0, window, 50.0, at_midnight) is None
    assert spares_low_not_before(3, None, 50.0, at_midnight) is None


def test_a_window_is_compacted_once() -> None:
    window = CompactionWindow(2 * 60, 4 * 60)
    inside = 2.5 * 3600  # 02:30 UTC

    started = window_started(window, 1000.0, inside, None)
    assert started == 1000.0 - 1800.0
    assert window_started(window, 1010.0, inside + 10, started) is None  # the same window
    assert window_started(window, 1000.0 + DAY_S, inside + DAY_S, started) is not None
    assert window_started(window, 1000.0, 0.0, None) is None  # outside it
    assert window_started(None, 1000.0, inside, None) is None


def test_spares_are_sized_from_the_registry_within_the_bounds() -> None:
    registry = frozenset(f"t{n}" for n in range(1000))

    assert spares_wanted(None, registry, {"t1", "other"}, 4096) == 999 + 250
    assert spares_wanted(None, frozenset(), set(), 4096) == SPARES_MIN
    assert spares_wanted(None, None, set(), 4096) == SPARES_UNKNOWN
    assert spares_wanted(None, registry, set(), 100) == 100
    assert spares_wanted(7, registry, set(), 4096) == 7


def test_reloads_are_rate_limited_and_a_failure_waits_at_least_its_retry() -> None:
    assert rate_limit_until(None, 60.0, False) == -float("inf")
    assert rate_limit_until(100.0, 60.0, False) == 160.0
    assert rate_limit_until(100.0, 0.0, True) == 100.0 + RETRY_AFTER_FAILURE_S


def test_a_plan_starts_after_its_window_and_the_rate_limit_never_during_a_load() -> None:
    plan = Plan(LOW, 0.0, 50.0)

    assert starts_in_s(plan, False, 80.0, 10.0) == 70.0
    assert starts_in_s(plan, False, -float("inf"), 60.0) == 0.0
    assert starts_in_s(plan, True, -float("inf"), 60.0) is None
    assert starts_in_s(None, False, -float("inf"), 60.0) is None
