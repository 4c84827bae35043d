"""What :class:`~pytest_dnnsafety.engines.robustness.bounds.BoundedModel` accepts and refuses, by layer, function and method.

The tables its tracer classifies ``torch.fx`` nodes with: :data:`SUPPORTED` (the text every
:class:`~pytest_dnnsafety.engines.robustness.bounds.UnsupportedLayerError` names),
:data:`FUNCTION_KINDS` and :data:`METHOD_KINDS` (every ``call_function`` target and
``call_method`` name accepted, by the kind of op it becomes: the one place that lists them, for a
translator from another graph format to map its operations onto), the keyword arguments each
kind accepts, and the layers refused with a reason and a fix of their own (per-sample
normalisation, softmax, attention, products of two input-dependent tensors). Pure data; no
pytest import.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["SUPPORTED", "FUNCTION_KINDS", "METHOD_KINDS", "REFUSED_REASONS"]

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
