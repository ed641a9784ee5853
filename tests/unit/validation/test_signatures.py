"""OMS signatures and the signing policy's modes, on folders signed in the test with real keys and
a test CA: what verifies, what is refused and with which code (sidecar/validation/signatures.py).
The policy file is tested in test_signing_policy.py; the stage, watcher and restart paths in
tests/behaviour/test_signed_stage.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import model_signing
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from sidecar.core.filehash import hash_file
from sidecar.process.examples import write_adapter
from sidecar.validation.oms import certificate_identities
from sidecar.validation.signatures import (
    SIGNATURE_CODES,
    SignatureVerdict,
    check_signature,
    verify_folder,
)
from sidecar.validation.signing_policy import SignatureMode, SigningPolicy
from tests.support.signing_keys import (
    CertificateAuthority,
    KeyPair,
    key_policy,
    load,
    make_key,
    sign_with_certificate,
    sign_with_key,
    write_policy,
    write_sha256sums,
)

WEIGHTS = "adapter_model.safetensors"


def digests(folder: Path) -> dict[str, str | None]:
    return {p.name: hash_file(p).sha256 for p in folder.iterdir() if p.name != "model.sig"}


def verify(folder: Path, policy: SigningPolicy, adapter_id: str | None = None) -> SignatureVerdict:
    adapter_id = adapter_id or folder.name
    return verify_folder(folder, adapter_id, policy.rule_for(adapter_id), digests(folder))


def codes(verdict: SignatureVerdict) -> list[str]:
    return [p.code for p in verdict.problems]


@pytest.fixture
def signed(tmp_path: Path, key: KeyPair) -> Path:
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    sign_with_key(folder, key)
    return folder


# ---- keys ------------------------------------------------------------------------------------


def test_an_adapter_signed_with_the_policys_key_verifies(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    policy = load(key_policy(tmp_path, key))

    verdict = verify(signed, policy)

    assert verdict.problems == ()
    assert verdict.outcome == "verified"
    assert verdict.signed is not None
    assert verdict.signed.signer == "publisher"
    assert verdict.signed.identity == policy.rules[0].signers[0].identity
    assert verdict.signed.signed_as == "acme-support-v1"
    assert set(verdict.signed.digests) == {"adapter_config.json", WEIGHTS}


def test_the_statement_of_model_sig_lists_every_file_with_its_sha256(
    key: KeyPair, signed: Path
) -> None:
    bundle = json.loads((signed / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))

    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    resources = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert resources == {name: d for name, d in digests(signed).items()}
    assert statement["predicate"]["serialization"]["method"] == "files"


def test_a_signature_by_another_key_is_refused_naming_the_allowed_signers(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    other = make_key(tmp_path / "keys", "someone-else")
    policy = load(key_policy(tmp_path, other))

    verdict = verify(signed, policy)

    assert codes(verdict) == ["signer_not_allowed"]
    assert verdict.outcome == "refused"
    message = verdict.problems[0].message
    assert "publisher (key sha256:" in message and "rule 1" in message


def test_a_statement_altered_after_signing_is_refused_as_an_invalid_signature(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    path = signed / "model.sig"
    bundle = json.loads(path.read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    for resource in statement["predicate"]["resources"]:  # vouch for other weights
        if resource["name"] == WEIGHTS:
            resource["digest"] = "0" * 64
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    path.write_text(json.dumps(bundle))

    verdict = verify(signed, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["signature_invalid"]


def test_one_byte_of_the_weights_changed_after_signing_is_refused(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    weights = signed / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))

    verdict = verify(signed, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["signed_digest_mismatch"]
    assert verdict.problems[0].file == WEIGHTS


def test_a_file_the_sidecar_publishes_added_after_signing_is_refused_as_unsigned(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    write_sha256sums(signed)

    verdict = verify(signed, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["unsigned_file"]
    assert verdict.problems[0].file == "SHA256SUMS"


def test_a_file_the_sidecar_publishes_removed_after_signing_is_refused(
    tmp_path: Path, key: KeyPair
) -> None:
    folder = tmp_path / "adapters" / "acme-support-v2"
    write_adapter(folder)
    write_sha256sums(folder)
    sign_with_key(folder, key)
    (folder / "SHA256SUMS").unlink()

    verdict = verify(folder, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["signed_file_missing"]


def test_files_the_sidecar_never_publishes_are_outside_the_statement(
    tmp_path: Path, key: KeyPair
) -> None:
    # What PEFT or `hf download` leave beside an adapter is neither fetched nor published: a
    # statement need not list it, and one that does (model_signing signs the whole folder)
    # still verifies when it is gone.
    folder = tmp_path / "adapters" / "acme-support-v3"
    write_adapter(folder)
    (folder / "README.md").write_text("model card\n")
    sign_with_key(folder, key)
    (folder / "training_args.bin").write_bytes(b"added later, never fetched")
    bundle = json.loads((folder / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    whole = tmp_path / "adapters" / "acme-support-v4"
    write_adapter(whole, seed=2)
    (whole / "README.md").write_text("model card\n")
    model_signing.signing.Config().use_elliptic_key_signer(private_key=key.private) \
        .set_hashing_config(model_signing.hashing.Config().set_ignored_paths(
            paths=["model.sig"])).sign(whole, whole / "model.sig")
    (whole / "README.md").unlink()
    policy = load(key_policy(tmp_path, key))

    assert sorted(r["name"] for r in statement["predicate"]["resources"]) == [
        "adapter_config.json", WEIGHTS]
    assert verify(folder, policy).outcome == "verified"
    assert verify(whole, policy).outcome == "verified"


def test_the_signature_of_another_adapters_files_is_refused_as_such(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    other = tmp_path / "adapters" / "acme-sql-v1"
    write_adapter(other, seed=7)
    (other / "model.sig").write_bytes((signed / "model.sig").read_bytes())

    verdict = verify(other, load(key_policy(tmp_path, key)))

    assert codes(verdict)[0] == "signature_for_other_adapter"
    assert "signed_digest_mismatch" in codes(verdict)
    assert "'acme-support-v1'" in verdict.problems[0].message


def test_a_folder_renamed_after_signing_still_verifies(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    # OMS: the statement's name is informative; the same bytes under another id are the bytes
    # the signer vouched for.
    renamed = signed.rename(signed.with_name("acme-support-v1-copy"))

    verdict = verify(renamed, load(key_policy(tmp_path, key)))

    assert verdict.outcome == "verified"
    assert verdict.signed is not None and verdict.signed.signed_as == "acme-support-v1"


def test_a_model_sig_that_is_not_a_bundle_is_refused_as_malformed(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    (signed / "model.sig").write_text("not a bundle")

    verdict = verify(signed, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["signature_malformed"]


def test_rotation_a_rule_with_the_new_and_the_old_key_accepts_both(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    new = make_key(tmp_path / "keys", "acme-2027", ec.SECP384R1())
    policy = load(write_policy(tmp_path / "signing.toml", f"""
[signers.acme-2027]
public_key = "{new.public}"
[signers.acme-2026]
public_key = "{key.public}"
[[adapters]]
prefix = "acme-"
mode = "require"
signers = ["acme-2027", "acme-2026"]
"""))
    fresh = tmp_path / "adapters" / "acme-support-v9"
    write_adapter(fresh, seed=3)
    sign_with_key(fresh, new)

    old_verdict, new_verdict = verify(signed, policy), verify(fresh, policy)

    assert old_verdict.signed is not None and old_verdict.signed.signer == "acme-2026"
    assert new_verdict.signed is not None and new_verdict.signed.signer == "acme-2027"


# ---- modes -----------------------------------------------------------------------------------


def test_unsigned_is_refused_under_require_and_served_under_verify_if_present(
    tmp_path: Path, key: KeyPair
) -> None:
    folder = tmp_path / "adapters" / "plain-v1"
    write_adapter(folder)
    require = load(key_policy(tmp_path / "a", key, mode="require"))
    if_present = load(key_policy(tmp_path / "b", key, mode="verify-if-present"))

    refused, served = verify(folder, require), verify(folder, if_present)

    assert codes(refused) == ["signature_missing"]
    assert "publisher (key sha256:" in refused.problems[0].message
    assert served.problems == () and served.outcome == "unsigned"


def test_verify_if_present_still_refuses_a_bad_signature(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    write_sha256sums(signed)

    verdict = verify(signed, load(key_policy(tmp_path, key, mode="verify-if-present")))

    assert codes(verdict) == ["unsigned_file"]


def test_off_looks_at_nothing(tmp_path: Path, key: KeyPair, signed: Path) -> None:
    (signed / "model.sig").write_text("not a bundle")
    policy = load(write_policy(tmp_path / "signing.toml", """
[[adapters]]
glob = "*"
mode = "off"
"""))

    verdict = verify(signed, policy)

    assert verdict.problems == () and verdict.outcome is None


def test_no_policy_and_an_id_no_rule_matches_are_off(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    policy = load(key_policy(tmp_path, key, match='prefix = "globex-"'))

    assert SigningPolicy().rule_for("acme-support-v1").mode is SignatureMode.OFF
    assert policy.rule_for("acme-support-v1").mode is SignatureMode.OFF
    assert verify(signed, policy).outcome is None


# ---- certificates ----------------------------------------------------------------------------


def certificate_policy(tmp_path: Path, ca: CertificateAuthority, identity: str) -> SigningPolicy:
    return load(write_policy(tmp_path / "signing.toml", f"""
[signers.acme-release]
certificate_roots = ["{ca.root}"]
identity = "{identity}"

[[adapters]]
prefix = "acme-"
mode = "require"
signers = ["acme-release"]
"""))


def test_a_certificate_of_the_trusted_ca_naming_the_identity_verifies(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    sign_with_certificate(folder, ca.issue("release", "release@acme.example"))

    verdict = verify(folder, certificate_policy(tmp_path, ca, "release@acme.example"))

    assert verdict.problems == ()
    assert verdict.signed is not None
    assert (verdict.signed.signer, verdict.signed.identity) == (
        "acme-release", "release@acme.example")


def test_an_expired_certificate_is_refused(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    sign_with_certificate(folder, ca.issue("old", "release@acme.example", expired=True))

    verdict = verify(folder, certificate_policy(tmp_path, ca, "release@acme.example"))

    assert codes(verdict) == ["certificate_expired"]


def test_a_certificate_of_another_ca_is_refused_as_untrusted(tmp_path: Path) -> None:
    trusted = CertificateAuthority(tmp_path / "ca", "Trusted CA")
    rogue = CertificateAuthority(tmp_path / "rogue", "Rogue CA")
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    sign_with_certificate(folder, rogue.issue("release", "release@acme.example"))

    verdict = verify(folder, certificate_policy(tmp_path, trusted, "release@acme.example"))

    assert codes(verdict) == ["certificate_untrusted"]
    assert "Rogue CA" in verdict.problems[0].message


def test_a_certificate_for_another_identity_is_refused(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    leaf = ca.issue("intern", "intern@acme.example")
    sign_with_certificate(folder, leaf)

    verdict = verify(folder, certificate_policy(tmp_path, ca, "release@acme.example"))

    assert codes(verdict) == ["signer_not_allowed"]
    assert "intern@acme.example" in verdict.problems[0].message


def test_a_certificate_signature_under_a_key_only_rule_names_what_it_found(
    tmp_path: Path, key: KeyPair
) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    folder = tmp_path / "adapters" / "acme-support-v1"
    write_adapter(folder)
    leaf = ca.issue("release", "release@acme.example")
    sign_with_certificate(folder, leaf)

    verdict = verify(folder, load(key_policy(tmp_path, key)))

    assert codes(verdict) == ["certificate_untrusted"]
    assert "'release@acme.example', 'release'" in verdict.problems[0].message
    assert certificate_identities(x509.load_pem_x509_certificate(
        leaf.certificate.read_bytes())) == ["release@acme.example", "release"]


# ---- the codes, the check before the download, and model_signing's own signatures ----------


def test_every_code_a_check_can_answer_is_a_signature_code() -> None:
    assert {"signature_missing", "signer_not_allowed", "signature_invalid",
            "signed_digest_mismatch", "unsigned_file", "signed_file_missing",
            "signature_for_other_adapter", "certificate_expired",
            "certificate_untrusted", "signature_malformed"} <= SIGNATURE_CODES


def test_check_signature_before_download_compares_only_the_list_of_files(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    policy = load(key_policy(tmp_path, key))

    verdict = check_signature(policy.rule_for("acme-support-v1"), "acme-support-v1",
                              (signed / "model.sig").read_bytes(),
                              {"adapter_config.json", WEIGHTS, "SHA256SUMS"})

    assert codes(verdict) == ["unsigned_file"]


def test_signatures_go_both_ways_between_model_signing_and_the_sidecar(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    # The sidecar's signature, verified by model_signing's own public API (it hashes the
    # folder itself).
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=key.public).verify(
        signed, signed / "model.sig")
    # model_signing's signature (its public API, as its command line signs), verified here.
    other = tmp_path / "adapters" / "acme-sql-v2"
    write_adapter(other, seed=9)
    model_signing.signing.Config().use_elliptic_key_signer(private_key=key.private) \
        .set_hashing_config(model_signing.hashing.Config().set_ignored_paths(
            paths=["model.sig"])).sign(other, other / "model.sig")

    verdict = verify(other, load(key_policy(tmp_path, key)))

    assert verdict.outcome == "verified", verdict.problems


def _mutations(bundle: dict[str, object]) -> list[object]:
    def with_(path: list[str], value: object) -> dict[str, object]:
        copy = json.loads(json.dumps(bundle))
        node = copy
        for key in path[:-1]:
            node = node[key]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return copy

    return [
        {}, [], "text", {"verificationMaterial": 5},
        with_(["dsseEnvelope"], None),
        with_(["dsseEnvelope", "signatures"], []),
        with_(["dsseEnvelope", "payload"], base64.b64encode(b"not json").decode()),
        with_(["dsseEnvelope", "payloadType"], "text/plain"),
        with_(["mediaType"], "application/vnd.dev.sigstore.bundle+json;version=0.1"),
        with_(["verificationMaterial", "publicKey"], None),
        with_(["verificationMaterial"], {"x509CertificateChain": {"certificates": [
            {"rawBytes": base64.b64encode(b"not a certificate").decode()}]}}),
    ]


def test_a_damaged_model_sig_is_refused_with_a_signature_code_never_an_error(
    tmp_path: Path, key: KeyPair, signed: Path
) -> None:
    policy = load(key_policy(tmp_path, key))
    original = json.loads((signed / "model.sig").read_text())

    for mutation in _mutations(original):
        (signed / "model.sig").write_text(json.dumps(mutation))
        verdict = verify(signed, policy)
        assert verdict.problems, mutation
        assert {p.code for p in verdict.problems} <= SIGNATURE_CODES, (mutation, verdict)
