"""naming.py: POST /stage's use case, the name a request must send vLLM, the lease given back
when none can be given, a stage held while no engine serves a catalog that names the adapter,
and the engine's refusal judged; GET /adapters' word on a registry that changed under an id."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from sidecar.catalog.engine_refusal import EngineRefusal
from sidecar.catalog.name_state import Version
from sidecar.config import TritonReload
from sidecar.core.errors import (
    CatalogPending,
    EngineFailed,
    EngineUnavailable,
)
from sidecar.process.examples import write_adapter
from tests.support.catalog_world import (
    World,
    api_sidecar,
    hold_a_reload,
    serving,
)
from tests.support.settings import local_registry_adapter


async def test_a_stage_that_cannot_be_named_yet_gives_its_lease_back(world: World) -> None:
    world.add_adapter("a1")
    await serving(world, base_model_config=None)  # spares off: a1 waits for a compaction
    assert world.naming is not None and world.store is not None

    with pytest.raises(CatalogPending):
        await world.naming.stage("a1", timeout_s=30, lease=True)

    assert world.store.get("a1") is not None  # staged, and free to be evicted again
    assert world.store.lease_count("a1") == 0


async def test_a_hit_that_cannot_be_named_yet_gives_its_lease_back_too(world: World) -> None:
    world.add_adapter("a1")
    await serving(world, base_model_config=None)
    assert world.naming is not None and world.store is not None
    with pytest.raises(CatalogPending):
        await world.naming.stage("a1", timeout_s=30, lease=True)  # the miss that stages it

    with pytest.raises(CatalogPending):
        await world.naming.stage("a1", timeout_s=30, lease=True)

    assert world.store.get("a1") is not None and world.store.lease_count("a1") == 0


async def test_stage_answers_the_name_to_send_and_catalog_shows_it(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.support.api import call

    local_registry_adapter(tmp_path, "a1")
    sidecar = await api_sidecar(tmp_path, start_sidecar)

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})
    _, again = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})
    _, shown = await call(http, "GET", f"{sidecar.url}/catalog")

    assert status == 200, body
    assert body["lora_name"].startswith("_spare-g1-") and again["lora_name"] == body["lora_name"]
    assert body["adapter_id"] == "a1"
    assert shown["spares"]["bound"] == {
        body["lora_name"]: str(Version("a1", body["content_digest"]))}
    assert shown["spares"]["left"] == 3 and shown["spares"]["enabled"] is True
    assert shown["generation"] == 1 and shown["next_compaction"] is None
    assert shown["names"]["states"]["bound"] == 1 and shown["names"]["changes"]["bound"] == 1
    assert shown["disk"]["catalog_bytes"] > shown["disk"]["noop_bytes"] > 0
    assert shown["disk"]["adapter_bytes"] == body["size_bytes"]
    assert shown["disk"]["max_bytes"] == sidecar.settings.max_bytes
    assert "on disk" in shown["rule"]
    metrics = (await (await http.get(f"{sidecar.url}/metrics")).text())
    assert "lora_sidecar_catalog_bindings_total 1.0" in metrics
    assert "lora_sidecar_catalog_spares_left 3.0" in metrics
    assert 'lora_sidecar_catalog_names{state="unbound"} 3.0' in metrics
    assert 'lora_sidecar_catalog_name_changes_total{change="bound"} 1.0' in metrics


async def test_get_adapters_says_when_the_registry_changed_under_an_id(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.support.api import call

    local_registry_adapter(tmp_path, "a1", seed=1)
    sidecar = await api_sidecar(tmp_path, start_sidecar)
    _, first = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1",
                                                                 "lease": False})
    await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "a1"})
    shutil.rmtree(tmp_path / "registry" / "a1")
    write_adapter(tmp_path / "registry" / "a1", seed=2)

    _, second = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1",
                                                                  "lease": False})
    _, shown = await call(http, "GET", f"{sidecar.url}/adapters/a1")

    assert second["lora_name"] != first["lora_name"]
    assert second["content_digest"] != first["content_digest"]
    assert shown["registry_changed"]["digest_before"] == first["content_digest"]
    assert shown["registry_changed"]["digest_now"] == second["content_digest"]


async def test_a_stage_arriving_during_an_unload_first_reload_is_held_and_answered(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    reload = await hold_a_reload(world, reloads)
    assert world.naming is not None

    held = asyncio.create_task(world.naming.stage("a1", timeout_s=30, lease=True, hold_s=30))
    await asyncio.sleep(0)  # the stage meets the reload: it waits, no error
    assert not held.done()
    world.control.gate.set()
    await reload
    named = await held

    assert named.lora_name == "a1"
    assert named.staged.lease is not None


async def test_held_past_hold_s_the_stage_fails_and_gives_its_lease_back(world: World) -> None:
    world.add_adapter("a1")
    await serving(world, spare_names=0)
    world.add_adapter("a2")
    assert world.naming is not None and world.store is not None

    with pytest.raises(CatalogPending, match="does not list it"):
        await world.naming.stage("a2", timeout_s=30, lease=True, hold_s=0.05)

    assert world.store.snapshot().active_leases == 0


async def test_an_engine_refusal_is_judged_and_a_name_answered_once_what_serves_changed(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    name = await world.stage("a1")
    assert world.naming is not None
    refusal = EngineRefusal(name, "Request for unknown model: 'vllm_model' is not found",
                            "NOT_FOUND")

    with pytest.raises(EngineUnavailable, match="vllm_model is not available"):
        await world.naming.stage("a1", timeout_s=30, lease=False, refused=refusal)
    held = asyncio.create_task(world.naming.stage("a1", timeout_s=30, lease=False, hold_s=30,
                                                  refused=refusal))
    await asyncio.sleep(0)  # one turn of the loop: the stage is waiting, not answered
    assert not held.done()
    world.control.ready = False  # the engine went: the probe sees it, the sidecar loads it
    await reloads.sync()
    await reloads.sync()

    assert (await held).lora_name == name


async def test_an_engine_failing_on_the_request_itself_is_answered_before_staging(
    world: World,
) -> None:
    world.add_adapter("a1")
    await serving(world)
    assert world.naming is not None

    with pytest.raises(EngineFailed, match="failed on adapter a1: bad prompt"):
        await world.naming.stage("a1", timeout_s=30, lease=True,
                                 refused=EngineRefusal("a1", "bad prompt", "INTERNAL"))
