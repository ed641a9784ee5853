"""Watching the sidecar from outside, as an operator would: read /metrics with Prometheus's own
text parser, and count the bytes this process has read. (Waiting until something holds:
waiting.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(frozen=True)
class Scrape:
    """One scrape of /metrics, parsed."""

    families: dict[str, list[Sample]]  # family name -> its samples
    types: dict[str, str]  # family name -> counter, gauge, histogram, ...

    def value(self, sample_name: str, **labels: str) -> float:
        """The one sample of that name whose labels include `labels`."""
        family = sample_name
        for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
            if family.endswith(suffix) and family.removesuffix(suffix) in self.families:
                family = family.removesuffix(suffix)
                break
        found = [
            s.value for s in self.families.get(family, [])
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, f"{sample_name}{labels}: {len(found)} samples"
        return found[0]

    def buckets(self, family: str, **labels: str) -> list[float]:
        """The upper bounds of a histogram's buckets, +Inf last."""
        return [
            float(s.labels["le"]) for s in self.families[family]
            if s.name == f"{family}_bucket"
            and all(s.labels.get(k) == v for k, v in labels.items())
        ]


def parse_metrics(text: str) -> Scrape:
    families: dict[str, list[Sample]] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = list(family.samples)
        types[family.name] = family.type
    return Scrape(families, types)


async def scrape(http: aiohttp.ClientSession, base_url: str) -> Scrape:
    async with http.get(f"{base_url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(await response.text())


def bytes_read_by_process() -> int:
    """Bytes this process has read through read(2) and friends (mmap is not counted)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")
