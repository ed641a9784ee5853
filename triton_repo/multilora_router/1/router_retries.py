"""Asking again: the one backoff the router waits with, and the holds that keep a request
while no engine serves its adapter (a reload, a catalog not loaded yet, an engine restarting).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from router_errors import RouteError
from router_settings import RouterSettings

Clock = Callable[[], float]
Pause = Callable[[float], None]

_FIRST_S = 0.05
_MAX_S = 1.0


class Backoff:
    """Pauses between attempts until `limit_s` from its creation: 50 ms doubling to 1 s, each
    jittered down by up to half so requests refused together do not ask again together."""

    def __init__(self, limit_s: float, clock: Clock, pause: Pause) -> None:
        self._clock = clock
        self._pause = pause
        self._started = clock()
        self._deadline = self._started + limit_s
        self._delay_s = _FIRST_S

    @property
    def remaining_s(self) -> float:
        return self._deadline - self._clock()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def pause(self) -> bool:
        """Pause before the next attempt; False, at once, when it would start past the limit."""
        if self._clock() + self._delay_s >= self._deadline:
            return False
        self._pause(self._delay_s * random.uniform(0.5, 1.0))
        self._delay_s = min(self._delay_s * 2, _MAX_S)
        return True


class Holds:
    """The requests held at once: each waits up to `hold_s`, and at most `max_held_requests`
    wait together; past either bound a request fails with the error it got. Thread-safe."""

    def __init__(self, settings: RouterSettings, clock: Clock = time.monotonic,
                 pause: Pause = time.sleep) -> None:
        self.hold_s = settings.hold_s
        self._max = settings.max_held_requests
        self._clock = clock
        self._pause = pause
        self._lock = threading.Lock()
        self.held = 0  # requests waiting now

    @classmethod
    def none(cls) -> Holds:
        """Holding off: every request is answered at once."""
        return cls(RouterSettings(hold_s=0.0))

    def start(self) -> Hold:
        return Hold(self)

    def _new_backoff(self) -> Backoff:
        return Backoff(self.hold_s, self._clock, self._pause)

    def _take(self) -> bool:
        with self._lock:
            if self.hold_s <= 0 or self.held >= self._max:
                return False
            self.held += 1
            return True

    def _give_back(self) -> None:
        with self._lock:
            self.held -= 1


class Hold:
    """One request's hold, a context: `wait(error)` pauses before the next attempt, or raises
    `error`; leaving the context gives the hold's place back."""

    def __init__(self, holds: Holds) -> None:
        self._holds = holds
        self._backoff: Backoff | None = None
        self._taken = False
        self.waits = 0

    def wait(self, error: RouteError) -> None:
        if self._backoff is None:
            self._backoff = self._holds._new_backoff()
            self._taken = self._holds._take()
            if not self._taken:
                raise error  # holding is off, or enough requests wait already
        if not self._backoff.pause():
            error.message += f" (held {self._backoff.elapsed_s:.1f}s, the router's hold_s)"
            raise error
        self.waits += 1

    @property
    def held_s(self) -> float:
        return 0.0 if self._backoff is None else self._backoff.elapsed_s

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._taken:
            self._taken = False
            self._holds._give_back()
