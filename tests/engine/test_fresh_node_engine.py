"""A node joining with an empty volume (a new node of the ring, a replaced disk) sees its whole
registry as new adapters: with 500 in the registry, 100 drawn at random are each served, by
the real engine, with no reload; the first generation's spare names are sized from the
registry's listing."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import EngineAssets
from tests.engine.node import EngineNode
from tests.engine.surgery import variant

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REGISTRY = 500
DRAWN = 100
MAX_ADAPTERS = 20


@pytest.fixture(scope="module")
def registry(engine_assets: EngineAssets, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("fresh-registry")
    return {f"tenant-{n:03d}": variant(engine_assets.adapter(f"tenant-{n % 4}"),
                                       folder / f"t{n}", lora_alpha=1.0 + 0.37 * n)
            for n in range(REGISTRY)}


@pytest.fixture(scope="module")
def node(start_engine_node: Any, registry: dict[str, Path]) -> Iterator[EngineNode]:
    node: EngineNode = start_engine_node(
        adapters=registry, sidecar_args=["--max-adapters", str(MAX_ADAPTERS)])
    yield node


def reloads(node: EngineNode) -> float:
    with urllib.request.urlopen(node.sidecar.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lora_sidecar_triton_reloads_total{"))


def test_a_hundred_of_five_hundred_adapters_are_served_on_an_empty_volume_with_no_reload(
    node: EngineNode, registry: dict[str, Path], engine_assets: EngineAssets,
    engine_figures: dict[str, str],
) -> None:
    catalog = node.sidecar_json("/catalog")
    assert catalog["adapter_count"] == 0  # nothing was on disk: every name is a spare
    assert catalog["spares"]["total"] == REGISTRY + REGISTRY // 4
    drawn = random.Random(500).sample(sorted(registry), DRAWN)
    references = engine_assets.references({a: registry[a] for a in drawn})
    before = reloads(node)

    answers = {adapter_id: node.ask(adapter_id) for adapter_id in drawn}  # no retry

    assert {a: t for a, t in answers.items() if t != references[a].text} == {}
    assert reloads(node) == before
    after = node.sidecar_json("/catalog")
    assert after["generation"] == catalog["generation"]
    assert after["spares"]["left"] == catalog["spares"]["total"] - DRAWN
    engine_figures["fresh node, 500 in the registry: engine load with its catalog"] = (
        f"{node.engine_load_s:.1f} s ({catalog['spares']['total']} spare names); "
        f"{DRAWN} drawn at random served, 0 reloads")
