"""What :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel` accepts and refuses, by layer, function and method.

The tables its tracer classifies ``torch.fx`` nodes with: :data:`SUPPORTED` (the text every
:class:`~pytest_dnnsafety.engines.bounds.model.UnsupportedLayerError` names),
:data:`FUNCTION_KINDS` and :data:`METHOD_KINDS` (every ``call_function`` target and
``call_method`` name accepted, by the kind of op it becomes: the one place that lists them, for a
translator from another graph format to map its operations onto), the keyword arguments each
kind accepts, and the layers refused with a reason and a fix of their own (per-sample
normalisation, softmax, attention, products of two input-dependent tensors). Also the checks of
the parameters of the accepted nodes (a LeakyReLU's slope, a GELU's approximation, a
concatenation's dimension and constant pieces, a transpose's dimensions), which raise
:class:`Refusal` for the tracer to turn into an error naming the node. No pytest import.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

__all__ = ["SUPPORTED", "FUNCTION_KINDS", "METHOD_KINDS", "REFUSED_REASONS", "Refusal", "activation_params",
           "permutation", "concat_dim", "concat_pieces"]

#: What the certified bounds understand (named in every :class:`UnsupportedLayerError`).
SUPPORTED = ("nn.Linear, nn.Conv2d and nn.ConvTranspose2d (zeros padding), ReLU (nn.ReLU, F.relu, torch.relu, "
             ".relu()), LeakyReLU (nn.LeakyReLU, F.leaky_relu), sigmoid and tanh (nn.Sigmoid, nn.Tanh, "
             "torch.sigmoid, torch.tanh, .sigmoid(), .tanh()), GELU (nn.GELU, F.gelu, exact or tanh), SiLU "
             "(nn.SiLU, F.silu), nn.BatchNorm1d/2d in eval mode, nn.AvgPool2d, nn.AdaptiveAvgPool2d, "
             "nn.MaxPool2d (floor mode), flatten/view/reshape (nn.Flatten, torch.flatten, .view, .reshape), "
             "transpose/permute of the per-sample dimensions, nn.Identity, nn.Dropout, additions of two tensors "
             "(residual blocks), torch.cat along a non-batch dimension, and +, -, *, / with constants")

_FIX = ("Fix: verify a model built only from supported layers (for a final Softmax/LogSoftmax: verify the "
        "logits model without it, the predicted class is the same), or use the attack-based robustness gates, "
        "which need no bounds.")

#: Every ``call_function`` target the bounds accept, by kind: the one place that lists them (a translator from
#: other graph formats, e.g. torch.export's aten ops, maps its operations onto these targets).
FUNCTION_KINDS: dict[Any, str] = {
    F.relu: "relu", torch.relu: "relu", torch.relu_: "relu",
    operator.add: "add", operator.iadd: "add", torch.add: "add",
    operator.sub: "sub", operator.isub: "sub", torch.sub: "sub",
    operator.mul: "mul", operator.imul: "mul", torch.mul: "mul",
    operator.truediv: "div", operator.itruediv: "div", torch.div: "div", torch.true_divide: "div",
    operator.neg: "neg", torch.neg: "neg",
    torch.flatten: "reshape", torch.reshape: "reshape",
    F.leaky_relu: "leaky_relu",  # negative_slope: a number (args[1] or the keyword; default 0.01)
    torch.sigmoid: "sigmoid", torch.special.expit: "sigmoid", torch.tanh: "tanh",
    F.gelu: "gelu",  # approximate="none" or "tanh" (keyword)
    F.silu: "silu",
    torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat",  # dim: args[1] or the keyword, not 0
    torch.transpose: "permute", torch.permute: "permute",  # of the per-sample dimensions (not the batch's)
}
#: Every ``call_method`` name the bounds accept, by kind.
METHOD_KINDS = {"relu": "relu", "relu_": "relu", "add": "add", "add_": "add", "sub": "sub", "mul": "mul",
                "div": "div", "neg": "neg", "flatten": "reshape", "view": "reshape", "reshape": "reshape",
                "contiguous": "reshape", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh",
                "tanh_": "tanh", "transpose": "permute", "permute": "permute"}
#: The keyword arguments each kind accepts.
_KWARGS = {"relu": {"inplace"}, "add": {"alpha"}, "sub": {"alpha"}, "reshape": {"start_dim", "end_dim", "shape"},
           "leaky_relu": {"negative_slope", "inplace"}, "gelu": {"approximate"}, "silu": {"inplace"},
           "cat": {"dim"}, "permute": {"dim0", "dim1", "dims"}}
_ELEMENTWISE_MODULES = {nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.GELU: "gelu", nn.SiLU: "silu",
                        nn.LeakyReLU: "leaky_relu"}

_NOT = "is not supported by certified bounds"
_ATTACK_FIX = "Fix: use the attack-based robustness gates, which need no bounds."
_NORM_WHY = ("It normalises each sample by its own mean and standard deviation (a division by a function of the "
             "input), which has no sound linear relaxation here. Fix: verify a model with eval-mode BatchNorm in "
             "its place (a fixed affine map), or use the attack-based robustness gates, which need no bounds.")
_SOFTMAX_WHY = ("A softmax (exponentials divided by their sum) has no sound linear relaxation here. Fix: for a final "
                "Softmax/LogSoftmax verify the logits model without it (the predicted class is the same); a softmax "
                "inside the network (attention) cannot be verified here: use the attack-based robustness gates, "
                "which need no bounds.")
_ATTENTION_WHY = ("Softmax attention multiplies two tensors computed from the input (q·kᵀ, weights·v) and takes a "
                  "softmax, neither of which has a sound linear relaxation here. " + _ATTACK_FIX)
_MATMUL_WHY = ("It multiplies two tensors computed from the input (bilinear, as the attention scores q·kᵀ), which "
               "has no sound linear relaxation here. " + _ATTACK_FIX)
#: Layers refused with a reason of their own (they are common and the generic message would not say why).
_REFUSED_MODULES = (
    ((nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
      *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())), _NOT, _NORM_WHY),
    ((nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d), _NOT, _SOFTMAX_WHY),
    ((nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
      nn.TransformerDecoder, nn.Transformer), _NOT, _ATTENTION_WHY),
)
_REFUSED_FUNCTIONS = {F.layer_norm: "norm", F.group_norm: "norm", F.instance_norm: "norm", torch.layer_norm: "norm",
                      F.softmax: "softmax", torch.softmax: "softmax", F.log_softmax: "softmax",
                      torch.log_softmax: "softmax", F.softmin: "softmax", F.scaled_dot_product_attention: "attention",
                      operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "matmul", torch.einsum: "matmul",
                      torch.mm: "matmul"}
#: Each refused kind's message parts: ``(why, reason and fix)``.
REFUSED_REASONS = {"norm": (_NOT, _NORM_WHY), "softmax": (_NOT, _SOFTMAX_WHY), "attention": (_NOT, _ATTENTION_WHY),
                   "matmul": (_NOT, _MATMUL_WHY)}
_REFUSED_METHODS = {"softmax": "softmax", "log_softmax": "softmax", "matmul": "matmul", "bmm": "matmul",
                    "mm": "matmul", "__matmul__": "matmul"}
_ELEMENTWISE_KINDS = {"leaky_relu", "sigmoid", "tanh", "gelu", "silu"}


def _lookup(table: dict[Any, str], target: Any) -> str | None:
    try:
        return table.get(target)
    except TypeError:  # an unhashable target
        return None


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a call: positional ``index``, else the keyword, else ``default``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


class Refusal(Exception):
    """Why a node cannot be bounded, and the fix (``None``: the generic one); the tracer names the node."""

    def __init__(self, why: str, fix: str | None = None) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def activation_params(kind: str, *, module: nn.Module | None = None, node: fx.Node | None = None) -> dict[str, Any]:
    """The parameters of an elementwise activation (a LeakyReLU's slope, a GELU's approximation), checked."""
    if kind == "leaky_relu":
        slope = module.negative_slope if module is not None else _arg(node, 1, "negative_slope", 0.01)  # type: ignore
        if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not math.isfinite(slope):
            raise Refusal(f"has negative_slope={slope!r}; certified bounds need a finite number",
                          "Fix: give the LeakyReLU a constant finite slope.")
        return {"slope": float(slope)}
    if kind == "gelu":
        approximate = module.approximate if module is not None else _arg(node, 1, "approximate", "none")  # type: ignore
        if approximate not in ("none", "tanh"):
            raise Refusal(f"has approximate={approximate!r}, which is not supported",
                          "Fix: use approximate='none' or 'tanh'.")
        return {"approximate": approximate}
    return {}


def permutation(node: fx.Node, ndim: int | None) -> tuple[int, ...]:
    """The permutation of the per-sample dimensions of a ``transpose``/``permute`` node (checked).

    ``ndim``: the tensor's number of dimensions, batch included (None: check the arguments only).
    """
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name == "transpose":
        dims: Any = (_arg(node, 1, "dim0", None), _arg(node, 2, "dim1", None))
    else:
        dims = node.args[1:] if len(node.args) > 2 else _arg(node, 1, "dims", None)
    dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise Refusal(f"reorders dimensions {dims!r}, which are not constant integers")
    resolved = dims if ndim is None else tuple(d + ndim if d < 0 else d for d in dims)
    if name == "transpose":
        batch_moves = 0 in resolved and resolved[0] != resolved[1]
    else:
        batch_moves = resolved[0] != 0 if ndim is not None or resolved[0] >= 0 else False
    if batch_moves or (ndim is not None and name != "transpose" and sorted(resolved) != list(range(ndim))):
        raise Refusal(f"reorders dimensions {dims!r} and moves the batch dimension",
                      "Fix: keep the batch first (transpose or permute the other dimensions only).")
    if ndim is None:
        return ()
    if name == "transpose":
        perm = list(range(ndim))
        perm[resolved[0]], perm[resolved[1]] = perm[resolved[1]], perm[resolved[0]]
        resolved = tuple(perm)
    return tuple(d - 1 for d in resolved[1:])


def concat_dim(node: fx.Node, tensor_args: list[fx.Node], ndim: int | None) -> int:
    """The dimension a ``torch.cat`` node concatenates along (checked; resolved when ``ndim`` is known)."""
    pieces = node.args[0] if node.args else None
    if not isinstance(pieces, (list, tuple)) or any(a not in pieces for a in tensor_args):
        raise Refusal("concatenates a tensor that is not in its list of tensors")
    dim = _arg(node, 1, "dim", 0)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim == 0:
        raise Refusal(f"concatenates along dim={dim!r}; certified bounds need a fixed non-batch dimension",
                      "Fix: concatenate along dim=1 or later.")
    if ndim is None:
        return dim
    resolved = dim + ndim if dim < 0 else dim
    if not 1 <= resolved < ndim:
        raise Refusal(f"concatenates along dim={dim!r}, the batch dimension of a {ndim}-d tensor",
                      "Fix: concatenate along dim=1 or later.")
    return resolved


def concat_pieces(node: fx.Node, env: dict[fx.Node, Any], index: dict[fx.Node, int], ndim: int,
                  like: Tensor) -> list[Tensor | None]:
    """The pieces of a ``torch.cat`` node for :class:`~.ops.ConcatOp`: None for a bounded tensor,
    ``(1, ...)`` for a constant shared by every sample (checked on the probe batch of 2, in ``like``'s dtype)."""
    pieces: list[Tensor | None] = []
    for piece in node.args[0]:
        if isinstance(piece, fx.Node) and piece in index:
            pieces.append(None)
            continue
        value = env[piece] if isinstance(piece, fx.Node) else piece
        if not isinstance(value, Tensor) or value.ndim != ndim or value.shape[0] != 2 or not bool(
                (value[0] == value[1]).all()):  # per-sample constants only (the same row for every sample)
            raise Refusal("concatenates a value that is neither computed from the input nor the same tensor for "
                          "every sample")
        pieces.append(value[:1].detach().to(device=like.device, dtype=like.dtype))
    return pieces
