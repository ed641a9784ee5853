"""The registry contract: what every registry kind lists and fetches (`AdapterRegistry`), the
values it hands over, and the rules shared by every kind (file names, skipped folders).
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..core.errors import SidecarError
from ..core.fsutil import EntryKind
from ..core.ids import ADAPTER_ID_PATTERN
from ..core.logs import fields
from .transfer import Inspector

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of an adapter as the registry lists it."""

    name: str  # plain file name inside the adapter folder
    size_bytes: int
    etag: str  # what must not change between listing and fetch
    locator: str  # S3 key or local path
    modified: float | None = None  # unix, by the registry's clock (S3: to the second)


@dataclass(frozen=True, slots=True)
class FetchedFile:
    crc32: str  # of the bytes written, 8 hex digits
    sha256: str | None  # of the bytes written, when asked for or the registry has one
    registry_crc32: str | None = None  # the registry's own full-object checksums, if kept
    registry_sha256: str | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """An entry of an adapter folder that is not a fetchable file: what the registry saw."""

    path: str  # inside the adapter folder, '/'-separated (an S3 key below `<id>/`)
    kind: EntryKind


@dataclass(frozen=True, slots=True)
class Listing:
    """An adapter folder as the registry lists it. Which files are fetched is the stager's
    decision (validation/files.py); a registry only ever fetches one of `files`."""

    files: list[RemoteFile]  # plain files right in the folder, with names safe to write
    others: list[Entry] = field(default_factory=list)  # all else: never fetched
    listed_at: float | None = None  # unix, by the registry's clock, when it answered
    upload: tuple[object, ...] = ()  # signature() of the listing as the registry gave it

    def quiet_s(self) -> float | None:
        """Seconds since the newest file was stored, by the registry's own clock; None when
        the registry does not say."""
        times = [f.modified for f in self.files if f.modified is not None]
        if not times or self.listed_at is None:
            return None
        return self.listed_at - max(times)

    def signature(self) -> tuple[object, ...]:
        """What the listing says of the bytes (names, sizes, etags, other entries): equal
        only for the same upload."""
        return (tuple(sorted((f.name, f.size_bytes, f.etag) for f in self.files)),
                tuple(sorted((e.path, str(e.kind)) for e in self.others)))


class AdapterRegistry(Protocol):
    description: str

    async def list_adapter_ids(self) -> list[str]: ...

    async def list_files(self, adapter_id: str, *, likely: tuple[str, ...] = ()) -> Listing:
        """Raises AdapterNotFound when the registry has nothing under this id. `likely`: names
        of files the caller will probably fetch next, whose fetch the registry may prepare
        while it lists (S3 signs their URLs meanwhile)."""
        ...

    async def fetch(
        self, adapter_id: str, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None],
        *, inspect: Inspector | None = None, sha256: bool = False,
    ) -> FetchedFile:
        """Download one file; `inspect` sees its bytes as they land (the value check);
        `sha256` asks for their SHA-256 (to check a SHA256SUMS) even if the registry has none."""
        ...

    async def fetch_bytes(
        self, adapter_id: str, file: RemoteFile, on_bytes: Callable[[int], None],
    ) -> tuple[bytes, FetchedFile]:
        """One small file into memory, with its SHA-256 and the same checks as `fetch`: what
        is judged before room is reserved. The caller bounds its listed size."""
        ...

    async def probe(self) -> None:
        """Raise a SidecarError if the registry cannot be used right now."""
        ...

    def makes_unready(self, error: SidecarError) -> bool:
        """Whether a failure means this registry cannot be used now (the sidecar is not ready
        until a call succeeds again), rather than a fault of one adapter. Each kind knows what
        its errors mean."""
        ...

    async def open(self) -> None:
        """Connect (clients, sessions) before the first call."""
        ...

    async def close(self) -> None: ...


SHOWN_SKIPPED = 20  # folder names quoted in one log line


class SkippedFolders:
    """Registry folders a listing leaves out (names that are not adapter ids): logged once
    each time the set changes, not at every listing, and counted in a gauge."""

    def __init__(self, description: str, on_count: Callable[[int], None] | None) -> None:
        self._description = description
        self._on_count = on_count
        self._last: frozenset[str] = frozenset()

    def note(self, skipped: list[str]) -> None:
        names = frozenset(skipped)
        if self._on_count is not None:
            self._on_count(len(names))
        if names == self._last:
            return
        self._last = names
        if not names:
            log.info("registry %s: no folder is skipped any more", self._description)
            return
        shown = ", ".join(repr(name[:100]) for name in sorted(names)[:SHOWN_SKIPPED])
        more = f" (+{len(names) - SHOWN_SKIPPED} more)" if len(names) > SHOWN_SKIPPED else ""
        log.warning("registry %s: skipping %d folder(s) that cannot be adapters (ids match "
                    "%s): %s%s", self._description, len(names), ADAPTER_ID_PATTERN.pattern,
                    shown, more, extra=fields(event="registry_folders_skipped",
                                              skipped=len(names)))


_NAME_RE = re.compile(r"^[A-Za-z0-9._-][A-Za-z0-9._ -]{0,254}$")


def is_safe_file_name(name: str) -> bool:
    """A plain name that stays inside its folder, fit to be written in a staging folder: no
    separators, no `..`, no absolute path."""
    return (
        bool(_NAME_RE.fullmatch(name))
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and posixpath.basename(name) == name
    )
