"""compose/client.py without a server: what a person sees when Triton is not there, or when
the command line is wrong. (Its calls through a real Triton are in test_triton.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from compose import client
from tests.triton.harness import REPO_ROOT as REPO
from tests.triton.harness import free_port


def test_unreachable_triton_is_named_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"127.0.0.1:{free_port()}"

    code = client.main(["--url", url, "--adapter-id", "a1", "--prompt", "hi", "--timeout", "10"])

    assert code == client.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"cannot reach Triton's gRPC endpoint at {url}" in err
    assert "gRPC port (8001 by default)" in err


@pytest.mark.parametrize(("sampling", "expected"), [
    ("{max_tokens: 3}", "not JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_sampling_parameters_are_a_usage_error(
    capsys: pytest.CaptureFixture[str], sampling: str, expected: str
) -> None:
    code = client.main(["--adapter-id", "a1", "--prompt", "hi", "--sampling-parameters", sampling])

    assert code == client.EXIT_USAGE
    assert expected in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_client_in_the_projects_own_venv_names_the_extra_then_works_with_it(
    tmp_path: Path,
) -> None:
    """The venv `make run` makes (`pip install -e .`: no tritonclient at all) gets a
    clear answer naming the `triton` extra, not tritonclient's traceback; with the extra, as the
    README says, the client runs (here: against a port where nothing listens)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "-e", str(REPO)], check=True, timeout=400, capture_output=True)
    command = [python, str(REPO / "compose" / "client.py"), "--url", f"127.0.0.1:{free_port()}",
               "--adapter-id", "a1", "--prompt", "hi", "--timeout", "10"]

    without = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    assert without.returncode == client.EXIT_USAGE, without.stderr
    assert "gRPC support is not installed" in without.stderr
    assert "pip install -e '.[triton]'" in without.stderr
    assert "Traceback" not in without.stderr

    subprocess.run([*pip, "-e", f"{REPO}[triton]"], check=True, timeout=400, capture_output=True)
    with_extra = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    assert with_extra.returncode == client.EXIT_UNREACHABLE, with_extra.stderr
    assert "cannot reach Triton's gRPC endpoint" in with_extra.stderr
