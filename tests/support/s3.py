"""The S3 registry of the tests: a bucket on moto's server, reached through the recording proxy
(support/s3proxy.py), with helpers to upload adapters into it."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import boto3

from sidecar.process.examples import write_adapter
from tests.support.s3proxy import S3Proxy

BUCKET = "adapters"
PREFIX = "lora"


class S3Registry:
    """A bucket on the moto server, with helpers to upload adapters into it."""

    def __init__(self, moto_url: str, proxy: S3Proxy, tmp_path: Path) -> None:
        self.moto_url = moto_url
        self.proxy = proxy
        self.bucket = BUCKET
        self.prefix = PREFIX
        self._tmp = tmp_path / "s3-uploads"
        self.client = boto3.client(
            "s3", endpoint_url=moto_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )

    @property
    def registry(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def endpoint_url(self) -> str:
        """Where the sidecar talks to: through the recording proxy."""
        return self.proxy.url

    def key(self, adapter_id: str, name: str) -> str:
        return f"{self.prefix}/{adapter_id}/{name}"

    def put_adapter(self, adapter_id: str, **kwargs: Any) -> dict[str, bytes]:
        """Write an adapter with `write_adapter(**kwargs)` and upload it; return its files."""
        folder = self._tmp / adapter_id
        write_adapter(folder, **kwargs)
        return self.put_folder(adapter_id, folder)

    def put_folder(self, adapter_id: str, folder: Path) -> dict[str, bytes]:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        for name, data in files.items():
            self.put_object(self.key(adapter_id, name), data)
        return files

    def put_object(self, key: str, data: bytes, **kwargs: Any) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **kwargs)


def reset_moto(moto_url: str) -> None:
    """Forget every bucket and object of the moto server."""
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset",
                                                  method="POST"), timeout=10).close()


def set_moto_auth(moto_url: str, unauthenticated_calls: str) -> None:
    """Switch moto's credential checks on ("0": no call passes unsigned) or off ("inf")."""
    request = urllib.request.Request(
        f"{moto_url}/moto-api/reset-auth", data=unauthenticated_calls.encode(), method="POST",
        headers={"Content-Type": "text/plain"},  # a form type would swallow the body
    )
    urllib.request.urlopen(request, timeout=10).close()
