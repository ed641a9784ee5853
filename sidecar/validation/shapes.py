"""The base model's linear-layer sizes, which fix every LoRA tensor's shape.

Read from a Hugging Face `config.json` (Llama family fields); used by validation to check
shapes and by the example generator to write adapters that fit a model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ModelShapes:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShapes:
        """From a parsed config.json; raises ValueError naming the missing or bad field."""

        def positive_int(key: str, default: object = None) -> int:
            value = config.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
            return value

        heads = positive_int("num_attention_heads")
        hidden = positive_int("hidden_size")
        return cls(
            hidden_size=hidden,
            intermediate_size=positive_int("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=positive_int("num_key_value_heads", heads),
            num_hidden_layers=positive_int("num_hidden_layers"),
            head_dim=positive_int("head_dim", hidden // heads if hidden % heads == 0 else None),
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelShapes:
        with path.open("rb") as f:
            raw = f.read(1024 * 1024)
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{path}: the top level is not a JSON object")
        return cls.from_config(config)

    def to_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "head_dim": self.head_dim,
        }

    def module_dims(self, module: str) -> tuple[int, int] | None:
        """(in_features, out_features) of a projection, or None for an unknown module."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        dims = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        return dims.get(module)


# A model small enough for examples and tests (a few hundred KB per adapter).
TINY_LLAMA = ModelShapes(
    hidden_size=64,
    intermediate_size=172,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    head_dim=16,
)

# Llama-3-8B, for realistic adapter sizes in benchmarks.
LLAMA_3_8B = ModelShapes(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    head_dim=128,
)
