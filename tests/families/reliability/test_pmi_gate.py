"""The max_pmi_ub gate end to end: fixtures from settings, pass/fail with the bound, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import GateProject

CONFTEST = """
import pytest
import torch


class Threshold(torch.nn.Module):
    \"\"\"Predicts class 1 right of x1 = 0.55; the truth switches at 0.5 (true pmi about 0.05).\"\"\"

    def forward(self, x):
        return torch.stack([0.55 - x[:, 0], x[:, 0] - 0.55], dim=1)


@pytest.fixture(scope="session")
def model():
    return Threshold()


@pytest.fixture(scope="session")
def wrong_shape_model():
    return lambda x: torch.zeros(x.shape[0], 2, 2)


class Poisoned(torch.nn.Module):
    # bit-flipped weights: every logit is NaN (argmax would say class 0 everywhere)

    def forward(self, x):
        return torch.full((x.shape[0], 2), float("nan"))


@pytest.fixture(scope="session")
def nan_model():
    return Poisoned()


@pytest.fixture(scope="session")
def many_labels():
    import numpy as np

    gen = np.random.default_rng(0)
    x = torch.from_numpy(gen.random((3000, 2)))
    return x, (x[:, 0] > 0.5).long()
"""


@pytest.fixture
def pmi_project(gate_project: GateProject) -> GateProject:
    gen = np.random.default_rng(0)
    x_op = gen.random((400, 2)).astype(np.float32)
    x_lab = gen.random((300, 2)).astype(np.float32)
    np.savez(gate_project.pytester.path / "operation.npz", x=x_op)
    np.savez(gate_project.pytester.path / "labelled.npz", x=x_lab, y=(x_lab[:, 0] > 0.5).astype(np.int64))
    gate_project.ini.update({"dnnsafety_operational_data": "operation.npz", "dnnsafety_data": "labelled.npz"})
    gate_project.write("conftest.py", CONFTEST)
    return gate_project


# eps=0.05 is above r̂ (about 0.016 for these 300 points): a violated assumption, accepted knowingly. Empty
# cells take the nearest labelled point's label: with the model's own vote (Assumption 5) the labelled data
# refute the bound (the model is wrong on the strip 0.5 < x1 < 0.55), see the contradiction test below.
SETTINGS = ('eps=0.05, box=[[0, 0], [1, 1]], samples_per_cell=100, bootstrap=5, accept_violated_assumptions=True, '
            'empty_cell_label="nearest"')


def _gates(project: GateProject) -> dict:
    return {g["nodeid"].split("::")[1]: g for g in json.loads((project.pytester.path / "e.json").read_text())["gates"]}


def test_pmi_gate_passes_and_fails_on_the_bound(pmi_project: GateProject) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub(0.2, {SETTINGS})
        def test_loose(model, operational_profile, dataset):
            pass

        @pytest.mark.max_pmi_ub(0.001, {SETTINGS}, method="normal")
        def test_tight():
            pass

        @pytest.mark.max_pmi_ub(0.2, eps=0.05, box=[[0, 0], [1, 1]], samples_per_cell=100, bootstrap=5,
                                empty_cell_label="nearest")
        def test_violation_not_accepted():
            pass
    """)
    result = pmi_project.run("-W", "error", "--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*max_pmi_ub: *(bound) > 0.001 (pmi E=*Ub97.5%=*[[]normal]*cells 400/400*"])
    gates = _gates(pmi_project)
    loose = gates["test_loose"]
    assert loose["status"] == "passed" and loose["op"] == "<=" and loose["metric"] == "pmi upper bound"
    assert 0 < loose["value"] <= loose["bound"] <= 0.2
    assert "VIOLATED ASSUMPTIONS ACCEPTED" in loose["summary"] and "ε = 0.05 ≥ r̂" in loose["summary"]
    details = loose["details"]
    assert details["method"] == "chernoff" and "normal" in json.dumps(details["alternatives"])
    assert details["cells_total"] == 400 and details["model_queries"] == 400 * 100
    assert details["violations_accepted"] is True and details["empty_cell_label"] == "nearest"
    assert details["labelled_check"]["applied"] and not details["labelled_check"]["contradicts"]
    assert any("r̂" in w or "r-hat" in w or "eps" in w for w in details.get("warnings", [])), details.get("warnings")
    strict = gates["test_violation_not_accepted"]
    assert strict["status"] == "inconclusive" and strict["passed"] is False
    assert "inconclusive: violated assumption(s)" in strict["summary"] and "Assumption 4" in strict["summary"]
    assert "accept_violated_assumptions=True" in strict["summary"]


def test_a_model_the_labelled_data_refute_fails_with_the_contradiction(pmi_project: GateProject) -> None:
    """Issue #7: the paper's Assumption 5 lets a model that is wrong on a 5% strip pass max_pmi_ub(0.2)."""
    pmi_project.tests("""
        import pytest

        common = dict(eps=0.01, box=[[0, 0], [1, 1]], samples_per_cell=20, bootstrap=5,
                      accept_violated_assumptions=True, data="many_labels")

        @pytest.mark.max_pmi_ub(0.2, **common)
        def test_vote():
            pass

        @pytest.mark.max_pmi_ub(0.2, empty_cell_label="nearest", **common)
        def test_nearest():
            pass

        @pytest.mark.max_pmi_ub(0.01, empty_cell_label="nearest", **common)
        def test_nearest_tight():
            pass
    """)
    result = pmi_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1, failed=2)
    gates = _gates(pmi_project)
    vote = gates["test_vote"]
    assert vote["status"] == "failed" and vote["bound"] < 0.03  # the bound alone would have passed
    assert "contradiction: the model misclassifies" in vote["summary"] and "of 3,000 labelled points" in vote["summary"]
    assert "Assumption 5" in vote["summary"] and "empty_cell_label='nearest'" in vote["summary"]
    nearest = gates["test_nearest"]
    assert nearest["status"] == "passed" and 0.045 <= nearest["bound"] <= 0.2
    assert "empty cells labelled by the nearest labelled point" in nearest["summary"]
    assert gates["test_nearest_tight"]["status"] == "failed"


def test_a_model_with_nan_logits_is_an_error_naming_the_first_bad_batch(pmi_project: GateProject) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub(0.2, {SETTINGS}, model="nan_model")
        def test_nan():
            pass
    """)
    result = pmi_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(failed=1)
    gate = _gates(pmi_project)["test_nan"]
    assert gate["status"] == "error" and gate["passed"] is not True
    assert "NaN/inf in 300 of 300 inputs; the first bad batch is batch 0" in gate["summary"]


def test_pmi_gate_errors_are_clear(pmi_project: GateProject) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub(0.2, {SETTINGS}, model="wrong_shape_model")
        def test_wrong_shape():
            pass

        @pytest.mark.max_pmi_ub(0.2, eps=5.0, box=[[0, 0], [1, 1]])
        def test_eps_larger_than_box():
            pass
    """)
    result = pmi_project.run()
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "max_pmi_ub: cannot compute pmi upper bound:" in out
    assert "shape" in out and "eps" in out


@pytest.mark.parametrize(("args", "fragment"), [
    ("0.01, confidence=1.5", "argument confidence: 1.5 is outside"),
    ("0.01, confidence=0", "argument confidence: expected float, got int 0"),
    ("0.01, method='bogus'", "argument method: 'bogus' is not one of 'chernoff', 'normal'"),
    ("0.01, eps=-1.0", "argument eps: -1.0 must be 'auto', a positive number"),
    ("0.01, box=[[0, 0], [0, 1]]", "argument box: "),
    ("0.01, failures=[(1, 'x')]", "argument failures: "),
    ("0.01, samples_per_cell=0", "argument samples_per_cell: 0 is outside"),
], ids=["confidence_above_one", "confidence_int_zero", "unknown_method", "negative_eps", "empty_box",
        "failures_not_int_pairs", "no_samples"])
def test_bad_pmi_marker_arguments_are_collection_errors(pmi_project: GateProject, args: str, fragment: str) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub({args})
        def test_gate():
            pass
    """)
    result = pmi_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert fragment in result.stdout.str()


def test_missing_operational_data_says_what_to_configure(pmi_project: GateProject) -> None:
    del pmi_project.ini["dnnsafety_operational_data"]
    pmi_project.tests("""
        import pytest

        @pytest.mark.max_pmi_ub(0.2)
        def test_gate():
            pass
    """)
    result = pmi_project.run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'operational_profile': the operational profile is not configured*"])


def test_marker_methods_match_the_engine() -> None:
    """The marker validates methods without importing torch; the list must not drift from stats."""
    from pytest_dnnsafety import gates
    from pytest_dnnsafety.stats import intervals as stats

    assert set(gates._PMI_METHODS) == set(stats.METHODS)


def test_pmi_gate_with_norm_balls_around_operational_inputs(pmi_project: GateProject) -> None:
    pmi_project.tests("""
        import pytest

        @pytest.mark.max_pmi_ub(0.5, cells="balls", radius=0.01, norm="l2", clip=(0, 1), max_balls=50,
                                samples_per_cell=50, bootstrap=5, empty_cell_label="nearest")
        def test_balls():
            pass

        @pytest.mark.max_pmi_ub(0.5, cells="balls", radius=0.05, eps=0.1)
        def test_grid_option_with_balls():
            pass
    """)
    result = pmi_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1, failed=1)
    gates = {g["nodeid"].split("::")[1]: g for g in json.loads((pmi_project.pytester.path / "e.json").read_text())["gates"]}
    balls = gates["test_balls"]["details"]
    assert balls["cell_kind"] == "balls" and balls["norm"] == "l2" and balls["cells_evaluated"] == 50
    assert balls["violations"] == [] and balls["contradictions"] == [] and balls["empty_cell_label"] == "nearest"
    assert gates["test_grid_option_with_balls"]["status"] == "error"
    assert "eps" in gates["test_grid_option_with_balls"]["summary"]
