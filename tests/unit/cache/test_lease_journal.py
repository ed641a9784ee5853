"""Leases outlive the process: journaled on the cache volume, read back at a restart, kept until
they are released (with the same lease id) or expire; expiry on the monotonic clock, so a
stepped wall clock neither ends nor extends a live lease."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.lease_journal import LEASE_JOURNAL_NAME, LeaseJournal, lease_digest
from sidecar.cache.records import AdapterRecord, FileRecord
from sidecar.cache.store import AdapterStore
from sidecar.core.errors import LeaseNotFound
from sidecar.core.metrics import Metrics
from tests.support.processes import SidecarProcess, get_blocking, post_blocking, stage_blocking
from tests.support.settings import local_registry_adapter
from tests.support.waiting import eventually_blocking

# Longer than a kill and a restart take on a loaded 2-core machine (7.8 s seen under a load
# average of 20): the leases must still be live when the second process reads them back.
LEASE_TTL_S = 20.0


def cached_ids(url: str) -> set[str]:
    status, body = get_blocking(url, "/adapters")
    assert status == 200, body
    adapters = body["adapters"]
    assert isinstance(adapters, list)
    return {a["adapter_id"] for a in adapters}


def unix_of(iso: object) -> float:
    assert isinstance(iso, str)
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_leases_survive_sigkill_and_hold_their_adapters_over_budget_until_they_end(
    tmp_path: Path, sidecar_processes: list[SidecarProcess]
) -> None:
    for seed, adapter_id in enumerate(("c", "a", "b")):
        local_registry_adapter(tmp_path, adapter_id, seed=seed)
    args = ["--registry", str(tmp_path / "registry"), "--cache-root", str(tmp_path / "cache"),
            "--min-free-disk", "0", "--lease-ttl", str(LEASE_TTL_S)]
    first = SidecarProcess([*args, "--max-adapters", "3"], tmp_path / "first.log")
    sidecar_processes.append(first)
    answers = {}
    for adapter_id in ("c", "a", "b"):
        status, body = stage_blocking(first.url, adapter_id, 30)
        assert status == 200, body
        answers[adapter_id] = body
        if adapter_id == "c":  # done before the crash: c is protected by nothing
            assert post_blocking(first.url, "/release", {"lease_id": body["lease_id"]})[0] == 200
    first.kill()  # vLLM may still be reading a and b

    # Restarted with a budget smaller than one adapter: only leases keep anything cached.
    second = SidecarProcess([*args, "--max-adapters", "3", "--max-bytes", "4KiB"],
                            tmp_path / "second.log")
    sidecar_processes.append(second)
    assert cached_ids(second.url) == {"a", "b"}, "a leased adapter was evicted at restart"
    status, listing = get_blocking(second.url, "/adapters")
    assert status == 200 and listing["cache"]["active_leases"] == 2  # type: ignore[index]

    # Released with the id the first process handed out: a goes at once (over budget).
    status, body = post_blocking(second.url, "/release", {"lease_id": answers["a"]["lease_id"]})
    assert status == 200 and body["adapter_id"] == "a", body
    assert cached_ids(second.url) == {"b"}
    status, body = post_blocking(second.url, "/release", {"lease_id": answers["a"]["lease_id"]})
    assert status == 404 and body["error"] == "lease_not_found"

    # b's lease ends when the first process said it would, not before, and b goes then.
    expires_at = unix_of(answers["b"]["lease_expires_at"])
    eventually_blocking(lambda: "b" not in cached_ids(second.url),
                        timeout_s=expires_at + 5 - time.time(), poll_s=0.05,
                        what="b gone once its lease expired (it outlived it)")
    assert time.time() >= expires_at - 0.3, "b was evicted before its lease expired"
    log = second.log_text()
    assert "leases=2" in log and "evicted adapter_id=b" in log


# ---- the store and its journal, with clocks the test controls ------------------------------


class Clock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def new_store(root: Path, wall: Clock, monotonic: Clock, ttl_s: float = 60.0,
              max_leases: int = 100_000) -> AdapterStore:
    return AdapterStore(root, max_bytes=10**9, max_adapters=10, min_free_bytes=0,
                        lease_ttl_s=ttl_s, metrics=Metrics(CollectorRegistry(), process=False),
                        max_leases=max_leases, clock=wall, monotonic=monotonic)


def records(wall: Clock) -> list[AdapterRecord]:
    return [AdapterRecord(i, "test", wall(), {"w": FileRecord(10, "e", "0" * 8)})
            for i in ("a", "b")]


def make_store(root: Path, wall: Clock, monotonic: Clock, ttl_s: float = 60.0) -> AdapterStore:
    store = new_store(root, wall, monotonic, ttl_s)
    store.install(records(wall))
    return store


def test_a_stepped_wall_clock_neither_ends_nor_extends_a_live_lease(tmp_path: Path) -> None:
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = make_store(tmp_path, wall, monotonic)
    lease = store.lease("a")
    assert lease.expires_at_unix == wall.now_s + 60

    wall.now_s += 3600  # NTP steps the clock an hour forward
    assert store.expire_leases() == []
    assert store.is_protected("a")
    wall.now_s -= 7200  # and two hours back
    monotonic.now_s += 59
    assert store.expire_leases() == []
    monotonic.now_s += 1
    assert [ended.lease_id for ended in store.expire_leases()] == [lease.lease_id]
    assert not store.is_protected("a")


def journaled_store(root: Path, wall: Clock, monotonic: Clock, boot_id: str,
                    max_leases: int = 100_000) -> AdapterStore:
    """A store recovered as recovery.py does it: records, the journal's leases, the journal."""
    store = new_store(root, wall, monotonic, max_leases=max_leases)
    journal = LeaseJournal(root / LEASE_JOURNAL_NAME, wall=wall, monotonic=monotonic,
                           boot_id=boot_id, max_leases=store.max_leases)
    store.install(records(wall), leases=journal.load(store.lease_ttl_s), lease_journal=journal)
    journal.reset(store.live_leases())
    return store


def test_a_restart_on_the_same_boot_ages_leases_by_the_monotonic_clock(tmp_path: Path) -> None:
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1")
    kept, released = store.lease("a"), store.lease("b")
    store.release(released.lease_id)
    store.lease_journal.flush()  # type: ignore[union-attr]
    raw = (tmp_path / LEASE_JOURNAL_NAME).read_text()
    assert kept.lease_id not in raw and lease_digest(kept.lease_id) in raw  # only digests

    monotonic.now_s += 20  # 20 s later, with the wall clock stepped two hours forward
    wall.now_s += 7200
    again = journaled_store(tmp_path, wall, monotonic, "boot-1")
    assert again.lease_count("a") == 1 and again.lease_count("b") == 0
    assert again.seconds_to_next_expiry() == pytest.approx(40, abs=0.01)
    with pytest.raises(LeaseNotFound):
        again.release(released.lease_id)
    assert again.release(kept.lease_id).adapter_id == "a"
    with pytest.raises(LeaseNotFound):  # a digest is not a lease id
        again.release("#" + lease_digest(kept.lease_id))


@pytest.mark.parametrize(("wall_step_s", "remaining_s"), [
    (20.0, 40.0),  # the wall clock is all a new boot can compare
    (-3600.0, 60.0),  # stepped back: never more than the lease's own TTL
    (61.0, None),  # past its end
])
def test_after_a_reboot_leases_age_by_the_wall_clock_clamped_to_their_ttl(
    tmp_path: Path, wall_step_s: float, remaining_s: float | None
) -> None:
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1")
    store.lease("a")
    wall.now_s += wall_step_s
    monotonic.now_s = 12.0  # a fresh boot's clock starts again
    again = journaled_store(tmp_path, wall, monotonic, "boot-2")
    if remaining_s is None:
        assert again.lease_count("a") == 0
    else:
        assert again.seconds_to_next_expiry() == pytest.approx(remaining_s, abs=0.01)


def journal_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob(f"{LEASE_JOURNAL_NAME}*"))


def test_the_journal_is_compacted_beside_new_appends_and_skips_a_torn_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sidecar.cache.lease_journal.COMPACT_MIN_BYTES", 4096)
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1")
    journal = store.lease_journal
    assert journal is not None
    live = store.lease("b")
    for _ in range(200):
        store.release(store.lease("a").lease_id)
    journal.flush()
    grown = journal_bytes(tmp_path)
    assert journal.compaction_due(store.live_lease_count)
    assert journal.begin_compaction()
    during = store.lease("a")  # granted while the merge runs: in the fresh file
    journal.merge()
    assert not journal.compacting_path.exists()
    assert journal_bytes(tmp_path) < grown / 10
    with open(tmp_path / LEASE_JOURNAL_NAME, "a") as f:
        f.write("G 0123456789abcdef0123456789abcdef a 60000 18000")  # a crash mid-line
    again = journaled_store(tmp_path, wall, monotonic, "boot-1")
    assert (again.lease_count("a"), again.lease_count("b")) == (1, 1)
    assert again.release(live.lease_id).adapter_id == "b"
    assert again.release(during.lease_id).adapter_id == "a"


def test_a_crash_between_the_merge_and_removing_its_input_loses_nothing(
    tmp_path: Path
) -> None:
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1")
    journal = store.lease_journal
    assert journal is not None
    kept, released = store.lease("a"), store.lease("b")
    store.release(released.lease_id)
    journal.flush()
    assert journal.begin_compaction()
    compacting = journal.compacting_path.read_bytes()
    journal.merge()
    journal.compacting_path.write_bytes(compacting)  # as if killed before the unlink
    again = journaled_store(tmp_path, wall, monotonic, "boot-1")
    assert (again.lease_count("a"), again.lease_count("b")) == (1, 0)
    assert again.release(kept.lease_id).adapter_id == "a"


def test_past_the_cap_a_restart_keeps_the_newest_leases(tmp_path: Path) -> None:
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1", max_leases=3)
    leases = [store.lease("a") for _ in range(5)]
    again = new_store(tmp_path, wall, monotonic)
    journal = LeaseJournal(tmp_path / LEASE_JOURNAL_NAME, wall=wall, monotonic=monotonic,
                           boot_id="boot-1", max_leases=3)
    again.install(records(wall), leases=journal.load(again.lease_ttl_s))
    assert again.lease_count("a") == 3
    with pytest.raises(LeaseNotFound):
        again.release(leases[1].lease_id)
    assert again.release(leases[2].lease_id).adapter_id == "a"


def test_lines_not_written_by_a_sidecar_are_skipped_and_end_no_lease(tmp_path: Path) -> None:
    """A line damaged or written by something else (a bad id, a field that is not a whole
    number, one missing, another kind) is skipped on its own: it neither takes a place under
    the cap nor ends the lease of a digest it names."""
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1", max_leases=2)
    first, second = store.lease("a"), store.lease("b")
    journal = store.lease_journal
    assert journal is not None
    journal.flush()
    taken = lease_digest(second.lease_id)
    with open(tmp_path / LEASE_JOURNAL_NAME, "a") as f:
        for line in (f"G {taken} ../a 60000 1800000000000 5000000",  # not an adapter id
                     f"G {taken} a 6e4 1800000000000 5000000",  # not a whole number
                     f"G {taken} a -60000 1800000000000 5000000",
                     f"G {taken} a \uff166 1800000000000 5000000",  # a digit, not ASCII
                     f"G {taken} a  1800000000000 5000000",  # a field missing
                     f"G {taken} a 60000 1800000000000 5000000 extra",
                     f"X {taken}", f"E {taken} extra", "E", ""):
            f.write(line + "\n")
    again = journaled_store(tmp_path, wall, monotonic, "boot-1", max_leases=2)
    assert (again.lease_count("a"), again.lease_count("b")) == (1, 1)
    assert again.release(first.lease_id).adapter_id == "a"
    assert again.release(second.lease_id).adapter_id == "b"


def test_a_merge_past_the_cap_keeps_the_newest_live_leases(tmp_path: Path) -> None:
    """Many more grants than the cap, none released: the merge keeps exactly the newest
    --max-leases, as the process that granted them did."""
    wall, monotonic = Clock(1_800_000_000.0), Clock(5_000.0)
    store = journaled_store(tmp_path, wall, monotonic, "boot-1", max_leases=50)
    leases = [store.lease("a" if i % 3 else "b") for i in range(1_000)]
    journal = store.lease_journal
    assert journal is not None
    assert journal.begin_compaction()
    journal.merge()
    again = journaled_store(tmp_path, wall, monotonic, "boot-1", max_leases=50)
    assert again.live_lease_count == 50
    for lease in leases[-50:]:
        assert again.release(lease.lease_id).adapter_id == lease.adapter_id
    with pytest.raises(LeaseNotFound):
        again.release(leases[-51].lease_id)
