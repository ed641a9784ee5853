"""The catalog's work, one piece at a time: its start-up (the journaled generation carried on, or a
first one rendered), a render of a new generation, a load of Triton's vLLM model. When each is
due is reloads.py's to say.

A generation lists every adapter validated and on disk when it is rendered, by its own name,
plus spare names sized from what the node can be asked for (the registry's listing, with
headroom for uploads).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ..config import Settings
from ..core.logs import fields
from ..core.metrics import Metrics
from .catalog import Catalog
from .compaction import CompactionReason
from .disk import NoopAdapter
from .engine_state import EngineTracker, LoadKind, LoadOutcome
from .name_state import Version
from .planner import CompactionPlanner
from .triton_control import ModelControl, ReloadFailed

log = logging.getLogger(__name__)

FIRST_LISTING_WAIT_S = 10.0  # a first generation waits this long for the registry's listing


class DiskView(Protocol):
    """The adapters on disk, as the catalog needs them (naming.StoreView over the store)."""

    def versions(self) -> list[Version]: ...

    def digest_of(self, adapter_id: str) -> str | None: ...

    def noop_like(self) -> tuple[NoopAdapter, str] | None:
        """Blocking: a no-op shaped like an adapter on disk, and which one."""
        ...

    def budget(self) -> tuple[int, int]:
        """Bytes of the adapters on disk, and --max-bytes."""
        ...


class Loads:
    """`start()` once; then `render()` and `load()` as reloads.py finds them due. Each tells
    `on_serving_changed` when what names requests may have changed."""

    def __init__(self, settings: Settings, catalog: Catalog, metrics: Metrics, disk: DiskView,
                 tracker: EngineTracker, planner: CompactionPlanner, *,
                 control: ModelControl | None, reloads: bool,
                 on_serving_changed: Callable[[], None], wall: Callable[[], float]) -> None:
        self._settings = settings
        self._catalog = catalog
        self._metrics = metrics
        self._disk = disk
        self._tracker = tracker
        self._planner = planner
        self._control = control
        self._reloads = reloads
        self._serving_changed = on_serving_changed
        self._wall = wall
        self._error: str | None = None  # why no catalog could be rendered
        self._last_reload_at: float | None = None  # unix, for status

    @property
    def error(self) -> str | None:
        """Why no catalog could be rendered (the last try), if it could not."""
        return self._error

    @property
    def last_reload_at(self) -> float | None:
        return self._last_reload_at

    # ---- start ---------------------------------------------------------------------------

    async def start(self, registry_listed: asyncio.Event | None = None) -> None:
        """Carry on with the journaled generation if multi_lora.json is still its rendering,
        and render a first generation otherwise (after the registry's first listing, which
        sizes its spares, or FIRST_LISTING_WAIT_S)."""
        catalog = self._catalog
        await asyncio.to_thread(catalog.prepare)
        if catalog.noop is None:
            await self._learn_noop()
        self._say_spares()
        try:
            await asyncio.to_thread(catalog.recover, self._disk.digest_of)
        except OSError as exc:
            self._error = f"cannot read or tidy the catalog's folder: {exc.strerror or exc}"
            log.warning("catalog: %s", self._error)
        catalog.watch()
        if catalog.current() is None:
            if registry_listed is not None:
                try:
                    async with asyncio.timeout(FIRST_LISTING_WAIT_S):
                        await registry_listed.wait()
                except TimeoutError:
                    pass
            await self.render(None)

    def _say_spares(self) -> None:
        catalog = self._catalog
        if catalog.spares_off is None:
            return
        if self._reloads:
            log.warning("catalog: spare names are off: %s; every adapter a loaded catalog does "
                        "not list costs a reload of %s", catalog.spares_off,
                        self._settings.triton_model)
        else:  # no reload to cost anything: no warning
            log.info("catalog: spare names are off: %s; the sidecar asks Triton for no reload "
                     "here, and each new adapter is listed by a new generation of the catalog "
                     "file", catalog.spares_off)

    async def _learn_noop(self) -> bool:
        """Without the base model's config, take the shapes of an adapter on disk (validated:
        its tensors fit the engine) for the no-op; True when spares became possible."""
        found = await asyncio.to_thread(self._disk.noop_like)
        if found is None:
            return False
        noop, source = found
        await asyncio.to_thread(self._catalog.prepare_from, noop, source)
        if self._catalog.noop is not None:
            log.info("catalog: the no-op adapter takes its shapes from %s (%s, rank 1)", source,
                     noop.module)
        return self._catalog.noop is not None

    # ---- a load of Triton's model --------------------------------------------------------

    async def load(self, kind: LoadKind) -> LoadOutcome:
        """Load the current generation into Triton's model, the way `kind` says."""
        assert self._control is not None
        model = self._settings.triton_model
        generation = self._catalog.current()
        if generation is None:
            return LoadOutcome.REFUSED
        number = generation.number
        self._tracker.start_load(number, kind)
        self._serving_changed()
        started = time.monotonic()
        log.info("catalog: %s of %s for generation %d (%d names, %d of them spares)",
                 kind.value, model, number, len(generation.names), generation.spare_count())
        error = None
        outcome = LoadOutcome.OK
        try:
            if kind is LoadKind.UNLOAD_FIRST:
                await self._control.unload(model)
            await self._control.load(model)
        except ReloadFailed as exc:
            error = str(exc)
            if kind is LoadKind.RELOAD:
                # The new engine loads beside the old one; on one GPU with vLLM's
                # gpu_memory_utilization above about half, it cannot fit.
                error += (" (on-change needs GPU memory for two engines at once; "
                          "--triton-reload unload-first needs one)")
            outcome = LoadOutcome.REFUSED if exc.reached else LoadOutcome.UNREACHABLE
        self._tracker.load_done(outcome, error)
        if outcome is LoadOutcome.OK:
            self._last_reload_at = self._wall()
            await self._catalog.mark_loaded(number)
            self._planner.loaded(generation, self._catalog.spares_on)
            self._metrics.triton_reloads.labels(outcome="ok").inc()
            log.info("catalog: %s serves generation %d (%s took %.1fs)", model, number,
                     kind.value, time.monotonic() - started)
        elif outcome is LoadOutcome.REFUSED:
            self._metrics.triton_reloads.labels(outcome="error").inc()
            log.warning("catalog: %s of %s failed: %s", kind.value, model, error)
        else:
            log.warning("catalog: %s of %s did not reach Triton: %s", kind.value, model, error)
        self._serving_changed()
        return outcome

    # ---- a render of a new generation ----------------------------------------------------

    async def render(self, reason: CompactionReason | None) -> bool:
        """A new generation: every adapter on disk by its own name, and fresh spare names
        (`reason`: the compaction it carries out; None for a first). False when it could not
        be written (the error is kept for status)."""
        try:
            await self._render(reason)
        except OSError as exc:
            self._error = f"cannot render generation: {exc.strerror or exc}"
            log.warning("catalog: %s", self._error)
            return False
        self._error = None
        return True

    async def _render(self, reason: CompactionReason | None) -> None:
        catalog = self._catalog
        if catalog.noop is None and await self._learn_noop():
            self._say_spares()
        versions = self._disk.versions()
        spares = self._planner.spares_wanted({v.adapter_id for v in versions})
        generation = await catalog.render(versions, spares, self._disk.digest_of)
        if reason is not None:
            self._metrics.catalog_compactions.labels(reason=reason.value).inc()
        self._serving_changed()  # without reloads, the rendered generation names
        spares = generation.spare_count()
        log.info("catalog: generation %d lists %d adapters and %d spare names (%s)",
                 generation.number, len(generation.names) - spares, spares,
                 f"compaction: {reason.value}" if reason else "first of this cache",
                 extra=fields(event="rendered", generation=generation.number,
                              adapters=len(generation.names) - spares, spares=spares))

    async def close(self) -> None:
        if self._control is not None:
            await self._control.close()
