"""Shared fixtures: a moto S3 server over HTTP behind a recording proxy, adapter factories,
settings, and the real sidecar running on a free port."""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from moto.server import ThreadedMotoServer
from prometheus_client import CollectorRegistry

from sidecar.config import Settings
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from tests.processes import SidecarProcess
from tests.s3proxy import S3Proxy

BUCKET = "adapters"
PREFIX = "lora"


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


class S3Registry:
    """A bucket on the moto server, with helpers to upload adapters into it."""

    def __init__(self, moto_url: str, proxy: S3Proxy, tmp_path: Path) -> None:
        self.moto_url = moto_url
        self.proxy = proxy
        self.bucket = BUCKET
        self.prefix = PREFIX
        self._tmp = tmp_path / "s3-uploads"
        self.client = boto3.client(
            "s3", endpoint_url=moto_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )

    @property
    def registry(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def endpoint_url(self) -> str:
        """Where the sidecar talks to: through the recording proxy."""
        return self.proxy.url

    def key(self, adapter_id: str, name: str) -> str:
        return f"{self.prefix}/{adapter_id}/{name}"

    def put_adapter(self, adapter_id: str, **kwargs: Any) -> dict[str, bytes]:
        """Write an adapter with `write_adapter(**kwargs)` and upload it; return its files."""
        folder = self._tmp / adapter_id
        write_adapter(folder, **kwargs)
        return self.put_folder(adapter_id, folder)

    def put_folder(self, adapter_id: str, folder: Path) -> dict[str, bytes]:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        for name, data in files.items():
            self.put_object(self.key(adapter_id, name), data)
        return files

    def put_object(self, key: str, data: bytes, **kwargs: Any) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **kwargs)


@pytest.fixture
def s3(moto_server: str, s3_proxy: S3Proxy, tmp_path: Path) -> Iterator[S3Registry]:
    urllib.request.urlopen(urllib.request.Request(f"{moto_server}/moto-api/reset",
                                                  method="POST"), timeout=10).close()
    registry = S3Registry(moto_server, s3_proxy, tmp_path)
    registry.client.create_bucket(Bucket=BUCKET)
    yield registry
    registry.client.close()


def set_moto_auth(moto_url: str, unauthenticated_calls: str) -> None:
    """Switch moto's credential checks on ("0": no call passes unsigned) or off ("inf")."""
    request = urllib.request.Request(
        f"{moto_url}/moto-api/reset-auth", data=unauthenticated_calls.encode(), method="POST",
        headers={"Content-Type": "text/plain"},  # a form type would swallow the body
    )
    urllib.request.urlopen(request, timeout=10).close()


# ---- settings and the running sidecar ----------------------------------------------------


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    base = Settings.from_values({
        "registry": str(tmp_path / "registry"),
        "cache_root": str(tmp_path / "cache"),
        "port": "0",
        "s3_connect_timeout_s": "2",
        "s3_read_timeout_s": "5",
        "s3_max_attempts": "3",
        "min_free_bytes": "0",
        # Adapters are written just before they are staged here; the tests of the settle
        # time set it themselves.
        "upload_settle_s": "0",
    })
    settings = dataclasses.replace(base, **overrides)
    if settings.is_local:
        # A local registry folder that does not exist stops the start (process/preflight.py).
        Path(settings.registry).mkdir(parents=True, exist_ok=True)
    return settings


def s3_settings(tmp_path: Path, s3: S3Registry, **overrides: Any) -> Settings:
    return make_settings(tmp_path, registry=s3.registry, s3_endpoint_url=s3.endpoint_url,
                         **overrides)


StartSidecar = Callable[[Settings], Awaitable[Sidecar]]


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


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One JSON request; returns (status, parsed body)."""
    data = None if body is None else json.dumps(body)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.request(method, url, data=data, headers=all_headers) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


async def stage_ok(http: aiohttp.ClientSession, sidecar: Sidecar, adapter_id: str,
                   **extra: object) -> dict[str, object]:
    """POST /stage that must answer 200; its body."""
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": adapter_id, **extra})
    assert status == 200, body
    assert isinstance(body, dict)
    return body


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


def local_registry_adapter(tmp_path: Path, adapter_id: str, **kwargs: Any) -> Path:
    folder = tmp_path / "registry" / adapter_id
    write_adapter(folder, **kwargs)
    return folder
