"""local.py: a registry folder listed in one job, a file of one part copied (or read into memory)
by one job with the same checks and checksums as the ranged copy of a larger one, nothing
behind a link or changed since the listing ever read."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.core.errors import AdapterNotFound, RegistryObjectChanged, RegistryUnavailable
from sidecar.registry import local
from sidecar.registry.base import RemoteFile
from sidecar.registry.checksum import crc32_hex
from sidecar.registry.local import LocalRegistry
from sidecar.registry.transfer import TransferPolicy

PART_BYTES = 64 * 1024  # below the option's floor, so a test file can span several parts


class _Chunks:
    """An inspector that keeps what each chunk held when it was handed over."""

    def __init__(self) -> None:
        self.seen: dict[int, bytes] = {}

    def stream(self, offset: int) -> Callable[[int, memoryview], None]:
        def look(at: int, chunk: memoryview) -> None:
            self.seen[at] = bytes(chunk)
        return look

    def joined(self) -> bytes:
        return b"".join(data for _, data in sorted(self.seen.items()))


def _registry(tmp_path: Path) -> LocalRegistry:
    policy = TransferPolicy(PART_BYTES, 3, asyncio.Semaphore(4), 4)
    return LocalRegistry(tmp_path / "registry", policy)


def _adapter(tmp_path: Path, files: dict[str, bytes]) -> None:
    folder = tmp_path / "registry" / "a1"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _listed(files: list[RemoteFile], name: str) -> RemoteFile:
    return next(f for f in files if f.name == name)


@pytest.mark.parametrize("size_bytes", [0, 1000, PART_BYTES, 3 * PART_BYTES + 17])
async def test_a_file_is_copied_with_the_checksums_of_its_bytes(
    tmp_path: Path, size_bytes: int
) -> None:
    data = os.urandom(size_bytes)
    _adapter(tmp_path, {"adapter_model.safetensors": data})
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    counted: list[int] = []
    chunks = _Chunks()
    dest = tmp_path / "dest"
    fetched = await registry.fetch("a1", _listed(listing.files, "adapter_model.safetensors"),
                                   dest, counted.append, inspect=chunks, sha256=True)
    assert dest.read_bytes() == data
    assert fetched.crc32 == crc32_hex(zlib.crc32(data))
    assert fetched.sha256 == hashlib.sha256(data).hexdigest()
    assert sum(counted) == size_bytes
    assert chunks.joined() == data


async def test_a_small_file_is_read_into_memory_with_its_checksums(tmp_path: Path) -> None:
    data = b'{"r": 16, "lora_alpha": 32}'
    _adapter(tmp_path, {"adapter_config.json": data})
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    got, fetched = await registry.fetch_bytes(
        "a1", _listed(listing.files, "adapter_config.json"), lambda _: None)
    assert got == data
    assert fetched.crc32 == crc32_hex(zlib.crc32(data))
    assert fetched.sha256 == hashlib.sha256(data).hexdigest()


async def test_a_file_changed_since_its_listing_is_not_copied(tmp_path: Path) -> None:
    _adapter(tmp_path, {"adapter_model.safetensors": b"x" * 100})
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    (tmp_path / "registry" / "a1" / "adapter_model.safetensors").write_bytes(b"y" * 200)
    dest = tmp_path / "dest"
    with pytest.raises(RegistryObjectChanged, match="changed between listing and copy"):
        await registry.fetch("a1", listing.files[0], dest, lambda _: None)
    assert not dest.exists()
    with pytest.raises(RegistryObjectChanged):
        await registry.fetch_bytes("a1", listing.files[0], lambda _: None)


async def test_a_file_replaced_by_a_link_is_never_followed(tmp_path: Path) -> None:
    _adapter(tmp_path, {"adapter_config.json": b"{}"})
    secret = tmp_path / "secret"
    secret.write_bytes(b"{}")
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    path = tmp_path / "registry" / "a1" / "adapter_config.json"
    path.unlink()
    path.symlink_to(secret)
    with pytest.raises(RegistryObjectChanged, match="became a link"):
        await registry.fetch_bytes("a1", listing.files[0], lambda _: None)
    with pytest.raises(RegistryObjectChanged, match="became a link"):
        await registry.fetch("a1", listing.files[0], tmp_path / "dest", lambda _: None)


async def test_a_read_error_of_a_small_file_is_retried_as_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(5000)
    _adapter(tmp_path, {"adapter_model.safetensors": data})
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    real = local._FileRange.readinto
    failures = [1]

    def failing_once(self: local._FileRange, buffer: memoryview) -> int:
        if failures:  # a disk's I/O error, once (a stand-in for the fault)
            failures.pop()
            raise RegistryUnavailable("I/O error", cause="read_error")
        return real(self, buffer)

    monkeypatch.setattr(local._FileRange, "readinto", failing_once)
    dest = tmp_path / "dest"
    fetched = await registry.fetch("a1", listing.files[0], dest, lambda _: None, sha256=True)
    assert not failures
    assert dest.read_bytes() == data
    assert fetched.sha256 == hashlib.sha256(data).hexdigest()


class _Held:
    """An inspector that holds the copy's worker thread at its first chunk until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def stream(self, offset: int) -> Callable[[int, memoryview], None]:
        def look(at: int, chunk: memoryview) -> None:
            self.entered.set()
            self.release.wait(10)
        return look


async def test_a_cancelled_copy_returns_only_once_its_worker_thread_has_ended(
    tmp_path: Path
) -> None:
    data = os.urandom(3000)
    _adapter(tmp_path, {"adapter_model.safetensors": data})
    registry = _registry(tmp_path)
    listing = await registry.list_files("a1")
    held = _Held()
    dest = tmp_path / "dest"
    copying = asyncio.create_task(
        registry.fetch("a1", listing.files[0], dest, lambda _: None, inspect=held))
    assert await asyncio.to_thread(held.entered.wait, 10)
    copying.cancel()
    for _ in range(5):
        await asyncio.sleep(0)  # turns of the loop: the cancellation is seen meanwhile
    assert not copying.done()  # the thread still copies: the stage's folder must stay
    held.release.set()
    with pytest.raises(asyncio.CancelledError):
        await copying
    assert dest.read_bytes() == data  # written whole before the caller went on


async def test_a_listing_says_whether_the_folder_or_the_adapter_is_missing(
    tmp_path: Path
) -> None:
    registry = _registry(tmp_path)
    with pytest.raises(RegistryUnavailable, match="does not exist"):
        await registry.list_files("a1")
    _adapter(tmp_path, {"adapter_config.json": b"{}"})
    with pytest.raises(AdapterNotFound):
        await registry.list_files("a2")
    (tmp_path / "registry" / "a3").symlink_to(tmp_path / "registry" / "a1")
    with pytest.raises(AdapterNotFound):
        await registry.list_files("a3")
