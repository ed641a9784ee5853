"""The `.sidecar.json` record of a published folder: its format, reading it back against the
files present, writing it fsynced, and re-reading files whose times changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..core.filehash import hash_file
from ..core.fsutil import fsync_dir, iso_utc
from ..core.ids import is_valid_adapter_id
from ..core.logs import fields
from ..validation.files import SIGNATURE_FILE
from ..validation.signatures import SignatureVerdict
from ..validation.signing_policy import SignatureMode

log = logging.getLogger(__name__)

RECORD_NAME = ".sidecar.json"
RECORD_MAX_BYTES = 1024 * 1024
RECORD_FORMAT = 1
_HEX8 = re.compile(r"[0-9a-f]{8}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class FileRecord:
    size_bytes: int
    etag: str
    crc32: str  # 8 hex digits, computed while the bytes streamed
    sha256: str | None = None  # of the bytes as staged (None in records of older versions)
    mtime_ns: int | None = None  # when sealed: a restart trusts the checks only if unchanged


class RecordStale(ValueError):
    """The files have the recorded sizes but not the recorded modification times: copied
    without their times, or rewritten in place. Only re-reading them can tell which."""

    def __init__(self, message: str, record: AdapterRecord, mtimes: Mapping[str, int]) -> None:
        super().__init__(message)
        self.record = record
        self.mtimes = dict(mtimes)


# What a record's `verified` may list: checks the bytes passed before publication.
class Check(StrEnum):
    REGISTRY = "registry_checksum"  # the registry's full-object CRC-32 or SHA-256
    SHA256SUMS = "sha256sums"  # the adapter's own SHA256SUMS file
    RULES = "validation"  # the validation rules of the sidecar that published it
    VALUES = "finite_values"  # every tensor value read and found finite
    SIGNATURE = "signature"  # an OMS signature by a signer the policy allows, over these bytes


@dataclass(frozen=True, slots=True)
class SignatureRecord:
    """The signing policy's verdict on a published folder. `policy` is the fingerprint of the
    rule that judged it: a restart whose rule for the id has another re-checks the folder."""

    policy: str
    signer: str | None = None  # the policy's name of who signed; None: unsigned, allowed
    identity: str | None = None  # `sha256:<key hint>`, or the certificate's identity
    signed_as: str | None = None  # the name in the signed statement

    @classmethod
    def of(cls, verdict: SignatureVerdict) -> SignatureRecord | None:
        """What a record keeps of a verdict that passed (None under mode off)."""
        if verdict.rule.mode is SignatureMode.OFF:
            return None
        signed = verdict.signed
        if signed is None:
            return cls(verdict.rule.fingerprint)
        return cls(verdict.rule.fingerprint, signed.signer, signed.identity, signed.signed_as)

    def to_json(self) -> dict[str, str | None]:
        return {"policy": self.policy, "signer": self.signer, "identity": self.identity,
                "signed_as": self.signed_as}

    @classmethod
    def from_json(cls, data: object) -> SignatureRecord | None:
        if data is None:
            return None
        if not (isinstance(data, dict) and isinstance(data.get("policy"), str) and all(
                data.get(k) is None or isinstance(data.get(k), str)
                for k in ("signer", "identity", "signed_as"))):
            raise ValueError("bad signature entry")
        return cls(data["policy"], data.get("signer"), data.get("identity"),
                   data.get("signed_as"))


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """What `.sidecar.json` says about a published folder."""

    adapter_id: str
    source: str
    staged_at: float
    files: Mapping[str, FileRecord]
    # What the bytes passed before publication (Check values), trusted by a restart while
    # every file keeps its recorded size and modification time: nothing is re-hashed.
    verified: tuple[str, ...] = ()
    signature: SignatureRecord | None = None  # None: no signing policy applied to it
    size_bytes: int = field(init=False, compare=False)  # summed once: read on every hit
    content_digest: str = field(init=False, compare=False)  # once too: see _content_digest

    def __post_init__(self) -> None:
        object.__setattr__(self, "size_bytes", sum(f.size_bytes for f in self.files.values()))
        object.__setattr__(self, "content_digest", _content_digest(self.files))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "adapter_id": self.adapter_id,
            "source": self.source,
            "size_bytes": self.size_bytes,
            "content_digest": self.content_digest,
            "staged_at": iso_utc(self.staged_at),
            "staged_at_unix": self.staged_at,
            "verified": list(self.verified),
            "signature": None if self.signature is None else self.signature.to_json(),
            "files": {
                name: {"size_bytes": f.size_bytes, "etag": f.etag, "crc32": f.crc32,
                       "sha256": f.sha256, "mtime_ns": f.mtime_ns}
                for name, f in sorted(self.files.items())
            },
        }

    def with_times(self, mtimes: Mapping[str, int]) -> AdapterRecord:
        """The same record with each file's modification time as found on disk."""
        files = {name: FileRecord(f.size_bytes, f.etag, f.crc32, f.sha256, mtimes.get(name))
                 for name, f in self.files.items()}
        return replace(self, files=files)

    @property
    def signer(self) -> str | None:
        return None if self.signature is None else self.signature.signer

    @classmethod
    def from_json(cls, data: object) -> AdapterRecord:
        """Parse a record; ValueError says what is wrong with it."""
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError("not a record of a known format")
        files_raw = data.get("files")
        if not isinstance(files_raw, dict) or not files_raw:
            raise ValueError("no files listed")
        files = {}
        for name, entry in files_raw.items():
            if not isinstance(entry, dict):
                raise ValueError(f"bad entry for {name!r}")
            size, etag = entry.get("size_bytes"), entry.get("etag")
            crc, sha, mtime = entry.get("crc32"), entry.get("sha256"), entry.get("mtime_ns")
            if not (isinstance(size, int) and size >= 0 and isinstance(etag, str)
                    and isinstance(crc, str) and _HEX8.fullmatch(crc)
                    and (sha is None or (isinstance(sha, str) and _HEX64.fullmatch(sha)))
                    and (mtime is None or isinstance(mtime, int))):
                raise ValueError(f"bad entry for {name!r}")
            files[name] = FileRecord(size, etag, crc, sha, mtime)
        adapter_id, source, staged_at = (
            data.get("adapter_id"), data.get("source"), data.get("staged_at_unix"),
        )
        if not (isinstance(adapter_id, str) and isinstance(source, str)
                and isinstance(staged_at, int | float)):
            raise ValueError("missing adapter_id, source or staged_at")
        verified = data.get("verified", [])  # absent from records of older versions
        if not (isinstance(verified, list) and all(isinstance(v, str) for v in verified)):
            raise ValueError("bad verified list")
        signature = SignatureRecord.from_json(data.get("signature"))  # absent from older ones
        return cls(adapter_id, source, float(staged_at), files, tuple(verified), signature)


def _content_digest(all_files: Mapping[str, FileRecord]) -> str:
    """What identifies an adapter's bytes: `sha256:` and the SHA-256 of a list written out
    from its files' hashes (one `<sha256>  <name>` line per file, sorted by name: what
    `sha256sum` prints; not a file the adapter ships), so an operator can compute it. The
    signature (model.sig) is left out: it says who vouches for the bytes, it
    is not bytes the engine reads, and signing the same files again keeps their digest. A
    record of an older version without every file's SHA-256 gets a `crc32:` digest of the same
    form from sizes and CRC-32s: never equal to a `sha256:` one, so such bytes count as other
    bytes (the safe direction)."""
    files = {name: f for name, f in all_files.items() if name != SIGNATURE_FILE}
    sha256 = {name: f.sha256 for name, f in files.items() if f.sha256}
    if len(sha256) == len(files):
        return content_digest(sha256)
    lines = [f"{f.size_bytes}:{f.crc32}  {name}\n" for name, f in sorted(files.items())]
    return f"crc32:{hashlib.sha256(''.join(lines).encode()).hexdigest()}"


def content_digest(sha256: Mapping[str, str]) -> str:
    """The content digest of files by their SHA-256 hex digests (model.sig left out): what
    `lora-sidecar sign` prints, and what the sidecar will answer for those bytes."""
    lines = [f"{digest}  {name}\n" for name, digest in sorted(sha256.items())
             if name != SIGNATURE_FILE]
    return f"sha256:{hashlib.sha256(''.join(lines).encode()).hexdigest()}"


def read_record(folder: Path) -> AdapterRecord:
    """The folder's record, checked against the files present (stat only, no hashing)."""
    if folder.is_symlink() or not folder.is_dir():
        raise ValueError("not a folder")
    if not is_valid_adapter_id(folder.name):
        raise ValueError("not a valid adapter id")
    try:
        with open(folder / RECORD_NAME, "rb") as f:
            raw = f.read(RECORD_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"no {RECORD_NAME} record") from None
    except OSError as exc:
        raise ValueError(f"cannot read {RECORD_NAME}: {exc.strerror}") from None
    if len(raw) > RECORD_MAX_BYTES:
        raise ValueError(f"{RECORD_NAME} is too large")
    try:
        record = AdapterRecord.from_json(json.loads(raw))
    except ValueError as exc:
        raise ValueError(f"{RECORD_NAME} is not valid: {exc}") from None
    if record.adapter_id != folder.name:
        raise ValueError(f"{RECORD_NAME} names another adapter ({record.adapter_id!r})")
    present, mtimes = {}, {}
    for entry in os.scandir(folder):
        if entry.name == RECORD_NAME:
            continue
        st = entry.stat(follow_symlinks=False)
        present[entry.name] = st.st_size if entry.is_file(follow_symlinks=False) else -1
        mtimes[entry.name] = st.st_mtime_ns
    expected = {name: f.size_bytes for name, f in record.files.items()}
    if present != expected:
        raise ValueError(f"files on disk differ from {RECORD_NAME}")
    changed = sorted(name for name, f in record.files.items()
                     if f.mtime_ns is not None and mtimes[name] != f.mtime_ns)
    if changed:
        raise RecordStale(f"{', '.join(changed)} modified since {RECORD_NAME} was "
                          "written", record, mtimes)
    return record


def write_record(folder: Path, record: AdapterRecord, *, dir_fd: int | None = None,
                 name: str = RECORD_NAME) -> AdapterRecord:
    """Write `.sidecar.json` into a folder, fsynced, with each file's modification time as it
    is now (blocking: run in a thread); returns the record written. With `dir_fd` (the folder,
    opened) the record lands in that folder even if it was renamed meanwhile."""
    base = folder if dir_fd is None else Path()
    mtimes = {file: os.stat(base / file, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
              for file in record.files}
    record = record.with_times(mtimes)
    data = json.dumps(record.to_json(), indent=2).encode()
    fd = os.open(base / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644,
                 dir_fd=dir_fd)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def add_verified(folder: Path, record: AdapterRecord, check: str) -> AdapterRecord:
    """Rewrite a published folder's record with one more passed check (blocking; a rename, so
    a crash leaves the old record or the new one)."""
    return rewrite_record(folder, replace(record, verified=(*record.verified, check)))


def rewrite_record(folder: Path, record: AdapterRecord) -> AdapterRecord:
    """Replace a published folder's record (blocking; a rename, so a crash leaves the old
    record or the new one)."""
    fresh = write_record(folder, record, name=f"{RECORD_NAME}.new")
    os.replace(folder / f"{RECORD_NAME}.new", folder / RECORD_NAME)
    fsync_dir(folder)
    return fresh


def reverified(folder: Path, stale: RecordStale) -> AdapterRecord:
    """Re-read files whose times changed; if every CRC-32 still matches the record, the checks
    made before publication still hold: rewrite the record with the new times (a rename, so a
    crash leaves the old record or the new one) and trust it again."""
    record = stale.record
    for name, recorded in sorted(record.files.items()):
        if recorded.mtime_ns is None or stale.mtimes.get(name) == recorded.mtime_ns:
            continue
        crc = hash_file(folder / name, sha256=False).crc32
        if crc != recorded.crc32:
            raise ValueError(f"{name} changed since it was verified (CRC-32 {crc}, "
                             f"{RECORD_NAME} says {recorded.crc32})")
    fresh = write_record(folder, record, name=f"{RECORD_NAME}.new")
    os.replace(folder / f"{RECORD_NAME}.new", folder / RECORD_NAME)
    fsync_dir(folder)
    log.info("re-read adapter_id=%s: files had new modification times but the recorded "
             "bytes; record updated", record.adapter_id,
             extra=fields(event="record_refreshed", adapter_id=record.adapter_id))
    return fresh
