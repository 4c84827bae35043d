"""Neuron gates end to end: one forward pass shared by gates, clear errors, xdist, the example project."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GateProject

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.classifier(self.features(x))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="session")
def dataset():
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(48, 1, 6, 6, generator=gen),
                                          torch.randint(0, 3, (48,), generator=gen))
"""

SCENARIOS = "weather,road,orientation\n" + "".join(
    f"{w},{r},{o}\n" for w, r, o in [("sunny", "stone", "straight"), ("rainy", "tarmac", "curvy"),
                                     ("cloudy", "mud", "curvy")] * 16)


@pytest.fixture
def neuron_project(gate_project: GateProject) -> GateProject:
    gate_project.write("conftest.py", CONFTEST)
    gate_project.write("data/scenarios.csv", SCENARIOS)
    gate_project.ini["dnnsafety_batch_size"] = "16"
    return gate_project


GATES = """
import pytest

@pytest.mark.min_neuron_k_activation(0.5, layer="classifier.2", k=2)
def test_pairs(model, dataset):
    pass

@pytest.mark.min_neuron_k_activation(0.2, layer="classifier.2", k=3, activation_threshold=0.1)
def test_triples():
    pass

@pytest.mark.min_neuron_k_activation(0.5, layer="features.1", k=1, reduce="mean")
def test_conv_channels():
    pass

@pytest.mark.max_neuron_pattern_deviation(0.9, layer="classifier.2", groups=3)
def test_patterns():
    pass

@pytest.mark.max_neuron_pattern_deviation(0.9, layer="classifier.2", groups=3, where={"weather": "rainy"})
def test_patterns_when_rainy():
    pass

def test_zz_one_forward_pass_for_all_gates(model, request):
    if hasattr(request.config, "workerinput"):
        pytest.skip("per-worker cache under xdist")
    assert model.calls == 3  # 48 inputs, batch size 16, one pass for both layers
"""


@pytest.mark.parametrize("extra", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_neuron_gates_run_share_one_pass_and_report(neuron_project: GateProject, extra: tuple) -> None:
    neuron_project.tests(GATES)
    result = neuron_project.run("-W", "error", "--dnnsafety-json=e.json", "-p", "no:randomly", *extra)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    assert outcomes.get("passed") == (6 if not extra else 5)
    evidence = json.loads((neuron_project.pytester.path / "e.json").read_text())
    gates = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
    assert gates["test_pairs"]["metric"] == "neuron k-activation coverage"
    assert gates["test_pairs"]["details"]["layer"] == "classifier.2"
    assert gates["test_pairs"]["details"]["total"] == 15 * 4  # C(6,2) pairs x 4 patterns
    assert gates["test_conv_channels"]["details"]["total"] == 8
    assert gates["test_patterns"]["op"] == "<="
    assert gates["test_patterns_when_rainy"]["details"]["n_inputs"] == 16
    result.stdout.fnmatch_lines(["*test_pairs*min_neuron_k_activation*PASS"])


def test_unknown_layer_fails_the_gate_listing_layers(neuron_project: GateProject) -> None:
    neuron_project.tests("""
        import pytest

        @pytest.mark.min_neuron_k_activation(0.5, layer="classifier.9")
        def test_gate():
            pass
    """)
    result = neuron_project.run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cannot compute neuron k-activation coverage: unknown layer 'classifier.9'*"
                                 "features, features.0, features.1, classifier, classifier.0*"])


def test_missing_layer_keyword_is_a_collection_error(neuron_project: GateProject) -> None:
    neuron_project.tests("""
        import pytest

        @pytest.mark.min_neuron_k_activation(0.5)
        def test_gate():
            pass
    """)
    result = neuron_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*@pytest.mark.min_neuron_k_activation: argument layer: missing*"])


def test_bad_reduce_is_a_collection_error(neuron_project: GateProject) -> None:
    neuron_project.tests("""
        import pytest

        @pytest.mark.min_neuron_k_activation(0.5, layer="features.1", reduce="median")
        def test_gate():
            pass
    """)
    result = neuron_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*argument reduce: 'median' is not one of 'max', 'mean'*"])


def test_pattern_gate_without_where_needs_no_scenario_table(neuron_project: GateProject) -> None:
    del neuron_project.ini["dnnsafety_scenarios"]
    neuron_project.tests("""
        import pytest

        @pytest.mark.max_neuron_pattern_deviation(1.0, layer="classifier.2", groups=3)
        def test_gate():
            pass
    """)
    neuron_project.run().assert_outcomes(passed=1)


def test_misaligned_scenario_table_fails_the_pattern_gate(neuron_project: GateProject) -> None:
    neuron_project.write("data/scenarios.csv", SCENARIOS.rsplit("\n", 3)[0] + "\n")
    neuron_project.tests("""
        import pytest

        @pytest.mark.max_neuron_pattern_deviation(1.0, layer="classifier.2", where={"weather": "sunny"})
        def test_gate():
            pass
    """)
    result = neuron_project.run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the scenario table has 46 rows but the data has 48 samples*"])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_example_project_gates_pass(tmp_path: Path, extra: tuple) -> None:
    """The example project, trained from scratch in a copy, passes all of its gates."""
    project = tmp_path / "example_project"
    shutil.copytree(ROOT / "example_project", project,
                    ignore=shutil.ignore_patterns("models", "data", "reports", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "digits_demo.train"], cwd=project, check=True, capture_output=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error",
                          "--dnnsafety-json=reports/e.json", *extra],
                         cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    evidence = json.loads((project / "reports" / "e.json").read_text())
    markers = {g["marker"] for g in evidence["gates"]}
    assert {"min_scene_coverage", "min_neuron_k_activation", "max_neuron_pattern_deviation"} <= markers
    assert all(g["status"] == "passed" for g in evidence["gates"])
