"""What the sidecar offers a cluster of nodes: the adapter set for an endpoint picker on
/metrics/epp, and a read-only listener for metrics and probes on another address. (The model
repository seeded into the cache volume: tests/unit/process/test_seed.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.api import StartSidecar, call
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings, s3_settings
from tests.support.waiting import eventually

EPP_METRIC = "lora_sidecar_lora_requests_info"


def llm_d_lora_view(text: str, name: str = EPP_METRIC) -> dict[str, Any]:
    """What llm-d's metrics extractor takes from a scrape (its LoRA spec): among the series of
    the family, the one with the largest value; its running/waiting labels split on commas
    and trimmed, empty names dropped; max_lora parsed as an integer."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get(name)
    if family is None or not family.samples:
        return {}
    latest = max(family.samples, key=lambda sample: sample.value)
    labels = latest.labels

    def names(value: str) -> set[str]:
        return {part.strip() for part in value.split(",") if part.strip()}

    return {"running": names(labels.get("running_lora_adapters", "")),
            "waiting": names(labels.get("waiting_lora_adapters", "")),
            "max": int(labels["max_lora"]), "changed_at": latest.value,
            "series": len(family.samples)}


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.text()


async def test_epp_metrics_follow_the_adapter_set_in_the_shape_llm_d_reads(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for n in range(4):
        s3.put_adapter(f"tenant-{n}-v1", seed=n)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, epp_metrics=True, max_adapters=3,
                                              epp_adapter_prefix="llama/"))
    epp = f"{sidecar.url}/metrics/epp"

    empty = llm_d_lora_view(await scrape(http, epp))
    for n in range(2):
        status, _ = await call(http, "POST", f"{sidecar.url}/stage",
                               {"adapter_id": f"tenant-{n}-v1", "lease": False})
        assert status == 200
    two = llm_d_lora_view(await scrape(http, epp))
    again = llm_d_lora_view(await scrape(http, epp))

    # A download that hangs is listed as waiting.
    async def hang(request: Any, seen: Any) -> None:
        if seen.method == "GET" and "tenant-2-v1" in seen.path:
            await s3.proxy.stall()

    s3.proxy.fault = hang
    staging = asyncio.create_task(call(http, "POST", f"{sidecar.url}/stage",
                                       {"adapter_id": "tenant-2-v1", "lease": False}))
    try:
        await eventually(lambda: sidecar.stager.inflight, timeout_s=10,
                         what="the stage under way")
        waiting = llm_d_lora_view(await scrape(http, epp))
    finally:
        s3.proxy.fault = None
        s3.proxy.release_stalls()
    assert (await staging)[0] == 200
    full = llm_d_lora_view(await scrape(http, epp))

    assert empty["running"] == set() and empty["max"] == 1
    assert two["running"] == {"llama/tenant-0-v1", "llama/tenant-1-v1"}
    assert two["max"] == 3  # two listed, room for one more without an eviction
    assert two["changed_at"] > empty["changed_at"]
    assert again["changed_at"] == two["changed_at"]  # no change, same value: no new series
    assert waiting["waiting"] == {"llama/tenant-2-v1"}
    assert full["running"] == {f"llama/tenant-{n}-v1" for n in range(3)}
    assert full["max"] == 3  # the cache holds its 3: one more would evict
    assert all(view["series"] == 1 for view in (empty, two, waiting, full))


async def test_a_long_adapter_list_is_cut_to_the_cap_most_recent_first(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    ids = [f"adapter-number-{n:02d}-v1" for n in range(8)]  # 23 bytes each
    for n, adapter_id in enumerate(ids):
        s3.put_adapter(adapter_id, seed=n)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, epp_metrics=True,
                                              epp_label_max_bytes=100))
    for adapter_id in ids:
        status, _ = await call(http, "POST", f"{sidecar.url}/stage",
                               {"adapter_id": adapter_id, "lease": False})
        assert status == 200

    text = await scrape(http, f"{sidecar.url}/metrics/epp")
    view = llm_d_lora_view(text)
    truncated = {s.name: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples}["lora_sidecar_lora_requests_info_truncated_total"]

    assert view["running"] == set(ids[-4:])  # four fit in 100 bytes: the most recent four
    assert truncated == 1


async def test_epp_metrics_are_off_unless_asked_for(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, body = await call(http, "GET", f"{sidecar.url}/metrics/epp")

    assert status == 404
    assert "--epp-metrics" in body["message"]


async def test_the_read_only_listener_serves_metrics_and_probes_and_nothing_else(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    (tmp_path / "registry").mkdir()
    # 127.0.0.2: another address than the API's, as the pod IP is in a cluster.
    sidecar = await start_sidecar(make_settings(tmp_path, metrics_host="127.0.0.2",
                                                metrics_port=0, epp_metrics=True))
    metrics_url = f"http://127.0.0.2:{sidecar.metrics_port}"
    await sidecar.reloads.sync()  # ready once the first catalog is rendered

    answers = {path: (await call(http, "GET", metrics_url + path))[0]
               for path in ("/metrics", "/metrics/epp", "/healthz", "/readyz", "/adapters",
                            "/catalog")}
    stage, _ = await call(http, "POST", f"{metrics_url}/stage", {"adapter_id": "a1"})
    evict, _ = await call(http, "POST", f"{metrics_url}/evict", {"adapter_id": "a1"})

    assert sidecar.metrics_port != sidecar.port
    assert answers == {"/metrics": 200, "/metrics/epp": 200, "/healthz": 200, "/readyz": 200,
                       "/adapters": 404, "/catalog": 404}
    assert (stage, evict) == (404, 404)
    assert (await call(http, "GET", f"{sidecar.url}/adapters"))[0] == 200  # the API is as was
