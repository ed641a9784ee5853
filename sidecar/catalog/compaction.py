"""When a new catalog generation is worth a reload (compaction), as a pure plan: its reasons,
the quiet window, the spares threshold, how many spares a generation gets, and the rate limit
between reloads. No I/O and no clock of its own: planner.py feeds it the time and the engine's
state; reloads.py carries out what is due.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..config import CompactionWindow

RETRY_AFTER_FAILURE_S = 5.0  # a failed load is tried again no sooner than this
SPARES_MIN = 32  # spares of a generation sized from the registry: at least these
SPARES_UNKNOWN = 256  # when the registry could not be listed yet
WINDOW_SAME_S = 60.0  # two window starts this close are the same window


class CompactionReason(Enum):
    EXHAUSTED = "exhausted"  # an adapter waits for a name and no spare is left
    SPARES_LOW = "spares_low"  # spares left at or below --compact-below
    WINDOW = "window"  # the quiet window, with something to tidy
    REQUESTED = "requested"  # POST /catalog/compact
    ENGINE_LOST = "engine_lost"  # a load is needed anyway and the generation names a gone path


# What a reload costs nothing for (the operator reloads Triton): never planned ahead of need.
AHEAD_OF_NEED = frozenset({CompactionReason.SPARES_LOW, CompactionReason.WINDOW})
# What a freshly loaded generation's spares settle.
SETTLED_BY_A_LOAD = frozenset({CompactionReason.EXHAUSTED, CompactionReason.SPARES_LOW})


@dataclass(frozen=True, slots=True)
class Plan:
    reason: CompactionReason
    since: float  # monotonic: when it was planned
    not_before: float  # monotonic: the earliest it may start (a quiet window's start)


def replan(plan: Plan | None, reason: CompactionReason, now: float,
           not_before: float | None, reloads: bool) -> Plan | None:
    """The plan after asking for one for `reason` (not before `not_before`); None when the
    plan stays as it is. An adapter waiting (EXHAUSTED) never waits longer than planned."""
    if not reloads and reason in AHEAD_OF_NEED:
        return None  # a generation rendered ahead of need would only change the names given
    at = not_before if not_before is not None else now
    if plan is not None and plan.not_before <= at and (
        reason is not CompactionReason.EXHAUSTED or plan.reason is reason
    ):
        return None  # one is planned already, no later than this one would be
    if plan is not None:
        at = min(at, plan.not_before)
    return Plan(reason, now, at)


def compact_below(setting: int | None, spares: int) -> int:
    """Spares left at or below which a compaction is planned: --compact-below, or an eighth of
    the generation's spares (at least 4, or a quarter of them when fewer than 16)."""
    if setting is not None:
        return setting
    return max(spares // 8, min(4, spares // 4))


def spares_low_not_before(free: int, window: CompactionWindow | None, now: float,
                          wall: float) -> float | None:
    """When a compaction for spares running low may start: low but not out waits for the quiet
    window (the outage a reload may cost); out of spares, or no window, at once (None)."""
    if window is None or free <= 0:
        return None
    return now + window.seconds_until_start(wall)


def window_started(window: CompactionWindow | None, now: float, wall: float,
                   done: float | None) -> float | None:
    """The monotonic start of the quiet window we are in, unless compacted in it already
    (`done`: the start of the window last compacted); None outside one."""
    if window is None or not window.contains(wall):
        return None
    started = now - window.seconds_since_start(wall)
    if done is not None and abs(done - started) < WINDOW_SAME_S:
        return None
    return started


def spares_wanted(setting: int | None, registry: frozenset[str] | None, own: set[str],
                  most: int) -> int:
    """Spares for a new generation listing `own` by their own names: --spare-names, or what the
    registry's listing holds beyond them, plus a quarter of it for uploads, within the bounds."""
    if setting is not None:
        return setting
    if registry is None:
        wanted = SPARES_UNKNOWN
    else:
        wanted = max(SPARES_MIN, len(registry - own) + len(registry) // 4)
    return min(wanted, most)


def rate_limit_until(last_restart_at: float | None, min_interval_s: float,
                     last_load_failed: bool) -> float:
    """The earliest a reload may start: --triton-reload-min-interval after the last one (and a
    failed one tried again no sooner than RETRY_AFTER_FAILURE_S)."""
    if last_restart_at is None:
        return -float("inf")
    gap_s = max(min_interval_s, RETRY_AFTER_FAILURE_S) if last_load_failed else min_interval_s
    return last_restart_at + gap_s


def starts_in_s(plan: Plan | None, loading: bool, rate_limit: float, now: float) -> float | None:
    """Seconds until the planned compaction may start; None when none is planned or a load is
    in progress (it starts after)."""
    if plan is None or loading:
        return None
    return max(max(plan.not_before, rate_limit) - now, 0.0)
