"""An option is declared once, as a settings field: its flag, its parser, its default as it would
be written on the command line, and its help. The `serve` command line, the environment
variables (`LORA_SIDECAR_<NAME>`), `--help` and the defaults of Settings are all read from those
fields (`options_of`). Each layer declares the options it reads (registry/kinds.py and each
registry kind, validation/options.py, config.py for the rest); the parsers they share are here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "LORA_SIDECAR_"
_OPTION = "option"  # the key of a field's metadata that holds its Option


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field, its command-line flag, its parser, default and help."""

    field: str
    flag: str
    parse: Callable[[str], Any]
    default: str  # as written on the command line; parsed like a value given there
    help: str
    metavar: str = "VALUE"
    secret: bool = False
    default_text: str = ""  # --help's default where the raw value would not say (empty ones)

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.flag.removeprefix("--").replace("-", "_").upper()


def option(flag: str, parse: Callable[[str], Any], default: str, help: str,
           metavar: str = "VALUE", *, secret: bool = False, default_text: str = "") -> Any:
    """A settings field declared by its option. The field's default is `default` parsed when a
    Settings is made, exactly as the same text given as a flag would be."""
    declared = Option("", flag, parse, default, help, metavar, secret, default_text)
    return dataclasses.field(default_factory=functools.partial(parse, default),
                             repr=not secret, metadata={_OPTION: declared})


def options_of(settings_class: type) -> tuple[Option, ...]:
    """Every option a settings class declares, its bases' included, in field order."""
    return tuple(dataclasses.replace(f.metadata[_OPTION], field=f.name)
                 for f in dataclasses.fields(settings_class) if _OPTION in f.metadata)


# ---- parsers every layer uses ---------------------------------------------------------------

_E = TypeVar("_E", bound=Enum)


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("not a whole number") from None


def parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def at_least(parse: Callable[[str], Any], low: float, what: str) -> Callable[[str], Any]:
    def parse_checked(text: str) -> Any:
        value = parse(text)
        if value < low:
            raise ValueError(f"must be {what}")
        return value

    return parse_checked


def positive(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_checked(text: str) -> Any:
        value = parse(text)
        if value <= 0:
            raise ValueError("must be greater than 0")
        return value

    return parse_checked


def parse_port(text: str) -> int:
    port = parse_int(text)
    if not 0 <= port <= 65535:
        raise ValueError("must be between 0 and 65535")
    return port


def parse_host(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text.strip()


def parse_http_url(text: str) -> str | None:
    url = text.strip()
    if url and not re.match(r"^https?://[^/\s]+", url):
        raise ValueError("use http(s)://host:port")
    return url or None


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("use true or false")


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_enum(kind: type[_E], text: str) -> _E:
    try:
        return kind(text.strip().lower())
    except ValueError:
        raise ValueError(f"use one of {', '.join(str(m.value) for m in kind)}") from None


def parse_optional_str(text: str) -> str | None:
    return text.strip() or None


def parse_optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text.strip() else None


def parse_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("must not be empty")
    return Path(text).expanduser().absolute()


def parse_absolute_path(text: str) -> Path | None:
    path = parse_optional_path(text)
    if path is not None and not path.is_absolute():
        raise ValueError("must be an absolute path")
    return path


def parse_existing_file(text: str) -> Path | None:
    path = parse_optional_path(text)
    if path is not None and not path.is_file():
        raise ValueError("no such file")
    return path
