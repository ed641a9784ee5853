"""The value scan: NaN and infinity found in a safetensors file fed as a download feeds it, in
parts that land in any order, in chunks that cut elements in two, before or after the header,
against an independent reference (numpy's isfinite on the decoded tensors)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import TensorSpec, serialize_file

from sidecar.validation import values
from sidecar.validation.values import ValueScan, scan_file

DTYPES = {"F16": ("float16", np.float16), "BF16": ("bfloat16", np.uint16),
          "F32": ("float32", np.float32)}
SPECIALS = (np.nan, np.inf, -np.inf)


def _bf16(values_f32: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return (values_f32.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_file(path: Path, tensors: list[tuple[str, str, int, list[tuple[int, float]]]]) -> None:
    """Tensors (name, dtype, element count, [(index, special value)]) as a safetensors file."""
    arrays = {}
    for name, dtype, count, specials in tensors:
        data = np.linspace(-2, 2, count, dtype=np.float32)
        for index, value in specials:
            data[index] = value
        arrays[name] = (dtype, _bf16(data) if dtype == "BF16" else data.astype(DTYPES[dtype][1]))
    specs = {name: TensorSpec(dtype=DTYPES[dtype][0], shape=[a.size], data_ptr=a.ctypes.data,
                              data_len=a.nbytes) for name, (dtype, a) in arrays.items()}
    serialize_file(specs, str(path), metadata=None)


def reference(path: Path) -> dict[str, tuple[int, int]]:
    """(count, first index) of the non-finite values of each tensor, decoded as floats."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[8 + length + begin: 8 + length + end]
        if entry["dtype"] == "BF16":  # the top half of a float32
            array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, "<f2" if entry["dtype"] == "F16" else "<f4")
        bad = np.flatnonzero(~np.isfinite(array))
        if len(bad):
            found[name] = (len(bad), int(bad[0]))
    return found


def feed_in_parts(path: Path, cuts: list[int], chunk_sizes: list[int], order: list[int],
                  ) -> values.ValueReport:
    """Feed the file as a download does: parts [cuts[i], cuts[i+1]) in `order`, each in chunks
    of the given sizes (cycled), into a reused buffer; then finish from the file."""
    data = path.read_bytes()
    scan = ValueScan(len(data))
    bounds = [0, *cuts, len(data)]
    for part in order:
        start, end = bounds[part], bounds[part + 1]
        feed = scan.stream(start)
        offset, turn = start, 0
        buffer = bytearray(max(chunk_sizes))
        while offset < end:
            length = min(chunk_sizes[turn % len(chunk_sizes)], end - offset)
            buffer[:length] = data[offset:offset + length]
            feed(offset, memoryview(buffer)[:length])
            offset += length
            turn += 1
    fd = os.open(path, os.O_RDONLY)
    try:
        return scan.finish(fd)
    finally:
        os.close(fd)


def found(report: values.ValueReport) -> dict[str, tuple[int, int]]:
    assert report.complete
    return {n.tensor: (n.count, n.first_index) for n in report.nonfinite}


tensor_strategy = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPES)), st.integers(1, 300),
              st.lists(st.tuples(st.integers(0, 299), st.sampled_from(SPECIALS)), max_size=4)),
    min_size=1, max_size=6,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=tensor_strategy, seed=st.integers(0, 2**32 - 1), wait=st.booleans())
def test_parts_in_any_order_and_chunks_cutting_elements_find_what_numpy_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    tensors: list[tuple[str, int, list[tuple[int, float]]]], seed: int, wait: bool,
) -> None:
    # No wait: parts that arrive before the header are left for the end (read back).
    monkeypatch.setattr(values, "HEADER_WAIT_S", 0.0 if not wait else 0.001)
    path = tmp_path / f"w{seed}.safetensors"
    write_file(path, [(f"t{i}", dtype, count, [(j % count, v) for j, v in specials])
                      for i, (dtype, count, specials) in enumerate(tensors)])
    size = path.stat().st_size
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, size), min(rng.randint(0, 6), size - 1)))
    order = list(range(len(cuts) + 1))
    rng.shuffle(order)
    chunk_sizes = [rng.randint(1, 64) for _ in range(rng.randint(1, 4))]

    assert found(feed_in_parts(path, cuts, chunk_sizes, order)) == reference(path)


def test_a_whole_file_on_disk_is_scanned_in_one_pass_with_its_hash(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "w.safetensors"
    write_file(path, [("a", "BF16", 5000, [(4321, np.inf)]), ("b", "F32", 70, []),
                      ("c", "F16", 3, [(0, np.nan), (2, -np.inf)])])
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        report = scan_file(fd, path.stat().st_size, digest=digest)
    finally:
        os.close(fd)
    assert found(report) == {"a": (1, 4321), "c": (2, 0)} == reference(path)
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [n.first_is_nan for n in report.nonfinite] == [False, True]
    assert "index [0] of shape [3]" in report.nonfinite[1].describe()


def test_an_unreadable_header_leaves_the_scan_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    report = feed_in_parts(path, [], [3], [0])
    assert not report.complete and report.nonfinite == ()
