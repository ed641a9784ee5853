"""Generate valid PEFT LoRA adapters: the examples of a fresh install, and test fixtures.

Adapters are written the way PEFT saves them (`adapter_config.json` plus
`adapter_model.safetensors` with `base_model.model.` tensor names).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize_file

from ..validation.shapes import ATTENTION_MODULES, TINY_LLAMA, ModelShapes

log = logging.getLogger(__name__)

EXAMPLE_ADAPTERS = ("example-support-v1", "example-sql-v1")
_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def tensor_name(layer: int, module: str, half: str) -> str:
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{half}.weight"


def adapter_config(
    rank: int, target_modules: Sequence[str], base_model: str = "tiny-llama"
) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank * 2,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def _random_tensor(
    rng: np.random.Generator, shape: tuple[int, int], dtype: str, scale: float
) -> np.ndarray[Any, Any]:
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    # bfloat16 is the top half of a float32; numpy has no bfloat16, so keep raw uint16.
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def write_adapter(
    folder: Path,
    *,
    rank: int = 8,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    shapes: ModelShapes = TINY_LLAMA,
    dtype: str = "float16",
    seed: int = 0,
    base_model: str = "tiny-llama",
    scale: float = 0.02,
) -> int:
    """Write a valid adapter into `folder` (created); return its total size in bytes. `scale` is
    the weights' standard deviation: the default barely changes a model's text; a few tenths
    give an adapter a text of its own."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for layer in range(shapes.num_hidden_layers):
        for module in target_modules:
            dims = shapes.module_dims(module)
            if dims is None:
                raise ValueError(f"unknown module {module!r}")
            in_features, out_features = dims
            arrays[tensor_name(layer, module, "A")] = _random_tensor(
                rng, (rank, in_features), dtype, scale
            )
            arrays[tensor_name(layer, module, "B")] = _random_tensor(
                rng, (out_features, rank), dtype, scale
            )
    specs = {
        name: TensorSpec(
            dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for name, a in arrays.items()
    }
    config = folder / "adapter_config.json"
    config.write_text(json.dumps(adapter_config(rank, target_modules, base_model), indent=2))
    weights = folder / "adapter_model.safetensors"
    serialize_file(specs, str(weights), metadata={"format": "pt"})
    # safetensors creates its file 0600 whatever the umask; a registry seeded here is read by
    # others too (MinIO's user, a container's), so the weights get the mode the config got.
    os.chmod(weights, stat.S_IMODE(config.stat().st_mode))
    return weights.stat().st_size + config.stat().st_size


def ensure_examples(registry: Path) -> list[str]:
    """Put the example adapters into an empty local registry; return the ids written."""
    registry.mkdir(parents=True, exist_ok=True)
    if any(registry.iterdir()):
        return []
    for seed, adapter_id in enumerate(EXAMPLE_ADAPTERS):
        write_adapter(registry / adapter_id, rank=8, seed=seed + 1)
        log.info("wrote example adapter adapter_id=%s into %s", adapter_id, registry)
    return list(EXAMPLE_ADAPTERS)
