"""The adapters the benchmark stages: generated once (Llama-3-8B shapes, bfloat16), uploaded
to each S3 server, and the byte-for-byte reference for every download."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from sidecar.process.examples import write_adapter
from sidecar.validation.files import SIGNATURE_FILE
from sidecar.validation.shapes import ATTENTION_MODULES, LLAMA_3_8B, MLP_MODULES

BUCKET = "lsbench"
PREFIX = "adapters"
ALL_LINEAR = ATTENTION_MODULES + MLP_MODULES
COMPARE_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    adapter_id: str
    rank: int
    target_modules: tuple[str, ...]
    seed: int


FULL = (
    AdapterSpec("bench-r16-qkvo", 16, ATTENTION_MODULES, 1),
    AdapterSpec("bench-r64-all", 64, ALL_LINEAR, 2),
    AdapterSpec("bench-r128-all", 128, ALL_LINEAR, 3),
)
QUICK = (
    AdapterSpec("bench-r16-qkvo", 16, ATTENTION_MODULES, 1),
    AdapterSpec("bench-r16-all", 16, ALL_LINEAR, 4),
)


@dataclass(frozen=True, slots=True)
class Adapter:
    spec: AdapterSpec
    folder: Path
    size_bytes: int

    @property
    def adapter_id(self) -> str:
        return self.spec.adapter_id

    @property
    def label(self) -> str:
        return f"{self.size_bytes / 1e6:.0f} MB"

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())


def generate(specs: tuple[AdapterSpec, ...], root: Path) -> list[Adapter]:
    """Write each adapter under `root`, reusing one an earlier run wrote from the same spec."""
    adapters = []
    for spec in specs:
        folder = root / spec.adapter_id
        marker = root / f"{spec.adapter_id}.spec.json"
        wanted: dict[str, Any] = asdict(spec)
        wanted["target_modules"] = list(spec.target_modules)
        if not (marker.exists() and json.loads(marker.read_text()) == wanted):
            shutil.rmtree(folder, ignore_errors=True)
            marker.unlink(missing_ok=True)
            write_adapter(folder, rank=spec.rank, target_modules=spec.target_modules,
                          shapes=LLAMA_3_8B, dtype="bfloat16", seed=spec.seed,
                          base_model="meta-llama/Meta-Llama-3-8B")
            marker.write_text(json.dumps(wanted))
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        adapters.append(Adapter(spec, folder, size))
    return adapters


def sign(adapters: list[Adapter], work: Path, *, signing: bool) -> Path | None:
    """With `signing`, write each adapter's model.sig with the run's key (made once, kept in
    `work`) and return a policy requiring it for every id; without, remove any model.sig."""
    if not signing:
        for adapter in adapters:
            (adapter.folder / SIGNATURE_FILE).unlink(missing_ok=True)
        return None
    # model_signing takes seconds to import: only a signed run pays for it.
    from sidecar.validation.oms import sign_folder

    key, public = work / "bench-key.pem", work / "bench-key.pub"
    if not key.exists():
        work.mkdir(parents=True, exist_ok=True)
        private = ec.generate_private_key(ec.SECP256R1())
        key.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        public.write_bytes(private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for adapter in adapters:
        # Signed once per generated folder and key: a signature made again differs (ECDSA is
        # randomised) at the same size, which the upload would not send again.
        signature = adapter.folder / SIGNATURE_FILE
        if not signature.exists() or signature.stat().st_mtime_ns < key.stat().st_mtime_ns:
            sign_folder(adapter.folder, private_key=key)
    policy = work / "policy.toml"
    policy.write_text(f'[signers.bench]\npublic_key = "{public}"\n\n'
                      '[[adapters]]\nglob = "*"\nmode = "require"\nsigners = ["bench"]\n')
    return policy


def upload(client: Any, adapters: list[Adapter]) -> None:
    """Put every adapter under s3://BUCKET/PREFIX/<adapter_id>/ (boto3 client), and remove
    objects there that the adapter no longer has (a model.sig of a signed run)."""
    try:
        client.create_bucket(Bucket=BUCKET)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass
    existing = {
        obj["Key"]: obj["Size"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        for obj in page.get("Contents", [])
    }
    for adapter in adapters:
        wanted = set()
        for path in adapter.files():
            key = f"{PREFIX}/{adapter.adapter_id}/{path.name}"
            wanted.add(key)
            # A signature made again has the size of the last one: always sent (2 KB).
            if existing.get(key) != path.stat().st_size or path.name == SIGNATURE_FILE:
                client.upload_file(str(path), BUCKET, key)
        for key in existing:
            if key.startswith(f"{PREFIX}/{adapter.adapter_id}/") and key not in wanted:
                client.delete_object(Bucket=BUCKET, Key=key)


def verify(adapter: Adapter, downloaded: Path) -> None:
    """Raise unless `downloaded` holds exactly the adapter's files, byte for byte (dot files,
    such as the sidecar's own record, are not the adapter's)."""
    got = sorted(p.name for p in downloaded.iterdir() if not p.name.startswith("."))
    want = [p.name for p in adapter.files()]
    if got != want:
        raise AssertionError(f"{downloaded}: files {got}, expected {want}")
    for path in adapter.files():
        with path.open("rb") as a, (downloaded / path.name).open("rb") as b:
            offset = 0
            while True:
                left, right = a.read(COMPARE_CHUNK_BYTES), b.read(COMPARE_CHUNK_BYTES)
                if left != right:
                    raise AssertionError(f"{downloaded / path.name}: differs near byte {offset}")
                if not left:
                    break
                offset += len(left)
