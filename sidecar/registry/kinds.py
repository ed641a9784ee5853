"""Registry kinds by URL scheme, and the options of the registry. A new kind is one module
(defining LOCATION, check_location and open_registry, as s3.py and local.py do) plus one line in
KINDS, and, for a kind with options of its own, its options class among RegistryOptions' bases.

Modules are imported when a location names them, so a local registry never loads aiobotocore.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Protocol, cast

from ..core.options import at_least, option, parse_int
from ..core.units import parse_size
from .base import AdapterRegistry
from .s3 import S3Options
from .transfer import TransferPolicy

KINDS: dict[str, str] = {  # URL scheme ("" for a folder path) -> module
    "": "sidecar.registry.local",
    "s3": "sidecar.registry.s3",
}


class RegistryKind(Protocol):
    LOCATION: str  # how a location of this kind is written, for messages

    def check_location(self, location: str) -> None: ...

    def open_registry(self, location: str, options: RegistryOptions, policy: TransferPolicy,
                      on_error: Callable[[str], None],
                      on_skipped: Callable[[int], None]) -> AdapterRegistry: ...


def scheme_of(location: str) -> str:
    return location.split("://", 1)[0] if "://" in location else ""


def kind_of(location: str) -> RegistryKind:
    """The kind a --registry value names; ValueError (saying which kinds exist) if none."""
    module = KINDS.get(scheme_of(location))
    if module is None:
        known = [cast(RegistryKind, importlib.import_module(m)).LOCATION for m in KINDS.values()]
        raise ValueError(f"use {' or '.join(known)}")
    return cast(RegistryKind, importlib.import_module(module))


def parse_location(text: str) -> str:
    location = text.strip()
    if not location:
        raise ValueError("must not be empty")
    kind_of(location).check_location(location)  # each registry kind judges its own locations
    return location


@dataclasses.dataclass(frozen=True)
class RegistryLocation:
    registry: str = option(
        "--registry", parse_location, "./registry",
        "where adapters live: a local folder (one sub-folder per adapter) or s3://bucket/prefix",
        "URL")
    part_size_bytes: int = option(
        "--part-size", at_least(parse_size, 5 * 1024**2, "at least 5MiB (S3's smallest part)"),
        "8MiB", "objects larger than this are fetched as parallel ranged GETs of this size",
        "SIZE")
    download_concurrency: int = option(
        "--download-concurrency", at_least(parse_int, 1, "at least 1"), "32",
        "ranged GETs in flight at once, across all adapters (S3 serves each connection at a "
        "fraction of a NIC: parallel ones fill it; 1 MiB of buffer each)", "N")

    @property
    def is_local(self) -> bool:
        """A folder path rather than a URL of some registry kind."""
        return scheme_of(self.registry) == ""


@dataclasses.dataclass(frozen=True)
class RegistryOptions(S3Options, RegistryLocation):
    """Where adapters come from and how they are fetched, then each kind's own options (the
    bases before RegistryLocation, one per kind that has any). Not slotted: config.Settings
    inherits these with the validation's options, and two slotted bases cannot be combined."""


def open_registry(options: RegistryOptions, policy: TransferPolicy,
                  on_error: Callable[[str], None],
                  on_skipped: Callable[[int], None]) -> AdapterRegistry:
    return kind_of(options.registry).open_registry(options.registry, options, policy, on_error,
                                                   on_skipped)
