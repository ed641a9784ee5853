"""router_errors.py against the sidecar: every error code the sidecar answers has a status the
router chose for it, and the choices keep the rule that UNAVAILABLE is for what another node can
help with. A new SidecarError fails here until the router's table says what it means."""

from __future__ import annotations

from tests.support.api import api_error_codes
from tests.triton.harness import import_router

router_errors = import_router("router_errors")
Status = router_errors.Status


def test_every_code_the_sidecar_answers_is_in_the_routers_table_and_no_other() -> None:
    codes = api_error_codes()
    table = router_errors.STATUS_BY_CODE
    assert "registry_transient" in codes  # a subclass's subclass: the walk goes all the way down

    missing = sorted(set(codes) - set(table))
    assert not missing, f"the router's STATUS_BY_CODE has no status for {missing}"
    stale = sorted(set(table) - set(codes))
    assert not stale, f"the router's STATUS_BY_CODE names codes the sidecar never answers: {stale}"
    assert router_errors.HOLD_CODES | {"cache_full"} <= set(codes)  # the codes it retries on


def test_the_routers_statuses_agree_with_the_sidecars_http_statuses() -> None:
    for code, http_status in api_error_codes().items():
        status = router_errors.STATUS_BY_CODE[code]
        if http_status in (503, 504, 507):  # this node cannot, now: another node may
            assert status is Status.UNAVAILABLE, code
        if status is Status.NOT_FOUND:
            assert http_status == 404, code
        if status is Status.INVALID_ARG:
            assert http_status in (400, 422), code
