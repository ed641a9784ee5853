"""Installing the project is quiet: the package builds, and installs editable as `make` does,
with no warning or notice from the build backend (pip shows those banners on every install)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from sidecar.process.examples import write_adapter
from tests.support.paths import REPO
from tests.support.processes import free_port, http_status, stage_blocking
from tests.support.signing_keys import key_policy, make_key, sign_with_key
from tests.support.waiting import eventually_blocking

BANNERS = ("DeprecationWarning", "InformationOnly", "BuildBackendWarning")


def _copy_of_the_project(tmp_path: Path) -> Path:
    # A copy, so the build's egg-info and build/ folders never land in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "sidecar", source / "sidecar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return source


def _pip(*args: str) -> str:
    # pip builds in an isolated environment with the setuptools pyproject.toml asks for, as
    # `make run` and `make test` do; -v shows what the build backend printed.
    result = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "-v"],
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    for banner in BANNERS:
        assert banner not in output, output[max(output.find(banner) - 800, 0):][:2000]
    return output


def test_the_package_builds_without_a_deprecation_warning(tmp_path: Path) -> None:
    source = _copy_of_the_project(tmp_path)
    _pip("wheel", "--no-cache-dir", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("lora_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    assert "License-Expression: Apache-2.0" in lines
    # Only the package, nothing else of the project root.
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"sidecar"}


def test_an_editable_install_is_quiet_and_imports_the_checkout(tmp_path: Path) -> None:
    source = _copy_of_the_project(tmp_path)
    target = tmp_path / "site"
    _pip("install", "--no-cache-dir", "--target", str(target), "-e", str(source))
    (pth,) = target.glob("__editable__*.pth")
    assert Path(pth.read_text().strip()).resolve() == source.resolve()


def test_the_sidecar_runs_without_the_packages_only_tests_and_the_client_need() -> None:
    """`make run` installs the project's dependencies only: every module of sidecar/ imports
    with tritonclient (compose/client.py's, in the `triton` and `test` extras) unavailable."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("tritonclient")]
    script = (
        "import importlib, pkgutil, sys\n"
        "sys.modules['tritonclient'] = None  # any import of it raises ImportError\n"
        "import sidecar\n"
        "for module in pkgutil.walk_packages(sidecar.__path__, 'sidecar.'):\n"
        "    importlib.import_module(module.name)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_parsing_the_settings_loads_no_server_nor_storage_client() -> None:
    """The layout's rule (README): settings parse without aiohttp or aiobotocore, so a client
    command or a tool that reads them stays light, and config.py sits below the web layer."""
    script = (
        "import sys\n"
        "from sidecar.config import Settings\n"
        "Settings.from_values({'registry': 's3://bucket/lora', 'max_bytes': '10GiB'})\n"
        "heavy = ('aiohttp', 'aiobotocore', 'botocore', 'watchdog')\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"parsing the settings imported: {result.stdout}"


def test_without_the_signing_extra_the_sidecar_serves_and_a_policy_says_what_to_install(
        tmp_path: Path) -> None:
    """`make run`'s venv: the project's dependencies, no `signing` extra. The sidecar serves
    (an adapter's model.sig published unread, as with no policy), and everything that would
    check or make a signature stops with exit 2 naming the extra to install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    # The installer `make run` uses: uv, which make put beside this interpreter (INSTALLER=uv,
    # the default; a quarter of pip's time here), else pip (INSTALLER=pip).
    uv = Path(sys.executable).parent / "uv"
    install = ([str(uv), "pip", "install", "--quiet", "--native-tls", "--python",
                str(bin_dir / "python")] if uv.is_file() else
               [str(bin_dir / "python"), "-m", "pip", "install", "--quiet",
                "--disable-pip-version-check"])
    installed = subprocess.run([*install, "-e", str(REPO)], capture_output=True, text=True,
                               timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    for module in ("model_signing", "cryptography", "sigstore"):
        found = subprocess.run([str(bin_dir / "python"), "-c", f"import {module}"],
                               capture_output=True, timeout=60)
        assert found.returncode != 0, f"{module} is installed without the signing extra"

    registry = tmp_path / "registry"
    write_adapter(registry / "signed-v1", rank=4, seed=1)
    key = make_key(tmp_path / "keys", "publisher")
    sign_with_key(registry / "signed-v1", key)  # with this process's extra
    policy = key_policy(tmp_path / "keys", key)
    tool = str(bin_dir / "lora-sidecar")

    def refused(*args: str) -> str:
        done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (args, done.returncode, done.stdout, done.stderr)
        assert "lora-sidecar[signing]" in done.stderr, done.stderr
        return done.stderr

    refused("validate", str(registry / "signed-v1"), "--policy", str(policy))
    refused("sign", str(registry / "signed-v1"), "--key", str(key.private))
    refused("serve", "--registry", str(registry), "--cache-root", str(tmp_path / "refused"),
            "--signing-policy", str(policy), "--port", str(free_port()))
    assert not (tmp_path / "refused").exists()

    checked = subprocess.run([tool, "validate", str(registry / "signed-v1")],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(
            [tool, "serve", "--registry", str(registry), "--cache-root", str(tmp_path / "cache"),
             "--port", str(port), "--min-free-disk", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        eventually_blocking(lambda: http_status(f"{url}/readyz") == 200, timeout_s=60,
                            what=lambda: (tmp_path / "serve.log").read_text()[-2000:])
        status, body = stage_blocking(url, "signed-v1", 60, lease=False)
        assert status == 200, body
        assert body["signer"] is None
        published = tmp_path / "cache" / "adapters" / "signed-v1"
        assert (published / "model.sig").read_bytes() == (
            registry / "signed-v1" / "model.sig").read_bytes()
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    log_text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log_text, log_text[-3000:]
