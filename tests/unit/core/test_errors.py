"""core/errors.py: each error says what a client of the router sees (the Triton status, the
message, whether asking again can help), and those choices keep one rule: UNAVAILABLE is for
what another node, or this one later, can help with."""

from __future__ import annotations

from sidecar.core import errors
from sidecar.web import api
from tests.support.api import api_error_codes

STATUSES = {"NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "INTERNAL"}


def every_error() -> list[type[errors.SidecarError]]:
    found, pending = [], [errors.SidecarError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_each_error_has_a_triton_status_that_agrees_with_its_http_status() -> None:
    http = api_error_codes()
    for cls in every_error():
        status, code = cls.triton_status, cls.code
        assert status in STATUSES, code
        if http[code] in (503, 504, 507):  # this node cannot, now: another node may
            assert status == "UNAVAILABLE", code
        if status == "NOT_FOUND":
            assert http[code] == 404, code
        if status == "INVALID_ARG":
            assert http[code] in (400, 422), code
        if cls.retry_helps:
            assert status == "UNAVAILABLE", code


def test_the_answer_carries_what_a_client_sees() -> None:
    body = errors.CatalogReloading("Triton is loading generation 3", adapter_id="a1").to_json()

    assert body == {"error": "catalog_reloading", "message": "Triton is loading generation 3",
                    "adapter_id": "a1", "triton_status": "UNAVAILABLE", "retryable": True,
                    "triton_message": "Triton is loading generation 3 (catalog_reloading)"}
    assert api.status_of(errors.CatalogReloading("x")) == 503


def test_a_cache_full_that_waiting_cannot_fix_is_not_retryable() -> None:
    assert errors.CacheFull("larger than the budget", retryable=False).to_json()[
        "retryable"] is False
    assert errors.CacheFull("leased", retryable=True).to_json()["retryable"] is True


def test_a_refused_adapter_lists_every_problem_with_its_code_for_the_client() -> None:
    problems = [{"file": "adapter_config.json", "code": "rank_too_large", "message": "r 32"}] + [
        {"file": f"f{n}", "code": "bad", "message": "no"} for n in range(6)]

    body = errors.InvalidAdapter("wide-v1", problems).to_json()

    assert body["triton_status"] == "INVALID_ARG" and body["retryable"] is False
    assert body["triton_message"].startswith(
        "adapter wide-v1 was refused by validation: adapter_config.json: r 32 [rank_too_large]")
    assert "f5: no [bad]" in body["triton_message"]  # all of them, not the first five
    assert body["triton_message"].endswith("(invalid_adapter)")


def test_a_registry_error_names_its_cause_for_the_client() -> None:
    body = errors.RegistryError("access denied", cause="permission").to_json()

    assert body["triton_status"] == "INTERNAL"
    assert body["triton_message"] == "access denied [cause: permission] (registry_error)"
