"""How a parallel run (`pytest -n 2`, pytest-xdist; `make test` runs so) shares the tests out
between its workers, safe by default for tests written later:

- a test module is one unit, run on one worker: its module-scoped fixtures (a Triton server, a
  node of the engine) start once, and its tests never race each other;
- the heavy tiers, tests/engine and tests/compose_up, are one unit together, handed out first:
  their tests are the longest, each fills both cores of a small machine on its own (vLLM on
  CPU, image builds), and both build the engine's assets into the same folder of pytest's cache.
  So no two engines ever run at once, and the other worker takes every other module meanwhile;
- the other modules are handed out in the order they are collected, not by their number of
  tests (xdist's default): tests/behaviour's long single tests (several nodes, repeated crashes)
  then start early, and tests/unit's many short modules come last and even out the end.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

HEAVY_TIERS = ("tests/engine/", "tests/compose_up/")
HEAVY = "the heavy tiers (tests/engine, tests/compose_up)"


def unit_of(nodeid: str) -> str:
    """The unit a test is run in: its module, or the heavy tiers' one unit."""
    if nodeid.startswith(HEAVY_TIERS):
        return HEAVY
    return nodeid.split("::", 1)[0]


class TierScheduling(LoadScopeScheduling):
    """xdist's scheduling by scope, with the units above and the heavy one first."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        config.option.loadscopereorder = False  # read by schedule(): collection order
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        if HEAVY in self.workqueue:
            self.workqueue.move_to_end(HEAVY, last=False)
        super()._assign_work_unit(node)



# ---- how busy each worker was -------------------------------------------------------------


def busy_lines(stats: dict[str, list[Any]]) -> list[str]:
    """One line per xdist worker: its tests and their seconds, set-ups and teardowns included,
    from the reports of the run (the terminal reporter's `stats`, as --durations reads them).
    The busiest worker sets the run's length; the gap is what a better sharing could save."""
    busy: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])  # seconds, tests, heavy
    for report in (r for reports in stats.values() for r in reports):
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
        duration = getattr(report, "duration", None)
        if worker is None or duration is None:
            continue
        busy[worker][0] += duration
        busy[worker][1] += report.when == "call"
        busy[worker][2] += unit_of(report.nodeid) == HEAVY
    return [f"{worker}: {int(tests)} tests, {seconds:.0f} s"
            + (f" ({HEAVY} among them)" if heavy else "")
            for worker, (seconds, tests, heavy) in sorted(busy.items())]
