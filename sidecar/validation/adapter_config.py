"""adapter_config.json, parsed strictly (duplicate keys, NaN and non-objects refused) and
checked against what the served vLLM engine loads correctly (checklist A3, B1-B17).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from .safetensors_check import Fault, shown

_REQUIRED_FIELDS = ("r", "lora_alpha", "target_modules")
# After vLLM's own words for a rank too large: which knob that is here.
_RANK_LIMIT = ("The limit is the engine's max_lora_rank in vllm_model's model.json, which the "
               "sidecar reads with --engine-config (LORA_SIDECAR_ENGINE_CONFIG); without that "
               "file, the sidecar's --max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK), which must "
               "equal the engine's max_lora_rank: raise it in model.json, or train the adapter "
               "at a lower rank.")
# A module name or dotted path ("q_proj", "model.layers.0.self_attn.q_proj"), as PEFT writes
# target_modules for a list, or for "all-linear" once resolved.
_MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_REGEX_MAX_CHARS = 1000
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>[0-9]+)\.")
_SUPPORTED_INITS = frozenset({"gaussian", "eva", "orthogonal", "mica", "lora_ga"})
_UNSUPPORTED_FEATURES = {
    "alora_invocation_tokens": "vLLM does not support Activated LoRA (aLoRA).",
    "use_bdlora": "vLLM does not support block-diagonal LoRA (BD-LoRA).",
    "use_qalora": "vLLM does not support QALoRA.",
}


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """target_modules or exclude_modules as PEFT matches them against a module's path: a list
    names modules by their last names or dotted suffixes, a string is a regular expression the
    whole path must match."""

    names: tuple[str, ...] = ()
    regex: re.Pattern[str] | None = None

    def matches(self, module_path: str) -> bool:
        if self.regex is not None:
            return self.regex.fullmatch(module_path) is not None
        return any(module_path == n or module_path.endswith("." + n) for n in self.names)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """What the tensor checks need from a config: the rank, per-module exceptions, and which
    modules the adapter says it trained."""

    rank: int | None
    rank_pattern: Mapping[str, int]
    targets: ModuleSpec | None = None  # None when target_modules is unusable
    excluded: ModuleSpec | None = None
    layers: frozenset[int] | None = None  # layers_to_transform

    def rank_for(self, module_path: str) -> int | None:
        # vLLM 0.34: a key matches a suffix of the module name at a "." boundary; first wins.
        for key, rank in self.rank_pattern.items():
            if module_path == key or module_path.endswith("." + key):
                return rank
        return self.rank

    def targets_module(self, module_path: str) -> bool | None:
        """Whether PEFT would put LoRA weights on this module (None: the config cannot say)."""
        if self.targets is None:
            return None
        if self.excluded is not None and self.excluded.matches(module_path):
            return False
        if self.layers is not None:
            layer = _LAYER.search(module_path)
            if layer is None or int(layer["layer"]) not in self.layers:
                return False
        return self.targets.matches(module_path)


def check_adapter_config(
    data: bytes,
    *,
    max_lora_rank: int,
    allowed_target_modules: frozenset[str],
    base_model: str | None,
) -> tuple[list[Fault], LoraConfig | None]:
    """The faults of a config file's bytes, and what the tensor checks need from it (None when
    it is not a JSON object at all).

    A stage judges its config twice, in memory before room is reserved and then from disk with
    the folder: the same bytes under the same rules find the first result (a config up to
    CHECKED_KEY_MAX_BYTES, among the last CHECKED_MAX)."""
    if len(data) > CHECKED_KEY_MAX_BYTES:
        return _check(data, max_lora_rank, allowed_target_modules, base_model)
    faults, config = _check_remembered(data, max_lora_rank, allowed_target_modules, base_model)
    return list(faults), config


CHECKED_MAX = 8
CHECKED_KEY_MAX_BYTES = 16 * 1024  # a LoRA config is a few hundred bytes


@functools.lru_cache(maxsize=CHECKED_MAX)
def _check_remembered(data: bytes, max_lora_rank: int, allowed_target_modules: frozenset[str],
                      base_model: str | None) -> tuple[tuple[Fault, ...], LoraConfig | None]:
    faults, config = _check(data, max_lora_rank, allowed_target_modules, base_model)
    return tuple(faults), config


def _check(data: bytes, max_lora_rank: int, allowed_target_modules: frozenset[str],
           base_model: str | None) -> tuple[list[Fault], LoraConfig | None]:
    try:
        config = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_refuse_constant,
        )
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return [("config_invalid_json", f"not valid JSON: {shown(str(exc))}")], None
    if not isinstance(config, dict):
        return [("config_invalid_json", "the top level is not a JSON object")], None
    faults: list[Fault] = []
    if config.get("peft_type") != "LORA":
        faults.append(("not_lora", f"peft_type is {_json(config.get('peft_type'))}, not \"LORA\""))
    missing = sorted(set(_REQUIRED_FIELDS) - set(config))
    if missing:
        faults.append(("missing_config_field", f"Missing required configuration fields: {missing}"))
    rank = config.get("r")
    if "r" in config and not _positive_int(rank):
        faults.append(("invalid_rank", f"LoRA rank `r` must be a positive integer, got "
                       f"{_json(rank)}."))
    elif _positive_int(rank) and rank > max_lora_rank:
        faults.append(("rank_too_large", f"LoRA rank {rank} is greater than max_lora_rank "
                       f"{max_lora_rank}. {_RANK_LIMIT}"))
    faults.extend(_rank_pattern_faults(config.get("rank_pattern"), max_lora_rank))
    faults.extend(_alpha_faults(config))
    faults.extend(_ignored_pattern_faults(config, max_lora_rank))
    faults.extend(_target_module_faults(config, allowed_target_modules))
    faults.extend(_feature_faults(config))
    if base_model is not None and config.get("base_model_name_or_path") != base_model:
        faults.append(("base_model_mismatch", "base_model_name_or_path is "
                       f"{_json(config.get('base_model_name_or_path'))}, but this server serves "
                       f"{_json(base_model)}"))
    return faults, _lora_config(config)


def _rank_pattern_faults(pattern: object, max_lora_rank: int) -> list[Fault]:
    if pattern is None:
        return []
    if not isinstance(pattern, dict):
        return [("invalid_rank_pattern", f"rank_pattern must be an object, got {_json(pattern)}")]
    faults: list[Fault] = [
        ("invalid_rank_pattern",
         f"LoRA rank for `{shown(key)}` in `rank_pattern` must be a positive integer, got "
         f"{_json(value)}.")
        for key, value in pattern.items()
        if not _positive_int(value)
    ]
    too_large = [v for v in pattern.values() if _positive_int(v) and v > max_lora_rank]
    if too_large:
        faults.append(("rank_pattern_too_large", f"LoRA rank {max(too_large)} is greater than "
                       f"max_lora_rank {max_lora_rank}. (from rank_pattern) {_RANK_LIMIT}"))
    return faults


def _ignored_pattern_faults(config: dict[str, Any], max_lora_rank: int) -> list[Fault]:
    """vLLM 0.13 (Triton 26.01) reads neither rank_pattern nor alpha_pattern: it scales every
    module by lora_alpha / r, so a module with a rank or alpha of its own is served wrongly."""
    faults: list[Fault] = []
    rank, alpha = config.get("r"), config.get("lora_alpha")
    pattern = config.get("rank_pattern")
    if isinstance(pattern, dict):
        own = sorted(k for k, v in pattern.items()
                     if _positive_int(v) and v <= max_lora_rank and v != rank)
        if own:
            faults.append(("rank_pattern_not_supported", f"rank_pattern gives "
                           f"{_names(own)} a rank of their own; the served vLLM (0.13) ignores "
                           "rank_pattern and would scale them by lora_alpha/r: merge the "
                           "pattern into the weights or retrain with one rank"))
    pattern = config.get("alpha_pattern")
    if isinstance(pattern, dict):
        own = sorted(k for k, v in pattern.items() if _positive_number(v) and v != alpha)
        if own:
            faults.append(("alpha_pattern_not_supported", f"alpha_pattern gives "
                           f"{_names(own)} an alpha of their own; the served vLLM (0.13) "
                           "ignores alpha_pattern and would scale them by lora_alpha/r: fold "
                           "the scale into lora_B or retrain with one alpha"))
    return faults


def _alpha_faults(config: dict[str, Any]) -> list[Fault]:
    faults: list[Fault] = []
    if "lora_alpha" in config and not _positive_number(config["lora_alpha"]):
        faults.append(("invalid_lora_alpha", "lora_alpha must be a finite number above 0, got "
                       f"{_json(config['lora_alpha'])}"))
    pattern = config.get("alpha_pattern")
    if pattern is not None and not (
        isinstance(pattern, dict) and all(_positive_number(v) for v in pattern.values())
    ):
        faults.append(("invalid_lora_alpha", "alpha_pattern must map module names to finite "
                       "numbers above 0"))
    return faults


def _target_module_faults(config: dict[str, Any], allowed: frozenset[str]) -> list[Fault]:
    if "target_modules" not in config:
        return []
    modules = config.get("target_modules")
    if isinstance(modules, str):
        # A regular expression (PEFT matches it against every module's path); the tensors'
        # modules are checked against the allowed list instead.
        return [] if _regex(modules) is not None else [(
            "invalid_target_modules", "target_modules is a string but not a regular expression "
            f"of at most {_REGEX_MAX_CHARS} characters: {_json(modules)}")]
    if not (isinstance(modules, list) and modules
            and all(isinstance(m, str) and _MODULE_PATH.fullmatch(m) for m in modules)):
        return [("invalid_target_modules", "target_modules must be a regular expression or a "
                 f"non-empty list of module names or dotted paths, got {_json(modules)}")]
    # PEFT writes "all-linear" out as every module's full path: the last name decides.
    unexpected = sorted({m for m in modules if m.rsplit(".", 1)[-1] not in allowed})
    if unexpected:
        return [("module_not_allowed", f"target_modules lists {_names(unexpected)}; this "
                 f"server allows {_names(sorted(allowed))}")]
    return []


def _regex(text: str) -> re.Pattern[str] | None:
    if len(text) > _REGEX_MAX_CHARS:
        return None
    try:
        return re.compile(text)
    except (re.error, RecursionError, OverflowError):
        return None


def _module_spec(value: object) -> ModuleSpec | None:
    if isinstance(value, str):
        pattern = _regex(value)
        return ModuleSpec(regex=pattern) if pattern is not None else None
    if isinstance(value, list) and value and all(
            isinstance(m, str) and _MODULE_PATH.fullmatch(m) for m in value):
        return ModuleSpec(names=tuple(value))
    return None


def _layers(value: object) -> frozenset[int] | None:
    if type(value) is int:
        return frozenset({value})
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return frozenset(value)
    return None


def _feature_faults(config: dict[str, Any]) -> list[Fault]:
    """Features vLLM refuses at load time, or silently serves wrongly (B8-B13, B17)."""
    faults: list[Fault] = []
    if not _absent(config.get("use_dora")):
        faults.append(("dora_not_supported", "vLLM does not yet support DoRA."))
    if config.get("bias") not in (None, "none"):
        faults.append(("bias_not_supported", "Adapter bias is not supported."))
    if not _absent(config.get("lora_bias")):
        faults.append(("bias_not_supported", "vLLM does not support LoRA bias (lora_bias)."))
    if not _absent(config.get("modules_to_save")):
        faults.append(("modules_to_save_not_supported",
                       "vLLM only supports modules_to_save being None."))
    init = config.get("init_lora_weights", True)
    if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() in _SUPPORTED_INITS)):
        faults.append(("init_not_supported", f"vLLM does not support init_lora_weights="
                       f"{_json(init)}. Inits such as PiSSA, OLoRA, CorDA and LoftQ modify "
                       "the base model weights."))
    if not _absent(config.get("layer_replication")):
        faults.append(("layer_replication_not_supported",
                       "vLLM does not support layer_replication."))
    for key, message in _UNSUPPORTED_FEATURES.items():
        if not _absent(config.get(key)):
            faults.append(("unsupported_feature", message))
    if not _absent(config.get("context_length")):
        faults.append(("long_context_not_supported", "context_length is set, but vLLM no "
                       "longer applies long-context LoRA scaling and would silently ignore it"))
    return faults


def _lora_config(config: dict[str, Any]) -> LoraConfig:
    rank = config.get("r")
    pattern = config.get("rank_pattern")
    excluded = config.get("exclude_modules")
    return LoraConfig(
        rank=rank if _positive_int(rank) else None,
        rank_pattern={k: v for k, v in pattern.items() if _positive_int(v)}
        if isinstance(pattern, dict)
        else {},
        targets=_module_spec(config.get("target_modules")),
        excluded=_module_spec(excluded) if excluded not in (None, [], "") else None,
        layers=_layers(config.get("layers_to_transform")),
    )


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _positive_int(value: object) -> TypeGuard[int]:
    return type(value) is int and value > 0


def _positive_number(value: object) -> bool:
    if type(value) is int:
        return value > 0
    return type(value) is float and math.isfinite(value) and value > 0


def _absent(value: object) -> bool:
    """Unset in the ways PEFT writes "off": missing, null, false, empty, zero."""
    return value is None or value is False or value == 0 or value in ([], {}, "")


def _json(value: object) -> str:
    return shown(json.dumps(value), limit=100)


def _names(names: Sequence[str]) -> str:
    return shown(", ".join(names), limit=300)
