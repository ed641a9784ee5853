"""A real `tritonserver` for tests, from the nvidia-pytriton wheel: its own backend directory
(the Python backend plus, as backend `vllm`, the CPU stand-in or the stock vLLM backend), a copy
of triton_repo whose catalog link points at the test's cache, free ports, explicit model control.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.support.waiting import eventually_blocking

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_REPO = REPO_ROOT / "triton_repo"
STANDIN_DIR = Path(__file__).resolve().parent / "standin_vllm"
CATALOG_LINK = Path("vllm_model") / "1" / "multi_lora.json"
ROUTER = "multilora_router"
VLLM_MODEL = "vllm_model"
ADAPTER_HEADER = "x-adapter-id"
# How a deployment starts Triton so the router sees the header a routing proxy hashes on.
HEADER_FORWARD_ARGS = (f"--grpc-header-forward-pattern=^{ADAPTER_HEADER}$",
                       f"--http-header-forward-pattern=^{ADAPTER_HEADER}$")


def import_router(module: str = "routing") -> ModuleType:
    """A module of the router (multilora_router/1/) imported as Triton's Python backend imports
    it: with its folder on sys.path, so the modules beside it import too. Nothing is compiled
    into a __pycache__ inside the checked-in model repository."""
    folder = str(TRITON_REPO / ROUTER / "1")
    if folder not in sys.path:
        sys.path.append(folder)
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return importlib.import_module(module)
    finally:
        sys.dont_write_bytecode = saved


def pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def build_backends(dest: Path, vllm_backend: Path | None = None) -> Path:
    """Copies, not links: Triton refuses a backend library whose real path leaves the dir.
    Backend `vllm` is the stock backend's folder (model.py, utils/) when given, unmodified;
    otherwise the CPU stand-in."""
    source = pytriton_dir()
    python_dir = dest / "python"
    python_dir.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(source / "backends" / "python" / name, python_dir / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(source / "python_backend_stubs" / version / "triton_python_backend_stub",
                 python_dir / "triton_python_backend_stub")
    vllm_dir = dest / "vllm"
    if vllm_backend is not None:
        vllm_dir.mkdir()
        shutil.copy2(vllm_backend / "model.py", vllm_dir / "model.py")
        shutil.copytree(vllm_backend / "utils", vllm_dir / "utils",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return dest
    vllm_dir.mkdir()
    for name in ("model.py", "answer.py"):
        shutil.copy2(STANDIN_DIR / name, vllm_dir / name)
    return dest


def copy_model_repository(dest: Path, catalog_path: Path,
                          engine_args: Mapping[str, Any] | None = None,
                          source: Path = TRITON_REPO) -> Path:
    """triton_repo as checked in (or `source`), but for the one link to the catalog the sidecar
    renders and, when given, the engine settings (vllm_model/1/model.json) of the test's
    machine."""
    shutil.copytree(source, dest, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    link = dest / CATALOG_LINK
    link.unlink()
    link.symlink_to(catalog_path)
    if engine_args is not None:
        (dest / VLLM_MODEL / "1" / "model.json").write_text(json.dumps(engine_args, indent=2))
    return dest


def router_config(sidecar_url: str, *, instances: int | None = None,
                  repository: Path = TRITON_REPO, **parameters: str) -> str:
    """The router's checked-in config.pbtxt as JSON with other parameter values (and instance
    count), for a load with a config override: the files stay as checked in."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    text_format.Parse((repository / ROUTER / "config.pbtxt").read_text(), config)
    for key, value in {"sidecar_url": sidecar_url, **parameters}.items():
        config.parameters[key].string_value = value
    if instances is not None:
        config.instance_group[0].count = instances
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


@dataclass
class TritonServer:
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @classmethod
    def start(cls, workdir: Path, catalog_path: Path, *, env: Mapping[str, str] | None = None,
              ready_timeout_s: float = 60.0, vllm_backend: Path | None = None,
              python_venv: Path | None = None,
              engine_args: Mapping[str, Any] | None = None,
              ports: tuple[int, int] | None = None,
              args: Sequence[str] = HEADER_FORWARD_ARGS,
              http_port: int | None = None, source: Path = TRITON_REPO) -> TritonServer:
        """`vllm_backend`: the stock backend's folder (else the stand-in); `python_venv`: the
        environment the Python models run in (else this interpreter's); `engine_args`: the
        model.json of vllm_model (else the checked-in one); `ports`: (HTTP, gRPC), for a restart
        where clients expect the server (`http_port`: the HTTP one only); `args`: more
        tritonserver flags; `source`: the model repository to copy."""
        backends = build_backends(workdir / "backends", vllm_backend)
        repository = copy_model_repository(workdir / "model_repository", catalog_path,
                                           engine_args, source)
        libs = pytriton_dir().parent.parent / "nvidia_pytriton.libs"
        python_bin = python_venv / "bin" if python_venv else Path(sys.executable).parent
        libdir = sysconfig.get_config_var("LIBDIR")
        if python_venv is not None:
            libdir = subprocess.run(
                [str(python_bin / "python"), "-c",
                 "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        libpython = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
        if not (Path(libdir) / libpython).exists():
            raise RuntimeError(f"the Python backend stub needs {libpython}, which is not in "
                               f"{libdir}: use a Python built with --enable-shared (pyenv's "
                               "is), or install Debian's libpython3.11")
        # The router reads LORA_SIDECAR_* from its environment; a developer's own must not
        # leak into the test's server.
        child_env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("LORA_SIDECAR_", "AWS_"))}
        # The stub finds its packages through the first python3 on PATH, and it embeds
        # libpython, which lives in the interpreter's LIBDIR.
        child_env["PATH"] = f"{python_bin}{os.pathsep}{child_env.get('PATH', '')}"
        child_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(libs), libdir, child_env.get("LD_LIBRARY_PATH")) if p
        )
        child_env.update(env or {})
        http_port, grpc_port = ports or (http_port or free_port(), free_port())
        log_path = workdir / "tritonserver.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    str(pytriton_dir() / "bin" / "tritonserver"),
                    f"--model-repository={repository}",
                    f"--backend-directory={backends}",
                    "--model-control-mode=explicit",
                    f"--http-port={http_port}",
                    f"--grpc-port={grpc_port}",
                    "--allow-metrics=false",
                    "--exit-timeout-secs=2",
                    "--log-verbose=0",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
        server = cls(process, http_port, grpc_port, log_path)
        try:
            server._wait_ready(ready_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, timeout_s: float) -> None:
        def ready() -> bool:  # a starting process: there is no event to wait on but its answer
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}):\n"
                                   + self.log_tail())
            try:
                with urllib.request.urlopen(self.http_url + "/v2/health/ready", timeout=1):
                    return True
            except (urllib.error.URLError, OSError):
                return False

        try:
            eventually_blocking(ready, timeout_s=timeout_s, poll_s=0.05, what="tritonserver ready")
        except AssertionError:
            raise TimeoutError(f"tritonserver not ready after {timeout_s} s:\n"
                               + self.log_tail()) from None

    def _post(self, path: str, body: Mapping[str, Any] | None = None,
              timeout_s: float = 120.0) -> None:
        request = urllib.request.Request(self.http_url + path, method="POST",
                                         data=json.dumps(body or {}).encode())
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return
        except urllib.error.HTTPError as exc:
            with exc:
                detail = exc.read().decode("utf-8", "replace")
            raise RuntimeError(f"POST {path}: {exc.code} {detail}\n" + self.log_tail()) from None

    def load(self, model: str, config_json: str | None = None) -> None:
        body = {"parameters": {"config": config_json}} if config_json else None
        self._post(f"/v2/repository/models/{model}/load", body)

    def unload(self, model: str) -> None:
        self._post(f"/v2/repository/models/{model}/unload")

    def model_states(self) -> dict[str, str]:
        request = urllib.request.Request(self.http_url + "/v2/repository/index", method="POST",
                                         data=b"{}")
        with urllib.request.urlopen(request, timeout=10) as response:
            return {m["name"]: m.get("state", "") for m in json.loads(response.read())}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        # The stubs and vLLM's engine processes are in the server's session; whatever of them
        # outlived the server (an EngineCore spins a core when abandoned) ends with it.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait(timeout=10)
