"""Baselines (report/baseline.py): comparison statuses, loading, saving, rendering, and end to end."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.report import build_evidence
from pytest_dnnsafety.report.baseline import (
    BASELINE_STATUSES, Baseline, compare, format_change, save_baseline, subject_roles,
)
from pytest_dnnsafety.report.junit import gate_line, patch_junit
from pytest_dnnsafety.report.terminal import baseline_notes, change_cell, render_table
from pytest_dnnsafety.results import GateResult

NODE = "tests/test_gates.py::test_cov"

D_SCEN_A = "sha256:" + "a" * 64
D_SCEN_B = "sha256:" + "b" * 64
D_MODEL_A = "sha256:" + "1" * 64
D_MODEL_B = "sha256:" + "2" * 64
D_DATA_A = "sha256:" + "c" * 64
D_DATA_B = "sha256:" + "d" * 64
F_COND_A = "sha256:" + "e" * 64
F_COND_B = "sha256:" + "f" * 64


def scenarios_role(digest: str = D_SCEN_A, conditions_file: str = F_COND_A) -> dict[str, Any]:
    return {"fixture": "scenario_table", "digest": digest,
            "origin": {"kind": "plugin fixture", "settings": {
                "scenarios": {"setting": "dnnsafety_scenarios", "sha256": "sha256:" + "9" * 64},
                "conditions": {"setting": "dnnsafety_conditions", "sha256": conditions_file}}}}


def gate(value: float | None = 0.9, *, op: str = ">=", bound: float | None = None, status: str = "passed",
         marker: str = "min_scene_coverage", inputs: dict[str, Any] | None = None,
         nodeid: str = NODE, threshold: float = 0.8) -> GateResult:
    return GateResult(nodeid=nodeid, marker=marker, metric="m", threshold=threshold, op=op, status=status,
                      value=value, bound=bound, passed=status == "passed", summary=f"{marker}: summary",
                      inputs=inputs if inputs is not None else {"scenarios": scenarios_role()})


def row(result: GateResult) -> dict[str, Any]:
    return json.loads(json.dumps(build_evidence([result], {"seed": 1})["gates"][0]))


# ------------------------------------------------------------------------------------- compare


@pytest.mark.parametrize("op, old, new, limit, status", [
    (">=", 0.934, 0.934, 0.02, "ok"),
    (">=", 0.934, 0.920, 0.02, "ok"),          # worse, within max_drop
    (">=", 0.934, 0.914, 0.02, "ok"),          # worse by exactly max_drop (float noise is not a regression)
    (">=", 0.934, 0.901, 0.02, "regressed"),
    (">=", 0.934, 0.901, None, "ok"),          # no limit: never regressed
    (">=", 0.901, 0.934, 0.02, "improved"),
    (">=", 0.901, 0.934, None, "improved"),
    ("<=", 0.010, 0.010, 0.005, "ok"),
    ("<=", 0.010, 0.014, 0.005, "ok"),          # higher is worse for <=, within max_rise
    ("<=", 0.010, 0.020, 0.005, "regressed"),
    ("<=", 0.010, 0.020, None, "ok"),
    ("<=", 0.020, 0.010, 0.005, "improved"),
    ("<=", 0.020, 0.010, 0.0, "improved"),
    (">=", 0.5, 0.49, 0.0, "regressed"),       # max_drop=0: any drop regresses
])
def test_compare_statuses_for_both_ops(op: str, old: float, new: float, limit: float | None, status: str) -> None:
    stored = row(gate(old, op=op))
    result = compare(gate(new, op=op), stored, limit)
    assert result["status"] == status
    assert result["status"] in BASELINE_STATUSES
    assert result["baseline_value"] == pytest.approx(old)
    assert result["value"] == pytest.approx(new)
    assert result["change"] == pytest.approx(new - old, abs=1e-12)
    assert result["limit"] == limit
    assert isinstance(result["message"], str) and "\n" not in result["message"]
    json.dumps(result, allow_nan=False)


def test_regressed_message_matches_the_documented_form() -> None:
    result = compare(gate(0.901), row(gate(0.934)), 0.02)
    assert result["message"] == "0.934 → 0.901 (−0.033, max_drop 0.02): regressed"
    rise = compare(gate(0.02, op="<="), row(gate(0.01, op="<=")), 0.005)
    assert rise["message"] == "0.010 → 0.020 (+0.010, max_rise 0.005): regressed"


def test_change_is_reported_without_a_limit() -> None:
    result = compare(gate(0.901), row(gate(0.934)), None)
    assert result["status"] == "ok"
    assert result["change"] == pytest.approx(-0.033)
    assert "no max_drop set" in result["message"] and "worse" in result["message"]


def test_the_bound_is_compared_when_present() -> None:
    stored = row(gate(0.05, op="<=", bound=0.10, marker="max_pmi_ub"))
    result = compare(gate(0.01, op="<=", bound=0.13, marker="max_pmi_ub"), stored, 0.02)
    assert result["baseline_value"] == pytest.approx(0.10)
    assert result["value"] == pytest.approx(0.13)
    assert result["change"] == pytest.approx(0.03)
    assert result["status"] == "regressed"  # the value improved, but the compared bound rose by 0.03


def test_missing_when_the_baseline_has_no_such_gate() -> None:
    result = compare(gate(0.9), None, 0.02)
    assert result["status"] == "missing"
    assert result["baseline_value"] is None and result["change"] is None
    assert "new" in result["message"]


def test_missing_when_this_run_has_no_number_unverifiable_when_the_baseline_has_none() -> None:
    errored = row(gate(None, status="error"))
    result = compare(gate(0.9), errored, 0.02)
    assert result["status"] == "unverifiable" and "error" in result["message"]
    assert "max_drop 0.02 is not applied" in result["message"]
    result = compare(gate(None, status="error"), row(gate(0.9)), 0.02)
    assert result["status"] == "missing" and result["baseline_value"] == pytest.approx(0.9)
    # evidence writes non-finite floats as strings (tests/report/test_baseline_hostile_rows.py has more)
    nan_row = row(gate(0.9))
    nan_row["value"] = "nan"
    assert compare(gate(0.9), nan_row, 0.02)["status"] == "unverifiable"


def test_inputs_changed_for_a_changed_yardstick_role_wins_over_regressed() -> None:
    model_gate = dict(model={"fixture": "model", "digest": D_MODEL_A}, data={"fixture": "dataset", "digest": D_DATA_A})
    stored = row(gate(0.9, marker="min_neuron_k_activation", inputs=model_gate))
    now = gate(0.5, marker="min_neuron_k_activation",
               inputs=dict(model={"fixture": "model", "digest": D_MODEL_A},
                           data={"fixture": "dataset", "digest": D_DATA_B}))
    result = compare(now, stored, 0.02)
    assert result["status"] == "inputs-changed"
    assert result["change"] == pytest.approx(-0.4)  # reported, not judged
    assert result["changed"] == [{"role": "data", "baseline": D_DATA_A, "current": D_DATA_B}]
    message = result["message"]
    assert "data" in message and "sha256:cccccccc…" in message and "sha256:dddddddd…" in message
    assert D_DATA_A not in message  # shortened


def test_a_changed_model_is_what_a_baseline_compares() -> None:
    """The model is a model gate's subject: a retrained model is compared, not refused."""
    stored = row(gate(0.9, marker="min_neuron_k_activation",
                      inputs=dict(model={"digest": D_MODEL_A}, data={"digest": D_DATA_A})))
    now = gate(0.85, marker="min_neuron_k_activation",
               inputs=dict(model={"digest": D_MODEL_B}, data={"digest": D_DATA_A}))
    assert compare(now, stored, 0.02)["status"] == "regressed"
    assert compare(now, stored, 0.1)["status"] == "ok"


def test_a_data_gate_compares_its_data_but_not_a_changed_condition_domain() -> None:
    stored = row(gate(0.9))
    fewer_rows = gate(0.7, inputs={"scenarios": scenarios_role(digest=D_SCEN_B)})
    assert subject_roles(fewer_rows.inputs) == {"scenarios"}
    assert compare(fewer_rows, stored, 0.02)["status"] == "regressed"
    other_domain = gate(0.7, inputs={"scenarios": scenarios_role(digest=D_SCEN_B, conditions_file=F_COND_B)})
    result = compare(other_domain, stored, 0.02)
    assert result["status"] == "inputs-changed"
    assert result["changed"] == [{"role": "scenarios", "setting": "conditions", "baseline": F_COND_A,
                                  "current": F_COND_B}]
    assert "scenarios (conditions file) sha256:eeeeeeee… → sha256:ffffffff…" in result["message"]


def test_a_changed_input_file_of_a_yardstick_role_is_inputs_changed() -> None:
    def data_role(file_digest: str) -> dict[str, Any]:
        return {"digest": D_DATA_A, "origin": {"settings": {"data": {"sha256": file_digest}}}}

    stored = row(gate(0.9, inputs={"model": {"digest": D_MODEL_A}, "data": data_role(F_COND_A)}))
    now = gate(0.9, inputs={"model": {"digest": D_MODEL_A}, "data": data_role(F_COND_B)})
    assert compare(now, stored, 0.02)["status"] == "inputs-changed"


def test_unknown_digests_and_roles_only_in_the_baseline_are_not_changes() -> None:
    stored = row(gate(0.9, inputs={"model": {"digest": D_MODEL_A}, "data": {"digest": None},
                                   "scenarios": scenarios_role()}))
    now = gate(0.9, inputs={"model": {"digest": D_MODEL_A}, "data": {"digest": D_DATA_A}})
    result = compare(now, stored, 0.02)
    assert result["status"] == "ok"
    assert result["unverified"] == ["data"]
    # a role this run read that the stored row does not record cannot be checked (issue #29 §3)
    now.inputs["scenarios"] = scenarios_role()
    del stored["inputs"]["scenarios"]
    result = compare(now, stored, 0.02)
    assert result["status"] == "unverifiable" and result["unverifiable"] == ["scenarios"]


def test_subject_can_be_overridden() -> None:
    stored = row(gate(0.9, inputs={"model": {"digest": D_MODEL_A}}))
    now = gate(0.9, inputs={"model": {"digest": D_MODEL_B}})
    assert compare(now, stored, 0.02)["status"] == "ok"
    assert compare(now, stored, 0.02, subject=())["status"] == "inputs-changed"


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit"):
        compare(gate(0.9), row(gate(0.9)), -0.1)


def test_format_change() -> None:
    assert format_change(0.012) == "+0.012"
    assert format_change(-0.033) == "−0.033"
    assert format_change(0.0) == "0.000"
    assert format_change(None) == "-"
    assert format_change(-2e-5) == "−2.000e-05"


# ------------------------------------------------------------------------------------- load / save


def evidence(*results: GateResult) -> dict[str, Any]:
    env = {"seed": 1, "inputs": {"scenarios": {"path": "x.csv", "digest": D_SCEN_A}}}
    return build_evidence(list(results), env)


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    a, b = gate(0.9), gate(0.01, op="<=", marker="max_pmi_ub", bound=0.02)
    path = save_baseline(tmp_path / "reports" / "base.json", evidence(a, b))
    assert path == tmp_path / "reports" / "base.json"
    assert not [p for p in path.parent.iterdir() if p.name != "base.json"]  # no temporary file left
    base = Baseline.load(path)
    assert base.lookup(NODE, "min_scene_coverage")["value"] == 0.9
    assert base.lookup(NODE, "max_pmi_ub")["bound"] == 0.02
    assert base.lookup(NODE, "max_neuron_k_activation") is None
    assert base.lookup("tests/other.py::t", "min_scene_coverage") is None
    assert base.environment["seed"] == 1
    assert compare(gate(0.9), base.lookup(NODE, "min_scene_coverage"), 0.02)["status"] == "ok"
    assert json.loads(path.read_text())["schema"] == "pytest-dnnsafety/1"


def test_an_evidence_file_written_by_dnnsafety_json_is_a_baseline(tmp_path: Path) -> None:
    from pytest_dnnsafety.report import write_evidence

    path = write_evidence(tmp_path / "e.json", evidence(gate(0.9)))
    assert Baseline.load(path).lookup(NODE, "min_scene_coverage") is not None


def test_save_refuses_something_that_is_not_evidence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not evidence"):
        save_baseline(tmp_path / "b.json", {"gates": []})
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("content, problem", [
    (None, "no such file"),
    ("", "not valid JSON"),
    ("{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "cannot be read"),
    ("[1, 2]", "expected a JSON object"),
    ('{"gates": []}', "not a pytest-dnnsafety evidence file"),
    ('{"schema": "pytest-benchmark/1", "gates": []}', "not a pytest-dnnsafety evidence file"),
    ('{"schema": "pytest-dnnsafety/99", "gates": []}', "save the baseline again"),
    ('{"schema": "pytest-dnnsafety/1"}', "'gates' list is missing"),
    ('{"schema": "pytest-dnnsafety/1", "gates": [{"nodeid": 1}]}', "gates[0] is not a gate row"),
])
def test_load_errors_name_the_file_and_the_fix(tmp_path: Path, content: Any, problem: str) -> None:
    path = tmp_path / "base.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        Baseline.load(path)
    message = str(info.value)
    assert str(path) in message
    assert problem in message
    assert "Fix:" in message and "--dnnsafety-save-baseline" in message


def test_load_refuses_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        Baseline.load(tmp_path)


def test_environment_changes(tmp_path: Path) -> None:
    base = Baseline.from_evidence(evidence(gate(0.9)), tmp_path / "b.json")
    assert base.environment_changes({"seed": 1, "inputs": {"scenarios": {"digest": D_SCEN_A}}}) == []
    lines = base.environment_changes({"seed": 2, "inputs": {"scenarios": {"digest": D_SCEN_B}}})
    assert lines == ["scenarios: sha256:aaaaaaaa… → sha256:bbbbbbbb…", "seed: 1 → 2"]


# ------------------------------------------------------------------------------------- rendering


def with_baseline(result: GateResult, comparison: dict[str, Any] | None) -> GateResult:
    result.baseline = comparison  # the field the gates engineer adds to GateResult
    return result


def test_terminal_table_has_no_change_column_without_baselines() -> None:
    lines = [text for text, _ in render_table([gate(0.9)])]
    assert "change" not in lines[0]


def test_terminal_table_change_column() -> None:
    old = row(gate(0.934))
    rows = [
        with_baseline(gate(0.946, nodeid="t.py::a"), compare(gate(0.946), old, 0.02)),
        with_baseline(gate(0.901, nodeid="t.py::b", status="failed"), compare(gate(0.901), old, 0.02)),
        with_baseline(gate(0.9, nodeid="t.py::c"), compare(gate(0.9), None, 0.02)),
        with_baseline(gate(0.5, nodeid="t.py::d"),
                      compare(gate(0.5, inputs={"scenarios": scenarios_role(conditions_file=F_COND_B)}), old, 0.02)),
        gate(0.9, nodeid="t.py::e"),  # not compared (e.g. a gate that errored before comparison)
    ]
    lines = [text for text, _ in render_table(rows)]
    head = lines[0].split()
    assert head == ["test", "metric", "value", "bound", "threshold", "change", "verdict"]
    by_test = {line.split()[0]: line for line in lines[2:]}
    assert by_test["a"].split()[-2:] == ["+0.012", "PASS"]
    assert by_test["b"].split()[-3:] == ["−0.033", "✗", "FAIL"]
    assert by_test["c"].split()[-2:] == ["new", "PASS"]
    assert by_test["d"].split()[-2:] == ["inputs≠", "PASS"]
    assert by_test["e"].split()[-2:] == ["0.800", "PASS"]
    # the verdict column stays aligned
    assert len({line.rindex(line.split()[-1]) for line in lines[2:]}) == 1
    notes = baseline_notes(rows)
    assert len(notes) == 2
    assert notes[0].startswith("  t.py::b [min_scene_coverage] baseline: 0.934 → 0.901 (−0.033, max_drop 0.02)")
    assert "inputs changed" in notes[1]


def test_change_cell() -> None:
    assert change_cell(None) == ""
    assert change_cell({"status": "missing", "baseline_value": 0.5, "change": None}) == "-"


def test_junit_gate_lines_append_the_comparison(tmp_path: Path) -> None:
    regressed = with_baseline(gate(0.901, status="failed"), compare(gate(0.901), row(gate(0.934)), 0.02))
    assert gate_line(regressed) == ("[dnnsafety] FAILED min_scene_coverage: summary | baseline: "
                                    "0.934 → 0.901 (−0.033, max_drop 0.02): regressed")
    assert gate_line(gate(0.9)) == "[dnnsafety] PASSED min_scene_coverage: summary"
    xml = tmp_path / "junit.xml"
    xml.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">'
                   '<testcase classname="tests.test_gates" name="test_cov" time="0.1"/></testsuite></testsuites>')
    assert patch_junit(xml, [regressed], {"dnnsafety.version": "x"}, testcase_properties=True) == 1
    case = ET.parse(xml).getroot().find(".//testcase")
    assert "max_drop 0.02): regressed" in case.find("system-out").text
    props = {p.get("name"): p.get("value") for p in case.find("properties")}
    assert props["dnnsafety.min_scene_coverage.baseline_status"] == "regressed"
    assert props["dnnsafety.min_scene_coverage.baseline_change"] == "-0.033"


# ------------------------------------------------------------------------------------- end to end
#
# These run the documented CLI (--dnnsafety-save-baseline, --dnnsafety-baseline, max_drop) through
# pytester; they pass once the gates compare with the baseline and the run saves it.


GATE_TESTS = """
    import pytest

    @pytest.mark.min_scene_coverage(0.1, k=2, max_drop=0.02)
    def test_cov(scenario_table):
        pass
"""

#: One row fewer than FIG2_SCENARIOS: 3 of 21 pairs instead of 6 (0.286 -> 0.143); still >= 0.1.
FEWER_SCENARIOS = """\
weather,road,orientation
sunny,stone,straight
"""

#: A larger weather domain: the yardstick changed.
MORE_CONDITIONS = """\
[conditions]
weather = ["sunny", "cloudy", "rainy", "snow"]
road = ["stone", "mud", "tarmac"]
orientation = ["straight", "curvy"]
"""


def evidence_gate(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["gates"][0]


@pytest.mark.slow
def test_save_then_compare_unchanged_passes(gate_project) -> None:
    gate_project.tests(GATE_TESTS)
    first = gate_project.run("--dnnsafety-save-baseline=base.json")
    first.assert_outcomes(passed=1)
    base = gate_project.pytester.path / "base.json"
    assert Baseline.load(base).lookup("test_gates.py::test_cov", "min_scene_coverage")["value"] == pytest.approx(
        6 / 21)
    second = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=e.json")
    second.assert_outcomes(passed=1)
    second.stdout.re_match_lines([r"\s+test_cov\s+min_scene_coverage\s+0\.286\s+-\s+≥ 0\.100\s+0\.000\s+PASS"])
    comparison = evidence_gate(gate_project.pytester.path / "e.json")["baseline"]
    assert comparison["status"] == "ok" and comparison["change"] == 0


@pytest.mark.slow
def test_a_worse_run_fails_on_max_drop_although_its_threshold_passes(gate_project) -> None:
    gate_project.tests(GATE_TESTS)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    gate_project.write("data/scenarios.csv", FEWER_SCENARIOS)
    result = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=e.json",
                              "--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*0.286 → 0.143 (−0.143, max_drop 0.02): regressed*"])
    result.stdout.re_match_lines([r"\s+test_cov\s+min_scene_coverage\s+0\.143\s+-\s+≥ 0\.100\s+−0\.143 ✗\s+FAIL"])
    row_ = evidence_gate(gate_project.pytester.path / "e.json")
    assert row_["value"] == pytest.approx(3 / 21) and row_["value"] >= row_["threshold"]
    assert row_["status"] == "failed" and row_["baseline"]["status"] == "regressed"
    out = ET.parse(gate_project.pytester.path / "junit.xml").getroot().find(".//testcase/system-out").text
    assert "baseline: 0.286 → 0.143 (−0.143, max_drop 0.02): regressed" in out
    # without the baseline the same run passes: the regression alone failed it
    gate_project.run().assert_outcomes(passed=1)


@pytest.mark.slow
def test_changed_conditions_are_reported_as_inputs_changed_not_compared(gate_project) -> None:
    gate_project.tests(GATE_TESTS)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    gate_project.write("data/conditions.toml", MORE_CONDITIONS)
    result = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1)  # 6/26 pairs >= 0.1, and a changed yardstick is never a regression
    result.stdout.re_match_lines([r"\s+test_cov\s+min_scene_coverage\s+0\.231\s+.*inputs≠\s+PASS"])
    comparison = evidence_gate(gate_project.pytester.path / "e.json")["baseline"]
    assert comparison["status"] == "inputs-changed"
    assert comparison["changed"][0]["role"] == "scenarios" and comparison["changed"][0]["setting"] == "conditions"
    assert "inputs changed" in comparison["message"]


@pytest.mark.slow
def test_a_gate_missing_from_the_baseline_is_new(gate_project) -> None:
    gate_project.tests(GATE_TESTS)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    gate_project.tests(GATE_TESTS.replace("test_cov", "test_other"))
    result = gate_project.run("--dnnsafety-baseline=base.json")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"\s+test_other\s+.*\s+new\s+PASS"])


@pytest.mark.slow
def test_a_missing_baseline_file_fails_the_run_naming_the_fix(gate_project) -> None:
    gate_project.tests(GATE_TESTS)
    result = gate_project.run("--dnnsafety-baseline=nope.json")
    assert result.ret != 0
    text = result.stdout.str() + result.stderr.str()
    assert "nope.json" in text and "no such file" in text and "--dnnsafety-save-baseline" in text
