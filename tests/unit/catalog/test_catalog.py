"""The catalog's logic: generations rendered from what is on disk, names given without a reload,
parked when their adapter leaves the disk and returned when the same bytes come back, new bytes
under an old id given a new name, reads of no-ops, the journal across restarts, compaction, and
the reload decisions; against a real store and local registry on the real filesystem, with
Triton's model control replaced by a recorder. The same against a real Triton is in
tests/triton/, with the real engine in tests/engine/."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.stager import Stager
from sidecar.cache.store import AdapterStore
from sidecar.catalog.catalog import Catalog
from sidecar.catalog.disk import read_catalog_journal
from sidecar.catalog.engine_refusal import EngineRefusal
from sidecar.catalog.engine_state import EngineState, Probe
from sidecar.catalog.name_state import NameState, Version
from sidecar.catalog.naming import Naming, StoreView
from sidecar.catalog.read_watch import DECOY_WINDOW_S
from sidecar.catalog.reloads import RETRY_AFTER_FAILURE_S, Reloads
from sidecar.config import CompactionWindow, Settings, TritonReload
from sidecar.core.errors import (
    CatalogPending,
    CatalogReloading,
    EngineFailed,
    EngineUnavailable,
)
from sidecar.core.metrics import Metrics
from sidecar.process.examples import write_adapter
from sidecar.registry.local import LocalRegistry
from sidecar.registry.transfer import TransferPolicy
from sidecar.validation.shapes import TINY_LLAMA
from sidecar.validation.validate import Rules, validate_adapter
from tests.support.settings import local_registry_adapter, make_settings

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


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
    registry: frozenset[str] | None = None  # what the registry's listing says, when set
    store: AdapterStore | None = None
    stager: Stager | None = None
    names: Catalog | None = None
    reloads: Reloads | None = None
    naming: Naming | None = None
    settings: Settings | None = None

    @property
    def cache(self) -> Path:
        return self.tmp_path / "cache"

    def add_adapter(self, adapter_id: str, **kwargs: Any) -> bytes:
        """Upload (or upload again: other bytes under the same id) an adapter."""
        shutil.rmtree(self.tmp_path / "registry" / adapter_id, ignore_errors=True)
        folder = local_registry_adapter(self.tmp_path, adapter_id,
                                        seed=kwargs.pop("seed", len(adapter_id)), **kwargs)
        return (folder / WEIGHTS).read_bytes()

    async def start(self, **overrides: Any) -> Reloads:
        """A fresh store, stager and catalog on the world's cache (a sidecar (re)start)."""
        if self.names is not None:
            self.names.close()
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
        names = Catalog(settings.cache_root, settings.triton_root, rules, self.metrics,
                        lease_ttl_s=settings.lease_ttl_s, spares_wanted=settings.spare_names != 0,
                        clock=self.clock, wall=self.wall)
        store = AdapterStore(settings.cache_root, max_bytes=settings.max_bytes,
                             max_adapters=settings.max_adapters, min_free_bytes=0,
                             lease_ttl_s=600, metrics=self.metrics, listener=names)
        store.prepare()
        store.install([store.recover_folder(folder, lambda folder, record: [])
                       for folder in store.published_folders()])
        policy = TransferPolicy(part_size_bytes=8 << 20, attempts=1, limiter=asyncio.Semaphore(4))
        self.stager = Stager(store, LocalRegistry(Path(settings.registry), policy), rules,
                             self.metrics, refusal_ttl_s=0)
        reloads = Reloads(settings, names, self.metrics,
                          StoreView(store, settings.allowed_target_modules),
                          registry_ids=lambda: self.registry, control=self.control,
                          clock=self.clock, wall=self.wall)
        await reloads.start()
        self.store, self.names, self.reloads = store, names, reloads
        self.naming = Naming(names, reloads, self.stager, store, self.metrics, wall=self.wall)
        return reloads

    async def stage(self, adapter_id: str) -> str:
        """POST /stage's use case: stage, then the name vLLM must be sent."""
        assert self.naming is not None
        return (await self.naming.stage(adapter_id, timeout_s=30, lease=False)).lora_name

    def lora_name(self, adapter_id: str) -> str:
        """The hit path's answer for a staged adapter, without staging anything."""
        assert self.store is not None and self.reloads is not None
        adapter = self.store.get(adapter_id)
        assert adapter is not None, f"{adapter_id} is not on disk"
        name = self.reloads.naming_generation().serving_name(
            adapter_id, adapter.record.content_digest)
        assert name is not None, f"{adapter_id} has no bound name"
        return name

    def evict(self, adapter_id: str) -> None:
        assert self.store is not None
        self.store.evict(adapter_id, force=True)

    def rendered(self) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.cache / "multi_lora.json").read_text())
        return data

    def local(self, triton_path: str) -> Path:
        """A path of the catalog, as the sidecar sees it."""
        return self.cache / Path(triton_path).relative_to("/lora-cache")

    def link(self, name: str) -> str:
        return os.readlink(self.local(self.rendered()[name]))

    def read_as_engine(self, name: str) -> None:
        """What vLLM does with a name it does not hold: open the config, then the weights, by
        name, through the catalog's link, from another process."""
        link = self.local(self.rendered()[name])
        subprocess.run(["sh", "-c", f"cat '{link}/{CONFIG}' '{link}/{WEIGHTS}' >/dev/null"],
                       check=True, timeout=30)

    def judge_reads(self) -> None:
        """Let the read watch's window pass and take its verdicts."""
        assert self.names is not None
        self.names.reads.drain()
        self.clock.now_s += DECOY_WINDOW_S + 1
        self.names.check_reads()

    def state(self, name: str, generation: int | None = None) -> NameState:
        assert self.names is not None
        found = self.names.generation(generation or self.names.catalog_journal.current)
        assert found is not None
        return found.names[name].state

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.metrics_registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    (tmp_path / "registry").mkdir()
    world = World(tmp_path, Metrics(CollectorRegistry(), process=False), RecordingControl(),
                  Clock(), Clock(1_800_000_000.0))
    yield world
    if world.names is not None:
        world.names.close()
    if world.store is not None:
        await world.store.settle_trash()


def raises(error: type[Exception], check: Callable[[], object]) -> str:
    with pytest.raises(error) as caught:
        check()
    return str(caught.value)


async def serving(world: World, **overrides: Any) -> Reloads:
    """A catalog whose first generation Triton has loaded."""
    reloads = await world.start(**overrides)
    await reloads.sync()
    assert reloads.status()["triton"]["state"] == "serving", reloads.status()
    return reloads


def valid_copy(folder: Path, tmp_path: Path) -> list[Any]:
    """The validation problems of a copy of a folder (a no-op's files are hard links, which a
    published adapter may not have): whether its bytes make a valid adapter."""
    copy = tmp_path / f"copy-{folder.name}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    return validate_adapter(copy, Rules(shapes=TINY_LLAMA))


def spares_of(world: World) -> list[str]:
    return sorted(name for name in world.rendered() if name.startswith("_spare-"))


# ---- what a generation lists ------------------------------------------------------------------


async def test_a_generation_lists_the_adapters_on_disk_and_spare_names_at_no_op_adapters(
    world: World,
) -> None:
    world.add_adapter("sql-v1")
    world.add_adapter("support-v2")
    world.add_adapter("never-staged-v1")
    reloads = await serving(world)
    await world.stage("sql-v1")
    await world.stage("support-v2")
    reloads.request_compaction()

    await reloads.sync()

    rendered = world.rendered()
    spares = spares_of(world)
    assert sorted(set(rendered) - set(spares)) == ["sql-v1", "support-v2"]
    assert rendered["sql-v1"] == "/lora-cache/catalog/g2/names/sql-v1"
    assert world.link("sql-v1") == "../../../adapters/sql-v1"
    assert spares == [f"_spare-g2-000{n}" for n in range(1, 5)]
    shared = world.cache / "catalog" / "g2" / "noop" / ".shared" / WEIGHTS
    for spare in spares:
        assert rendered[spare] == f"/lora-cache/catalog/g2/names/{spare}"
        assert world.link(spare) == f"../noop/{spare}"  # relative: resolves in Triton's mount
        folder = world.local(rendered[spare]).resolve()
        assert valid_copy(folder, world.tmp_path) == []
        # Each name its own folder (its reads are told apart), the bytes once on disk.
        assert (folder / WEIGHTS).stat().st_ino == shared.stat().st_ino
    assert world.metric("lora_sidecar_catalog_adapters") == 2
    assert world.metric("lora_sidecar_catalog_generation") == 2


async def test_spares_are_sized_from_the_registry_with_room_for_uploads(world: World) -> None:
    world.registry = frozenset(f"tenant-{n:04d}" for n in range(1000))
    reloads = await world.start(spare_names=None)
    assert len(spares_of(world)) == 1000 + 250  # an empty volume: the whole registry, + 1/4

    assert reloads.spares_wanted({"tenant-0001", "other"}) == 999 + 250
    world.registry = frozenset(f"t{n}" for n in range(40))
    assert reloads.spares_wanted(set()) == 50
    world.registry = frozenset({"t1"})
    assert reloads.spares_wanted(set()) == 32  # never fewer
    world.registry = frozenset(f"t{n}" for n in range(100_000))
    assert reloads.spares_wanted(set()) == 4096  # --spare-names-max
    world.registry = None
    assert reloads.spares_wanted(set()) == 256  # the registry could not be listed yet


async def test_a_refused_adapter_is_never_listed_nor_named(world: World) -> None:
    world.add_adapter("too-wide-v1", rank=32)  # max_lora_rank is 16
    reloads = await serving(world)

    with pytest.raises(Exception, match="refused by validation"):
        await world.stage("too-wide-v1")
    reloads.request_compaction()
    await reloads.sync()

    assert spares_of(world) == sorted(world.rendered())
    assert reloads.status()["spares"]["bound"] == {}


async def test_without_a_base_model_config_the_first_adapters_shapes_make_the_no_op(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    with caplog.at_level("INFO", logger="sidecar.catalog"):
        reloads = await serving(world, base_model_config=None)

    spares = reloads.status()["spares"]
    assert spares["enabled"] is False
    assert "--base-model-config" in spares["off_because"]
    assert world.rendered() == {}
    assert any("spare names are off" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)

    with pytest.raises(CatalogPending, match="spare names are off"):
        await world.stage("a1")
    await reloads.sync()  # the compaction the wait planned: a1's shapes give the no-op

    assert reloads.status()["spares"]["enabled"] is True
    assert reloads.status()["spares"]["noop_from"] == "adapter a1"
    assert await world.stage("a1") == "a1"
    assert (await world.stage("a2")).startswith("_spare-g2-")
    noop = world.local(world.rendered()[spares_of(world)[0]]).resolve()
    assert valid_copy(noop, world.tmp_path) == []  # it fits the model


@pytest.mark.parametrize("triton_url", ["http://127.0.0.1:1", None], ids=["triton", "no triton"])
async def test_spares_off_is_a_warning_only_where_it_costs_reloads(
    world: World, caplog: pytest.LogCaptureFixture, triton_url: str | None
) -> None:
    with caplog.at_level("INFO", logger="sidecar.catalog"):
        await world.start(base_model_config=None, triton_url=triton_url)

    said = [r for r in caplog.records if "spare names are off" in r.getMessage()]
    assert len(said) == 1
    if triton_url is None:  # `make run`: nothing is reloaded, so nothing to warn a newcomer of
        assert said[0].levelname == "INFO" and "no reload" in said[0].getMessage()
    else:
        assert said[0].levelname == "WARNING" and "costs a reload" in said[0].getMessage()
    assert not [r for r in caplog.records if "compaction planned" in r.getMessage()
                and r.levelname != "DEBUG" and triton_url is None]


# ---- names given, parked, returned -------------------------------------------------------------


async def test_a_new_adapter_gets_a_spare_without_any_triton_call(world: World) -> None:
    weights = world.add_adapter("fresh-v1")
    reloads = await serving(world)
    calls = list(world.control.calls)

    name = await world.stage("fresh-v1")

    assert name.startswith("_spare-g1-")
    assert world.control.calls == calls
    link = world.local(world.rendered()[name])
    assert os.readlink(link) == "../../../adapters/fresh-v1"
    assert (link / WEIGHTS).read_bytes() == weights
    assert world.store is not None
    digest = world.store.get("fresh-v1").record.content_digest  # type: ignore[union-attr]
    entry = read_catalog_journal(world.cache).generations[1].names[name]
    assert (entry.state, entry.version) == (NameState.BOUND, Version("fresh-v1", digest))
    status = reloads.status()
    assert status["spares"]["bound"] == {name: str(Version("fresh-v1", digest))}
    assert status["spares"]["left"] == 3
    assert world.metric("lora_sidecar_catalog_bindings_total") == 1
    assert world.metric("lora_sidecar_catalog_spares_left") == 3


async def test_a_name_is_given_once_and_each_adapter_gets_its_own(world: World) -> None:
    for adapter_id in ("a1", "a2"):
        world.add_adapter(adapter_id)
    await serving(world)

    first = await world.stage("a1")
    again = await world.stage("a1")
    other = await world.stage("a2")

    assert first == again
    assert other != first
    assert world.link(other) == "../../../adapters/a2"


async def test_concurrent_first_stages_of_one_adapter_share_one_name(world: World) -> None:
    world.add_adapter("popular-v1")
    reloads = await serving(world)

    names = await asyncio.gather(*(world.stage("popular-v1") for _ in range(8)))

    assert len(set(names)) == 1
    assert len(reloads.status()["spares"]["bound"]) == 1


async def test_an_evicted_adapter_s_name_is_parked_at_a_no_op_and_returns_with_its_bytes(
    world: World,
) -> None:
    weights = world.add_adapter("a1")
    world.add_adapter("a2")
    world.add_adapter("a3")
    reloads = await serving(world, max_adapters=1)
    name = await world.stage("a1")

    await world.stage("a2")  # a1 goes: the budget is one adapter

    assert not (world.cache / "adapters" / "a1").exists()
    assert world.link(name) == f"../noop/{name}"  # never dangling, never kept copies
    assert world.state(name) is NameState.PARKED
    assert valid_copy(world.local(world.rendered()[name]).resolve(), world.tmp_path) == []
    assert not (world.cache / "catalog" / "g1" / "kept").exists()
    left = reloads.status()["spares"]["left"]

    assert await world.stage("a1") == name  # the same bytes: the same name, no spare used
    assert (world.local(world.rendered()[name]) / WEIGHTS).read_bytes() == weights
    assert reloads.status()["spares"]["left"] == left
    # Own names are parked and returned alike.
    reloads.request_compaction()
    await reloads.sync()
    assert await world.stage("a1") == "a1"
    await world.stage("a3")
    assert world.state("a1") is NameState.PARKED and world.link("a1") == "../noop/a1"
    assert await world.stage("a1") == "a1"
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "returned"}) == 2


async def test_new_bytes_under_an_old_id_get_a_new_name_and_the_old_name_never_reads_them(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    old = world.add_adapter("tenant-x", seed=1)
    world.add_adapter("filler")
    reloads = await serving(world, max_adapters=1)
    reloads.request_compaction()
    await world.stage("tenant-x")
    await reloads.sync()
    assert await world.stage("tenant-x") == "tenant-x"  # listed by its own name
    await world.stage("filler")  # evicted: its own name is parked
    new = world.add_adapter("tenant-x", seed=2)  # re-uploaded under the same id
    assert new != old

    with caplog.at_level("WARNING", logger="sidecar.catalog.naming"):
        name = await world.stage("tenant-x")

    assert name.startswith("_spare-g2-")
    assert (world.local(world.rendered()[name]) / WEIGHTS).read_bytes() == new
    assert world.link("tenant-x") == "../noop/tenant-x"  # still the old bytes' name, parked
    assert any("the registry changed under adapter tenant-x" in r.getMessage()
               for r in caplog.records)
    assert world.naming is not None
    changed = world.naming.replaced("tenant-x")
    assert changed is not None and changed["digest_before"] != changed["digest_now"]

    # The old bytes come back (a revert): their own name returns to them, never to the new.
    await world.stage("filler")
    world.add_adapter("tenant-x", seed=1)
    assert await world.stage("tenant-x") == "tenant-x"
    assert (world.local(world.rendered()["tenant-x"]) / WEIGHTS).read_bytes() == old


async def test_names_given_equal_the_distinct_versions_staged_under_churn(world: World) -> None:
    ids = [f"t{n}" for n in range(8)]
    for adapter_id in ids:
        world.add_adapter(adapter_id)
    reloads = await serving(world, max_adapters=2, spare_names=10)
    order = [0, 1, 2, 0, 3, 1, 4, 5, 0, 6, 7, 2, 3, 0, 1, 5, 6, 7, 4, 0]
    names: dict[str, str] = {}
    for n in order:
        name = await world.stage(ids[n])
        assert names.setdefault(ids[n], name) == name  # never another name for the same bytes

    spares = reloads.status()["spares"]
    assert len(set(names.values())) == 8 == len(spares["bound"]) + len(spares["parked"])
    assert spares["left"] == 2 and spares["burnt"] == []
    assert world.metric("lora_sidecar_catalog_bindings_total") == 8


async def test_bindings_survive_a_sidecar_restart_without_a_load(world: World) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    world.add_adapter("a3")
    await serving(world, max_adapters=2)
    name = await world.stage("a1")
    parked = await world.stage("a2")
    await world.stage("a3")
    await world.stage("a1")  # a2 is evicted: parked
    loads = world.control.loads()
    before = (world.cache / "multi_lora.json").stat()

    restarted = await world.start(max_adapters=2)  # the same cache, Triton still serving
    await restarted.sync()

    # Untouched: Triton reloads a model whose catalog file's ctime moved.
    after = (world.cache / "multi_lora.json").stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    assert restarted.status()["triton"]["state"] == "serving"
    assert world.control.loads() == loads  # the catalog file is the one Triton loaded
    assert world.state(parked) is NameState.PARKED
    assert await world.stage("a1") == name
    assert await world.stage("a2") == parked  # returned after the restart too


# ---- reads of no-ops ----------------------------------------------------------------------------


async def test_a_spare_the_engine_read_before_it_was_given_is_never_given(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    reloads = await serving(world)
    spares = spares_of(world)
    # What a direct call to vllm_model with these names makes the engine do.
    for spare in spares[:3]:
        world.read_as_engine(spare)
    world.judge_reads()

    assert await world.stage("a1") == spares[3]
    assert sorted(reloads.status()["spares"]["burnt"]) == spares[:3]
    with pytest.raises(CatalogPending, match="no spare name is left"):
        await world.stage("a2")


class WatchesRunOut:
    """libc as inotify answers once fs.inotify.max_user_watches is reached (fault injection):
    after `left` watches, inotify_add_watch fails with ENOSPC; every other call is libc's."""

    def __init__(self, libc: Any, left: int) -> None:
        self._libc, self.left = libc, left

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        if self.left == 0:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        self.left -= 1
        return int(self._libc.inotify_add_watch(fd, path, mask))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._libc, name)


async def test_a_spare_whose_no_op_inotify_cannot_watch_is_never_given(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL",
                        lambda *args, **kwargs: WatchesRunOut(real_cdll(*args, **kwargs), left=2))
    for adapter_id in ("a1", "a2", "a3"):
        world.add_adapter(adapter_id)
    reloads = await serving(world)  # four spares; inotify watches only two of their no-ops
    assert world.names is not None
    watched = sorted(name for name in spares_of(world)
                     if world.names.reads.is_watched((1, name)))
    assert len(watched) == 2 and len(spares_of(world)) == 4

    given = sorted([await world.stage("a1"), await world.stage("a2")])
    with pytest.raises(CatalogPending, match="no spare name is left"):
        await world.stage("a3")  # two spares left, but a read of them would go unseen

    assert given == watched
    assert sorted(reloads.status()["spares"]["bound"]) == watched
    warnings = [r.getMessage() for r in caplog.records
                if "cannot be watched are not handed out" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    assert "max_user_watches" in warnings[0]


async def test_a_stage_that_cannot_be_named_yet_gives_its_lease_back(world: World) -> None:
    world.add_adapter("a1")
    await serving(world, base_model_config=None)  # spares off: a1 waits for a compaction
    assert world.naming is not None and world.store is not None

    with pytest.raises(CatalogPending):
        await world.naming.stage("a1", timeout_s=30, lease=True)

    assert world.store.get("a1") is not None  # staged, and free to be evicted again
    assert world.store.lease_count("a1") == 0


async def test_a_parked_name_the_engine_read_is_burnt_and_its_adapter_takes_a_fresh_spare(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    await serving(world, max_adapters=1)
    name = await world.stage("a1")
    await world.stage("a2")  # a1 parked

    world.read_as_engine(name)
    world.judge_reads()

    assert world.state(name) is NameState.BURNT
    again = await world.stage("a1")
    assert again not in (name, "a1")
    assert world.link(name) == f"../noop/{name}"  # it answers as the no-op it was read as
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "burnt"}) == 1


@pytest.mark.parametrize("command", [
    "du -sh .", "find . -type f", "ls -lR .", "du -shL .", "tar -cf /dev/null .",
    "cp -r catalog ../backup", "find . -name '*.safetensors' -exec sha256sum {} +",
    "cat catalog/g1/noop/*/adapter_config.json",
])
async def test_operators_looking_at_the_volume_burn_no_name(world: World, command: str) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    reloads = await serving(world, max_adapters=1)
    await world.stage("a1")
    await world.stage("a2")  # a1 parked: its no-op is watched too
    left = reloads.status()["spares"]["left"]

    process = await asyncio.create_subprocess_exec(
        "sh", "-c", command, cwd=world.cache, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    assert await process.wait() == 0
    world.judge_reads()

    assert reloads.status()["spares"]["burnt"] == []
    assert reloads.status()["spares"]["left"] == left
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "burnt"}) == 0


# ---- faults ----------------------------------------------------------------------------------


async def test_a_bound_adapter_removed_by_hand_parks_its_name_and_one_changed_in_place_burns_it(
    world: World,
) -> None:
    world.add_adapter("a1")
    world.add_adapter("a2")
    reloads = await serving(world)
    removed = await world.stage("a1")
    changed = await world.stage("a2")
    assert world.store is not None

    shutil.rmtree(world.cache / "adapters" / "a1")
    world.store.forget("a1")  # what the watcher does when the folder is gone
    world.store.forget("a2", changed=True)  # ... and when its files changed in place

    assert world.link(removed) == f"../noop/{removed}"
    assert world.state(removed) is NameState.PARKED
    assert world.state(changed) is NameState.BURNT
    assert world.link(changed) == f"../noop/{changed}"
    assert await world.stage("a1") == removed  # the same bytes from the registry: returned
    assert await world.stage("a2") not in (changed, "a2")
    assert reloads.status()["spares"]["burnt"] == [changed]


async def test_crashes_between_journal_and_link_never_hand_out_a_half_given_name(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    assert world.store is not None
    given = await world.stage("a1")
    journaled_only, linked_only = [s for s in spares_of(world) if s != given][:2]
    assert reloads.status()["spares"]["bound"].keys() == {given}
    a1 = world.store.get("a1")
    assert a1 is not None
    # A crash after the journal was written, before the link; and one after a link was
    # replaced, before the journal (neither name was handed out).
    journal_path = world.cache / "catalog" / "journal.json"
    journal = json.loads(journal_path.read_text())
    for entry in journal["generations"]["1"]["names"]:
        if entry["name"] == journaled_only:
            entry.update(state="bound", adapter_id="a1", digest=a1.record.content_digest)
    journal_path.write_text(json.dumps(journal))
    folder = world.cache / "catalog" / "g1" / "names"
    (folder / linked_only).unlink()
    (folder / linked_only).symlink_to("../../../adapters/a1")

    restarted = await world.start()
    await restarted.sync()

    burnt = restarted.status()["spares"]["burnt"]
    assert sorted(burnt) == sorted([journaled_only, linked_only])
    for spare in burnt:
        assert os.readlink(folder / spare) == f"../noop/{spare}"


async def test_a_restart_parks_names_whose_adapter_left_while_it_was_down(world: World) -> None:
    world.add_adapter("a1")
    await serving(world)
    name = await world.stage("a1")
    shutil.rmtree(world.cache / "adapters" / "a1")  # gone while no sidecar ran

    restarted = await world.start()
    await restarted.sync()

    assert world.state(name) is NameState.PARKED
    assert world.link(name) == f"../noop/{name}"
    assert await world.stage("a1") == name


async def test_a_catalog_file_that_is_not_the_journals_starts_a_new_generation(
    world: World,
) -> None:
    world.add_adapter("a1")
    await serving(world)
    await world.stage("a1")
    (world.cache / "multi_lora.json").write_text("{}\n")  # edited by hand

    restarted = await world.start()

    assert restarted.status()["generation"] == 2
    assert sorted(world.rendered()) == [*(f"_spare-g2-000{n}" for n in range(1, 5)), "a1"]


# ---- the budget --------------------------------------------------------------------------------


async def test_the_catalog_keeps_no_adapter_bytes_outside_the_budget(world: World) -> None:
    for n in range(6):
        world.add_adapter(f"t{n}", seed=n)
    reloads = await serving(world, max_adapters=2, spare_names=8)
    for n in [0, 1, 2, 3, 0, 4, 5, 1, 2]:
        await world.stage(f"t{n}")
    assert world.store is not None
    await world.store.settle_trash()

    adapters = sum(p.stat().st_size for p in (world.cache / "adapters").rglob("*")
                   if p.is_file() and p.name != ".sidecar.json")
    assert adapters == world.store.total_bytes
    seen: set[int] = set()
    catalog = 0
    for path in (world.cache / "catalog").rglob("*"):
        st = path.lstat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            catalog += st.st_size
    await reloads.catalog.measure()
    assert catalog <= reloads.status()["disk"]["catalog_bytes"]
    # No-op copies aside, nothing: the no-op's bytes are on disk once per generation.
    noop = reloads.status()["disk"]["noop_bytes"]
    assert 0 < noop < catalog < noop + 64 * 1024 + 8192 * len(world.rendered())


# ---- compaction ---------------------------------------------------------------------------------


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

    reloads.request_compaction()
    await reloads.sync()

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
    world.add_adapter("a1")
    world.add_adapter("a2")
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


# ---- reloads: the state machine in use ----------------------------------------------------------


async def test_triton_unreachable_at_start_is_loaded_at_once_when_it_answers(
    world: World,
) -> None:
    world.control.reachable = False
    reloads = await world.start(triton_reload_min_interval_s=3600.0)
    await reloads.sync()
    assert reloads.status()["triton"]["state"] == "unreachable"
    assert "does not answer" in raises(CatalogPending, reloads.naming_generation)

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
    world.add_adapter("a1")
    world.add_adapter("a2")
    world.add_adapter("a3")
    reloads = await serving(world)
    await world.stage("a1")
    reloads.request_compaction()
    await reloads.sync()
    given = await world.stage("a2")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    reloads.request_compaction()

    reload = asyncio.create_task(reloads.sync())
    await world.control.entered.wait()

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
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    reloads.request_compaction()

    reload = asyncio.create_task(reloads.sync())
    await world.control.entered.wait()

    message = raises(CatalogReloading, reloads.naming_generation)
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
    reloads.request_compaction()

    await reloads.sync()

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
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    reloads.request_compaction()
    reload = asyncio.create_task(reloads.sync())
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


# ---- the HTTP API, on the real sidecar ----------------------------------------------------------


async def api_sidecar(tmp_path: Path, start_sidecar: Any, **overrides: Any) -> Any:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(TINY_LLAMA.to_config()))
    return await start_sidecar(make_settings(tmp_path, base_model_config=base, spare_names=4,
                                             **overrides))


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


async def test_an_adapter_the_watcher_adopts_follows_the_catalogs_rule(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.support.api import call
    from tests.support.waiting import eventually

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
    sidecar.reloads.request_compaction()
    await sidecar.reloads.sync()
    assert "copied-v1" in sidecar.reloads.status()["adapter_ids"]


# ---- /stage held while no engine serves (naming.py) -------------------------------------------


async def test_a_stage_arriving_during_an_unload_first_reload_is_held_and_answered(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world, triton_reload=TritonReload.UNLOAD_FIRST)
    await world.stage("a1")
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    reloads.request_compaction()
    reload = asyncio.create_task(reloads.sync())
    await world.control.entered.wait()
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

    with pytest.raises(CatalogPending) as caught:
        await world.naming.stage("a2", timeout_s=30, lease=True, hold_s=0.05)

    assert "held" in caught.value.message and "hold_s" in caught.value.message
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
