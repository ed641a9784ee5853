"""/metrics, read with Prometheus's own text parser after scripted scenarios: every counter
moves by exactly what happened, and the cache gauges agree with the folders on disk."""

from __future__ import annotations

import ast
import math
import platform
import shutil
from importlib.metadata import version
from pathlib import Path

import aiohttp
from aiohttp import web

from sidecar.cache.records import RECORD_NAME
from tests.support.api import StartSidecar, call
from tests.support.broken_adapters import CORPUS
from tests.support.observing import Scrape, scrape
from tests.support.s3 import S3Registry
from tests.support.s3proxy import Seen
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parents[3]
TRUNCATED = next(case for case in CORPUS if case.name == "truncated_file")


async def _stage(http: aiohttp.ClientSession, url: str, adapter_id: str,
                 **extra: object) -> tuple[int, dict[str, object]]:
    status, body = await call(http, "POST", f"{url}/stage", {"adapter_id": adapter_id, **extra})
    assert isinstance(body, dict)
    return status, body


def _on_disk(cache_root: Path) -> tuple[int, int]:
    """(adapters, bytes of their files) as found under adapters/, records not counted."""
    folders = [p for p in (cache_root / "adapters").iterdir() if p.is_dir()]
    size_bytes = sum(f.stat().st_size for p in folders for f in p.iterdir()
                     if f.name != RECORD_NAME)
    return len(folders), size_bytes


async def test_hits_misses_bytes_and_gauges_after_a_scripted_session(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sizes = {adapter_id: sum(len(b) for b in s3.put_adapter(adapter_id, seed=n).values())
             for n, adapter_id in enumerate(("a", "b"))}
    settings = s3_settings(tmp_path, s3, max_adapters=5, max_bytes=10_000_000)
    sidecar = await start_sidecar(settings)

    assert (await _stage(http, sidecar.url, "a"))[0] == 200  # miss
    assert (await _stage(http, sidecar.url, "a"))[0] == 200  # hit
    assert (await _stage(http, sidecar.url, "a", lease=False))[0] == 200  # hit
    assert (await _stage(http, sidecar.url, "b", lease=False))[0] == 200  # miss
    assert (await _stage(http, sidecar.url, "no-such-adapter"))[0] == 404  # error

    m = await scrape(http, sidecar.url)
    assert m.value("lora_sidecar_stage_requests_total", result="hit") == 2
    assert m.value("lora_sidecar_stage_requests_total", result="miss") == 2
    assert m.value("lora_sidecar_stage_requests_total", result="error") == 1
    assert m.value("lora_sidecar_stage_duration_seconds_count", result="hit") == 2
    assert m.value("lora_sidecar_download_bytes_total") == sizes["a"] + sizes["b"]
    assert m.value("lora_sidecar_download_duration_seconds_count") == 2
    assert m.value("lora_sidecar_inflight_downloads") == 0
    adapters, size_bytes = _on_disk(settings.cache_root)
    assert adapters == 2 and size_bytes == sizes["a"] + sizes["b"]
    assert m.value("lora_sidecar_cache_adapters") == adapters
    assert m.value("lora_sidecar_cache_bytes") == size_bytes
    assert m.value("lora_sidecar_cache_capacity_adapters") == 5
    assert m.value("lora_sidecar_cache_capacity_bytes") == 10_000_000
    assert m.value("lora_sidecar_active_leases") == 2
    assert m.value("lora_sidecar_pinned_adapters") == 0

    status, _ = await call(http, "POST", f"{sidecar.url}/pin", {"adapter_id": "b"})
    assert status == 200
    m = await scrape(http, sidecar.url)
    assert m.value("lora_sidecar_pinned_adapters") == 1
    assert m.value("lora_sidecar_stage_requests_total", result="hit") == 3  # the pin's stage


async def test_histograms_span_1ms_to_10min_and_the_process_is_described(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    m = await scrape(http, sidecar.url)
    # Written out, not read from the code: a hit is a millisecond, a cold adapter minutes.
    expected = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 120.0, 300.0, 600.0, math.inf]
    for family in ("lora_sidecar_stage_duration_seconds",
                   "lora_sidecar_download_duration_seconds"):
        assert m.types[family] == "histogram"
    assert m.buckets("lora_sidecar_stage_duration_seconds", result="hit") == expected
    assert m.buckets("lora_sidecar_download_duration_seconds") == expected
    assert m.types["lora_sidecar_adapter_age_at_eviction_seconds"] == "histogram"
    for result in ("hit", "miss", "error"):  # present from the start, at zero
        assert m.value("lora_sidecar_stage_requests_total", result=result) == 0
    assert m.value("process_resident_memory_bytes") > 0
    assert m.value("process_cpu_seconds_total") >= 0  # described; a fast start may show 0
    assert m.value("process_open_fds") > 0
    assert "python_info" in m.families
    assert "python_gc_objects_collected" in m.families
    # Which build is running, as prometheus_client's Info renders it: a gauge at 1.
    assert m.value("lora_sidecar_build_info", version=version("lora-sidecar"),
                   python=platform.python_version()) == 1
    # Labels stay bounded: no family has a label carrying an adapter id.
    labels = {k for samples in m.families.values() for s in samples for k in s.labels}
    assert "adapter_id" not in labels


async def test_evictions_are_counted_by_reason_with_their_age(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for n, adapter_id in enumerate(("a", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=n)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=2))
    url = sidecar.url
    for adapter_id in ("a", "b", "c"):  # the third one pushes a out: lru
        assert (await _stage(http, url, adapter_id, lease=False))[0] == 200
    status, _ = await call(http, "POST", f"{url}/evict", {"adapter_id": "b"})  # manual
    assert status == 200
    status, staged = await _stage(http, url, "a")  # leased ...
    assert status == 200
    status, evicted = await call(http, "POST", f"{url}/evict",
                                 {"adapter_id": "a", "force": True})  # ... so forced
    assert (status, evicted["broken_leases"]) == (200, [staged["lease_id"]])
    shutil.rmtree(sidecar.store.path_of("c"))  # external, noticed by the watcher

    async def external_counted() -> Scrape | None:
        m = await scrape(http, url)
        return m if m.value("lora_sidecar_evictions_total", reason="external") == 1 else None

    m = await eventually(external_counted, timeout_s=2, what="the external eviction")
    for reason in ("policy", "manual", "forced", "external"):
        assert m.value("lora_sidecar_evictions_total", reason=reason) == 1, reason
    assert m.value("lora_sidecar_adapter_age_at_eviction_seconds_count") == 4
    assert m.value("lora_sidecar_cache_adapters") == 0
    assert m.value("lora_sidecar_cache_bytes") == 0
    assert m.value("lora_sidecar_active_leases") == 0


async def test_a_refused_adapter_counts_its_validation_failure(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    TRUNCATED.write(tmp_path / "registry" / "truncated")
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, body = await _stage(http, sidecar.url, "truncated")

    assert (status, body["error"]) == (422, "invalid_adapter")
    m = await scrape(http, sidecar.url)
    assert m.value("lora_sidecar_validation_failures_total",
                   reason="safetensors_length_mismatch") == 1
    assert m.value("lora_sidecar_stage_requests_total", result="error") == 1
    assert m.value("lora_sidecar_cache_adapters") == 0
    assert _on_disk(sidecar.settings.cache_root) == (0, 0)


async def test_registry_errors_are_counted_by_operation(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    s3.put_adapter("denied", seed=1)

    async def deny_object_gets(request: web.Request, seen: Seen) -> web.Response | None:
        if seen.method == "GET" and "list-type" not in seen.query and "/denied/" in seen.path:
            body = ("<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                    "<Message>denied by the test</Message></Error>")
            return web.Response(status=403, body=body.encode(), content_type="application/xml")
        return None

    s3.proxy.fault = deny_object_gets
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))
    status, body = await _stage(http, sidecar.url, "denied")
    assert (status, body["error"]) == (502, "registry_error")

    missing_bucket = await start_sidecar(make_settings(
        tmp_path / "other", registry="s3://no-such-bucket/lora", s3_endpoint_url=s3.endpoint_url
    ))
    status, body = await _stage(http, missing_bucket.url, "denied")
    assert status == 502 and body["error"] == "registry_error"

    m = await scrape(http, sidecar.url)
    assert m.value("lora_sidecar_registry_errors_total", operation="get") >= 1
    m = await scrape(http, missing_bucket.url)
    assert m.value("lora_sidecar_registry_errors_total", operation="list") >= 1


async def test_a_fresh_sidecar_exports_every_known_series_at_zero_and_no_created_series(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """What a dashboard shows before the first event: 0 for every label value known in advance
    (not "no data"), and no `_created` twin beside each counter and histogram."""
    from sidecar.catalog.engine_state import EngineState
    from sidecar.catalog.name_state import NameState
    from sidecar.core import metrics
    from sidecar.validation.problem import PROBLEM_CODES

    sidecar = await start_sidecar(make_settings(tmp_path))
    async with http.get(f"{sidecar.url}/metrics") as response:
        text = await response.text()
    assert "_created" not in text
    m = await scrape(http, sidecar.url)
    expected = {
        "lora_sidecar_registry_errors_total": ("operation", metrics.REGISTRY_OPERATIONS),
        "lora_sidecar_triton_reloads_total": ("outcome", ("ok", "error")),
        "lora_sidecar_evictions_total": ("reason", ("policy", "manual", "forced", "external")),
        "lora_sidecar_catalog_compactions_total": (
            "reason", ("exhausted", "spares_low", "window", "requested", "engine_lost")),
        "lora_sidecar_signature_verifications_total": (
            "outcome", ("verified", "unsigned", "refused")),
        "lora_sidecar_catalog_name_changes_total": (
            "change", ("bound", "parked", "returned", "burnt")),
        "lora_sidecar_stage_requests_total": ("result", ("hit", "miss", "error")),
        "lora_sidecar_tenant_refusals_total": ("route", metrics.TENANT_ROUTES),
        # every code a check can give (tests/unit/validation/test_problem.py walks them)
        "lora_sidecar_validation_failures_total": ("reason", PROBLEM_CODES),
    }
    for sample, (label, values) in expected.items():
        for value in values:
            assert m.value(sample, **{label: value}) == 0, (sample, value)
    # the catalog's states, as its own enums name them
    assert metrics.NAME_STATES == tuple(state.value for state in NameState)
    assert metrics.ENGINE_STATES == tuple(state.value for state in EngineState)
    for state in metrics.NAME_STATES:
        m.value("lora_sidecar_catalog_names", state=state)  # present (the catalog sets it)
    for state in metrics.ENGINE_STATES:
        m.value("lora_sidecar_triton_model_state", state=state)
    # and nothing else: each labelled counter has exactly the series declared for it
    for sample, (label, values) in expected.items():
        assert {s.labels[label] for s in m.families[sample.removesuffix("_total")]
                if s.name == sample} == set(values), sample


def test_the_tenant_routes_counted_are_the_routes_the_api_authorizes() -> None:
    """TENANT_ROUTES (each counted from the first scrape) against every route name web/api.py
    passes to `_authorize`, which every refusal of a tenant's token follows."""
    from sidecar.core.metrics import TENANT_ROUTES

    tree = ast.parse((REPO / "sidecar" / "web" / "api.py").read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "_authorize"]
    routes = [call.args[1] for call in calls]
    assert all(isinstance(r, ast.Constant) for r in routes), "a route not written out"
    assert sorted({r.value for r in routes if isinstance(r, ast.Constant)}) == sorted(TENANT_ROUTES)
