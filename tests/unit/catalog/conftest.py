"""Fixtures of the catalog's tests: the world they run in (tests/support/catalog_world.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.core.metrics import Metrics
from tests.support.catalog_world import Clock, RecordingControl, World


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
