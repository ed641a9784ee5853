"""The running lora-sidecar's version, for `--version` and the build-info metric."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version


def version() -> str:
    """The installed distribution's version; "unknown" when run from a tree not installed."""
    try:
        return distribution_version("lora-sidecar")
    except PackageNotFoundError:
        return "unknown"


def build_info() -> dict[str, str]:
    """The labels of lora_sidecar_build_info."""
    return {"version": version(), "python": platform.python_version()}
