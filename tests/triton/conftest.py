"""Fixtures for tests in a real Triton: one server per module (a start and the router's load
cost seconds), and per test a fresh sidecar on the port the router was loaded with. The node and
the calls these use are in node.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc.aio as grpcclient

from sidecar.process.app import Sidecar
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.api import StartSidecar
from tests.support.s3 import S3Registry
from tests.support.settings import s3_settings
from tests.triton.node import StartNodeSidecar, TritonNode, start_triton_node


@pytest.fixture(scope="module")
def triton_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonNode]:
    node = start_triton_node(tmp_path_factory.mktemp("triton"))
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
async def node_sidecar(
    triton_node: TritonNode, tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar
) -> AsyncIterator[StartNodeSidecar]:
    """Start the sidecar the router talks to, on the module's cache, with Triton's URL; return
    once Triton has loaded the catalog it rendered (unless `triton_url=None` is given)."""
    for entry in triton_node.cache_root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()

    async def start(**overrides: Any) -> Sidecar:
        base_config = tmp_path / "base-model-config.json"
        base_config.write_text(json.dumps(TINY_LLAMA.to_config()))
        values: dict[str, Any] = {
            "base_model_config": base_config,
            "cache_root": triton_node.cache_root,
            "port": triton_node.sidecar_port,
            "triton_url": triton_node.server.http_url,
            "triton_reload_min_interval_s": 0.0,
            "catalog_refresh_s": 3600.0,  # tests sync the catalog when they mean to
            **overrides,
        }
        sidecar = await start_sidecar(s3_settings(tmp_path, s3, **values))
        # The daemon's own first sync queues behind this one on the catalog's lock; the second
        # call returns after it, so no listing is left to race with what the test uploads.
        await sidecar.reloads.sync()
        await sidecar.reloads.sync()
        status = sidecar.reloads.status()
        if values["triton_url"] is not None:
            assert status["triton"]["loaded_generation"] == status["generation"], (
                f"{status}\n{triton_node.server.log_tail()}")
        return sidecar

    yield start


@pytest.fixture
async def grpc(triton_node: TritonNode) -> AsyncIterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(triton_node.server.grpc_url)
    yield client
    await client.close()
