"""The example project's custom gate (``max_calibration_error``) on models with a known answer.

It is written only against the public API; here it must fail on plainly wrong models: a model
that is confidently wrong (ECE near 1), one whose logits are NaN (an error naming the batch), and
its ECE must equal a numpy reference computed independently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import GateProject

CALIBRATION = Path(__file__).resolve().parents[2] / "example_project" / "digits_demo" / "calibration.py"

CONFTEST = """
import pytest
import torch

from calibration import pytest_dnnsafety_register_gates  # noqa: F401  - registers max_calibration_error


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(90, 1, 4, 4, generator=gen)
    y = (x.flatten(1).mean(1) > 0.5).long()
    return x, y


class Model(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.scale = torch.nn.Parameter(torch.tensor(4.0))

    def forward(self, x):
        score = (x.flatten(1).mean(1) - 0.5) * self.scale * 20
        logits = torch.stack([-score, score], 1)
        if self.kind == "wrong":       # confidently predicts the other class
            logits = -logits
        if self.kind == "nan":
            logits = logits * float("nan")
        return logits


@pytest.fixture(scope="session")
def dataset():
    return torch.utils.data.TensorDataset(*_data())


@pytest.fixture(scope="session")
def good_model():
    return Model("good")


@pytest.fixture(scope="session")
def wrong_model():
    return Model("wrong")


@pytest.fixture(scope="session")
def nan_model():
    return Model("nan")
"""

TESTS = """
import pytest

@pytest.mark.max_calibration_error(0.2, bins=10, model="good_model")
def test_good():
    pass

@pytest.mark.max_calibration_error(0.2, bins=10, model="wrong_model")
def test_wrong():
    pass

@pytest.mark.max_calibration_error(0.2, bins=10, model="nan_model")
def test_nan():
    pass
"""


def _reference_ece(probs: np.ndarray, y: np.ndarray, bins: int) -> float:
    conf, pred = probs.max(1), probs.argmax(1)
    ece = 0.0
    for b in range(bins):
        in_bin = (conf >= b / bins) & (conf < (b + 1) / bins) if b < bins - 1 else conf >= b / bins
        if in_bin.any():
            ece += in_bin.mean() * abs((pred[in_bin] == y[in_bin]).mean() - conf[in_bin].mean())
    return float(ece)


def test_example_calibration_gate_fails_on_wrong_and_nan_models(gate_project: GateProject) -> None:
    import torch

    shutil.copy(CALIBRATION, gate_project.pytester.path / "calibration.py")
    gate_project.pytester.syspathinsert()
    gate_project.write("conftest.py", CONFTEST)
    gate_project.tests(TESTS)
    result = gate_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1, failed=2)
    gates = {g["nodeid"].split("::")[1]: g for g in json.loads((gate_project.pytester.path / "e.json").read_text())
             ["gates"]}
    assert gates["test_good"]["status"] == "passed"
    assert gates["test_wrong"]["status"] == "failed" and gates["test_wrong"]["value"] > 0.9
    assert gates["test_nan"]["status"] == "error"
    assert "max_calibration_error: model on the evaluation data: the model's outputs hold NaN/inf in 90 of 90 " \
           "inputs; the first bad batch is batch 0" in gates["test_nan"]["summary"]

    # the measured ECE equals an independent numpy computation on the same model and data
    namespace: dict = {}
    exec(compile(CONFTEST, "conftest", "exec"), namespace)
    x, y = namespace["_data"]()
    for kind in ("good", "wrong"):
        with torch.no_grad():
            probs = torch.softmax(namespace["Model"](kind)(x).double(), 1).numpy()
        assert gates[f"test_{kind}"]["value"] == pytest.approx(_reference_ece(probs, y.numpy(), 10), abs=1e-12)
