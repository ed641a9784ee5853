"""The tests' layout, as "How the code is laid out" in docs/contributing.md states it: a module's
tests are found from its path, helpers live in tests/support/, conftest.py files hold fixtures
only, and a test waits with `eventually`, a fixed sleep only where time passing is itself the
point."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SIDECAR = ROOT / "sidecar"
SLEEP = re.compile(r"\b(?:time|asyncio)\.sleep\(")
COMMENT_REACH = 4  # a sleep's comment is on its line or on one of the lines just above


# The modules of sidecar/ that have no test of their own under tests/unit/ yet (their rules are
# tested through the running sidecar in tests/behaviour/).
UNMIRRORED = frozenset({  # may only shrink: a module added comes with its test
    "__main__.py", "cache/admission.py", "cache/lease_sweep.py", "cache/leases.py",
    "cache/records.py", "cache/stager.py", "config.py", "core/exits.py", "core/filehash.py",
    "core/fsutil.py", "core/net.py", "core/options.py", "core/version.py", "process/app.py",
    "process/examples.py", "process/preflight.py",
    "registry/base.py", "registry/httpranges.py", "registry/kinds.py", "registry/listing.py",
    "registry/proxies.py",
    "registry/s3errors.py", "validation/adapter_config.py", "validation/oms.py",
    "validation/options.py", "validation/safetensors_check.py",
    "validation/shapes.py", "web/server.py",
})


def _python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_unit_test_file_mirrors_a_module_of_the_sidecar() -> None:
    files = [p for p in _python_files(TESTS / "unit") if p.name.startswith("test_")]
    assert files, "tests/unit/ holds no test"
    astray = []
    for path in files:
        package = path.parent.relative_to(TESTS / "unit")
        subject = path.stem.removeprefix("test_")
        modules = {m.stem for m in (SIDECAR / package).glob("*.py") if m.stem != "__init__"}
        if not any(subject == m or subject.startswith(f"{m}_") for m in modules):
            astray.append(f"{path.relative_to(ROOT)}: no sidecar/{package}/<module>.py named by it")
    assert not astray, astray


def _mirrored(module: Path) -> bool:
    folder = TESTS / "unit" / module.parent.relative_to(SIDECAR)
    return any(test.stem.removeprefix("test_") == module.stem
               or test.stem.removeprefix("test_").startswith(f"{module.stem}_")
               for test in folder.glob("test_*.py"))


def test_every_module_of_the_sidecar_has_its_test_or_is_on_the_list_that_only_shrinks() -> None:
    modules = {str(p.relative_to(SIDECAR)): p for p in _python_files(SIDECAR)
               if p.name != "__init__.py"}
    untested = sorted(name for name, path in modules.items()
                      if not _mirrored(path) and name not in UNMIRRORED)
    assert not untested, f"modules with no test at their mirrored path: {untested}"
    tested_now = sorted(name for name in UNMIRRORED if name in modules and _mirrored(modules[name]))
    gone = sorted(name for name in UNMIRRORED if name not in modules)
    assert not tested_now and not gone, (
        f"drop from UNMIRRORED: {tested_now} (tested now), {gone} (no such module)")


def test_the_tiers_of_tests_hold_tests_and_the_helpers_live_in_support() -> None:
    for tier in ("unit", "behaviour", "project"):
        strays = [str(p.relative_to(ROOT)) for p in _python_files(TESTS / tier)
                  if not p.name.startswith("test_")
                  and p.name not in {"__init__.py", "conftest.py"}]
        assert not strays, f"helpers belong in tests/support/: {strays}"
    assert (TESTS / "support" / "waiting.py").is_file()


def test_no_test_imports_from_a_conftest() -> None:
    importers = []
    for path in _python_files(TESTS):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name.split(".")[-1] == "conftest" for name in names):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not importers, importers


def test_conftests_define_fixtures_and_hooks_only() -> None:
    for path in _python_files(TESTS):
        if path.name != "conftest.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            hook = node.name.startswith("pytest_")
            assert fixture or hook, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is a " \
                                    "helper, not a fixture: it belongs in tests/support/"


def test_every_fixed_sleep_says_why_time_passing_is_the_point() -> None:
    silent = []
    for path in _python_files(TESTS):
        if path == TESTS / "support" / "waiting.py":
            continue  # the one place that waits by polling
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            if not SLEEP.search(line):
                continue
            above = lines[max(0, number - 1 - COMMENT_REACH):number - 1]
            if not any("#" in text for text in [*above, line]):
                silent.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not silent, "a fixed sleep with no word of why (wait with eventually instead): " \
                       f"{silent}"
