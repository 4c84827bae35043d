"""ONNX models under onnxruntime (:mod:`pytest_dnnsafety.files.onnx_model`, issue #32, item 1).

A small CNN exported with ``torch.onnx.export`` (legacy exporter, dynamic batch axis) and loaded through the plugin's
loader gives the eager model's outputs (max abs difference printed; asserted below 1e-5) and its intermediate tensors
(node output names) equal the eager modules' forward-hook outputs; the shared activation pass reads them in one
run; an unknown name lists the graph's names; external data (when allowed) is inlined; a detector graph's
boxes/scores/labels become the plugin's detector output; a fixed-batch graph runs any batch; the evidence names the
ONNX file's digest; without the extra the error names it.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")
onnx = pytest.importorskip("onnx", reason="needs the [onnx] extra")

from pytest_dnnsafety.engines.core.capture import activations_from, capture, check_layers, layer_names  # noqa: E402
from pytest_dnnsafety.errors import ConfigError, ModelLoadError  # noqa: E402
from pytest_dnnsafety.files.loading import load_model  # noqa: E402
from pytest_dnnsafety.files.onnx_model import OnnxModel, is_onnx_model  # noqa: E402
from pytest_dnnsafety.files.provenance import fingerprint  # noqa: E402
from pytest_dnnsafety.settings import SETTINGS, Settings  # noqa: E402

CPU = torch.device("cpu")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _export(model: nn.Module, x: torch.Tensor, dynamic: bool = True, outputs: list[str] | None = None) -> bytes:
    buffer = io.BytesIO()
    outputs = outputs or ["logits"]
    axes = {name: {0: "n"} for name in ["x", *outputs]} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buffer, dynamo=False, input_names=["x"], output_names=outputs,
                          dynamic_axes=axes)
    return buffer.getvalue()


def _settings(root: Path, **ini: str) -> Settings:
    values = {SETTINGS[name].ini: value for name, value in ini.items()}
    return Settings(cli={}, ini=values.get, env={}, ini_file=root / "pyproject.toml", invocation_dir=root)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path, torch.Tensor]:
    torch.manual_seed(0)
    eager = SmallCNN().eval()
    root = tmp_path_factory.mktemp("onnx")
    (root / "model.onnx").write_bytes(_export(eager, torch.randn(2, 1, 10, 10)))
    return eager, root, torch.randn(37, 1, 10, 10)


def _load(root: Path, name: str = "model.onnx", **ini: str) -> Any:
    return load_model(_settings(root, model=name, **ini), CPU)


def test_outputs_equal_the_eager_model(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    eager, root, x = case
    model = _load(root)
    assert is_onnx_model(model) and not is_onnx_model(eager)
    assert model.input_name == "x" and model.output_names == ["logits"] and model.fixed_batch is None
    assert model.sha256 == hashlib.sha256((root / "model.onnx").read_bytes()).hexdigest()
    with torch.no_grad():
        want = eager(x)
    got = model(x)
    diff = float((got - want).abs().max())
    print(f"max abs difference ONNX vs eager: {diff:.3g}")
    assert got.dtype == torch.float32 and got.shape == want.shape and diff < 1e-5


def test_intermediate_tensors_equal_the_eager_hooks(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    eager, root, x = case
    model = _load(root)
    names = layer_names(model)
    relus = [name for name in names if "Relu" in name]
    assert len(relus) == 3 and "logits" in names and names.index("logits") == len(model.layer_names()) - 1
    assert {"features.1", "features.4", "head.2"} <= set(names)  # the eager module paths, after the node names
    seen: dict[str, torch.Tensor] = {}
    for module in ("features.1", "features.4", "head.2"):
        dict(eager.named_modules())[module].register_forward_hook(
            lambda m, a, out, module=module: seen.__setitem__(module, out.detach()))
    with torch.no_grad():
        want = eager(x)
    got: dict[int, torch.Tensor] = {}
    tapped = model.tapped(relus)
    out = tapped.run(lambda i, value: got.__setitem__(i, value), x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    for i, module in enumerate(("features.1", "features.4", "head.2")):
        torch.testing.assert_close(got[i], seen[module], rtol=0, atol=1e-5)
    eager._forward_hooks.clear()


def test_capture_reads_the_graph_tensors_in_one_pass(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    eager, root, x = case
    model = _load(root)
    relus = [name for name in layer_names(model) if "Relu" in name]
    y = torch.arange(len(x)) % 5
    want_out: list[Any] = []
    got_out: list[Any] = []
    want = capture(eager, (x, y), ["features.1", "features.4", "head.2"], batch_size=16, outputs=want_out)
    got = capture(model, (x, y), relus, batch_size=16, outputs=got_out)
    for onnx_name, module in zip(relus, ("features.1", "features.4", "head.2")):
        assert got[onnx_name].unit_shape == want[module].unit_shape
        for field in ("max", "mean", "min"):
            torch.testing.assert_close(getattr(got[onnx_name], field), getattr(want[module], field),
                                       rtol=0, atol=1e-5)
    torch.testing.assert_close(got_out[0].logits, want_out[0].logits, rtol=0, atol=1e-5)
    assert activations_from(model) == {"activations_from": "ONNX graph tensors"}


def test_an_unknown_layer_lists_the_graphs_names(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    model = _load(case[1])
    with pytest.raises(ConfigError, match=r"'features\.9'.*node output name.*/features/features\.1/Relu_output_0"
                                          r".*eager module path.*features\.1"):
        check_layers(model, ["features.9"])
    check_layers(model, ["features.1", "/features/features.1/Relu_output_0"])  # a module path names its output


def test_the_fingerprint_names_the_onnx_file(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    model = _load(case[1])
    record = fingerprint(model)
    assert record["model_format"] == "ONNX" and record["file"] == "model.onnx"
    assert record["digest"] == "sha256:" + hashlib.sha256((case[1] / "model.onnx").read_bytes()).hexdigest()


def test_external_data_is_refused_then_inlined_when_allowed(case: tuple[nn.Module, Path, torch.Tensor],
                                                            tmp_path: Path) -> None:
    eager, root, x = case
    proto = onnx.load_model(str(root / "model.onnx"))
    onnx.save_model(proto, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    with pytest.raises(ModelLoadError, match="external data is refused.*dnnsafety_onnx_external_data"):
        _load(tmp_path, "ext.onnx")
    model = _load(tmp_path, "ext.onnx", onnx_external_data="true")
    assert b"weights.bin" not in model.proto
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), rtol=0, atol=1e-5)


def test_a_custom_domain_file_is_refused_through_the_loader(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Evil", ["x"], ["y"], domain="com.evil")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.evil", 1)])
    (tmp_path / "evil.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match=r"dnnsafety_model='evil.onnx'.*custom-operator domains \('com.evil'\)"):
        _load(tmp_path, "evil.onnx")


@pytest.mark.parametrize("data", [b"", b"\xff" * 64, b"PK\x03\x04garbage"])
def test_garbage_onnx_files_give_a_clear_error(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "bad.onnx").write_bytes(data)
    with pytest.raises(ModelLoadError, match="bad.onnx|not a valid ONNX model"):
        _load(tmp_path, "bad.onnx")


def test_a_fixed_batch_graph_runs_any_batch(case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    eager, _, x = case
    model = OnnxModel(_export(eager, x[:8], dynamic=False))
    assert model.fixed_batch == 8
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), rtol=0, atol=1e-5)  # 37 rows: 4 calls of 8 + 5 padded


class Detector(nn.Module):
    """Two padded detections per image: the second is padding (label -1) where the image's mean is negative."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = x.flatten(1).mean(1)
        boxes = torch.stack([torch.stack([m, m, m + 1, m + 2], 1), torch.stack([m, m, m + 3, m + 3], 1)], 1)
        scores = torch.stack([torch.sigmoid(m), torch.sigmoid(-m)], 1)
        labels = torch.stack([torch.zeros_like(m), torch.where(m < 0, -torch.ones_like(m), torch.ones_like(m))], 1)
        return boxes, scores, labels.long()


def test_a_detector_graph_returns_the_plugins_detections() -> None:
    from pytest_dnnsafety.data.tasks import detections_from_output, is_detection_output

    x = torch.randn(6, 1, 4, 4)
    model = OnnxModel(_export(Detector(), x[:2], outputs=["boxes", "scores", "labels"]))
    out = model(x)
    assert is_detection_output(out) and len(out) == 6
    boxes, scores, labels = Detector()(x)
    for i, image in enumerate(out):
        keep = labels[i] >= 0
        torch.testing.assert_close(image["boxes"], boxes[i][keep])
        torch.testing.assert_close(image["scores"], scores[i][keep])
        assert image["labels"].tolist() == labels[i][keep].tolist()
    assert detections_from_output(out, 6, "t").scores.numel() == int((labels >= 0).sum())


def test_without_the_extra_the_error_names_it(case: tuple[nn.Module, Path, torch.Tensor],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_onnxruntime(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "onnxruntime":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    with pytest.raises(ModelLoadError, match=r'pip install "pytest-dnnsafety\[onnx\]"'):
        _load(case[1])


def test_an_onnx_project_gates_like_the_eager_model(pytester: pytest.Pytester,
                                                    case: tuple[nn.Module, Path, torch.Tensor]) -> None:
    eager, root, x = case
    y = (torch.arange(len(x)) % 5).numpy()
    np.savez(pytester.path / "eval.npz", x=x.numpy(), y=y)
    (pytester.path / "model.onnx").write_bytes((root / "model.onnx").read_bytes())
    relu = "/features/features.1/Relu_output_0"
    light = ["day" if i % 3 else "night" for i in range(len(x))]
    (pytester.path / "scenarios.csv").write_text("light\n" + "\n".join(light) + "\n")
    (pytester.path / "conditions.toml").write_text('[conditions]\nlight = ["day", "night"]\n')
    (pytester.path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ndnnsafety_model = "model.onnx"\ndnnsafety_data = "eval.npz"\n'
        'dnnsafety_scenarios = "scenarios.csv"\ndnnsafety_conditions = "conditions.toml"\n')
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.min_scenario_accuracy(0.0, by=["light"], min_samples=1)
        def test_accuracy(model, dataset):
            pass

        @pytest.mark.min_neuron_k_activation(0.0, layer={relu!r}, k=2)
        def test_coverage(model, dataset):
            pass
    """)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider", "--dnnsafety-json=ev.json")
    result.assert_outcomes(passed=2)
    evidence = json.loads((pytester.path / "ev.json").read_text())
    gates = {g["nodeid"].split("::")[1].split("[")[0]: g for g in evidence["gates"]}
    with torch.no_grad():
        right = eager(x).argmax(1).numpy() == y
    accuracy = min(float(right[np.array(light) == group].mean()) for group in ("day", "night"))
    assert gates["test_accuracy"]["value"] == pytest.approx(accuracy, abs=1e-12)
    assert gates["test_coverage"]["details"]["activations_from"] == "ONNX graph tensors"
    model = gates["test_accuracy"]["inputs"]["model"]
    assert model["model_format"] == "ONNX" and model["digest"].startswith("sha256:")
