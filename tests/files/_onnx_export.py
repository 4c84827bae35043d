"""ONNX test helpers: a module exported by torch's legacy exporter (dynamic batch) as an :class:`OnnxModel`, and the
example project's digits CNN (its trained weights when present, else seeded ones)."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[2] / "example_project"


def export_onnx(model: nn.Module, shape: tuple[int, ...], output: str = "logits") -> bytes:
    """The ``.onnx`` bytes of ``model`` on inputs of per-sample ``shape``, input ``x``, batch axis dynamic."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
        torch.onnx.export(model.eval(), (torch.rand(2, *shape),), buf, dynamo=False, input_names=["x"],
                          output_names=[output], dynamic_axes={"x": {0: "n"}, output: {0: "n"}})
    return buf.getvalue()


def onnx_model(model: nn.Module, shape: tuple[int, ...], output: str = "logits"):
    """:func:`export_onnx` loaded as an :class:`~pytest_dnnsafety.files.onnx_model.OnnxModel`."""
    from pytest_dnnsafety.files.onnx_model import OnnxModel

    return OnnxModel(export_onnx(model, shape, output), where="test model")


def example_digits() -> nn.Module:
    """The example project's digits CNN in eval mode: its trained weights when they were generated (git-ignored),
    else seeded random weights (the equalities tested hold for any weights)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from digits_demo.model import build_model
    finally:
        sys.path.remove(str(EXAMPLE))
    torch.manual_seed(0)
    model = build_model()
    state = EXAMPLE / "models" / "digits_cnn.pt"
    if state.exists():
        model.load_state_dict(torch.load(state, weights_only=True))
    return model.eval()
