"""The eviction policies: aging, counts that outlive eviction and restart, adapters in use never
chosen, every other adapter reachable, bounded state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.cache.eviction import (
    HISTORY,
    HISTORY_MIN,
    POLICIES,
    AgedLfu,
    EvictionPolicy,
    S3Fifo,
    make_policy,
)
from sidecar.cache.frequency import FREQUENCY_FILE_NAME, FrequencySketch
from sidecar.cache.lru import CachedAdapter, LruIndex
from sidecar.cache.records import AdapterRecord, FileRecord
from sidecar.cache.store import AdapterStore
from sidecar.config import EvictionPolicyName
from sidecar.core.metrics import Metrics

ALL = list(EvictionPolicyName)


def record(adapter_id: str, size_bytes: int = 10) -> AdapterRecord:
    return AdapterRecord(adapter_id, "test", 0.0, {"w": FileRecord(size_bytes, "e", "0" * 8)})


class Cache:
    """The store's calls into its policy, without the disk: what benchmarks/policy.py drives."""

    def __init__(self, policy: EvictionPolicy, room: int) -> None:
        self.policy, self.room = policy, room
        self.index = LruIndex()
        self.protected: set[str] = set()
        self.evicted: list[str] = []

    def request(self, adapter_id: str) -> bool:
        hit = adapter_id in self.index
        if not hit:
            while len(self.index) + 1 > self.room:
                victim = next(self.policy.order(self.index, self.protected.__contains__), None)
                if victim is None:
                    break
                self.evict(victim.adapter_id)
            adapter = CachedAdapter(record(adapter_id), 0.0)
            self.index.add_newest(adapter)
            self.policy.admitted(adapter, newest=True)
        self.index.touch(adapter_id)
        self.policy.used(adapter_id)
        return hit

    def evict(self, adapter_id: str) -> None:
        del self.index[adapter_id]
        self.policy.evicted(adapter_id)
        self.evicted.append(adapter_id)


def lfu(room: int, aging: int = 10) -> Cache:
    return Cache(make_policy(EvictionPolicyName.LFU, max_bytes=10**9, max_adapters=room,
                             aging=aging), room)


def test_the_least_used_goes_first_and_equals_go_least_recently_used_first() -> None:
    cache = lfu(room=3)
    for adapter_id in ("a", "a", "a", "b", "c", "b"):
        cache.request(adapter_id)
    order = [a.adapter_id for a in cache.policy.order(cache.index, lambda _: False)]
    assert order == ["c", "b", "a"]
    cache.request("d")  # c goes: fewest requests
    assert cache.evicted == ["c"]
    cache.request("e")  # d (1) and b (2): d goes
    assert cache.evicted == ["c", "d"]


def test_a_popular_adapter_evicted_comes_back_with_its_count() -> None:
    cache = lfu(room=2, aging=1000)
    for _ in range(5):
        cache.request("hot")
    cache.evict("hot")  # an operator's eviction, say
    cache.request("x")
    cache.request("hot")  # back: 6 requests, against x's one
    cache.request("y")

    assert cache.evicted == ["hot", "x"]
    assert cache.policy.standing("hot") == {"policy": "lfu", "count": 6}


def test_aging_lets_a_new_favourite_overtake_an_old_one() -> None:
    """Without halving the old favourite's 200 requests would keep it for 200 more."""
    room = 2
    cache = lfu(room=room, aging=10)  # halved every 20 requests
    for _ in range(200):
        cache.request("old")
    for _ in range(30):
        cache.request("new")
        cache.request(f"once-{random.random()}")
    # Each burst of newcomers now finds 'old' the least used of the two: it went.
    assert "old" in cache.evicted
    assert "new" in cache.index
    assert cache.policy.sketch.halvings >= 10


def test_a_favourite_silent_far_longer_than_its_count_predicts_goes_before_a_lesser_one() -> None:
    """No halving here (3,000 requests a period): only the silence ranks 'old' below 'mid'."""
    cache = lfu(room=3, aging=1000)
    for _ in range(15):
        cache.request("old")
    for _ in range(3):
        cache.request("mid")
    for i in range(100):
        cache.request(f"once-{i}")  # one-offs take turns in the third place
    order = [a.adapter_id for a in cache.policy.order(cache.index, lambda _: False)]
    assert order[1:] == ["mid", "old"]  # 100 requests: about what 15 in 3,000 predicts
    # Silent for 2,400 requests (15 x 2,400 // (4 x 3,000) = 3 halvings): ranked as 15 >> 3 = 1,
    # a one-off's rank, and older than the one-off, it goes on the next miss; 'mid' stays.
    for i in range(100, 2500):
        cache.request(f"once-{i}")
    assert "old" in cache.evicted and "mid" in cache.index
    assert cache.policy.sketch.halvings == 0
    assert cache.policy.standing("mid")["count"] == 3


def test_a_newcomer_asked_for_often_lately_goes_after_an_older_larger_count() -> None:
    """Halving every 60 requests (20 x 3 on disk), none here: only the rate of the last four
    requests puts 'new' (4 requests in a row) above 'steady' (6, the last four spread out)."""
    cache = lfu(room=3, aging=20)
    cache.request("steady")
    cache.request("steady")
    for i in range(4):
        cache.request("steady")
        for j in range(9):
            cache.request(f"once-{i}-{j}")
    for _ in range(4):
        cache.request("new")
    assert cache.policy.sketch.halvings == 0
    assert [cache.policy.standing(i)["count"] for i in ("steady", "new")] == [6, 4]
    order = [a.adapter_id for a in cache.policy.order(cache.index, lambda _: False)]
    assert order[1:] == ["steady", "new"]
    # Once 'new' is silent, its rate fades with the span of its last four requests.
    for i in range(20):
        cache.request(f"later-{i}")
        cache.request("steady")
    order = [a.adapter_id for a in cache.policy.order(cache.index, lambda _: False)]
    assert order.index("new") < order.index("steady")


@pytest.mark.parametrize("name", ALL)
def test_an_adapter_in_use_is_never_a_victim(name: EvictionPolicyName) -> None:
    rng = random.Random(7)
    policy = make_policy(name, max_bytes=10**9, max_adapters=8)
    cache = Cache(policy, room=8)
    for step in range(5000):
        adapter_id = f"a{min(int(rng.paretovariate(1.0)), 40)}"
        if rng.random() < 0.2 and cache.index:
            cache.protected ^= {rng.choice(list(cache.index))}  # leased, or released
        cache.protected &= set(cache.index)
        before, evicted = set(cache.protected), len(cache.evicted)
        cache.request(adapter_id)
        assert not before & set(cache.evicted[evicted:]), step
        order = [a.adapter_id for a in policy.order(cache.index, cache.protected.__contains__)]
        # Every unprotected adapter can be reached, once: the budget can always be restored.
        assert sorted(order) == sorted(set(cache.index) - cache.protected)


@pytest.mark.parametrize("name", ALL)
def test_with_everything_in_use_there_is_no_victim(name: EvictionPolicyName) -> None:
    cache = Cache(make_policy(name, max_bytes=10**9, max_adapters=4), room=4)
    for adapter_id in "abcd":
        cache.request(adapter_id)
    cache.protected = set("abcd")
    assert list(cache.policy.order(cache.index, cache.protected.__contains__)) == []
    cache.request("e")  # over the room: held, as the store keeps it until a release
    assert cache.evicted == []


def test_s3fifo_keeps_its_ghosts_bounded_and_sends_returning_ids_to_main() -> None:
    policy = make_policy(EvictionPolicyName.S3FIFO, max_bytes=10**9, max_adapters=10)
    assert isinstance(policy, S3Fifo)
    cache = Cache(policy, room=10)
    for n in range(5000):
        cache.request(f"scan-{n}")
    assert len(policy._ghost) <= 10
    assert len(policy._where) == len(cache.index) == 10
    ghost = next(reversed(policy._ghost))
    cache.request(ghost)
    assert policy.standing(ghost)["queue"] == "main"


@pytest.mark.parametrize("name", ALL)
def test_state_stays_bounded_by_the_cache_whatever_the_ids(name: EvictionPolicyName) -> None:
    policy = make_policy(name, max_bytes=10**9, max_adapters=16)
    cache = Cache(policy, room=16)
    rng = random.Random(3)
    for _ in range(20_000):
        cache.request(f"id-{rng.randrange(100_000)}")
    assert policy.sketch.size_bytes == FrequencySketch().size_bytes
    # Aged LFU's recent request times have their own bound, a few times the cache's.
    bounds = {"_recent": max(HISTORY * 16, HISTORY_MIN)}
    for name_, state in vars(policy).items():
        if isinstance(state, dict) and name_ != "_queues":
            assert len(state) <= bounds.get(name_, 16), name_
    assert policy._cached == 16


def store(root: Path, name: EvictionPolicyName = EvictionPolicyName.LFU) -> AdapterStore:
    return AdapterStore(root, max_bytes=10**9, max_adapters=2, min_free_bytes=0,
                        lease_ttl_s=60.0, max_leases=100,
                        metrics=Metrics(CollectorRegistry(), process=False), eviction_policy=name)


async def test_counts_outlive_a_restart_and_choose_the_victim(tmp_path: Path) -> None:
    first = store(tmp_path)
    first.prepare()
    for adapter_id in ("hot", "cold"):
        (tmp_path / "adapters" / adapter_id).mkdir()
    first.install([record("hot"), record("cold")])
    for _ in range(5):
        first.touch("hot")
    first.touch("cold")
    await first.close()
    assert (tmp_path / FREQUENCY_FILE_NAME).is_file()

    second = store(tmp_path)
    second.prepare()
    # Installed with 'hot' the more recently staged: LRU would evict it first, LFU will not.
    second.install([record("cold"), record("hot")])
    assert second.standing("hot") == {"policy": "lfu", "count": 5}
    async with second.staging("new") as staging:
        await staging.reserve(10, wait_s=0)  # room for it: one of the two goes
        second.admit(record("new"), staging=staging.path)

    assert second.get("hot") is not None and second.get("cold") is None
    await second.close()


async def test_a_store_under_lru_still_keeps_and_shows_the_counts(tmp_path: Path) -> None:
    lru = store(tmp_path, EvictionPolicyName.LRU)
    lru.prepare()
    (tmp_path / "adapters" / "a").mkdir()
    lru.install([record("a")])
    lru.touch("a")
    assert lru.standing("a") == {"policy": "lru", "count": 1}
    assert lru.eviction_policy is EvictionPolicyName.LRU
    await lru.close()


def test_every_policy_name_has_its_class() -> None:
    assert set(POLICIES) == set(EvictionPolicyName)
    assert isinstance(make_policy(EvictionPolicyName.LFU, max_bytes=1, max_adapters=1), AgedLfu)


async def test_counts_are_saved_when_changed_and_due_not_otherwise(tmp_path: Path) -> None:
    counting = store(tmp_path)
    counting.prepare()
    (tmp_path / "adapters" / "a").mkdir()
    counting.install([record("a")])
    assert not counting.frequency_save_due(every_s=0)  # nothing counted yet
    counting.touch("a")
    assert counting.frequency_save_due(every_s=0)
    assert not counting.frequency_save_due(every_s=3600)  # changed, but saved too recently

    await counting.save_frequencies()

    assert not counting.frequency_save_due(every_s=0)
    assert not (tmp_path / f"{FREQUENCY_FILE_NAME}.new").exists()
    reloaded = store(tmp_path)
    reloaded.prepare()
    assert reloaded.standing("a")["count"] == 1
    await counting.close()
