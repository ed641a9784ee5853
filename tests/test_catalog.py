"""The catalog: multi_lora.json rendered from a real local registry, and the reload policy,
with Triton's model control replaced by a recorder (the real Triton is in tests/triton/)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.catalog import RETRY_AFTER_FAILURE_S, Catalog, ReloadFailed
from sidecar.config import Settings, TritonReload
from sidecar.errors import CatalogPending, CatalogReloading
from sidecar.localsource import LocalSource
from sidecar.metrics import Metrics
from sidecar.transfer import TransferPolicy
from tests.conftest import local_registry_adapter, make_settings


@dataclass
class RecordingControl:
    """Triton's load/unload as calls recorded; `gate` holds a load open; `failures` fail loads."""

    calls: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0
    loaded: asyncio.Queue[None] = field(default_factory=asyncio.Queue)
    ready: bool = False  # what Triton answers to "is vllm_model ready?"

    async def load(self, model: str) -> None:
        self.calls.append(f"load {model}")
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise ReloadFailed("Triton refused to load vllm_model: out of memory")
        self.ready = True
        self.loaded.put_nowait(None)

    async def unload(self, model: str) -> None:
        self.calls.append(f"unload {model}")
        self.ready = False

    async def is_ready(self, model: str) -> bool:
        return self.ready

    async def close(self) -> None:
        self.calls.append("close")


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class World:
    tmp_path: Path
    metrics: Metrics
    control: RecordingControl
    clock: Clock
    made: list[Catalog] = field(default_factory=list)

    def add_adapter(self, adapter_id: str) -> None:
        local_registry_adapter(self.tmp_path, adapter_id, seed=len(adapter_id))

    def catalog(self, **overrides: Any) -> Catalog:
        values: dict[str, Any] = {"triton_cache_root": Path("/lora-cache"),
                                  "triton_url": "http://127.0.0.1:1",
                                  "triton_reload_min_interval_s": 0.0, **overrides}
        settings: Settings = make_settings(self.tmp_path, **values)
        settings.cache_root.mkdir(parents=True, exist_ok=True)
        policy = TransferPolicy(part_size_bytes=8 << 20, attempts=1, limiter=asyncio.Semaphore(1))
        source = LocalSource(Path(settings.registry), policy)
        catalog = Catalog(settings, source, self.metrics, control=self.control, clock=self.clock)
        self.made.append(catalog)
        return catalog

    def rendered(self) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.tmp_path / "cache" / "multi_lora.json").read_text())
        return data

    def reloads(self, outcome: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "lora_sidecar_triton_reloads_total", {"outcome": outcome})
        return value or 0.0


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    (tmp_path / "registry").mkdir()
    w = World(tmp_path, Metrics(CollectorRegistry(), process=False), RecordingControl(), Clock())
    yield w
    for catalog in w.made:
        await catalog.close()


def raises(error: type[Exception], check: Callable[[], None]) -> str:
    with pytest.raises(error) as caught:
        check()
    return str(caught.value)


async def test_catalog_maps_each_registry_id_to_tritons_absolute_path(world: World) -> None:
    world.add_adapter("sql-v1")
    world.add_adapter("support-v2")
    catalog = world.catalog()

    assert await catalog.sync() is True

    assert world.rendered() == {"sql-v1": "/lora-cache/adapters/sql-v1",
                                "support-v2": "/lora-cache/adapters/support-v2"}
    assert world.metrics.registry.get_sample_value("lora_sidecar_catalog_adapters") == 2
    status = catalog.status()
    assert status["generation"] == 1
    assert status["adapter_ids"] == ["sql-v1", "support-v2"]
    assert status["triton"]["loaded_generation"] == 1


async def test_without_a_triton_root_paths_are_the_absolute_cache_root(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(triton_cache_root=None, triton_url=None)

    await catalog.sync()

    path = world.rendered()["a1"]
    assert Path(path).is_absolute()
    assert path == str((world.tmp_path / "cache" / "adapters" / "a1").resolve())


async def test_an_unchanged_registry_leaves_the_file_and_triton_alone(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog()
    await catalog.sync()
    mtime_ns = (world.tmp_path / "cache" / "multi_lora.json").stat().st_mtime_ns

    await catalog.sync()

    assert (world.tmp_path / "cache" / "multi_lora.json").stat().st_mtime_ns == mtime_ns
    assert catalog.status()["generation"] == 1
    assert world.control.calls == ["load vllm_model"]


async def test_a_catalog_left_by_a_previous_run_is_not_rewritten(world: World) -> None:
    world.add_adapter("a1")
    await world.catalog().sync()
    path = world.tmp_path / "cache" / "multi_lora.json"
    mtime_ns = path.stat().st_mtime_ns
    half_written = path.with_name(".multi_lora.json.dead")  # a writer killed mid-write
    half_written.write_text("{")

    restarted = world.catalog()
    await restarted.sync()

    # Triton reloads a model only when a file in its folder changed: an identical catalog
    # must keep its mtime, and the start-up load is then a no-op for Triton.
    assert path.stat().st_mtime_ns == mtime_ns
    assert not half_written.exists()
    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    restarted.check_servable("a1")


async def test_a_new_adapter_renders_a_new_generation_and_reloads_triton(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog()
    await catalog.sync()
    world.add_adapter("a2")

    await catalog.sync()

    assert set(world.rendered()) == {"a1", "a2"}
    assert catalog.status()["generation"] == 2
    assert catalog.status()["triton"]["loaded_generation"] == 2
    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert world.reloads("ok") == 2
    catalog.check_servable("a2")


async def test_reloads_wait_for_the_minimum_interval(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(triton_reload_min_interval_s=60.0)
    await catalog.sync()
    world.add_adapter("a2")

    world.clock.now_s += 10
    await catalog.sync()

    assert world.control.calls == ["load vllm_model"]
    triton = catalog.status()["triton"]
    assert triton["pending"] == {"added": ["a2"], "removed": []}
    assert triton["next_reload_in_s"] == pytest.approx(50.0)
    catalog.check_servable("a1")
    message = raises(CatalogPending, lambda: catalog.check_servable("a2"))
    assert "generation 2" in message and "loaded generation 1" in message
    assert "--triton-reload-min-interval" in message

    world.clock.now_s += 50
    await catalog.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert catalog.status()["triton"]["pending"] is None
    catalog.check_servable("a2")


async def test_old_adapters_stay_servable_while_triton_loads_the_new_catalog(
    world: World,
) -> None:
    world.add_adapter("a1")
    catalog = world.catalog()
    await catalog.sync()
    world.add_adapter("a2")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()

    reload = asyncio.create_task(catalog.sync())
    await world.control.entered.wait()

    catalog.check_servable("a1")
    assert catalog.status()["triton"]["reloading"] is True
    message = raises(CatalogReloading, lambda: catalog.check_servable("a2"))
    assert "reloading vllm_model" in message
    world.control.gate.set()
    await reload
    catalog.check_servable("a2")


async def test_unload_first_reload_makes_every_adapter_wait(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(triton_reload=TritonReload.UNLOAD_FIRST)
    await catalog.sync()
    world.add_adapter("a2")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()

    reload = asyncio.create_task(catalog.sync())
    await world.control.entered.wait()

    raises(CatalogReloading, lambda: catalog.check_servable("a1"))
    world.control.gate.set()
    await reload
    assert world.control.calls[-2:] == ["unload vllm_model", "load vllm_model"]
    catalog.check_servable("a1")


async def test_a_failed_reload_keeps_the_old_generation_and_is_retried(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog()
    await catalog.sync()
    world.add_adapter("a2")
    world.control.failures = 1

    await catalog.sync()

    triton = catalog.status()["triton"]
    assert triton["loaded_generation"] == 1
    assert "out of memory" in triton["last_reload_error"]
    assert "unload-first needs one" in triton["last_reload_error"]
    assert world.reloads("error") == 1
    catalog.check_servable("a1")
    assert "last reload failed" in raises(CatalogPending, lambda: catalog.check_servable("a2"))

    await catalog.sync()  # too soon: failures wait at least RETRY_AFTER_FAILURE_S
    assert len(world.control.calls) == 2
    world.clock.now_s += RETRY_AFTER_FAILURE_S
    await catalog.sync()

    assert len(world.control.calls) == 3
    assert catalog.status()["triton"]["last_reload_error"] is None
    catalog.check_servable("a2")


@pytest.mark.parametrize("overrides", [
    {"triton_url": None},
    {"triton_reload": TritonReload.NEVER},
])
async def test_without_reloads_the_sidecar_never_refuses(
    world: World, overrides: dict[str, Any]
) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(**overrides)
    await catalog.sync()

    catalog.check_servable("a1")
    catalog.check_servable("not-listed")
    assert world.control.calls == []
    assert "loaded_generation" not in catalog.status()["triton"]
    assert set(world.rendered()) == {"a1"}


async def test_a_registry_that_cannot_be_listed_keeps_the_last_catalog(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog()
    await catalog.sync()
    shutil.rmtree(world.tmp_path / "registry")

    assert await catalog.sync() is False

    assert world.rendered() == {"a1": "/lora-cache/adapters/a1"}
    assert "does not exist" in catalog.status()["list_error"]
    catalog.check_servable("a1")


async def test_an_adapter_not_listed_yet_asks_for_an_early_listing(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(catalog_refresh_s=3600.0)
    task = asyncio.create_task(catalog.run())
    try:
        await asyncio.wait_for(world.control.loaded.get(), timeout=30)
        world.add_adapter("a2")
        world.clock.now_s += 5  # past the early-listing floor

        message = raises(CatalogPending, lambda: catalog.check_servable("a2"))

        assert "not in the catalog yet" in message
        await asyncio.wait_for(world.control.loaded.get(), timeout=30)
        assert catalog.status()["triton"]["loaded_generation"] == 2
        catalog.check_servable("a2")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_sidecar_is_not_ready_until_a_catalog_is_rendered(world: World) -> None:
    catalog = world.catalog()
    shutil.rmtree(world.tmp_path / "registry")

    await catalog.sync()

    problem = catalog.problem()
    assert problem is not None and "multi_lora.json not rendered yet" in problem
    assert "does not exist" in problem
    world.add_adapter("a1")
    await catalog.sync()
    assert catalog.problem() is None


async def test_a_restarted_sidecar_adopts_the_catalog_triton_already_serves(world: World) -> None:
    world.add_adapter("a1")
    await world.catalog(triton_reload=TritonReload.UNLOAD_FIRST).sync()
    world.control.calls.clear()
    assert world.control.ready  # Triton keeps serving while the sidecar restarts

    restarted = world.catalog(triton_reload=TritonReload.UNLOAD_FIRST)
    await restarted.sync()

    # No unload: restarting the engine would cost minutes of GPU downtime for nothing.
    assert world.control.calls == ["load vllm_model"]
    assert restarted.status()["triton"]["loaded_generation"] == 1
    restarted.check_servable("a1")


async def test_a_changed_catalog_at_start_is_reloaded_in_the_configured_mode(
    world: World,
) -> None:
    world.add_adapter("a1")
    await world.catalog(triton_reload=TritonReload.UNLOAD_FIRST).sync()
    world.add_adapter("a2")  # arrived while the sidecar was down
    world.control.calls.clear()
    world.control.failures = 1  # the in-place reload needs a second engine: out of memory

    restarted = world.catalog(triton_reload=TritonReload.UNLOAD_FIRST)
    await restarted.sync()

    assert world.control.calls == ["load vllm_model", "unload vllm_model", "load vllm_model"]
    restarted.check_servable("a2")


async def test_a_triton_that_lost_the_vllm_model_gets_it_loaded_again(world: World) -> None:
    world.add_adapter("a1")
    catalog = world.catalog(triton_reload_min_interval_s=3600.0)
    await catalog.sync()
    await catalog.sync()
    assert world.control.calls == ["load vllm_model"]

    world.control.ready = False  # Triton restarted without loading it
    await catalog.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert catalog.status()["triton"]["loaded_generation"] == 1


async def test_a_triton_started_after_the_sidecar_is_taken_over_without_a_second_load(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.control.failures = 1  # Triton is not up yet when the sidecar first syncs
    catalog = world.catalog(triton_reload=TritonReload.UNLOAD_FIRST)
    await catalog.sync()
    assert catalog.status()["triton"]["loaded_generation"] is None

    world.control.ready = True  # Triton started and loaded vllm_model with our catalog
    world.control.calls.clear()
    world.clock.now_s += RETRY_AFTER_FAILURE_S
    await catalog.sync()

    assert world.control.calls == ["load vllm_model"]  # a no-op load, no unload
    assert catalog.status()["triton"]["loaded_generation"] == 1
