"""Checks at start that need the outside world: settings that parse but cannot work.

The rule, also in docs/reference.md and `serve --help`: a problem that only the operator can fix
stops the start (exit 2, every problem listed); one that can pass on its own does not (the
sidecar starts, and /readyz says why it is not ready).

- A local registry folder that does not exist, is not a folder, or cannot be read: stops it.
- A registry that does not answer (an S3 endpoint down or slow, credentials refused, a bucket
  not created yet): does not; S3 services often come up after the sidecar.
- A pinned id the registry answers has nothing under it: stops it. When the registry does not
  answer within START_CHECK_S, pins are not judged at start; they are staged once it answers,
  and one it then reports missing keeps /readyz at 503 naming it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ..config import Settings, option_for
from ..core.errors import AdapterNotFound, SidecarError
from ..registry.base import AdapterRegistry
from ..registry.kinds import scheme_of
from ..registry.local import folder_problem

log = logging.getLogger(__name__)

START_CHECK_S = 10.0  # the most a start waits on the registry to judge --pin, then starts
SHOWN_IDS = 10


async def configuration_problems(settings: Settings, registry: AdapterRegistry) -> list[str]:
    """Every problem of `settings` that stops the start, each naming its option."""
    if settings.is_local:
        problem = await asyncio.to_thread(registry_folder_problem, settings.registry)
        if problem is not None:
            return [problem]  # pins cannot be looked up without it
    if not settings.pin:
        return []
    return await _missing_pins(settings, registry)


def registry_folder_problem(location: str) -> str | None:
    """Why a local --registry cannot work, naming the option, or None. An S3 registry is never
    judged here: one that does not answer yet may still come up (services start in any order).
    Blocking."""
    if scheme_of(location) != "":
        return None
    problem = folder_problem(location)
    if problem is None:
        return None
    option = option_for("registry")
    return f"{option.flag} ({option.env_var}) = {location!r}: {problem}"


def _folder(registry: str) -> Path:
    return Path(registry).expanduser().absolute()


async def _missing_pins(settings: Settings, registry: AdapterRegistry) -> list[str]:
    missing: list[str] = []
    answered = True
    try:
        async with asyncio.timeout(START_CHECK_S):
            for adapter_id in settings.pin:
                try:
                    await registry.list_files(adapter_id)
                except AdapterNotFound:
                    missing.append(adapter_id)
    except (SidecarError, TimeoutError) as exc:
        answered = False
        why = exc.message if isinstance(exc, SidecarError) else f"no answer in {START_CHECK_S:g}s"
        log.warning("could not check the pinned adapters at start (%s); starting: they are "
                    "staged once the registry answers, and /readyz says why until then", why)
    if not missing:
        return []
    option = option_for("pin")
    held = await _registry_ids(registry) if answered else ""
    where = (registry.description if not settings.is_local
             else f"folder {_folder(settings.registry)}")
    return [f"{option.flag} ({option.env_var}): no adapter {adapter_id!r} in the registry "
            f"{where}{held}" for adapter_id in missing]


async def _registry_ids(registry: AdapterRegistry) -> str:
    """`" (it holds: a, b, …)"` to help spot a typo; empty when the registry cannot say."""
    try:
        async with asyncio.timeout(START_CHECK_S):
            ids = await registry.list_adapter_ids()
    except (SidecarError, TimeoutError):
        return ""
    if not ids:
        return " (it holds no adapter)"
    more = f", … {len(ids)} in all" if len(ids) > SHOWN_IDS else ""
    return f" (it holds: {', '.join(ids[:SHOWN_IDS])}{more})"
