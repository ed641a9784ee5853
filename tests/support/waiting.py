"""The one way the tests wait for something to happen: ask until it holds, with a deadline.

`eventually` (in the event loop) and `eventually_blocking` (in a plain thread, for tests of
child processes) call `probe` until it answers something truthy and return that answer. A probe
that raises ends the wait at once: a process that exited, an answer that can no longer change.
Past `timeout_s` the test fails with `what` (a text, or a function giving one at that moment,
such as a log's tail) and the last answer.

A fixed sleep is for the one case where time passing is itself the point (an idle connection,
a client's think time); it says so in a comment beside it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.02

What = str | Callable[[], str]


async def eventually(
    probe: Callable[[], Awaitable[T | None] | T | None], *, timeout_s: float, what: What,
    poll_s: float = POLL_S,
) -> T:
    """The first truthy answer of `probe` (a coroutine function, or a plain one for a condition
    read without I/O); fails the test if none comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise _not_within(what, timeout_s, answer)
        await asyncio.sleep(poll_s)


def eventually_blocking(
    probe: Callable[[], T | None], *, timeout_s: float, what: What, poll_s: float = POLL_S,
) -> T:
    """`eventually` for code outside the event loop: blocks this thread while it waits."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise _not_within(what, timeout_s, answer)
        time.sleep(poll_s)


def _not_within(what: What, timeout_s: float, answer: object) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"{text}: not within {timeout_s:g}s (last answer {answer!r})")
