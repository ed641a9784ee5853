"""units.py: sizes read and written in binary units, decimal spellings refused."""

from __future__ import annotations

import pytest

from sidecar.core.units import format_size, parse_size


@pytest.mark.parametrize(("text", "size_bytes"), [
    ("1048576", 1 << 20), ("512MiB", 512 << 20), ("20GiB", 20 << 30), (" 1.5 KiB ", 1536),
    ("2Ti", 2 << 40), ("7b", 7),
])
def test_sizes_are_read_in_binary_units(text: str, size_bytes: int) -> None:
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize(("text", "why"), [
    ("20GB", "write 20GiB"), ("5m", "write 5MiB"), ("lots", "not a size"), ("3 PiB", "not a size"),
    ("-1", "not a size"),
])
def test_a_size_not_in_binary_units_is_refused_with_what_to_write(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_size(text)


@pytest.mark.parametrize(("size_bytes", "shown"), [
    (512, "512 B"), (8500, "8.3 KiB"), (20 << 30, "20 GiB"), (1023 * 1024 + 1000, "1 MiB"),
    (3 << 50, "3072 TiB"),
])
def test_sizes_are_written_so_that_they_read_back(size_bytes: int, shown: str) -> None:
    assert format_size(size_bytes) == shown
    assert abs(parse_size(shown.replace(" ", "")) - size_bytes) <= 0.05 * size_bytes
