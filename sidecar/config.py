"""Settings: one frozen dataclass, built once from a mapping of option names to strings.

Every option is declared once, as a field (sidecar/core/options.py): the layers below declare
theirs (the registry in registry/kinds.py and each registry kind, the validation in
validation/options.py) and Settings inherits them; the rest are declared here. The `serve`
command line, the environment variables (`LORA_SIDECAR_<NAME>`), `--help` and the defaults are
all read from those fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .core.errors import ConfigError
from .core.ids import is_valid_adapter_id
from .core.logs import LogFormat
from .core.net import hide_password
from .core.options import (
    Option,
    at_least,
    option,
    options_of,
    parse_absolute_path,
    parse_bool,
    parse_enum,
    parse_float,
    parse_host,
    parse_http_url,
    parse_int,
    parse_list,
    parse_optional_path,
    parse_optional_str,
    parse_path,
    parse_port,
    positive,
)
from .core.units import format_size, parse_size
from .registry.kinds import RegistryOptions
from .validation.engine_config import EngineConfig
from .validation.options import ValidationOptions, take_engine_limits


class EvictionPolicyName(Enum):
    """The eviction policies of cache/eviction.py."""

    LFU = "lfu"  # aged LFU
    LRU = "lru"
    S3FIFO = "s3-fifo"
    TINYLFU = "w-tinylfu"


class TritonReload(Enum):
    NEVER = "never"
    ON_CHANGE = "on-change"
    UNLOAD_FIRST = "unload-first"


@dataclass(frozen=True, slots=True)
class CompactionWindow:
    """A daily quiet window in UTC, `HH:MM-HH:MM`; it may wrap past midnight."""

    start_min: int
    end_min: int

    @property
    def text(self) -> str:
        return (f"{self.start_min // 60:02d}:{self.start_min % 60:02d}-"
                f"{self.end_min // 60:02d}:{self.end_min % 60:02d} UTC")

    def _minute(self, unix_s: float) -> float:
        return (unix_s % 86400.0) / 60.0

    def contains(self, unix_s: float) -> bool:
        minute = self._minute(unix_s)
        if self.start_min <= self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min

    def seconds_until_start(self, unix_s: float) -> float:
        """0 inside the window, else the seconds until it opens."""
        if self.contains(unix_s):
            return 0.0
        return ((self.start_min - self._minute(unix_s)) % 1440.0) * 60.0

    def seconds_since_start(self, unix_s: float) -> float:
        return ((self._minute(unix_s) - self.start_min) % 1440.0) * 60.0


def _parse_window(text: str) -> CompactionWindow | None:
    if not text.strip():
        return None
    match = re.fullmatch(r"\s*([0-9]{1,2}):([0-9]{2})\s*-\s*([0-9]{1,2}):([0-9]{2})\s*", text)
    if match is None:
        raise ValueError("use HH:MM-HH:MM (UTC), e.g. 02:00-04:00")
    hours_a, minutes_a, hours_b, minutes_b = (int(g) for g in match.groups())
    if hours_a > 23 or hours_b > 23 or minutes_a > 59 or minutes_b > 59:
        raise ValueError("hours are 00-23 and minutes 00-59")
    start, end = hours_a * 60 + minutes_a, hours_b * 60 + minutes_b
    if start == end:
        raise ValueError("the window must not be empty")
    return CompactionWindow(start, end)


def _parse_optional_count(text: str) -> int | None:
    if not text.strip() or text.strip() == "auto":
        return None
    value = parse_int(text)
    if value < 0:
        raise ValueError("must be 0 or more, or auto")
    return value


def _parse_log_level(text: str) -> str:
    if text.strip().upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("use DEBUG, INFO, WARNING or ERROR")
    return text.strip().upper()


def _parse_pins(text: str) -> tuple[str, ...]:
    pins = parse_list(text)
    bad = [p for p in pins if not is_valid_adapter_id(p)]
    if bad:
        raise ValueError(f"not valid adapter ids: {', '.join(map(repr, bad))}")
    return pins


def _parse_label_prefix(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._/:-]*", text.strip()):
        raise ValueError("use letters, digits and . _ / : - only")
    return text.strip()


@dataclass(frozen=True)
class Settings(ValidationOptions, RegistryOptions):
    """Every option: the registry's and the validation's (inherited, declared where they are
    read), then the cache's, the catalog's, the API's and the process's."""

    cache_root: Path = option(
        "--cache-root", parse_path, "./.lora-cache",
        "the cache volume shared with Triton (adapters/, .staging/, .trash/)", "DIR")
    triton_cache_root: Path | None = option(
        "--triton-cache-root", parse_absolute_path, "",
        "the cache root as Triton's container sees it, used in the paths handed out and in "
        "multi_lora.json", "DIR", default_text="--cache-root, made absolute")
    host: str = option(
        "--host", parse_host, "127.0.0.1",
        "address the HTTP API binds to; anything but loopback should set --api-token", "ADDR")
    port: int = option(
        "--port", parse_port, "8500", "port of the HTTP API (0 picks a free one)", "PORT")
    metrics_host: str | None = option(
        "--metrics-host", parse_optional_str, "",
        "address of a second, read-only listener (GET /metrics, /metrics/epp, /healthz, "
        "/readyz), e.g. the pod IP or 0.0.0.0, while the API stays on --host", "ADDR",
        default_text="none: no second listener")
    metrics_port: int = option(
        "--metrics-port", parse_port, "9400", "port of the --metrics-host listener", "PORT")
    epp_metrics: bool = option(
        "--epp-metrics", parse_bool, "false",
        "serve GET /metrics/epp: the adapter set as the model-server protocol's "
        "lora_requests_info gauge, for an endpoint picker (llm-d)", "BOOL")
    epp_adapter_prefix: str = option(
        "--epp-adapter-prefix", _parse_label_prefix, "",
        "put before each adapter id in /metrics/epp (the model name an endpoint picker sees, "
        "e.g. base-model/)", "TEXT")
    epp_label_max_bytes: int = option(
        "--epp-label-max-bytes", at_least(parse_int, 64, "at least 64"), "4096",
        "longest adapter list in a /metrics/epp label; the most recently used are kept", "N")
    seed_model_repository: Path | None = option(
        "--seed-model-repository", parse_optional_path, "",
        "a Triton model repository template to copy into <cache-root>/model_repository at start "
        "(only what differs is written), so Triton loads a repository on the cache volume while "
        "the template stays read-only", "DIR")
    max_bytes: int = option(
        "--max-bytes", positive(parse_size), "20GiB",
        "byte budget of the cache (e.g. 500GiB); past it adapters are evicted, in the order of "
        "--eviction-policy", "SIZE")
    max_adapters: int = option(
        "--max-adapters", at_least(parse_int, 1, "at least 1"), "256",
        "most adapters kept on disk at once", "N")
    eviction_policy: EvictionPolicyName = option(
        "--eviction-policy", lambda t: parse_enum(EvictionPolicyName, t), "lfu",
        "which unused adapter goes first when room is needed: lfu (the fewest requests lately, "
        "counts kept across evictions and restarts and halved as they age), lru, s3-fifo or "
        "w-tinylfu", "POLICY")
    min_free_bytes: int = option(
        "--min-free-disk", parse_size, "256MiB",
        "refuse a stage that would leave less than this free on the cache filesystem", "SIZE")
    pin: tuple[str, ...] = option(
        "--pin", _parse_pins, "",
        "adapter ids staged at start and never evicted (comma-separated)", "ID,ID")
    lease_ttl_s: float = option(
        "--lease-ttl", positive(parse_float), "600",
        "seconds after which an unreleased lease expires", "SECONDS")
    max_leases: int = option(
        "--max-leases", at_least(parse_int, 1, "at least 1"), "100000",
        "most live leases; past it the oldest end early (callers that never release would "
        "otherwise grow memory without bound)", "N")
    stage_timeout_s: float = option(
        "--stage-timeout", positive(parse_float), "600",
        "longest a /stage call waits when the caller gives no timeout_s", "SECONDS")
    refusal_ttl_s: float = option(
        "--refusal-ttl", at_least(parse_float, 0, "0 or more"), "60",
        "seconds a refused (invalid) adapter is remembered before it is fetched again "
        "(`lora-sidecar evict ID` forgets it sooner)", "SECONDS")
    not_found_ttl_s: float = option(
        "--not-found-ttl", at_least(parse_float, 0, "0 or more"), "2",
        "seconds an id the registry does not have is answered 404 from memory, without listing "
        "the registry again (an adapter uploaded since is found once they pass)", "SECONDS")
    upload_settle_s: float = option(
        "--upload-settle", at_least(parse_float, 0, "0 or more"), "1",
        "an adapter whose newest file the registry stored less than this ago (by the registry's "
        "own clock, to the second on S3) is staged once its files have been quiet that long, so "
        "the files of one upload landing a moment apart are staged together; 0 stages at once",
        "SECONDS")
    catalog_refresh_s: float = option(
        "--catalog-refresh", positive(parse_float), "30",
        "longest seconds between two looks at the catalog (quiet window, generations to "
        "retire; changes are acted on at once), and seconds between two listings of the "
        "registry (GET /catalog's registry view; folders that cannot be adapters are logged and "
        "counted)", "SECONDS")
    spare_names: int | None = option(  # None: sized from the registry
        "--spare-names", _parse_optional_count, "auto",
        "spare names each catalog generation lists, given to adapters it does not list without "
        "a reload (auto: the registry's adapters not on disk plus a quarter of the registry, at "
        "least 32, at most --spare-names-max); 0: every adapter the loaded catalog does not "
        "list costs a reload", "N")
    spare_names_max: int = option(
        "--spare-names-max", at_least(parse_int, 1, "at least 1"), "4096",
        "most spare names one generation lists (each costs the engine a little at load time "
        "and per request; see docs/operating.md)", "N")
    compact_below: int | None = option(
        "--compact-below", _parse_optional_count, "auto",
        "plan a compaction (a new generation and a reload) when this many spare names or fewer "
        "are left (auto: an eighth of the generation's spares, and at least 4 or a quarter of "
        "them); with --compaction-window it waits for the window unless no spare is left", "N")
    compaction_window: CompactionWindow | None = option(
        "--compaction-window", _parse_window, "",
        "daily quiet window, HH:MM-HH:MM in UTC, in which the catalog is compacted if anything "
        "was bound or evicted since it was rendered", "HH:MM-HH:MM")
    triton_url: str | None = option(
        "--triton-url", parse_http_url, "",
        "Triton's HTTP endpoint (explicit model control), e.g. http://localhost:8000; when set, "
        "the vLLM model is reloaded when the catalog changes", "URL")
    triton_model: str = option(
        "--triton-model", str, "vllm_model", "name of the vLLM model in Triton's repository",
        "NAME")
    triton_reload: TritonReload = option(
        "--triton-reload", lambda t: parse_enum(TritonReload, t), "on-change",
        "never | on-change (new engine loads beside the old, no downtime, two engines' memory) "
        "| unload-first (old engine unloaded first: downtime, one engine's memory)", "MODE")
    triton_probe_timeout_s: float = option(
        "--triton-probe-timeout", positive(parse_float), "5",
        "seconds a readiness probe of the vLLM model may take; the engine is declared lost only "
        "after 3 failed probes over 5 s, or when Triton says it is not ready", "SECONDS")
    triton_reload_min_interval_s: float = option(
        "--triton-reload-min-interval", at_least(parse_float, 0, "0 or more"), "60",
        "least seconds between two reloads of the vLLM model", "SECONDS")
    api_token: str | None = option(
        "--api-token", parse_optional_str, "",
        "bearer token required by mutating endpoints (prefer --api-token-file)", "TOKEN",
        secret=True)
    api_token_file: Path | None = option(
        "--api-token-file", parse_optional_path, "", "file holding the bearer token", "FILE")
    tenants_file: Path | None = option(
        "--tenants", parse_optional_path, "",
        "TOML file of tokens per adapter-id prefix (a tenant's token stages, pins, unpins and "
        "evicts only its own ids), the router's token, and whether /stage needs a token; "
        "off without it (see docs/operating.md, Tenants)", "FILE")
    max_request_bytes: int = option(
        "--max-request-bytes", at_least(parse_size, 1024, "at least 1KiB"), "64KiB",
        "largest request body the API accepts", "SIZE")
    log_level: str = option(
        "--log-level", _parse_log_level, "INFO", "DEBUG, INFO, WARNING or ERROR", "LEVEL")
    log_format: LogFormat = option(
        "--log-format", lambda t: parse_enum(LogFormat, t), "text", "text or json", "FORMAT")

    # ---- derived -------------------------------------------------------------------

    @property
    def triton_root(self) -> Path:
        """Triton's view of the cache root; always absolute (vLLM reads relative paths as
        hub ids)."""
        return self.triton_cache_root or self.cache_root.absolute()

    # ---- construction --------------------------------------------------------------

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Build from `LORA_SIDECAR_*` variables; anything else in the mapping is ignored."""
        values = {o.field: env[o.env_var] for o in OPTIONS if o.env_var in env}
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: Mapping[str, str]) -> Settings:
        """Build from option field names to raw strings; every problem is gathered."""
        problems: list[str] = []
        parsed: dict[str, Any] = {}
        unknown = sorted(set(values) - set(_BY_FIELD))
        problems.extend(f"unknown setting {name!r}" for name in unknown)
        for declared in OPTIONS:
            raw = values.get(declared.field, declared.default)
            try:
                parsed[declared.field] = declared.parse(raw)
            except (ValueError, TypeError) as exc:
                shown = "<hidden>" if declared.secret else repr(raw)
                problems.append(f"{declared.flag} ({declared.env_var}) = {shown}: {exc}")
        if not problems:
            if parsed["api_token_file"] is not None and parsed["api_token"] is None:
                parsed["api_token"] = _read_token(parsed["api_token_file"], problems)
            if parsed["engine_config"] is None and parsed["seed_model_repository"] is not None:
                parsed["engine_config"] = _seeded_engine_config(parsed, problems)
            problems.extend(take_engine_limits(parsed, set(values)))
            problems.extend(_check(parsed))
        if problems:
            raise ConfigError(problems)
        return cls(**parsed)

    def describe(self) -> dict[str, Any]:
        """Settings as shown in logs, as JSON values: secrets hidden, lists as given."""
        shown: dict[str, Any] = {}
        for declared in OPTIONS:
            value = getattr(self, declared.field)
            if declared.secret:
                value = "<set>" if value else None
            elif isinstance(value, Enum):
                value = value.value
            elif declared.metavar == "SIZE":
                value = format_size(value)
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, EngineConfig):
                value = str(value.path)
            elif isinstance(value, CompactionWindow):
                value = value.text
            elif isinstance(value, str):
                value = hide_password(value)
            elif isinstance(value, tuple):
                value = ",".join(value)
            shown[declared.field] = value
        return shown

    def changes(self) -> str:
        """One short line for the start-up log: `key=value` for each setting that differs
        from its default (describe() has them all)."""
        defaults = Settings().describe()
        pairs = [f"{key}={_logfmt(value)}" for key, value in self.describe().items()
                 if value != defaults[key]]
        return " ".join(pairs) or "all at their defaults"


OPTIONS: tuple[Option, ...] = options_of(Settings)
_BY_FIELD = {declared.field: declared for declared in OPTIONS}


def option_for(field_name: str) -> Option:
    """The option behind a settings field, to name its flag and variable in messages."""
    return _BY_FIELD[field_name]


def _logfmt(value: object) -> str:
    text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(
        value)
    return json.dumps(text) if not text or any(c in text for c in ' "=\t\n') else text


def _read_token(path: Path, problems: list[str]) -> str | None:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        problems.append(f"--api-token-file {path}: cannot read it ({exc.strerror})")
        return None
    if not token:
        problems.append(f"--api-token-file {path}: the file is empty")
    return token or None


def _seeded_engine_config(parsed: Mapping[str, Any], problems: list[str]) -> EngineConfig | None:
    """The model.json of the vLLM model in the repository Triton is seeded from: the file the
    engine will read, so its limits are the sidecar's without being named twice."""
    path = parsed["seed_model_repository"] / parsed["triton_model"] / "1" / "model.json"
    if not path.is_file():
        return None
    try:
        return EngineConfig.load(path)
    except ValueError as exc:
        problems.append(f"--engine-config (LORA_SIDECAR_ENGINE_CONFIG), from "
                        f"--seed-model-repository: {exc}")
        return None


def _check(p: Mapping[str, Any]) -> Iterable[str]:
    """Checks across options; only run once every option parsed on its own."""
    if len(p["pin"]) > p["max_adapters"]:
        yield f"--pin lists {len(p['pin'])} adapters but --max-adapters is {p['max_adapters']}"
    spares = p["spare_names"]
    if p["compact_below"] is not None and spares is not None and 0 < spares <= p["compact_below"]:
        yield (f"--compact-below {p['compact_below']} must be less than --spare-names "
               f"{spares}: every binding would plan a compaction")
    if spares is not None and spares > p["spare_names_max"]:
        yield f"--spare-names {spares} is more than --spare-names-max {p['spare_names_max']}"
    if p["metrics_host"] == p["host"] and p["metrics_port"] == p["port"] and p["port"] != 0:
        yield (f"--metrics-host/--metrics-port {p['metrics_host']}:{p['metrics_port']} is the "
               "API's own address; give the read-only listener another port")
