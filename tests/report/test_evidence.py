"""The JSON evidence, field by field, for the verdicts that are not a plain comparison.

Lost gates (a crashed xdist worker), errors (a measure that raised, a fixture that failed), not
evaluated (skipped tests, a run stopped by -x), inconclusive and contradiction (a test-only dummy
gate), what each gate evaluated (``inputs``: fixture, origin, content digest), optional fixture
roles, and the evidence file's lifecycle (bad path at start, stale file, failed write).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from xml.etree import ElementTree

from conftest import FIG2_SCENARIOS, GateProject
from pytest_dnnsafety.gates import GATES

#: A conftest.py registering ``dummy_gate`` (threshold >= value), whose ``mode`` decides what it measures.
DUMMY_GATE = '''
import pytest
from pytest_dnnsafety.gates import GateDef, Param, register_gate
from pytest_dnnsafety.results import Measurement


def _measure(spec, fx, ctx):
    mode = spec.options["mode"]
    if mode == "raise":
        raise ValueError("the model exploded on batch 0")
    if mode == "inconclusive":
        return Measurement(0.9, inconclusive="fewer than 30 samples per cell")
    if mode == "contradiction":
        return Measurement(0.9, bound=0.8, contradiction="the upper bound 0.8 is below the estimate 0.9")
    return Measurement(0.9, details={"roles": sorted(fx)})


register_gate(GateDef(
    marker="dummy_gate", metric="dummy metric", op=">=", threshold_range=(0.0, 1.0),
    params=(Param("mode", (str,), "ok"),),
    fixtures={"model": "model"}, measure=_measure, doc="a test-only gate",
), replace=True)

register_gate(GateDef(
    marker="dummy_optional", metric="dummy metric", op=">=", threshold_range=(0.0, 1.0),
    params=(Param("mode", (str,), "ok"),),
    fixtures={"scenarios": "scenario_table", "data": "dataset"}, optional={"data": "data"},
    measure=_measure, doc="a test-only gate with an optional data role",
), replace=True)
'''

OVERRIDE_MODEL = '''
import os
import torch


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight[0, 0] = float(os.environ.get("WEIGHT", "0.5"))
    return net
'''


@pytest.fixture(autouse=True)
def _restore_gates():
    """In-process runs register dummy gates in this process's GATES; take them out again."""
    saved = dict(GATES)
    yield
    GATES.clear()
    GATES.update(saved)


def _evidence(project: GateProject, name: str = "e.json") -> dict[str, Any]:
    return json.loads((project.pytester.path / name).read_text())


def _gates(evidence: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["nodeid"].split("::")[-1]: g for g in evidence["gates"]}


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------- lost, error, not run


CRASH = """
import os
import pytest

@pytest.fixture
def boom():
    if WHERE == "setup":
        os._exit(3)

@pytest.mark.min_scene_coverage(0.25, k=2)
def test_crash(scenario_table, boom):
    os._exit(3)

@pytest.mark.min_scene_coverage(0.1)
def test_fine(scenario_table):
    pass
"""


@pytest.mark.parametrize("where", ["body", "setup"])
def test_crashed_worker_gate_is_lost_with_its_threshold(gate_project: GateProject, where: str) -> None:
    """``setup``: the worker dies before its first report; the gate plan comes from the other worker."""
    gate_project.tests(f"WHERE = {where!r}\n" + CRASH)
    result = gate_project.run("-n", "2", "--dnnsafety-json=e.json", "--junitxml=j.xml", "-p", "no:faulthandler")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    evidence = _evidence(gate_project)
    crash = _gates(evidence)["test_crash"]
    assert crash["status"] == "lost"
    assert crash["threshold"] == 0.25 and crash["op"] == ">="
    assert crash["metric"] == "scenario k-projection coverage"
    assert crash["passed"] is None and crash["value"] is None
    assert "worker" in crash["details"]["reason"] and "crashed" in crash["details"]["reason"]
    assert crash["summary"].startswith("min_scene_coverage: lost (")
    assert evidence["lost"] == ["test_gates.py::test_crash"]
    assert evidence["summary"]["lost"] == 1 and evidence["summary"]["passed"] == 1
    assert _gates(evidence)["test_fine"]["status"] == "passed"
    result.stdout.fnmatch_lines(["*test_crash*min_scene_coverage*0.250*LOST",
                                 "*1 gated test(s) never reported a result*test_crash*"])
    junit = (gate_project.pytester.path / "j.xml").read_text()
    assert "[dnnsafety] LOST min_scene_coverage: lost" in junit


def test_measure_that_raises_is_an_error_with_type_message_and_traceback(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", DUMMY_GATE + OVERRIDE_MODEL)
    gate_project.tests("""
        import pytest

        @pytest.mark.dummy_gate(0.5, mode="raise")
        def test_raises(model):
            pass
    """)
    result = gate_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*dummy_gate: error while computing dummy metric: ValueError: the model exploded on batch 0*"])
    assert "setup failed" not in result.stdout.str()
    gate = _gates(_evidence(gate_project))["test_raises"]
    assert gate["status"] == "error" and gate["passed"] is None
    assert gate["threshold"] == 0.5
    assert gate["details"]["error_type"] == "ValueError"
    assert gate["details"]["error"] == "the model exploded on batch 0"
    assert any("conftest.py" in frame and "_measure" in frame for frame in gate["details"]["traceback"])


def test_gate_fixture_that_fails_is_an_error_naming_the_fixture(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest

        @pytest.fixture(scope="session")
        def scenario_table():
            raise RuntimeError("scenario database unreachable")
    """)
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.3)
        def test_one(scenario_table):
            pass

        @pytest.mark.min_scene_coverage(0.4)
        def test_two():
            pass
    """)
    result = gate_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(errors=2)
    gates = _gates(_evidence(gate_project))
    for name, threshold in (("test_one", 0.3), ("test_two", 0.4)):  # the second hits pytest's cached error
        gate = gates[name]
        assert gate["status"] == "error" and gate["threshold"] == threshold
        assert gate["details"]["fixture"] == "scenario_table"
        assert gate["details"]["error_type"] == "RuntimeError"
        assert gate["details"]["error"] == "scenario database unreachable"
        assert "fixture 'scenario_table' failed: scenario database unreachable" in gate["summary"]


def test_skipped_tests_are_not_evaluated_with_their_threshold(gate_project: GateProject) -> None:
    gate_project.tests("""
        import pytest

        @pytest.mark.skip(reason="no GPU today")
        @pytest.mark.min_scene_coverage(0.25)
        def test_marked_skip(scenario_table):
            pass

        @pytest.mark.min_scene_coverage(0.75, k=1)
        def test_skips_in_body(scenario_table):
            pytest.skip("data not ready")
    """)
    result = gate_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(skipped=2)
    evidence = _evidence(gate_project)
    gates = _gates(evidence)
    marked, body = gates["test_marked_skip"], gates["test_skips_in_body"]
    assert marked["status"] == body["status"] == "not-evaluated"
    assert marked["details"]["reason"] == body["details"]["reason"] == "test skipped"
    assert marked["details"]["message"] == "no GPU today"
    assert body["details"]["message"] == "data not ready"
    assert marked["threshold"] == 0.25 and body["threshold"] == 0.75
    assert marked["passed"] is None and marked["value"] is None
    assert evidence["summary"]["not-evaluated"] == 2 and evidence["lost"] == []
    assert "nan" not in json.dumps(evidence["gates"])
    result.stdout.fnmatch_lines(["*test_marked_skip*min_scene_coverage*0.250*NOT RUN"])


def test_gates_after_a_stop_are_not_evaluated(gate_project: GateProject) -> None:
    gate_project.tests("""
        import pytest

        def test_first():
            assert False

        @pytest.mark.min_scene_coverage(0.6)
        def test_never_reached(scenario_table):
            pass
    """)
    result = gate_project.run("-x", "--dnnsafety-json=e.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    gate = _gates(_evidence(gate_project))["test_never_reached"]
    assert gate["status"] == "not-evaluated" and gate["threshold"] == 0.6
    assert gate["details"]["reason"] == "run stopped before this test"
    result.stdout.fnmatch_lines(["*test_never_reached*min_scene_coverage*0.600*NOT RUN"])


# ---------------------------------------------------------------------------------- inconclusive, contradiction


def test_inconclusive_and_contradiction_fail_and_say_why(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", DUMMY_GATE + OVERRIDE_MODEL)
    gate_project.tests("""
        import pytest

        @pytest.mark.dummy_gate(0.5, mode="inconclusive")
        def test_inconclusive(model):
            pass

        @pytest.mark.dummy_gate(0.1, mode="contradiction")
        def test_contradiction(model):
            pass

        @pytest.mark.dummy_gate(0.5)
        def test_ok(model):
            pass
    """)
    result = gate_project.run("--dnnsafety-json=e.json", "--junitxml=j.xml")
    result.assert_outcomes(passed=1, failed=2)
    evidence = _evidence(gate_project)
    gates = _gates(evidence)
    inc = gates["test_inconclusive"]
    assert inc["status"] == "inconclusive" and inc["passed"] is False
    assert inc["value"] == 0.9 and inc["threshold"] == 0.5
    assert inc["details"]["inconclusive"] == "fewer than 30 samples per cell"
    assert inc["summary"].startswith("dummy_gate: inconclusive: fewer than 30 samples per cell")
    con = gates["test_contradiction"]
    assert con["status"] == "failed" and con["passed"] is False  # 0.8 >= 0.1 would have passed
    assert con["bound"] == 0.8
    assert con["details"]["contradiction"] == "the upper bound 0.8 is below the estimate 0.9"
    assert "contradiction: the upper bound 0.8 is below the estimate 0.9" in con["summary"]
    assert gates["test_ok"]["status"] == "passed"
    assert evidence["summary"] == {"passed": 1, "failed": 1, "error": 0, "not-evaluated": 0, "inconclusive": 1,
                                   "lost": 0, "total": 3}
    result.stdout.fnmatch_lines(["*test_inconclusive*dummy_gate*0.900*INCONCLUSIVE"])
    root = ElementTree.parse(gate_project.pytester.path / "j.xml").getroot()
    case = root.find(".//testcase[@name='test_inconclusive']")
    assert "[dnnsafety] INCONCLUSIVE dummy_gate: inconclusive" in case.findtext("system-out")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["dnnsafety.gates_inconclusive"] == "1" and props["dnnsafety.gates_failed"] == "1"


# ---------------------------------------------------------------------------------- inputs: what was evaluated


def test_overridden_model_is_named_with_file_line_and_parameter_digest(gate_project: GateProject,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    conftest = gate_project.write("conftest.py", DUMMY_GATE + OVERRIDE_MODEL)
    gate_project.ini["dnnsafety_model"] = "models/ignored.pt"  # configured, but the conftest fixture wins
    gate_project.tests("""
        import pytest
        import torch

        @pytest.mark.dummy_gate(0.5)
        def test_model(model):
            with torch.no_grad():  # mutated after loading: the evidence keeps the digest taken at load
                model.weight.add_(1.0)
    """)
    digests = []
    for weight in ("0.5", "0.25"):
        monkeypatch.setenv("WEIGHT", weight)
        gate_project.run("--dnnsafety-json=e.json").assert_outcomes(passed=1)
        evidence = _evidence(gate_project)
        entry = _gates(evidence)["test_model"]["inputs"]["model"]
        assert entry["fixture"] == "model"
        origin = entry["origin"]
        assert origin["kind"] == "user fixture" and origin["file"] == "conftest.py"
        line = next(i for i, text in enumerate(conftest.read_text().splitlines(), 1) if text.startswith("@pytest"))
        assert origin["line"] == line
        assert entry["type"] == "torch.nn.modules.linear.Linear"
        assert entry["digest"].startswith("sha256:") and entry["tensors"] == 2
        assert entry["taken"] == "at fixture setup"
        # the configured file is still listed, but only as configuration
        assert evidence["environment"]["inputs"]["model"]["spec"] == "models/ignored.pt"
        digests.append(entry["digest"])
        torch = pytest.importorskip("torch")
        from pytest_dnnsafety.files.provenance import fingerprint

        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        with torch.no_grad():
            net.weight[0, 0] = float(weight)
        assert entry["digest"] == fingerprint(net)["digest"]  # before the test body's mutation
    assert digests[0] != digests[1]


def test_plugin_fixture_inputs_name_the_setting_and_file_digest(gate_project: GateProject) -> None:
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.25)
        def test_cov(scenario_table):
            pass
    """)
    gate_project.run("--dnnsafety-json=e.json").assert_outcomes(passed=1)
    entry = _gates(_evidence(gate_project))["test_cov"]["inputs"]["scenarios"]
    assert entry["fixture"] == "scenario_table" and entry["origin"]["kind"] == "plugin fixture"
    settings = entry["origin"]["settings"]
    csv = gate_project.pytester.path / "data/scenarios.csv"
    assert settings["scenarios"]["sha256"] == _sha256(csv)
    assert settings["scenarios"]["source"].startswith("ini option dnnsafety_scenarios in ")
    assert settings["scenarios"]["path"] == str(csv)
    assert settings["conditions"]["sha256"] == _sha256(gate_project.pytester.path / "data/conditions.toml")
    assert entry["type"] == "pytest_dnnsafety.scenarios.table.ScenarioTable"
    assert entry["digest"].startswith("sha256:") and entry["rows"] == len(FIG2_SCENARIOS.splitlines()) - 1


# ---------------------------------------------------------------------------------- optional fixture roles


def test_optional_role_requested_only_when_named_configured_or_overridden(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", DUMMY_GATE + """
import torch


@pytest.fixture(scope="session")
def my_data():
    return (torch.zeros(2, 3), torch.tensor([0, 1]))
""")
    gate_project.write("sub/conftest.py", """
        import pytest
        import torch

        @pytest.fixture(scope="session")
        def dataset():
            return torch.utils.data.TensorDataset(torch.ones(2, 3), torch.tensor([1, 0]))
    """)
    source = """
        import pytest

        @pytest.mark.dummy_optional(0.5)
        def test_default(scenario_table):
            pass

        @pytest.mark.dummy_optional(0.5, data="my_data")
        def test_named():
            pass
    """
    gate_project.tests(source)
    gate_project.write("sub/test_sub.py", source.replace("test_default", "test_overridden")
                       .replace("test_named", "test_named_sub"))
    result = gate_project.run("--dnnsafety-json=e.json")  # no dnnsafety_data: requesting `dataset` would fail
    result.assert_outcomes(passed=4)
    gates = _gates(_evidence(gate_project))
    assert gates["test_default"]["details"]["roles"] == ["scenarios"]
    assert set(gates["test_default"]["inputs"]) == {"scenarios"}
    assert gates["test_named"]["details"]["roles"] == ["data", "scenarios"]
    assert gates["test_named"]["inputs"]["data"]["fixture"] == "my_data"
    assert gates["test_overridden"]["details"]["roles"] == ["data", "scenarios"]
    data = gates["test_overridden"]["inputs"]["data"]
    assert data["fixture"] == "dataset" and data["origin"]["file"] == "sub/conftest.py"
    assert data["type"] == "torch.utils.data.dataset.TensorDataset" and data["rows"] == 2


def test_optional_role_requested_when_its_setting_is_configured(gate_project: GateProject) -> None:
    np = pytest.importorskip("numpy")
    gate_project.write("conftest.py", DUMMY_GATE)
    np.savez(gate_project.pytester.path / "data/eval.npz", x=np.zeros((2, 3), dtype="float32"), y=np.array([0, 1]))
    gate_project.ini["dnnsafety_data"] = "data/eval.npz"
    gate_project.tests("""
        import pytest

        @pytest.mark.dummy_optional(0.5)
        def test_configured(scenario_table):
            pass
    """)
    gate_project.run("--dnnsafety-json=e.json").assert_outcomes(passed=1)
    gate = _gates(_evidence(gate_project))["test_configured"]
    assert gate["details"]["roles"] == ["data", "scenarios"]
    data = gate["inputs"]["data"]
    assert data["origin"]["kind"] == "plugin fixture"
    assert data["origin"]["settings"]["data"]["sha256"] == _sha256(gate_project.pytester.path / "data/eval.npz")


# ---------------------------------------------------------------------------------- the evidence file


GATED = """
    import pytest

    @pytest.mark.min_scene_coverage(0.25)
    def test_cov(scenario_table):
        pass
"""


def test_json_path_that_is_a_directory_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    (gate_project.pytester.path / "out").mkdir()
    result = gate_project.run("--dnnsafety-json=out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_json='out' (from command-line option --dnnsafety-json)*"
                                 "is a directory. Fix: give a writable file path*"])
    result.stdout.no_fnmatch_line("*test_cov*PASS*")


def test_json_path_that_cannot_be_written_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    gate_project.write("blocker", "a file, not a folder")
    gate_project.ini["dnnsafety_json"] = "blocker/e.json"
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_json='blocker/e.json' (from ini option dnnsafety_json in *)"
                                 "*cannot be written*Fix:*"])


def test_stale_evidence_is_removed_at_start(gate_project: GateProject) -> None:
    stale = gate_project.write("out/e.json", '{"schema": "pytest-dnnsafety/1", "gates": "from an old run"}')
    gate_project.tests(GATED + """
    def test_no_stale_file_while_running():  # the file is this run's own, written as its gates finish
        import json
        evidence = json.load(open("out/e.json"))
        assert evidence["complete"] is False and evidence["gates"][0]["nodeid"].endswith("test_cov")
    """)
    gate_project.run("--dnnsafety-json=out/e.json").assert_outcomes(passed=2)
    assert json.loads(stale.read_text())["gates"][0]["status"] == "passed"
    assert json.loads(stale.read_text())["complete"] is True
    assert sorted(p.name for p in stale.parent.iterdir()) == ["e.json"]


def test_failed_write_keeps_the_summary_fails_the_run_and_leaves_no_tmp(gate_project: GateProject) -> None:
    gate_project.tests(GATED + """
    def test_turns_the_target_into_a_folder():
        import os
        os.remove("out/e.json")  # the evidence written as test_cov finished
        os.mkdir("out/e.json")
    """)
    result = gate_project.run("--dnnsafety-json=out/e.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*= dependability gates =*",
        "*test_cov*min_scene_coverage*PASS",
        "*dependability evidence NOT written to *e.json: IsADirectoryError*the run fails*",
    ])
    assert sorted(p.name for p in (gate_project.pytester.path / "out").iterdir()) == ["e.json"]
