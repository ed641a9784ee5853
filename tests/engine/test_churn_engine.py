"""The ordinary day with the real engine: a registry four times the disk budget, Zipf traffic from
several gRPC clients with no retries, new adapters uploaded during the traffic, one adapter
re-uploaded under its id, an operator's `find` and `du` over the cache root, and one forced
compaction in the middle. Every answer is compared with the text transformers + peft generate
for the bytes that were in the registry.

Then, on the same node with the traffic stopped: an upload that lands file by file is served
within a second or two of its last file, with no manual step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tritonclient.utils import InferenceServerException

from tests.engine.harness import EngineAssets
from tests.engine.node import ENGINE_LOAD_TIMEOUT_S, EngineNode
from tests.engine.surgery import variant
from tests.engine.traffic import Clients, DiskSampler
from tests.support.waiting import eventually_blocking

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

REGISTRY = [f"churn-{n:02d}" for n in range(24)]
NEW = [f"arrival-{n}" for n in range(3)]
REUPLOADED = "churn-09"  # re-uploaded with other bytes during the traffic
MAX_ADAPTERS = 6  # the registry is four times the disk budget
CLIENTS = 4
TRAFFIC_S = 100.0


@pytest.fixture(scope="module")
def adapters(engine_assets: EngineAssets, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[Path, str]]:
    """Every adapter of the run (the tenants' tensors at other scales) with its reference text;
    candidates answering like one taken already are passed over, so a crossed answer shows."""
    folder = tmp_path_factory.mktemp("churn-variants")
    names = [*REGISTRY, *NEW, f"{REUPLOADED}.v2"]
    candidates = {}
    for n in range(len(names) * 2):
        source = engine_assets.adapter(f"tenant-{n % 4}")
        candidates[f"candidate-{n}"] = variant(source, folder / f"candidate-{n}",
                                               lora_alpha=1.0 + 1.75 * (n // 4) + 0.5 * (n % 4))
    references = engine_assets.references(candidates)
    chosen: dict[str, tuple[Path, str]] = {}
    texts: set[str] = set()
    for candidate, reference in references.items():
        if len(chosen) == len(names) or not reference.fits or not reference.text:
            continue
        if reference.text in texts or reference.text == engine_assets.text("base"):
            continue
        texts.add(reference.text)
        chosen[names[len(chosen)]] = (candidates[candidate], reference.text)
    assert len(chosen) == len(names), "not enough adapters that answer apart"
    return chosen


@pytest.fixture(scope="module")
def node(start_engine_node: Any, adapters: dict[str, tuple[Path, str]]) -> Iterator[EngineNode]:
    size = max(sum(p.stat().st_size for p in folder.iterdir()) for folder, _ in adapters.values())
    node: EngineNode = start_engine_node(
        adapters={a: adapters[a][0] for a in REGISTRY},
        sidecar_args=["--log-format", "json", "--triton-reload", "unload-first",
                      "--max-adapters", str(MAX_ADAPTERS),
                      "--max-bytes", str(MAX_ADAPTERS * size)])
    yield node


def metric(node: EngineNode, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(node.sidecar.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.split()[-1])
    return 0.0


def evict_when_free(node: EngineNode, adapter_id: str, timeout_s: float = 60.0) -> None:
    """POST /evict without force, until no lease holds the adapter (a request may use it)."""

    def evicted() -> bool:
        try:
            node.sidecar_json("/evict", {"adapter_id": adapter_id})
            return True
        except urllib.error.HTTPError as exc:
            code = json.loads(exc.read()).get("error")
            if code == "not_cached":
                return True
            assert code == "adapter_in_use", code
            return False

    eventually_blocking(evicted, timeout_s=timeout_s, poll_s=0.2,
                        what=f"{adapter_id} free to evict")


def log_events(node: EngineNode, event: str) -> list[dict[str, Any]]:
    return [entry for line in node.sidecar.log_text().splitlines() if line.startswith("{")
            for entry in [json.loads(line)] if entry.get("event") == event]


def test_churn_with_uploads_a_reupload_an_operator_and_a_forced_compaction(
    node: EngineNode, adapters: dict[str, tuple[Path, str]], engine_figures: dict[str, str],
) -> None:
    reloads_before = metric(node, "lora_sidecar_triton_reloads_total", '{outcome="ok"}')
    active = list(REGISTRY)
    lock = threading.Lock()
    # Most popular first; the arrivals join in the middle of the popularity.
    order = [*REGISTRY[:8], *NEW, *REGISTRY[8:]]

    def pool() -> list[str]:
        with lock:
            return [a for a in order if a in active]

    sampler = DiskSampler(node.cache_root).start()
    clients = Clients(node, pool, CLIENTS).start()
    t0 = time.monotonic()
    timeline: dict[str, float] = {}

    def at(offset_s: float) -> None:  # the scenario's timeline: time passing is the point
        time.sleep(max(0.0, t0 + offset_s - time.monotonic()))

    try:
        at(10)
        for n, adapter_id in enumerate(NEW[:2]):
            node.upload(adapter_id, adapters[adapter_id][0])
            with lock:
                active.append(adapter_id)
            at(15 + 5 * n)
        at(25)
        subprocess.run(["find", str(node.cache_root)], check=True, capture_output=True)
        subprocess.run(["du", "-sh", str(node.cache_root)], check=True, capture_output=True)
        at(30)
        node.upload(REUPLOADED, adapters[f"{REUPLOADED}.v2"][0])
        evict_when_free(node, REUPLOADED)  # its old bytes go; the next stage fetches the new
        at(40)
        generation = node.sidecar_json("/catalog")["generation"]
        node.sidecar_json("/catalog/compact", {})
        timeline["compact"] = time.monotonic()

        def compacted() -> bool:
            catalog = node.sidecar_json("/catalog")
            loaded = catalog["triton"]["loaded_generation"]
            return bool(loaded is not None and loaded > generation
                        and not catalog["triton"]["reloading"])

        eventually_blocking(compacted, timeout_s=ENGINE_LOAD_TIMEOUT_S, poll_s=0.2,
                            what="the compacted generation loaded")
        timeline["compacted"] = time.monotonic()
        at(timeline["compacted"] - t0 + 10)
        node.upload(NEW[2], adapters[NEW[2]][0])
        with lock:
            active.append(NEW[2])
        at(TRAFFIC_S)
    finally:
        answers = clients.stop()
        sampler.stop()

    errors = [a for a in answers if a.error is not None]
    assert not errors, f"{len(errors)} failed requests, first: {errors[:3]}"
    old, new = adapters[REUPLOADED][1], adapters[f"{REUPLOADED}.v2"][1]
    wrong = []
    new_seen_at = None
    for answer in sorted(answers, key=lambda a: a.ended):
        if answer.adapter_id != REUPLOADED:
            if answer.text != adapters[answer.adapter_id][1]:
                wrong.append(answer)
            continue
        if answer.text == new:
            new_seen_at = new_seen_at or answer.ended
        elif answer.text != old or (new_seen_at is not None and answer.started > new_seen_at):
            wrong.append(answer)  # a mix, or the old text after the new was served
    assert not wrong, f"{len(wrong)} wrong answers, first: {wrong[:3]}"
    assert new_seen_at is not None, "the re-uploaded adapter's new bytes were never served"

    reloads = metric(node, "lora_sidecar_triton_reloads_total", '{outcome="ok"}') - reloads_before
    assert reloads == 1, f"{reloads} reloads; only the forced compaction should reload"

    catalog = node.sidecar_json("/catalog")
    assert catalog["spares"]["burnt"] == [], "an operator's look at the volume burnt names"
    budget = MAX_ADAPTERS * max(sum(p.stat().st_size for p in folder.iterdir())
                                for folder, _ in adapters.values())
    assert sampler.adapter_bytes and max(sampler.adapter_bytes) <= budget, (
        max(sampler.adapter_bytes), budget)
    catalog_bytes = catalog["disk"]["catalog_bytes"]
    records = 1024 * 1024  # .sidecar.json records, the lease journal, .owner.json
    assert max(sampler.other_bytes) <= catalog_bytes + records, (
        max(sampler.other_bytes), catalog_bytes)

    # Names: in each generation, one bound event per distinct version, never two.
    bound = log_events(node, "bound")
    per_generation = Counter(e["generation"] for e in bound)
    for number, count in per_generation.items():
        versions = {(e["adapter_id"], e["digest"]) for e in bound if e["generation"] == number}
        assert count == len(versions), (number, count, len(versions))
    changed = log_events(node, "registry_changed")
    assert [e["adapter_id"] for e in changed] == [REUPLOADED]

    hits = metric(node, "lora_sidecar_stage_requests_total", '{result="hit"}')
    misses = metric(node, "lora_sidecar_stage_requests_total", '{result="miss"}')
    changes = {c: metric(node, "lora_sidecar_catalog_name_changes_total", f'{{change="{c}"}}')
               for c in ("bound", "parked", "returned", "burnt")}
    outside = [a.seconds for a in answers
               if a.ended < timeline["compact"] or a.started > timeline["compacted"] + 5]
    across = [a.seconds for a in answers
              if a.started < timeline["compacted"] and a.ended > timeline["compact"]]
    engine_figures["churn: requests, failed, wrong, reloads"] = (
        f"{len(answers)}, {len(errors)}, {len(wrong)}, {reloads:.0f} (the forced one)")
    engine_figures["churn: stage hits / misses; names bound, parked, returned, burnt"] = (
        f"{hits:.0f} / {misses:.0f}; {changes['bound']:.0f}, {changes['parked']:.0f}, "
        f"{changes['returned']:.0f}, {changes['burnt']:.0f}")
    engine_figures["churn: latency p50 outside / held across the compaction (s)"] = (
        f"{statistics.median(outside):.2f} / {statistics.median(across):.2f} (max "
        f"{max(across):.1f}, {len(across)} requests held; the reload took "
        f"{timeline['compacted'] - timeline['compact']:.1f} s)")
    engine_figures["churn: bytes of adapters on disk, max sampled / budget"] = (
        f"{max(sampler.adapter_bytes)} / {budget}; catalog {catalog_bytes} bytes "
        f"(no-op {catalog['disk']['noop_bytes']})")


def test_an_upload_landing_file_by_file_is_served_a_moment_after_its_last_file(
    node: EngineNode, adapters: dict[str, tuple[Path, str]], engine_figures: dict[str, str],
) -> None:
    folder, expected = adapters["churn-23"]
    late = "late-upload"
    node.upload(late, folder, only=["adapter_model.safetensors"])
    refused = []
    for _ in range(3):  # asked while only the weights are there: refused, for those files
        with pytest.raises(InferenceServerException) as caught:
            node.ask(late)
        refused.append(caught.value.message() or "")
    assert all("missing" in message for message in refused), refused
    # Time passing is the point: the config lands seconds later, as `aws s3 cp --recursive`
    # does.
    time.sleep(3)
    node.upload(late, folder, only=["adapter_config.json"])
    landed = time.monotonic()

    def answered() -> tuple[str] | None:  # a client that retries, as clients do on an error
        try:
            return (node.ask(late),)
        except InferenceServerException:
            return None

    (text,) = eventually_blocking(answered, timeout_s=10, poll_s=0.2,
                                  what="served after its last file landed")
    served_s = time.monotonic() - landed

    assert text == expected
    assert served_s < 3.0, served_s
    engine_figures["upload landing file by file: served after its last file"] = (
        f"{served_s:.2f} s (refused {len(refused)} times before, for the files then listed)")
