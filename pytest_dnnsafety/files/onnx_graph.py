"""An ONNX graph as the equivalent eager torch module: what certified bounds and gradients are computed on.

onnxruntime gives outputs, not gradients, and CROWN/IBP propagate bounds through torch layers, not through a
runtime. :func:`translate_onnx` turns the graph of an :class:`~pytest_dnnsafety.files.onnx_model.OnnxModel`, node
for node, into a ``torch.fx`` GraphModule (:class:`OnnxTranslation`) built only from what the bounds engine
propagates through — the same vocabulary as the ``.pt2`` translation (``engines/bounds/export.py``):

==============================================  ==================================================
ONNX operator                                   becomes
==============================================  ==================================================
``Conv`` (2-D, symmetric pads)                  ``nn.Conv2d``
``Gemm`` (constant B, C), ``MatMul`` (const B)  ``nn.Linear`` (alpha, beta and transB folded in)
``BatchNormalization`` (inference)              ``nn.BatchNorm1d/2d`` in eval mode
``MaxPool``, ``AveragePool``                    ``nn.MaxPool2d``, ``nn.AvgPool2d``
``GlobalAveragePool``                           ``nn.AdaptiveAvgPool2d(1)``
``Relu``, ``LeakyRelu``, ``Sigmoid``, ``Tanh``  ``F.relu``, ``F.leaky_relu``, ``torch.sigmoid``, ``torch.tanh``
``Add``, ``Sub``, ``Mul``, ``Div``, ``Neg``     ``+ - * /`` (two tensors, or with a constant)
``Flatten`` (axis 1), ``Reshape``, ``Squeeze``,  ``torch.flatten`` / ``reshape`` (batch kept first, the
``Unsqueeze``                                   per-sample shape from ONNX shape inference)
``Concat``, ``Transpose`` (batch kept first)    ``torch.cat``, ``torch.permute``
``Identity``, ``Dropout`` (inference)           identity
``Constant``, ``Shape``/``Gather``/... on shapes  folded (they feed a ``Reshape``'s shape only)
==============================================  ==================================================

Anything else is refused before any work, naming every unsupported operator type and its node names. The weights
are the graph's initializers (float32). The translation is checked, never trusted: at construction its outputs are
compared with onnxruntime's (the artifact's) on a seeded random probe batch, to ``RTOL·(1 + |z|)``; the verification
loop compares them again on every batch of real inputs (``engines/bounds/export.export_mismatch``).

:class:`OnnxModel` uses the translation for gradients only (:func:`ort_with_translated_gradient`): its values are
always onnxruntime's, and the backward pass is the translation's vector-Jacobian product at the same input. The onnx
package is imported lazily (the ``[onnx]`` extra); no onnxruntime here.
"""

from __future__ import annotations

import math

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["OnnxTranslation", "translate_onnx", "TRANSLATED", "RTOL", "ort_with_translated_gradient"]

#: Relative tolerance of the translation's outputs against onnxruntime's (``1e-4·(1 + |z|)``).
RTOL = 1e-4
TRANSLATED = ("Conv (2-D), Gemm/MatMul with constant weights, BatchNormalization, MaxPool, AveragePool, "
              "GlobalAveragePool, Relu, LeakyRelu, Sigmoid, Tanh, Add/Sub/Mul/Div/Neg, Flatten/Reshape/Squeeze/"
              "Unsqueeze (batch kept first), Concat, Transpose (batch kept first), Identity, Dropout, Constant")
_FIX = ("Fix: export a model built only from these operators (for a final Softmax: export the logits, the predicted "
        "class is the same), verify the eager nn.Module instead (dnnsafety_model_factory with a state dict), or use "
        "gates that read only the outputs.")
#: Operators that compute shapes, folded when all their inputs are constants or shapes.
_SHAPE_OPS = {"Shape", "Gather", "Unsqueeze", "Concat", "Cast", "Slice", "Squeeze", "Constant", "ConstantOfShape",
              "Mul", "Div", "Add", "Sub", "Identity", "Reshape"}
#: Operators computed now when all their inputs are constants (ONNX's reference semantics): the exporter's shape
#: arithmetic, and initializers it shared through ``Identity`` (equal weights are stored once).
_FOLD = {"Identity", "Cast", "Unsqueeze", "Squeeze", "Concat", "Gather", "Reshape", "Slice", "Transpose", "Flatten",
         "Mul", "Div", "Add", "Sub", "Neg", "Sqrt", "Reciprocal", "Pow", "Equal", "Where", "ConstantOfShape", "Shape"}
#: The batch size shape inference assumes for a graph with a dynamic batch axis (a prime no layer is likely to have).
_PROBE_BATCH = 1031
#: The largest constant folding may make (elements): a hostile graph cannot make us allocate more.
_FOLD_MAX = 1 << 24


class OnnxTranslation(fx.GraphModule):
    """The eager-equivalent GraphModule of an ONNX graph (see the module docstring). ``onnx_nodes``: its node count."""

    onnx_nodes: int = 0


class _Refused(Exception):
    pass


def _attrs(node: Any) -> dict[str, Any]:
    import onnx.helper

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class _Translator:
    def __init__(self, proto: Any) -> None:
        import onnx
        from onnx import numpy_helper

        try:  # with a fixed batch size and values propagated, `x.view(x.size(0), -1)` gets a static shape too
            fixed = onnx.ModelProto()
            fixed.CopyFrom(proto)
            constants = {init.name for init in fixed.graph.initializer}
            for value in fixed.graph.input:
                dims = value.type.tensor_type.shape.dim
                if value.name not in constants and len(dims) and not dims[0].HasField("dim_value"):
                    dims[0].dim_value = _PROBE_BATCH
            proto = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
        except Exception:  # noqa: BLE001 - shapes are a help for Reshape only; without them Reshape needs constants
            pass
        self.graph_proto = proto.graph
        self.graph = fx.Graph()
        self.attrs: dict[str, Any] = {}
        self.env: dict[str, Any] = {}  # value name -> fx node (tensor) or ("const", Tensor) or ("shape", None)
        for init in self.graph_proto.initializer:
            self.env[init.name] = ("const", torch.from_numpy(numpy_helper.to_array(init).copy()))
        self.shapes: dict[str, list[Any]] = {}
        for info in [*self.graph_proto.value_info, *self.graph_proto.output, *self.graph_proto.input]:
            dims = info.type.tensor_type.shape.dim
            self.shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        self.problems: dict[str, list[str]] = {}
        self._count = 0
        self.opsets = {o.domain or "": o.version for o in proto.opset_import}

    # -- values ---------------------------------------------------------------------------------------------------
    def const(self, name: str) -> Tensor | None:
        value = self.env.get(name)
        return value[1] if isinstance(value, tuple) and value[0] == "const" else None

    def tensor(self, name: str) -> fx.Node:
        value = self.env.get(name)
        if isinstance(value, fx.Node):
            return value
        raise _Refused(f"takes {name!r} as a tensor computed from the input, but it is not one")

    def arg(self, name: str) -> Any:
        """A tensor input, or a constant as a get_attr node (a Python number when it is a scalar)."""
        value = self.env.get(name)
        if isinstance(value, fx.Node):
            return value
        c = self.const(name)
        if c is None:
            raise _Refused(f"uses {name!r}, which is neither computed from the input nor a constant")
        if c.numel() == 1 and c.ndim <= 1:
            return float(c.reshape(()).item())
        target = f"_const_{len(self.attrs)}"
        self.attrs[target] = c.float() if c.is_floating_point() else c
        return self.graph.get_attr(target)

    def module(self, node: Any, module: nn.Module, x: fx.Node) -> fx.Node:
        self._count += 1
        target = f"{node.op_type.lower()}_{self._count}"
        self.attrs[target] = module.eval()
        return self.graph.call_module(target, (x,))

    def rest_shape(self, name: str) -> tuple[int, ...] | None:
        """The per-sample shape of value ``name`` (dims after the batch) when shape inference made it static."""
        dims = self.shapes.get(name)
        if not dims or any(d is None for d in dims[1:]):
            return None
        return tuple(int(d) for d in dims[1:])

    # -- the pass -------------------------------------------------------------------------------------------------
    def run(self, input_name: str) -> fx.Graph:
        self.env[input_name] = self.graph.placeholder("x")
        for node in self.graph_proto.node:
            try:
                self.visit(node)
            except _Refused as exc:
                why = f": {exc}" if str(exc) else ""
                self.problems.setdefault(node.op_type, []).append(f"node {node.name or node.output[0]!r}{why}")
                for out in node.output:
                    self.env[out] = ("refused", None)
        outs = [self.env.get(o.name) for o in self.graph_proto.output]
        if not self.problems:
            if not outs or not all(isinstance(o, fx.Node) for o in outs):
                raise _Refused("the graph's outputs are not computed from its input")
            self.graph.output(outs[0] if len(outs) == 1 else tuple(outs))
        return self.graph

    def visit(self, node: Any) -> None:
        op, ins = node.op_type, list(node.input)
        if node.domain not in ("", "ai.onnx"):
            raise _Refused(f"is in the operator domain {node.domain!r}")
        kinds = {self._kind(i) for i in ins if i}
        if "refused" in kinds:
            for out in node.output:
                self.env[out] = ("refused", None)
            return
        if op == "Constant":
            from onnx import numpy_helper

            a = node.attribute[0]
            value = numpy_helper.to_array(a.t) if a.name == "value" else None
            if value is None:
                raise _Refused(f"holds a {a.name!r} constant (only tensor constants are supported)")
            self.env[node.output[0]] = ("const", torch.from_numpy(value.copy()))
            return
        if op == "Shape" and kinds == {"tensor"}:  # a computed tensor's shape: only shape arithmetic may read it
            self.env[node.output[0]] = ("shape", None)
            return
        if kinds <= {"const"} and op in _FOLD:  # constants only: computed now
            self.fold(node, ins)
            return
        if "tensor" not in kinds:  # shape arithmetic on a computed shape: a Reshape reads inferred shapes instead
            if op not in _SHAPE_OPS:
                raise _Refused("computes on constants with an operator the translation does not fold")
            for out in node.output:
                self.env[out] = ("shape", None)
            return
        handler = _HANDLERS.get(op)
        if handler is None:
            raise _Refused("")
        self.env[node.output[0]] = handler(self, node, ins, _attrs(node))

    def fold(self, node: Any, ins: list[str]) -> None:
        """The outputs of ``node`` on constant inputs, by ONNX's reference evaluator (bounded in size)."""
        import numpy as np
        from onnx.reference import ReferenceEvaluator

        values = [self.const(i).numpy() if i else None for i in ins]
        given = [v for v in values if v is not None]
        try:  # the output's size in Python integers (numpy's products wrap around for a forged shape)
            if node.op_type == "ConstantOfShape":
                dims = [int(d) for d in given[0].ravel()] if given else []
                size = math.prod(dims) if all(d >= 0 for d in dims) else _FOLD_MAX + 1
            elif node.op_type in ("Mul", "Div", "Add", "Sub", "Pow", "Equal", "Where"):
                size = math.prod(int(d) for d in np.broadcast_shapes(*(v.shape for v in given)))
            elif node.op_type == "Gather":
                axis = int(_attrs(node).get("axis", 0))
                size = given[1].size * given[0].size // max(1, given[0].shape[axis] if given[0].ndim else 1)
            else:
                size = sum(v.size for v in given)
        except (ValueError, IndexError) as exc:
            raise _Refused(f"has constant inputs of shapes that do not fit ({exc})") from None
        if size > _FOLD_MAX:
            raise _Refused(f"would make a constant of {size} elements (at most {_FOLD_MAX} are folded)")
        try:
            outs = ReferenceEvaluator(node, opsets=self.opsets).run(
                None, {i: v for i, v in zip(ins, values) if i and v is not None})
        except Exception as exc:  # noqa: BLE001 - named in the refusal
            raise _Refused(f"could not be computed on its constant inputs ({type(exc).__name__}: {str(exc)[:120]})")
        for name, value in zip(node.output, outs):
            self.env[name] = ("const", torch.from_numpy(np.array(value, copy=True)))

    def _kind(self, name: str) -> str:
        value = self.env.get(name)
        if isinstance(value, fx.Node):
            return "tensor"
        return value[0] if isinstance(value, tuple) else "missing"


# ---------------------------------------------------------------------- operators
def _pads(a: dict[str, Any], n: int = 2) -> tuple[int, ...]:
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        raise _Refused(f"pads with auto_pad={a['auto_pad']!r} (export with explicit padding)")
    pads = list(a.get("pads", [0] * (2 * n)))
    if pads[:n] != pads[n:]:
        raise _Refused(f"pads asymmetrically ({pads})")
    return tuple(int(p) for p in pads[:n])


def _conv(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    w = t.const(ins[1])
    b = t.const(ins[2]) if len(ins) > 2 and ins[2] else None
    if w is None or w.ndim != 4:
        raise _Refused("is not a 2-D convolution with a constant weight")
    groups = int(a.get("group", 1))
    conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], tuple(w.shape[2:]), tuple(a.get("strides", (1, 1))),
                     _pads(a), tuple(a.get("dilations", (1, 1))), groups, bias=b is not None)
    with torch.no_grad():
        conv.weight.copy_(w)
        if b is not None:
            conv.bias.copy_(b)
    return t.module(node, conv, t.tensor(ins[0]))


def _linear(t: _Translator, node: Any, w: Tensor, b: Tensor | None, x: fx.Node) -> fx.Node:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b.reshape(-1).expand(w.shape[0]))
    return t.module(node, lin, x)


def _gemm(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    w = t.const(ins[1])
    c = t.const(ins[2]) if len(ins) > 2 and ins[2] else None
    if a.get("transA", 0) or w is None or w.ndim != 2 or (len(ins) > 2 and ins[2] and c is None):
        raise _Refused("is not x·W + c with constant W and c (transA must be 0)")
    w = w.float() if a.get("transB", 0) else w.float().t()
    w = w * float(a.get("alpha", 1.0))
    if c is not None and c.numel() not in (1, w.shape[0]):
        raise _Refused(f"adds a bias of shape {tuple(c.shape)}, not one per output")
    return _linear(t, node, w, None if c is None else c.float() * float(a.get("beta", 1.0)), t.tensor(ins[0]))


def _matmul(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    w = t.const(ins[1])
    if w is None or w.ndim != 2 or not isinstance(t.env.get(ins[0]), fx.Node):
        raise _Refused("multiplies two computed tensors (only x·W with a constant W is supported)")
    return _linear(t, node, w.float().t(), None, t.tensor(ins[0]))


def _batch_norm(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    scale, bias, mean, var = (t.const(i) for i in ins[1:5])
    if any(v is None for v in (scale, bias, mean, var)) or len(node.output) > 1 and any(node.output[1:]):
        raise _Refused("normalises with statistics that are not constants (training mode)")
    rank = len(t.shapes.get(ins[0]) or [0, 0, 0, 0])
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(rank)
    if cls is None:
        raise _Refused(f"normalises a {rank}-D tensor")
    bn = cls(mean.shape[0], eps=float(a.get("epsilon", 1e-5)))
    with torch.no_grad():
        for name, value in (("weight", scale), ("bias", bias), ("running_mean", mean), ("running_var", var)):
            getattr(bn, name).copy_(value)
    return t.module(node, bn, t.tensor(ins[0]))


def _max_pool(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    if len(node.output) > 1 and node.output[1]:
        raise _Refused("returns indices")
    k = tuple(a["kernel_shape"])
    pool = nn.MaxPool2d(k, tuple(a.get("strides", k)), _pads(a), tuple(a.get("dilations", (1, 1))),
                        ceil_mode=bool(a.get("ceil_mode", 0)))
    return t.module(node, pool, t.tensor(ins[0]))


def _avg_pool(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    k = tuple(a["kernel_shape"])
    pool = nn.AvgPool2d(k, tuple(a.get("strides", k)), _pads(a), bool(a.get("ceil_mode", 0)),
                        bool(a.get("count_include_pad", 0)))
    return t.module(node, pool, t.tensor(ins[0]))


def _global_avg(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    return t.module(node, nn.AdaptiveAvgPool2d(1), t.tensor(ins[0]))


def _unary(fn: Callable[..., Any]) -> Callable[..., fx.Node]:
    def handler(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
        if fn is F.leaky_relu:
            return t.graph.call_function(F.leaky_relu, (t.tensor(ins[0]), float(a.get("alpha", 0.01))))
        return t.graph.call_function(fn, (t.tensor(ins[0]),))
    return handler


def _binary(fn: Callable[..., Any]) -> Callable[..., fx.Node]:
    def handler(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
        return t.graph.call_function(fn, (t.arg(ins[0]), t.arg(ins[1])))
    return handler


def _identity(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    if node.op_type == "Dropout" and len(ins) > 2 and ins[2] and bool(t.const(ins[2]) is None or t.const(ins[2]).any()):
        raise _Refused("is dropout in training mode")
    return t.graph.call_method("contiguous", (t.tensor(ins[0]),))


def _reshape(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    x = t.tensor(ins[0])
    if node.op_type == "Flatten" and int(a.get("axis", 1)) == 1:
        return t.graph.call_function(torch.flatten, (x, 1))
    rest = t.rest_shape(node.output[0])
    if rest is None:
        raise _Refused("changes a shape that ONNX shape inference could not make static (export with static "
                       "per-sample shapes)")
    dims = t.shapes.get(node.output[0]) or []
    in_dims = t.shapes.get(ins[0]) or []
    if dims and in_dims and dims[0] != in_dims[0]:
        raise _Refused("changes the batch dimension")
    return t.graph.call_method("reshape", (x, (-1, *rest)))


def _concat(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    axis = int(a.get("axis", 0))
    if axis == 0:
        raise _Refused("concatenates along the batch dimension")
    return t.graph.call_function(torch.cat, ([t.arg(i) for i in ins], axis))


def _transpose(t: _Translator, node: Any, ins: list[str], a: dict[str, Any]) -> fx.Node:
    perm = tuple(int(p) for p in a.get("perm", ()))
    if not perm or perm[0] != 0:
        raise _Refused(f"moves the batch dimension (perm {perm})")
    return t.graph.call_function(torch.permute, (t.tensor(ins[0]), perm))


_HANDLERS: dict[str, Callable[..., Any]] = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul, "BatchNormalization": _batch_norm, "MaxPool": _max_pool,
    "AveragePool": _avg_pool, "GlobalAveragePool": _global_avg, "Relu": _unary(F.relu),
    "LeakyRelu": _unary(F.leaky_relu), "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh),
    "Neg": _unary(operator.neg), "Add": _binary(operator.add), "Sub": _binary(operator.sub),
    "Mul": _binary(operator.mul), "Div": _binary(operator.truediv), "Identity": _identity, "Dropout": _identity,
    "Flatten": _reshape, "Reshape": _reshape, "Squeeze": _reshape, "Unsqueeze": _reshape, "Concat": _concat,
    "Transpose": _transpose,
}


# ---------------------------------------------------------------------- entry points
def _refusal(problems: dict[str, list[str]], name: str) -> str:
    items = []
    for op, where in list(problems.items())[:6]:
        more = f" and {len(where) - 1} more node(s)" if len(where) > 1 else ""
        items.append(f"{op} ({where[0]}{more})")
    extra = f"; and {len(problems) - 6} more operator type(s)" if len(problems) > 6 else ""
    return (f"the ONNX graph {name} holds operators that certified bounds and gradients cannot go through: "
            f"{'; '.join(items)}{extra}. The translation covers: {TRANSLATED}. {_FIX}")


def translate_onnx(model: Any, error: type[Exception] = ValueError) -> OnnxTranslation:
    """The eager-equivalent :class:`OnnxTranslation` of an :class:`OnnxModel`, checked against onnxruntime on a probe.

    ``error``: the exception class for a graph that cannot be translated (every unsupported operator named) or whose
    translation computes something else than onnxruntime.
    """
    proto = model._model_proto()
    name = repr(model.path.name) if getattr(model, "path", None) is not None else "(in memory)"
    translator = _Translator(proto)
    try:
        graph = translator.run(model.input_name)
    except _Refused as exc:
        raise error(f"the ONNX graph {name}: {exc}. {_FIX}") from None
    if translator.problems:
        raise error(_refusal(translator.problems, name))
    translated = OnnxTranslation(translator.attrs, graph, class_name="OnnxTranslation")
    translated.onnx_nodes = len(translator.graph_proto.node)
    translated.eval()
    _self_check(translated, model, translator, error, name)
    return translated


def _self_check(translated: OnnxTranslation, model: Any, t: _Translator, error: type[Exception], name: str) -> None:
    rest = t.rest_shape(model.input_name)
    if rest is None:
        return  # no static input shape: the per-batch check of the verification loop stays
    batch = model.fixed_batch or 2
    x = torch.rand((batch, *rest), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(x), translated(x)
    if not isinstance(want, Tensor) or not isinstance(got, Tensor):
        return
    if got.shape != want.shape or not bool(((got - want).abs() <= RTOL * (1 + want.abs())).all()):
        diff = (got - want).abs().max().item() if got.shape == want.shape else f"shapes {tuple(got.shape)}"
        raise error(f"the translation of the ONNX graph {name} does not compute what onnxruntime computes (largest "
                    f"difference {diff} on a random probe batch of shape {tuple(x.shape)}); bounds or gradients on it "
                    f"would not be about the artifact. {_FIX}")


class _OrtFunction(torch.autograd.Function):
    """Values from onnxruntime; the backward pass is the translation's vector-Jacobian product at the same input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: Any, translated: Any) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.translated = translated
        return run(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        create = torch.is_grad_enabled()  # a double backward (create_graph=True): the gradient stays differentiable
        with torch.enable_grad():
            xd = x if create else x.detach().requires_grad_(True)
            out = ctx.translated(xd)
            (gx,) = torch.autograd.grad(out, xd, grad.to(out.dtype), create_graph=create)
        return gx, None, None


def ort_with_translated_gradient(x: Tensor, run: Callable[[Tensor], Tensor], translated: nn.Module) -> Tensor:
    """``run(x)`` (onnxruntime's outputs) as a differentiable function of ``x`` whose gradient is the translation's."""
    return _OrtFunction.apply(x, run, translated)
