"""NaN and infinity in a LoRA tensor are refused (`non_finite_weights`) on every path: a stage
checks them in the bytes its download reads (one pass, even for an element cut in two by a
ranged part), an adapter copied into the cache is quarantined, a restart that re-reads the
weights checks them, and `lora-sidecar validate` says so. With the real engine, an adapter
holding one NaN is served with empty text and corrupts the next answer of another tenant."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from sidecar.cache.records import Check
from sidecar.process.examples import tensor_name, write_adapter
from sidecar.registry.checksum import crc32_hex
from sidecar.registry.transfer import TransferPolicy, part_starts
from sidecar.validation.shapes import ModelShapes
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.observing import scrape
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.s3 import S3Registry
from tests.support.settings import local_registry_adapter, make_settings, s3_settings
from tests.support.waiting import eventually

CHECK_VALUES = Check.VALUES  # what a record lists once every tensor value was read
WEIGHTS = "adapter_model.safetensors"
PART_BYTES = 5 * 1024**2
# About 20 MB of float32 weights: four ranged parts of 5 MiB.
SHAPES = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=8, head_dim=128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layout(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header: dict[str, dict[str, object]] = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    return 8 + length, header


def pad_header(path: Path, extra_spaces: int) -> None:
    """Pad the header with spaces (allowed), moving every tensor by that many bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + length] + b" " * extra_spaces
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])


def encode(value: float, dtype: str) -> bytes:
    if dtype == "F16":
        return np.float16(value).tobytes()
    if dtype == "BF16":
        return np.float32(value).tobytes()[2:]  # the top half of a float32
    return np.float32(value).tobytes()


def set_element(path: Path, tensor: str, index: int, value: float) -> int:
    """Write `value` into element `index` of `tensor`; return the element's file offset."""
    data_start, header = layout(path)
    entry = header[tensor]
    size = {"F16": 2, "BF16": 2, "F32": 4}[str(entry["dtype"])]
    begin = data_start + int(entry["data_offsets"][0]) + index * size  # type: ignore[index]
    with path.open("r+b") as f:
        f.seek(begin)
        f.write(encode(value, str(entry["dtype"])))
    return begin


def ranged_parts(size_bytes: int) -> list[int]:
    return part_starts(size_bytes, TransferPolicy(PART_BYTES, 3, asyncio.Semaphore(1), 32))


def adapter_with_a_nan_across_a_part_boundary(folder: Path) -> tuple[str, int, int]:
    """An f32 adapter with NaN in an element whose 4 bytes two ranged parts share, and +Inf
    elsewhere in the same tensor. Returns (tensor, index of the NaN, index of the Inf)."""
    write_adapter(folder, rank=16, target_modules=MODULES, shapes=SHAPES, dtype="float32")
    path = folder / WEIGHTS
    pristine = path.read_bytes()
    for spaces in range(8):  # tensors start where the header ends: move them until one
        path.write_bytes(pristine)  # element straddles a part boundary
        pad_header(path, spaces)
        data_start, header = layout(path)
        boundary = ranged_parts(path.stat().st_size)[2]
        for name, entry in header.items():
            begin, end = (data_start + int(o) for o in entry["data_offsets"])  # type: ignore[attr-defined]
            if begin < boundary < end and (boundary - begin) % 4:
                nan_index = (boundary - begin) // 4
                inf_index = (nan_index + 1000) % ((end - begin) // 4)
                set_element(path, name, nan_index, np.nan)
                set_element(path, name, inf_index, np.inf)
                return name, nan_index, inf_index
    raise AssertionError("no padding puts an element across a part boundary")


async def test_a_stage_refuses_nan_and_inf_found_in_flight_even_across_a_part_boundary(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    folder = tmp_path / "upload" / "nan-v1"
    tensor, nan_index, inf_index = adapter_with_a_nan_across_a_part_boundary(folder)
    s3.put_folder("nan-v1", folder)
    s3.put_adapter("clean-v1", rank=16, target_modules=MODULES, shapes=SHAPES, dtype="bfloat16")
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=PART_BYTES))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "nan-v1"})

    assert status == 422, body
    assert len(s3.proxy.gets(s3.key("nan-v1", WEIGHTS))) == 4  # in ranged parts
    assert [(p["code"], p["file"]) for p in body["problems"]] == [
        ("non_finite_weights", WEIGHTS)]
    message = body["problems"][0]["message"]
    assert tensor in message and "2 non-finite values" in message
    first = min(nan_index, inf_index)
    rows, columns = divmod(first, int(layout(folder / WEIGHTS)[1][tensor]["shape"][1]))  # type: ignore[index]
    kind = "NaN" if first == nan_index else "an infinity"
    assert f"the first is {kind} at index [{rows}, {columns}]" in message
    assert not (tmp_path / "cache" / "adapters" / "nan-v1").exists()
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_validation_failures_total",
                         reason="non_finite_weights") == 1
    # The next tenant's adapter is unaffected.
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "clean-v1"})
    assert status == 200, body


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_a_stage_from_a_local_registry_refuses_a_half_precision_infinity(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession, dtype: str
) -> None:
    folder = local_registry_adapter(tmp_path, "inf-v1", dtype=dtype)
    tensor = tensor_name(1, "q_proj", "A")
    set_element(folder / WEIGHTS, tensor, 7, -np.inf)
    sidecar = await start_sidecar(make_settings(tmp_path))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "inf-v1"})

    assert status == 422, body
    assert body["problems"][0]["code"] == "non_finite_weights"
    assert "the first is an infinity at index [0, 7]" in body["problems"][0]["message"]


def rchar(pid: int) -> int:
    """Bytes the process has read through read(2), pread(2) and friends (not recv(2))."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_the_values_are_checked_in_the_bytes_the_download_reads_not_in_a_second_pass(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    files = s3.put_adapter("big-v1", rank=16, target_modules=MODULES, shapes=SHAPES,
                           dtype="float32")
    size = sum(len(data) for data in files.values())
    process = SidecarProcess(
        ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
         "--cache-root", str(tmp_path / "cache"), "--min-free-disk", "0",
         "--part-size", str(PART_BYTES), "--download-concurrency", "1"],
        tmp_path / "sidecar.log")
    sidecar_processes.append(process)
    before = rchar(process.pid)

    status, body = stage_blocking(process.url, "big-v1", 60)

    read = rchar(process.pid) - before
    assert status == 200, body
    # recv(2) is not counted: what a pass over the files reads shows alone. One range at a
    # time, every chunk lands at the end of the hashed prefix, so the SHA-256 of the content
    # digest is taken in the buffers the bytes arrive in (parts landing out of order would be
    # read back once); the value check adds no pass of its own, and beyond that only the
    # header and the config are read back.
    assert read < size * 0.1, f"read {read} bytes from files to stage {size}"


async def test_an_adapter_with_nan_copied_into_the_cache_is_quarantined_never_served(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    outside = tmp_path / "cache" / "copy-in" / "copied-v1"
    write_adapter(outside, dtype="bfloat16")
    set_element(outside / WEIGHTS, tensor_name(0, "v_proj", "B"), 3, np.nan)
    os.rename(outside, sidecar.store.adapters_dir / "copied-v1")

    async def quarantined() -> bool:
        folder = sidecar.store.quarantine_dir
        return folder.is_dir() and any(p.name.startswith("copied-v1") for p in folder.iterdir())

    await eventually(quarantined, timeout_s=10, what="the copied folder is quarantined")
    status, body = await call(http, "GET", f"{sidecar.url}/adapters/copied-v1")
    assert status == 404, body
    metrics = await scrape(http, sidecar.url)
    assert metrics.value("lora_sidecar_validation_failures_total",
                         reason="non_finite_weights") == 1


async def test_a_restart_checks_the_values_of_a_record_that_never_had_them_checked(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # An adapter published by a version that did not read tensor values: its record vouches
    # for its bytes but not for their values, so the restart reads them once.
    local_registry_adapter(tmp_path, "old-v1")
    sidecar = await start_sidecar(make_settings(tmp_path))
    body = await stage_ok(http, sidecar, "old-v1", lease=False)
    await sidecar.stop()
    published = Path(str(body["local_path"]))
    set_element(published / WEIGHTS, tensor_name(1, "q_proj", "B"), 0, np.nan)
    as_recorded_before_values_were_checked(published)

    restarted = await start_sidecar(make_settings(tmp_path))

    assert restarted.store.get("old-v1") is None
    quarantined = [p.name for p in restarted.store.quarantine_dir.iterdir()]
    assert [name for name in quarantined if name.startswith("old-v1")], quarantined


async def test_a_restart_reads_the_values_once_and_records_that_it_did(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    local_registry_adapter(tmp_path, "old-v1")
    sidecar = await start_sidecar(make_settings(tmp_path))
    body = await stage_ok(http, sidecar, "old-v1", lease=False)
    await sidecar.stop()
    published = Path(str(body["local_path"]))
    as_recorded_before_values_were_checked(published)

    restarted = await start_sidecar(make_settings(tmp_path))

    assert restarted.store.get("old-v1") is not None
    record = json.loads((published / ".sidecar.json").read_text())
    assert CHECK_VALUES in record["verified"], record


def as_recorded_before_values_were_checked(published: Path) -> None:
    """Rewrite the folder's record as a version without the value check wrote it: the files'
    CRC-32s and times as they are now, no `finite_values` among the checks."""
    record_path = published / ".sidecar.json"
    record = json.loads(record_path.read_text())
    weights = (published / WEIGHTS).read_bytes()
    record["files"][WEIGHTS]["crc32"] = crc32_hex(zlib.crc32(weights))
    record["files"][WEIGHTS]["size_bytes"] = len(weights)
    record["files"][WEIGHTS]["sha256"] = None
    record["files"][WEIGHTS]["mtime_ns"] = (published / WEIGHTS).stat().st_mtime_ns
    record["verified"] = [c for c in record["verified"] if c != CHECK_VALUES]
    record_path.write_text(json.dumps(record))


def test_the_validate_command_names_the_tensor_and_exits_1(tmp_path: Path) -> None:
    folder = tmp_path / "adapter"
    write_adapter(folder, dtype="float32")
    tensor = tensor_name(0, "q_proj", "B")
    set_element(folder / WEIGHTS, tensor, 9, np.nan)

    result = subprocess.run([sys.executable, "-m", "sidecar", "validate", str(folder), "--json"],
                            capture_output=True, text=True, timeout=60)

    assert result.returncode == 1, result.stderr
    verdict = json.loads(result.stdout)
    assert [p["code"] for p in verdict["problems"]] == ["non_finite_weights"]
    assert tensor in verdict["problems"][0]["message"]
    shutil.rmtree(folder)
