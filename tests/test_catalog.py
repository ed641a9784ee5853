"""The catalog's logic: generations rendered from what is on disk, spare names bound without a
reload, the journal across restarts, compaction, and the reload decisions, against a real store
and local registry on the real filesystem, with Triton's model control replaced by a recorder.
The same against a real Triton is in tests/triton/."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.stager import Stager
from sidecar.cache.store import AdapterStore
from sidecar.catalog.catalog import RETRY_AFTER_FAILURE_S, Catalog
from sidecar.catalog.engine_state import EngineState, Probe
from sidecar.catalog.generations import read_journal
from sidecar.config import CompactionWindow, Settings, TritonReload
from sidecar.errors import CatalogPending, CatalogReloading
from sidecar.metrics import Metrics
from sidecar.registry.local import LocalSource
from sidecar.registry.transfer import TransferPolicy
from sidecar.validation.shapes import TINY_LLAMA
from sidecar.validation.validate import Rules, validate_adapter
from tests.conftest import local_registry_adapter, make_settings

WEIGHTS = "adapter_model.safetensors"


@dataclass
class RecordingControl:
    """Triton's model control as calls recorded. `ready`/`reachable` drive the probe; `gate`
    holds a load open; `failures` fail that many loads."""

    calls: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0
    ready: bool = False
    reachable: bool = True
    probe_answers: list[Probe] = field(default_factory=list)  # served first, one per probe

    async def load(self, model: str) -> None:
        from sidecar.catalog.triton_control import ReloadFailed

        self.calls.append(f"load {model}")
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if not self.reachable:
            raise ReloadFailed("Triton did not answer", reached=False)
        if self.failures:
            self.failures -= 1
            raise ReloadFailed("Triton refused to load vllm_model: out of memory", reached=True)
        self.ready = True

    async def unload(self, model: str) -> None:
        self.calls.append(f"unload {model}")
        self.ready = False

    async def probe(self, model: str) -> tuple[Probe, str]:
        if self.probe_answers:
            return self.probe_answers.pop(0), "scripted"
        if not self.reachable:
            return Probe.FAILED, "connection refused"
        return (Probe.READY, "ready") if self.ready else (Probe.NOT_LOADED, "UNAVAILABLE")

    async def close(self) -> None:
        pass

    def loads(self) -> int:
        return sum(1 for c in self.calls if c.startswith(("load", "unload")))


class Clock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@dataclass
class World:
    tmp_path: Path
    metrics: Metrics
    control: RecordingControl
    clock: Clock
    wall: Clock
    store: AdapterStore | None = None
    stager: Stager | None = None
    catalog: Catalog | None = None
    settings: Settings | None = None

    def add_adapter(self, adapter_id: str, **kwargs: Any) -> bytes:
        folder = local_registry_adapter(self.tmp_path, adapter_id,
                                        seed=kwargs.pop("seed", len(adapter_id)), **kwargs)
        return (folder / WEIGHTS).read_bytes()

    async def start(self, **overrides: Any) -> Catalog:
        """A fresh store, stager and catalog on the world's cache (a sidecar (re)start)."""
        base = self.tmp_path / "base.json"
        base.write_text(json.dumps(TINY_LLAMA.to_config()))
        values: dict[str, Any] = {
            "triton_cache_root": Path("/lora-cache"), "triton_url": "http://127.0.0.1:1",
            "triton_reload_min_interval_s": 0.0, "base_model_config": base,
            "spare_names": 4, "lease_ttl_s": 600.0, **overrides,
        }
        settings = make_settings(self.tmp_path, **values)
        self.settings = settings
        rules = Rules.from_settings(settings)
        store = AdapterStore(settings.cache_root, max_bytes=settings.max_bytes,
                             max_adapters=settings.max_adapters, min_free_bytes=0,
                             lease_ttl_s=600, metrics=self.metrics)
        store.prepare()
        store.install([store.recover_folder(folder, lambda folder, record: [])
                       for folder in store.published_folders()])
        policy = TransferPolicy(part_size_bytes=8 << 20, attempts=1, limiter=asyncio.Semaphore(4))
        self.stager = Stager(store, LocalSource(Path(settings.registry), policy), rules,
                             self.metrics, refusal_ttl_s=0)
        catalog = Catalog(settings, store, rules, self.metrics, control=self.control,
                          clock=self.clock, wall=self.wall)
        store.before_evict = catalog.names.before_evict
        store.after_forget = catalog.names.after_forget
        await catalog.start()
        self.store, self.catalog = store, catalog
        return catalog

    async def stage(self, adapter_id: str) -> str:
        """What POST /stage does: stage, then the name vLLM must be sent."""
        assert self.stager is not None and self.catalog is not None
        await self.stager.stage(adapter_id, timeout_s=30, lease=False)
        return self.catalog.lora_name(adapter_id) or await self.catalog.bind(adapter_id)

    def rendered(self) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.tmp_path / "cache" / "multi_lora.json")
                                          .read_text())
        return data

    def local(self, triton_path: str) -> Path:
        """A path of the catalog, as the sidecar sees it."""
        return self.tmp_path / "cache" / Path(triton_path).relative_to("/lora-cache")

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    (tmp_path / "registry").mkdir()
    yield World(tmp_path, Metrics(CollectorRegistry(), process=False), RecordingControl(),
                Clock(), Clock(1_800_000_000.0))


def raises(error: type[Exception], check: Callable[[], object]) -> str:
    with pytest.raises(error) as caught:
        check()
    return str(caught.value)


async def serving(world: World, **overrides: Any) -> Catalog:
    """A catalog whose first generation Triton has loaded."""
    catalog = await world.start(**overrides)
    await catalog.sync()
    assert catalog.status()["triton"]["state"] == "serving", catalog.status()
    return catalog


# ---- what a generation lists ------------------------------------------------------------------


async def test_a_generation_lists_the_adapters_on_disk_and_spare_names_at_no_op_adapters(
    world: World,
) -> None:
    world.add_adapter("sql-v1")
    world.add_adapter("support-v2")
    world.add_adapter("never-staged-v1")
    await serving(world)
    await world.stage("sql-v1")
    await world.stage("support-v2")
    world.catalog.request_compaction()  # type: ignore[union-attr]

    await world.catalog.sync()  # type: ignore[union-attr]

    rendered = world.rendered()
    spares = sorted(name for name in rendered if name.startswith("_spare-"))
    assert sorted(set(rendered) - set(spares)) == ["sql-v1", "support-v2"]
    assert rendered["sql-v1"] == "/lora-cache/catalog/g2/names/sql-v1"
    assert os.readlink(world.local(rendered["sql-v1"])) == "../../../adapters/sql-v1"
    assert spares == [f"_spare-g2-00{n}" for n in range(1, 5)]
    rules = Rules(shapes=TINY_LLAMA)
    for spare in spares:
        assert rendered[spare] == f"/lora-cache/catalog/g2/names/{spare}"
        folder = world.local(rendered[spare])
        assert os.readlink(folder) == f"../noop/{spare}"  # relative: resolves in Triton's mount
        assert validate_adapter(folder.resolve(), rules) == []
    assert world.metric("lora_sidecar_catalog_adapters") == 2
    assert world.metric("lora_sidecar_catalog_generation") == 2


async def test_a_refused_adapter_is_never_listed_nor_bound(world: World) -> None:
    world.add_adapter("too-wide-v1", rank=32)  # max_lora_rank is 16
    catalog = await serving(world)

    with pytest.raises(Exception, match="refused by validation"):
        await world.stage("too-wide-v1")
    catalog.request_compaction()
    await catalog.sync()

    assert not [name for name in world.rendered() if not name.startswith("_spare-")]
    assert catalog.status()["spares"]["bound"] == {}


async def test_without_a_base_model_config_spares_are_off_and_status_says_why(
    world: World,
) -> None:
    catalog = await world.start(base_model_config=None)
    await catalog.sync()

    spares = catalog.status()["spares"]
    assert spares["enabled"] is False
    assert "--base-model-config" in spares["off_because"]
    assert world.rendered() == {}


@pytest.mark.parametrize("triton_url", ["http://127.0.0.1:1", None], ids=["triton", "no triton"])
async def test_spares_off_is_a_warning_only_where_it_costs_reloads(
    world: World, caplog: pytest.LogCaptureFixture, triton_url: str | None
) -> None:
    with caplog.at_level("INFO", logger="sidecar.catalog.catalog"):
        await world.start(base_model_config=None, triton_url=triton_url)

    said = [r for r in caplog.records if "spare names are off" in r.getMessage()]
    assert len(said) == 1
    if triton_url is None:  # `make run`: nothing is reloaded, so nothing to warn a newcomer of
        assert said[0].levelname == "INFO" and "no reload" in said[0].getMessage()
    else:
        assert said[0].levelname == "WARNING" and "costs a reload" in said[0].getMessage()


# ---- binding spare names ----------------------------------------------------------------------


async def test_a_new_adapter_is_bound_to_a_spare_without_any_triton_call(world: World) -> None:
    weights = world.add_adapter("fresh-v1")
    catalog = await serving(world)
    calls = list(world.control.calls)

    name = await world.stage("fresh-v1")

    assert name.startswith("_spare-g1-")
    assert world.control.calls == calls
    link = world.local(world.rendered()[name])
    assert os.readlink(link) == "../../../adapters/fresh-v1"
    assert (link / WEIGHTS).read_bytes() == weights
    assert read_journal(world.tmp_path / "cache").generations[1].bound == {name: "fresh-v1"}
    status = catalog.status()
    assert status["spares"]["bound"] == {name: "fresh-v1"}
    assert status["spares"]["left"] == 3
    assert world.metric("lora_sidecar_catalog_bindings_total") == 1
    assert world.metric("lora_sidecar_catalog_spares_left") == 3


async def test_a_name_is_bound_once_and_each_adapter_gets_its_own(world: World) -> None:
    for adapter_id in ("a1", "a2"):
        world.add_adapter(adapter_id)
    await serving(world)

    first = await world.stage("a1")
    again = await world.stage("a1")
    other = await world.stage("a2")

    assert first == again
    assert other != first
    assert os.readlink(world.local(world.rendered()[other])) == "../../../adapters/a2"


async def test_concurrent_first_stages_of_one_adapter_share_one_binding(world: World) -> None:
    world.add_adapter("popular-v1")
    catalog = await serving(world)

    names = await asyncio.gather(*(world.stage("popular-v1") for _ in range(8)))

    assert len(set(names)) == 1
    assert len(catalog.status()["spares"]["bound"]) == 1


async def test_bindings_survive_a_sidecar_restart_without_a_load(world: World) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    await serving(world)
    name = await world.stage("a1")
    loads = world.control.loads()
    before = (world.tmp_path / "cache" / "multi_lora.json").stat()

    restarted = await world.start()  # the same cache, Triton still serving
    await restarted.sync()

    # Untouched: Triton reloads a model whose catalog file's ctime moved.
    after = (world.tmp_path / "cache" / "multi_lora.json").stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)

    assert restarted.status()["triton"]["state"] == "serving"
    assert world.control.loads() == loads  # the catalog file is the one Triton loaded
    assert await world.stage("a1") == name
    assert await world.stage("a2") not in (name, "a2")


async def test_an_evicted_bound_adapter_keeps_its_bytes_under_its_spare_name(
    world: World,
) -> None:
    weights = world.add_adapter("a1")
    world.add_adapter("a2")
    await serving(world, max_adapters=1)
    name = await world.stage("a1")

    await world.stage("a2")  # a1 goes: the budget is one adapter

    assert not (world.tmp_path / "cache" / "adapters" / "a1").exists()
    link = world.local(world.rendered()[name])
    assert os.readlink(link) == f"../kept/{name}"
    assert (link / WEIGHTS).read_bytes() == weights
    assert await world.stage("a1") == name  # re-staged: the same name, the same bytes
    # The published folder owns its bytes again once the trash is emptied: never a hard link
    # between what the engine may read and what the next stage publishes.
    assert (world.tmp_path / "cache" / "adapters" / "a1" / WEIGHTS).stat().st_nlink <= 2


async def test_a_bound_adapter_removed_behind_the_sidecars_back_never_leaves_a_dangling_name(
    world: World,
) -> None:
    world.add_adapter("a1")
    catalog = await serving(world)
    name = await world.stage("a1")

    shutil.rmtree(world.tmp_path / "cache" / "adapters" / "a1")
    world.store.forget("a1")  # type: ignore[union-attr]  # what the watcher does

    assert os.readlink(world.local(world.rendered()[name])) == f"../noop/{name}"
    assert name in catalog.status()["spares"]["burnt"]
    assert await world.stage("a1") not in (name, "a1")  # a fresh spare


async def test_crashes_between_journal_and_link_never_hand_out_a_half_bound_name(
    world: World,
) -> None:
    world.add_adapter("a1")
    catalog = await serving(world)
    spares = list(catalog.status()["spares"]["bound"]) or [
        n for n in world.rendered() if n.startswith("_spare-")]
    journaled_only, linked_only = spares[0], spares[1]
    # A crash after the journal was written, before the link: and one after a link was
    # replaced, before the journal (neither name was handed out).
    journal_path = world.tmp_path / "cache" / "catalog" / "journal.json"
    journal = json.loads(journal_path.read_text())
    journal["generations"]["1"]["bound"][journaled_only] = "a1"
    journal_path.write_text(json.dumps(journal))
    folder = world.tmp_path / "cache" / "catalog" / "g1" / "names"
    (folder / linked_only).unlink()
    (folder / linked_only).symlink_to("../../../adapters/a1")

    restarted = await world.start()
    await restarted.sync()

    burnt = restarted.status()["spares"]["burnt"]
    assert sorted(burnt) == sorted([journaled_only, linked_only])
    for spare in burnt:
        assert os.readlink(folder / spare) == f"../noop/{spare}"
    assert await world.stage("a1") not in (journaled_only, linked_only)


async def test_a_catalog_file_that_is_not_the_journals_starts_a_new_generation(
    world: World,
) -> None:
    world.add_adapter("a1")
    await serving(world)
    await world.stage("a1")
    (world.tmp_path / "cache" / "multi_lora.json").write_text("{}\n")  # edited by hand

    restarted = await world.start()

    assert restarted.status()["generation"] == 2
    assert sorted(world.rendered()) == ["_spare-g2-001", "_spare-g2-002", "_spare-g2-003",
                                        "_spare-g2-004", "a1"]


# ---- compaction -------------------------------------------------------------------------------


async def test_running_low_on_spares_compacts_once_listing_every_adapter_by_its_own_name(
    world: World,
) -> None:
    weights = {a: world.add_adapter(a) for a in ("a1", "a2", "a3")}
    catalog = await serving(world, compact_below=1, triton_reload_min_interval_s=60.0)
    world.clock.now_s += 120  # the first load is long past

    names = [await world.stage(a) for a in ("a1", "a2", "a3")]  # 1 spare left: low
    assert all(n.startswith("_spare-g1-") for n in names)
    assert catalog.status()["next_compaction"]["reason"] == "spares_low"
    await catalog.sync()

    assert catalog.status()["generation"] == 2
    assert catalog.status()["triton"]["loaded_generation"] == 2
    assert [await world.stage(a) for a in ("a1", "a2", "a3")] == ["a1", "a2", "a3"]
    assert sorted(weights) == sorted(n for n in world.rendered() if not n.startswith("_"))
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "spares_low"}) == 1
    assert catalog.status()["spares"]["left"] == 4
    # The old generation's folder stays while the old engine may finish its requests.
    assert (world.tmp_path / "cache" / "catalog" / "g1").is_dir()
    world.wall.now_s += 601
    await catalog.sync()
    assert not (world.tmp_path / "cache" / "catalog" / "g1").exists()
    assert list(read_journal(world.tmp_path / "cache").generations) == [2]


async def test_compactions_wait_for_the_minimum_interval_between_reloads(world: World) -> None:
    world.add_adapter("a1")
    catalog = await serving(world, triton_reload_min_interval_s=60.0)
    await world.stage("a1")
    world.clock.now_s += 10

    catalog.request_compaction()
    await catalog.sync()

    assert world.control.loads() == 1
    plan = catalog.status()["next_compaction"]
    assert plan["reason"] == "requested" and plan["in_s"] == pytest.approx(50.0)
    assert plan["waits_for"] == "--triton-reload-min-interval"
    world.clock.now_s += 50
    await catalog.sync()
    assert world.control.loads() == 2
    assert catalog.status()["next_compaction"] is None


async def test_with_no_spare_left_the_adapter_waits_for_the_compaction_it_plans(
    world: World,
) -> None:
    for n in range(5):
        world.add_adapter(f"a{n}")
    catalog = await serving(world, compact_below=0, spare_names=1)
    await world.stage("a0")  # the last spare: a compaction is planned before anyone waits
    assert catalog.status()["next_compaction"]["reason"] == "spares_low"

    with pytest.raises(CatalogPending) as caught:
        await world.stage("a1")
    message = str(caught.value)

    assert "no spare name is left" in message and "loaded now" in message
    assert catalog.status()["next_compaction"]["reason"] == "exhausted"
    await catalog.sync()
    assert await world.stage("a1") == "a1"
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "exhausted"}) == 1


async def test_with_spare_names_zero_each_new_adapter_costs_a_reload(world: World) -> None:
    world.add_adapter("a1")
    catalog = await serving(world, spare_names=0)

    message = str(await asyncio.gather(world.stage("a1"), return_exceptions=True))
    assert "spare names are off (--spare-names is 0)" in message
    await catalog.sync()

    assert await world.stage("a1") == "a1"
    assert world.control.loads() == 2
    assert world.rendered() == {"a1": "/lora-cache/catalog/g2/names/a1"}


async def test_a_restart_with_spare_names_zero_binds_no_spare_left_from_before(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    await serving(world)
    name = await world.stage("a1")

    restarted = await world.start(spare_names=0)
    await restarted.sync()

    assert await world.stage("a1") == name  # what was bound stays served
    with pytest.raises(CatalogPending, match="spare names are off"):
        await world.stage("a2")
    await restarted.sync()
    assert await world.stage("a2") == "a2"
    assert [n for n in world.rendered() if n.startswith("_spare-")] == []


async def test_low_spares_wait_for_the_quiet_window_but_an_empty_catalog_does_not(
    world: World,
) -> None:
    for n in range(5):
        world.add_adapter(f"a{n}")
    window = CompactionWindow(2 * 60, 4 * 60)  # 02:00-04:00 UTC
    world.wall.now_s = 1_800_000_000.0 - 1_800_000_000.0 % 86400 + 12 * 3600  # noon UTC
    catalog = await serving(world, compact_below=2, compaction_window=window)
    for n in range(2):
        await world.stage(f"a{n}")

    plan = catalog.status()["next_compaction"]
    assert plan["reason"] == "spares_low" and plan["waits_for"] == "the quiet window"
    assert plan["in_s"] == pytest.approx(14 * 3600)
    for n in range(2, 4):
        await world.stage(f"a{n}")
    with pytest.raises(CatalogPending):
        await world.stage("a4")  # none left: it cannot wait for the night
    await catalog.sync()
    assert catalog.status()["generation"] == 2


async def test_the_quiet_window_compacts_what_changed_since_the_last_generation(
    world: World,
) -> None:
    world.add_adapter("a1")
    window = CompactionWindow(2 * 60, 4 * 60)
    day = 1_800_000_000.0 - 1_800_000_000.0 % 86400
    world.wall.now_s = day + 1 * 3600
    catalog = await serving(world, compaction_window=window)
    await world.stage("a1")
    await catalog.sync()
    assert catalog.status()["generation"] == 1

    world.wall.now_s = day + 2 * 3600 + 60
    await catalog.sync()

    assert catalog.status()["generation"] == 2
    assert await world.stage("a1") == "a1"
    await catalog.sync()
    assert catalog.status()["generation"] == 2  # nothing left to tidy in this window


# ---- reloads: the state machine in use ----------------------------------------------------------


async def test_triton_unreachable_at_start_is_loaded_at_once_when_it_answers(
    world: World,
) -> None:
    world.control.reachable = False
    catalog = await world.start(triton_reload_min_interval_s=3600.0)
    await catalog.sync()
    assert catalog.status()["triton"]["state"] == "unreachable"
    assert "does not answer" in raises(CatalogPending, lambda: catalog.lora_name("a1"))

    world.control.reachable = True
    await catalog.sync()

    assert catalog.status()["triton"]["state"] == "serving"
    assert world.control.calls == ["load vllm_model"]


async def test_a_load_that_could_not_reach_triton_costs_no_minimum_interval(
    world: World,
) -> None:
    catalog = await world.start(triton_reload_min_interval_s=3600.0)
    world.control.reachable = True
    world.control.probe_answers = [Probe.NOT_LOADED]
    world.control.reachable = False  # gone between the probe and the load
    await catalog.sync()
    assert world.control.calls == ["load vllm_model"]
    assert catalog.status()["triton"]["state"] == "unreachable"

    world.control.reachable = True
    await catalog.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert catalog.status()["triton"]["state"] == "serving"


async def test_one_failed_probe_changes_nothing(world: World) -> None:
    world.add_adapter("a1")
    catalog = await serving(world)
    name = await world.stage("a1")
    loads = world.control.loads()
    world.control.probe_answers = [Probe.FAILED]

    await catalog.sync()

    assert catalog.status()["triton"]["state"] == "suspect"
    assert catalog.lora_name("a1") == name
    await catalog.sync()
    assert catalog.status()["triton"]["state"] == "serving"
    assert world.control.loads() == loads


async def test_triton_saying_the_model_is_gone_reloads_at_once(world: World) -> None:
    catalog = await serving(world, triton_reload_min_interval_s=3600.0)
    world.control.ready = False  # unloaded: Triton restarted, or the health check fired

    await catalog.sync()

    assert world.control.calls == ["load vllm_model", "load vllm_model"]
    assert catalog.status()["triton"]["state"] == "serving"


async def test_an_evicted_adapter_s_own_name_answers_like_the_base_model_and_is_retired(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    catalog = await serving(world, max_adapters=1)
    await world.stage("a1")
    catalog.request_compaction()
    await catalog.sync()
    assert await world.stage("a1") == "a1"
    link = world.local(world.rendered()["a1"])

    await world.stage("a2")  # evicts a1, listed by its own name

    assert os.readlink(link) == "../noop/_retired"
    assert validate_adapter(link.resolve(), Rules(shapes=TINY_LLAMA)) == []
    assert catalog.status()["retired"] == ["a1"]
    # The own name may hold the no-op in the engine now: the adapter comes back under a spare.
    assert (await world.stage("a1")).startswith("_spare-g2-")


async def test_a_lost_engine_whose_catalog_names_a_gone_adapter_comes_back_compacted(
    world: World,
) -> None:
    world.add_adapter("a1")
    catalog = await serving(world, base_model_config=None)  # no no-op to retire names with
    with pytest.raises(CatalogPending):
        await world.stage("a1")
    await catalog.sync()
    assert "a1" in world.rendered()
    shutil.rmtree(world.tmp_path / "cache" / "adapters" / "a1")
    world.store.forget("a1")  # type: ignore[union-attr]
    world.control.ready = False  # a direct call with a1 killed the engine

    await catalog.sync()

    assert "a1" not in world.rendered()
    assert catalog.status()["generation"] == 3
    assert world.metric("lora_sidecar_catalog_compactions_total", {"reason": "engine_lost"}) == 1


async def test_during_an_on_change_reload_the_serving_engines_names_stay_servable(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    world.add_adapter("a3")
    catalog = await serving(world)
    await world.stage("a1")
    catalog.request_compaction()
    await catalog.sync()
    bound = await world.stage("a2")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    catalog.request_compaction()

    reload = asyncio.create_task(catalog.sync())
    await world.control.entered.wait()

    assert catalog.status()["triton"]["reloading"] is True
    assert catalog.lora_name("a1") == "a1"
    assert catalog.lora_name("a2") == bound
    fresh = await world.stage("a3")  # bound in the generation that serves meanwhile
    assert fresh.startswith("_spare-g2-")
    world.control.gate.set()
    await reload
    assert catalog.lora_name("a2") == "a2"


async def test_an_unload_first_reload_makes_every_adapter_wait(world: World) -> None:
    world.add_adapter("a1")
    catalog = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    catalog.request_compaction()

    reload = asyncio.create_task(catalog.sync())
    await world.control.entered.wait()

    message = raises(CatalogReloading, lambda: catalog.lora_name("a1"))
    assert "no engine serves until it is up" in message
    world.control.gate.set()
    await reload
    assert world.control.calls[-2:] == ["unload vllm_model", "load vllm_model"]
    assert catalog.lora_name("a1") == "a1"


async def test_a_failed_reload_keeps_the_old_generation_and_is_retried(world: World) -> None:
    world.add_adapter("a1")
    catalog = await serving(world)
    name = await world.stage("a1")
    world.control.failures = 1
    catalog.request_compaction()

    await catalog.sync()

    triton = catalog.status()["triton"]
    assert (triton["loaded_generation"], triton["pending"]) == (1, 2)
    assert "out of memory" in triton["last_reload_error"]
    assert "unload-first needs one" in triton["last_reload_error"]
    assert catalog.lora_name("a1") == name  # the old engine and its names serve on
    assert world.metric("lora_sidecar_triton_reloads_total", {"outcome": "error"}) == 1
    await catalog.sync()  # too soon: failures wait at least RETRY_AFTER_FAILURE_S
    assert world.control.loads() == 2
    world.clock.now_s += RETRY_AFTER_FAILURE_S
    await catalog.sync()
    assert world.control.loads() == 3
    assert catalog.lora_name("a1") == "a1"


async def test_a_restarted_sidecar_takes_over_a_changed_catalog_with_a_plain_load(
    world: World,
) -> None:
    world.add_adapter("a1")
    catalog = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    catalog.request_compaction()
    reload = asyncio.create_task(catalog.sync())
    await world.control.entered.wait()
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
    catalog = await world.start(triton_reload=TritonReload.NEVER)
    await catalog.sync()

    name = await world.stage("a1")

    assert name.startswith("_spare-g1-")
    assert world.control.calls == []
    assert "loaded_generation" not in catalog.status()["triton"]
    assert catalog.status()["triton"]["reload"] == "never"


async def test_the_sidecar_is_ready_once_a_generation_is_rendered(world: World) -> None:
    catalog = await world.start()
    assert catalog.problem() is None
    assert catalog.status()["generation"] == 1
    assert EngineState.STARTING.value == catalog.status()["triton"]["state"]


async def test_a_spare_someone_read_before_it_was_bound_is_never_bound(world: World) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    catalog = await serving(world)
    spares = sorted(n for n in world.rendered() if n.startswith("_spare-"))
    # What a direct call to vllm_model with these names makes the engine do: read the no-op
    # (from another process, through the catalog's link), and cache it under the name.
    for spare in spares[:3]:
        reader = await asyncio.create_subprocess_exec(
            "cat", str(world.local(world.rendered()[spare]) / "adapter_config.json"),
            stdout=asyncio.subprocess.DEVNULL)
        assert await reader.wait() == 0

    assert await world.stage("a1") == spares[3]
    assert sorted(catalog.status()["spares"]["burnt"]) == spares[:3]
    with pytest.raises(CatalogPending, match="no spare name is left"):
        await world.stage("a2")


# ---- the HTTP API, on the real sidecar ----------------------------------------------------------


async def api_sidecar(tmp_path: Path, start_sidecar: Any, **overrides: Any) -> Any:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(TINY_LLAMA.to_config()))
    return await start_sidecar(make_settings(tmp_path, base_model_config=base, spare_names=4,
                                             **overrides))


async def test_stage_answers_the_name_to_send_and_catalog_shows_the_binding(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.conftest import call

    local_registry_adapter(tmp_path, "a1")
    sidecar = await api_sidecar(tmp_path, start_sidecar)

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})
    _, again = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})
    _, shown = await call(http, "GET", f"{sidecar.url}/catalog")

    assert status == 200, body
    assert body["lora_name"].startswith("_spare-g1-") and again["lora_name"] == body["lora_name"]
    assert body["adapter_id"] == "a1"
    assert shown["spares"]["bound"] == {body["lora_name"]: "a1"}
    assert shown["spares"]["left"] == 3 and shown["spares"]["enabled"] is True
    assert shown["generation"] == 1 and shown["next_compaction"] is None
    assert "on disk" in shown["rule"]
    metrics = (await (await http.get(f"{sidecar.url}/metrics")).text())
    assert "lora_sidecar_catalog_bindings_total 1.0" in metrics
    assert "lora_sidecar_catalog_spares_left 3.0" in metrics


async def test_compact_needs_the_token_and_renders_a_generation_listing_what_is_on_disk(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.conftest import call

    local_registry_adapter(tmp_path, "a1")
    sidecar = await api_sidecar(tmp_path, start_sidecar, api_token="s3cret-token")
    await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})

    refused, body = await call(http, "POST", f"{sidecar.url}/catalog/compact", {})
    accepted, plan = await call(http, "POST", f"{sidecar.url}/catalog/compact", None,
                                {"Authorization": "Bearer s3cret-token"})
    wrong, _ = await call(http, "POST", f"{sidecar.url}/catalog/compact", {"force": True},
                          {"Authorization": "Bearer s3cret-token"})
    await sidecar.catalog.sync()
    _, stage = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "a1"})

    assert (refused, body["error"]) == (401, "unauthorized")
    assert accepted == 202 and plan["planned"]["reason"] == "requested"
    assert wrong == 400  # unknown field
    assert stage["lora_name"] == "a1"  # listed by its own name now
    assert sidecar.catalog.status()["generation"] == 2


async def test_an_adapter_the_watcher_adopts_follows_the_catalogs_rule(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from sidecar.examples import write_adapter
    from tests.conftest import call
    from tests.observing import eventually

    sidecar = await api_sidecar(tmp_path, start_sidecar)
    outside = tmp_path / "copy"
    write_adapter(outside, seed=3)
    outside.rename(tmp_path / "cache" / "adapters" / "copied-v1")

    async def adopted() -> bool:
        return sidecar.store.get("copied-v1") is not None

    await eventually(adopted, timeout_s=15, what="the watcher adopts the copy")
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "copied-v1"})

    assert status == 200, body
    assert body["cached"] is True and body["lora_name"].startswith("_spare-g1-")
    sidecar.catalog.request_compaction()
    await sidecar.catalog.sync()
    assert "copied-v1" in sidecar.catalog.status()["adapter_ids"]
