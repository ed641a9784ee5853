"""disk.py: a generation's folder of links and no-ops, a link switched, strays tidied, the
journal written and read back (or refused), multi_lora.json's text; on the real filesystem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sidecar.catalog import disk
from sidecar.catalog.generation import CatalogJournal, Generation
from sidecar.catalog.name_state import NameEvent, Version
from sidecar.validation.shapes import TINY_LLAMA
from sidecar.validation.validate import Rules, validate_adapter

A1 = Version("a1", "sha256:" + "1" * 64)
MODULES = ("q_proj", "v_proj")


def noop() -> disk.NoopAdapter:
    return disk.NoopAdapter.for_model(TINY_LLAMA, MODULES)


def test_a_generation_folder_links_own_names_to_adapters_and_spares_to_their_own_no_op(
    tmp_path: Path,
) -> None:
    generation = Generation.render(1, [A1], 2, 1000.0)

    disk.create_generation(tmp_path, generation, noop())

    assert disk.link_target(tmp_path, 1, "a1") == "../../../adapters/a1"
    spare = "_spare-g1-0001"
    assert disk.link_target(tmp_path, 1, spare) == f"../noop/{spare}"
    folder = disk.noop_dir(tmp_path, 1, spare)
    shared = disk.generation_dir(tmp_path, 1) / disk.NOOP_DIR / disk.SHARED_DIR
    assert os.path.samefile(folder / disk.WEIGHTS_FILE, shared / disk.WEIGHTS_FILE)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [disk.CONFIG_FILE, disk.WEIGHTS_FILE, disk.DECOY_FILE])
    assert disk.generation_numbers_on_disk(tmp_path) == {1}
    assert not [p for p in (tmp_path / disk.CATALOG_DIR).iterdir() if p.name.startswith(".")]


def test_the_no_op_is_a_valid_adapter_of_the_base_model(tmp_path: Path) -> None:
    made = noop()
    made.write(tmp_path / "noop")

    assert validate_adapter(tmp_path / "noop", Rules(shapes=TINY_LLAMA)) == []
    assert made.size_bytes == sum(p.stat().st_size for p in (tmp_path / "noop").iterdir())
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    like = disk.NoopAdapter.like({f"{layer}.lora_A.weight": (8, 64),
                                  f"{layer}.lora_B.weight": (64, 8)}, MODULES)
    assert like is not None and like.module == "q_proj"
    assert disk.NoopAdapter.like({}, MODULES) is None


def test_a_switched_link_leads_to_its_new_target_and_a_missing_no_op_is_remade(
    tmp_path: Path,
) -> None:
    generation = Generation.render(1, [], 1, 1000.0)
    disk.create_generation(tmp_path, generation, noop())
    spare = "_spare-g1-0001"

    disk.point_link(tmp_path, 1, spare, disk.adapter_target("a1"))
    assert disk.link_target(tmp_path, 1, spare) == "../../../adapters/a1"
    names = disk.names_dir(tmp_path, 1)
    assert sorted(os.listdir(names)) == [spare]  # no temporary link left behind

    disk.remove_generation(tmp_path, 1)
    assert disk.link_target(tmp_path, 1, spare) is None
    assert disk.ensure_noop(tmp_path, 2, spare, None) is False  # no shapes: nothing to give
    assert disk.ensure_noop(tmp_path, 2, spare, noop()) is True
    assert (disk.noop_dir(tmp_path, 2, spare) / disk.WEIGHTS_FILE).is_file()


def test_strays_are_removed_and_what_is_not_the_catalogs_is_left_alone(tmp_path: Path) -> None:
    folder = tmp_path / disk.CATALOG_DIR
    for name in ("g1", "g2", ".g3.0a1b2c3d"):
        (folder / name).mkdir(parents=True)
    (folder / ".journal.json.deadbeef").write_bytes(b"{")
    (folder / "notes").mkdir()

    removed = disk.remove_strays(tmp_path, keep=[1])

    assert sorted(removed) == [".g3.0a1b2c3d", ".journal.json.deadbeef", "g2"]
    assert sorted(p.name for p in folder.iterdir()) == ["g1", "notes"]


def test_the_journal_reads_back_and_one_that_cannot_be_trusted_is_refused(
    tmp_path: Path,
) -> None:
    assert disk.read_catalog_journal(tmp_path).generations == {}  # none yet: an empty one
    generation = Generation.render(4, [], 1, 1000.0)
    generation.apply("_spare-g4-0001", NameEvent.BIND, "staged", A1)
    disk.write_catalog_journal(tmp_path, disk.catalog_journal_bytes(
        CatalogJournal({4: generation}, current=4)))

    read = disk.read_catalog_journal(tmp_path)
    assert read.current == 4 and read.generations[4].held_name(A1) == "_spare-g4-0001"

    (tmp_path / disk.CATALOG_DIR / disk.CATALOG_JOURNAL_FILE).write_text("[1, 2")
    with pytest.raises(ValueError, match=r"journal\.json"):
        disk.read_catalog_journal(tmp_path)


def test_multi_lora_json_names_each_link_by_tritons_path_and_counts_in_the_catalogs_bytes(
    tmp_path: Path,
) -> None:
    generation = Generation.render(2, [A1], 1, 1000.0)
    disk.create_generation(tmp_path, generation, noop())
    before = disk.disk_bytes(tmp_path)

    disk.write_atomically(tmp_path / disk.CATALOG_FILE,
                          disk.render_text(generation, Path("/lora-cache")).encode())

    assert json.loads((tmp_path / disk.CATALOG_FILE).read_text()) == {
        "a1": "/lora-cache/catalog/g2/names/a1",
        "_spare-g2-0001": "/lora-cache/catalog/g2/names/_spare-g2-0001"}
    assert disk.disk_bytes(tmp_path) == before + (tmp_path / disk.CATALOG_FILE).stat().st_size
