"""Crash anywhere: the sidecar process is SIGKILLed at random points of a stage (during the
download, after it and before validation, around publication, during eviction), then
restarted on the same cache. After every restart the cache must be consistent."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from sidecar.validation.shapes import ModelShapes
from sidecar.validation.validate import Rules
from tests.support.cache_checks import check_cache
from tests.support.processes import SidecarProcess, stage_blocking
from tests.support.s3 import S3Registry
from tests.support.s3proxy import S3Proxy, Seen, is_object_get
from tests.support.settings import make_settings

ITERATIONS = 20
ADAPTERS = [f"crash-{i}" for i in range(6)]
MAX_ADAPTERS = 3  # every stage of an adapter not cached evicts another one
WEIGHTS = "adapter_model.safetensors"
# ~265 KB: long enough to be killed mid-download behind a throttle, quick otherwise.
SHAPES = ModelShapes(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                     num_key_value_heads=8, num_hidden_layers=4, head_dim=64)
PHASES = ("download", "after_download", "publish", "eviction")


class Trigger:
    """One iteration's SIGKILL, fired once by whichever thread sees its moment first: the
    proxy's byte counts (download phases) or a poller watching .staging/ and .trash/."""

    def __init__(self, pid: int, phase: str, adapter_id: str, cache: Path,
                 weights_size: int, rng: random.Random) -> None:
        self.pid = pid
        self.phase = phase
        self.adapter_id = adapter_id
        self.cache = cache
        self.threshold_bytes = rng.uniform(0.05, 0.95) * weights_size
        self.delay_s = rng.uniform(0.0, 0.03)
        self.fired = threading.Event()
        self.weights_sent = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None

    def arm(self, proxy: S3Proxy) -> None:
        proxy.body_progress = self._on_progress
        proxy.throttle_bytes_per_s = 2 * 1024**2 if self.phase == "download" else None
        if self.phase in ("publish", "eviction"):
            self._poller = threading.Thread(target=self._poll, daemon=True)
            self._poller.start()

    def disarm(self, proxy: S3Proxy) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(10)
        proxy.body_progress = None
        proxy.throttle_bytes_per_s = None

    def fire(self) -> None:
        with self._lock:
            if not self.fired.is_set():
                os.kill(self.pid, signal.SIGKILL)
                self.fired.set()

    def _on_progress(self, seen: Seen, sent: int, total: int | None) -> None:
        if not (is_object_get(seen) and seen.path.endswith(f"/{self.adapter_id}/{WEIGHTS}")):
            return
        if self.phase == "download" and sent >= self.threshold_bytes:
            self.fire()
        if sent == total:
            self.weights_sent.set()
            if self.phase == "after_download":  # runs on the proxy's loop
                asyncio.get_running_loop().call_later(self.delay_s, self.fire)

    def _moment_has_come(self) -> bool:
        if self.phase == "publish":  # sealed: the record is written, the rename is next
            return any((self.cache / ".staging").glob(f"{self.adapter_id}.*/.sidecar.json"))
        return any((self.cache / ".trash").iterdir())  # an evicted folder awaits deletion

    def _poll(self) -> None:
        """Every 0.2 ms (these windows last a few milliseconds) until the moment comes. Not a
        wait of the test's, so not `eventually`: a trigger that races the sidecar for a window
        it may never open, with no deadline of its own; disarm() stops it."""
        while not self._stop.is_set() and not self.fired.is_set():
            if self._moment_has_come():
                self.fire()
                return
            time.sleep(0.0002)  # lets the proxy and moto threads of this process run


def classify(cache: Path, adapter_id: str, weights_sent: bool) -> str:
    """Where the stage was when the kill landed, read from what it left on disk."""
    if any((cache / ".trash").iterdir()):
        return "during eviction"
    staging = list((cache / ".staging").glob(f"{adapter_id}.*"))
    if staging:
        if (staging[0] / ".sidecar.json").exists():
            return "sealed, not yet published"
        return "downloaded, not yet published" if weights_sent else "during download"
    if (cache / "adapters" / adapter_id).exists():
        return "after publication"
    return "before the download"


def test_sigkill_at_random_points_never_leaves_a_partial_or_unrecorded_adapter(
    tmp_path: Path, s3: S3Registry, sidecar_processes: list[SidecarProcess]
) -> None:
    rng = random.Random(os.environ.get("CRASH_SEED", "lora-sidecar"))
    sources = {
        adapter_id: s3.put_adapter(adapter_id, seed=i, rank=16, shapes=SHAPES,
                                   target_modules=("q_proj", "v_proj"))
        for i, adapter_id in enumerate(ADAPTERS)
    }
    weights_size = len(sources[ADAPTERS[0]][WEIGHTS])
    cache = tmp_path / "cache"
    settings = make_settings(tmp_path, max_adapters=MAX_ADAPTERS)
    rules = Rules.from_settings(settings)
    args = ["--registry", s3.registry, "--s3-endpoint-url", s3.endpoint_url,
            "--cache-root", str(cache), "--max-adapters", str(MAX_ADAPTERS),
            "--min-free-disk", "0", "--s3-max-attempts", "2"]
    log_path = tmp_path / "sidecar.log"
    process = SidecarProcess(args, log_path)
    sidecar_processes.append(process)
    landed: Counter[str] = Counter()

    for iteration in range(ITERATIONS):
        phase = PHASES[iteration % len(PHASES)]
        cached = {p.name for p in (cache / "adapters").iterdir()}
        adapter_id = rng.choice([a for a in ADAPTERS if a not in cached])
        trigger = Trigger(process.pid, phase, adapter_id, cache, weights_size, rng)
        trigger.arm(s3.proxy)
        status = _stage_until_killed(process.url, adapter_id)
        trigger.fire()  # no-op if it fired; if its window was missed, the kill lands late
        trigger.disarm(s3.proxy)
        process.process.wait(10)
        landed[classify(cache, adapter_id, trigger.weights_sent.is_set())] += 1

        process = SidecarProcess(args, log_path)
        sidecar_processes.append(process)
        state = check_cache(cache, rules, max_adapters=MAX_ADAPTERS, sources=sources)
        quarantine = cache / ".quarantine"
        assert not quarantine.exists() or not any(quarantine.iterdir()), (
            f"iteration {iteration} ({phase}): a half-made folder had to be quarantined")
        assert status in (0, 200), (iteration, phase, status)
        assert len(state.ids) <= MAX_ADAPTERS

    # Every adapter still stages, whole, on the last restarted process.
    for adapter_id in ADAPTERS:
        status, body = stage_blocking(process.url, adapter_id, 30, lease=False)
        assert status == 200, body
    process.stop()  # a clean stop finishes deleting what was evicted
    check_cache(cache, rules, max_adapters=MAX_ADAPTERS, sources=sources)
    print(f"\n{ITERATIONS} kills landed: {dict(sorted(landed.items()))}")
    assert landed["during download"] >= 1
    assert len(landed) >= 3, landed


def _stage_until_killed(url: str, adapter_id: str) -> int:
    """Stage; the status, or 0 when the sidecar died under the request. Without a lease: a
    lease outlives the kill (journaled) and would hold its adapter past the next iterations."""
    try:
        return stage_blocking(url, adapter_id, 30, lease=False)[0]
    except OSError:
        return 0
