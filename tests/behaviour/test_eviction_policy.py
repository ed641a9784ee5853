"""The eviction policy as a client sees it: a trace replayed over HTTP, one /stage at a time,
hits exactly where the simulation of the store's policy puts them; each adapter's standing in
GET /adapters; the policy in the build-info metric."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest

from benchmarks.policy import belady, ranked, simulate, zipf
from sidecar.config import EvictionPolicyName
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.settings import local_registry_adapter, make_settings

ADAPTERS, ROOM, REQUESTS = 30, 5, 160


@pytest.mark.parametrize("policy", list(EvictionPolicyName))
async def test_a_trace_over_http_hits_exactly_where_the_simulation_does(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    policy: EvictionPolicyName,
) -> None:
    rng = random.Random(33)
    ids = [f"z{i}" for i in range(ADAPTERS)]
    trace = ranked(ids, zipf(ADAPTERS, 1.0, REQUESTS, rng), rng)
    for seed, adapter_id in enumerate(ids):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    sidecar = await start_sidecar(make_settings(tmp_path, max_adapters=ROOM,
                                                eviction_policy=policy))

    hits = [(await stage_ok(http, sidecar, adapter_id, lease=False))["cached"] is True
            for adapter_id in trace]

    sizes = dict.fromkeys(ids, 1)
    simulated = simulate(policy, trace, sizes, max_bytes=1 << 62, max_adapters=ROOM,
                         keep_flags=True)
    assert hits == simulated.hit_flags
    assert 0 < sum(hits) <= belady(trace, sizes, max_bytes=1 << 62, max_adapters=ROOM).hits
    assert sidecar.store.snapshot().cache_adapters == ROOM


async def test_adapters_show_their_standing_and_metrics_name_the_policy(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    for seed, adapter_id in enumerate(("often", "once")):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    sidecar = await start_sidecar(make_settings(tmp_path,
                                                eviction_policy=EvictionPolicyName.S3FIFO))
    for adapter_id in ("often", "often", "often", "once"):
        await stage_ok(http, sidecar, adapter_id, lease=False)

    status, listing = await call(http, "GET", f"{sidecar.url}/adapters")
    assert status == 200
    standing = {a["adapter_id"]: a["standing"] for a in listing["adapters"]}
    # Its first request was the miss: two uses since it entered the small queue.
    assert standing["often"] == {"policy": "s3-fifo", "count": 3, "queue": "small", "uses": 2}
    assert standing["once"]["count"] == 1

    status, text = await call(http, "GET", f"{sidecar.url}/metrics")
    assert status == 200
    assert 'eviction_policy="s3-fifo"' in next(
        line for line in text.splitlines() if line.startswith("lora_sidecar_build_info"))
