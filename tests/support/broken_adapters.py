"""A corpus of broken adapters, one per validation rule, generated on demand (no binaries are
checked in): a valid adapter from sidecar.process.examples, then byte-level surgery on its files.

Each case names the exact set of problem codes validation must report, so a test proves both
that the adapter is refused and that it is refused for the right reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import load_file, save_file

from sidecar.process.examples import tensor_name, write_adapter
from sidecar.validation.shapes import TINY_LLAMA, ModelShapes
from sidecar.validation.validate import Rules

WEIGHTS = "adapter_model.safetensors"
Arrays = dict[str, NDArray[Any]]
CONFIG = "adapter_config.json"
# The base model the cases are written for, and their weights' scale; the engine tier writes
# them for its own model, with weights that change its text.
_base = [TINY_LLAMA]
_scale = [0.02]


@contextlib.contextmanager
def written_for(shapes: ModelShapes, scale: float = 0.02) -> Iterator[None]:
    """Write the cases inside this block for another base model than TINY_LLAMA."""
    _base.append(shapes)
    _scale.append(scale)
    try:
        yield
    finally:
        _base.pop()
        _scale.pop()


def _other_base() -> ModelShapes:
    """A model of the same family whose MLP has another width."""
    return dataclasses.replace(_base[-1], intermediate_size=_base[-1].intermediate_size - 44)


def _deeper_base() -> ModelShapes:
    return dataclasses.replace(_base[-1], num_hidden_layers=_base[-1].num_hidden_layers + 1)


@dataclass(frozen=True)
class BrokenAdapter:
    name: str
    codes: frozenset[str]  # exactly the problem codes validation must report
    write: Callable[[Path], None]
    base_shapes: ModelShapes | None = None  # validate with --base-model-config of these shapes
    base_model: str | None = None  # validate with --base-model
    in_registry: bool = True  # False when an object store cannot hold it (a symlink)

    def rules(self) -> Rules:
        return Rules(base_model=self.base_model, shapes=self.base_shapes)


# ---- surgery helpers --------------------------------------------------------------------------


def write_valid(folder: Path, **options: Any) -> None:
    """The starting point of every case: rank 8, q_proj and v_proj, float16, TINY_LLAMA (or the
    model of the enclosing `written_for`)."""
    options.setdefault("shapes", _base[-1])
    options.setdefault("scale", _scale[-1])
    write_adapter(folder, **options)


def read_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file as (header object, data buffer)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_parts(path: Path, header: dict[str, Any] | str | bytes, data: bytes) -> None:
    """Write a header (an object, or raw text for malformed JSON) and data, padded as writers do."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    encoded = header.encode("utf-8") if isinstance(header, str) else header
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / WEIGHTS
    header, data = read_parts(path)
    edit(header)
    write_parts(path, header, data)


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / CONFIG
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def edit_tensors(folder: Path, edit: Callable[[Arrays], object]) -> None:
    path = folder / WEIGHTS
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def tensors_by_offset(header: dict[str, Any]) -> list[str]:
    names = [name for name in header if name != "__metadata__"]
    return sorted(names, key=lambda name: header[name]["data_offsets"][0])


def _shift_data(folder: Path, index: int, delta: int) -> None:
    """Move the offsets of the tensors from `index` (in file order) on by `delta` bytes, and
    grow or shrink the data buffer to match, so only the layout at `index` is wrong."""
    path = folder / WEIGHTS
    header, data = read_parts(path)
    names = tensors_by_offset(header)
    for name in names[index:]:
        header[name]["data_offsets"] = [o + delta for o in header[name]["data_offsets"]]
    at = header[names[index]]["data_offsets"][0]
    data = data[:at] + bytes(delta) + data[at:] if delta > 0 else data[:delta]
    write_parts(path, header, data)


def _set_length_prefix(folder: Path, length: int) -> None:
    path = folder / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", length) + raw[8:])


def _replace_in_header(folder: Path, old: bytes, new: bytes, count: int = 1) -> None:
    path = folder / WEIGHTS
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length]
    assert old in header, old
    header = header.replace(old, new, count)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length :])


def _random(shape: tuple[int, int]) -> NDArray[np.float16]:
    return (np.random.default_rng(7).standard_normal(shape) * _scale[-1]).astype(np.float16)


# ---- the cases --------------------------------------------------------------------------------


def _truncated(folder: Path) -> None:
    write_valid(folder)
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])


def _header_length_past_end(folder: Path) -> None:
    write_valid(folder)
    _set_length_prefix(folder, (folder / WEIGHTS).stat().st_size)


def _header_claims_200mb(folder: Path) -> None:
    write_valid(folder)
    _set_length_prefix(folder, 200_000_000)


def _header_not_utf8(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b"base_model", b"base\xff\xfeodel")


def _header_not_json(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b'"dtype":', b'"dtype";')


def _header_leading_whitespace(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b"{", b"\n\n{")


def _header_nul_padding(folder: Path) -> None:
    write_valid(folder)
    path = folder / WEIGHTS
    header, data = read_parts(path)
    text = json.dumps(header, separators=(",", ":")).encode()
    write_parts(path, text + b"\0" * (8 - len(text) % 8 or 8), data)


def _unknown_dtype(folder: Path) -> None:
    write_valid(folder)
    edit_header(folder, lambda h: h[tensors_by_offset(h)[0]].update(dtype="F17"))


def _integer_dtype(folder: Path) -> None:
    write_valid(folder)
    edit_header(folder, lambda h: h[tensors_by_offset(h)[0]].update(dtype="I16"))


def _negative_dim(folder: Path) -> None:
    write_valid(folder)
    edit_header(folder, lambda h: h[tensors_by_offset(h)[0]].update(shape=[-8, 64]))


def _offsets_hole(folder: Path) -> None:
    write_valid(folder)
    _shift_data(folder, 3, 2)


def _offsets_overlap(folder: Path) -> None:
    write_valid(folder)
    _shift_data(folder, 3, -24)


def _bytes_not_elements_times_size(folder: Path) -> None:
    write_valid(folder)
    edit_header(folder, lambda h: h[tensors_by_offset(h)[0]].update(shape=[8, 63]))


def _trailing_bytes(folder: Path) -> None:
    write_valid(folder)
    with (folder / WEIGHTS).open("ab") as f:
        f.write(b"#!/bin/sh\necho polyglot\n")


def _duplicate_names(folder: Path) -> None:
    write_valid(folder)
    header, data = read_parts(folder / WEIGHTS)
    first = tensors_by_offset(header)[0]
    text = json.dumps(header, separators=(",", ":"))
    # json.dumps cannot write a key twice; splice the repeated entry in as text.
    extra = json.dumps({first: {**header[first], "dtype": "F16"}}, separators=(",", ":"))
    write_parts(folder / WEIGHTS, text[:-1] + "," + extra[1:], data)


def _unknown_entry_key(folder: Path) -> None:
    write_valid(folder)
    edit_header(folder, lambda h: h[tensors_by_offset(h)[0]].update(quantization="int4"))


def _rank_above_limit(folder: Path) -> None:
    write_valid(folder, rank=32)


def _rank_pattern_above_limit(folder: Path) -> None:
    write_valid(folder, rank=8)
    edit_config(folder, rank_pattern={"model.layers.0.self_attn.q_proj": 32})

    in_features, out_features = _base[-1].module_dims("q_proj") or (0, 0)

    def widen(tensors: Arrays) -> None:
        tensors[tensor_name(0, "q_proj", "A")] = _random((32, in_features))
        tensors[tensor_name(0, "q_proj", "B")] = _random((out_features, 32))

    edit_tensors(folder, widen)


def _dora(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, use_dora=True)


def _bias(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, bias="lora_only")


def _modules_to_save(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, modules_to_save=["lm_head"])


def _pissa_init(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, init_lora_weights="pissa_niter_4")


def _layer_replication(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, layer_replication=[[0, 2], [1, 2]])


def _long_context(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, context_length=32768)


def _not_lora(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, peft_type="PREFIX_TUNING")


def _missing_config_field(folder: Path) -> None:
    write_valid(folder)
    config = json.loads((folder / CONFIG).read_text())
    del config["lora_alpha"]
    (folder / CONFIG).write_text(json.dumps(config))


def _string_rank(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, r="8")


def _config_targets_module_without_tensors(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, target_modules=["q_proj", "k_proj", "v_proj"])


def _tensors_for_module_not_targeted(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, target_modules=["q_proj"])


def _config_rank_differs_from_tensors(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, r=16)


def _rank_pattern_ignored(folder: Path) -> None:
    write_valid(folder, rank=8)
    edit_config(folder, rank_pattern={"q_proj": 4})
    in_features, out_features = _base[-1].module_dims("q_proj") or (0, 0)

    def narrow(tensors: Arrays) -> None:
        for layer in range(_base[-1].num_hidden_layers):
            tensors[tensor_name(layer, "q_proj", "A")] = _random((4, in_features))
            tensors[tensor_name(layer, "q_proj", "B")] = _random((out_features, 4))

    edit_tensors(folder, narrow)


def _alpha_pattern_ignored(folder: Path) -> None:
    write_valid(folder)
    edit_config(folder, alpha_pattern={"v_proj": 64})


def _unknown_module(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b"v_proj.lora_A", b"w_proj.lora_A")
    _replace_in_header(folder, b"v_proj.lora_B", b"w_proj.lora_B")
    edit_config(folder, target_modules=["q_proj", "w_proj"])


def _a_without_b(folder: Path) -> None:
    write_valid(folder)
    edit_tensors(folder, lambda t: t.pop(tensor_name(1, "v_proj", "B")))


def _wrong_ab_shapes(folder: Path) -> None:
    write_valid(folder)

    def narrow(tensors: Arrays) -> None:
        tensors[tensor_name(0, "v_proj", "B")] = _random((32, 4))

    edit_tensors(folder, narrow)


def _peft_adapter_name_kept(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b"q_proj.lora_A.weight", b"q_proj.lora_A.default.weight", 2)
    _replace_in_header(folder, b"q_proj.lora_B.weight", b"q_proj.lora_B.default.weight", 2)


def _base_config_mismatch(folder: Path) -> None:
    write_valid(folder, shapes=_other_base(), target_modules=("q_proj", "down_proj"))


def _layer_out_of_range(folder: Path) -> None:
    write_valid(folder, shapes=_deeper_base())


def _wrong_module_path(folder: Path) -> None:
    write_valid(folder)
    _replace_in_header(folder, b"layers.0.self_attn.q_proj", b"layers.0.mlp.q_proj", 2)


def _no_lora_tensors(folder: Path) -> None:
    write_valid(folder)
    write_parts(folder / WEIGHTS, {"__metadata__": {"format": "pt"}}, b"")


def _pickle_weights_only(folder: Path) -> None:
    write_valid(folder)
    (folder / WEIGHTS).unlink()
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04\x95 not really a pickle")


def _new_embeddings(folder: Path) -> None:
    write_valid(folder)
    (folder / "new_embeddings.safetensors").write_bytes(b"\0" * 16)


def _symlink(folder: Path) -> None:
    write_valid(folder)
    real = folder.parent / f"{folder.name}.config.json"
    (folder / CONFIG).rename(real)
    os.symlink(real, folder / CONFIG)


def _missing_weights(folder: Path) -> None:
    write_valid(folder)
    (folder / WEIGHTS).unlink()


def _checksum_mismatch(folder: Path) -> None:
    write_valid(folder)
    config_digest = hashlib.sha256((folder / CONFIG).read_bytes()).hexdigest()
    (folder / "SHA256SUMS").write_text(f"{config_digest}  {CONFIG}\n{'0' * 64}  {WEIGHTS}\n")


def _config_not_json(folder: Path) -> None:
    write_valid(folder)
    (folder / CONFIG).write_text("{'r': 8, 'lora_alpha': 16,")


def _config_duplicate_key(folder: Path) -> None:
    write_valid(folder)
    text = (folder / CONFIG).read_text()
    (folder / CONFIG).write_text(text.replace('"r": 8,', '"r": 8, "r": 4,', 1))


def _base_model_mismatch(folder: Path) -> None:
    write_valid(folder, base_model="some-other-model")


def _case(name: str, code: str, write: Callable[[Path], None], **options: Any) -> BrokenAdapter:
    return BrokenAdapter(name, frozenset({code}), write, **options)


CORPUS: tuple[BrokenAdapter, ...] = (
    # adapter_model.safetensors, structure (checklist D)
    _case("truncated_file", "safetensors_length_mismatch", _truncated),
    _case("header_length_past_end", "safetensors_header_length_invalid", _header_length_past_end),
    _case("header_claims_200mb", "safetensors_header_too_large", _header_claims_200mb),
    _case("header_not_utf8", "safetensors_header_not_utf8", _header_not_utf8),
    _case("header_not_json", "safetensors_header_invalid_json", _header_not_json),
    _case("header_nul_padding", "safetensors_header_invalid_json", _header_nul_padding),
    _case("header_leading_whitespace", "safetensors_header_leading_whitespace",
          _header_leading_whitespace),
    _case("unknown_dtype", "safetensors_unknown_dtype", _unknown_dtype),
    _case("integer_dtype", "safetensors_dtype_not_allowed", _integer_dtype),
    _case("negative_dim", "safetensors_invalid_shape", _negative_dim),
    _case("offsets_with_hole", "safetensors_invalid_offsets", _offsets_hole),
    _case("overlapping_offsets", "safetensors_invalid_offsets", _offsets_overlap),
    _case("bytes_not_elements_times_size", "safetensors_size_mismatch",
          _bytes_not_elements_times_size),
    _case("trailing_bytes", "safetensors_length_mismatch", _trailing_bytes),
    _case("duplicate_names", "safetensors_duplicate_tensor", _duplicate_names),
    _case("unknown_entry_key", "safetensors_unknown_key", _unknown_entry_key),
    # adapter_config.json (checklist A2, A3, B)
    _case("rank_above_limit", "rank_too_large", _rank_above_limit),
    _case("rank_pattern_above_limit", "rank_pattern_too_large", _rank_pattern_above_limit),
    _case("dora", "dora_not_supported", _dora),
    _case("bias", "bias_not_supported", _bias),
    _case("modules_to_save", "modules_to_save_not_supported", _modules_to_save),
    _case("pissa_init", "init_not_supported", _pissa_init),
    _case("layer_replication", "layer_replication_not_supported", _layer_replication),
    _case("long_context", "long_context_not_supported", _long_context),
    _case("not_lora", "not_lora", _not_lora),
    _case("missing_config_field", "missing_config_field", _missing_config_field),
    _case("string_rank", "invalid_rank", _string_rank),
    _case("config_not_json", "config_invalid_json", _config_not_json),
    _case("config_duplicate_key", "config_invalid_json", _config_duplicate_key),
    _case("base_model_mismatch", "base_model_mismatch", _base_model_mismatch,
          base_model="tiny-llama"),
    # tensors (checklist C)
    _case("unknown_module", "module_not_allowed", _unknown_module),
    _case("a_without_b", "missing_lora_pair", _a_without_b),
    _case("wrong_ab_shapes", "lora_shape_mismatch", _wrong_ab_shapes),
    _case("peft_adapter_name_kept", "unsupported_tensor_name", _peft_adapter_name_kept),
    _case("shapes_not_matching_base_config", "base_shape_mismatch", _base_config_mismatch,
          base_shapes=TINY_LLAMA),
    _case("layer_out_of_range", "layer_out_of_range", _layer_out_of_range,
          base_shapes=TINY_LLAMA),
    _case("wrong_module_path", "module_path_mismatch", _wrong_module_path,
          base_shapes=TINY_LLAMA),
    _case("no_lora_tensors", "no_lora_tensors", _no_lora_tensors),
    _case("config_targets_module_without_tensors", "targeted_module_without_tensors",
          _config_targets_module_without_tensors),
    _case("tensors_for_module_not_targeted", "tensor_module_not_targeted",
          _tensors_for_module_not_targeted),
    _case("config_rank_differs_from_tensors", "lora_shape_mismatch",
          _config_rank_differs_from_tensors),
    _case("rank_pattern_ignored", "rank_pattern_not_supported", _rank_pattern_ignored),
    _case("alpha_pattern_ignored", "alpha_pattern_not_supported", _alpha_pattern_ignored),
    # files (checklist A)
    _case("pickle_weights_only", "forbidden_file", _pickle_weights_only),
    _case("new_embeddings", "forbidden_file", _new_embeddings),
    _case("symlink", "symlink", _symlink, in_registry=False),
    _case("missing_weights", "missing_file", _missing_weights),
    # checksums
    _case("checksum_mismatch", "checksum_mismatch", _checksum_mismatch),
)
