"""The signing policy file (sidecar/validation/signing_policy.py): the first matching rule
decides, and a policy that cannot work is refused when it is read, with every reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.validation.signing_policy import SignatureMode
from tests.support.signing_keys import KeyPair, load, write_policy


def test_the_first_matching_rule_decides(tmp_path: Path, key: KeyPair) -> None:
    policy = load(write_policy(tmp_path / "signing.toml", f"""
[signers.k]
public_key = "{key.public}"
[[adapters]]
id = "acme-legacy-v1"
mode = "off"
[[adapters]]
prefix = "acme-"
mode = "require"
signers = ["k"]
[[adapters]]
glob = "*-beta"
mode = "verify-if-present"
signers = ["k"]
"""))

    assert policy.rule_for("acme-legacy-v1").mode is SignatureMode.OFF
    assert policy.rule_for("acme-support-beta").mode is SignatureMode.REQUIRE
    assert policy.rule_for("globex-beta").mode is SignatureMode.VERIFY_IF_PRESENT
    assert policy.rule_for("globex-v1").number == 0


@pytest.mark.parametrize(("text", "expected"), [
    ('[[adapters]]\nprefix = "a"\nmode = "require"\nsigners = ["nobody"]',
     "no [signers.nobody] is declared"),
    ('[[adapters]]\nprefix = "a"\nmode = "require"', "needs at least one signer"),
    ('[[adapters]]\nprefix = "a"\nmode = "sometimes"', "mode must be one of"),
    ('[[adapters]]\nprefix = "a*"\nmode = "off"', "use glob for patterns"),
    ('[[adapters]]\nid = "a"\nprefix = "a"\nmode = "off"', "exactly one of id, prefix or glob"),
    ('[[adapters]]\nprefix = "acme-"\nmode = "off"\n[[adapters]]\nid = "acme-x"\nmode = "off"',
     "rule 2 (id 'acme-x') never applies"),
    ('[[adapters]]\nglob = "*"\nmode = "off"\n[[adapters]]\nprefix = "b"\nmode = "off"',
     "rule 2 (prefix 'b') never applies"),
    ('[signers.c]\ncertificate_roots = ["x.pem"]', "identity must name"),
    ('[signers.k]\npublic_key = "missing.pub"', "cannot read"),
    ("tenants = 1", "unknown top-level key 'tenants'"),
    ("[[adapters]", "not valid TOML"),
])
def test_a_policy_that_cannot_work_is_refused_with_every_reason(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        load(write_policy(tmp_path / "signing.toml", text))


def test_a_key_that_oms_cannot_use_is_refused_when_the_policy_is_read(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = tmp_path / "ed.pub"
    public.write_bytes(ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    with pytest.raises(ValueError, match="not an elliptic-curve key on P-256"):
        load(write_policy(tmp_path / "signing.toml", f'[signers.k]\npublic_key = "{public}"'))


def test_key_files_are_found_beside_the_policy_and_the_fingerprint_follows_the_signers(
    tmp_path: Path, key: KeyPair
) -> None:
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "k.pub").write_bytes(key.public.read_bytes())
    text = '[signers.k]\npublic_key = "k.pub"\n[[adapters]]\nglob = "*"\nmode = "{}"\n{}'
    require = load(write_policy(tmp_path / "policy" / "a.toml",
                                text.format("require", 'signers = ["k"]')))
    also_require = load(write_policy(tmp_path / "policy" / "b.toml",
                                     text.format("require", 'signers = ["k"]').replace(
                                         'glob = "*"', 'prefix = "x"')))
    if_present = load(write_policy(tmp_path / "policy" / "c.toml",
                                   text.format("verify-if-present", 'signers = ["k"]')))

    assert require.rules[0].fingerprint == also_require.rules[0].fingerprint
    assert require.rules[0].fingerprint != if_present.rules[0].fingerprint
