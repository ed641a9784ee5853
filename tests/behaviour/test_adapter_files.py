"""Adapters as people have them (an `hf download --local-dir` folder, a Trainer's output_dir)
through every part that applies sidecar/validation/files.py: a local registry, an S3 registry,
`lora-sidecar validate`, the watcher and compose/upload_adapters.py agree on what is fetched
(the engine's two files), what is left out (said once), and what is refused."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from sidecar.cache.records import RECORD_NAME
from tests.support.api import StartSidecar, call, stage_ok
from tests.support.compose_uploader import Bucket, upload
from tests.support.ecosystem_adapters import (
    CONFIG,
    WEIGHTS,
    files_below,
    write_hf_download,
    write_trainer_checkpoint,
    write_trainer_output,
)
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings, s3_settings
from tests.support.waiting import eventually

LAYOUTS: dict[str, Callable[..., None]] = {
    "hf-download-v1": write_hf_download,
    "trainer-output-v1": write_trainer_output,
    "trainer-checkpoint-v1": write_trainer_checkpoint,
}
SERVED = {CONFIG, WEIGHTS}  # what the engine reads, and all a published folder holds
LEFT_OUT = {
    "hf-download-v1": [".cache/", ".gitattributes", "README.md"],
    "trainer-output-v1": ["README.md", "checkpoint-500/", "special_tokens_map.json",
                          "tokenizer.json", "tokenizer_config.json", "training_args.bin"],
    "trainer-checkpoint-v1": ["optimizer.pt", "rng_state.pth", "scheduler.pt",
                              "trainer_state.json", "training_args.bin"],
}


def _published(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} - {RECORD_NAME}


def _left_out_lines(caplog: pytest.LogCaptureFixture, adapter_id: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if f"adapter_id={adapter_id}" in r.getMessage() and "never reads" in r.getMessage()]


@pytest.mark.parametrize("adapter_id", sorted(LAYOUTS))
async def test_a_local_registry_serves_the_adapter_and_leaves_out_the_rest_saying_so_once(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture, adapter_id: str,
) -> None:
    LAYOUTS[adapter_id](tmp_path / "registry" / adapter_id, seed=3)
    sidecar = await start_sidecar(make_settings(tmp_path))
    caplog.set_level(logging.INFO, logger="sidecar")

    body = await stage_ok(http, sidecar, adapter_id, lease=False)
    again = await stage_ok(http, sidecar, adapter_id, lease=False)

    assert body["cached"] is False and again["cached"] is True
    assert _published(Path(str(body["local_path"]))) == SERVED
    (line,) = _left_out_lines(caplog, adapter_id)
    assert line.endswith(", ".join(LEFT_OUT[adapter_id]))


@pytest.mark.parametrize("adapter_id", sorted(LAYOUTS))
async def test_an_s3_registry_synced_from_the_folder_serves_it_without_fetching_the_rest(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    adapter_id: str,
) -> None:
    folder = tmp_path / "upload" / adapter_id
    LAYOUTS[adapter_id](folder, seed=4)
    for key, data in files_below(folder).items():  # as `aws s3 sync` puts it, nested keys too
        s3.put_object(s3.key(adapter_id, key), data)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    body = await stage_ok(http, sidecar, adapter_id, lease=False)

    assert _published(Path(str(body["local_path"]))) == SERVED
    fetched = {seen.path.rsplit("/", 1)[-1] for seen in s3.proxy.gets(f"/{adapter_id}/")}
    assert fetched == SERVED


async def test_pickle_weights_without_safetensors_are_refused_before_anything_is_fetched(
    tmp_path: Path, s3: S3Registry, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    folder = tmp_path / "upload" / "pickled-v1"
    write_trainer_output(folder)
    # What save_pretrained(safe_serialization=False) writes.
    (folder / WEIGHTS).rename(folder / "adapter_model.bin")
    for key, data in files_below(folder).items():
        s3.put_object(s3.key("pickled-v1", key), data)
    sidecar = await start_sidecar(s3_settings(tmp_path, s3))

    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "pickled-v1"})

    assert status == 422, body
    assert [(p["code"], p["file"]) for p in body["problems"]] == [
        ("forbidden_file", "adapter_model.bin")]
    assert "safetensors" in body["problems"][0]["message"]
    assert s3.proxy.gets("/pickled-v1/") == []


@pytest.mark.parametrize("adapter_id", sorted(LAYOUTS))
def test_validate_passes_the_folder_with_a_note_naming_what_is_left_out(
    tmp_path: Path, adapter_id: str
) -> None:
    LAYOUTS[adapter_id](tmp_path / adapter_id)

    done = subprocess.run([sys.executable, "-m", "sidecar", "validate", str(tmp_path / adapter_id)],
                          capture_output=True, text=True, timeout=60, check=False)

    assert done.returncode == 0, done.stdout + done.stderr
    note, ok = done.stdout.splitlines()
    assert note.startswith(f"note  {len(LEFT_OUT[adapter_id])} entries the engine never reads")
    assert note.endswith(": " + ", ".join(LEFT_OUT[adapter_id]))
    assert ok == f"OK {tmp_path / adapter_id}"


@pytest.mark.parametrize("adapter_id", sorted(LAYOUTS))
async def test_a_folder_copied_into_the_cache_is_adopted_holding_only_what_is_served(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture, adapter_id: str,
) -> None:
    sidecar = await start_sidecar(make_settings(tmp_path))
    caplog.set_level(logging.INFO, logger="sidecar")
    provisioned = tmp_path / "provisioning" / adapter_id
    LAYOUTS[adapter_id](provisioned, seed=5)
    shutil.copytree(provisioned, sidecar.store.path_of(adapter_id))

    async def adopted() -> bool:
        return sidecar.store.get(adapter_id) is not None

    await eventually(adopted, timeout_s=10, what="the copy is adopted")
    assert _published(sidecar.store.path_of(adapter_id)) == SERVED
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        f"adopted adapter_id={adapter_id}")]
    assert line.endswith(", ".join(LEFT_OUT[adapter_id]))
    body = await stage_ok(http, sidecar, adapter_id, lease=False)
    assert body["cached"] is True


def test_the_compose_uploader_sends_what_the_sidecar_fetches_and_names_the_rest(
    moto_server: str, tmp_path: Path
) -> None:
    bucket = Bucket(moto_server, "ecosystem-adapters")
    for adapter_id, write in LAYOUTS.items():
        write(tmp_path / "adapters" / adapter_id)

    result = upload(bucket.registry, bucket.endpoint_url, tmp_path / "adapters")

    assert result.returncode == 0, result.stdout + result.stderr
    assert set(bucket.objects()) == {f"team/adapters/{adapter_id}/{name}"
                                     for adapter_id in LAYOUTS for name in SERVED}
    for adapter_id, left_out in LEFT_OUT.items():
        (line,) = [line for line in result.stdout.splitlines() if adapter_id in line]
        assert line.endswith(f"left out {len(left_out)} entries the engine never reads: "
                             + ", ".join(left_out))


async def test_a_sha256sums_of_the_whole_folder_checks_the_files_served_and_skips_the_rest(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession
) -> None:
    """`sha256sum * > SHA256SUMS` in a Trainer's folder lists files the adapter is served
    without: their lines are not checked, the engine's files' are."""
    folder = tmp_path / "registry" / "summed-v1"
    write_trainer_output(folder)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}"
             for p in sorted(folder.iterdir()) if p.is_file()]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    sidecar = await start_sidecar(make_settings(tmp_path))

    body = await stage_ok(http, sidecar, "summed-v1", lease=False)

    assert _published(Path(str(body["local_path"]))) == SERVED | {"SHA256SUMS"}
    (folder / "SHA256SUMS").write_text(f"{'0' * 64}  {WEIGHTS}\n")
    status, refused = await call(http, "POST", f"{sidecar.url}/stage",
                                 {"adapter_id": "summed-v1", "lease": False})
    assert status == 200  # cached: the registry's change is not seen until evicted
    await call(http, "POST", f"{sidecar.url}/evict", {"adapter_id": "summed-v1"})
    status, refused = await call(http, "POST", f"{sidecar.url}/stage",
                                 {"adapter_id": "summed-v1", "lease": False})
    assert status == 422, refused
    assert [p["code"] for p in refused["problems"]] == ["checksum_mismatch"]
