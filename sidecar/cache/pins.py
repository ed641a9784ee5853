"""Pins: adapters kept on disk whatever the budget wants. One owner for all a pin is: the pinned
ids (the store never evicts them), the pins given at start that are not staged yet (they hold
readiness back) and the retries that stage them, and the budget rule for a new pin.

The store holds its Pins as it holds its leases, and is the way in for the change that frees
room: `AdapterStore.unpin()` trims to the budget after `Pins.remove()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from ..core.errors import CacheFull, InvalidAdapter, SidecarError

log = logging.getLogger(__name__)

PIN_RETRY_S = (1.0, 30.0)  # first and largest delay between attempts to stage a pin


class Pins:
    def __init__(self, pinned: Iterable[str], *, max_adapters: int,
                 on_disk: Callable[[str], bool]) -> None:
        self._ids: set[str] = set(pinned)
        self._max_adapters = max_adapters
        self._on_disk = on_disk
        # Given at start and not staged yet, in the order given; each with why it is not (yet).
        self._waiting: dict[str, str | None] = dict.fromkeys(pinned)
        self._retries: dict[str, asyncio.Task[None]] = {}

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._ids

    def add(self, adapter_id: str) -> None:
        self._ids.add(adapter_id)

    def remove(self, adapter_id: str) -> bool:
        """Unpin, a pin still waiting to be staged included: its retries stop and it no longer
        holds readiness back. True if it was pinned. (Through AdapterStore.unpin, which trims.)"""
        was_pinned = adapter_id in self._ids or adapter_id in self._waiting
        self._ids.discard(adapter_id)
        self._waiting.pop(adapter_id, None)
        retry = self._retries.pop(adapter_id, None)
        if retry is not None and not retry.done():
            retry.cancel("unpinned")
        return was_pinned

    def on_disk(self) -> int:
        """Pinned adapters in the cache."""
        return sum(1 for adapter_id in self._ids if self._on_disk(adapter_id))

    def check_room(self, adapter_id: str) -> None:
        """The budget rule for a new pin, judged before anything is downloaded: pinned adapters
        on disk never fill the adapter budget (something must stay evictable)."""
        if adapter_id in self._ids:
            return
        pinned = self.on_disk()
        if pinned >= self._max_adapters:
            raise CacheFull(f"cannot pin {adapter_id}: {pinned} adapters are pinned already and "
                            f"the budget is {self._max_adapters}", adapter_id=adapter_id)

    def problems(self) -> list[str]:
        """Why the sidecar is not ready on account of its pins; empty when they are all in."""
        failing = [f"pin {adapter_id}: {problem}"
                   for adapter_id, problem in sorted(self._waiting.items()) if problem]
        if self._waiting:
            failing.append(f"pinned adapters not staged yet: {', '.join(sorted(self._waiting))}")
        return failing

    async def keep_staged(self, stage: Callable[[str], Awaitable[object]], *,
                          retry_refused_s: float) -> None:
        """Stage every pin given at start that is not on disk, each retried with a growing
        delay until it is in or unpinned. A refused one is asked again every
        `retry_refused_s` (as often as the stager looks at a refused adapter again), so an
        upload that completes, or a fix, is staged within a second or two."""
        for adapter_id in [i for i in self._waiting if self._on_disk(i)]:
            del self._waiting[adapter_id]
        async with asyncio.TaskGroup() as group:
            for adapter_id in self._waiting:
                self._retries[adapter_id] = group.create_task(
                    self._stage_until_in(stage, adapter_id, retry_refused_s),
                    name=f"pin:{adapter_id}")

    async def _stage_until_in(self, stage: Callable[[str], Awaitable[object]], adapter_id: str,
                              retry_refused_s: float) -> None:
        delay = PIN_RETRY_S[0]
        while True:
            try:
                await stage(adapter_id)
            except SidecarError as exc:
                self._note(adapter_id, f"{exc.code}: {exc.message}")
                if isinstance(exc, InvalidAdapter):
                    await asyncio.sleep(retry_refused_s)
                    continue
                await asyncio.sleep(delay)
                delay = min(delay * 2, PIN_RETRY_S[1])
                continue
            except Exception:  # a fault of ours: logged, the other pins carry on, tried again
                log.exception("staging pinned adapter %s failed", adapter_id)
                await asyncio.sleep(PIN_RETRY_S[1])
                continue
            if self._waiting.pop(adapter_id, None) is not None:
                log.info("ready again: pin %s recovered", adapter_id)
            self._retries.pop(adapter_id, None)
            log.info("pinned adapter staged adapter_id=%s", adapter_id)
            return

    def _note(self, adapter_id: str, problem: str) -> None:
        if adapter_id not in self._waiting:
            return  # unpinned meanwhile
        if self._waiting[adapter_id] != problem:
            log.warning("not ready: pin %s: %s", adapter_id, problem)
        self._waiting[adapter_id] = problem
