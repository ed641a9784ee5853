"""ids.py: the one rule an adapter id from outside must meet, and the error that says it."""

from __future__ import annotations

import pytest

from sidecar.core.errors import InvalidAdapterId
from sidecar.core.ids import check_adapter_id, is_valid_adapter_id


@pytest.mark.parametrize("adapter_id", ["a", "sql-v1", "Tenant_7.v2", "9" * 128])
def test_letters_digits_dots_dashes_and_underscores_make_an_id(adapter_id: str) -> None:
    assert is_valid_adapter_id(adapter_id)
    assert check_adapter_id(adapter_id) == adapter_id


@pytest.mark.parametrize("adapter_id", [
    "", ".", "..", "_spare-g1-0001", "-a", ".hidden", "a/b", "../etc", "a b", "é",
    "a" * 129, None, 7, b"a1",
])
def test_anything_else_is_refused_with_what_an_id_may_be(adapter_id: object) -> None:
    assert not is_valid_adapter_id(adapter_id)
    with pytest.raises(InvalidAdapterId, match="ids are 1-128 characters"):
        check_adapter_id(adapter_id)
