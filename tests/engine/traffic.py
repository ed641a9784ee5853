"""Traffic over a node with the real engine, shared by the churn test and benchmarks/churn.py:
gRPC clients calling the router with Zipf-skewed adapters (no retries), every answer recorded,
and a sampler of the bytes under the cache root."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.utils import InferenceServerException

from tests.engine.node import EngineNode, status_of
from tests.support.cache_checks import disk_bytes

ZIPF_S = 1.1
SAMPLE_S = 0.5


@dataclass(frozen=True)
class Answer:
    adapter_id: str
    started: float  # monotonic
    ended: float
    text: str | None
    error: str | None

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def zipf_weights(count: int, s: float = ZIPF_S) -> list[float]:
    return [1.0 / (rank ** s) for rank in range(1, count + 1)]


class Clients:
    """`clients` threads, each with its own gRPC client, calling the router in a loop with an
    adapter drawn from `pool()` (most popular first) until stopped."""

    def __init__(self, node: EngineNode, pool: Callable[[], Sequence[str]], clients: int,
                 seed: int = 23) -> None:
        self._node = node
        self._pool = pool
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.answers: list[Answer] = []
        rng = random.Random(seed)
        self._threads = [threading.Thread(target=self._run, args=(rng.random(),))
                         for _ in range(clients)]

    def start(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.answers

    def _run(self, seed: float) -> None:
        rng = random.Random(seed)
        grpc = self._node.client()
        try:
            while not self._stop.is_set():
                pool = list(self._pool())
                adapter_id = rng.choices(pool, zipf_weights(len(pool)))[0]
                started = time.monotonic()
                try:
                    text, error = self._node.ask(adapter_id, client=grpc), None
                except InferenceServerException as exc:
                    text, error = None, f"{status_of(exc)}: {exc.message()}"
                with self._lock:
                    self.answers.append(Answer(adapter_id, started, time.monotonic(), text,
                                               error))
        finally:
            grpc.close()


@dataclass
class DiskSampler:
    """Bytes under the cache root every SAMPLE_S (`cache_checks.disk_bytes`): those the budget
    bounds (the adapters' files, published, being staged, being deleted; records aside,
    `.sidecar.json` and the `.sidecar.json.new` that replaces it), and everything else."""

    root: Path
    adapter_bytes: list[int] = field(default_factory=list)
    other_bytes: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> DiskSampler:
        self._thread = threading.Thread(target=self._run, name="disk-sampler")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            adapters, other = disk_bytes(self.root)
            self.adapter_bytes.append(adapters)
            self.other_bytes.append(other)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(answers: Sequence[Answer], seconds: float) -> dict[str, float]:
    ok = [a.seconds for a in answers if a.error is None]
    return {
        "requests": len(answers),
        "failed": sum(1 for a in answers if a.error is not None),
        "per_s": len(ok) / seconds if seconds > 0 else 0.0,
        "p50_s": statistics.median(ok) if ok else float("nan"),
        "p99_s": percentile(ok, 0.99),
    }
