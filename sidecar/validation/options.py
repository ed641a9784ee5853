"""The validation's options: what the served engine accepts (rank, target modules, base model)
and the signing policy. Declared here, where they are read (validate.Rules), and inherited by
config.Settings.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..core.options import (
    at_least,
    option,
    parse_existing_file,
    parse_int,
    parse_list,
    parse_optional_str,
)
from .signing_policy import SigningPolicy

LLAMA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def parse_modules(text: str) -> tuple[str, ...]:
    modules = parse_list(text)
    bad = [m for m in modules if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", m)]
    if bad:
        raise ValueError(f"not module names: {', '.join(map(repr, bad))}")
    if not modules:
        raise ValueError("list at least one module")
    return modules


def parse_signing_policy(text: str) -> Path | None:
    """The policy file, read and checked now so that its problems stop the start with the
    others, before the cache is touched (Rules reads it again for its own use)."""
    path = parse_existing_file(text)
    if path is not None:
        SigningPolicy.load(path)
    return path


@dataclasses.dataclass(frozen=True)
class ValidationOptions:
    max_lora_rank: int = option(
        "--max-lora-rank", at_least(parse_int, 1, "at least 1"), "16",
        "largest LoRA rank the served engine accepts (vLLM's max_lora_rank)", "N")
    allowed_target_modules: tuple[str, ...] = option(
        "--allowed-target-modules", parse_modules, ",".join(LLAMA_TARGET_MODULES),
        "modules an adapter may target (comma-separated)", "NAMES",
        default_text="the Llama family's projections, " + ",".join(LLAMA_TARGET_MODULES))
    base_model: str | None = option(
        "--base-model", parse_optional_str, "",
        "when set, an adapter's base_model_name_or_path must equal it", "NAME")
    base_model_config: Path | None = option(
        "--base-model-config", parse_existing_file, "",
        "the base model's config.json; when set, tensor shapes are checked against it", "FILE")
    signing_policy: Path | None = option(
        "--signing-policy", parse_signing_policy, "",
        "a TOML file naming, per adapter id, exact or by prefix or glob, the signers (public "
        "keys, or CA roots and an identity) whose OMS signature (model.sig) it needs and a "
        "mode: require, verify-if-present or off (without a file every adapter is off)", "FILE")
