"""Fixtures of the validation tests: a signing key of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.signing_keys import KeyPair, make_key


@pytest.fixture
def key(tmp_path: Path) -> KeyPair:
    return make_key(tmp_path / "keys", "acme-2026")
