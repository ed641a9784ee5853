"""The request counts: exact for few ids, halved as they age, bounded, saved whole."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sidecar.cache.frequency import (
    FREQUENCY_FILE_NAME,
    FrequencySketch,
    load_sketch,
    save_sketch,
)


def test_counts_are_exact_for_a_few_ids() -> None:
    sketch = FrequencySketch()
    for adapter_id, uses in (("a", 7), ("b", 3), ("c", 1)):
        for _ in range(uses):
            sketch.add(adapter_id)
    assert [sketch.estimate(i) for i in ("a", "b", "c", "never")] == [7, 3, 1, 0]


def test_every_count_is_halved_once_a_period_of_requests_has_passed() -> None:
    sketch = FrequencySketch(period=10)
    for _ in range(8):
        sketch.add("a")
    sketch.add("b")
    sketch.add("b")
    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.halvings) == (8, 2, 0)

    sketch.add("c")  # the eleventh request halves first, then counts itself

    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.estimate("c")) == (4, 1, 1)
    assert sketch.halvings == 1


def test_memory_stays_the_same_for_100000_ids() -> None:
    sketch = FrequencySketch()
    before = sketch.size_bytes
    for n in range(100_000):
        sketch.add(f"adapter-{n}")
    assert sketch.size_bytes == before == 512 * 1024
    assert len(sketch.to_bytes()) < before + 64
    # Over-estimates stay rare: most ids seen once read 1.
    ones = sum(sketch.estimate(f"adapter-{n}") == 1 for n in range(0, 100_000, 100))
    assert ones >= 900, ones


def test_saved_counts_read_back_the_same(tmp_path: Path) -> None:
    sketch = FrequencySketch(period=50)
    for n in range(30):
        sketch.add(f"a{n % 4}")
    save_sketch(tmp_path, sketch.to_bytes())

    loaded = load_sketch(tmp_path)

    assert loaded is not None
    assert [loaded.estimate(f"a{n}") for n in range(4)] == [8, 8, 7, 7]
    assert (loaded.period, loaded.since_halving) == (50, 30)
    assert not (tmp_path / f"{FREQUENCY_FILE_NAME}.new").exists()


def test_counts_read_back_are_halved_like_the_others(tmp_path: Path) -> None:
    sketch = FrequencySketch()
    ids = [f"adapter-{n}" for n in range(0, 100_000, 997)]  # counters all over the sketch
    for adapter_id in ids:
        for _ in range(12):
            sketch.add(adapter_id)
    save_sketch(tmp_path, sketch.to_bytes())
    loaded = load_sketch(tmp_path)
    assert loaded is not None

    loaded.halve()
    halved_once = [loaded.estimate(i) for i in ids]
    for _ in range(3):
        loaded.halve()

    assert set(halved_once) == {6}
    assert [loaded.estimate(i) for i in ids] == [0] * len(ids)
    counters = loaded.to_bytes()[-4 - loaded.size_bytes:-4]
    assert counters == bytes(loaded.size_bytes)  # no counter anywhere left over


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign"])
def test_a_damaged_file_is_refused_and_the_counts_start_from_zero(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    sketch = FrequencySketch()
    sketch.add("a")
    data = bytearray(sketch.to_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "flipped":
        data[100] ^= 0xFF
    else:
        data = bytearray(b"{}" * (len(data) // 2))
    (tmp_path / FREQUENCY_FILE_NAME).write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING):
        assert load_sketch(tmp_path) is None
    assert "cannot read the request counts" in caplog.text


def test_a_save_cut_short_leaves_the_previous_counts(tmp_path: Path) -> None:
    sketch = FrequencySketch()
    sketch.add("a")
    save_sketch(tmp_path, sketch.to_bytes())
    # A process killed while writing leaves only the temporary file, never a half file.
    (tmp_path / f"{FREQUENCY_FILE_NAME}.new").write_bytes(b"half")

    loaded = load_sketch(tmp_path)

    assert loaded is not None and loaded.estimate("a") == 1
    assert not (tmp_path / f"{FREQUENCY_FILE_NAME}.new").exists()


def test_no_file_means_no_counts(tmp_path: Path) -> None:
    assert load_sketch(tmp_path) is None
