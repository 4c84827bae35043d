"""Acceptance of the ONNX route (issue #32): the example project's classifier exported to ONNX gives, gate for gate,
the eager model's values — every gate family the example uses, the activation gates (by eager module path, mapped to
the graph's tensors), attacks (gradients of the translated graph, values from onnxruntime) and CROWN included."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnx", reason="needs the [onnx] extra")
pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "example_project"
#: Gates whose value is a wall-clock ratio (the monitors' overhead): measured, never equal between two runs.
TIMED = {"monitor overhead"}

pytestmark = pytest.mark.slow


def _run(project: Path, report: Path, *args: str) -> dict[str, dict]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          f"--dnnsafety-json={report}", *args], cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {g["nodeid"]: g for g in json.loads(report.read_text())["gates"]}


def test_the_example_classifier_as_onnx_gives_the_eager_values(tmp_path: Path) -> None:
    if not (EXAMPLE / "models" / "digits_cnn.pt").is_file() or not (EXAMPLE / "data" / "eval.npz").is_file():
        pytest.skip("the example project is not trained: run `cd example_project && python -m digits_demo.train`")
    project = tmp_path / "example_project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("reports", "__pycache__", ".pytest_cache"))
    sys.path.insert(0, str(project))
    try:
        from digits_demo.model import build_model
    finally:
        sys.path.remove(str(project))
    model = build_model().eval()
    model.load_state_dict(torch.load(project / "models" / "digits_cnn.pt", weights_only=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.rand(2, 1, 8, 8),), str(project / "models" / "digits_cnn.onnx"), dynamo=False,
                          input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}})
    eager = _run(project, tmp_path / "eager.json")
    onnx = _run(project, tmp_path / "onnx.json", "-o", "dnnsafety_model=models/digits_cnn.onnx",
                "-o", "dnnsafety_model_factory=")
    assert eager.keys() == onnx.keys()
    families = set()
    for nodeid, want in eager.items():
        got = onnx[nodeid]
        assert got["status"] == want["status"] == "passed" or got["passed"] == want["passed"], nodeid
        if want["metric"] in TIMED:
            continue
        families.add(want["marker"])
        assert got["value"] == pytest.approx(want["value"], abs=1e-6), (nodeid, want["value"], got["value"])
        if want["bound"] is not None:
            assert got["bound"] == pytest.approx(want["bound"], abs=1e-6), nodeid
    assert {"min_verified_robustness", "min_robust_accuracy", "max_adversarial_confidence_loss", "max_pmi_ub",
            "min_neuron_k_activation", "max_class_confusion", "min_occlusion_sensitivity", "min_safe_radius",
            "min_scenario_accuracy", "max_weighted_confusion"} <= families
    crown = next(g for g in onnx.values() if g["marker"] == "min_verified_robustness")
    assert crown["details"]["bounds_model"].startswith("ONNX graph (translated into torch layers")
    model_input = crown["inputs"]["model"]  # the evidence names the artifact read: the .onnx file's digest
    digest = hashlib.sha256((project / "models" / "digits_cnn.onnx").read_bytes()).hexdigest()
    assert model_input["model_format"] == "ONNX" and model_input["digest"] == f"sha256:{digest}"


def test_an_unknown_layer_lists_the_graphs_names_and_module_paths(tmp_path: Path) -> None:
    from pytest_dnnsafety.engines.core.capture import capture
    from pytest_dnnsafety.errors import ConfigError
    from pytest_dnnsafety.files.onnx_model import OnnxModel

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.eval(), (torch.rand(2, 1, 4, 4),), str(path), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "n"}})
    model = OnnxModel.from_file(path, "test")
    x = torch.rand(10, 1, 4, 4)
    with pytest.raises(ConfigError, match=r"'nope'.*/2/Relu_output_0.*eager module path.*\b2\b"):
        capture(model, torch.utils.data.TensorDataset(x), ["nope"])
    eager = {}
    net[2].register_forward_hook(lambda m, i, o: eager.setdefault("relu", o.detach()))
    net(x)
    by_path = capture(model, torch.utils.data.TensorDataset(x), ["2"])
    by_name = capture(model, torch.utils.data.TensorDataset(x), ["/2/Relu_output_0"])
    assert torch.allclose(by_path["2"].max, eager["relu"], atol=1e-6)  # the module path names the eager output
    assert torch.equal(by_path["2"].max, by_name["/2/Relu_output_0"].max)
