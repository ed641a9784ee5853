"""The adapter set in the model-server protocol's LoRA shape, for an endpoint picker (the
Gateway API Inference Extension / llm-d EPP) that scrapes `/metrics/epp`.

The protocol's gauge (vLLM's `vllm:lora_requests_info`) is one series whose labels list the
adapters and whose value is the time of the last change; a scraper takes the series with the
largest value and splits the labels on commas. Here "running" means published on this node's
disk (not vLLM's "in GPU memory"), "waiting" a download in progress, and `max_lora` is one
more than the adapters listed while another fits without an eviction. Every change is a new
series with a long label, so it is served on its own path, which a cluster Prometheus need not
scrape, and the running list is capped (most recently used kept) with a counter of truncations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

METRIC = "lora_sidecar_lora_requests_info"
TRUNCATED = "lora_sidecar_lora_requests_info_truncated_total"
RUNNING_LABEL = "running_lora_adapters"
WAITING_LABEL = "waiting_lora_adapters"
MAX_LABEL = "max_lora"


@dataclass(frozen=True, slots=True)
class AdapterSet:
    running: Sequence[str]  # published on disk, most recently used first
    waiting: Sequence[str]  # being downloaded now
    room_for_another: bool  # one more adapter fits without evicting one


class EppExporter:
    """Renders the metric; the change time moves only when the rendered labels change."""

    def __init__(self, read: Callable[[], AdapterSet], *, prefix: str = "",
                 max_label_bytes: int = 4096,
                 clock: Callable[[], float] = time.time) -> None:
        self._read = read
        self._prefix = prefix
        self._max_label_bytes = max_label_bytes
        self._clock = clock
        self._last: tuple[str, str, int] | None = None
        self._changed_at = 0.0
        self._truncations = 0

    def render(self) -> bytes:
        adapters = self._read()
        running, running_cut = self._label(adapters.running)
        waiting, waiting_cut = self._label(adapters.waiting)
        listed = len(adapters.running) + len(adapters.waiting)
        max_lora = listed + 1 if adapters.room_for_another else listed
        current = (running, waiting, max_lora)
        if current != self._last:
            self._last = current
            self._changed_at = max(self._clock(), self._changed_at + 0.001)  # strictly newer
            if running_cut or waiting_cut:
                self._truncations += 1
        lines = [
            f"# HELP {METRIC} Adapters on this node's disk (running), being downloaded "
            "(waiting) and how many fit (max_lora); the value is the time of the last change.",
            f"# TYPE {METRIC} gauge",
            f'{METRIC}{{{RUNNING_LABEL}="{running}",{WAITING_LABEL}="{waiting}",'
            f'{MAX_LABEL}="{max_lora}"}} {self._changed_at:.3f}',
            f"# HELP {TRUNCATED} Changes of the adapter set whose list was cut to the label cap.",
            f"# TYPE {TRUNCATED} counter",
            f"{TRUNCATED} {self._truncations}",
            "",
        ]
        return "\n".join(lines).encode()

    def _label(self, ids: Sequence[str]) -> tuple[str, bool]:
        """Comma-separated names within the cap, earliest (most recently used) kept first;
        sorted, so a new order of the same set is no change. Ids need no escaping: the
        sidecar's id pattern has no quote, backslash or comma."""
        kept: list[str] = []
        size = 0
        for adapter_id in ids:
            name = self._prefix + adapter_id
            if size + len(name) + (1 if kept else 0) > self._max_label_bytes:
                return ",".join(sorted(kept)), True
            size += len(name) + (1 if kept else 0)
            kept.append(name)
        return ",".join(sorted(kept)), False
