"""Races: hundreds of clients stage, release, evict, pin and unpin 30 adapters over a cache
budget of 5 for half a minute, against a sidecar process. Invariants are checked while it
runs (leased folders whole, budget held but for protected adapters, no request hanging) and
at the end (index == disk == metrics; each adapter downloaded once per stay in the cache)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from sidecar.validation.validate import Rules
from tests.support.api import call
from tests.support.cache_checks import check_cache, leftovers
from tests.support.processes import SidecarProcess
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings

DURATION_S = 30.0
CLIENTS = 200
ADAPTERS = [f"t{i:02d}" for i in range(30)]
HOT = ADAPTERS[:3]  # most stages go to these, as most traffic goes to a few adapters
PINNABLE = ADAPTERS[3:5]
MAX_ADAPTERS = 5
LEASE_TTL_S = 3.0
STAGE_TIMEOUT_S = 10.0
CLIENT_GRACE_S = 5.0  # a request still unanswered this long after its own timeout is hung
TOKEN = "torture-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WEIGHTS = "adapter_model.safetensors"
OPERATIONS = ("stage", "abandon", "evict", "pin", "unpin", "list")
OPERATION_WEIGHTS = (78, 1, 9, 3, 3, 6)
# What a client may be answered, by operation; anything else is a failure.
EXPECTED = {
    "stage": {200: None, 507: "cache_full"},
    "release": {200: None},
    "evict": {200: None, 404: "not_cached", 409: "adapter_in_use"},
    "pin": {200: None, 507: "cache_full"},
    "unpin": {200: None},
    "list": {200: None},
}


@dataclass
class World:
    """What the clients know and did; checked against the sidecar while it runs and after."""

    url: str
    digests: dict[str, dict[str, str]]  # adapter -> file name -> sha256
    sizes: dict[str, int]
    max_bytes: int
    # Adapters the sidecar may be protecting because of us: a stage sent and its lease not
    # yet released, an abandoned lease not yet expired, a pin not yet undone.
    holding: Counter[str] = field(default_factory=Counter)
    abandoned: dict[str, tuple[str, float]] = field(default_factory=dict)  # lease -> id, until
    pinned: set[str] = field(default_factory=set)
    pin_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    answers: Counter[tuple[str, int]] = field(default_factory=Counter)
    stage_calls: int = 0  # valid /stage and /pin requests: what stage_requests_total counts
    manual_evictions: int = 0
    leases_checked: int = 0
    budget_checks: int = 0
    slowest_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def protected(self) -> set[str]:
        now = time.monotonic()
        return ({a for a, n in self.holding.items() if n > 0} | set(self.pinned)
                | {a for a, until in self.abandoned.values() if until > now})

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)


async def request(world: World, session: aiohttp.ClientSession, operation: str, path: str,
                  body: Any = None, *, timeout_s: float = 10.0,
                  auth: bool = False) -> tuple[int, Any]:
    """One call; a wrong answer or one that hangs past its timeout is recorded as a failure."""
    method = "GET" if body is None else "POST"
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s + CLIENT_GRACE_S):
            status, answer = await call(session, method, f"{world.url}{path}", body,
                                        AUTH if auth else None)
    except TimeoutError:
        world.fail(f"{method} {path} {body} hung past its {timeout_s:g}s timeout")
        return 0, None
    world.slowest_s = max(world.slowest_s, time.monotonic() - started)
    world.answers[(operation, status)] += 1
    expected = EXPECTED[operation]
    code = answer.get("error") if isinstance(answer, dict) else None
    if status not in expected or code != expected[status]:
        world.fail(f"{method} {path} {body} -> {status} {answer}")
    return status, answer


def folder_problem(folder: Path, expected: dict[str, str]) -> str | None:
    """Why a leased folder is not exactly the registry's adapter, or None."""
    try:
        names = {p.name for p in folder.iterdir()} - {".sidecar.json"}
        if names != set(expected):
            return f"{folder} holds {sorted(names)}"
        for name, digest in expected.items():
            if hashlib.sha256((folder / name).read_bytes()).hexdigest() != digest:
                return f"{folder}/{name} differs from the registry's bytes"
    except OSError as exc:
        return f"{folder}: {exc}"
    return None


async def check_lease(world: World, adapter_id: str, answer: dict[str, Any], when: str) -> None:
    problem = await asyncio.to_thread(folder_problem, Path(answer["local_path"]),
                                      world.digests[adapter_id])
    world.leases_checked += 1
    if problem is not None:
        world.fail(f"lease {answer['lease_id']} on {adapter_id} ({when}): {problem}")


def check_budget(world: World, listing: dict[str, Any]) -> None:
    """Over budget only by adapters that are pinned, leased, or being staged for a caller.

    The listing is one atomic snapshot of the sidecar's index; our own view of what we hold
    only grows before a request is sent and shrinks after its answer, so it covers claims the
    listing cannot show (callers waiting for a download)."""
    world.budget_checks += 1
    adapters = listing["adapters"]
    cached_bytes = sum(a["size_bytes"] for a in adapters)
    if len(adapters) <= MAX_ADAPTERS and cached_bytes <= world.max_bytes:
        return
    protected = world.protected()
    loose = [a["adapter_id"] for a in adapters
             if not a["pinned"] and a["leases"] == 0 and a["adapter_id"] not in protected]
    if loose:
        world.fail(f"over budget ({len(adapters)} adapters, {cached_bytes} bytes) with "
                   f"unprotected {loose}")


# ---- the clients ----------------------------------------------------------------------------


def pick(rng: random.Random) -> str:
    return rng.choice(HOT) if rng.random() < 0.7 else rng.choice(ADAPTERS)


async def stage_and_release(world: World, session: aiohttp.ClientSession, rng: random.Random,
                            *, abandon: bool) -> None:
    adapter_id = pick(rng)
    world.holding[adapter_id] += 1
    try:
        world.stage_calls += 1
        status, answer = await request(world, session, "stage", "/stage",
                                       {"adapter_id": adapter_id, "timeout_s": STAGE_TIMEOUT_S},
                                       timeout_s=STAGE_TIMEOUT_S)
        if status != 200:
            return
        if answer["size_bytes"] != world.sizes[adapter_id]:
            world.fail(f"{adapter_id} answered size {answer['size_bytes']}")
        await check_lease(world, adapter_id, answer, "granted")
        if abandon:  # a caller that crashed: the lease must expire on its own
            world.abandoned[answer["lease_id"]] = (adapter_id,
                                                   time.monotonic() + LEASE_TTL_S + 1.5)
            return
        await asyncio.sleep(rng.uniform(0.0, 0.03))  # the inference reading the adapter
        await check_lease(world, adapter_id, answer, "before release")
        await request(world, session, "release", "/release", {"lease_id": answer["lease_id"]})
    finally:
        world.holding[adapter_id] -= 1


async def evict(world: World, session: aiohttp.ClientSession, rng: random.Random) -> None:
    status, _ = await request(world, session, "evict", "/evict",
                              {"adapter_id": rng.choice(ADAPTERS)}, auth=True)
    world.manual_evictions += status == 200


async def pin(world: World, session: aiohttp.ClientSession, rng: random.Random) -> None:
    adapter_id = rng.choice(PINNABLE)
    async with world.pin_locks[adapter_id]:  # so that we know exactly what is pinned
        was_pinned = adapter_id in world.pinned
        world.pinned.add(adapter_id)
        world.stage_calls += 1
        status, _ = await request(world, session, "pin", "/pin", {"adapter_id": adapter_id},
                                  timeout_s=STAGE_TIMEOUT_S, auth=True)
        if status != 200 and not was_pinned:
            world.pinned.discard(adapter_id)


async def unpin(world: World, session: aiohttp.ClientSession, rng: random.Random) -> None:
    adapter_id = rng.choice(PINNABLE)
    async with world.pin_locks[adapter_id]:
        status, _ = await request(world, session, "unpin", "/unpin", {"adapter_id": adapter_id},
                                  auth=True)
        if status == 200:
            world.pinned.discard(adapter_id)


async def list_adapters(world: World, session: aiohttp.ClientSession) -> None:
    status, listing = await request(world, session, "list", "/adapters")
    if status == 200:
        check_budget(world, listing)


async def client(world: World, session: aiohttp.ClientSession, seed: int,
                 deadline: float) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, 0.5))  # spread the start
    while time.monotonic() < deadline:
        operation = rng.choices(OPERATIONS, OPERATION_WEIGHTS)[0]
        if operation in ("stage", "abandon"):
            await stage_and_release(world, session, rng, abandon=operation == "abandon")
        elif operation == "evict":
            await evict(world, session, rng)
        elif operation == "pin":
            await pin(world, session, rng)
        elif operation == "unpin":
            await unpin(world, session, rng)
        else:
            await list_adapters(world, session)
        await asyncio.sleep(rng.uniform(0.02, 0.2))  # think time


async def monitor(world: World, session: aiohttp.ClientSession, deadline: float) -> None:
    """The budget, checked ten times a second whatever the clients are doing."""
    while time.monotonic() < deadline:
        await list_adapters(world, session)
        await asyncio.sleep(0.1)  # ten times a second: time passing is the point


# ---- the end: index == disk == metrics == events ----------------------------------------------


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def sidecar_events(log_text: str) -> list[dict[str, Any]]:
    events = []
    for line in log_text.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if "event" in entry:
                events.append(entry)
    return events


async def test_hundreds_of_clients_racing_stage_release_evict_pin_unpin_keep_every_invariant(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    rng = random.Random(7)
    sources = {adapter_id: s3.put_adapter(adapter_id, seed=i, rank=rng.choice((4, 8, 16)))
               for i, adapter_id in enumerate(ADAPTERS)}
    sizes = {a: sum(len(data) for data in files.values()) for a, files in sources.items()}
    max_bytes = int(sorted(sizes.values())[len(sizes) // 2] * 4.5)  # the byte budget bites too
    cache = tmp_path / "cache"
    process = SidecarProcess(
        ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
         "--cache-root", str(cache), "--max-adapters", str(MAX_ADAPTERS),
         "--max-bytes", str(max_bytes), "--lease-ttl", str(LEASE_TTL_S),
         "--stage-timeout", str(STAGE_TIMEOUT_S), "--min-free-disk", "0",
         "--api-token", TOKEN, "--log-format", "json"],
        tmp_path / "sidecar.log")
    sidecar_processes.append(process)
    world = World(
        url=process.url,
        digests={a: {n: hashlib.sha256(d).hexdigest() for n, d in f.items()}
                 for a, f in sources.items()},
        sizes=sizes, max_bytes=max_bytes,
        pin_locks={a: asyncio.Lock() for a in PINNABLE},
    )
    connector = aiohttp.TCPConnector(limit=CLIENTS + 10)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        deadline = started + DURATION_S
        await asyncio.gather(monitor(world, session, deadline),
                             *(client(world, session, seed, deadline)
                               for seed in range(CLIENTS)))
        ran_s = time.monotonic() - started

        # Drain: abandoned leases are released (or found expired), pins undone.
        for lease_id in list(world.abandoned):
            status, answer = await call(session, "POST", f"{world.url}/release",
                                        {"lease_id": lease_id})
            assert status == 200 or answer["error"] == "lease_not_found", answer  # expired
        for adapter_id in PINNABLE:
            await call(session, "POST", f"{world.url}/unpin", {"adapter_id": adapter_id}, AUTH)
        _, listing = await call(session, "GET", f"{world.url}/adapters")
        async with session.get(f"{world.url}/metrics") as response:
            metrics = metric_values(await response.text())
    assert not world.failures, "\n".join(world.failures)

    # A clean stop finishes deleting what was evicted; then disk, index and metrics agree.
    process.stop()
    assert leftovers(cache) == []
    on_disk = check_cache(cache, Rules.from_settings(make_settings(tmp_path)),
                          max_adapters=MAX_ADAPTERS, max_bytes=max_bytes, sources=sources)
    index = {a["adapter_id"]: a["size_bytes"] for a in listing["adapters"]}
    assert index == {a: r.size_bytes for a, r in on_disk.records.items()}
    assert listing["cache"]["active_leases"] == 0 and listing["staging"] == []
    assert metrics[("lora_sidecar_cache_adapters", ())] == len(index)
    assert metrics[("lora_sidecar_cache_bytes", ())] == sum(index.values())
    assert metrics[("lora_sidecar_active_leases", ())] == 0
    stage_requests = sum(v for (name, _), v in metrics.items()
                         if name == "lora_sidecar_stage_requests_total")
    assert stage_requests == world.stage_calls

    # Downloads: the weights exactly once per stay in the cache, counted at the S3 server. The
    # config is fetched into memory to judge the adapter before any room is held, so a stage
    # that then waited for room past its deadline (507) fetched it once more, and nothing
    # else did.
    events = sidecar_events(process.log_text())
    history: dict[str, list[str]] = defaultdict(list)
    evictions_by_reason: Counter[str] = Counter()
    judged_then_full: Counter[str] = Counter()
    for entry in events:
        if entry["event"] in ("staged", "evicted"):
            history[entry["adapter_id"]].append(entry["event"])
        if entry["event"] == "evicted":
            evictions_by_reason[entry["reason"]] += 1
        if entry["event"] == "stage_failed" and entry["error"] == "cache_full":
            judged_then_full[entry["adapter_id"]] += 1
    for adapter_id in ADAPTERS:
        stays = history[adapter_id]
        assert stays[::2] == ["staged"] * len(stays[::2]), (adapter_id, stays)
        assert stays[1::2] == ["evicted"] * len(stays[1::2]), (adapter_id, stays)
        assert (len(stays) % 2 == 1) == (adapter_id in index), (adapter_id, stays)
        for name in sources[adapter_id]:
            downloads = len(s3.proxy.gets(s3.key(adapter_id, name)))
            judged = judged_then_full[adapter_id] if name == "adapter_config.json" else 0
            assert downloads == stays.count("staged") + judged, (
                adapter_id, name, downloads, stays, judged)
    assert evictions_by_reason["external"] == 0 and evictions_by_reason["forced"] == 0
    assert evictions_by_reason["manual"] == world.manual_evictions
    for reason in ("policy", "manual"):
        assert metrics[("lora_sidecar_evictions_total", (("reason", reason),))] == (
            evictions_by_reason[reason])
    staged = sum(len(h[::2]) for h in history.values())
    assert metrics[("lora_sidecar_download_duration_seconds_count", ())] == staged
    assert not [e for e in events if e["event"] == "quarantined"]

    print(f"\n{CLIENTS} clients for {ran_s:.1f}s: {sum(world.answers.values())} requests, "
          f"{dict(sorted(world.answers.items()))}; {staged} downloads, "
          f"evictions {dict(evictions_by_reason)}, {world.leases_checked} lease checks, "
          f"{world.budget_checks} budget checks, slowest answer {world.slowest_s:.2f}s")
    assert world.leases_checked > 1000 and staged > 30 and world.budget_checks > 200
