"""What a consistent cache looks like on disk, checked independently of the sidecar's own code
after faults, crashes and races: every published folder complete, valid and recorded."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from sidecar.cache.records import RECORD_NAME, AdapterRecord
from sidecar.validation.validate import Rules, validate_adapter


@dataclass(frozen=True, slots=True)
class CacheState:
    records: dict[str, AdapterRecord]  # adapter id -> its .sidecar.json

    @property
    def ids(self) -> set[str]:
        return set(self.records)

    @property
    def size_bytes(self) -> int:
        return sum(r.size_bytes for r in self.records.values())


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """The files of an adapter folder, without the sidecar's record."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != RECORD_NAME}


BUDGET_DIRS = ("adapters", ".staging", ".trash")  # what --max-bytes bounds


def _file_sizes(top: Path, seen: set[int], skip: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """The name and size of each file under `top` not in `seen` (by inode; added to it), the
    folders of `top` named in `skip` aside. A file deleted while walking is left out."""
    for folder, dirs, files in os.walk(top):
        if folder == str(top):
            dirs[:] = [d for d in dirs if d not in skip]
        for file in files:
            try:
                st = os.lstat(os.path.join(folder, file))
            except OSError:
                continue  # deleted while walking
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                yield file, st.st_size


def disk_bytes(cache_root: Path) -> tuple[int, int]:
    """The bytes under the cache root, a hard-linked file once: those --max-bytes bounds, as
    `du` would count them apart from the sidecar's own files (every adapter file under
    adapters/, .staging/ and .trash/: published, being staged, being deleted; the records
    aside), and all the rest (the records, the catalog). Safe to call while the sidecar
    works."""
    seen: set[int] = set()
    budget, other = 0, 0
    for name in BUDGET_DIRS:  # first: a file linked from outside them too counts here
        for file, size in _file_sizes(cache_root / name, seen):
            if file.startswith(RECORD_NAME):
                other += size
            else:
                budget += size
    other += sum(size for _file, size in _file_sizes(cache_root, seen, skip=BUDGET_DIRS))
    return budget, other


def budget_bytes(cache_root: Path) -> int:
    """The bytes --max-bytes bounds (see `disk_bytes`)."""
    return disk_bytes(cache_root)[0]


def leftovers(cache_root: Path) -> list[str]:
    """What is left in .staging/ and .trash/ (nothing, once a stage or restart is over)."""
    found = []
    for name in (".staging", ".trash"):
        folder = cache_root / name
        if folder.is_dir():
            found += [f"{name}/{p.name}" for p in sorted(folder.iterdir())]
    return found


def check_cache(
    cache_root: Path,
    rules: Rules,
    *,
    max_adapters: int | None = None,
    max_bytes: int | None = None,
    sources: Mapping[str, Mapping[str, bytes]] | None = None,
    allow_leftovers: bool = False,
) -> CacheState:
    """Assert the cache is consistent and return what it holds.

    Every folder under adapters/ has a record whose files, sizes and checksums match the bytes
    on disk (re-hashed here), passes validation, and, when `sources` has it, holds exactly the
    registry's bytes; the budget holds; .staging/ and .trash/ are empty.
    """
    problems: list[str] = []
    records: dict[str, AdapterRecord] = {}
    if not allow_leftovers:
        problems += [f"left behind: {name}" for name in leftovers(cache_root)]
    adapters = cache_root / "adapters"
    for folder in sorted(adapters.iterdir()) if adapters.is_dir() else []:
        adapter_id = folder.name
        try:
            record = AdapterRecord.from_json(json.loads((folder / RECORD_NAME).read_bytes()))
        except (OSError, ValueError) as exc:
            problems.append(f"{adapter_id}: no valid {RECORD_NAME} ({exc})")
            continue
        files = folder_bytes(folder)
        if record.adapter_id != adapter_id:
            problems.append(f"{adapter_id}: record names {record.adapter_id}")
        if set(files) != set(record.files):
            problems.append(f"{adapter_id}: files {sorted(files)} but record lists "
                            f"{sorted(record.files)}")
        for name, data in files.items():
            expected = record.files.get(name)
            if expected is not None and (
                expected.size_bytes != len(data)
                or expected.crc32 != f"{zlib.crc32(data):08x}"
                or expected.sha256 not in (None, hashlib.sha256(data).hexdigest())
            ):
                problems.append(f"{adapter_id}/{name}: bytes differ from the record")
        problems += [f"{adapter_id}: invalid: {p.code} {p.file}: {p.message}"
                     for p in validate_adapter(folder, rules)]
        if sources is not None and adapter_id in sources and files != dict(sources[adapter_id]):
            problems.append(f"{adapter_id}: bytes differ from the registry's")
        records[adapter_id] = record
    state = CacheState(records)
    if max_adapters is not None and len(records) > max_adapters:
        problems.append(f"{len(records)} adapters cached, budget {max_adapters}")
    if max_bytes is not None and state.size_bytes > max_bytes:
        problems.append(f"{state.size_bytes} bytes cached, budget {max_bytes}")
    assert not problems, "inconsistent cache:\n  " + "\n  ".join(problems)
    return state
