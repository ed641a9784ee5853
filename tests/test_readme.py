"""The README's error table against the code: every error code the API can answer is listed,
with the status the API answers it with."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar import errors
from sidecar.web import api

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_error_table() -> dict[str, set[int]]:
    """`error` code -> the statuses its rows give, from the table whose header is
    `| status | `error` | when |`."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines)
                 if re.fullmatch(r"\|\s*status\s*\|\s*`error`\s*\|\s*when\s*\|", line.strip()))
    table: dict[str, set[int]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        status, codes = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for code in re.findall(r"`([a-z_]+)`", codes):
            table.setdefault(code, set()).add(int(status))
    return table


def api_error_codes() -> dict[str, int]:
    """Every code the API answers: each SidecarError (raised by the stager, the store, the
    catalog, or built by /readyz) with its status, and the HTTP layer's own codes."""
    codes: dict[str, int] = {}
    pending: list[type[errors.SidecarError]] = [errors.SidecarError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        codes[cls.code] = api.STATUS.get(cls) or next(
            (api.STATUS[base] for base in cls.__mro__ if base in api.STATUS), 500)
    for status, code in api._HTTP_CODES.items():
        codes.setdefault(code, status)
    return codes


def test_every_error_code_of_the_api_is_in_the_readme_with_its_status() -> None:
    table = readme_error_table()
    codes = api_error_codes()
    assert {"not_ready", "not_found", "method_not_allowed", "internal_error"} <= set(codes)
    missing = sorted(code for code in codes if code not in table)
    assert not missing, f"README's error table lacks {missing}"
    wrong = {code: (status, sorted(table[code])) for code, status in codes.items()
             if status not in table[code]}
    assert not wrong, f"README gives other statuses (code: (API's, README's)): {wrong}"


def test_the_readme_lists_no_code_the_api_cannot_answer() -> None:
    stale = sorted(set(readme_error_table()) - set(api_error_codes()))
    assert not stale, f"README's error table lists codes the API never answers: {stale}"
