"""Real signing material made in the test: elliptic-curve keys, a test CA with leaf certificates
(valid, expired, of another CA), signing policy files, and adapters signed with them through
the same `sign_folder` that `lora-sidecar sign` runs."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sidecar.validation.oms import sign_folder
from sidecar.validation.signing_policy import SigningPolicy

_NOW = datetime.datetime.now(datetime.UTC)
_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path


@dataclass(frozen=True)
class Leaf:
    key: Path
    certificate: Path
    chain: tuple[Path, ...]  # the CA certificates up to the root, as the signer passes them


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_key(folder: Path, name: str, curve: ec.EllipticCurve | None = None) -> KeyPair:
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(curve or ec.SECP256R1())
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    private.write_bytes(_pem_private(key))
    public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return KeyPair(private, public)


class CertificateAuthority:
    """A root CA on disk (`root`), issuing code-signing leaf certificates."""

    def __init__(self, folder: Path, name: str = "Test Root CA") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._serial = 1
        cert = (x509.CertificateBuilder()
                .subject_name(self._name).issuer_name(self._name)
                .public_key(self._key.public_key()).serial_number(self._next_serial())
                .not_valid_before(_NOW - 30 * _DAY).not_valid_after(_NOW + 3650 * _DAY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(_usage(cert_sign=True), critical=True)
                .sign(self._key, hashes.SHA256()))
        self.root = folder / f"{name.replace(' ', '-').lower()}.pem"
        self.root.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def issue(self, name: str, identity: str, *, expired: bool = False) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        start, end = ((_NOW - 20 * _DAY, _NOW - _DAY) if expired
                      else (_NOW - _DAY, _NOW + 365 * _DAY))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._name).public_key(key.public_key())
                .serial_number(self._next_serial())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(identity)]),
                               critical=False)
                .add_extension(_usage(cert_sign=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        key_path = self.folder / f"{name}.key"
        cert_path = self.folder / f"{name}.crt"
        key_path.write_bytes(_pem_private(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Leaf(key_path, cert_path, (self.root,))


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=cert_sign, crl_sign=cert_sign, encipher_only=False,
                         decipher_only=False)


def sign_with_key(folder: Path, key: KeyPair) -> Path:
    return sign_folder(folder, private_key=key.private)


def sign_with_certificate(folder: Path, leaf: Leaf) -> Path:
    return sign_folder(folder, private_key=leaf.key, certificate=leaf.certificate,
                       chain=leaf.chain)


def write_sha256sums(folder: Path) -> Path:
    """A valid SHA256SUMS for the adapter's two engine files: a file the sidecar publishes."""
    import hashlib

    names = ("adapter_config.json", "adapter_model.safetensors")
    path = folder / "SHA256SUMS"
    path.write_text("".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n"
                            for n in names))
    return path


def write_policy(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def key_policy(folder: Path, key: KeyPair, *, mode: str = "require", match: str = 'glob = "*"',
               name: str = "publisher") -> Path:
    """A policy with one key signer and one rule."""
    return write_policy(folder / "signing.toml", f"""
[signers.{name}]
public_key = "{key.public}"

[[adapters]]
{match}
mode = "{mode}"
signers = ["{name}"]
""")


def load(path: Path) -> SigningPolicy:
    return SigningPolicy.load(path)
