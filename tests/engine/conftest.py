"""Fixtures of the engine tier (marker `engine`): the engine environment, the tiny model with
its good adapters and reference texts, the stock backend, and a node with the real engine.

A missing stock backend is reported in the terminal summary with what was tried and how to fix
it, and the tests that need it are skipped with that reason; the tests that need only the
engine environment (the offline corpus) still run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.harness import (
    BackendLookup,
    EngineAssets,
    EngineEnv,
    build_assets,
    ensure_engine_env,
    find_vllm_backend,
)
from tests.engine.node import EngineNode, start_node
from tests.support import summary

_BACKEND: dict[str, BackendLookup] = {}
# Figures the tests measured (engine load, cold call, ...), printed in the terminal summary.
FIGURES: dict[str, str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if FIGURES:
        summary.add(session.config, summary.Section(
            "engine tier: measured", [f"{name}: {value}" for name, value in FIGURES.items()]))
    lookup = _BACKEND.get("lookup")
    if lookup is None or lookup.path is not None:
        return
    summary.add(session.config, summary.Section(
        "ENGINE TIER: THE STOCK TRITON vLLM BACKEND WAS NOT FOUND",
        ["The tests of the real chain (Triton + stock backend + vLLM) were SKIPPED.", "Tried:",
         *(f"  - {attempt}" for attempt in lookup.tried), lookup.fix()],
        alarm=True))


@pytest.fixture(scope="session")
def engine_figures() -> dict[str, str]:
    """Name -> measured figure (text), shown at the end of the run."""
    return FIGURES


@pytest.fixture(scope="session")
def engine_cache(request: pytest.FixtureRequest) -> Path:
    """Built assets and reference texts, kept across sessions by content."""
    return Path(request.config.cache.mkdir("engine"))


@pytest.fixture(scope="session")
def engine_env() -> EngineEnv:
    return ensure_engine_env()


@pytest.fixture(scope="session")
def engine_assets(engine_env: EngineEnv, engine_cache: Path) -> EngineAssets:
    return build_assets(engine_env, engine_cache)


@pytest.fixture(scope="session")
def vllm_backend(engine_cache: Path) -> Path:
    lookup = _BACKEND.get("lookup")
    if lookup is None:
        lookup = _BACKEND["lookup"] = find_vllm_backend(engine_cache)
    if lookup.path is None:
        pytest.skip("the stock Triton vLLM backend was not found (tried: "
                    + "; ".join(lookup.tried) + "). " + lookup.fix())
    return lookup.path


StartNode = Callable[..., EngineNode]


@pytest.fixture(scope="module")
def start_engine_node(
    tmp_path_factory: pytest.TempPathFactory, moto_server: str, engine_assets: EngineAssets,
    vllm_backend: Path,
) -> Iterator[StartNode]:
    """Start nodes (see tests.engine.node.start_node for the arguments); all are stopped when
    the module ends, their engine processes killed."""
    nodes: list[EngineNode] = []

    def start(**kwargs: Any) -> EngineNode:
        node = start_node(engine_assets, tmp_path_factory.mktemp("engine-node"), moto_server,
                          vllm_backend, **kwargs)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()
