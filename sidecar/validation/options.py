"""The validation's options: what the served engine accepts (rank, target modules, base model)
and the signing policy. Declared here, where they are read (validate.Rules), and inherited by
config.Settings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..core.options import (
    at_least,
    option,
    parse_existing_file,
    parse_int,
    parse_list,
    parse_optional_str,
)
from .engine_config import EngineConfig
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


def parse_engine_config(text: str) -> EngineConfig | None:
    path = parse_existing_file(text)
    return EngineConfig.load(path) if path is not None else None


@dataclasses.dataclass(frozen=True)
class ValidationOptions:
    engine_config: EngineConfig | None = option(
        "--engine-config", parse_engine_config, "",
        "the vLLM model's model.json (triton_repo/vllm_model/1/model.json, the file the engine "
        "reads): max_lora_rank and the base model's folder are taken from it, so a limit is "
        "changed in that one place", "FILE",
        default_text="the vLLM model's model.json in --seed-model-repository, when there is "
        "one; else none")
    max_lora_rank: int = option(
        "--max-lora-rank", at_least(parse_int, 1, "at least 1"), "16",
        "largest LoRA rank the served engine accepts (vLLM's max_lora_rank); with "
        "--engine-config it is that file's, and a value given here must equal it", "N")
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


def take_engine_limits(parsed: dict[str, Any], given: Collection[str]) -> list[str]:
    """With --engine-config, the engine's own limits replace the options' defaults: its
    max_lora_rank, and its base model folder's config.json for the shapes unless
    --base-model-config is given. `given` names the options set by flag or variable; a
    --max-lora-rank among them that disagrees with the file is a problem naming both."""
    engine: EngineConfig | None = parsed.get("engine_config")
    if engine is None:
        return []
    problems = []
    if "max_lora_rank" in given and parsed["max_lora_rank"] != engine.max_lora_rank:
        problems.append(
            f"--max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK) = {parsed['max_lora_rank']} "
            f"disagrees with max_lora_rank {engine.max_lora_rank} in {engine.path} "
            "(--engine-config, LORA_SIDECAR_ENGINE_CONFIG), the engine's own limit: adapters "
            "the engine refuses would be let through, or ones it serves refused. Change the "
            "limit in that file only, and leave --max-lora-rank unset")
    parsed["max_lora_rank"] = engine.max_lora_rank
    folder = engine.model_folder
    if "base_model_config" not in given and folder is not None \
            and (folder / "config.json").is_file():
        parsed["base_model_config"] = folder / "config.json"
    return problems
