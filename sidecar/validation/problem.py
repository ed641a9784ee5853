"""`Problem`: one reason an adapter is refused, as every check reports it, and `ProblemCode`:
every code a check can give, declared once here (mypy holds each check to this list, and the
metrics count each from the first scrape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ProblemCode = Literal[
    # the folder and its files
    "not_a_folder", "symlink", "hard_link", "not_regular_file", "unsafe_path", "forbidden_file",
    "missing_file", "read_error",
    # adapter_config.json
    "config_too_large", "config_invalid_json", "not_lora", "missing_config_field",
    "invalid_rank", "rank_too_large", "invalid_rank_pattern", "rank_pattern_too_large",
    "rank_pattern_not_supported", "alpha_pattern_not_supported", "invalid_lora_alpha",
    "invalid_target_modules", "module_not_allowed", "base_model_mismatch",
    "dora_not_supported", "bias_not_supported", "modules_to_save_not_supported",
    "init_not_supported", "layer_replication_not_supported", "long_context_not_supported",
    "unsupported_feature",
    # adapter_model.safetensors: its structure
    "safetensors_too_small", "safetensors_header_too_large", "safetensors_header_length_invalid",
    "safetensors_header_not_utf8", "safetensors_header_leading_whitespace",
    "safetensors_header_invalid_json", "safetensors_header_invalid", "safetensors_unknown_key",
    "safetensors_unknown_dtype", "safetensors_dtype_not_allowed", "safetensors_invalid_shape",
    "safetensors_invalid_offsets", "safetensors_size_mismatch", "safetensors_length_mismatch",
    "safetensors_duplicate_tensor", "safetensors_rejected",
    # its tensors, against the config and the base model
    "unsupported_tensor_name", "duplicate_lora_tensor", "no_lora_tensors", "missing_lora_pair",
    "lora_shape_mismatch", "tensor_module_not_targeted", "targeted_module_without_tensors",
    "module_path_mismatch", "layer_out_of_range", "base_shape_mismatch", "non_finite_weights",
    # checksums
    "invalid_checksum_file", "checksum_mismatch",
    # signatures (--signing-policy)
    "signature_missing", "signature_malformed", "signature_unsupported", "signature_invalid",
    "signature_for_other_adapter", "signer_not_allowed", "certificate_untrusted",
    "certificate_expired", "unsigned_file", "signed_file_missing", "signed_digest_mismatch",
]
PROBLEM_CODES: tuple[ProblemCode, ...] = get_args(ProblemCode)


@dataclass(frozen=True, slots=True)
class Problem:
    code: ProblemCode  # stable snake_case code, e.g. "rank_too_large"
    file: str  # file name inside the adapter folder, "" for the folder itself
    message: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "file": self.file, "message": self.message}
