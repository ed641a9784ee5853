"""Fixtures of the compose tier (marker `docker`): a real Docker engine, the project's images
built on a local Debian base, and the tiny model with adapters and reference texts of the engine
tier (shared through pytest's cache, so nothing is built twice)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose_up.docker import Docker, docker_engine
from tests.engine.harness import EngineAssets, build_assets, ensure_engine_env
from tests.support import summary

# Figures measured by the run (build times, image sizes, time to healthy, ...), printed in the
# terminal summary.
FIGURES: dict[str, str] = {}
# Printed whatever the outcome: what the tier left out on purpose, and why.
NOTES: list[str] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if FIGURES or NOTES:
        summary.add(session.config, summary.Section(
            "compose node: measured",
            [*(f"{name}: {value}" for name, value in FIGURES.items()),
             *(f"note: {note}" for note in NOTES)]))


@pytest.fixture(scope="session")
def compose_figures() -> dict[str, str]:
    return FIGURES


@pytest.fixture(scope="session")
def compose_notes() -> list[str]:
    return NOTES


@pytest.fixture(scope="session")
def docker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Docker]:
    with docker_engine(tmp_path_factory.mktemp("dockerd")) as engine:
        yield engine


@pytest.fixture(scope="session")
def compose_assets(request: pytest.FixtureRequest) -> EngineAssets:
    """The engine tier's tiny model, good adapters and reference texts (same cache folder and
    key as tests/engine/conftest.py, so a run with both builds them once)."""
    return build_assets(ensure_engine_env(), Path(request.config.cache.mkdir("engine")))
