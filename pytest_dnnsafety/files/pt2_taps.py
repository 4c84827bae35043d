"""Layer activations of a ``torch.export`` program, read from its graph's nodes.

A deployed ``.pt2`` program's module (``torch.export.load(path).module()``) is a
:class:`torch.fx.GraphModule` that runs ATen operations inline: its submodules survive only as
holders of weights, so a forward hook on a layer never fires. The graph still knows its layers:
every node carries ``node.meta["nn_module_stack"]``, the modules of the eager model the operation
ran in (``{"L__self__layer4.1": ("layer4.1", "…BasicBlock"), …}``), named as in the eager model's
``named_modules()``. This module maps those names back to values:

* :func:`graph_layers` — every module path of the graph's module hierarchy, in execution order,
  and for each one its *output node*: the one node computed in the module's scope whose value is
  used outside the scope (by a later module or the program's output). A module called more than
  once per forward pass, one whose scope hands on several values (a module returning a tuple) or
  none (a module returning its input), has no single output and is refused by
  :func:`layer_outputs` with the reason; modules that compute nothing (``nn.Identity``, a dropout
  that export removed) leave no node and are not in the hierarchy.
* :func:`tapped_forward` — the program's forward with *taps*: a copy of the graph (the user's
  module is never changed) in which a call ``_tap(tag, slot, value)`` follows the last node of
  each requested layer's scope — where the eager module would return and its forward hook fire —
  and hands the layer's output to a callback. The copy's code runs with the user's module as
  ``self`` (its weights, buffers and input guards, as they are at call time), so it computes the
  program's outputs with the same operations; the compiled copy is cached per model object (and
  per set of layers), without keeping the model alive.

Pure torch; no pytest import. :func:`is_exported_module` is the one test of "is this a
``torch.export`` program's module" for every part of the package.
"""

from __future__ import annotations

import contextvars
import itertools
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pytest_dnnsafety.errors import ConfigError

__all__ = ["is_exported_module", "node_module_path", "GraphLayers", "graph_layers", "layer_outputs", "TappedForward", "tapped_forward",
           "ACTIVATIONS_FROM"]

#: How the evidence names where an exported program's layer activations come from.
ACTIVATIONS_FROM = "exported graph nodes"


def is_exported_module(model: Any) -> bool:
    """Whether ``model`` is the module of a ``torch.export`` program (``torch.export.load(...).module()``)."""
    return isinstance(model, torch.fx.GraphModule) and any(
        cls.__name__ == "_StatefulGraphModule" or cls.__module__.startswith("torch.export")
        for cls in type(model).__mro__)


@dataclass(frozen=True)
class GraphLayers:
    """The module hierarchy of an exported graph.

    ``names``: every module path some node ran in, in the order the graph first enters it;
    ``outputs``: path -> name of the node that is the module's output (only for the paths that have
    exactly one); ``last``: path -> name of the last node of the module's scope (where a tap goes);
    ``refused``: path -> why the path has no single output (a sentence, for :class:`ConfigError`).
    """

    names: tuple[str, ...]
    outputs: dict[str, str]
    last: dict[str, str]
    refused: dict[str, str]


_ANALYSED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, GraphLayers]]" = weakref.WeakKeyDictionary()
#: model -> {(graph code, layers): (compiled tapped forward, its tag)}
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[Any, ...], tuple[Callable[..., Any], int]]]" = (
    weakref.WeakKeyDictionary())
_TAGS = itertools.count(1)
#: The callback of the tapped pass running in this context: (tag of its compiled forward, callback).
_SINK: contextvars.ContextVar[tuple[int, Callable[[int, Any], None]] | None] = contextvars.ContextVar(
    "dnnsafety_export_sink", default=None)


def _path(value: Any) -> str | None:
    """The module path of one ``nn_module_stack`` entry (``("layer1.0", "…")``), as ``named_modules()`` spells it."""
    path = value[0] if isinstance(value, (tuple, list)) and value else value
    if not isinstance(path, str):
        return None
    # older torch spelled paths as Dynamo sources: L['self'].layer1[0] -> layer1.0
    path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    return None if not path or path.startswith("_empty_nn_module_stack") else path


def node_module_path(node: torch.fx.Node) -> str:
    """The innermost module the node's operation ran in, as ``named_modules()`` spells it ("" at top level)."""
    paths = [_path(value) for value in (node.meta.get("nn_module_stack") or {}).values()]
    paths = [path for path in paths if path]
    return paths[-1] if paths else ""


def _tensor_valued(node: torch.fx.Node) -> bool | None:
    """True for a node computing a tensor, False for a tuple/list, None for a non-tensor (a shape's SymInt)."""
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:  # no metadata: shape arithmetic is named sym_*; anything else is taken for a tensor
        return None if "sym_" in str(node.target) else True
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)):
        return False
    return None


def _analyse(model: torch.fx.GraphModule) -> GraphLayers:
    nodes = [n for n in model.graph.nodes if n.op in ("call_function", "call_method")]
    order = {node: i for i, node in enumerate(nodes)}
    members: dict[str, set[torch.fx.Node]] = {}
    calls: dict[str, dict[str, None]] = {}
    last: dict[str, torch.fx.Node] = {}
    for node in nodes:
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            path = _path(value)
            if path is None:
                continue
            members.setdefault(path, set()).add(node)
            calls.setdefault(path, {})[str(key)] = None
            last[path] = node
    outputs: dict[str, str] = {}
    refused: dict[str, str] = {}
    for path, scope in members.items():
        if len(calls[path]) > 1:
            refused[path] = (f"the program calls this module {len(calls[path])} times per forward pass, so it has "
                             "no single output; neuron metrics need exactly one output per input. Fix: name a layer "
                             "the model calls once per forward pass (or give each call its own module)")
            continue
        leaving = [n for n in sorted(scope, key=order.__getitem__) if any(user not in scope for user in n.users)]
        values = [n for n in leaving if _tensor_valued(n) is not None]  # shapes (SymInts) are no values
        if len(values) == 1 and _tensor_valued(values[0]):
            outputs[path] = values[0].name
        elif not values:
            refused[path] = ("no value computed in its scope is used after it (the module returns its input, or "
                             "only changes it in place), so the graph holds no output of it. Fix: name the layer "
                             "that computes the value")
        else:
            refused[path] = (f"its scope in the graph hands on {len(values)} value(s) (graph node(s) "
                             f"{', '.join(n.name for n in values)}): the module returns a tuple or several tensors, "
                             "and layer activations need one tensor (batch, neurons, ...). Fix: name a submodule "
                             "that returns one tensor, or make the module return one tensor")
    return GraphLayers(tuple(members), outputs, {p: n.name for p, n in last.items()}, refused)


def graph_layers(model: torch.fx.GraphModule) -> GraphLayers:
    """The module hierarchy of ``model``'s graph (see :class:`GraphLayers`), cached per model and graph code."""
    code = model.code
    seen = _ANALYSED.get(model)
    if seen is not None and seen[0] == code:
        return seen[1]
    layers = _analyse(model)
    _ANALYSED[model] = (code, layers)
    return layers


def layer_outputs(model: torch.fx.GraphModule, layers: Sequence[str]) -> dict[str, str]:
    """``{layer: output node name}``; :class:`ConfigError` for a layer that is not in the graph or has no single output.

    An unknown layer's error lists the graph's module names (as the eager model's error lists
    ``named_modules()``).
    """
    known = graph_layers(model)
    for layer in layers:
        if layer not in known.outputs and layer not in known.refused:
            shown = ", ".join(known.names[:40]) + (", …" if len(known.names) > 40 else "")
            raise ConfigError(
                f"unknown layer {layer!r}: the torch.export program's graph runs no module of that name (modules "
                f"that compute nothing, such as nn.Identity, leave no node in it). Fix: use a name from the "
                f"exported graph's modules (as in the eager model's named_modules()): {shown or 'none'}")
        if layer in known.refused:
            raise ConfigError(f"layer {layer!r} of the torch.export program: {known.refused[layer]}.")
    return {layer: known.outputs[layer] for layer in layers}


def _tap(tag: int, slot: int, value: Any) -> None:
    """Called by a tapped graph right after a layer's scope: hands the layer's output to the running pass's callback."""
    sink = _SINK.get()
    if sink is not None and sink[0] == tag:
        sink[1](slot, value)


def _compile(model: torch.fx.GraphModule, layers: tuple[str, ...]) -> tuple[Callable[..., Any], int]:
    known = graph_layers(model)
    layer_outputs(model, layers)
    graph = torch.fx.Graph()  # a copy of the nodes; the user's graph is left as it is
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    result, output = graph.graph_copy(model.graph, copies, return_output_node=True)  # type: ignore[misc]
    graph.output(result, type_expr=output.type)
    graph.set_codegen(model.graph._codegen)  # the program's (pytree) calling convention; only read
    by_name = {node.name: copies[node] for node in model.graph.nodes if node in copies}
    tag = next(_TAGS)
    for slot, layer in enumerate(layers):
        with graph.inserting_after(by_name[known.last[layer]]):
            graph.call_function(_tap, (tag, slot, by_name[known.outputs[layer]]))
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<dnnsafety: tapped torch.export graph, tag {tag}>", "exec", dont_inherit=True),
         namespace)
    return namespace["forward"], tag


class TappedForward:
    """The exported program's forward with taps on ``layers``: ``run(sink, x)`` returns the program's output and calls
    ``sink(i, value)`` with the output of ``layers[i]`` during the pass (see the module docstring)."""

    def __init__(self, model: torch.fx.GraphModule, layers: tuple[str, ...], forward: Callable[..., Any],
                 tag: int) -> None:
        self.model = model
        self.layers = layers
        self._forward = forward
        self._tag = tag

    def run(self, sink: Callable[[int, Any], None], *args: Any) -> Any:
        token = _SINK.set((self._tag, sink))
        try:
            return self._forward(self.model, *args)
        finally:
            _SINK.reset(token)


def tapped_forward(model: torch.fx.GraphModule, layers: Sequence[str]) -> TappedForward:
    """:class:`TappedForward` of ``model`` on ``layers`` (a bad layer: :class:`ConfigError`, as :func:`layer_outputs`).

    The compiled copy is cached per model object, graph code and layers; it holds no reference to the model.
    """
    key = (model.code, tuple(layers))
    compiled = _COMPILED.setdefault(model, {})
    if key not in compiled:
        if any(k[0] != key[0] for k in compiled):  # the graph was edited: its old copies are stale
            compiled.clear()
        while len(compiled) >= 8:  # keep the latest few sets of layers
            compiled.pop(next(iter(compiled)))
        compiled[key] = _compile(model, key[1])
    forward, tag = compiled[key]
    return TappedForward(model, key[1], forward, tag)
