"""Live leases: in expiry order, counted per adapter, with ids drawn from a pool, and every
grant and release written to the lease journal when there is one.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from ..core.errors import LeaseNotFound
from ..core.logs import fields
from ..core.metrics import Metrics
from .lease_journal import JournalLease, LeaseJournal, lease_digest

log = logging.getLogger(__name__)

EXPIRY_LOG_LINES = 20  # per sweep; a crashed router can leave thousands to expire at once


class Lease(NamedTuple):
    lease_id: str
    adapter_id: str
    expires_at: float  # on the store's monotonic clock: what expiry compares against
    expires_at_unix: float  # the same moment on the wall clock, for callers to read


class LeaseTable:
    def __init__(self, ttl_s: float, max_leases: int, metrics: Metrics,
                 clock: Callable[[], float], monotonic: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_leases = max_leases
        self._metrics = metrics
        self._clock = clock
        self._monotonic = monotonic
        # lease key -> (adapter_id, expires_at on the monotonic clock, the id's digest in the
        # journal), in expiry order. The key is the lease id, or "#" + its digest for a lease
        # read back from the journal (only digests are written there; "#" never starts an id
        # we hand out). Untracked tuples in an OrderedDict: benchmarks/README.md, "hit path".
        self._leases: OrderedDict[str, tuple[str, float, str]] = OrderedDict()
        self._counts: dict[str, int] = {}  # adapter_id -> live leases
        self._random_pool: list[tuple[str, str]] = []  # (lease id, digest)
        self._cap_warned_at = -math.inf
        self.lease_journal: LeaseJournal | None = None  # the store installs it once recovered

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, adapter_id: str, now: float) -> tuple[Lease, bool]:
        """A new lease on `adapter_id` (`now` on the wall clock), and whether the cap on live
        leases ended the last lease of an adapter, which may then have to go."""
        monotonic_now = self._monotonic()
        expires_at = monotonic_now + self.ttl_s
        pool = self._random_pool
        lease_id, digest = pool.pop() if pool else self._new_lease_ids()
        leases = self._leases
        leases[lease_id] = (adapter_id, expires_at, digest)
        self._counts[adapter_id] = self._counts.get(adapter_id, 0) + 1
        if self.lease_journal is not None:
            self.lease_journal.granted(digest, adapter_id, self.ttl_s, now, monotonic_now)
        unheld = len(leases) > self.max_leases and self._drop_oldest(monotonic_now)
        return Lease(lease_id, adapter_id, expires_at, now + self.ttl_s), unheld

    def _new_lease_ids(self) -> tuple[str, str]:
        """A lease id, 128 random bits from the OS's CSPRNG, and its digest for the journal;
        the pool refilled with 255 more: one getrandom() and the hashes in one loop (hit
        path)."""
        pool = secrets.token_bytes(16 * 256)
        ids = [pool[i:i + 16].hex() for i in range(0, len(pool), 16)]
        self._random_pool = [(lease_id, lease_digest(lease_id)) for lease_id in ids]
        return self._random_pool.pop()

    def _drop_oldest(self, now: float) -> bool:
        """Past --max-leases someone is not releasing: the oldest lease ends early, so memory
        stays bounded. A request still running after that many newer ones is not plausible.
        No journal line: a restart applies the same cap. True when that was the last lease
        of its adapter."""
        _, (adapter_id, _, _) = self._leases.popitem(last=False)
        self._uncount(adapter_id)
        self._metrics.leases_expired.inc()
        if now - self._cap_warned_at >= 60:
            self._cap_warned_at = now
            log.warning("%d live leases: the oldest end early (adapter_id=%s); callers are "
                        "not releasing their leases (POST /release)", self.max_leases,
                        adapter_id, extra=fields(event="lease_cap", count=self.max_leases))
        return adapter_id not in self._counts

    def release(self, lease_id: str) -> Lease:
        key = lease_id
        if key not in self._leases and not key.startswith("#"):
            key = "#" + lease_digest(lease_id)  # granted before a restart
        if key not in self._leases:
            raise LeaseNotFound(f"no live lease {lease_id[:80]!r} (released or expired "
                                "already)")
        return self.end(key)._replace(lease_id=lease_id)

    def expire(self) -> list[Lease]:
        """Drop leases past their expiry. Every lease gets the same TTL (leases read back from
        the journal expire sooner), so `_leases`, in insertion order, is in expiry order: the
        sweep stops at the first live one."""
        now = self._monotonic()
        ended = []
        for lease_id, (_, expires_at, _) in self._leases.items():
            if expires_at > now:
                break
            ended.append(lease_id)
        # Expiry needs no journal line: a restart works it out from the grant's time.
        expired = [self.end(lease_id, journal=False) for lease_id in ended]
        if expired:
            self._metrics.leases_expired.inc(len(expired))
        for lease in expired[:EXPIRY_LOG_LINES]:
            log.info("lease expired lease_id=%s adapter_id=%s", lease.lease_id, lease.adapter_id,
                     extra=fields(event="lease_expired", adapter_id=lease.adapter_id,
                                  lease_id=lease.lease_id))
        if len(expired) > EXPIRY_LOG_LINES:
            log.info("%d more leases expired on %d adapters", len(expired) - EXPIRY_LOG_LINES,
                     len({lease.adapter_id for lease in expired[EXPIRY_LOG_LINES:]}),
                     extra=fields(event="lease_expired",
                                  count=len(expired) - EXPIRY_LOG_LINES))
        return expired

    def next_expiry(self) -> float | None:
        """On the monotonic clock."""
        first = next(iter(self._leases.values()), None)
        return None if first is None else first[1]

    def count_of(self, adapter_id: str) -> int:
        return self._counts.get(adapter_id, 0)

    def holds(self, adapter_id: str) -> bool:
        return adapter_id in self._counts

    def ids_of(self, adapter_id: str) -> list[str]:
        """A scan: only forced and external evictions need the ids, and they are rare."""
        if adapter_id not in self._counts:
            return []
        return sorted(i for i, (held, _, _) in self._leases.items() if held == adapter_id)

    def end(self, lease_id: str, *, journal: bool = True) -> Lease:
        adapter_id, expires_at, digest = self._leases.pop(lease_id)
        self._uncount(adapter_id)
        if journal and self.lease_journal is not None:
            self.lease_journal.ended(digest)
        expires_in_s = expires_at - self._monotonic()
        return Lease(lease_id, adapter_id, expires_at, self._clock() + expires_in_s)

    def _uncount(self, adapter_id: str) -> None:
        left = self._counts[adapter_id] - 1
        if left:
            self._counts[adapter_id] = left
        else:
            del self._counts[adapter_id]

    def restore(self, leases: Iterable[JournalLease]) -> int:
        """Take back leases a previous process granted (soonest to expire first). Returns how
        many were restored."""
        now = self._monotonic()
        restored = 0
        for lease in sorted(leases, key=lambda lease: lease.remaining_s):
            key = "#" + lease.digest
            if key in self._leases:
                continue
            # Never beyond the TTL of leases granted from now on: the expiry order holds.
            remaining_s = min(lease.remaining_s, self.ttl_s)
            self._leases[key] = (lease.adapter_id, now + remaining_s, lease.digest)
            self._counts[lease.adapter_id] = self._counts.get(lease.adapter_id, 0) + 1
            restored += 1
        return restored

    def live(self) -> list[tuple[str, str, float]]:
        """(digest, adapter_id, remaining seconds) of every live lease, for the journal."""
        now = self._monotonic()
        return [(digest, adapter_id, expires_at - now)
                for adapter_id, expires_at, digest in self._leases.values()]
