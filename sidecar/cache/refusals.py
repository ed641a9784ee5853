"""Verdicts the stager answers again without a fetch: a refusal for --refusal-ttl, for the upload
it judged (a changed listing is judged afresh), and "not in the registry" for --not-found-ttl.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import AdapterNotFound, InvalidAdapter
from ..core.fsutil import iso_utc
from ..core.logs import fields
from ..core.metrics import Metrics
from ..validation.problem import Problem

log = logging.getLogger(__name__)

NOT_FOUND_MAX = 10_000  # ids remembered as not in the registry
# A remembered refusal holds for the bytes it judged: the registry is listed again at most this
# often while callers keep asking, and a changed listing (an upload finished, a fixed one) is
# judged afresh at once.
RELIST_REFUSED_S = 1.0

Upload = tuple[object, ...]  # Listing.signature(): what the registry listed of the bytes


@dataclass(slots=True)
class _Refusal:
    until: float  # monotonic: --refusal-ttl
    error: InvalidAdapter
    upload: Upload  # what the registry listed when it was judged
    checked: float  # monotonic: when the listing was last seen unchanged


class Refusals:
    def __init__(self, metrics: Metrics, *, refusal_ttl_s: float, not_found_ttl_s: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._refusal_ttl_s = refusal_ttl_s
        self._not_found_ttl_s = not_found_ttl_s
        self._monotonic = monotonic
        self._refused: dict[str, _Refusal] = {}
        # Ids asked for are the caller's choice, so this map is bounded. One TTL for all, so
        # in insertion order it is in expiry order: the oldest ends first, in O(1).
        self._not_found: OrderedDict[str, tuple[float, AdapterNotFound]] = OrderedDict()

    def raise_if_remembered(self, adapter_id: str) -> None:
        """Before a stage: answer from memory a refusal checked within RELIST_REFUSED_S, or an
        id not in the registry; else the stage lists the registry (see `recall`)."""
        now = self._monotonic()
        refused = self._refused.get(adapter_id)
        if refused is not None:
            if now >= refused.until:
                del self._refused[adapter_id]
            elif now - refused.checked < RELIST_REFUSED_S:
                raise refused.error.recalled()
        missing = self._not_found.get(adapter_id)
        if missing is not None:
            if now < missing[0]:
                raise missing[1]
            del self._not_found[adapter_id]

    def recall(self, adapter_id: str, upload: Upload) -> None:
        """With a fresh listing: answer a remembered refusal if the registry still lists the
        bytes it judged; forget it if not."""
        refused = self._refused.get(adapter_id)
        if refused is None:
            return
        if refused.upload == upload:
            refused.checked = self._monotonic()
            raise refused.error.recalled()
        del self._refused[adapter_id]
        log.info("adapter_id=%s changed in the registry since it was refused; judging it "
                 "afresh", adapter_id, extra=fields(event="refusal_outdated",
                                                     adapter_id=adapter_id))

    def refuse(self, adapter_id: str, problems: list[Problem], upload: Upload) -> InvalidAdapter:
        """The refusal to raise, counted, logged and remembered for `upload`."""
        for code in sorted({p.code for p in problems}):
            self._metrics.validation_failures.labels(reason=code).inc()
        refused_at = time.time()
        until = None if self._refusal_ttl_s <= 0 else iso_utc(refused_at + self._refusal_ttl_s)
        error = InvalidAdapter(adapter_id, [p.to_json() for p in problems],
                               refused_at=iso_utc(refused_at), remembered_until=until)
        if self._refusal_ttl_s > 0:
            now = self._monotonic()
            self._refused[adapter_id] = _Refusal(now + self._refusal_ttl_s, error, upload, now)
        error.logged = True
        log.warning("refused adapter_id=%s problems=%d: %s", adapter_id, len(problems),
                    "; ".join(f"{p.code} {p.file}" for p in problems),
                    extra=fields(event="refused", adapter_id=adapter_id,
                                 problems=sorted({p.code for p in problems})))
        return error

    def not_found(self, error: AdapterNotFound) -> None:
        """Remember an id the registry does not have, for --not-found-ttl."""
        if self._not_found_ttl_s <= 0 or error.adapter_id is None:
            return
        now = self._monotonic()
        missing = self._not_found
        while missing and (next(iter(missing.values()))[0] <= now
                           or len(missing) >= NOT_FOUND_MAX):
            missing.popitem(last=False)  # expired, or the oldest past the bound
        remembered = AdapterNotFound(
            f"{error.message} (remembered for {self._not_found_ttl_s:g}s, "
            "--not-found-ttl: an adapter uploaded since is found once that has passed)",
            adapter_id=error.adapter_id)
        missing.pop(error.adapter_id, None)  # remembered again: last to expire
        missing[error.adapter_id] = (now + self._not_found_ttl_s, remembered)

    def forget(self, adapter_id: str) -> bool:
        """Drop a remembered refusal (and "not found") so the next stage looks afresh; the
        operator's way out after fixing an adapter in place. True if a refusal was dropped."""
        self._not_found.pop(adapter_id, None)
        if self._refused.pop(adapter_id, None) is None:
            return False
        log.info("forgot the remembered refusal of adapter_id=%s", adapter_id,
                 extra=fields(event="refusal_forgotten", adapter_id=adapter_id))
        return True
