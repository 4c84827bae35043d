"""Reproducing the reliability paper without tripping (issue #13, items 4 and 5).

The half-size bootstrap of the paper's reference implementation, ``box=None`` as the data's range
(reported), numbers printed with enough digits to tell a value from its bound, scikit-learn
estimators as the model, the per-cell audit file and ``mass="center"``.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import GateProject
from pytest_dnnsafety.engines.reliability import ReliabilityWarning, assess_reliability
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile
from pytest_dnnsafety.report.markdown import step_summary
from pytest_dnnsafety.report.terminal import render_table
from pytest_dnnsafety.results import GateResult, format_number, format_numbers

sklearn = pytest.importorskip("sklearn")
from sklearn.ensemble import RandomForestClassifier  # noqa: E402
from sklearn.linear_model import LogisticRegression, Perceptron  # noqa: E402


def _data(seed: int = 0, n_op: int = 400, n_lab: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    x_op = gen.random((n_op, 2)) * [1.0, 0.8] + [0.05, 0.1]
    x_lab = gen.random((n_lab, 2))
    return x_op, x_lab, (x_lab[:, 0] > 0.5).astype(np.int64)


def _threshold_model(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([0.55 - x[:, 0], x[:, 0] - 0.55], dim=1)


#: eps 0.05 exceeds r̂ of 300 random points: knowingly accepted (these tests are about other things)
FAST = dict(eps=0.05, samples_per_cell=40, bootstrap=8, accept_violated_assumptions=True,
            empty_cell_label="nearest")


def _assess(model, x_op, lab, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return assess_reliability(model, OperationalProfile(x_op), lab, **{**FAST, **options})


# ---------------------------------------------------------------------- item 4: the paper's half-size bootstrap
def test_half_size_bootstrap_doubles_the_cells_op_variance_and_is_seeded() -> None:
    x_op, x_lab, y = _data(1)
    full = _assess(_threshold_model, x_op, (x_lab, y), bootstrap=60)
    half = _assess(_threshold_model, x_op, (x_lab, y), bootstrap=60, bootstrap_size="half")
    assert full.bootstrap_size == "full" and half.bootstrap_size == "half"
    assert half.E == full.E  # the masses themselves are the full-data KDE's
    ratio = float(torch.median(half.cells.op_var / full.cells.op_var))
    assert 1.6 <= ratio <= 2.8, ratio
    assert half.Var > full.Var
    again = _assess(_threshold_model, x_op, (x_lab, y), bootstrap=60, bootstrap_size="half")
    assert (again.E, again.Var, again.Ub) == (half.E, half.Var, half.Ub)
    assert torch.equal(again.cells.op_var, half.cells.op_var)
    assert half.to_details()["bootstrap_size"] == "half" and "half-size refits" in half.summary()


def test_bootstrap_size_is_checked() -> None:
    x_op, x_lab, y = _data(2)
    with pytest.raises(ConfigError, match="bootstrap_size must be one of"):
        _assess(_threshold_model, x_op, (x_lab, y), bootstrap_size="twice")
    with pytest.raises(ConfigError, match="ball cells use the empirical profile"):
        assess_reliability(_threshold_model, x_op, (x_lab, y), cells="balls", radius=0.01, samples_per_cell=5,
                           bootstrap_size="half")


# ---------------------------------------------------------------------- item 5: box=None is the data's range
def test_default_box_is_the_data_range_and_is_reported() -> None:
    x_op, x_lab, y = _data(3)
    default = _assess(_threshold_model, x_op, (x_lab, y))
    pts = np.concatenate([x_op, x_lab])
    lower, upper = tuple(pts.min(0)), tuple(pts.max(0))
    explicit = _assess(_threshold_model, x_op, (x_lab, y), box=(lower, upper))
    assert default.box == (lower, upper) and default.box_rule == "data range"
    assert explicit.box == (lower, upper) and explicit.box_rule == "given"
    assert (default.E, default.Ub, default.cells_total) == (explicit.E, explicit.Ub, explicit.cells_total)
    assert default.labelled_outside_box == 0  # the closed box holds the extreme points
    details = default.to_details()
    assert details["box"] == [list(lower), list(upper)] and details["box_rule"] == "data range"
    assert "(the data's range)" in default.summary()
    padded = _assess(_threshold_model, x_op, (x_lab, y), box="padded")
    pad = 3 * OperationalProfile(x_op).bandwidth.numpy()
    np.testing.assert_allclose(padded.box[0], np.array(lower) - pad, rtol=1e-12)
    np.testing.assert_allclose(padded.box[1], np.array(upper) + pad, rtol=1e-12)
    assert padded.box_rule == "data range ± 3 bandwidths" and padded.cells_total > default.cells_total
    with pytest.raises(ConfigError, match="'padded'"):
        _assess(_threshold_model, x_op, (x_lab, y), box="tight")


# ---------------------------------------------------------------------- item 5: digits
def test_a_value_and_its_bound_print_differently() -> None:
    # the case: E = 0.00487 and Ub = 0.00493 were both "0.005"
    assert format_number(0.00487) == format_number(0.00493) == "0.005"
    assert format_numbers(0.00487, 0.00493, 0.01) == ["0.00487", "0.00493", "0.01000"]
    assert format_numbers(0.00487, 0.00493, 0.005) == ["0.00487", "0.00493", "0.00500"]
    assert format_numbers(0.9, 0.95, 0.9) == ["0.900", "0.950", "0.900"]  # distinct already: unchanged
    assert format_numbers(4.871e-4, 4.8712e-4, None) == ["4.8710e-04", "4.8712e-04", "-"]
    assert format_numbers(0.2, 0.2, float("nan")) == ["0.200", "0.200", "nan"]
    gate = GateResult(nodeid="test_x.py::test_pmi", marker="max_pmi_ub", metric="pmi upper bound",
                      threshold=0.005, op="<=", status="passed", value=0.00487, bound=0.00493, passed=True)
    row = [text for text, _ in render_table([gate])][-1]
    assert "0.00487" in row and "0.00493" in row and "≤ 0.00500" in row
    table = step_summary([gate], {})
    assert "| 0.00487 | 0.00493 | ≤ 0.00500 |" in table


# ---------------------------------------------------------------------- item 5: scikit-learn estimators
def _torch_reference(estimator):
    """The estimator's predictions through a plain torch callable (the reference path)."""
    return lambda x: torch.as_tensor(estimator.predict_proba(x.reshape(x.shape[0], -1).cpu().numpy()))


@pytest.mark.parametrize("make", [lambda: LogisticRegression(),
                                  lambda: RandomForestClassifier(n_estimators=8, random_state=0)])
def test_sklearn_estimators_are_accepted(make) -> None:
    x_op, x_lab, y = _data(4)
    est = make().fit(x_lab, y)
    result = _assess(est, x_op, (x_lab, y))
    reference = _assess(_torch_reference(est), x_op, (x_lab, y))
    assert (result.E, result.Ub) == (reference.E, reference.Ub)
    assert torch.equal(result.cells.failures, reference.cells.failures)
    assert 0 < result.E < 0.5


def test_estimator_classes_are_aligned_and_predict_only_estimators_work() -> None:
    x_op, x_lab, y = _data(5)
    y2 = np.where(y == 1, 2, 0)  # classes_ = [0, 2]: predict_proba's columns are classes 0 and 2
    est = LogisticRegression().fit(x_lab, y2)
    result = _assess(est, x_op, (x_lab, y2))
    labels = lambda x: torch.as_tensor(est.predict(x.numpy()))  # noqa: E731  the reference: labels as predicted
    reference = _assess(labels, x_op, (x_lab, y2), num_classes=3)
    assert (result.E, result.Ub) == (reference.E, reference.Ub)
    perceptron = Perceptron(random_state=0).fit(x_lab, y)  # no predict_proba
    assert not hasattr(perceptron, "predict_proba")
    by_predict = _assess(perceptron, x_op, (x_lab, y))
    as_numpy = _assess(lambda x: perceptron.predict(x.numpy()), x_op, (x_lab, y))  # a callable returning numpy
    assert (by_predict.E, by_predict.Ub) == (as_numpy.E, as_numpy.Ub)
    with pytest.raises(ConfigError, match="integer class indices"):
        _assess(LogisticRegression().fit(x_lab, np.where(y == 1, "go", "stop")), x_op, (x_lab, y))
    with pytest.raises(ConfigError, match="predict_proba/predict"):
        _assess(object(), x_op, (x_lab, y))


# ---------------------------------------------------------------------- item 5: the per-cell audit file
@pytest.mark.parametrize("conservative_rest", [True, False])
def test_cells_file_rows_add_up_to_the_estimate(tmp_path: Path, conservative_rest: bool) -> None:
    x_op, x_lab, y = _data(6)
    result = _assess(_threshold_model, x_op, (x_lab, y), max_cells=150, conservative_rest=conservative_rest,
                     empty_cell_label="model")
    path = result.write_cells(tmp_path / "audit" / "cells.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == result.cells_evaluated == 150
    total = sum(float(r["op"]) * float(r["lambda_hat"]) for r in rows)
    rest = result.mass_rest if conservative_rest else 0.0
    assert total + rest == pytest.approx(result.E, rel=1e-12)
    assert {r["type"] for r in rows} <= {"normal", "empty", "cross_boundary"}
    assert sum(int(r["samples"]) for r in rows) == result.model_queries
    first = rows[0]
    assert float(first["lambda_hat"]) == int(first["failures"]) / int(first["samples"])
    assert float(first["upper_0"]) - float(first["lower_0"]) == pytest.approx(0.05)
    lines = result.write_cells(tmp_path / "cells.jsonl").read_text().splitlines()
    assert len(lines) == 150 and json.loads(lines[0])["op"] == float(first["op"])


def test_cells_file_needs_the_cell_table(tmp_path: Path) -> None:
    x_op, x_lab, y = _data(7)
    from dataclasses import replace

    result = replace(_assess(_threshold_model, x_op, (x_lab, y)), cells=None)
    with pytest.raises(MetricError, match="no per-cell table"):
        result.write_cells(tmp_path / "c.csv")


# ---------------------------------------------------------------------- item 5: mass="center"
def test_center_is_accepted_and_reported_as_centre() -> None:
    x_op, x_lab, y = _data(8)
    center = _assess(_threshold_model, x_op, (x_lab, y), mass="center")
    centre = _assess(_threshold_model, x_op, (x_lab, y), mass="centre")
    assert center.mass_method == "centre" and (center.E, center.Ub) == (centre.E, centre.Ub)
    with pytest.raises(ConfigError, match="'exact' or 'centre'"):
        _assess(_threshold_model, x_op, (x_lab, y), mass="middle")


# ---------------------------------------------------------------------- the gate: estimator, box, cells file
CONFTEST = """
import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression


@pytest.fixture(scope="session")
def model():
    data = np.load("labelled.npz")
    return LogisticRegression().fit(data["x"], data["y"])
"""


def test_gate_takes_an_estimator_and_writes_the_cells_file(gate_project: GateProject) -> None:
    gen = np.random.default_rng(0)
    x_op = gen.random((300, 2)).astype(np.float32)
    x_lab = gen.random((200, 2)).astype(np.float32)
    np.savez(gate_project.pytester.path / "operation.npz", x=x_op)
    np.savez(gate_project.pytester.path / "labelled.npz", x=x_lab, y=(x_lab[:, 0] > 0.5).astype(np.int64))
    gate_project.ini.update({"dnnsafety_operational_data": "operation.npz", "dnnsafety_data": "labelled.npz"})
    gate_project.write("conftest.py", CONFTEST)
    gate_project.tests("""
        import pytest

        @pytest.mark.max_pmi_ub(0.3, eps=0.05, samples_per_cell=40, bootstrap=5, bootstrap_size="half",
                                mass="center", accept_violated_assumptions=True, empty_cell_label="nearest",
                                cells_file="reports/pmi_cells.csv")
        def test_estimator():
            pass
    """)
    result = gate_project.run("-W", "ignore::UserWarning", "--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1)
    gate = json.loads((gate_project.pytester.path / "e.json").read_text())["gates"][0]
    details = gate["details"]
    written = gate_project.pytester.path / "reports" / "pmi_cells.csv"
    assert details["cells_file"] == str(written) and written.exists()
    rows = list(csv.DictReader(written.open()))
    assert len(rows) == details["cells_evaluated"]
    total = sum(float(r["op"]) * float(r["lambda_hat"]) for r in rows) + details["mass_rest"]
    assert total == pytest.approx(details["E"], rel=1e-9)
    pts = np.concatenate([x_op, x_lab]).astype(np.float64)
    np.testing.assert_allclose(details["box"], [pts.min(0), pts.max(0)], rtol=1e-12)
    assert details["box_rule"] == "data range"
    assert details["bootstrap_size"] == "half" and details["mass_method"] == "centre"
    assert gate["inputs"]["model"]["type"].endswith("LogisticRegression")
