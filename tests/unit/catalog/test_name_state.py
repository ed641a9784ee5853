"""The life of a catalogued name on its own: every allowed transition, every refused one, and the
generation's indexes kept by `Generation.apply` (what the hit path and a return look up). The
catalog's use of it, with links on a real filesystem, is in test_catalog.py."""

from __future__ import annotations

import itertools

import pytest

from sidecar.catalog.generation import Generation, spare_name
from sidecar.catalog.name_state import (
    HELD,
    SERVABLE,
    TRANSITIONS,
    WATCHED,
    BadTransition,
    NameEvent,
    NameState,
    Version,
    next_state,
)

S, E = NameState, NameEvent

# The whole table, written out once more by hand: a change to the machine changes both.
EXPECTED = {
    (S.UNBOUND, E.BIND): S.BOUND,
    (S.UNBOUND, E.READ): S.BURNT,
    (S.UNBOUND, E.FAIL): S.BURNT,
    (S.UNBOUND, E.RETIRE): S.RETIRED,
    (S.BOUND, E.LEAVE): S.PARKED,
    (S.BOUND, E.FAIL): S.BURNT,
    (S.BOUND, E.RETIRE): S.RETIRED,
    (S.PARKED, E.RETURN): S.BOUND,
    (S.PARKED, E.READ): S.BURNT,
    (S.PARKED, E.FAIL): S.BURNT,
    (S.PARKED, E.RETIRE): S.RETIRED,
    (S.BURNT, E.READ): S.BURNT,
    (S.BURNT, E.FAIL): S.BURNT,
    (S.BURNT, E.RETIRE): S.RETIRED,
}

V1 = Version("tenant-a", "sha256:" + "1" * 64)
V2 = Version("tenant-a", "sha256:" + "2" * 64)


@pytest.mark.parametrize(("start", "event"), sorted(EXPECTED, key=str))
def test_each_allowed_transition(start: NameState, event: NameEvent) -> None:
    assert next_state(start, event) is EXPECTED[(start, event)]


@pytest.mark.parametrize(("start", "event"), sorted(
    set(itertools.product(NameState, NameEvent)) - set(EXPECTED), key=str))
def test_every_other_event_is_refused(start: NameState, event: NameEvent) -> None:
    with pytest.raises(BadTransition, match=f"{start.value} name cannot {event.value}"):
        next_state(start, event)


def test_the_table_is_the_one_written_here() -> None:
    assert TRANSITIONS == EXPECTED


def test_a_name_at_a_no_op_is_watched_and_only_a_bound_one_is_handed_out() -> None:
    assert SERVABLE == {S.BOUND}
    assert WATCHED == {S.UNBOUND, S.PARKED}
    assert HELD == {S.BOUND, S.PARKED}
    # Nothing leaves burnt or retired for a state a request could be given.
    for (start, _event), end in TRANSITIONS.items():
        if start in (S.BURNT, S.RETIRED):
            assert end not in SERVABLE


def test_a_rendered_generation_binds_own_names_and_indexes_spares_as_free() -> None:
    generation = Generation.render(3, [V1, Version("b", "sha256:b")], spares=2, rendered_at=1.0)
    assert list(generation.names) == ["b", "tenant-a", spare_name(3, 1), spare_name(3, 2)]
    assert generation.serving_name("tenant-a", V1.digest) == "tenant-a"
    assert generation.serving_name("tenant-a", V2.digest) is None  # other bytes, no name
    assert generation.free_spares() == ["_spare-g3-0001", "_spare-g3-0002"]
    assert generation.own_ids() == {"b", "tenant-a"}


def test_park_return_and_burn_keep_the_indexes_true() -> None:
    generation = Generation.render(1, [V1], spares=2, rendered_at=1.0)
    generation.apply("tenant-a", E.LEAVE, "evicted")
    assert generation.serving_name("tenant-a", V1.digest) is None
    assert generation.held_name(V1) == "tenant-a"  # parked: the same bytes may return
    generation.apply("tenant-a", E.RETURN, "staged again")
    assert generation.serving_name("tenant-a", V1.digest) == "tenant-a"

    # New bytes under the same id get a spare; the own name stays with the old bytes.
    generation.apply("tenant-a", E.LEAVE, "evicted")
    spare = generation.free_spares()[0]
    generation.apply(spare, E.BIND, "new bytes", V2)
    assert generation.serving_name("tenant-a", V2.digest) == spare
    assert generation.held_names_of("tenant-a") == {V1: "tenant-a", V2: spare}
    assert generation.free_spares() == ["_spare-g1-0002"]

    generation.apply("tenant-a", E.READ, "read while parked")
    assert generation.held_name(V1) is None  # burnt: V1 would take a fresh spare
    assert generation.counts.burnt == 1 and generation.counts.parked == 2
    assert generation.counts.returned == 1 and generation.counts.bound == 1


def test_the_journal_form_round_trips_and_refuses_what_cannot_be_true() -> None:
    generation = Generation.render(4, [V1], spares=1, rendered_at=5.0)
    generation.apply(spare_name(4, 1), E.BIND, "new", Version("c", "sha256:c"))
    generation.apply("tenant-a", E.LEAVE, "evicted")
    again = Generation.from_json(4, generation.to_json())
    assert {n: (e.state, e.version) for n, e in again.names.items()} == {
        n: (e.state, e.version) for n, e in generation.names.items()}
    assert again.held_name(V1) == "tenant-a"

    data = generation.to_json()
    data["names"][0]["name"] = spare_name(5, 1)  # a spare of another generation
    with pytest.raises(ValueError, match="not a name of it"):
        Generation.from_json(4, data)
    data = generation.to_json()
    data["names"][1].pop("adapter_id")  # a bound spare without its version
    data["names"][1].pop("digest")
    with pytest.raises(ValueError, match="bound without a version"):
        Generation.from_json(4, data)
