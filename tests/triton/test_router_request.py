"""routing.py's reading of a request: the adapter it names, by the header a routing proxy hashed
on or by the input. (Sampling parameters are refused before staging: test_routing.py.)"""

from __future__ import annotations

import pytest

from tests.triton.harness import import_router

routing = import_router()
requested_adapter_id = routing.requested_adapter_id
RouteError = routing.RouteError


@pytest.mark.parametrize(("input_value", "parameters", "expected"), [
    ("a1", None, "a1"),
    ("a1", "{}", "a1"),
    (None, '{"x-adapter-id": "a2"}', "a2"),
    (None, '{"X-Adapter-Id": "a2"}', "a2"),  # Triton keeps an HTTP header's spelling
    ("", '{"x-adapter-id": "a2"}', "a2"),
    ("a3", '{"x-adapter-id": "a3", "other": 1}', "a3"),
])
def test_the_adapter_comes_from_the_header_or_the_input(
    input_value: str | None, parameters: str | None, expected: str
) -> None:
    assert requested_adapter_id(input_value, parameters) == expected


@pytest.mark.parametrize(("input_value", "parameters", "expected"), [
    ("a1", '{"x-adapter-id": "a2"}', "name different adapters"),
    (None, None, "send the x-adapter-id header or the adapter_id input"),
    (None, '{"x-adapter-id": 7}', "as a string"),
])
def test_a_missing_or_conflicting_adapter_id_is_an_invalid_argument(
    input_value: str | None, parameters: str | None, expected: str
) -> None:
    with pytest.raises(RouteError) as caught:
        requested_adapter_id(input_value, parameters)

    assert caught.value.status == "INVALID_ARG"
    assert expected in caught.value.message
