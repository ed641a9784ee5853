"""What a tier prints at the end of the run (figures it measured, what it skipped and why), in
a serial run and in a parallel one alike: a tier adds its sections when the session finishes;
in an xdist worker they travel to the controller with the worker's output, and tests/conftest.py
prints them all in the terminal summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pytest

_WORKER_KEY = "tier_summary"
_SECTIONS = pytest.StashKey[list["Section"]]()


@dataclass(frozen=True)
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    alarm: bool = False  # in red between rows of "!", where it cannot be missed


def add(config: pytest.Config, section: Section) -> None:
    """Print `section` at the end of this run, from whichever process ran the tier."""
    workeroutput: dict[str, Any] | None = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput.setdefault(_WORKER_KEY, []).append(asdict(section))
    else:
        config.stash.setdefault(_SECTIONS, []).append(section)


def receive(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """The sections an xdist worker finished with, kept for the controller's summary."""
    for value in workeroutput.get(_WORKER_KEY, []):
        config.stash.setdefault(_SECTIONS, []).append(Section(**value))


def write(config: pytest.Config, reporter: Any) -> None:
    for section in config.stash.get(_SECTIONS, []):
        mark = "!" if section.alarm else "-"
        reporter.write_sep(mark, section.title, red=section.alarm, bold=section.alarm)
        for line in section.lines:
            reporter.write_line(line)
        if section.alarm:
            reporter.write_sep(mark, "", red=True, bold=True)
