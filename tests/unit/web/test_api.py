"""api.py's request body parse: the same objects and the same refusals as json.loads on bytes,
whatever the encoding the body came in."""

from __future__ import annotations

import json

import pytest

from sidecar.web.api import _parse_json

BODIES = [
    b'{"adapter_id": "a1"}',
    b'\xef\xbb\xbf{"adapter_id": "a1"}',  # a UTF-8 byte order mark
    '{"adapter_id": "\u00e9"}'.encode("utf-16"),
    '{"adapter_id": "a1"}'.encode("utf-16-le"),
    '{"adapter_id": "a1"}'.encode("utf-32"),
    b'{"adapter_id": "\xed\xa0\x80"}',  # a lone surrogate, as json.loads lets it through
    b'{"adapter_id": "\xff"}',
    b'{"adapter_id\x00": 1}',
    b"[1,",
    b"null",
]


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_parses_as_json_loads_parses_its_bytes(raw: bytes) -> None:
    def outcome(parse: object) -> object:
        try:
            return parse(raw)  # type: ignore[operator]
        except ValueError as exc:
            return type(exc)

    assert outcome(_parse_json) == outcome(json.loads)
