"""compose/upload_adapters.py (the minio-init service) against a real S3 API: moto's server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sidecar.process.examples import write_adapter
from tests.support.compose_uploader import Bucket, upload


@pytest.fixture
def bucket(moto_server: str) -> Bucket:
    """A bucket name of this test's own on the session's moto server; the script creates it."""
    return Bucket(moto_server, f"upload-{uuid.uuid4().hex[:12]}")


def test_upload_creates_the_bucket_puts_adapters_under_the_prefix_and_reruns_as_noop(
    bucket: Bucket, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "support-v1", seed=1)
    write_adapter(adapters / "sql-v1", seed=2, rank=16)
    (adapters / "notes.txt").write_text("a file beside the adapters is not an adapter")

    first = upload(bucket.registry, bucket.endpoint_url, adapters)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"created bucket {bucket.name}" in first.stdout
    uploaded = bucket.objects()
    assert set(uploaded) == {
        f"team/adapters/{adapter_id}/{name}"
        for adapter_id in ("support-v1", "sql-v1")
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }

    second = upload(bucket.registry, bucket.endpoint_url, adapters)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.splitlines() == ["unchanged sql-v1", "unchanged support-v1"]
    assert bucket.objects() == uploaded


def test_upload_keeps_adapter_ids_immutable_unless_told_to_overwrite(
    bucket: Bucket, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "support-v1", seed=1)
    assert upload(bucket.registry, bucket.endpoint_url, adapters).returncode == 0
    before = bucket.objects()

    write_adapter(adapters / "support-v1", seed=2)  # same id, new weights
    refused = upload(bucket.registry, bucket.endpoint_url, adapters)
    assert refused.returncode == 1
    assert "refused support-v1: already in the registry with different content" in refused.stdout
    assert bucket.objects() == before

    replaced = upload(bucket.registry, bucket.endpoint_url, adapters, "--overwrite")
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    after = bucket.objects()
    weights = "team/adapters/support-v1/adapter_model.safetensors"
    assert after[weights][0] != before[weights][0]


def test_upload_refuses_what_is_not_an_adapter_and_still_uploads_the_rest(
    bucket: Bucket, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "good-v1")
    write_adapter(adapters / "bad id")
    (adapters / "no-config-v1").mkdir()
    (adapters / "no-config-v1" / "adapter_model.safetensors").write_bytes(b"\0" * 16)

    result = upload(bucket.registry, bucket.endpoint_url, adapters)
    assert result.returncode == 1
    assert "refused bad id: not a valid adapter id" in result.stdout
    assert "refused no-config-v1: no adapter_config.json" in result.stdout
    assert {key.split("/")[2] for key in bucket.objects()} == {"good-v1"}


def test_upload_refuses_an_adapter_the_sidecar_would_refuse_with_every_reason(
    bucket: Bucket, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "rank-32-v1", rank=32)
    (adapters / "rank-32-v1" / "new_embeddings.bin").write_bytes(b"pickle")

    result = upload(bucket.registry, bucket.endpoint_url, adapters)
    assert result.returncode == 1
    refusal = result.stdout.splitlines()[-1]
    assert refusal.startswith("refused rank-32-v1: not a valid adapter: 2 problem(s):")
    assert "rank_too_large" in refusal and "forbidden_file new_embeddings.bin" in refusal
    assert bucket.objects() == {}

    # The same rules as the sidecar's, from the same variables.
    (adapters / "rank-32-v1" / "new_embeddings.bin").unlink()
    raised = upload(bucket.registry, bucket.endpoint_url, adapters,
                    env={"LORA_SIDECAR_MAX_LORA_RANK": "32"})
    assert raised.returncode == 0, raised.stdout + raised.stderr


def test_upload_without_validation_sends_the_adapter_as_it_is(
    bucket: Bucket, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "rank-32-v1", rank=32)
    result = upload(bucket.registry, bucket.endpoint_url, adapters, "--no-validate")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(bucket.objects()) == 2


def test_upload_says_what_is_wrong_with_its_arguments(tmp_path: Path) -> None:
    result = upload("s3://lora-adapters/adapters", "http://127.0.0.1:9", tmp_path / "missing")
    assert result.returncode == 2
    assert "is not a folder" in result.stderr


def test_upload_checks_signatures_under_the_sidecars_signing_policy(
    bucket: Bucket, tmp_path: Path
) -> None:
    from tests.support.signing_keys import key_policy, make_key, sign_with_key

    key = make_key(tmp_path / "keys", "acme-2026")
    policy = key_policy(tmp_path, key, match='prefix = "acme-"')
    adapters = tmp_path / "adapters"
    write_adapter(adapters / "acme-signed-v1")
    sign_with_key(adapters / "acme-signed-v1", key)
    write_adapter(adapters / "acme-unsigned-v1", seed=1)

    result = upload(bucket.registry, bucket.endpoint_url, adapters,
                    env={"LORA_SIDECAR_SIGNING_POLICY": str(policy)})

    assert result.returncode == 1
    assert "refused acme-unsigned-v1: not a valid adapter" in result.stdout
    assert "signature_missing" in result.stdout
    assert sorted(key.rsplit("/", 1)[1] for key in bucket.objects()) == [
        "adapter_config.json", "adapter_model.safetensors", "model.sig"]
