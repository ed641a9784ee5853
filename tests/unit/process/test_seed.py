"""The model repository seeded into the cache volume: copied from its template once, rewritten
only where it differs, and done before the sidecar listens."""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.process.app import Sidecar
from sidecar.process.seed import REPOSITORY_DIR, seed_model_repository
from tests.support.api import StartSidecar
from tests.support.settings import make_settings
from tests.triton.harness import TRITON_REPO


def test_seeding_copies_the_template_and_later_writes_only_what_differs(tmp_path: Path) -> None:
    target = tmp_path / "cache" / REPOSITORY_DIR

    first = seed_model_repository(TRITON_REPO, target)
    link = target / "vllm_model" / "1" / "multi_lora.json"
    config = target / "multilora_router" / "config.pbtxt"
    stamps = {p: p.lstat().st_mtime_ns for p in (link, config)}
    second = seed_model_repository(TRITON_REPO, target)

    assert first >= 5
    assert link.is_symlink()
    assert os.readlink(link) == os.readlink(TRITON_REPO / "vllm_model" / "1" / "multi_lora.json")
    assert config.read_bytes() == (TRITON_REPO / "multilora_router" / "config.pbtxt").read_bytes()
    assert second == 0  # a restart rewrites nothing, so Triton sees no changed file
    assert {p: p.lstat().st_mtime_ns for p in (link, config)} == stamps
    assert not list(target.rglob("__pycache__"))
    assert not list(target.rglob(".*.seeding"))


async def test_the_sidecar_seeds_the_repository_before_it_listens(
    tmp_path: Path, start_sidecar: StartSidecar
) -> None:
    template = tmp_path / "template"
    (template / "m" / "1").mkdir(parents=True)
    (template / "m" / "config.pbtxt").write_text('backend: "python"\n')
    (template / "m" / "1" / "model.py").write_text("old\n")
    seeded = tmp_path / "cache" / REPOSITORY_DIR / "m" / "1" / "model.py"
    seeded.parent.mkdir(parents=True)
    seeded.write_text("stale\n")

    sidecar: Sidecar = await start_sidecar(make_settings(tmp_path, seed_model_repository=template))

    assert sidecar.port != 0
    assert seeded.read_text() == "old\n"
    assert (seeded.parents[1] / "config.pbtxt").read_text() == 'backend: "python"\n'
