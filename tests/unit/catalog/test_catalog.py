"""catalog.py: generations rendered from what is on disk, names given without a reload, parked
when their adapter leaves the disk and returned when the same bytes come back, new bytes under
an old id given a new name, reads of no-ops, the journal across restarts and faults, the
budget; against a real store and local registry on the real filesystem. The same against a
real Triton is in tests/triton/, with the real engine in tests/engine/."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from sidecar.catalog import disk
from sidecar.catalog.disk import read_catalog_journal
from sidecar.catalog.name_state import NameState, Version
from sidecar.core.errors import (
    CatalogPending,
)
from sidecar.process.examples import write_adapter
from tests.support.catalog_world import (
    WEIGHTS,
    World,
    api_sidecar,
    compact,
    serving,
    spares_of,
    valid_copy,
)


async def test_a_generation_lists_the_adapters_on_disk_and_spare_names_at_no_op_adapters(
    world: World,
) -> None:
    world.add_adapters("sql-v1", "support-v2", "never-staged-v1")
    reloads = await serving(world)
    await world.stage("sql-v1")
    await world.stage("support-v2")
    await compact(reloads)

    rendered = world.rendered()
    spares = spares_of(world)
    assert sorted(set(rendered) - set(spares)) == ["sql-v1", "support-v2"]
    assert rendered["sql-v1"] == "/lora-cache/catalog/g2/names/sql-v1"
    assert world.link("sql-v1") == "../../../adapters/sql-v1"
    assert spares == [f"_spare-g2-000{n}" for n in range(1, 5)]
    shared = world.cache / "catalog" / "g2" / "noop" / ".shared" / WEIGHTS
    for spare in spares:
        assert rendered[spare] == f"/lora-cache/catalog/g2/names/{spare}"
        assert world.link(spare) == f"../noop/{spare}"  # relative: resolves in Triton's mount
        folder = world.local(rendered[spare]).resolve()
        assert valid_copy(folder, world.tmp_path) == []
        # Each name its own folder (its reads are told apart), the bytes once on disk.
        assert (folder / WEIGHTS).stat().st_ino == shared.stat().st_ino
    assert world.metric("lora_sidecar_catalog_adapters") == 2
    assert world.metric("lora_sidecar_catalog_generation") == 2


async def test_a_refused_adapter_is_never_listed_nor_named(world: World) -> None:
    world.add_adapter("too-wide-v1", rank=32)  # max_lora_rank is 16
    reloads = await serving(world)

    with pytest.raises(Exception, match="refused by validation"):
        await world.stage("too-wide-v1")
    await compact(reloads)

    assert spares_of(world) == sorted(world.rendered())
    assert reloads.status()["spares"]["bound"] == {}


async def test_without_a_base_model_config_the_first_adapters_shapes_make_the_no_op(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    world.add_adapters("a1", "a2")
    with caplog.at_level("INFO", logger="sidecar.catalog"):
        reloads = await serving(world, base_model_config=None)

    spares = reloads.status()["spares"]
    assert spares["enabled"] is False
    assert "--base-model-config" in spares["off_because"]
    assert world.rendered() == {}
    assert any("spare names are off" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)

    with pytest.raises(CatalogPending, match="spare names are off"):
        await world.stage("a1")
    await reloads.sync()  # the compaction the wait planned: a1's shapes give the no-op

    assert reloads.status()["spares"]["enabled"] is True
    assert reloads.status()["spares"]["noop_from"] == "adapter a1"
    assert await world.stage("a1") == "a1"
    assert (await world.stage("a2")).startswith("_spare-g2-")
    noop = world.local(world.rendered()[spares_of(world)[0]]).resolve()
    assert valid_copy(noop, world.tmp_path) == []  # it fits the model


async def test_a_new_adapter_gets_a_spare_without_any_triton_call(world: World) -> None:
    weights = world.add_adapter("fresh-v1")
    reloads = await serving(world)
    calls = list(world.control.calls)

    name = await world.stage("fresh-v1")

    assert name.startswith("_spare-g1-")
    assert world.control.calls == calls
    link = world.local(world.rendered()[name])
    assert os.readlink(link) == "../../../adapters/fresh-v1"
    assert (link / WEIGHTS).read_bytes() == weights
    assert world.store is not None
    digest = world.store.get("fresh-v1").record.content_digest  # type: ignore[union-attr]
    entry = read_catalog_journal(world.cache).generations[1].names[name]
    assert (entry.state, entry.version) == (NameState.BOUND, Version("fresh-v1", digest))
    status = reloads.status()
    assert status["spares"]["bound"] == {name: str(Version("fresh-v1", digest))}
    assert status["spares"]["left"] == 3
    assert world.metric("lora_sidecar_catalog_bindings_total") == 1
    assert world.metric("lora_sidecar_catalog_spares_left") == 3


async def test_a_name_is_given_once_and_each_adapter_gets_its_own(world: World) -> None:
    for adapter_id in ("a1", "a2"):
        world.add_adapter(adapter_id)
    await serving(world)

    first = await world.stage("a1")
    again = await world.stage("a1")
    other = await world.stage("a2")

    assert first == again
    assert other != first
    assert world.link(other) == "../../../adapters/a2"


async def test_concurrent_first_stages_of_one_adapter_share_one_name(world: World) -> None:
    world.add_adapter("popular-v1")
    reloads = await serving(world)

    names = await asyncio.gather(*(world.stage("popular-v1") for _ in range(8)))

    assert len(set(names)) == 1
    assert len(reloads.status()["spares"]["bound"]) == 1


async def test_an_evicted_adapter_s_name_is_parked_at_a_no_op_and_returns_with_its_bytes(
    world: World,
) -> None:
    weights = world.add_adapter("a1")
    world.add_adapters("a2", "a3")
    reloads = await serving(world, max_adapters=1)
    name = await world.stage("a1")

    await world.stage("a2")  # a1 goes: the budget is one adapter

    assert not (world.cache / "adapters" / "a1").exists()
    assert world.link(name) == f"../noop/{name}"  # never dangling, never kept copies
    assert world.state(name) is NameState.PARKED
    assert valid_copy(world.local(world.rendered()[name]).resolve(), world.tmp_path) == []
    assert not (world.cache / "catalog" / "g1" / "kept").exists()
    left = reloads.status()["spares"]["left"]

    assert await world.stage("a1") == name  # the same bytes: the same name, no spare used
    assert (world.local(world.rendered()[name]) / WEIGHTS).read_bytes() == weights
    assert reloads.status()["spares"]["left"] == left
    # Own names are parked and returned alike.
    await compact(reloads)
    assert await world.stage("a1") == "a1"
    await world.stage("a3")
    assert world.state("a1") is NameState.PARKED and world.link("a1") == "../noop/a1"
    assert await world.stage("a1") == "a1"
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "returned"}) == 2


async def test_new_bytes_under_an_old_id_get_a_new_name_and_the_old_name_never_reads_them(
    world: World, caplog: pytest.LogCaptureFixture,
) -> None:
    old = world.add_adapter("tenant-x", seed=1)
    world.add_adapter("filler")
    reloads = await serving(world, max_adapters=1)
    reloads.request_compaction()
    await world.stage("tenant-x")
    await reloads.sync()
    assert await world.stage("tenant-x") == "tenant-x"  # listed by its own name
    await world.stage("filler")  # evicted: its own name is parked
    new = world.add_adapter("tenant-x", seed=2)  # re-uploaded under the same id
    assert new != old

    with caplog.at_level("WARNING", logger="sidecar.catalog.naming"):
        name = await world.stage("tenant-x")

    assert name.startswith("_spare-g2-")
    assert (world.local(world.rendered()[name]) / WEIGHTS).read_bytes() == new
    assert world.link("tenant-x") == "../noop/tenant-x"  # still the old bytes' name, parked
    assert any("the registry changed under adapter tenant-x" in r.getMessage()
               for r in caplog.records)
    assert world.naming is not None
    changed = world.naming.replaced("tenant-x")
    assert changed is not None and changed["digest_before"] != changed["digest_now"]

    # The old bytes come back (a revert): their own name returns to them, never to the new.
    await world.stage("filler")
    world.add_adapter("tenant-x", seed=1)
    assert await world.stage("tenant-x") == "tenant-x"
    assert (world.local(world.rendered()["tenant-x"]) / WEIGHTS).read_bytes() == old


async def test_names_given_equal_the_distinct_versions_staged_under_churn(world: World) -> None:
    ids = [f"t{n}" for n in range(8)]
    for adapter_id in ids:
        world.add_adapter(adapter_id)
    reloads = await serving(world, max_adapters=2, spare_names=10)
    order = [0, 1, 2, 0, 3, 1, 4, 5, 0, 6, 7, 2, 3, 0, 1, 5, 6, 7, 4, 0]
    names: dict[str, str] = {}
    for n in order:
        name = await world.stage(ids[n])
        assert names.setdefault(ids[n], name) == name  # never another name for the same bytes

    spares = reloads.status()["spares"]
    assert len(set(names.values())) == 8 == len(spares["bound"]) + len(spares["parked"])
    assert spares["left"] == 2 and spares["burnt"] == []
    assert world.metric("lora_sidecar_catalog_bindings_total") == 8


async def test_bindings_survive_a_sidecar_restart_without_a_load(world: World) -> None:
    world.add_adapters("a1", "a2", "a3")
    await serving(world, max_adapters=2)
    name = await world.stage("a1")
    parked = await world.stage("a2")
    await world.stage("a3")
    await world.stage("a1")  # a2 is evicted: parked
    loads = world.control.loads()
    before = (world.cache / "multi_lora.json").stat()

    restarted = await world.start(max_adapters=2)  # the same cache, Triton still serving
    await restarted.sync()

    # Untouched: Triton reloads a model whose catalog file's ctime moved.
    after = (world.cache / "multi_lora.json").stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    assert restarted.status()["triton"]["state"] == "serving"
    assert world.control.loads() == loads  # the catalog file is the one Triton loaded
    assert world.state(parked) is NameState.PARKED
    assert await world.stage("a1") == name
    assert await world.stage("a2") == parked  # returned after the restart too


async def test_a_spare_the_engine_read_before_it_was_given_is_never_given(
    world: World,
) -> None:
    world.add_adapters("a1", "a2")
    reloads = await serving(world)
    spares = spares_of(world)
    # What a direct call to vllm_model with these names makes the engine do.
    for spare in spares[:3]:
        world.read_as_engine(spare)
    world.judge_reads()

    assert await world.stage("a1") == spares[3]
    assert sorted(reloads.status()["spares"]["burnt"]) == spares[:3]
    with pytest.raises(CatalogPending, match="no spare name is left"):
        await world.stage("a2")


class WatchesRunOut:
    """libc as inotify answers once fs.inotify.max_user_watches is reached (fault injection):
    after `left` watches, inotify_add_watch fails with ENOSPC; every other call is libc's."""

    def __init__(self, libc: Any, left: int) -> None:
        self._libc, self.left = libc, left

    def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
        if self.left == 0:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        self.left -= 1
        return int(self._libc.inotify_add_watch(fd, path, mask))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._libc, name)


async def test_a_spare_whose_no_op_inotify_cannot_watch_is_never_given(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    real_cdll = ctypes.CDLL
    monkeypatch.setattr(ctypes, "CDLL",
                        lambda *args, **kwargs: WatchesRunOut(real_cdll(*args, **kwargs), left=2))
    for adapter_id in ("a1", "a2", "a3"):
        world.add_adapter(adapter_id)
    reloads = await serving(world)  # four spares; inotify watches only two of their no-ops
    assert world.names is not None
    watched = sorted(name for name in spares_of(world)
                     if world.names.reads.is_watched((1, name)))
    assert len(watched) == 2 and len(spares_of(world)) == 4

    given = sorted([await world.stage("a1"), await world.stage("a2")])
    with pytest.raises(CatalogPending, match="no spare name is left"):
        await world.stage("a3")  # two spares left, but a read of them would go unseen

    assert given == watched
    assert sorted(reloads.status()["spares"]["bound"]) == watched
    warnings = [r.getMessage() for r in caplog.records
                if "cannot be watched are not handed out" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    assert "max_user_watches" in warnings[0]


async def test_a_parked_name_the_engine_read_is_burnt_and_its_adapter_takes_a_fresh_spare(
    world: World,
) -> None:
    world.add_adapters("a1", "a2")
    await serving(world, max_adapters=1)
    name = await world.stage("a1")
    await world.stage("a2")  # a1 parked

    world.read_as_engine(name)
    world.judge_reads()

    assert world.state(name) is NameState.BURNT
    again = await world.stage("a1")
    assert again not in (name, "a1")
    assert world.link(name) == f"../noop/{name}"  # it answers as the no-op it was read as
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "burnt"}) == 1


@pytest.mark.parametrize("command", [
    "du -sh .", "find . -type f", "ls -lR .", "du -shL .", "tar -cf /dev/null .",
    "cp -r catalog ../backup", "find . -name '*.safetensors' -exec sha256sum {} +",
    "cat catalog/g1/noop/*/adapter_config.json",
])


async def test_operators_looking_at_the_volume_burn_no_name(world: World, command: str) -> None:
    world.add_adapters("a1", "a2")
    reloads = await serving(world, max_adapters=1)
    await world.stage("a1")
    await world.stage("a2")  # a1 parked: its no-op is watched too
    left = reloads.status()["spares"]["left"]

    process = await asyncio.create_subprocess_exec(
        "sh", "-c", command, cwd=world.cache, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    assert await process.wait() == 0
    world.judge_reads()

    assert reloads.status()["spares"]["burnt"] == []
    assert reloads.status()["spares"]["left"] == left
    assert world.metric("lora_sidecar_catalog_name_changes_total", {"change": "burnt"}) == 0


async def test_a_bound_adapter_removed_by_hand_parks_its_name_and_one_changed_in_place_burns_it(
    world: World,
) -> None:
    world.add_adapters("a1", "a2")
    reloads = await serving(world)
    removed = await world.stage("a1")
    changed = await world.stage("a2")
    assert world.store is not None

    shutil.rmtree(world.cache / "adapters" / "a1")
    world.store.forget("a1")  # what the watcher does when the folder is gone
    world.store.forget("a2", changed=True)  # ... and when its files changed in place

    assert world.link(removed) == f"../noop/{removed}"
    assert world.state(removed) is NameState.PARKED
    assert world.state(changed) is NameState.BURNT
    assert world.link(changed) == f"../noop/{changed}"
    assert await world.stage("a1") == removed  # the same bytes from the registry: returned
    assert await world.stage("a2") not in (changed, "a2")
    assert reloads.status()["spares"]["burnt"] == [changed]


async def test_crashes_between_journal_and_link_never_hand_out_a_half_given_name(
    world: World,
) -> None:
    world.add_adapter("a1")
    reloads = await serving(world)
    assert world.store is not None
    given = await world.stage("a1")
    journaled_only, linked_only = [s for s in spares_of(world) if s != given][:2]
    assert reloads.status()["spares"]["bound"].keys() == {given}
    a1 = world.store.get("a1")
    assert a1 is not None
    # A crash after the journal was written, before the link; and one after a link was
    # replaced, before the journal (neither name was handed out).
    journal_path = world.cache / "catalog" / "journal.json"
    journal = json.loads(journal_path.read_text())
    for entry in journal["generations"]["1"]["names"]:
        if entry["name"] == journaled_only:
            entry.update(state="bound", adapter_id="a1", digest=a1.record.content_digest)
    journal_path.write_text(json.dumps(journal))
    folder = world.cache / "catalog" / "g1" / "names"
    (folder / linked_only).unlink()
    (folder / linked_only).symlink_to("../../../adapters/a1")

    restarted = await world.start()
    await restarted.sync()

    burnt = restarted.status()["spares"]["burnt"]
    assert sorted(burnt) == sorted([journaled_only, linked_only])
    for spare in burnt:
        assert os.readlink(folder / spare) == f"../noop/{spare}"


async def test_a_restart_parks_names_whose_adapter_left_while_it_was_down(world: World) -> None:
    world.add_adapter("a1")
    await serving(world)
    name = await world.stage("a1")
    shutil.rmtree(world.cache / "adapters" / "a1")  # gone while no sidecar ran

    restarted = await world.start()
    await restarted.sync()

    assert world.state(name) is NameState.PARKED
    assert world.link(name) == f"../noop/{name}"
    assert await world.stage("a1") == name


async def test_a_catalog_file_that_is_not_the_journals_starts_a_new_generation(
    world: World,
) -> None:
    world.add_adapter("a1")
    await serving(world)
    await world.stage("a1")
    (world.cache / "multi_lora.json").write_text("{}\n")  # edited by hand

    restarted = await world.start()

    assert restarted.status()["generation"] == 2
    assert sorted(world.rendered()) == [*(f"_spare-g2-000{n}" for n in range(1, 5)), "a1"]


async def test_the_catalog_keeps_no_adapter_bytes_outside_the_budget(world: World) -> None:
    for n in range(6):
        world.add_adapter(f"t{n}", seed=n)
    reloads = await serving(world, max_adapters=2, spare_names=8)
    for n in [0, 1, 2, 3, 0, 4, 5, 1, 2]:
        await world.stage(f"t{n}")
    assert world.store is not None
    await world.store.settle_trash()

    adapters = sum(p.stat().st_size for p in (world.cache / "adapters").rglob("*")
                   if p.is_file() and p.name != ".sidecar.json")
    assert adapters == world.store.total_bytes
    seen: set[int] = set()
    catalog = 0
    for path in (world.cache / "catalog").rglob("*"):
        st = path.lstat()
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            catalog += st.st_size
    await reloads.catalog.measure()
    assert catalog <= reloads.status()["disk"]["catalog_bytes"]
    # No-op copies aside, nothing: the no-op's bytes are on disk once per generation.
    noop = reloads.status()["disk"]["noop_bytes"]
    assert 0 < noop < catalog < noop + 64 * 1024 + 8192 * len(world.rendered())


async def test_an_adapter_the_watcher_adopts_follows_the_catalogs_rule(
    tmp_path: Path, start_sidecar: Any, http: Any,
) -> None:
    from tests.support.api import call
    from tests.support.waiting import eventually

    sidecar = await api_sidecar(tmp_path, start_sidecar)
    outside = tmp_path / "copy"
    write_adapter(outside, seed=3)
    outside.rename(tmp_path / "cache" / "adapters" / "copied-v1")

    async def adopted() -> bool:
        return sidecar.store.get("copied-v1") is not None

    await eventually(adopted, timeout_s=15, what="the watcher adopts the copy")
    status, body = await call(http, "POST", f"{sidecar.url}/stage", {"adapter_id": "copied-v1"})

    assert status == 200, body
    assert body["cached"] is True and body["lora_name"].startswith("_spare-g1-")
    sidecar.reloads.request_compaction()
    await sidecar.reloads.sync()
    assert "copied-v1" in sidecar.reloads.status()["adapter_ids"]


async def test_a_slow_link_fsync_holds_no_hit_and_gives_no_one_the_name_before_it_ends(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    world.add_adapters("warm", "new")
    await serving(world)
    assert world.naming is not None
    warm = await world.stage("warm")
    syncing, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    sync_names = disk.sync_names

    def slow_sync(root: Path, number: int) -> None:  # a disk whose fsync takes its time
        loop.call_soon_threadsafe(syncing.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(30)
        sync_names(root, number)

    monkeypatch.setattr(disk, "sync_names", slow_sync)
    staging = asyncio.create_task(world.stage("new"))
    await asyncio.wait_for(syncing.wait(), 30)
    # The link is switched, its fsync under way: the loop answers hits of other adapters, and
    # nobody is given the new name yet.
    hit = world.naming.hit("warm", lease=False)
    assert hit is not None and hit.lora_name == warm
    assert world.naming.hit("new", lease=False) is None
    second = asyncio.create_task(world.stage("new"))
    await asyncio.sleep(0.05)  # time for a stage that did not wait for the fsync to end
    assert not staging.done() and not second.done()

    release.set()
    name = await asyncio.wait_for(staging, 30)
    assert await asyncio.wait_for(second, 30) == name
    assert world.link(name) == "../../../adapters/new"
    assert world.state(name) is NameState.BOUND
    hit = world.naming.hit("new", lease=False)
    assert hit is not None and hit.lora_name == name


async def test_a_link_that_cannot_be_made_durable_is_burnt_and_given_to_no_one(
    world: World, monkeypatch: pytest.MonkeyPatch,
) -> None:
    world.add_adapter("a1")
    await serving(world)
    assert world.naming is not None
    sync_names = disk.sync_names

    def failing_sync(root: Path, number: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "sync_names", failing_sync)
    with pytest.raises(CatalogPending) as caught:
        await world.stage("a1")
    assert "could not give adapter a1 a name" in str(caught.value)
    assert "Input/output error" in str(caught.value)
    burnt = [s for s in spares_of(world) if world.state(s) is NameState.BURNT]
    assert len(burnt) == 1 and world.link(burnt[0]) == f"../noop/{burnt[0]}"
    assert world.naming.hit("a1", lease=False) is None

    monkeypatch.setattr(disk, "sync_names", sync_names)
    name = await world.stage("a1")  # the disk is back: another spare, never the burnt one
    assert name != burnt[0] and world.link(name) == "../../../adapters/a1"
