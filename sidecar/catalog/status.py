"""What the catalog shows: GET /catalog's body, the readiness problem and the catalog's gauges, all
built from the facts they are given (reloads.py gathers them). No I/O and no clock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.fsutil import iso_utc
from ..core.metrics import Metrics
from .compaction import CompactionReason
from .engine_state import EngineState
from .generation import Generation
from .name_state import NameState

RULE = ("adapters validated and on disk when the generation was rendered, by their own names, "
        "plus spare names given to adapter versions staged since; a name whose adapter left the "
        "disk is parked at a no-op and returns when the same bytes are staged again")


@dataclass(frozen=True, slots=True)
class PlanFacts:
    """The compaction planned."""

    reason: CompactionReason
    in_s: float | None  # until it may start; None while a load is in progress
    for_window: bool  # it waits for the quiet window (else, if at all, for the rate limit)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Triton's vLLM model as the sidecar sees it (only where the sidecar reloads it)."""

    state: EngineState
    loaded: int | None
    serving: int | None
    pending: int | None  # the generation rendered and not loaded yet
    next_reload_in_s: float | None
    last_reload_at: float | None  # unix
    last_error: str | None


@dataclass(frozen=True, slots=True)
class CatalogFacts:
    path: Path  # multi_lora.json
    current: Generation | None  # the generation rendered last
    naming: Generation | None  # the generation whose names requests use now
    generations: Sequence[Generation]  # every live one
    error: str | None  # why no generation could be rendered
    spares_on: bool
    reads_watched: bool
    spares_off: str | None
    noop_from: str
    noop_bytes: int
    watched_noops: int
    compact_below: int | None  # for the naming generation
    adapter_bytes: int
    max_bytes: int
    catalog_bytes: int
    plan: PlanFacts | None
    window: str | None
    triton_url: str | None
    model: str
    reload: str  # the reload mode, "never" without Triton
    engine: EngineFacts | None  # None where the sidecar reloads nothing
    wall: float  # unix, now


def waits_for(plan: PlanFacts) -> str | None:
    if plan.in_s is None or plan.in_s <= 0:
        return None
    return "the quiet window" if plan.for_window else "--triton-reload-min-interval"


def plan_view(plan: PlanFacts | None, wall: float) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "reason": plan.reason.value,
        "in_s": None if plan.in_s is None else round(plan.in_s, 1),
        "at": None if plan.in_s is None else iso_utc(wall + plan.in_s),
        "waits_for": waits_for(plan),
    }


def generation_view(generation: Generation) -> dict[str, Any]:
    counts = generation.counts
    return {
        "generation": generation.number,
        "names": len(generation.names),
        "own": len(generation.own_ids()),
        "spares": generation.spare_count(),
        "states": generation.state_counts(),
        "changes": {"bound": counts.bound, "parked": counts.parked,
                    "returned": counts.returned, "burnt": counts.burnt},
        "retire_at": generation.retire_at,
    }


def problem(path: Path, current: Generation | None, error: str | None) -> str | None:
    """Why the sidecar is not ready on the catalog's account: Triton's vLLM model cannot load
    before multi_lora.json (`path`) exists."""
    if current is not None:
        return None
    return f"catalog: {path.name} not rendered yet ({error or 'starting'})"


def status(facts: CatalogFacts) -> dict[str, Any]:
    """GET /catalog's body."""
    current, naming = facts.current, facts.naming
    own = sorted(current.own_ids()) if current else []
    bound_spares = {name: str(e.version) for name, e in naming.names.items()
                    if e.spare and e.state is NameState.BOUND and e.version} if naming else {}
    body: dict[str, Any] = {
        "enabled": True,
        "path": str(facts.path),
        "generation": current.number if current else 0,
        "rendered_at": iso_utc(current.rendered_at) if current else None,
        "rule": RULE,
        "adapter_ids": own,
        "adapter_count": len(own),
        "error": facts.error,
        "names": generation_view(naming) if naming else None,
        "spares": {
            "enabled": facts.spares_on,
            "reads_watched": facts.reads_watched,
            "off_because": facts.spares_off,
            "noop_from": facts.noop_from or None,
            "generation": naming.number if naming else None,
            "total": naming.spare_count() if naming else 0,
            "left": naming.free_count() if naming else 0,
            "bound": dict(sorted(bound_spares.items())),
            "parked": naming.in_state(NameState.PARKED) if naming else [],
            "burnt": naming.in_state(NameState.BURNT) if naming else [],
            "compact_below": facts.compact_below,
        },
        "disk": {
            "adapter_bytes": facts.adapter_bytes,
            "max_bytes": facts.max_bytes,
            "catalog_bytes": facts.catalog_bytes,
            "noop_bytes": facts.noop_bytes,
            "watched_noops": facts.watched_noops,
        },
        "next_compaction": plan_view(facts.plan, facts.wall),
        "compaction_window": facts.window,
        "generations": [generation_view(g)
                        for g in sorted(facts.generations, key=lambda g: g.number)],
    }
    triton: dict[str, Any] = {"url": facts.triton_url, "model": facts.model,
                              "reload": facts.reload}
    engine = facts.engine
    if engine is not None:
        triton.update({
            "state": engine.state.value,
            "loaded_generation": engine.loaded,
            "serving_generation": engine.serving,
            "reloading": engine.state is EngineState.LOADING,
            "pending": engine.pending,
            "next_reload_in_s": engine.next_reload_in_s,
            "last_reload_at": iso_utc(engine.last_reload_at) if engine.last_reload_at else None,
            "last_reload_error": engine.last_error,
        })
    body["triton"] = triton
    return body


def show_gauges(metrics: Metrics, facts: CatalogFacts) -> None:
    """The catalog's gauges, every one of them, from the same facts as GET /catalog."""
    current, naming = facts.current, facts.naming
    metrics.catalog_adapters.set(len(current.own_ids()) if current else 0)
    metrics.catalog_generation.set(current.number if current else 0)
    metrics.catalog_spares_left.set(naming.free_count() if naming else 0)
    for state in NameState:
        metrics.catalog_names.labels(state=state.value).set(
            naming.count_in(state) if naming else 0)
    metrics.catalog_disk_bytes.set(facts.catalog_bytes)
    if facts.engine is not None:
        for engine_state in EngineState:
            metrics.triton_model_state.labels(state=engine_state.value).set(
                1 if engine_state is facts.engine.state else 0)
