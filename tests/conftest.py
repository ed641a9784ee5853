"""Fixtures shared by every test: an isolated environment, a moto S3 server over HTTP behind a
recording proxy, the real sidecar running on a free port, an HTTP session, and sidecar child
processes cleaned up after the test. The helpers these build on are in tests/support/."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from moto.server import ThreadedMotoServer
from prometheus_client import CollectorRegistry

from sidecar.config import Settings
from sidecar.process.app import Sidecar
from tests.support import scheduling, summary
from tests.support.api import StartSidecar
from tests.support.processes import SidecarProcess
from tests.support.s3 import BUCKET, S3Registry, reset_moto
from tests.support.s3proxy import S3Proxy
from tests.support.scheduling import TierScheduling

# ---- the run: parallel workers, the tiers' summaries ---------------------------------------


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> TierScheduling | None:
    """`-n N` shares the tests out by module, the heavy tiers as one unit (tests.support.
    scheduling); another `--dist` than xdist's default is run as asked."""
    if config.getvalue("dist") in ("load", "loadscope"):
        return TierScheduling(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    summary.receive(node.config, getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    summary.write(config, terminalreporter)
    busy = scheduling.busy_lines(terminalreporter.stats)
    if busy:  # a parallel run: how long each worker worked, beside the slowest tests
        terminalreporter.write_sep("-", "time per worker (set-ups and teardowns included)")
        for line in busy:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A developer's own AWS or sidecar settings must not change results."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "LORA_SIDECAR_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# ---- S3 ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def _session_proxy(moto_server: str) -> Iterator[S3Proxy]:
    proxy = S3Proxy(moto_server)
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture
def s3_proxy(_session_proxy: S3Proxy) -> Iterator[S3Proxy]:
    """The recording proxy in front of moto, cleared for this test."""
    _session_proxy.reset()
    yield _session_proxy
    _session_proxy.reset()


@pytest.fixture
def s3(moto_server: str, s3_proxy: S3Proxy, tmp_path: Path) -> Iterator[S3Registry]:
    reset_moto(moto_server)
    registry = S3Registry(moto_server, s3_proxy, tmp_path)
    registry.client.create_bucket(Bucket=BUCKET)
    yield registry
    registry.client.close()


# ---- the running sidecar ------------------------------------------------------------------


@pytest.fixture
async def start_sidecar() -> AsyncIterator[StartSidecar]:
    """Start the real sidecar in this event loop, on a free port; stopped after the test."""
    running: list[Sidecar] = []

    async def start(settings: Settings) -> Sidecar:
        sidecar = Sidecar(settings, metrics_registry=CollectorRegistry())
        await sidecar.start()
        running.append(sidecar)
        return sidecar

    yield start
    for sidecar in running:
        await sidecar.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.fixture
def sidecar_processes() -> Iterator[list[SidecarProcess]]:
    """Sidecar child processes a test started; killed after it if still running."""
    started: list[SidecarProcess] = []
    yield started
    for process in started:
        if process.process.poll() is None:
            process.process.kill()
            process.process.wait(10)
        process.stop()
