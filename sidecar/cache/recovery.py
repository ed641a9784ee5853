"""Start-up recovery: re-index the cache's published folders and take back the lease journal
(the store trims to its budget as it installs them), one folder at a time in threads while the
port already answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..core.filehash import hash_file
from ..core.logs import fields
from ..core.metrics import Metrics
from ..validation.signatures import SignatureVerdict, verify_folder
from ..validation.signing_policy import SignatureMode
from ..validation.validate import Rules, validate_adapter
from .admission import signature_rechecked
from .lease_journal import JournalLease, LeaseJournal
from .records import AdapterRecord, Check, add_verified, rewrite_record
from .store import AdapterStore

log = logging.getLogger(__name__)


async def recover(
    store: AdapterStore,
    rules: Rules,
    *,
    max_leases: int,
    lease_ttl_s: float,
    on_problem: Callable[[str], None],
    on_progress: Callable[[int, int], None],
    metrics: Metrics | None = None,
) -> None:
    """Re-index the cache. Costs a stat per file and the headers per adapter, whatever the
    adapters' bytes (and model.sig where the signing policy's rule for an id changed). `on_problem`
    hears why the cache cannot be used (readiness)."""
    started = time.perf_counter()
    try:
        await asyncio.to_thread(store.prepare)
    except OSError as exc:
        on_problem(f"cannot prepare the cache root {store.root}: {exc.strerror or exc}")
        if not store.adapters_dir.is_dir():
            return
    journal = LeaseJournal(store.lease_journal_path, max_leases=max_leases)
    leases = await _read_journal(journal, lease_ttl_s)
    try:
        folders = await asyncio.to_thread(store.published_folders)
    except OSError as exc:
        on_problem(f"cannot read {store.adapters_dir}: {exc.strerror or exc}")
        return
    on_progress(0, len(folders))
    log.info("recovering the cache: %d adapter folders, %d leases in the journal",
             len(folders), len(leases))

    rewritten: dict[str, AdapterRecord] = {}  # records a check brought up to date

    def check(folder: Path, record: AdapterRecord) -> list[str]:
        # The rules may have changed since publication: re-checked from the config and
        # the safetensors header. The bytes are vouched for by the record (no hashing);
        # their values are read once for a record of a version that did not check them.
        scan = Check.VALUES not in record.verified
        problems = [f"{p.code} {p.file}: {p.message}"
                    for p in validate_adapter(folder, rules, checksums=False,
                                              scan_values=scan)]
        if problems:
            return problems
        if scan:
            record = rewritten[folder.name] = add_verified(folder, record, Check.VALUES)
        verdict = _signature_changed(folder, record, rules)
        if verdict is None:
            return []
        if metrics is not None and verdict.outcome is not None:
            metrics.signature_verifications.labels(outcome=verdict.outcome).inc()
        if verdict.problems:
            return [f"{p.code} {p.file}: {p.message}" for p in verdict.problems]
        rewritten[folder.name] = rewrite_record(folder, signature_rechecked(record, verdict))
        return []

    records, quarantined = [], 0
    for checked, folder in enumerate(folders, start=1):
        try:
            record = await asyncio.to_thread(store.recover_folder, folder, check)
            records.append(rewritten.pop(folder.name, record))
        except ValueError:
            quarantined += 1  # logged by the quarantine
        except OSError as exc:
            quarantined += 1
            log.warning("cannot quarantine adapter folder %s: %s", folder.name,
                        exc.strerror or exc)
        on_progress(checked, len(folders))
    installed = store.install(records, leases=leases, lease_journal=journal)
    try:
        # Nothing can lease yet (the API waits for recovery), so off the loop is safe.
        await asyncio.to_thread(journal.reset, store.live_leases())
    except OSError as exc:
        journal.failed = True
        log.warning("cannot write the lease journal %s (%s): leases will not survive a "
                    "restart", journal.path, exc.strerror or exc)
    elapsed_s = time.perf_counter() - started
    log.info("recovered cache in %.2fs: adopted=%d quarantined=%d leases=%d "
             "evicted_to_budget=%d bytes=%d", elapsed_s, len(records), quarantined,
             installed.restored_leases, installed.evicted, store.total_bytes,
             extra=fields(event="recovered", adapters=len(records), quarantined=quarantined,
                          leases=installed.restored_leases, duration_s=round(elapsed_s, 3)))


def _signature_changed(folder: Path, record: AdapterRecord,
                       rules: Rules) -> SignatureVerdict | None:
    """The signing policy's verdict on a published folder whose rule is not the one that
    judged it (a policy added or changed since): model.sig is verified again and its digests
    compared with the record's, so no weights are read (files of records older than per-file
    SHA-256s excepted). None when the record's verdict still holds."""
    rule = rules.signing.rule_for(record.adapter_id)
    if rule.mode is SignatureMode.OFF:
        return None  # what the record says of a signature stays true, and nothing is required
    if record.signature is not None and record.signature.policy == rule.fingerprint:
        return None
    digests = {name: f.sha256 or hash_file(folder / name).sha256
               for name, f in record.files.items()}
    verdict = verify_folder(folder, record.adapter_id, rule, digests)
    log.info("adapter_id=%s: the signing policy's rule changed since it was published; "
             "signature checked again: %s", record.adapter_id, verdict.outcome,
             extra=fields(event="signature_rechecked", adapter_id=record.adapter_id,
                          outcome=verdict.outcome))
    return verdict


async def _read_journal(journal: LeaseJournal, lease_ttl_s: float) -> list[JournalLease]:
    try:
        return await asyncio.to_thread(journal.load, lease_ttl_s)
    except OSError as exc:
        log.warning("cannot read the lease journal %s (%s): leases granted before this "
                    "start are not known, and their adapters may be evicted",
                    journal.path, exc.strerror or exc)
        return []
