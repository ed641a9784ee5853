"""`serve` as a real process: settings that cannot work stop the start (exit 2, every problem
listed, nothing created); a registry that does not answer does not (the sidecar starts and
/readyz says why)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from sidecar.process.examples import EXAMPLE_ADAPTERS, ensure_examples
from tests.support.api import StartSidecar, call
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.s3proxy import BodyFault
from tests.support.settings import s3_settings
from tests.support.waiting import eventually, eventually_blocking


def serve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def readyz(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_registry_folder_that_does_not_exist_stops_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "reg"
    result = serve("--registry", str(missing), "--cache-root", str(tmp_path / "cache"))

    assert result.returncode == 2, result.stderr
    assert "--registry (LORA_SIDECAR_REGISTRY)" in result.stderr
    assert f"the folder {missing} does not exist" in result.stderr
    assert "lora-sidecar examples" in result.stderr  # what to do next
    assert not (tmp_path / "cache").exists()
    assert "listening" not in result.stderr


def test_every_problem_is_listed_at_once_with_the_missing_registry(tmp_path: Path) -> None:
    result = serve("--registry", str(tmp_path / "nope"), "--max-bytes", "lots",
                   "--lease-ttl", "-1", "--cache-root", str(tmp_path / "cache"))

    assert result.returncode == 2
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert [p.split()[1] for p in problems] == ["--max-bytes", "--lease-ttl", "--registry"]


def test_a_port_in_use_names_the_setting_to_change_and_leaves_no_cache_behind(
    tmp_path: Path,
) -> None:
    (tmp_path / "registry").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, variable, extra in (("--port", "LORA_SIDECAR_PORT", []),
                                      ("--metrics-port", "LORA_SIDECAR_METRICS_PORT",
                                       ["--metrics-host", "127.0.0.1"])):
            listen = (["--port", str(port)] if flag == "--port"
                      else ["--metrics-port", str(port), *extra])
            result = serve("--registry", str(tmp_path / "registry"),
                           "--cache-root", str(tmp_path / "cache"), *listen)

            assert result.returncode == 1, result.stderr
            assert (f"cannot start: port {port} on 127.0.0.1 is already in use (another "
                    "lora-sidecar, or another program): stop it, or choose another port with "
                    f"{flag} ({variable})") in result.stderr
            assert "Errno" not in result.stderr
            # The cache root was made for the lock only: it goes again, .lock and all.
            assert not (tmp_path / "cache").exists()


def test_a_registry_path_that_is_a_file_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "registry").write_text("not a folder")
    result = serve("--registry", str(tmp_path / "registry"),
                   "--cache-root", str(tmp_path / "cache"))
    assert result.returncode == 2
    assert "is not a folder" in result.stderr


def test_a_pin_the_local_registry_does_not_hold_stops_the_start(tmp_path: Path) -> None:
    ensure_examples(tmp_path / "registry")
    result = serve("--registry", str(tmp_path / "registry"), "--cache-root",
                   str(tmp_path / "cache"), "--pin", f"nope-v1,{EXAMPLE_ADAPTERS[0]},also-nope")

    assert result.returncode == 2, result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 2
    assert "'nope-v1'" in problems[0] and "'also-nope'" in problems[1]
    for problem in problems:
        assert problem.startswith("  - --pin (LORA_SIDECAR_PIN)")
        assert all(adapter_id in problem for adapter_id in EXAMPLE_ADAPTERS)  # a typo shows
    assert not (tmp_path / "cache").exists()


def test_the_default_registry_is_judged_where_the_sidecar_runs(tmp_path: Path) -> None:
    result = serve(cwd=tmp_path)
    assert result.returncode == 2
    assert f"the folder {tmp_path / 'registry'} does not exist" in result.stderr

    ensure_examples(tmp_path / "registry")
    process = SidecarProcess(["--cache-root", str(tmp_path / "cache")],
                             tmp_path / "sidecar.log", cwd=tmp_path)
    try:
        eventually_blocking(lambda: readyz(process.url)[0] == 200, timeout_s=30, poll_s=0.1,
                            what="/readyz answering 200")
    finally:
        process.stop()


def test_a_pin_missing_from_an_s3_registry_that_answers_stops_the_start(
    tmp_path: Path, s3: S3Registry
) -> None:
    s3.put_adapter("present")
    result = serve("--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
                   "--cache-root", str(tmp_path / "cache"), "--pin", "present,nope-v1")

    assert result.returncode == 2, result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1
    assert "'nope-v1'" in problems[0] and s3.registry in problems[0]
    assert "it holds: present" in problems[0]


def test_an_s3_registry_that_does_not_answer_starts_not_ready_saying_why(
    tmp_path: Path
) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    process = SidecarProcess(
        ["--registry", "s3://adapters/lora", "--s3-endpoint-url", endpoint,
         "--s3-max-attempts", "1", "--cache-root", str(tmp_path / "cache"), "--pin", "p1"],
        tmp_path / "sidecar.log")
    try:
        status, body = readyz(process.url)
        assert status == 503
        message = str(body["message"])
        assert endpoint in message  # the registry is named as the reason
        assert "p1" in message  # and the pin still waiting
        assert process.process.poll() is None
        assert "could not check the pinned adapters at start" in process.log_text()
    finally:
        process.stop()


def test_an_s3_bucket_not_created_yet_does_not_stop_the_start(
    tmp_path: Path, s3: S3Registry
) -> None:
    process = SidecarProcess(
        ["--registry", "s3://bucket-made-later/lora", "--s3-endpoint-url", s3.endpoint_url,
         "--cache-root", str(tmp_path / "cache"), "--pin", "p1"],
        tmp_path / "sidecar.log")

    def naming_the_bucket() -> tuple[int, dict[str, object]] | None:
        status, body = readyz(process.url)
        return (status, body) if "bucket-made-later" in str(body.get("message")) else None

    try:
        status, body = eventually_blocking(naming_the_bucket, timeout_s=30, poll_s=0.2,
                                           what="/readyz naming the bucket")
        assert status == 503
        assert "bucket-made-later" in str(body["message"])

        s3.client.create_bucket(Bucket="bucket-made-later")
        ensure_examples(tmp_path / "examples")
        for path in (tmp_path / "examples" / EXAMPLE_ADAPTERS[0]).iterdir():
            s3.client.put_object(Bucket="bucket-made-later", Key=f"lora/p1/{path.name}",
                                 Body=path.read_bytes())
        eventually_blocking(lambda: readyz(process.url)[0] == 200, timeout_s=60, poll_s=0.2,
                            what=lambda: f"/readyz answering 200 (last {readyz(process.url)})")
    finally:
        process.stop()


async def test_a_second_sidecar_on_the_same_cache_root_stops_and_touches_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    s3.put_adapter("slow")
    s3.proxy.body_faults = [BodyFault(lambda seen: seen.method == "GET" and "slow/adapter_model"
                                      in seen.path, after_bytes=3000, mode="stall")]
    settings = s3_settings(tmp_path, s3)
    first = await start_sidecar(settings)
    staging = asyncio.create_task(call(http, "POST", f"{first.url}/stage",
                                       {"adapter_id": "slow"}))

    async def downloading() -> list[Path]:
        return list((settings.cache_root / ".staging").iterdir())

    in_flight = await eventually(downloading, timeout_s=30, what="a download in .staging/")

    second = await asyncio.to_thread(
        serve, "--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
        "--cache-root", str(settings.cache_root))
    assert second.returncode == 3, second.stderr
    assert f"in use by another lora-sidecar (pid {os.getpid()}" in second.stderr
    assert str(settings.cache_root) in second.stderr
    assert "--cache-root" in second.stderr
    assert list((settings.cache_root / ".staging").iterdir()) == in_flight

    s3.proxy.release_stalls()
    status, body = await staging
    assert status == 200, body
    assert (settings.cache_root / "adapters" / "slow").is_dir()
