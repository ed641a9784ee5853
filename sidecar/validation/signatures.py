"""OMS signatures (`model.sig`: a Sigstore bundle signing an in-toto statement of every file's
SHA-256), judged under the policy's rule for an adapter, then compared with the digests the
download computed (no second read). The cryptography is oms.py's, imported only when a rule
asks for a signature to be checked: without a policy the sidecar runs without the `signing`
extra. Blocking: use threads.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.filehash import hash_file, open_regular
from .files import SIGNATURE_FILE, SIGNATURE_MAX_BYTES, FileRole, classify, plan_folder
from .problem import Problem
from .safetensors_check import shown
from .signing_policy import Rule, SignatureMode

# The problem codes of signature checks: their refusals are remembered for the exact bytes only.
SIGNATURE_CODES = frozenset({
    "signature_missing", "signature_malformed", "signature_unsupported", "signature_invalid",
    "signer_not_allowed", "certificate_untrusted", "certificate_expired", "unsigned_file",
    "signed_file_missing", "signed_digest_mismatch", "signature_for_other_adapter",
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class Signed:
    """A signature that verified: who signed, and what it vouches for."""

    signer: str  # the policy's name for the signer
    identity: str  # `sha256:<key hint>` of a key, or the certificate's identity
    signed_as: str  # the statement's subject name (the folder's name when it was signed)
    digests: Mapping[str, str]  # file name -> SHA-256 hex, every file the statement lists


@dataclass(frozen=True, slots=True)
class SignatureVerdict:
    rule: Rule
    signed: Signed | None = None
    problems: tuple[Problem, ...] = field(default=())

    @property
    def outcome(self) -> str | None:
        """For the verification counter: verified, unsigned, refused; None when nothing was
        checked (mode off)."""
        if self.problems:
            return "refused"
        if self.signed is not None:
            return "verified"
        return None if self.rule.mode is SignatureMode.OFF else "unsigned"


def published_names(names: Collection[str]) -> set[str]:
    """The files a statement must list: of `names`, every file the sidecar fetches and
    publishes (files.py) but the signature itself. Others (README.md, training_args.bin) are
    never published, so a statement may list them or not."""
    return {name for name in names if _published(name)}


def _published(name: str) -> bool:
    return classify(name) is FileRole.FETCHED and name != SIGNATURE_FILE


# ---- before the download: the envelope, the signer, the list of files ------------------------


def check_signature(rule: Rule, adapter_id: str, signature: bytes | None,
                    files: Collection[str], *,
                    now: datetime.datetime | None = None) -> SignatureVerdict:
    """Verify `signature` (the bytes of model.sig, or None when the adapter has none) under
    `rule`, and that its statement lists exactly `files` (the names to publish, without
    model.sig). The digests are compared later, with `check_digests`, once the download has
    computed them."""
    if rule.mode is SignatureMode.OFF:
        return SignatureVerdict(rule)
    if signature is None:
        if rule.mode is SignatureMode.VERIFY_IF_PRESENT:
            return SignatureVerdict(rule)
        return _refused(rule, Problem(
            "signature_missing", SIGNATURE_FILE,
            f"{rule.describe()} requires an OMS signature in {SIGNATURE_FILE} by one of: "
            f"{rule.describe_signers()}; the adapter has none (sign it with `lora-sidecar sign`)"))
    from . import oms  # the signing extra's libraries, loaded by the first signature checked

    verified = oms.verify(rule, signature, now or datetime.datetime.now(datetime.UTC))
    if isinstance(verified, Problem):
        return _refused(rule, verified)
    signed = Signed(*verified)
    problems = _file_set_problems(signed, set(files))
    if problems and signed.signed_as != adapter_id:
        problems.insert(0, _other_adapter(signed, adapter_id))
    return SignatureVerdict(rule, signed, tuple(problems))


def check_digests(verdict: SignatureVerdict, adapter_id: str,
                  digests: Mapping[str, str | None]) -> SignatureVerdict:
    """The statement's SHA-256 of each file against the bytes' (computed by the download)."""
    signed = verdict.signed
    if signed is None:
        return verdict
    problems = list(verdict.problems)
    for name, expected in sorted(signed.digests.items()):
        actual = digests.get(name)
        if actual is not None and actual != expected:
            problems.append(Problem(
                "signed_digest_mismatch", name,
                f"SHA-256 of the bytes is {actual}; {SIGNATURE_FILE} (signed by {signed.signer}) "
                f"says {expected}: the file changed after it was signed"))
    if (len(problems) > len(verdict.problems) and signed.signed_as != adapter_id
            and not any(p.code == "signature_for_other_adapter" for p in problems)):
        problems.insert(0, _other_adapter(signed, adapter_id))
    return replace(verdict, problems=tuple(problems))


def verify_folder(folder: Path, adapter_id: str, rule: Rule,
                  digests: Mapping[str, str | None] | None = None, *,
                  now: datetime.datetime | None = None) -> SignatureVerdict:
    """A folder on disk (copied in, restarted, `validate --policy`): its files as they are,
    against the statement, by the digests given (None: every file the statement lists is
    hashed here, a read of the weights that the stage and the watcher avoid)."""
    if rule.mode is SignatureMode.OFF:
        return SignatureVerdict(rule)
    try:
        names = set(plan_folder(folder).fetched)
    except OSError as exc:
        return _refused(rule, Problem("read_error", "", f"cannot read the folder: "
                                      f"{shown(str(exc))}"))
    try:
        signature = _read_signature(folder / SIGNATURE_FILE) if SIGNATURE_FILE in names else None
    except OSError as exc:
        return _refused(rule, Problem("signature_malformed", SIGNATURE_FILE,
                                      f"cannot read it: {shown(str(exc))}"))
    verdict = check_signature(rule, adapter_id, signature, published_names(names), now=now)
    if digests is None and verdict.signed is not None:
        digests = {}
        for name in set(verdict.signed.digests) & names:
            try:
                digests[name] = hash_file(folder / name).sha256
            except OSError as exc:
                problem = Problem("read_error", name, f"cannot read it: {shown(str(exc))}")
                return replace(verdict, problems=(*verdict.problems, problem))
    return check_digests(verdict, adapter_id, digests or {})


def _read_signature(path: Path) -> bytes:
    """A model.sig's bytes, not followed through a link; one over SIGNATURE_MAX_BYTES is read
    only that far and refused by the check."""
    with os.fdopen(open_regular(path), "rb", buffering=0) as f:
        return f.read(SIGNATURE_MAX_BYTES + 1)


def _refused(rule: Rule, problem: Problem) -> SignatureVerdict:
    return SignatureVerdict(rule, None, (problem,))


def _other_adapter(signed: Signed, adapter_id: str) -> Problem:
    return Problem("signature_for_other_adapter", SIGNATURE_FILE,
                   f"{SIGNATURE_FILE} was made for {shown(signed.signed_as)!r} (its statement's "
                   f"name), not {adapter_id!r}, and does not describe these files")


def _file_set_problems(signed: Signed, files: set[str]) -> list[Problem]:
    listed = {name for name in signed.digests if _published(name)}
    problems = [Problem("unsigned_file", shown(name),
                        f"{name} is not in the statement {SIGNATURE_FILE} signs (by "
                        f"{signed.signer}): added after signing")
                for name in sorted(files - listed)]
    problems += [Problem("signed_file_missing", shown(name),
                         f"{SIGNATURE_FILE} (signed by {signed.signer}) lists {name}, which the "
                         "adapter does not have: removed after signing")
                 for name in sorted(listed - files)]
    return problems
