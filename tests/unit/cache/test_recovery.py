"""Restart cost: a record is trusted while its files keep their sizes and times, so a restart
reads headers, never an adapter's bytes; the port answers while the recovery runs, /readyz
says how far it is, and calls that need the index wait for it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.records import RECORD_NAME, AdapterRecord
from sidecar.cache.store import AdapterStore
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import ModelShapes
from sidecar.web import api
from tests.support.api import StartSidecar, call, readiness
from tests.support.processes import SidecarProcess, get_blocking, stage_blocking
from tests.support.settings import local_registry_adapter, make_settings

# About 10 MB of weights per adapter: re-hashing four of them would read 40 MB.
SHAPES = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=16, head_dim=128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_with_checksums(folder: Path, seed: int) -> int:
    """An adapter that ships a SHA256SUMS file; returns its size in bytes."""
    write_adapter(folder, rank=16, shapes=SHAPES, target_modules=MODULES, seed=seed)
    files = sorted(p for p in folder.iterdir())
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in files]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return sum(p.stat().st_size for p in folder.iterdir())


def bytes_read(pid: int) -> int:
    """What the process has read through read(2) and friends, files and sockets alike."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/<pid>/io")


def test_a_restart_reads_no_adapter_bytes_even_with_sha256sums(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    registry = tmp_path / "registry"
    ids = [f"summed-{i}" for i in range(4)]
    total_bytes = sum(write_with_checksums(registry / adapter_id, i)
                      for i, adapter_id in enumerate(ids))
    base = ["--registry", str(registry), "--min-free-disk", "0"]
    args = [*base, "--cache-root", str(tmp_path / "cache")]
    first = SidecarProcess(args, tmp_path / "first.log")
    sidecar_processes.append(first)
    for adapter_id in ids:
        assert stage_blocking(first.url, adapter_id, 60, lease=False)[0] == 200
    first.stop()

    # The same start on an empty cache: what a start reads without any adapter.
    empty = SidecarProcess([*base, "--cache-root", str(tmp_path / "empty-cache")],
                           tmp_path / "empty.log")
    sidecar_processes.append(empty)
    baseline = bytes_read(empty.pid)
    empty.stop()

    second = SidecarProcess(args, tmp_path / "second.log")  # returns once recovered
    sidecar_processes.append(second)
    read = bytes_read(second.pid) - baseline
    status, listing = get_blocking(second.url, "/adapters")
    assert status == 200
    assert sorted(a["adapter_id"] for a in listing["adapters"]) == ids  # type: ignore[union-attr]
    assert read < total_bytes / 10, (
        f"the restart read {read} bytes more than a start on an empty cache; the adapters "
        f"hold {total_bytes}")
    record = json.loads((tmp_path / "cache" / "adapters" / ids[0] / RECORD_NAME).read_text())
    assert "sha256sums" in record["verified"]


async def test_healthz_answers_and_readyz_counts_while_a_slow_recovery_runs(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for seed, adapter_id in enumerate(("a", "b", "c")):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    settings = make_settings(tmp_path)
    first = await start_sidecar(settings)
    for adapter_id in ("a", "b", "c"):
        assert (await call(http, "POST", f"{first.url}/stage",
                           {"adapter_id": adapter_id, "lease": False}))[0] == 200
    await first.stop()

    # Slow storage: reading folder b's record stalls until the test lets it go on.
    storage_back = threading.Event()
    read_record = AdapterStore.read_record

    def stalling_read(store: AdapterStore, folder: Path) -> AdapterRecord:
        if folder.name == "b":
            storage_back.wait(60)
        return read_record(store, folder)

    monkeypatch.setattr(AdapterStore, "read_record", stalling_read)
    # A call that needs the index, now held until the recovery has rebuilt it.
    holding = asyncio.Event()
    recovered = api._recovered

    async def recovered_noted(services: api.Services, *args: float) -> None:
        holding.set()
        await recovered(services, *args)

    monkeypatch.setattr(api, "_recovered", recovered_noted)
    second = Sidecar(settings, metrics_registry=CollectorRegistry())
    try:
        await second.start(wait_for_recovery=False)
        assert (await call(http, "GET", f"{second.url}/healthz"))[0] == 200
        status, ready = await readiness(http, second.url, mentioning="1 of 3")
        assert status == 503, ready
        assert "recovering: 1 of 3 adapter folders checked" in ready["problems"]
        held = asyncio.create_task(call(http, "POST", f"{second.url}/stage",
                                        {"adapter_id": "c", "lease": False}))
        await asyncio.wait_for(holding.wait(), 10)
        # Time passing is the point: a stage that did not wait for the index would be answered.
        await asyncio.wait({held}, timeout=0.3)
        assert not held.done(), "a stage was answered before the index was rebuilt"

        storage_back.set()
        status, body = await held
        assert status == 200 and body["cached"] is True, body
        status, ready = await call(http, "GET", f"{second.url}/readyz")
        assert not any("recovering" in p for p in ready.get("problems", [])), ready
    finally:
        storage_back.set()
        await second.stop()


async def test_a_restart_rereads_only_files_whose_times_changed(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    for seed, adapter_id in enumerate(("touched", "rewritten", "untouched")):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    settings = make_settings(tmp_path)
    first = await start_sidecar(settings)
    for adapter_id in ("touched", "rewritten", "untouched"):
        assert (await call(http, "POST", f"{first.url}/stage",
                           {"adapter_id": adapter_id, "lease": False}))[0] == 200
    await first.stop()
    adapters = tmp_path / "cache" / "adapters"
    weights = "adapter_model.safetensors"
    # Copied without its times: same bytes, a new modification time.
    touched = adapters / "touched" / weights
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    # Rewritten in place at the same size: the bytes vLLM would read are not the ones checked.
    rewritten = adapters / "rewritten" / weights
    data = bytearray(rewritten.read_bytes())
    data[-1] ^= 0xFF
    rewritten.write_bytes(bytes(data))
    os.utime(rewritten, ns=(rewritten.stat().st_atime_ns, rewritten.stat().st_mtime_ns + 10**9))

    second = await start_sidecar(settings)
    status, listing = await call(http, "GET", f"{second.url}/adapters")
    assert status == 200
    assert sorted(a["adapter_id"] for a in listing["adapters"]) == ["touched", "untouched"]
    quarantined = [p.name.split(".")[0] for p in (tmp_path / "cache" / ".quarantine").iterdir()]
    assert quarantined == ["rewritten"]
    record = json.loads((adapters / "touched" / RECORD_NAME).read_text())
    assert record["files"][weights]["mtime_ns"] == touched.stat().st_mtime_ns
    assert not (adapters / "touched" / f"{RECORD_NAME}.new").exists()
