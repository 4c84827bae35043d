"""The plugin end to end, through pytester: gates, terminal section, JSON evidence, JUnit, xdist."""

from __future__ import annotations

import json
import sys
from xml.etree import ElementTree

import pytest

from conftest import JUNIT_XSD, GateProject

GATES = """
import pytest

@pytest.mark.min_scene_coverage(0.25, k=2)
def test_reaches(scenario_table):
    \"\"\"6/21 = 0.286 >= 0.25.\"\"\"

@pytest.mark.min_scene_coverage(0.5)
def test_misses(scenario_table):
    \"\"\"6/21 < 0.5.\"\"\"

@pytest.mark.min_scene_coverage(1.0, k=1)
def test_single_values(scenario_table):
    \"\"\"k=1: 6 of 8 values seen.\"\"\"

def test_plain_assertion(scenario_table):
    assert scenario_table.coverage(k=2).covered == 6

@pytest.mark.min_scene_coverage(0.1)
def test_body_fails(scenario_table):
    assert False, "the body failed first"
"""

MODES = [
    pytest.param(False, (), id="inprocess"),
    pytest.param(False, ("-n", "2"), id="inprocess-xdist"),
    pytest.param(True, (), id="subprocess"),
    pytest.param(True, ("-n", "2"), id="subprocess-xdist"),
]


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    return result.parseoutcomes()


@pytest.mark.parametrize(("subprocess", "extra"), MODES)
def test_gates_pass_fail_and_report_everywhere(gate_project: GateProject, subprocess: bool, extra: tuple) -> None:
    gate_project.tests(GATES)
    result = gate_project.run("-W", "error", "--dnnsafety-json=out/evidence.json", "--junitxml=out/junit.xml",
                              *extra, subprocess=subprocess)
    outcomes = _outcomes(result)
    assert outcomes.get("passed") == 2 and outcomes.get("failed") == 3, result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    for line in [  # one at a time: under xdist the failures come in any order
        "*min_scene_coverage: 0.286 < 0.500 (k=2, 6/21 cells; uncovered: *",
        "*min_scene_coverage: 0.750 < 1.000 (k=1, 6/8 cells; uncovered: *",
    ]:
        result.stdout.fnmatch_lines([line])
    result.stdout.fnmatch_lines([
        "*= dependability gates =*",
        "pytest-dnnsafety * | torch * | device cpu | seed 1234*",
        "*test_reaches*min_scene_coverage*0.286*PASS",
        "*test_misses*min_scene_coverage*0.286*FAIL",
        "*test_body_fails*min_scene_coverage*NOT RUN",
    ])
    evidence = json.loads((gate_project.pytester.path / "out/evidence.json").read_text())
    assert evidence["summary"] == {"passed": 1, "failed": 2, "error": 0, "not-evaluated": 1, "inconclusive": 0,
                                   "lost": 0, "total": 4}
    assert evidence["environment"]["seed"] == 1234
    assert evidence["environment"]["workers"] == (2 if extra else 0)
    assert {g["nodeid"].split("::")[1] for g in evidence["gates"]} == {
        "test_reaches", "test_misses", "test_single_values", "test_body_fails"}
    assert (gate_project.pytester.path / "out/junit.xml").is_file()


def test_evidence_json_field_by_field(gate_project: GateProject) -> None:
    gate_project.tests(GATES)
    gate_project.run("--dnnsafety-json=evidence.json")
    evidence = json.loads((gate_project.pytester.path / "evidence.json").read_text())
    assert evidence["schema"] == "pytest-dnnsafety/1"
    env = evidence["environment"]
    assert env["pytest_dnnsafety"] and env["torch"].startswith("2.") and env["device"] == "cpu"
    assert env["python"] == sys.version.split()[0]
    assert env["inputs"]["scenarios"]["digest"].startswith("sha256:")
    assert env["inputs"]["conditions"]["source"].startswith("ini option dnnsafety_conditions in ")
    gates = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
    reach = gates["test_reaches"]
    assert reach["marker"] == "min_scene_coverage"
    assert reach["metric"] == "scenario k-projection coverage"
    assert reach["value"] == pytest.approx(6 / 21)
    assert reach["threshold"] == 0.25 and reach["op"] == ">=" and reach["passed"] is True
    assert reach["status"] == "passed" and reach["bound"] is None and reach["device"] == "cpu"
    details = reach["details"]
    assert details["covered"] == 6 and details["total"] == 21 and details["k"] == 2
    assert len(details["uncovered"]) == 15
    assert {"weather": "cloudy", "road": "stone"} in details["uncovered"]
    miss = gates["test_misses"]
    assert miss["passed"] is False and miss["status"] == "failed"
    assert miss["summary"].startswith("min_scene_coverage: 0.286 < 0.500 (k=2, 6/21 cells; uncovered: ")
    body = gates["test_body_fails"]
    assert body["status"] == "not-evaluated" and body["passed"] is None and body["value"] is None


@pytest.mark.parametrize("extra", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_junit_is_schema_valid_with_suite_properties_and_gate_output(gate_project: GateProject, extra: tuple) -> None:
    junitparser = pytest.importorskip("junitparser")
    xmlschema = pytest.importorskip("xmlschema")
    gate_project.tests(GATES)
    gate_project.run("--junitxml=junit.xml", *extra)
    path = gate_project.pytester.path / "junit.xml"
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    xml = junitparser.JUnitXml.fromfile(str(path))
    suites = list(xml) if isinstance(xml, junitparser.JUnitXml) else [xml]
    suite = suites[0]
    props = {p.name: p.value for p in suite.properties()}
    assert props["dnnsafety.seed"] == "1234" and props["dnnsafety.device"] == "cpu"
    assert props["dnnsafety.gates"] == "4" and props["dnnsafety.gates_passed"] == "1"
    cases = {case.name: case for case in suite}
    assert "[dnnsafety] PASSED min_scene_coverage: 0.286 >= 0.250" in cases["test_reaches"].system_out
    assert "[dnnsafety] FAILED min_scene_coverage: 0.286 < 0.500" in cases["test_misses"].system_out
    assert cases["test_plain_assertion"].system_out in (None, "")
    raw = path.read_text()
    assert raw.count("<properties>") == 1, "no per-testcase <properties> by default"


def test_junit_testcase_properties_only_when_asked(gate_project: GateProject) -> None:
    junitparser = pytest.importorskip("junitparser")
    gate_project.tests(GATES)
    gate_project.ini["dnnsafety_junit_properties"] = "true"
    gate_project.run("--junitxml=junit.xml")
    path = gate_project.pytester.path / "junit.xml"
    suite = next(iter(junitparser.JUnitXml.fromfile(str(path))))
    assert {case.name for case in suite} >= {"test_reaches", "test_misses"}
    case = ElementTree.parse(path).find(".//testcase[@name='test_reaches']")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["dnnsafety.min_scene_coverage.value"] == "0.286"
    assert props["dnnsafety.min_scene_coverage.status"] == "passed"


def test_markers_are_registered_for_strict_markers(gate_project: GateProject) -> None:
    gate_project.tests(GATES)
    result = gate_project.run("--strict-markers", "-W", "error")
    assert _outcomes(result).get("passed") == 2
    listing = gate_project.run("--markers")
    listing.stdout.fnmatch_lines(["@pytest.mark.min_scene_coverage(threshold, k=2, min_count=1, where=None, *"])


def test_fixture_override_in_conftest_and_marker_fixture_keyword(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest
        from pytest_dnnsafety import Conditions, ScenarioTable

        @pytest.fixture(scope="session")
        def night_table():
            conditions = Conditions({"light": ["day", "night"], "rain": ["no", "yes"]})
            return ScenarioTable(conditions, [{"light": "night", "rain": "no"}, {"light": "day", "rain": "yes"}])
    """)
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.5, scenarios="night_table")
        def test_own_table():
            pass
    """)
    result = gate_project.run("-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_own_table*min_scene_coverage*0.500*PASS"])


def test_where_narrows_rows_and_domain(gate_project: GateProject) -> None:
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(1.0, k=1, where={"weather": "sunny"})
        def test_sunny(scenario_table):
            pass
    """)
    result = gate_project.run()
    # sunny rows: one row -> k=1 cells: weather(sunny) 1/1, road 1/3, orientation 1/2 => 3/6
    result.stdout.fnmatch_lines(["*min_scene_coverage: 0.500 < 1.000 (k=1, where weather=sunny, 3/6 cells*"])


def test_gate_that_never_reports_fails_the_run(gate_project: GateProject) -> None:
    """A report losing its gate results (as when a worker dies) must not give exit 0."""
    gate_project.write("conftest.py", """
        import pytest

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_makereport(item, call):
            report = yield
            report.__dict__.pop("dnnsafety_gates", None)
            return report
    """)
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.1)
        def test_gate(scenario_table):
            pass
    """)
    result = gate_project.run()
    assert _outcomes(result).get("passed") == 1
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*1 gated test(s) never reported a result*"])


def test_crashed_xdist_worker_fails_the_run(gate_project: GateProject) -> None:
    gate_project.tests("""
        import os
        import pytest

        @pytest.mark.min_scene_coverage(0.1)
        def test_crash(scenario_table):
            os._exit(3)

        @pytest.mark.min_scene_coverage(0.1)
        def test_fine(scenario_table):
            pass
    """)
    result = gate_project.run("-n", "2", "--dnnsafety-json=e.json", "-p", "no:faulthandler")
    assert result.ret != pytest.ExitCode.OK
    evidence = json.loads((gate_project.pytester.path / "e.json").read_text())
    statuses = {g["nodeid"].split("::")[1]: g["status"] for g in evidence["gates"]}
    assert statuses == {"test_crash": "lost", "test_fine": "passed"}


def test_plugin_import_does_not_import_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="""
        import sys

        def test_no_torch():
            assert "torch" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    out = pytester.run(sys.executable, "-c",
                       "import sys, pytest_dnnsafety, pytest_dnnsafety.plugin.hooks; print('torch' in sys.modules)")
    assert out.stdout.lines[-1] == "False"


def test_junit_gate_output_reaches_classes_and_parametrized_tests(gate_project: GateProject) -> None:
    xmlschema = pytest.importorskip("xmlschema")
    gate_project.write("sub/test_nested.py", """
        import pytest

        class TestGroup:
            @pytest.mark.min_scene_coverage(0.1)
            @pytest.mark.parametrize("k", [1, 2])
            def test_param(self, scenario_table, k):
                pass
    """)
    gate_project.run("--junitxml=junit.xml", "-o", "junit_suite_name=dnn", "--junitprefix=pre")
    path = gate_project.pytester.path / "junit.xml"
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    cases = ElementTree.parse(path).findall(".//testcase")
    assert {(c.get("classname"), c.get("name")) for c in cases} == {
        ("pre.sub.test_nested.TestGroup", "test_param[1]"), ("pre.sub.test_nested.TestGroup", "test_param[2]")}
    assert all("[dnnsafety] PASSED min_scene_coverage" in (c.findtext("system-out") or "") for c in cases)


def test_gate_marker_added_by_a_conftest_hook_is_validated_and_runs(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                item.add_marker(pytest.mark.min_scene_coverage(0.5))
    """)
    gate_project.tests("""
        def test_gets_a_gate(scenario_table):
            pass
    """)
    result = gate_project.run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*min_scene_coverage: 0.286 < 0.500*"])
