"""status.py: GET /catalog's body, the readiness problem and the catalog's gauges, built from
facts given by hand: no store, no catalog, no I/O."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.catalog.compaction import CompactionReason
from sidecar.catalog.engine_state import EngineState
from sidecar.catalog.generation import Generation
from sidecar.catalog.name_state import NameEvent, NameState, Version
from sidecar.catalog.status import (
    CatalogFacts,
    EngineFacts,
    PlanFacts,
    plan_view,
    problem,
    show_gauges,
    status,
)
from sidecar.core.metrics import Metrics

WALL = 1_800_000_000.0  # 2027-01-15T08:00:00Z
A1, A2 = Version("a1", "sha256:" + "1" * 64), Version("a2", "sha256:" + "2" * 64)


def generation(number: int = 1) -> Generation:
    """a1 by its own name, four spares: the second bound to a2, the third parked."""
    made = Generation.render(number, [A1], 4, WALL - 60)
    made.apply(f"_spare-g{number}-0002", NameEvent.BIND, "staged", A2)
    made.apply(f"_spare-g{number}-0003", NameEvent.BIND, "staged", Version("a3", "sha256:3"))
    made.apply(f"_spare-g{number}-0003", NameEvent.LEAVE, "evicted")
    return made


def facts(**overrides: object) -> CatalogFacts:
    current = generation()
    values: dict[str, object] = dict(
        path=Path("/cache/multi_lora.json"), current=current, naming=current,
        generations=[current], error=None, spares_on=True, reads_watched=True,
        spares_off=None, noop_from="--base-model-config", noop_bytes=4096, watched_noops=3,
        compact_below=1, adapter_bytes=10_000, max_bytes=50_000, catalog_bytes=8192,
        plan=None, window=None, triton_url="http://triton:8000", model="vllm_model",
        reload="on-change",
        engine=EngineFacts(EngineState.SERVING, 1, 1, None, None, WALL - 30, None),
        wall=WALL)
    values.update(overrides)
    return CatalogFacts(**values)  # type: ignore[arg-type]


def test_the_body_lists_own_names_spares_and_what_the_engine_serves() -> None:
    body = status(facts())

    assert body["generation"] == 1 and body["adapter_ids"] == ["a1"]
    assert body["spares"]["total"] == 4 and body["spares"]["left"] == 2
    assert body["spares"]["bound"] == {"_spare-g1-0002": str(A2)}
    assert body["spares"]["parked"] == ["_spare-g1-0003"] and body["spares"]["burnt"] == []
    assert body["names"]["states"] == {"unbound": 2, "bound": 2, "parked": 1, "burnt": 0}
    assert body["names"]["changes"] == {"bound": 2, "parked": 1, "returned": 0, "burnt": 0}
    assert body["disk"] == {"adapter_bytes": 10_000, "max_bytes": 50_000, "catalog_bytes": 8192,
                            "noop_bytes": 4096, "watched_noops": 3}
    assert body["triton"]["state"] == "serving" and body["triton"]["reloading"] is False
    assert body["triton"]["last_reload_at"] == "2027-01-15T07:59:30.000Z"
    assert body["next_compaction"] is None


def test_without_reloads_the_body_says_nothing_of_the_engines_state() -> None:
    body = status(facts(engine=None, reload="never", triton_url=None))

    assert body["triton"] == {"url": None, "model": "vllm_model", "reload": "never"}


def test_with_no_engine_serving_the_spares_are_of_no_generation() -> None:
    body = status(facts(naming=None, compact_below=None,
                        engine=EngineFacts(EngineState.LOADING, None, None, 1, None, None, None)))

    assert body["names"] is None and body["spares"]["generation"] is None
    assert body["spares"]["left"] == 0 and body["spares"]["bound"] == {}
    assert body["triton"]["reloading"] is True and body["triton"]["pending"] == 1


def test_a_planned_compaction_says_what_it_waits_for() -> None:
    window = PlanFacts(CompactionReason.SPARES_LOW, 3600.0, for_window=True)
    rate = PlanFacts(CompactionReason.REQUESTED, 12.34, for_window=False)
    due = PlanFacts(CompactionReason.EXHAUSTED, 0.0, for_window=False)
    loading = PlanFacts(CompactionReason.EXHAUSTED, None, for_window=False)

    assert plan_view(window, WALL) == {"reason": "spares_low", "in_s": 3600.0,
                                       "at": "2027-01-15T09:00:00.000Z",
                                       "waits_for": "the quiet window"}
    assert plan_view(rate, WALL)["waits_for"] == "--triton-reload-min-interval"  # type: ignore[index]
    assert plan_view(rate, WALL)["in_s"] == 12.3  # type: ignore[index]
    assert plan_view(due, WALL)["waits_for"] is None  # type: ignore[index]
    assert plan_view(loading, WALL) == {"reason": "exhausted", "in_s": None, "at": None,
                                        "waits_for": None}
    assert status(facts(plan=window))["next_compaction"] == plan_view(window, WALL)


def test_not_ready_until_a_generation_is_rendered_and_the_error_says_why() -> None:
    path = Path("/cache/multi_lora.json")

    assert problem(path, generation(), None) is None
    assert problem(path, None, None) == "catalog: multi_lora.json not rendered yet (starting)"
    assert "(cannot render generation: No space left on device)" in (
        problem(path, None, "cannot render generation: No space left on device") or "")


def test_the_gauges_follow_the_same_facts() -> None:
    metrics = Metrics(CollectorRegistry(), process=False)

    def value(name: str, **labels: str) -> float | None:
        return metrics.metrics_registry.get_sample_value(name, labels)

    show_gauges(metrics, facts())
    assert value("lora_sidecar_catalog_adapters") == 1
    assert value("lora_sidecar_catalog_generation") == 1
    assert value("lora_sidecar_catalog_spares_left") == 2
    assert value("lora_sidecar_catalog_names", state=NameState.PARKED.value) == 1
    assert value("lora_sidecar_catalog_disk_bytes") == 8192
    assert value("lora_sidecar_triton_model_state", state="serving") == 1

    show_gauges(metrics, dataclasses.replace(
        facts(), naming=None,
        engine=EngineFacts(EngineState.LOADING, 1, None, 2, None, None, None)))
    assert value("lora_sidecar_catalog_spares_left") == 0
    assert value("lora_sidecar_catalog_names", state=NameState.BOUND.value) == 0
    assert value("lora_sidecar_triton_model_state", state="serving") == 0
    assert value("lora_sidecar_triton_model_state", state="loading") == 1
