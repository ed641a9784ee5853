"""The ways to stage an adapter that the benchmark compares: each `fetch` brings one adapter
from the registry into a local folder and is timed; `reset` (untimed) forgets it again."""

from __future__ import annotations

import http.client
import json
import resource
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from .adapters import BUCKET, PREFIX
from .hitpath import process_cpu_s
from .servers import S3_REGION, S3Server, Supervisor, free_port, wait_for_port

MIB = 1024 * 1024


class Stager(Protocol):
    name: str

    def fetch(self, adapter_id: str) -> Path: ...

    def reset(self, adapter_id: str) -> None: ...

    def cpu_s(self) -> float:
        """CPU seconds the client has used so far (user + system), a counter."""
        ...


def s3_client(endpoint_url: str, config: Config | None = None) -> Any:
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=S3_REGION, config=config
    )


class Boto3Stager:
    """The reference design's way: list the prefix with the paginator, then `download_file`
    one object after another. `transfer` None keeps boto3's defaults, as the reference did."""

    def __init__(
        self, name: str, server: S3Server, dest: Path, transfer: TransferConfig | None = None,
        client_config: Config | None = None,
    ) -> None:
        self.name = name
        self._client = s3_client(server.endpoint_url, client_config)
        self._transfer = transfer
        self._dest = dest

    def fetch(self, adapter_id: str) -> Path:
        folder = self._dest / adapter_id
        prefix = f"{PREFIX}/{adapter_id}/"
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
            for obj in page.get("Contents", []):
                target = folder / obj["Key"].removeprefix(prefix)
                target.parent.mkdir(parents=True, exist_ok=True)
                self._client.download_file(BUCKET, obj["Key"], str(target),
                                           Config=self._transfer)
        return folder

    def reset(self, adapter_id: str) -> None:
        shutil.rmtree(self._dest / adapter_id, ignore_errors=True)

    def cpu_s(self) -> float:
        return time.process_time()  # its threads run in this process, which waits meanwhile


def tuned_boto3(server: S3Server, dest: Path) -> Boto3Stager:
    """boto3 given what an operator would tune: many threads, a pool to match, 8 MiB parts."""
    concurrency = 32
    return Boto3Stager(
        "boto3, tuned",
        server,
        dest,
        TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB,
                       max_concurrency=concurrency, io_chunksize=1 * MIB),
        Config(max_pool_connections=concurrency),
    )


class CommandStager:
    """A command-line tool, timed as an operator runs it: the whole process."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], dest: Path) -> None:
        self.name = name
        self._argv = argv  # "{src}" and "{dst}" are filled in per adapter
        self._env = dict(env)
        self._dest = dest

    def fetch(self, adapter_id: str) -> Path:
        folder = self._dest / adapter_id
        folder.mkdir(parents=True, exist_ok=True)
        src = f"s3://{BUCKET}/{PREFIX}/{adapter_id}/"
        argv = [a.format(src=src, dst=f"{folder}/") for a in self._argv]
        done = subprocess.run(argv, env=self._env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name} failed ({done.returncode}): {done.stderr[-2000:]}")
        return folder

    def reset(self, adapter_id: str) -> None:
        shutil.rmtree(self._dest / adapter_id, ignore_errors=True)

    def cpu_s(self) -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children that have ended
        return usage.ru_utime + usage.ru_stime


def aws_cli(aws: Path, server: S3Server, env: Mapping[str, str], dest: Path) -> CommandStager:
    argv = [str(aws), "s3", "cp", "--recursive", "--only-show-errors", "--no-progress",
            "--endpoint-url", server.endpoint_url, "{src}", "{dst}"]
    return CommandStager("aws s3 cp", argv, env, dest)


def s5cmd(
    binary: Path, server: S3Server, env: Mapping[str, str], dest: Path, *, tuned: bool = False
) -> CommandStager:
    """s5cmd at its defaults (ranges of 50 MB, 5 at a time per file), or tuned to the same
    ranges and parallelism as the sidecar's defaults."""
    flags = ["--concurrency", "16", "--part-size", "8"] if tuned else []
    argv = [str(binary), "--log", "error", "--endpoint-url", server.endpoint_url, "cp",
            *flags, "{src}*", "{dst}"]
    return CommandStager("s5cmd cp, tuned" if tuned else "s5cmd cp", argv, env, dest)


class CrtStager(CommandStager):
    """awscrt's S3 client with the sidecar's checks (benchmarks/crt_get.py), timed as a whole
    process like the other commands."""

    def __init__(self, python: Path, server: S3Server, env: Mapping[str, str], dest: Path,
                 objects: Mapping[str, list[tuple[str, int]]]) -> None:
        script = str(Path(__file__).resolve().parent / "crt_get.py")
        super().__init__("awscrt + the sidecar's checks",
                         [str(python), script, server.endpoint_url, S3_REGION, BUCKET, "{dst}"],
                         env, dest)
        self._objects = objects  # adapter id -> (key, size) of each file

    def fetch(self, adapter_id: str) -> Path:
        argv = self._argv
        self._argv = [*argv, *(f"{key}:{size}" for key, size in self._objects[adapter_id])]
        try:
            return super().fetch(adapter_id)
        finally:
            self._argv = argv


class SidecarStager:
    """The real `lora-sidecar serve` in a process of its own; a fetch is one cold POST /stage,
    a reset releases the lease and evicts the adapter."""

    name = "sidecar"

    def __init__(
        self, sup: Supervisor, command: list[str], server: S3Server, cache_root: Path,
        env: Mapping[str, str], extra_args: tuple[str, ...] = (), name: str = "sidecar",
    ) -> None:
        self.name = name
        self._sup = sup
        self._cache_root = cache_root
        self.port = free_port()
        shutil.rmtree(cache_root, ignore_errors=True)
        cache_root.mkdir(parents=True)
        argv = [
            *command, "serve",
            "--registry", f"s3://{BUCKET}/{PREFIX}",
            "--s3-endpoint-url", server.endpoint_url,
            "--s3-region", S3_REGION,
            "--cache-root", str(cache_root),
            "--port", str(self.port),
            "--max-lora-rank", "128",
            "--catalog-refresh", "3600",
            "--log-level", "WARNING",
            *extra_args,
        ]
        label = name.replace(" ", "-").replace("(", "").replace(")", "")
        self.proc = sup.start(f"{label}-{server.label}", argv, env)
        wait_for_port("127.0.0.1", self.port, self.proc, "the sidecar")
        self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        self._leases: dict[str, str] = {}
        self._wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None
              ) -> tuple[int, Any]:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        self._conn.request(method, path, body=payload, headers=headers)
        response = self._conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self._call("GET", "/readyz")
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the sidecar is not ready after {timeout_s:.0f} s: {body}")
            time.sleep(0.1)

    def stage(self, adapter_id: str) -> dict[str, Any]:
        status, body = self._call("POST", "/stage", {"adapter_id": adapter_id})
        if status != 200:
            raise RuntimeError(f"POST /stage {adapter_id}: {status} {body}")
        self._leases[adapter_id] = body["lease_id"]
        result: dict[str, Any] = body
        return result

    def fetch(self, adapter_id: str) -> Path:
        body = self.stage(adapter_id)
        if body["cached"]:
            raise RuntimeError(f"POST /stage {adapter_id} was a hit; the run is not cold")
        return Path(body["local_path"])

    def reset(self, adapter_id: str) -> None:
        lease_id = self._leases.pop(adapter_id, None)
        if lease_id is not None:
            self._call("POST", "/release", {"lease_id": lease_id})
        status, body = self._call("POST", "/evict", {"adapter_id": adapter_id, "force": True})
        if status not in (200, 404):
            raise RuntimeError(f"POST /evict {adapter_id}: {status} {body}")
        # Evicted folders are deleted in the background; wait so the next run starts quiet.
        trash = self._cache_root / ".trash"
        deadline = time.monotonic() + 60
        while trash.exists() and any(trash.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def cpu_s(self) -> float:
        return process_cpu_s(self.pid)

    def close(self) -> None:
        self._conn.close()
        self._sup.stop(self.proc)
