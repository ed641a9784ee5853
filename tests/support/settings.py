"""Settings for a sidecar under test: a cache and a local registry under the test's own folder,
a port of its own, short registry timeouts; and adapters written into that local registry."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sidecar.config import Settings
from sidecar.process.examples import write_adapter
from tests.support.s3 import S3Registry


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


def local_registry_adapter(tmp_path: Path, adapter_id: str, **kwargs: Any) -> Path:
    """An adapter written into the local registry of `make_settings(tmp_path)`."""
    folder = tmp_path / "registry" / adapter_id
    write_adapter(folder, **kwargs)
    return folder
