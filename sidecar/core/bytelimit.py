"""A bound on bytes held at once by many tasks (small files kept in memory until they can be
written): each holder is granted its bytes whole, first come first served, and gives them back
when it is done, or earlier.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class ByteLimit:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._free_bytes = limit_bytes
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def held_bytes(self) -> int:
        return self.limit_bytes - self._free_bytes

    @property
    def waiting(self) -> int:
        """Holders waiting for their bytes."""
        return sum(not waiter.done() for _, waiter in self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, size_bytes: int) -> AsyncIterator[Held]:
        """`size_bytes` held until the block ends or `Held.release()`, waiting behind earlier
        holders for them. ValueError for more than the whole limit: it could never be held."""
        if not 0 <= size_bytes <= self.limit_bytes:
            raise ValueError(f"{size_bytes} bytes cannot be held within {self.limit_bytes}")
        await self._acquire(size_bytes)
        held = Held(self, size_bytes)
        try:
            yield held
        finally:
            held.release()

    async def _acquire(self, size_bytes: int) -> None:
        if not self._waiters and size_bytes <= self._free_bytes:
            self._free_bytes -= size_bytes
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (size_bytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._give_back(size_bytes)  # granted as it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._grant()  # the next in line may fit where this one did not
            raise

    def _give_back(self, size_bytes: int) -> None:
        self._free_bytes += size_bytes
        self._grant()

    def _grant(self) -> None:
        """Grant waiters in arrival order while the first fits."""
        while self._waiters:
            size_bytes, waiter = self._waiters[0]
            if waiter.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if size_bytes > self._free_bytes:
                return
            self._waiters.popleft()
            self._free_bytes -= size_bytes
            waiter.set_result(None)


class Held:
    """Bytes granted by a `ByteLimit`; `release()` gives them back early (once)."""

    def __init__(self, limit: ByteLimit, size_bytes: int) -> None:
        self._limit = limit
        self.size_bytes = size_bytes
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limit._give_back(self.size_bytes)
