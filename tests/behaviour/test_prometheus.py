"""A real Prometheus server (Debian's `prometheus`) scrapes the sidecar, and its HTTP API answers
for the sidecar's metrics: the path an operator's Prometheus takes."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import StartSidecar, call
from tests.support.settings import local_registry_adapter, make_settings
from tests.support.waiting import eventually

StartPrometheus = Callable[[str], str]  # scrape target host:port -> Prometheus base URL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[StartPrometheus]:
    """Start Prometheus scraping one target every second; stopped after the test."""
    executable = shutil.which("prometheus")
    if executable is None:
        pytest.fail("prometheus is missing: run scripts/install-system-deps.sh")
    running: list[tuple[subprocess.Popen[bytes], Any]] = []
    log_path = tmp_path / "prometheus.log"

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML: no YAML writer needed
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "lora-sidecar", "static_configs": [{"targets": [target]}]},
            ],
        }))
        port = _free_port()
        log_file = open(log_path, "wb")  # closed once the process has ended
        process = subprocess.Popen(
            [executable, f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
        )
        running.append((process, log_file))
        return f"http://127.0.0.1:{port}"

    yield start
    for process, log_file in running:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log_file.close()


async def _query(http: aiohttp.ClientSession, prometheus: str, promql: str) -> dict[str, float]:
    """An instant query's answer as {result label: value}; {} while Prometheus is starting."""
    try:
        async with http.get(f"{prometheus}/api/v1/query", params={"query": promql}) as response:
            if response.status != 200:
                return {}
            body = await response.json()
    except aiohttp.ClientConnectionError:
        return {}
    assert body["status"] == "success"
    return {r["metric"].get("result", ""): float(r["value"][1]) for r in body["data"]["result"]}


async def test_prometheus_scrapes_cache_gauges_and_stage_counters(
    tmp_path: Path, start_sidecar: StartSidecar, start_prometheus: StartPrometheus,
    http: aiohttp.ClientSession,
) -> None:
    for n, adapter_id in enumerate(("a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=n)
    sidecar = await start_sidecar(make_settings(tmp_path))
    for adapter_id in ("a", "a", "a"):  # one miss, two hits
        status, _ = await call(http, "POST", f"{sidecar.url}/stage",
                               {"adapter_id": adapter_id, "lease": False})
        assert status == 200
    prometheus = start_prometheus(f"127.0.0.1:{sidecar.port}")

    async def stage_counts() -> dict[str, float]:
        counts = await _query(http, prometheus,
                              'lora_sidecar_stage_requests_total{job="lora-sidecar"}')
        return counts if counts.get("hit") == 2 else {}

    counts = await eventually(stage_counts, timeout_s=20, what="Prometheus has scraped")
    assert counts == {"hit": 2, "miss": 1, "error": 0}
    assert await _query(http, prometheus, "lora_sidecar_cache_adapters") == {"": 1}
    assert await _query(http, prometheus, 'up{job="lora-sidecar"}') == {"": 1}

    # A change on the sidecar shows in Prometheus at the next scrape.
    status, _ = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "b"})
    assert status == 200

    async def two_cached() -> bool:
        return await _query(http, prometheus, "lora_sidecar_cache_adapters") == {"": 2}

    await eventually(two_cached, timeout_s=5, what="the next scrape sees two adapters")
    assert await _query(http, prometheus, "lora_sidecar_active_leases") == {"": 1}
