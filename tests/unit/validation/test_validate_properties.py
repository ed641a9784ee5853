"""Property tests: random bytes and random mutations of a valid adapter get a verdict (a list of
problems), never an exception, and the validator reads no more than the header and the config
(and the data once more when it checks the tensor values)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.process.examples import write_adapter
from sidecar.validation.safetensors_check import HEADER_MAX_BYTES
from sidecar.validation.shapes import ATTENTION_MODULES, MLP_MODULES
from sidecar.validation.validate import Problem, Rules, validate_adapter
from tests.support.broken_adapters import CONFIG, WEIGHTS
from tests.support.observing import bytes_read_by_process

# Reads besides the header and the config: /proc/self/io itself and small directory reads.
SLACK_BYTES = 16 * 1024
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One valid adapter whose data (about 150 KB of float32) dwarfs its header, so reading
    the data by mistake would show; each example overwrites its weights."""
    folder = tmp_path_factory.mktemp("property") / "adapter"
    write_adapter(folder, rank=16, target_modules=ATTENTION_MODULES + MLP_MODULES, dtype="float32")
    yield folder
    shutil.rmtree(folder.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def valid_weights(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The pristine weights of `adapter` (written alike: the generator is deterministic)."""
    folder = tmp_path_factory.mktemp("pristine")
    write_adapter(folder, rank=16, target_modules=ATTENTION_MODULES + MLP_MODULES, dtype="float32")
    weights = (folder / WEIGHTS).read_bytes()
    shutil.rmtree(folder, ignore_errors=True)
    return weights


def verdict(folder: Path, weights: bytes) -> list[Problem]:
    """Validate `folder` with `weights` as its safetensors file; check the read bound."""
    (folder / WEIGHTS).write_bytes(weights)
    claimed = struct.unpack("<Q", weights[:8])[0] if len(weights) >= 8 else 0
    bound = 8 + min(claimed, HEADER_MAX_BYTES) + (folder / CONFIG).stat().st_size + SLACK_BYTES

    before = bytes_read_by_process()
    problems = validate_adapter(folder, Rules(), scan_values=False)
    read = bytes_read_by_process() - before
    # With the values checked (the default): the same verdict plus NaN or infinity, the data
    # read once more at most.
    before = bytes_read_by_process()
    scanned = validate_adapter(folder, Rules())
    read_scanned = bytes_read_by_process() - before

    assert isinstance(problems, list)
    assert all(isinstance(p, Problem) and p.code and p.message for p in problems)
    assert read <= bound, f"read {read} bytes, more than {bound}"
    assert [p for p in scanned if p.code != "non_finite_weights"] == problems
    assert read_scanned <= bound + len(weights), f"read {read_scanned} bytes with the values"
    return problems


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=10,
)


@PROPERTY_SETTINGS
@given(data=st.binary(max_size=4096))
def test_random_bytes_get_a_verdict(adapter: Path, data: bytes) -> None:
    assert verdict(adapter, data) != []


@PROPERTY_SETTINGS
@given(body=st.binary(max_size=2048), slack=st.integers(-16, 16))
def test_random_header_after_a_plausible_length_gets_a_verdict(
    adapter: Path, body: bytes, slack: int
) -> None:
    length = max(0, len(body) + slack)
    assert verdict(adapter, struct.pack("<Q", length) + body) != []


@PROPERTY_SETTINGS
@given(data=st.data())
def test_a_mutated_valid_file_is_judged_without_an_error_reading_no_more_than_its_header(
    adapter: Path, valid_weights: bytes, data: st.DataObject
) -> None:
    """A mutation may leave the file valid (a flipped bit in the data), so the property is the
    one `verdict` asserts: a list of well-formed problems, never an exception, the read bound
    kept, and the value scan adding only non_finite_weights."""
    header_end = 8 + struct.unpack("<Q", valid_weights[:8])[0]
    mutated = bytearray(valid_weights)
    mutation = data.draw(st.sampled_from(["flip", "truncate", "splice", "length"]))
    if mutation == "flip":
        # Mostly in the header, where a flip changes structure; data flips are valid files.
        for _ in range(data.draw(st.integers(1, 8))):
            end = data.draw(st.sampled_from([header_end, len(mutated)]))
            position = data.draw(st.integers(0, end - 1))
            mutated[position] ^= 1 << data.draw(st.integers(0, 7))
    elif mutation == "truncate":
        del mutated[data.draw(st.integers(0, len(mutated) - 1)) :]
    elif mutation == "splice":
        start = data.draw(st.integers(8, header_end))
        stop = data.draw(st.integers(start, min(header_end, start + 64)))
        mutated[start:stop] = data.draw(st.binary(max_size=64))
    else:
        claim = data.draw(st.integers(0, 2**64 - 1) | st.integers(0, header_end + 64))
        mutated[:8] = struct.pack("<Q", claim)
    verdict(adapter, bytes(mutated))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_header_edits_get_a_verdict(
    adapter: Path, valid_weights: bytes, data: st.DataObject
) -> None:
    header, body = read_parts_from(valid_weights)
    names = sorted(n for n in header if n != "__metadata__")
    name = data.draw(st.sampled_from(names))
    edit = data.draw(st.sampled_from(["field", "extra_key", "rename", "metadata", "drop"]))
    if edit == "field":
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][field] = data.draw(json_values)
    elif edit == "extra_key":
        key = data.draw(st.text(max_size=10).filter(lambda k: k not in header[name]))
        header[name][key] = data.draw(json_values)
    elif edit == "rename":
        header[data.draw(st.text(max_size=80))] = header.pop(name)
    elif edit == "metadata":
        header["__metadata__"] = data.draw(json_values)
    else:
        del header[name]
    text = json.dumps(header)  # may write NaN or Infinity, which are not JSON
    problems = verdict(adapter, pack(text.encode(), body))
    if edit in ("extra_key", "drop"):
        assert problems != []


@PROPERTY_SETTINGS
@given(config=st.dictionaries(
    st.sampled_from(["peft_type", "r", "lora_alpha", "target_modules", "rank_pattern",
                     "alpha_pattern", "use_dora", "bias", "modules_to_save",
                     "init_lora_weights", "layer_replication", "context_length",
                     "base_model_name_or_path"]),
    json_values,
))  # fmt: skip
def test_a_random_config_is_judged_without_an_error_reading_no_more_than_its_header(
    adapter: Path, valid_weights: bytes, config: Any
) -> None:
    """Some random configs are valid, so the property is the one `verdict` asserts: a list of
    well-formed problems, never an exception, and the read bound kept."""
    original = (adapter / CONFIG).read_bytes()
    try:
        (adapter / CONFIG).write_text(json.dumps(config))
        verdict(adapter, valid_weights)
    finally:
        (adapter / CONFIG).write_bytes(original)


def read_parts_from(weights: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", weights[:8])
    return json.loads(weights[8 : 8 + length]), weights[8 + length :]


def pack(header: bytes, body: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + body
