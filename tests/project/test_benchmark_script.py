"""`benchmarks/run.sh --help` answers before anything is installed, and a run that cannot work
says what is missing before the long set-up."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.options import PHASES, missing_prerequisites
from tests.support.paths import REPO


def test_help_answers_without_building_anything(tmp_path: Path) -> None:
    # A copy without Makefile or venv: a run.sh that built the venv first would fail here.
    (tmp_path / "benchmarks").mkdir()
    for name in ("run.sh", "options.py", "__init__.py"):
        shutil.copy2(REPO / "benchmarks" / name, tmp_path / "benchmarks" / name)
    result = subprocess.run([str(tmp_path / "benchmarks" / "run.sh"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for fragment in ("--quick", "prerequisites:", "root", "npm", "tc", "wrk", "minutes"):
        assert fragment in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["benchmarks"]


def test_missing_tools_are_named_with_their_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    problems = missing_prerequisites(set(PHASES), is_root=False)
    text = "\n".join(problems)
    assert "the shaped link needs root" in problems[0]
    assert "--phases loopback,moto,memory,hit,miss" in problems[0]
    for fragment in ("apt-get install nodejs", "apt-get install npm", "apt-get install wrk",
                     "apt-get install iproute2", "apt-get install util-linux"):
        assert fragment in text

    as_root = missing_prerequisites({"loopback"}, is_root=True)
    assert as_root == []  # node, npm and curl are installed by the run itself as root
    assert missing_prerequisites({"loopback", "hit"}, is_root=False) != []
