"""Crashes that must end as clear errors, and output paths checked at start (issue #19, items 5 and 6).

* A ``conftest.py`` implementing this plugin's hooks with ``pytest_dnnsafety.hookimpl`` works when
  the plugin is disabled (``-p no:dnnsafety``): the marker makes them optional hooks.
* No file the plugin reads ends pytest in a RecursionError (or an INTERNALERROR): a baseline nested
  very deep, a severity or conditions TOML built as a recursion bomb.
* Output paths are checked before anything runs: two outputs on one file, an output on the
  baseline, a gate's ``cells_file`` that is a link, a folder, under a file, or one of the outputs.
* ``--dnnsafety-threads=100000`` / ``OMP_NUM_THREADS=100000`` are capped at the usable cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import GateProject
from pytest_dnnsafety.runtime import threads
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.parsing import MAX_DEPTH, TooDeep, check_depth, loads_json, loads_toml

ROOT = Path(__file__).resolve().parents[2]

#: A conftest that uses the plugin's hooks the documented way, and a pytest hook through the same marker.
HOOK_CONFTEST = """
from pytest_dnnsafety import GateDef, Measurement, hookimpl

GATE = GateDef(marker="always_one", metric="one", op=">=", threshold_range=(0.0, 1.0), params=(),
               fixtures={}, measure=lambda spec, fx, ctx: Measurement(1.0), doc="measures 1")


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(GATE)


@hookimpl(tryfirst=True)
def pytest_dnnsafety_gate_result(result, config):
    print("RESULT", result.marker)


@hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "always_one(threshold): registered by hand for -p no:dnnsafety")
"""

GATED = """
import pytest

@pytest.mark.min_scene_coverage(0.25)
def test_cov(scenario_table):
    pass
"""

# ---------------------------------------------------------------------------------- hooks, plugin disabled


@pytest.mark.parametrize("strict", [False, True])
def test_conftest_hooks_work_with_the_plugin_disabled(gate_project: GateProject, strict: bool) -> None:
    gate_project.write("conftest.py", HOOK_CONFTEST)
    gate_project.tests("import pytest\n\n@pytest.mark.always_one(0.5)\ndef test_plain():\n    pass\n")
    result = gate_project.run("-p", "no:dnnsafety", *(["--strict-markers"] if strict else []))
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=1)
    # and with the plugin: the same conftest registers its gate and gets its result
    result = gate_project.run("-s", *(["--strict-markers"] if strict else []))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*RESULT always_one*"])


def test_hookimpl_keeps_pytest_hooks_checked_and_its_own_optional() -> None:
    from pytest_dnnsafety import hookimpl

    def pytest_dnnsafety_register_gates(registry):  # noqa: ARG001
        pass

    def pytest_configure(config):  # noqa: ARG001
        pass

    def renamed(registry):  # noqa: ARG001
        pass

    assert hookimpl(pytest_dnnsafety_register_gates).pytest_impl["optionalhook"] is True
    assert hookimpl(tryfirst=True)(pytest_configure).pytest_impl == {
        "wrapper": False, "hookwrapper": False, "optionalhook": False, "tryfirst": True, "trylast": False,
        "specname": None}
    assert hookimpl(specname="pytest_dnnsafety_gate_result")(renamed).pytest_impl["optionalhook"] is True
    assert hookimpl(optionalhook=False)(renamed).pytest_impl["optionalhook"] is False


def test_misspelled_plugin_hook_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", "from pytest_dnnsafety import hookimpl\n\n@hookimpl\n"
                                      "def pytest_dnnsafety_register_gate(registry):\n    pass\n")
    gate_project.tests("def test_plain():\n    pass\n")
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown hook 'pytest_dnnsafety_register_gate' in *conftest.py*"
                                 "Fix: rename it to one of *pytest_dnnsafety_register_gates*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


@pytest.mark.slow
def test_example_project_conftest_works_with_the_plugin_disabled(pytester: pytest.Pytester) -> None:
    project = ROOT / "example_project"
    pytester.chdir()
    result = pytester.runpytest_subprocess("--rootdir", str(project), "-c", str(project / "pyproject.toml"),
                                           "-p", "no:dnnsafety", "-p", "no:cacheprovider", "-o", "addopts=",
                                           "--co", "-q", str(project / "tests"))
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and result.ret == pytest.ExitCode.OK, output


# ---------------------------------------------------------------------------------- recursion bombs


def _bomb_toml(depth: int = 100_000) -> str:
    return "matrix = " + "[" * depth + "]" * depth + "\n"


def test_depth_safe_parsers() -> None:
    assert loads_json('{"a": [[1]]}') == {"a": [[1]]}
    assert loads_toml("a = [[1]]") == {"a": [[1]]}
    with pytest.raises(TooDeep, match=f"more than {MAX_DEPTH} levels"):
        loads_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TooDeep):
        loads_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))  # parses, but deeper than allowed
    with pytest.raises(TooDeep):
        loads_toml(_bomb_toml())
    with pytest.raises(TooDeep):
        loads_toml("a = " + "{b = " * 50_000 + "1" + "}" * 50_000)
    # a deep table without recursion in the parser: dotted keys
    with pytest.raises(TooDeep):
        loads_toml("[" + ".".join(["x"] * 5_000) + "]\n")
    assert check_depth([[[]]], limit=3) == [[[]]]
    with pytest.raises(TooDeep):
        check_depth([[[[]]]], limit=3)


def test_baseline_nested_too_deep_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    gate_project.write("base.json", '{"gates": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = gate_project.run("--dnnsafety-baseline=base.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*dnnsafety_baseline (from command-line option --dnnsafety-baseline)*base.json*"
                                 "nested more than 100 levels deep*"])


def test_severity_toml_recursion_bomb_names_the_file(tmp_path: Path) -> None:
    from pytest_dnnsafety.engines.confusion.weighted import SeverityMatrix

    path = tmp_path / "severity.toml"
    path.write_text(_bomb_toml())
    with pytest.raises(ConfigError, match=r"severity file .*severity\.toml cannot be read as TOML: .*nested"):
        SeverityMatrix.from_toml(path)


def test_conditions_toml_recursion_bomb_names_the_file(tmp_path: Path) -> None:
    from pytest_dnnsafety.scenarios import Conditions

    path = tmp_path / "conditions.toml"
    path.write_text("[conditions]\nweather = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"conditions file .*conditions\.toml.* cannot be read: .*nested"):
        Conditions.from_toml(path)
    path.write_text("[conditions." + ".".join(["x"] * 5_000) + "]\n")
    with pytest.raises(DataError, match="nested"):
        Conditions.from_toml(path)


# ---------------------------------------------------------------------------------- output paths


def test_json_on_the_baseline_is_refused_and_the_baseline_kept(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    base = gate_project.pytester.path / "base.json"
    before = base.read_text()
    result = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=./sub/../base.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_json='./sub/../base.json' (from command-line option --dnnsafety-json)"
                                 " and dnnsafety_baseline='base.json' (from command-line option "
                                 "--dnnsafety-baseline) both resolve to *base.json: the run would delete the "
                                 "baseline at start*Fix: give each a path of its own*"])
    assert base.read_text() == before


def test_an_output_on_an_input_file_is_refused(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    scenarios = gate_project.pytester.path / "data" / "scenarios.csv"
    before = scenarios.read_text()
    result = gate_project.run("--dnnsafety-html=data/scenarios.csv")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_html='data/scenarios.csv' (from command-line option --dnnsafety-html) "
                                 "and dnnsafety_scenarios='data/scenarios.csv' (from ini option dnnsafety_scenarios *) "
                                 "both resolve to *scenarios.csv: the run would delete an input file at start*"])
    assert scenarios.read_text() == before


@pytest.mark.parametrize("args, first, second", [
    (("--dnnsafety-json=r/out", "--dnnsafety-html=r/out"), "dnnsafety_json", "dnnsafety_html"),
    (("--dnnsafety-json=r/out", "--junitxml=r/out"), "dnnsafety_json", "--junitxml"),
    (("--dnnsafety-save-baseline=r/out", "--dnnsafety-html=r/out"), "dnnsafety_html", "dnnsafety_save_baseline"),
])
def test_two_outputs_on_one_file_are_refused(gate_project: GateProject, args, first, second) -> None:
    gate_project.tests(GATED)
    result = gate_project.run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{first}=*{second}=*both resolve to *out: the file written last would "
                                 "silently replace the other's evidence. Fix:*"])
    result.stdout.no_fnmatch_line("*test_cov*")


def test_step_summary_on_the_evidence_is_refused(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch) -> None:
    gate_project.tests(GATED)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(gate_project.pytester.path / "e.json"))
    result = gate_project.run("--dnnsafety-json=e.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_json='e.json'*GITHUB_STEP_SUMMARY=*both resolve to*"])


def test_two_inputs_may_share_a_file_but_an_output_may_not_join_them(tmp_path: Path) -> None:
    from pytest_dnnsafety.report.paths import Output, check_collisions

    shared = tmp_path / "eval.npz"
    shared.write_bytes(b"x")
    data = Output("dnnsafety_data", shared, writes=False, setting="data")
    operational = Output("dnnsafety_operational_data", shared, writes=False, setting="operational_data")
    check_collisions([data, operational])  # one .npz for both roles is fine
    with pytest.raises(ConfigError, match="dnnsafety_json.*overwrite|dnnsafety_json.*delete"):
        check_collisions([data, operational, Output("dnnsafety_json", shared, setting="json")])


def test_baseline_may_be_replaced_by_the_saved_baseline(gate_project: GateProject) -> None:
    gate_project.tests(GATED)
    gate_project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    result = gate_project.run("--dnnsafety-baseline=base.json", "--dnnsafety-save-baseline=base.json")
    result.assert_outcomes(passed=1)


PMI_TEST = """
import pytest

@pytest.mark.max_pmi_ub(0.3, cells_file={path!r})
def test_pmi():
    raise AssertionError("the test must not run: its marker is refused at collection")
"""


def _pmi(gate_project: GateProject, path: str, *args: str) -> pytest.RunResult:
    gate_project.tests(PMI_TEST.format(path=path))
    result = gate_project.run(*args)
    result.assert_outcomes(errors=1)
    result.stdout.no_fnmatch_line("*must not run*")
    return result


def test_cells_file_symlink_is_refused_at_collection(gate_project: GateProject) -> None:
    target = gate_project.write("elsewhere/precious.csv", "do not overwrite\n")
    (gate_project.pytester.path / "cells.csv").symlink_to(target)
    result = _pmi(gate_project, "cells.csv")
    result.stdout.fnmatch_lines(["*test_pmi: @pytest.mark.max_pmi_ub(cells_file='cells.csv') resolves to "
                                 "*cells.csv, a symbolic link to *precious.csv*does not write through links*Fix:*"])
    assert target.read_text() == "do not overwrite\n"


def test_cells_file_folder_or_unwritable_parent_is_refused_at_collection(gate_project: GateProject) -> None:
    (gate_project.pytester.path / "reports").mkdir()
    _pmi(gate_project, "reports").stdout.fnmatch_lines(["*cells_file='reports'*which is a directory. Fix:*"])
    gate_project.write("blocker", "a file, not a folder")
    _pmi(gate_project, "blocker/sub/cells.csv").stdout.fnmatch_lines(
        ["*cells_file='blocker/sub/cells.csv'*whose folder cannot be created: *blocker is a file. Fix:*"])


def test_cells_file_on_a_run_output_is_refused_at_collection(gate_project: GateProject) -> None:
    result = _pmi(gate_project, "reports/e.json", "--dnnsafety-json=reports/e.json")
    result.stdout.fnmatch_lines(["*cells_file='reports/e.json'*the file of dnnsafety_json='reports/e.json' "
                                 "(from command-line option --dnnsafety-json)*Fix:*"])


def test_write_cells_does_not_follow_a_link(tmp_path: Path) -> None:
    from test_reliability_usability import _assess, _data, _threshold_model

    x_op, x_lab, y = _data(6)
    result = _assess(_threshold_model, x_op, (x_lab, y), max_cells=20)
    target = tmp_path / "precious.csv"
    target.write_text("keep\n")
    (tmp_path / "cells.csv").symlink_to(target)
    with pytest.raises(OSError):
        result.write_cells(tmp_path / "cells.csv")
    assert target.read_text() == "keep\n"


# ---------------------------------------------------------------------------------- threads


def test_a_thread_count_above_the_cores_is_capped_and_says_so() -> None:
    settings = Settings(cli={"dnnsafety_threads": "100000"}, ini=lambda name: "", env={})
    plan = threads.plan(settings, env={}, cores=2, busy=0)
    assert plan.threads == 2
    assert plan.header() == ("threads=2 (from command-line option --dnnsafety-threads: 100000 capped at the 2 "
                             "usable cores)")
    plan = threads.plan(Settings(cli={}, ini=lambda name: "", env={}), env={"OMP_NUM_THREADS": "100000"},
                        cores=1, busy=0)
    assert (plan.threads, plan.header()) == (1, "threads=1 (from OMP_NUM_THREADS: 100000 capped at the 1 usable core)")


THREAD_TEST = """
import pytest
import torch

@pytest.mark.min_scene_coverage(0.25)
def test_cov(scenario_table):
    x = torch.randn(512, 512)
    assert torch.isfinite(x @ x).all()
    print("TORCH_THREADS", torch.get_num_threads())
"""


@pytest.mark.slow  # a fresh process each (its own torch): about 5 s
@pytest.mark.parametrize("how", ["cli", "env"])
def test_a_huge_thread_count_runs_without_crashing(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch,
                                                   how: str) -> None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DNNSAFETY_THREADS", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(name, raising=False)
    args = ["-s"]
    if how == "cli":
        args.append("--dnnsafety-threads=100000")
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    gate_project.tests(THREAD_TEST)
    result = gate_project.run(*args, subprocess=True)  # a segmentation fault must not take this process down
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    cores = threads.usable_cores()
    source = "command-line option --dnnsafety-threads" if how == "cli" else "OMP_NUM_THREADS"
    result.stdout.fnmatch_lines([f"dnnsafety: *threads={cores} (from {source}: 100000 capped at the {cores} "
                                 "usable core*)", f"*TORCH_THREADS {cores}*"])
