"""An ONNX model (``dnnsafety_model = "model.onnx"``) as a ``torch.nn.Module`` run by onnxruntime.

The file is read once; its bytes are checked by :func:`~pytest_dnnsafety.files.onnx_wire.check_onnx_bytes` (external
data, custom-operator domains, declared sizes); external data, when allowed, is read by us from the model's folder
and inlined, so onnxruntime is given bytes (:attr:`OnnxModel.proto`), never a path. :attr:`OnnxModel.sha256` is the
digest of the bytes read.

``forward(x)`` hands ``x`` to onnxruntime as a host numpy array of the graph input's element type (float32 for most
graphs) and returns torch tensors on ``x``'s device: the CPU execution provider, with the CUDA provider first when
onnxruntime has it and ``x`` is on a CUDA device. A graph with a fixed batch size ``B`` runs a batch in calls of
``B`` rows, the last padded with zero rows whose outputs are dropped (inference is per row). A graph whose outputs
are named ``boxes``, ``scores``, ``labels`` ((N, K, 4), (N, K), (N, K)) is a detector: it returns one dict per image
(torchvision's format, the plugin's detector output), its padding rows (label < 0) dropped.

Intermediate tensors: :meth:`OnnxModel.layer_names` lists the node output names; :meth:`OnnxModel.tapped` adds
requested names as extra graph outputs (a modified ModelProto, cached per set of names), so a gate's outputs and
activations come from one run. Before the first run at an input shape, what the graph will allocate is bounded
(:func:`~pytest_dnnsafety.files.onnx_sizes.check_runtime_sizes`). onnx and onnxruntime (the ``[onnx]`` extra) are
imported lazily.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pytest_dnnsafety.errors import ConfigError, ModelLoadError
from pytest_dnnsafety.files.onnx_wire import check_onnx_bytes
from pytest_dnnsafety.files.parsing import format_bytes, open_regular

__all__ = ["OnnxModel", "OnnxTapped", "is_onnx_model", "ACTIVATIONS_FROM", "ONNX_MAGIC_HINT", "MAX_FILE"]

#: The evidence detail of a gate that read intermediate tensors of an ONNX graph.
ACTIVATIONS_FROM = "ONNX graph tensors"
#: The largest .onnx file read (protobuf's own limit on one message).
MAX_FILE = 2 << 30
ONNX_MAGIC_HINT = "an ONNX model (.onnx)"
_EXTRA = 'Fix: pip install "pytest-dnnsafety[onnx]"'
_DETECTOR = ("boxes", "scores", "labels")
_NUMPY = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
          "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(uint8)": "uint8"}


def _import(name: str, where: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise ModelLoadError(f"{where}: an ONNX model needs the optional packages onnx and onnxruntime ({name} is "
                             f"not installed). {_EXTRA}") from None


def is_onnx_model(obj: Any) -> bool:
    """True for a model loaded from an ``.onnx`` file (:class:`OnnxModel`)."""
    return isinstance(obj, OnnxModel)


def _inline_external(data: bytes, external: Sequence[Any], where: str) -> bytes:
    """``data`` with each external tensor's bytes read by us and put in its raw_data (then checked again)."""
    onnx = _import("onnx", where)
    model = onnx.load_model_from_string(data)
    by_name = {item.name: item for item in external}

    def tensors(graph: Any):
        yield from graph.initializer
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors
                for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                    yield from tensors(sub)

    for tensor in tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL and not len(tensor.external_data):
            continue
        item = by_name.get(tensor.name)
        if item is None:  # pragma: no cover - every external tensor was listed by the walk
            raise ModelLoadError(f"{where}: external tensor {tensor.name!r} was not checked.")
        with open_regular(item.path) as handle:
            handle.seek(item.offset)
            raw = handle.read(item.length)
        if len(raw) != item.length:
            raise ModelLoadError(f"{where}: external data of {tensor.name!r} ended early ({len(raw)} of "
                                 f"{item.length} bytes).")
        tensor.raw_data = raw
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
    return model.SerializeToString()


class OnnxTapped:
    """The ONNX graph with ``layers`` as extra outputs: ``run(sink, x)`` returns the model's output and calls
    ``sink(i, value)`` with the value of ``layers[i]`` from the same run (as :class:`~.pt2_taps.TappedForward`)."""

    def __init__(self, model: "OnnxModel", layers: tuple[str, ...], values: tuple[str, ...] | None = None) -> None:
        self.model = model
        self.layers = layers  # as the gates name them
        self.values = values or layers  # the graph values they resolve to (a module path -> its output's name)

    def run(self, sink: Callable[[int, Any], None], x: torch.Tensor) -> Any:
        outputs, extra = self.model._run(x, tuple(dict.fromkeys(self.values)))
        extra = [extra[list(dict.fromkeys(self.values)).index(v)] for v in self.values]
        for i, value in enumerate(extra):
            sink(i, value)
        return outputs


class OnnxModel(torch.nn.Module):
    """An ONNX graph run by onnxruntime (see the module docstring)."""

    def __init__(self, proto: bytes, *, path: Path | None = None, sha256: str | None = None,
                 where: str = "the ONNX model", allow_external: bool = False,
                 allow_custom_domains: bool = False) -> None:
        super().__init__()
        report = check_onnx_bytes(proto, where=where, name="the file" if path is None else path.name,
                                  folder=None if path is None else path.parent,
                                  allow_external=allow_external, allow_custom_domains=allow_custom_domains)
        self.sha256 = sha256 or hashlib.sha256(proto).hexdigest()
        if report.external:
            proto = _inline_external(proto, report.external, where)
            check_onnx_bytes(proto, where=where, allow_custom_domains=allow_custom_domains)
        self.path = path
        self.proto = proto
        self._where = where
        self._sessions: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}
        self._parsed: Any = None
        self._bounded: set[tuple[int, ...]] = set()  # per-sample input shapes whose allocations were bounded
        declared = self._declared_sample_shape()
        if declared is not None:  # static per-sample shape: bounded before onnxruntime even builds a session
            self._bound(declared)
        ort = _import("onnxruntime", where)
        session = self._session((), ("CPUExecutionProvider",))
        inputs = session.get_inputs()
        if len(inputs) != 1:
            raise ModelLoadError(f"{where}: the graph has {len(inputs)} inputs ({[i.name for i in inputs]}); the "
                                 f"plugin gives a model one input batch. Fix: export the model with one input.")
        self.input_name = inputs[0].name
        self._input_type = _NUMPY.get(inputs[0].type, "float32")
        batch = inputs[0].shape[0] if inputs[0].shape else None
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.output_names = [o.name for o in session.get_outputs()]
        self.providers = list(ort.get_available_providers())
        self.eval()

    @classmethod
    def from_file(cls, path: Path, where: str, *, allow_external: bool = False,
                  allow_custom_domains: bool = False) -> "OnnxModel":
        """Read ``path`` once (at most :data:`MAX_FILE` bytes) and build the model from the checked bytes."""
        with open_regular(path) as handle:
            data = handle.read(MAX_FILE + 1)
        if len(data) > MAX_FILE:
            raise ModelLoadError(f"{where}: {path.name} is larger than {format_bytes(MAX_FILE)}, protobuf's limit on "
                                 f"one ONNX message. Fix: keep large weights as external data in the model's folder "
                                 f"and set dnnsafety_onnx_external_data = true.")
        return cls(data, path=path, sha256=hashlib.sha256(data).hexdigest(), where=where,
                   allow_external=allow_external, allow_custom_domains=allow_custom_domains)

    def extra_repr(self) -> str:
        return f"path={str(self.path)!r}, sha256={self.sha256[:12]}…, outputs={self.output_names}"

    # -- the graph ------------------------------------------------------------------------------------------------
    def _model_proto(self) -> Any:
        if self._parsed is None:
            onnx = _import("onnx", self._where)
            self._parsed = onnx.load_model_from_string(self.proto)
        return self._parsed

    def _declared_sample_shape(self) -> tuple[int, ...] | None:
        """The graph input's per-sample dims when all are static, else None."""
        graph = self._model_proto().graph
        constants = {init.name for init in graph.initializer}
        inputs = [value for value in graph.input if value.name not in constants]
        if len(inputs) != 1:
            return None
        dims = inputs[0].type.tensor_type.shape.dim
        if not len(dims) or not all(d.HasField("dim_value") for d in dims[1:]):
            return None
        return tuple(int(d.dim_value) for d in dims[1:])

    def _bound(self, sample: tuple[int, ...]) -> None:
        """:func:`~pytest_dnnsafety.files.onnx_sizes.check_runtime_sizes` once per per-sample input shape."""
        if sample not in self._bounded:
            from pytest_dnnsafety.files.onnx_sizes import check_runtime_sizes

            check_runtime_sizes(self._model_proto(), sample, self._where)
            self._bounded.add(sample)

    def layer_names(self) -> list[str]:
        """The graph's node output names (its intermediate values), in node order."""
        return list(dict.fromkeys(o for node in self._model_proto().graph.node for o in node.output if o))

    def module_outputs(self) -> dict[str, str]:
        """Eager module paths -> the graph value each module's output became, read from the node names torch's
        exporter writes (``/features/features.0/Conv``: scopes, qualified for containers' children): the last node
        of a module's scope gives its output. Lets ``layer="classifier.0"`` name the same tensor as in the eager
        model's ``named_modules()``."""
        cached = self.__dict__.get("_module_outputs")
        if cached is None:
            cached = {}
            for node in self._model_proto().graph.node:
                if not node.name.startswith("/") or not node.output or not node.output[0]:
                    continue
                path = ""
                for seg in node.name.split("/")[1:-1]:
                    path = seg if not path or seg.startswith(path + ".") else f"{path}.{seg}"
                    cached[path] = node.output[0]
            object.__setattr__(self, "_module_outputs", cached)
        return cached

    def resolve_layer(self, layer: str) -> str | None:
        """The graph value a gate's ``layer=`` names: a node output name, else an eager module path (None: neither)."""
        if layer in set(self.layer_names()):
            return layer
        return self.module_outputs().get(layer)

    def check_layers(self, layers: Sequence[str]) -> None:
        """ConfigError naming the unknown names and listing the graph's (truncated) when a name is not a value."""
        unknown = [layer for layer in layers if self.resolve_layer(layer) is None]
        if unknown:
            names = self.layer_names()
            modules = list(self.module_outputs())
            shown = ", ".join(names[:40]) + (", …" if len(names) > 40 else "")
            paths = (f"; or an eager module path the exporter recorded: {', '.join(modules[:40])}"
                     f"{', …' if len(modules) > 40 else ''}") if modules else ""
            raise ConfigError(f"layer(s) {', '.join(map(repr, unknown))}: not a tensor of the ONNX graph. Fix: use a "
                              f"node output name of the graph ({len(names)}): {shown}{paths}")

    def tapped(self, layers: Sequence[str]) -> OnnxTapped:
        """The graph with ``layers`` (node output names or module paths) as extra outputs, read in the same run."""
        layers = tuple(dict.fromkeys(layers))
        self.check_layers(layers)
        return OnnxTapped(self, layers, tuple(self.resolve_layer(layer) or layer for layer in layers))

    def _tapped_proto(self, layers: tuple[str, ...]) -> bytes:
        onnx = _import("onnx", self._where)
        model = onnx.ModelProto()
        model.CopyFrom(self._model_proto())
        try:
            typed = onnx.shape_inference.infer_shapes(model)
            infos = {v.name: v for v in list(typed.graph.value_info) + list(typed.graph.output)}
        except Exception:  # no inferred types: ORT takes outputs with a name only
            infos = {}
        present = {o.name for o in model.graph.output}
        for name in layers:
            if name in present:
                continue
            info = infos.get(name)
            if info is not None:
                model.graph.output.append(info)
            else:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
        return model.SerializeToString()

    def _session(self, layers: tuple[str, ...], providers: tuple[str, ...]) -> Any:
        key = (layers, providers)
        session = self._sessions.get(key)
        if session is None:
            ort = _import("onnxruntime", self._where)
            options = ort.SessionOptions()
            options.intra_op_num_threads = max(1, torch.get_num_threads())
            options.log_severity_level = 3
            proto = self._tapped_proto(layers) if layers else self.proto
            try:
                session = ort.InferenceSession(proto, sess_options=options, providers=list(providers))
            except Exception as exc:
                raise ModelLoadError(f"{self._where}: onnxruntime could not load the graph: "
                                     f"{type(exc).__name__}: {str(exc)[:400]}") from None
            self._sessions[key] = session
        return session

    # -- running --------------------------------------------------------------------------------------------------
    def _providers(self, device: torch.device) -> tuple[str, ...]:
        if device.type == "cuda" and "CUDAExecutionProvider" in self.providers:
            return ("CUDAExecutionProvider", "CPUExecutionProvider")
        return ("CPUExecutionProvider",)

    def _run(self, x: torch.Tensor, layers: tuple[str, ...] = ()) -> tuple[Any, list[torch.Tensor]]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"an ONNX model takes one tensor batch, not {type(x).__name__}")
        self._bound(tuple(int(d) for d in x.shape[1:]))  # what the graph allocates at this shape, before it runs
        session = self._session(layers, self._providers(x.device))
        array = x.detach().to("cpu", getattr(torch, self._input_type)).contiguous().numpy()
        names = self.output_names + [name for name in layers if name not in self.output_names]
        n = array.shape[0] if array.ndim else 1
        fixed = self.fixed_batch
        if fixed is None or n == fixed:
            values = session.run(names, {self.input_name: array})
        else:  # a fixed-batch graph: calls of `fixed` rows, the last padded with zero rows (dropped)
            import numpy as np

            parts: list[list[Any]] = []
            for start in range(0, n, fixed):
                rows = array[start:start + fixed]
                pad = fixed - rows.shape[0]
                if pad:
                    rows = np.concatenate([rows, np.zeros((pad,) + rows.shape[1:], rows.dtype)])
                got = session.run(names, {self.input_name: rows})
                parts.append([value[:fixed - pad] for value in got])
            values = [np.concatenate([part[i] for part in parts]) for i in range(len(names))]
        tensors = {name: torch.from_numpy(value).to(x.device) for name, value in zip(names, values)}
        outputs = self._outputs([tensors[name] for name in self.output_names], n)
        return outputs, [tensors[name] for name in layers]

    def _outputs(self, values: list[torch.Tensor], n: int) -> Any:
        if set(_DETECTOR) <= set(self.output_names):
            boxes, scores, labels = (values[self.output_names.index(name)] for name in _DETECTOR)
            if boxes.ndim == 3 and scores.ndim == 2 and labels.ndim == 2:
                keep = labels >= 0
                return [{"boxes": boxes[i][keep[i]].float(), "scores": scores[i][keep[i]].float(),
                         "labels": labels[i][keep[i]].long()} for i in range(boxes.shape[0])]
        return values[0] if len(values) == 1 else tuple(values)

    def translated(self, error: type[Exception] = ConfigError) -> torch.nn.Module:
        """The graph as the equivalent eager torch module (:func:`~pytest_dnnsafety.files.onnx_graph.translate_onnx`),
        checked against onnxruntime once and kept (not a submodule: the model's parameters stay empty)."""
        cached = self.__dict__.get("_translation")
        if cached is None:
            from pytest_dnnsafety.files.onnx_graph import translate_onnx

            try:
                cached = translate_onnx(self, error)
            except Exception as exc:  # kept too: the refusal is given again, not recomputed
                cached = exc
            object.__setattr__(self, "_translation", cached)
        if isinstance(cached, Exception):
            raise error(str(cached)) from None
        return cached

    def forward(self, x: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad and \
                not set(_DETECTOR) <= set(self.output_names) and len(self.output_names) == 1:
            # a gradient is asked for (an attack): onnxruntime's values, the checked translation's gradient
            from pytest_dnnsafety.files.onnx_graph import ort_with_translated_gradient

            translation = self.translated()
            return ort_with_translated_gradient(x, lambda xx: self._run(xx)[0], translation.to(x.device))
        return self._run(x)[0]
