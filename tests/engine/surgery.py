"""Bad adapters made from good ones, for the engine tier: byte-level or tensor-level changes to
a copy of a PEFT adapter folder (test venv: numpy and safetensors only)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
Tensors = dict[str, np.ndarray[Any, Any]]


def copy_adapter(source: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest, symlinks=True)
    return dest


def edit_tensors(folder: Path, edit: Callable[[Tensors], object]) -> None:
    """Change the tensors of an F16 or F32 adapter (numpy has no bfloat16)."""
    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / CONFIG).read_text())
    for key, value in changes.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


_DELETE = object()


def delete() -> Any:
    """A value for edit_config that removes the key."""
    return _DELETE


def first_tensor(tensors: Tensors, half: str = "B") -> str:
    return sorted(name for name in tensors if f".lora_{half}." in name)[0]


def with_value(value: float, half: str = "B") -> Callable[[Tensors], None]:
    """One element of one lora_A/lora_B tensor set to `value` (NaN, +inf, -inf)."""

    def edit(tensors: Tensors) -> None:
        name = first_tensor(tensors, half)
        array = tensors[name].copy()
        array.flat[array.size // 2] = value
        tensors[name] = array

    return edit


def non_finite(source: Path, dest: Path, value: float, half: str = "B") -> Path:
    copy_adapter(source, dest)
    edit_tensors(dest, with_value(value, half))
    return dest


def variant(source: Path, dest: Path, lora_alpha: float) -> Path:
    """A good adapter of its own from a good one: the same tensors at another scale (its own
    text; get it with EngineAssets.references)."""
    copy_adapter(source, dest)
    edit_config(dest, lora_alpha=lora_alpha)
    return dest


def with_rank(source: Path, dest: Path, rank: int, seed: int) -> Path:
    """A good adapter of its own at another LoRA rank, from a good one of the plainest kind (the
    same modules and dtype): new A and B tensors of `rank`, drawn with `seed` at the spread of
    the source's own, and `r` and `lora_alpha` (2 x r) in its config to match (its own text;
    get it with EngineAssets.references)."""
    copy_adapter(source, dest)
    rng = np.random.default_rng(seed)

    def edit(tensors: Tensors) -> None:
        for name, array in list(tensors.items()):
            if ".lora_A." in name:  # (r, in)
                shape: tuple[int, ...] = (rank, array.shape[1])
            elif ".lora_B." in name:  # (out, r)
                shape = (array.shape[0], rank)
            else:
                raise ValueError(f"{source}: {name} is neither lora_A nor lora_B")
            spread = float(array.astype(np.float32).std())
            tensors[name] = rng.normal(0.0, spread, shape).astype(array.dtype)

    edit_tensors(dest, edit)
    edit_config(dest, r=rank, lora_alpha=2 * rank)
    return dest
