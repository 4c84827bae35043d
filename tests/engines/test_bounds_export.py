"""Certified bounds of deployed torch.export programs (.pt2): the ATen graph translated for BoundedModel.

The programs are exported with a dynamic batch dimension, saved, and loaded through the plugin's
loader (``load_model``), as a user's ``dnnsafety_model = "model.pt2"`` would be. Their IBP and
CROWN margin bounds must equal the eager model's (the translation holds the program's own tensors
and keeps its graph node for node), the gate must give the same value on the .pt2 as on the eager
model, and what cannot be bounded (a ViT's LayerNorm and softmax) is refused by the constructor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _digits import digits_cnn, digits_images
from _digits_project import digits_project, gates_of, write_digits_files
from _hostile import WithConstant, make_settings
from conftest import GateProject
from pytest_dnnsafety.engines.bounds import aten as bounds_aten
from pytest_dnnsafety.engines.bounds import export as bounds_export
from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError
from pytest_dnnsafety.engines.bounds.export import (ExportTranslation, bounds_model_note, export_mismatch,
                                                               translate_export)
from pytest_dnnsafety.engines.robustness.verification import verify_robustness
from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.files.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "scale_project"))
from scale_demo.models import resnet18, vit  # noqa: E402

CPU = torch.device("cpu")
BATCH = torch.export.Dim("batch", min=1, max=4096)


def _save_and_load(model: nn.Module, example: torch.Tensor, path: Path, decompose: bool = False) -> nn.Module:
    program = torch.export.export(model, (example,), dynamic_shapes=({0: BATCH},))
    if decompose:  # the core-ATen form (convolution, addmm, _native_batch_norm_legit_no_training, ...)
        program = program.run_decompositions()
    torch.export.save(program, str(path))
    return load_model(make_settings(path.parent, model=path.name), CPU)


def _assert_same_bounds(eager: nn.Module, exported: nn.Module, x: torch.Tensor, eps: float,
                        methods: tuple[str, ...] = ("ibp", "crown")) -> None:
    y = eager(x).argmax(dim=1)
    b_eager, b_export = BoundedModel(eager), BoundedModel(exported)
    assert isinstance(b_export.model, ExportTranslation)
    for method in methods:
        want = b_eager.margin_lower_bounds(x - eps, x + eps, y, method)
        got = b_export.margin_lower_bounds(x - eps, x + eps, y, method)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
        assert torch.equal(want.min(dim=1).values > 0, got.min(dim=1).values > 0), method  # verified: the same


@pytest.fixture(scope="module")
def cnn_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, nn.Module]:
    model = digits_cnn()
    x, _ = digits_images(2)
    return model, _save_and_load(model, x, tmp_path_factory.mktemp("cnn") / "digits.pt2")


def test_digits_cnn_bounds_equal_the_eager_models(cnn_pair: tuple[nn.Module, nn.Module]) -> None:
    eager, exported = cnn_pair
    x, _ = digits_images(1232)
    _assert_same_bounds(eager, exported, x[1200:], 0.01)
    assert bounds_model_note(exported) == "torch.export program (translated ATen graph, 9 nodes)"
    assert bounds_model_note(eager) is None


def test_translation_holds_the_programs_own_tensors(cnn_pair: tuple[nn.Module, nn.Module]) -> None:
    _, exported = cnn_pair
    translated = BoundedModel(exported).model
    assert translated.get_submodule("features.0").weight is exported.get_parameter("features.0.weight")
    assert translated.get_submodule("classifier.2").bias is exported.get_parameter("classifier.2.bias")
    x, _ = digits_images(8)
    with torch.no_grad():
        assert torch.equal(translated(x), exported(x))
    # the verification loop's per-batch check: equal outputs pass, a translation that drifted is caught
    assert not export_mismatch(translated, x, exported(x)).any()
    translated.get_submodule("classifier.2").bias = nn.Parameter(exported.get_parameter("classifier.2.bias") + 1)
    assert export_mismatch(translated, x, exported(x)).all()
    assert export_mismatch(nn.Linear(2, 2), x, exported(x)) is None


def test_decomposed_program_and_tensor_constants(tmp_path: Path) -> None:
    """The core-ATen form of the CNN (convolution, addmm of a transposed weight, view, max_pool2d_with_indices)
    and a program whose forward uses a buffer and a tensor constant (get_attr nodes in arithmetic)."""
    x, _ = digits_images(1216)
    x = x[1200:]
    exported = _save_and_load(digits_cnn(), x[:2], tmp_path / "core.pt2", decompose=True)
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"aten.addmm.default", "aten.convolution.default", "aten.max_pool2d_with_indices.default"} <= ops
    _assert_same_bounds(digits_cnn(), exported, x, 0.01)
    torch.manual_seed(0)
    const = WithConstant().eval()
    z = torch.randn(16, 4)
    _assert_same_bounds(const, _save_and_load(const, z[:2], tmp_path / "const.pt2"), z, 0.05)


class _SharedConv(nn.Module):
    """One conv called twice (two ATen nodes, one module path), padding="same", arithmetic around a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding="same", bias=False)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(72, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        h = 2 * (self.bn(self.conv(h) + h) - 0.5) / 3
        return self.fc(h.view(h.shape[0], -1))


@pytest.mark.parametrize("decompose", [False, True], ids=["aten", "core-aten"])
def test_a_layer_called_twice(tmp_path: Path, decompose: bool) -> None:
    torch.manual_seed(0)
    model = _SharedConv().eval()
    model.bn.running_mean.uniform_()
    model.bn.running_var.uniform_(0.5, 2)
    x = torch.rand(8, 2, 6, 6)
    exported = _save_and_load(model, x[:2], tmp_path / "shared.pt2", decompose)
    translated = BoundedModel(exported).model
    convs = [m for m in translated.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 2 and convs[0].weight is convs[1].weight is exported.get_parameter("conv.weight")
    _assert_same_bounds(model, exported, x, 0.01)


@pytest.mark.slow
def test_resnet18_bounds_equal_the_eager_models(tmp_path: Path) -> None:
    """Residual blocks, BatchNorm with non-trivial running statistics, adaptive pooling (ResNet-18 style)."""
    torch.manual_seed(0)
    model = resnet18(width=4, stem="cifar")
    with torch.no_grad():  # running statistics that are not the identity
        model.train()
        model(torch.rand(64, 3, 16, 16) * 2)
    model.eval()
    x = torch.rand(4, 3, 16, 16)
    exported = _save_and_load(model, x[:2], tmp_path / "resnet.pt2")
    assert bounds_model_note(exported) == "torch.export program (translated ATen graph, 68 nodes)"
    bn = BoundedModel(exported).model.get_submodule("layer2.0.shortcut.1")
    assert isinstance(bn, nn.BatchNorm2d) and not bn.training
    assert bn.running_var is exported.get_buffer("layer2.0.shortcut.1.running_var")
    _assert_same_bounds(model, exported, x, 1e-3, ("ibp",))
    _assert_same_bounds(model, exported, x[:1], 1e-6, ("crown",))  # CROWN through 17 ReLUs: one input


def test_vit_is_refused_by_the_constructor_naming_layernorm_and_softmax(tmp_path: Path) -> None:
    model = vit(image=32, patch=8, dim=32, depth=1, heads=2).eval()
    exported = _save_and_load(model, torch.rand(2, 3, 32, 32), tmp_path / "vit.pt2")
    with pytest.raises(UnsupportedLayerError) as info:
        BoundedModel(exported)
    text = str(info.value)
    assert "aten.layer_norm.default (LayerNorm) from module 'blocks.0.norm1' (LayerNorm)" in text
    assert "aten.softmax.int (softmax) from module 'blocks.0.attn.softmax' (Softmax)" in text
    assert "Fix: " in text and text.index("LayerNorm") < text.index("aten.unbind")  # the well-known layers first


def test_batchnorm_exported_in_training_mode_is_refused() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3)).train()
    exported = torch.export.export(model, (torch.rand(2, 1, 8, 8),), dynamic_shapes=({0: BATCH},)).module()
    with pytest.raises(UnsupportedLayerError, match=r"from module '1' \(BatchNorm2d\).*training mode.*Fix: "):
        BoundedModel(exported)


def test_a_translation_that_computes_something_else_is_an_error(cnn_pair: tuple[nn.Module, nn.Module],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _, exported = cnn_pair
    wrong = lambda t, node, a: t.graph.call_function(F.leaky_relu, (t.tensor(a["self"]), 0.5))  # noqa: E731
    monkeypatch.setitem(bounds_aten.HANDLERS, torch.ops.aten.relu, wrong)
    with pytest.raises(UnsupportedLayerError, match="does not compute what the program computes"):
        translate_export(exported, UnsupportedLayerError)
    # without the construction-time probe, the verification loop's check on the real batch catches it
    monkeypatch.setattr(bounds_export, "_self_check", lambda *args: None)
    x, y = digits_images(1264)
    with pytest.raises(MetricError, match="translated graph of the torch.export program computes other logits"):
        verify_robustness(exported, (x[1200:], y[1200:]), 0.01, method="ibp", attack_steps=0)


@pytest.mark.slow
def test_gate_on_a_pt2_model_file_gives_the_eager_models_value(gate_project: GateProject, tmp_path: Path) -> None:
    files = tmp_path / "files"
    x, y = write_digits_files(files)
    np.savez(files / "data" / "eval.npz", x=x[:96].numpy(), y=y[:96].numpy())
    program = torch.export.export(digits_cnn(), (x[:2],), dynamic_shapes=({0: BATCH},))
    torch.export.save(program, str(files / "models" / "digits.pt2"))
    gates = {"crown": "min_verified_robustness(0.1, eps=0.01, clip=(0, 1))",
             "ibp": "min_verified_robustness(0.1, eps=0.01, clip=(0, 1), method='ibp')"}
    project = digits_project(gate_project, files, gates)
    runs = {}
    for kind in ("eager", "pt2"):
        if kind == "pt2":
            project.ini["dnnsafety_model"] = "models/digits.pt2"
            del project.ini["dnnsafety_model_factory"]
        result = project.run("--dnnsafety-json=evidence.json")
        assert result.ret == 0, result.stdout.str()
        runs[kind] = gates_of(project)
    for name in gates:
        eager, pt2 = runs["eager"][name]["details"], runs["pt2"][name]["details"]
        assert pt2.pop("bounds_model") == "torch.export program (translated ATen graph, 9 nodes)"
        assert "bounds_model" not in eager
        assert runs["pt2"][name]["value"] == runs["eager"][name]["value"]
        # same verdicts: the PGD attack on the undecided inputs runs through the program's autograd
        assert {k: pt2[k] for k in ("verified", "falsified", "unknown")} == \
            {k: eager[k] for k in ("verified", "falsified", "unknown")}
        assert pt2["margin_min"] == pytest.approx(eager["margin_min"], abs=1e-5)
