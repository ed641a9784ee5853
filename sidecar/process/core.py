"""The core, built one way for the daemon and its tests: the catalog, the store, the stager,
the catalog's reloads and POST /stage's use case, each given its collaborators at construction
(the catalog's `on_change` included). `app.py` adds the process around it: the registry's
connections, the HTTP servers, the background tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..cache.stager import Stager
from ..cache.store import AdapterStore
from ..catalog.catalog import Catalog
from ..catalog.naming import Naming, StoreView
from ..catalog.reloads import Reloads
from ..catalog.triton_control import ModelControl
from ..config import Settings
from ..core.errors import SidecarError
from ..core.metrics import Metrics
from ..registry.base import AdapterRegistry
from ..validation.validate import Rules


@dataclass(frozen=True, slots=True)
class Core:
    catalog: Catalog
    store: AdapterStore
    stager: Stager
    reloads: Reloads
    naming: Naming


def build_core(
    settings: Settings,
    rules: Rules,
    metrics: Metrics,
    registry: AdapterRegistry,
    *,
    registry_ids: Callable[[], frozenset[str] | None] = lambda: None,
    on_registry_result: Callable[[SidecarError | None], None] = lambda _: None,
    control: ModelControl | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> Core:
    """The core from the settings; `control` stands in for Triton, `clock` and `wall` for the
    catalog's time (tests)."""
    reloads: Reloads | None = None

    def catalog_changed() -> None:  # the catalog is built first: the store tells it of leavers
        if reloads is not None:
            reloads.catalog_changed()

    catalog = Catalog(settings.cache_root, settings.triton_root, rules, metrics,
                      lease_ttl_s=settings.lease_ttl_s, spares_wanted=settings.spare_names != 0,
                      on_change=catalog_changed, clock=clock, wall=wall)
    store = AdapterStore(
        settings.cache_root,
        max_bytes=settings.max_bytes,
        max_adapters=settings.max_adapters,
        min_free_bytes=settings.min_free_bytes,
        lease_ttl_s=settings.lease_ttl_s,
        max_leases=settings.max_leases,
        pinned=settings.pin,
        metrics=metrics,
        listener=catalog,
        eviction_policy=settings.eviction_policy,
    )
    stager = Stager(
        store,
        registry,
        rules,
        metrics,
        refusal_ttl_s=settings.refusal_ttl_s,
        not_found_ttl_s=settings.not_found_ttl_s,
        upload_settle_s=settings.upload_settle_s,
        on_registry_result=on_registry_result,
    )
    reloads = Reloads(settings, catalog, metrics,
                      StoreView(store, settings.allowed_target_modules),
                      registry_ids=registry_ids, control=control, clock=clock, wall=wall)
    naming = Naming(catalog, reloads.serving, reloads, stager, store, metrics, wall=wall)
    return Core(catalog, store, stager, reloads, naming)
