"""`make test`'s parallel run (pytest-xdist, tests/support/scheduling.py), on a suite made for
the test with the real tiers' layout: a module's tests stay on one worker, and the tests of the
engine and compose tiers run on one worker, one at a time, while the other worker runs the rest.
The made tests record when and where they ran; nothing is run in this process's own session."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

CONFTEST = '''
from tests.support.scheduling import TierScheduling


def pytest_xdist_make_scheduler(config, log):
    return TierScheduling(config, log)
'''
# Each made test takes a moment, so that what one worker runs is seen beside the other's.
TEST = '''
import json, os, time


def _record(name):
    started = time.monotonic()
    time.sleep(0.3)  # time passing is the point: a test that takes a moment
    with open({record!r}, "a") as sink:
        sink.write(json.dumps({{"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"],
                               "started": started, "ended": time.monotonic()}}) + "\\n")
'''
MODULES = {
    "tests/engine/test_engine_one.py": 3,
    "tests/engine/test_engine_two.py": 2,
    "tests/compose_up/test_compose_node.py": 2,
    "tests/unit/test_light_one.py": 3,
    "tests/unit/test_light_two.py": 3,
    "tests/behaviour/test_light_three.py": 3,
}


def test_a_module_stays_on_one_worker_and_the_heavy_tiers_run_one_test_at_a_time(
        tmp_path: Path) -> None:
    record = tmp_path / "ran.jsonl"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for module, count in MODULES.items():
        path = suite / module
        path.parent.mkdir(parents=True, exist_ok=True)
        tests = "".join(f"\n\ndef test_{n}():\n    _record({module + str(n)!r})\n"
                        for n in range(count))
        path.write_text(TEST.format(record=str(record)) + tests)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "--rootdir", str(suite), "-c", os.devnull, str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    ran = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(ran) == sum(MODULES.values())
    workers = {module: {r["worker"] for r in ran if r["test"].startswith(module)}
               for module in MODULES}
    assert all(len(w) == 1 for w in workers.values()), workers
    heavy = sorted((r for r in ran if r["test"].startswith(("tests/engine/",
                                                            "tests/compose_up/"))),
                   key=lambda r: r["started"])
    assert len({r["worker"] for r in heavy}) == 1, heavy
    assert all(one["ended"] <= two["started"] for one, two in itertools.pairwise(heavy))
    light_workers = {r["worker"] for r in ran} - {heavy[0]["worker"]}
    assert light_workers, "the other worker ran nothing beside the heavy tiers"
