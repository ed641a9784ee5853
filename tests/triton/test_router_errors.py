"""The router carries what the sidecar decides: no copy of the sidecar's error codes lives in
the router's folder (its answers say the Triton status and message), and the folder stays small
enough to read in one sitting."""

from __future__ import annotations

import re

from tests.support.api import api_error_codes
from tests.triton.harness import ROUTER, TRITON_REPO

ROUTER_FILES = sorted((TRITON_REPO / ROUTER).rglob("*.py"))
ROUTER_LINES_MAX = 400


def test_no_error_code_of_the_sidecar_is_copied_into_the_router() -> None:
    codes = api_error_codes()
    assert {"registry_transient", "catalog_reloading", "engine_unavailable"} <= set(codes)
    copies = [(path.name, code) for path in ROUTER_FILES for code in codes
              if re.search(rf"\b{code}\b", path.read_text())]

    assert ROUTER_FILES and not copies, f"the router keeps the sidecar's codes: {copies}"


def test_the_router_is_at_most_400_lines() -> None:
    lines = sum(len(path.read_text().splitlines()) for path in ROUTER_FILES)

    assert lines <= ROUTER_LINES_MAX, f"{lines} lines in {[p.name for p in ROUTER_FILES]}"
