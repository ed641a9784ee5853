"""Which entries of an adapter's folder are fetched, ignored or refused, judged by their names
and kinds alone. The same rule through every part that applies it (the registries, validate,
the watcher, the compose uploader): tests/behaviour/test_adapter_files.py."""

from __future__ import annotations

import pytest

from sidecar.core.fsutil import EntryKind
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
