"""ByteLimit: bytes held at once never exceed the limit, holders are granted in arrival order,
and a holder that is cancelled or lets go early gives its bytes back exactly once."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.core.bytelimit import ByteLimit
from tests.support.waiting import eventually


async def test_holders_are_granted_in_arrival_order_within_the_limit() -> None:
    limit = ByteLimit(100)
    granted: list[str] = []
    peaks: list[int] = []
    go = {name: asyncio.Event() for name in ("a", "b", "c", "d")}

    async def holder(name: str, size_bytes: int) -> None:
        async with limit.hold(size_bytes):
            granted.append(name)
            peaks.append(limit.held_bytes)
            await go[name].wait()

    tasks = [asyncio.create_task(holder("a", 60))]
    await eventually(lambda: granted == ["a"], timeout_s=5, what="a granted")
    # b does not fit beside a; c would, but never overtakes b.
    tasks += [asyncio.create_task(holder("b", 70)), asyncio.create_task(holder("c", 10))]
    await eventually(lambda: limit.waiting == 2, timeout_s=5, what="b and c waiting")
    assert granted == ["a"] and limit.held_bytes == 60

    go["a"].set()
    await eventually(lambda: granted == ["a", "b", "c"], timeout_s=5, what="b, then c")
    tasks.append(asyncio.create_task(holder("d", 30)))
    await eventually(lambda: limit.waiting == 1, timeout_s=5, what="d waiting")
    assert granted == ["a", "b", "c"]
    go["b"].set()
    await eventually(lambda: granted == ["a", "b", "c", "d"], timeout_s=5, what="d")
    go["c"].set()
    go["d"].set()
    await asyncio.gather(*tasks)

    assert max(peaks) <= 100
    assert limit.held_bytes == 0


async def test_a_waiter_cancelled_gives_up_its_place_and_the_next_is_granted() -> None:
    limit = ByteLimit(100)
    release_first = asyncio.Event()
    granted: list[str] = []

    async def holder(name: str, size_bytes: int, until: asyncio.Event) -> None:
        async with limit.hold(size_bytes):
            granted.append(name)
            await until.wait()

    done = asyncio.Event()
    first = asyncio.create_task(holder("first", 50, release_first))
    await eventually(lambda: granted == ["first"], timeout_s=5, what="first granted")
    big = asyncio.create_task(holder("big", 90, done))
    small = asyncio.create_task(holder("small", 40, done))
    await eventually(lambda: limit.waiting == 2, timeout_s=5, what="big, then small, waiting")
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)

    await eventually(lambda: granted == ["first", "small"], timeout_s=5, what="small granted")
    assert limit.held_bytes == 90
    release_first.set()
    done.set()
    await asyncio.gather(first, small)
    assert limit.held_bytes == 0


async def test_bytes_let_go_early_are_given_back_once() -> None:
    limit = ByteLimit(100)
    async with limit.hold(80) as held:
        held.release()
        assert limit.held_bytes == 0
        async with limit.hold(100):
            assert limit.held_bytes == 100
        held.release()
    assert limit.held_bytes == 0


async def test_more_than_the_whole_limit_is_refused_rather_than_waited_for() -> None:
    limit = ByteLimit(100)
    with pytest.raises(ValueError, match="cannot be held"):
        async with limit.hold(101):
            pass
    assert limit.held_bytes == 0
