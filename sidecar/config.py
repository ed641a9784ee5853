"""Settings: one frozen dataclass, built once from a mapping of option names to strings.

Every option is declared once in OPTIONS; the `serve` command line, the environment
variables (`LORA_SIDECAR_<NAME>`) and `--help` are all generated from that table.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from .errors import ConfigError

ENV_PREFIX = "LORA_SIDECAR_"
ADAPTER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LLAMA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def is_valid_adapter_id(adapter_id: object) -> bool:
    """Strict id check: the pattern, and never a name the filesystem treats specially."""
    return (
        isinstance(adapter_id, str)
        and ADAPTER_ID_PATTERN.fullmatch(adapter_id) is not None
        and adapter_id not in (".", "..")
    )


class TritonReload(Enum):
    NEVER = "never"
    ON_CHANGE = "on-change"
    UNLOAD_FIRST = "unload-first"


class LogFormat(Enum):
    TEXT = "text"
    JSON = "json"


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """`"20GiB"`, `"500MB"`, `"1048576"` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit such as 500MB, 20GiB)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    return int(value)


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


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

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").replace("-", "_").upper()


OPTIONS: tuple[Option, ...] = (
    Option("registry", "--registry", str, "./registry",
           "where adapters live: a local folder (one sub-folder per adapter) or "
           "s3://bucket/prefix", "URL"),
    Option("cache_root", "--cache-root", _parse_path, "./.lora-cache",
           "the cache volume shared with Triton (adapters/, .staging/, .trash/)", "DIR"),
    Option("triton_cache_root", "--triton-cache-root", _parse_optional_path, "",
           "the cache root as Triton's container sees it, used in the paths handed out "
           "and in multi_lora.json (default: --cache-root, made absolute)", "DIR"),
    Option("host", "--host", str, "127.0.0.1",
           "address the HTTP API binds to; anything but loopback should set --api-token",
           "ADDR"),
    Option("port", "--port", _parse_int, "8500", "port of the HTTP API (0 picks a free one)",
           "PORT"),
    Option("s3_endpoint_url", "--s3-endpoint-url", _parse_optional_str, "",
           "S3-compatible endpoint, e.g. http://minio:9000 (default: AWS)", "URL"),
    Option("s3_region", "--s3-region", _parse_optional_str, "",
           "S3 region (default: the AWS credential chain's region, else us-east-1)", "REGION"),
    Option("s3_connect_timeout_s", "--s3-connect-timeout", _parse_float, "5",
           "seconds to wait for a connection to the registry", "SECONDS"),
    Option("s3_read_timeout_s", "--s3-read-timeout", _parse_float, "30",
           "seconds to wait for the registry's next bytes before giving up on a request",
           "SECONDS"),
    Option("s3_max_attempts", "--s3-max-attempts", _parse_int, "5",
           "attempts per registry request (with capped exponential backoff and jitter)", "N"),
    Option("part_size_bytes", "--part-size", parse_size, "8MiB",
           "objects larger than this are fetched as parallel ranged GETs of this size",
           "SIZE"),
    Option("download_concurrency", "--download-concurrency", _parse_int, "16",
           "registry requests in flight at once, across all adapters", "N"),
    Option("max_bytes", "--max-bytes", parse_size, "20GiB",
           "byte budget of the cache (e.g. 500GB); least recently used adapters are evicted",
           "SIZE"),
    Option("max_adapters", "--max-adapters", _parse_int, "256",
           "most adapters kept on disk at once", "N"),
    Option("min_free_bytes", "--min-free-disk", parse_size, "256MiB",
           "refuse a stage that would leave less than this free on the cache filesystem",
           "SIZE"),
    Option("pin", "--pin", _parse_list, "",
           "adapter ids staged at start and never evicted (comma-separated)", "ID,ID"),
    Option("lease_ttl_s", "--lease-ttl", _parse_float, "600",
           "seconds after which an unreleased lease expires", "SECONDS"),
    Option("stage_timeout_s", "--stage-timeout", _parse_float, "600",
           "longest a /stage call waits when the caller gives no timeout_s", "SECONDS"),
    Option("refusal_ttl_s", "--refusal-ttl", _parse_float, "60",
           "seconds a refused (invalid) adapter is remembered before it is fetched again",
           "SECONDS"),
    Option("max_lora_rank", "--max-lora-rank", _parse_int, "16",
           "largest LoRA rank the served engine accepts (vLLM's max_lora_rank)", "N"),
    Option("allowed_target_modules", "--allowed-target-modules", _parse_list,
           ",".join(LLAMA_TARGET_MODULES),
           "modules an adapter may target (comma-separated; default: the Llama family's)",
           "NAMES"),
    Option("base_model", "--base-model", _parse_optional_str, "",
           "when set, an adapter's base_model_name_or_path must equal it", "NAME"),
    Option("base_model_config", "--base-model-config", _parse_optional_path, "",
           "the base model's config.json; when set, tensor shapes are checked against it",
           "FILE"),
    Option("catalog_refresh_s", "--catalog-refresh", _parse_float, "30",
           "seconds between listings of the registry for multi_lora.json", "SECONDS"),
    Option("triton_url", "--triton-url", _parse_optional_str, "",
           "Triton's HTTP endpoint (explicit model control), e.g. http://localhost:8000; "
           "when set, the vLLM model is reloaded when the catalog changes", "URL"),
    Option("triton_model", "--triton-model", str, "vllm_model",
           "name of the vLLM model in Triton's repository", "NAME"),
    Option("triton_reload", "--triton-reload", TritonReload, "on-change",
           "never | on-change (new engine loads beside the old, no downtime, two engines' "
           "memory) | unload-first (old engine unloaded first: downtime, one engine's memory)",
           "MODE"),
    Option("triton_reload_min_interval_s", "--triton-reload-min-interval", _parse_float, "60",
           "least seconds between two reloads of the vLLM model", "SECONDS"),
    Option("api_token", "--api-token", _parse_optional_str, "",
           "bearer token required by mutating endpoints (prefer --api-token-file)", "TOKEN",
           secret=True),
    Option("api_token_file", "--api-token-file", _parse_optional_path, "",
           "file holding the bearer token", "FILE"),
    Option("max_request_bytes", "--max-request-bytes", parse_size, "64KiB",
           "largest request body the API accepts", "SIZE"),
    Option("log_level", "--log-level", str, "INFO", "DEBUG, INFO, WARNING or ERROR", "LEVEL"),
    Option("log_format", "--log-format", LogFormat, "text", "text or json", "FORMAT"),
)

_BY_FIELD = {option.field: option for option in OPTIONS}


@dataclass(frozen=True, slots=True)
class Settings:
    registry: str = "./registry"
    cache_root: Path = Path("./.lora-cache")
    triton_cache_root: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8500
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_connect_timeout_s: float = 5.0
    s3_read_timeout_s: float = 30.0
    s3_max_attempts: int = 5
    part_size_bytes: int = 8 * 1024**2
    download_concurrency: int = 16
    max_bytes: int = 20 * 1024**3
    max_adapters: int = 256
    min_free_bytes: int = 256 * 1024**2
    pin: tuple[str, ...] = ()
    lease_ttl_s: float = 600.0
    stage_timeout_s: float = 600.0
    refusal_ttl_s: float = 60.0
    max_lora_rank: int = 16
    allowed_target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES
    base_model: str | None = None
    base_model_config: Path | None = None
    catalog_refresh_s: float = 30.0
    triton_url: str | None = None
    triton_model: str = "vllm_model"
    triton_reload: TritonReload = TritonReload.ON_CHANGE
    triton_reload_min_interval_s: float = 60.0
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
        return self.triton_cache_root or self.cache_root.resolve()

    @property
    def is_s3(self) -> bool:
        return self.registry.startswith("s3://")

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
        """Settings as shown in logs and /healthz: secrets hidden."""
        shown: dict[str, Any] = {}
        for option in OPTIONS:
            value = getattr(self, option.field)
            if option.secret:
                value = "<set>" if value else None
            elif isinstance(value, Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            shown[option.field] = value
        return shown


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
    """Cross-field and range checks, after every option parsed on its own."""
    registry: str = p["registry"]
    if registry.startswith("s3://"):
        bucket = registry.removeprefix("s3://").split("/", 1)[0]
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            yield f"--registry {registry!r}: {bucket!r} is not a valid S3 bucket name"
    elif "://" in registry:
        yield f"--registry {registry!r}: use a local folder or s3://bucket/prefix"
    elif not registry.strip():
        yield "--registry must not be empty"
    if not 0 <= p["port"] <= 65535:
        yield f"--port {p['port']}: must be between 0 and 65535"
    if not p["host"].strip():
        yield "--host must not be empty"
    positive = (
        "s3_connect_timeout_s", "s3_read_timeout_s", "lease_ttl_s", "stage_timeout_s",
        "catalog_refresh_s",
    )
    for name in positive:
        if p[name] <= 0:
            yield f"{_BY_FIELD[name].flag} must be greater than 0"
    for name in ("refusal_ttl_s", "triton_reload_min_interval_s", "min_free_bytes"):
        if p[name] < 0:
            yield f"{_BY_FIELD[name].flag} must not be negative"
    for name in ("s3_max_attempts", "download_concurrency", "max_adapters", "max_lora_rank"):
        if p[name] < 1:
            yield f"{_BY_FIELD[name].flag} must be at least 1"
    if p["max_bytes"] < 1:
        yield "--max-bytes must be at least 1 byte"
    if p["part_size_bytes"] < 5 * 1024**2:
        yield "--part-size must be at least 5MiB (S3's smallest useful range part)"
    if p["max_request_bytes"] < 1024:
        yield "--max-request-bytes must be at least 1KiB"
    for adapter_id in p["pin"]:
        if not is_valid_adapter_id(adapter_id):
            yield f"--pin: {adapter_id!r} is not a valid adapter id"
    if len(p["pin"]) > p["max_adapters"]:
        yield f"--pin lists {len(p['pin'])} adapters but --max-adapters is {p['max_adapters']}"
    for module in p["allowed_target_modules"]:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", module):
            yield f"--allowed-target-modules: {module!r} is not a module name"
    if not p["allowed_target_modules"]:
        yield "--allowed-target-modules must list at least one module"
    config = p["base_model_config"]
    if config is not None and not config.is_file():
        yield f"--base-model-config {config}: no such file"
    if p["log_level"].upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        yield f"--log-level {p['log_level']!r}: use DEBUG, INFO, WARNING or ERROR"
    if p["triton_url"] is not None and not re.match(r"^https?://", p["triton_url"]):
        yield f"--triton-url {p['triton_url']!r}: use http://host:port"
    if p["s3_endpoint_url"] is not None and not re.match(r"^https?://", p["s3_endpoint_url"]):
        yield f"--s3-endpoint-url {p['s3_endpoint_url']!r}: use http(s)://host:port"
    triton_root = p["triton_cache_root"]
    if triton_root is not None and not triton_root.is_absolute():
        yield f"--triton-cache-root {triton_root}: must be an absolute path"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
