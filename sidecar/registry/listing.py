"""What the registry holds, as of its last listing (every --catalog-refresh seconds). The catalog
lists what is validated and on disk, not the registry, so nothing else lists it while the
sidecar runs: this listing is what reports registry folders that cannot be adapters (the
registry logs them once per change and counts them in lora_sidecar_registry_skipped_folders), and
what GET /catalog shows of the adapters a first /stage would add.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..core.errors import SidecarError
from ..core.fsutil import iso_utc
from .base import AdapterRegistry

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 5.0
SHOWN_NOT_STAGED = 100  # ids quoted in GET /catalog; the count is always whole


class RegistryListing:
    """`run()` as a background task; `status()` for GET /catalog."""

    def __init__(self, registry: AdapterRegistry, interval_s: float,
                 on_disk: Callable[[], Iterable[str]],
                 wall: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._on_disk = on_disk
        self._wall = wall
        self._ids: frozenset[str] | None = None
        self.listed = asyncio.Event()  # set by the first listing that succeeded
        self._listed_at: float | None = None  # unix, of the last listing that succeeded
        self._error: str | None = None

    async def run(self) -> None:
        while True:
            listed = await self.list_once()
            await asyncio.sleep(self._interval_s if listed
                                else min(self._interval_s, RETRY_AFTER_FAILURE_S))

    async def list_once(self) -> bool:
        """One listing; False (the reason kept for status()) when the registry cannot say."""
        try:
            ids = frozenset(await self._registry.list_adapter_ids())
        except SidecarError as exc:
            if self._error != exc.message:
                log.warning("cannot list the registry: %s", exc.message)
            self._error = exc.message
            return False
        except Exception as exc:  # a fault of ours: logged, and the next listing tries again
            log.exception("listing the registry failed")
            self._error = f"{type(exc).__name__}: {exc}"
            return False
        if self._error is not None:
            log.info("the registry can be listed again")
        self._ids, self._listed_at, self._error = ids, self._wall(), None
        self.listed.set()
        return True

    def ids(self) -> frozenset[str] | None:
        """The adapter ids of the last listing that succeeded; None before the first."""
        return self._ids

    def status(self) -> dict[str, Any]:
        not_staged = sorted(self._ids - set(self._on_disk())) if self._ids is not None else []
        return {
            "listed_at": iso_utc(self._listed_at) if self._listed_at is not None else None,
            "adapters": len(self._ids) if self._ids is not None else None,
            "not_staged_count": len(not_staged),
            "not_staged": not_staged[:SHOWN_NOT_STAGED],
            "error": self._error,
        }
