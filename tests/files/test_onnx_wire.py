"""The ONNX file check (:mod:`pytest_dnnsafety.files.onnx_wire`) on hostile files built by hand (issue #32, item 1).

The walker reads the protobuf bytes themselves: its field numbers are checked against the onnx package's
descriptors; external data outside the model's folder, custom-operator domains, a 10 GB declared tensor in a tiny
file, a raw_data of the wrong length, deep nesting and truncated or garbage bytes are refused quickly, by name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="needs the [onnx] extra")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from pytest_dnnsafety.errors import ModelLoadError  # noqa: E402
from pytest_dnnsafety.files.onnx_wire import FIELDS, check_onnx_bytes  # noqa: E402


def test_field_numbers_are_onnx_protos() -> None:
    for (message, name), number in FIELDS.items():
        descriptor = getattr(onnx, message).DESCRIPTOR
        assert descriptor.fields_by_name[name].number == number, (message, name)
    assert TensorProto.EXTERNAL == 1


def _model(initializers=(), nodes=None, opsets=(("", 17),), inputs=None) -> bytes:
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])]
    nodes = nodes if nodes is not None else [helper.make_node("Relu", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    return model.SerializeToString()


def _external(name: str, location: str, length: int = 16) -> TensorProto:
    tensor = helper.make_tensor(name, TensorProto.FLOAT, [4], [0.0] * 4)
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _refused(data: bytes, *words: str, folder: Path | None = None, seconds: float = 0.5, **allow) -> str:
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        check_onnx_bytes(data, folder=folder, **allow)
    assert time.perf_counter() - start < seconds
    message = str(info.value)
    for word in words:
        assert word in message, message
    return message


def test_a_plain_model_passes() -> None:
    weight = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    report = check_onnx_bytes(_model([weight]))
    assert report.tensors == 1 and report.declared_bytes == 24 and not report.external


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../outside.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    (tmp_path / "outside.bin").write_bytes(b"\0" * 16)
    folder = tmp_path / "model"
    folder.mkdir()
    data = _model([_external("w", location)])
    _refused(data, "'w'", "external data is refused", "dnnsafety_onnx_external_data", folder=folder)
    _refused(data, "not a plain path inside the model's folder", folder=folder, allow_external=True)


def test_external_data_by_a_symlink_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside.bin").write_bytes(b"\0" * 16)
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(tmp_path / "outside.bin", folder / "w.bin")
    _refused(_model([_external("w", "w.bin")]), "outside the model's folder", folder=folder, allow_external=True)


def test_external_data_inside_the_folder_is_checked_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    report = check_onnx_bytes(_model([_external("w", "w.bin")]), folder=tmp_path, allow_external=True)
    assert [(t.name, t.path.name, t.offset, t.length) for t in report.external] == [("w", "w.bin", 0, 16)]
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    _refused(_model([_external("w", "w.bin")]), "runs past the file's 8 bytes", folder=tmp_path, allow_external=True)
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    _refused(_model([_external("w", "w.bin", 32)]), "not the 16 bytes", folder=tmp_path, allow_external=True)


def test_external_data_in_a_tensor_attribute_of_a_subgraph_is_found(tmp_path: Path) -> None:
    constant = helper.make_node("Constant", [], ["c"], value=_external("k", "../k.bin"))
    body = helper.make_graph([constant], "body", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=body)
    _refused(_model(nodes=[node], inputs=[cond]), "'k'", "external data", folder=tmp_path)


@pytest.mark.parametrize("where", ["opset", "node"])
def test_a_custom_operator_domain_is_refused(where: str) -> None:
    if where == "opset":
        data = _model(opsets=(("", 17), ("com.evil", 1)))
    else:
        data = _model(nodes=[helper.make_node("Evil", ["x"], ["y"], domain="com.evil")])
    _refused(data, "'com.evil'", "custom-operator domains", "dnnsafety_onnx_custom_domains")
    assert check_onnx_bytes(data, allow_custom_domains=True).domains == {"com.evil"}
    check_onnx_bytes(_model(opsets=(("", 17), ("ai.onnx.ml", 3))))


def test_a_10_gb_declared_tensor_is_refused_in_milliseconds() -> None:
    huge = TensorProto(name="huge", data_type=TensorProto.FLOAT, dims=[50000, 50000])
    data = _model([huge])
    assert len(data) < 200
    _refused(data, "'huge'", "[50000, 50000]", "9.3 GiB", "limit", seconds=0.5)


def test_the_total_of_the_declared_sizes_is_limited() -> None:
    tensors = [TensorProto(name=f"t{i}", data_type=TensorProto.FLOAT, dims=[1000, 1000]) for i in range(3)]
    _refused(_model(tensors), "together", "'t2'", total_limit=10 << 20)


def test_raw_data_of_the_wrong_length_is_refused() -> None:
    tensor = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    tensor.raw_data = tensor.raw_data[:-4]
    _refused(_model([tensor]), "'w'", "24 bytes", "raw_data holds 20 bytes")


def test_a_negative_dimension_is_refused() -> None:
    _refused(_model([TensorProto(name="neg", data_type=TensorProto.FLOAT, dims=[-1, 4])]), "negative dimension")


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2), lengths < 2**14 here."""
    def varint(value: int) -> bytes:
        out = b""
        while value > 0x7F:
            out += bytes([value & 0x7F | 0x80])
            value >>= 7
        return out + bytes([value])
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def test_deep_nesting_is_refused() -> None:
    """If-bodies inside If-bodies, 40 graphs deep, written as wire bytes (onnx's own parser stops at 100 levels)."""
    graph = b""
    for _ in range(40):
        attribute = _field(FIELDS["AttributeProto", "g"], graph)
        graph = _field(FIELDS["GraphProto", "node"], _field(FIELDS["NodeProto", "attribute"], attribute))
    _refused(_field(FIELDS["ModelProto", "graph"], graph), "nest more than 32 deep")
    check_onnx_bytes(_field(FIELDS["ModelProto", "graph"], graph[:0] or b""))


@pytest.mark.parametrize("cut", [1, 7, 0.5, -3])
def test_truncated_or_garbage_bytes_give_a_clear_error(cut: float) -> None:
    weight = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    data = _model([weight])
    data = data[:int(len(data) * cut)] if isinstance(cut, float) else data[:cut] if cut > 0 else data[:cut]
    with pytest.raises(ModelLoadError, match="not a valid ONNX model file|raw_data holds|no graph"):
        check_onnx_bytes(data)


def test_random_garbage_never_crashes() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        data = rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        try:
            check_onnx_bytes(data)
        except ModelLoadError:
            pass
