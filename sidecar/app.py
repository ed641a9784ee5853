"""Wiring: builds the objects, owns their lifetimes and every background task, and shuts
them down in order (HTTP first, storage client last).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from .api import Services, build_web_app
from .catalog import Catalog
from .config import Settings, is_loopback
from .errors import SidecarError, SourceUnavailable
from .localsource import LocalSource
from .logs import configure_logging
from .metrics import Metrics
from .source import AdapterSource, S3Source
from .stager import Stager
from .store import AdapterRecord, AdapterStore, remove_tree
from .transfer import TransferPolicy, transfer_executor
from .validate import Rules, validate_adapter
from .watcher import Watcher

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
REGISTRY_PROBE_OK_S = 15.0
PIN_RETRY_S = (1.0, 30.0)  # first and largest delay between attempts to stage a pin
SHUTDOWN_GRACE_S = 10.0


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

    def problems(self) -> list[str]:
        return [f"{name}: {problem}" for name, problem in sorted(self._problems.items())]


class Sidecar:
    """The running daemon. `await start()`, then `await stop()`; tests use it in-process."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(registry)
        self.health = Health()
        self.rules = Rules.from_settings(settings)
        self.store = AdapterStore(
            settings.cache_root,
            max_bytes=settings.max_bytes,
            max_adapters=settings.max_adapters,
            min_free_bytes=settings.min_free_bytes,
            lease_ttl_s=settings.lease_ttl_s,
            max_leases=settings.max_leases,
            metrics=self.metrics,
        )
        self.metrics.watch_store(self.store)
        policy = TransferPolicy(
            part_size_bytes=settings.part_size_bytes,
            attempts=settings.s3_max_attempts,
            limiter=asyncio.Semaphore(settings.download_concurrency),
            concurrency=settings.download_concurrency,
            executor=transfer_executor(settings.download_concurrency),
        )
        self._transfer_executor = policy.executor
        self.source: AdapterSource
        if settings.is_s3:
            self.source = S3Source(settings, policy, self._count_registry_error)
        else:
            self.source = LocalSource(Path(settings.registry), policy)
        self.stager = Stager(
            self.store,
            self.source,
            self.rules,
            self.metrics,
            refusal_ttl_s=settings.refusal_ttl_s,
            on_trash=self.purge_trash,
            on_source_result=self._note_source_result,
        )
        self.catalog = Catalog(settings, self.store, self.rules, self.metrics)
        self.store.before_evict = self.catalog.names.before_evict
        self.store.after_forget = self.catalog.names.after_forget
        self.watcher = Watcher(self.store, self.rules, self.metrics, on_trash=self.purge_trash)
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._pins_pending = set(settings.pin)
        self.port = settings.port

    # ---- lifetime ----------------------------------------------------------------------

    async def start(self) -> None:
        await self._recover()
        await self.catalog.start()  # after recovery: a generation lists what is on disk
        await self.watcher.start()
        self._spawn(self.watcher.run(), "watcher")
        if isinstance(self.source, S3Source):
            await self.source.open()
        services = Services(
            settings=self.settings, store=self.store, stager=self.stager, metrics=self.metrics,
            readiness=self, purge_trash=self.purge_trash, catalog=self.catalog,
        )
        app = build_web_app(services)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=False,  # a client hanging up must not cancel a shared stage
            shutdown_timeout=SHUTDOWN_GRACE_S,
            max_line_size=8190,  # bounded request line and headers
            max_field_size=8190,
            max_headers=64,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port,
                           backlog=1024, reuse_address=True)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._spawn(self._expire_leases_loop(), "leases")
        self._spawn(self._health_loop(), "health")
        self._spawn(self.catalog.run(), "catalog")
        for adapter_id in self.settings.pin:
            self._spawn(self._stage_pin(adapter_id), f"pin:{adapter_id}")
        log.info("lora-sidecar listening on http://%s:%d registry=%s cache_root=%s",
                 self.settings.host, self.port, self.source.description,
                 self.settings.cache_root)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # stop accepting HTTP first
            self._runner = None
        await self.watcher.stop()
        for task in list(self._tasks):
            task.cancel("sidecar shutting down")
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=SHUTDOWN_GRACE_S)
        await self.stager.close()
        await self.catalog.close()
        await self.source.close()
        if self._transfer_executor is not None:
            # Every download has waited for its threads; none is left running here.
            self._transfer_executor.shutdown(wait=False, cancel_futures=True)
        log.info("lora-sidecar stopped")

    @property
    def url(self) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def problems(self) -> list[str]:
        pending = sorted(self._pins_pending)
        problems = self.health.problems()
        if pending:
            problems.append(f"pinned adapters not staged yet: {', '.join(pending)}")
        catalog_problem = self.catalog.problem()
        if catalog_problem is not None:
            problems.append(catalog_problem)
        return problems

    # ---- start-up recovery -------------------------------------------------------------

    async def _recover(self) -> None:
        store = self.store
        try:
            await asyncio.to_thread(store.prepare)
        except OSError as exc:
            self.health.set("cache", f"cannot prepare the cache root {store.root}: "
                            f"{exc.strerror or exc}")
            if not store.adapters_dir.is_dir():
                return

        def check(folder: Path, record: AdapterRecord) -> list[str]:
            digests = {name: f.sha256 for name, f in record.files.items() if f.sha256}
            return [f"{p.code} {p.file}: {p.message}"
                    for p in validate_adapter(folder, self.rules, sha256=digests)]

        try:
            records, report = await asyncio.to_thread(store.scan, check)
        except OSError as exc:
            self.health.set("cache", f"cannot read {store.adapters_dir}: {exc.strerror or exc}")
            return
        for adapter_id in self.settings.pin:
            store.pin(adapter_id)
        store.install(records)
        for adapter_id in self.settings.pin:
            if store.get(adapter_id) is not None:
                self._pins_pending.discard(adapter_id)
        evicted = store.trim()
        if evicted:
            self.purge_trash()
        log.info("recovered cache: adopted=%d quarantined=%d evicted_to_budget=%d bytes=%d",
                 len(report.adopted), len(report.quarantined), len(evicted), store.total_bytes)

    # ---- background work ---------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def purge_trash(self) -> None:
        """Delete evicted folders off the loop; the rename already hid them from readers."""
        for folder in self.store.take_trash():
            self._spawn(asyncio.to_thread(remove_tree, folder), f"purge:{folder.name}")

    async def _expire_leases_loop(self) -> None:
        while True:
            try:
                expired = self.store.expire_leases()
                if expired and self.store.trim():
                    self.purge_trash()
            except Exception:
                log.exception("lease expiry failed")
            next_expiry = self.store.next_lease_expiry()
            delay = 1.0 if next_expiry is None else next_expiry - time.time()
            await asyncio.sleep(min(1.0, max(0.05, delay)))

    async def _health_loop(self) -> None:
        last_probe = 0.0
        while True:
            try:
                problem = await asyncio.to_thread(_check_writable, self.store.root)
                self.health.set("cache", problem)
                registry_down = "registry" in {p.split(":")[0] for p in self.health.problems()}
                interval = HEALTH_INTERVAL_S if registry_down else REGISTRY_PROBE_OK_S
                if time.monotonic() - last_probe >= interval:
                    last_probe = time.monotonic()
                    try:
                        await self.source.probe()
                        self._note_source_result(None)
                    except SidecarError as exc:
                        self._note_source_result(exc)
            except Exception:
                log.exception("health check failed")
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _stage_pin(self, adapter_id: str) -> None:
        delay = PIN_RETRY_S[0]
        while True:
            try:
                await self.stager.stage(adapter_id, timeout_s=self.settings.stage_timeout_s,
                                        lease=False)
            except SidecarError as exc:
                self.health.set(f"pin {adapter_id}", f"{exc.code}: {exc.message}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, PIN_RETRY_S[1])
                continue
            self.health.set(f"pin {adapter_id}", None)
            self._pins_pending.discard(adapter_id)
            log.info("pinned adapter staged adapter_id=%s", adapter_id)
            return

    def _note_source_result(self, error: SidecarError | None) -> None:
        if error is None:
            self.health.set("registry", None)
        elif isinstance(error, SourceUnavailable) or getattr(error, "cause", "") in (
            "credentials", "permission", "bucket",
        ):
            self.health.set("registry", error.message)

    def _count_registry_error(self, operation: str) -> None:
        self.metrics.registry_errors.labels(operation=operation).inc()


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


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code."""
    configure_logging(settings.log_level, settings.log_format)
    if not is_loopback(settings.host) and settings.api_token is None:
        log.warning("binding to %s without --api-token: anyone who can reach this port can "
                    "evict and pin adapters", settings.host)
    log.info("settings: %s", settings.describe())
    try:
        return asyncio.run(_run(settings))
    except KeyboardInterrupt:
        return 0


async def _run(settings: Settings) -> int:
    sidecar = Sidecar(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await sidecar.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await sidecar.stop()
        return 1
    # Everything built so far (modules, botocore's service models) lives as long as the
    # process: out of the collector's sight, a full collection stops costing a pause that
    # showed in the hit path's tail latency.
    gc.collect()
    gc.freeze()
    await stop.wait()
    log.info("stopping on signal")
    await sidecar.stop()
    return 0
