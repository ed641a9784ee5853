"""`docker compose up`, for real: the node of compose/ started from its own files (the main file
plus the CPU profile) on a real Docker engine, from images built here with the project's
Dockerfiles, and called as a client calls it.

What this machine cannot have is stood in for, in the test only: the base image (a Debian made
with debootstrap, passed as the Dockerfiles' BASE_IMAGE), MinIO (moto's S3 server, built here,
under the `minio` service with its health check replaced), Prometheus's image (Debian's real
Prometheus laid out like it). Grafana's image cannot be had at all: its service is left out.
Everything else runs from compose/ unchanged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.process.examples import write_adapter
from tests.compose_up.docker import (
    IMAGE_PREFIX,
    REPO_ROOT,
    Built,
    ComposeProject,
    Docker,
    DockerError,
    build,
    debian_base,
    wheel_server,
)
from tests.engine.harness import (
    ENGINE_MODEL,
    MAX_TOKENS,
    PROMPT,
    EngineAssets,
    find_vllm_backend,
)
from tests.support.processes import free_port
from tests.support.waiting import eventually_blocking

COMPOSE = REPO_ROOT / "compose"
CLIENT = COMPOSE / "client.py"
IMAGES = Path(__file__).resolve().parent / "images"
TRITON_CPU_DOCKERFILE = COMPOSE / "triton-cpu" / "Dockerfile"
BACKEND_CONTEXT = COMPOSE / "triton-cpu" / "vllm_backend"
ENGINE_REQUIREMENTS = REPO_ROOT / "engine" / "requirements.txt"
# The services started: all but Grafana, whose image no registry here can serve.
SERVICES = ("minio", "minio-init", "sidecar", "triton", "prometheus")
HEALTH_CHECKED = ("minio", "sidecar", "triton")
# Adapter id in the registry -> the engine tier's good adapter it is a copy of.
ADAPTERS = {"support-v1": "f32-qv", "sql-v1": "tenant-0"}
# The wheels of the engine's PyTorch (PyPI's build: download.pytorch.org, where the small CPU
# build lives, is not reachable here) and of everything else it pins, downloaded once.
WHEELS = Path(os.environ.get("LORA_ENGINE_WHEELS") or REPO_ROOT / ".engine-wheels")
WHEELS_PORT = 47813
TEST_TORCH = {"TORCH_SPEC": "torch==2.9.1", "TORCH_INDEX_URL": "https://pypi.org/simple"}
NODE_TIMEOUT_S = 900.0
PROJECT_PREFIX = "lorasidecartest"  # compose projects of this test, and only of it
SIDECAR_UID = 10001
# Loopback and the compose network are never reached through a proxy the environment names.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _ca_bundle() -> Path | None:
    """The host's CA bundle, handed to pip in the builds as a BuildKit secret: registries are
    reached here through a TLS-inspecting gateway whose CA only the host trusts."""
    for candidate in (os.environ.get("LORA_TEST_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _fill_wheels() -> float:
    """Every wheel the CPU Triton image installs, into WHEELS; seconds spent. Offline first:
    when the folder is complete nothing is fetched."""
    start = time.monotonic()
    WHEELS.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", "--no-deps", "--dest", str(WHEELS), "-r",
            str(ENGINE_REQUIREMENTS)]
    offline = subprocess.run([*base, "--no-index", "--find-links", str(WHEELS)],
                             capture_output=True, text=True, timeout=300, check=False)
    if offline.returncode != 0:
        online = subprocess.run(base, capture_output=True, text=True, timeout=1800, check=False)
        assert online.returncode == 0, f"pip download of the engine failed:\n{online.stderr}"
    return time.monotonic() - start


@contextlib.contextmanager
def _stock_backend_in_context(cache: Path) -> Iterator[str]:
    """VLLM_BACKEND_FROM for the CPU Triton build: `context` with the stock backend's files
    copied into compose/triton-cpu/vllm_backend/ for the build (and removed after), as a user
    without GitHub does; `release` (the Dockerfile fetches the tag's files) when no copy is at
    hand."""
    mark = cache / "backend-copied-into-context"  # outside the build context
    if mark.exists():  # a copy left by a run that was killed: not the user's, made again
        shutil.rmtree(BACKEND_CONTEXT, ignore_errors=True)
        mark.unlink()
    if (BACKEND_CONTEXT / "model.py").is_file():  # a copy of the user's own: used as it is
        yield "context"
        return
    lookup = find_vllm_backend(cache)
    if lookup.path is None:
        try:
            yield "release"
        except DockerError as exc:  # the build could not fetch the files either: say where
            raise DockerError(  # the test looked, not only what the build's fetch answered
                f"{exc}\n\nThe CPU Triton image fetches the stock vLLM backend from GitHub "
                f"when no copy is at hand, and that failed. Looked for a copy: "
                f"{'; '.join(lookup.tried)}. {lookup.fix()}") from None
        return
    mark.touch()
    try:
        shutil.copytree(lookup.path, BACKEND_CONTEXT,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        license_file = lookup.path.parent / "LICENSE"
        if license_file.is_file():
            shutil.copy2(license_file, BACKEND_CONTEXT / "LICENSE")
        yield "context"
    finally:
        shutil.rmtree(BACKEND_CONTEXT, ignore_errors=True)
        mark.unlink(missing_ok=True)


@dataclass
class Images:
    sidecar: str
    triton: str
    s3: str
    prometheus: str
    dangling_before: set[str]


@pytest.fixture(scope="module")
def images(docker: Docker, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest, compose_figures: dict[str, str]) -> Images:
    """The project's images, built from its Dockerfiles with the test's base image (tags of
    their own). An image a rebuild replaced is removed, so no build leaves a dangling image."""
    for left in docker.remove_projects(PROJECT_PREFIX):
        logging.getLogger(__name__).warning("removed %s, left by a run that was killed", left)
    dangling_before = docker.dangling_images()
    start = time.monotonic()
    base = debian_base(docker, tmp_path_factory.mktemp("debian"))
    compose_figures["base image (debootstrap + import, or found)"] = (
        f"{time.monotonic() - start:.0f} s, {docker.image_size(base) / 1e6:.0f} MB")
    ca = _ca_bundle()
    compose_figures["engine wheels (pip download, or found)"] = f"{_fill_wheels():.0f} s"
    common = {"BASE_IMAGE": base}
    built: dict[str, Built] = {}
    built["sidecar"] = build(docker, f"{IMAGE_PREFIX}/sidecar:latest", REPO_ROOT,
                             build_args=common, ca_bundle=ca)
    backend_cache = Path(request.config.cache.mkdir("engine"))
    with wheel_server(WHEELS, WHEELS_PORT) as address, \
            _stock_backend_in_context(backend_cache) as backend_from:
        built["triton-cpu"] = build(
            docker, f"{IMAGE_PREFIX}/triton-cpu:latest", REPO_ROOT,
            dockerfile=TRITON_CPU_DOCKERFILE, ca_bundle=ca,
            build_args={**common, **TEST_TORCH, "VLLM_BACKEND_FROM": backend_from,
                        "WHEELS_URL": f"http://lora-wheels:{WHEELS_PORT}/"},
            extra=("--network", "host", "--add-host", f"lora-wheels:{address}"))
    built["s3"] = build(docker, f"{IMAGE_PREFIX}/s3:latest", IMAGES / "s3", build_args=common,
                        ca_bundle=ca)
    built["prometheus"] = build(docker, f"{IMAGE_PREFIX}/prometheus:latest",
                                IMAGES / "prometheus", build_args=common)
    for name, result in built.items():
        compose_figures[f"image {name}"] = (f"{result.size_bytes / 1e9:.2f} GB, built in "
                                            f"{result.seconds:.0f} s")
        if result.replaced and result.replaced in docker.dangling_images():
            docker.run("image", "rm", result.replaced)
    return Images(built["sidecar"].tag, built["triton-cpu"].tag, built["s3"].tag,
                  built["prometheus"].tag, dangling_before)


def _env_file(path: Path, settings: Mapping[str, str]) -> Path:
    """compose/.env.example with the test's values, as a user fills it in."""
    remaining = dict(settings)
    lines = []
    for line in (COMPOSE / ".env.example").read_text().splitlines():
        key = line.partition("=")[0].strip()
        if not line.startswith("#") and key in remaining:
            line = f"{key}={remaining.pop(key)}"
        lines.append(line)
    lines += [f"{key}={value}" for key, value in remaining.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Node:
    project: ComposeProject
    grpc_url: str
    http_url: str
    token: str
    workdir: Path
    since: float  # when `up` began (the engine's clock, for its event log)
    started_s: float

    def ask(self, adapter_id: str, *, prompt: str = PROMPT,
            max_tokens: int = MAX_TOKENS) -> subprocess.CompletedProcess[str]:
        """compose/client.py, as the README runs it."""
        return subprocess.run(
            [sys.executable, str(CLIENT), "--url", self.grpc_url, "--adapter-id", adapter_id,
             "--prompt", prompt, "--sampling-parameters", json.dumps({"max_tokens": max_tokens}),
             "--timeout", "300"],
            capture_output=True, text=True, timeout=330, check=False)

    def get(self, service: str, port: int, path: str) -> str:
        """GET from a service on the compose network (not published to the host); proxies
        left out."""
        url = f"http://{self.project.address(service)}:{port}{path}"
        with OPENER.open(url, timeout=10) as response:
            return str(response.read().decode())


def _metric(exposition: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain `labels`)."""
    total = 0.0
    for line in exposition.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="module")
def node(docker: Docker, images: Images, compose_assets: EngineAssets,
         tmp_path_factory: pytest.TempPathFactory, compose_figures: dict[str, str],
         compose_notes: list[str]) -> Iterator[Node]:
    workdir = tmp_path_factory.mktemp("compose-node")
    # A user's folders as they have them: the model as transformers saved it and adapters as
    # PEFT saved them (safetensors writes its files 0600, owned by whoever made them).
    model_dir = workdir / "model"
    shutil.copytree(compose_assets.base, model_dir)
    adapters_dir = workdir / "adapters"
    for adapter_id, kind in ADAPTERS.items():
        shutil.copytree(compose_assets.adapter(kind), adapters_dir / adapter_id)
    for weights in [*model_dir.glob("*.safetensors"), *adapters_dir.glob("*/*.safetensors")]:
        weights.chmod(0o600)  # as safetensors writes them, owned by this (root) user
    token = uuid.uuid4().hex
    http_port, grpc_port = free_port(), free_port()
    name = f"{PROJECT_PREFIX}{uuid.uuid4().hex[:8]}"
    env_file = _env_file(workdir / "test.env", {
        "COMPOSE_PROJECT_NAME": name,
        "MODEL_DIR": str(model_dir),
        "ADAPTERS_DIR": str(adapters_dir),
        "S3_SECRET_ACCESS_KEY": uuid.uuid4().hex,
        "SIDECAR_API_TOKEN": token,
        "GRAFANA_ADMIN_PASSWORD": uuid.uuid4().hex,
        "SIDECAR_IMAGE": images.sidecar,
        "TRITON_CPU_IMAGE": images.triton,
        "MINIO_IMAGE": images.s3,
        "PROMETHEUS_IMAGE": images.prometheus,
        "TRITON_HTTP_PORT": str(http_port),
        "TRITON_GRPC_PORT": str(grpc_port),
    })
    # The test's only change to the node: MinIO's command and health check (`mc`) do not fit the
    # S3 server standing in for it.
    override = workdir / "stand-ins.yml"  # JSON is YAML
    override.write_text(json.dumps({"services": {"minio": {
        "command": ["-H", "0.0.0.0", "-p", "9000"],
        "healthcheck": {"test": ["CMD", "/opt/moto/bin/python", "-c",
                                 "import urllib.request; urllib.request.urlopen("
                                 "'http://127.0.0.1:9000/', timeout=4)"]},
    }}}))
    project = ComposeProject(docker, name, [COMPOSE / "docker-compose.yml",
                                            COMPOSE / "docker-compose.cpu.yml", override],
                             env_file, workdir)
    compose_notes.append("grafana left out: its image (grafana/grafana) cannot be pulled and "
                         "Debian has no package of it; its dashboard's queries are checked "
                         "against Prometheus and the sidecar in tests/project/test_compose.py")
    start, since = time.monotonic(), time.time()
    try:
        project.run("up", "--detach", "--no-build", *SERVICES, timeout_s=NODE_TIMEOUT_S)
        up_s = time.monotonic() - start  # returns once Triton's container is started
        took = project.wait_healthy(HEALTH_CHECKED, NODE_TIMEOUT_S)
        started_s = time.monotonic() - start
        compose_figures["up to every health check green"] = (
            f"{started_s:.0f} s (`up` returned after {up_s:.0f} s, Triton healthy "
            f"{took['triton']:.0f} s later)")
        yield Node(project, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", token,
                   workdir, since, started_s)
    finally:
        # Logs for a failed run, then down (the last test checks what down leaves).
        for service in SERVICES:
            (workdir / f"{service}.log").write_text(project.logs(service, 400))
        project.run("down", "--volumes", "--remove-orphans", timeout_s=300, check=False)


def _peak_memory_bytes(container_id: str) -> int | None:
    """The container's peak memory use, from its cgroup (v1 or v2); None when not found."""
    for path in (f"/sys/fs/cgroup/memory/docker/{container_id}/memory.max_usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.peak"):
        with contextlib.suppress(OSError, ValueError):
            return int(Path(path).read_text())
    return None


# ---- the tests -------------------------------------------------------------------------------


@pytest.mark.timeout(3600)
def test_node_comes_up_with_every_adapter_uploaded_through_minio_init(node: Node) -> None:
    project = node.project
    for service in HEALTH_CHECKED:
        assert project.state(service)["Health"]["Status"] == "healthy"
    init = project.state("minio-init")
    assert (init["Status"], init["ExitCode"]) == ("exited", 0), project.logs("minio-init")
    uploaded = project.logs("minio-init")
    for adapter_id in ADAPTERS:
        assert re.search(rf"uploaded {re.escape(adapter_id)} \(\d+ bytes\)", uploaded), uploaded
    with OPENER.open(node.http_url + "/v2/health/ready", timeout=10) as ready:
        assert ready.status == 200


@pytest.mark.timeout(300)
def test_wiring_a_first_start_found_stays_fixed(node: Node) -> None:
    """Each thing the first real start of the node tripped over, checked on the running node."""
    project = node.project
    # Start order: MinIO healthy -> minio-init uploads and exits 0 -> sidecar healthy (its first
    # catalog rendered) -> Triton, whose vllm_model reads that catalog at its first load.
    events = project.events(node.since)

    def first(service: str, action: str) -> int:
        return next(t for t, name, what in events if name == service and what == action)

    healthy = "health_status: healthy"
    assert first("minio", healthy) < first("minio-init", "start"), events
    assert first("minio-init", "die") < first("sidecar", "start"), events
    assert first("sidecar", healthy) < first("triton", "start"), events
    assert project.state("minio-init")["ExitCode"] == 0
    # The catalog link across containers: what the sidecar rendered on its volume is what Triton
    # loaded through triton_repo's link. It carries spare names, which the base model's
    # config.json mounted in the sidecar makes possible: a new adapter needs no reload.
    catalog = json.loads(node.get("sidecar", 8500, "/catalog"))
    assert catalog["triton"]["loaded_generation"] == catalog["generation"], catalog
    assert catalog["spares"]["enabled"] and catalog["spares"]["total"] > 0, catalog
    # The sidecar: non-root, read-only root filesystem, /tmp a tmpfs, the cache volume its own.
    host = project.docker.inspect(project.container("sidecar"))
    assert host["Config"]["User"] == f"{SIDECAR_UID}:{SIDECAR_UID}"
    assert host["HostConfig"]["ReadonlyRootfs"] is True
    assert "/tmp" in host["HostConfig"]["Tmpfs"]
    # Triton on the CPU: the model's 0600 files are read by root holding only DAC_READ_SEARCH
    # (the image's own user could not: "No such file or directory" from safetensors), NUMA
    # memory policy allowed by SYS_NICE, no locked-memory ulimit the engine may not raise (the
    # container would not even start: "error setting rlimit type 8"), and the fp32 model not
    # downcast to bf16 (its answers would differ from the reference).
    host = project.docker.inspect(project.container("triton"))
    assert host["Config"]["User"] == "0:0"
    assert host["HostConfig"]["CapDrop"] == ["ALL"]
    assert sorted(host["HostConfig"]["CapAdd"]) == ["DAC_READ_SEARCH", "SYS_NICE"]
    assert not any(limit["Name"] == "memlock" for limit in host["HostConfig"]["Ulimits"] or [])
    weights = next((node.workdir / "model").glob("*.safetensors"))
    assert weights.stat().st_mode & 0o077 == 0  # the condition is there
    log = project.logs("triton", 100000)
    assert "mempolicy: Operation not permitted" not in log
    assert "Downcasting torch.float32" not in log


@pytest.mark.timeout(900)
def test_router_answers_each_adapter_with_its_reference_text(
    node: Node, compose_assets: EngineAssets, compose_figures: dict[str, str]
) -> None:
    texts = {adapter_id: compose_assets.text(kind) for adapter_id, kind in ADAPTERS.items()}
    assert len(set(texts.values())) == len(texts)  # each adapter says something of its own
    for adapter_id, expected in texts.items():
        start = time.monotonic()
        answer = node.ask(adapter_id)
        elapsed = time.monotonic() - start
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == expected + "\n", (adapter_id, answer.stdout, expected)
        waited = " (of which waiting out UNAVAILABLE: the catalog not yet confirmed)" if (
            "waiting: UNAVAILABLE" in answer.stderr) else ""
        compose_figures.setdefault("first answer after healthy (client.py, cold adapter)",
                                   f"{elapsed:.1f} s{waited}")
    # Each adapter is served by its own name or by a spare name bound to it, and the engine
    # serves the generation the sidecar rendered last.
    catalog = json.loads(node.get("sidecar", 8500, "/catalog"))
    served = set(catalog["adapter_ids"]) | {
        version.split("@")[0] for version in catalog["spares"]["bound"].values()}
    assert set(ADAPTERS) <= served, catalog
    assert catalog["triton"]["loaded_generation"] == catalog["generation"], catalog
    unknown = node.ask("no-such-adapter-v1")
    assert unknown.returncode == 1 and "no-such-adapter-v1" in unknown.stderr, unknown
    assert "waiting:" not in unknown.stderr  # an answer that will not change is not retried


@pytest.mark.timeout(300)
def test_prometheus_scrapes_the_sidecar(node: Node) -> None:
    query = urllib.parse.urlencode(
        {"query": 'lora_sidecar_stage_requests_total{job="lora-sidecar"}'})
    last: list[object] = []

    def scraped() -> bool:
        up = json.loads(node.get("prometheus", 9090, "/api/v1/query?" + urllib.parse.urlencode(
            {"query": 'up{job="lora-sidecar"}'})))
        stages = json.loads(node.get("prometheus", 9090, f"/api/v1/query?{query}"))
        last[:] = [up, stages]
        ups = [sample["value"][1] for sample in up["data"]["result"]]
        staged = sum(float(s["value"][1]) for s in stages["data"]["result"])
        # The router's calls of the test before are in what Prometheus scraped.
        return ups == ["1"] and staged >= len(ADAPTERS)

    # The scrape interval is 10 s: nothing to wait on but the next scrape.
    eventually_blocking(scraped, timeout_s=120, poll_s=2, what=lambda: f"scraped: {last}")


@pytest.mark.timeout(600)
def test_a_restarted_sidecar_serves_from_the_cache_it_left(
    node: Node, compose_assets: EngineAssets
) -> None:
    """The sidecar's container stopped and started again with a request waiting on it: the
    client rides out the router's UNAVAILABLE answers, and the new process serves both
    adapters from the cache volume without downloading anything."""
    project = node.project
    project.run("stop", "sidecar", timeout_s=120)
    adapter_id, kind = next(iter(ADAPTERS.items()))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(node.ask, adapter_id)
        # The request goes in and is answered UNAVAILABLE while nothing listens; the client
        # retries inside its own process, where this test sees no event: it waits a moment.
        time.sleep(3)
        project.run("start", "sidecar", timeout_s=120)
        answer = waiting.result(timeout=300)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout == compose_assets.text(kind) + "\n"
    assert "waiting: UNAVAILABLE" in answer.stderr  # it did wait for the restart
    project.wait_healthy(["sidecar"], 300)
    for adapter_id, kind in ADAPTERS.items():
        answer = node.ask(adapter_id)
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == compose_assets.text(kind) + "\n"
    metrics = node.get("sidecar", 8500, "/metrics")
    assert _metric(metrics, "lora_sidecar_download_bytes_total") == 0, "downloaded again"
    assert _metric(metrics, "lora_sidecar_stage_requests_total", 'result="hit"') >= len(ADAPTERS)
    assert _metric(metrics, "lora_sidecar_stage_requests_total", 'result="miss"') == 0


@pytest.mark.timeout(300)
def test_a_refused_adapter_fails_minio_init_with_its_reasons(node: Node) -> None:
    """What the README says of a refused adapter in ADAPTERS_DIR: minio-init exits 1 naming
    every reason (the node would not start), and uploads nothing of it."""
    bad = node.workdir / "adapters" / "too-big-rank-v1"
    write_adapter(bad, rank=32, shapes=ENGINE_MODEL, dtype="float32")  # max_lora_rank is 16
    try:
        result = node.project.run("run", "--rm", "minio-init", timeout_s=120, check=False)
    finally:
        shutil.rmtree(bad)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.search(r"refused too-big-rank-v1: .*rank", output), output
    for adapter_id in ADAPTERS:
        assert f"unchanged {adapter_id}" in output, output
    catalog = json.loads(node.get("sidecar", 8500, "/catalog"))
    assert "too-big-rank-v1" not in catalog["adapter_ids"]


@pytest.mark.timeout(600)
def test_down_leaves_nothing_behind(node: Node, docker: Docker, images: Images,
                                    compose_figures: dict[str, str]) -> None:
    project = node.project
    # No service crashed at any point of the run (its restart policy would hide it).
    restarts = {service: project.docker.inspect(project.container(service))["RestartCount"]
                for service in ("minio", "sidecar", "triton", "prometheus")}
    assert set(restarts.values()) == {0}, restarts
    for service in ("minio", "sidecar", "triton", "prometheus"):
        peak = _peak_memory_bytes(project.container(service))
        if peak is not None:
            compose_figures[f"peak memory {service}"] = f"{peak / 2**30:.2f} GiB"
    project.run("down", "--volumes", "--remove-orphans", timeout_s=300)
    label = f"com.docker.compose.project={project.name}"
    for kind in ("container", "network", "volume"):
        assert docker.labelled(kind, label) == [], f"{kind}s left by down -v"
    assert docker.dangling_images() <= images.dangling_before, "dangling images left"
    # Only the test's own tags remain of what it built.
    for tag in (images.sidecar, images.triton, images.s3, images.prometheus):
        assert docker.image_id(tag)
