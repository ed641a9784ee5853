"""The served engine's own settings, read from the vLLM model's model.json (the file Triton's vLLM
backend hands to vLLM): its LoRA limits and its base model are the sidecar's rules, so that
there is one place to change a limit and the sidecar cannot let through an adapter the engine
refuses (or refuse one it would serve).

Only the keys the sidecar needs are read; the others are the engine's alone. Where a key is
absent, vLLM's own default applies, and is used here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENGINE_CONFIG_MAX_BYTES = 1024**2  # a model.json is a few hundred bytes
# vLLM's defaults (EngineArgs) where model.json leaves a key out.
VLLM_MAX_LORA_RANK = 16
VLLM_MAX_LORAS = 1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    path: Path
    model: str  # a folder (absolute path) or a Hugging Face hub id
    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int  # vLLM's default: max_loras

    @property
    def model_folder(self) -> Path | None:
        """The base model's folder, when model.json names one rather than a hub id."""
        return Path(self.model) if self.model.startswith("/") else None

    def describe(self) -> str:
        return (f"{self.path}: model {self.model}, max_lora_rank {self.max_lora_rank}, "
                f"max_loras {self.max_loras}, max_cpu_loras {self.max_cpu_loras}")

    @classmethod
    def load(cls, path: Path) -> EngineConfig:
        """Read and check `path`; ValueError says what is wrong with which key."""
        try:
            with path.open("rb") as f:
                data = f.read(ENGINE_CONFIG_MAX_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) > ENGINE_CONFIG_MAX_BYTES:
            raise ValueError(f"{path} is larger than {ENGINE_CONFIG_MAX_BYTES} bytes: not a "
                             "model.json")
        try:
            config = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object (vLLM's engine arguments)")
        if config.get("enable_lora") is not True:
            raise ValueError(f"{path} does not set \"enable_lora\": true: that engine serves "
                             "no adapter")
        model = config.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"{path}: \"model\" must name the base model (a folder or a hub "
                             "id)")
        rank = _count(config, "max_lora_rank", VLLM_MAX_LORA_RANK, path)
        loras = _count(config, "max_loras", VLLM_MAX_LORAS, path)
        cpu_loras = _count(config, "max_cpu_loras", loras, path)
        if cpu_loras < loras:
            raise ValueError(f"{path}: max_cpu_loras {cpu_loras} is less than max_loras "
                             f"{loras}; vLLM refuses that")
        return cls(path, model.strip(), rank, loras, cpu_loras)


def _count(config: dict[str, Any], key: str, default: int, path: Path) -> int:
    value = config.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {key} must be a whole number of at least 1, not {value!r}")
    return value
