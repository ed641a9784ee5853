"""What the CPU stand-in for vLLM answers: text derived from the prompt, the sampling
parameters and the bytes of the adapter it loaded (never the name it was asked by, as a real
engine), so a test can tell which adapter, complete and unchanged, produced an answer. Shared
by the stand-in and the tests.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def weights_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_adapter(folder: Path) -> str:
    """Read an adapter folder the way vLLM would before using it; return its weights' digest.

    Raises ValueError when the folder is missing, incomplete or not loadable, as vLLM fails.
    """
    config_path = folder / CONFIG_FILE
    weights_path = folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"No adapter found for {folder}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder}: not a LoRA adapter")
    data = weights_path.read_bytes()
    _check_safetensors(data, weights_path)
    return weights_digest(data)


def _check_safetensors(data: bytes, path: Path) -> None:
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    if 8 + header_len + max(ends, default=0) != len(data):
        raise ValueError(f"{path}: length does not match its header (truncated?)")


def answer_words(digest: str | None, prompt: str, temperature: float) -> list[str]:
    """The 'tokens' of the stand-in's answer; max_tokens keeps the first ones."""
    prompt_digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]
    return [
        f"lora={'yes' if digest else 'none'}",
        f"sha256={digest or '-'}",
        f"prompt={prompt_digest}",
        f"temperature={temperature:g}",
    ]


def expected_text(weights: bytes | None, prompt: str, temperature: float = 0.0,
                  max_tokens: int = 256) -> str:
    """What a test expects for a request with exclude_input_in_output true: `weights` are the
    adapter's safetensors bytes (None: the base model alone)."""
    digest = weights_digest(weights) if weights is not None else None
    return " ".join(answer_words(digest, prompt, temperature)[:max_tokens])
