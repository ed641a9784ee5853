"""Registry kinds by URL scheme. A new kind is one module (defining LOCATION, check_location
and open_source, as s3.py and local.py do) plus one line in KINDS.

Modules are imported when a location names them, so configuration parsing needs no cycle and
a local registry never loads aiobotocore.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from ..config import Settings
    from .base import AdapterSource
    from .transfer import TransferPolicy

KINDS: dict[str, str] = {  # URL scheme ("" for a folder path) -> module
    "": "sidecar.registry.local",
    "s3": "sidecar.registry.s3",
}


class RegistryKind(Protocol):
    LOCATION: str  # how a location of this kind is written, for messages

    def check_location(self, location: str) -> None: ...

    def open_source(self, settings: Settings, policy: TransferPolicy,
                    on_error: Callable[[str], None],
                    on_skipped: Callable[[int], None]) -> AdapterSource: ...


def scheme_of(location: str) -> str:
    return location.split("://", 1)[0] if "://" in location else ""


def kind_of(location: str) -> RegistryKind:
    """The kind a --registry value names; ValueError (saying which kinds exist) if none."""
    module = KINDS.get(scheme_of(location))
    if module is None:
        known = [cast(RegistryKind, importlib.import_module(m)).LOCATION for m in KINDS.values()]
        raise ValueError(f"use {' or '.join(known)}")
    return cast(RegistryKind, importlib.import_module(module))


def check_location(location: str) -> None:
    kind_of(location).check_location(location)


def open_source(settings: Settings, policy: TransferPolicy, on_error: Callable[[str], None],
                on_skipped: Callable[[int], None]) -> AdapterSource:
    return kind_of(settings.registry).open_source(settings, policy, on_error, on_skipped)
