"""The ONNX graph translated for CROWN/IBP and attack gradients (files/onnx_graph.py), on the patterns torch's legacy
exporter emits: ``x.view(x.size(0), -1)`` (Shape/Gather/Unsqueeze/Concat/Reshape), initializers it shares through
``Identity``, input normalisation by constant tensors, strided/grouped/dilated convolutions and the other layers; the
refusals name the operator that is not translated (``Pad``, not the shape arithmetic before it) and bound the
constants folding may make; the attack gates read onnxruntime's predictions with the translation's gradients, say so
in their details and give the eager model's robust accuracy; the verification loop's per-batch check names
onnxruntime."""

from __future__ import annotations


import pytest
import torch
from torch import nn

pytest.importorskip("onnx", reason="needs the [onnx] extra")
pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")

from onnx import TensorProto, helper  # noqa: E402

from pytest_dnnsafety.engines.bounds.model import BoundedModel  # noqa: E402
from pytest_dnnsafety.engines.robustness.plan import ClassifierAttack  # noqa: E402
from pytest_dnnsafety.errors import ConfigError, MetricError  # noqa: E402
from pytest_dnnsafety.files import onnx_graph  # noqa: E402
from pytest_dnnsafety.files.onnx_model import OnnxModel  # noqa: E402
from _onnx_export import example_digits, onnx_model  # noqa: E402

#: float32 tolerance of the bounds: the translated layers hold the same weights as the eager ones
TOL = 1e-4


def _export(model: nn.Module, shape: tuple[int, ...]) -> OnnxModel:
    return onnx_model(model, shape, "y")


class _View(nn.Module):
    """``h.view(h.size(0), -1)``: the exporter's Shape → Gather → Unsqueeze → Concat → Reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.head = nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.head(h.view(h.size(0), -1))


class _Zoo(nn.Module):
    """Normalisation by constant tensors, strided/grouped/dilated convolutions, LeakyReLU, MaxPool, Sigmoid,
    AvgPool, Dropout, Tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 0.3, 0.25]).view(1, 3, 1, 1))
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.1), nn.MaxPool2d(2),
                                 nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2), nn.Sigmoid(), nn.AvgPool2d(2),
                                 nn.Flatten(), nn.Dropout(0.3), nn.Linear(16, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x):
        return self.net((x - self.mean) / self.std)


def _shared() -> nn.Module:
    # a fresh BatchNorm1d: weight == running_var and bias == running_mean, stored once and shared through Identity
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


CASES = {"view": (_View, (1, 8, 8)), "zoo": (_Zoo, (3, 16, 16)), "shared_initializers": (_shared, (1, 4, 4))}


@pytest.mark.parametrize("case", list(CASES))
def test_exporter_patterns_translate_and_bound_as_the_eager_model(case: str) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    eager = build().eval()
    model = _export(eager, shape)
    x = torch.rand(6, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, runtime, got = eager(x), model(x), model.translated()(x)
    assert (got - runtime).abs().max() < 1e-5 and (got - want).abs().max() < 1e-5
    for method in ("ibp", "crown"):
        lo_e, hi_e = getattr(BoundedModel(eager), method)(x - 0.01, x + 0.01)
        lo_o, hi_o = getattr(BoundedModel(model), method)(x - 0.01, x + 0.01)
        diff = max((lo_e - lo_o).abs().max().item(), (hi_e - hi_o).abs().max().item())
        assert diff < TOL, f"{case} {method}: max |bound difference| {diff:.3g}"


def test_the_refusal_names_the_untranslated_operator_not_the_shape_arithmetic_before_it() -> None:
    model = _export(nn.Sequential(nn.ZeroPad2d((1, 0, 1, 0)), nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(98, 4)),
                    (1, 8, 8))
    with pytest.raises(ConfigError, match=r"cannot go through: Pad \(node '/0/Pad'\)\. The translation covers") as err:
        model.translated()
    assert "Transpose" not in str(err.value).split("The translation covers")[0]


@pytest.mark.parametrize("dims, size", [([4100, 4100, 1, 1], "16810000")])
def test_constant_folding_is_bounded(dims: list[int], size: str) -> None:
    """67 MB, under the runtime limit of one tensor (files/onnx_sizes.py refuses a forged 2^64-element shape when the
    file is loaded: tests/files/test_onnx_sizes.py), over the translation's folding limit."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    shape = helper.make_node("Constant", [], ["s"], value=helper.make_tensor("v", TensorProto.INT64, [4], dims))
    fill = helper.make_node("ConstantOfShape", ["s"], ["c"], name="the_fill")
    add = helper.make_node("Add", ["x", "c"], ["y"], name="add")
    graph = helper.make_graph([shape, fill, add], "g", [x], [y])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model = OnnxModel(proto.SerializeToString(), where="test model")
    with pytest.raises(ConfigError, match=rf"ConstantOfShape \(node 'the_fill': would make a constant of {size} "):
        model.translated()


def _digits() -> nn.Module:
    return example_digits()


def test_attack_gates_read_onnxruntime_with_the_translations_gradients_and_say_so() -> None:
    eager = _digits()
    model = _export(eager, (1, 8, 8))
    x = torch.rand(48, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = eager(x).argmax(1)
    data = torch.utils.data.TensorDataset(x, y)
    plan = ClassifierAttack("min_robust_accuracy", ("fgsm", "pgd", "gaussian_noise"), 0.02, clip=(0.0, 1.0), steps=5)
    a = plan.assess(eager, data, batch_size=16, device="cpu", seed=0)
    b = plan.assess(model, data, batch_size=16, device="cpu", seed=0)
    assert a.robust_accuracy_all == pytest.approx(b.robust_accuracy_all, abs=1e-9)
    assert a.robust_accuracy == pytest.approx(b.robust_accuracy, abs=1e-9)
    assert a.loss == pytest.approx(b.loss, abs=1e-5)
    assert "gradients" not in plan.accuracy_report(a)["details"]
    note = plan.accuracy_report(b)["details"]["gradients"]
    assert "translated into torch layers" in note and "predictions from onnxruntime" in note
    assert plan.loss_report(b)["details"]["gradients"] == note


def test_an_attack_on_an_untranslatable_graph_is_refused_before_any_model_run(monkeypatch) -> None:
    model = _export(nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.Softmax(1), nn.Linear(4, 3)), (1, 4, 4))
    runs = []
    real = model._run
    monkeypatch.setattr(model, "_run", lambda *args: runs.append(1) or real(*args))
    data = torch.utils.data.TensorDataset(torch.rand(8, 1, 4, 4), torch.zeros(8, dtype=torch.long))
    plan = ClassifierAttack("min_robust_accuracy", ("pgd",), 0.1, clip=(0.0, 1.0), steps=2)
    with pytest.raises(ConfigError, match=r"Softmax \(node '/2/Softmax'\)"):
        plan.assess(model, data, batch_size=8, device="cpu", seed=0)
    assert runs == []
    # a family without gradients needs no translation: onnxruntime's outputs only
    noise = ClassifierAttack("min_robust_accuracy", ("gaussian_noise",), 0.1, clip=(0.0, 1.0))
    assert noise.assess(model, data, batch_size=8, device="cpu", seed=0).n == 8


def test_the_verification_loop_checks_the_translation_against_onnxruntime_per_batch(monkeypatch) -> None:
    from pytest_dnnsafety.engines.robustness.verification import verify_robustness

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    model = _export(eager, (1, 4, 4))
    def wrong(t, node, ins, a):  # a translation computing something else than the graph
        return t.graph.call_function(nn.functional.leaky_relu, (t.tensor(ins[0]), 0.5))

    monkeypatch.setitem(onnx_graph._HANDLERS, "Relu", wrong)
    monkeypatch.setattr(onnx_graph, "_self_check", lambda *args: None)  # so only the per-batch check can catch it
    x = torch.rand(20, 1, 4, 4)
    with torch.no_grad():
        y = eager(x).argmax(1)
    with pytest.raises(MetricError, match="translated graph of the ONNX graph computes other logits than onnxruntime"):
        verify_robustness(model, (x, y), 0.01, method="ibp", attack_steps=0)
