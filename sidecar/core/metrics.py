"""Every Prometheus metric of the sidecar, on a metrics registry passed in (Prometheus' word:
the adapter store is the registry everywhere else); cache gauges are read when scraped, from
functions the wiring passes in, so they cannot drift from what they show.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .version import build_info

# No `_created` series beside each counter and histogram: a second series per metric that
# dashboards never read (prometheus_client's switch is process-wide).
disable_created_metrics()  # type: ignore[no-untyped-call]  # (unannotated upstream)

# Every series of a labelled metric exists from the first scrape, at 0, for the label values
# known in advance (a dashboard then shows 0, not "no data"). The catalog's states are its
# enums' values (catalog/name_state.py, catalog/engine_state.py; a test keeps them equal).
REGISTRY_OPERATIONS = ("probe", "list", "head", "get", "presign")
RELOAD_OUTCOMES = ("ok", "error")
NAME_STATES = ("unbound", "bound", "parked", "burnt", "retired")
ENGINE_STATES = ("starting", "unreachable", "absent", "unconfirmed", "serving", "suspect",
                 "loading")
# The routes a tenant's token can be refused on (web/api.py's `_authorize`; a test keeps them
# equal). The validation codes are validation/problem.py's, passed in by the wiring.
TENANT_ROUTES = ("stage", "evict", "pin", "unpin", "compact")

# The text format of /metrics/epp (hand-rendered: one gauge per adapter, web/epp.py).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# 1 ms .. 10 min: a hit is a millisecond, a cold 671 MB adapter on a slow link minutes.
STAGE_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
STAGE_RESULTS = ("hit", "miss", "error")
AGE_BUCKETS_S = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0, 7 * 86400.0)


class ScrapeGauges(Collector):
    """Gauges whose value is read when Prometheus scrapes: one (name, help, read) each."""

    def __init__(self, gauges: Sequence[tuple[str, str, Callable[[], float]]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for name, doc, read in self._gauges:
            yield GaugeMetricFamily(f"lora_sidecar_{name}", doc, value=read())


class StageTally(Collector):
    """POST /stage's requests by result and their durations, kept as plain numbers and shown
    as the counter `lora_sidecar_stage_requests_total` and the histogram
    `lora_sidecar_stage_duration_seconds`: a request counted in one bucket's addition, where
    a Counter and a Histogram took four calls and three locks per request (hit path). Counted
    on the event loop only; each count is read from the buckets, so a scrape never shows a
    count apart from its buckets."""

    def __init__(self) -> None:
        # Per result: the requests in each bucket (`le` its bound, +Inf last), and seconds.
        self._buckets = {result: [0] * (len(STAGE_BUCKETS_S) + 1) for result in STAGE_RESULTS}
        self._seconds = dict.fromkeys(STAGE_RESULTS, 0.0)
        self._bounds = [*map(floatToGoString, STAGE_BUCKETS_S), "+Inf"]

    def record(self, result: str, seconds: float) -> None:
        """One request answered with `result` ("hit", "miss" or "error") in `seconds`."""
        self._buckets[result][bisect_left(STAGE_BUCKETS_S, seconds)] += 1
        self._seconds[result] += seconds

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("lora_sidecar_stage_requests",
                                       "Stage requests by result (hit, miss, error).",
                                       labels=["result"])
        durations = HistogramMetricFamily("lora_sidecar_stage_duration_seconds",
                                          "Time to answer a stage request.", labels=["result"])
        for result in STAGE_RESULTS:
            seconds = self._seconds[result]
            cumulative = list(accumulate(self._buckets[result]))
            requests.add_metric([result], cumulative[-1])
            durations.add_metric([result], list(zip(self._bounds, cumulative, strict=True)),
                                 sum_value=seconds)
        yield requests
        yield durations


class LoopCounter(Collector):
    """A counter without labels that only the event loop adds to: `inc` is one addition,
    without prometheus_client's lock and checks (hit path)."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name, self._documentation = name, documentation
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self.value)


class Metrics:
    """The sidecar's metrics. `process/app.py` makes one per process; tests make their own."""

    def __init__(self, metrics_registry: CollectorRegistry | None = None, *,
                 process: bool = True, eviction_policy: str = "",
                 problem_codes: Sequence[str] = ()) -> None:
        self.metrics_registry = (metrics_registry if metrics_registry is not None
                                 else CollectorRegistry())
        r = self.metrics_registry
        self.stage = StageTally()
        r.register(self.stage)
        self.download_bytes = Counter(
            "lora_sidecar_download_bytes", "Bytes downloaded from the registry.", registry=r,
        )
        self.download_duration = Histogram(
            "lora_sidecar_download_duration_seconds",
            "Time to download one adapter (all its files).",
            buckets=STAGE_BUCKETS_S, registry=r,
        )
        self.evictions = Counter(
            "lora_sidecar_evictions", "Adapters removed from the cache, by reason "
            "(policy: chosen by --eviction-policy to make room; manual, forced, external).",
            ["reason"], registry=r,
        )
        self.age_at_eviction = Histogram(
            "lora_sidecar_adapter_age_at_eviction_seconds",
            "Time between staging an adapter and evicting it.",
            buckets=AGE_BUCKETS_S, registry=r,
        )
        self.validation_failures = Counter(
            "lora_sidecar_validation_failures", "Problems found in refused adapters, by code.",
            ["reason"], registry=r,
        )
        self.registry_errors = Counter(
            "lora_sidecar_registry_errors", "Failed registry calls, by operation.",
            ["operation"], registry=r,
        )
        self.signature_verifications = Counter(
            "lora_sidecar_signature_verifications", "Adapters judged by the signing policy, "
            "by outcome: verified (a signature by an allowed signer over these bytes), "
            "unsigned (none, and the policy lets it be), refused.", ["outcome"], registry=r,
        )
        # Ended at --max-leases on every grant when callers never release (hit path).
        self.leases_expired = LoopCounter(
            "lora_sidecar_leases_expired", "Leases that ran out before being released.")
        r.register(self.leases_expired)
        self.quarantined = Counter(
            "lora_sidecar_quarantined", "Folders moved aside because they were not valid.",
            registry=r,
        )
        self.tenant_refusals = Counter(
            "lora_sidecar_tenant_refusals",
            "Requests refused 403 under --tenants: a token for an id outside its prefix, or "
            "the router's token for anything but a stage.", ["route"], registry=r)
        self.registry_skipped_folders = Gauge(
            "lora_sidecar_registry_skipped_folders",
            "Folders in the registry's last listing that were left out: names that are not "
            "valid adapter ids (and, in a local registry, symbolic links).", registry=r,
        )
        self.catalog_adapters = Gauge(
            "lora_sidecar_catalog_adapters", "Adapters the rendered multi_lora.json lists by "
            "their own names.",
            registry=r,
        )
        self.catalog_generation = Gauge(
            "lora_sidecar_catalog_generation", "Number of the generation multi_lora.json holds.",
            registry=r,
        )
        self.catalog_bindings = Counter(
            "lora_sidecar_catalog_bindings", "Spare catalog names bound to new adapters (each "
            "one an adapter served without a reload).", registry=r,
        )
        self.catalog_spares_left = Gauge(
            "lora_sidecar_catalog_spares_left", "Unbound spare names in the generation the "
            "serving engine loaded.", registry=r,
        )
        self.catalog_names = Gauge(
            "lora_sidecar_catalog_names", "Names of the generation the serving engine loaded, "
            "by state (unbound, bound, parked, burnt, retired).", ["state"], registry=r,
        )
        self.catalog_name_changes = Counter(
            "lora_sidecar_catalog_name_changes", "Names that changed, by change: bound (a spare "
            "given to an adapter version), parked (its version left the disk), returned (the "
            "same bytes staged again), burnt (never handed out again).", ["change"], registry=r,
        )
        self.catalog_disk_bytes = Gauge(
            "lora_sidecar_catalog_disk_bytes", "Bytes the catalog keeps on the cache volume "
            "outside the adapters' budget: the no-op adapters, the names' links and folders, "
            "the journal and multi_lora.json.", registry=r,
        )
        self.catalog_compactions = Counter(
            "lora_sidecar_catalog_compactions", "New catalog generations rendered to replace "
            "one in use, by reason (exhausted, spares_low, window, requested, engine_lost).",
            ["reason"], registry=r,
        )
        self.triton_model_state = Gauge(
            "lora_sidecar_triton_model_state", "1 for the state the sidecar sees Triton's vLLM "
            "model in (starting, unreachable, absent, unconfirmed, serving, suspect, loading).",
            ["state"], registry=r,
        )
        self.triton_reloads = Counter(
            "lora_sidecar_triton_reloads", "Reloads of the vLLM model asked of Triton, by outcome.",
            ["outcome"], registry=r,
        )
        self.build = Info(
            "lora_sidecar_build", "The running lora-sidecar: its version, Python's and its "
            "eviction policy.",
            registry=r,
        )
        self.build.info(build_info() | ({"eviction_policy": eviction_policy}
                                        if eviction_policy else {}))
        # Every labelled series exists, at 0, from the first scrape: each family and the
        # values of its one label.
        declared: list[tuple[Counter | Histogram | Gauge, Iterable[str]]] = [
            (self.evictions, ("policy", "manual", "forced", "external")),
            (self.signature_verifications, ("verified", "unsigned", "refused")),
            (self.catalog_compactions,
             ("exhausted", "spares_low", "window", "requested", "engine_lost")),
            (self.catalog_name_changes, ("bound", "parked", "returned", "burnt")),
            (self.registry_errors, REGISTRY_OPERATIONS),
            (self.triton_reloads, RELOAD_OUTCOMES),
            (self.catalog_names, NAME_STATES),
            (self.triton_model_state, ENGINE_STATES),
            (self.tenant_refusals, TENANT_ROUTES),
            (self.validation_failures, problem_codes),
        ]
        for family, values in declared:
            for value in values:
                family.labels(value)
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def watch(self, *, cache_bytes: Callable[[], float], cache_adapters: Callable[[], float],
              cache_capacity_bytes: Callable[[], float],
              cache_capacity_adapters: Callable[[], float],
              pinned_adapters: Callable[[], float], active_leases: Callable[[], float],
              inflight_downloads: Callable[[], float],
              cache_room_bytes: Callable[[], float],
              waiting_for_room: Callable[[], float]) -> None:
        """Register the gauges read at scrape time, each from the function given for it."""
        self.metrics_registry.register(ScrapeGauges((
            ("cache_bytes", "Bytes of published adapters on the cache volume.", cache_bytes),
            ("cache_adapters", "Published adapters on the cache volume.", cache_adapters),
            ("cache_capacity_bytes", "Byte budget of the cache.", cache_capacity_bytes),
            ("cache_capacity_adapters", "Adapter budget of the cache.",
             cache_capacity_adapters),
            ("pinned_adapters", "Adapters that are never evicted.", pinned_adapters),
            ("active_leases", "Leases handed out and not yet released or expired.",
             active_leases),
            ("inflight_downloads", "Adapters being downloaded now.", inflight_downloads),
            ("cache_room_bytes", "Bytes a new adapter can have now, evicting what nothing "
             "protects: the budget's room or the disk's above --min-free-disk, the smaller.",
             cache_room_bytes),
            ("stages_waiting_for_room", "Downloads waiting, first come first served, for room "
             "that leases, claims or other downloads hold.", waiting_for_room),
        )))
