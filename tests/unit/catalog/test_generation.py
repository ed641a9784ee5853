"""generation.py: a generation's names and their indexes as names change, and the journal's JSON
form, read back or refused; plain data, no I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.catalog.generation import CatalogJournal, Generation, spare_name
from sidecar.catalog.name_state import HELD, BadTransition, NameEvent, NameState, Version

A1 = Version("a1", "sha256:" + "1" * 64)
A2 = Version("a2", "sha256:" + "2" * 64)
A2_NEW = Version("a2", "sha256:" + "3" * 64)


def test_a_rendered_generation_lists_own_names_first_then_its_spares() -> None:
    generation = Generation.render(3, [A2, A1], 2, 1000.0)

    assert list(generation.names) == ["a1", "a2", "_spare-g3-0001", "_spare-g3-0002"]
    assert generation.own_ids() == {"a1", "a2"}
    assert generation.free_spares() == [spare_name(3, 1), spare_name(3, 2)]
    assert generation.spare_count() == 2
    assert generation.state_counts() == {"unbound": 2, "bound": 2, "parked": 0, "burnt": 0}
    assert generation.serving_name("a1", A1.digest) == "a1"
    assert generation.serving_name("a1", A2.digest) is None  # other bytes under the id


def test_the_indexes_follow_a_name_bound_parked_and_returned() -> None:
    generation = Generation.render(1, [A1], 2, 1000.0)
    spare = spare_name(1, 1)

    generation.apply(spare, NameEvent.BIND, "staged", A2, pending=True)
    assert generation.serving_name("a2", A2.digest) is None  # its link is not switched yet
    generation.linked(spare)
    assert generation.serving_name("a2", A2.digest) == spare
    assert generation.free_spares() == [spare_name(1, 2)]

    generation.apply(spare, NameEvent.LEAVE, "evicted")
    assert generation.serving_name("a2", A2.digest) is None
    assert generation.held_name(A2) == spare and generation.bound_name_of("a2") is None
    assert generation.held_names_of("a2") == {A2: spare}

    generation.apply(spare, NameEvent.RETURN, "staged again")
    assert generation.bound_name_of("a2") == spare
    counts = generation.counts
    assert (counts.bound, counts.parked, counts.returned, counts.burnt) == (1, 1, 1, 0)


def test_a_burnt_name_is_counted_once_and_never_free_again() -> None:
    generation = Generation.render(1, [], 1, 1000.0)
    spare = spare_name(1, 1)

    generation.apply(spare, NameEvent.READ, "the engine read its no-op")
    generation.apply(spare, NameEvent.READ, "read again")

    assert generation.names[spare].state is NameState.BURNT
    assert generation.free_spares() == [] and generation.counts.burnt == 1
    with pytest.raises(BadTransition):
        generation.apply(spare, NameEvent.BIND, "staged", A1)


def test_the_journal_reads_back_what_it_wrote() -> None:
    generation = Generation.render(2, [A1], 2, 1000.0, )
    generation.apply(spare_name(2, 1), NameEvent.BIND, "staged", A2)
    generation.apply(spare_name(2, 1), NameEvent.LEAVE, "evicted")
    generation.retire_at = 2000.0
    journal = CatalogJournal({2: generation}, current=2, loaded=2)

    again = CatalogJournal.from_json(json.loads(json.dumps(journal.to_json())))

    read = again.current_generation()
    assert read is not None and again.loaded == 2 and read.retire_at == 2000.0
    assert {n: (e.state, e.version, e.spare) for n, e in read.names.items()} == {
        n: (e.state, e.version, e.spare) for n, e in generation.names.items()}
    assert read.held_name(A2) == spare_name(2, 1) and read.counts.parked == 1


def journal_with(name: dict[str, Any], **top: Any) -> dict[str, Any]:
    data = CatalogJournal({1: Generation.render(1, [A1], 0, 1000.0)}, 1, None).to_json()
    data["generations"]["1"]["names"] = [name]
    data.update(top)
    return data


@pytest.mark.parametrize(("data", "why"), [
    (journal_with({"name": "a1", "state": "bound", "spare": False}), "bound without a version"),
    (journal_with({"name": "_spare-g2-0001", "state": "unbound", "spare": True}),
     "is not a name of it"),  # a spare of another generation
    (journal_with({"name": "../etc", "state": "bound", "spare": False,
                   "adapter_id": "a1", "digest": "sha256:1"}), "is not a name of it"),
    (journal_with({"name": "_spare-g1-0001", "state": "unbound", "spare": True,
                   "adapter_id": "a1", "digest": "sha256:1"}), "unbound with a version"),
    (journal_with({"name": "a1", "state": "bound", "spare": False,
                   "adapter_id": "a1", "digest": "sha256:1"}, current=7),
     "generation 7 is named but not recorded"),
    ({"format": 1, "generations": {}}, "not a journal of a known format"),
])
def test_a_journal_that_cannot_be_trusted_is_refused(data: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        CatalogJournal.from_json(data)


def test_the_journal_text_is_the_whole_journal_encoded_after_any_changes() -> None:
    """`journal_text` keeps each name's text from the last save it did not change in; after
    every kind of change, in two generations, it is the journal encoded whole."""
    old = Generation.render(1, [A1], 3, 1000.0)
    new = Generation.render(2, [A1, A2], 4, 1500.0)
    journal = CatalogJournal({1: old, 2: new}, current=2, loaded=1)

    def whole() -> str:
        return json.dumps(journal.to_json(), separators=(",", ":"))

    assert journal.journal_text() == whole()
    steps = [
        (new, spare_name(2, 1), NameEvent.BIND, "staged: «naïve» \"quoted\"\n", A2_NEW),
        (new, spare_name(2, 1), NameEvent.LEAVE, "evicted", None),
        (old, spare_name(1, 2), NameEvent.READ, "the engine read its no-op", None),
        (new, spare_name(2, 1), NameEvent.RETURN, "x" * 400, None),  # cut to 300
        (new, "a2", NameEvent.LEAVE, "evicted", None),
        (new, spare_name(2, 3), NameEvent.BIND, "staged", A2),
    ]
    for generation, name, event, why, version in steps:
        generation.apply(name, event, why, version)
        assert journal.journal_text() == whole()
    old.retire_at, new.counts.burnt = 2000.5, 7  # fields outside the names, changed in place
    journal.loaded = 2
    assert journal.journal_text() == whole()
    again = CatalogJournal.from_json(json.loads(journal.journal_text()))
    assert again.journal_text() == journal.journal_text()


def test_the_counts_kept_as_names_change_equal_a_recount() -> None:
    """The gauges read counts kept by `apply`, and a miss the held names of its id, not a pass
    over thousands of names: after each change they equal a recount of the names."""
    generation = Generation.render(1, [A1], 3, 1000.0)

    def recount() -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in NameState if s is not NameState.RETIRED), 0)
        for entry in generation.names.values():
            if entry.state is not NameState.RETIRED:
                counts[entry.state.value] += 1
        return counts

    steps = [(spare_name(1, 1), NameEvent.BIND, A2), (spare_name(1, 1), NameEvent.LEAVE, None),
             (spare_name(1, 2), NameEvent.READ, None), ("a1", NameEvent.LEAVE, None),
             (spare_name(1, 1), NameEvent.RETURN, None), (spare_name(1, 3), NameEvent.BIND, A1)]
    for name, event, version in steps:
        generation.apply(name, event, "why", version)
        assert generation.state_counts() == recount()
        assert generation.free_count() == len(generation.free_spares())
        for adapter_id in ("a1", "a2"):  # the held names by id, kept as they change
            assert generation.held_names_of(adapter_id) == {
                entry.version: held for held, entry in generation.names.items()
                if entry.version is not None and entry.version.adapter_id == adapter_id
                and entry.state in HELD}
    assert generation.count_in(NameState.BOUND) == 2 and generation.spare_count() == 3
    assert generation.own_ids() == {"a1"}
