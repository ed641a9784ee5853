"""Remembered verdicts: a refusal holds for the upload it judged, for --refusal-ttl, and is
checked against a fresh listing at most once a RELIST_REFUSED_S; "not found" for its own TTL."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.refusals import RELIST_REFUSED_S, Refusals
from sidecar.core.errors import AdapterNotFound, InvalidAdapter
from sidecar.core.metrics import Metrics
from sidecar.validation.problem import Problem

UPLOAD = (("adapter_model.safetensors", 10, "etag-1"),)
FIXED = (("adapter_model.safetensors", 10, "etag-2"),)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def refusals(clock: Clock, *, refusal_ttl_s: float = 60.0,
             not_found_ttl_s: float = 2.0) -> Refusals:
    return Refusals(Metrics(CollectorRegistry(), process=False), refusal_ttl_s=refusal_ttl_s,
                    not_found_ttl_s=not_found_ttl_s, monotonic=clock)


def test_a_refusal_is_answered_from_memory_for_the_same_upload_until_it_expires() -> None:
    clock = Clock()
    memory = refusals(clock)
    error = memory.refuse("a", [Problem("rank_too_large", "adapter_config.json", "r 64")], UPLOAD)
    assert error.remembered_until is not None

    with pytest.raises(InvalidAdapter) as raised:
        memory.raise_if_remembered("a")  # within RELIST_REFUSED_S: no listing needed
    assert raised.value.to_json()["remembered"] is True

    clock.now_s += RELIST_REFUSED_S
    memory.raise_if_remembered("a")  # time to list again: the caller lists
    with pytest.raises(InvalidAdapter):
        memory.recall("a", UPLOAD)  # the same upload: the same verdict

    clock.now_s += 60.0
    memory.raise_if_remembered("a")  # expired: forgotten
    memory.recall("a", UPLOAD)


def test_a_changed_upload_is_judged_afresh_and_forget_drops_the_verdict() -> None:
    clock = Clock()
    memory = refusals(clock)
    memory.refuse("a", [Problem("signature_missing", "model.sig", "none")], UPLOAD)

    memory.recall("a", FIXED)  # another upload: nothing raised, the verdict dropped
    clock.now_s += RELIST_REFUSED_S
    memory.recall("a", UPLOAD)

    memory.refuse("b", [Problem("signature_missing", "model.sig", "none")], UPLOAD)
    assert memory.forget("b") is True
    assert memory.forget("b") is False
    memory.raise_if_remembered("b")


def test_not_found_is_remembered_for_its_ttl_only() -> None:
    clock = Clock()
    memory = refusals(clock)
    memory.not_found(AdapterNotFound("no adapter 'x'", adapter_id="x"))

    with pytest.raises(AdapterNotFound, match="--not-found-ttl"):
        memory.raise_if_remembered("x")
    clock.now_s += 2.0
    memory.raise_if_remembered("x")


def test_with_no_ttl_nothing_is_remembered() -> None:
    clock = Clock()
    memory = refusals(clock, refusal_ttl_s=0, not_found_ttl_s=0)
    error = memory.refuse("a", [Problem("signature_missing", "model.sig", "none")], UPLOAD)
    memory.not_found(AdapterNotFound("no adapter 'x'", adapter_id="x"))

    assert error.remembered_until is None
    memory.raise_if_remembered("a")
    memory.raise_if_remembered("x")


def test_not_found_ids_stay_within_their_bound_the_soonest_to_expire_ending_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sidecar.cache.refusals.NOT_FOUND_MAX", 4)
    clock = Clock()
    memory = refusals(clock, not_found_ttl_s=10.0)

    def missing(adapter_id: str) -> None:
        memory.not_found(AdapterNotFound(f"no adapter {adapter_id!r}", adapter_id=adapter_id))

    for adapter_id in ("a", "b", "c"):  # at 100, 101, 102
        missing(adapter_id)
        clock.now_s += 1.0
    missing("b")  # again at 103: b now expires last of the three
    missing("d")
    missing("e")  # the bound: a, the soonest to expire, goes
    missing("f")  # then c, not b
    for forgotten in ("a", "c"):
        memory.raise_if_remembered(forgotten)  # the caller lists the registry
    for adapter_id in ("b", "d", "e", "f"):
        with pytest.raises(AdapterNotFound):
            memory.raise_if_remembered(adapter_id)

    clock.now_s = 113.0  # every one remembered at 103 has expired: they go at the next
    missing("g")
    assert list(memory._not_found) == ["g"]
