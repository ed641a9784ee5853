"""compose/upload_adapters.py (the minio-init service), run as minio-init runs it, and the bucket
it uploads into on moto's server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from tests.support.paths import REPO

UPLOAD_SCRIPT = REPO / "compose" / "upload_adapters.py"


@dataclass(frozen=True)
class Bucket:
    endpoint_url: str
    name: str

    @property
    def registry(self) -> str:
        return f"s3://{self.name}/team/adapters"

    def objects(self) -> dict[str, tuple[str, Any]]:
        """Key -> (ETag, LastModified) of every object in the bucket."""
        client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")
        listed = client.list_objects_v2(Bucket=self.name).get("Contents", [])
        return {item["Key"]: (item["ETag"], item["LastModified"]) for item in listed}


def upload(registry: str, endpoint_url: str, folder: Path, *extra: str,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The script as minio-init runs it: registry and endpoint from the sidecar's variables."""
    env = dict(os.environ, LORA_SIDECAR_REGISTRY=registry,
               LORA_SIDECAR_S3_ENDPOINT_URL=endpoint_url, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(UPLOAD_SCRIPT), str(folder), *extra],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
