"""The catalog's test world: a real store, stager and catalog built through the one composition
root (sidecar/process/core.py) on a real filesystem and local registry, Triton's model control
replaced by a recorder, and the clocks the tests move."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sidecar.cache.stager import Stager
from sidecar.cache.store import AdapterStore
from sidecar.catalog.catalog import Catalog
from sidecar.catalog.engine_state import Probe
from sidecar.catalog.name_state import NameState
from sidecar.catalog.naming import Naming
from sidecar.catalog.read_watch import DECOY_WINDOW_S
from sidecar.catalog.reloads import Reloads
from sidecar.config import Settings
from sidecar.core.metrics import Metrics
from sidecar.process.core import build_core
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

    def add_adapters(self, *adapter_ids: str) -> None:
        """Upload several adapters, each with its own bytes."""
        for adapter_id in adapter_ids:
            self.add_adapter(adapter_id)

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
        settings = make_settings(self.tmp_path, **{
            "min_free_bytes": 0, "refusal_ttl_s": 0.0, "not_found_ttl_s": 0.0,
            **values})
        self.settings = settings
        policy = TransferPolicy(part_size_bytes=8 << 20, attempts=1, limiter=asyncio.Semaphore(4))
        core = build_core(settings, Rules.from_settings(settings), self.metrics,
                          LocalRegistry(Path(settings.registry), policy),
                          registry_ids=lambda: self.registry, control=self.control,
                          clock=self.clock, wall=self.wall)
        store, reloads = core.store, core.reloads
        store.prepare()
        store.install([store.recover_folder(folder, lambda folder, record: [])
                       for folder in store.published_folders()])
        await reloads.start()
        self.store, self.names, self.reloads = store, core.catalog, reloads
        self.stager, self.naming = core.stager, core.naming
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
        name = self.reloads.serving.naming_generation().serving_name(
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


async def compact(reloads: Reloads) -> None:
    """A compaction asked for (POST /catalog/compact) and carried out by the next step."""
    reloads.request_compaction()
    await reloads.sync()


async def hold_a_reload(world: World, reloads: Reloads) -> asyncio.Task[None]:
    """A compaction asked for, its load held open at Triton until `world.control.gate` is set:
    the step's task, once Triton has been asked."""
    world.control.gate = asyncio.Event()
    world.control.entered.clear()
    reloads.request_compaction()
    reload = asyncio.create_task(reloads.sync())
    await world.control.entered.wait()
    return reload


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


async def api_sidecar(tmp_path: Path, start_sidecar: Any, **overrides: Any) -> Any:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(TINY_LLAMA.to_config()))
    return await start_sidecar(make_settings(tmp_path, base_model_config=base, spare_names=4,
                                             **overrides))
