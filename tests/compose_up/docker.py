"""A real Docker engine for tests: the machine's client and daemon (Debian's docker.io or Docker
CE; the daemon started here when none answers, and stopped again), images built from the
project's Dockerfiles on a Debian base made locally with debootstrap (no image registry is
reachable), and a compose project driven by Debian's docker-compose 1.29.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.support.waiting import eventually_blocking

REPO_ROOT = Path(__file__).resolve().parents[2]
# The packaged client (Debian's docker.io, or Docker CE's with buildx): it builds with BuildKit
# secrets. A newer static client elsewhere on PATH without the buildx plugin cannot build with
# BuildKit at all.
DEBIAN_DOCKER = Path("/usr/bin/docker")
INSTALL_HINT = "run scripts/install-system-deps.sh --docker (a Docker engine, debootstrap)"


def _dockerd() -> Path | None:
    """The daemon to start: Debian's (/usr/sbin) or Docker CE's (/usr/bin), whichever is here."""
    found = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    return Path(found) if found else None
IMAGE_PREFIX = "lora-sidecar-test"


class DockerError(AssertionError):
    """A docker command failed; the message holds its output."""


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Docker:
    """Debian's docker client, with BuildKit."""

    executable: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def find(cls) -> Docker:
        executable = str(DEBIAN_DOCKER) if DEBIAN_DOCKER.exists() else shutil.which("docker")
        if executable is None:
            raise DockerError(f"no docker client: {INSTALL_HINT}")
        env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        return cls(executable, env)

    def run(self, *args: str, timeout_s: float = 120.0, check: bool = True,
            stdin: IO[bytes] | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.executable, *args], env=self.env, stdin=stdin,
                                capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise DockerError(f"docker {' '.join(args[:3])} failed ({result.returncode}):\n"
                              + _tail(result.stdout + result.stderr))
        return result

    def answers(self) -> bool:
        return self.run("info", "--format", "{{.ServerVersion}}", timeout_s=20,
                        check=False).returncode == 0

    def image_id(self, reference: str) -> str | None:
        result = self.run("image", "inspect", "--format", "{{.Id}}", reference, check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def image_size(self, reference: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", reference).stdout)

    def dangling_images(self) -> set[str]:
        out = self.run("images", "--quiet", "--no-trunc", "--filter", "dangling=true").stdout
        return set(out.split())

    def labelled(self, kind: str, label: str) -> list[str]:
        """Containers, networks or volumes carrying a label (`key=value`)."""
        args = {"container": ("ps", "--all", "--quiet"), "network": ("network", "ls", "--quiet"),
                "volume": ("volume", "ls", "--quiet")}[kind]
        return self.run(*args, "--filter", f"label={label}").stdout.split()

    def remove_projects(self, prefix: str) -> list[str]:
        """Compose projects whose names start with `prefix` (a killed run's, which dockerd
        restarts with their restart policy): their containers, networks and volumes removed."""
        label = '{{.Label "com.docker.compose.project"}}'
        listed = (self.run("ps", "--all", "--format", label).stdout
                  + self.run("network", "ls", "--format", label).stdout
                  + self.run("volume", "ls", "--format", label).stdout)
        names = sorted({name for name in listed.split() if name.startswith(prefix)})
        for name in names:
            project = f"com.docker.compose.project={name}"
            if containers := self.labelled("container", project):
                self.run("rm", "--force", "--volumes", *containers)
            if networks := self.labelled("network", project):
                self.run("network", "rm", *networks)
            if volumes := self.labelled("volume", project):
                self.run("volume", "rm", "--force", *volumes)
        return names

    def inspect(self, container: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(self.run("inspect", container).stdout)
        return data[0]


@contextlib.contextmanager
def docker_engine(workdir: Path) -> Iterator[Docker]:
    """A Docker engine that answers: the running one, or a dockerd started here (root only)
    and stopped at the end, with nothing else of the machine touched."""
    docker = Docker.find()
    if docker.answers():
        yield docker
        return
    dockerd = _dockerd()
    if dockerd is None:
        raise DockerError(f"no Docker engine answers and dockerd is not installed: {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise DockerError("no Docker engine answers, and starting dockerd needs root: start "
                          "Docker (systemctl start docker) or run the tests as root")
    log_path = workdir / "dockerd.log"
    with log_path.open("wb") as log:
        daemon = subprocess.Popen([str(dockerd)], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        _wait_answering(docker, daemon, log_path)
        yield docker
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)  # dockerd stops the containerd it started
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)


def _wait_answering(docker: Docker, daemon: subprocess.Popen[bytes], log_path: Path) -> None:
    """Until the dockerd just started answers; with its log's tail if it exits or does not."""

    def answering() -> bool:  # a starting daemon: nothing to wait on but its answer
        if docker.answers():
            return True
        if daemon.poll() is not None:
            raise DockerError("dockerd exited")
        return False

    try:
        eventually_blocking(answering, timeout_s=60, poll_s=0.5, what="dockerd answering")
    except (AssertionError, DockerError):
        raise DockerError("dockerd did not start:\n"
                          + _tail(log_path.read_text(errors="replace"))) from None


# ---- the local base image ------------------------------------------------------------------

# What the project's Dockerfiles need of a base: Python 3.11 with venv, the shared libpython the
# Triton Python backend stub embeds, CA certificates, and apt (minbase has it).
BASE_PACKAGES = ("python3", "python3-venv", "libpython3.11", "ca-certificates")
DEBIAN_MIRROR = os.environ.get("LORA_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")


def debian_base(docker: Docker, workdir: Path) -> str:
    """A minimal Debian bookworm image from Debian's packages, made once (tagged by what made
    it); stands in for the pinned python:3.11-slim base that no registry here can serve."""
    recipe = json.dumps({"suite": "bookworm", "packages": BASE_PACKAGES, "mirror": DEBIAN_MIRROR})
    tag = f"{IMAGE_PREFIX}/debian:bookworm-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if docker.image_id(tag):
        return tag
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not Path(debootstrap).exists():
        raise DockerError(f"debootstrap is missing: {INSTALL_HINT}")
    rootfs = workdir / "rootfs"
    try:
        result = subprocess.run(
            [debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", str(rootfs), DEBIAN_MIRROR],
            capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0:
            raise DockerError(f"debootstrap failed:\n{_tail(result.stdout + result.stderr)}")
        # Streamed: the tree is some 280 MB.
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        with tar.stdout:
            docker.run("import", "--change", 'CMD ["/bin/bash"]', "-", tag, stdin=tar.stdout,
                       timeout_s=600)
        if tar.wait(60) != 0:
            raise DockerError(f"tar of {rootfs} failed ({tar.returncode})")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return tag


# ---- wheels for an offline engine build -----------------------------------------------------


@contextlib.contextmanager
def wheel_server(folder: Path, port: int) -> Iterator[str]:
    """Serve a folder of wheels to `docker build --network host` on a loopback address of its
    own; yields the address. The URL the build sees is always http://lora-wheels:<port>/, so
    the build's cache key does not change from run to run."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    last_error: OSError | None = None
    for _ in range(20):
        address = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(1, 254)}"
        try:
            server = http.server.ThreadingHTTPServer((address, port), handler)
            break
        except OSError as exc:
            last_error = exc
    else:
        raise DockerError(f"no loopback address free for port {port}: {last_error}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


# ---- builds -------------------------------------------------------------------------------


@dataclass
class Built:
    tag: str
    seconds: float
    size_bytes: int
    replaced: str | None  # the image the tag named before, when this build moved it


def build(docker: Docker, tag: str, context: Path, *, dockerfile: Path | None = None,
          build_args: Mapping[str, str] | None = None, ca_bundle: Path | None = None,
          extra: Sequence[str] = (), timeout_s: float = 1800.0) -> Built:
    before = docker.image_id(tag)
    args = ["build", "--progress=plain", "--tag", tag]
    if dockerfile is not None:
        args += ["--file", str(dockerfile)]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    if ca_bundle is not None:
        args += ["--secret", f"id=ca,src={ca_bundle}"]
    args += [*extra, str(context)]
    start = time.monotonic()
    docker.run(*args, timeout_s=timeout_s)
    seconds = time.monotonic() - start
    after = docker.image_id(tag)
    replaced = before if before and before != after else None
    return Built(tag, seconds, docker.image_size(tag), replaced)


# ---- compose -----------------------------------------------------------------------------


@dataclass
class ComposeProject:
    docker: Docker
    name: str
    files: Sequence[Path]
    env_file: Path
    log_dir: Path

    def run(self, *args: str, timeout_s: float = 300.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        executable = shutil.which("docker-compose")
        if executable is None:
            raise DockerError(f"docker-compose is missing: {INSTALL_HINT}")
        command = [executable, "--project-name", self.name, "--env-file", str(self.env_file)]
        for path in self.files:
            command += ["--file", str(path)]
        # A clean environment: a variable exported in the developer's shell would win over the
        # env file.
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.log_dir)}
        if "DOCKER_HOST" in os.environ:
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        result = subprocess.run([*command, *args], env=env, capture_output=True, text=True,
                                timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise DockerError(f"docker-compose {' '.join(args[:2])} failed "
                              f"({result.returncode}):\n" + _tail(result.stdout + result.stderr))
        return result

    def container(self, service: str) -> str:
        ids = self.run("ps", "--all", "--quiet", service).stdout.split()
        if not ids:
            raise DockerError(f"no container for service {service}")
        return ids[0]

    def state(self, service: str) -> dict[str, Any]:
        state: dict[str, Any] = self.docker.inspect(self.container(service))["State"]
        return state

    def address(self, service: str) -> str:
        """The service's address on the project's network (reachable from this host)."""
        networks = self.docker.inspect(self.container(service))["NetworkSettings"]["Networks"]
        return str(next(iter(networks.values()))["IPAddress"])

    def events(self, since: float) -> list[tuple[int, str, str]]:
        """(time in ns, service, action) of the project's container events since a time:
        create, start, die, `health_status: healthy`, ... in the order the engine saw them."""
        out = self.docker.run(
            "events", "--since", f"{since:.3f}", "--until", f"{time.time():.3f}",
            "--filter", "type=container",
            "--filter", f"label=com.docker.compose.project={self.name}",
            "--format", "{{json .}}").stdout
        events = []
        for line in out.splitlines():
            event = json.loads(line)
            service = event["Actor"]["Attributes"].get("com.docker.compose.service", "")
            events.append((int(event["timeNano"]), service, str(event["Action"])))
        return sorted(events)

    def logs(self, service: str, tail: int = 80) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def wait_healthy(self, services: Sequence[str], timeout_s: float) -> dict[str, float]:
        """Wait until every service is healthy; return the seconds each took from now. A
        service that exits, turns unhealthy or was restarted by its restart policy fails at
        once, with its log."""
        start = time.monotonic()
        took: dict[str, float] = {}

        def all_healthy() -> bool:
            for service in services:
                if service in took:
                    continue
                container = self.docker.inspect(self.container(service))
                state = container["State"]
                health = (state.get("Health") or {}).get("Status")
                # Checked first: `restart: unless-stopped` hides a crash (an engine that failed
                # to load starts again, and may even turn healthy before crashing once more).
                if state["Restarting"] or container["RestartCount"] > 0:
                    raise DockerError(f"{service} restarted (crashed):\n"
                                      + self.logs(service, 200))
                if health == "healthy":
                    took[service] = time.monotonic() - start
                elif health == "unhealthy" or state["Status"] in ("exited", "dead"):
                    raise DockerError(f"{service} is {health or state['Status']}:\n"
                                      + self.logs(service))
            return len(took) == len(services)

        try:
            # Health checks run every few seconds: nothing to wait on but them.
            eventually_blocking(all_healthy, timeout_s=timeout_s, poll_s=1,
                                what="every service healthy")
        except AssertionError:
            waiting = sorted(set(services) - set(took))
            raise DockerError(f"not healthy after {timeout_s:.0f} s: {waiting}\n"
                              + "\n".join(self.logs(s, 30) for s in waiting)) from None
        return took
