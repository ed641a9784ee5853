"""Single flight: one task per adapter id does list -> fetch -> validate -> publish; every
caller of that id awaits the same task, and leases the adapter once it is published.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import is_valid_adapter_id
from .errors import (
    AdapterNotFound,
    CacheFull,
    CacheUnwritable,
    InvalidAdapter,
    InvalidAdapterId,
    NotCached,
    SidecarError,
    StageTimeout,
)
from .logs import fields
from .metrics import Metrics
from .source import AdapterSource, FetchedFile, Listing
from .store import (
    RECORD_NAME,
    AdapterRecord,
    AdapterStore,
    CachedAdapter,
    FileRecord,
    Lease,
    fsync_dir,
    remove_tree,
    write_record,
)
from .validate import Problem, Rules, check_file_name, validate_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StageResult:
    adapter: CachedAdapter
    lease: Lease | None
    cached: bool  # true when the adapter was on disk already (a hit)


def check_adapter_id(adapter_id: object) -> str:
    if not is_valid_adapter_id(adapter_id):
        shown = repr(adapter_id)[:80]
        raise InvalidAdapterId(
            f"invalid adapter id {shown}: ids are 1-128 characters of letters, digits, '.', "
            "'_' and '-', starting with a letter or digit"
        )
    assert isinstance(adapter_id, str)
    return adapter_id


class Stager:
    def __init__(
        self,
        store: AdapterStore,
        source: AdapterSource,
        rules: Rules,
        metrics: Metrics,
        *,
        refusal_ttl_s: float,
        on_trash: Callable[[], None],
        on_source_result: Callable[[SidecarError | None], None] = lambda _: None,
    ) -> None:
        self._store = store
        self._source = source
        self._rules = rules
        self._metrics = metrics
        self._refusal_ttl_s = refusal_ttl_s
        self._on_trash = on_trash
        self._on_source_result = on_source_result
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._refused: dict[str, tuple[float, InvalidAdapter]] = {}
        # Children bound once: a labels() lookup per request shows on the hit path.
        results = ("hit", "miss", "error")
        self._requests = {r: metrics.stage_requests.labels(result=r) for r in results}
        self._durations = {r: metrics.stage_duration.labels(result=r) for r in results}

    @property
    def inflight(self) -> list[str]:
        return sorted(self._inflight)

    async def close(self) -> None:
        """Cancel downloads in progress; their `finally` blocks delete the staging folders."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel("sidecar shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stage(self, adapter_id: str, *, timeout_s: float, lease: bool = True) -> StageResult:
        """Return the published adapter, leased; download it first if it is not cached."""
        started = time.perf_counter()
        result = "error"
        try:
            check_adapter_id(adapter_id)
            if self._store.get(adapter_id) is not None:
                result = "hit"
                return self._hand_out(adapter_id, lease, cached=True)
            result = "miss"
            staged = await self._await_stage(adapter_id, timeout_s, lease)
            return staged
        except BaseException:
            result = "error"
            raise
        finally:
            self._requests[result].inc()
            self._durations[result].observe(
                time.perf_counter() - started
            )

    async def _await_stage(self, adapter_id: str, timeout_s: float, lease: bool) -> StageResult:
        # A claim keeps the adapter from being evicted between its publication and our lease.
        self._store.claim(adapter_id)
        try:
            while True:
                task = self._inflight.get(adapter_id)
                if task is None:
                    self._raise_if_refused(adapter_id)
                    task = asyncio.create_task(self._stage_once(adapter_id),
                                               name=f"stage:{adapter_id}")
                    self._inflight[adapter_id] = task
                    task.add_done_callback(lambda _: self._inflight.pop(adapter_id, None))
                try:
                    async with asyncio.timeout(timeout_s) as deadline:
                        await asyncio.shield(task)
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    raise StageTimeout(
                        f"adapter {adapter_id} was not staged within {timeout_s:g}s; the "
                        "download goes on, ask again later",
                        adapter_id=adapter_id,
                    ) from None
                if self._store.get(adapter_id) is not None:
                    return self._hand_out(adapter_id, lease, cached=False)
                # Forcibly evicted right after publication: stage it again.
                log.info("adapter_id=%s was evicted before it could be leased; restaging",
                         adapter_id)
        finally:
            self._store.unclaim(adapter_id)

    def _hand_out(self, adapter_id: str, lease: bool, *, cached: bool) -> StageResult:
        if lease:
            granted: Lease | None = self._store.lease(adapter_id)
        else:
            self._store.touch(adapter_id)
            granted = None
        adapter = self._store.get(adapter_id)
        if adapter is None:  # cannot happen: both calls above are synchronous
            raise NotCached(f"adapter {adapter_id} vanished", adapter_id=adapter_id)
        if cached:
            log.debug("hit adapter_id=%s bytes=%d", adapter_id, adapter.size_bytes,
                      extra=fields(event="hit", adapter_id=adapter_id,
                                   size_bytes=adapter.size_bytes))
        return StageResult(adapter, granted, cached)

    def _raise_if_refused(self, adapter_id: str) -> None:
        refused = self._refused.get(adapter_id)
        if refused is None:
            return
        expires_at, error = refused
        if time.monotonic() < expires_at:
            raise error
        del self._refused[adapter_id]

    def _refuse(self, adapter_id: str, problems: list[Problem]) -> InvalidAdapter:
        error = InvalidAdapter(adapter_id, [p.to_json() for p in problems])
        for code in sorted({p.code for p in problems}):
            self._metrics.validation_failures.labels(reason=code).inc()
        if self._refusal_ttl_s > 0:
            self._refused[adapter_id] = (time.monotonic() + self._refusal_ttl_s, error)
        log.warning("refused adapter_id=%s problems=%d: %s", adapter_id, len(problems),
                    "; ".join(f"{p.code} {p.file}" for p in problems),
                    extra=fields(event="refused", adapter_id=adapter_id,
                                 problems=sorted({p.code for p in problems})))
        return error

    # ---- the one task per adapter -----------------------------------------------------

    async def _stage_once(self, adapter_id: str) -> None:
        self._metrics.inflight_downloads.inc()
        started = time.perf_counter()
        staging: Path | None = None
        reservation = None
        try:
            listing = await self._list(adapter_id)
            size_bytes = sum(f.size_bytes for f in listing.files)
            reservation = self._store.reserve(adapter_id, size_bytes)
            # Room made by evicting is on disk only once the evicted folders are deleted.
            trash = self._store.take_trash()
            if trash:
                await asyncio.to_thread(_remove_all, trash)
            staging = await asyncio.to_thread(self._store.new_staging_dir, adapter_id)
            fetched = await self._fetch_all(adapter_id, listing, staging)
            problems = [
                problem for f, got in zip(listing.files, fetched, strict=True)
                for problem in _checksum_problems(f.name, got)
            ]
            digests = {f.name: got.sha256 for f, got in zip(listing.files, fetched, strict=True)
                       if got.sha256 is not None}
            problems += await asyncio.to_thread(
                validate_adapter, staging, self._rules, sha256=digests
            )
            if problems:
                raise self._refuse(adapter_id, problems)
            record = AdapterRecord(
                adapter_id=adapter_id,
                source=self._source.description,
                staged_at=time.time(),
                files={
                    f.name: FileRecord(f.size_bytes, f.etag, got.crc32, got.sha256)
                    for f, got in zip(listing.files, fetched, strict=True)
                },
            )
            await asyncio.to_thread(_seal, staging, record)
            self._store.publish(staging, record)
            staging = None
            elapsed = time.perf_counter() - started
            self._metrics.download_duration.observe(elapsed)
            log.info("staged adapter_id=%s bytes=%d files=%d in %.2fs (%.1f MiB/s)", adapter_id,
                     size_bytes, len(listing.files), elapsed,
                     size_bytes / 1024**2 / max(elapsed, 1e-6),
                     extra=fields(event="staged", adapter_id=adapter_id, size_bytes=size_bytes,
                                  files=len(listing.files), duration_s=round(elapsed, 3)))
            # Trimmed in the same loop step as the publication, never after an await: no
            # request may see the cache over budget with an adapter nothing protects.
            if self._store.trim():
                self._on_trash()
            await asyncio.to_thread(fsync_dir, self._store.adapters_dir)
        except SidecarError as exc:
            _log_failure(adapter_id, exc, time.perf_counter() - started)
            raise
        except OSError as exc:
            error = _disk_error(adapter_id, exc)
            _log_failure(adapter_id, error, time.perf_counter() - started)
            raise error from exc
        finally:
            self._metrics.inflight_downloads.dec()
            if reservation is not None:
                self._store.unreserve(reservation)
            if staging is not None:
                await asyncio.to_thread(remove_tree, staging)

    async def _list(self, adapter_id: str) -> Listing:
        try:
            listing = await self._source.list_files(adapter_id)
        except SidecarError as exc:
            self._on_source_result(exc)
            raise
        self._on_source_result(None)
        problems = [
            Problem("unsafe_path", name, f"registry entry {name!r} would leave the adapter "
                    "folder (nested folder, '..', absolute path, backslash or link)")
            for name in listing.unsafe_names
        ]
        problems += [p for f in listing.files if (p := check_file_name(f.name)) is not None]
        if any(f.name == RECORD_NAME for f in listing.files):
            # A record copied back into the registry describes some other cache; ours is
            # written after validation and is the only one a published folder may carry.
            log.info("ignoring %s in the registry for adapter_id=%s", RECORD_NAME, adapter_id)
            listing = Listing([f for f in listing.files if f.name != RECORD_NAME],
                              listing.unsafe_names)
        if problems:
            raise self._refuse(adapter_id, problems)
        return listing

    async def _fetch_all(
        self, adapter_id: str, listing: Listing, staging: Path
    ) -> list[FetchedFile]:
        def count(n: int) -> None:
            self._metrics.download_bytes.inc(n)

        tasks = [
            asyncio.create_task(self._source.fetch(adapter_id, f, staging / f.name, count))
            for f in listing.files
        ]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException as exc:
            for task in tasks:  # one file failed: stop the others before the folder goes
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(exc, SidecarError):
                self._on_source_result(exc)
            raise


def _checksum_problems(name: str, got: FetchedFile) -> list[Problem]:
    """The downloaded bytes against the registry's own full-object checksums."""
    pairs = (("CRC-32", got.crc32, got.registry_crc32),
             ("SHA-256", got.sha256, got.registry_sha256))
    return [
        Problem("checksum_mismatch", name, f"{algorithm} of the downloaded bytes is {ours}, "
                f"the registry says {theirs}")
        for algorithm, ours, theirs in pairs
        if theirs is not None and ours != theirs
    ]


def _remove_all(folders: list[Path]) -> None:
    for folder in folders:
        remove_tree(folder)


def _seal(staging: Path, record: AdapterRecord) -> None:
    write_record(staging, record)
    fsync_dir(staging)


def _log_failure(adapter_id: str, error: SidecarError, elapsed_s: float) -> None:
    if isinstance(error, InvalidAdapter):
        return  # logged with its problems when it was refused
    level = logging.INFO if isinstance(error, AdapterNotFound) else logging.WARNING
    log.log(level, "stage failed adapter_id=%s after %.2fs: %s: %s", adapter_id, elapsed_s,
            error.code, error.message,
            extra=fields(event="stage_failed", adapter_id=adapter_id, error=error.code,
                         duration_s=round(elapsed_s, 3)))


def _disk_error(adapter_id: str, exc: OSError) -> SidecarError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheFull(
            f"the cache filesystem ran out of space while staging {adapter_id}; nothing was "
            "published. Free disk space or lower --max-bytes",
            adapter_id=adapter_id,
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return CacheUnwritable(
            f"the cache volume refused a write while staging {adapter_id}: {exc.strerror}",
            adapter_id=adapter_id,
        )
    return CacheUnwritable(
        f"disk error while staging {adapter_id}: {exc.strerror or exc}", adapter_id=adapter_id
    )
