"""Wiring: builds the objects, owns their lifetimes and every background task, and shuts
them down in order (HTTP first, storage client last).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from ..cache.lease_sweep import sweep_leases
from ..cache.ownership import CacheLock
from ..cache.recovery import recover
from ..cache.refusals import RELIST_REFUSED_S
from ..cache.watcher import Watcher
from ..config import Settings
from ..core.errors import CacheOwned, ConfigError, SidecarError
from ..core.exits import EXIT_CACHE_OWNED, EXIT_FAILED, EXIT_OK
from ..core.logs import configure_logging, fields
from ..core.metrics import Metrics
from ..core.net import is_loopback
from ..core.units import format_size
from ..registry.base import AdapterRegistry
from ..registry.kinds import open_registry
from ..registry.listing import RegistryListing
from ..registry.transfer import DEFAULT_ATTEMPTS, TransferPolicy, transfer_executor
from ..validation.problem import PROBLEM_CODES
from ..validation.signing_policy import describe_rules
from ..validation.validate import Rules
from ..web.api import READ_ONLY_ROUTES, Services, build_web_app
from ..web.epp import AdapterSet, EppExporter
from ..web.server import SHUTDOWN_GRACE_S, quiet_bad_requests, serve_http
from ..web.tenants import NO_TENANTS, Tenants
from .core import build_core
from .preflight import configuration_problems
from .seed import REPOSITORY_DIR, seed_model_repository

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
REGISTRY_PROBE_OK_S = 15.0


class Health:
    """Why the sidecar is not ready, by condition; empty when it is."""

    def __init__(self) -> None:
        self._problems: dict[str, str] = {}

    def set(self, condition: str, problem: str | None) -> None:
        if problem is None:
            if self._problems.pop(condition, None) is not None:
                log.info("ready again: %s recovered", condition)
        else:
            if self._problems.get(condition) != problem:
                log.warning("not ready: %s: %s", condition, problem)
            self._problems[condition] = problem

    def failing(self, condition: str) -> bool:
        return condition in self._problems

    def problems(self) -> list[str]:
        return [f"{name}: {problem}" for name, problem in sorted(self._problems.items())]


class Sidecar:
    """The running daemon. `await start()`, then `await stop()`; tests use it in-process."""

    def __init__(self, settings: Settings, metrics_registry: CollectorRegistry | None = None, *,
                 lock: CacheLock | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(metrics_registry,
                               eviction_policy=settings.eviction_policy.value,
                               problem_codes=PROBLEM_CODES)
        self.health = Health()
        self._disk_full: str | None = None  # why no new adapter fits the cache volume
        self.rules = Rules.from_settings(settings)
        self.tenants = _load_tenants(settings.tenants_file)
        policy = TransferPolicy(
            part_size_bytes=settings.part_size_bytes,
            attempts=DEFAULT_ATTEMPTS,  # a kind with a setting of its own sets it (S3)
            limiter=asyncio.Semaphore(settings.download_concurrency),
            concurrency=settings.download_concurrency,
            executor=transfer_executor(settings.download_concurrency),
        )
        self._transfer_executor = policy.executor
        self.registry: AdapterRegistry = open_registry(
            settings, policy, self._count_registry_error,
            self.metrics.registry_skipped_folders.set)
        # The listing reads the store when it runs, after the core is built.
        self.registry_listing = RegistryListing(
            self.registry, settings.catalog_refresh_s,
            lambda: (adapter.adapter_id for adapter in self.store.adapters()))
        core = build_core(settings, self.rules, self.metrics, self.registry,
                          registry_ids=self.registry_listing.ids,
                          on_registry_result=self._note_registry_result)
        self.catalog, self.store, self.stager = core.catalog, core.store, core.stager
        self.reloads, self.naming = core.reloads, core.naming
        store, stager = self.store, self.stager
        self.metrics.watch(
            cache_bytes=lambda: store.total_bytes,
            cache_adapters=lambda: len(store.adapters()),
            cache_capacity_bytes=lambda: store.max_bytes,
            cache_capacity_adapters=lambda: store.max_adapters,
            pinned_adapters=lambda: store.snapshot().pinned_adapters,
            active_leases=lambda: store.live_lease_count,
            inflight_downloads=lambda: len(stager.inflight),
            cache_room_bytes=store.room_bytes,
            waiting_for_room=lambda: store.waiting_for_room,
        )
        self.watcher = Watcher(self.store, self.rules, self.metrics)
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._started = False
        self.port = settings.port
        self.lock = lock or CacheLock(settings.cache_root)  # `serve` takes it before imports
        # Set once the cache is re-indexed; until then the API answers /healthz and /readyz
        # and holds every call that needs the index.
        self.recovered = asyncio.Event()
        self._recovery_progress: tuple[int, int] | None = None  # (checked, found) folders
        self.metrics_port = settings.metrics_port
        self.epp: EppExporter | None = None
        if settings.epp_metrics:
            self.epp = EppExporter(self._adapter_set, prefix=settings.epp_adapter_prefix,
                                   max_label_bytes=settings.epp_label_max_bytes)

    # ---- lifetime ----------------------------------------------------------------------

    async def start(self, *, wait_for_recovery: bool = True) -> None:
        """Own the cache root, bind the port, then recover the cache in the background
        (awaited here unless `wait_for_recovery` is false). Raises CacheOwned, touching
        nothing, when another process owns the cache root."""
        # Before anything in the cache is touched: a second process must leave it alone.
        if not self.lock.held:
            self.lock.acquire(self.settings.port or None)
        log.info("owning the cache root %s (flock on %s)", self.settings.cache_root,
                 self.lock.path, extra=fields(event="cache_locked",
                                              cache_root=str(self.settings.cache_root)))
        try:
            await self._listen()
        except BaseException:
            for runner in (self._runner, self._metrics_runner):
                if runner is not None:
                    await runner.cleanup()
            self._runner = self._metrics_runner = None
            await self.registry.close()
            # A start that fails (refused settings, a port in use) leaves nothing behind, not
            # even a cache root made for the lock, when nothing else was written into it.
            self.lock.release(undo=True)
            raise
        self._started = True
        self.lock.set_port(self.port)
        recovery = self._spawn(self._recover_then_serve(), "recovery")
        self._spawn(self._health_loop(), "health")
        self._spawn(self.registry_listing.run(), "registry-listing")
        log.info("lora-sidecar listening on http://%s:%d registry=%s cache_root=%s",
                 self.settings.host, self.port, self.registry.description,
                 self.settings.cache_root)
        for line in describe_rules(self.rules.signing):
            log.info("signing policy %s: %s", self.rules.signing.path, line)
        if wait_for_recovery:
            await asyncio.shield(recovery)

    async def _listen(self) -> None:
        await self.registry.open()
        # Settings that parse but cannot work stop the start (process/preflight.py says which
        # problems stop it and which only delay ready); the caller makes it exit code 2.
        problems = await configuration_problems(self.settings, self.registry)
        if problems:
            raise ConfigError(problems)
        if self.settings.seed_model_repository is not None:
            # Before the port binds: a startup probe passes only once Triton's repository is
            # on the volume.
            await asyncio.to_thread(seed_model_repository, self.settings.seed_model_repository,
                                    self.settings.cache_root / REPOSITORY_DIR)
        services = Services(
            settings=self.settings, store=self.store, stager=self.stager, naming=self.naming,
            metrics=self.metrics, readiness=self, catalog=self.naming,
            recovered=self.recovered, epp=self.epp,
            registry_listing=self.registry_listing, tenants=self.tenants,
        )
        self._runner, self.port = await serve_http(
            build_web_app(services), self.settings.host, self.settings.port, "port")
        if self.settings.metrics_host is not None:
            self._metrics_runner, self.metrics_port = await serve_http(
                build_web_app(services, READ_ONLY_ROUTES), self.settings.metrics_host,
                self.settings.metrics_port, "metrics_port")
            log.info("read-only listener (metrics, probes) on http://%s:%d",
                     self.settings.metrics_host, self.metrics_port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stop accepting HTTP first
            self._runner = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        await self.watcher.stop()
        for task in list(self._tasks):
            task.cancel("sidecar shutting down")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=SHUTDOWN_GRACE_S)
        await self.stager.close()
        await self.reloads.close()
        await self.store.close()
        await self.registry.close()
        if self._transfer_executor is not None:
            # Every download has waited for its threads; none is left running here.
            self._transfer_executor.shutdown(wait=False, cancel_futures=True)
        self.lock.release()  # last: everything of ours in the cache is settled
        if self._started:
            log.info("lora-sidecar stopped")

    @property
    def url(self) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def problems(self) -> list[str]:
        problems = self.health.problems()
        if not self.recovered.is_set():
            progress = self._recovery_progress
            problems.insert(0, "recovering: reading the cache" if progress is None else
                            f"recovering: {progress[0]} of {progress[1]} adapter folders "
                            "checked")
        problems.extend(self.store.pin_problems())
        catalog_problem = self.reloads.problem()
        if catalog_problem is not None:
            problems.append(catalog_problem)
        return problems

    def _adapter_set(self) -> AdapterSet:
        snap = self.store.snapshot()
        room = (snap.cache_adapters < snap.capacity_adapters
                and snap.cache_bytes < snap.capacity_bytes)
        return AdapterSet([a.adapter_id for a in self.store.adapters()], self.stager.inflight,
                          room)

    # ---- start-up recovery -------------------------------------------------------------

    async def _recover_then_serve(self) -> None:
        try:
            await self._recover()
        except Exception as exc:
            log.exception("recovering the cache failed")
            self.health.set("recovery", f"recovering the cache failed: {exc}")
        try:
            # After the cache's index (a generation lists what is on disk), before the API
            # answers /stage (which asks the catalog for the name to send).
            await self.reloads.start(self.registry_listing.listed)
        except Exception as exc:
            log.exception("starting the catalog failed")
            self.health.set("catalog", f"starting the catalog failed: {exc}")
        finally:
            self.recovered.set()  # a failed recovery is reported by /readyz, not by hanging
        self._spawn(self.reloads.run(), "catalog")
        await self.watcher.start()
        self._spawn(self.watcher.run(), "watcher")
        self._spawn(sweep_leases(self.store), "leases")
        stage_pinned = functools.partial(self.stager.stage, timeout_s=self.settings.stage_timeout_s,
                                         lease=False)
        self._spawn(self.store.keep_pins_staged(stage_pinned, retry_refused_s=RELIST_REFUSED_S),
                    "pins")

    async def _recover(self) -> None:
        await recover(self.store, self.rules,
                      max_leases=self.settings.max_leases,
                      lease_ttl_s=self.settings.lease_ttl_s,
                      on_problem=lambda problem: self.health.set("cache", problem),
                      on_progress=self._note_recovery_progress,
                      metrics=self.metrics)

    def _note_recovery_progress(self, checked: int, folders: int) -> None:
        self._recovery_progress = (checked, folders)

    # ---- background work ---------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _health_loop(self) -> None:
        last_probe = 0.0
        while True:
            try:
                problem = await asyncio.to_thread(_check_writable, self.store.root)
                self.health.set("cache", problem)
                self._note_disk_full(self.store.disk_full())
                interval = (HEALTH_INTERVAL_S if self.health.failing("registry")
                            else REGISTRY_PROBE_OK_S)
                if time.monotonic() - last_probe >= interval:
                    last_probe = time.monotonic()
                    try:
                        await self.registry.probe()
                        self._note_registry_result(None)
                    except SidecarError as exc:
                        self._note_registry_result(exc)
            except Exception:
                log.exception("health check failed")
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def notices(self) -> list[str]:
        """What /readyz says beside its verdict: conditions that do not make the sidecar
        unready (hits still serve) but that an operator should see."""
        return [] if self._disk_full is None else [self._disk_full]

    def _note_disk_full(self, full: str | None) -> None:
        """Say once when the cache filesystem leaves no room for a new adapter, and once when
        it has room again."""
        was_full, self._disk_full = self._disk_full is not None, full
        if full is not None and not was_full:
            log.warning("cache volume full: %s", full, extra=fields(event="disk_full"))
        elif full is None and was_full:
            log.warning("cache volume has room again: %s can be staged into",
                        format_size(self.store.disk_room_bytes()),
                        extra=fields(event="disk_room_again"))

    def _note_registry_result(self, error: SidecarError | None) -> None:
        """A call to the registry succeeded (None) or failed: readiness says the registry is
        down while its failures mean so (the registry kind decides which do)."""
        if error is None:
            self.health.set("registry", None)
        elif self.registry.makes_unready(error):
            self.health.set("registry", error.message)

    def _count_registry_error(self, operation: str) -> None:
        self.metrics.registry_errors.labels(operation=operation).inc()


def _load_tenants(path: Path | None) -> Tenants:
    if path is None:
        return NO_TENANTS
    try:
        tenants = Tenants.load(path)
    except ValueError as exc:
        raise ConfigError([f"--tenants {path}: {exc}"]) from None
    log.info("tenants %s: %d tenant prefix(es), %s router token, /stage %s", path,
             len(tenants.tenants), "a" if tenants.router_token_sha256 else "no",
             "needs a token" if tenants.stage_requires_token else "open to callers without one")
    return tenants


def _check_writable(folder: Path) -> str | None:
    # At the cache root, not in .staging/: .staging/ holds downloads only, and a probe
    # caught there by a crash would look like one.
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"the cache root is not writable ({folder}: {exc.strerror or exc})"
    return None


# ---- the process ---------------------------------------------------------------------------


def serve(settings: Settings, lock: CacheLock | None = None) -> int:
    """Run until SIGTERM/SIGINT (with the cache's lock, if the caller took it already).
    Returns the process exit code."""
    configure_logging(settings.log_level, settings.log_format)
    quiet_bad_requests()
    if not is_loopback(settings.host) and settings.api_token is None:
        log.warning("binding to %s without --api-token: anyone who can reach this port can "
                    "evict and pin adapters", settings.host)
    log.info("settings: %s (eviction policy %s)", settings.changes(),
             settings.eviction_policy.value,
             extra=fields(event="settings", settings=settings.describe()))
    if settings.engine_config is not None:
        log.info("the engine's limits, from its model.json: %s",
                 settings.engine_config.describe())
    try:
        return asyncio.run(_run(settings, lock))
    except KeyboardInterrupt:
        return EXIT_OK


async def _run(settings: Settings, lock: CacheLock | None) -> int:
    """Raises ConfigError for settings that cannot work; the caller makes it exit code 2."""
    sidecar = Sidecar(settings, lock=lock)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, stop)
    try:
        await sidecar.start(wait_for_recovery=False)
    except CacheOwned as exc:
        log.error("cannot start: %s", exc.message)
        await sidecar.stop()
        return EXIT_CACHE_OWNED
    except OSError as exc:
        log.error("cannot start: %s", exc.strerror or exc)
        await sidecar.stop()
        return EXIT_FAILED
    # What is built so far lives as long as the process: out of the collector's sight (hit path).
    gc.collect()
    gc.freeze()
    await stop.wait()
    log.info("stopping on signal")
    await sidecar.stop()
    return EXIT_OK


def _on_signal(stop: asyncio.Event) -> None:
    """The first signal stops gracefully; a second exits at once, as uvicorn does (an operator
    who asks twice does not want to wait for downloads and threads to finish)."""
    if not stop.is_set():
        stop.set()
        return
    log.warning("second signal while stopping: exiting at once",
                extra=fields(event="forced_exit"))
    logging.shutdown()
    os._exit(EXIT_FAILED)

