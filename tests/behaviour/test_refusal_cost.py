"""What a refused adapter costs the others: nothing. Through the real sidecar (moto S3 over HTTP,
signatures made in the test): an adapter as large as the whole budget, refused for any reason
that needs no weights, evicts no cached adapter, deletes no folder and downloads no weights."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import aiohttp

from sidecar.process.app import Sidecar
from sidecar.process.examples import write_adapter
from sidecar.validation.files import FETCHED_FILES
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.s3 import S3Registry
from tests.support.settings import s3_settings
from tests.support.signing_keys import (
    KeyPair,
    key_policy,
    make_key,
    sign_with_key,
    write_sha256sums,
)

WEIGHTS = "adapter_model.safetensors"
TENANTS = ("tenant-a-chat", "tenant-b-sql", "tenant-c-code")
BIG = {"rank": 16, "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj")}


def _signed(folder: Path, key: KeyPair, seed: int, **kwargs: object) -> Path:
    write_adapter(folder, seed=seed, **kwargs)  # type: ignore[arg-type]
    sign_with_key(folder, key)
    return folder


def _unsigned(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    write_adapter(folder, seed=21, **BIG)  # type: ignore[arg-type]


def _foreign_key(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    _signed(folder, intruder, 22, **BIG)


def _huge_signature(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    _signed(folder, key, 23, **BIG)
    (folder / "model.sig").write_bytes(os.urandom(3 * 1024 * 1024))


def _forbidden_file(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    _signed(folder, key, 24, **BIG)
    (folder / "new_embeddings.safetensors").write_bytes(b"{}")  # tokens added in training


def _file_added_after_signing(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    _signed(folder, key, 25, **BIG)
    write_sha256sums(folder)


def _rank_over_the_engine_limit(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    _signed(folder, key, 26, rank=32, target_modules=("q_proj", "v_proj"))


def _config_too_large(folder: Path, key: KeyPair, intruder: KeyPair) -> None:
    write_adapter(folder, seed=27, **BIG)  # type: ignore[arg-type]
    config = folder / "adapter_config.json"
    body = json.loads(config.read_text())
    body["notes"] = "x" * (1024 * 1024)
    config.write_text(json.dumps(body))
    sign_with_key(folder, key)


Damage = Callable[[Path, KeyPair, KeyPair], None]
# (adapter id, how it is made, the code it is refused with): every refusal that needs no weights.
REFUSED: list[tuple[str, Damage, str]] = [
    ("intruder-unsigned", _unsigned, "signature_missing"),
    ("intruder-foreign-key", _foreign_key, "signer_not_allowed"),
    ("intruder-huge-sig", _huge_signature, "signature_malformed"),
    ("intruder-embeddings", _forbidden_file, "forbidden_file"),
    ("intruder-added-file", _file_added_after_signing, "unsigned_file"),
    ("intruder-rank", _rank_over_the_engine_limit, "rank_too_large"),
    ("intruder-config", _config_too_large, "config_too_large"),
]


def listed_bytes(folder: Path) -> int:
    return sum((folder / name).stat().st_size for name in FETCHED_FILES
               if (folder / name).is_file())


def evictions(sidecar: Sidecar) -> float:
    registry = sidecar.metrics.metrics_registry
    return sum(registry.get_sample_value("lora_sidecar_evictions_total", {"reason": reason}) or 0.0
               for reason in ("policy", "manual", "forced", "external"))


def volume(sidecar: Sidecar) -> dict[str, list[str]]:
    root = sidecar.store.root
    return {name: sorted(p.name for p in (root / name).iterdir())
            for name in ("adapters", ".staging", ".trash")}


async def test_an_adapter_refused_without_its_weights_evicts_and_deletes_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    key = make_key(tmp_path / "keys", "acme-2026")
    intruder = make_key(tmp_path / "keys", "intruder")
    publisher = tmp_path / "publisher"
    for seed, adapter_id in enumerate(TENANTS):
        s3.put_folder(adapter_id, _signed(publisher / adapter_id, key, seed, rank=4))
    sizes = {}
    for adapter_id, damage, _ in REFUSED:
        damage(publisher / adapter_id, key, intruder)
        s3.put_folder(adapter_id, publisher / adapter_id)
        sizes[adapter_id] = listed_bytes(publisher / adapter_id)
    tenants_bytes = sum(listed_bytes(publisher / t) for t in TENANTS)
    # The largest refused adapter is the whole budget: every one of them needs room the three
    # tenants hold. A file listed over its cap makes an adapter larger still: it is refused
    # for that, not answered 507.
    oversized = {"intruder-huge-sig", "intruder-config"}
    budget = max(size for adapter_id, size in sizes.items() if adapter_id not in oversized)
    assert tenants_bytes <= budget
    assert all(size + tenants_bytes > budget for size in sizes.values())
    sidecar = await start_sidecar(s3_settings(
        tmp_path, s3, max_bytes=budget, max_lora_rank=16,
        signing_policy=key_policy(tmp_path, key, name="acme-2026")))
    for adapter_id in TENANTS:
        await stage_ok(http, sidecar, adapter_id, lease=False)
    await sidecar.store.settle_trash()
    before, evicted_before = volume(sidecar), evictions(sidecar)
    assert before["adapters"] == sorted(TENANTS)

    for adapter_id, _, code in REFUSED:
        status, body = await call(http, "POST", f"{sidecar.url}/stage",
                                  {"adapter_id": adapter_id})

        assert status == 422, body
        assert code in [p["code"] for p in body["problems"]], (adapter_id, body)
        assert evictions(sidecar) == evicted_before, adapter_id
        assert volume(sidecar) == before, adapter_id
        assert s3.proxy.gets(s3.key(adapter_id, WEIGHTS)) == [], adapter_id
    # Refused from their listed sizes: never fetched, not even into memory.
    assert s3.proxy.gets(s3.key("intruder-huge-sig", "model.sig")) == []
    assert s3.proxy.gets(s3.key("intruder-config", "adapter_config.json")) == []
    for adapter_id in TENANTS:  # still hits
        assert (await stage_ok(http, sidecar, adapter_id, lease=False))["cached"] is True


async def test_a_small_adapter_refused_with_free_room_evicts_nothing_and_leaves_nothing(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    # Small and unsigned, with room free without evicting: its weights are fetched beside its
    # config, within room reserved for them; the refusal is the config's, as it always was.
    publisher = tmp_path / "publisher"
    for seed, adapter_id in enumerate(TENANTS):
        write_adapter(publisher / adapter_id, seed=seed, rank=4)
        s3.put_folder(adapter_id, publisher / adapter_id)
    write_adapter(publisher / "small-rank", seed=9, rank=32, target_modules=("q_proj",))
    s3.put_folder("small-rank", publisher / "small-rank")
    budget = sum(listed_bytes(publisher / t) for t in TENANTS) + 4 * 1024 * 1024
    sidecar = await start_sidecar(s3_settings(tmp_path, s3, max_bytes=budget, max_lora_rank=16))
    for adapter_id in TENANTS:
        await stage_ok(http, sidecar, adapter_id, lease=False)
    await sidecar.store.settle_trash()
    before, evicted_before = volume(sidecar), evictions(sidecar)

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "small-rank"})

    assert status == 422, body
    assert [p["code"] for p in body["problems"]] == ["rank_too_large"], body
    assert evictions(sidecar) == evicted_before
    assert volume(sidecar) == before  # nothing in .staging, nothing in .trash
    assert before[".staging"] == [] and before[".trash"] == []
    assert sidecar.store.room_bytes() == budget  # its room given back (nothing is leased)
    assert len(s3.proxy.gets(s3.key("small-rank", WEIGHTS))) <= 1
