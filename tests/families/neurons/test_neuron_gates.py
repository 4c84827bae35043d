"""Neuron gates end to end: one forward pass shared by gates, clear errors, xdist, the example project."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GateProject

ROOT = Path(__file__).resolve().parents[3]

CONFTEST = """
import pytest
import torch
from torch import nn
from pytest_dnnsafety.engines.core.guard import probing


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 0 if probing() else 1  # not the guard's determinism probe
        return self.classifier(self.features(x))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return Net()


@pytest.fixture(scope="session")
def dataset():
    gen = torch.Generator().manual_seed(3)
    # unlabelled: the neuron gates read no labels, and this untrained net answers class 2 to every input, a collapsed
    # model whose pattern deviation labelled data would make inconclusive (the relative gates' precondition)
    return torch.utils.data.TensorDataset(torch.randn(48, 1, 6, 6, generator=gen))
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


@pytest.fixture(scope="module")
def trained_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the example project, trained from scratch once for this module's runs."""
    project = tmp_path_factory.mktemp("example") / "example_project"
    shutil.copytree(ROOT / "example_project", project,
                    ignore=shutil.ignore_patterns("models", "data", "reports", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "digits_demo.train"], cwd=project, check=True, capture_output=True)
    return project


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("-n", "2")], ids=["xdist"])
def test_example_project_gates_pass(trained_example: Path, extra: tuple) -> None:
    """The example project, trained from scratch in a copy, passes all of its gates under two xdist workers
    (the serial run is README command 1, which CI runs first; test_torchrun runs it under two ranks)."""
    project = trained_example
    report = f"reports/e{len(extra)}.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error",
                          f"--dnnsafety-json={report}", *extra],
                         cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    evidence = json.loads((project / report).read_text())
    markers = {g["marker"] for g in evidence["gates"]}
    assert {"min_scene_coverage", "min_neuron_k_activation", "max_neuron_pattern_deviation",
            "max_adversarial_confidence_loss", "min_verified_robustness", "min_scenario_accuracy",
            "max_weighted_confusion", "min_interpretation_precision", "min_monitor_detection",
            "max_monitor_selective_risk", "max_monitor_overhead"} <= markers
    assert all(g["status"] == "passed" for g in evidence["gates"])
    if importlib.util.find_spec("jsonschema") is not None:  # the published schema (issue #23)
        from test_evidence_schema import validate_file

        assert validate_file(project / report) == []


# ---------------------------------------------------------------------- the model is checked too (issue #7)
# The common case: a small conv net on (N, 1, 8, 8) images. MODE picks what is wrong with it.
NETDEF = """
import torch
from torch import nn


class Conv8(nn.Module):
    def __init__(self):
        super().__init__()
        self.mode = "ok"
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.classifier(self.features(x))
        if self.mode == "nan":  # NaN logits for inputs whose first pixel is above 5; activations stay finite
            out = torch.where(x[:, :1, 0, 0] > 5, torch.full_like(out, float("nan")), out)
        return out


def build():
    torch.manual_seed(0)
    return Conv8()
"""

CONV_CONFTEST = """
import pytest
import torch

from netdef import Conv8, build

MODE = "{mode}"

if MODE != "file":
    @pytest.fixture(scope="session")
    def model():
        net = build()
        net.mode = MODE
        return net.double() if MODE == "float64" else net


@pytest.fixture(scope="session")
def dataset():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(48, 1, 8, 8, generator=gen)
    if MODE == "nan":
        x[37, 0, 0, 0] = 9.0  # batch 2 of 16
    if MODE == "flat":
        x = x.flatten(1)
    return torch.utils.data.TensorDataset(x)  # unlabelled: the untrained net is no better than chance on labels
"""

CONV_GATES = """
import pytest

@pytest.mark.min_neuron_k_activation(0.0, layer="classifier.2", k=2)
def test_pairs():
    pass

@pytest.mark.max_neuron_pattern_deviation(1.0, layer="features.1", groups=3)
def test_conv_patterns():
    pass

@pytest.mark.max_neuron_pattern_deviation(1.0, layer="classifier.2", groups=3, where={"weather": "rainy"})
def test_patterns_when_rainy():
    pass

def test_zz_calls(model, request):
    print("MODEL CALLS", getattr(model, "calls", None))
"""


def _conv_project(project: GateProject, mode: str) -> GateProject:
    project.write("netdef.py", NETDEF)
    project.write("conftest.py", CONV_CONFTEST.format(mode=mode))
    project.write("data/scenarios.csv", SCENARIOS)
    project.ini["dnnsafety_batch_size"] = "16"
    project.tests(CONV_GATES)
    return project


def _gate_errors(project: GateProject, *args: str) -> tuple[pytest.RunResult, dict[str, dict]]:
    result = project.run("-s", "--dnnsafety-json=e.json", *args)
    evidence = json.loads((project.pytester.path / "e.json").read_text())
    gates = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
    assert set(gates) == {"test_pairs", "test_conv_patterns", "test_patterns_when_rainy"}
    assert not any(g["status"] == "passed" or g["passed"] for g in gates.values())
    assert result.parseoutcomes().get("failed") == 3 and result.parseoutcomes().get("passed") == 1
    return result, gates


def test_nan_logits_fail_every_neuron_gate_naming_the_first_bad_batch(gate_project: GateProject) -> None:
    result, gates = _gate_errors(_conv_project(gate_project, "nan"))
    for gate in gates.values():
        assert gate["status"] == "error"
        assert gate["details"]["error"].splitlines()[0].startswith(
            "the shared forward pass (model outputs and layer activations): the model's outputs hold NaN/inf in 1 "
            "of 48 inputs; the first bad batch is batch 2.")
    # the determinism probe's two passes, the cost probe's three (gates/cost.py: a warm-up, then the fastest of two)
    # and the memory probe's two (engines/core/budget.py: 1 and 2 inputs), then one pass of 3 batches; its error
    # reached all three gates
    result.stdout.fnmatch_lines(["*MODEL CALLS 10*"])


def test_float64_model_with_float32_images_fails_the_neuron_gates_naming_both_dtypes(
        gate_project: GateProject) -> None:
    result, gates = _gate_errors(_conv_project(gate_project, "float64"))
    for gate in gates.values():
        first = gate["details"]["error"].splitlines()[0]
        assert first.startswith("the shared forward pass (model outputs and layer activations): the model raised "
                                "RuntimeError on batch 0 (inputs of shape (16, 1, 8, 8), float32, on cpu; "
                                "model: Conv8 with float64 weights on cpu)")
        assert "Fix: the inputs are float32 but the model's weights are float64" in first
    # the determinism probe tried 8 rows and the whole batch (both raised: left to the pass), the cost probe
    # and the memory probe tried once each (raised: both fall back), then the pass failed on its first batch, not
    # retried per gate
    result.stdout.fnmatch_lines(["*MODEL CALLS 5*"])


def test_flattened_inputs_to_a_conv_model_fail_the_neuron_gates_naming_the_shape(gate_project: GateProject) -> None:
    _, gates = _gate_errors(_conv_project(gate_project, "flat"))
    for gate in gates.values():
        first = gate["details"]["error"].splitlines()[0]
        assert "the model raised RuntimeError on batch 0 (inputs of shape (16, 64), float32" in first
        assert "Fix: give inputs in the shape the model expects" in first


@pytest.fixture(scope="session")
def conv_model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The conv net saved as TorchScript, torch.export program and state dict, each loaded once.

    Session scope: torch.export imports torch modules that an in-process pytester run must not import
    (and unload) itself.
    """
    import importlib.util
    import warnings

    import torch

    folder = tmp_path_factory.mktemp("conv_models")
    (folder / "netdef.py").write_text(NETDEF)
    spec = importlib.util.spec_from_file_location("_netdef_for_saving", folder / "netdef.py")
    netdef = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netdef)  # type: ignore[union-attr]
    net = netdef.build().eval()
    x = torch.rand(2, 1, 8, 8)
    files = {"torchscript": folder / "m.pt", "export": folder / "m.pt2", "state_dict": folder / "m.pth"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(net), str(files["torchscript"]))
        torch.jit.load(str(files["torchscript"]))(x)
    program = torch.export.export(net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    torch.export.save(program, str(files["export"]))
    torch.export.load(str(files["export"])).module()(x)
    torch.save(net.state_dict(), str(files["state_dict"]))
    return files


def _use_model_file(project: GateProject, files: dict[str, Path], how: str) -> str:
    name = files[how].name
    (project.pytester.path / "models").mkdir(exist_ok=True)
    shutil.copy(files[how], project.pytester.path / "models" / name)
    project.ini["dnnsafety_model"] = f"models/{name}"
    return name


@pytest.mark.parametrize(("how", "name", "first"), [
    ("torchscript", "m.pt", "layer 'classifier.2': layer activations need forward hooks, which TorchScript modules "
                            "do not support"),
], ids=["torchscript"])
def test_model_file_without_hookable_layers_fails_the_neuron_gates_with_the_eager_fix(
        conv_model_files: dict, gate_project: GateProject, how: str, name: str, first: str) -> None:
    project = _conv_project(gate_project, "file")
    assert _use_model_file(project, conv_model_files, how) == name
    _, gates = _gate_errors(project)
    error = gates["test_pairs"]["details"]["error"]
    assert error.splitlines()[0].startswith(first)
    assert "Fix: give the eager torch.nn.Module (dnnsafety_model_factory + a state dict, or a `model` fixture" in error
    assert gates["test_conv_patterns"]["details"]["error"].startswith("layer 'features.1': layer activations need")


@pytest.mark.parametrize("how", ["state_dict", "export"])
def test_state_dict_with_factory_is_the_fix_and_passes(conv_model_files: dict, gate_project: GateProject,
                                                       how: str) -> None:
    """A torch.export program passes too: its layers are read from its graph's nodes (tests/files/test_export_activations.py)."""
    project = _conv_project(gate_project, "file")
    _use_model_file(project, conv_model_files, how)
    if how == "state_dict":
        project.ini["dnnsafety_model_factory"] = "netdef:build"
    project.run().assert_outcomes(passed=4)
