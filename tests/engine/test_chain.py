"""The whole chain with the real engine: a gRPC client -> multilora_router -> the sidecar (moto
S3) -> vllm_model on the stock Triton vLLM backend -> vLLM on CPU. Every answer is compared with
the text transformers + peft generate for the same base model and adapter.

One node for the module (an engine load costs tens of seconds on 2 cores); the sidecar keeps
room for 2 adapters on disk. The test that kills the engine runs last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from tests.engine.harness import GOOD_ADAPTERS, PROMPT, EngineAssets
from tests.engine.node import EngineNode, status_of
from tests.engine.surgery import copy_adapter, edit_config, non_finite
from tests.triton.harness import TRITON_REPO, VLLM_MODEL

# An engine load takes tens of seconds, a reload with two engines on 2 cores more.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

TENANTS = [f"tenant-{n}" for n in range(4)]
KINDS = [name for name in GOOD_ADAPTERS if not name.startswith("tenant-")]


@pytest.fixture(scope="module")
def node(start_engine_node: object, engine_assets: EngineAssets,
         engine_figures: dict[str, str]) -> Iterator[EngineNode]:
    started = time.monotonic()
    node: EngineNode = start_engine_node(  # type: ignore[operator]
        adapters=engine_assets.good_adapters, sidecar_args=["--max-adapters", "2"])
    engine_figures["engine load in Triton (vllm_model, first catalog)"] = (
        f"{node.engine_load_s:.1f} s (node up in {time.monotonic() - started:.1f} s)")
    yield node
    if node.memory_samples:
        engine_figures["node peak RSS (Triton + stubs + EngineCore + sidecar)"] = (
            f"{max(node.memory_samples) / 2**30:.2f} GiB")


def test_cold_call_then_warm_call_answer_the_adapters_reference_text(
    node: EngineNode, engine_assets: EngineAssets, engine_figures: dict[str, str]
) -> None:
    expected = engine_assets.text("tenant-0")
    assert expected != engine_assets.text("base")  # the adapter changes what the model says

    started = time.monotonic()
    cold = node.ask("tenant-0")
    cold_s = time.monotonic() - started
    started = time.monotonic()
    warm = node.ask("tenant-0")
    warm_s = time.monotonic() - started

    assert cold == expected
    assert warm == expected
    engine_figures["router call, cold adapter (download + first engine use)"] = f"{cold_s:.2f} s"
    engine_figures["router call, warm adapter"] = f"{warm_s:.2f} s"


def test_every_good_kind_answers_its_reference_text(
    node: EngineNode, engine_assets: EngineAssets
) -> None:
    answers = {kind: node.ask(kind) for kind in KINDS}

    assert answers == {kind: engine_assets.text(kind) for kind in KINDS}
    assert len(set(answers.values())) == len(KINDS)  # every adapter has a text of its own


def test_eight_concurrent_calls_over_four_adapters_with_room_for_two(
    node: EngineNode, engine_assets: EngineAssets
) -> None:
    calls = [TENANTS[n % 4] for n in range(8)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(node.ask, calls))

    assert answers == [engine_assets.text(tenant) for tenant in calls]
    on_disk = node.sidecar_json("/adapters")
    assert len(on_disk["adapters"]) <= 2, on_disk
    node.sample_memory()


def test_a_load_with_unchanged_files_keeps_the_running_engine(node: EngineNode) -> None:
    # Before any test touches the catalog file: Triton compares its ctime, which a swap and
    # restore of the file moves for good (a restored mtime does not hide it).
    before = {pid: name for pid, name in node.engine_pids().items() if "EngineCore" in name}

    started = time.monotonic()
    node.server.load(VLLM_MODEL)
    seconds = time.monotonic() - started
    after = {pid: name for pid, name in node.engine_pids().items() if "EngineCore" in name}

    assert before and after == before, node.engine_pids()
    assert seconds < 5, seconds  # nothing was loaded: an engine start takes tens of seconds


# ---- the stock backend's contract, asserted on the real backend ----------------------------


def test_vllm_model_is_decoupled_and_streams_the_adapters_text_in_pieces(
    node: EngineNode, engine_assets: EngineAssets
) -> None:
    name = node.lora_name("tenant-1")  # staged, so vLLM can read its folder
    with urllib.request.urlopen(f"{node.server.http_url}/v2/models/{VLLM_MODEL}/config",
                                timeout=10) as response:
        config = json.loads(response.read())

    pieces = node.vllm_stream(name, stream=True)

    assert config["model_transaction_policy"]["decoupled"] is True
    assert len(pieces) > 1
    assert "".join(pieces) == engine_assets.text("tenant-1")


def test_vllm_model_echoes_the_prompt_unless_told_not_to(
    node: EngineNode, engine_assets: EngineAssets
) -> None:
    name = node.lora_name("tenant-2")
    expected = engine_assets.text("tenant-2")

    echoed = node.vllm_stream(name)
    excluded = node.vllm_stream(name, exclude_input=True)
    base = node.vllm_stream(None, exclude_input=True)

    assert echoed == [PROMPT + expected]  # the stock default when not streaming
    assert excluded == [expected]  # what the router asks for
    assert base == [engine_assets.text("base")]


def test_an_unlisted_lora_name_is_refused_with_the_whole_catalog_in_the_message(
    node: EngineNode,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        node.vllm_stream("no-such-tenant")

    message = caught.value.message() or ""
    catalog = json.loads((node.cache_root / "multi_lora.json").read_text())
    assert f"LoRA no-such-tenant is not supported, we currently support {list(catalog)}" in message
    assert node.loaded_lora_names() == list(catalog)


def test_the_backend_reads_its_catalog_once_per_load(node: EngineNode) -> None:
    catalog_path = node.cache_root / "multi_lora.json"
    original = catalog_path.read_bytes()
    times = catalog_path.stat()
    catalog = json.loads(original)
    changed = {**catalog, "ghost": next(iter(catalog.values()))}
    staging = catalog_path.with_name(".ghost-catalog")
    staging.write_text(json.dumps(changed))
    os.replace(staging, catalog_path)
    try:
        listed = node.loaded_lora_names()
    finally:
        staging.write_bytes(original)
        os.replace(staging, catalog_path)
        # Triton reloads a model whose file times changed: leave none changed.
        os.utime(catalog_path, ns=(times.st_atime_ns, times.st_mtime_ns))

    assert "ghost" not in listed
    assert listed == list(catalog)


# ---- adapters that arrive later -----------------------------------------------------------


def test_an_adapter_uploaded_later_answers_its_reference_text_while_others_keep_being_served(
    node: EngineNode, engine_assets: EngineAssets, engine_figures: dict[str, str],
    tmp_path: Path,
) -> None:
    late = copy_adapter(engine_assets.adapter("tenant-3"), tmp_path / "late")
    edit_config(late, lora_alpha=32)  # the same tensors, twice the scale: a text of its own
    expected = engine_assets.references({"late": late})["late"]
    assert expected.fits and expected.text not in (engine_assets.text("tenant-3"), None)
    stop = threading.Event()
    other: list[str | BaseException] = []

    def keep_calling() -> None:
        while not stop.is_set():
            try:
                other.append(node.ask("tenant-0"))
            except BaseException as exc:  # counted and shown by the assertion below
                other.append(exc)
            node.sample_memory()

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        node.upload("late-tenant", late)
        uploaded = time.monotonic()
        text, _, unavailable = node.ask_until_served("late-tenant")
        seconds = time.monotonic() - uploaded
    finally:
        stop.set()
        caller.join()

    assert text == expected.text
    errors = [answer for answer in other if isinstance(answer, BaseException)]
    assert not errors, errors[:3]
    assert other and all(answer == engine_assets.text("tenant-0") for answer in other)
    engine_figures["new adapter: upload to first answer"] = (
        f"{seconds:.1f} s ({unavailable} UNAVAILABLE answers first; "
        f"{len(other)} calls of another tenant meanwhile, 0 errors)")


def test_a_refused_adapter_never_reaches_the_engine(
    node: EngineNode, engine_assets: EngineAssets, tmp_path: Path
) -> None:
    wide = copy_adapter(engine_assets.adapter("tenant-1"), tmp_path / "wide")
    edit_config(wide, r=32)  # above max_lora_rank 16: vLLM would refuse it, killing the engine
    node.upload("too-wide", wide)

    with pytest.raises(InferenceServerException) as caught:
        node.ask_until_served("too-wide")  # a client retries UNAVAILABLE, not a refusal
    # The catalog lists what is on disk and validated: a restarted sidecar carries on with it.
    node.restart_sidecar()
    node.wait_catalog_loaded()

    assert status_of(caught.value) == "INVALID_ARGUMENT"
    assert "rank_too_large" in (caught.value.message() or "")
    assert "too-wide" not in node.loaded_lora_names()
    assert "too-wide" not in json.loads((node.cache_root / "multi_lora.json").read_text())
    assert node.ask("tenant-1") == engine_assets.text("tenant-1")


def test_a_nan_adapter_is_refused_and_the_next_tenants_answer_is_intact(
    node: EngineNode, engine_assets: EngineAssets, tmp_path: Path
) -> None:
    poisoned = non_finite(engine_assets.adapter("tenant-2"), tmp_path / "nan", float("nan"))
    node.upload("poisoned", poisoned)

    with pytest.raises(InferenceServerException) as caught:
        node.ask_until_served("poisoned")
    after = node.ask("tenant-0")
    node.wait_catalog_loaded()

    assert status_of(caught.value) == "INVALID_ARGUMENT"
    assert "non_finite_weights" in (caught.value.message() or "")
    assert after == engine_assets.text("tenant-0")
    assert "poisoned" not in node.loaded_lora_names()


# ---- last: a dead engine -------------------------------------------------------------------


def _health_check_enabled() -> bool:
    """Whether the checked-in vllm_model config turns on the stock backend's health check."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    text_format.Parse((TRITON_REPO / VLLM_MODEL / "config.pbtxt").read_text(), config)
    parameter = config.parameters.get("ENABLE_VLLM_HEALTH_CHECK")
    return parameter is not None and parameter.string_value.lower() == "true"


def test_a_dead_engine_as_the_stock_backend_shows_it(
    node: EngineNode, engine_figures: dict[str, str]
) -> None:
    name = node.lora_name("tenant-0")
    engines = [pid for pid, title in node.engine_pids().items() if "EngineCore" in title]
    assert engines
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    # vLLM notices its engine process died through a socket, inside Triton's process: no event
    # of it reaches this test, so it is given a moment.
    time.sleep(1)

    with pytest.raises(InferenceServerException) as direct:
        node.vllm_stream(name)
    engine_figures["dead engine, direct vllm_model call"] = (direct.value.message() or "")[:160]

    if _health_check_enabled():
        # The backend checks the engine before each request, answers with an error and unloads
        # the model by itself. (A streamed error carries its message, not its code: the router,
        # which gets the code through BLS, is what clients see.)
        assert "Model is unavailable due to unhealthy vLLM engine" in (
            direct.value.message() or "")
        # The sidecar sees the model gone and loads it again; the router holds a client's
        # call meanwhile and answers it then: one call, no error, the adapter's own text.
        started = time.monotonic()
        assert node.ask("tenant-0") == node.assets.text("tenant-0")
        engine_figures["dead engine, router call"] = (
            f"held {time.monotonic() - started:.1f} s while the sidecar loaded the engine "
            "again, then answered")
        return
    # Without the check the model stays READY while every request fails, and a load with
    # unchanged files does not bring the engine back.
    with pytest.raises(InferenceServerException) as routed:
        node.ask("tenant-0")
    node.server.load(VLLM_MODEL)
    with pytest.raises(InferenceServerException):
        node.vllm_stream(name)
    assert "EngineCore encountered an issue" in (direct.value.message() or "")
    assert node.server.model_states()[VLLM_MODEL] == "READY"
    engine_figures["dead engine, router call"] = (
        f"{status_of(routed.value)}: {(routed.value.message() or '')[:160]}")
