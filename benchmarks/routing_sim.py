"""Routing simulator: which node should a request for adapter X go to, when each node keeps an
LRU of C adapters on its disk? Fixed seeds, Zipf popularity, N nodes with K request slots each,
Poisson arrivals, exponential service (a disk miss adds a download's time). It prints, per
policy, the disk-hit ratio after warm-up, registry GETs, queueing waits and the load imbalance
(max/mean requests per node), so the routing defaults are argued with numbers.

    python -m benchmarks.routing_sim                 # the table behind the defaults
    python -m benchmarks.routing_sim --nodes 8 --cache 100 --policies bounded,random
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

POLICIES = ("random", "least", "chash", "bounded", "sticky", "affinity")
DEFAULT_GRID = ((1, 100), (4, 50), (4, 100), (4, 200), (8, 50), (8, 100), (8, 200), (16, 50),
                (16, 100))


@dataclass(frozen=True, slots=True)
class Scenario:
    nodes: int = 8
    cache: int = 100  # adapters each node's disk holds (LRU)
    adapters: int = 1000
    zipf_s: float = 1.0
    requests: int = 100_000
    slots: int = 16  # requests a node serves at once; more wait in its queue
    utilisation: float = 0.7
    miss_cost: float = 0.5  # a download, in mean service times
    warmup: float = 0.2  # share of requests before hits are counted
    bound: float = 1.25  # bounded-load factor (HAProxy hash-balance-factor 125)
    spill: float = 1.5  # sticky/affinity: leave a node above spill x the mean load
    refresh: float = 0.5  # affinity: how often the router's view of the caches is renewed
    seed: int = 1


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    hit_ratio: float
    gets: int  # registry downloads after warm-up
    mean_wait: float
    p99_wait: float
    imbalance: float  # max / mean requests per node after warm-up


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, count + 1)]


def preference(adapter: int, nodes: int) -> list[int]:
    """Rendezvous (highest random weight) order of the nodes for an adapter: a consistent
    hash; removing a node moves only its adapters."""
    def weight(node: int) -> int:
        digest = hashlib.blake2b(f"{adapter}/{node}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")
    return sorted(range(nodes), key=weight, reverse=True)


class _Node:
    __slots__ = ("active", "cache", "queue", "served")

    def __init__(self) -> None:
        self.active = 0
        self.queue: deque[float] = deque()  # arrival times waiting for a slot
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.served = 0

    @property
    def load(self) -> int:
        return self.active + len(self.queue)


def simulate(scenario: Scenario, policy: str) -> Result:
    rng = random.Random(scenario.seed)
    ids = list(range(scenario.adapters))
    rng.shuffle(ids)  # popularity rank -> adapter id
    weights = zipf_weights(scenario.adapters, scenario.zipf_s)
    # The same requests for every policy: popularity draws and arrivals from their own seeds.
    picks = random.Random(scenario.seed * 7919).choices(ids, weights, k=scenario.requests)
    arrivals = random.Random(scenario.seed * 104729)
    services = random.Random(scenario.seed * 1299709)
    router = random.Random(scenario.seed * 15485863)
    n = scenario.nodes
    rate = scenario.utilisation * n * scenario.slots  # per mean service time
    nodes = [_Node() for _ in range(n)]
    prefs: dict[int, list[int]] = {}
    binding: dict[int, int] = {}
    view: list[set[int]] = [set() for _ in range(n)]
    next_refresh = 0.0
    completions: list[tuple[float, int]] = []  # (time, node)
    waits: list[float] = []
    hits = counted = gets = 0
    warm = int(scenario.requests * scenario.warmup)
    served_after_warmup = [0] * n
    now = 0.0

    def order(adapter: int) -> list[int]:
        cached = prefs.get(adapter)
        if cached is None:
            cached = prefs[adapter] = preference(adapter, n)
        return cached

    def least(candidates: Sequence[int]) -> int:
        low = min(nodes[c].load for c in candidates)
        return router.choice([c for c in candidates if nodes[c].load == low])

    def bounded(adapter: int, factor: float) -> int:
        total = sum(node.load for node in nodes) + 1
        limit = math.ceil(factor * total / n)
        for candidate in order(adapter):
            if nodes[candidate].load + 1 <= limit:
                return candidate
        return order(adapter)[0]

    def start(node_index: int, arrived: float, at: float, duration: float) -> None:
        node = nodes[node_index]
        node.active += 1
        heapq.heappush(completions, (at + duration, node_index))
        if arrived >= 0:
            waits.append(at - arrived)

    def finish_until(t: float) -> None:
        while completions and completions[0][0] <= t:
            done_at, index = heapq.heappop(completions)
            node = nodes[index]
            node.active -= 1
            if node.queue:
                arrived, duration = node.queue.popleft()
                start(index, arrived if arrived >= 0 else -1, done_at, duration)

    choose: dict[str, Callable[[int], int]] = {
        "random": lambda adapter: router.randrange(n),
        "least": lambda adapter: least(range(n)),
        "chash": lambda adapter: order(adapter)[0],
        "bounded": lambda adapter: bounded(adapter, scenario.bound),
    }

    def sticky(adapter: int) -> int:
        mean = sum(node.load for node in nodes) / n
        bound = binding.get(adapter)
        if bound is None or nodes[bound].load > scenario.spill * mean + 1:
            bound = binding[adapter] = least(range(n))
        return bound

    def affinity(adapter: int) -> int:
        mean = sum(node.load for node in nodes) / n
        holders = [i for i in range(n) if adapter in view[i]]
        if holders:
            best = least(holders)
            if nodes[best].load <= scenario.spill * mean + 1:
                return best
        return bounded(adapter, scenario.spill)

    choose["sticky"] = sticky
    choose["affinity"] = affinity
    pick_node = choose[policy]

    for index, adapter in enumerate(picks):
        now += arrivals.expovariate(rate)
        finish_until(now)
        if policy == "affinity" and now >= next_refresh:
            view = [set(node.cache) for node in nodes]
            next_refresh = now + scenario.refresh
        target = pick_node(adapter)
        node = nodes[target]
        hit = adapter in node.cache
        if hit:
            node.cache.move_to_end(adapter)
        else:
            node.cache[adapter] = None
            if len(node.cache) > scenario.cache:
                node.cache.popitem(last=False)
        duration = services.expovariate(1.0) + (0 if hit else scenario.miss_cost)
        counting = index >= warm
        if counting:
            counted += 1
            hits += hit
            gets += not hit
            served_after_warmup[target] += 1
        arrived = now if counting else -1.0
        if node.active < scenario.slots:
            start(target, arrived, now, duration)
        else:
            node.queue.append((arrived, duration))
    finish_until(math.inf)
    waits.sort()
    mean_served = sum(served_after_warmup) / n
    return Result(
        policy=policy,
        hit_ratio=hits / counted,
        gets=gets,
        mean_wait=sum(waits) / len(waits) if waits else 0.0,
        p99_wait=waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0,
        imbalance=max(served_after_warmup) / mean_served,
    )


_DEFAULT = Scenario()


def _row(scenario: Scenario, result: Result) -> str:
    return (f"| {scenario.nodes:>2} | {scenario.cache:>3} | {result.policy:<8} | "
            f"{result.hit_ratio:.3f} | {result.gets:>6} | {result.mean_wait:7.2f} | "
            f"{result.p99_wait:7.2f} | {result.imbalance:.2f} |")


HEADER = ("| N | C | policy | hit ratio | S3 GETs | mean wait | p99 wait | max/mean |\n"
          "|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, help="nodes (default: the grid of the table)")
    parser.add_argument("--cache", type=int, help="adapters per node's cache (with --nodes)")
    parser.add_argument("--adapters", type=int, default=_DEFAULT.adapters)
    parser.add_argument("--zipf", type=float, default=_DEFAULT.zipf_s, help="Zipf exponent s")
    parser.add_argument("--requests", type=int, default=_DEFAULT.requests)
    parser.add_argument("--slots", type=int, default=_DEFAULT.slots)
    parser.add_argument("--utilisation", type=float, default=_DEFAULT.utilisation)
    parser.add_argument("--bound", type=float, default=_DEFAULT.bound,
                        help="bounded-load factor (1.25 = HAProxy hash-balance-factor 125)")
    parser.add_argument("--seed", type=int, default=_DEFAULT.seed)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, of {', '.join(POLICIES)}")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies {unknown}; use {', '.join(POLICIES)}")
    if (args.nodes is None) != (args.cache is None):
        parser.error("give --nodes and --cache together, or neither for the whole grid")
    grid = [(args.nodes, args.cache)] if args.nodes is not None else list(DEFAULT_GRID)
    print(f"{args.adapters} adapters, Zipf s={args.zipf:g}, {args.requests} requests "
          f"(hits counted after the first 20%), utilisation {args.utilisation:g}, "
          f"{args.slots} slots per node, seed {args.seed}")
    print(HEADER)
    for nodes, cache in grid:
        scenario = Scenario(nodes=nodes, cache=cache, adapters=args.adapters, zipf_s=args.zipf,
                            requests=args.requests, slots=args.slots,
                            utilisation=args.utilisation, bound=args.bound, seed=args.seed)
        for policy in policies:
            print(_row(scenario, simulate(scenario, policy)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
