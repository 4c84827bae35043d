"""An ONNX graph translated into torch layers (files/onnx_graph.py): equal to onnxruntime and to the eager model,
certified bounds (IBP, CROWN) and gradient attacks on the ``.onnx`` equal to those on the eager module, unsupported
operators refused by name before any work."""

from __future__ import annotations


import pytest
import torch
from torch import nn

pytest.importorskip("onnx", reason="needs the [onnx] extra")
pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")

import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError  # noqa: E402
from pytest_dnnsafety.engines.perturb.adversarial import pgd  # noqa: E402
from pytest_dnnsafety.engines.robustness.verification import verify_robustness  # noqa: E402
from pytest_dnnsafety.files.onnx_graph import OnnxTranslation  # noqa: E402
from pytest_dnnsafety.files.onnx_model import OnnxModel  # noqa: E402
from _onnx_export import example_digits, onnx_model  # noqa: E402



def _export(model: nn.Module, shape: tuple[int, ...]) -> OnnxModel:
    return onnx_model(model, shape, "logits")


def _digits() -> nn.Module:
    return example_digits()


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(h + self.block(h))
        return self.head(torch.flatten(self.pool(h), 1))


def _residual() -> nn.Module:
    torch.manual_seed(1)
    model = _Residual()
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("build, shape", [(_digits, (1, 8, 8)), (_residual, (3, 8, 8))], ids=["digits", "residual"])
def test_translation_equals_onnxruntime_and_eager(build, shape) -> None:
    eager = build()
    onnx_model = _export(eager, shape)
    translated = onnx_model.translated()
    assert isinstance(translated, OnnxTranslation)
    x = torch.rand(16, *shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, runtime, got = eager(x), onnx_model(x), translated(x)
    assert (got - runtime).abs().max() < 1e-5
    assert (got - want).abs().max() < 1e-5
    assert list(onnx_model.parameters()) == []  # the translation is not a submodule


@pytest.mark.parametrize("method", ["ibp", "crown"])
@pytest.mark.parametrize("build, shape", [(_digits, (1, 8, 8)), (_residual, (3, 8, 8))], ids=["digits", "residual"])
def test_bounds_on_the_onnx_file_equal_the_eager_models(build, shape, method) -> None:
    eager = build()
    onnx_model = _export(eager, shape)
    x = torch.rand(6, *shape, generator=torch.Generator().manual_seed(3))
    eps = 0.01
    lo_e, hi_e = getattr(BoundedModel(eager), method)(x - eps, x + eps)
    lo_o, hi_o = getattr(BoundedModel(onnx_model), method)(x - eps, x + eps)
    assert (lo_e - lo_o).abs().max() < 1e-4 and (hi_e - hi_o).abs().max() < 1e-4


def test_verification_on_the_onnx_file_equals_the_eager_models() -> None:
    eager = _digits()
    onnx_model = _export(eager, (1, 8, 8))
    x = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y = eager(x).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    a = verify_robustness(eager, data, 0.004, method="crown", clip=(0.0, 1.0))
    b = verify_robustness(onnx_model, data, 0.004, method="crown", clip=(0.0, 1.0))
    assert (a.verified, a.falsified, a.unknown) == (b.verified, b.falsified, b.unknown)
    assert a.margin_min == pytest.approx(b.margin_min, abs=1e-4)


def test_gradient_attack_reads_onnxruntime_values_with_the_translations_gradient() -> None:
    eager = _digits()
    onnx_model = _export(eager, (1, 8, 8))
    x = torch.rand(32, 1, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = eager(x).argmax(1)
    xe = pgd(eager, x, y, 0.1, torch.Generator().manual_seed(0), steps=5, clip=(0.0, 1.0))
    xo = pgd(onnx_model, x, y, 0.1, torch.Generator().manual_seed(0), steps=5, clip=(0.0, 1.0))
    assert (xe - xo).abs().max() < 1e-4
    with torch.no_grad():
        assert torch.equal(eager(xe).argmax(1), onnx_model(xo).argmax(1))


def _graph_with(node: onnx.NodeProto) -> OnnxModel:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    relu = helper.make_node("Relu", ["x"], ["h"], name="relu_0")
    graph = helper.make_graph([relu, node], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # older runtimes too
    return OnnxModel(model.SerializeToString(), where="test model")


def test_an_unsupported_operator_is_refused_by_name_before_any_work() -> None:
    model = _graph_with(helper.make_node("Softmax", ["h"], ["y"], name="the_softmax", axis=1))
    with pytest.raises(UnsupportedLayerError, match=r"Softmax \(node 'the_softmax'.*Fix: export"):
        BoundedModel(model)
    with pytest.raises(Exception, match="Softmax"):  # an attack asks for a gradient: refused the same way
        model(torch.rand(2, 4).requires_grad_(True)).sum()
    model2 = _graph_with(helper.make_node("Erf", ["h"], ["y"], name="erf_1"))
    with pytest.raises(UnsupportedLayerError, match="Erf"):
        BoundedModel(model2)
