"""The ATen operations of a ``torch.export`` program as the eager ops certified bounds know (docs: gates/robustness.md).

The table of :mod:`~pytest_dnnsafety.engines.bounds.export`'s translation: one handler per
ATen operation family, called with the translator and the node's arguments by schema name; it
adds the equivalent node (a module holding the program's own tensors, or a torch function) to
the new graph, or raises :class:`Refused` saying why the operation cannot be bounded.

========================================================  =============================================
ATen operation (of the program's graph)                   becomes
========================================================  =============================================
``conv2d``, ``convolution``, ``conv_transpose2d`` (2-D)   ``nn.Conv2d`` / ``nn.ConvTranspose2d``
``linear``; ``addmm``/``mm`` with a transposed weight     ``nn.Linear``
``batch_norm`` (eval),                                    ``nn.BatchNorm1d/2d`` in eval mode (the
``_native_batch_norm_legit_no_training`` + ``getitem 0``  program's running statistics)
``max_pool2d``, ``max_pool2d_with_indices`` + getitem 0   ``nn.MaxPool2d``
``avg_pool2d``, ``adaptive_avg_pool2d``, ``mean`` (H, W)  ``nn.AvgPool2d``, ``nn.AdaptiveAvgPool2d``
``relu``, ``leaky_relu``, ``sigmoid``, ``tanh``,          ``F.relu``, ``F.leaky_relu``, ``torch.sigmoid``,
``gelu``, ``silu`` (also decomposed: ``x·sigmoid(x)``)    ``torch.tanh``, ``F.gelu``, ``F.silu``
``add``/``sub``/``rsub``/``mul``/``div``/``neg``          ``+ - * /`` (two tensors, or with a constant)
``cat``, ``transpose``, ``permute``                       ``torch.cat``, ``torch.transpose``, ``torch.permute``
``view``/``reshape``/``flatten``/``(un)squeeze``          ``reshape`` / ``torch.flatten`` (batch kept first)
``clone``/``alias``/``detach``/eval ``dropout``           identity (``contiguous``)
========================================================  =============================================

Weights must be tensors stored in the program (``get_attr`` nodes): the modules hold those very
objects, not copies. Pure torch; no pytest import.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn


class _Translator(Protocol):
    """What a rule here needs of the graph translator (:class:`pytest_dnnsafety.engines.bounds.export._Translator`)."""

    graph: fx.Graph

    def arg(self, value: Any) -> Any: ...

    def tensor(self, node: Any) -> fx.Node: ...

    def stored(self, value: Any, what: str, optional: bool = False) -> Tensor | None: ...

    def module(self, node: fx.Node, module: nn.Module, x: fx.Node) -> fx.Node: ...


__all__ = ["HANDLERS", "MODULE_OPS", "TRANSLATED", "Refused", "bind", "val"]

aten = torch.ops.aten

TRANSLATED = ("conv2d/convolution/conv_transpose2d (2-D), linear/addmm/mm, batch_norm (eval), relu, leaky_relu, "
              "sigmoid, tanh, gelu, silu, cat, transpose/permute (batch kept first), max_pool2d, avg_pool2d, "
              "adaptive_avg_pool2d, mean over (H, W), add/sub/rsub/mul/div/neg, view/reshape/flatten/squeeze/"
              "unsqueeze, clone/alias/detach/eval dropout")


class Refused(Exception):
    """One node the translation cannot express (collected, then reported all together)."""


def bind(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _concrete(shape: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in shape) if all(isinstance(s, int) for s in shape) else None
    except TypeError:
        return None


def _share(module: nn.Module, name: str, tensor: Tensor | None) -> None:
    """Make ``module.<name>`` the program's own tensor (the same object: a Parameter stays one)."""
    if tensor is None:
        return
    if isinstance(tensor, nn.Parameter):
        setattr(module, name, tensor)
        return
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    module.register_buffer(name, tensor)


def _conv(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    w = t.stored(a["weight"], "weight")
    b = t.stored(a.get("bias"), "bias", optional=True)
    if w.ndim != 4:
        raise Refused(f"is a {w.ndim - 2}-D convolution; only 2-D convolutions (nn.Conv2d) are supported")
    groups = int(a.get("groups") or 1)
    padding = a["padding"] if isinstance(a["padding"], str) else tuple(a["padding"])
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(a["stride"]), tuple(a["dilation"])
    conv: nn.Module
    if a.get("transposed") or node.target.overloadpacket is aten.conv_transpose2d:
        conv = nn.ConvTranspose2d(w.shape[0], w.shape[1] * groups, kernel, stride, padding, tuple(a["output_padding"]),
                                  groups, b is not None, dilation, device="meta")
    else:
        conv = nn.Conv2d(w.shape[1] * groups, w.shape[0], kernel, stride, padding, dilation, groups,
                         bias=b is not None, device="meta")
    _share(conv, "weight", w)
    _share(conv, "bias", b)
    return t.module(node, conv, t.tensor(a["input"]))


def _linear_module(node: fx.Node, w: Tensor, b: Tensor | None) -> nn.Linear:
    if w.ndim != 2 or (b is not None and b.shape != (w.shape[0],)):
        raise Refused(f"has a weight of shape {tuple(w.shape)}, not (out, in)")
    linear = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    _share(linear, "weight", w)
    _share(linear, "bias", b)
    return linear


def _linear(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    w = t.stored(a["weight"], "weight")
    b = t.stored(a.get("bias"), "bias", optional=True)
    return t.module(node, _linear_module(node, w, b), t.tensor(a["input"]))


def _transposed_weight(t: _Translator, value: Any) -> Tensor:
    """``W`` behind the ``W.T`` (``permute(W, [1, 0])`` / ``t(W)``) that a decomposed ``linear`` multiplies by."""
    if isinstance(value, fx.Node) and value.op == "call_function" and (value.target is aten.t.default or (
            value.target is aten.permute.default and list(value.args[1]) == [1, 0])):
        return t.stored(value.args[0], "weight")
    raise Refused("multiplies by a matrix that is not a stored weight transposed (a decomposed nn.Linear)")


def _addmm(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    if a.get("beta", 1) != 1 or a.get("alpha", 1) != 1:
        raise Refused("scales its terms (beta/alpha not 1)")
    w = _transposed_weight(t, a["mat2"])
    b = t.stored(a["self"], "bias")
    return t.module(node, _linear_module(node, w, b), t.tensor(a["mat1"]))


def _mm(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    return t.module(node, _linear_module(node, _transposed_weight(t, a["mat2"]), None), t.tensor(a["self"]))


def _batch_norm(t: _Translator, node: fx.Node, a: dict[str, Any]) -> Any:
    packet = node.target.overloadpacket
    if packet is aten.batch_norm and a["training"]:
        raise Refused("normalises with batch statistics (the model was exported in training mode)",)
    if packet not in (aten.batch_norm, aten._native_batch_norm_legit_no_training):
        raise Refused("normalises with batch statistics (the model was exported in training mode)")
    mean = t.stored(a["running_mean"], "running mean", optional=True)
    var = t.stored(a["running_var"], "running variance", optional=True)
    if mean is None or var is None:
        raise Refused("has no running statistics (track_running_stats=False), which is not supported")
    w = t.stored(a["weight"], "weight", optional=True)
    b = t.stored(a["bias"], "bias", optional=True)
    ndim = getattr(val(a["input"]), "ndim", 4)
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(ndim)
    if cls is None:
        raise Refused(f"normalises a {ndim}-D tensor; only BatchNorm1d/2d are supported")
    bn = cls(mean.shape[0], eps=float(a["eps"]), momentum=float(a["momentum"]), affine=w is not None, device="meta")
    for name, tensor in (("weight", w), ("bias", b), ("running_mean", mean), ("running_var", var)):
        _share(bn, name, tensor)
    bn.num_batches_tracked = torch.zeros((), dtype=torch.long, device=mean.device)
    new = t.module(node, bn, t.tensor(a["input"]))
    return new if packet is aten.batch_norm else {0: new}


def _max_pool(t: _Translator, node: fx.Node, a: dict[str, Any]) -> Any:
    pool = nn.MaxPool2d(tuple(a["kernel_size"]), tuple(a["stride"] or a["kernel_size"]), tuple(a["padding"]),
                        tuple(a["dilation"]), ceil_mode=bool(a["ceil_mode"]))
    new = t.module(node, pool, t.tensor(a["self"]))
    return new if node.target.overloadpacket is aten.max_pool2d else {0: new}


def _avg_pool(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    pool = nn.AvgPool2d(tuple(a["kernel_size"]), tuple(a["stride"] or a["kernel_size"]), tuple(a["padding"]),
                        bool(a["ceil_mode"]), bool(a["count_include_pad"]), a["divisor_override"])
    return t.module(node, pool, t.tensor(a["self"]))


def _adaptive_avg_pool(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    return t.module(node, nn.AdaptiveAvgPool2d(tuple(a["output_size"])), t.tensor(a["self"]))


def _mean(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    ndim = getattr(val(a["self"]), "ndim", None)
    dims = {d % ndim for d in (a["dim"] or [])} if ndim else set()
    if ndim != 4 or dims != {2, 3} or a.get("dtype") is not None:
        raise Refused("averages over dimensions other than (H, W) of an image batch")
    new = t.module(node, nn.AdaptiveAvgPool2d(1), t.tensor(a["self"]))
    return new if a["keepdim"] else t.graph.call_function(torch.flatten, (new, 1))


def _relu(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    return t.graph.call_function(F.relu, (t.tensor(a["self"]),))


def _activation(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    """LeakyReLU, sigmoid, tanh, GELU, SiLU: the torch functions the bounds accept."""
    packet, x = node.target.overloadpacket, t.tensor(a["self"])
    if packet in (aten.leaky_relu, aten.leaky_relu_):
        return t.graph.call_function(F.leaky_relu, (x, a["negative_slope"]))
    if packet is aten.gelu:
        return t.graph.call_function(F.gelu, (x,), {"approximate": a["approximate"]})
    fn = {aten.sigmoid: torch.sigmoid, aten.sigmoid_: torch.sigmoid, aten.tanh: torch.tanh, aten.tanh_: torch.tanh,
          aten.silu: F.silu, aten.silu_: F.silu}[packet]
    return t.graph.call_function(fn, (x,))


def _cat(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    return t.graph.call_function(torch.cat, (t.arg(list(a["tensors"])), a["dim"]))


def _permute(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    if node.target.overloadpacket is aten.transpose:
        return t.graph.call_function(torch.transpose, (t.tensor(a["self"]), a["dim0"], a["dim1"]))
    return t.graph.call_function(torch.permute, (t.tensor(a["self"]), tuple(a["dims"])))


def _alpha(a: dict[str, Any]) -> Any:
    alpha = a.get("alpha", 1)
    return 1 if alpha is None else alpha


def _add_sub(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    sub = node.target.overloadpacket in (aten.sub, aten.sub_)
    x, y, alpha = t.arg(a["self"]), t.arg(a["other"]), _alpha(a)
    if alpha == 1:
        return t.graph.call_function(operator.sub if sub else operator.add, (x, y))
    return t.graph.call_function(torch.sub if sub else torch.add, (x, y), {"alpha": alpha})


def _rsub(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    if _alpha(a) != 1:
        raise Refused("computes other − alpha·x with alpha not 1")
    return t.graph.call_function(operator.sub, (t.arg(a["other"]), t.arg(a["self"])))


def _mul_div(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    if a.get("rounding_mode") is not None:
        raise Refused("divides with rounding (not linear)")
    div = node.target.overloadpacket in (aten.div, aten.div_)
    for x, s in ((a["self"], a["other"]), (a["other"], a["self"])):  # a decomposed SiLU: x · sigmoid(x)
        if not div and isinstance(s, fx.Node) and s.target is aten.sigmoid.default and s.args[0] is x:
            return t.graph.call_function(F.silu, (t.tensor(x),))
    return t.graph.call_function(operator.truediv if div else operator.mul, (t.arg(a["self"]), t.arg(a["other"])))


def _neg(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    return t.graph.call_function(operator.neg, (t.tensor(a["self"]),))


def _identity(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    if node.target.overloadpacket is aten.dropout and a.get("train"):
        raise Refused("is dropout in training mode (the model was exported in training mode)")
    return t.graph.call_method("contiguous", (t.tensor(a.get("input", a.get("self"))),))


def _reshape(t: _Translator, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    """A relayout that keeps the batch first; the per-sample shape from the program's metadata where static."""
    x = a.get("self", a.get("input"))
    xt = t.tensor(x)
    val_in, val_out = val(x), val(node)
    rest = _concrete(val_out.shape[1:]) if val_out is not None else None
    if val_in is not None and val_out is not None and val_out.ndim and rest is not None and \
            str(val_out.shape[0]) == str(val_in.shape[0]):
        return t.graph.call_method("reshape", (xt, (-1, *rest)))
    if node.target.overloadpacket is aten.flatten:
        return t.graph.call_function(torch.flatten, (xt, a["start_dim"], a["end_dim"]))
    if node.target.overloadpacket in (aten.view, aten.reshape, aten._unsafe_view):
        return t.graph.call_method("reshape", (xt, t.arg(a["size"] if "size" in a else a["shape"])))
    raise Refused("changes the batch dimension")


HANDLERS: dict[Any, Callable[[_Translator, fx.Node, dict[str, Any]], Any]] = {
    aten.conv2d: _conv, aten.convolution: _conv, aten._convolution: _conv,
    aten.linear: _linear, aten.addmm: _addmm, aten.mm: _mm,
    aten.batch_norm: _batch_norm, aten._native_batch_norm_legit_no_training: _batch_norm,
    aten._native_batch_norm_legit: _batch_norm, aten._native_batch_norm_legit_functional: _batch_norm,
    aten.native_batch_norm: _batch_norm,
    aten.max_pool2d: _max_pool, aten.max_pool2d_with_indices: _max_pool,
    aten.avg_pool2d: _avg_pool, aten.adaptive_avg_pool2d: _adaptive_avg_pool,
    aten._adaptive_avg_pool2d: _adaptive_avg_pool, aten.mean: _mean,
    aten.relu: _relu, aten.relu_: _relu, aten.conv_transpose2d: _conv, aten.cat: _cat,
    aten.transpose: _permute, aten.permute: _permute,
    **{op: _activation for op in (aten.leaky_relu, aten.leaky_relu_, aten.gelu, aten.sigmoid, aten.sigmoid_, aten.tanh,
                                  aten.tanh_, aten.silu, aten.silu_)},
    aten.add: _add_sub, aten.add_: _add_sub, aten.sub: _add_sub, aten.sub_: _add_sub, aten.rsub: _rsub,
    aten.mul: _mul_div, aten.mul_: _mul_div, aten.div: _mul_div, aten.div_: _mul_div, aten.neg: _neg,
    aten.clone: _identity, aten.alias: _identity, aten.detach: _identity, aten.contiguous: _identity,
    aten.dropout: _identity,
    aten.view: _reshape, aten.reshape: _reshape, aten._unsafe_view: _reshape, aten.flatten: _reshape,
    aten.squeeze: _reshape, aten.unsqueeze: _reshape,
}
#: The ATen ops that become a module (named after the program's module path).
MODULE_OPS = {aten.conv2d, aten.convolution, aten._convolution, aten.conv_transpose2d, aten.linear, aten.addmm,
              aten.mm, aten.batch_norm, aten._native_batch_norm_legit_no_training, aten.max_pool2d,
              aten.max_pool2d_with_indices, aten.avg_pool2d, aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d,
              aten.mean}
