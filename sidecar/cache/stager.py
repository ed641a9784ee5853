"""Single flight: one task per adapter id does list -> fetch -> validate -> publish; every
caller of that id awaits the same task, and leases the adapter once it is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import NamedTuple

from ..core.bytelimit import ByteLimit, Held
from ..core.errors import (
    AdapterNotFound,
    CacheFull,
    CacheUnwritable,
    InvalidAdapter,
    RegistryObjectChanged,
    RegistryTransient,
    SidecarError,
    StageTimeout,
)
from ..core.fsutil import EntryKind, iso_utc, write_synced
from ..core.ids import check_adapter_id
from ..core.logs import fields
from ..core.metrics import Metrics
from ..registry.base import AdapterRegistry, FetchedFile, Listing, RemoteFile
from ..validation.files import (
    CONFIG_FILE,
    SIGNATURE_FILE,
    SIGNATURE_MAX_BYTES,
    WEIGHTS_FILE,
    plan_files,
)
from ..validation.problem import Problem
from ..validation.signatures import (
    SIGNATURE_CODES,
    SignatureVerdict,
    check_digests,
    check_signature,
    published_names,
)
from ..validation.signing_policy import Rule, SignatureMode
from ..validation.validate import (
    CONFIG_MAX_BYTES,
    Rules,
    judge_config,
    listed_size_problems,
    validate_adapter,
)
from ..validation.values import ValueReport, ValueScan, finish_scan
from .admission import Passed, admit_sealed, seal
from .leases import Lease
from .lru import CachedAdapter
from .records import AdapterRecord, FileRecord
from .refusals import Refusals
from .store import AdapterStore, Reservation

log = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3  # downloads of a file whose bytes did not arrive intact, the first included
SETTLE_STEP_S = 0.25  # past the settle time before listing again
SETTLE_LISTINGS_MAX = 30  # an upload that never stops landing is staged as it is then
LISTINGS_MAX = 3  # listings of one stage whose files changed while they were fetched
# Of a caller's deadline, what is kept to answer 507 rather than 504 when room never freed.
ROOM_ANSWER_S = 1.0
# Stages fetching their small files (model.sig, adapter_config.json) into memory to judge them
# before any room is made, at once.
JUDGE_FIRST_MAX = 4
# What those files hold in memory at most, stages judging them and stages waiting for room
# with them included: they are written to disk only once room is reserved.
JUDGED_MAX_BYTES = JUDGE_FIRST_MAX * (CONFIG_MAX_BYTES + SIGNATURE_MAX_BYTES)
# An unsigned adapter listed at most this large, whose room is free without evicting anything,
# has its weights fetched beside its config rather than after it (one round trip less): a
# refusal then costs at most this much transfer, deleted with the stage, and evicts nothing.
BESIDE_MAX_BYTES = 4 * 1024**2
# Without a signature to verify, a config this small is judged on the loop: its parse takes
# tens of microseconds, a worker thread's hand-off and return a few hundred on a busy machine.
JUDGE_ON_LOOP_MAX_BYTES = 16 * 1024


# Each file's fetch, and the weights' value scan: finished (a report) by the validation job.
_Fetched = dict[str, tuple[FetchedFile, ValueScan | ValueReport | None]]
_InMemory = dict[str, tuple[FetchedFile, bytes]]  # files fetched to be judged before room


class _Judged:
    """The verdict on what needs no weights, and the files it read, held in memory until they
    are written into the stage's folder."""

    def __init__(self, verdict: SignatureVerdict, files: _InMemory, held: Held) -> None:
        self.verdict = verdict
        self._files = files
        self._held = held

    def take(self) -> tuple[dict[str, bytes], _Fetched]:
        """The files' bytes, to be written into the stage's folder (this keeps no reference to
        them), and what their fetch found."""
        files = dict(self._files)
        self._files.clear()
        return ({name: data for name, (_, data) in files.items()},
                {name: (fetched, None) for name, (fetched, _) in files.items()})

    async def write_into(self, folder: Path) -> _Fetched:
        """Write the files into `folder` (fsynced) and let go of their bytes."""
        data, fetched = self.take()
        await asyncio.to_thread(_write_all, folder, data)
        self._held.release()
        return fetched


class StageResult(NamedTuple):  # a tuple, not a frozen dataclass: built on every hit
    adapter: CachedAdapter
    lease: Lease | None
    cached: bool  # true when the adapter was on disk already (a hit)


class Stager:
    def __init__(
        self,
        store: AdapterStore,
        registry: AdapterRegistry,
        rules: Rules,
        metrics: Metrics,
        *,
        refusal_ttl_s: float,
        not_found_ttl_s: float,
        upload_settle_s: float,
        on_registry_result: Callable[[SidecarError | None], None] = lambda _: None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._rules = rules
        self._metrics = metrics
        self._upload_settle_s = upload_settle_s
        self._on_registry_result = on_registry_result
        self._inflight: dict[str, asyncio.Task[None]] = {}
        # Verdicts answered again without a fetch until they expire.
        self._refusals = Refusals(metrics, refusal_ttl_s=refusal_ttl_s,
                                  not_found_ttl_s=not_found_ttl_s)
        self._judging_first = asyncio.Semaphore(JUDGE_FIRST_MAX)
        self._judged_bytes = ByteLimit(JUDGED_MAX_BYTES)
        self._skew_logged = False
        self._record = metrics.stage.record  # the counts and durations of stage requests

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
        staged = self.hit(adapter_id, lease=lease)
        if staged is not None:
            return staged
        started = time.perf_counter()
        result = "miss"
        try:
            check_adapter_id(adapter_id)
            return await self._await_stage(adapter_id, timeout_s, lease)
        except BaseException:
            result = "error"
            raise
        finally:
            self._record(result, time.perf_counter() - started)

    def hit(self, adapter_id: str, *, lease: bool = True) -> StageResult | None:
        """The adapter leased (or touched) and counted as a hit when it is cached, without a
        wait; None when it is not (`stage` fetches it)."""
        adapter = self._store.get(adapter_id)
        if adapter is None:
            return None
        started = time.perf_counter()
        result = "error"
        try:
            staged = self._hand_out(adapter, lease, cached=True)
            result = "hit"
            return staged
        finally:
            self._record(result, time.perf_counter() - started)

    async def _await_stage(self, adapter_id: str, timeout_s: float, lease: bool) -> StageResult:
        # A claim keeps the adapter from being evicted between its publication and our lease.
        with self._store.claim(adapter_id):
            while True:
                task = self._inflight.get(adapter_id)
                if task is None:
                    self._refusals.raise_if_remembered(adapter_id)
                    # Room held by others is waited for within this caller's deadline.
                    answer_by = time.monotonic() + timeout_s - ROOM_ANSWER_S
                    task = asyncio.create_task(self._stage_once(adapter_id, answer_by),
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
                adapter = self._store.get(adapter_id)
                if adapter is not None:
                    return self._hand_out(adapter, lease, cached=False)
                # Forcibly evicted right after publication: stage it again.
                log.info("adapter_id=%s was evicted before it could be leased; restaging",
                         adapter_id)

    async def pin(self, adapter_id: str, *, timeout_s: float) -> StageResult:
        """Stage an adapter and pin it: never evicted until unpinned. CacheFull before any
        download when pinned adapters would fill the adapter budget."""
        self._store.check_pin_room(adapter_id)
        result = await self.stage(adapter_id, timeout_s=timeout_s, lease=False)
        self._store.pin(adapter_id)  # no await since the stage returned: it is still cached
        log.info("pinned adapter_id=%s", adapter_id)
        return result

    def _hand_out(self, adapter: CachedAdapter, lease: bool, *, cached: bool) -> StageResult:
        """`adapter`, cached (no await since it was looked up), leased or touched."""
        adapter_id = adapter.adapter_id
        if lease:
            granted: Lease | None = self._store.lease(adapter_id)
        else:
            self._store.touch(adapter_id)
            granted = None
        if cached and log.isEnabledFor(logging.DEBUG):  # no fields built per hit otherwise
            log.debug("hit adapter_id=%s bytes=%d", adapter_id, adapter.size_bytes,
                      extra=fields(event="hit", adapter_id=adapter_id,
                                   size_bytes=adapter.size_bytes))
        return StageResult(adapter, granted, cached)

    def forget(self, adapter_id: str) -> bool:
        """Drop a remembered refusal (and "not found") so the next stage looks afresh; the
        operator's way out after fixing an adapter in place. True if a refusal was dropped."""
        return self._refusals.forget(adapter_id)

    def _refuse(self, adapter_id: str, problems: list[Problem],
                listing: Listing) -> InvalidAdapter:
        return self._refusals.refuse(adapter_id, problems, listing.upload)

    # ---- the one task per adapter -----------------------------------------------------

    async def _stage_once(self, adapter_id: str, answer_by: float) -> None:
        """The adapter staged from a fresh listing; listed again when a file changed in the
        registry while it was fetched (a re-upload landing then), up to LISTINGS_MAX times
        while the first caller's deadline allows: the next listing waits for the upload to
        settle and fetches the new version whole."""
        for listing_number in range(1, LISTINGS_MAX + 1):
            try:
                return await self._stage_listed(adapter_id, answer_by)
            except RegistryObjectChanged as exc:
                if listing_number == LISTINGS_MAX or time.monotonic() >= answer_by:
                    raise
                log.info("adapter_id=%s changed in the registry while it was fetched (%s); "
                         "listing it again", adapter_id, exc.message,
                         extra=fields(event="relist", adapter_id=adapter_id))

    async def _stage_listed(self, adapter_id: str, answer_by: float) -> None:
        """list -> judge -> reserve -> fetch -> validate -> admit. Everything that can refuse
        the adapter without its weights is judged before room is reserved: a refused adapter
        evicts nothing."""
        started = time.perf_counter()
        try:
            listing = await self._settled(adapter_id, await self._list(adapter_id))
            size_bytes = sum(f.size_bytes for f in listing.files)
            self._judge_listed_sizes(adapter_id, listing)
            self._store.fits_budget(adapter_id, size_bytes)
            async with contextlib.AsyncExitStack() as stack:
                free = self._free_room(adapter_id, listing, size_bytes)
                if free is None:
                    judged = await stack.enter_async_context(
                        self._judge_first(adapter_id, listing))
                    staging = await stack.enter_async_context(self._store.staging(adapter_id))
                    await staging.reserve(size_bytes, wait_s=answer_by - time.monotonic())
                    # Written only now, within the room just reserved: the budget holds
                    # throughout; before the weights' fetch, so their memory is free during it.
                    first = await judged.write_into(staging.path)
                    unwritten: dict[str, bytes] = {}
                else:
                    staging = await stack.enter_async_context(
                        self._store.staging(adapter_id, reserved=free))
                    judged, rest = await self._judge_beside(adapter_id, listing, staging.path,
                                                            stack)
                    # Written by the validation's own job (every file is fetched already).
                    unwritten, first = judged.take()
                    first |= rest
                verdict = judged.verdict
                sealed, problems = await self._fetch_and_validate(
                    adapter_id, listing, staging.path, verdict, first, unwritten)
                self._count_signature(verdict, problems)
                if problems:
                    raise self._refuse(adapter_id, problems, listing)
                if sealed is None:
                    raise AssertionError("a folder without problems is sealed as it is judged")
                await admit_sealed(self._store, staging.path, sealed)
            elapsed = time.perf_counter() - started
            self._metrics.download_duration.observe(elapsed)
            log.info("staged adapter_id=%s bytes=%d files=%d in %.2fs (%.1f MiB/s)", adapter_id,
                     size_bytes, len(listing.files), elapsed,
                     size_bytes / 1024**2 / max(elapsed, 1e-6),
                     extra=fields(event="staged", adapter_id=adapter_id, size_bytes=size_bytes,
                                  files=len(listing.files), duration_s=round(elapsed, 3)))
        except SidecarError as exc:
            _log_failure(adapter_id, exc, time.perf_counter() - started)
            raise
        except OSError as exc:
            error = _disk_error(adapter_id, exc)
            _log_failure(adapter_id, error, time.perf_counter() - started)
            raise error from exc

    async def _settled(self, adapter_id: str, listing: Listing) -> Listing:
        """The listing once its newest file has been quiet for --upload-settle: files of one
        upload landing a moment apart are fetched together, never half old and half new.

        A file stamped later than the registry's own clock says (a gateway or replica whose
        clock runs ahead) tells nothing of when it landed: the listing is settled once it
        stays the same for one settle period."""
        if self._upload_settle_s <= 0:
            return listing
        for _ in range(SETTLE_LISTINGS_MAX):
            quiet_s = listing.quiet_s()
            # S3 gives times to the second: an age of exactly the settle time may be less.
            if quiet_s is None or quiet_s > self._upload_settle_s:
                return listing
            if quiet_s < 0:
                self._note_skew(adapter_id, listing, -quiet_s)
                before = listing.upload
                await asyncio.sleep(self._upload_settle_s)  # the period it must stay the same
                listing = await self._list(adapter_id)
                if listing.upload == before:
                    return listing
                continue
            wait_s = self._upload_settle_s - quiet_s + SETTLE_STEP_S
            log.info("adapter_id=%s: a file landed in the registry %.1fs ago; staging once the "
                     "upload has been quiet for %gs", adapter_id, quiet_s,
                     self._upload_settle_s, extra=fields(event="upload_settling",
                                                         adapter_id=adapter_id))
            await asyncio.sleep(min(wait_s, self._upload_settle_s + 1.0))
            listing = await self._list(adapter_id)
        return listing

    def _note_skew(self, adapter_id: str, listing: Listing, ahead_s: float) -> None:
        """Say once (then at DEBUG) that the registry stamps objects ahead of its own clock."""
        newest = max(f.modified for f in listing.files if f.modified is not None)
        level = logging.DEBUG if self._skew_logged else logging.WARNING
        self._skew_logged = True
        log.log(level, "registry clock skew: adapter_id=%s has a file stamped %s, %.1fs after "
                "the registry's own time %s; upload times cannot tell whether it is still "
                "landing, so it is staged once its listing stays the same for %gs "
                "(--upload-settle)", adapter_id, iso_utc(newest), ahead_s,
                iso_utc(listing.listed_at or 0.0), self._upload_settle_s,
                extra=fields(event="registry_clock_skew", adapter_id=adapter_id,
                             ahead_s=round(ahead_s, 3)))

    async def _list(self, adapter_id: str) -> Listing:
        try:
            listing = await self._registry.list_files(adapter_id,
                                                      likely=(CONFIG_FILE, WEIGHTS_FILE))
        except SidecarError as exc:
            self._on_registry_result(exc)
            if isinstance(exc, AdapterNotFound):
                self._refusals.not_found(exc)
            raise
        self._on_registry_result(None)
        # The whole upload as listed: a remembered refusal holds for exactly it.
        listing = dataclasses.replace(listing, upload=listing.signature())
        self._refusals.recall(adapter_id, listing.upload)
        plan = plan_files([(f.name, EntryKind.FILE) for f in listing.files]
                          + [(entry.path, entry.kind) for entry in listing.others])
        if plan.problems:
            raise self._refuse(adapter_id, list(plan.problems), listing)
        if plan.ignored:
            log.info("adapter_id=%s: leaving out %d registry entries the engine never reads "
                     "(never downloaded or published): %s", adapter_id, len(plan.ignored),
                     plan.ignored_text(), extra=fields(event="entries_ignored",
                                                       adapter_id=adapter_id,
                                                       ignored=list(plan.ignored)))
        fetched = set(plan.fetched)
        return dataclasses.replace(listing, files=[f for f in listing.files if f.name in fetched],
                                   others=[])

    def _judge_listed_sizes(self, adapter_id: str, listing: Listing) -> None:
        """Refuse, from the listing alone, a config or (when a signature is checked) a
        model.sig larger than the most ever read of it: neither is fetched."""
        checked = self._rules.signing.rule_for(adapter_id).mode is not SignatureMode.OFF
        problems = listed_size_problems({f.name: f.size_bytes for f in listing.files},
                                        signature_checked=checked)
        if problems:
            if any(p.code in SIGNATURE_CODES for p in problems):
                self._metrics.signature_verifications.labels(outcome="refused").inc()
            raise self._refuse(adapter_id, problems, listing)

    def _free_room(self, adapter_id: str, listing: Listing, size_bytes: int) -> Reservation | None:
        """Room held at once for a small unsigned adapter when it is free without evicting
        anything (its weights are then fetched beside its config); None otherwise."""
        if (size_bytes > BESIDE_MAX_BYTES
                or self._rules.signing.rule_for(adapter_id).mode is not SignatureMode.OFF):
            return None  # a signature is judged before any weights are downloaded
        return self._store.reserve_free(adapter_id, size_bytes)

    async def _judge_beside(self, adapter_id: str, listing: Listing, staging: Path,
                            stack: contextlib.AsyncExitStack) -> tuple[_Judged, _Fetched]:
        """The config judged (`_judge_first`) while the other files are fetched into
        `staging`, whose room is reserved already; on a refusal their fetch is stopped, and
        the stage's exit deletes what it wrote and gives the room back."""
        rest = [f for f in listing.files if f.name != CONFIG_FILE]
        fetching = asyncio.create_task(self._fetch_all(adapter_id, rest, staging))
        try:
            judged = await stack.enter_async_context(self._judge_first(adapter_id, listing))
            return judged, await fetching
        except BaseException:
            fetching.cancel()
            await asyncio.gather(fetching, return_exceptions=True)
            raise

    @contextlib.asynccontextmanager
    async def _judge_first(self, adapter_id: str, listing: Listing) -> AsyncIterator[_Judged]:
        """Judge what needs no weights, before any room is made: the signature under the
        signing policy (the signer, and the files its statement lists against the listing)
        and the adapter config, both fetched first into memory (their listed sizes are capped:
        `_judge_listed_sizes`), so nothing lands on disk before room is reserved. Yields the
        verdict and those files, held in memory (within JUDGED_MAX_BYTES, for every stage)
        until they are written or the block ends."""
        rule = self._rules.signing.rule_for(adapter_id)
        checked = rule.mode is not SignatureMode.OFF
        first = [f for f in listing.files
                 if f.name == CONFIG_FILE or (checked and f.name == SIGNATURE_FILE)]
        async with self._judged_bytes.hold(sum(f.size_bytes for f in first)) as held:
            async with self._judging_first:
                verdict, got = await self._judge_fetched(adapter_id, listing, rule, first)
            yield _Judged(verdict, got, held)

    async def _judge_fetched(self, adapter_id: str, listing: Listing, rule: Rule,
                             first: list[RemoteFile]) -> tuple[SignatureVerdict, _InMemory]:
        got = await self._fetch_intact(adapter_id, first)
        signature, config = got.get(SIGNATURE_FILE), got.get(CONFIG_FILE)
        config_bytes = config[1] if config is not None else None
        judge = functools.partial(
            _judge_in_memory, rule, adapter_id, signature[1] if signature is not None else None,
            published_names([f.name for f in listing.files]), config_bytes, self._rules)
        if signature is None and len(config_bytes or b"") <= JUDGE_ON_LOOP_MAX_BYTES:
            verdict, problems = judge()
        else:
            verdict, problems = await asyncio.to_thread(judge)
        if problems:
            self._count_signature(verdict, problems)
            raise self._refuse(adapter_id, problems, listing)
        return verdict, got

    async def _fetch_intact(self, adapter_id: str, files: list[RemoteFile]) -> _InMemory:
        """Small files fetched into memory until their bytes match the registry's own checksums
        (FETCH_ATTEMPTS downloads in all, then RegistryTransient, which nothing remembers)."""
        got: _InMemory = {}
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            got = await self._fetch_into_memory(adapter_id, files)
            faults = [p for name, (fetched, _) in got.items()
                      for p in _checksum_problems(name, fetched)]
            if not faults:
                return got
            if attempt == FETCH_ATTEMPTS:
                raise RegistryTransient(
                    f"{faults[0].file} of adapter {adapter_id} did not arrive intact in "
                    f"{FETCH_ATTEMPTS} downloads: {faults[0].message}. Nothing is "
                    "remembered: ask again", adapter_id=adapter_id, cause=faults[0].code)
        return got

    async def _fetch_into_memory(self, adapter_id: str, files: list[RemoteFile]) -> _InMemory:
        tasks = [asyncio.create_task(self._registry.fetch_bytes(
            adapter_id, f, self._metrics.download_bytes.inc)) for f in files]
        try:
            return {f.name: (fetched, data) for f, (data, fetched)
                    in zip(files, await asyncio.gather(*tasks), strict=True)}
        except BaseException as exc:
            for task in tasks:  # one file failed: stop the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(exc, SidecarError):
                self._on_registry_result(exc)
            raise

    def _count_signature(self, verdict: SignatureVerdict, problems: list[Problem]) -> None:
        """Count the signature's verdict (the adapter may be refused for other reasons)."""
        if any(p.code in SIGNATURE_CODES for p in problems):
            self._metrics.signature_verifications.labels(outcome="refused").inc()
        elif verdict.outcome is not None:
            self._metrics.signature_verifications.labels(outcome=verdict.outcome).inc()

    async def _fetch_and_validate(
        self, adapter_id: str, listing: Listing, staging: Path, verdict: SignatureVerdict,
        fetched_first: _Fetched, unwritten: dict[str, bytes],
    ) -> tuple[AdapterRecord | None, list[Problem]]:
        """Download every file (but those fetched first), then the verdict on the folder, the
        signature's digests included, and the record of a folder that passed, written and
        sealed (`admission.seal`) by the same worker-thread job.

        Bytes that differ from the registry's own checksum, a file that cannot be read back,
        or a SHA256SUMS mismatch that a second download does not repeat are faults of the
        transfer, not of the adapter: those files are fetched afresh (FETCH_ATTEMPTS in all),
        and if the fault persists the stage fails with RegistryTransient, which nothing
        remembers. The tensor values are checked by the download, in the bytes it reads, and
        what it could not check is read back by the validation's job. `unwritten`: files
        fetched into memory, written (and let go) by that job before it validates.
        """
        files = {f.name: f for f in listing.files}
        got = fetched_first | await self._fetch_all(
            adapter_id, [f for f in listing.files if f.name not in fetched_first], staging)
        crc_before: dict[str, str] = {}  # of files fetched again: the previous download's
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            transfer_faults = [problem for f in listing.files
                               for problem in _checksum_problems(f.name, got[f.name][0])]
            digests = {name: fetched.sha256 for name, (fetched, _) in got.items()
                       if fetched.sha256 is not None}
            signed = list(check_digests(verdict, adapter_id, digests).problems)
            record = None if transfer_faults or signed else self._passed(
                adapter_id, listing, got, verdict).record()
            reports, problems, sealed = await asyncio.to_thread(
                _write_and_validate, staging, dict(unwritten), self._rules, digests,
                {name: scan for name, (_, scan) in got.items() if scan is not None}, record)
            unwritten.clear()  # the caller's reference to their bytes: written now
            got |= {name: (got[name][0], report) for name, report in reports.items()}
            problems += signed
            suspects = _suspect_files(problems, got, crc_before) | {
                p.file for p in transfer_faults}
            if not suspects:
                return sealed, problems
            faults = transfer_faults + [p for p in problems if p.file in suspects
                                        or p.code == "read_error"]
            if attempt == FETCH_ATTEMPTS:
                raise RegistryTransient(
                    f"adapter {adapter_id} did not arrive intact in {FETCH_ATTEMPTS} "
                    f"downloads: {'; '.join(f'{p.file}: {p.message}' for p in faults[:3])}. "
                    "Nothing is remembered: ask again. If it persists, check what lies between "
                    "this node and the registry (a proxy that rewrites bodies), the cache "
                    "volume (read errors in the kernel log) and the stored objects",
                    adapter_id=adapter_id, cause=faults[0].code)
            names = sorted(suspects & files.keys() or files.keys())
            log.warning("adapter_id=%s: %s; downloading %s again (attempt %d of %d)",
                        adapter_id, "; ".join(f"{p.code} {p.file}" for p in faults[:3]),
                        ", ".join(names), attempt + 1, FETCH_ATTEMPTS,
                        extra=fields(event="refetch", adapter_id=adapter_id,
                                     problems=sorted({p.code for p in faults})))
            crc_before = {name: got[name][0].crc32 for name in names}
            await asyncio.to_thread(_unlink_all, [staging / name for name in names])
            got.update(await self._fetch_all(adapter_id, [files[n] for n in names], staging))
        raise AssertionError("FETCH_ATTEMPTS is at least 1")

    def _passed(self, adapter_id: str, listing: Listing, got: _Fetched,
                verdict: SignatureVerdict) -> Passed:
        fetched = [got[f.name][0] for f in listing.files]
        return Passed(
            adapter_id, self._registry.description,
            {f.name: FileRecord(f.size_bytes, f.etag, one.crc32, one.sha256)
             for f, one in zip(listing.files, fetched, strict=True)},
            verdict,
            registry_checksums=any(one.registry_crc32 or one.registry_sha256 for one in fetched))

    async def _fetch_all(
        self, adapter_id: str, files: list[RemoteFile], staging: Path
    ) -> _Fetched:
        """Every file, each hashed (SHA-256) as it lands (in the buffer it arrived in, or once
        from the page cache when a later part landed first): the adapter's content digest, and
        the SHA256SUMS check without a second read."""
        def count(n: int) -> None:
            self._metrics.download_bytes.inc(n)

        tasks = [asyncio.create_task(self._fetch_one(adapter_id, f, staging / f.name, count))
                 for f in files]
        try:
            return {f.name: result
                    for f, result in zip(files, await asyncio.gather(*tasks), strict=True)}
        except BaseException as exc:
            for task in tasks:  # one file failed: stop the others before the folder goes
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(exc, SidecarError):
                self._on_registry_result(exc)
            raise

    async def _fetch_one(
        self, adapter_id: str, file: RemoteFile, dest: Path, count: Callable[[int], None],
    ) -> tuple[FetchedFile, ValueScan | None]:
        """One file; the weights' tensor values are checked in the chunks the download
        reads (what it could not check in flight is read back by the validation's job)."""
        if file.name != WEIGHTS_FILE:
            return await self._registry.fetch(adapter_id, file, dest, count, sha256=True), None
        scan = ValueScan(file.size_bytes)
        fetched = await self._registry.fetch(adapter_id, file, dest, count, inspect=scan,
                                           sha256=True)
        return fetched, scan


def _suspect_files(problems: list[Problem], got: _Fetched,
                   crc_before: dict[str, str]) -> set[str]:
    """Files whose problems may come from the transfer rather than the adapter: unreadable
    ones, and SHA256SUMS or signature mismatches of bytes neither the registry's checksum nor a
    second download with the same CRC-32 vouches for."""
    suspects = set()
    for problem in problems:
        if problem.code == "read_error":
            suspects.add(problem.file)
        elif problem.code in ("checksum_mismatch", "signed_digest_mismatch") and (
                problem.file in got):
            fetched = got[problem.file][0]
            vouched = (fetched.registry_crc32 is not None or fetched.registry_sha256 is not None
                       or crc_before.get(problem.file) == fetched.crc32)
            if not vouched:
                suspects.add(problem.file)
    return suspects


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


def _write_and_validate(
    staging: Path, unwritten: dict[str, bytes], rules: Rules, digests: dict[str, str],
    scans: dict[str, ValueScan | ValueReport], record: AdapterRecord | None,
) -> tuple[dict[str, ValueReport], list[Problem], AdapterRecord | None]:
    """One worker-thread job: files fetched into memory written into the folder, the value
    scans finished (what the download could not check read back), the folder judged, and,
    when it passed and `record` is given (nothing else refused the bytes), the record written
    and the folder sealed."""
    _write_all(staging, unwritten)
    reports = {name: scan if isinstance(scan, ValueReport) else finish_scan(scan, staging / name)
               for name, scan in scans.items()}
    problems = validate_adapter(staging, rules, sha256=digests, scanned=reports)
    sealed = seal(staging, record) if record is not None and not problems else None
    return reports, problems, sealed


def _judge_in_memory(rule: Rule, adapter_id: str, signature: bytes | None,
                     names: set[str], config: bytes | None,
                     rules: Rules) -> tuple[SignatureVerdict, list[Problem]]:
    """The signature's verdict, then (if it refuses nothing) the config's problems: one
    worker-thread job for both."""
    verdict = check_signature(rule, adapter_id, signature, names)
    if verdict.problems:
        return verdict, list(verdict.problems)
    return verdict, [] if config is None else judge_config(config, rules)


def _write_all(folder: Path, files: dict[str, bytes]) -> None:
    """Files fetched into memory, written into the staging folder as a download leaves its
    own: created there, whole, and fsynced."""
    for name, data in files.items():
        write_synced(folder / name, data, os.O_CREAT | os.O_EXCL)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _log_failure(adapter_id: str, error: SidecarError, elapsed_s: float) -> None:
    if isinstance(error, InvalidAdapter):
        return  # logged with its problems when it was refused
    level = logging.INFO if isinstance(error, AdapterNotFound) else logging.WARNING
    log.log(level, "stage failed adapter_id=%s after %.2fs: %s: %s", adapter_id, elapsed_s,
            error.code, error.message,
            extra=fields(event="stage_failed", adapter_id=adapter_id, error=error.code,
                         duration_s=round(elapsed_s, 3)))
    error.logged = True


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
