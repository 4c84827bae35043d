"""Certified bounds of a deployed ``torch.export`` program (``.pt2``): its ATen graph, translated (docs: gates/robustness.md).

A ``.pt2`` file holds no ``nn.Module`` classes, only a graph of ATen operations over stored
tensors (``torch.export.load(path).module()``: ``aten.conv2d``, ``aten.linear``,
``aten.batch_norm``, ``aten.relu``, ``aten.add.Tensor``, ``aten.view`` …, with the weights as
``get_attr`` nodes). :func:`translate_export` turns that graph, node for node, into an
equivalent ``torch.fx`` GraphModule built only from what
:class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel` propagates bounds through:

modules (``nn.Conv2d``, ``nn.Linear``, eval-mode ``nn.BatchNorm2d``, pooling) holding the
program's weights, and torch functions (``F.relu``, ``+``, ``reshape`` …), one node for each of
the program's (the table is in :mod:`~pytest_dnnsafety.engines.bounds.aten`).

The modules hold the program's **own** tensors (the same ``Parameter`` and buffer objects, not
copies), so the bounds are computed from exactly the artifact's weights. The export machinery's
input-guard module (``_guards_fn``) and shape assertions are dropped; they check shapes, compute
nothing. Any other operation (``layer_norm``, ``softmax``, ``matmul`` of two tensors …) is refused
with :class:`UnsupportedLayerError` naming every such ATen operation, the module it came from
(``node.meta["nn_module_stack"]``) and a fix — before any bounding work.

The translation is checked, never trusted: at construction the translated module's forward is
compared with the program's on a seeded random probe batch, and :func:`export_mismatch` lets the
verification loop compare them again on every batch of real inputs (the program's own logits,
already computed for the clean verdicts): a difference beyond ``1e-4·(1 + |z|)`` is an error, so
a bound is always about the artifact. Pure torch; no pytest import.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from pytest_dnnsafety.files.pt2_taps import is_exported_module, node_module_path
from pytest_dnnsafety.engines.bounds.aten import HANDLERS, MODULE_OPS, TRANSLATED, Refused, bind, val

__all__ = ["ExportTranslation", "is_exported", "translate_export", "export_mismatch", "bounds_model_note",
           "aten_node_count"]

aten = torch.ops.aten

#: Relative tolerance of the translated module's outputs against the program's (``1e-4·(1 + |z|)``).
RTOL = 1e-4

_FIX = ("Fix: export a model built only from supported layers (for a final softmax: export the logits model, the "
        "predicted class is the same), verify the eager nn.Module instead (dnnsafety_model_factory with a state "
        "dict), or use the attack-based robustness gates (min_robust_accuracy, max_adversarial_confidence_loss), "
        "which run the program itself.")
#: Export machinery that computes nothing on the tensors: dropped.
_DROPPED_MODULES = {"_guards_fn"}
_DROPPED = {aten._assert_scalar.default, aten._assert_tensor_metadata.default, aten.sym_constrain_range.default,
            aten.sym_constrain_range_for_size.default, aten._assert_async.msg}
#: What the well-known refused operations are called in torch.nn (named in the error).
_EAGER_NAMES = {"layer_norm": "LayerNorm", "native_layer_norm": "LayerNorm", "group_norm": "GroupNorm",
                "native_group_norm": "GroupNorm", "softmax": "softmax", "_softmax": "softmax",
                "log_softmax": "log_softmax", "_log_softmax": "log_softmax", "matmul": "matmul of two tensors",
                "bmm": "matmul of two tensors", "scaled_dot_product_attention": "attention",
                "hardtanh": "Hardtanh/ReLU6", "embedding": "Embedding", "pad": "padding other than zeros",
                "upsample_nearest2d": "Upsample", "upsample_bilinear2d": "Upsample"}


class ExportTranslation(fx.GraphModule):
    """The eager-equivalent GraphModule of a ``torch.export`` program (see the module docstring).

    ``aten_nodes``: the program's ATen operation nodes it was translated from.
    """

    aten_nodes: int = 0


def _note(count: int) -> str:
    return f"torch.export program (translated ATen graph, {count} nodes)"


def is_exported(model: Any) -> bool:
    """Whether ``model`` is the module of a ``torch.export`` program (``torch.export.load(...).module()``)."""
    return isinstance(model, nn.Module) and is_exported_module(model)


def _counted(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target not in _DROPPED


def aten_node_count(model: fx.GraphModule) -> int:
    """The operation nodes of a program's graph that a translation carries over (assertions left out)."""
    return sum(1 for node in model.graph.nodes if _counted(node))


def bounds_model_note(model: Any) -> str | None:
    """What the certified bounds of ``model`` are computed on, for the gate's details (None: the eager model)."""
    from pytest_dnnsafety.files.onnx_model import is_onnx_model

    if is_onnx_model(model):
        return f"ONNX graph (translated into torch layers, {len(model._model_proto().graph.node)} nodes)"
    return _note(aten_node_count(model)) if is_exported(model) else None


def _where(node: fx.Node) -> str:
    stack = {k: v for k, v in (node.meta.get("nn_module_stack") or {}).items() if not k.startswith("_empty")}
    if not stack:
        return "in the program's top-level forward"
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
    kind = kind.rsplit(".", 1)[-1]
    return f"from module {path!r} ({kind})" if path else f"from the model's own forward ({kind})"


class _Translator:
    """One pass over the program's graph, building the new graph and its modules (see :func:`translate_export`)."""

    def __init__(self, artifact: fx.GraphModule) -> None:
        self.artifact = artifact
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}  # program node -> new node / ("attr", tensor) / {index: new node}
        self.kind: dict[fx.Node, str] = {}  # "tensor" (from the input), "shape", "const"
        self.attrs: dict[str, Any] = {}  # new target -> module or tensor
        self.const_nodes: dict[str, fx.Node] = {}
        self.problems: dict[str, list[tuple[str, str]]] = {}  # op -> (reason, where) per refused node
        self.refused: set[fx.Node] = set()
        self._names = self._module_names()

    # ------------------------------------------------------------------ naming
    def _module_names(self) -> dict[fx.Node, str]:
        """The target of every module the translation creates: the program's module path where unambiguous."""
        wanted: dict[fx.Node, str] = {}
        for node in self.artifact.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                    node.target.overloadpacket in MODULE_OPS:
                wanted[node] = node_module_path(node)
        paths = list(wanted.values())
        taken = set(paths)
        out = {}
        for node, path in wanted.items():
            clash = (not path or paths.count(path) > 1 or
                     any(p != path and (p.startswith(path + ".") or path.startswith(p + ".")) for p in taken))
            out[node] = f"_{node.name}" if clash else path
        return out

    # ------------------------------------------------------------------ arguments
    def fetch(self, target: str) -> Any:
        value: Any = self.artifact
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def arg(self, value: Any) -> Any:
        """A program argument mapped into the new graph (tensors held by the program become get_attr nodes)."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.arg(v) for v in value)
        if not isinstance(value, fx.Node):
            return value
        mapped = self.env[value]
        if isinstance(mapped, tuple) and mapped[0] == "attr":
            name = "_const_" + value.target.replace(".", "_")
            if name not in self.const_nodes:
                self.attrs[name] = mapped[1]
                self.const_nodes[name] = self.graph.get_attr(name)
            return self.const_nodes[name]
        if isinstance(mapped, dict):
            raise Refused("uses the whole result of an operation that returns several tensors")
        return mapped

    def tensor(self, node: Any) -> fx.Node:
        if not isinstance(node, fx.Node) or self.kind.get(node) != "tensor":
            raise Refused("applies to a value that is not computed from the input")
        return self.arg(node)

    def stored(self, value: Any, what: str, optional: bool = False) -> Tensor | None:
        """The program's own tensor behind a weight argument (a get_attr node)."""
        if value is None and optional:
            return None
        if isinstance(value, fx.Node) and isinstance(self.env.get(value), tuple) and self.env[value][0] == "attr":
            tensor = self.env[value][1]
            if isinstance(tensor, Tensor):
                return tensor
        raise Refused(f"takes its {what} from a computed value, not from a tensor stored in the program")

    def module(self, node: fx.Node, module: nn.Module, x: fx.Node) -> fx.Node:
        name = self._names[node]
        self.attrs[name] = module.eval()
        return self.graph.call_module(name, (x,))

    # ------------------------------------------------------------------ the pass
    def run(self) -> fx.Graph:
        for node in self.artifact.graph.nodes:
            after_refusal = any(a in self.refused for a in node.all_input_nodes)
            try:
                self.visit(node)
                continue
            except Refused as exc:
                reason = str(exc)
            except Exception as exc:  # an argument list the handler did not expect
                reason = f"could not be translated ({type(exc).__name__}: {exc})"
            self.refused.add(node)
            self.env[node], self.kind[node] = None, "tensor"
            if after_refusal and (node.target is operator.getitem or reason.startswith("could not")):
                continue  # a consequence of a refusal reported already
            target = str(node.target)
            eager = _EAGER_NAMES.get(target.split(".")[1] if target.startswith("aten.") else target)
            op = f"{target} ({eager})" if eager else target
            self.problems.setdefault(op, []).append((reason, f"{_where(node)}, node {node.name!r}"))
        return self.graph

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            new = self.graph.placeholder(node.name)
            new.meta = dict(node.meta)
            self.env[node], self.kind[node] = new, "tensor"
            return
        if node.op == "get_attr":
            self.env[node], self.kind[node] = ("attr", self.fetch(str(node.target))), "const"
            return
        if node.op == "output":
            outs = self.arg(node.args[0])
            if isinstance(outs, (list, tuple)) and len(outs) == 1:
                outs = outs[0]
            self.graph.output(outs)
            return
        if node.op == "call_module" and node.target in _DROPPED_MODULES:
            return
        if node.op != "call_function" or node.target in _DROPPED:
            if node.op == "call_function":
                return
            raise Refused(f"is a {node.op} node, which the translation does not know")
        kinds = {self.kind.get(a) for a in node.all_input_nodes}
        target = node.target
        if target is operator.getitem and isinstance(self.env.get(node.args[0]), dict):
            parts = self.env[node.args[0]]
            if node.args[1] not in parts:
                raise Refused(f"uses output {node.args[1]} of a multi-output operation (only output 0, the "
                               f"result, is supported)")
            self.env[node], self.kind[node] = parts[node.args[1]], "tensor"
            return
        if target is aten.sym_size.int:
            self.env[node] = self.graph.call_method("size", (self.arg(node.args[0]), node.args[1]))
            self.kind[node] = "shape"
            return
        if "tensor" not in kinds:  # arithmetic on constants or shapes: copied as it is
            new = self.graph.node_copy(node, self.arg)
            self.env[node], self.kind[node] = new, ("shape" if "shape" in kinds else "const")
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise Refused("")
        handler = HANDLERS.get(target.overloadpacket)
        if handler is None:
            raise Refused("")
        new = handler(self, node, bind(node))
        if isinstance(new, fx.Node):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        self.env[node], self.kind[node] = new, "tensor"


# ---------------------------------------------------------------------- the public entry points
def _refusal(problems: dict[str, list[tuple[str, str]]]) -> str:
    """The error text naming every refused operation (the well-known layers first), where, and a fix."""
    ops = sorted(problems, key=lambda op: not op.endswith(")"))  # "aten.layer_norm.default (LayerNorm)" first
    items = []
    for op in ops[:6]:
        (reason, where), more = problems[op][0], len(problems[op]) - 1
        items.append(f"{op} {where}{f' and {more} more node(s)' if more else ''}{': ' + reason if reason else ''}")
    extra = f"; and {len(ops) - 6} more operation(s)" if len(ops) > 6 else ""
    return (f"the torch.export program holds ATen operations that certified bounds cannot propagate through: "
            f"{'; '.join(items)}{extra}. The bounds translate a program's graph built from: {TRANSLATED}. {_FIX}")


def translate_export(model: fx.GraphModule, error: type[Exception] = ValueError) -> ExportTranslation:
    """The eager-equivalent :class:`ExportTranslation` of a ``torch.export`` program's module.

    ``error``: the exception class raised for a program the bounds cannot handle (BoundedModel
    passes :class:`~pytest_dnnsafety.engines.bounds.model.UnsupportedLayerError`): every
    unsupported ATen operation is named with its module path and a fix, and a translation whose
    forward differs from the program's on a seeded probe batch is refused too.
    """
    translator = _Translator(model)
    graph = translator.run()
    if translator.problems:
        raise error(_refusal(translator.problems))
    for new in reversed(list(graph.nodes)):  # constants only a module's weight used (all pure)
        if new.op in ("call_function", "call_method", "get_attr") and not new.users:
            graph.erase_node(new)
    translated = ExportTranslation(translator.attrs, graph, class_name="ExportTranslation")
    translated.aten_nodes = aten_node_count(model)
    translated.eval()
    _self_check(translated, model, error)
    return translated


def _probe(model: fx.GraphModule) -> Tensor | None:
    """A seeded random batch shaped like the program's input (batch 2 where the batch is dynamic)."""
    holders = [node for node in model.graph.nodes if node.op == "placeholder"]
    meta = val(holders[0]) if len(holders) == 1 else None
    if meta is None or not meta.is_floating_point():
        return None
    shape = []
    for i, size in enumerate(meta.shape):
        if isinstance(size, int):
            shape.append(size)
            continue
        hint = getattr(getattr(size, "node", None), "hint", None)
        if hint is None:
            return None
        shape.append(2 if i == 0 and hint >= 2 else int(hint))
    device = next((t.device for t in model.parameters()), None) or next((t.device for t in model.buffers()), None)
    gen = torch.Generator().manual_seed(0)
    return torch.rand(shape, generator=gen, dtype=meta.dtype).to(device or "cpu")


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out


def _self_check(translated: ExportTranslation, model: fx.GraphModule, error: type[Exception]) -> None:
    x = _probe(model)
    if x is None:
        return
    with torch.no_grad():
        try:
            want = _first(model(x))
        except Exception:  # the program refuses this probe (e.g. a batch range without 2): the per-batch check stays
            return
        got = _first(translated(x))
    if not isinstance(want, Tensor) or not isinstance(got, Tensor):
        return
    if got.shape != want.shape or not bool(((got - want).abs() <= RTOL * (1 + want.abs())).all()):
        diff = (got - want).abs().max().item() if got.shape == want.shape else f"shapes {tuple(got.shape)}"
        raise error(f"the translation of the torch.export program for certified bounds does not compute what the "
                    f"program computes (largest difference {diff} on a random probe batch of shape {tuple(x.shape)}); "
                    f"its bounds would not be about the artifact. {_FIX} Please report this with the program.")


def export_mismatch(model: Any, x: Tensor, outputs: Tensor) -> Tensor | None:
    """Per row of ``x``: the translated module's outputs differ from the program's (None: not a translation).

    For a verification loop that already has the program's outputs on the batch (no host sync).
    """
    from pytest_dnnsafety.files.onnx_graph import OnnxTranslation

    if not isinstance(model, (ExportTranslation, OnnxTranslation)):  # an ONNX graph's: against onnxruntime's logits
        return None
    with torch.no_grad():
        got = _first(model(x))
    want = outputs.detach().to(got.dtype)
    if got.shape != want.shape:
        return torch.ones(x.shape[0], dtype=torch.bool, device=want.device)
    return ((got - want).abs() > RTOL * (1 + want.abs())).flatten(1).any(dim=1)
