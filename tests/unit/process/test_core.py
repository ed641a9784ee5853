"""process/core.py: the one composition root of the core, for the app and the tests alike, its
collaborators given at construction (the catalog's `on_change` included)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.catalog.name_state import NameState
from sidecar.core.metrics import Metrics
from sidecar.process.app import Sidecar
from sidecar.process.core import build_core
from sidecar.registry.local import LocalRegistry
from sidecar.registry.transfer import TransferPolicy
from sidecar.validation.shapes import TINY_LLAMA
from sidecar.validation.validate import Rules
from tests.support.settings import local_registry_adapter, make_settings


def test_the_app_builds_its_core_through_the_same_function(tmp_path: Path) -> None:
    sidecar = Sidecar(make_settings(tmp_path), CollectorRegistry())

    assert sidecar.naming.reloads is sidecar.reloads and sidecar.reloads.catalog is sidecar.catalog
    assert sidecar.store.max_leases == sidecar.settings.max_leases  # the option's, once


async def test_the_catalogs_changes_reach_the_reloads_it_was_built_with(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(TINY_LLAMA.to_config()))
    local_registry_adapter(tmp_path, "a1", seed=1)
    settings = make_settings(tmp_path, base_model_config=base, spare_names=4, triton_url=None)
    metrics = Metrics(CollectorRegistry(), process=False)
    policy = TransferPolicy(part_size_bytes=8 << 20, attempts=1, limiter=asyncio.Semaphore(1))
    core = build_core(settings, Rules.from_settings(settings), metrics,
                      LocalRegistry(Path(settings.registry), policy))
    core.store.prepare()
    await core.reloads.start()
    try:
        await core.naming.stage("a1", timeout_s=30, lease=False)
        assert parked(metrics) == 0

        core.store.evict("a1", force=True)  # the catalog parks its name: no sync, no hook set

        assert parked(metrics) == 1
    finally:
        core.catalog.close()
        await core.store.settle_trash()


def parked(metrics: Metrics) -> float | None:
    return metrics.metrics_registry.get_sample_value(
        "lora_sidecar_catalog_names", {"state": NameState.PARKED.value})
