"""The cryptography of OMS signatures, through model_signing (the `signing` extra): read a
`model.sig`, verify its envelope offline with the policy's keys or X.509 roots, read the in-toto
statement it signs; and sign a folder. Imported only where a signature is checked or made
(signatures.py, `lora-sidecar sign`), so the sidecar runs without the extra when no policy asks
for signatures. Blocking: use threads.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import exceptions, x509
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import hashing, manifest, signing
from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb
from model_signing._signing import signing as oms
from OpenSSL import crypto

from .files import SIGNATURE_FILE, SIGNATURE_MAX_BYTES, plan_folder
from .problem import Problem
from .safetensors_check import shown
from .signing_policy import CertificateSigner, KeySigner, Rule, describe_signer

# model_signing names a statement of its pre-1.0 format so (it carries no name of its own).
_COMPAT_NAME = "compat-undefined-not-present"

# What a signature that verified vouches for: the policy's name for the signer, its identity
# (`sha256:<key hint>` of a key, or the certificate's), the statement's subject name, and the
# SHA-256 hex of every file the statement lists.
Verified = tuple[str, str, str, Mapping[str, str]]


def verify(rule: Rule, signature: bytes, now: datetime.datetime) -> Verified | Problem:
    """Verify `signature` (the bytes of a model.sig) with the signers `rule` allows and read
    the statement it signs."""
    try:
        parsed = _parse_signature(signature)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Problem("signature_malformed", SIGNATURE_FILE,
                       f"not an OMS signature (a Sigstore bundle): {shown(str(exc))}")
    material = parsed.bundle.verification_material
    if material.public_key is not None:
        verified = _verify_with_keys(parsed, rule)
    elif material.x509_certificate_chain is not None:
        verified = _verify_with_certificates(parsed, rule, now)
    else:
        return Problem(
            "signature_unsupported", SIGNATURE_FILE,
            "signed keylessly (Sigstore's public instance: a short-lived certificate and a "
            "transparency-log entry), which cannot be verified offline; sign with a key or "
            f"a certificate of your CA. {rule.describe()} allows: {rule.describe_signers()}")
    if isinstance(verified, Problem):
        return verified
    signer, identity, payload = verified
    statement = _statement(payload)
    if isinstance(statement, Problem):
        return statement
    return signer, identity, statement.model_name, _digests(statement)


def _parse_signature(data: bytes) -> sign_sigstore_pb.Signature:
    if len(data) > SIGNATURE_MAX_BYTES:
        raise ValueError(f"larger than {SIGNATURE_MAX_BYTES} bytes")
    # model_signing parses a bundle only from a path (its read_text): hand it the bytes read.
    return sign_sigstore_pb.Signature.read(cast(Path, _SignatureText(data)))


@dataclass(frozen=True, slots=True)
class _SignatureText:
    """A model.sig already in memory, as the one method of a path model_signing reads."""

    data: bytes

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.data.decode(encoding)  # UnicodeDecodeError: a ValueError, malformed


# ---- the cryptography: model_signing's verifiers, given keys and roots already loaded --------


class _KeyVerifier(sign_ec_key.Verifier):
    """model_signing's key verifier, with the policy's key rather than a path read again (the
    file may have changed since the policy was read)."""

    def __init__(self, public_key: ec.EllipticCurvePublicKey) -> None:
        self._public_key = public_key


class _CertificateVerifier(sign_certificate.Verifier):
    """model_signing's certificate verifier, over the policy's roots only (never the system's).
    It checks the chain as of the signing certificate's start of validity; the expiry is checked
    here, against the clock."""

    def __init__(self, roots: Sequence[x509.Certificate]) -> None:
        self._log_fingerprints = False
        self._store = crypto.X509Store()
        for root in roots:
            self._store.add_cert(crypto.X509.from_cryptography(root))


_Verified = tuple[str, str, bytes]  # signer name, identity, the statement's JSON


def _verify_with_keys(parsed: sign_sigstore_pb.Signature, rule: Rule) -> _Verified | Problem:
    keys = [s for s in rule.signers if isinstance(s, KeySigner)]
    material = parsed.bundle.verification_material.public_key
    hint = material.hint if material is not None else None
    candidates = [k for k in keys if not hint or k.identity == f"sha256:{hint}"]
    if not candidates:
        found = f"key sha256:{hint}" if hint else "a key"
        return Problem("signer_not_allowed", SIGNATURE_FILE,
                       f"signed with {found}, which is not among the signers {rule.describe()} "
                       f"allows: {rule.describe_signers()}")
    for key in candidates:
        if not hint and material is not None:
            # A bundle of model_signing < 1.0 names no key; ours is tried as if it did (the
            # hint is not signed: the ECDSA check decides either way).
            material.hint = key.identity.removeprefix("sha256:")
        try:
            payload_type, payload = _KeyVerifier(key.public_key)._verify_signed_content(parsed)
        except (exceptions.InvalidSignature, ValueError, IndexError, TypeError, AttributeError):
            continue  # a bundle model_signing parsed but cannot check: not signed by this key
        return _envelope_payload(key.name, key.identity, payload_type, payload)
    tried = ", ".join(describe_signer(k) for k in candidates)
    return Problem("signature_invalid", SIGNATURE_FILE,
                   f"the signature does not verify with {tried}: the signed statement was "
                   "altered, or the signature was made with another key")


def _verify_with_certificates(parsed: sign_sigstore_pb.Signature, rule: Rule,
                              now: datetime.datetime) -> _Verified | Problem:
    chain_material = parsed.bundle.verification_material.x509_certificate_chain
    assert chain_material is not None
    try:
        chain = [x509.load_der_x509_certificate(c.raw_bytes) for c in chain_material.certificates]
    except ValueError as exc:
        return Problem("signature_malformed", SIGNATURE_FILE,
                       f"a certificate of the bundle cannot be read: {shown(str(exc))}")
    if not chain:
        return Problem("signature_malformed", SIGNATURE_FILE, "the bundle holds no certificate")
    leaf = chain[0]
    names = certificate_identities(leaf)
    shown_names = ", ".join(repr(n) for n in names) or "no identity"
    signers = [s for s in rule.signers if isinstance(s, CertificateSigner)]
    trusted: list[tuple[CertificateSigner, str, bytes]] = []
    why_untrusted = ""
    for signer in signers:
        try:
            payload_type, payload = _CertificateVerifier(signer.roots)._verify_signed_content(
                parsed)
        except crypto.X509StoreContextError as exc:
            why_untrusted = str(exc)
            continue
        except exceptions.InvalidSignature:
            return Problem("signature_invalid", SIGNATURE_FILE,
                           f"the signature does not verify with the certificate for "
                           f"{shown_names}: the signed statement was altered")
        except (ValueError, IndexError, TypeError, AttributeError) as exc:
            why_untrusted = str(exc)  # e.g. a certificate whose key usage excludes signing
            continue
        trusted.append((signer, payload_type, payload))
    if not trusted:
        allowed = rule.describe_signers()
        return Problem("certificate_untrusted", SIGNATURE_FILE,
                       f"signed with a certificate for {shown_names} issued by "
                       f"{leaf.issuer.rfc4514_string()!r}, which does not chain to the roots of "
                       f"the signers {rule.describe()} allows ({allowed})"
                       + (f": {shown(why_untrusted)}" if why_untrusted else ""))
    matching = [(s, t, p) for s, t, p in trusted if s.identity in names]
    if not matching:
        return Problem("signer_not_allowed", SIGNATURE_FILE,
                       f"signed with a certificate for {shown_names}, which is not among the "
                       f"signers {rule.describe()} allows: {rule.describe_signers()}")
    signer, payload_type, payload = matching[0]
    anchors = [r for r in signer.roots if any(c.issuer == r.subject for c in chain)]
    for cert in [*chain, *anchors]:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            which = "signing certificate" if cert == leaf else (
                f"certificate {cert.subject.rfc4514_string()!r} of its chain")
            return Problem("certificate_expired", SIGNATURE_FILE,
                           f"the {which} (for {shown_names}) is valid from "
                           f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                           f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now; an OMS "
                           "certificate signature carries no trusted time, so a signature "
                           "is accepted only while its certificates are valid: sign again")
    return _envelope_payload(signer.name, signer.identity, payload_type, payload)


def certificate_identities(cert: x509.Certificate) -> list[str]:
    """What a certificate names its subject: its email, URI and DNS alternative names, and its
    subject's common name."""
    names: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for kind in (x509.RFC822Name, x509.UniformResourceIdentifier, x509.DNSName):
            names.extend(str(v) for v in san.get_values_for_type(kind))
    except x509.ExtensionNotFound:
        pass
    names.extend(str(a.value) for a in cert.subject.get_attributes_for_oid(
        x509.NameOID.COMMON_NAME))
    return names


def _envelope_payload(signer: str, identity: str, payload_type: str,
                      payload: bytes) -> _Verified | Problem:
    if payload_type != oms._IN_TOTO_JSON_PAYLOAD_TYPE:
        return Problem("signature_malformed", SIGNATURE_FILE,
                       f"the envelope carries {shown(payload_type)!r}, not an in-toto statement")
    return signer, identity, payload


# ---- the statement ---------------------------------------------------------------------------


def _statement(payload: bytes) -> manifest.Manifest | Problem:
    try:
        data = json.loads(payload)
        if data.get("_type") != oms._IN_TOTO_STATEMENT_TYPE:
            raise ValueError(f"not an in-toto statement ({shown(str(data.get('_type')))})")
        statement = oms.dsse_payload_to_manifest(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return Problem("signature_malformed", SIGNATURE_FILE,
                       f"the signed statement cannot be read: {shown(str(exc))}")
    serialization = statement.serialization_type
    if statement.model_name == _COMPAT_NAME:
        return Problem("signature_unsupported", SIGNATURE_FILE,
                       "signed in model_signing's pre-1.0 format; sign again with "
                       "`lora-sidecar sign` (or model_signing 1.0 or later)")
    if serialization.get("method") != "files" or serialization.get("hash_type") != "sha256":
        return Problem("signature_unsupported", SIGNATURE_FILE,
                       f"signed by {shown(str(serialization.get('method')))} with "
                       f"{shown(str(serialization.get('hash_type')))}; the sidecar compares "
                       "whole files' SHA-256 (model_signing's default, what `lora-sidecar "
                       "sign` writes)")
    return statement


def _digests(statement: manifest.Manifest) -> dict[str, str]:
    return {d.identifier: d.digest.digest_hex for d in statement.resource_descriptors()}


# ---- signing ---------------------------------------------------------------------------------


def sign_folder(folder: Path, *, private_key: Path, certificate: Path | None = None,
                chain: Sequence[Path] = (), password: str | None = None) -> Path:
    """Write `folder/model.sig`: an OMS signature, by whole file and SHA-256, of the files the
    sidecar publishes (files.py; what it leaves out, such as README.md or .cache/, is left out
    of the statement too). With `certificate`, `chain` lists the CA certificates it chains up
    to (model_signing needs at least the issuer). Returns its path."""
    folder = folder.resolve()
    left_out = [name.rstrip("/") for name in plan_folder(folder).ignored]
    config = signing.Config()  # type: ignore[no-untyped-call]
    if certificate is None:
        config.use_elliptic_key_signer(private_key=private_key, password=password)
    else:
        if not chain:
            raise ValueError("signing with a certificate needs its CA chain (at least the "
                             "certificate that issued it)")
        config.use_certificate_signer(private_key=private_key, signing_certificate=certificate,
                                      certificate_chain=list(chain))
    config.set_hashing_config(
        hashing.Config()  # type: ignore[no-untyped-call]
        .use_file_serialization(hashing_algorithm="sha256")
        .set_ignored_paths(paths=[SIGNATURE_FILE, *left_out], ignore_git_paths=False))
    target = folder / SIGNATURE_FILE
    config.sign(folder, target)
    return target
