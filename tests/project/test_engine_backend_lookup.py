"""Where the engine tier finds the stock Triton vLLM backend, and what it says when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.harness import BACKEND_TAG, find_vllm_backend


def _backend(folder: Path) -> Path:
    (folder / "utils").mkdir(parents=True)
    (folder / "model.py").write_text("# the stock backend\n")
    return folder


def test_the_named_folder_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = _backend(tmp_path / "named" / "src")
    vendored = _backend(tmp_path / "vendored" / "src")
    monkeypatch.setenv("TRITON_VLLM_BACKEND_DIR", str(named.parent))

    lookup = find_vllm_backend(tmp_path / "clones", vendored.parent)

    assert lookup.path == named


def test_the_vendored_copy_is_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_VLLM_BACKEND_DIR", str(tmp_path / "nothing-here"))
    vendored = _backend(tmp_path / "vendored" / "src")

    lookup = find_vllm_backend(tmp_path / "clones", vendored.parent)

    assert lookup.path == vendored
    assert "no model.py and utils/ there" in lookup.tried[0]


def test_nothing_found_says_what_was_tried_and_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_VLLM_BACKEND_DIR", raising=False)
    unreachable = f"file://{tmp_path}/no-such-repository"

    lookup = find_vllm_backend(tmp_path / "clones", tmp_path / "absent", unreachable)

    assert lookup.path is None
    assert lookup.tried[0] == "TRITON_VLLM_BACKEND_DIR: not set"
    assert lookup.tried[1] == f"{tmp_path / 'absent'}: absent"
    assert lookup.tried[2].startswith(f"git clone --branch {BACKEND_TAG} {unreachable}: exit ")
    assert "TRITON_VLLM_BACKEND_DIR" in lookup.fix()


def test_a_clone_of_the_tag_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    monkeypatch.delenv("TRITON_VLLM_BACKEND_DIR", raising=False)
    origin = tmp_path / "origin"
    _backend(origin / "src")
    (origin / "src" / "utils" / "request.py").write_text("# request\n")
    for command in (["init", "-q"], ["add", "."],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "backend"],
                    ["tag", BACKEND_TAG]):
        subprocess.run(["git", *command], cwd=origin, check=True, capture_output=True)

    lookup = find_vllm_backend(tmp_path / "clones", tmp_path / "absent", f"file://{origin}")

    assert lookup.path == tmp_path / "clones" / "vllm_backend" / "src"
    assert (lookup.path / "model.py").read_text() == "# the stock backend\n"
