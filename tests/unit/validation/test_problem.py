"""The problem codes: every code a check in sidecar/ gives is declared once, in
validation/problem.py's `ProblemCode`, and every code declared there is given by some check
(the metrics count each declared code from the first scrape, tests/unit/core/test_metrics.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from sidecar.validation.problem import PROBLEM_CODES, Problem

SIDECAR = Path(__file__).resolve().parents[3] / "sidecar"


def _makers(tree: ast.Module) -> set[str]:
    """The functions of a module whose first parameter is a `ProblemCode`."""
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.args.args
            and ast.unparse(node.args.args[0].annotation or ast.Constant(None)) == "ProblemCode"}


def given_codes() -> dict[str, set[str]]:
    """Code -> the modules that give it: the first argument of each call to `Problem` (or to a
    helper taking a `ProblemCode` first), and the code of each `Fault` tuple written out
    (code, message) in a module that speaks of faults."""
    trees = {path.relative_to(SIDECAR).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
             for path in sorted(SIDECAR.rglob("*.py"))}
    makers = {"Problem"}.union(*(_makers(tree) for tree in trees.values()))
    given: dict[str, set[str]] = {}
    for module, tree in trees.items():
        faults = "Fault" in ast.unparse(tree)
        for node in ast.walk(tree):
            code = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in makers and node.args):
                code = node.args[0]
            elif faults and isinstance(node, ast.Tuple) and len(node.elts) == 2:
                code = node.elts[0]
            if isinstance(code, ast.Constant) and isinstance(code.value, str):
                given.setdefault(code.value, set()).add(module)
    return given


def test_every_code_a_check_gives_is_declared_once() -> None:
    given = given_codes()
    assert len(given) > 50, f"the walk found too few codes to be reading the checks: {given}"
    undeclared = {code: sorted(modules) for code, modules in given.items()
                  if code not in PROBLEM_CODES}
    assert not undeclared, f"codes given but not declared in ProblemCode: {undeclared}"
    assert len(PROBLEM_CODES) == len(set(PROBLEM_CODES)), "a code declared twice"


def test_every_declared_code_is_given_by_some_check() -> None:
    unused = sorted(set(PROBLEM_CODES) - given_codes().keys())
    assert not unused, f"declared in ProblemCode, given by no check: {unused}"


def test_codes_are_stable_snake_case_and_travel_as_json() -> None:
    for code in PROBLEM_CODES:
        assert code.replace("_", "").isalnum() and code == code.lower(), code
    problem = Problem("rank_too_large", "adapter_config.json", "LoRA rank 64 > 16")
    assert problem.to_json() == {"code": "rank_too_large", "file": "adapter_config.json",
                                 "message": "LoRA rank 64 > 16"}
