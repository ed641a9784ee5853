"""What counts as the engine's read of a no-op: the judge's rule on a clock, then the real inotify
watch with real processes on the volume (du, find, ls -R, tar, cp -r, cat, sha256sum) and the
engine's own pattern (config then weights, by name, through the name's link)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar.catalog.read_watch import DECOY_WINDOW_S, ReadJudge, ReadWatch

CONFIG, WEIGHTS, README = "adapter_config.json", "adapter_model.safetensors", "README"
KEY = (1, "_spare-g1-0001")


def test_config_then_weights_alone_is_the_engines_read() -> None:
    judge = ReadJudge()
    judge.opened(KEY, CONFIG, 10.0)
    judge.opened(KEY, WEIGHTS, 10.01)
    assert judge.suspect(KEY) and judge.maybe_engine(KEY)
    assert judge.judge(10.5) == set()  # the README may still come
    assert judge.judge(10.02 + DECOY_WINDOW_S) == {KEY}
    assert not judge.suspect(KEY)  # judged and forgotten


@pytest.mark.parametrize("readme_at", [9.5, 10.005, 10.3])
def test_a_process_that_reads_the_readme_too_is_walking(readme_at: float) -> None:
    judge = ReadJudge()
    judge.opened(KEY, CONFIG, 10.0)
    judge.opened(KEY, WEIGHTS, 10.01)
    judge.opened(KEY, README, readme_at)
    assert not judge.maybe_engine(KEY)
    assert judge.judge(11.0 + DECOY_WINDOW_S) == set()


def test_a_listing_or_one_file_alone_is_not_a_read() -> None:
    judge = ReadJudge()
    judge.opened(KEY, "", 10.0)  # the folder itself: du, find, ls -R
    assert not judge.suspect(KEY)
    judge.opened(KEY, CONFIG, 11.0)  # cat adapter_config.json
    assert judge.suspect(KEY)  # not handed out until judged
    assert judge.judge(12.0 + DECOY_WINDOW_S) == set()
    assert not judge.suspect(KEY)


def test_an_overflowed_queue_counts_as_a_read() -> None:
    judge = ReadJudge()
    judge.opened(KEY, "*overflow*", 10.0)
    assert judge.judge(11.0 + DECOY_WINDOW_S) == {KEY}


# ---- the real watch --------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def noops(tmp_path: Path) -> Path:
    """Two names' no-op folders of hard links to one no-op, and a link to each, as the catalog
    lays them out."""
    shared = tmp_path / "noop" / ".shared"
    shared.mkdir(parents=True)
    for name, data in ((CONFIG, b"{}"), (WEIGHTS, b"\0" * 64), (README, b"a no-op")):
        (shared / name).write_bytes(data)
    for name in ("n1", "n2"):
        (tmp_path / "noop" / name).mkdir()
        for file in (CONFIG, WEIGHTS, README):
            os.link(shared / file, tmp_path / "noop" / name / file)
    (tmp_path / "names").mkdir()
    for name in ("n1", "n2"):
        os.symlink(f"../noop/{name}", tmp_path / "names" / name)
    return tmp_path


def watch(noops: Path, clock: Clock) -> ReadWatch:
    reads = ReadWatch(clock)
    if not reads.available:
        pytest.fail(f"inotify must be available on Linux: {reads.problem}")
    for name in ("n1", "n2"):
        assert reads.watch((1, name), noops / "noop" / name)
    return reads


def verdict(reads: ReadWatch, clock: Clock) -> set[tuple[int, str]]:
    reads.drain()
    clock.now_s += DECOY_WINDOW_S + 1
    return reads.judge.judge(clock.now_s)


@pytest.mark.parametrize("command", [
    ["du", "-sh", "."], ["find", "."], ["ls", "-R", "."], ["du", "-shL", "."],
    ["tar", "-cf", "/dev/null", "."], ["tar", "-chf", "/dev/null", "."],
    ["cp", "-r", "noop", "copy"], ["sh", "-c", "sha256sum noop/n1/* noop/n2/*"],
    ["sh", "-c", "cat noop/*/adapter_config.json"],
])
def test_operators_commands_on_the_volume_never_count_as_a_read(
        noops: Path, command: list[str]) -> None:
    if shutil.which(command[0]) is None:
        pytest.fail(f"{command[0]} is not installed")
    clock = Clock()
    reads = watch(noops, clock)
    try:
        subprocess.run(command, cwd=noops, check=True, capture_output=True, timeout=30)
        assert verdict(reads, clock) == set()
    finally:
        reads.close()


def test_the_engines_pattern_through_one_names_link_is_that_names_read_only(
        noops: Path) -> None:
    clock = Clock()
    reads = watch(noops, clock)
    try:
        # What vLLM does: open the config, then the weights, by name, through the link.
        for file in (CONFIG, WEIGHTS):
            with open(noops / "names" / "n1" / file, "rb") as f:
                f.read()
        # No wait: inotify queues an open's event within the open itself.
        assert verdict(reads, clock) == {(1, "n1")}
        # The shared copy itself is nobody's name: opening it is no name's read.
        for file in (CONFIG, WEIGHTS):
            (noops / "noop" / ".shared" / file).read_bytes()
        assert verdict(reads, clock) == set()
    finally:
        reads.close()
