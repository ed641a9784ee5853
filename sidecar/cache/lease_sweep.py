"""The lease sweep: ends expired leases, keeps the lease journal short and saves the request
counts now and then, as a background task the app runs and cancels.
"""

from __future__ import annotations

import asyncio
import logging

from .store import AdapterStore

log = logging.getLogger(__name__)


async def sweep_leases(store: AdapterStore) -> None:
    """Forever: end expired leases (the store trims what they held), flush and compact the
    lease journal, save the request counts when due."""
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
            if store.frequency_save_due():
                await store.save_frequencies()
        except Exception:
            log.exception("lease expiry failed")
        delay = store.seconds_to_next_expiry()
        await asyncio.sleep(min(1.0, max(0.05, 1.0 if delay is None else delay)))
