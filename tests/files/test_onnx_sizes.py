"""What an ONNX graph allocates at run time, bounded before onnxruntime runs it (files/onnx_sizes.py).

A graph can compute a size — ``ConstantOfShape`` of a constant shape, ``Expand``/``Range``/``Tile`` to a shape made
from the input's values or its shape — and have onnxruntime allocate tens of gigabytes. Each hostile graph here is
refused within a second, naming the node and its operator, before onnxruntime runs it (at construction when the
input's per-sample shape is static, else before the first run at a new shape); the example exports and the
exporter's usual patterns pass.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("onnx", reason="needs the [onnx] extra")
pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")

from onnx import TensorProto, helper  # noqa: E402

from pytest_dnnsafety.errors import ModelLoadError  # noqa: E402
from pytest_dnnsafety.files.onnx_model import OnnxModel  # noqa: E402


def _model(nodes: list, inputs: list, constants: list | None = None) -> bytes:
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs, [y], initializer=constants or [])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return proto.SerializeToString()


def _int64(name: str, values: list[int]) -> object:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])


def _fill() -> bytes:
    """A 64 GB constant of a constant shape, summed into the output."""
    return _model([helper.make_node("Constant", [], ["s"], value=_int64("v", [40000, 40000, 10])),
                   helper.make_node("ConstantOfShape", ["s"], ["c"], name="the_fill"),
                   helper.make_node("ReduceSum", ["c"], ["r"], keepdims=0),
                   helper.make_node("Add", ["x", "r"], ["y"])], [X])


def _expand_from_values() -> bytes:
    """``Expand`` to a shape read from the input's values (x[0, :2] cast to int64): unknown before it runs."""
    return _model([helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["head"]),
                   helper.make_node("Reshape", ["head", "flat"], ["head1"]),
                   helper.make_node("Cast", ["head1"], ["shape"], to=TensorProto.INT64),
                   helper.make_node("Expand", ["one", "shape"], ["big"], name="the_expand"),
                   helper.make_node("ReduceSum", ["big"], ["r"], keepdims=0),
                   helper.make_node("Add", ["x", "r"], ["y"])], [X],
                  [_int64("starts", [0, 0]), _int64("ends", [1, 2]), _int64("axes", [0, 1]), _int64("flat", [2]),
                   helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])


def _range_from_values() -> bytes:
    """``Range`` up to the input's first value: its length is unknown before it runs."""
    return _model([helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
                   helper.make_node("Range", ["zero", "m", "step"], ["r"], name="the_range"),
                   helper.make_node("ReduceSum", ["r"], ["s"], keepdims=0),
                   helper.make_node("Add", ["x", "s"], ["y"])], [X],
                  [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
                   helper.make_tensor("step", TensorProto.FLOAT, [], [1.0])])


def _expand_by_the_input_shape() -> bytes:
    """A dynamic-width input expanded to 10^5 × its shape: known only at a given width, then too big."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "w"])
    return _model([helper.make_node("Shape", ["x"], ["shape"]),
                   helper.make_node("Mul", ["shape", "times"], ["big_shape"]),
                   helper.make_node("Expand", ["one", "big_shape"], ["big"], name="the_expand"),
                   helper.make_node("ReduceSum", ["big"], ["r"], keepdims=0),
                   helper.make_node("Add", ["x", "r"], ["y"])], [x],
                  [_int64("times", [100000, 100000]), helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])


@pytest.mark.parametrize("build, words", [
    (_fill, r"node 'the_fill' \(ConstantOfShape\) makes a tensor of shape \[40000, 40000, 10\] \(59\.6 GiB"),
    (_expand_from_values, r"node 'the_expand' \(Expand\) makes a tensor whose shape depends on values computed at "
                          r"run time"),
    (_range_from_values, r"node 'the_range' \(Range\) makes a tensor whose shape depends on values"),
])
def test_a_graph_that_would_allocate_without_bound_is_refused_when_loaded(build, words: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=words) as info:
        OnnxModel(build(), where="the model file")
    assert time.perf_counter() - start < 5
    assert "refused before onnxruntime" in str(info.value) or "cannot be bounded before onnxruntime" in str(info.value)
    assert "Fix:" in str(info.value)


def test_a_dynamic_input_shape_is_bounded_before_the_first_run_at_that_shape() -> None:
    model = OnnxModel(_expand_by_the_input_shape(), where="the model file")  # its width unknown: nothing to bound yet
    runs = []
    real = model._session
    model._session = lambda *args: runs.append(1) or real(*args)  # type: ignore[method-assign]
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"node 'the_expand' \(Expand\) makes a tensor of shape \[100000, 300000\]"):
        model(torch.rand(2, 3))
    assert time.perf_counter() - start < 5 and runs == []


def test_the_exporters_patterns_and_a_detector_decoding_pass() -> None:
    """A legitimate graph with value-dependent shape arithmetic that inference resolves (``x.view(x.size(0), -1)``,
    ``ConstantOfShape`` of the input's shape) runs."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 3])
    model = OnnxModel(_model([helper.make_node("Shape", ["x"], ["shape"]),
                              helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
                              helper.make_node("Add", ["x", "zeros"], ["sum"]),
                              helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
                              helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
                              helper.make_node("Concat", ["n1", "minus_one"], ["flat"], axis=0),
                              helper.make_node("Reshape", ["sum", "flat"], ["y"])], [x],
                             [helper.make_tensor("zero", TensorProto.INT64, [], [0]), _int64("axes", [0]),
                              _int64("minus_one", [-1])]), where="the model file")
    x = torch.rand(5, 2, 3)
    torch.testing.assert_close(model(x), x.reshape(5, -1))


class _ClassToken(torch.nn.Module):
    """A ViT's class token, ``cls.expand(x.shape[0], -1, -1)``: the exporter's Shape → ... → Where → Expand, which
    ONNX's own value propagation leaves unknown; the shape arithmetic is folded and the graph loads."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 3))
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        tokens = x.flatten(2).transpose(1, 2)
        return self.head(torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], 1).mean(1))


def test_a_class_token_expanded_to_the_batch_loads_and_runs() -> None:
    from _onnx_export import onnx_model

    eager = _ClassToken().eval()
    model = onnx_model(eager, (3, 4, 4))
    x = torch.rand(5, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)


def test_a_shape_whose_numpy_product_wraps_to_zero_is_refused() -> None:
    """2^31 × 2^31 × 4 elements: numpy's int64 product wraps to 0; the sizes are Python integers."""
    model = _model([helper.make_node("Constant", [], ["s"], value=_int64("v", [2**31, 2**31, 4])),
                    helper.make_node("ConstantOfShape", ["s"], ["c"], name="the_fill"),
                    helper.make_node("ReduceSum", ["c"], ["r"], keepdims=0),
                    helper.make_node("Add", ["x", "r"], ["y"])], [X])
    with pytest.raises(ModelLoadError, match=r"node 'the_fill' \(ConstantOfShape\) makes a tensor of shape "
                                             r"\[2147483648, 2147483648, 4\]"):
        OnnxModel(model, where="the model file")


def test_folding_never_computes_a_large_value() -> None:
    """``Where`` of three 4096-element vectors shaped to broadcast to 4096³ elements: not folded (its size is known
    first), and the Where itself is refused by its inferred size, in milliseconds, with no 550 GB allocation."""
    import numpy as np
    from onnx import numpy_helper

    vectors = [numpy_helper.from_array(np.ones(shape, dtype=np.int64), name)
               for name, shape in (("a", (4096, 1, 1)), ("b", (1, 4096, 1)), ("c", (1, 1, 4096)))]
    model = _model([helper.make_node("Cast", ["a"], ["cond"], to=TensorProto.BOOL),
                    helper.make_node("Where", ["cond", "b", "c"], ["w"], name="the_where"),
                    helper.make_node("Reshape", ["w", "flat"], ["shape"]),
                    helper.make_node("Expand", ["one", "shape"], ["big"], name="the_expand"),
                    helper.make_node("ReduceSum", ["big"], ["r"], keepdims=0),
                    helper.make_node("Add", ["x", "r"], ["y"])], [X],
                   [*vectors, _int64("flat", [-1]), helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"node 'the_where' \(Where\) makes a tensor of shape \[4096, 4096, 4096\]"):
        OnnxModel(model, where="the model file")
    assert time.perf_counter() - start < 5
