"""Tenants through the real sidecar (--tenants): a tenant's token acts only on its own ids, on
every mutating route; the router's token stages every id and nothing else; the operator's
token does everything; /stage can require a token. Off without the file."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from sidecar.process.app import Sidecar
from tests.support.api import StartSidecar, call
from tests.support.settings import local_registry_adapter, make_settings

OPERATOR = "operator-token-0123456789"
TOKENS = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}
ROUTER = "router-token-0123456789ab"
IDS = {"a": "tenant-a-chat", "b": "tenant-b-sql"}
MUTATING = ("stage", "pin", "unpin", "evict")


def tenants_file(tmp_path: Path, *, stage_requires_token: bool) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(f"""
stage_requires_token = {str(stage_requires_token).lower()}
[router]
token = "{ROUTER}"
[[tenants]]
name = "a"
prefix = "tenant-a-"
token = "{TOKENS["a"]}"
[[tenants]]
name = "b"
prefix = "tenant-b-"
token = "{TOKENS["b"]}"
""")
    return path


async def start(tmp_path: Path, start_sidecar: StartSidecar, *,
                stage_requires_token: bool = True) -> Sidecar:
    for seed, adapter_id in enumerate(IDS.values()):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    return await start_sidecar(make_settings(
        tmp_path, api_token=OPERATOR,
        tenants_file=str(tenants_file(tmp_path, stage_requires_token=stage_requires_token))))


async def ask(http: aiohttp.ClientSession, sidecar: Sidecar, route: str, adapter_id: str,
              token: str | None) -> tuple[int, dict[str, object]]:
    body: dict[str, object] = {"adapter_id": adapter_id}
    if route == "stage":
        body["lease"] = False
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return await call(http, "POST", f"{sidecar.url}/{route}", body, headers=headers)


def refusals(sidecar: Sidecar, route: str) -> float:
    return sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_tenant_refusals_total", {"route": route}) or 0.0


async def test_each_tenants_token_is_refused_on_the_other_tenants_ids_for_every_mutating_route(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    sidecar = await start(tmp_path, start_sidecar)
    for route in ("stage", "pin"):  # each tenant's ids cached and pinned by the operator
        for adapter_id in IDS.values():
            assert (await ask(http, sidecar, route, adapter_id, OPERATOR))[0] == 200

    for tenant, other in (("a", "b"), ("b", "a")):
        for route in MUTATING:
            status, body = await ask(http, sidecar, route, IDS[other], TOKENS[tenant])

            assert status == 403, (tenant, route, body)
            assert body["error"] == "forbidden"
            assert f"'tenant-{tenant}-'" in str(body["message"])  # the prefix it may use
            assert refusals(sidecar, route) == (1 if tenant == "a" else 2)
    # Nothing the refused calls asked for happened: both still cached and pinned.
    for adapter_id in IDS.values():
        adapter = sidecar.store.get(adapter_id)
        assert adapter is not None and sidecar.store.is_pinned(adapter_id)

    for tenant, adapter_id in IDS.items():  # each on its own ids: every route
        for route in ("stage", "unpin", "pin", "unpin", "evict"):
            status, body = await ask(http, sidecar, route, adapter_id, TOKENS[tenant])
            assert status == 200, (tenant, route, body)
        assert sidecar.store.get(adapter_id) is None


async def test_the_routers_token_stages_every_id_and_nothing_else_and_stage_can_need_a_token(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    sidecar = await start(tmp_path, start_sidecar)

    for adapter_id in IDS.values():
        assert (await ask(http, sidecar, "stage", adapter_id, ROUTER))[0] == 200
        for route in ("pin", "unpin", "evict"):
            status, body = await ask(http, sidecar, route, adapter_id, ROUTER)
            assert status == 403 and "router" in str(body["message"]), (route, body)
        status, body = await ask(http, sidecar, "stage", adapter_id, None)
        assert status == 401 and body["error"] == "unauthorized"
        status, body = await ask(http, sidecar, "stage", adapter_id, "no-such-token-0123456789")
        assert status == 401
    status, body = await call(http, "POST", f"{sidecar.url}/catalog/compact", {},
                              headers={"Authorization": f"Bearer {TOKENS['a']}"})
    assert status == 403, body


async def test_stage_stays_open_to_callers_without_a_token_unless_the_file_says_otherwise(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    sidecar = await start(tmp_path, start_sidecar, stage_requires_token=False)

    assert (await ask(http, sidecar, "stage", IDS["a"], None))[0] == 200
    # A tenant's token is still held to its prefix, and the other routes need a token.
    assert (await ask(http, sidecar, "stage", IDS["b"], TOKENS["a"]))[0] == 403
    assert (await ask(http, sidecar, "evict", IDS["a"], None))[0] == 401
