"""The signing policy (`--signing-policy FILE`, TOML): per adapter id (the first `[[adapters]]`
rule whose id, prefix or glob matches; none: `off`), a mode and the signers allowed, public keys
or X.509 roots with an identity. Read once at start; without a file every adapter is `off`.
A policy needs the `signing` extra (model-signing and its cryptography); without a policy
nothing here loads them.
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.fsutil import read_toml
from ..core.ids import is_valid_adapter_id

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

POLICY_MAX_BYTES = 1024 * 1024
# The curves OMS (model_signing) signs and verifies with.
_CURVES = ("secp256r1", "secp384r1", "secp521r1")
_GLOB_CHARACTERS = frozenset("*?[")
# What checking and making OMS signatures imports (oms.py): the `signing` extra.
_SIGNING_MODULES = ("model_signing", "cryptography", "OpenSSL")
SIGNING_EXTRA = "pip install 'lora-sidecar[signing]'"


def signing_extra_missing() -> str | None:
    """None when the `signing` extra is installed; otherwise what is missing and how to
    install it (as `make run`'s .venv: only `make test`'s has it)."""
    missing = [m for m in _SIGNING_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"signed adapters need the `signing` extra, which this Python lacks "
            f"({', '.join(missing)} cannot be imported): install it into the sidecar's "
            f"environment with `{SIGNING_EXTRA}` (from a clone: `.venv/bin/pip install -e "
            "'.[signing]'`)")


class SignatureMode(StrEnum):
    REQUIRE = "require"  # unsigned or badly signed: refused
    VERIFY_IF_PRESENT = "verify-if-present"  # unsigned: served; badly signed: refused
    OFF = "off"  # signatures are not looked at (the default)


@dataclass(frozen=True, slots=True)
class KeySigner:
    """An elliptic-curve public key (PEM). `identity` is `sha256:` and the SHA-256 of the key's
    PEM form: the key hint model_signing writes into model.sig."""

    name: str
    public_key: ec.EllipticCurvePublicKey
    path: Path
    identity: str


@dataclass(frozen=True, slots=True)
class CertificateSigner:
    """Certificates that chain to one of `roots` and name `identity` (a subject alternative
    name: email, URI or DNS name; or the subject's common name)."""

    name: str
    roots: tuple[x509.Certificate, ...]
    root_paths: tuple[Path, ...]
    identity: str


Signer = KeySigner | CertificateSigner


@dataclass(frozen=True, slots=True)
class Rule:
    number: int  # position among the file's [[adapters]] rules, from 1; 0: no rule matched
    kind: str  # "id", "prefix", "glob" (or "none")
    pattern: str
    mode: SignatureMode
    signers: tuple[Signer, ...]

    @property
    def fingerprint(self) -> str:
        """What a record remembers of the rule that judged it: its mode and signers' material
        (not its pattern). A restart re-checks an adapter whose rule's fingerprint changed."""
        if self.mode is SignatureMode.OFF:
            return ""
        material = sorted(_signer_material(s) for s in self.signers)
        text = json.dumps({"mode": self.mode.value, "signers": material}, sort_keys=True)
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def matches(self, adapter_id: str) -> bool:
        if self.kind == "id":
            return adapter_id == self.pattern
        if self.kind == "prefix":
            return adapter_id.startswith(self.pattern)
        return fnmatch.fnmatchcase(adapter_id, self.pattern)

    def describe(self) -> str:
        if self.number == 0:
            return "no rule of the signing policy (off)"
        return f"signing policy rule {self.number} ({self.kind} {self.pattern!r}, {self.mode})"

    def describe_signers(self) -> str:
        return ", ".join(describe_signer(s) for s in self.signers) or "none"


NO_RULE = Rule(0, "none", "", SignatureMode.OFF, ())


def describe_signer(signer: Signer) -> str:
    if isinstance(signer, KeySigner):
        return f"{signer.name} (key {signer.identity})"
    return f"{signer.name} (certificate for {signer.identity!r})"


def _signer_material(signer: Signer) -> str:
    if isinstance(signer, KeySigner):
        return f"key {signer.identity}"
    from cryptography.hazmat.primitives import serialization

    roots = sorted(hashlib.sha256(r.public_bytes(serialization.Encoding.DER)).hexdigest()
                   for r in signer.roots)
    return f"certificate {signer.identity!r} roots {','.join(roots)}"


@dataclass(frozen=True, slots=True)
class SigningPolicy:
    rules: tuple[Rule, ...] = ()
    path: Path | None = None

    @property
    def is_off(self) -> bool:
        return all(rule.mode is SignatureMode.OFF for rule in self.rules)

    def rule_for(self, adapter_id: str) -> Rule:
        for rule in self.rules:
            if rule.matches(adapter_id):
                return rule
        return NO_RULE

    @classmethod
    def load(cls, path: Path) -> SigningPolicy:
        """Read and check a policy file; ValueError lists every problem found (or says that
        the `signing` extra is missing)."""
        missing = signing_extra_missing()
        if missing:
            raise ValueError(missing)
        data = read_toml(path, POLICY_MAX_BYTES)
        problems: list[str] = []
        policy = _parse(data, path.parent, problems)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(policy, path)


NO_POLICY = SigningPolicy()  # no --signing-policy: every adapter off


# ---- parsing -------------------------------------------------------------------------------


def _parse(data: Mapping[str, Any], base: Path, problems: list[str]) -> tuple[Rule, ...]:
    problems.extend(f"unknown top-level key {key!r} (use [signers.NAME] and [[adapters]])"
                    for key in sorted(set(data) - {"signers", "adapters"}))
    raw_signers = data.get("signers", {})
    signers: dict[str, Signer] = {}
    if not isinstance(raw_signers, dict):
        problems.append("signers must be a table of [signers.NAME] tables")
        raw_signers = {}
    for name, entry in raw_signers.items():
        signer = _parse_signer(name, entry, base, problems)
        if signer is not None:
            signers[name] = signer
    raw_rules = data.get("adapters", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        problems.append("adapters must be an array of [[adapters]] tables")
        return ()
    rules = []
    for number, entry in enumerate(raw_rules, start=1):
        rule = _parse_rule(number, entry, signers, set(raw_signers), problems)
        if rule is not None:
            rules.append(rule)
    for later_index, later in enumerate(rules):
        for earlier in rules[:later_index]:
            if _covers(earlier, later):
                problems.append(f"rule {later.number} ({later.kind} {later.pattern!r}) never "
                                f"applies: rule {earlier.number} ({earlier.kind} "
                                f"{earlier.pattern!r}) above it matches every id it matches "
                                "(the first matching rule decides: put narrower rules first)")
                break
    return tuple(rules)


def _parse_signer(name: str, entry: object, base: Path, problems: list[str]) -> Signer | None:
    where = f"signers.{name}"
    if not isinstance(entry, dict):
        problems.append(f"{where} must be a table")
        return None
    unknown = sorted(set(entry) - {"public_key", "certificate_roots", "identity"})
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (a signer is "
                        "public_key = FILE, or certificate_roots = [FILE, ...] and identity)")
        return None
    if "public_key" in entry:
        if "certificate_roots" in entry or "identity" in entry:
            problems.append(f"{where}: give public_key, or certificate_roots and identity, "
                            "not both")
            return None
        return _key_signer(where, name, entry["public_key"], base, problems)
    if "certificate_roots" not in entry:
        problems.append(f"{where}: give public_key = FILE, or certificate_roots = [FILE, ...] "
                        "and identity")
        return None
    identity = entry.get("identity")
    if not isinstance(identity, str) or not identity.strip():
        problems.append(f"{where}: identity must name the signing certificate's subject "
                        "(an email, URI or DNS name in its subject alternative names, or its "
                        "common name); without it any certificate of the CA would do")
        return None
    roots_raw = entry["certificate_roots"]
    if isinstance(roots_raw, str):
        roots_raw = [roots_raw]
    if not isinstance(roots_raw, list) or not roots_raw or not all(
            isinstance(r, str) for r in roots_raw):
        problems.append(f"{where}: certificate_roots must be a list of PEM files")
        return None
    from cryptography import x509

    roots: list[x509.Certificate] = []
    paths = tuple(_resolve(base, r) for r in roots_raw)
    now = datetime.datetime.now(datetime.UTC)
    for path in paths:
        try:
            loaded = x509.load_pem_x509_certificates(path.read_bytes())
        except OSError as exc:
            problems.append(f"{where}: cannot read {path}: {exc.strerror or exc}")
            continue
        except ValueError:
            problems.append(f"{where}: {path} holds no PEM certificate")
            continue
        for cert in loaded:
            if cert.not_valid_after_utc < now:
                problems.append(f"{where}: the root {cert.subject.rfc4514_string()} in {path} "
                                f"expired on {cert.not_valid_after_utc:%Y-%m-%d}")
        roots.extend(loaded)
    if len(roots) == 0:
        return None
    return CertificateSigner(name, tuple(roots), paths, identity.strip())


def _key_signer(where: str, name: str, raw: object, base: Path,
                problems: list[str]) -> KeySigner | None:
    if not isinstance(raw, str) or not raw.strip():
        problems.append(f"{where}: public_key must be a file name")
        return None
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = _resolve(base, raw)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        problems.append(f"{where}: cannot read {path}: {exc.strerror or exc}")
        return None
    except ValueError:
        problems.append(f"{where}: {path} is not a PEM public key")
        return None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _CURVES:
        problems.append(f"{where}: {path} is not an elliptic-curve key on P-256, P-384 or P-521 "
                        "(the keys OMS signs with)")
        return None
    return KeySigner(name, key, path, key_identity(key))


def key_identity(key: ec.EllipticCurvePublicKey) -> str:
    """`sha256:` and the SHA-256 of the key's PEM form, as model_signing's key hint."""
    from cryptography.hazmat.primitives import serialization

    pem = key.public_bytes(serialization.Encoding.PEM,
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(pem).hexdigest()


def _parse_rule(number: int, entry: Mapping[str, Any], signers: Mapping[str, Signer],
                declared: set[str], problems: list[str]) -> Rule | None:
    where = f"adapters rule {number}"
    before = len(problems)
    unknown = sorted(set(entry) - {"id", "prefix", "glob", "mode", "signers"})
    if unknown:
        problems.append(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
    kinds = [k for k in ("id", "prefix", "glob") if k in entry]
    if len(kinds) != 1:
        problems.append(f"{where}: give exactly one of id, prefix or glob")
        return None
    kind = kinds[0]
    pattern = entry[kind]
    if not isinstance(pattern, str) or not pattern:
        problems.append(f"{where}: {kind} must be a non-empty string")
        return None
    if kind == "id" and not is_valid_adapter_id(pattern):
        problems.append(f"{where}: {pattern!r} is not a valid adapter id")
    if kind == "prefix" and _GLOB_CHARACTERS & set(pattern):
        problems.append(f"{where}: prefix {pattern!r} holds *, ? or [: use glob for patterns")
    try:
        mode = SignatureMode(entry.get("mode", ""))
    except ValueError:
        problems.append(f"{where}: mode must be one of "
                        f"{', '.join(m.value for m in SignatureMode)}")
        return None
    names = entry.get("signers", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        problems.append(f"{where}: signers must be a list of signer names")
        return None
    missing = [n for n in names if n not in declared]
    if missing:
        problems.append(f"{where}: no [signers.{missing[0]}] is declared"
                        + (f" (nor {', '.join(missing[1:])})" if missing[1:] else ""))
    if mode is SignatureMode.OFF and names:
        problems.append(f"{where}: mode off takes no signers")
    if mode is not SignatureMode.OFF and not names:
        problems.append(f"{where}: mode {mode} needs at least one signer")
    if len(problems) > before:
        return None
    chosen = tuple(signers[n] for n in names if n in signers)
    if len(chosen) != len(names):
        return None  # a signer whose own declaration failed: already reported
    return Rule(number, kind, pattern, mode, chosen)


def _literal_head(rule: Rule) -> str:
    """The text every id the rule matches starts with."""
    if rule.kind != "glob":
        return rule.pattern
    cut = min((rule.pattern.index(c) for c in _GLOB_CHARACTERS if c in rule.pattern),
              default=len(rule.pattern))
    return rule.pattern[:cut]


def _covers(earlier: Rule, later: Rule) -> bool:
    """Whether `earlier` matches every id `later` can match (for the cases that can be told)."""
    if later.kind == "id":
        return earlier.matches(later.pattern)
    if earlier.kind == "prefix":
        return _literal_head(later).startswith(earlier.pattern)
    if earlier.kind == "glob":
        head = _literal_head(earlier)
        if earlier.pattern == head + "*":  # `acme-*`, `*`: a prefix written as a glob
            return _literal_head(later).startswith(head)
        return earlier.pattern == later.pattern
    return False


def _resolve(base: Path, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else base / path


def describe_rules(policy: SigningPolicy) -> Sequence[str]:
    """One line per rule, for the start log."""
    return [f"{rule.describe()}: signers {rule.describe_signers()}" for rule in policy.rules]
