"""What an ONNX graph will allocate when it runs, bounded before onnxruntime runs it.

The byte walker (:mod:`~pytest_dnnsafety.files.onnx_wire`) limits what a file *declares*; a graph can also compute a
size at run time — ``ConstantOfShape`` of a constant ``[4100, 4100, 1000]``, ``Expand``/``Tile``/``Range``/``Resize``
to a shape it builds — and make onnxruntime allocate terabytes (the process is killed, no error names the file).
:func:`check_runtime_sizes` runs ONNX shape inference, with value propagation, on the graph with the input's real
per-sample shape and a batch of one (large initializers' data left out: only their shapes are read), computing the
shape arithmetic ONNX's value propagation leaves open (``Shape`` of a static tensor, ``Gather``, ``Concat``, ``Where``,
a small ``ConstantOfShape``, ...: the exporter's ``expand(n, -1, -1)``) and inferring again, then

* refuses any tensor whose inferred size exceeds :data:`~pytest_dnnsafety.files.onnx_wire.TENSOR_LIMIT` (the
  declared tensors' limit), naming the node, its operator, the shape and the size;
* refuses an *allocating* operator (:data:`ALLOCATING`) whose output shape inference cannot determine: its size
  depends on values computed at run time and cannot be bounded before it runs.

Model-local functions are inlined first and control-flow bodies are checked too. Exported perception models
(convolutions, attention, detectors with their decoding) infer to static shapes at a fixed input shape, so they
pass; a refusal names the node and the fix. onnx is imported lazily (the ``[onnx]`` extra).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

from pytest_dnnsafety.errors import ModelLoadError
from pytest_dnnsafety.files.onnx_wire import TENSOR_LIMIT
from pytest_dnnsafety.files.parsing import format_bytes

__all__ = ["ALLOCATING", "check_runtime_sizes"]

#: Operators whose output size comes from values (a shape, a count, scales, pads, a trip count), not only from the
#: sizes of their inputs.
ALLOCATING = frozenset({"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "OneHot", "Pad", "Loop",
                        "Scan", "ConcatFromSequence", "SplitToSequence", "Col2Im", "CenterCropPad", "RandomNormal",
                        "RandomUniform", "Multinomial", "Bernoulli"})
#: Rounds of folding shape arithmetic and inferring again.
_ROUNDS = 4
#: The most elements a folded shape value (or a constant read to fold one) may have.
_SMALL = 4096
#: Shape arithmetic folded into constants (on small inputs; an output over :data:`_SMALL` elements is not kept).
_FOLDABLE = frozenset({"Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Slice", "Mul", "Add", "Sub", "Div", "Neg",
                       "Abs", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "Where",
                       "Reshape", "Identity", "Max", "Min", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin",
                       "Floor", "Ceil", "Mod", "Sqrt", "Size", "Transpose", "Flatten", "Clip", "Sign", "Round",
                       "Pow", "ReduceMean"})
_FIX = ("Fix: export with static shapes (constant shape, size and pad inputs; torch.onnx.export with fixed input sizes "
        "apart from the batch), or gate the model's recorded outputs (dnnsafety_predictions) instead.")


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every control-flow body inside it."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def _shapes(graph: Any, itemsize: dict[int, int]) -> dict[str, tuple[list[int | None], int] | None]:
    """Value name -> (dims, bytes per element), or None when its shape is unknown."""
    out: dict[str, tuple[list[int | None], int] | None] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        kind = info.type.tensor_type
        if not kind.HasField("shape"):
            out[info.name] = None
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim]
        out[info.name] = (dims, itemsize.get(kind.elem_type, 8))
    return out


def check_runtime_sizes(model: Any, sample_shape: Sequence[int], where: str) -> None:
    """Raise :class:`~pytest_dnnsafety.errors.ModelLoadError` when ``model`` (a parsed ``ModelProto``, not changed)
    would make a tensor over the limit, or one of unknown size by an allocating operator, on one input of
    ``sample_shape`` (see the module docstring)."""
    import onnx
    from onnx import helper

    probe = _skeleton(model)
    if probe.functions:
        from onnx import inliner

        probe = inliner.inline_local_functions(probe)
    constants = {init.name for init in probe.graph.initializer}
    for value in probe.graph.input:
        if value.name in constants:
            continue
        dims = value.type.tensor_type.shape.dim
        for i, dim in enumerate(dims):
            if not dim.HasField("dim_value"):
                size = 1 if i == 0 else (sample_shape[i - 1] if i - 1 < len(sample_shape) else None)
                if size is not None:
                    dim.dim_value = int(size)
    probe = _inferred(probe, where)
    itemsize = {code: max(1, helper.tensor_dtype_to_np_dtype(code).itemsize)
                for code in onnx.TensorProto.DataType.values() if code not in (0, 8)
                and _np_dtype_known(helper, code)}
    for graph in _graphs(probe.graph):
        shapes = _shapes(graph, itemsize)
        for node in graph.node:
            label = f"node {node.name or node.output[0]!r} ({node.op_type})"
            for name in node.output:
                if not name:
                    continue
                known = shapes.get(name)
                if known is None or any(d is None for d in known[0]):
                    if node.op_type in ALLOCATING:
                        raise ModelLoadError(f"{where}: {label} makes a tensor whose shape depends on values computed "
                                             f"at run time, so its size cannot be bounded before onnxruntime runs "
                                             f"it (a hostile graph allocates terabytes this way). {_FIX}")
                    continue
                dims, size = known
                total = math.prod(dims) * size
                if total > TENSOR_LIMIT:
                    raise ModelLoadError(f"{where}: {label} makes a tensor of shape {dims} ({format_bytes(total)}) "
                                         f"for a single input, more than the {format_bytes(TENSOR_LIMIT)} one tensor "
                                         "may hold; refused before onnxruntime runs it. Fix: no perception model "
                                         "needs a tensor this large for one input: check how the file was made (and "
                                         "where it came from).")


def _skeleton(model: Any) -> Any:
    """A copy of ``model`` without the data of its large initializers (their names, types and dims kept): what
    shape inference reads, without copying the weights."""
    import onnx

    probe = onnx.ModelProto()
    probe.ir_version = model.ir_version
    probe.opset_import.extend(model.opset_import)
    probe.functions.extend(model.functions)
    source, graph = model.graph, probe.graph
    graph.name = source.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(source, field))
    for init in source.initializer:
        if math.prod(init.dims) <= _SMALL:
            graph.initializer.append(init)
        else:
            kept = graph.initializer.add()
            kept.name, kept.data_type = init.name, init.data_type
            kept.dims.extend(init.dims)
    return probe


def _infer(probe: Any, where: str) -> Any:
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(probe, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - named in the refusal
        raise ModelLoadError(f"{where}: ONNX shape inference fails on the graph ({type(exc).__name__}: "
                             f"{str(exc)[:300]}), so what it allocates cannot be bounded before it runs. Fix: export a "
                             "graph that onnx.checker.check_model(model, full_check=True) accepts.") from None


def _unknown_allocation(graph: Any) -> bool:
    shapes = {info.name: info.type.tensor_type for info in [*graph.value_info, *graph.output]}
    for node in graph.node:
        if node.op_type in ALLOCATING:
            for name in node.output:
                kind = shapes.get(name)
                if name and (kind is None or not kind.HasField("shape")
                             or not all(d.HasField("dim_value") for d in kind.shape.dim)):
                    return True
    return False


def _inferred(probe: Any, where: str) -> Any:
    """``probe`` shape-inferred; while an allocating operator's shape stays unknown, the shape arithmetic feeding it
    (small integer tensors computed from constants and static shapes: ``Shape``, ``Gather``, ``Concat``, ``Where``,
    ...) is computed and put in as constants, and inference runs again — ONNX's own value propagation stops at
    ``Where``/``Equal``, which the exporter emits for ``expand(n, -1, -1)`` (a ViT's class token)."""
    inferred = _infer(probe, where)
    for _ in range(_ROUNDS):
        if not _unknown_allocation(inferred.graph) or not _fold(inferred):
            break
        inferred = _infer(inferred, where)
    return inferred


def _constant(node: Any) -> Any:
    """A ``Constant`` node's value when it is small, else None."""
    from onnx import helper, numpy_helper

    attr = node.attribute[0] if len(node.attribute) == 1 else None
    if attr is None:
        return None
    if attr.name == "value":
        return numpy_helper.to_array(attr.t) if math.prod(attr.t.dims) <= _SMALL else None
    if attr.name in ("value_int", "value_ints", "value_float", "value_floats"):
        import numpy as np

        value = helper.get_attribute_value(attr)
        return np.asarray(value, dtype=np.int64 if "int" in attr.name else np.float32)
    return None


#: Shape arithmetic whose output broadcasts its inputs' shapes.
_BROADCAST = frozenset({"Mul", "Add", "Sub", "Div", "Mod", "Pow", "Equal", "Greater", "Less", "GreaterOrEqual",
                        "LessOrEqual", "And", "Or", "Where", "Max", "Min"})


def _small_result(node: Any, values: dict[str, Any]) -> bool:
    """Whether ``node`` is foldable shape arithmetic whose output has at most :data:`_SMALL` elements, known before
    computing it (``Where`` of three 4096-element vectors could broadcast to 6.9e10 elements; the sizes are Python
    integers)."""
    import numpy as np

    given = [values[i] for i in node.input if i]
    try:
        if node.op_type == "ConstantOfShape":
            dims = [int(d) for d in given[0].ravel()]
            size = math.prod(dims) if all(d >= 0 for d in dims) else _SMALL + 1
        elif node.op_type in _BROADCAST:
            size = math.prod(int(d) for d in np.broadcast_shapes(*(np.shape(v) for v in given)))
        elif node.op_type == "Gather":
            data, indices = given[0], given[1]
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            size = int(np.size(indices)) * (int(np.size(data)) // max(1, int(np.shape(data)[axis])))
        elif node.op_type in _FOLDABLE:  # the rest make at most what they are given
            size = sum(int(np.size(v)) for v in given)
        else:
            return False
    except (ValueError, IndexError, TypeError):
        return False
    return size <= _SMALL


def _fold(model: Any) -> bool:
    """Replace the main graph's foldable nodes by constants (see :func:`_inferred`); whether any was."""
    import numpy as np
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values: dict[str, Any] = {init.name: numpy_helper.to_array(init) for init in graph.initializer
                              if math.prod(init.dims) <= _SMALL}
    static = {}
    for info in [*graph.input, *graph.value_info]:
        dims = info.type.tensor_type.shape.dim
        if info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            static[info.name] = [d.dim_value for d in dims]
    changed = False
    nodes = []
    for node in graph.node:
        made = None
        if node.op_type == "Constant":
            value = _constant(node)
            if value is not None:
                values[node.output[0]] = value
        elif node.op_type == "Shape" and node.input[0] in static:
            attrs = {a.name: a.i for a in node.attribute}
            dims = static[node.input[0]]
            made = [np.array(dims[attrs.get("start", 0):attrs.get("end", len(dims))], dtype=np.int64)]
        elif node.input and all(not i or i in values for i in node.input) and _small_result(node, values):
            try:
                made = ReferenceEvaluator(node, opsets=opsets).run(None, {i: values[i] for i in node.input if i})
            except Exception:  # noqa: BLE001 - left for onnxruntime to compute
                made = None
            if made is not None and any(np.asarray(v).size > _SMALL for v in made):
                made = None
        if made is None:
            nodes.append(node)
            continue
        changed = True
        for name, value in zip(node.output, made):
            value = np.asarray(value)
            values[name] = value
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _np_dtype_known(helper: Any, code: int) -> bool:
    try:
        helper.tensor_dtype_to_np_dtype(code)
    except Exception:  # noqa: BLE001 - a type numpy does not hold (bfloat16 on old numpy, ...)
        return False
    return True
