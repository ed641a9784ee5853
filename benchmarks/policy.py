"""Eviction policies on traces: the store's own policy objects (sidecar/cache/eviction.py),
driven through the calls the store makes, against LRU and the offline optimum (Belady).

    .venv/bin/python -m benchmarks.policy            # every trace, 100,000 requests: 5-20 min
    .venv/bin/python -m benchmarks.policy --quick    # shorter traces, fewer sizes, 3 seeds: 1-3 min
    .venv/bin/python -m benchmarks.policy --robustness  # only the many-seed table: 2 min
    .venv/bin/python -m benchmarks.policy --http     # a running sidecar replays a trace
    benchmarks/run.sh policy [--quick|--http]        # the same, building the venv first

Each request either hits (the store's lease: `used`) or misses: room is made as the store's
reserve() makes it (victims from `order` until the bytes and the count fit), the adapter is
admitted and then leased, as a download for a request is. Nothing is in use between requests
(one at a time), so no adapter is protected. Belady inserts every miss, as the sidecar must,
and evicts the cached adapter asked for again the farthest in the future (never: first); for
adapters of different sizes that rule is a heuristic, not a proven optimum, and a policy may
come out above it. Download seconds: missed bytes at an assumed 200 MB/s (one S3 stream).

The robustness table draws each trace family anew for many seeds (10; --quick 3), short (600
requests, what a fresh sidecar sees), longer (2,000) and long enough for three changes of a
hot set replaced every 2,000 (6,000; not in --quick), at rooms of 5%, 10% and 25%, and gives
the min and median of each policy's ratio to Belady, so that no choice rests on one seed;
beside them exact LFU (evicting by exact counts so far, never aged: the online reference) and
the top-k oracle (evicting by the whole trace's counts: what knowing popularity
exactly would give a frequency policy).

`--http` starts `python -m sidecar serve` on a local registry of tiny adapters, sends each
request of a trace as POST /stage (lease false, one at a time) and counts the answers that
say cached, then simulates the same trace with the same policy: the two must be equal.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.cache.eviction import make_policy
from sidecar.cache.lru import CachedAdapter, LruIndex
from sidecar.cache.records import AdapterRecord, FileRecord
from sidecar.config import EvictionPolicyName
from sidecar.core.fsutil import replace_file

REPO = Path(__file__).resolve().parent.parent
POLICIES = (EvictionPolicyName.LRU, EvictionPolicyName.LFU, EvictionPolicyName.TINYLFU,
            EvictionPolicyName.S3FIFO)
BANDWIDTH_B_S = 200e6  # assumed download speed for "download seconds"
SEED = 20261206
SHIFT_EVERY = (250, 500, 2000)  # requests between changes of the hot set (small traces)
SHORT = 600  # requests of a short trace

# Llama-3-8B: 32 layers, hidden 4096, k/v project to 1,024, intermediate 14,336; bf16.
_PROJECTIONS = {"q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
                "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096)}
TARGETS = {"q,v": ("q", "v"), "q,k,v,o": ("q", "k", "v", "o"), "all 7": tuple(_PROJECTIONS)}
RANKS = (8, 16, 32, 64, 128)


def lora_bytes(rank: int, targets: Sequence[str]) -> int:
    """2 bytes x 32 layers x rank x sum of (d_in + d_out) over the targeted projections."""
    return 2 * 32 * rank * sum(sum(_PROJECTIONS[t]) for t in targets)


# ---- traces --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: list[str]
    sizes: dict[str, int]  # bytes of every adapter of the registry
    by_count: bool = False  # the room is a number of adapters (equal sizes), not bytes

    @property
    def registry_bytes(self) -> int:
        return sum(self.sizes.values())


def realistic_sizes(n: int, rng: random.Random) -> dict[str, int]:
    """Each adapter a rank of 8-128 and q/v to all seven projections, drawn uniformly:
    6.8 MB to 671 MB, uncorrelated with popularity."""
    return {f"a{i}": lora_bytes(rng.choice(RANKS), TARGETS[rng.choice(list(TARGETS))])
            for i in range(n)}


def zipf_draw(n: int, s: float, rng: random.Random) -> Callable[[], int]:
    weights = [1 / (rank + 1) ** s for rank in range(n)]
    total = sum(weights)
    cumulative, acc = [], 0.0
    for w in weights:
        acc += w / total
        cumulative.append(acc)
    import bisect

    return lambda: min(bisect.bisect_left(cumulative, rng.random()), n - 1)


def zipf(n: int, s: float, length: int, rng: random.Random) -> list[int]:
    """Ranks 0..n-1 with P(rank) proportional to 1/(rank+1)^s."""
    draw = zipf_draw(n, s, rng)
    return [draw() for _ in range(length)]


def ranked(ids: list[str], ranks: list[int], rng: random.Random) -> list[str]:
    """Popularity rank -> id through a random permutation (popularity apart from size)."""
    order = ids[:]
    rng.shuffle(order)
    return [order[r] for r in ranks]


def shifting(ids: list[str], s: float, length: int, every: int, hot: int,
             rng: random.Random) -> list[str]:
    """Zipf(s) where, every `every` requests, the `hot` most popular adapters are replaced by
    adapters nobody asked for lately (they trade places with the least popular)."""
    order = ids[:]
    rng.shuffle(order)
    draw = zipf_draw(len(ids), s, rng)
    out = []
    for i in range(length):
        if i and i % every == 0:
            cold = rng.sample(range(len(order) // 2, len(order)), hot)
            for r, c in zip(range(hot), cold, strict=True):
                order[r], order[c] = order[c], order[r]
        out.append(order[draw()])
    return out


def with_scan(ids: list[str], s: float, length: int, rng: random.Random) -> list[str]:
    """Zipf(s) with one request for every adapter, once, in the middle."""
    requests = ranked(ids, zipf(len(ids), s, length, rng), rng)
    scan = ids[:]
    rng.shuffle(scan)
    half = length // 2
    return requests[:half] + scan + requests[half:]


def slora(ids: list[str], alpha: float, length: int, seed: int) -> list[str]:
    """S-LoRA's construction: adapter int(numpy.random.power(alpha) * n) for each request."""
    import numpy

    draws = numpy.random.default_rng(seed).power(alpha, length)
    n = len(ids)
    return [ids[min(int(x * n), n - 1)] for x in draws]


def traces(quick: bool, requests: int | None = None) -> list[tuple[Trace, list[float]]]:
    """Every trace with the cache sizes it is run at (fractions of the registry's bytes, or
    of its adapters for the equal-size ones); `requests`: the long traces' length, when not
    the default (100,000; --quick 20,000)."""
    length = requests or (20_000 if quick else 100_000)
    rng = random.Random(SEED)
    n = 1000
    ids = [f"a{i}" for i in range(n)]
    sizes = realistic_sizes(n, rng)
    out: list[tuple[Trace, list[float]]] = []
    fractions = [0.1, 0.25] if quick else [0.025, 0.05, 0.1, 0.25, 0.5]
    for s in (0.8, 1.0, 1.2):
        out.append((Trace(f"zipf {s}", ranked(ids, zipf(n, s, length, rng), rng), sizes),
                    fractions))
    out.append((Trace("shifting (zipf 1.0, 20 hot replaced every 5,000)",
                      shifting(ids, 1.0, length, 5000, 20, rng), sizes), fractions))
    out.append((Trace("scan (zipf 1.0, all 1,000 once mid-trace)",
                      with_scan(ids, 1.0, length, rng), sizes), fractions))
    for alpha in (0.1, 0.3):
        out.append((Trace(f"S-LoRA power({alpha})", slora(ids, alpha, length, SEED), sizes),
                    fractions))
    # The small shapes of the independent check: equal sizes, room counted in adapters.
    small_n, small_len = 120, 3000 if quick else 12_000
    small_ids = [f"s{i}" for i in range(small_n)]
    equal = dict.fromkeys(small_ids, 1)
    small_fracs = [0.1] if quick else [0.05, 0.1, 0.2, 0.4]
    out.append((Trace("small: zipf 1.0, 120 adapters",
                      ranked(small_ids, zipf(small_n, 1.0, small_len, rng), rng), equal, True),
                small_fracs))
    for every in SHIFT_EVERY:
        out.append((Trace(f"small: shifting, 120 adapters (10 hot replaced every {every:,})",
                          shifting(small_ids, 1.0, small_len, every, 10, rng), equal, True),
                    small_fracs))
    out.append((Trace("small: scan, 120 adapters", with_scan(small_ids, 1.0, small_len, rng),
                      equal, True), small_fracs))
    # What a fresh sidecar driven over HTTP sees: a few hundred requests, the counts still empty.
    short_fracs = [0.1] if quick else [0.05, 0.1, 0.25]
    out.append((Trace(f"short: zipf 1.0, 120 adapters, {SHORT:,} requests",
                      ranked(small_ids, zipf(small_n, 1.0, SHORT, rng), rng), equal, True),
                short_fracs))
    out.append((Trace(f"short: shifting every 250, 120 adapters, {SHORT:,} requests",
                      shifting(small_ids, 1.0, SHORT, 250, 10, rng), equal, True), short_fracs))
    out.append((Trace(f"short: scan, 120 adapters, {SHORT:,} requests",
                      with_scan(small_ids, 1.0, SHORT, rng), equal, True), short_fracs))
    return out


# ---- replay --------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    requests: int = 0
    hits: int = 0
    bytes_requested: int = 0
    bytes_hit: int = 0
    hit_flags: list[bool] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def byte_hit_ratio(self) -> float:
        return self.bytes_hit / self.bytes_requested if self.bytes_requested else 0.0

    @property
    def download_s(self) -> float:
        return (self.bytes_requested - self.bytes_hit) / BANDWIDTH_B_S

    def count(self, hit: bool, size: int, keep_flags: bool) -> None:
        self.requests += 1
        self.bytes_requested += size
        if hit:
            self.hits += 1
            self.bytes_hit += size
        if keep_flags:
            self.hit_flags.append(hit)


def simulate(policy_name: EvictionPolicyName, requests: Sequence[str], sizes: dict[str, int],
             *, max_bytes: int, max_adapters: int, keep_flags: bool = False) -> Outcome:
    """The store's calls, one request at a time: a hit leases (`used`); a miss makes room as
    reserve() does, admits the download and leases it."""
    policy = make_policy(policy_name, max_bytes=max_bytes, max_adapters=max_adapters)
    records = {i: AdapterRecord(i, "trace", 0.0, {"w": FileRecord(size, "e", "0" * 8)})
               for i, size in sizes.items()}
    index = LruIndex()
    cached_bytes = 0
    outcome = Outcome()

    def nothing_in_use(_: str) -> bool:
        return False

    for adapter_id in requests:
        size = sizes[adapter_id]
        hit = adapter_id in index
        if not hit:
            while cached_bytes + size > max_bytes or len(index) + 1 > max_adapters:
                victim = next(policy.order(index, nothing_in_use), None)
                if victim is None:
                    break
                del index[victim.adapter_id]
                policy.evicted(victim.adapter_id)
                cached_bytes -= victim.size_bytes
            adapter = CachedAdapter(records[adapter_id], 0.0)
            index.add_newest(adapter)
            policy.admitted(adapter, newest=True)
            cached_bytes += size
        index.touch(adapter_id)
        policy.used(adapter_id)
        outcome.count(hit, size, keep_flags)
    return outcome


def _offline(requests: Sequence[str], sizes: dict[str, int], *, max_bytes: int,
             max_adapters: int, rank: Callable[[int], tuple[int, int]]) -> Outcome:
    """An offline policy inserting every miss: `rank(i)` ranks the adapter of request i as of
    that request, and a miss evicts the cached adapter of the lowest rank until it fits."""
    cached: dict[str, int] = {}  # id -> its last request
    heap: list[tuple[tuple[int, int], int, str]] = []  # (rank, request, id); stale ones skipped
    cached_bytes = 0
    outcome = Outcome()
    for i, adapter_id in enumerate(requests):
        size = sizes[adapter_id]
        hit = adapter_id in cached
        if not hit:
            while cached and (cached_bytes + size > max_bytes or len(cached) + 1 > max_adapters):
                _, last, victim = heapq.heappop(heap)
                if cached.get(victim) != last:
                    continue
                del cached[victim]
                cached_bytes -= sizes[victim]
            cached_bytes += size
        cached[adapter_id] = i
        heapq.heappush(heap, (rank(i), i, adapter_id))
        outcome.count(hit, size, False)
    return outcome


def belady(requests: Sequence[str], sizes: dict[str, int], *, max_bytes: int,
           max_adapters: int) -> Outcome:
    """Offline, inserting every miss: evict the adapter asked for again the farthest ahead."""
    never = len(requests)
    next_use = [never] * len(requests)
    seen: dict[str, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = seen.get(requests[i], never + i)  # never: keep apart, farthest first
        seen[requests[i]] = i
    return _offline(requests, sizes, max_bytes=max_bytes, max_adapters=max_adapters,
                    rank=lambda i: (-next_use[i], 0))


# ---- the table and the curves --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    trace: str
    fraction: float
    room: str
    outcomes: dict[str, Outcome]


def _room(trace: Trace, fraction: float) -> tuple[int, int]:
    """(max adapters, max bytes) for a cache of `fraction` of the registry."""
    if trace.by_count:
        return max(1, round(fraction * len(trace.sizes))), 1 << 62
    return 1 << 30, int(fraction * trace.registry_bytes)


def run_trace(trace: Trace, fraction: float) -> Row:
    max_adapters, max_bytes = _room(trace, fraction)
    if trace.by_count:
        room = f"{max_adapters} adapters"
    else:
        room = f"{fraction:.1%} of bytes ({max_bytes / 1e9:.1f} GB)"
    outcomes = {"belady": belady(trace.requests, trace.sizes, max_bytes=max_bytes,
                                 max_adapters=max_adapters)}
    for name in POLICIES:
        outcomes[name.value] = simulate(name, trace.requests, trace.sizes, max_bytes=max_bytes,
                                        max_adapters=max_adapters)
    return Row(trace.name, fraction, room, outcomes)


def print_table(rows: list[Row]) -> None:
    names = [p.value for p in POLICIES]
    print("\nhit ratio / Belady's (and the hit ratio itself)")
    print(f"| trace | room | Belady | {' | '.join(names)} |")
    print("|---|---|---:|" + "---:|" * len(names))
    for row in rows:
        best = row.outcomes["belady"]
        cells = [f"{row.outcomes[n].hit_ratio / best.hit_ratio:.2f} "
                 f"({row.outcomes[n].hit_ratio:.3f})" for n in names]
        print(f"| {row.trace} | {row.room} | {best.hit_ratio:.3f} | {' | '.join(cells)} |")
    print("\nbyte hit ratio, and download seconds at "
          f"{BANDWIDTH_B_S / 1e6:.0f} MB/s (realistic sizes)")
    print(f"| trace | room | Belady | {' | '.join(names)} |")
    print("|---|---|---:|" + "---:|" * len(names))
    for row in rows:
        if row.room.endswith("adapters"):
            continue
        cells = [f"{row.outcomes[n].byte_hit_ratio:.3f}, {row.outcomes[n].download_s:,.0f} s"
                 for n in ["belady", *names]]
        print(f"| {row.trace} | {row.room} | {' | '.join(cells)} |")


# ---- robustness: many seeds, short and long traces -----------------------------------------


@dataclass(frozen=True, slots=True)
class Family:
    """A kind of trace, drawn anew for each seed and length."""

    name: str
    goal: float  # the goal for the ratio to Belady on such traces
    draw: Callable[[random.Random, int], list[str]]  # (rng, requests) -> the trace
    sizes: dict[str, int]
    by_count: bool


# 6,000 requests: three changes of the hot set every 2,000, the shifts the goal names
# ("every few thousand requests"); left out of --quick.
ROBUST_LENGTHS = (SHORT, 2000, 6000)
ROBUST_ROOMS = (0.05, 0.1, 0.25)


def families() -> list[Family]:
    """Equal sizes over 120 adapters (room counted in adapters) and realistic sizes over 300
    (room in bytes); stationary Zipf, hot sets replaced at several rates, a scan."""
    n = 120
    ids = [f"s{i}" for i in range(n)]
    equal = dict.fromkeys(ids, 1)

    def stationary(s: float) -> Callable[[random.Random, int], list[str]]:
        return lambda rng, length: ranked(ids, zipf(n, s, length, rng), rng)

    def shifts(every: int) -> Callable[[random.Random, int], list[str]]:
        return lambda rng, length: shifting(ids, 1.0, length, every, 10, rng)

    out = [Family(f"zipf {s}", 0.85, stationary(s), equal, True) for s in (0.8, 1.0, 1.2)]
    out += [Family(f"shifting every {every:,}", 0.78, shifts(every), equal, True)
            for every in SHIFT_EVERY]
    out.append(Family("scan", 0.85, lambda rng, length: with_scan(ids, 1.0, length, rng),
                      equal, True))
    sizes = realistic_sizes(300, random.Random(SEED))
    big_ids = list(sizes)
    out.append(Family("realistic sizes: zipf 1.0", 0.85, lambda rng, length: ranked(
        big_ids, zipf(len(big_ids), 1.0, length, rng), rng), sizes, False))
    out.append(Family("realistic sizes: shifting every 500", 0.78, lambda rng, length: shifting(
        big_ids, 1.0, length, 500, 25, rng), sizes, False))
    return out


def top_k_oracle(requests: Sequence[str], sizes: dict[str, int], *, max_bytes: int,
                 max_adapters: int) -> Outcome:
    """Offline, inserting every miss: evict the adapter asked for least often over the whole
    trace (ties: least recently used). What a frequency policy could do knowing popularity
    exactly; no better than that on a stationary trace, and blind to shifts."""
    total: dict[str, int] = {}
    for adapter_id in requests:
        total[adapter_id] = total.get(adapter_id, 0) + 1
    return _offline(requests, sizes, max_bytes=max_bytes, max_adapters=max_adapters,
                    rank=lambda i: (total[requests[i]], i))


def exact_lfu(requests: Sequence[str], sizes: dict[str, int], *, max_bytes: int,
              max_adapters: int) -> Outcome:
    """Online, inserting every miss: evict the adapter asked for least often so far, counted
    exactly (never aged, never capped; ties: least recently used). The reference for an online
    frequency policy on a stationary trace: what exact counts, without the future, give; on
    short traces the counts are few and it stays below the top-k oracle, whose counts are the
    whole trace's. Blind to shifts (counts never age)."""
    so_far: dict[str, int] = {}
    counts = []
    for adapter_id in requests:
        so_far[adapter_id] = so_far.get(adapter_id, 0) + 1
        counts.append(so_far[adapter_id])
    return _offline(requests, sizes, max_bytes=max_bytes, max_adapters=max_adapters,
                    rank=lambda i: (counts[i], i))


def robustness(seeds: int, lengths: Sequence[int] = ROBUST_LENGTHS,
               ) -> list[tuple[Family, int, dict[str, list[float]], list[float]]]:
    """Each family at each length, for every seed and room: each policy's hit ratio over
    Belady's (and the top-k oracle's), and Belady's own hit ratio."""
    out = []
    for family in families():
        for length in lengths:
            ratios: dict[str, list[float]] = {p.value: [] for p in POLICIES}
            ratios["exact LFU"] = []
            ratios["top-k oracle"] = []
            bests = []
            for seed in range(seeds):
                trace = Trace(family.name, family.draw(random.Random(SEED + seed), length),
                              family.sizes, family.by_count)
                for fraction in ROBUST_ROOMS:
                    row = run_trace(trace, fraction)
                    best = row.outcomes["belady"].hit_ratio
                    bests.append(best)
                    for name in POLICIES:
                        ratios[name.value].append(row.outcomes[name.value].hit_ratio / best)
                    room = _room(trace, fraction)
                    oracle = top_k_oracle(trace.requests, trace.sizes, max_bytes=room[1],
                                          max_adapters=room[0])
                    ratios["top-k oracle"].append(oracle.hit_ratio / best)
                    exact = exact_lfu(trace.requests, trace.sizes, max_bytes=room[1],
                                      max_adapters=room[0])
                    ratios["exact LFU"].append(exact.hit_ratio / best)
            out.append((family, length, ratios, bests))
    return out


def print_robustness(results: list[tuple[Family, int, dict[str, list[float]], list[float]]],
                     seeds: int) -> None:
    names = [*(p.value for p in POLICIES), "exact LFU", "top-k oracle"]
    rooms = ", ".join(f"{f:.0%}" for f in ROBUST_ROOMS)
    print(f"\nrobustness: hit ratio / Belady's, min / median over {seeds} seeds x rooms of "
          f"{rooms}")
    print(f"| family | requests | goal | Belady (median) | {' | '.join(names)} |")
    print("|---|---:|---:|---:|" + "---:|" * len(names))
    for family, length, ratios, bests in results:
        cells = [f"{min(ratios[n]):.3f} / {statistics.median(ratios[n]):.3f}" for n in names]
        print(f"| {family.name} | {length:,} | {family.goal:.2f} | "
              f"{statistics.median(bests):.3f} | {' | '.join(cells)} |")


_COLOURS = {"belady": "#000000", "lru": "#d62728", "lfu": "#1f77b4", "w-tinylfu": "#2ca02c",
            "s3-fifo": "#ff7f0e"}


def draw_curves(rows: list[Row], path: Path) -> None:
    """Hit ratio against cache size, one panel per trace, one line per policy and Belady's,
    as an SVG written here (no plotting library needed)."""
    panels: dict[str, list[Row]] = {}
    for row in rows:
        panels.setdefault(row.trace, []).append(row)
    cols = 3
    w, h, pad = 320, 230, 45
    nrows = math.ceil(len(panels) / cols)
    width, height = cols * w, nrows * h + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    x = 10
    for name, colour in _COLOURS.items():
        out.append(f'<line x1="{x}" y1="14" x2="{x + 20}" y2="14" stroke="{colour}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{x + 24}" y="18">{name}</text>')
        x += 90
    for k, (trace, prows) in enumerate(panels.items()):
        ox, oy = (k % cols) * w, 30 + (k // cols) * h
        px0, px1, py0, py1 = ox + pad, ox + w - 10, oy + h - 35, oy + 20
        xs = [math.log(r.fraction) for r in prows]
        lo, hi = min(xs), max(xs)
        span = (hi - lo) or 1.0

        def sx(f: float, lo: float = lo, span: float = span, px0: int = px0,
               px1: int = px1, single: bool = len(xs) == 1) -> float:
            return (px0 + px1) / 2 if single else px0 + (math.log(f) - lo) / span * (px1 - px0)

        def sy(v: float, py0: int = py0, py1: int = py1) -> float:
            return py0 - v * (py0 - py1)

        out.append(f'<text x="{ox + w / 2}" y="{oy + 12}" text-anchor="middle" '
                   f'font-weight="bold">{trace}</text>')
        out.append(f'<rect x="{px0}" y="{py1}" width="{px1 - px0}" height="{py0 - py1}" '
                   'fill="none" stroke="#999"/>')
        for v in (0.0, 0.25, 0.5, 0.75, 1.0):
            out.append(f'<text x="{px0 - 4}" y="{sy(v) + 3}" text-anchor="end">{v:.2f}</text>')
        for r in prows:
            label = f"{r.fraction:.1%}".replace(".0%", "%")
            out.append(f'<text x="{sx(r.fraction)}" y="{py0 + 12}" '
                       f'text-anchor="middle">{label}</text>')
        out.append(f'<text x="{(px0 + px1) / 2}" y="{py0 + 25}" text-anchor="middle">cache size '
                   f'({"adapters" if prows[0].room.endswith("adapters") else "bytes"})</text>')
        for name, colour in _COLOURS.items():
            points = " ".join(f"{sx(r.fraction):.1f},{sy(r.outcomes[name].hit_ratio):.1f}"
                              for r in prows)
            out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" '
                       f'stroke-width="{2 if name == "belady" else 1.5}"/>')
            for r in prows:
                out.append(f'<circle cx="{sx(r.fraction):.1f}" '
                           f'cy="{sy(r.outcomes[name].hit_ratio):.1f}" r="2" fill="{colour}"/>')
    out.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, ("\n".join(out) + "\n").encode())


# ---- --http: a running sidecar replays a trace ---------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        data: dict[str, object] = json.loads(answer.read())
        return data


def replay_over_http(policy: EvictionPolicyName, requests: Sequence[str], room: int,
                     work: Path) -> list[bool]:
    """Each request as POST /stage (lease false), one at a time; whether each was a hit."""
    from sidecar.process.examples import write_adapter

    registry, cache = work / "registry", work / "cache"
    for i, adapter_id in enumerate(sorted(set(requests))):
        write_adapter(registry / adapter_id, seed=i)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "sidecar.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "serve", "--port", str(port), "--registry",
             str(registry), "--cache-root", str(cache), "--min-free-disk", "0",
             "--max-adapters", str(room), "--eviction-policy", policy.value,
             "--upload-settle", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/adapters", timeout=5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the sidecar did not start: see {work}/sidecar.log") from None
                time.sleep(0.05)
        return [bool(_post(f"{url}/stage", {"adapter_id": adapter_id, "lease": False})[
            "cached"]) for adapter_id in requests]
    finally:
        process.terminate()
        process.wait(30)


# The --http traces: Zipf 1.0; the same with the 10 most popular replaced every 2,000 requests;
# the same with every adapter asked for once mid-trace.
HTTP_TRACES: dict[str, Callable[[list[str], int, random.Random], list[str]]] = {
    "zipf": lambda ids, length, rng: ranked(ids, zipf(len(ids), 1.0, length, rng), rng),
    "shifting": lambda ids, length, rng: shifting(ids, 1.0, length, 2000, 10, rng),
    "scan": lambda ids, length, rng: with_scan(ids, 1.0, length, rng),
}


def http_check(args: argparse.Namespace) -> int:
    rng = random.Random(SEED)
    ids = [f"t{i}" for i in range(args.http_adapters)]
    requests = HTTP_TRACES[args.http_trace](ids, args.http_requests, rng)
    sizes = dict.fromkeys(ids, 1)
    failed = False
    for name in args.policies:
        policy = EvictionPolicyName(name)
        simulated = simulate(policy, requests, sizes, max_bytes=1 << 62,
                             max_adapters=args.http_room, keep_flags=True)
        with tempfile.TemporaryDirectory(prefix="lsbench-policy-") as work:
            started = time.monotonic()
            daemon = replay_over_http(policy, requests, args.http_room, Path(work))
            took = time.monotonic() - started
        hits = sum(daemon)
        best = belady(requests, sizes, max_bytes=1 << 62, max_adapters=args.http_room)
        same = daemon == simulated.hit_flags
        failed |= not same
        print(f"{policy.value}: {args.http_trace} over {len(ids)} adapters, room {args.http_room}, "
              f"{len(requests)} requests over HTTP in {took:.0f} s: daemon hit ratio "
              f"{hits / len(requests):.3f}, simulated {simulated.hit_ratio:.3f}, "
              f"Belady {best.hit_ratio:.3f} (daemon / Belady "
              f"{hits / len(requests) / best.hit_ratio:.2f}); request by request "
              f"{'identical' if same else 'DIFFERENT'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter traces, two sizes")
    parser.add_argument("--http", action="store_true",
                        help="replay a trace against a running sidecar, one /stage at a time")
    parser.add_argument("--http-adapters", type=int, default=120)
    parser.add_argument("--http-room", type=int, default=12)
    parser.add_argument("--http-requests", type=int, default=600)
    parser.add_argument("--http-trace", choices=sorted(HTTP_TRACES), default="zipf",
                        help="--http: Zipf 1.0, the same with the 10 most popular replaced "
                             "every 2,000 requests, or with a scan of every adapter mid-trace")
    parser.add_argument("--policies", default="lfu,lru",
                        help="--http: the policies to replay (comma-separated)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="traces per family in the robustness table (default 10, --quick 3)")
    parser.add_argument("--requests", type=int, default=None,
                        help="length of the 1,000-adapter traces (default 100,000, --quick "
                             "20,000); the suite's run uses a few thousand to see it all run")
    parser.add_argument("--robustness", action="store_true",
                        help="only the robustness table (no long traces, no curves)")
    parser.add_argument("--svg", type=Path, default=REPO / "benchmarks" / "policy-curves.svg",
                        help="where the curves go")
    args = parser.parse_args(argv)
    if args.http:
        args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        return http_check(args)
    started = time.monotonic()
    seeds = args.seeds or (3 if args.quick else 10)
    robust = robustness(seeds, ROBUST_LENGTHS[:2] if args.quick else ROBUST_LENGTHS)
    print(f"[{time.monotonic() - started:5.1f}s] robustness", file=sys.stderr, flush=True)
    if args.robustness:
        print_robustness(robust, seeds)
        return 0
    rows = []
    for trace, fractions in traces(args.quick, args.requests):
        for fraction in fractions:
            rows.append(run_trace(trace, fraction))
        print(f"[{time.monotonic() - started:5.1f}s] {trace.name}", file=sys.stderr, flush=True)
    print_table(rows)
    print_robustness(robust, seeds)
    draw_curves(rows, args.svg)
    print(f"\ncurves: {args.svg}")
    if shutil.which("rsvg-convert"):
        subprocess.run(["rsvg-convert", "-o", str(args.svg.with_suffix(".png")), str(args.svg)],
                       check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
