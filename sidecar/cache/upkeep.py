"""The cache's background work: expiring leases (and keeping their journal short), and
staging pinned adapters until they are in. The app runs these as tasks and cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..errors import InvalidAdapter, SidecarError
from .stager import RELIST_REFUSED_S, Stager
from .store import AdapterStore

log = logging.getLogger(__name__)

PIN_RETRY_S = (1.0, 30.0)  # first and largest delay between attempts to stage a pin


async def sweep_leases(store: AdapterStore) -> None:
    """Forever: end expired leases (the store trims what they held), flush and compact the
    lease journal."""
    while True:
        try:
            store.expire_leases()
            journal = store.lease_journal
            if journal is not None:
                if journal.flush_due():
                    journal.flush()
                if journal.compaction_due(store.live_lease_count) and (
                        journal.begin_compaction()):
                    await asyncio.to_thread(journal.merge)  # the loop appends meanwhile
                journal.close_if_idle()
        except Exception:
            log.exception("lease expiry failed")
        delay = store.seconds_to_next_expiry()
        await asyncio.sleep(min(1.0, max(0.05, 1.0 if delay is None else delay)))


async def stage_pin(stager: Stager, adapter_id: str, timeout_s: float,
                    on_problem: Callable[[str | None], None]) -> None:
    """Stage a pinned adapter, retrying with a growing delay until it is in; `on_problem`
    hears each failure (readiness) and None once it is staged."""
    delay = PIN_RETRY_S[0]
    while True:
        try:
            await stager.stage(adapter_id, timeout_s=timeout_s, lease=False)
        except SidecarError as exc:
            on_problem(f"{exc.code}: {exc.message}")
            if isinstance(exc, InvalidAdapter):
                # Refused for these files: asked again as often as a refusal is re-checked,
                # so an upload that completes (or a fix) is staged within a second or two.
                await asyncio.sleep(RELIST_REFUSED_S)
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, PIN_RETRY_S[1])
            continue
        on_problem(None)
        log.info("pinned adapter staged adapter_id=%s", adapter_id)
        return
