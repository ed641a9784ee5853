"""Which cached adapter goes first when room is needed: the eviction policies, behind the one
interface the store calls (`admitted`, `used`, `evicted`, `order`).

Every policy keeps the same frequency memory (frequency.py), so a change of policy keeps the
counts. Adapters the store protects (leased, pinned, claimed) are never in an order. An order
is lazy: the store takes victims from it one by one until the budget holds, and a policy that
moves adapters between its queues while choosing (S3-FIFO, W-TinyLFU) does so as it goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from ..config import EvictionPolicyName
from .frequency import COUNTER_MAX, FrequencySketch
from .lru import CachedAdapter, LruIndex, eviction_order

IsProtected = Callable[[str], bool]

# Counts are halved every AGING x (adapters on disk) requests: chosen by benchmarks/policy.py
# (its README section says why: with the two rules below to follow a shift, slower aging keeps
# the counts of stationary traffic long enough to rank the adapters near the edge of the room).
AGING = 40
# Aged LFU takes a cached adapter's count as out of date once it goes unasked STALE times as
# long as that count predicts (a count c per aging period: one request every period / c);
# measured in benchmarks/policy.py (hot sets replaced every 500 requests: +0.02 of Belady;
# stationary and scan traces: within 0.005; 3 loses 0.01 on Zipf 0.8, 2 loses 0.02).
STALE = 4
# And at least as high as its recent rate: an adapter asked for RECENT times within the last d
# requests ranks as if its count were RECENT_WEIGHT x RECENT x period / d (at most the counters'
# cap), so the new favourites of a shifted popularity, and in a young cache the adapters asked
# for most lately, win their place before their counts have grown; measured in
# benchmarks/policy.py (its README section gives the figures and the variants not kept).
RECENT = 4
RECENT_WEIGHT = 0.4
# The last RECENT request times are kept for the ids asked for most lately, at most HISTORY x
# (adapters on disk) of them (and HISTORY_MIN), whatever the number of ids.
HISTORY = 4
HISTORY_MIN = 64


class EvictionPolicy:
    """Least recently used first (the index's own order); the base of the others."""

    name: ClassVar[EvictionPolicyName] = EvictionPolicyName.LRU

    def __init__(self, *, max_bytes: int, max_adapters: int,
                 sketch: FrequencySketch | None = None, aging: int = AGING) -> None:
        self.max_bytes = max_bytes
        self.max_adapters = max_adapters
        self.sketch = sketch or FrequencySketch()
        self.aging = aging
        self._cached = 0

    def admitted(self, adapter: CachedAdapter, *, newest: bool) -> None:
        """A new adapter in the index (`newest` false: one nobody asked for, first to go)."""
        self._cached += 1
        self.sketch.period = self.aging * max(self._cached, 1)

    def used(self, adapter_id: str) -> None:
        """A request for a cached adapter: a hit, or the lease after a miss."""
        self.sketch.add(adapter_id)

    def evicted(self, adapter_id: str) -> None:
        """The adapter left the index (evicted or vanished); its count stays in the sketch."""
        self._cached = max(self._cached - 1, 0)

    def order(self, index: LruIndex, is_protected: IsProtected) -> Iterator[CachedAdapter]:
        """The adapters that may be evicted, in the order they go."""
        return eviction_order(index, is_protected)

    def standing(self, adapter_id: str) -> dict[str, int | str]:
        """What decides the adapter's turn, for GET /adapters."""
        return {"policy": self.name.value, "count": self.sketch.estimate(adapter_id)}


class AgedLfu(EvictionPolicy):
    """The lowest request count goes first, ties to the least recently used. Counts outlive
    eviction (a popular adapter evicted once comes back with its history) and are halved every
    AGING x (adapters on disk) requests, so a shift in popularity wins within a few periods.

    A cached adapter silent for longer than its count predicts is ranked as if its count were
    halved once for every STALE x (period / count) requests of silence: the formerly hot
    adapters of a shifted popularity go before their counts have aged, while one that is just
    between requests keeps its place.

    An adapter asked for RECENT times lately ranks at least as its rate over those requests
    says (in the count's units, discounted by RECENT_WEIGHT): the new favourites of a shift are
    kept on their first few requests, where their counts alone would still rank them last."""

    name = EvictionPolicyName.LFU

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._counts: dict[str, int] = {}  # the sketch's estimate of each cached adapter
        self._halvings = self.sketch.halvings
        self._requests = 0  # since start: the clock of silences (not saved; a restart resets)
        self._last: dict[str, int] = {}  # each cached adapter's last request on that clock
        # The last RECENT requests of the ids asked for lately, newest first (cached or not;
        # at most HISTORY x cached ids, least recently asked dropped first; not saved either).
        self._recent: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._history_max = HISTORY_MIN

    def admitted(self, adapter: CachedAdapter, *, newest: bool) -> None:
        super().admitted(adapter, newest=newest)
        self._counts[adapter.adapter_id] = self.sketch.estimate(adapter.adapter_id)
        self._last[adapter.adapter_id] = self._requests
        self._bound_history()

    def used(self, adapter_id: str) -> None:
        # Called on every hit: locals and one membership test (hit path).
        requests = self._requests = self._requests + 1
        sketch = self.sketch
        count = sketch.add(adapter_id)
        if sketch.halvings != self._halvings:
            self._halvings = sketch.halvings
            self._counts = {cached: sketch.estimate(cached) for cached in self._counts}
        if adapter_id in self._counts:  # cached: `_last` has the same ids
            self._counts[adapter_id] = count
            self._last[adapter_id] = requests
        recent = self._recent
        times = recent.pop(adapter_id, None)
        recent[adapter_id] = (requests,) if times is None else (requests, *times[:RECENT - 1])
        while len(recent) > self._history_max:
            recent.popitem(last=False)

    def evicted(self, adapter_id: str) -> None:
        super().evicted(adapter_id)
        self._counts.pop(adapter_id, None)
        self._last.pop(adapter_id, None)
        self._bound_history()

    def _bound_history(self) -> None:
        """The recent-request history's bound, kept as adapters come and go rather than
        worked out on every request (hit path)."""
        self._history_max = max(HISTORY * self._cached, HISTORY_MIN)

    def order(self, index: LruIndex, is_protected: IsProtected) -> Iterator[CachedAdapter]:
        counts, last, recent, now = self._counts, self._last, self._recent, self._requests
        period = max(self.sketch.period, 1)
        stretch = STALE * period  # x count: silences of STALE x expected
        lately = RECENT_WEIGHT * RECENT * period  # / the span of the last RECENT requests

        # Every evictable adapter is ranked at each eviction: the rank is worked out in the
        # loop, not by a function called per adapter (2.0 → 1.4 ms among 2,048 cached).
        candidates: list[CachedAdapter] = []
        ranks: list[float] = []
        for adapter_id, adapter in index.items():
            if is_protected(adapter_id):
                continue
            count = counts.get(adapter_id, 0)
            if count:  # halved once per STALE x (period / count) of silence
                count >>= min((now - last.get(adapter_id, now)) * count // stretch, 8)
            times = recent.get(adapter_id)
            if times is not None and len(times) >= RECENT:
                ranks.append(max(count, min(lately / (now - times[-1] + 1), COUNTER_MAX)))
            else:
                ranks.append(count)
            candidates.append(adapter)
        ranked = sorted(range(len(ranks)), key=ranks.__getitem__)  # stable: LRU among equals
        return map(candidates.__getitem__, ranked)


class _Queues(EvictionPolicy):
    """Adapters kept in named FIFO/LRU queues (id -> size), for S3-FIFO and W-TinyLFU."""

    QUEUES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._queues: dict[str, OrderedDict[str, int]] = {q: OrderedDict() for q in self.QUEUES}
        self._where: dict[str, str] = {}

    def _put(self, queue: str, adapter_id: str, size_bytes: int, *, first: bool = False) -> None:
        self._take(adapter_id)
        self._queues[queue][adapter_id] = size_bytes
        if first:
            self._queues[queue].move_to_end(adapter_id, last=False)
        self._where[adapter_id] = queue

    def _take(self, adapter_id: str) -> int | None:
        queue = self._where.pop(adapter_id, None)
        return None if queue is None else self._queues[queue].pop(adapter_id)

    def _over(self, queue: str, share: float, gone: set[str]) -> bool:
        """Whether `queue` holds more than `share` of either budget (and more than one)."""
        members = [(i, s) for i, s in self._queues[queue].items() if i not in gone]
        return len(members) > 1 and (
            sum(s for _, s in members) > share * self.max_bytes
            or len(members) > share * self.max_adapters)

    def evicted(self, adapter_id: str) -> None:
        super().evicted(adapter_id)
        self._take(adapter_id)

    def _first(self, queue: str, skip: Callable[[str], bool]) -> str | None:
        return next((i for i in self._queues[queue] if not skip(i)), None)

    def standing(self, adapter_id: str) -> dict[str, int | str]:
        shown = super().standing(adapter_id)
        queue = self._where.get(adapter_id)
        if queue is not None:
            shown["queue"] = queue
        return shown


class S3Fifo(_Queues):
    """S3-FIFO (Yang et al., SOSP 2023): new adapters enter a small FIFO (SMALL of the budget);
    one used again before it reaches the head moves to the main FIFO, others leave and are
    remembered in a ghost list, whose ids go straight to main when they come back. Main is a
    FIFO with a 2-bit use counter: a used adapter at the head goes round again."""

    name = EvictionPolicyName.S3FIFO
    QUEUES = ("small", "main")
    SMALL = 0.1
    MOVE_AT = 1  # uses in small that earn a place in main

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._uses: dict[str, int] = {}
        self._ghost: OrderedDict[str, None] = OrderedDict()
        # Downloaded for a request whose own lease is still to come: that use is the miss,
        # not a use after insertion, which is what S3-FIFO counts.
        self._fresh: set[str] = set()

    def admitted(self, adapter: CachedAdapter, *, newest: bool) -> None:
        super().admitted(adapter, newest=newest)
        adapter_id = adapter.adapter_id
        returning = adapter_id in self._ghost
        self._ghost.pop(adapter_id, None)
        self._put("main" if returning else "small", adapter_id, adapter.size_bytes,
                  first=not newest)
        self._uses[adapter_id] = 0
        if newest:
            self._fresh.add(adapter_id)

    def used(self, adapter_id: str) -> None:
        super().used(adapter_id)
        if adapter_id in self._fresh:
            self._fresh.discard(adapter_id)
        elif adapter_id in self._uses:
            self._uses[adapter_id] = min(self._uses[adapter_id] + 1, 3)

    def standing(self, adapter_id: str) -> dict[str, int | str]:
        shown = super().standing(adapter_id)
        if adapter_id in self._uses:
            shown["uses"] = self._uses[adapter_id]  # since it entered its queue, at most 3
        return shown

    def evicted(self, adapter_id: str) -> None:
        if self._where.get(adapter_id) == "small":
            self._ghost[adapter_id] = None
            while len(self._ghost) > max(len(self._where), self.max_adapters):
                self._ghost.popitem(last=False)
        super().evicted(adapter_id)
        self._uses.pop(adapter_id, None)
        self._fresh.discard(adapter_id)

    def order(self, index: LruIndex, is_protected: IsProtected) -> Iterator[CachedAdapter]:
        gone: set[str] = set()
        while True:
            # Taking from small may move its used adapters to main, where a victim then is.
            small, main = self._from_small, self._from_main
            if self._over("small", self.SMALL, gone):
                victim = small(is_protected, gone) or main(is_protected, gone)
            else:
                victim = (main(is_protected, gone) or small(is_protected, gone)
                          or main(is_protected, gone))
            if victim is None:
                return
            gone.add(victim)
            yield index[victim]

    def _from_small(self, is_protected: IsProtected, gone: set[str]) -> str | None:
        for adapter_id in list(self._queues["small"]):
            if adapter_id in gone or is_protected(adapter_id):
                continue
            if self._uses[adapter_id] >= self.MOVE_AT:
                self._put("main", adapter_id, self._queues["small"][adapter_id])
                self._uses[adapter_id] = 0
                continue
            return adapter_id
        return None

    def _from_main(self, is_protected: IsProtected, gone: set[str]) -> str | None:
        main = self._queues["main"]
        for _ in range(4):  # a use counter is at most 3: the fourth round finds a victim
            for adapter_id in list(main):
                if adapter_id in gone or is_protected(adapter_id):
                    continue
                if self._uses[adapter_id] == 0:
                    return adapter_id
                self._uses[adapter_id] -= 1
                main.move_to_end(adapter_id)
        return None


class WTinyLfu(_Queues):
    """W-TinyLFU (Einziger et al., as Caffeine runs it): new adapters enter a small LRU window
    (WINDOW of the budget); those pushed out of it join probation as candidates, and when room
    is needed the newest candidate duels probation's least recently used: the one asked for
    less often (by the sketch) goes. Main is a segmented LRU: probation, and a protected
    segment (PROTECTED of the budget) for adapters used again there."""

    name = EvictionPolicyName.TINYLFU
    QUEUES = ("window", "probation", "protected")
    WINDOW = 0.01
    PROTECTED = 0.8

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._candidates: OrderedDict[str, None] = OrderedDict()  # left the window, undecided

    def admitted(self, adapter: CachedAdapter, *, newest: bool) -> None:
        super().admitted(adapter, newest=newest)
        if not newest:
            self._put("probation", adapter.adapter_id, adapter.size_bytes, first=True)
            return
        self._put("window", adapter.adapter_id, adapter.size_bytes)
        while self._over("window", self.WINDOW, set()):
            leaving = next(iter(self._queues["window"]))
            self._put("probation", leaving, self._queues["window"][leaving])
            self._candidates[leaving] = None

    def used(self, adapter_id: str) -> None:
        super().used(adapter_id)
        queue = self._where.get(adapter_id)
        if queue == "window" or queue == "protected":
            self._queues[queue].move_to_end(adapter_id)
        elif queue == "probation":
            self._candidates.pop(adapter_id, None)
            self._put("protected", adapter_id, self._queues["probation"][adapter_id])
            while self._over("protected", self.PROTECTED, set()):
                demoted = next(iter(self._queues["protected"]))
                self._put("probation", demoted, self._queues["protected"][demoted])

    def evicted(self, adapter_id: str) -> None:
        super().evicted(adapter_id)
        self._candidates.pop(adapter_id, None)

    def order(self, index: LruIndex, is_protected: IsProtected) -> Iterator[CachedAdapter]:
        gone: set[str] = set()

        def skip(adapter_id: str) -> bool:
            return adapter_id in gone or is_protected(adapter_id)

        while True:
            victim: str | None
            candidate = next((c for c in reversed(self._candidates) if not skip(c)), None)
            head = next((i for i in self._queues["probation"]
                         if not skip(i) and i != candidate), None)
            if candidate is not None and head is not None:
                estimate = self.sketch.estimate
                victim = head if estimate(candidate) > estimate(head) else candidate
                winner = candidate if victim == head else head
                self._candidates.pop(winner, None)  # admitted to main: no longer on trial
            else:
                victim = (candidate or head or self._first("protected", skip)
                          or self._first("window", skip))
            if victim is None:
                return
            gone.add(victim)
            yield index[victim]


POLICIES: dict[EvictionPolicyName, type[EvictionPolicy]] = {
    policy.name: policy for policy in (EvictionPolicy, AgedLfu, S3Fifo, WTinyLfu)}


def make_policy(name: EvictionPolicyName, *, max_bytes: int, max_adapters: int,
                sketch: FrequencySketch | None = None, aging: int = AGING) -> EvictionPolicy:
    return POLICIES[name](max_bytes=max_bytes, max_adapters=max_adapters, sketch=sketch,
                          aging=aging)
