"""Certified output bounds of a network over an input box: IBP and CROWN (docs: gates/robustness.md; Gowal et al. 2018, Zhang et al. 2018).

A search (PGD, DeepQuant's pattern search) only finds adversarial inputs; it cannot prove there
are none. Sound output bounds over the whole L∞ ball can: if the lower bound of
``z_y − z_j`` is positive for every ``j ≠ y``, no input in the ball is misclassified.

:class:`BoundedModel` traces a model with ``torch.fx`` into a DAG of supported ops (Linear,
Conv2d, ConvTranspose2d, ReLU, LeakyReLU, sigmoid, tanh, GELU, SiLU, eval-mode BatchNorm,
average/max pooling, flatten/view/reshape, identity, eval dropout, residual additions,
concatenation, arithmetic with constants; see :data:`SUPPORTED`, and :data:`FUNCTION_KINDS` /
:data:`METHOD_KINDS` for the functions and methods) and refuses anything else with
:class:`UnsupportedLayerError` naming the layer, its type and a fix — never a silent skip. The
refusal comes from the constructor, before any input is bounded: LayerNorm and the other
per-sample normalisations, softmax, attention (``nn.MultiheadAttention``, transformer layers,
``F.scaled_dot_product_attention``) and products of two tensors computed from the input
(attention scores ``q·kᵀ``) each get a reason and a fix of their own.

* :meth:`BoundedModel.ibp` — interval bound propagation (Gowal et al. 2018, "On the
  effectiveness of interval bound propagation for training verifiably robust models"): boxes
  forward through the graph, affine ops in centre/radius form ``W·c + b ± |W|·r``.
* :meth:`BoundedModel.crown` — CROWN (Zhang et al. 2018, "Efficient neural network robustness
  certification with general activation functions"): backward linear bound propagation of the
  requested linear functions of the output, with the relaxations of
  :mod:`~pytest_dnnsafety.engines.bounds.ops` (ReLU, LeakyReLU, max-pooling) and
  :mod:`~pytest_dnnsafety.engines.bounds.smooth` (sigmoid and tanh by the tangent and
  secant lines of Zhang et al. 2018, §3.3; GELU and SiLU by lines whose offsets are bounded from a
  grid plus a curvature term). The bounds of every nonlinear op's input are themselves
  computed by CROWN back from that node ("full" CROWN, not CROWN-IBP), intersected with the IBP
  bounds; the final bounds are intersected with IBP too, so CROWN is never looser
  than IBP. Only the intermediate neurons whose bounds can change a relaxation are bounded by
  CROWN (a ReLU input that IBP already proves stable keeps its IBP bounds). The linear maps in
  front of the first nonlinearity are shared by the batch (computed once), and a small input
  (≤ 4096 values) lets the affine layers before the first nonlinearity collapse into one dense
  Jacobian. Work is chunked over the batch and over the bounded rows so that no intermediate
  tensor holds more than ``max_elements`` values, derived from the ``max_memory`` budget (default
  2 GiB), which also splits a batch into parts whose per-input state fits; chunks change no bound.
* :meth:`BoundedModel.margin_lower_bounds` — lower bounds of ``z_y − z_j``; both methods bound
  the margin as one linear function (the specification ``C = e_y − e_j``), tighter than two
  separate bounds: IBP folds ``C`` into the affine layers at the end of the network (``C·W``
  over the interval of the last linear layer's input; Gowal et al. 2018, §3, "elision of the
  last layer"), CROWN propagates it backward.

The bounds are sound up to floating-point rounding (about 1e-6 relative in float32): compare them
with a small tolerance. Everything runs under ``torch.no_grad`` on the model's device in the
model's dtype (float32, or float64 for a float64 model). Pure torch; no pytest import.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import Tensor, nn

from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.engines.core.guard import model_dtype_device
from pytest_dnnsafety.runtime.sizes import parse_memory
from pytest_dnnsafety.engines.bounds.box import _check_box
from pytest_dnnsafety.engines.bounds.crown import DEFAULT_MAX_MEMORY, BoundState, memory_plan
from pytest_dnnsafety.engines.bounds.crown_ibp import AUTO_MAX_PASSES, check_method, estimate as estimate_cost
from pytest_dnnsafety.engines.bounds.crown_ibp import margins as method_margins
from pytest_dnnsafety.engines.bounds.ops import (AffineOp, ConcatOp, ConvOp, ConvTransposeOp, LeakyReluOp, LinearOp, MaxPoolOp, Op,
                         PermuteOp, PositiveLinearOp, ReluOp, ReshapeOp, SumOp)
from pytest_dnnsafety.engines.bounds.layers import (_ELEMENTWISE_KINDS, _ELEMENTWISE_MODULES, _FIX, _KWARGS, _REFUSED_FUNCTIONS,
                            _REFUSED_METHODS, _REFUSED_MODULES, FUNCTION_KINDS, METHOD_KINDS, REFUSED_REASONS,
                            SUPPORTED, Refusal, _lookup, activation_params, concat_dim, concat_pieces, permutation)
from pytest_dnnsafety.engines.bounds.smooth import ACTIVATIONS

__all__ = ["UnsupportedLayerError", "BoundedModel", "SUPPORTED", "FUNCTION_KINDS", "METHOD_KINDS"]

_SHAPE_METHODS = {"size", "dim"}
_RESHAPE_MODULES = (nn.Flatten, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class UnsupportedLayerError(MetricError):
    """The model holds a layer or operation certified bounds cannot propagate through (named in the message)."""


class _Node:
    """One traced node that carries a bounded tensor: how to build its op once shapes are known."""

    def __init__(self, fx_node: fx.Node, kind: str, label: str, module: nn.Module | None = None) -> None:
        self.fx_node, self.kind, self.label, self.module = fx_node, kind, label, module


def _label(node: fx.Node, module: nn.Module | None) -> str:
    if module is not None:
        return f"layer {node.target!r} ({type(module).__name__})"
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    stack = node.meta.get("nn_module_stack") or {}
    owner = f"in module {list(stack)[-1]!r}" if stack else "in the model's forward"
    what = "method" if node.op == "call_method" else "function"
    return f"operation {node.name!r} ({what} {name}) {owner}"


def _unsupported(label: str, why: str = "is not supported by certified bounds", fix: str = _FIX) -> UnsupportedLayerError:
    return UnsupportedLayerError(f"{label} {why}; supported: {SUPPORTED}. {fix}")


@contextlib.contextmanager
def _naming(label: str) -> Iterator[None]:
    """Turn a :class:`Refusal` raised inside into an :class:`UnsupportedLayerError` naming ``label``."""
    try:
        yield
    except Refusal as refusal:
        raise _unsupported(label, refusal.why, refusal.fix or _FIX) from None


def _training_error(model: nn.Module) -> UnsupportedLayerError | None:
    modules = list(model.named_modules())  # a BatchNorm in training mode first: the worst offender
    modules.sort(key=lambda item: not isinstance(item[1], nn.modules.batchnorm._BatchNorm))
    for name, module in modules:
        if module.training:
            where = f"layer {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
            extra = (" (a BatchNorm layer in training mode normalises with batch statistics, so its output "
                     "depends on the other inputs of the batch)" if isinstance(module, nn.modules.batchnorm._BatchNorm)
                     else "")
            return UnsupportedLayerError(
                f"{where} is in training mode{extra}; certified bounds need the inference-time function. "
                f"Fix: put the model in eval mode (model.eval()) before verifying it.")
    return None


def _flat_nodes(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat_nodes(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flat_nodes(item)]
    return [value]


class BoundedModel:
    """A model traced for certified bounds (IBP and CROWN); see the module docstring.

    ``model``: an eval-mode ``nn.Module`` whose forward takes one input tensor ``(B, ...)`` and
    returns one tensor. ``max_memory``: CROWN's working-memory budget in bytes (an int, or text
    such as ``"2GiB"``/``"512MiB"``; default :data:`~.crown.DEFAULT_MAX_MEMORY`, 1 GiB): half
    for the per-input state (the batch is bounded in parts that fit it), half for the coefficient
    tensors of the backward passes (chunked over inputs and bounded rows; see
    :func:`~.crown.memory_plan`). ``max_elements``: the largest intermediate coefficient
    tensor CROWN builds (values), derived from ``max_memory`` when not given (2^24 ≈ 64 MB in
    float32 at the default). Chunking never changes a bound. Raises :class:`UnsupportedLayerError` for anything it
    cannot bound, naming the layer and its type.
    """

    def __init__(self, model: nn.Module, *, max_elements: int | None = None,
                 max_memory: int | str | None = None) -> None:
        from pytest_dnnsafety.engines.bounds.export import is_exported, translate_export  # a torch.export program (.pt2): its ATen graph
        from pytest_dnnsafety.files.onnx_model import is_onnx_model
        if is_exported(model):  # translated into the modules below, holding the program's own tensors
            model = translate_export(model, UnsupportedLayerError)
        elif is_onnx_model(model):  # an ONNX graph: translated node for node, checked against onnxruntime
            model = model.translated(UnsupportedLayerError)
        if isinstance(model, torch.jit.ScriptModule):
            raise _unsupported(f"the model ({type(model).__name__}) is a TorchScript module, which",
                               "cannot be traced", "Fix: pass the original eager nn.Module (or load it with a "
                               "factory: dnnsafety_model_factory) to verify it.")
        if not isinstance(model, nn.Module):
            kind = type(model).__name__
            what = "a torch.export program" if "Exported" in kind else f"a {kind}, not an nn.Module"
            raise _unsupported(f"the model is {what}, which", "cannot be traced by torch.fx",
                               "Fix: pass the original eager nn.Module to verify it.")
        for name, sub in model.named_modules():
            if isinstance(sub, torch.jit.ScriptModule):
                raise _unsupported(f"layer {name!r} ({type(sub).__name__}) is a TorchScript module and",
                                   "cannot be traced", "Fix: build the model from eager nn.Modules.")
        error = _training_error(model)
        if error is not None:
            raise error
        if max_elements is not None and (isinstance(max_elements, bool) or not isinstance(max_elements, int)
                                         or max_elements < 1):
            raise ValueError(f"max_elements={max_elements!r} must be a positive int")
        self.model = model
        self.max_memory = DEFAULT_MAX_MEMORY if max_memory is None else parse_memory(max_memory, "max_memory")
        self._max_elements = None if max_elements is None else int(max_elements)
        try:
            self.graph_module = fx.symbolic_trace(model)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise _unsupported(f"the model's forward ({type(model).__name__})",
                               f"could not be traced with torch.fx ({type(exc).__name__}: {first})",
                               "Fix: avoid Python control flow on tensor values in forward(), or use the "
                               "attack-based robustness gates.") from exc
        self._plan = self._analyse()

    # ------------------------------------------------------------------ static analysis
    def _analyse(self) -> list[_Node]:
        gm = self.graph_module
        kinds: dict[fx.Node, str] = {}  # "tensor" (bounded), "shape" (from an input's shape), "const"
        plan: list[_Node] = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                if plan:
                    raise _unsupported(f"the model's forward argument {node.name!r}", "is a second input",
                                       "Fix: verify a model whose forward takes exactly one input tensor.")
                kinds[node] = "tensor"
                plan.append(_Node(node, "input", "the input"))
                continue
            if node.op == "get_attr":
                kinds[node] = "const"
                continue
            if node.op == "output":
                outs = _flat_nodes(node.args[0])
                if len(outs) != 1 or not isinstance(outs[0], fx.Node) or kinds.get(outs[0]) != "tensor":
                    raise _unsupported("the model's output", "is not one tensor computed from the input",
                                       "Fix: return one tensor of class scores (batch, classes).")
                self._output_node = outs[0]
                continue
            args = [a for a in _flat_nodes((node.args, node.kwargs)) if isinstance(a, fx.Node)]
            arg_kinds = {kinds[a] for a in args}
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            label = _label(node, module)
            if (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
                    node.op == "call_function" and node.target is getattr):
                kinds[node] = "shape" if "tensor" in arg_kinds or "shape" in arg_kinds else "const"
                continue
            if "tensor" not in arg_kinds:
                kinds[node] = "shape" if "shape" in arg_kinds else "const"
                continue
            kinds[node] = "tensor"
            plan.append(_Node(node, self._classify(node, module, label, args, kinds), label, module))
        return plan

    def _classify(self, node: fx.Node, module: nn.Module | None, label: str, args: list[fx.Node],
                  kinds: dict[fx.Node, str]) -> str:
        if module is not None:
            if isinstance(module, nn.Linear):
                return "linear"
            if isinstance(module, nn.Conv2d):
                if module.padding_mode != "zeros":
                    raise _unsupported(label, f"uses padding_mode={module.padding_mode!r}, which is not supported")
                return "conv"
            if isinstance(module, nn.ConvTranspose2d):
                if module.padding_mode != "zeros":  # pragma: no cover - torch itself only allows zeros
                    raise _unsupported(label, f"uses padding_mode={module.padding_mode!r}, which is not supported")
                return "conv_transpose"
            if isinstance(module, nn.ReLU):
                return "relu"
            for cls, kind in _ELEMENTWISE_MODULES.items():
                if isinstance(module, cls):
                    with _naming(label):
                        activation_params(kind, module=module)
                    return kind
            for classes, why, fix in _REFUSED_MODULES:
                if isinstance(module, classes):
                    raise _unsupported(label, why, fix)
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                if module.running_mean is None or module.running_var is None:
                    raise _unsupported(label, "has no running statistics (track_running_stats=False) and normalises "
                                              "with batch statistics even in eval mode, which is not supported")
                return "batchnorm"
            if isinstance(module, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)):
                return "positive"
            if isinstance(module, nn.MaxPool2d):
                if module.ceil_mode or module.return_indices:
                    raise _unsupported(label, "uses ceil_mode=True or return_indices=True, which is not supported")
                return "maxpool"
            if isinstance(module, _RESHAPE_MODULES):
                return "reshape"
            raise _unsupported(label)
        tensor_args = [a for a in args if kinds[a] == "tensor"]
        if node.op == "call_method":
            kind = METHOD_KINDS.get(str(node.target))
            refused = _REFUSED_METHODS.get(str(node.target))
        else:
            kind = _lookup(FUNCTION_KINDS, node.target)
            refused = _lookup(_REFUSED_FUNCTIONS, node.target)
        if refused == "matmul" and len(tensor_args) < 2:
            raise _unsupported(label, "multiplies a tensor computed from the input by a constant matrix, which is "
                                      "not supported", "Fix: use nn.Linear (or a 1×1 nn.Conv2d) for the product.")
        if refused is not None:
            raise _unsupported(label, *REFUSED_REASONS[refused])
        if kind is None:
            raise _unsupported(label)
        if kind in ("mul", "div") and len(tensor_args) > 1:
            raise _unsupported(label, "multiplies or divides two tensors computed from the input (not linear)")
        if kind == "div" and (not isinstance(node.args[0], fx.Node) or kinds.get(node.args[0]) != "tensor"):
            raise _unsupported(label, "divides by a tensor computed from the input (not linear)")
        extra = set(node.kwargs) - _KWARGS.get(kind, set())
        if extra:
            raise _unsupported(label, f"is called with {sorted(extra)}, which is not supported")
        with _naming(label):
            if kind == "cat":
                concat_dim(node, tensor_args, None)
            elif kind == "permute":
                permutation(node, None)
            elif kind in _ELEMENTWISE_KINDS:
                activation_params(kind, node=node)
                if len(tensor_args) != 1 or node.args[0] is not tensor_args[0]:
                    raise Refusal("has an unexpected argument list")
        if any(kinds[a] == "shape" for a in args) and kind not in ("reshape", "cat"):
            raise _unsupported(label, "combines a tensor with a value computed from the input's shape")
        return kind

    # ------------------------------------------------------------------ building the ops
    def _prepare(self, x_lo: Tensor, x_hi: Tensor, check: bool = True, parts: bool = False) -> Any:
        error = _training_error(self.model)
        if error is not None:
            raise error
        dtype, device = model_dtype_device(self.model)
        if not isinstance(x_lo, Tensor) or not isinstance(x_hi, Tensor):
            raise DataError("certified bounds need the input box as two tensors (x_lo, x_hi).")
        dtype = dtype or (x_lo.dtype if x_lo.is_floating_point() else torch.float32)
        device = device or x_lo.device
        non_blocking = device.type != "cpu"  # towards an accelerator: asynchronous copies
        x_lo = x_lo.detach().to(device, dtype, non_blocking=non_blocking)
        x_hi = x_hi.detach().to(device, dtype, non_blocking=non_blocking)
        if x_lo.shape != x_hi.shape or x_lo.ndim < 1 or x_lo.shape[0] == 0:
            raise DataError(f"the input box's bounds have shapes {tuple(x_lo.shape)} and {tuple(x_hi.shape)}; "
                            f"certified bounds need two tensors of one shape (batch, ...) with a non-empty batch.")
        if check:  # the value checks read the box on the host (one sync each on an accelerator)
            _check_box(x_lo, x_hi)
        ops, out = self._build_ops((x_lo + x_hi) / 2)
        if not parts:
            return BoundState(ops, out, x_lo, x_hi, self._elements(x_lo.dtype))
        # parts: a list of states over consecutive slices of the batch whose per-input state fits half the budget
        size = memory_plan(self.max_memory, x_lo.element_size(), ops)[1]
        return [BoundState(ops, out, x_lo[b0:b0 + size], x_hi[b0:b0 + size], self._elements(x_lo.dtype))
                for b0 in range(0, x_lo.shape[0], size)]

    @property
    def max_elements(self) -> int:
        """The largest coefficient tensor (values) in the model's dtype (float32 unless known)."""
        dtype = model_dtype_device(self.model)[0] or torch.float32
        return self._elements(dtype)

    def _elements(self, dtype: torch.dtype) -> int:
        if self._max_elements is not None:
            return self._max_elements
        return memory_plan(self.max_memory, torch.empty((), dtype=dtype).element_size())[0]

    # ------------------------------------------------------------------ public bounds
    def ibp(self, x_lo: Tensor, x_hi: Tensor, *, check: bool = True,
            spec: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Interval bound propagation (Gowal et al. 2018): ``(lo, hi)`` of the output over the box.

        ``check=False`` skips the box's value checks (finite, ``x_lo ≤ x_hi``), which read it on the
        host: for a device loop that checks its boxes itself (see :func:`box_problems`).
        ``spec`` (shaped as for :meth:`crown`): bounds ``(B, K)`` of ``spec·output`` instead, the
        spec folded into the affine layers at the end of the network (never looser than combining
        the output's bounds; see :meth:`BoundState.folded_spec_ibp`).
        """
        with torch.no_grad():
            state = self._prepare(x_lo, x_hi, check)
            if spec is not None:
                return state.spec_ibp(state.spec(spec)[0])
            return state.ivs[state.out]

    def crown(self, x_lo: Tensor, x_hi: Tensor, spec: Tensor | None = None, *,
              check: bool = True) -> tuple[Tensor, Tensor]:
        """CROWN (Zhang et al. 2018): bounds ``(lo, hi)``, each ``(B, K)``, of ``spec·output`` over the box.

        ``spec``: ``(B, K, *out_shape)`` (or ``(B, K, out_numel)``; ``(K, ...)`` shared by the batch);
        ``None``: the identity, i.e. bounds of every output ``(B, *out_shape)``. Intersected with IBP.
        ``check``: as for :meth:`ibp`.
        """
        with torch.no_grad():
            states = self._prepare(x_lo, x_hi, check, parts=True)  # consecutive slices of the batch
            spec_t, shared = states[0].spec(spec, batch=x_lo.shape[0])
            k = spec_t.shape[1]
            los, his, b0 = [], [], 0
            for state in states:
                part = spec_t if shared else spec_t[b0:b0 + state.batch]
                b0 += state.batch
                low = state.lower(state.out, lambda k0, k1: torch.cat([part, -part], dim=1)[:, k0:k1], shared,
                                  count=2 * k)
                if spec is None:  # the output's own IBP interval (c ± r would round differently)
                    lo_i, hi_i = (t.flatten(1) for t in state.ivs[state.out])
                else:
                    lo_i, hi_i = state.spec_ibp(part)
                los.append(torch.maximum(low[:, :k], lo_i))
                his.append(torch.minimum(-low[:, k:], hi_i))
            lo, hi = torch.cat(los), torch.cat(his)
            if spec is None:
                shape = (lo.shape[0], *states[0].ops[states[0].out].out_shape)
                return lo.reshape(shape), hi.reshape(shape)
            return lo, hi

    def estimate_passes(self, x_lo: Tensor, x_hi: Tensor, method: str = "auto") -> Tensor:
        """Per input of the box, the model passes a margin bound by ``method`` is estimated to take
        (:func:`.crown_ibp.estimate`: IBP on the box, then full CROWN's rows from its unstable neurons, or
        CROWN-IBP's from the specification; ``"auto"`` picks as :meth:`margin_lower_bounds` does). ``(B,)`` float64
        on the CPU. Costs one interval pass."""
        method = check_method(method)
        with torch.no_grad():
            state = self._prepare(x_lo, x_hi, check=False)
            classes = state.ops[state.out].out_shape[0] if len(state.ops[state.out].out_shape) == 1 else 2
            if method == "ibp":
                return torch.full((state.batch,), 2.0, dtype=torch.float64)
            full, crown_ibp, _ = estimate_cost(state, max(1, classes - 1))
        if method == "crown":
            return full
        if method == "crown-ibp":
            return crown_ibp
        return torch.where(full <= AUTO_MAX_PASSES, full, crown_ibp)

    def margin_lower_bounds(self, x_lo: Tensor, x_hi: Tensor, y: Tensor, method: str = "crown", *,
                            check: bool = True, used: list[Tensor] | None = None) -> Tensor:
        """Lower bounds ``(B, classes)`` of ``z_y − z_j`` over the box (``+inf`` at ``j = y``).

        ``method="ibp"``: IBP with the margin spec ``C = e_y − e_j`` folded into the last affine
        layers (``C·W`` bounded over the interval of the last layer's input; Gowal et al. 2018, §3),
        never looser than ``lb_y − ub_j``, which it falls back to when the last op is not affine;
        ``"crown"``: CROWN on the same spec, intersected with that IBP margin; ``"crown-ibp"``: one
        CROWN pass from the spec over IBP's intermediate intervals; ``"auto"``: per input, full CROWN
        where it is estimated cheap, else CROWN-IBP (:mod:`.crown_ibp`). All positive in a row
        ⇒ no input of the box is misclassified. ``used``: a list that gets, per part of the batch,
        the method each input was bounded by (int8: 0 ibp, 1 crown-ibp, 2 crown).

        ``check=False`` skips the checks that read values on the host (the box's, as for
        :meth:`ibp`, and the labels' range): for a device loop that checks them itself. Labels
        outside ``[0, classes)`` are then clamped into it (their rows are meaningless).
        """
        method = check_method(method)
        with torch.no_grad():
            states = self._prepare(x_lo, x_hi, check, parts=True)  # consecutive slices of the batch
            state = states[0]
            out_shape = state.ops[state.out].out_shape
            if len(out_shape) != 1 or out_shape[0] < 2:
                raise MetricError(f"margin bounds need class scores of shape (batch, classes); the model returns "
                                  f"per-sample shape {out_shape}. Fix: return one row of class scores per input.")
            n, batch = out_shape[0], sum(part.batch for part in states)
            device = state.x_lo.device
            y = torch.as_tensor(y).to(device=device, dtype=torch.int64, non_blocking=device.type != "cpu")
            if y.shape != (batch,) or (check and bool(((y < 0) | (y >= n)).any())):
                raise DataError(f"margin bounds need one label in [0, {n}) per input; got labels of shape "
                                f"{tuple(y.shape)} for {batch} inputs.")
            if not check:  # an index out of range would be a device-side assert on CUDA
                y = y.clamp(0, n - 1)
            parts, b0 = [], 0
            for state in states:
                y_part = y[b0:b0 + state.batch]
                b0 += state.batch
                lo, hi = state.ivs[state.out]
                eye = torch.eye(n, dtype=lo.dtype, device=lo.device)
                spec = eye[y_part].unsqueeze(1) - eye.unsqueeze(0)  # (B, n, n): rows e_y − e_j
                # the spec folded into the last affine layers, intersected with lb_y − ub_j (never looser)
                margins = torch.maximum(lo.gather(1, y_part[:, None]) - hi, state.folded_spec_ibp(spec)[0])
                margins, codes = method_margins(state, spec, method, margins)
                if used is not None:
                    used.append(codes)
                parts.append(margins.scatter(1, y_part[:, None], math.inf))
            return torch.cat(parts)

    def _build_ops(self, centre: Tensor) -> tuple[list[Op], int]:
        """The ops of the traced graph for inputs shaped like ``centre`` (a probe forward gives the shapes)."""
        bm = self
        probe = centre[:1].expand(2, *centre.shape[1:]).clone()
        interp = fx.Interpreter(bm.graph_module, garbage_collect_values=False)
        try:
            interp.run(probe)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MetricError(f"certified bounds: the model raised {type(exc).__name__} on inputs of per-sample shape "
                              f"{tuple(probe.shape[1:])}: {first}. Fix: give inputs in the shape the model expects.") from exc
        env = interp.env
        index: dict[fx.Node, int] = {}
        ops: list[Op] = []
        device = centre.device
        for item in bm._plan:
            node, module = item.fx_node, item.module
            value = env[node]
            if not isinstance(value, Tensor) or value.ndim < 1 or value.shape[0] != 2:
                raise _unsupported(item.label, f"returned {type(value).__name__} "
                                   f"{tuple(getattr(value, 'shape', ()))} for a batch of 2; bounds need an output "
                                   f"with the batch as its first dimension")
            out_shape = tuple(int(s) for s in value.shape[1:])
            if item.kind == "input":
                index[node] = 0
                ops.append(ReshapeOp(item.label, (), (), out_shape))
                continue
            targs = [a for a in _flat_nodes((node.args, node.kwargs)) if isinstance(a, fx.Node) and a in index]
            inputs = tuple(index[a] for a in targs)
            in_shapes = tuple(ops[j].out_shape for j in inputs)
            head = (item.label, inputs[:1], in_shapes[:1], out_shape)
            kind = item.kind
            if kind == "linear":
                w = module.weight.detach()
                op: Op = LinearOp(*head, w, None if module.bias is None else module.bias.detach())
            elif kind == "conv":
                op = ConvOp(*head, module)
            elif kind == "relu":
                op = ReluOp(*head)
            elif kind == "maxpool":
                op = MaxPoolOp(*head, module, device)
            elif kind == "positive":
                op = PositiveLinearOp(*head, module)
            elif kind == "batchnorm":
                scale = module.running_var.detach().add(module.eps).rsqrt()
                if module.weight is not None:
                    scale = scale * module.weight.detach()
                shift = -module.running_mean.detach() * scale
                if module.bias is not None:
                    shift = shift + module.bias.detach()
                view = (-1,) + (1,) * (len(out_shape) - 1)
                op = AffineOp(*head, scale.reshape(view).to(centre.dtype), shift.reshape(view).to(centre.dtype))
            elif kind == "reshape":
                op = ReshapeOp(*head)
            elif kind == "conv_transpose":
                if len(in_shapes[0]) != 3:
                    raise _unsupported(item.label, f"gets per-sample shape {in_shapes[0]}; certified bounds need "
                                                   f"(channels, height, width)")
                op = ConvTransposeOp(*head, module)
            elif kind in _ELEMENTWISE_KINDS or kind in ("cat", "permute"):
                with _naming(item.label):
                    if kind == "cat":
                        pieces = concat_pieces(node, env, index, len(out_shape) + 1, centre)
                        op = ConcatOp(item.label, inputs, in_shapes, out_shape,
                                      concat_dim(node, [], len(out_shape) + 1) - 1, pieces)
                    elif kind == "permute":
                        op = PermuteOp(*head, permutation(node, len(out_shape) + 1))
                    else:
                        params = activation_params(kind, module=module, node=node)
                        op = (LeakyReluOp(*head, params["slope"]) if kind == "leaky_relu"
                              else ACTIVATIONS[kind](*head, **params))
            else:
                op = _arith(item, env, index, inputs, in_shapes, out_shape, centre)
            index[node] = len(ops)
            ops.append(op)
        return ops, index[bm._output_node]


def _arith(item: _Node, env: dict[fx.Node, Any], index: dict[fx.Node, int], inputs: tuple[int, ...],
           in_shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...], centre: Tensor) -> Op:
    """The op of an arithmetic node: ``x ± α·y`` of two bounded tensors, or an affine map with a constant."""
    node, kind = item.fx_node, item.kind
    dtype, device = centre.dtype, centre.device
    if len(inputs) == 2:  # x ± alpha·y of two bounded tensors
        if in_shapes[0] != in_shapes[1] or in_shapes[0] != out_shape:
            raise _unsupported(item.label, f"adds tensors of shapes {in_shapes[0]} and {in_shapes[1]} "
                                           f"(broadcasting two bounded tensors is not supported)")
        alpha = float(node.kwargs.get("alpha", 1))
        return SumOp(item.label, inputs, in_shapes, out_shape, (1.0, -alpha if kind == "sub" else alpha))
    pos = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a in index]
    tensor_first = pos == [0]
    others = [env[a] if isinstance(a, fx.Node) else a for i, a in enumerate(node.args) if i not in pos]
    others += [env[v] if isinstance(v, fx.Node) else v for key, v in node.kwargs.items() if key != "alpha"]
    if kind == "neg":
        const: Any = 0.0
    elif len(others) != 1:
        raise _unsupported(item.label, "has an unexpected argument list")
    else:
        const = others[0]
    if isinstance(const, bool) or not isinstance(const, (int, float, Tensor)):
        raise _unsupported(item.label, f"combines the tensor with a {type(const).__name__}")
    c = torch.as_tensor(const).detach().to(device=device, dtype=dtype, non_blocking=device.type != "cpu")
    full = (1, *out_shape)
    if c.ndim > len(full) or torch.broadcast_shapes(c.shape, full) != full:
        raise _unsupported(item.label, f"uses a constant of shape {tuple(c.shape)} that does not broadcast to "
                                       f"one sample's shape {out_shape}")
    one, zero = torch.ones((), dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device)
    alpha = float(node.kwargs.get("alpha", 1))
    if kind == "add":
        scale, shift = (one, c * alpha) if tensor_first else (one * alpha, c)
    elif kind == "sub":
        scale, shift = (one, -c * alpha) if tensor_first else (-one * alpha, c)
    elif kind == "mul":
        scale, shift = c, zero
    elif kind == "div":
        scale, shift = 1 / c, zero
    else:
        scale, shift = -one, zero
    return AffineOp(item.label, inputs, in_shapes, out_shape, scale, shift)
