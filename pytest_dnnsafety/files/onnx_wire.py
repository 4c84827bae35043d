"""A check of an ONNX file's bytes, read as protobuf wire format, before any parser or runtime sees them.

The walker reads the exact bytes onnxruntime will be given (never the onnx package's parsed view, which could
differ from the runtime's on a crafted file) and refuses, with a :class:`~pytest_dnnsafety.errors.ModelLoadError`
naming the problem and the fix:

* **external data** (a tensor with ``data_location = EXTERNAL`` or ``external_data`` entries): its path could point
  outside the model's folder. Refused unless ``dnnsafety_onnx_external_data = true``; then only relative paths that
  stay inside the model's folder (no ``..``, no absolute path, no symlink escaping) with offsets and lengths inside
  the actual file (:func:`external_tensors` lists them; :mod:`.onnx_model` reads and inlines them);
* **custom-operator domains** (an ``opset_import`` or node domain other than ``""``, ``ai.onnx``, ``ai.onnx.ml``):
  onnxruntime can load libraries for them. Refused unless ``dnnsafety_onnx_custom_domains = true``;
* **sizes**: a tensor whose declared size (product of its dims x element size) is above :data:`TENSOR_LIMIT`, or
  all of them together above the data budget (:func:`~pytest_dnnsafety.files.parsing.data_budget`), is refused
  from its header, before anything is allocated; a ``raw_data`` whose length is not the declared size is refused;
  graphs nest at most :data:`MAX_DEPTH` deep.

Field numbers are onnx.proto's (checked against the onnx package's descriptors in tests/files/test_onnx_wire.py).
No onnx, onnxruntime or torch import here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from pytest_dnnsafety.errors import ModelLoadError
from pytest_dnnsafety.files.parsing import data_budget, format_bytes

__all__ = ["FIELDS", "TENSOR_LIMIT", "MAX_DEPTH", "STANDARD_DOMAINS", "ExternalTensor", "WireReport",
           "check_onnx_bytes"]

#: The most bytes one tensor may declare.
TENSOR_LIMIT = 4 << 30
#: The deepest nesting of graphs (control-flow bodies in attributes) accepted.
MAX_DEPTH = 32
#: Operator domains onnxruntime implements itself (anything else may load a custom-op library).
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})

#: (message, field) -> field number, from onnx.proto.
FIELDS = {
    ("ModelProto", "graph"): 7, ("ModelProto", "opset_import"): 8, ("ModelProto", "functions"): 25,
    ("OperatorSetIdProto", "domain"): 1,
    ("GraphProto", "node"): 1, ("GraphProto", "initializer"): 5, ("GraphProto", "sparse_initializer"): 15,
    ("NodeProto", "attribute"): 5, ("NodeProto", "domain"): 7,
    ("FunctionProto", "node"): 7, ("FunctionProto", "opset_import"): 9, ("FunctionProto", "domain"): 10,
    ("AttributeProto", "t"): 5, ("AttributeProto", "g"): 6, ("AttributeProto", "tensors"): 10,
    ("AttributeProto", "graphs"): 11, ("AttributeProto", "sparse_tensor"): 22, ("AttributeProto", "sparse_tensors"): 23,
    ("SparseTensorProto", "values"): 1, ("SparseTensorProto", "indices"): 2,
    ("TensorProto", "dims"): 1, ("TensorProto", "data_type"): 2, ("TensorProto", "name"): 8,
    ("TensorProto", "raw_data"): 9, ("TensorProto", "external_data"): 13, ("TensorProto", "data_location"): 14,
    ("StringStringEntryProto", "key"): 1, ("StringStringEntryProto", "value"): 2,
}
_F = FIELDS
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
#: TensorProto.DataType -> bits per element (STRING, 8, has no fixed size: not counted).
_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 14: 64, 15: 128,
         16: 16, 17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4, 24: 8, 25: 2, 26: 2}

_FIX_EXTERNAL = ("Fix: save the model with its weights inside the file (onnx.save_model(model, path, "
                 "save_as_external_data=False)), or, for a model you trust whose data files lie in its folder, set "
                 "dnnsafety_onnx_external_data = true")
_FIX_DOMAIN = ("Fix: export with standard ONNX operators only (no custom-op domains), or, for a model you trust, set "
               "dnnsafety_onnx_custom_domains = true (onnxruntime must then have the custom operators registered)")


class _Bad(Exception):
    """The bytes are not the protobuf they claim to be (worded by :func:`check_onnx_bytes`)."""


@dataclass(frozen=True)
class ExternalTensor:
    """One tensor stored in another file: its name, that file (resolved, inside the model's folder), offset, bytes."""

    name: str
    path: Path
    offset: int
    length: int


@dataclass
class WireReport:
    """What the walk found: the tensors' declared bytes, custom domains, external tensors, graphs' depth."""

    tensors: int = 0
    declared_bytes: int = 0
    domains: set[str] = field(default_factory=set)
    external: list[ExternalTensor] = field(default_factory=list)
    depth: int = 0


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Bad("a varint runs past its message" if pos >= end else "a varint longer than 10 bytes")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview, start: int, end: int):
    """(field number, wire type, value) of a message: value is an int (varint, fixed) or a (start, end) span."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Bad("a field numbered 0")
        if wire == 0:
            value, pos = _varint(data, pos, end)
            yield number, wire, value
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise _Bad("a fixed-size field runs past its message")
            yield number, wire, int.from_bytes(data[pos:pos + size], "little")
            pos += size
        elif wire == 2:
            length, pos = _varint(data, pos, end)
            if length > end - pos:
                raise _Bad(f"a field declares {length} bytes but its message has {end - pos} left")
            yield number, wire, (pos, pos + length)
            pos += length
        else:
            raise _Bad(f"wire type {wire} (groups or an unknown type) in field {number}")


def _text(data: memoryview, span: tuple[int, int]) -> str:
    try:
        return bytes(data[span[0]:span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("a string that is not UTF-8") from None


class _Walker:
    def __init__(self, data: memoryview, folder: Path | None, allow_external: bool, tensor_limit: int,
                 total_limit: int) -> None:
        self.data = data
        self.folder = folder
        self.allow_external = allow_external
        self.tensor_limit = tensor_limit
        self.total_limit = total_limit
        self.report = WireReport()

    def model(self) -> None:
        data = self.data
        graphs = 0
        for number, wire, value in _fields(data, 0, len(data)):
            if wire != 2:
                continue
            if number == _F["ModelProto", "graph"]:
                graphs += 1
                self.graph(value, 1)
            elif number == _F["ModelProto", "opset_import"]:
                self.opset(value)
            elif number == _F["ModelProto", "functions"]:
                self.function(value)
        if not graphs:
            raise _Bad("no graph in the model")

    def opset(self, span: tuple[int, int]) -> None:
        domain = ""
        for number, wire, value in _fields(self.data, *span):
            if number == _F["OperatorSetIdProto", "domain"] and wire == 2:
                domain = _text(self.data, value)
        self.domain(domain, "opset_import")

    def domain(self, domain: str, where: str) -> None:
        if domain not in STANDARD_DOMAINS:
            self.report.domains.add(domain)

    def function(self, span: tuple[int, int]) -> None:
        for number, wire, value in _fields(self.data, *span):
            if wire != 2:
                continue
            if number == _F["FunctionProto", "node"]:
                self.node(value, 1)
            elif number == _F["FunctionProto", "opset_import"]:
                self.opset(value)
            elif number == _F["FunctionProto", "domain"]:
                self.domain(_text(self.data, value), "function")

    def graph(self, span: tuple[int, int], depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ModelLoadError(f"graphs nest more than {MAX_DEPTH} deep (control-flow bodies inside bodies): "
                                 f"refused before parsing. Fix: give a model with a flatter graph.")
        self.report.depth = max(self.report.depth, depth)
        for number, wire, value in _fields(self.data, *span):
            if wire != 2:
                continue
            if number == _F["GraphProto", "node"]:
                self.node(value, depth)
            elif number == _F["GraphProto", "initializer"]:
                self.tensor(value)
            elif number == _F["GraphProto", "sparse_initializer"]:
                self.sparse(value)

    def node(self, span: tuple[int, int], depth: int) -> None:
        for number, wire, value in _fields(self.data, *span):
            if wire != 2:
                continue
            if number == _F["NodeProto", "domain"]:
                self.domain(_text(self.data, value), "node")
            elif number == _F["NodeProto", "attribute"]:
                self.attribute(value, depth)

    def attribute(self, span: tuple[int, int], depth: int) -> None:
        for number, wire, value in _fields(self.data, *span):
            if wire != 2:
                continue
            if number in (_F["AttributeProto", "t"], _F["AttributeProto", "tensors"]):
                self.tensor(value)
            elif number in (_F["AttributeProto", "g"], _F["AttributeProto", "graphs"]):
                self.graph(value, depth + 1)
            elif number in (_F["AttributeProto", "sparse_tensor"], _F["AttributeProto", "sparse_tensors"]):
                self.sparse(value)

    def sparse(self, span: tuple[int, int]) -> None:
        for number, wire, value in _fields(self.data, *span):
            if wire == 2 and number in (_F["SparseTensorProto", "values"], _F["SparseTensorProto", "indices"]):
                self.tensor(value)

    def tensor(self, span: tuple[int, int]) -> None:
        data = self.data
        dims: list[int] = []
        dtype = 0
        name = ""
        raw: tuple[int, int] | None = None
        location = 0
        entries: dict[str, str] = {}
        for number, wire, value in _fields(data, *span):
            if number == _F["TensorProto", "dims"]:
                if wire == 0:
                    dims.append(value)
                elif wire == 2:  # packed
                    pos, end = value
                    while pos < end:
                        dim, pos = _varint(data, pos, end)
                        dims.append(dim)
            elif number == _F["TensorProto", "data_type"] and wire == 0:
                dtype = value
            elif number == _F["TensorProto", "name"] and wire == 2:
                name = _text(data, value)
            elif number == _F["TensorProto", "raw_data"] and wire == 2:
                raw = value
            elif number == _F["TensorProto", "data_location"] and wire == 0:
                location = value
            elif number == _F["TensorProto", "external_data"] and wire == 2:
                key = val = ""
                for n, w, v in _fields(data, *value):
                    if w == 2 and n == _F["StringStringEntryProto", "key"]:
                        key = _text(data, v)
                    elif w == 2 and n == _F["StringStringEntryProto", "value"]:
                        val = _text(data, v)
                entries[key] = val
        label = f"tensor {name!r}" if name else "an unnamed tensor"
        if any(dim >= 1 << 63 for dim in dims):  # int64 dims read as unsigned varints: negative
            raise ModelLoadError(f"{label} declares a negative dimension: not a valid ONNX tensor.")
        bits = _BITS.get(dtype, 0)
        count = math.prod(dims)
        declared = (count * bits + 7) // 8
        self.report.tensors += 1
        if declared > self.tensor_limit:
            raise ModelLoadError(
                f"{label} declares dims {dims} ({format_bytes(declared)}), above the limit of "
                f"{format_bytes(self.tensor_limit)} per tensor: refused before reading it. Fix: give a model whose "
                f"tensors are each at most {format_bytes(self.tensor_limit)}.")
        self.report.declared_bytes += declared
        if self.report.declared_bytes > self.total_limit:
            raise ModelLoadError(
                f"the model's tensors declare more than {format_bytes(self.total_limit)} together "
                f"(reached at {label}), "
                f"the most read from one file on this machine: refused before reading them. Fix: give a smaller model.")
        if raw is not None and bits and raw[1] - raw[0] != declared:
            raise ModelLoadError(
                f"{label} declares dims {dims} ({declared} bytes) but its raw_data holds {raw[1] - raw[0]} bytes: "
                f"not a valid ONNX tensor (a corrupt or crafted file). Fix: re-export the model.")
        if location == _EXTERNAL or entries:
            self.external(label, name, entries, declared if bits else None)

    def external(self, label: str, name: str, entries: dict[str, str], declared: int | None) -> None:
        location = entries.get("location", "")
        if not self.allow_external:
            raise ModelLoadError(
                f"{label} keeps its data in another file ({location!r}): external data is refused by default, as its "
                f"path can point outside the model's folder. {_FIX_EXTERNAL}.")
        if self.folder is None:
            raise ModelLoadError(f"{label} keeps its data in another file ({location!r}) but the model was given as "
                                 f"bytes, with no folder to read it from. {_FIX_EXTERNAL}.")
        where = f"{label}: its external data location {location!r}"
        if not location or os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location \
                or ".." in Path(location.replace("\\", "/")).parts:
            raise ModelLoadError(f"{where} is not a plain path inside the model's folder (absolute, a drive or `..`): "
                                 f"refused. {_FIX_EXTERNAL}.")
        folder = self.folder.resolve()
        path = (folder / location).resolve()
        if not path.is_relative_to(folder):
            raise ModelLoadError(f"{where} resolves to {path}, outside the model's folder {folder} (a symlink "
                                 f"escaping it): refused. {_FIX_EXTERNAL}.")
        if not path.is_file():
            raise ModelLoadError(f"{where}: no such regular file in the model's folder. {_FIX_EXTERNAL}.")
        try:
            offset = int(entries.get("offset", "0") or 0)
            size = path.stat().st_size
            length = int(entries["length"]) if entries.get("length") else (declared if declared is not None
                                                                           else size - offset)
        except ValueError:
            raise ModelLoadError(f"{where}: offset/length are not integers. {_FIX_EXTERNAL}.") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise ModelLoadError(f"{where}: offset {offset} + length {length} runs past the file's {size} bytes. "
                                 f"{_FIX_EXTERNAL}.")
        if declared is not None and length != declared:
            raise ModelLoadError(f"{where}: length {length} is not the {declared} bytes its dims declare. "
                                 f"{_FIX_EXTERNAL}.")
        self.report.external.append(ExternalTensor(name, path, offset, length))


def check_onnx_bytes(data: bytes, *, where: str = "the ONNX model", name: str = "the file",
                     folder: Path | None = None, allow_external: bool = False, allow_custom_domains: bool = False,
                     tensor_limit: int = TENSOR_LIMIT, total_limit: int | None = None) -> WireReport:
    """Walk ``data`` (a serialized ModelProto) and refuse what the module docstring lists; what it found.

    ``folder`` is the model file's folder (external data is resolved in it). Raises :class:`ModelLoadError`,
    its message starting with ``where``."""
    walker = _Walker(memoryview(data), folder, allow_external, tensor_limit,
                     data_budget() if total_limit is None else total_limit)
    try:
        walker.model()
    except _Bad as exc:
        raise ModelLoadError(f"{where}: {name} is not a valid ONNX model file: its protobuf bytes are malformed "
                             f"({exc}). "
                             f"Fix: give the .onnx file as torch.onnx.export or onnx.save_model wrote it.") from None
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    report = walker.report
    if report.domains and not allow_custom_domains:
        shown = ", ".join(sorted(map(repr, report.domains)))
        raise ModelLoadError(f"{where}: the model uses custom-operator domains ({shown}); onnxruntime can load "
                             f"libraries for custom operators, so they are refused by default. {_FIX_DOMAIN}.")
    return report
