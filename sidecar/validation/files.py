"""Which entries of an adapter folder the sidecar fetches, which it ignores, and which make it
refuse the adapter: the one rule behind the registry listing (the stager), `validate`, the
watcher and compose/upload_adapters.py.

The engine (vLLM 0.13) reads `adapter_config.json` and `adapter_model.safetensors`; without the
latter it unpickles `adapter_model.bin` or `.pt` (lora_model.py), and vLLM 0.10 also read
`new_embeddings.*` and a tokenizer from the folder. So, by name:

- fetched, validated and published: those two files, `SHA256SUMS`, which vouches for them, and
  `model.sig`, their OMS signature (signatures.py; the engine never reads it);
- refused: `adapter_model.bin`/`.pt` with no `adapter_model.safetensors` beside it,
  `new_embeddings.*`, an engine file that is a link or not a plain file, and any path that would
  leave the folder;
- ignored, everything else: never downloaded, never published, named once. That is what PEFT,
  Trainer and `hf download --local-dir` leave beside an adapter (training_args.bin, optimizer.pt,
  tokenizer files, README.md, .gitattributes, `.cache/huggingface/`, checkpoint-N/ folders).
  A pickle the engine never reads cannot run; a tokenizer that is never published cannot load.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..core.fsutil import EntryKind, entry_kind
from .problem import Problem
from .safetensors_check import shown

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKSUMS_FILE = "SHA256SUMS"
SIGNATURE_FILE = "model.sig"  # model_signing's default name, inside the adapter folder
SIGNATURE_MAX_BYTES = 1024 * 1024  # a model.sig larger is refused from its listed size
FETCHED_FILES = (CONFIG_FILE, WEIGHTS_FILE, CHECKSUMS_FILE, SIGNATURE_FILE)
# What vLLM loads with torch.load when adapter_model.safetensors is missing; torch.load runs
# pickles, and `weights_only=True` has been bypassed (CVE-2025-32434).
PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")
_NEW_EMBEDDINGS = "new_embeddings."
SHOWN_IGNORED = 12  # entries named in one log line or note


class FileRole(Enum):
    FETCHED = "fetched"
    IGNORED = "ignored"
    PICKLE_WEIGHTS = "pickle weights"  # ignored beside adapter_model.safetensors, else refused
    REFUSED = "refused"


def leaves_folder(path: str) -> bool:
    """Whether a path inside an adapter folder ('/'-separated) could lead out of it, or alias
    another entry: absolute, a '..' or '.' or empty part, a backslash (a separator on Windows)."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return True
    return any(part in ("", ".", "..") for part in path.removesuffix("/").split("/"))


def classify(path: str) -> FileRole:
    """The role of the entry at `path` (relative to the adapter folder, '/'-separated) by its
    name alone. The engine reads the folder's own files only, so anything below a sub-folder is
    ignored."""
    if leaves_folder(path):
        return FileRole.REFUSED
    if "/" in path:
        return FileRole.IGNORED
    if path in FETCHED_FILES:
        return FileRole.FETCHED
    lowered = path.lower()
    if lowered in PICKLE_WEIGHTS:
        return FileRole.PICKLE_WEIGHTS
    if lowered.startswith(_NEW_EMBEDDINGS):
        return FileRole.REFUSED
    return FileRole.IGNORED


@dataclass(frozen=True, slots=True)
class FilePlan:
    """What to do with each entry of one adapter folder."""

    fetched: tuple[str, ...]  # plain files to fetch, validate and publish
    ignored: tuple[str, ...]  # never fetched or published; a sub-folder shown as `name/`
    problems: tuple[Problem, ...]  # reasons to refuse the adapter from its entries alone

    def ignored_text(self) -> str:
        return listed(self.ignored)


def listed(names: Sequence[str]) -> str:
    """Entries for one log line or note: `README.md, training_args.bin, .cache/ (+3 more)`."""
    shown_names = [shown(name, limit=100) for name in names[:SHOWN_IGNORED]]
    more = len(names) - SHOWN_IGNORED
    return ", ".join(shown_names) + (f" (+{more} more)" if more > 0 else "")


def plan_files(entries: Iterable[tuple[str, EntryKind]]) -> FilePlan:
    """The plan for a folder's entries: each a path relative to the folder ('/'-separated, as
    an S3 key below the adapter's prefix) and what it is."""
    fetched: list[str] = []
    ignored: set[str] = set()
    problems: list[Problem] = []
    pickles: list[str] = []
    present: set[str] = set()
    nested: list[str] = []  # engine files below a sub-folder, for a hint
    for path, kind in entries:
        role = classify(path)
        present.add(path)
        if role is FileRole.REFUSED:
            problems.append(_refusal(path))
        elif role is FileRole.IGNORED:
            top, below, _ = path.partition("/")
            ignored.add(f"{top}/" if below or kind is EntryKind.FOLDER else top)
            if path.rpartition("/")[2] in (CONFIG_FILE, WEIGHTS_FILE) and below:
                nested.append(path)
        elif kind is not EntryKind.FILE:
            problems.append(_not_plain(path, kind))
        elif role is FileRole.PICKLE_WEIGHTS:
            pickles.append(path)
        else:
            fetched.append(path)
    for name in pickles:
        if WEIGHTS_FILE in present:
            ignored.add(name)  # the engine reads adapter_model.safetensors first
        else:
            problems.append(Problem("forbidden_file", shown(name), "pickle-based weights, and "
                                    f"no {WEIGHTS_FILE}: the engine would load them with "
                                    "torch.load, which can run code. Convert them where the "
                                    "file is trusted: PEFT's PeftModel.from_pretrained(...)"
                                    f".save_pretrained(folder) writes {WEIGHTS_FILE} (its "
                                    "default, safe_serialization=True)"))
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if name not in present and not (name == WEIGHTS_FILE and pickles):
            hint = [p for p in nested if p.endswith(f"/{name}")]
            problems.append(Problem("missing_file", name,
                                    f"{name} is missing{_one_level_down(hint)}"))
    return FilePlan(tuple(sorted(fetched)), tuple(sorted(ignored)), tuple(problems))


_CHECKPOINT = re.compile(r"checkpoint-(?P<step>[0-9]+)")


def _one_level_down(paths: Sequence[str]) -> str:
    """Where the missing file is below the folder, as a hint: a Trainer's output folder holds
    the adapter of each saved step in checkpoint-N/, and the last one is named."""
    if not paths:
        return ""
    steps = {int(m["step"]): path for path in paths
             if (m := _CHECKPOINT.fullmatch(path.partition("/")[0]))}
    if steps:
        last = steps[max(steps)]
        folder = last.partition("/")[0]
        return (f"; {shown(last)} is one level down: this looks like a Trainer's output folder, "
                f"whose checkpoint-N/ folders each hold the adapter saved at step N ({len(steps)} "
                f"here, the last {folder}/). Point at that folder, or save the final adapter "
                "with trainer.save_model(DIR) (PEFT's save_pretrained) and use DIR")
    return (f"; {shown(paths[0])} is one level down: point at the folder that holds the "
            "adapter's files directly")


def plan_folder(folder: Path) -> FilePlan:
    """The plan for a local folder's entries (raises OSError if it cannot be listed). A
    sub-folder is looked into only for the engine's two files, for the missing files' hint."""
    entries: list[tuple[str, EntryKind]] = []
    with os.scandir(folder) as scan:
        for entry in scan:
            kind = entry_kind(entry.stat(follow_symlinks=False).st_mode)
            entries.append((entry.name, kind))
            if kind is EntryKind.FOLDER:
                entries.extend((f"{entry.name}/{name}", EntryKind.FILE)
                               for name in (CONFIG_FILE, WEIGHTS_FILE)
                               if os.path.isfile(os.path.join(entry.path, name)))
    return plan_files(sorted(entries))


def _refusal(path: str) -> Problem:
    if leaves_folder(path):
        return Problem("unsafe_path", shown(path), "would leave the adapter folder ('..', '.', "
                       "an absolute path or a backslash); nothing of the adapter is fetched")
    return Problem("forbidden_file", shown(path), "new embeddings (tokens added in training): "
                   "vLLM 0.13 ignores them, so the adapter would not answer as trained, and "
                   "older versions unpickle a .bin")


def _not_plain(path: str, kind: EntryKind) -> Problem:
    if kind is EntryKind.LINK:
        return Problem("symlink", shown(path), "a symbolic link: the engine would follow it "
                       "anywhere, and its target can change at any time")
    return Problem("not_regular_file", shown(path), f"a {kind.value}, not a plain file")
