"""Settings: one frozen dataclass, built once from a mapping of option names to strings.

Every option is declared once in OPTIONS; the `serve` command line, the environment
variables (`LORA_SIDECAR_<NAME>`) and `--help` are all generated from that table.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError
from .ids import is_valid_adapter_id
from .registry.kinds import check_location

log = logging.getLogger(__name__)

ENV_PREFIX = "LORA_SIDECAR_"
# The most a start waits on the registry to judge --pin before starting anyway (preflight.py).
REGISTRY_START_CHECK_S = 10.0
LLAMA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]*@")


def hide_password(text: str) -> str:
    """A URL fit for logs and error messages: `http://user:<hidden>@host`."""
    return _URL_PASSWORD.sub(r"\1<hidden>@", text)


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


class LogFormat(Enum):
    TEXT = "text"
    JSON = "json"


_E = TypeVar("_E", bound=Enum)

# Binary units only, in every option, log line, listing and error: a budget given as 20GiB
# reads back as 20 GiB, never as "21.5 GB". Decimal spellings are refused, not reinterpreted.
_SIZE_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
               "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
_DECIMAL_UNITS = {"k": "KiB", "kb": "KiB", "m": "MiB", "mb": "MiB", "g": "GiB", "gb": "GiB",
                  "t": "TiB", "tb": "TiB"}
_SHOWN_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_size(text: str) -> int:
    """`"20GiB"`, `"512MiB"`, `"1048576"` -> bytes. Units are binary (KiB, MiB, GiB, TiB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use bytes or a binary unit: 512MiB, 20GiB)")
    unit = match.group(2).lower()
    if unit in _DECIMAL_UNITS:
        raise ValueError(f"sizes use binary units (KiB, MiB, GiB, TiB), as the sidecar prints "
                         f"them: write {match.group(1)}{_DECIMAL_UNITS[unit]} or a number of "
                         "bytes")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a binary unit: 512MiB, 20GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(size_bytes: int) -> str:
    """Bytes for people, in the units `parse_size` reads: `8.3 KiB`, `20 GiB`, `512 B`."""
    value = float(size_bytes)
    for unit in _SHOWN_UNITS:
        if round(abs(value), 1) < 1024 or unit == _SHOWN_UNITS[-1]:
            if unit == "B":
                return f"{size_bytes} B"
            shown = f"{value:.1f}".removesuffix(".0")
            return f"{shown} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _at_least(parse: Callable[[str], Any], low: float, what: str) -> Callable[[str], Any]:
    def parse_checked(text: str) -> Any:
        value = parse(text)
        if value < low:
            raise ValueError(f"must be {what}")
        return value

    return parse_checked


def _positive(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_checked(text: str) -> Any:
        value = parse(text)
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value

    return parse_checked


def _parse_port(text: str) -> int:
    port = _parse_int(text)
    if not 0 <= port <= 65535:
        raise ValueError("must be between 0 and 65535")
    return port


def _parse_registry(text: str) -> str:
    registry = text.strip()
    if not registry:
        raise ValueError("must not be empty")
    check_location(registry)  # each registry kind judges its own locations
    return registry


def _parse_http_url(text: str) -> str | None:
    url = text.strip()
    if url and not re.match(r"^https?://[^/\s]+", url):
        raise ValueError("use http(s)://host:port")
    return url or None


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
    value = _parse_int(text)
    if value < 0:
        raise ValueError("must be 0 or more, or auto")
    return value


def _parse_host(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def _parse_log_level(text: str) -> str:
    if text.strip().upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("use DEBUG, INFO, WARNING or ERROR")
    return text.strip().upper()


def _parse_modules(text: str) -> tuple[str, ...]:
    modules = _parse_list(text)
    bad = [m for m in modules if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", m)]
    if bad:
        raise ValueError(f"not module names: {', '.join(map(repr, bad))}")
    if not modules:
        raise ValueError("list at least one module")
    return modules


def _parse_pins(text: str) -> tuple[str, ...]:
    pins = _parse_list(text)
    bad = [p for p in pins if not is_valid_adapter_id(p)]
    if bad:
        raise ValueError(f"not valid adapter ids: {', '.join(map(repr, bad))}")
    return pins


def _parse_absolute_path(text: str) -> Path | None:
    path = _parse_optional_path(text)
    if path is not None and not path.is_absolute():
        raise ValueError("must be an absolute path")
    return path


def _parse_existing_file(text: str) -> Path | None:
    path = _parse_optional_path(text)
    if path is not None and not path.is_file():
        raise ValueError("no such file")
    return path


def _parse_signing_policy(text: str) -> Path | None:
    """The policy file, read and checked now so that its problems stop the start with the
    others, before the cache is touched (Rules reads it again for its own use)."""
    path = _parse_existing_file(text)
    if path is not None:
        # Imported here: it brings `cryptography`, which the client commands never need.
        from .validation.signing_policy import SigningPolicy

        SigningPolicy.load(path)
    return path


def _parse_enum(kind: type[_E], text: str) -> _E:
    try:
        return kind(text.strip().lower())
    except ValueError:
        raise ValueError(f"use one of {', '.join(str(m.value) for m in kind)}") from None


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("use true or false")


def _parse_label_prefix(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._/:-]*", text.strip()):
        raise ValueError("use letters, digits and . _ / : - only")
    return text.strip()


def _parse_optional_str(text: str) -> str | None:
    return text.strip() or None


def _parse_optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text.strip() else None


def _parse_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("must not be empty")
    return Path(text).expanduser().absolute()


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field, its command-line flag, its parser, default and help."""

    field: str
    flag: str
    parse: Callable[[str], Any]
    default: str
    help: str
    metavar: str = "VALUE"
    secret: bool = False
    default_text: str = ""  # --help's default where the raw value would not say (empty ones)

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").replace("-", "_").upper()


OPTIONS: tuple[Option, ...] = (
    Option("registry", "--registry", _parse_registry, "./registry",
           "where adapters live: a local folder (one sub-folder per adapter) or "
           "s3://bucket/prefix", "URL"),
    Option("cache_root", "--cache-root", _parse_path, "./.lora-cache",
           "the cache volume shared with Triton (adapters/, .staging/, .trash/)", "DIR"),
    Option("triton_cache_root", "--triton-cache-root", _parse_absolute_path, "",
           "the cache root as Triton's container sees it, used in the paths handed out "
           "and in multi_lora.json", "DIR", default_text="--cache-root, made absolute"),
    Option("host", "--host", _parse_host, "127.0.0.1",
           "address the HTTP API binds to; anything but loopback should set --api-token",
           "ADDR"),
    Option("port", "--port", _parse_port, "8500", "port of the HTTP API (0 picks a free one)",
           "PORT"),
    Option("metrics_host", "--metrics-host", _parse_optional_str, "",
           "address of a second, read-only listener (GET /metrics, /metrics/epp, /healthz, "
           "/readyz), e.g. the pod IP or 0.0.0.0, while the API stays on --host", "ADDR",
           default_text="none: no second listener"),
    Option("metrics_port", "--metrics-port", _parse_port, "9400",
           "port of the --metrics-host listener", "PORT"),
    Option("epp_metrics", "--epp-metrics", _parse_bool, "false",
           "serve GET /metrics/epp: the adapter set as the model-server protocol's "
           "lora_requests_info gauge, for an endpoint picker (llm-d)", "BOOL"),
    Option("epp_adapter_prefix", "--epp-adapter-prefix", _parse_label_prefix, "",
           "put before each adapter id in /metrics/epp (the model name an endpoint picker "
           "sees, e.g. base-model/)", "TEXT"),
    Option("epp_label_max_bytes", "--epp-label-max-bytes",
           _at_least(_parse_int, 64, "at least 64"), "4096",
           "longest adapter list in a /metrics/epp label; the most recently used are kept",
           "N"),
    Option("seed_model_repository", "--seed-model-repository", _parse_optional_path, "",
           "a Triton model repository template to copy into <cache-root>/model_repository "
           "at start (only what differs is written), so Triton loads a repository on the "
           "cache volume while the template stays read-only", "DIR"),
    Option("s3_endpoint_url", "--s3-endpoint-url", _parse_http_url, "",
           "S3-compatible endpoint, e.g. http://minio:9000", "URL", default_text="AWS S3"),
    Option("s3_region", "--s3-region", _parse_optional_str, "",
           "S3 region", "REGION",
           default_text="the AWS credential chain's region, else us-east-1"),
    Option("s3_connect_timeout_s", "--s3-connect-timeout", _positive(_parse_float), "5",
           "seconds to wait for a connection to the registry", "SECONDS"),
    Option("s3_read_timeout_s", "--s3-read-timeout", _positive(_parse_float), "30",
           "seconds to wait for the registry's next bytes before giving up on a request",
           "SECONDS"),
    Option("s3_max_attempts", "--s3-max-attempts", _at_least(_parse_int, 1, "at least 1"), "5",
           "attempts per registry request (with capped exponential backoff and jitter)", "N"),
    Option("part_size_bytes", "--part-size",
           _at_least(parse_size, 5 * 1024**2, "at least 5MiB (S3's smallest part)"), "8MiB",
           "objects larger than this are fetched as parallel ranged GETs of this size",
           "SIZE"),
    Option("download_concurrency", "--download-concurrency",
           _at_least(_parse_int, 1, "at least 1"), "32",
           "ranged GETs in flight at once, across all adapters (S3 serves each connection "
           "at a fraction of a NIC: parallel ones fill it; 1 MiB of buffer each)", "N"),
    Option("max_bytes", "--max-bytes", _positive(parse_size), "20GiB",
           "byte budget of the cache (e.g. 500GiB); least recently used adapters are evicted",
           "SIZE"),
    Option("max_adapters", "--max-adapters", _at_least(_parse_int, 1, "at least 1"), "256",
           "most adapters kept on disk at once", "N"),
    Option("min_free_bytes", "--min-free-disk", parse_size, "256MiB",
           "refuse a stage that would leave less than this free on the cache filesystem",
           "SIZE"),
    Option("pin", "--pin", _parse_pins, "",
           "adapter ids staged at start and never evicted (comma-separated)", "ID,ID"),
    Option("lease_ttl_s", "--lease-ttl", _positive(_parse_float), "600",
           "seconds after which an unreleased lease expires", "SECONDS"),
    Option("max_leases", "--max-leases", _at_least(_parse_int, 1, "at least 1"), "100000",
           "most live leases; past it the oldest end early (callers that never release "
           "would otherwise grow memory without bound)", "N"),
    Option("stage_timeout_s", "--stage-timeout", _positive(_parse_float), "600",
           "longest a /stage call waits when the caller gives no timeout_s", "SECONDS"),
    Option("refusal_ttl_s", "--refusal-ttl", _at_least(_parse_float, 0, "0 or more"), "60",
           "seconds a refused (invalid) adapter is remembered before it is fetched again "
           "(`lora-sidecar evict ID` forgets it sooner)", "SECONDS"),
    Option("not_found_ttl_s", "--not-found-ttl", _at_least(_parse_float, 0, "0 or more"), "2",
           "seconds an id the registry does not have is answered 404 from memory, without "
           "listing the registry again (an adapter uploaded since is found once they pass)",
           "SECONDS"),
    Option("upload_settle_s", "--upload-settle", _at_least(_parse_float, 0, "0 or more"), "1",
           "an adapter whose newest file the registry stored less than this ago (by the "
           "registry's own clock, to the second on S3) is staged once its files have been "
           "quiet that long, so the files of one upload landing a moment apart are staged "
           "together; 0 stages at once", "SECONDS"),
    Option("max_lora_rank", "--max-lora-rank", _at_least(_parse_int, 1, "at least 1"), "16",
           "largest LoRA rank the served engine accepts (vLLM's max_lora_rank)", "N"),
    Option("allowed_target_modules", "--allowed-target-modules", _parse_modules,
           ",".join(LLAMA_TARGET_MODULES),
           "modules an adapter may target (comma-separated)", "NAMES",
           default_text="the Llama family's projections, " + ",".join(LLAMA_TARGET_MODULES)),
    Option("base_model", "--base-model", _parse_optional_str, "",
           "when set, an adapter's base_model_name_or_path must equal it", "NAME"),
    Option("base_model_config", "--base-model-config", _parse_existing_file, "",
           "the base model's config.json; when set, tensor shapes are checked against it",
           "FILE"),
    Option("signing_policy", "--signing-policy", _parse_signing_policy, "",
           "a TOML file naming, per adapter id, exact or by prefix or glob, the signers (public "
           "keys, or CA roots and an identity) whose OMS signature (model.sig) it needs and a "
           "mode: require, verify-if-present or off (without a file every adapter is off)",
           "FILE"),
    Option("catalog_refresh_s", "--catalog-refresh", _positive(_parse_float), "30",
           "longest seconds between two looks at the catalog (quiet window, generations to "
           "retire; changes are acted on at once), and seconds between two listings of the "
           "registry (GET /catalog's registry view; folders that cannot be adapters are logged "
           "and counted)", "SECONDS"),
    Option("spare_names", "--spare-names", _parse_optional_count, "auto",
           "spare names each catalog generation lists, given to adapters it does not list "
           "without a reload (auto: the registry's adapters not on disk plus a quarter of the "
           "registry, at least 32, at most --spare-names-max); 0: every adapter the loaded "
           "catalog does not list costs a reload", "N"),
    Option("spare_names_max", "--spare-names-max", _at_least(_parse_int, 1, "at least 1"),
           "4096", "most spare names one generation lists (each costs the engine a little at "
           "load time and per request; see the README)", "N"),
    Option("compact_below", "--compact-below", _parse_optional_count, "auto",
           "plan a compaction (a new generation and a reload) when this many spare names or "
           "fewer are left (auto: an eighth of the generation's spares, and at least 4 or a "
           "quarter of them); with --compaction-window it waits for the window unless no spare "
           "is left", "N"),
    Option("compaction_window", "--compaction-window", _parse_window, "",
           "daily quiet window, HH:MM-HH:MM in UTC, in which the catalog is compacted if "
           "anything was bound or evicted since it was rendered", "HH:MM-HH:MM"),
    Option("triton_url", "--triton-url", _parse_http_url, "",
           "Triton's HTTP endpoint (explicit model control), e.g. http://localhost:8000; "
           "when set, the vLLM model is reloaded when the catalog changes", "URL"),
    Option("triton_model", "--triton-model", str, "vllm_model",
           "name of the vLLM model in Triton's repository", "NAME"),
    Option("triton_reload", "--triton-reload", lambda t: _parse_enum(TritonReload, t), "on-change",
           "never | on-change (new engine loads beside the old, no downtime, two engines' "
           "memory) | unload-first (old engine unloaded first: downtime, one engine's memory)",
           "MODE"),
    Option("triton_probe_timeout_s", "--triton-probe-timeout", _positive(_parse_float), "5",
           "seconds a readiness probe of the vLLM model may take; the engine is declared lost "
           "only after 3 failed probes over 5 s, or when Triton says it is not ready",
           "SECONDS"),
    Option("triton_reload_min_interval_s", "--triton-reload-min-interval",
           _at_least(_parse_float, 0, "0 or more"), "60",
           "least seconds between two reloads of the vLLM model", "SECONDS"),
    Option("api_token", "--api-token", _parse_optional_str, "",
           "bearer token required by mutating endpoints (prefer --api-token-file)", "TOKEN",
           secret=True),
    Option("api_token_file", "--api-token-file", _parse_optional_path, "",
           "file holding the bearer token", "FILE"),
    Option("max_request_bytes", "--max-request-bytes",
           _at_least(parse_size, 1024, "at least 1KiB"), "64KiB",
           "largest request body the API accepts", "SIZE"),
    Option("log_level", "--log-level", _parse_log_level, "INFO",
           "DEBUG, INFO, WARNING or ERROR", "LEVEL"),
    Option("log_format", "--log-format", lambda t: _parse_enum(LogFormat, t), "text",
           "text or json", "FORMAT"),
)

_BY_FIELD = {option.field: option for option in OPTIONS}


def option_for(field_name: str) -> Option:
    """The option behind a settings field, to name its flag and variable in messages."""
    return _BY_FIELD[field_name]


@dataclass(frozen=True, slots=True)
class Settings:
    registry: str = "./registry"
    cache_root: Path = Path("./.lora-cache")
    triton_cache_root: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8500
    metrics_host: str | None = None
    metrics_port: int = 9400
    epp_metrics: bool = False
    epp_adapter_prefix: str = ""
    epp_label_max_bytes: int = 4096
    seed_model_repository: Path | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_connect_timeout_s: float = 5.0
    s3_read_timeout_s: float = 30.0
    s3_max_attempts: int = 5
    part_size_bytes: int = 8 * 1024**2
    download_concurrency: int = 32
    max_bytes: int = 20 * 1024**3
    max_adapters: int = 256
    min_free_bytes: int = 256 * 1024**2
    pin: tuple[str, ...] = ()
    lease_ttl_s: float = 600.0
    max_leases: int = 100_000
    stage_timeout_s: float = 600.0
    refusal_ttl_s: float = 60.0
    not_found_ttl_s: float = 2.0
    upload_settle_s: float = 1.0
    max_lora_rank: int = 16
    allowed_target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES
    base_model: str | None = None
    base_model_config: Path | None = None
    signing_policy: Path | None = None
    catalog_refresh_s: float = 30.0
    spare_names: int | None = None  # None: sized from the registry
    spare_names_max: int = 4096
    compact_below: int | None = None
    compaction_window: CompactionWindow | None = None
    triton_url: str | None = None
    triton_model: str = "vllm_model"
    triton_reload: TritonReload = TritonReload.ON_CHANGE
    triton_reload_min_interval_s: float = 60.0
    triton_probe_timeout_s: float = 5.0
    api_token: str | None = field(default=None, repr=False)
    api_token_file: Path | None = None
    max_request_bytes: int = 64 * 1024
    log_level: str = "INFO"
    log_format: LogFormat = LogFormat.TEXT

    # ---- derived -------------------------------------------------------------------

    @property
    def triton_root(self) -> Path:
        """Triton's view of the cache root; always absolute (vLLM reads relative paths as
        hub ids)."""
        return self.triton_cache_root or self.cache_root.absolute()

    @property
    def is_s3(self) -> bool:
        return self.registry.startswith("s3://")

    @property
    def is_local(self) -> bool:
        """A folder path rather than a URL of some registry kind."""
        return "://" not in self.registry

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
        for option in OPTIONS:
            raw = values.get(option.field, option.default)
            try:
                parsed[option.field] = option.parse(raw)
            except (ValueError, TypeError) as exc:
                shown = "<hidden>" if option.secret else repr(raw)
                problems.append(f"{option.flag} ({option.env_var}) = {shown}: {exc}")
        if not problems:
            if parsed["api_token_file"] is not None and parsed["api_token"] is None:
                parsed["api_token"] = _read_token(parsed["api_token_file"], problems)
            problems.extend(_check(parsed))
        if problems:
            raise ConfigError(problems)
        return cls(**parsed)

    def describe(self) -> dict[str, Any]:
        """Settings as shown in logs, as JSON values: secrets hidden, lists as given."""
        shown: dict[str, Any] = {}
        for option in OPTIONS:
            value = getattr(self, option.field)
            if option.secret:
                value = "<set>" if value else None
            elif isinstance(value, Enum):
                value = value.value
            elif option.metavar == "SIZE":
                value = format_size(value)
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, CompactionWindow):
                value = value.text
            elif isinstance(value, str):
                value = hide_password(value)
            elif isinstance(value, tuple):
                value = ",".join(value)
            shown[option.field] = value
        return shown

    def changes(self) -> str:
        """One short line for the start-up log: `key=value` for each setting that differs
        from its default (describe() has them all)."""
        defaults = Settings.from_values({}).describe()
        pairs = [f"{key}={_logfmt(value)}" for key, value in self.describe().items()
                 if value != defaults[key]]
        return " ".join(pairs) or "all at their defaults"


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_registry_problem(registry: str) -> str | None:
    """Why a local --registry cannot work, or None. An S3 registry is never judged here: one
    that does not answer yet may still come up (services start in any order)."""
    if registry.startswith("s3://") or "://" in registry:
        return None
    option = _BY_FIELD["registry"]
    folder = Path(registry).expanduser().absolute()
    prefix = f"{option.flag} ({option.env_var}) = {registry!r}"
    try:
        with os.scandir(folder) as entries:
            next(entries, None)
    except FileNotFoundError:
        return (f"{prefix}: the folder {folder} does not exist; create it (`lora-sidecar "
                f"examples {registry}` writes two example adapters into it), or name an "
                "existing folder or s3://bucket/prefix")
    except NotADirectoryError:
        return f"{prefix}: {folder} is not a folder (one sub-folder per adapter is expected)"
    except PermissionError:
        return f"{prefix}: the folder {folder} cannot be read (permission denied)"
    except OSError as exc:
        # An I/O error (a network file system that blinks) can pass: readiness reports it.
        log.warning("cannot read the registry folder %s at start (%s); starting anyway",
                    folder, exc.strerror or exc)
    return None
