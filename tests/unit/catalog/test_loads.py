"""loads.py: the catalog's start-up, a render and what it is sized from, and a render that
cannot be written, on a real store and catalog with Triton's model control replaced by a
recorder; when each is due is test_reloads.py's."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from sidecar.catalog import disk
from sidecar.config import TritonReload
from sidecar.core.errors import CatalogPending
from tests.support.catalog_world import World, raises, spares_of


async def test_spares_are_sized_from_the_registry_with_room_for_uploads(world: World) -> None:
    world.registry = frozenset(f"tenant-{n:04d}" for n in range(1000))
    reloads = await world.start(spare_names=None)  # rendered by the start-up
    assert len(spares_of(world)) == 1000 + 250  # an empty volume: the whole registry, + 1/4

    assert reloads.planner.spares_wanted({"tenant-0001", "other"}) == 999 + 250
    world.registry = frozenset(f"t{n}" for n in range(40))
    assert reloads.planner.spares_wanted(set()) == 50
    world.registry = frozenset({"t1"})
    assert reloads.planner.spares_wanted(set()) == 32  # never fewer
    world.registry = frozenset(f"t{n}" for n in range(100_000))
    assert reloads.planner.spares_wanted(set()) == 4096  # --spare-names-max
    world.registry = None
    assert reloads.planner.spares_wanted(set()) == 256  # the registry could not be listed yet


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


async def test_a_render_that_cannot_be_written_says_why_until_one_can(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(root: Path, *args: object) -> None:  # fault injected: the volume is full
        raise OSError(errno.ENOSPC, "No space left on device")

    create = disk.create_generation
    monkeypatch.setattr(disk, "create_generation", full)
    reloads = await world.start(triton_reload=TritonReload.NEVER)  # names: the one rendered

    why = "cannot render generation: No space left on device"
    assert reloads.problem() == f"catalog: multi_lora.json not rendered yet ({why})"
    assert reloads.status()["error"] == why and reloads.status()["generation"] == 0
    assert why in raises(CatalogPending, reloads.serving.naming_generation)
    monkeypatch.setattr(disk, "create_generation", create)
    await reloads.sync()
    assert reloads.problem() is None and reloads.status()["error"] is None
    assert reloads.status()["generation"] == 1
