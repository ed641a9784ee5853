"""Sizes for people: bytes read from and written in binary units (KiB, MiB, GiB, TiB), in every
option, log line, listing and error: a budget given as 20GiB reads back as 20 GiB, never as
"21.5 GB". Decimal spellings are refused, not reinterpreted.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
               "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
_DECIMAL_UNITS = {"k": "KiB", "kb": "KiB", "m": "MiB", "mb": "MiB", "g": "GiB", "gb": "GiB",
                  "t": "TiB", "tb": "TiB"}
_SHOWN_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_size(text: str) -> int:
    """`"20GiB"`, `"512MiB"`, `"1048576"` -> bytes. Units are binary (KiB, MiB, GiB, TiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use bytes or a binary unit: 512MiB, 20GiB)")
    unit = match.group(2).lower()
    if unit in _DECIMAL_UNITS:
        raise ValueError(f"sizes use binary units (KiB, MiB, GiB, TiB), as the sidecar prints "
                         f"them: write {match.group(1)}{_DECIMAL_UNITS[unit]} or a number of "
                         "bytes")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a binary unit: 512MiB, 20GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(size_bytes: int) -> str:
    """Bytes for people, in the units `parse_size` reads: `8.3 KiB`, `20 GiB`, `512 B`."""
    value = float(size_bytes)
    for unit in _SHOWN_UNITS:
        if round(abs(value), 1) < 1024 or unit == _SHOWN_UNITS[-1]:
            if unit == "B":
                return f"{size_bytes} B"
            shown = f"{value:.1f}".removesuffix(".0")
            return f"{shown} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
