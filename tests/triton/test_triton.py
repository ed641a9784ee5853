"""The whole path in a real Triton: gRPC client -> multilora_router -> the sidecar (moto S3)
-> vllm_model on the CPU stand-in, whose answers prove which adapter bytes it was given."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from compose import client as compose_client
from sidecar.config import TritonReload
from sidecar.process.app import Sidecar
from tests.support.api import call
from tests.support.s3 import S3Registry
from tests.support.waiting import eventually
from tests.triton.harness import ROUTER, VLLM_MODEL, router_config
from tests.triton.node import StartNodeSidecar, TritonNode, ask, direct_call
from tests.triton.standin_vllm.answer import expected_text

WEIGHTS = "adapter_model.safetensors"


def stage_count(sidecar: Sidecar, result: str) -> float:
    value = sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_stage_requests_total", {"result": result})
    return value or 0.0


async def router_error(grpc: Any, adapter_id: str, prompt: str = "hello",
                       sampling: Any = None) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await ask(grpc, adapter_id, prompt, sampling)
    return caught.value


def status_of(error: InferenceServerException) -> str:
    return str(error.status()).removeprefix("StatusCode.")


async def test_client_gets_a_cold_adapters_text_and_the_second_call_is_a_hit(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar
) -> None:
    files = s3.put_adapter("cold-sql-v1", seed=11)
    sidecar = await node_sidecar()
    url = triton_node.server.grpc_url

    first = await asyncio.to_thread(compose_client.generate, url, "cold-sql-v1", "List tables")
    second = await asyncio.to_thread(compose_client.generate, url, "cold-sql-v1", "Count rows",
                                     {"max_tokens": 2})

    assert first == expected_text(files[WEIGHTS], "List tables")
    assert second == expected_text(files[WEIGHTS], "Count rows", max_tokens=2)
    assert (stage_count(sidecar, "miss"), stage_count(sidecar, "hit")) == (1, 1)
    assert len(s3.proxy.gets(s3.key("cold-sql-v1", WEIGHTS))) == 1
    assert sidecar.store.snapshot().active_leases == 0


async def test_sixteen_concurrent_calls_over_eight_adapters_with_room_for_three(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    adapter_ids = [f"tenant-{n}-v1" for n in range(8)]
    weights = {a: s3.put_adapter(a, seed=100 + n)[WEIGHTS] for n, a in enumerate(adapter_ids)}
    sidecar = await node_sidecar(max_adapters=3)
    calls = [(adapter_ids[n % 8], f"prompt {n}") for n in range(16)]

    answers = await asyncio.gather(*(ask(grpc, a, prompt) for a, prompt in calls))

    for (adapter_id, prompt), answer in zip(calls, answers, strict=True):
        assert answer == expected_text(weights[adapter_id], prompt)
    assert sidecar.store.snapshot().active_leases == 0
    assert len(sidecar.store.adapters()) <= 3
    evicted = sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_evictions_total", {"reason": "policy"})
    assert evicted is not None and evicted >= 5  # eight adapters went through three places


async def test_thousands_of_calls_from_sixteen_clients_leave_the_routers_stubs_alive(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any, triton_node: TritonNode
) -> None:
    """The router's BLS streams under load: before the router kept its finished streams
    (model.py, _FinishedStreams), the stub freed them on its own thread without the GIL and 16
    clients killed both router stubs before 12,000 calls were answered ("Stub process ... is
    not healthy"; the same test failed so). Every call must be answered, with its adapter's
    text."""
    adapter_ids = [f"load-{n}-v1" for n in range(4)]
    weights = {a: s3.put_adapter(a, seed=300 + n)[WEIGHTS] for n, a in enumerate(adapter_ids)}
    await node_sidecar()
    calls = 12000
    failures: list[str] = []
    wrong: list[str] = []
    queue = iter(range(calls))

    async def client() -> None:
        for n in queue:
            adapter_id, prompt = adapter_ids[n % 4], f"p{n % 16}"
            try:
                answer = await ask(grpc, adapter_id, prompt, {"max_tokens": 2})
            except InferenceServerException as exc:
                failures.append(str(exc)[:160])
                continue
            if answer != expected_text(weights[adapter_id], prompt, max_tokens=2):
                wrong.append(f"{adapter_id} {prompt}: {answer!r}")

    await asyncio.gather(*(client() for _ in range(16)))

    log = triton_node.server.log_text()
    assert not failures, (f"{len(failures)} of {calls} failed, first: {failures[:3]}\n"
                          f"{triton_node.server.log_tail()}")
    assert not wrong, wrong[:5]
    assert "Segmentation fault" not in log and "Reference count error" not in log


async def test_unknown_adapter_is_not_found(
    triton_node: TritonNode, node_sidecar: StartNodeSidecar, grpc: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await node_sidecar()

    error = await router_error(grpc, "no-such-adapter")
    code = await asyncio.to_thread(compose_client.main, [
        "--url", triton_node.server.grpc_url, "--adapter-id", "no-such-adapter", "--prompt", "hi"])

    assert status_of(error) == "NOT_FOUND"
    assert "no-such-adapter" in error.message()
    assert "(adapter_not_found)" in error.message()
    assert code == compose_client.EXIT_FAILED
    assert capsys.readouterr().err.startswith("error: NOT_FOUND: ")


async def test_invalid_adapter_is_an_invalid_argument_listing_its_problems(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    s3.put_adapter("too-wide-v1", rank=32)  # the served model's max_lora_rank is 16
    await node_sidecar()

    error = await router_error(grpc, "too-wide-v1")

    assert status_of(error) == "INVALID_ARGUMENT"
    assert "adapter too-wide-v1 was refused by validation" in error.message()
    assert "adapter_config.json" in error.message()
    assert "16" in error.message()


async def test_misspelt_sampling_key_is_refused_clearly(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    s3.put_adapter("sampling-v1", seed=3)
    sidecar = await node_sidecar()

    error = await router_error(grpc, "sampling-v1", sampling={"max_token": 8})

    assert status_of(error) == "INVALID_ARGUMENT"
    assert "unknown key 'max_token'" in error.message()
    assert stage_count(sidecar, "miss") == 0  # refused before anything was staged


async def test_sidecar_down_is_unavailable(triton_node: TritonNode, grpc: Any) -> None:
    error = await router_error(grpc, "any-adapter")

    assert status_of(error) == "UNAVAILABLE"
    assert f"sidecar unreachable at {triton_node.sidecar_url}" in error.message()


async def test_vllm_refusing_a_lora_it_does_not_list_is_unavailable(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    # Without a Triton URL (and without spare names) the sidecar cannot know what vllm_model
    # loaded, so the refusal comes from vLLM itself ("LoRA ... is not supported").
    sidecar = await node_sidecar(triton_url=None, spare_names=0)
    await asyncio.to_thread(triton_node.server.load, VLLM_MODEL)
    s3.put_adapter("late-v1", seed=6)

    error = await router_error(grpc, "late-v1")

    assert status_of(error) == "UNAVAILABLE"
    assert "has not loaded a catalog that lists adapter late-v1" in error.message()
    assert "LoRA late-v1 is not supported" in error.message()
    assert sidecar.store.snapshot().active_leases == 0


async def test_without_spare_names_a_new_adapter_is_served_after_one_reload(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any,
    http: aiohttp.ClientSession,
) -> None:
    first = s3.put_adapter("first-v1", seed=7)
    sidecar = await node_sidecar(spare_names=0)
    files = s3.put_adapter("fresh-v1", seed=8)

    error = await router_error(grpc, "fresh-v1")
    assert status_of(error) == "UNAVAILABLE"
    assert "(catalog_pending)" in error.message()
    assert "spare names are off" in error.message()
    await sidecar.reloads.sync()  # the refusal planned a compaction; this carries it out

    status, catalog = await call(http, "GET", f"{sidecar.url}/catalog")
    assert status == 200
    assert catalog["adapter_ids"] == ["fresh-v1"]  # on disk; first-v1 was never staged
    assert catalog["triton"]["loaded_generation"] == catalog["generation"] == 2
    assert catalog["triton"]["pending"] is None
    rendered = json.loads((triton_node.cache_root / "multi_lora.json").read_text())
    assert rendered == {"fresh-v1": str(triton_node.cache_root.resolve() / "catalog" / "g2"
                                        / "names" / "fresh-v1")}
    # Served at all proves Triton reloaded: the old engine's catalog did not list it.
    assert await ask(grpc, "fresh-v1", "hi") == expected_text(files[WEIGHTS], "hi")
    error = await router_error(grpc, "first-v1")  # staged now: it waits for the next one
    assert "(catalog_pending)" in error.message()
    await sidecar.reloads.sync()
    assert await ask(grpc, "first-v1", "hi") == expected_text(first[WEIGHTS], "hi")


async def test_unload_first_reload_serves_the_new_adapter_after_the_downtime(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    sidecar = await node_sidecar(triton_reload=TritonReload.UNLOAD_FIRST, spare_names=0)
    files = s3.put_adapter("after-v1", seed=10)
    await router_error(grpc, "after-v1")

    await sidecar.reloads.sync()

    assert sidecar.reloads.status()["triton"]["loaded_generation"] == 2
    assert await ask(grpc, "after-v1", "x") == expected_text(files[WEIGHTS], "x")


async def test_a_request_no_engine_can_serve_yet_is_held_through_an_unload_first_reload(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    # The router as checked in holds such requests; this module's is loaded with hold_s 0.
    await asyncio.to_thread(triton_node.server.load, ROUTER,
                            router_config(triton_node.sidecar_url, hold_s="120"))
    try:
        sidecar = await node_sidecar(triton_reload=TritonReload.UNLOAD_FIRST, spare_names=0)
        files = s3.put_adapter("held-v1", seed=14)
        reloads = sidecar.metrics.metrics_registry.get_sample_value(
            "lora_sidecar_triton_reloads_total", {"outcome": "ok"})
        started = time.monotonic()

        # One call, no retry: the sidecar says no engine names it (spares off), plans the
        # reload that lists it, and the router holds the call through the unload and load.
        answer = await ask(grpc, "held-v1", "x")

        assert answer == expected_text(files[WEIGHTS], "x")
        assert time.monotonic() - started > 0.05
        assert sidecar.metrics.metrics_registry.get_sample_value(
            "lora_sidecar_triton_reloads_total", {"outcome": "ok"}) == (reloads or 0) + 1
        assert sidecar.store.snapshot().active_leases == 0
    finally:
        await asyncio.to_thread(triton_node.server.load, ROUTER,
                                router_config(triton_node.sidecar_url, hold_s="0"))


async def test_a_failed_reload_leaves_the_old_catalog_serving(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    old = s3.put_adapter("old-v1", seed=12)
    sidecar = await node_sidecar(spare_names=0)
    await router_error(grpc, "old-v1")
    await sidecar.reloads.sync()
    assert await ask(grpc, "old-v1", "x") == expected_text(old[WEIGHTS], "x")
    s3.put_adapter("new-v1", seed=13)
    await router_error(grpc, "new-v1")
    triton_node.fail_flag.touch()
    try:
        await sidecar.reloads.sync()
    finally:
        triton_node.fail_flag.unlink()

    triton = sidecar.reloads.status()["triton"]
    assert triton["loaded_generation"] == 2
    assert triton["pending"] == 3
    assert "CUDA out of memory (simulated" in triton["last_reload_error"]
    assert await ask(grpc, "old-v1", "x") == expected_text(old[WEIGHTS], "x")
    error = await router_error(grpc, "new-v1")
    assert status_of(error) == "UNAVAILABLE"
    assert "adapter new-v1 is in catalog generation 3, but Triton serves generation 2" in (
        error.message())
    assert "the last reload failed" in error.message()


async def test_the_standin_keeps_the_stock_vllm_backends_contract(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar,
    http: aiohttp.ClientSession,
) -> None:
    weights = s3.put_adapter("contract-v1", seed=14)[WEIGHTS]
    sidecar = await node_sidecar(spare_names=0)
    status, _ = await call(http, "POST", f"{sidecar.url}/stage",
                           {"adapter_id": "contract-v1", "lease": False})
    assert status == 503  # staged; listed by the compaction this planned
    await sidecar.reloads.sync()
    url, lora = triton_node.server.grpc_url, {"lora_name": "contract-v1", "temperature": 0}
    expected = expected_text(weights, "Hi", max_tokens=16)

    def refusal(sampling: dict[str, Any], **kwargs: bool) -> str:
        with pytest.raises(RuntimeError) as caught:
            direct_call(url, "Hi", sampling, **kwargs)
        return str(caught.value)

    assert await asyncio.to_thread(direct_call, url, "Hi", lora) == [expected]
    assert await asyncio.to_thread(direct_call, url, "Hi", lora, exclude=False) == ["Hi" + expected]
    streamed = await asyncio.to_thread(direct_call, url, "Hi", lora, stream=True)
    assert len(streamed) > 1 and "".join(streamed) == expected
    assert await asyncio.to_thread(refusal, {"lora_name": "nope"}) == (
        "LoRA nope is not supported, we currently support ['contract-v1']")
    assert await asyncio.to_thread(refusal, {**lora, "max_token": 3}) == (
        "Error generating stream: 'NoneType' object has no attribute 'lora_name'")
    assert "`exclude_input_in_output` = False is not allowed" in await asyncio.to_thread(
        refusal, lora, exclude=False, stream=True)


async def test_a_restarted_sidecar_takes_over_the_loaded_engine_without_unloading_it(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    files = s3.put_adapter("steady-v1", seed=14)
    first = await node_sidecar(triton_reload=TritonReload.UNLOAD_FIRST)
    await first.stop()
    # Counted once the engine is settled: an unload an earlier test set off may still be
    # finishing (its log line lands late), and the model is READY only after it.
    await eventually(lambda: triton_node.server.model_states().get(VLLM_MODEL) == "READY",
                     timeout_s=120, what="vllm_model READY before the count")
    unloads = triton_node.server.log_text().count("successfully unloaded 'vllm_model'")

    second = await node_sidecar(triton_reload=TritonReload.UNLOAD_FIRST)

    assert second.reloads.status()["triton"]["loaded_generation"] == 1
    assert triton_node.server.log_text().count("successfully unloaded 'vllm_model'") == unloads
    assert await ask(grpc, "steady-v1", "x") == expected_text(files[WEIGHTS], "x")


# ---- the adapter id as a header, and many requests at once -----------------------------------


async def test_the_x_adapter_id_header_alone_names_the_adapter(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    files = s3.put_adapter("header-v1", seed=21)
    await node_sidecar()
    http_client = tritonhttp.InferenceServerClient(f"127.0.0.1:{triton_node.server.http_port}")

    over_grpc = await ask(grpc, None, "hi", headers={"x-adapter-id": "header-v1"})
    prompt = tritonhttp.InferInput("prompt", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"hi"], dtype=object))
    # HTTP keeps the header's spelling; the router compares names without case.
    result = await asyncio.to_thread(http_client.infer, "multilora_router", [prompt],
                                     headers={"X-Adapter-Id": "header-v1"})
    http_client.close()

    expected = expected_text(files[WEIGHTS], "hi")
    assert over_grpc == expected
    assert result.as_numpy("generated_text")[0].decode() == expected
    assert triton_node.proxy.requests() == []  # the sidecar calls ignored the proxy variables


async def test_a_header_and_an_input_naming_different_adapters_are_refused(
    s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    s3.put_adapter("left-v1", seed=22)
    s3.put_adapter("right-v1", seed=23)
    sidecar = await node_sidecar()

    mismatch = await router_error_with(grpc, "left-v1", {"x-adapter-id": "right-v1"})
    neither = await router_error_with(grpc, None, None)

    assert status_of(mismatch) == "INVALID_ARGUMENT"
    assert "'right-v1'" in mismatch.message() and "'left-v1'" in mismatch.message()
    assert status_of(neither) == "INVALID_ARGUMENT"
    assert "x-adapter-id" in neither.message()
    assert stage_count(sidecar, "miss") == 0  # refused before anything was staged


async def router_error_with(grpc: Any, adapter_id: str | None,
                            headers: dict[str, str] | None) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await ask(grpc, adapter_id, "hello", headers=headers)
    return caught.value


async def test_warm_requests_are_answered_while_sixteen_cold_downloads_hang(
    triton_node: TritonNode, s3: S3Registry, node_sidecar: StartNodeSidecar, grpc: Any
) -> None:
    warm = s3.put_adapter("warm-v1", seed=30)
    cold_ids = [f"cold-{n}-v1" for n in range(16)]
    cold_weights = [s3.put_adapter(adapter_id, seed=40 + n)[WEIGHTS]
                    for n, adapter_id in enumerate(cold_ids)]
    await node_sidecar()
    assert await ask(grpc, "warm-v1", "x") == expected_text(warm[WEIGHTS], "x")
    hung: list[str] = []

    async def hang_cold_weights(request: Any, seen: Any) -> None:
        if seen.method == "GET" and "cold-" in seen.path and seen.path.endswith(WEIGHTS):
            hung.append(seen.path)
            await s3.proxy.stall()
        return None

    s3.proxy.fault = hang_cold_weights
    cold = [asyncio.create_task(ask(grpc, adapter_id, "c")) for adapter_id in cold_ids]
    try:
        await eventually(lambda: len(set(hung)) == 16, timeout_s=30, poll_s=0.05,
                         what="every cold download reaching S3 and hanging there")

        answers = await asyncio.wait_for(
            asyncio.gather(*(ask(grpc, "warm-v1", f"w{n}") for n in range(8))), timeout=60)

        assert answers == [expected_text(warm[WEIGHTS], f"w{n}") for n in range(8)]
        assert not any(task.done() for task in cold)  # the cold ones are still downloading
    finally:
        s3.proxy.fault = None
        s3.proxy.release_stalls()
    cold_answers = await asyncio.gather(*cold)
    assert cold_answers == [expected_text(weights, "c") for weights in cold_weights]
