"""Signed adapters through the real sidecar: moto S3 over HTTP, the aiohttp server on a free port,
signatures made in the test. A correctly signed adapter is served and every answer says which
bytes and which signer; each way of breaking a signature is refused with its own code under
`require`, nothing published; `verify-if-present` and off behave as docs/signing.md says; folders
copied in and a restart under a changed policy are judged by the same rules."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from sidecar.cache.refusals import RELIST_REFUSED_S
from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings, s3_settings
from tests.support.signing_keys import (
    CertificateAuthority,
    KeyPair,
    key_policy,
    make_key,
    sign_with_certificate,
    sign_with_key,
    write_policy,
    write_sha256sums,
)
from tests.support.waiting import eventually

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def key(tmp_path: Path) -> KeyPair:
    return make_key(tmp_path / "keys", "acme-2026")


def signed_folder(tmp_path: Path, adapter_id: str, key: KeyPair, seed: int = 0) -> Path:
    folder = tmp_path / "publisher" / adapter_id
    write_adapter(folder, seed=seed)
    sign_with_key(folder, key)
    return folder


def published(sidecar: Sidecar) -> list[str]:
    return sorted(p.name for p in sidecar.store.adapters_dir.iterdir())


def quarantined(sidecar: Sidecar) -> list[str]:
    folder = sidecar.store.quarantine_dir
    return sorted(p.name.split(".")[0] for p in folder.iterdir()) if folder.is_dir() else []


def staging_left(sidecar: Sidecar) -> list[str]:
    return sorted(p.name for p in (sidecar.store.root / ".staging").iterdir())


def verifications(sidecar: Sidecar, outcome: str) -> float:
    value = sidecar.metrics.metrics_registry.get_sample_value(
        "lora_sidecar_signature_verifications_total", {"outcome": outcome})
    return value or 0.0


async def refused_codes(http: aiohttp.ClientSession, sidecar: Sidecar,
                        adapter_id: str) -> tuple[list[str], dict[str, object]]:
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": adapter_id})
    assert status == 422, body
    assert body["error"] == "invalid_adapter"
    return [p["code"] for p in body["problems"]], body


async def test_a_correctly_signed_adapter_is_served_with_its_digest_and_signer(
    tmp_path: Path, s3: S3Registry, key: KeyPair, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    folder = signed_folder(tmp_path, "acme-support-v1", key)
    s3.put_folder("acme-support-v1", folder)
    sidecar = await start_sidecar(s3_settings(
        tmp_path, s3, signing_policy=key_policy(tmp_path, key, name="acme-2026")))

    first = await stage_ok(http, sidecar, "acme-support-v1")
    again = await stage_ok(http, sidecar, "acme-support-v1")

    rule = sidecar.rules.signing.rules[0]
    assert first["signer"] == again["signer"] == "acme-2026"
    assert first["signer_identity"] == rule.signers[0].identity
    # The digest names the bytes the engine reads: sha256sum of the files but model.sig.
    adapter = Path(str(first["local_path"]))
    sums = "".join(f"{hashlib.sha256((adapter / n).read_bytes()).hexdigest()}  {n}\n"
                   for n in sorted(("adapter_config.json", WEIGHTS)))
    assert first["content_digest"] == f"sha256:{hashlib.sha256(sums.encode()).hexdigest()}"
    assert (adapter / "model.sig").read_bytes() == (folder / "model.sig").read_bytes()
    record = json.loads((adapter / ".sidecar.json").read_text())
    assert "signature" in record["verified"]
    assert record["signature"] == {"policy": rule.fingerprint, "signer": "acme-2026",
                                   "identity": rule.signers[0].identity,
                                   "signed_as": "acme-support-v1"}
    status, view = await call(http, "GET", f"{sidecar.url}/adapters/acme-support-v1")
    assert status == 200
    assert view["signature"]["signer"] == "acme-2026"
    assert view["content_digest"] == first["content_digest"]
    assert verifications(sidecar, "verified") == 1


def _unsigned(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    (folder / "model.sig").unlink()


def _other_key(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    sign_with_key(folder, make_key(tmp_path / "keys", "intruder"))


def _one_byte(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    weights = folder / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))


def _added_file(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    write_sha256sums(folder)  # a file the sidecar publishes


def _removed_file(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    write_sha256sums(folder)
    sign_with_key(folder, key)
    (folder / "SHA256SUMS").unlink()  # signed, then left out of the upload


def _other_adapters_signature(tmp_path: Path, key: KeyPair, ca: CertificateAuthority,
            folder: Path) -> None:
    other = signed_folder(tmp_path, "acme-sql-v1", key, seed=11)
    shutil.copy(other / "model.sig", folder / "model.sig")


Damage = Callable[[Path, KeyPair, CertificateAuthority, Path], None]


def _certificate(expired: bool, rogue: bool) -> Damage:
    def sign(tmp_path: Path, key: KeyPair, ca: CertificateAuthority, folder: Path) -> None:
        issuer = CertificateAuthority(tmp_path / "rogue-ca", "Rogue CA") if rogue else ca
        sign_with_certificate(folder, issuer.issue("release", "release@acme.example",
                                                   expired=expired))
    return sign


REFUSALS = [
    ("unsigned", _unsigned, "signature_missing"),
    ("signed by another key", _other_key, "signer_not_allowed"),
    ("one byte of the weights changed", _one_byte, "signed_digest_mismatch"),
    ("a file added", _added_file, "unsigned_file"),
    ("a file removed", _removed_file, "signed_file_missing"),
    ("another adapter's signature", _other_adapters_signature, "signature_for_other_adapter"),
    ("an expired certificate", _certificate(expired=True, rogue=False), "certificate_expired"),
    ("a certificate of another CA", _certificate(expired=False, rogue=True),
     "certificate_untrusted"),
]


@pytest.mark.parametrize(("case", "damage", "code"), REFUSALS, ids=[r[0] for r in REFUSALS])
async def test_under_require_each_broken_signature_is_refused_with_its_code_and_nothing_published(
    tmp_path: Path, s3: S3Registry, key: KeyPair, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession, case: str, damage: Damage, code: str,
) -> None:
    ca = CertificateAuthority(tmp_path / "ca")  # the CA the policy trusts
    folder = signed_folder(tmp_path, "acme-support-v1", key)
    damage(tmp_path, key, ca, folder)
    s3.put_folder("acme-support-v1", folder)
    policy = write_policy(tmp_path / "signing.toml", f"""
[signers.acme-2026]
public_key = "{key.public}"
[signers.acme-release]
certificate_roots = ["{ca.root}"]
identity = "release@acme.example"
[[adapters]]
prefix = "acme-"
mode = "require"
signers = ["acme-2026", "acme-release"]
""")
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, signing_policy=policy))

    codes, body = await refused_codes(http, sidecar, "acme-support-v1")

    assert codes[0] == code, body
    assert "adapter acme-support-v1 was refused" in str(body["message"])
    assert published(sidecar) == [] and staging_left(sidecar) == []
    assert sidecar.store.get("acme-support-v1") is None
    assert verifications(sidecar, "refused") == 1
    if code in ("signature_missing", "signer_not_allowed", "certificate_untrusted",
                "certificate_expired"):
        # Judged on model.sig alone: the weights were never downloaded.
        assert s3.proxy.gets(s3.key("acme-support-v1", WEIGHTS)) == []


async def test_a_signature_refusal_is_remembered_for_those_bytes_only(
    tmp_path: Path, s3: S3Registry, key: KeyPair, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    folder = signed_folder(tmp_path, "acme-support-v1", key)
    _other_key(tmp_path, key, CertificateAuthority(tmp_path / "ca"), folder)
    s3.put_folder("acme-support-v1", folder)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3,
                                              signing_policy=key_policy(tmp_path, key)))

    codes, first = await refused_codes(http, sidecar, "acme-support-v1")
    _, again = await refused_codes(http, sidecar, "acme-support-v1")
    assert codes == ["signer_not_allowed"]
    assert first["remembered"] is False and again["remembered"] is True
    assert len(s3.proxy.gets(s3.key("acme-support-v1", "model.sig"))) == 1

    sign_with_key(folder, key)  # the publisher signs again, with the right key
    s3.put_folder("acme-support-v1", folder)
    # Time passing is the point: a refusal is answered without a listing for this long.
    await asyncio.sleep(RELIST_REFUSED_S)
    served = await stage_ok(http, sidecar, "acme-support-v1")

    assert served["signer"] == "publisher"


async def test_verify_if_present_serves_unsigned_adapters_and_refuses_bad_signatures(
    tmp_path: Path, s3: S3Registry, key: KeyPair, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    s3.put_adapter("plain-v1")
    good = signed_folder(tmp_path, "signed-v1", key)
    s3.put_folder("signed-v1", good)
    bad = signed_folder(tmp_path, "tampered-v1", key)
    _one_byte(tmp_path, key, CertificateAuthority(tmp_path / "ca"), bad)
    s3.put_folder("tampered-v1", bad)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, signing_policy=key_policy(
        tmp_path, key, mode="verify-if-present")))

    plain = await stage_ok(http, sidecar, "plain-v1")
    signed = await stage_ok(http, sidecar, "signed-v1")
    codes, _ = await refused_codes(http, sidecar, "tampered-v1")

    assert plain["signer"] is None and plain["signer_identity"] is None
    assert signed["signer"] == "publisher"
    assert codes == ["signed_digest_mismatch"]
    assert published(sidecar) == ["plain-v1", "signed-v1"]
    assert [verifications(sidecar, o) for o in ("verified", "unsigned", "refused")] == [1, 1, 1]


async def test_without_a_policy_signatures_are_not_looked_at(
    tmp_path: Path, s3: S3Registry, key: KeyPair, start_sidecar: StartSidecar,
    http: aiohttp.ClientSession,
) -> None:
    folder = signed_folder(tmp_path, "acme-support-v1", key)
    (folder / "model.sig").write_text("not even a bundle")
    s3.put_folder("acme-support-v1", folder)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    answer = await stage_ok(http, sidecar, "acme-support-v1")

    assert answer["signer"] is None
    record = json.loads((Path(str(answer["local_path"])) / ".sidecar.json").read_text())
    assert record["signature"] is None and "signature" not in record["verified"]
    assert sum(verifications(sidecar, o) for o in ("verified", "unsigned", "refused")) == 0


# ---- folders copied in by an operator, and restarts -----------------------------------------


async def test_the_watcher_adopts_a_signed_copy_and_quarantines_unsigned_and_tampered_ones(
    tmp_path: Path, key: KeyPair, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    sidecar = await start_sidecar(make_settings(
        tmp_path, signing_policy=key_policy(tmp_path, key)))
    signed = signed_folder(tmp_path, "copied-signed", key)
    tampered = signed_folder(tmp_path, "copied-tampered", key, seed=2)
    _added_file(tmp_path, key, CertificateAuthority(tmp_path / "ca"), tampered)
    unsigned = tmp_path / "publisher" / "copied-unsigned"
    write_adapter(unsigned, seed=3)
    for folder in (signed, tampered, unsigned):
        shutil.copytree(folder, tmp_path / "copy" / folder.name)
        (tmp_path / "copy" / folder.name).rename(sidecar.store.path_of(folder.name))

    async def judged() -> bool:
        return sidecar.store.get("copied-signed") is not None and len(quarantined(sidecar)) == 2

    await eventually(judged, timeout_s=10, what="three copies judged")
    answer = await stage_ok(http, sidecar, "copied-signed")
    assert answer["signer"] == "publisher" and answer["cached"] is True
    assert quarantined(sidecar) == ["copied-tampered", "copied-unsigned"]
    assert [verifications(sidecar, o) for o in ("verified", "refused")] == [1, 2]


async def test_a_restart_under_a_new_policy_rechecks_signatures_without_reading_the_weights(
    tmp_path: Path, key: KeyPair, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = tmp_path / "registry"
    shutil.copytree(signed_folder(tmp_path, "acme-signed", key), registry / "acme-signed")
    intruder = make_key(tmp_path / "keys", "intruder")
    other = tmp_path / "publisher" / "acme-other-key"
    write_adapter(other, seed=4)
    sign_with_key(other, intruder)
    shutil.copytree(other, registry / "acme-other-key")
    write_adapter(registry / "acme-unsigned", seed=5)
    write_adapter(registry / "globex-unsigned", seed=6)
    first = await start_sidecar(make_settings(tmp_path))  # no policy: all served
    for adapter_id in ("acme-signed", "acme-other-key", "acme-unsigned", "globex-unsigned"):
        assert (await stage_ok(http, first, adapter_id, lease=False))["signer"] is None
    await first.stop()

    def no_hashing(path: Path, **_: object) -> object:
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr("sidecar.cache.recovery.hash_file", no_hashing)
    policy = key_policy(tmp_path, key, match='prefix = "acme-"')
    second = await start_sidecar(make_settings(tmp_path, signing_policy=policy))

    assert sorted(a.adapter_id for a in second.store.adapters()) == [
        "acme-signed", "globex-unsigned"]
    assert quarantined(second) == ["acme-other-key", "acme-unsigned"]
    answer = await stage_ok(http, second, "acme-signed")
    assert answer["cached"] is True and answer["signer"] == "publisher"
    record = json.loads((second.store.path_of("acme-signed") / ".sidecar.json").read_text())
    assert record["signature"]["policy"] == second.rules.signing.rules[0].fingerprint
    assert [verifications(second, o) for o in ("verified", "refused")] == [1, 2]
    await second.stop()

    third = await start_sidecar(make_settings(tmp_path, signing_policy=policy))
    assert sorted(a.adapter_id for a in third.store.adapters()) == [
        "acme-signed", "globex-unsigned"]
    assert verifications(third, "verified") == 0  # the same rule: the record's verdict holds
