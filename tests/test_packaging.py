"""Installing the project is quiet: the package builds from pyproject.toml with no deprecation
from the build backend (pip shows those banners on every install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_package_builds_without_a_deprecation_warning(tmp_path: Path) -> None:
    # A copy, so the build's egg-info and build/ folders never land in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "sidecar", source / "sidecar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # pip builds in an isolated environment with the setuptools pyproject.toml asks for,
    # as `make run` and `make test` do.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "DeprecationWarning" not in output, output[output.find("DeprecationWarning") - 500:]
    (wheel,) = (tmp_path / "dist").glob("lora_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    assert "License-Expression: Apache-2.0" in lines
