"""The tenants file: what it grants, and every problem of a bad one named at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.web.tenants import ROUTER, Tenants

A_TOKEN = "tenant-a-token-0123456789"
B_TOKEN = "tenant-b-token-0123456789"
ROUTER_TOKEN = "router-token-0123456789ab"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_each_token_is_its_tenant_and_a_prefix_covers_only_ids_that_start_with_it(
    tmp_path: Path,
) -> None:
    tenants = Tenants.load(write(tmp_path, f"""
stage_requires_token = true
[router]
token = "{ROUTER_TOKEN}"
[[tenants]]
name = "a"
prefix = "tenant-a-"
token = "{A_TOKEN}"
[[tenants]]
name = "b"
prefix = "tenant-b-"
token = "{B_TOKEN}"
"""))

    a, b = tenants.caller(A_TOKEN), tenants.caller(B_TOKEN)
    assert a is not None and a.name == "a" and b is not None and b.name == "b"
    assert tenants.caller(ROUTER_TOKEN) is ROUTER
    assert tenants.caller("not-a-token-of-anyone") is None and tenants.caller(None) is None
    assert a.owns("tenant-a-chat") and not a.owns("tenant-b-chat")
    assert not a.owns("tenant-ab-chat")  # a prefix ends in a separator
    assert tenants.on and tenants.stage_requires_token


def test_a_file_of_800_tenants_gives_each_token_its_own_tenant(tmp_path: Path) -> None:
    """Found by the token's digest (not by comparing every entry, whose cost grew with the
    tenants on every request): each of 800 tokens is its own tenant, the router's is the
    router, and near misses (a character more or less, another case) are no one."""
    entries = "".join(f'[[tenants]]\nname = "t{i}"\nprefix = "t{i}-"\n'
                      f'token = "tenant-{i:04d}-token"\n' for i in range(800))
    tenants = Tenants.load(write(tmp_path, f'[router]\ntoken = "{ROUTER_TOKEN}"\n{entries}'))

    assert len(tenants.tenants) == 800
    for i in range(800):
        found = tenants.caller(f"tenant-{i:04d}-token")
        assert found is not None and found.name == f"t{i}" and found.owns(f"t{i}-x"), i
    assert tenants.caller(ROUTER_TOKEN) is ROUTER
    for near in ("tenant-0001-token ", "tenant-0001-toke", "Tenant-0001-token", "", " "):
        assert tenants.caller(near) is None, near


def test_without_a_file_nothing_applies() -> None:
    assert not Tenants().on


def test_every_problem_of_a_bad_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        Tenants.load(write(tmp_path, f"""
stage_requires_token = "yes"
colour = "blue"
[[tenants]]
name = "a"
prefix = "tenant-a"
token = "{A_TOKEN}"
[[tenants]]
name = "b"
prefix = "tenant-b/"
token = "{B_TOKEN}"
[[tenants]]
name = "c"
prefix = "tenant-c-"
token = "short"
[[tenants]]
name = "d"
prefix = "tenant-d-"
token = "{ROUTER_TOKEN}"
[[tenants]]
name = "e"
prefix = "tenant-e-"
token = "{ROUTER_TOKEN}"
"""))
    message = str(raised.value)
    assert "stage_requires_token must be true or false" in message
    assert "unknown key 'colour'" in message
    assert "prefix 'tenant-a'" in message and "prefix 'tenant-b/'" in message
    assert "at least 16 characters" in message
    assert "used twice" in message


def test_a_file_that_is_not_toml_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid TOML"):
        Tenants.load(write(tmp_path, "[[tenants]\n"))
