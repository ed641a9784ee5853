"""POST /stage's use case, for the HTTP API and the tests alike: stage an adapter, then the name
a request must send vLLM for it, which joins what the engine serves (serving.py) and the names
kept for it (catalog.py). Also the cache as the catalog sees it (`StoreView`: versions on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ..cache.lru import CachedAdapter
from ..cache.stager import Stager, StageResult
from ..cache.store import AdapterStore
from ..core.errors import (
    CatalogPending,
    CatalogReloading,
    EngineFailed,
    LeaseNotFound,
    SidecarError,
)
from ..core.fsutil import iso_utc
from ..core.logs import fields
from ..core.metrics import Metrics
from ..validation.safetensors_check import check_safetensors
from .catalog import Catalog, NoNameLeft
from .disk import WEIGHTS_FILE, NoopAdapter
from .engine_refusal import EngineRefusal, judge
from .name_state import NameEvent, Version
from .reloads import Reloads
from .serving import Serving

log = logging.getLogger(__name__)

REPLACED_MAX = 10_000  # ids whose registry bytes changed, remembered for GET /adapters


class StoreView:
    """The store's adapters as versions (id and content digest)."""

    def __init__(self, store: AdapterStore, allowed_modules: tuple[str, ...]) -> None:
        self._store = store
        self._allowed = allowed_modules

    def versions(self) -> list[Version]:
        return [version_of(a) for a in self._store.adapters()]

    def digest_of(self, adapter_id: str) -> str | None:
        adapter = self._store.get(adapter_id)
        return adapter.record.content_digest if adapter is not None else None

    def budget(self) -> tuple[int, int]:
        return self._store.total_bytes, self._store.max_bytes

    def noop_like(self) -> tuple[NoopAdapter, str] | None:
        """Blocking. A no-op shaped like an adapter on disk (they passed validation: their
        tensors are what the engine accepts), for when the base model's config is not given."""
        for adapter in self._store.adapters():
            path = self._store.path_of(adapter.adapter_id) / WEIGHTS_FILE
            try:
                with open(path, "rb") as f:
                    check = check_safetensors(f, path.stat().st_size, Path(path))
            except OSError:
                continue
            if check.tensors is None:
                continue
            noop = NoopAdapter.like({t.name: t.shape for t in check.tensors}, self._allowed)
            if noop is not None:
                return noop, f"adapter {adapter.adapter_id}"
        return None


def version_of(adapter: CachedAdapter) -> Version:
    return Version(adapter.adapter_id, adapter.record.content_digest)


class Named(NamedTuple):  # a tuple, not a frozen dataclass: built on every hit
    """A staged adapter, and the name vLLM knows it by."""

    staged: StageResult
    lora_name: str


class Naming:
    """`stage()` for POST /stage; `status()` for GET /catalog."""

    def __init__(self, catalog: Catalog, serving: Serving, reloads: Reloads, stager: Stager,
                 store: AdapterStore, metrics: Metrics, wall: Callable[[], float] = time.time
                 ) -> None:
        self._catalog = catalog
        self._serving = serving
        self._reloads = reloads  # GET /catalog and POST /catalog/compact
        self._stager = stager
        self._store = store
        self._metrics = metrics
        self._wall = wall
        # adapter id -> (the digest named before, the digest now, when it was seen, unix)
        self._replaced: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    async def stage(self, adapter_id: str, *, timeout_s: float, lease: bool = True,
                    hold_s: float = 0.0, refused: EngineRefusal | None = None) -> Named:
        """Stage an adapter (leased unless `lease` is false), then name it. Named after staging,
        so an unknown or invalid adapter says so first and a name is given only to an adapter
        validated and published.

        While no engine serves a catalog that names it (a reload, a load, a compaction
        planned), the answer waits up to `hold_s` (within `timeout_s`) for that to end: the
        sidecar knows when it does. `refused` is the engine's refusal of the name the last
        answer gave: judged here, it is answered at once when the engine failed on the request
        itself, else waited out like a reload. The lease is released before an error is
        raised."""
        # The hit path: cached and named already, answered without a wait (so no claim).
        staged = self._stager.hit(adapter_id, lease=lease) if refused is None else None
        if staged is not None:
            name = self._serving_name(staged.adapter)
            if name is not None:
                return Named(staged, name)
        now = asyncio.get_running_loop().time()
        hold_until = now + min(hold_s, timeout_s)
        failure = None if refused is None else judge(refused, adapter_id, self._serving.model)
        if isinstance(failure, EngineFailed):
            raise failure  # asking the engine again would be answered the same
        # Kept from eviction until it has its name: by its lease, or (a warm-up, unleased) by
        # a claim held from before the stage to after the naming, so an adapter that was
        # staged is always answered with a name.
        with contextlib.nullcontext() if lease else self._store.claim(adapter_id):
            if staged is None:
                staged = await self._stager.stage(adapter_id, timeout_s=timeout_s, lease=lease)
            try:
                name = await self._name_when_served(staged.adapter, hold_until, refused, failure)
            except BaseException:  # an error, or the caller gone while held
                if staged.lease is not None:
                    with contextlib.suppress(LeaseNotFound):  # expired meanwhile
                        self._store.release(staged.lease.lease_id)
                raise
        return Named(staged, name)

    def hit(self, adapter_id: str, *, lease: bool = True) -> Named | None:
        """A cached adapter that an engine serves by a name already, leased (or touched),
        counted and named in one synchronous step (hit path); None, with nothing done, for
        every other case, which `stage` answers."""
        adapter = self._store.get(adapter_id)
        if adapter is None:
            return None
        name = self._serving_name(adapter)
        if name is None:
            return None
        staged = self._stager.hit(adapter_id, lease=lease)  # no await since the get: cached
        return None if staged is None else Named(staged, name)

    def _serving_name(self, adapter: CachedAdapter) -> str | None:
        """The name an engine serves the adapter by now, if it has one: the hit path, without
        the waits and catalog changes of `_name_when_served`."""
        generation = self._serving.naming_or_none()
        if generation is None:
            return None
        return generation.serving_name(adapter.adapter_id, adapter.record.content_digest)

    async def _name_when_served(self, adapter: CachedAdapter, hold_until: float,
                                refused: EngineRefusal | None, failure: SidecarError | None
                                ) -> str:
        """The name, once an engine serves a catalog that names the adapter (and, after a
        refusal, once something changed in what serves), or the last error at `hold_until`."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        held = hold_until > started  # else the stage itself took the hold asked for
        while True:
            changed = self._serving.changed  # taken first: a change after it wakes us
            error: SidecarError
            try:
                name = await self.lora_name(adapter)
                if refused is None or name != refused.lora_name:
                    return name
                assert failure is not None
                error = failure
                if not self._serving.reloads:
                    raise error  # the operator reloads Triton: nothing here to wait for
                self._serving.engine_refused()
            except (CatalogPending, CatalogReloading) as exc:
                error = exc
            remaining_s = hold_until - loop.time()
            if remaining_s > 0:
                try:
                    async with asyncio.timeout(remaining_s):
                        await changed.wait()
                except TimeoutError:
                    pass
                else:
                    refused = None  # what serves changed: the engine may serve the name now
                    continue
            if held:
                error.message += f" (held {loop.time() - started:.1f}s, the caller's hold_s)"
            raise error

    async def lora_name(self, adapter: CachedAdapter) -> str:
        """The name to send vLLM for a staged adapter. CatalogPending or CatalogReloading
        when no engine serves a catalog that can name it (yet)."""
        generation = self._serving.naming_generation()
        digest = adapter.record.content_digest
        name = generation.serving_name(adapter.adapter_id, digest)
        if name is not None:
            return name  # the hit path
        version = version_of(adapter)
        self._note_replaced(generation.held_names_of(adapter.adapter_id), version)
        try:
            name, event = await self._catalog.name(
                generation.number, version, lambda: self._store_holds(version))
        except NoNameLeft as exc:
            pending = self._serving.no_name_left(adapter.adapter_id, generation, exc.why)
            if not self._serving.reloads:
                # No Triton to reload: the next generation (rendered at once) lists it by its
                # own name, and the operator's reload of Triton makes it servable.
                return adapter.adapter_id
            raise pending from None
        if event is NameEvent.BIND:
            self._metrics.catalog_bindings.inc()
            left = generation.free_count()
            log.info("catalog: adapter %s served without a reload as %s (generation %d, %d spare "
                     "names left)", adapter.adapter_id, name, generation.number, left,
                     extra=fields(event="bound", adapter_id=adapter.adapter_id, lora_name=name,
                                  generation=generation.number, spares_left=left,
                                  digest=digest))
        self._serving.named(generation)
        return name

    def _store_holds(self, version: Version) -> bool:
        adapter = self._store.get(version.adapter_id)
        return adapter is not None and adapter.record.content_digest == version.digest

    def _note_replaced(self, held: dict[Version, str], version: Version) -> None:
        """Say once when an id comes back with other bytes than a name was given for: the
        registry changed under the id, and the new bytes get a new name."""
        others = [v for v in held if v.digest != version.digest]
        if not others:
            return
        known = self._replaced.get(version.adapter_id)
        if known is not None and known[1] == version.digest:
            return
        if len(self._replaced) >= REPLACED_MAX:
            self._replaced.popitem(last=False)  # the first noted (O(1), unlike a dict's first)
        self._replaced[version.adapter_id] = (others[0].digest, version.digest, self._wall())
        log.warning("catalog: the registry changed under adapter %s: its bytes are now %s, "
                    "names given for %s never lead to them; they get a new name",
                    version.adapter_id, version.digest, ", ".join(v.digest for v in others),
                    extra=fields(event="registry_changed", adapter_id=version.adapter_id,
                                 digest=version.digest, before=[v.digest for v in others]))

    def replaced(self, adapter_id: str) -> dict[str, Any] | None:
        """For GET /adapters: whether (and when) the registry changed under this id."""
        known = self._replaced.get(adapter_id)
        if known is None:
            return None
        return {"digest_before": known[0], "digest_now": known[1], "seen_at": iso_utc(known[2])}

    # ---- GET /catalog and POST /catalog/compact ----------------------------------------

    @property
    def reloads(self) -> Reloads:
        return self._reloads

    def status(self) -> dict[str, Any]:
        return self._reloads.status()

    def request_compaction(self) -> dict[str, Any]:
        return self._reloads.request_compaction()

