"""Checksums: each part's CRC-32 is taken as its bytes land and combined into the file's, then
compared with the full-object checksums the registry keeps (CRC-32 by default for uploads of
current AWS SDKs, SHA-256 when the uploader asked for it)."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import aiohttp
import boto3
import botocore.config
import pytest
from boto3.s3.transfer import TransferConfig
from hypothesis import given
from hypothesis import strategies as st

from sidecar.process.examples import write_adapter
from sidecar.registry.checksum import crc32_combine, s3_checksum_hex
from sidecar.registry.transfer import TransferPolicy, part_starts
from sidecar.validation.shapes import ModelShapes
from tests.support.api import StartSidecar, call
from tests.support.s3 import S3Registry
from tests.support.s3proxy import BodyFault, Seen
from tests.support.settings import s3_settings

WEIGHTS = "adapter_model.safetensors"
# About 12 MB of weights: three ranged parts of 5 MiB or less.
SHAPES = ModelShapes(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=20, head_dim=128)


@given(st.binary(max_size=3000), st.binary(max_size=3000), st.binary(max_size=300))
def test_crc32_of_parts_combines_into_the_crc32_of_the_whole(
    a: bytes, b: bytes, c: bytes
) -> None:
    ab = crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert ab == zlib.crc32(a + b)
    assert crc32_combine(ab, zlib.crc32(c), len(c)) == zlib.crc32(a + b + c)


def test_composite_checksums_of_multipart_uploads_are_not_compared() -> None:
    assert s3_checksum_hex("DUoRhQ==", None) == "0d4a1185"
    assert s3_checksum_hex("DUoRhQ==-3", None) is None
    assert s3_checksum_hex("DUoRhQ==", "COMPOSITE") is None
    assert s3_checksum_hex("not base64!", "FULL_OBJECT") is None


def upload(s3: S3Registry, tmp_path: Path, adapter_id: str, algorithm: str) -> dict[str, bytes]:
    folder = tmp_path / "upload" / adapter_id
    write_adapter(folder, rank=16, shapes=SHAPES, target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    for name, data in files.items():
        s3.put_object(s3.key(adapter_id, name), data, ChecksumAlgorithm=algorithm)
    return files


def record_of(body: dict[str, object]) -> dict[str, dict[str, object]]:
    record = json.loads((Path(str(body["local_path"])) / ".sidecar.json").read_text())
    files: dict[str, dict[str, object]] = record["files"]
    return files


async def test_registry_crc32_is_checked_over_ranged_parts_and_recorded(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    files = upload(s3, tmp_path, "crc-v1", "CRC32")
    head = s3.client.head_object(Bucket=s3.bucket, Key=s3.key("crc-v1", WEIGHTS),
                                 ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32")  # the registry keeps one: the sidecar must compare it
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "crc-v1"})

    assert status == 200, body
    assert len(s3.proxy.gets(s3.key("crc-v1", WEIGHTS))) > 1  # combined from ranged parts
    recorded = record_of(body)
    for name, data in files.items():
        assert recorded[name]["crc32"] == f"{zlib.crc32(data):08x}"
        # Hashed in order as the parts land: the content digest needs it.
        assert recorded[name]["sha256"] == hashlib.sha256(data).hexdigest()


async def test_registry_sha256_is_computed_checked_and_recorded(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    files = upload(s3, tmp_path, "sha-v1", "SHA256")
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "sha-v1"})

    assert status == 200, body
    recorded = record_of(body)
    for name, data in files.items():
        assert recorded[name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert recorded[name]["crc32"] == f"{zlib.crc32(data):08x}"


def staged_weights(body: dict[str, object]) -> bytes:
    return (Path(str(body["local_path"])) / WEIGHTS).read_bytes()


def transfer_part_starts(size_bytes: int) -> list[int]:
    """The ranged GETs the sidecar makes for one file with the settings used here."""
    import asyncio

    return part_starts(size_bytes, TransferPolicy(5 * 1024**2, 3, asyncio.Semaphore(1), 32))


def file_get(name: str) -> Callable[[Seen], bool]:
    """Whether a request the proxy saw is a GET of the file `name` (not a listing)."""
    def matches(seen: Seen) -> bool:
        return seen.method == "GET" and seen.path.endswith(name) and "list-type" not in seen.query
    return matches


weights_get = file_get(WEIGHTS)
config_get = file_get("adapter_config.json")


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
async def test_bytes_corrupted_in_transit_once_are_fetched_again_and_staged_intact(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    algorithm: str,
) -> None:
    adapter_id = f"{algorithm.lower()}-flip-once"
    files = upload(s3, tmp_path, adapter_id, algorithm)
    # One bit flipped in the tensor data of one ranged part (past the ~50 KB header): the
    # length is right, the bytes are not, and the registry's checksum says so.
    s3.proxy.body_faults.append(BodyFault(weights_get, after_bytes=200_000, mode="flip"))
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})

    assert status == 200, body
    parts = len(transfer_part_starts(len(files[WEIGHTS])))
    assert len(s3.proxy.gets(s3.key(adapter_id, WEIGHTS))) == 2 * parts  # fetched once more
    assert staged_weights(body) == files[WEIGHTS]
    assert record_of(body)[WEIGHTS]["crc32"] == f"{zlib.crc32(files[WEIGHTS]):08x}"
    # The SHA-256 of the corrupted download (hashed as its ranges landed) went with it: the
    # one recorded is of the intact bytes.
    assert record_of(body)[WEIGHTS]["sha256"] == hashlib.sha256(files[WEIGHTS]).hexdigest()


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
async def test_a_file_of_one_get_is_checked_against_the_checksums_its_own_answer_brings(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    algorithm: str,
) -> None:
    adapter_id = f"{algorithm.lower()}-whole"
    files = upload(s3, tmp_path, adapter_id, algorithm)
    s3.proxy.body_faults.append(BodyFault(weights_get, after_bytes=200_000, mode="flip"))
    # Every file fits one part: each is one GET of the whole object, and no HEAD is made.
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=64 * 1024**2))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})

    assert status == 200, body
    weights_gets = s3.proxy.gets(s3.key(adapter_id, WEIGHTS))
    assert len(weights_gets) == 2  # the flipped bit was caught by the registry's checksum
    assert all(seen.range is None for seen in weights_gets)
    assert [seen for seen in s3.proxy.seen if seen.method == "HEAD"] == []
    assert staged_weights(body) == files[WEIGHTS]
    recorded = record_of(body)
    for name, data in files.items():
        assert recorded[name]["crc32"] == f"{zlib.crc32(data):08x}"
        assert recorded[name]["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
async def test_bytes_corrupted_on_every_download_are_a_retryable_503_that_is_not_remembered(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    algorithm: str,
) -> None:
    adapter_id = f"{algorithm.lower()}-flip-always"
    files = upload(s3, tmp_path, adapter_id, algorithm)
    fault = BodyFault(weights_get, after_bytes=200_000, mode="flip", times=1000)
    s3.proxy.body_faults.append(fault)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2,
                                              refusal_ttl_s=3600.0))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})

    assert status == 503, body
    assert body["error"] == "registry_transient" and body["cause"] == "checksum_mismatch"
    assert "CRC-32" in body["message"] or "SHA-256" in body["message"]
    assert "ask again" in body["message"] and "proxy" in body["message"]
    parts = len(transfer_part_starts(len(files[WEIGHTS])))
    assert len(s3.proxy.gets(s3.key(adapter_id, WEIGHTS))) == 3 * parts  # three downloads
    assert not (tmp_path / "cache" / "adapters" / adapter_id).exists()
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []

    s3.proxy.body_faults.clear()  # the path heals: the next stage fetches, nothing remembered
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})
    assert status == 200, body
    assert staged_weights(body) == files[WEIGHTS]


async def test_a_sha256sums_mismatch_only_in_flight_is_fetched_again_and_a_real_one_is_refused(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    # No registry checksum to compare with: only the adapter's own SHA256SUMS. A mismatch
    # that a second download does not repeat was the transfer's; one it repeats is the
    # adapter's (its SHA256SUMS is wrong), and that verdict is remembered.
    plain = boto3.client("s3", endpoint_url=s3.moto_url, region_name="us-east-1",
                         config=botocore.config.Config(request_checksum_calculation="when_required"))
    for adapter_id, wrong in (("sums-flip-v1", False), ("sums-wrong-v1", True)):
        folder = tmp_path / "upload" / adapter_id
        write_adapter(folder, rank=16, shapes=SHAPES, target_modules=("q_proj", "v_proj"))
        digest = hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest()
        (folder / "SHA256SUMS").write_text(f"{'0' * 64 if wrong else digest}  {WEIGHTS}\n")
        for path in folder.iterdir():
            plain.put_object(Bucket=s3.bucket, Key=s3.key(adapter_id, path.name),
                             Body=path.read_bytes())
    head = plain.head_object(Bucket=s3.bucket, Key=s3.key("sums-flip-v1", WEIGHTS),
                             ChecksumMode="ENABLED")
    assert not any(k.startswith("Checksum") and k != "ChecksumType" for k in head)
    s3.proxy.body_faults.append(BodyFault(weights_get, after_bytes=200_000, mode="flip"))
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, part_size_bytes=5 * 1024**2))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "sums-flip-v1"})
    assert status == 200, body
    size = len(staged_weights(body))
    assert len(s3.proxy.gets(s3.key("sums-flip-v1", WEIGHTS))) == 2 * len(
        transfer_part_starts(size))  # the mismatch was not repeated: fetched once more

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "sums-wrong-v1"})
    assert status == 422, body
    assert [(p["code"], p["file"]) for p in body["problems"]] == [("checksum_mismatch", WEIGHTS)]
    gets = len(s3.proxy.gets(s3.key("sums-wrong-v1", WEIGHTS)))
    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "sums-wrong-v1"})
    assert status == 422, body  # remembered: not fetched again
    assert len(s3.proxy.gets(s3.key("sums-wrong-v1", WEIGHTS))) == gets


async def test_a_multipart_uploads_composite_checksum_is_not_taken_for_the_files(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    folder = tmp_path / "upload" / "multipart-v1"
    write_adapter(folder, rank=16, shapes=SHAPES, target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    weights = (folder / WEIGHTS).read_bytes()
    config = TransferConfig(multipart_threshold=5 * 1024**2, multipart_chunksize=5 * 1024**2)
    for path in folder.iterdir():
        s3.client.upload_file(str(path), s3.bucket, s3.key("multipart-v1", path.name),
                              Config=config)
    head = s3.client.head_object(Bucket=s3.bucket, Key=s3.key("multipart-v1", WEIGHTS),
                                 ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"')  # uploaded in parts: its checksum covers the parts
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    status, body = await call(http, "POST", f"{sidecar.url}/stage",
                              {"adapter_id": "multipart-v1"})

    assert status == 200, body
    assert record_of(body)[WEIGHTS]["crc32"] == f"{zlib.crc32(weights):08x}"


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256"])
async def test_a_bit_flipped_in_the_config_judged_in_memory_is_caught_and_fetched_again(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    algorithm: str,
) -> None:
    # The config is fetched into memory and judged before room is reserved: its bytes are
    # checked against the registry's checksum there, as a file's are on disk.
    adapter_id = f"{algorithm.lower()}-config-flip"
    files = upload(s3, tmp_path, adapter_id, algorithm)
    s3.proxy.body_faults.append(BodyFault(config_get, after_bytes=20, mode="flip"))
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})

    assert status == 200, body
    assert len(s3.proxy.gets(s3.key(adapter_id, "adapter_config.json"))) == 2
    staged = Path(str(body["local_path"])) / "adapter_config.json"
    assert staged.read_bytes() == files["adapter_config.json"]
    recorded = record_of(body)["adapter_config.json"]
    assert recorded["crc32"] == f"{zlib.crc32(files['adapter_config.json']):08x}"
    assert recorded["sha256"] == hashlib.sha256(files["adapter_config.json"]).hexdigest()


async def test_a_config_corrupted_on_every_download_is_a_503_that_leaves_nothing_on_disk(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    adapter_id = "config-flip-always"
    upload(s3, tmp_path, adapter_id, "CRC32")
    s3.proxy.body_faults.append(BodyFault(config_get, after_bytes=20, mode="flip", times=1000))
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, refusal_ttl_s=3600.0))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})

    assert status == 503, body
    assert body["error"] == "registry_transient" and body["cause"] == "checksum_mismatch"
    assert len(s3.proxy.gets(s3.key(adapter_id, "adapter_config.json"))) == 3
    assert s3.proxy.gets(s3.key(adapter_id, WEIGHTS)) == []  # refused before any room
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []
    assert list((tmp_path / "cache" / "adapters").iterdir()) == []
