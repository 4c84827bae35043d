"""Bad input gets a clear error that names the marker or option, the value and the fix; nothing passes."""

from __future__ import annotations

import pytest

from conftest import GateProject

# --------------------------------------------------------------------- marker arguments: collection errors

BAD_MARKERS = [
    pytest.param("min_scene_coverage(1.5)", ["argument threshold: 1.5 is outside [0.0, 1.0]"],
                 id="threshold_above_one"),
    pytest.param("min_scene_coverage(-0.1)", ["argument threshold: -0.1 is outside [0.0, 1.0]"],
                 id="threshold_negative"),
    pytest.param("min_scene_coverage('high')", ["argument threshold: expected a number, got str 'high'"],
                 id="threshold_is_a_string"),
    pytest.param("min_scene_coverage(True)", ["argument threshold: expected a number, got bool True"],
                 id="threshold_is_a_bool"),
    pytest.param("min_scene_coverage()", ["argument threshold: missing",
                                          "Fix: write @pytest.mark.min_scene_coverage(threshold, k=2*"],
                 id="threshold_missing"),
    pytest.param("min_scene_coverage(0.5, 2)", ["argument *args: takes one positional argument*"],
                 id="k_given_positionally"),
    pytest.param("min_scene_coverage(0.5, kk=2)", ["argument kk: unknown keyword",
                                                   "Fix: use one of batch_size, data, device, k, max_seconds, min_count, sample, *"],
                 id="unknown_keyword"),
    pytest.param("min_scene_coverage(0.5, k=4)", ["argument k: 4 is outside [1, 3]. Fix: use k = 1, 2 or 3."],
                 id="k_out_of_range"),
    pytest.param("min_scene_coverage(0.5, k=2.0)", ["argument k: expected int, got float 2.0*"],
                 id="k_is_a_float"),
    pytest.param("min_scene_coverage(0.5, min_count=0)", ["argument min_count: 0 is outside*"],
                 id="min_count_zero"),
    pytest.param("min_scene_coverage(0.5, where='night')", ["argument where: expected dict or None, got str*"],
                 id="where_not_a_dict"),
    pytest.param("min_scene_coverage(0.5, scenarios=3)", ["argument scenarios: must name a fixture*"],
                 id="fixture_keyword_not_a_name"),
    pytest.param("min_scene_coverage(0.5, seed=-1)",
                 ["*dnnsafety_seed=-1 (from marker @pytest.mark.min_scene_coverage(seed=...)): must be >= 0*"],
                 id="seed_override_negative"),
    pytest.param("min_scene_coverage(0.5, device='gpu')",
                 ["*dnnsafety_device='gpu' (from marker @pytest.mark.min_scene_coverage(device=...))*"],
                 id="device_override_unknown"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS)
def test_bad_marker_argument_is_a_collection_error(gate_project: GateProject, marker: str, expected: list) -> None:
    gate_project.tests(f"""
        import pytest

        @pytest.mark.{marker}
        def test_gate(scenario_table):
            pass

        def test_other():
            pass
    """)
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*ERROR collecting test_gates.py*", "*invalid gate marker*"])
    out = result.stdout.str()
    assert "test_gates.py::test_gate: @pytest.mark.min_scene_coverage: " in out
    for fragment in expected:  # each fragment must appear literally, '*' separating the pieces
        position = 0
        for piece in filter(None, fragment.split("*")):
            position = out.find(piece, position)
            assert position >= 0, f"{piece!r} not in output:\n{out}"
    assert "passed" not in result.parseoutcomes()


# --------------------------------------------------------------------- settings: usage errors naming the source

BAD_SETTINGS = [
    pytest.param({"ini": {"dnnsafety_seed": "abc"}},
                 "*dnnsafety_seed='abc' (from ini option dnnsafety_seed in *pyproject.toml): expected an integer*",
                 id="ini_seed_not_an_integer"),
    pytest.param({"env": {"DNNSAFETY_BATCH_SIZE": "0"}},
                 "*dnnsafety_batch_size='0' (from environment variable DNNSAFETY_BATCH_SIZE): must be >= 1*",
                 id="env_batch_size_zero"),
    pytest.param({"args": ["--dnnsafety-device=gpu"]},
                 "*dnnsafety_device='gpu' (from command-line option --dnnsafety-device): expected auto, cpu*",
                 id="cli_device_unknown"),
    pytest.param({"ini": {"dnnsafety_junit_properties": "maybe"}}, "*dnnsafety_junit_properties*",
                 id="ini_bool_not_a_bool"),
]


@pytest.mark.parametrize(("case", "pattern"), BAD_SETTINGS)
def test_bad_setting_is_a_usage_error_naming_its_source(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch,
                                                        case: dict, pattern: str) -> None:
    gate_project.tests("def test_x():\n    pass\n")
    gate_project.ini.update(case.get("ini", {}))
    for key, value in case.get("env", {}).items():
        monkeypatch.setenv(key, value)
    result = gate_project.run(*case.get("args", []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([pattern.replace("[", "[[]")])


# --------------------------------------------------------------------- data and configuration: setup errors

def _run_gate(gate_project: GateProject, marker: str = "min_scene_coverage(0.1)") -> pytest.RunResult:
    gate_project.tests(f"""
        import pytest

        @pytest.mark.{marker}
        def test_gate(scenario_table):
            pass
    """)
    return gate_project.run()


def test_missing_scenarios_setting_says_what_to_configure(gate_project: GateProject) -> None:
    del gate_project.ini["dnnsafety_scenarios"]
    result = _run_gate(gate_project)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*fixture 'scenario_table': the scenario table is not configured: dnnsafety_scenarios is unset*"
        "define a `scenario_table` fixture in conftest.py*"])


def test_missing_conditions_setting_says_what_to_configure(gate_project: GateProject) -> None:
    del gate_project.ini["dnnsafety_conditions"]
    result = _run_gate(gate_project)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*operating conditions*is not configured: dnnsafety_conditions is unset*"])


def test_scenario_file_not_found_names_path_and_source(gate_project: GateProject) -> None:
    gate_project.ini["dnnsafety_scenarios"] = "data/nope.csv"
    result = _run_gate(gate_project)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*dnnsafety_scenarios='data/nope.csv' (from ini option*): file not found at *nope.csv*"])


def test_scenario_value_outside_domain_names_line_and_value(gate_project: GateProject) -> None:
    gate_project.write("data/scenarios.csv", "weather,road,orientation\nsunny,stone,straight\nsnowy,mud,curvy\n")
    result = _run_gate(gate_project)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*snowy*"])
    assert "line 3" in result.stdout.str()


def test_where_with_unknown_condition_fails_the_gate(gate_project: GateProject) -> None:
    result = _run_gate(gate_project, "min_scene_coverage(0.1, where={'season': 'winter'})")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*min_scene_coverage: cannot compute scenario k-projection coverage:*season*"])


def test_fixture_of_wrong_type_fails_the_gate(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest

        @pytest.fixture
        def scenario_table():
            return [("sunny", "stone")]
    """)
    result = _run_gate(gate_project)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fixture 'scenario_table' returned list, not a ScenarioTable*"])


def test_gate_naming_an_undefined_fixture_errors(gate_project: GateProject) -> None:
    result = _run_gate(gate_project, "min_scene_coverage(0.1, scenarios='night_table')")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'night_table' not found*"])


def test_untrusted_pickled_model_is_refused(gate_project: GateProject) -> None:
    import torch

    torch.save(torch.nn.Linear(2, 2), gate_project.pytester.path / "model.pt")
    gate_project.ini["dnnsafety_model"] = "model.pt"
    gate_project.tests("""
        def test_model(model):
            pass
    """)
    result = gate_project.run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*refused to unpickle model.pt*dnnsafety_allow_pickle=true*"])


def test_evaluation_data_with_nan_is_refused(gate_project: GateProject) -> None:
    import numpy as np

    x = np.zeros((4, 2), dtype=np.float32)
    x[1, 0] = np.nan
    np.savez(gate_project.pytester.path / "eval.npz", x=x, y=np.zeros(4, dtype=np.int64))
    gate_project.ini["dnnsafety_data"] = "eval.npz"
    gate_project.tests("""
        def test_data(dataset):
            pass
    """)
    result = gate_project.run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*evaluation data*x holds 1 NaN/inf value(s)*"])
