"""What an adapter id may be: the one rule every module that takes an id from outside checks."""

from __future__ import annotations

import re

from .errors import InvalidAdapterId

ADAPTER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def is_valid_adapter_id(adapter_id: object) -> bool:
    """Strict id check: the pattern, and never a name the filesystem treats specially."""
    return (
        isinstance(adapter_id, str)
        and ADAPTER_ID_PATTERN.fullmatch(adapter_id) is not None
        and adapter_id not in (".", "..")
    )


def check_adapter_id(adapter_id: object) -> str:
    if not is_valid_adapter_id(adapter_id):
        shown = repr(adapter_id)[:80]
        raise InvalidAdapterId(
            f"invalid adapter id {shown}: ids are 1-128 characters of letters, digits, '.', "
            "'_' and '-', starting with a letter or digit"
        )
    assert isinstance(adapter_id, str)
    return adapter_id
