"""Structural checks of a safetensors file: a bounded header reader stricter than the reference
one (rules D1-D14 of the vLLM adapter checklist) and a cross-check with the `safetensors`
library. Tensor values (NaN, infinity) are checked in `values.py`.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from safetensors import safe_open

from .problem import ProblemCode

# A fault is (stable code, human message); validate.py adds the file name.
Fault = tuple[ProblemCode, str]

HEADER_MAX_BYTES = 16 * 1024**2  # policy D14; the reference reader allows 100 MB
_MAX_U64 = 2**64 - 1
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_METADATA_KEY = "__metadata__"

# Every dtype name the reference reader knows, with its size in bits (checklist D6).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}  # fmt: skip
# vLLM casts whatever it finds to the LoRA dtype; integers or bools would be cast silently (B18).
ALLOWED_DTYPES = frozenset({"F16", "BF16", "F32"})


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets into the data buffer, which starts right after the header
    end: int


@dataclass(frozen=True, slots=True)
class SafetensorsCheck:
    # Every entry (known dtype, valid shape and offsets); None when the header could not be
    # read or an entry is unusable: pairing tensors with one missing would only mislead.
    tensors: tuple[TensorInfo, ...] | None
    faults: tuple[Fault, ...]
    data_start: int  # 8 + header length


def shown(text: str, limit: int = 200) -> str:
    """`text` made safe for a one-line log or a JSON answer: escaped if odd, and bounded."""
    try:
        text.encode("utf-8")
        safe = text if text.isprintable() else ascii(text)[1:-1]
    except UnicodeEncodeError:
        safe = ascii(text)[1:-1]
    return safe if len(safe) <= limit else safe[: limit - 1] + "…"


def check_safetensors(file: BinaryIO, size_bytes: int, path: Path) -> SafetensorsCheck:
    """Check the open `file` (of `size_bytes`); reads at most 8 + HEADER_MAX_BYTES bytes."""
    if size_bytes < 8:
        return _failed(("safetensors_too_small", f"header too small: the file has {size_bytes} "
                        "bytes, fewer than the 8 of the header length"))
    (header_bytes,) = struct.unpack("<Q", _read_exactly(file, 8))
    # Checked before reading anything more, so a huge claim costs nothing (D2, D14).
    if header_bytes > HEADER_MAX_BYTES:
        return _failed(("safetensors_header_too_large", f"header too large: it claims "
                        f"{header_bytes} bytes, the limit is {HEADER_MAX_BYTES}"))
    if 8 + header_bytes > size_bytes:
        return _failed(("safetensors_header_length_invalid", f"invalid header length: "
                        f"{header_bytes} bytes claimed, but the file has {size_bytes}"))
    raw = _read_exactly(file, header_bytes)
    tensors, faults = parse_header(raw, size_bytes)
    data_start = 8 + header_bytes
    if not faults and tensors is not None:
        faults.extend(_cross_check(path, tensors))
    return SafetensorsCheck(tensors, tuple(faults), data_start)


def parse_header(raw: bytes, size_bytes: int) -> tuple[tuple[TensorInfo, ...] | None, list[Fault]]:
    """The tensors of the header `raw` (the bytes after the 8-byte length) of a file of
    `size_bytes`, and its faults; the value scan reads the same layout from bytes in flight.

    A stage parses its weights' header twice, the value scan in flight and then the validation
    from disk: the same bytes find the first parse's result (a header up to
    PARSED_KEY_MAX_BYTES, among the last PARSED_MAX)."""
    if len(raw) > PARSED_KEY_MAX_BYTES:
        return _parse(raw, size_bytes)
    tensors, faults = _parse_remembered(raw, size_bytes)
    return tensors, list(faults)


PARSED_MAX = 8
PARSED_KEY_MAX_BYTES = 64 * 1024  # a few hundred tensors; the memo holds at most 512 KiB of keys


@functools.lru_cache(maxsize=PARSED_MAX)
def _parse_remembered(raw: bytes,
                      size_bytes: int) -> tuple[tuple[TensorInfo, ...] | None, tuple[Fault, ...]]:
    tensors, faults = _parse(raw, size_bytes)
    return tensors, tuple(faults)


def _parse(raw: bytes, size_bytes: int) -> tuple[tuple[TensorInfo, ...] | None, list[Fault]]:
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, [("safetensors_header_not_utf8", f"invalid UTF-8 in header: {exc}")]
    header, faults = _parse_header(text)
    if header is None:
        return None, faults
    tensors, entry_faults = _check_entries(header, data_start, size_bytes)
    faults.extend(entry_faults)
    return tensors, faults


def _failed(fault: Fault) -> SafetensorsCheck:
    return SafetensorsCheck(None, (fault,), 0)


def _read_exactly(file: BinaryIO, count: int) -> bytes:
    chunks: list[bytes] = []
    remaining = count
    while remaining > 0:
        chunk = file.read(remaining)
        if not chunk:
            raise OSError(f"the file ended {remaining} bytes early (changed while read?)")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class _JsonObject(dict[str, Any]):
    """A JSON object that remembers the keys it saw twice (json keeps the last silently)."""

    duplicates: list[str]


def _object_with_duplicates(pairs: list[tuple[str, Any]]) -> _JsonObject:
    obj = _JsonObject()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_object_with_duplicates, parse_constant=_refuse_constant
)


def _parse_header(text: str) -> tuple[_JsonObject | None, list[Fault]]:
    faults: list[Fault] = []
    start = len(text) - len(text.lstrip(" \t\r\n"))
    if start and text[start:].startswith("{"):
        # The reference reader skips it, but the format says the header MUST begin with '{' (D13b).
        faults.append(("safetensors_header_leading_whitespace",
                       f"the header begins with {start} whitespace bytes instead of '{{'"))
    elif not text.startswith("{"):
        return None, [("safetensors_header_invalid_json",
                       "invalid JSON in header: it does not begin with '{'")]
    try:
        header, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError) as exc:
        return None, [*faults, ("safetensors_header_invalid_json",
                                f"invalid JSON in header: {shown(str(exc))}")]
    if text[end:].strip(" "):
        # Writers pad the header with spaces only; NUL or other bytes are refused (D5).
        return None, [*faults, ("safetensors_header_invalid_json", "invalid JSON in header: "
                                "trailing characters after the object (only spaces may pad it)")]
    if not isinstance(header, _JsonObject):
        return None, [*faults, ("safetensors_header_invalid",
                                "invalid JSON in header: the top level is not an object")]
    return header, faults


def _check_entries(
    header: _JsonObject, data_start: int, size_bytes: int
) -> tuple[tuple[TensorInfo, ...] | None, list[Fault]]:
    faults: list[Fault] = []
    for name in dict.fromkeys(header.duplicates):
        if name == _METADATA_KEY:
            faults.append(("safetensors_header_invalid", "duplicate field `__metadata__`"))
        else:
            faults.append(("safetensors_duplicate_tensor",
                           f"tensor `{shown(name)}` is listed more than once"))
    tensors: list[TensorInfo] = []
    offsets: list[tuple[int, int, str]] = []
    all_offsets_valid = all_usable = True
    for name, entry in header.items():
        if name == _METADATA_KEY:
            faults.extend(_check_metadata(entry))
            continue
        info, entry_offsets, entry_faults = _check_entry(name, entry)
        faults.extend(entry_faults)
        if entry_offsets is None:
            all_offsets_valid = False
        else:
            offsets.append((*entry_offsets, name))
        if info is None:
            all_usable = False
        else:
            tensors.append(info)
    # Holes, overlaps and the file length only make sense when every entry has its offsets.
    if all_offsets_valid:
        faults.extend(_check_layout(offsets, size_bytes - data_start))
    return (tuple(tensors) if all_usable else None), faults


def _check_metadata(entry: object) -> list[Fault]:
    if isinstance(entry, _JsonObject) and not entry.duplicates and all(
        isinstance(v, str) and _encodable(k) and _encodable(v) for k, v in entry.items()
    ):
        return []
    return [("safetensors_header_invalid", "`__metadata__` must map strings to strings")]


def _check_entry(
    name: str, entry: object
) -> tuple[TensorInfo | None, tuple[int, int] | None, list[Fault]]:
    if not (name.isascii() or _encodable(name)):
        return None, None, [("safetensors_header_invalid",
                             f"{_label(name)}: the name is not valid Unicode")]
    if not isinstance(entry, _JsonObject):
        return None, None, [("safetensors_header_invalid",
                             f"{_label(name)}: the entry is not an object")]
    faults: list[Fault] = []
    if entry.duplicates:
        faults.append(("safetensors_header_invalid", f"{_label(name)}: duplicate field "
                       f"`{shown(entry.duplicates[0])}`"))
    if entry.keys() != _ENTRY_KEYS:  # the usual entry has exactly these: no sets to sort
        unknown = sorted(entry.keys() - _ENTRY_KEYS)
        if unknown:
            # The reference reader ignores extra keys (D13c); another parser might not.
            faults.append(("safetensors_unknown_key", f"{_label(name)}: unknown key "
                           f"`{shown(unknown[0])}` (only dtype, shape and data_offsets are "
                           "allowed)"))
        missing = sorted(_ENTRY_KEYS - entry.keys())
        if missing:
            faults.append(("safetensors_header_invalid",
                           f"{_label(name)}: missing field `{missing[0]}`"))

    dtype = entry.get("dtype")
    dtype_ok = isinstance(dtype, str) and dtype in DTYPE_BITS
    if "dtype" in entry and not dtype_ok:
        faults.append(("safetensors_unknown_dtype", f"{_label(name)}: unknown dtype "
                       f"{shown(json.dumps(dtype))}, expected one of {', '.join(DTYPE_BITS)}"))
    elif dtype_ok and dtype not in ALLOWED_DTYPES:
        faults.append(("safetensors_dtype_not_allowed", f"{_label(name)}: dtype {dtype} is not "
                       f"allowed in an adapter (only {', '.join(sorted(ALLOWED_DTYPES))})"))

    shape = _u64_list(entry.get("shape"))
    if "shape" in entry and shape is None:
        faults.append(("safetensors_invalid_shape", f"{_label(name)}: the shape must be a list of "
                       f"integers from 0 to 2**64-1, got {shown(json.dumps(entry['shape']))}"))
    offsets = _u64_list(entry.get("data_offsets"))
    if offsets is None or len(offsets) != 2:
        if "data_offsets" in entry:
            faults.append(("safetensors_invalid_offsets", f"{_label(name)}: data_offsets must "
                           "be two integers from 0 to 2**64-1, got "
                           f"{shown(json.dumps(entry['data_offsets']))}"))
        return None, None, faults
    begin, end = offsets
    if not dtype_ok or shape is None:
        return None, (begin, end), faults
    assert isinstance(dtype, str)
    bits = DTYPE_BITS[dtype] * _product(shape)
    if bits > _MAX_U64 or bits % 8:
        faults.append(("safetensors_size_mismatch", f"{_label(name)}: invalid shape, data type, or "
                       f"offset: {shape} of {dtype} is not a whole number of bytes in range"))
    elif end >= begin and end - begin != bits // 8:
        faults.append(("safetensors_size_mismatch", f"{_label(name)}: invalid shape, data type, or "
                       f"offset: {shape} of {dtype} needs {bits // 8} bytes, the offsets give "
                       f"{end - begin}"))
    return TensorInfo(name, dtype, tuple(shape), begin, end), (begin, end), faults


def _label(name: str) -> str:
    """How a fault names a tensor (built only when there is a fault)."""
    return f"tensor `{shown(name)}`"


def _check_layout(offsets: list[tuple[int, int, str]], data_bytes: int) -> list[Fault]:
    faults: list[Fault] = []
    previous_end = 0
    for begin, end, name in sorted(offsets):
        if end < begin or begin != previous_end:
            what = "ends before it begins" if end < begin else (
                "leaves a hole before it" if begin > previous_end else "overlaps the one before"
            )
            faults.append(("safetensors_invalid_offsets", f"invalid offset for tensor "
                           f"`{shown(name)}`: [{begin}, {end}] {what}"))
        previous_end = max(previous_end, end)
    if not faults and previous_end != data_bytes:
        # The data buffer must be covered exactly: no truncation, no trailing bytes (D11).
        faults.append(("safetensors_length_mismatch", "incomplete metadata, file not fully "
                       f"covered: the header describes {previous_end} data bytes, the file "
                       f"holds {data_bytes}"))
    return faults


def _cross_check(path: Path, tensors: Sequence[TensorInfo]) -> list[Fault]:
    """What vLLM will run: the library's own reader must agree with ours."""
    ours = {t.name: (t.dtype, list(t.shape)) for t in tensors}
    try:
        with safe_open(str(path), framework="numpy") as f:
            theirs = {}
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                theirs[name] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
    except Exception as exc:  # SafetensorError, OSError, or anything the binding raises
        return [("safetensors_rejected", f"the safetensors library refused the file: "
                 f"{shown(str(exc))}")]
    if theirs != ours:
        return [("safetensors_rejected",
                 "the safetensors library reads the header differently from this check")]
    return []


def _u64_list(value: object) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if all(type(v) is int and 0 <= v <= _MAX_U64 for v in value):
        return value
    return None


def _product(values: Iterable[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
