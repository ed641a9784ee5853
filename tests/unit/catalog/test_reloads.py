"""reloads.py: compactions planned and carried out when due, and the reload decisions of the
state machine in use, with Triton's model control replaced by a recorder; GET /catalog and
POST /catalog/compact on the real sidecar. The rules alone, without I/O: test_compaction.py and
test_planner.py; spares sized and renders: test_loads.py."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from sidecar.catalog.compaction import RETRY_AFTER_FAILURE_S
from sidecar.catalog.disk import read_catalog_journal
from sidecar.catalog.engine_state import EngineState, Probe
from sidecar.catalog.naming import StoreView
from sidecar.config import CompactionWindow, TritonReload
from sidecar.core.errors import (
    CatalogPending,
    CatalogReloading,
)
from tests.support.catalog_world import (
    World,
    api_sidecar,
    compact,
    hold_a_reload,
    raises,
    serving,
    spares_of,
)
from tests.support.settings import local_registry_adapter


async def test_running_low_on_spares_compacts_once_listing_every_adapter_by_its_own_name(
    world: World,
) -> None:
    for adapter_id in ("a1", "a2", "a3"):
        world.add_adapter(adapter_id)
    reloads = await serving(world, compact_below=1, triton_reload_min_interval_s=60.0)
    world.clock.now_s += 120  # the first load is long past

    names = [await world.stage(a) for a in ("a1", "a2", "a3")]  # 1 spare left: low
    assert all(n.startswith("_spare-g1-") for n in names)
    assert reloads.status()["next_compaction"]["reason"] == "spares_low"
    await reloads.sync()

    assert reloads.status()["generation"] == 2
    assert reloads.status()["triton"]["loaded_generation"] == 2
    assert [await world.stage(a) for a in ("a1", "a2", "a3")] == ["a1", "a2", "a3"]
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "spares_low"}) == 1
    assert reloads.status()["spares"]["left"] == 4
    # The old generation's folder stays while the old engine may finish its requests.
    assert (world.cache / "catalog" / "g1").is_dir()
    world.wall.now_s += 601
    await reloads.sync()
    assert not (world.cache / "catalog" / "g1").exists()
    assert list(read_catalog_journal(world.cache).generations) == [2]


async def test_compactions_wait_for_the_minimum_interval_between_reloads(world: World) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, triton_reload_min_interval_s=60.0)
    await world.stage("a1")
    world.clock.now_s += 10

    await compact(reloads)

    assert world.control.loads() == 1
    plan = reloads.status()["next_compaction"]
    assert plan["reason"] == "requested" and plan["in_s"] == pytest.approx(50.0)
    assert plan["waits_for"] == "--triton-reload-min-interval"
    world.clock.now_s += 50
    await reloads.sync()
    assert world.control.loads() == 2
    assert reloads.status()["next_compaction"] is None


async def test_with_no_spare_left_the_adapter_waits_for_the_compaction_it_plans(
    world: World,
) -> None:
    for n in range(5):
        world.add_adapter(f"a{n}")
    reloads = await serving(world, compact_below=0, spare_names=1)
    await world.stage("a0")  # the last spare: a compaction is planned before anyone waits
    assert reloads.status()["next_compaction"]["reason"] == "spares_low"

    with pytest.raises(CatalogPending) as caught:
        await world.stage("a1")
    message = str(caught.value)

    assert "no spare name is left" in message and "loaded now" in message
    assert reloads.status()["next_compaction"]["reason"] == "exhausted"
    await reloads.sync()
    assert await world.stage("a1") == "a1"
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "exhausted"}) == 1


async def test_with_spare_names_zero_each_new_adapter_costs_a_reload(world: World) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, spare_names=0)

    message = str(await asyncio.gather(world.stage("a1"), return_exceptions=True))
    assert "spare names are off (--spare-names is 0)" in message
    await reloads.sync()

    assert await world.stage("a1") == "a1"
    assert world.control.loads() == 2
    assert world.rendered() == {"a1": "/lora-cache/catalog/g2/names/a1"}


async def test_a_restart_with_spare_names_zero_gives_no_spare_left_from_before(
    world: World,
) -> None:
    world.add_adapters("a1", "a2")
    await serving(world)
    name = await world.stage("a1")

    restarted = await world.start(spare_names=0)
    await restarted.sync()

    assert await world.stage("a1") == name  # what was given stays served
    with pytest.raises(CatalogPending, match="spare names are off"):
        await world.stage("a2")
    await restarted.sync()
    assert await world.stage("a2") == "a2"
    assert spares_of(world) == []


async def test_low_spares_wait_for_the_quiet_window_but_an_empty_catalog_does_not(
    world: World,
) -> None:
    for n in range(5):
        world.add_adapter(f"a{n}")
    window = CompactionWindow(2 * 60, 4 * 60)  # 02:00-04:00 UTC
    world.wall.now_s = 1_800_000_000.0 - 1_800_000_000.0 % 86400 + 12 * 3600  # noon UTC
    reloads = await serving(world, compact_below=2, compaction_window=window)
    for n in range(2):
        await world.stage(f"a{n}")

    plan = reloads.status()["next_compaction"]
    assert plan["reason"] == "spares_low" and plan["waits_for"] == "the quiet window"
    assert plan["in_s"] == pytest.approx(14 * 3600)
    for n in range(2, 4):
        await world.stage(f"a{n}")
    with pytest.raises(CatalogPending):
        await world.stage("a4")  # none left: it cannot wait for the night
    await reloads.sync()
    assert reloads.status()["generation"] == 2


async def test_the_quiet_window_compacts_what_changed_since_the_last_generation(
    world: World,
) -> None:
    world.add_adapter("a1")
    window = CompactionWindow(2 * 60, 4 * 60)
    day = 1_800_000_000.0 - 1_800_000_000.0 % 86400
    world.wall.now_s = day + 1 * 3600
    reloads = await serving(world, compaction_window=window)
    await world.stage("a1")
    await reloads.sync()
    assert reloads.status()["generation"] == 1

    world.wall.now_s = day + 2 * 3600 + 60
    await reloads.sync()

    assert reloads.status()["generation"] == 2
    assert await world.stage("a1") == "a1"
    await reloads.sync()
    assert reloads.status()["generation"] == 2  # nothing left to tidy in this window


async def test_triton_unreachable_at_start_is_loaded_at_once_when_it_answers(
    world: World,
) -> None:
    world.control.reachable = False
    reloads = await world.start(triton_reload_min_interval_s=3600.0)
    await reloads.sync()
    assert reloads.status()["triton"]["state"] == "unreachable"
    assert "does not answer" in raises(CatalogPending, reloads.serving.naming_generation)

    world.control.reachable = True
    await reloads.sync()

    assert reloads.status()["triton"]["state"] == "serving"
    assert world.control.calls == ["load vllm_model"]


async def test_a_load_that_could_not_reach_triton_costs_no_minimum_interval(
    world: World,
) -> None:
    reloads = await world.start(triton_reload_min_interval_s=3600.0)
    world.control.probe_answers = [Probe.NOT_LOADED]
    world.control.reachable = False  # gone between the probe and the load
    await reloads.sync()
    assert world.control.calls == ["load vllm_model"]
    assert reloads.status()["triton"]["state"] == "unreachable"

    world.control.reachable = True
    await reloads.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert reloads.status()["triton"]["state"] == "serving"


async def test_one_failed_probe_changes_nothing(world: World) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    name = await world.stage("a1")
    loads = world.control.loads()
    world.control.probe_answers = [Probe.FAILED]

    await reloads.sync()

    assert reloads.status()["triton"]["state"] == "suspect"
    assert world.lora_name("a1") == name
    await reloads.sync()
    assert reloads.status()["triton"]["state"] == "serving"
    assert world.control.loads() == loads


async def test_triton_saying_the_model_is_gone_reloads_at_once(world: World) -> None:
    reloads = await serving(world, triton_reload_min_interval_s=3600.0)
    world.control.ready = False  # unloaded: Triton restarted, or the health check fired

    await reloads.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert reloads.status()["triton"]["state"] == "serving"


async def test_a_lost_engine_whose_catalog_has_a_name_with_nothing_to_lead_to_comes_back_compacted(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    world.add_adapter("a1")
    # Fault injected: no shapes to be had anywhere, so no no-op to park a name at.
    monkeypatch.setattr(StoreView, "noop_like", lambda self: None)
    reloads = await serving(world, base_model_config=None, spare_names=0)
    with pytest.raises(CatalogPending):
        await world.stage("a1")
    await reloads.sync()
    assert "a1" in world.rendered()
    shutil.rmtree(world.cache / "adapters" / "a1")
    world.store.forget("a1")  # type: ignore[union-attr]
    world.control.ready = False  # a direct call with a1 killed the engine

    await reloads.sync()

    assert "a1" not in world.rendered()
    assert reloads.status()["generation"] == 3
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "engine_lost"}) == 1


async def test_during_an_on_change_reload_the_serving_engines_names_stay_servable(
    world: World,
) -> None:
    world.add_adapters("a1", "a2", "a3")
    reloads = await serving(world)
    await world.stage("a1")
    await compact(reloads)
    given = await world.stage("a2")
    reload = await hold_a_reload(world, reloads)

    assert reloads.status()["triton"]["reloading"] is True
    assert world.lora_name("a1") == "a1"
    assert world.lora_name("a2") == given
    fresh = await world.stage("a3")  # given in the generation that serves meanwhile
    assert fresh.startswith("_spare-g2-")
    world.control.gate.set()
    await reload
    assert world.lora_name("a2") == "a2"


async def test_an_unload_first_reload_makes_every_adapter_wait(world: World) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    reload = await hold_a_reload(world, reloads)

    message = raises(CatalogReloading, reloads.serving.naming_generation)
    assert "no engine serves until it is up" in message
    world.control.gate.set()
    await reload
    assert world.control.calls[-2:] == ["unload vllm_model", "load vllm_model"]
    assert world.lora_name("a1") == "a1"


async def test_a_failed_reload_keeps_the_old_generation_and_is_retried(world: World) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    name = await world.stage("a1")
    world.control.failures = 1
    await compact(reloads)

    triton = reloads.status()["triton"]
    assert (triton["loaded_generation"], triton["pending"]) == (1, 2)
    assert "out of memory" in triton["last_reload_error"]
    assert "unload-first needs one" in triton["last_reload_error"]
    assert world.lora_name("a1") == name  # the old engine and its names serve on
    assert world.metric("lora_sidecar_triton_reloads_total", {"outcome": "error"}) == 1
    await reloads.sync()  # too soon: failures wait at least RETRY_AFTER_FAILURE_S
    assert world.control.loads() == 2
    world.clock.now_s += RETRY_AFTER_FAILURE_S
    await reloads.sync()
    assert world.control.loads() == 3
    assert world.lora_name("a1") == "a1"


async def test_a_restarted_sidecar_takes_over_a_changed_catalog_with_a_plain_load(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    reload = await hold_a_reload(world, reloads)
    reload.cancel()  # the sidecar dies with generation 2 rendered, not confirmed
    await asyncio.gather(reload, return_exceptions=True)
    world.control.gate = None
    world.control.ready = True
    world.control.calls.clear()

    restarted = await world.start(triton_reload=TritonReload.UNLOAD_FIRST)
    await restarted.sync()

    # A plain load (a no-op for Triton if it already serves this file), never an unload.
    assert world.control.calls == ["load vllm_model"]
    assert restarted.status()["triton"]["loaded_generation"] == 2


async def test_without_reloads_names_come_from_the_rendered_generation(world: World) -> None:
    world.add_adapter("a1")
    reloads = await world.start(triton_reload=TritonReload.NEVER)
    await reloads.sync()

    name = await world.stage("a1")

    assert name.startswith("_spare-g1-")
    assert world.control.calls == []
    assert "loaded_generation" not in reloads.status()["triton"]
    assert reloads.status()["triton"]["reload"] == "never"


async def test_the_sidecar_is_ready_once_a_generation_is_rendered(world: World) -> None:
    reloads = await world.start()
    assert reloads.problem() is None
    assert reloads.status()["generation"] == 1
    assert EngineState.STARTING.value == reloads.status()["triton"]["state"]


async def test_compact_needs_the_token_and_renders_a_generation_listing_what_is_on_disk(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.support.api import call

    local_registry_adapter(tmp_path, "a1")
    sidecar = await api_sidecar(tmp_path, start_sidecar, api_token="s3cret-token")
    await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})

    refused, body = await call(http, "POST", f"{sidecar.url}/catalog/compact", {})
    accepted, plan = await call(http, "POST", f"{sidecar.url}/catalog/compact", None,
                                {"Authorization": "Bearer s3cret-token"})
    wrong, _ = await call(http, "POST", f"{sidecar.url}/catalog/compact", {"force": True},
                          {"Authorization": "Bearer s3cret-token"})
    await sidecar.reloads.sync()
    _, stage = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})

    assert (refused, body["error"]) == (401, "unauthorized")
    assert accepted == 202 and plan["planned"]["reason"] == "requested"
    assert wrong == 400  # unknown field
    assert stage["lora_name"] == "a1"  # listed by its own name now
    assert sidecar.reloads.status()["generation"] == 2
