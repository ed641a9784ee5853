"""Adapter validation: the broken-adapter corpus is refused with the right codes (directly and
through `lora-sidecar validate`), valid adapters of several shapes pass, and the validator never
reads more than it must."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from unittest.mock import ANY

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sidecar.__main__ import main
from sidecar.config import Settings
from sidecar.core.errors import ConfigError
from sidecar.process.examples import tensor_name, write_adapter
from sidecar.validation.safetensors_check import check_safetensors
from sidecar.validation.shapes import ATTENTION_MODULES, MLP_MODULES, TINY_LLAMA
from sidecar.validation.validate import (
    MAX_PROBLEMS_PER_CODE,
    Problem,
    Rules,
    run_validate,
    summarize,
    validate_adapter,
)
from tests.support.broken_adapters import (
    CORPUS,
    WEIGHTS,
    BrokenAdapter,
    edit_config,
    write_parts,
)
from tests.support.observing import bytes_read_by_process

ALL_LINEAR = ATTENTION_MODULES + MLP_MODULES


def codes(problems: list[Problem]) -> set[str]:
    return {p.code for p in problems}


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_broken_adapter_is_refused_with_its_own_code(tmp_path: Path, case: BrokenAdapter) -> None:
    case.write(tmp_path / case.name)

    problems = validate_adapter(tmp_path / case.name, case.rules())

    assert codes(problems) == case.codes, [p.to_json() for p in problems]
    assert all(p.message for p in problems)


def test_corpus_adapters_pass_once_the_rule_is_relaxed(tmp_path: Path) -> None:
    # The surgery breaks one rule only: the same adapter is fine where that rule is not in force.
    case = next(c for c in CORPUS if c.name == "rank_above_limit")
    case.write(tmp_path / "a")

    assert validate_adapter(tmp_path / "a", Rules(max_lora_rank=32)) == []


@pytest.mark.parametrize(
    ("rank", "modules", "dtype", "with_base_config"),
    [
        (8, ("q_proj", "v_proj"), "float16", False),
        (8, ATTENTION_MODULES, "bfloat16", True),
        (16, ALL_LINEAR, "float16", True),
        (16, ALL_LINEAR, "bfloat16", False),
        (4, ("q_proj", "k_proj", "down_proj"), "float32", True),
        (1, ("o_proj",), "bfloat16", True),
    ],
)
def test_valid_adapter_passes(
    tmp_path: Path, rank: int, modules: tuple[str, ...], dtype: str, with_base_config: bool
) -> None:
    write_adapter(tmp_path / "a", rank=rank, target_modules=modules, dtype=dtype, seed=rank)
    rules = Rules(shapes=TINY_LLAMA if with_base_config else None, base_model="tiny-llama")

    assert validate_adapter(tmp_path / "a", rules) == []
    assert validate_adapter(tmp_path / "a", rules, scan_values=True) == []


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder, rank=32)
    edit_config(folder, use_dora=True)
    (folder / "new_embeddings.bin").write_bytes(b"pickle")
    with (folder / WEIGHTS).open("ab") as f:
        f.write(b"tail")

    problems = validate_adapter(folder, Rules())

    assert codes(problems) == {
        "rank_too_large", "dora_not_supported", "forbidden_file", "safetensors_length_mismatch",
    }  # fmt: skip
    by_code = {p.code: p for p in problems}
    assert by_code["forbidden_file"].file == "new_embeddings.bin"
    assert by_code["rank_too_large"].file == "adapter_config.json"
    assert by_code["safetensors_length_mismatch"].file == WEIGHTS


def test_messages_quote_vllm_where_it_has_one(tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", rank=32, target_modules=("q_proj", "v_proj"))

    problems = validate_adapter(tmp_path / "a", Rules(allowed_target_modules=frozenset({"q_proj"})))

    messages = {p.message for p in problems}
    assert any(m.startswith("LoRA rank 32 is greater than max_lora_rank 16.") for m in messages)
    assert any("max_lora_rank in vllm_model's model.json, which the sidecar reads with "
               "--engine-config (LORA_SIDECAR_ENGINE_CONFIG)" in m
               and "--max-lora-rank (LORA_SIDECAR_MAX_LORA_RANK)" in m for m in messages)
    assert (
        f"While loading {tmp_path / 'a'}, expected target modules in ['q_proj'] but received "
        "['v_proj']. Please verify that the loaded LoRA module is correct." in messages
    )


def test_a_200mb_header_claim_is_refused_without_reading_it(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    claim = 200_000_000
    with (folder / WEIGHTS).open("r+b") as f:
        f.write(struct.pack("<Q", claim))
        f.truncate(8 + claim + 1024)  # sparse: the claim fits in the file, so only size refuses it

    before = bytes_read_by_process()
    problems = validate_adapter(folder, Rules())
    read = bytes_read_by_process() - before

    assert codes(problems) == {"safetensors_header_too_large"}
    assert read < 64 * 1024


def test_tensor_values_are_read_once_by_default_and_not_at_all_when_left_out(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "a"
    write_adapter(folder, rank=16, target_modules=ALL_LINEAR, dtype="float32")
    size = (folder / WEIGHTS).stat().st_size

    before = bytes_read_by_process()
    assert validate_adapter(folder, Rules(), scan_values=False) == []
    plain = bytes_read_by_process() - before
    before = bytes_read_by_process()
    assert validate_adapter(folder, Rules()) == []
    scanned = bytes_read_by_process() - before

    assert plain < size // 4
    assert size <= scanned < size * 1.5


def test_a_sha256sums_check_reads_the_weights_once_and_checks_their_values_too(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "a"
    write_adapter(folder, rank=16, target_modules=ALL_LINEAR, dtype="float32")
    set_value(folder / WEIGHTS, tensor_name(0, "q_proj", "A"), "float32", np.nan, 5)
    (folder / "SHA256SUMS").write_text(
        f"{hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest()}  {WEIGHTS}\n")
    size = (folder / WEIGHTS).stat().st_size

    before = bytes_read_by_process()
    problems = validate_adapter(folder, Rules(), scan_values=False)  # as a restart does
    read = bytes_read_by_process() - before

    assert codes(problems) == {"non_finite_weights"}  # the hash matched; the values did not
    assert size <= read < size * 1.5


def set_value(path: Path, target: str, dtype: str, value: float, index: int) -> None:
    """Write `value` into element `index` of tensor `target`, in place."""
    raw = bytearray(path.read_bytes())
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_bytes])
    encoded = {
        "float16": np.float16(value).tobytes(),
        "float32": np.float32(value).tobytes(),
        "bfloat16": np.float32(value).tobytes()[2:],  # bfloat16 is float32's top half
    }[dtype]
    begin = 8 + header_bytes + header[target]["data_offsets"][0] + index * len(encoded)
    raw[begin : begin + len(encoded)] = encoded
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_with_the_tensor_count_and_first_index(
    tmp_path: Path, dtype: str, value: float
) -> None:
    folder = tmp_path / "a"
    write_adapter(folder, dtype=dtype)  # rank 8: B is [out, 8]
    target = tensor_name(1, "v_proj", "B")
    set_value(folder / WEIGHTS, target, dtype, value, 8 * 3 + 5)
    set_value(folder / WEIGHTS, target, dtype, value, 8 * 7)

    problems = validate_adapter(folder, Rules())

    assert codes(problems) == {"non_finite_weights"}
    message = problems[0].message
    assert target in message and "2 non-finite values" in message
    assert "at index [3, 5]" in message
    assert ("NaN at" if np.isnan(value) else "an infinity at") in message
    assert validate_adapter(folder, Rules(), scan_values=False) == []  # left out: not read


def test_rank_pattern_is_refused_where_the_engine_ignores_it(tmp_path: Path) -> None:
    # vLLM 0.13 (Triton 26.01) scales every module by lora_alpha/r, whatever rank_pattern says;
    # the engine tier shows such an adapter served with another text than PEFT's.
    folder = tmp_path / "a"
    write_adapter(folder, rank=8)
    edit_config(folder, rank_pattern={"model.layers.1.self_attn.q_proj": 4})
    tensors = load_file(str(folder / WEIGHTS))
    tensors[tensor_name(1, "q_proj", "A")] = np.zeros((4, 64), np.float16)
    tensors[tensor_name(1, "q_proj", "B")] = np.zeros((64, 4), np.float16)
    save_file(tensors, str(folder / WEIGHTS))

    problems = validate_adapter(folder, Rules(shapes=TINY_LLAMA))
    assert codes(problems) == {"rank_pattern_not_supported"}  # the shapes fit the pattern
    assert "model.layers.1.self_attn.q_proj" in problems[0].message

    edit_config(folder, rank_pattern={"model.layers.1.self_attn.q_proj": 8})  # no change: fine
    tensors[tensor_name(1, "q_proj", "A")] = np.zeros((8, 64), np.float16)
    tensors[tensor_name(1, "q_proj", "B")] = np.zeros((64, 8), np.float16)
    save_file(tensors, str(folder / WEIGHTS))
    assert validate_adapter(folder, Rules(shapes=TINY_LLAMA)) == []

    edit_config(folder, rank_pattern={}, alpha_pattern={"q_proj": 4})
    assert codes(validate_adapter(folder, Rules())) == {"alpha_pattern_not_supported"}
    edit_config(folder, alpha_pattern={"q_proj": 16})  # lora_alpha itself: no change
    assert validate_adapter(folder, Rules()) == []


def test_target_modules_as_peft_writes_them(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder, rank=8, target_modules=("q_proj", "v_proj"))
    paths = [f"model.layers.{layer}.self_attn.{m}"
             for layer in (1, 0) for m in ("v_proj", "q_proj")]
    rules = Rules(shapes=TINY_LLAMA)

    edit_config(folder, target_modules=paths)  # "all-linear", resolved by PEFT
    assert validate_adapter(folder, rules) == []
    edit_config(folder, target_modules=r".*\.(q_proj|v_proj)")  # a regular expression
    assert validate_adapter(folder, rules) == []
    assert validate_adapter(folder, Rules()) == []

    edit_config(folder, target_modules=r".*\.q_proj")
    problems = validate_adapter(folder, rules)
    assert codes(problems) == {"tensor_module_not_targeted"}
    assert "model.layers.0.self_attn.v_proj" in problems[0].message
    edit_config(folder, target_modules=paths[:3])
    assert codes(validate_adapter(folder, rules)) == {"tensor_module_not_targeted"}
    edit_config(folder, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    assert codes(validate_adapter(folder, rules)) == {"tensor_module_not_targeted"}
    edit_config(folder, target_modules=["q_proj", "v_proj"], layers_to_transform=None,
                exclude_modules=["model.layers.0.self_attn.q_proj"])
    assert codes(validate_adapter(folder, rules)) == {"tensor_module_not_targeted"}

    edit_config(folder, exclude_modules=None, target_modules=["q_proj", "v_proj", "o_proj"])
    problems = validate_adapter(folder, rules)
    assert codes(problems) == {"targeted_module_without_tensors"}
    assert "o_proj" in problems[0].message
    assert codes(validate_adapter(folder, Rules())) == {"targeted_module_without_tensors"}
    edit_config(folder, target_modules=r".*\.(q|v|o)_proj")
    assert codes(validate_adapter(folder, rules)) == {"targeted_module_without_tensors"}

    # A module in some layers only: PEFT initialises the others as no-ops (lora_B zero), as
    # the sidecar's own no-op adapter for spare names does.
    edit_config(folder, target_modules=["q_proj", "v_proj"])
    tensors = load_file(str(folder / WEIGHTS))
    for half in ("A", "B"):
        del tensors[tensor_name(1, "q_proj", half)]
    save_file(tensors, str(folder / WEIGHTS))
    assert validate_adapter(folder, rules) == []

    for bad in ("(unclosed", "x" * 2000, ["q_proj", "v proj"], []):
        edit_config(folder, target_modules=bad)
        assert codes(validate_adapter(folder, rules)) == {"invalid_target_modules"}, bad


def test_embedding_tensors_need_embed_tokens_allowed(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    tensors = load_file(str(folder / WEIGHTS))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((8, 100), np.float16)
    tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = np.zeros((64, 8), np.float16)
    save_file(tensors, str(folder / WEIGHTS))
    edit_config(folder, target_modules=["q_proj", "v_proj", "embed_tokens"])

    assert codes(validate_adapter(folder, Rules())) == {"module_not_allowed"}
    allowed = Rules(allowed_target_modules=frozenset({"q_proj", "v_proj", "embed_tokens"}))
    assert validate_adapter(folder, allowed) == []


def test_checksums_file_is_checked_with_given_digests(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    digests = {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in ("adapter_config.json", WEIGHTS)
    }
    lines = [f"{digest}  {name}" for name, digest in digests.items()]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")

    assert validate_adapter(folder, Rules()) == []
    assert validate_adapter(folder, Rules(), sha256=digests) == []
    # Digests computed while downloading are trusted over re-reading the file.
    wrong = {**digests, WEIGHTS: "ab" * 32}
    problems = validate_adapter(folder, Rules(), sha256=wrong)
    assert [(p.code, p.file) for p in problems] == [("checksum_mismatch", WEIGHTS)]


@pytest.mark.parametrize(
    "content",
    [
        b"not a checksum line\n",
        b"a" * 64 + b"  ../adapter_config.json\n",
        b"a" * 64 + b"  SHA256SUMS\n",
        b"\xff\xfe not text",
    ],
)
def test_malformed_checksums_file_is_refused(tmp_path: Path, content: bytes) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    (folder / "SHA256SUMS").write_bytes(content)

    assert codes(validate_adapter(folder, Rules())) == {"invalid_checksum_file"}


def test_folder_problems_are_reported_not_raised(tmp_path: Path) -> None:
    write_adapter(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")

    assert codes(validate_adapter(tmp_path / "missing", Rules())) == {"read_error"}
    assert codes(validate_adapter(tmp_path / "file", Rules())) == {"not_a_folder"}
    assert codes(validate_adapter(tmp_path / "link", Rules())) == {"symlink"}
    (tmp_path / "empty").mkdir()
    assert [(p.code, p.file) for p in validate_adapter(tmp_path / "empty", Rules())] == [
        ("missing_file", "adapter_config.json"),
        ("missing_file", WEIGHTS),
    ]


def test_special_files_and_hard_links_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    os.mkfifo(folder / "SHA256SUMS")
    os.mkfifo(folder / "README")  # never read: ignored
    os.link(folder / "adapter_config.json", tmp_path / "elsewhere.json")

    problems = validate_adapter(folder, Rules())

    assert {(p.code, p.file) for p in problems} == {
        ("not_regular_file", "SHA256SUMS"),
        ("hard_link", "adapter_config.json"),
    }


def test_an_io_error_on_one_file_is_that_files_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    real_open = os.open

    def failing_open(path: object, *args: object, **kwargs: object) -> int:
        # A disk error cannot be produced on demand (and root reads any file), so fake one.
        if Path(str(path)).name == "adapter_config.json":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", failing_open)

    problems = validate_adapter(folder, Rules())

    assert [(p.code, p.file) for p in problems] == [("read_error", "adapter_config.json")]
    assert "Input/output error" in problems[0].message


def test_config_larger_than_the_cap_is_not_parsed(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    with (folder / "adapter_config.json").open("a") as f:
        f.write(" " * 1024**2)

    assert codes(validate_adapter(folder, Rules())) == {"config_too_large"}


def test_problems_of_one_kind_are_bounded(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    header = {f"junk.{i}": {"dtype": "F16", "shape": [1], "data_offsets": [2 * i, 2 * i + 2]}
              for i in range(500)}  # fmt: skip
    write_parts(folder / WEIGHTS, header, bytes(1000))

    problems = validate_adapter(folder, Rules())

    junk = [p for p in problems if p.code == "unsupported_tensor_name"]
    assert len(junk) == MAX_PROBLEMS_PER_CODE + 1
    assert "480 more" in junk[-1].message


def test_odd_tensor_names_cannot_break_a_log_line(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    write_adapter(folder)
    name = "evil\nname\u202e" + "x" * 5000
    write_parts(folder / WEIGHTS, {name: {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}},
                bytes(2))

    problems = validate_adapter(folder, Rules())
    line = summarize(problems)

    assert codes(problems) == {"unsupported_tensor_name", "no_lora_tensors"}
    assert "\n" not in line and "\u202e" not in line
    assert len(line) < 2000


def test_summarize_is_one_line() -> None:
    problems = [Problem("forbidden_file", f"f{i}.bin", "pickle") for i in range(7)]

    assert summarize([]) == "valid"
    assert summarize(problems).startswith("7 problem(s): forbidden_file f0.bin: pickle;")
    assert summarize(problems).endswith("(+2 more)")


def test_rules_come_from_settings(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA.to_config()))
    settings = Settings.from_values({
        "max_lora_rank": "32", "allowed_target_modules": "q_proj,v_proj",
        "base_model": "tiny-llama", "base_model_config": str(config),
    })  # fmt: skip

    rules = Rules.from_settings(settings)

    assert rules == Rules(32, frozenset({"q_proj", "v_proj"}), "tiny-llama", TINY_LLAMA)
    config.write_text('{"hidden_size": "big"}')
    with pytest.raises(ConfigError, match="base-model-config"):
        Rules.from_settings(settings)


def test_run_validate_prints_a_verdict_and_returns_an_exit_code(tmp_path: Path) -> None:
    write_adapter(tmp_path / "good")
    write_adapter(tmp_path / "bad", rank=32)
    (tmp_path / "bad" / "new_embeddings.bin").write_bytes(b"")
    (tmp_path / "bad" / "training_args.bin").write_bytes(b"")

    out = io.StringIO()
    assert run_validate(tmp_path / "good", Rules(), as_json=False, out=out) == 0
    assert out.getvalue() == f"OK {tmp_path / 'good'}\n"

    out = io.StringIO()
    assert run_validate(tmp_path / "bad", Rules(), as_json=False, out=out) == 1
    lines = out.getvalue().splitlines()
    assert [line.split(":", 1)[0] for line in lines] == [
        "forbidden_file  new_embeddings.bin",
        "rank_too_large  adapter_config.json",
        "note  1 entries the engine never reads are left out (never fetched or published)",
    ]
    assert lines[1].startswith("rank_too_large  adapter_config.json: LoRA rank 32 is greater "
                               "than max_lora_rank 16. The limit is the engine's "
                               "max_lora_rank in vllm_model's model.json")
    assert lines[2].endswith(": training_args.bin")

    out = io.StringIO()
    assert run_validate(tmp_path / "bad", Rules(), as_json=True, out=out) == 1
    verdict = json.loads(out.getvalue())
    assert verdict["path"] == str(tmp_path / "bad") and verdict["valid"] is False
    assert {p["code"] for p in verdict["problems"]} == {"rank_too_large", "forbidden_file"}
    assert verdict["ignored"] == ["training_args.bin"]



# ---- the `lora-sidecar validate` command ----------------------------------------------------


def cli_args(case: BrokenAdapter, folder: Path, tmp_path: Path) -> list[str]:
    args = ["validate", str(folder)]
    if case.base_model is not None:
        args += ["--base-model", case.base_model]
    if case.base_shapes is not None:
        config = tmp_path / "base-config.json"
        config.write_text(json.dumps(case.base_shapes.to_config()))
        args += ["--base-model-config", str(config)]
    return args


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_validate_command_refuses_broken_adapter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: BrokenAdapter
) -> None:
    case.write(tmp_path / case.name)

    exit_code = main(cli_args(case, tmp_path / case.name, tmp_path))

    lines = capsys.readouterr().out.splitlines()
    assert exit_code == 1
    assert {line.split("  ", 1)[0] for line in lines} == case.codes, lines


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_validate_command_passes_a_valid_adapter(tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", rank=16, target_modules=ALL_LINEAR, dtype="bfloat16")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA.to_config()))

    done = run_command(str(tmp_path / "a"), "--base-model-config", str(config),
                       "--base-model", "tiny-llama")

    assert (done.returncode, done.stdout, done.stderr) == (0, f"OK {tmp_path / 'a'}\n", "")


def test_validate_command_lists_every_problem_and_fails(tmp_path: Path) -> None:
    next(c for c in CORPUS if c.name == "rank_above_limit").write(tmp_path / "a")
    (tmp_path / "a" / "new_embeddings.safetensors").write_bytes(b"")

    done = run_command(str(tmp_path / "a"), "--allowed-target-modules", "q_proj")

    assert done.returncode == 1
    assert [line.split("  ", 1)[0] for line in done.stdout.splitlines()] == [
        "forbidden_file", "rank_too_large", "module_not_allowed", "module_not_allowed",
    ]  # fmt: skip
    relaxed = run_command(str(tmp_path / "a"), "--max-lora-rank", "32", "--json")
    assert relaxed.returncode == 1
    verdict = json.loads(relaxed.stdout)
    assert verdict == {
        "path": str(tmp_path / "a"),
        "valid": False,
        "problems": [{"code": "forbidden_file", "file": "new_embeddings.safetensors",
                      "message": ANY}],
        "ignored": [],
    }


@pytest.mark.parametrize(
    ("header", "data"),
    [
        ({}, b""),
        ({"__metadata__": {"format": "pt"}}, b""),
        ({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, bytes(4)),
        ({"z": {"dtype": "F16", "shape": [0, 64], "data_offsets": [0, 0]}}, b""),
        ({"b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]},
          "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, bytes(8)),
    ],
    ids=["empty", "metadata_only", "scalar", "zero_size", "any_order"],
)
def test_layouts_the_reference_reader_accepts_pass_the_structure_check(
    tmp_path: Path, header: dict[str, object], data: bytes
) -> None:
    # Checklist D12: stricter only where policy says so, never by accident.
    path = tmp_path / WEIGHTS
    write_parts(path, header, data)

    with path.open("rb") as f:
        checked = check_safetensors(f, path.stat().st_size, path)

    assert checked.faults == ()
    assert checked.tensors is not None and len(checked.tensors) == len(header) - (
        "__metadata__" in header
    )
