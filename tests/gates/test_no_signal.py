"""No pass on no signal (issue #19 §4, §6): a value of 0 or 1 reached because nothing could be measured.

Known answers on the digits CNN (tests/_digits_project.py):

* a random-output model has no true-class confidence to lose: the confidence-loss gate is inconclusive;
* an all-zero severity matrix makes the weighted confusion 0 by construction: an error naming its source;
* DeepInspect's bias on random activations has no NAPVD below the cutoff: inconclusive, value NaN, not 0;
* a model that ignores its input has no hot occlusion position: M_interpret under no_hot='one' is inconclusive;
  such a constant model answers one class, so the relative gates' shared precondition (issue #29 §2,
  :mod:`pytest_dnnsafety.engines.core.signal`) says it first: not better than chance, the numbers named;
* a chance-level and a collapsed digits model make every relative gate family inconclusive on a real project (the
  trained CNN, the positive control, is measured);
* a scenario degradation with one group holding every row compares the data with itself: inconclusive;
* a user gate's ``Measurement(value=nan, bound=0.0)`` is an error, not a pass;
* labels the model cannot have (every label 42 on the 10-class model): every gate that reads labels is
  an error naming the label range, the class count and the fix — one check per gate family.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from _digits_project import digits_project, gates_of, write_digits_files
from conftest import GateProject
from pytest_dnnsafety import GateDef, GateRegistry, Measurement
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.gates import evaluate, parse_marker

N = 300
CONDITIONS = '[conditions]\nlighting = ["day", "dusk", "night"]\n'


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits_no_signal")
    x, y = write_digits_files(root)
    np.savez(root / "data" / "label42.npz", x=x.numpy(), y=np.full(N, 42, dtype=np.int64))
    np.savez(root / "data" / "fit42.npz", x=x[:200].numpy(), y=np.full(200, 42, dtype=np.int64))
    np.savez(root / "data" / "fit.npz", x=x[:200].numpy(), y=y[:200].numpy())
    np.savez(root / "data" / "masks.npz", masks=x[:, 0].numpy() > 0.3)
    (root / "data" / "scenarios.csv").write_text(
        "lighting\n" + "\n".join(["day", "dusk", "night"][i % 3] for i in range(N)) + "\n")
    (root / "data" / "conditions.toml").write_text(CONDITIONS)
    (root / "data" / "day_only.csv").write_text("lighting\n" + "day\n" * N)
    (root / "data" / "zero.csv").write_text("true\\predicted," + ",".join(map(str, range(10))) + "\n" + "".join(
        f"{t}," + ",".join("0" for _ in range(10)) + "\n" for t in range(10)))
    return root


LABEL_42_GATES = {
    "scenario_accuracy": 'min_scenario_accuracy(0.0, by=["lighting"])',
    "scenario_degradation": 'max_scenario_degradation(1.0, by=["lighting"])',
    "weighted_confusion": 'max_weighted_confusion(1e9, severity={"1": {"7": 10.0}}, gate_on="value")',
    "class_confusion": 'max_class_confusion(1.0, layer="classifier.1")',
    "class_bias": 'max_class_bias(0.5, layer="classifier.1")',
    "confidence_loss": 'max_adversarial_confidence_loss(1.0, eps=0.05, families=["fgsm"], clip=(0, 1))',
    "robust_accuracy": 'min_robust_accuracy(0.0, eps=0.05, families=["fgsm"], clip=(0, 1))',
    "verified": 'min_verified_robustness(0.0, eps=0.001, clip=(0, 1))',
    "occlusion": 'min_occlusion_sensitivity(0.0, size=2, target="label")',
    "monitor_detection": 'min_monitor_detection(-1.0, monitor="oob", faults="black_frame")',
    "monitor_output_detection": 'min_monitor_detection(-1.0, monitor="energy", faults="fgsm")',
    "selective_risk": 'max_monitor_selective_risk(1.0, monitor="energy")',
    "selective_risk_data": 'max_monitor_selective_risk(1.0, monitor="energy", fit_data="good_fit")',
}

MONITORS = """
    import numpy as np
    import pytest
    import torch
    from pytest_dnnsafety import Energy, OutsideTheBox


    @pytest.fixture(scope="session")
    def good_fit():
        arrays = np.load("data/fit.npz")
        return torch.utils.data.TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))


    @pytest.fixture(scope="session")
    def monitors():
        return {"energy": Energy(), "oob": OutsideTheBox(layer="classifier.1")}
"""


@pytest.mark.slow
def test_labels_outside_the_model_classes_are_an_error_in_every_gate(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, LABEL_42_GATES, textwrap.dedent(MONITORS),
                             data="data/label42.npz", monitor_data="data/fit42.npz",
                             scenarios="data/scenarios.csv", conditions="data/conditions.toml",
                             masks="data/masks.npz")
    project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    for name in LABEL_42_GATES:
        gate = gates[name]
        print(name, gate["status"], gate["summary"][:300])
    for name in LABEL_42_GATES:
        gate = gates[name]
        assert gate["status"] == "error", (name, gate["summary"])
        assert "42" in gate["summary"] and "10 classes" in gate["summary"], (name, gate["summary"])


# ------------------------------------------------------------------------------------- NaN from a measure function


def _verdict(measurement: Measurement, op: str = "<=") -> Any:
    registry = GateRegistry()
    registry.add(GateDef(marker="max_thing", metric="thing", op=op, threshold_range=(0.0, 1.0), params=(),
                         fixtures={}, measure=lambda spec, fx, ctx: measurement, doc="a thing"), source="t")
    spec = parse_marker("max_thing", (0.5,), {}, "t.py::test", registry)
    return evaluate(spec, {}, Settings(cli={}, ini=lambda name: "", env={}), "t.py::test", {})


@pytest.mark.parametrize("measurement", [Measurement(value=float("nan"), bound=0.0),
                                         Measurement(value=0.1, bound=float("nan")),
                                         Measurement(value=float("nan"))])
def test_a_nan_value_or_bound_from_a_measure_function_is_an_error(measurement: Measurement) -> None:
    result = _verdict(measurement)
    assert result.status == "error" and result.passed is None
    name = "bound" if measurement.value == measurement.value else "value"
    assert f"the measure function returned {name}=nan" in result.summary, result.summary
    assert result.summary.startswith("max_thing: ")


def test_nan_with_a_reason_stays_inconclusive_and_finite_values_are_judged() -> None:
    result = _verdict(Measurement(value=float("nan"), inconclusive="no group has rows"))
    assert result.status == "inconclusive" and "no group has rows" in result.summary
    assert _verdict(Measurement(value=0.1, bound=0.2)).status == "passed"
    assert _verdict(Measurement(value=0.1, bound=0.7)).status == "failed"


# ------------------------------------------------------------------------------------- no signal, no pass

NO_SIGNAL = """
    import pytest
    import torch
    from torch import nn
    import netdef


    class RandomOutput(nn.Module):
        \"\"\"A random function of the input (deterministic): decisions at chance, no confidence to lose.\"\"\"

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 10, generator=torch.Generator().manual_seed(0)))
            self.classifier = nn.Sequential(nn.Flatten(), nn.ReLU())  # the layer the relative gates name

        def forward(self, x):
            return 3 * torch.sin(1000 * self.classifier(x) @ self.w)


    class Noise(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)

        def forward(self, x):
            return torch.rand(x.shape[0], 64, generator=self.gen)


    class RandomLayer(nn.Module):
        \"\"\"The trained digits CNN's decisions, and a hidden layer `noise` of random activations.\"\"\"

        def __init__(self):
            super().__init__()
            self.net = netdef.trained()
            self.noise = Noise()

        def forward(self, x):
            self.noise(x)
            return self.net(x)


    class Constant(nn.Module):
        \"\"\"Always the same logits, whatever the input: no occlusion can change its output.\"\"\"

        def __init__(self, top):
            super().__init__()
            self.logits = nn.Parameter(torch.linspace(0, top, 10))
            self.classifier = nn.Sequential(nn.Flatten(), nn.ReLU())  # the layer the relative gates name

        def forward(self, x):
            return self.logits.expand(x.shape[0], 10) + 0 * self.classifier(x)[:, :1]


    @pytest.fixture(scope="session")
    def constant():  # confident: class 9 at probability ≈ 1
        return Constant(20.0).eval()


    @pytest.fixture(scope="session")
    def unconfident():  # class 9 at probability ≈ 0.14, below ρ = 0.5 before any occlusion
        return Constant(1.0).eval()


    @pytest.fixture(scope="session")
    def day_only():
        from pytest_dnnsafety import Conditions, ScenarioTable

        return ScenarioTable.from_csv("data/day_only.csv", Conditions.from_toml("data/conditions.toml"))


    @pytest.fixture(scope="session")
    def random_output():
        return RandomOutput().eval()


    @pytest.fixture(scope="session")
    def random_layer():
        return RandomLayer().eval()
"""

NO_SIGNAL_GATES = {
    "random_loss": 'max_adversarial_confidence_loss(0.5, eps=0.05, families=["fgsm", "gaussian_noise"], '
                   'clip=(0, 1), model="random_output")',
    "trained_loss": 'max_adversarial_confidence_loss(1.0, eps=0.05, families=["fgsm", "gaussian_noise"], '
                    'clip=(0, 1))',
    "zero_file": 'max_weighted_confusion(1.0, severity="data/zero.csv")',
    "zero_dict": 'max_weighted_confusion(1.0, severity={"1": {"7": 0.0}}, default=0.0)',
    "random_bias": 'max_class_bias(0.5, layer="noise", model="random_layer")',
    "random_confusion": 'max_class_confusion(1.0, layer="noise", model="random_layer")',
    "constant_interpret": 'min_interpretation_precision(0.5, size=2, no_hot="one", model="constant")',
    "unconfident_sensitivity": 'min_occlusion_sensitivity(0.5, size=2, model="unconfident")',
    "one_group": 'max_scenario_degradation(0.1, by=["lighting"], allow_empty_groups=True, scenarios="day_only")',
    "all_groups": 'max_scenario_degradation(1.0, by=["lighting"])',
    # issue #29 §2: every relative gate family on the chance-level model, the collapsed (constant) one, the trained one
    **{f"{model}_{name}": gate if model == "model" else f'{gate[:-1]}, model="{model}")'
       for model in ("random_output", "constant", "model") for name, gate in {
           "degradation": 'max_scenario_degradation(0.5, by=["lighting"])',
           "pattern": 'max_neuron_pattern_deviation(0.9, layer="classifier.1")',
           "confusion": 'max_class_confusion(0.99, layer="classifier.1", unpredicted="exclude")',
           "weighted": 'max_weighted_confusion(5.0, severity={"1": {"7": 10.0}}, default=0.0)',
           "monitor": 'min_monitor_detection(0.0, monitor="energy", faults="black_frame")',
           "risk": 'max_monitor_selective_risk(0.9, monitor="energy")',
           "occlusion": 'max_occlusion_sensitivity(1.0, size=2)',
       }.items()},
}


@pytest.mark.slow
def test_no_signal_is_never_a_pass(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, NO_SIGNAL_GATES, textwrap.dedent(NO_SIGNAL),
                             scenarios="data/scenarios.csv", conditions="data/conditions.toml",
                             masks="data/masks.npz", monitor_data="data/fit.npz")
    project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    loss = gates["random_loss"]
    assert loss["status"] == "inconclusive", loss["summary"]
    why = loss["details"]["inconclusive"]
    assert "is not above chance" in why and "eq. 4" in why
    assert loss["details"]["chance_accuracy"] == pytest.approx(max(np.bincount(np.load(files / "data" / "eval.npz")
                                                                                ["y"])) / N)
    assert gates["trained_loss"]["status"] == "passed", gates["trained_loss"]["summary"]  # the trained CNN: signal
    for name, source in (("zero_file", "file data/zero.csv"), ("zero_dict", "marker severity=")):
        gate = gates[name]
        assert gate["status"] == "error", gate["summary"]
        assert f"the severity matrix of {source} weighs every misclassification 0" in gate["summary"]
    bias = gates["random_bias"]
    assert bias["status"] == "inconclusive" and bias["value"] is None, bias["summary"]
    assert "no pair of predicted classes has a NAPVD below the bias cutoff" in bias["details"]["inconclusive"]
    assert "no bias signal" in bias["summary"] and bias["details"]["bias_no_signal"]
    assert gates["random_confusion"]["status"] in ("passed", "failed")  # confusion has no cutoff: it measures
    # constant models answer one class: the shared precondition speaks before the occlusion's own checks (which
    # tests/families/interpretability/test_occlusion_plan.py pins)
    for name in ("constant_interpret", "unconfident_sensitivity"):
        gate = gates[name]
        assert gate["status"] == "inconclusive" and gate["value"] is None, gate["summary"]
        assert "no signal: the model's accuracy" in gate["details"]["inconclusive"]
        assert "it predicts 1 of 10 classes" in gate["details"]["inconclusive"]
    one = gates["one_group"]
    assert one["status"] == "inconclusive" and one["value"] == 0.0, one["summary"]
    assert "only group lighting=day has rows" in one["details"]["inconclusive"]
    assert gates["all_groups"]["status"] == "passed", gates["all_groups"]["summary"]
    labels = np.load(files / "data" / "eval.npz")["y"]
    chance = max(np.bincount(labels)) / N
    for model in ("random_output", "constant"):  # issue #29 §2: no relative gate passes a model without signal
        for name in ("degradation", "pattern", "confusion", "weighted", "monitor", "risk", "occlusion"):
            gate = gates[f"{model}_{name}"]
            assert gate["status"] == "inconclusive" and gate["value"] is None, (model, name, gate["summary"])
            why = gate["details"]["inconclusive"]
            assert why.startswith("no signal: the model's accuracy ") and f"is not above chance {chance:.3f}" in why
            assert f"10 classes, {N} inputs of fixture 'dataset'" in why and "Fix: " in why, why
            assert gate["details"]["no_signal"]["chance_accuracy"] == pytest.approx(chance)
    for name in ("degradation", "pattern", "confusion", "weighted", "monitor", "risk", "occlusion"):
        gate = gates[f"model_{name}"]  # the positive control: the trained CNN gives a signal, every gate measures
        assert gate["status"] in ("passed", "failed") and "no_signal" not in gate["details"], gate["summary"]


def test_bias_on_random_activations_has_no_signal_and_real_structure_has() -> None:
    """Engine known answer: random units and random decisions put no NAPVD below the cutoff (mean − std)."""
    from pytest_dnnsafety.engines.inspection.deepinspect import inspect_classes

    gen = torch.Generator().manual_seed(0)
    active = torch.rand(2000, 64, generator=gen) > 0.5
    predictions = torch.randint(0, 10, (2000,), generator=gen)
    result = inspect_classes(active, predictions, num_classes=10)
    assert result.max_bias() == 0.0 and result.bias_no_signal is not None
    assert "no pair of predicted classes has a NAPVD below the bias cutoff" in result.bias_no_signal
    assert result.to_details(by="bias")["bias_no_signal"] == result.bias_no_signal
    assert result.detail(by="bias").startswith("no bias signal: every avg_bias is 0 (45 pairs)")
    # each class fires its units at its own rates, and class 1 at nearly class 0's: NAPVD(0, 1) falls below the
    # cutoff, so the triplets through that pair measure how differently the other classes sit from 0 and 1
    rates = torch.rand(10, 64, generator=gen)
    rates[1] = (rates[0] + 0.05 * torch.rand(64, generator=gen)).clamp(0, 1)
    active = torch.rand(2000, 64, generator=gen) < rates[predictions]
    structured = inspect_classes(active, predictions, num_classes=10)
    assert structured.bias_no_signal is None and structured.max_bias() > 0


PMI_LABEL_42 = """
    import pytest
    import torch


    class Threshold(torch.nn.Module):
        def forward(self, x):
            return torch.stack([0.55 - x[:, 0], x[:, 0] - 0.55], dim=1)


    @pytest.fixture(scope="session")
    def model():
        return Threshold()
"""


@pytest.mark.slow
def test_pmi_gate_with_labels_outside_the_model_classes_is_an_error(gate_project: GateProject) -> None:
    gen = np.random.default_rng(0)
    np.savez(gate_project.pytester.path / "operation.npz", x=gen.random((400, 2)).astype(np.float32))
    np.savez(gate_project.pytester.path / "labelled.npz", x=gen.random((300, 2)).astype(np.float32),
             y=np.full(300, 42, dtype=np.int64))
    gate_project.ini.update({"dnnsafety_operational_data": "operation.npz", "dnnsafety_data": "labelled.npz"})
    gate_project.write("conftest.py", PMI_LABEL_42)
    gate_project.tests("""
        import pytest


        @pytest.mark.max_pmi_ub(1.0, eps=0.05, box=[[0, 0], [1, 1]], samples_per_cell=100, bootstrap=5,
                                accept_violated_assumptions=True, empty_cell_label="nearest")
        def test_pmi():
            pass
    """)
    gate_project.run("--dnnsafety-json=evidence.json")
    gate = json.loads((gate_project.pytester.path / "evidence.json").read_text())["gates"][0]
    assert gate["status"] == "error", gate["summary"]
    assert "class 42" in gate["summary"] and "2 classes" in gate["summary"], gate["summary"]
