"""serving.py: which generation names requests, what a request is told while none can name its
adapter, and the event a held request waits on; on a real store and catalog with Triton's model
control replaced by a recorder."""

from __future__ import annotations

from sidecar.catalog.engine_state import Probe
from sidecar.config import TritonReload
from sidecar.core.errors import CatalogPending
from tests.support.catalog_world import (
    World,
    compact,
    raises,
    serving,
)


async def test_before_triton_answers_no_generation_names_requests_and_the_answer_says_why(
    world: World,
) -> None:
    reloads = await world.start()

    assert "has not heard from Triton" in raises(CatalogPending,
                                                 reloads.serving.naming_generation)
    assert reloads.serving.naming_or_none() is None
    await reloads.sync()
    assert reloads.serving.naming_generation().number == 1


async def test_without_reloads_the_generation_rendered_names_requests(world: World) -> None:
    reloads = await world.start(triton_reload=TritonReload.NEVER)

    assert reloads.serving.reloads is False
    assert reloads.serving.naming_generation().number == 1


async def test_a_change_in_what_serves_sets_the_event_taken_before_it(world: World) -> None:
    reloads = await serving(world)
    taken = reloads.serving.changed
    world.control.probe_answers = [Probe.NOT_LOADED]  # the engine is gone

    await reloads.probe()

    assert taken.is_set()
    assert reloads.serving.changed is not taken and not reloads.serving.changed.is_set()


async def test_an_adapter_in_a_generation_not_loaded_yet_is_told_the_reload_it_waits_for(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    await world.stage("a1")
    world.control.failures = 1
    await compact(reloads)  # generation 2 lists a1 by its own name; its load failed
    served = reloads.serving.naming_generation()

    pending = reloads.serving.no_name_left("a1", served, "no spare name is left")

    assert served.number == 1 and pending.adapter_id == "a1"
    assert "is in catalog generation 2, but Triton serves generation 1" in str(pending)
    assert "the last reload failed" in str(pending) and "retrying in 5s" in str(pending)
