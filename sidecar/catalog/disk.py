"""The catalog on the volume: every name a generation lists is a link in its folder, so the
sidecar decides what each name reads and a switch is one atomic rename; the no-op adapter names
point at while they have nothing else to lead to; the journal; multi_lora.json. Blocking
functions (run them in a thread), except where a docstring says a call is a few system calls and
fits the loop.

    <cache_root>/catalog/journal.json           every live generation and its names (fsynced)
    <cache_root>/catalog/g<N>/names/<name>      a relative link:
                                                  ../../../adapters/<id>  bound (version on disk)
                                                  ../noop/<name>          unbound, parked, burnt
    <cache_root>/catalog/g<N>/noop/.shared/     the generation's one no-op adapter (zero lora_B)
    <cache_root>/catalog/g<N>/noop/<name>/      hard links to .shared's files: each name reads
                                                  its own folder, so a read of one name is told
                                                  from a read of another (read_watch.py)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from ..core.fsutil import fsync_dir
from ..validation.shapes import ATTENTION_MODULES, ModelShapes
from .generation import CatalogJournal, Generation
from .name_state import NameState

CATALOG_DIR = "catalog"
CATALOG_FILE = "multi_lora.json"
CATALOG_JOURNAL_FILE = "journal.json"
NAMES_DIR = "names"
NOOP_DIR = "noop"
SHARED_DIR = ".shared"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# In every no-op folder, never opened by the engine: a process that reads it too is walking the
# volume (a backup, a checksum run), not serving a request (read_watch.py).
DECOY_FILE = "README"
JOURNAL_MAX_BYTES = 256 * 1024**2
_MODULES = ("v_proj", "k_proj", "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_A = re.compile(r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                     r"(?P<module>\w+)\.lora_A\.weight")
DECOY_TEXT = b"""\
A no-op LoRA adapter (lora_B is zero): lora-sidecar points a catalogued name here while the name
has no adapter on disk to lead to, so a call with it answers like the base model and never finds
a missing folder. vLLM reads adapter_config.json and adapter_model.safetensors only; a process
that opens both without this file counts as the engine having read the no-op under this name,
and the name is then never handed out again. Reading every file here, as a backup does, is fine.
"""


def generation_dir(root: Path, number: int) -> Path:
    return root / CATALOG_DIR / f"g{number}"


def names_dir(root: Path, number: int) -> Path:
    return generation_dir(root, number) / NAMES_DIR


def noop_dir(root: Path, number: int, name: str) -> Path:
    return generation_dir(root, number) / NOOP_DIR / name


def adapter_target(adapter_id: str) -> str:
    """A name's link target for a published adapter, relative to names/."""
    return f"../../../adapters/{adapter_id}"


def noop_target(name: str) -> str:
    return f"../{NOOP_DIR}/{name}"


# ---- the no-op adapter --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NoopAdapter:
    """The bytes of an adapter that fits the base model and changes nothing: rank 1 on one
    projection of every layer (an adapter that names a module must hold it for every layer),
    lora_B zero (so B·A·x is 0 whatever A is). About 0.3 MB for an 8B Llama. vLLM refuses an
    adapter with no tensors at all, so it needs the model's shapes."""

    config: bytes
    weights: bytes
    module: str

    @classmethod
    def for_model(cls, shapes: ModelShapes, allowed_modules: Iterable[str]) -> NoopAdapter:
        """ValueError when no allowed module has a size known from the base model's config."""
        allowed = set(allowed_modules)
        known = {m: dims for m in _MODULES if m in allowed
                 and (dims := shapes.module_dims(m)) is not None}
        if not known:
            raise ValueError(f"none of the allowed target modules {sorted(allowed)} has a size "
                             "known from the base model's shapes")
        # The smallest: rank 1 costs in + out values per layer.
        module = min(known, key=lambda m: sum(known[m]))
        return cls._build(module, *known[module], shapes.num_hidden_layers)

    @classmethod
    def like(cls, tensors: Mapping[str, tuple[int, ...]], allowed_modules: Iterable[str]
             ) -> NoopAdapter | None:
        """A no-op with the shapes of an adapter the engine accepts (its tensor names and
        shapes), for when the base model's config is not given: one allowed module that the
        adapter holds in every layer from 0. None when it holds none."""
        allowed = set(allowed_modules)
        dims: dict[str, dict[int, tuple[int, int]]] = {}
        for name, shape in tensors.items():
            match = _LORA_A.fullmatch(name)
            if match is None or match["module"] not in allowed or len(shape) != 2:
                continue
            b_shape = tensors.get(name.replace(".lora_A.", ".lora_B."))
            if b_shape is None or len(b_shape) != 2:
                continue
            dims.setdefault(match["module"], {})[int(match["layer"])] = (shape[1], b_shape[0])
        usable = {}
        for module, layers in dims.items():
            sizes = set(layers.values())
            if len(sizes) == 1 and sorted(layers) == list(range(len(layers))):
                usable[module] = (*sizes.pop(), len(layers))
        if not usable:
            return None
        module = min(usable, key=lambda m: usable[m][0] + usable[m][1])
        return cls._build(module, *usable[module])

    @classmethod
    def _build(cls, module: str, in_features: int, out_features: int,
               layers: int) -> NoopAdapter:
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        tensors = {}
        for layer in range(layers):
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

    @property
    def size_bytes(self) -> int:
        return len(self.config) + len(self.weights) + len(DECOY_TEXT)

    def write(self, folder: Path) -> None:
        """The adapter's files in a new folder, fsynced (the folder too)."""
        folder.mkdir(parents=True)
        for name, data in ((CONFIG_FILE, self.config), (WEIGHTS_FILE, self.weights),
                           (DECOY_FILE, DECOY_TEXT)):
            with open(folder / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(folder / name, 0o644)
        fsync_dir(folder)


# ---- generation folders -------------------------------------------------------------------


def create_generation(root: Path, generation: Generation, noop: NoopAdapter | None) -> None:
    """The generation's folder: a link per name (its version's folder, or its own no-op), and
    the no-op folders of every name not bound. Built aside and renamed in, so a crash leaves all
    of it or nothing."""
    final = generation_dir(root, generation.number)
    building = final.with_name(f".{final.name}.{secrets.token_hex(4)}")
    names = building / NAMES_DIR
    names.mkdir(parents=True)
    try:
        if noop is not None:
            noop.write(building / NOOP_DIR / SHARED_DIR)
        for name, entry in generation.names.items():
            if entry.version is not None and entry.state is NameState.BOUND:
                target = adapter_target(entry.version.adapter_id)
            else:
                target = noop_target(name)
                if noop is not None:
                    _link_noop(building / NOOP_DIR, name)
            os.symlink(target, names / name)
        if noop is not None:
            fsync_dir(building / NOOP_DIR)
        fsync_dir(names)
        fsync_dir(building)
        if final.exists():  # left by a crash before the journal named it
            shutil.rmtree(final)
        os.rename(building, final)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    fsync_dir(final.parent)


def _link_noop(noops: Path, name: str) -> None:
    folder = noops / name
    folder.mkdir()
    for file in (CONFIG_FILE, WEIGHTS_FILE, DECOY_FILE):
        os.link(noops / SHARED_DIR / file, folder / file)


def ensure_noop(root: Path, number: int, name: str, noop: NoopAdapter | None) -> bool:
    """Give a name its no-op folder if it has none (its generation's shared no-op written first
    if missing). A few system calls when the shared no-op exists. False when there is no no-op
    to give (the base model's shapes are unknown)."""
    folder = noop_dir(root, number, name)
    if (folder / WEIGHTS_FILE).is_file():
        return True
    if noop is None:
        return False
    noops = generation_dir(root, number) / NOOP_DIR
    if not (noops / SHARED_DIR / WEIGHTS_FILE).is_file():
        building = noops / f".{SHARED_DIR}.{secrets.token_hex(4)}"
        noop.write(building)
        shutil.rmtree(noops / SHARED_DIR, ignore_errors=True)
        os.rename(building, noops / SHARED_DIR)
    shutil.rmtree(folder, ignore_errors=True)  # a half-made one
    _link_noop(noops, name)
    fsync_dir(noops)
    return True


def point_link(root: Path, number: int, name: str, target: str, *,
               durable: bool = True) -> None:
    """Point a name's link at `target` (relative to names/), atomically: a reader sees the old
    target or the new one. A few system calls; `durable` false leaves the folder's fsync to
    the caller (`sync_names`)."""
    folder = names_dir(root, number)
    temporary = folder / f".{name}.{secrets.token_hex(4)}"
    os.symlink(target, temporary)
    try:
        os.replace(temporary, folder / name)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    if durable:
        fsync_dir(folder)


def sync_names(root: Path, number: int) -> None:
    """Make the links of generation `number` durable (blocking: run in a thread)."""
    fsync_dir(names_dir(root, number))


def link_target(root: Path, number: int, name: str) -> str | None:
    try:
        return os.readlink(names_dir(root, number) / name)
    except OSError:
        return None


def remove_generation(root: Path, number: int) -> None:
    shutil.rmtree(generation_dir(root, number), ignore_errors=True)


def generation_numbers_on_disk(root: Path) -> set[int]:
    folder = root / CATALOG_DIR
    if not folder.is_dir():
        return set()
    return {int(p.name[1:]) for p in folder.iterdir()
            if p.name.startswith("g") and p.name[1:].isdigit()}


def remove_strays(root: Path, keep: Iterable[int]) -> list[str]:
    """Delete generation folders the journal does not name, half-built ones and temporary
    files of interrupted writes; return their names. Anything else is left alone."""
    folder = root / CATALOG_DIR
    if not folder.is_dir():
        return []
    wanted = {f"g{n}" for n in keep}
    removed = []
    for entry in folder.iterdir():
        if entry.name == CATALOG_JOURNAL_FILE or entry.name in wanted:
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


def disk_bytes(root: Path) -> int:
    """Bytes the catalog keeps on the volume (apparent sizes, folders and links included, a
    hard-linked file once): the no-op adapters, the names, the journal and multi_lora.json.
    None of it is an adapter's bytes, so none of it counts against --max-bytes."""
    seen: set[tuple[int, int]] = set()
    total = 0
    paths = [root / CATALOG_FILE]
    for folder, dirs, files in os.walk(root / CATALOG_DIR):
        paths.append(Path(folder))
        paths.extend(Path(folder) / name for name in [*dirs, *files])
    for path in paths:
        try:
            st = path.lstat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_size
    return total


# ---- the journal and multi_lora.json --------------------------------------------------------


def read_catalog_journal(root: Path) -> CatalogJournal:
    """The journal; an empty one when there is none. ValueError when it cannot be trusted."""
    path = root / CATALOG_DIR / CATALOG_JOURNAL_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(JOURNAL_MAX_BYTES + 1)
    except FileNotFoundError:
        return CatalogJournal()
    if len(raw) > JOURNAL_MAX_BYTES:
        raise ValueError(f"{path} is larger than {JOURNAL_MAX_BYTES} bytes")
    try:
        return CatalogJournal.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def catalog_journal_bytes(journal: CatalogJournal) -> bytes:
    """The journal's text (on the loop: the caller writes it in a thread with
    write_catalog_journal)."""
    return journal.journal_text().encode()


def write_catalog_journal(root: Path, data: bytes) -> None:
    folder = root / CATALOG_DIR
    folder.mkdir(exist_ok=True)
    write_atomically(folder / CATALOG_JOURNAL_FILE, data)


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


def catalog_entries(generation: Generation, triton_root: Path) -> dict[str, str]:
    """multi_lora.json's mapping for a generation, with Triton's absolute paths (vLLM takes a
    relative path for a Hugging Face hub id)."""
    folder = triton_root / CATALOG_DIR / f"g{generation.number}" / NAMES_DIR
    return {name: str(folder / name) for name in generation.names}


def render_text(generation: Generation, triton_root: Path) -> str:
    return json.dumps(catalog_entries(generation, triton_root), indent=2) + "\n"
