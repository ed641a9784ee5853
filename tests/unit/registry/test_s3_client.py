"""The S3 registry's client against moto over HTTP: URLs signed while a listing is awaited."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.registry import s3_client
from sidecar.registry.s3 import S3Options, open_registry
from sidecar.registry.transfer import TransferPolicy
from tests.support.s3 import S3Registry

CONFIG = "adapter_config.json"


@pytest.fixture
async def registry(s3: S3Registry) -> AsyncIterator[s3_client.S3Registry]:
    options = S3Options(s3_endpoint_url=s3.endpoint_url, s3_region="us-east-1",
                        s3_connect_timeout_s=5.0, s3_read_timeout_s=10.0, s3_max_attempts=2)
    opened = open_registry(s3.registry, options,
                           TransferPolicy(8 << 20, 2, asyncio.Semaphore(4), 4),
                           lambda _: None, lambda _: None)
    assert isinstance(opened, s3_client.S3Registry)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def _presigns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys signed when a file is fetched (not those signed ahead)."""
    signed: list[str] = []
    real = s3_client.S3Registry._presign

    async def noted(self: s3_client.S3Registry, adapter_id: str | None, key: str, *,
                    checksums: bool) -> str:
        signed.append(key)
        return await real(self, adapter_id, key, checksums=checksums)

    monkeypatch.setattr(s3_client.S3Registry, "_presign", noted)
    return signed


async def test_a_file_named_likely_is_fetched_whole_with_the_url_signed_during_its_listing(
    s3: S3Registry, registry: s3_client.S3Registry, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    files = s3.put_adapter("a1")
    signed = _presigns(monkeypatch)
    listing = await registry.list_files("a1", likely=(CONFIG, "absent.bin", "../escape"))
    config = next(f for f in listing.files if f.name == CONFIG)

    got, fetched = await registry.fetch_bytes("a1", config, lambda _: None)

    assert got == files[CONFIG]
    assert signed == []  # its URL was signed while the listing was awaited
    gets = s3.proxy.gets(s3.key("a1", CONFIG))
    assert len(gets) == 1 and gets[0].range is None
    assert "x-amz-checksum-mode" in gets[0].query.lower()
    assert fetched.crc32 == f"{zlib.crc32(got):08x}"
    # A URL is used once: the next fetch of the file signs its own.
    await registry.fetch("a1", config, tmp_path / "again", lambda _: None,
                         sha256=True)
    assert signed == [config.locator]


async def test_a_url_signed_ahead_and_grown_old_is_signed_again(
    s3: S3Registry, registry: s3_client.S3Registry, monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3.put_adapter("a1")
    signed = _presigns(monkeypatch)
    listing = await registry.list_files("a1", likely=(CONFIG,))
    config = next(f for f in listing.files if f.name == CONFIG)
    url, signed_at = registry._signed_ahead[config.locator]
    registry._signed_ahead[config.locator] = (url, signed_at - s3_client.RESIGN_AFTER_S - 1)

    await registry.fetch_bytes("a1", config, lambda _: None)

    assert signed == [config.locator]


async def test_urls_signed_ahead_are_bounded(
    s3: S3Registry, registry: s3_client.S3Registry, monkeypatch: pytest.MonkeyPatch,
) -> None:
    s3.put_adapter("a1")
    monkeypatch.setattr(s3_client, "SIGNED_AHEAD_MAX", 3)
    names = tuple(f"never-fetched-{i}.bin" for i in range(5))
    await registry.list_files("a1", likely=names)
    kept: dict[str, Any] = registry._signed_ahead
    assert list(kept) == [f"{s3.prefix}/a1/{name}" for name in names[-3:]]  # the newest
