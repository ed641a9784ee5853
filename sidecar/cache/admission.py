"""Admission: the one way an adapter that passed validation becomes servable, whoever found it.
What its record says the bytes passed is decided here, once; the record is written into its
folder and fsynced; then the store admits it (renaming a stage into `adapters/`, or taking a
folder copied in where it lies) and trims to its budget. A restart re-checks what was admitted
before (recovery.py) and brings a record up to date here when the signing policy changed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.fsutil import fsync_dir
from ..validation.files import CHECKSUMS_FILE
from ..validation.signatures import SignatureVerdict
from .records import AdapterRecord, Check, FileRecord, SignatureRecord, write_record
from .store import AdapterStore


@dataclass(frozen=True, slots=True)
class Passed:
    """An adapter folder that passed validation, and what vouched for its bytes."""

    adapter_id: str
    source: str  # the registry's description, or who else put it there
    files: Mapping[str, FileRecord]
    signature: SignatureVerdict
    registry_checksums: bool = False  # the registry's own checksums matched the bytes

    def record(self) -> AdapterRecord:
        checks = [Check.RULES, Check.VALUES]  # every admission judged both, whoever found it
        if self.registry_checksums:
            checks.append(Check.REGISTRY)
        if CHECKSUMS_FILE in self.files:
            checks.append(Check.SHA256SUMS)
        if self.signature.signed is not None:
            checks.append(Check.SIGNATURE)
        return AdapterRecord(self.adapter_id, self.source, time.time(), dict(self.files),
                             tuple(checks), SignatureRecord.of(self.signature))


def signature_rechecked(record: AdapterRecord, verdict: SignatureVerdict) -> AdapterRecord:
    """An admitted adapter's record under the signing policy's new verdict on it."""
    checks = tuple(c for c in record.verified if c != Check.SIGNATURE)
    return replace(record, signature=SignatureRecord.of(verdict),
                   verified=(*checks, Check.SIGNATURE) if verdict.signed else checks)


async def admit_sealed(store: AdapterStore, staging: Path, sealed: AdapterRecord) -> None:
    """A validated download whose record `seal()` wrote: renamed into `adapters/` (the most
    recently used), and `adapters/` fsynced."""
    store.admit(sealed, staging=staging)
    await asyncio.to_thread(fsync_dir, store.adapters_dir)


async def admit_in_place(store: AdapterStore, folder: Path, passed: Passed, *,
                         validated: os.stat_result, leave_out: frozenset[str],
                         still_ours: Callable[[], bool]) -> AdapterRecord | None:
    """A folder copied into `adapters/` by someone else, taken where it lies (the first to go):
    the entries left out deleted and its record written, both only into the folder that was
    validated; admitted if `still_ours()` then. None when it is not (gone, replaced, changed
    meanwhile); OSError when the folder refuses the record."""
    record = passed.record()
    if not await asyncio.to_thread(_write_record_into, folder, validated, record, leave_out):
        return None
    if not still_ours():
        return None
    store.admit(record)
    return record


# ---- blocking (run in threads) -----------------------------------------------------------


def seal(staging: Path, record: AdapterRecord) -> AdapterRecord:
    """Write the record of a validated download (with the files' times, as sealed) and make
    its folder durable (blocking: the stage's validation job calls it once the folder
    passed)."""
    sealed = write_record(staging, record)
    fsync_dir(staging)
    return sealed


def _write_record_into(folder: Path, expected: os.stat_result, record: AdapterRecord,
                       leave_out: frozenset[str]) -> bool:
    """Delete the entries left out, then write the record, into `folder` only if it is still
    the folder that was validated.

    Done through a descriptor of the folder: if the sidecar publishes its own copy of the id
    meanwhile (moving this one to quarantine), both follow this folder, never touching the
    published one.
    """
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return False  # gone or replaced: its events have the folder judged again
    try:
        st = os.fstat(dir_fd)
        if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
            return False
        for name in sorted(leave_out):
            _delete_entry(name, dir_fd)
        _publish_modes(dir_fd, record.files)
        write_record(folder, record, dir_fd=dir_fd)
        os.fsync(dir_fd)
        return True
    finally:
        os.close(dir_fd)


# The modes a stage publishes with (store.py makes the folder, registry/transfer.py its
# files): the engine, often another user, reads an adopted folder as it reads a staged one.
PUBLISHED_FOLDER_MODE = 0o755
PUBLISHED_FILE_MODE = 0o644


def _publish_modes(dir_fd: int, files: Iterable[str]) -> None:
    """Give the folder open as `dir_fd` and its files the modes a stage publishes with: a copy
    keeps the modes it was written with (safetensors writes 0600), which Triton's user may not
    read. Entries of another owner keep theirs (only the owner may change a mode)."""
    with suppress(PermissionError):
        os.fchmod(dir_fd, PUBLISHED_FOLDER_MODE)
    for name in files:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            with suppress(PermissionError):
                os.fchmod(fd, PUBLISHED_FILE_MODE)
        finally:
            os.close(fd)


def _delete_entry(name: str, dir_fd: int) -> None:
    """Delete one entry of the folder open as `dir_fd` (a sub-folder with all it holds), never
    following a link."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
