"""The catalog: the registry's adapter ids rendered to `multi_lora.json` for the vLLM backend,
and the reloads of Triton's vLLM model that make a new catalog take effect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .config import Settings, TritonReload
from .errors import CatalogPending, CatalogReloading, SidecarError
from .metrics import Metrics
from .store import fsync_dir, iso_utc

log = logging.getLogger(__name__)

CATALOG_FILE = "multi_lora.json"
# A vLLM engine can take minutes to load (weights, CUDA graphs); Triton answers the load
# request only once the new instance is ready.
TRITON_LOAD_TIMEOUT_S = 1800.0
RETRY_AFTER_FAILURE_S = 5.0
# An adapter that stages but is not listed yet asks for an early listing, at most this often.
EARLY_LISTING_MIN_INTERVAL_S = 1.0


class IdSource(Protocol):
    async def list_adapter_ids(self) -> list[str]: ...


class ModelControl(Protocol):
    """Triton's model-repository API, as far as the catalog needs it."""

    async def load(self, model: str) -> None: ...
    async def unload(self, model: str) -> None: ...
    async def is_ready(self, model: str) -> bool: ...
    async def close(self) -> None: ...


class TritonControl:
    """ModelControl over Triton's HTTP endpoint (explicit model-control mode)."""

    def __init__(self, url: str, timeout_s: float = TRITON_LOAD_TIMEOUT_S) -> None:
        self._address = url.split("://", 1)[-1].rstrip("/")
        self._ssl = url.startswith("https://")
        self._timeout_s = timeout_s
        self._client: Any = None
        self._last_answer: Any = None

    async def _call(self, method: str, model: str) -> None:
        from tritonclient.http.aio import InferenceServerClient
        from tritonclient.utils import InferenceServerException

        if self._client is None:
            # Built on first use: its aiohttp session belongs to the running loop.
            self._client = InferenceServerClient(self._address, ssl=self._ssl,
                                                 conn_timeout=self._timeout_s)
        try:
            async with asyncio.timeout(self._timeout_s):
                self._last_answer = await getattr(self._client, method)(model)
        except InferenceServerException as exc:
            raise ReloadFailed(f"Triton refused to {method.split('_')[0]} {model}: "
                               f"{exc.message()}") from exc
        except (OSError, TimeoutError) as exc:
            raise ReloadFailed(f"Triton at {self._address} did not answer "
                               f"({type(exc).__name__}: {exc})") from exc
        except Exception as exc:
            # aiohttp's own errors, without importing aiohttp's client here.
            if type(exc).__module__.startswith("aiohttp"):
                raise ReloadFailed(f"Triton at {self._address} unreachable: {exc}") from exc
            raise

    async def load(self, model: str) -> None:
        await self._call("load_model", model)

    async def unload(self, model: str) -> None:
        await self._call("unload_model", model)

    async def is_ready(self, model: str) -> bool:
        """Whether Triton serves the model now; False when Triton cannot be asked."""
        try:
            await self._call("is_model_ready", model)
        except ReloadFailed:
            return False
        return bool(self._last_answer)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class ReloadFailed(Exception):
    """Triton could not be asked, or refused, to (re)load the vLLM model."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One rendered catalog: generation numbers grow by one per change of the id set."""

    number: int
    adapter_ids: frozenset[str]
    rendered_at: float  # unix seconds


class Catalog:
    """Lists the registry, renders multi_lora.json, and keeps Triton's loaded copy current.

    `run()` is the background task; `status()` serves GET /catalog; `check_servable()` tells
    /stage whether Triton can use an adapter yet.
    """

    def __init__(
        self,
        settings: Settings,
        source: IdSource,
        metrics: Metrics,
        *,
        control: ModelControl | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._source = source
        self._metrics = metrics
        self.path = settings.cache_root / CATALOG_FILE
        self._adapters_root = settings.triton_root / "adapters"
        self._control: ModelControl | None = None
        if settings.triton_url is not None:
            self._control = control or TritonControl(settings.triton_url)
        self._reloads = (
            self._control is not None and settings.triton_reload is not TritonReload.NEVER
        )
        self._clock = clock
        self._rendered: Generation | None = None
        self._loaded: Generation | None = None  # what Triton confirmed it serves
        self._reloading = False
        self._last_reload_started: float | None = None  # monotonic
        self._last_reload_failed = False
        self._last_reload_error: str | None = None
        self._last_reload_at: float | None = None  # unix
        self._listed_at: float | None = None  # unix
        self._listed_mono: float | None = None
        self._list_error: str | None = None
        self._confirmed_once = False  # Triton has loaded (or we took over) a catalog of ours
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one listing or reload at a time

    # ---- what /stage and /catalog see --------------------------------------------------

    def check_servable(self, adapter_id: str) -> None:
        """Raise CatalogPending or CatalogReloading unless Triton's loaded catalog lists the id.

        Without a Triton URL (or with reloads off) the sidecar cannot know, so it never refuses.
        """
        if not self._reloads or (self._loaded and adapter_id in self._loaded.adapter_ids):
            return
        model = self._settings.triton_model
        rendered = self._rendered
        if rendered is None or adapter_id not in rendered.adapter_ids:
            self._ask_early_listing()
            raise CatalogPending(
                f"adapter {adapter_id} is not in the catalog yet (the registry was last listed "
                f"{self._age(self._listed_mono)}); it is listed again shortly, then Triton "
                f"reloads {model}",
                adapter_id=adapter_id,
            )
        if self._reloading:
            raise CatalogReloading(
                f"Triton is reloading {model} with catalog generation {rendered.number}, "
                f"which lists adapter {adapter_id}; retry in a moment",
                adapter_id=adapter_id,
            )
        loaded = "none" if self._loaded is None else str(self._loaded.number)
        if self._last_reload_failed:
            why = f"the last reload failed ({self._last_reload_error}); retrying"
        else:
            why = "the reload is waiting for --triton-reload-min-interval"
        raise CatalogPending(
            f"adapter {adapter_id} is in catalog generation {rendered.number} but Triton has "
            f"loaded generation {loaded} of {model}; {why}",
            adapter_id=adapter_id,
        )

    def problem(self) -> str | None:
        """Why the sidecar is not ready on the catalog's account: Triton's vLLM model cannot
        load before multi_lora.json exists."""
        if self._rendered is not None:
            return None
        why = f": {self._list_error}" if self._list_error else ""
        return f"catalog: {self.path.name} not rendered yet (the registry is not listed{why})"

    def status(self) -> dict[str, Any]:
        rendered, loaded = self._rendered, self._loaded
        ids = sorted(rendered.adapter_ids) if rendered else []
        body: dict[str, Any] = {
            "enabled": True,
            "path": str(self.path),
            "generation": rendered.number if rendered else 0,
            "adapter_ids": ids,
            "adapter_count": len(ids),
            "rendered_at": iso_utc(rendered.rendered_at) if rendered else None,
            "listed_at": iso_utc(self._listed_at) if self._listed_at else None,
            "list_error": self._list_error,
        }
        triton: dict[str, Any] = {
            "url": self._settings.triton_url,
            "model": self._settings.triton_model,
            "reload": self._settings.triton_reload.value if self._control else "never",
        }
        if self._reloads:
            loaded_ids = loaded.adapter_ids if loaded else frozenset()
            current = rendered.adapter_ids if rendered else frozenset()
            triton.update({
                "loaded_generation": loaded.number if loaded else None,
                "reloading": self._reloading,
                "pending": {
                    "added": sorted(current - loaded_ids),
                    "removed": sorted(loaded_ids - current),
                } if rendered and rendered != loaded else None,
                "next_reload_in_s": self._next_reload_in_s(),
                "last_reload_at": iso_utc(self._last_reload_at) if self._last_reload_at else None,
                "last_reload_error": self._last_reload_error,
            })
        body["triton"] = triton
        return body

    # ---- the background task -----------------------------------------------------------

    async def run(self) -> None:
        """Sync every --catalog-refresh seconds (sooner when asked) until cancelled; registry
        and Triton errors are recorded in status(), never raised."""
        while True:
            try:
                listed = await self.sync()
            except Exception:
                log.exception("catalog: sync failed")
                listed = False
            wait_s = self._settings.catalog_refresh_s
            if not listed:
                wait_s = min(wait_s, RETRY_AFTER_FAILURE_S)
            due_s = self._next_reload_in_s()
            if due_s is not None:
                wait_s = min(wait_s, due_s)
            try:
                async with asyncio.timeout(max(wait_s, 0.0)):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def sync(self) -> bool:
        """List the registry, render the catalog if the id set changed, and reload Triton's
        model if that is due. Returns False if the listing failed."""
        async with self._lock:
            listed = await self._refresh()
            if self._reloads:
                await self._notice_lost_model()
                await self._reload_if_due()
            return listed

    async def _refresh(self) -> bool:
        try:
            adapter_ids = frozenset(await self._source.list_adapter_ids())
        except SidecarError as exc:
            if self._list_error != exc.message:
                log.warning("catalog: cannot list the registry: %s", exc.message)
            self._list_error = exc.message
            return False
        self._listed_at, self._listed_mono = time.time(), self._clock()
        self._list_error = None
        if self._rendered is None or adapter_ids != self._rendered.adapter_ids:
            await self._render(adapter_ids)
        return True

    async def _reload_if_due(self) -> None:
        """Ask Triton to load the rendered generation, unless it has or the rate limit holds."""
        due_s = self._next_reload_in_s()
        if due_s is None or due_s > 0 or self._control is None or self._rendered is None:
            return
        target = self._rendered
        model = self._settings.triton_model
        mode = self._settings.triton_reload
        if await self._adopt_loaded(target):
            return
        self._reloading = True
        self._last_reload_started = self._clock()
        started = time.monotonic()
        log.info("catalog: reloading %s for generation %d (%d adapters, mode %s)",
                 model, target.number, len(target.adapter_ids), mode.value)
        try:
            if mode is TritonReload.UNLOAD_FIRST:
                # Nothing is servable until the new engine is up; /stage says so meanwhile.
                self._loaded = None
                await self._control.unload(model)
            await self._control.load(model)
        except ReloadFailed as exc:
            self._last_reload_failed = True
            self._last_reload_error = str(exc)
            if mode is TritonReload.ON_CHANGE:
                # The new engine loads beside the old one; on one GPU with vLLM's
                # gpu_memory_utilization above about half, it cannot fit.
                self._last_reload_error += (" (on-change needs GPU memory for two engines at "
                                            "once; --triton-reload unload-first needs one)")
            self._metrics.triton_reloads.labels(outcome="error").inc()
            log.warning("catalog: reload of %s failed: %s", model, self._last_reload_error)
        else:
            self._confirmed(target)
            self._metrics.triton_reloads.labels(outcome="ok").inc()
            log.info("catalog: %s serves generation %d (reload took %.1fs)",
                     model, target.number, time.monotonic() - started)
        finally:
            self._reloading = False

    async def _adopt_loaded(self, target: Generation) -> bool:
        """Until this process has seen Triton load a catalog, take over a model Triton already
        serves instead of unloading it (a sidecar restart; compose, where Triton loads the
        model itself once the sidecar has rendered the catalog).

        A plain load is a no-op in Triton when nothing in the model folder changed since it
        loaded, so it confirms the catalog without restarting the engine. If the catalog did
        change, the plain load reloads in place; where two engines do not fit that load fails,
        the old engine stays, and the configured mode takes over at once.
        """
        if self._control is None or self._confirmed_once:
            return False
        if not await self._control.is_ready(self._settings.triton_model):
            return False
        try:
            await self._control.load(self._settings.triton_model)
        except ReloadFailed as exc:
            log.info("catalog: could not take over the loaded %s (%s); reloading",
                     self._settings.triton_model, exc)
            return False
        self._confirmed(target)
        log.info("catalog: %s serves generation %d; taken over without a reload",
                 self._settings.triton_model, target.number)
        return True

    def _confirmed(self, target: Generation) -> None:
        self._loaded = target
        self._confirmed_once = True
        self._last_reload_failed = False
        self._last_reload_error = None
        self._last_reload_at = time.time()

    async def _notice_lost_model(self) -> None:
        """A Triton restarted without the vLLM model (or that unloaded it) needs a load."""
        if self._control is None or not self._reloads or self._loaded is None:
            return
        if self._reloading or await self._control.is_ready(self._settings.triton_model):
            return
        log.warning("catalog: Triton no longer serves %s (restarted?); loading it again",
                    self._settings.triton_model)
        self._loaded = None
        self._last_reload_started = None  # due now, not after the minimum interval

    async def close(self) -> None:
        if self._control is not None:
            await self._control.close()

    # ---- helpers ------------------------------------------------------------------------

    def _next_reload_in_s(self) -> float | None:
        """Seconds until a reload may start; None when Triton already has the rendered one."""
        if not self._reloads or self._rendered is None or self._rendered == self._loaded:
            return None
        if self._reloading:
            return None
        last = self._last_reload_started
        if last is None:
            return 0.0
        gap_s = self._settings.triton_reload_min_interval_s
        if self._last_reload_failed:
            gap_s = max(gap_s, RETRY_AFTER_FAILURE_S)
        return max(last + gap_s - self._clock(), 0.0)

    def _ask_early_listing(self) -> None:
        listed = self._listed_mono
        if listed is None or self._clock() - listed >= EARLY_LISTING_MIN_INTERVAL_S:
            self._wake.set()

    def _age(self, since: float | None) -> str:
        return "never" if since is None else f"{self._clock() - since:.0f} s ago"

    async def _render(self, adapter_ids: frozenset[str]) -> None:
        catalog = {
            adapter_id: str(self._adapters_root / adapter_id) for adapter_id in sorted(adapter_ids)
        }
        text = json.dumps(catalog, indent=2) + "\n"
        written = await asyncio.to_thread(_write_if_changed, self.path, text)
        number = self._rendered.number + 1 if self._rendered else 1
        self._rendered = Generation(number, adapter_ids, time.time())
        self._metrics.catalog_adapters.set(len(adapter_ids))
        log.info("catalog: generation %d lists %d adapters (%s)", number, len(adapter_ids),
                 "rendered" if written else "file already current")


def _write_if_changed(path: Path, text: str) -> bool:
    """Atomically replace `path` with `text`, unless it already holds exactly that.

    Leaving an identical file alone keeps its mtime, so Triton (which reloads a model only if
    a file in its folder changed) does not restart the engine for nothing.
    """
    data = text.encode("utf-8")
    # A process killed mid-write leaves its temporary file behind; no writer runs now.
    for leftover in path.parent.glob(f".{path.name}.*"):
        leftover.unlink(missing_ok=True)
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        with temporary.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True
