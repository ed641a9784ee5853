"""Pins still waiting: a pin the sidecar cannot stage holds readiness back and is retried, and
unpinning it stops both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.support.api import StartSidecar, call, readiness
from tests.support.settings import local_registry_adapter, make_settings


async def test_unpinning_a_pin_still_pending_makes_the_sidecar_ready(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "ok")
    local_registry_adapter(tmp_path, "refused", rank=32)  # can never be staged as it is
    sidecar = await start_sidecar(make_settings(tmp_path, pin=("refused",)))
    status, ready = await readiness(http, sidecar.url, mentioning="pin refused")
    assert status == 503 and "pin refused: invalid_adapter" in ready["message"], ready

    status, body = await call(http, "POST", f"{sidecar.url}/unpin", {"adapter_id": "refused"})
    assert status == 200 and body["was_pinned"] is True, body
    status, ready = await call(http, "GET", f"{sidecar.url}/readyz")
    assert status == 200, ready
    tasks = {task.get_name() for task in asyncio.all_tasks()}
    assert "pin:refused" not in tasks, "the pin is still being retried"
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "ok", "lease": False})
    assert status == 200
