"""Which entries of an adapter's folder are fetched, ignored or refused, judged by their names
and kinds alone. The same rule through every part that applies it (the registries, validate,
the watcher, the compose uploader): tests/behaviour/test_adapter_files.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.core.fsutil import EntryKind
from sidecar.process.examples import write_adapter
from sidecar.validation.files import FileRole, classify, plan_files
from tests.support.broken_adapters import CONFIG, WEIGHTS


@pytest.mark.parametrize(
    ("path", "role"),
    [
        ("adapter_config.json", FileRole.FETCHED),
        ("adapter_model.safetensors", FileRole.FETCHED),
        ("SHA256SUMS", FileRole.FETCHED),
        ("adapter_model.bin", FileRole.PICKLE_WEIGHTS),
        ("adapter_model.pt", FileRole.PICKLE_WEIGHTS),
        ("new_embeddings.safetensors", FileRole.REFUSED),
        ("new_embeddings.bin", FileRole.REFUSED),
        # What PEFT, Trainer and `hf download --local-dir` leave beside an adapter.
        ("README.md", FileRole.IGNORED),
        ("LICENSE", FileRole.IGNORED),
        (".gitattributes", FileRole.IGNORED),
        ("training_args.bin", FileRole.IGNORED),
        ("optimizer.pt", FileRole.IGNORED),
        ("rng_state.pth", FileRole.IGNORED),
        ("tokenizer.json", FileRole.IGNORED),
        ("tokenizer_config.json", FileRole.IGNORED),
        ("special_tokens_map.json", FileRole.IGNORED),
        ("modeling_custom.py", FileRole.IGNORED),
        ("Adapter_Config.json", FileRole.IGNORED),
        (".sidecar.json", FileRole.IGNORED),
        (".cache/huggingface/download/adapter_model.safetensors.metadata", FileRole.IGNORED),
        ("checkpoint-100/adapter_model.safetensors", FileRole.IGNORED),
        # Paths that would leave the folder, or alias one of its entries.
        ("", FileRole.REFUSED),
        ("..", FileRole.REFUSED),
        ("../adapter_config.json", FileRole.REFUSED),
        ("/etc/passwd", FileRole.REFUSED),
        ("./adapter_config.json", FileRole.REFUSED),
        ("a//b", FileRole.REFUSED),
        ("..\\adapter_config.json", FileRole.REFUSED),
    ],
)
def test_each_entry_has_one_role_by_its_name(path: str, role: FileRole) -> None:
    assert classify(path) is role


def test_pickle_weights_are_ignored_beside_safetensors_and_refused_alone() -> None:
    beside = plan_files([(CONFIG, EntryKind.FILE), (WEIGHTS, EntryKind.FILE),
                         ("adapter_model.bin", EntryKind.FILE)])
    alone = plan_files([(CONFIG, EntryKind.FILE), ("adapter_model.bin", EntryKind.FILE)])

    assert (beside.fetched, beside.ignored, beside.problems) == (
        (CONFIG, WEIGHTS), ("adapter_model.bin",), ())
    assert alone.fetched == (CONFIG,)
    assert [(p.code, p.file) for p in alone.problems] == [("forbidden_file", "adapter_model.bin")]
    assert "safe_serialization" in alone.problems[0].message


def test_a_plan_names_sub_folders_once_and_points_at_an_adapter_one_level_down() -> None:
    plan = plan_files([("README.md", EntryKind.FILE),
                       ("checkpoint-500/adapter_config.json", EntryKind.FILE),
                       ("checkpoint-500/adapter_model.safetensors", EntryKind.FILE),
                       ("checkpoint-500/optimizer.pt", EntryKind.FILE),
                       (".cache", EntryKind.FOLDER)])

    assert plan.fetched == ()
    assert plan.ignored == (".cache/", "README.md", "checkpoint-500/")
    assert [(p.code, p.file) for p in plan.problems] == [("missing_file", CONFIG),
                                                         ("missing_file", WEIGHTS)]
    assert "checkpoint-500/adapter_config.json is one level down" in plan.problems[0].message


def test_an_engine_file_that_is_not_a_plain_file_is_refused() -> None:
    plan = plan_files([(CONFIG, EntryKind.LINK), (WEIGHTS, EntryKind.FOLDER),
                       ("README.md", EntryKind.LINK)])

    assert {(p.code, p.file) for p in plan.problems} == {("symlink", CONFIG),
                                                         ("not_regular_file", WEIGHTS)}
    assert plan.ignored == ("README.md",)


def test_a_trainer_output_folder_is_refused_with_its_last_checkpoint_named(
    tmp_path: Path,
) -> None:
    """`lora-sidecar validate` on what transformers' Trainer leaves in output_dir: only
    checkpoint-N/ folders (and runs/). The answer names the last checkpoint, as a folder that
    holds the adapter, and how to save the final one."""
    output = tmp_path / "output"
    for step in (500, 1000, 1500):
        write_adapter(output / f"checkpoint-{step}")
    (output / "runs").mkdir()
    result = subprocess.run([sys.executable, "-m", "sidecar", "validate", str(output)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    missing = [line for line in result.stdout.splitlines() if line.startswith("missing_file")]
    assert len(missing) == 2, result.stdout
    for line in missing:
        assert "checkpoint-1500/" in line and "Trainer" in line, line
        assert "trainer.save_model" in line
    last = subprocess.run([sys.executable, "-m", "sidecar", "validate",
                           str(output / "checkpoint-1500")], capture_output=True, text=True,
                          timeout=60)
    assert last.returncode == 0, last.stdout + last.stderr  # the folder the hint points at
