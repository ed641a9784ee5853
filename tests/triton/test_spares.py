"""Spare catalog names in a real Triton (the router, the stock backend's contract on the CPU
stand-in): new adapters served with no call to Triton's model repository, counted by a real
HTTP proxy in front of Triton; a compaction when spares run out; every catalogued name called
directly; bindings across a sidecar restart and a Triton restart; the engine killed on purpose
and served again."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from sidecar.catalog.disk import NoopAdapter
from sidecar.validation.options import LLAMA_TARGET_MODULES
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.api import StartSidecar, call
from tests.support.s3 import S3Registry
from tests.support.settings import s3_settings
from tests.support.waiting import eventually
from tests.triton.harness import ROUTER, TritonServer, router_config
from tests.triton.node import (
    StartNodeSidecar,
    TritonNode,
    ask,
    direct_call,
    start_triton_node,
)
from tests.triton.standin_vllm.answer import expected_text
from tests.triton.triton_proxy import TritonProxy

WEIGHTS = "adapter_model.safetensors"
NOOP_WEIGHTS = NoopAdapter.for_model(TINY_LLAMA, LLAMA_TARGET_MODULES).weights


@pytest.fixture
async def proxy(triton_node: TritonNode) -> AsyncIterator[TritonProxy]:
    proxy = await TritonProxy(triton_node.server.http_url).start()
    yield proxy
    await proxy.stop()


async def ask_until_served(client: grpcclient.InferenceServerClient, adapter_id: str,
                           prompt: str, timeout_s: float = 60.0) -> tuple[str, list[str]]:
    """Call the router, retrying UNAVAILABLE as a client should; the answer and the
    UNAVAILABLE messages seen on the way."""
    seen: list[str] = []

    async def answered() -> tuple[str] | None:
        try:
            return (await ask(client, adapter_id, prompt),)
        except InferenceServerException as exc:
            if "UNAVAILABLE" not in str(exc.status()):
                raise
            seen.append(exc.message())
            return None

    # A client's back-off between two calls.
    (answer,) = await eventually(answered, timeout_s=timeout_s, poll_s=0.2,
                                 what=lambda: f"{adapter_id} served (last: {seen[-1:]})")
    return answer, seen


async def test_twenty_new_adapters_are_served_without_a_reload_while_another_tenant_calls(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any, proxy: TritonProxy
) -> None:
    steady = s3.put_adapter("steady-v1", seed=1)[WEIGHTS]
    sidecar = await node_sidecar(triton_url=proxy.url)
    assert await ask(grpc, "steady-v1", "warm") == expected_text(steady, "warm")
    before = proxy.repository_calls()
    stop = asyncio.Event()
    errors: list[BaseException] = []
    answers = 0

    async def other_tenant() -> None:
        nonlocal answers
        while not stop.is_set():
            try:
                assert await ask(grpc, "steady-v1", "tick") == expected_text(steady, "tick")
                answers += 1
            except Exception as exc:
                errors.append(exc)

    tenant = asyncio.create_task(other_tenant())
    try:
        for n in range(20):
            files = s3.put_adapter(f"new-{n}-v1", seed=100 + n)
            assert await ask(grpc, f"new-{n}-v1", "hello") == expected_text(files[WEIGHTS],
                                                                          "hello")
    finally:
        stop.set()
        await tenant

    assert proxy.repository_calls() == before  # no load, no unload
    assert errors == []
    assert answers > 0
    bound = sidecar.reloads.status()["spares"]["bound"]
    assert sorted(v.split("@")[0] for v in bound.values()) == sorted(
        ["steady-v1", *(f"new-{n}-v1" for n in range(20))])


async def test_running_out_of_spares_costs_one_compaction_then_every_adapter_answers(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any, proxy: TritonProxy
) -> None:
    sidecar = await node_sidecar(triton_url=proxy.url, spare_names=4, compact_below=0)
    before = len(proxy.repository_calls())
    weights = {f"t{n}-v1": s3.put_adapter(f"t{n}-v1", seed=200 + n)[WEIGHTS] for n in range(6)}

    for adapter_id in weights:
        answer, _ = await ask_until_served(grpc, adapter_id, "first")
        assert answer == expected_text(weights[adapter_id], "first")
    for adapter_id, data in weights.items():
        assert await ask(grpc, adapter_id, "again") == expected_text(data, "again")

    assert len(proxy.repository_calls()) - before == 1
    status = sidecar.reloads.status()
    assert status["generation"] == 2
    assert sorted(status["adapter_ids"]) == [f"t{n}-v1" for n in range(4)]


async def test_direct_calls_with_every_catalogued_name_leave_the_engine_serving(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any,
    proxy: TritonProxy, http: aiohttp.ClientSession,
) -> None:
    files = {a: s3.put_adapter(a, seed=300 + n)[WEIGHTS]
             for n, a in enumerate(("own-gone", "own-here", "bound-gone", "bound-here", "late"))}
    sidecar = await node_sidecar(triton_url=proxy.url, spare_names=4, compact_below=0,
                                 max_adapters=2)

    async def stage(adapter_id: str) -> str:
        status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                  {"adapter_id": adapter_id, "lease": False})
        assert status == 200, body
        return str(body["lora_name"])

    await stage("own-gone")
    await stage("own-here")
    sidecar.reloads.request_compaction()
    await sidecar.reloads.sync()  # generation 2 lists both by their own names
    bound_gone = await stage("bound-gone")  # evicts own-gone: its name is parked at a no-op
    await stage("own-here")
    bound_here = await stage("bound-here")  # evicts bound-gone: parked too
    assert not (triton_node.cache_root / "adapters" / "bound-gone").exists()
    calls = len(proxy.repository_calls())
    status = sidecar.reloads.status()
    assert sorted(status["spares"]["parked"]) == sorted(["own-gone", bound_gone])
    names = sorted(status["adapter_ids"]) + [f"_spare-g2-000{n}" for n in range(1, 5)]
    unbound = [n for n in names if n.startswith("_spare-") and n not in (bound_gone, bound_here)]
    url = triton_node.server.grpc_url
    sampling = {"temperature": 0, "max_tokens": 64}

    answers = {name: "".join(await asyncio.to_thread(direct_call, url, "Hi",
                                                     {**sampling, "lora_name": name}))
               for name in names}

    noop = expected_text(NOOP_WEIGHTS, "Hi")
    assert answers == {
        "own-gone": noop,  # evicted: its own name answers like the base model
        "own-here": expected_text(files["own-here"], "Hi"),
        bound_gone: noop,  # evicted: parked at its no-op, no copy of its bytes kept
        bound_here: expected_text(files["bound-here"], "Hi"),
        **{spare: noop for spare in unbound},
    }
    with pytest.raises(RuntimeError, match="LoRA late is not supported"):
        await asyncio.to_thread(direct_call, url, "Hi", {**sampling, "lora_name": "late"})
    # The engine serves on; no reload was needed; every name whose no-op was read directly is
    # never handed out again (the engine holds the no-op under it now).
    assert len(proxy.repository_calls()) == calls
    assert await ask(grpc, "own-here", "x") == expected_text(files["own-here"], "x")
    await eventually(lambda: sorted(sidecar.reloads.status()["spares"]["burnt"]) == sorted(
        [*unbound, "own-gone", bound_gone]), timeout_s=10, poll_s=0.1,
        what="the names read directly burnt")
    # Both evicted adapters come back under fresh names, and answer with their own bytes.
    for adapter_id in ("own-gone", "bound-gone"):
        answer, _ = await ask_until_served(grpc, adapter_id, "x")
        assert answer == expected_text(files[adapter_id], "x")
    answer, _ = await ask_until_served(grpc, "late", "x")
    assert answer == expected_text(files["late"], "x")


async def test_bindings_survive_a_sidecar_restart_and_a_triton_restart_on_the_same_catalog(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    node = start_triton_node(tmp_path / "node")
    servers = [node.server]
    try:
        settings = s3_settings(tmp_path, s3, cache_root=node.cache_root,
                               port=node.sidecar_port, triton_url=node.server.http_url,
                               triton_reload_min_interval_s=0.0,
                               base_model_config=write_base_config(tmp_path))
        files = {a: s3.put_adapter(a, seed=400 + n)[WEIGHTS] for n, a in enumerate(("a", "b"))}
        first = await start_sidecar(settings)
        await first.reloads.sync()
        async with grpcclient.InferenceServerClient(node.server.grpc_url) as client:
            assert await ask(client, "a", "x") == expected_text(files["a"], "x")
        await first.stop()

        second = await start_sidecar(settings)  # binds b: a second binding, a new process
        await second.reloads.sync()
        async with grpcclient.InferenceServerClient(node.server.grpc_url) as client:
            assert await ask(client, "b", "x") == expected_text(files["b"], "x")
            assert await ask(client, "a", "y") == expected_text(files["a"], "y")
        bound = {spare: version.split("@")[0] for spare, version
                 in second.reloads.status()["spares"]["bound"].items()}
        assert sorted(bound.values()) == ["a", "b"]

        reloads = second.metrics.metrics_registry.get_sample_value(
            "lora_sidecar_triton_reloads_total", {"outcome": "ok"}) or 0.0
        node.server.stop()  # Triton restarts on the same catalog, at the same address
        node.server = TritonServer.start(tmp_path / "node" / "again",
                                         node.cache_root / "multi_lora.json",
                                         env=node.proxy.environment(),
                                         ports=(node.server.http_port, node.server.grpc_port))
        servers.append(node.server)
        node.server.load(ROUTER, router_config(node.sidecar_url))
        await eventually(lambda: (second.metrics.metrics_registry.get_sample_value(
            "lora_sidecar_triton_reloads_total", {"outcome": "ok"}) or 0.0) > reloads,
            timeout_s=60, poll_s=0.1, what="the restarted Triton's reload")

        assert second.reloads.status()["generation"] == 1  # the same catalog, not a new one
        url = node.server.grpc_url
        for spare, adapter_id in bound.items():
            direct = await asyncio.to_thread(direct_call, url, "z",
                                             {"temperature": 0, "lora_name": spare})
            assert "".join(direct) == expected_text(files[adapter_id], "z", max_tokens=16)
        async with grpcclient.InferenceServerClient(url) as client:
            for adapter_id, data in files.items():
                assert await ask(client, adapter_id, "z") == expected_text(data, "z")
    finally:
        for server in servers:
            server.stop()
        node.proxy.stop()


async def test_an_engine_killed_on_purpose_is_reported_unavailable_and_serves_again(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any,
    proxy: TritonProxy, http: aiohttp.ClientSession,
) -> None:
    s3.put_adapter("victim-v1", seed=500)
    other = s3.put_adapter("other-v1", seed=501)[WEIGHTS]
    sidecar = await node_sidecar(triton_url=proxy.url)
    assert await ask(grpc, "other-v1", "x") == expected_text(other, "x")
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "victim-v1", "lease": False})
    assert status == 200, body
    name = body["lora_name"]  # bound, never used: the engine has not read it
    await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "victim-v1"})
    # Tampering behind the sidecar's back: the parked name's no-op goes, so the engine finds
    # nothing at a catalogued path it has never read: vLLM dies on that.
    generation = sidecar.reloads.status()["generation"]
    shutil.rmtree(triton_node.cache_root / "catalog" / f"g{generation}" / "noop" / name)
    proxy.calls.clear()
    killed_at = time.monotonic()
    with pytest.raises(RuntimeError, match="EngineCore encountered an issue"):
        await asyncio.to_thread(direct_call, triton_node.server.grpc_url, "x",
                                {"temperature": 0, "lora_name": name})

    answer, unavailable = await ask_until_served(grpc, "other-v1", "back")

    served_after_s = time.monotonic() - killed_at
    assert answer == expected_text(other, "back")
    # Every failure on the way was UNAVAILABLE (retryable); the first says why.
    assert unavailable, "the dead engine was never reported"
    assert "engine is down and is being restarted" in unavailable[0], unavailable
    assert any(c.endswith("/load") for c in proxy.repository_calls())
    assert served_after_s < 60
    # The reloaded engine lists the same generation, with the tampered name on a no-op again.
    assert name in sidecar.reloads.status()["spares"]["parked"]
    answer = "".join(await asyncio.to_thread(direct_call, triton_node.server.grpc_url, "x",
                                             {"temperature": 0, "lora_name": name}))
    assert answer == expected_text(NOOP_WEIGHTS, "x", max_tokens=16)


def write_base_config(tmp_path: Path) -> Path:
    path = tmp_path / "base-model-config.json"
    path.write_text(json.dumps(TINY_LLAMA.to_config()))
    return path



