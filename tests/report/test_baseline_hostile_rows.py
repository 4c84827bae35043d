"""Hostile baseline rows (issue #29 §3): rows whose inputs were removed, non-finite stored numbers, duplicate rows.

Before, a row without ``inputs`` was judged (its yardstick could not be checked, yet the change counted as ok or
improved), a stored ``nan``/``-inf`` value showed the gate as ``missing`` so that ``max_drop`` was silently not
applied, and a second row of the same gate was silently ignored. Now the first two are ``unverifiable`` (a status
that is never ok nor improved, whose message says what could not be checked and that the limit is not applied),
and a baseline file with a duplicated gate is refused naming the file and the gate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.report import build_evidence
from pytest_dnnsafety.report.baseline import BASELINE_STATUSES, Baseline, compare
from pytest_dnnsafety.report.schemas import evidence_schema
from pytest_dnnsafety.results import GateResult

NODE = "tests/test_gates.py::test_model"
D_MODEL_A = "sha256:" + "1" * 64
D_MODEL_B = "sha256:" + "2" * 64
D_DATA = "sha256:" + "c" * 64


def gate(value: float | None = 0.9, *, bound: float | None = None, model: str = D_MODEL_A,
         inputs: dict[str, Any] | None = None) -> GateResult:
    return GateResult(nodeid=NODE, marker="min_neuron_k_activation", metric="m", threshold=0.5, op=">=",
                      status="passed", value=value, bound=bound, passed=True, summary="s",
                      inputs=inputs if inputs is not None else {"model": {"fixture": "model", "digest": model},
                                                                "data": {"fixture": "dataset", "digest": D_DATA}})


def row(result: GateResult) -> dict[str, Any]:
    return json.loads(json.dumps(build_evidence([result], {"seed": 1})["gates"][0]))


def test_unverifiable_is_a_status_of_the_code_and_the_schema() -> None:
    assert "unverifiable" in BASELINE_STATUSES
    schema = evidence_schema()["$defs"]["baseline"]["properties"]["status"]["enum"]
    assert schema == list(BASELINE_STATUSES)


@pytest.mark.parametrize("damage", ["deleted", "empty", "null", "data role deleted"])
def test_a_row_whose_inputs_were_removed_is_unverifiable_not_judged(damage: str) -> None:
    stored = row(gate(0.8))
    if damage == "deleted":
        del stored["inputs"]
    elif damage == "data role deleted":
        del stored["inputs"]["data"]
    else:
        stored["inputs"] = {} if damage == "empty" else None
    for value, limit in ((0.95, 0.02), (0.8, 0.02), (0.5, None)):  # better, unchanged, worse without a limit
        result = compare(gate(value, model=D_MODEL_B), stored, limit)
        assert result["status"] == "unverifiable", (damage, value, result)
        assert "data" in result["message"] and "cannot be verified" in result["message"]
        assert "Fix:" in result["message"]
        assert result["unverifiable"] == ["data"]


@pytest.mark.parametrize("stored_value", ["nan", "-inf", "inf", None, "garbage"])
def test_a_non_finite_stored_value_is_unverifiable_and_says_the_limit_is_not_applied(stored_value: Any) -> None:
    stored = row(gate(0.9))
    stored["value"] = stored_value
    result = compare(gate(0.1), stored, 0.02)  # a drop of 0.8: must not pass as "missing"
    assert result["status"] == "unverifiable", result
    assert result["baseline_value"] is None
    assert f"{stored_value!r}" in result["message"] or str(stored_value) in result["message"]
    assert "max_drop 0.02 is not applied" in result["message"] and "Fix:" in result["message"]
    json.dumps(result, allow_nan=False)


def test_a_non_finite_stored_bound_does_not_fall_back_to_the_value() -> None:
    stored = row(gate(0.95, bound=0.9))
    stored["bound"] = "-inf"
    result = compare(gate(0.95, bound=0.5), stored, 0.02)
    assert result["status"] == "unverifiable" and "bound" in result["message"]


def test_a_gate_the_baseline_does_not_hold_is_still_missing() -> None:
    assert compare(gate(0.9), None, 0.02)["status"] == "missing"


def _evidence(*results: GateResult) -> dict[str, Any]:
    return json.loads(json.dumps(build_evidence(list(results), {"seed": 1})))


def test_duplicate_rows_are_refused_naming_the_file_and_the_gate(tmp_path: Path) -> None:
    evidence = _evidence(gate(0.5), gate(0.9))
    path = tmp_path / "base.json"
    path.write_text(json.dumps(evidence))
    with pytest.raises(ConfigError) as info:
        Baseline.load(path)
    message = str(info.value)
    assert str(path) in message and NODE in message and "min_neuron_k_activation" in message
    assert "twice" in message and "Fix:" in message
    # distinct gates of one test, or one marker on distinct tests, are fine
    other = gate(0.9)
    other.nodeid = NODE + "2"
    Baseline.from_evidence(_evidence(gate(0.5), other), path)


def _saved_baseline(gate_project) -> tuple[Path, dict]:
    """A one-gate project (``max_drop=0.02``) whose baseline was saved to ``base.json``: its path and content."""
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.1, k=2, max_drop=0.02)
        def test_cov(scenario_table):
            pass
    """)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    path = gate_project.pytester.path / "base.json"
    return path, json.loads(path.read_text())


@pytest.mark.slow
def test_a_duplicated_gate_stops_the_run_naming_the_file(gate_project) -> None:
    path, evidence = _saved_baseline(gate_project)
    evidence["gates"].append(dict(evidence["gates"][0], value=0.0))
    path.write_text(json.dumps(evidence))
    result = gate_project.run("--dnnsafety-baseline=base.json")
    assert result.ret != 0
    text = result.stdout.str() + result.stderr.str()
    assert "base.json" in text and "test_cov" in text and "twice" in text


@pytest.mark.slow
def test_an_edited_nan_baseline_is_reported_unverifiable(gate_project) -> None:
    path, evidence = _saved_baseline(gate_project)
    evidence["gates"][0]["value"] = "nan"
    path.write_text(json.dumps(evidence))
    result = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=e.json")
    gate = json.loads((gate_project.pytester.path / "e.json").read_text())["gates"][0]
    comparison = gate["baseline"]
    assert comparison["status"] == "unverifiable" and "max_drop 0.02 is not applied" in comparison["message"]
    # the marker asked for a regression check that could not be made: an error, never a pass
    assert gate["status"] == "error" and result.ret != 0
    result.stdout.fnmatch_lines(["*baseline: cannot compare*max_drop 0.02 is not applied*"])
