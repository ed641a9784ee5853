"""Upload a local folder of adapters (one sub-folder per adapter id) into an S3 registry.

The compose file's one-shot `minio-init` service runs it; it works against any S3 endpoint.
Adapters are validated with the sidecar's rules (its signing policy included) first; files
already there unchanged are skipped. Only the files the sidecar fetches are sent
(sidecar/validation/files.py): what PEFT, Trainer or `hf download` leave beside an adapter
(README.md, training_args.bin, .cache/) is left out.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from sidecar.config import Settings
from sidecar.core.errors import ConfigError
from sidecar.core.ids import is_valid_adapter_id
from sidecar.validation.files import CONFIG_FILE, listed, plan_folder
from sidecar.validation.signatures import verify_folder
from sidecar.validation.validate import Rules, judge_adapter, summarize

# put_object is one request; larger files would need a multipart upload, which no adapter needs.
MAX_FILE_BYTES = 5 * 1024**3
_HASH_CHUNK_BYTES = 8 * 1024**2
# Written last, so that anyone listing the registry mid-upload who sees an adapter's config
# also sees the weights it describes.
_LAST_FILE = CONFIG_FILE


class UploadError(Exception):
    """An adapter that was not uploaded; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Registry:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Registry:
        if not url.startswith("s3://"):
            raise ValueError(f"registry {url!r}: use s3://bucket/prefix")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"registry {url!r}: no bucket name")
        return cls(bucket, prefix.strip("/"))

    def key(self, adapter_id: str, file_name: str) -> str:
        parts = (self.prefix, adapter_id, file_name) if self.prefix else (adapter_id, file_name)
        return "/".join(parts)


@dataclass(frozen=True, slots=True)
class RemoteObject:
    size_bytes: int
    etag: str

    @property
    def is_multipart(self) -> bool:
        # A multipart ETag is "<md5 of part md5s>-<part count>", not the content's MD5.
        return "-" in self.etag


@dataclass(frozen=True, slots=True)
class LocalFile:
    name: str
    path: Path
    size_bytes: int
    md5_hex: str


def _md5_hex(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _adapter_files(folder: Path) -> tuple[list[LocalFile], tuple[str, ...]]:
    """The files the sidecar would fetch, config last, and the entries it leaves out."""
    plan = plan_folder(folder)
    if _LAST_FILE not in plan.fetched:
        raise UploadError(f"no {_LAST_FILE} (is this a PEFT LoRA adapter folder?)")
    files: list[LocalFile] = []
    for name in plan.fetched:
        path = folder / name
        size_bytes = path.stat().st_size
        if size_bytes > MAX_FILE_BYTES:
            raise UploadError(f"{path.name} is larger than {MAX_FILE_BYTES} bytes")
        files.append(LocalFile(path.name, path, size_bytes, _md5_hex(path)))
    return sorted(files, key=lambda f: f.name == _LAST_FILE), plan.ignored


def _is_same(local: LocalFile, remote: RemoteObject) -> bool:
    if remote.size_bytes != local.size_bytes:
        return False
    # Someone else's multipart upload: its ETag is not an MD5, so only the size can be compared.
    return remote.is_multipart or remote.etag == local.md5_hex


class Uploader:
    def __init__(self, client: Any, registry: Registry, *, rules: Rules | None = None,
                 overwrite: bool = False) -> None:
        self._client = client
        self.registry = registry
        self._rules = rules
        self._overwrite = overwrite

    def ensure_bucket(self) -> bool:
        """Create the bucket if it is missing; True when it was created."""
        try:
            self._client.head_bucket(Bucket=self.registry.bucket)
            return False
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                raise
        region = self._client.meta.region_name
        kwargs: dict[str, Any] = {"Bucket": self.registry.bucket}
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(**kwargs)
        except ClientError as exc:
            # Another uploader may have won the race; the bucket is ours either way.
            if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise
        return True

    def _remote_objects(self, adapter_id: str) -> dict[str, RemoteObject]:
        prefix = self.registry.key(adapter_id, "")
        found: dict[str, RemoteObject] = {}
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.registry.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                name = item["Key"].removeprefix(prefix)
                found[name] = RemoteObject(int(item["Size"]), item["ETag"].strip('"'))
        return found

    def upload_adapter(self, adapter_id: str, folder: Path) -> tuple[int, tuple[str, ...]]:
        """Upload one adapter; return the bytes sent (0 when it was already there) and the
        entries left out."""
        files, ignored = _adapter_files(folder)
        if self._rules is not None:
            # The sidecar would refuse it at the first request; say so now, with every reason.
            problems = judge_adapter(folder, self._rules).problems
            # And the signing policy's verdict (LORA_SIDECAR_SIGNING_POLICY), model.sig read
            # from the folder: an unsigned or badly signed adapter never reaches the registry.
            rule = self._rules.signing.rule_for(adapter_id)
            problems += verify_folder(folder, adapter_id, rule).problems
            if problems:
                raise UploadError(f"not a valid adapter: {summarize(problems)}")
        remote = self._remote_objects(adapter_id)
        changed = [f for f in files if f.name in remote and not _is_same(f, remote[f.name])]
        if changed and not self._overwrite:
            names = ", ".join(f.name for f in changed)
            raise UploadError(
                f"already in the registry with different content ({names}); adapter ids are "
                "immutable (the sidecar and vLLM keep serving the copy they hold), so upload "
                "the new version under a new id, or pass --overwrite"
            )
        sent_bytes = 0
        for local in files:
            if local.name in remote and _is_same(local, remote[local.name]):
                continue
            with local.path.open("rb") as body:
                self._client.put_object(
                    Bucket=self.registry.bucket,
                    Key=self.registry.key(adapter_id, local.name),
                    Body=body,
                    ContentLength=local.size_bytes,
                    ContentMD5=base64.b64encode(bytes.fromhex(local.md5_hex)).decode(),
                )
            sent_bytes += local.size_bytes
        return sent_bytes, ignored


def _adapter_folders(root: Path) -> Iterator[tuple[str, Path]]:
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            yield folder.name, folder


def upload_folder(uploader: Uploader, root: Path, out: TextIO | None = None) -> int:
    """Upload every adapter under `root`; return how many were refused or failed."""
    out = out or sys.stdout
    if uploader.ensure_bucket():
        print(f"created bucket {uploader.registry.bucket}", file=out)
    failed = 0
    count = 0
    for adapter_id, folder in _adapter_folders(root):
        count += 1
        if not is_valid_adapter_id(adapter_id):
            print(f"refused {adapter_id}: not a valid adapter id", file=out)
            failed += 1
            continue
        try:
            sent_bytes, ignored = uploader.upload_adapter(adapter_id, folder)
        except UploadError as exc:
            print(f"refused {adapter_id}: {exc}", file=out)
            failed += 1
            continue
        left_out = (f"; left out {len(ignored)} entries the engine never reads: "
                    f"{listed(ignored)}" if ignored else "")
        if sent_bytes:
            print(f"uploaded {adapter_id} ({sent_bytes} bytes){left_out}", file=out)
        else:
            print(f"unchanged {adapter_id}{left_out}", file=out)
    if count == 0:
        print(f"no adapters in {root}: put one sub-folder per adapter id there", file=out)
    return failed


def make_client(endpoint_url: str | None, region: str | None) -> Any:
    config = Config(
        connect_timeout=5,
        read_timeout=60,
        retries={"max_attempts": 5, "mode": "standard"},
        # MinIO and most S3 look-alikes answer path-style requests only.
        s3={"addressing_style": "path"},
    )
    session = botocore.session.get_session()
    return session.create_client(
        "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Upload each sub-folder of FOLDER as an adapter into an S3 registry, "
        "creating the bucket if needed; files already there unchanged are skipped.",
    )
    parser.add_argument("folder", type=Path, help="one sub-folder per adapter id")
    parser.add_argument(
        "--registry",
        default=os.environ.get("LORA_SIDECAR_REGISTRY"),
        help="s3://bucket/prefix [default: $LORA_SIDECAR_REGISTRY, as the sidecar reads it]",
    )
    parser.add_argument(
        "--endpoint-url",
        default=os.environ.get("LORA_SIDECAR_S3_ENDPOINT_URL") or None,
        help="S3-compatible endpoint [default: $LORA_SIDECAR_S3_ENDPOINT_URL, else AWS]",
    )
    parser.add_argument(
        "--region",
        default=os.environ.get("LORA_SIDECAR_S3_REGION") or None,
        help="S3 region [default: $LORA_SIDECAR_S3_REGION, else us-east-1]",
    )
    parser.add_argument(
        "--no-validate",
        action="store_true",
        help="upload without checking adapters against the sidecar's rules (read from the "
        "same LORA_SIDECAR_* variables as the sidecar: --max-lora-rank, --base-model-config, "
        "--signing-policy...)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace adapters whose files differ from the registry's (ids are meant to be "
        "immutable: prefer a new id)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.registry:
        print("upload_adapters: give --registry or set LORA_SIDECAR_REGISTRY", file=sys.stderr)
        return 2
    try:
        registry = Registry.parse(args.registry)
    except ValueError as exc:
        print(f"upload_adapters: {exc}", file=sys.stderr)
        return 2
    if not args.folder.is_dir():
        print(f"upload_adapters: {args.folder} is not a folder", file=sys.stderr)
        return 2
    rules = None
    if not args.no_validate:
        try:
            rules = Rules.from_settings(Settings.from_env(os.environ))
        except ConfigError as exc:
            print(f"upload_adapters: {exc.message}", file=sys.stderr)
            return 2
    client = make_client(args.endpoint_url, args.region)
    uploader = Uploader(client, registry, rules=rules, overwrite=args.overwrite)
    try:
        failed = upload_folder(uploader, args.folder)
    except (BotoCoreError, ClientError) as exc:
        print(f"upload_adapters: the registry failed: {exc}", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
