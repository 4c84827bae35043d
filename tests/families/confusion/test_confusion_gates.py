"""The severity-weighted confusion gate end to end, on real images and a conv model (scikit-learn's digits).

A user project with the example's digits CNN, 300 held-out digits and a severity file that makes
confusing 1 and 7 ten times worse than any other error. The healthy model passes; the same model with
the last layer's rows for 1 and 7 swapped (every 1 read as 7 and back) fails; the matrix may come from
a TOML or CSV file, a marker dict or a conftest fixture and gives the same numbers; a matrix of the
wrong size or naming an unknown class is an error naming the problem; ``-n 2`` equals serial; bad
marker arguments are collection errors.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import GateProject
from _digits_project import digits_project, gates_of, write_digits_files



SEVERITY_TOML = """\
# Reading a 1 as a 7 (or a 7 as a 1) silently changes an amount; other confusions are rated 1.
default = 1.0

[severity]
"1 -> 7" = 10.0
"7 -> 1" = 10.0

[severity.3]
8 = 2.0  # a 3 read as an 8: also plausible on a smudged form
"""



def _csv(cells: dict[tuple[int, int], str]) -> str:
    """A 10-class CSV severity file: the given cells, empty (the default weight) elsewhere."""
    rows = ["true\\predicted," + ",".join(map(str, range(10)))]
    rows += [f"{t}," + ",".join(cells.get((t, p), "") for p in range(10)) for t in range(10)]
    return "# the same matrix as severity.toml\n" + "\n".join(rows) + "\n"


SEVERITY_CSV = _csv({(1, 7): "10", (7, 1): "10", (3, 8): "2"})

SEVERITY_DICT = '{"1": {"7": 10.0}, "7 -> 1": 10.0, "3": {"8": 2.0}}'


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    (root / "data" / "severity.toml").write_text(SEVERITY_TOML)
    (root / "data" / "severity.csv").write_text(SEVERITY_CSV)
    return root


def _project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "") -> GateProject:
    return digits_project(gate_project, files, gates, conftest)


def _gates(project: GateProject) -> dict[str, dict]:
    return gates_of(project)


HEALTHY = {
    "toml": 'max_weighted_confusion(0.5, severity="data/severity.toml")',
    "csv": 'max_weighted_confusion(0.5, severity="data/severity.csv")',
    "dict": f"max_weighted_confusion(0.5, severity={SEVERITY_DICT})",
    "fixture": "max_weighted_confusion(0.5)",
    "value": 'max_weighted_confusion(0.2, severity="data/severity.toml", gate_on="value")',
}

FIXTURE = """
    import pytest


    @pytest.fixture(scope="session")
    def severity_matrix():
        return {"1": {"7": 10.0}, "7": {"1": 10.0}, "3 -> 8": 2.0}
"""

SWAP_1_7 = """
    import pytest
    import torch
    import netdef


    @pytest.fixture(scope="session")
    def model():
        net = netdef.trained()
        with torch.no_grad():  # the rows of classes 1 and 7 swapped: every 1 is read as 7 and back
            last = net.classifier[2]
            last.weight[[1, 7]] = last.weight[[7, 1]].clone()
            last.bias[[1, 7]] = last.bias[[7, 1]].clone()
        return net
"""


def test_healthy_model_passes_and_every_source_gives_the_same_numbers(gate_project: GateProject,
                                                                       files: Path) -> None:
    project = _project(gate_project, files, HEALTHY, textwrap.dedent(FIXTURE))
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret == 0, result.stdout.str()
    gates = _gates(project)
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(HEALTHY, "passed")
    toml = gates["toml"]
    for name in ("csv", "dict", "fixture", "value"):
        assert gates[name]["value"] == toml["value"] and gates[name]["details"]["bound"] == toml["bound"], name
        assert gates[name]["details"]["severity_sha256"] == toml["details"]["severity_sha256"], name
    d = toml["details"]
    assert d["n"] == 300 and 0.9 < d["accuracy"] < 1.0 and d["max_weight"] == 10.0
    assert 0 < toml["value"] < toml["bound"] <= 0.5
    assert gates["value"]["bound"] is None  # gate_on="value": the estimate is compared, the bound is a detail
    weights = np.asarray(d["severity"])
    assert weights[1, 7] == weights[7, 1] == 10 and weights[3, 8] == 2 and weights[0, 1] == 1
    # the value is Σ W∘C / N of the reported confusion matrix, and the pairs add up to it
    assert toml["value"] == pytest.approx((weights * np.asarray(d["confusion"])).sum() / 300)
    assert sum(p["contribution"] for p in d["pairs"]) == pytest.approx(toml["value"]) or d["pairs_total"] > 10
    assert gates["fixture"]["details"]["severity_source"] == "fixture 'severity_matrix'"
    result.stdout.fnmatch_lines(["*max_weighted_confusion*"])


def test_swapping_1_and_7_fails_naming_the_worst_pair(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {"toml": HEALTHY["toml"]}, textwrap.dedent(SWAP_1_7))
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    gate = _gates(project)["toml"]
    assert gate["status"] == "failed" and gate["value"] > 1.0, gate
    worst = gate["details"]["pairs"][:2]
    assert {(p["true"], p["predicted"]) for p in worst} == {("1", "7"), ("7", "1")}
    assert all(p["weight"] == 10.0 and p["count"] > 20 for p in worst)
    result.stdout.fnmatch_lines(["*max_weighted_confusion*worst pair ? -> ?: *× weight 10*"])


@pytest.mark.parametrize(("severity", "expected"), [
    ("wrong_size", "*severity matrix from *small.toml is 3×3 (3 classes) but the model has 10 classes*Fix: *"),
    ("unknown", "*entry '1 -> seven' names unknown class 'seven'*Fix: *"),
    ("negative", "*entry 3 -> 5 = -1.0 is negative*Fix: *"),
])
def test_bad_severity_files_are_errors(gate_project: GateProject, files: Path, severity: str, expected: str) -> None:
    gate_project.write("data/small.toml", 'classes = ["a", "b", "c"]\n[severity]\n"a -> b" = 2.0\n')
    gate_project.write("data/unknown.toml", '[severity]\n"1 -> seven" = 2.0\n')
    gate_project.write("data/negative.csv", _csv({(1, 7): "10", (3, 5): "-1"}))
    path = {"wrong_size": "data/small.toml", "unknown": "data/unknown.toml", "negative": "data/negative.csv"}
    project = _project(gate_project, files, {"bad": f'max_weighted_confusion(0.5, severity="{path[severity]}")'})
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    assert _gates(project)["bad"]["status"] == "error"
    result.stdout.fnmatch_lines([expected])


def test_a_missing_severity_fixture_is_an_error_naming_both_ways(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {"bare": "max_weighted_confusion(0.5)"})
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    assert _gates(project)["bare"]["status"] != "passed"
    result.stdout.fnmatch_lines(["*no severity matrix: the max_weighted_confusion marker gives no severity= and "
                                 "conftest.py defines no `severity_matrix` fixture. Fix: *"])


def test_class_names_from_the_marker_and_a_reordered_file(gate_project: GateProject, files: Path) -> None:
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    shuffled = names[::-1]
    gate_project.write("data/named.toml", f"classes = {json.dumps(shuffled)}\n[severity]\n\"one -> seven\" = 10.0\n"
                                          "\"seven -> one\" = 10.0\n\"three -> eight\" = 2.0\n")
    gates = {"named": f'max_weighted_confusion(0.5, severity="data/named.toml", classes={names!r})',
             "plain": HEALTHY["toml"]}
    project = _project(gate_project, files, gates)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    got = _gates(project)
    assert got["named"]["value"] == got["plain"]["value"] and got["named"]["bound"] == got["plain"]["bound"]
    assert got["named"]["details"]["classes"] == names


def test_xdist_equals_serial(gate_project: GateProject, files: Path) -> None:
    gates = {k: HEALTHY[k] for k in ("toml", "csv", "dict")}
    project = _project(gate_project, files, gates)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    serial = {name: (g["value"], g["bound"], g["details"]["pairs"]) for name, g in _gates(project).items()}
    assert project.run("--dnnsafety-json=evidence.json", "-n", "2", subprocess=True).ret == 0
    parallel = {name: (g["value"], g["bound"], g["details"]["pairs"]) for name, g in _gates(project).items()}
    assert parallel == serial


BAD_MARKERS = [
    ("max_weighted_confusion(-0.1, severity='s.toml')", "argument threshold*outside*"),
    ("max_weighted_confusion(0.1, severity='s.json')", "argument severity*not a .toml or .csv file*"),
    ("max_weighted_confusion(0.1, severity={'1': {'7': -2}})", "argument severity*-2 is not a finite number >= 0*"),
    ("max_weighted_confusion(0.1, severity={'1': 3})", "argument severity*entry '1' must be a dict*"),
    ("max_weighted_confusion(0.1, severity=[[0, 1], [1]])", "argument severity*square*"),
    ("max_weighted_confusion(0.1, severity=3)", "argument severity*expected*"),
    ("max_weighted_confusion(0.1, confidence=1.5)", "argument confidence*outside*"),
    ("max_weighted_confusion(0.1, gate_on='mean')", "argument gate_on*'mean' is not one of*"),
    ("max_weighted_confusion(0.1, method='normal')", "argument method*'normal' is not one of*"),
    ("max_weighted_confusion(0.1, classes=['a', 'a'])", "argument classes*twice*"),
    ("max_weighted_confusion(0.1, default=-1)", "argument default*not a finite number >= 0*"),
    ("max_weighted_confusion(0.1, severity_matrix='my-fixture')", "argument severity_matrix*must name a fixture*"),
    ("max_weighted_confusion(0.1, weights='s.toml')", "argument weights*unknown keyword*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n")
    result = gate_project.run()
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.max_weighted_confusion: {expected}Fix: *"])
