"""`benchmarks/run.sh --help` answers before anything is installed, and a run that cannot work
says what is missing before the long set-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
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


def test_the_quick_run_runs_every_benchmark() -> None:
    """`run.sh --quick` as a reader runs it: every benchmark in its small mode, each table
    printed; a benchmark that breaks (a moved import, a changed option) fails here. Without
    root the shaped link is left out, as `--help` says."""
    phases = [] if os.geteuid() == 0 else ["--phases", "loopback,moto,memory,hit"]
    # A folder of this run's own on tmpfs: another checkout's run on this machine (its own
    # suite, or a benchmark) keeps the default one.
    dest = Path(tempfile.mkdtemp(prefix="lsbench-suite-", dir="/dev/shm"))
    try:
        result = subprocess.run(
            [str(REPO / "benchmarks" / "run.sh"), "--quick", *phases, "--dest", str(dest)],
            capture_output=True, text=True, timeout=900, cwd=REPO)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        for lock in dest.parent.glob(f"{dest.name}*.lock"):  # this run's, ended
            lock.unlink()
    assert result.returncode == 0, result.stderr[-4000:]
    tables = ["### Cold stage, loopback, s3rver", "### Cold stage, loopback, moto",
              "### Hit path", "### Memory", "### routing simulator", "### restart cost",
              "### warm restart", "### lease journal", "### catalog journal",
              "### hit path with tenants", "### eviction policies"]
    if os.geteuid() == 0:
        tables.append("### Cold stage, shaped link")
    missing = [table for table in tables if table not in result.stdout]
    assert not missing, result.stdout
    # every client staged every adapter of the loopback table, each checked byte for byte
    loopback = result.stdout.split("### Cold stage, loopback, s3rver")[1].split("###")[0]
    rows = [line for line in loopback.splitlines() if line.startswith("| ") and " MB |" in line]
    assert {row.split("|")[2].strip() for row in rows} >= {
        "sidecar", "reference (boto3)", "boto3, tuned", "aws s3 cp", "s5cmd cp"}
    engine = [line for line in result.stdout.splitlines()
              if line.startswith("Imported, options parsed:")]
    assert engine and "churn" in engine[0] and "new_adapter" in engine[0]


def test_a_second_run_on_the_same_work_folder_stops_at_once_and_says_why(tmp_path: Path) -> None:
    """Each benchmark empties its work folder (--dest) at its start and end: a second run on
    the same folder would pull it from under the first, so it refuses while the first runs."""
    dest = tmp_path / "lsbench"
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from benchmarks.servers import holding\n"
         f"with holding(Path({str(dest)!r})):\n print('held', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        second = subprocess.run(
            [sys.executable, "-m", "benchmarks.miss", "--rounds", "1", "--dest", str(dest)],
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"another benchmark run is using {dest}" in second.stderr
    finally:
        first.communicate("")
    assert first.returncode == 0
