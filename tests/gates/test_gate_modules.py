"""A gate module holds declarations, argument checks and a short ``measure`` (issue #28, item 4).

Each top-level statement of a family module ``pytest_dnnsafety/gates/<family>.py`` is classed by what it is:
imports, the docstring, ``GateDef``/``Param``/``Family`` declarations, constants and the register hook are
*declarations*; a function passed to ``Param`` as its check (4th positional argument) is an *argument check*; a
function passed as ``measure=`` is *measure*; any other function or class is *orchestration* (task dispatch,
torchrun gathering, caching, grouping), which belongs in the family's engine package, the scenarios layer or the
gate mechanism (``gates/shared.py``). Blank and comment lines are not counted. The suite holds the share of
orchestration lines under 15% of all gate-module lines (36% before the house plan), and no ``measure`` over 40
lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pytest_dnnsafety.gates import BUILTIN_FAMILIES

GATES = Path(__file__).resolve().parents[2] / "pytest_dnnsafety" / "gates"
MAX_ORCHESTRATION = 0.15
MAX_MEASURE_LINES = 40


def classify(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Code lines per class and the code lines of each function classed as measure or orchestration."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    checks: set[str] = set()
    measures: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if called == "Param" and len(node.args) >= 4 and isinstance(node.args[3], ast.Name):
            checks.add(node.args[3].id)
        for keyword in node.keywords:
            if isinstance(keyword.value, ast.Name) and keyword.arg == "measure":
                measures.add(keyword.value.id)
            if isinstance(keyword.value, ast.Name) and keyword.arg == "check":
                checks.add(keyword.value.id)

    def code_lines(first: int, last: int) -> int:
        return sum(1 for line in lines[first - 1:last] if line.strip() and not line.strip().startswith("#"))

    counts = {"declarations": 0, "checks": 0, "measure": 0, "orchestration": 0}
    functions: dict[str, int] = {}
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        n = code_lines(first, node.end_lineno or node.lineno)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name != "pytest_dnnsafety_register_gates":
            kind = ("measure" if node.name in measures else "checks" if node.name in checks else "orchestration")
            counts[kind] += n
            if kind != "checks":
                functions[node.name] = n
        else:
            counts["declarations"] += n
    return counts, functions


def _modules() -> list[Path]:
    return [GATES / f"{name.rsplit('.', 1)[1]}.py" for name in BUILTIN_FAMILIES]


def test_every_family_module_is_read() -> None:
    assert len(_modules()) >= 11 and all(path.exists() for path in _modules())
    counts, _ = classify(GATES / "confusion.py")
    assert counts["measure"] > 0 and counts["declarations"] > 0 and counts["checks"] > 0


def test_gate_modules_are_declarations_checks_and_measure() -> None:
    total: dict[str, int] = {}
    rows = []
    for path in _modules():
        counts, functions = classify(path)
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
        rows.append(f"{path.stem}: {counts['orchestration']} of {sum(counts.values())}")
    share = total["orchestration"] / sum(total.values())
    assert share < MAX_ORCHESTRATION, (f"{share:.1%} of the gate-module lines are orchestration (at most "
                                       f"{MAX_ORCHESTRATION:.0%}): " + "; ".join(rows))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.stem)
def test_measure_functions_are_short(path: Path) -> None:
    counts, functions = classify(path)
    source = path.read_text(encoding="utf-8")
    long = {name: n for name, n in functions.items() if n > MAX_MEASURE_LINES and f"measure={name}" in source}
    assert not long, f"{path.name}: measure functions over {MAX_MEASURE_LINES} code lines: {long}"
