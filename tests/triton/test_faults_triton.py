"""Triton late, blinking or slow, for real: a real Triton started after the sidecar, and a real
HTTP server in front of Triton's HTTP port answering one readiness probe with 503, holding a
probe, or refusing every call for a while. The sidecar must not restart a healthy engine, must
keep answering /stage for what the serving engine has loaded, and must serve within seconds of
Triton becoming ready."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc.aio as grpcclient

from sidecar.process.app import Sidecar
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.api import StartSidecar, call
from tests.support.s3 import S3Registry
from tests.support.settings import s3_settings
from tests.support.waiting import eventually
from tests.triton.harness import free_port
from tests.triton.node import StartNodeSidecar, TritonNode, ask, start_triton_node
from tests.triton.standin_vllm.answer import expected_text
from tests.triton.triton_proxy import TritonProxy

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
async def proxy(triton_node: TritonNode) -> AsyncIterator[TritonProxy]:
    proxy = await TritonProxy(triton_node.server.http_url).start()
    yield proxy
    await proxy.stop()


async def stage(http: aiohttp.ClientSession, sidecar: Sidecar, adapter_id: str) -> tuple[
    int, Any]:
    return await call(http, "POST", f"{sidecar.url}/stage",
                      {"adapter_id": adapter_id, "lease": False})


class Probes:
    """The sidecar's readiness probes of Triton, counted from now: started, and finished (the
    answer, or the failure, fed to its state machine)."""

    def __init__(self, sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = self.finished = 0
        probe = sidecar.reloads.probe

        async def counted() -> None:
            self.started += 1
            try:
                await probe()
            finally:
                self.finished += 1

        monkeypatch.setattr(sidecar.reloads, "probe", counted)

    def next_applied(self, timeout_s: float = 30) -> Awaitable[None]:
        """Until the first probe started after this call has been answered and its answer
        applied (counted from the call, whenever the wait is awaited)."""
        target = self.started + 1
        return eventually(lambda: self.finished >= target, timeout_s=timeout_s, poll_s=0.05,
                          what="the sidecar's next probe of Triton")


async def probe_reaches(proxy: TritonProxy) -> None:
    """Until the sidecar's next readiness probe reaches the proxy."""

    def reached() -> int:
        return sum(1 for c in proxy.calls if c.endswith("/ready"))

    seen = reached()
    await eventually(lambda: reached() > seen, timeout_s=30, poll_s=0.05,
                     what="a probe reaching the proxy")


def base_config(tmp_path: Path) -> Path:
    path = tmp_path / "base-model-config.json"
    path.write_text(json.dumps(TINY_LLAMA.to_config()))
    return path


async def test_a_triton_that_starts_after_the_sidecar_is_served_within_seconds(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = s3.put_adapter("early-v1", seed=1)
    http_port, sidecar_port = free_port(), free_port()
    cache_root = tmp_path / "node" / "cache"
    cache_root.mkdir(parents=True)
    sidecar = await start_sidecar(s3_settings(
        tmp_path, s3, cache_root=cache_root, port=sidecar_port,
        triton_url=f"http://127.0.0.1:{http_port}",
        triton_reload_min_interval_s=3600.0, base_model_config=base_config(tmp_path)))
    probes = Probes(sidecar, monkeypatch)
    status, body = await stage(http, sidecar, "early-v1")
    assert status == 503 and body["error"] == "catalog_pending", body
    assert "does not answer" in body["message"]
    for _ in range(2):  # a few failed probes: none may start the interval
        await probes.next_applied()

    node = await asyncio.to_thread(start_triton_node, tmp_path / "node", http_port=http_port,
                                   cache_root=cache_root, sidecar_port=sidecar_port)
    try:
        ready_at = time.monotonic()

        async def served() -> bool:
            return (await stage(http, sidecar, "early-v1"))[0] == 200

        await eventually(served, timeout_s=60, poll_s=0.1,
                         what="served (or does the minimum interval wait?)")
        served_s = time.monotonic() - ready_at

        async with grpcclient.InferenceServerClient(node.server.grpc_url) as client:
            assert await ask(client, "early-v1", "x") == expected_text(files[WEIGHTS], "x")
        assert served_s < 30  # with --triton-reload-min-interval 3600
    finally:
        node.stop()


async def test_one_probe_answered_503_neither_reloads_nor_stops_stage(
    s3: S3Registry, node_sidecar: StartNodeSidecar, proxy: TritonProxy,
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3.put_adapter("a-v1", seed=2)
    sidecar = await node_sidecar(triton_url=proxy.url)
    probes = Probes(sidecar, monkeypatch)
    before = proxy.repository_calls()
    proxy.ready_failures = 1

    await probes.next_applied()
    during = await stage(http, sidecar, "a-v1")
    await probes.next_applied()

    assert during[0] == 200, during
    assert proxy.repository_calls() == before
    assert sidecar.reloads.status()["triton"]["state"] == "serving"


async def test_a_hung_probe_holds_nothing_and_ends_as_one_failed_probe(
    s3: S3Registry, node_sidecar: StartNodeSidecar, proxy: TritonProxy,
    http: aiohttp.ClientSession, grpc: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = {a: s3.put_adapter(a, seed=3 + n)[WEIGHTS] for n, a in enumerate(("a", "b"))}
    sidecar = await node_sidecar(triton_url=proxy.url, triton_probe_timeout_s=1.0)
    assert (await stage(http, sidecar, "a"))[0] == 200
    probes = Probes(sidecar, monkeypatch)
    await probes.next_applied()  # from here on, every probe is counted
    before = proxy.repository_calls()
    proxy.hang_ready = asyncio.Event()

    hung = probes.next_applied()  # ends past the probe's own timeout
    await probe_reaches(proxy)  # hanging now
    started = time.monotonic()
    during = await stage(http, sidecar, "b")  # a binding: the catalog's lock is free
    bound_s = time.monotonic() - started
    answer = await ask(grpc, "b", "x")
    await hung
    state_after_timeout = sidecar.reloads.status()["triton"]["state"]
    proxy.hang_ready.set()
    proxy.hang_ready = None
    await probes.next_applied()

    assert during[0] == 200, during
    assert bound_s < 1.0
    assert answer == expected_text(weights["b"], "x")
    assert state_after_timeout == "suspect"  # one failed probe: no evidence of a lost engine
    assert sidecar.reloads.status()["triton"]["state"] == "serving"
    assert proxy.repository_calls() == before


async def test_triton_unreachable_for_a_while_is_declared_lost_then_taken_back_without_a_load(
    s3: S3Registry, node_sidecar: StartNodeSidecar, proxy: TritonProxy,
    http: aiohttp.ClientSession,
) -> None:
    s3.put_adapter("a-v1", seed=5)
    sidecar = await node_sidecar(triton_url=proxy.url, triton_probe_timeout_s=1.0)
    assert (await stage(http, sidecar, "a-v1"))[0] == 200
    before = proxy.repository_calls()

    def state() -> str:
        return str(sidecar.reloads.status()["triton"]["state"])

    proxy.down = True
    deadline = time.monotonic() + 30
    await eventually(lambda: state() == "unreachable", timeout_s=30, poll_s=0.1,
                     what="Triton declared unreachable")
    lost = await stage(http, sidecar, "a-v1")
    proxy.down = False
    await eventually(lambda: state() == "serving", timeout_s=deadline - time.monotonic(),
                     poll_s=0.1, what="Triton taken back")

    assert lost[0] == 503 and "does not answer" in lost[1]["message"]
    assert (await stage(http, sidecar, "a-v1"))[0] == 200
    # The model answered ready from the catalog file it was confirmed with: nothing to load.
    assert proxy.repository_calls() == before


async def test_during_an_on_change_reload_what_the_serving_engine_loaded_stays_servable(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    node = start_triton_node(tmp_path / "node", env={"STANDIN_VLLM_LOAD_DELAY_S": "4"})
    try:
        files = {a: s3.put_adapter(a, seed=10 + n)[WEIGHTS]
                 for n, a in enumerate(("listed", "bound", "fresh"))}
        sidecar = await start_sidecar(s3_settings(
            tmp_path, s3, cache_root=node.cache_root, port=node.sidecar_port,
            triton_url=node.server.http_url, triton_reload_min_interval_s=0.0,
            base_model_config=base_config(tmp_path)))
        await sidecar.reloads.sync()
        assert (await stage(http, sidecar, "listed"))[0] == 200
        sidecar.reloads.request_compaction()
        await sidecar.reloads.sync()  # generation 2 lists it by its own name
        status, body = await stage(http, sidecar, "bound")
        assert status == 200 and body["lora_name"].startswith("_spare-g2-"), body

        status, _ = await call(http, "POST", f"{sidecar.url}/catalog/compact", {})
        assert status == 202
        def reloading() -> bool:
            return bool(sidecar.reloads.status()["triton"]["reloading"])

        deadline = time.monotonic() + 30
        await eventually(reloading, timeout_s=30, poll_s=0.05, what="the reload under way")
        during = {a: await stage(http, sidecar, a) for a in ("listed", "bound", "fresh")}
        await eventually(lambda: not reloading(), timeout_s=deadline - time.monotonic(),
                         poll_s=0.05, what="the reload done")

        assert {a: s for a, (s, _) in during.items()} == {"listed": 200, "bound": 200,
                                                           "fresh": 200}
        assert during["listed"][1]["lora_name"] == "listed"
        assert during["bound"][1]["lora_name"] == body["lora_name"]
        assert during["fresh"][1]["lora_name"].startswith("_spare-g2-")
        async with grpcclient.InferenceServerClient(node.server.grpc_url) as client:
            for adapter_id, data in files.items():
                assert await ask(client, adapter_id, "y") == expected_text(data, "y")
    finally:
        node.stop()
