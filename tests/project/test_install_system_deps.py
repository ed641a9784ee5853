"""scripts/install-system-deps.sh decides what to install from what the machine has, by need:
`make test-fast` never asks for a Docker engine, and `make test` never puts Debian's docker.io
over a working engine or Docker CE. Run against stand-in commands on a PATH of the test's own,
with apt-get recording what it was asked to install."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "install-system-deps.sh"
# What the script itself runs, taken from this machine; what it would write outside the test's
# folders with (policy-rc.d) is a stand-in that does nothing.
TOOLS = ("bash", "sed", "sort", "tr", "id", "dirname", "grep", "cat")
INERT = ("tee", "chmod", "rm")
FAST_NEEDS = ("prometheus", "promtool", "docker-compose", "mount", "haproxy", "kubectl")


def _stub(folder: Path, name: str, body: str = "exit 0") -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _docker_client(folder: Path, version: str, *, buildx: bool, engine: bool = False) -> None:
    _stub(folder, "docker", "\n".join([
        f'[ "$1" = --version ] && {{ echo "Docker version {version}, build 0"; exit 0; }}',
        f'[ "$1" = buildx ] && exit {0 if buildx else 1}',
        f'[ "$1" = info ] && exit {0 if engine else 1}',
        "exit 1"]))


def _run(tmp_path: Path, *args: str, have: tuple[str, ...] = (),
         dpkg_installed: tuple[str, ...] = (),
         setup: tuple[tuple[str, bool, bool], ...] = ()) -> tuple[int, str, list[str]]:
    """(exit code, stderr, the packages apt-get was asked to install)."""
    bin_dir, sbin_dir = tmp_path / "bin", tmp_path / "sbin"
    bin_dir.mkdir(exist_ok=True)
    sbin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real is not None, tool
        (bin_dir / tool).symlink_to(real)
    for name in (*have, *INERT):
        _stub(bin_dir, name)
    for version, buildx, engine in setup:
        _docker_client(bin_dir, version, buildx=buildx, engine=engine)
    asked = tmp_path / "apt-get.args"
    _stub(bin_dir, "apt-get", f'[ "$1" = install ] && echo "$@" >> {asked}; exit 0')
    installed = " ".join(dpkg_installed)
    _stub(bin_dir, "dpkg-query", f'for p in {installed}; do echo "install ok installed"; done')
    env = {"PATH": str(bin_dir), "SYSTEM_SBIN": str(sbin_dir), "HOME": str(tmp_path),
           "VENV_BIN": str(bin_dir)}
    done = subprocess.run([str(bin_dir / "bash"), str(SCRIPT), *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    packages = asked.read_text().split()[1:] if asked.exists() else []
    return done.returncode, done.stderr, [p for p in packages if not p.startswith("-")]


@pytest.mark.skipif(os.geteuid() != 0, reason="the script asks for sudo when not root")
class TestWhatIsInstalled:
    def test_test_fast_needs_no_docker_engine_nor_debootstrap(self, tmp_path: Path) -> None:
        assert _run(tmp_path, have=FAST_NEEDS) == (0, "", [])

    def test_test_fast_installs_only_what_it_lacks(self, tmp_path: Path) -> None:
        code, _, packages = _run(tmp_path, have=("docker-compose", "mount", "kubectl"))
        assert code == 0
        assert sorted(packages) == ["haproxy", "prometheus"]

    def test_docker_ce_with_buildx_and_its_dockerd_is_used_as_it_is(self, tmp_path: Path) -> None:
        (tmp_path / "bin").mkdir()
        _stub(tmp_path / "bin", "dockerd")  # Docker CE's, in /usr/bin
        code, err, packages = _run(tmp_path, "--docker", have=("debootstrap",),
                                   setup=(("28.1.1", True, False),),
                                   dpkg_installed=("docker-ce", "docker-ce-cli"))
        assert (code, packages) == (0, []), err

    def test_an_engine_that_answers_needs_no_dockerd(self, tmp_path: Path) -> None:
        code, err, packages = _run(tmp_path, "--docker", have=("debootstrap",),
                                   setup=(("27.0.3", True, True),))
        assert (code, packages) == (0, []), err

    def test_docker_ce_without_buildx_is_not_replaced_by_docker_io(self, tmp_path: Path) -> None:
        code, err, packages = _run(tmp_path, "--docker", have=("debootstrap",),
                                   setup=(("28.1.1", False, False),),
                                   dpkg_installed=("docker-ce-cli",))
        assert (code, packages) == (1, [])
        assert "docker-buildx-plugin" in err and "would replace Docker CE" in err

    def test_no_engine_at_all_installs_debians(self, tmp_path: Path) -> None:
        code, err, packages = _run(tmp_path, "--docker")
        assert code == 0, err
        assert sorted(packages) == ["debootstrap", "docker.io"]

    def test_debians_own_client_builds_without_buildx(self, tmp_path: Path) -> None:
        sbin = tmp_path / "sbin"
        sbin.mkdir()
        _stub(sbin, "dockerd")  # Debian's, in /usr/sbin: off a user's PATH
        _stub(sbin, "debootstrap")
        code, err, packages = _run(tmp_path, "--docker", setup=(("20.10.24+dfsg1", False, False),))
        assert (code, packages) == (0, []), err
