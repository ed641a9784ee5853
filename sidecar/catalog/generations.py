"""Catalog generations on disk: every name a generation lists is a link in its folder, so the
sidecar decides what each name reads and none ever dangles; the no-op adapters unbound spares
point at; and the journal that lets a restarted sidecar carry on with the generation Triton
serves. Blocking functions: run them in a thread, except where a docstring says a call is a few
system calls and fits the loop.

    <cache_root>/catalog/journal.json            generations, bindings (fsynced at every change)
    <cache_root>/catalog/g<N>/names/<name>       a relative link, for an adapter id:
                                                   ../../../adapters/<id>  while it is on disk
                                                   ../noop/_retired        once it left the disk
                                                 and for a spare name:
                                                   ../noop/<spare>         until bound
                                                   ../../../adapters/<id>  once bound
                                                   ../kept/<spare>         once that left the disk
    <cache_root>/catalog/g<N>/noop/<name>/       a valid adapter that changes nothing (zero B)
    <cache_root>/catalog/g<N>/kept/<spare>/      hard links to an evicted bound adapter's files
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from ..fsutil import fsync_dir
from ..validation.shapes import ATTENTION_MODULES, ModelShapes

CATALOG_DIR = "catalog"
JOURNAL_FILE = "journal.json"
JOURNAL_FORMAT = 1
SPARE_PREFIX = "_spare-g"  # '_' cannot start an adapter id, so a spare never shadows one
NAMES_DIR = "names"
NOOP_DIR = "noop"
KEPT_DIR = "kept"
RETIRED = "_retired"  # the no-op of adapter ids retired from a generation ('_' starts no id)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
JOURNAL_MAX_BYTES = 64 * 1024**2
# The engine reads only these; the others of an adapter (README, SHA256SUMS) need no keeping.
_KEPT_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def spare_name(generation: int, index: int) -> str:
    """`_spare-g7-003`: unique across generations, so a name handed out for one engine is
    refused by the next one ("not supported") instead of reaching another adapter there."""
    return f"{SPARE_PREFIX}{generation}-{index:03d}"


def generation_dir(root: Path, number: int) -> Path:
    return root / CATALOG_DIR / f"g{number}"


def names_dir(root: Path, number: int) -> Path:
    return generation_dir(root, number) / NAMES_DIR


def adapter_target(adapter_id: str) -> str:
    """A name's link target for a published adapter, relative to names/."""
    return f"../../../adapters/{adapter_id}"


def noop_target(name: str) -> str:
    return f"../{NOOP_DIR}/{name}"


def kept_target(spare: str) -> str:
    return f"../{KEPT_DIR}/{spare}"


# ---- the no-op adapter --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NoopAdapter:
    """The bytes of an adapter that fits the base model and changes nothing: rank 1 on one
    projection of every layer (an adapter that names a module must hold it for every layer),
    lora_B zero (so B·A·x is 0 whatever A is). About 0.5 MB for an 8B Llama."""

    config: bytes
    weights: bytes
    module: str

    @classmethod
    def for_model(cls, shapes: ModelShapes, allowed_modules: Iterable[str]) -> NoopAdapter:
        """ValueError when no allowed module has a size known from the base model's config."""
        allowed = set(allowed_modules)
        module = next((m for m in ("q_proj", "v_proj", "k_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj")
                       if m in allowed and shapes.module_dims(m) is not None), None)
        if module is None:
            raise ValueError(f"none of the allowed target modules {sorted(allowed)} has a size "
                             "known from --base-model-config")
        dims = shapes.module_dims(module)
        assert dims is not None
        in_features, out_features = dims
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        tensors = {}
        for layer in range(shapes.num_hidden_layers):
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.zeros((1, in_features), dtype=np.float16)
            tensors[f"{prefix}.lora_B.weight"] = np.zeros((out_features, 1), dtype=np.float16)
        weights = save(tensors, metadata={"format": "pt"})
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1,
            "lora_dropout": 0.0, "target_modules": [module], "bias": "none",
            "use_dora": False, "use_rslora": False, "modules_to_save": None,
            "fan_in_fan_out": False, "inference_mode": True,
        }
        return cls(json.dumps(config, indent=2).encode(), weights, module)

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        for name, data in ((CONFIG_FILE, self.config), (WEIGHTS_FILE, self.weights)):
            with open(folder / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(folder)


# ---- the journal --------------------------------------------------------------------------


@dataclass(slots=True)
class GenerationRecord:
    """One rendered generation: the adapters it lists by their own names, its spare names, and
    what each bound spare serves. A spare is bound at most once and never re-pointed to other
    bytes; a burnt spare is never handed out (never bound, or retired after a fault)."""

    number: int
    adapter_ids: frozenset[str]
    spares: tuple[str, ...]
    rendered_at: float  # unix
    bound: dict[str, str] = field(default_factory=dict)  # spare -> adapter id
    burnt: set[str] = field(default_factory=set)
    retire_at: float | None = None  # unix; the folder is deleted after it
    retired: set[str] = field(default_factory=set)  # adapter ids whose own name is a no-op now
    kept: set[str] = field(default_factory=set)  # bound spares linked into kept/ (from disk)
    by_adapter: dict[str, str] = field(default_factory=dict)  # adapter id -> live spare
    own: set[str] = field(default_factory=set)  # adapter ids served by their own name

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self.by_adapter = {a: s for s, a in self.bound.items() if s not in self.burnt}
        self.own = set(self.adapter_ids) - self.retired

    def retire_own(self, adapter_id: str) -> None:
        """The adapter left the disk: its own name points at a no-op and is never handed out
        again in this generation (a re-stage binds a spare)."""
        self.retired.add(adapter_id)
        self.own.discard(adapter_id)

    def bind(self, spare: str, adapter_id: str) -> None:
        """Record a binding (journaled next); `publish` hands it out once the link is in
        place: a name handed out earlier could reach the engine while it still points at the
        no-op, and the engine would cache the no-op under it."""
        assert spare in self.spares and spare not in self.bound and spare not in self.burnt
        self.bound[spare] = adapter_id

    def publish(self, spare: str) -> None:
        self.by_adapter[self.bound[spare]] = spare

    def unbind_failed(self, spare: str) -> None:
        """The binding could not be written: the spare is burnt, its link may have moved."""
        self.bound.pop(spare, None)
        self.burnt.add(spare)
        self._index()

    def retire_name(self, spare: str) -> None:
        """A bound name no longer handed out (its adapter's bytes could not be kept)."""
        self.burnt.add(spare)
        self._index()

    def free_spares(self) -> list[str]:
        return [s for s in self.spares if s not in self.bound and s not in self.burnt]

    def to_json(self) -> dict[str, Any]:
        return {
            "adapter_ids": sorted(self.adapter_ids), "spares": list(self.spares),
            "rendered_at": self.rendered_at, "bound": dict(sorted(self.bound.items())),
            "burnt": sorted(self.burnt), "retired": sorted(self.retired),
            "retire_at": self.retire_at,
        }

    @classmethod
    def from_json(cls, number: int, data: Mapping[str, Any]) -> GenerationRecord:
        ids, spares, bound = data["adapter_ids"], data["spares"], data["bound"]
        burnt = data.get("burnt", [])
        if not (isinstance(ids, list) and isinstance(spares, list) and isinstance(bound, dict)
                and isinstance(burnt, list)):
            raise ValueError(f"generation {number}: bad types")
        if any(not isinstance(s, str) or not s.startswith(f"{SPARE_PREFIX}{number}-")
               for s in spares):
            raise ValueError(f"generation {number}: a spare name of another generation")
        if not set(bound) <= set(spares) or not set(burnt) <= set(spares):
            raise ValueError(f"generation {number}: a binding of an unknown spare")
        retire_at = data.get("retire_at")
        retired = data.get("retired", [])
        if not isinstance(retired, list) or not set(retired) <= set(ids):
            raise ValueError(f"generation {number}: a retired name it does not list")
        return cls(number, frozenset(map(str, ids)), tuple(spares), float(data["rendered_at"]),
                   {str(k): str(v) for k, v in bound.items()}, set(map(str, burnt)),
                   float(retire_at) if retire_at is not None else None, set(map(str, retired)))


@dataclass(slots=True)
class Journal:
    """Every generation whose folder exists, the one multi_lora.json holds (`current`), and
    the last one Triton confirmed it loaded (`loaded`)."""

    generations: dict[int, GenerationRecord] = field(default_factory=dict)
    current: int | None = None
    loaded: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": JOURNAL_FORMAT, "current": self.current, "loaded": self.loaded,
            "generations": {str(n): g.to_json() for n, g in sorted(self.generations.items())},
        }

    @classmethod
    def from_json(cls, data: object) -> Journal:
        if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT:
            raise ValueError("not a journal of a known format")
        generations = {int(n): GenerationRecord.from_json(int(n), g)
                       for n, g in data["generations"].items()}
        current, loaded = data.get("current"), data.get("loaded")
        for number in (current, loaded):
            if number is not None and number not in generations:
                raise ValueError(f"generation {number} is named but not recorded")
        return cls(generations, current, loaded)

    def next_number(self, root: Path) -> int:
        """Past every generation recorded or left on disk: names are never reused."""
        numbers = set(self.generations)
        folder = root / CATALOG_DIR
        if folder.is_dir():
            numbers |= {int(p.name[1:]) for p in folder.iterdir()
                        if p.name.startswith("g") and p.name[1:].isdigit()}
        return max(numbers, default=0) + 1


def read_journal(root: Path) -> Journal:
    """The journal; an empty one when there is none. ValueError when it cannot be trusted."""
    path = root / CATALOG_DIR / JOURNAL_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(JOURNAL_MAX_BYTES + 1)
    except FileNotFoundError:
        return Journal()
    if len(raw) > JOURNAL_MAX_BYTES:
        raise ValueError(f"{path} is larger than {JOURNAL_MAX_BYTES} bytes")
    try:
        return Journal.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def write_journal(root: Path, journal: Journal) -> None:
    folder = root / CATALOG_DIR
    folder.mkdir(exist_ok=True)
    write_atomically(folder / JOURNAL_FILE, json.dumps(journal.to_json(), indent=1).encode())


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one rename, fsynced, so a crash leaves the old or the new."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        with temporary.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)


# ---- generation folders -------------------------------------------------------------------


def create_generation(root: Path, record: GenerationRecord, noop: NoopAdapter | None) -> None:
    """The generation's folder: a link per adapter id to its published folder, and per spare
    a link to its own no-op adapter (its own copy, so a read of one spare can be told from a
    read of another). Built aside and renamed in, so a crash leaves all of it or nothing."""
    final = generation_dir(root, record.number)
    building = final.with_name(f".{final.name}.{secrets.token_hex(4)}")
    names = building / NAMES_DIR
    names.mkdir(parents=True)
    try:
        if noop is not None:
            noop.write(building / NOOP_DIR / RETIRED)
            for spare in record.spares:
                noop.write(building / NOOP_DIR / spare)
            fsync_dir(building / NOOP_DIR)
        for adapter_id in record.adapter_ids:
            os.symlink(adapter_target(adapter_id), names / adapter_id)
        for spare in record.spares:
            os.symlink(noop_target(spare), names / spare)
        fsync_dir(names)
        fsync_dir(building)
        if final.exists():  # left by a crash before the journal named it
            shutil.rmtree(final)
        os.rename(building, final)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    fsync_dir(final.parent)


def bind_link(root: Path, number: int, spare: str, adapter_id: str) -> None:
    """Point a spare at a published adapter: one atomic rename of a fresh link over the one to
    the no-op. A few system calls; the caller has checked the spare was never bound."""
    point_link(root, number, spare, adapter_target(adapter_id))


def keep_bound_files(root: Path, number: int, spare: str, adapter_folder: Path) -> None:
    """Before a bound adapter's folder leaves adapters/, give the spare its own hard links to
    the same files and point the spare at them: the engine never finds the name dangling, and
    both targets hold the same bytes, so a read that straddles the switch is still whole."""
    kept = generation_dir(root, number) / KEPT_DIR / spare
    building = kept.with_name(f".{spare}.{secrets.token_hex(4)}")
    building.mkdir(parents=True)
    try:
        for name in _KEPT_FILES:
            os.link(adapter_folder / name, building / name)
        if kept.exists():
            shutil.rmtree(kept)
        os.rename(building, kept)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    point_link(root, number, spare, kept_target(spare))


def point_link(root: Path, number: int, name: str, target: str) -> None:
    """Point a name's link at `target` (relative to names/), atomically."""
    _replace_link(names_dir(root, number), name, target)


def _replace_link(folder: Path, name: str, target: str) -> None:
    temporary = folder / f".{name}.{secrets.token_hex(4)}"
    os.symlink(target, temporary)
    try:
        os.replace(temporary, folder / name)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    fsync_dir(folder)


def link_target(root: Path, number: int, name: str) -> str | None:
    try:
        return os.readlink(names_dir(root, number) / name)
    except OSError:
        return None


def remove_generation(root: Path, number: int) -> None:
    shutil.rmtree(generation_dir(root, number), ignore_errors=True)


def remove_strays(root: Path, keep: Iterable[int]) -> list[str]:
    """Delete generation folders the journal does not name, and half-built ones; return them."""
    folder = root / CATALOG_DIR
    if not folder.is_dir():
        return []
    wanted = {f"g{n}" for n in keep}
    removed = []
    for entry in folder.iterdir():
        if entry.name == JOURNAL_FILE or entry.name in wanted:
            continue
        if entry.name.startswith(".") and entry.name.endswith(tuple("0123456789abcdef")):
            pass  # a temporary file or folder of an interrupted write
        elif not (entry.name.startswith("g") and entry.name[1:].isdigit()):
            continue  # not ours
        removed.append(entry.name)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return removed


def kept_bytes(root: Path, record: GenerationRecord) -> int:
    """Bytes the generation's kept/ folder holds (files that left adapters/)."""
    total = 0
    for spare in record.kept:
        for name in _KEPT_FILES:
            try:
                total += (generation_dir(root, record.number) / KEPT_DIR / spare / name).stat(
                ).st_size
            except OSError:
                pass
    return total


def catalog_entries(record: GenerationRecord, triton_root: Path) -> dict[str, str]:
    """multi_lora.json's mapping for a generation, with Triton's absolute paths."""
    folder = triton_root / CATALOG_DIR / f"g{record.number}" / NAMES_DIR
    return {name: str(folder / name) for name in [*sorted(record.adapter_ids), *record.spares]}


def render_text(record: GenerationRecord, triton_root: Path) -> str:
    return json.dumps(catalog_entries(record, triton_root), indent=2) + "\n"

