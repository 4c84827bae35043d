"""Hostile and damaged files, failing factories and shuffling loaders, through the plugin's loaders.

Three promises are checked here (issue #7, "every verdict trustworthy"):

* **No format unpickles anything unless ``dnnsafety_allow_pickle`` is on.** A pickle whose
  ``__reduce__`` writes a marker file is planted in every model and data format; loading it with
  the default settings must fail with a clear message and the marker must never appear.
* **A damaged file is called damaged**, naming the kind expected and what was found, and never
  suggests ``dnnsafety_allow_pickle`` — unpickling a corrupt file fixes nothing.
* **Every other failure names its cause**: a factory that raises, a directory given as a file,
  an unknown suffix, a DataLoader that shuffles.

Messages are checked on their first line: that is what a user sees in a short test summary.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from _hostile import WithConstant, WritesMarker, make_settings, rewrite_zip, save_export, torch_save_bytes
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.errors import ConfigError, DataError, ModelLoadError
from pytest_dnnsafety.files.archives import weights_only_forced as _weights_only_forced
from pytest_dnnsafety.files.loading import load_dataset, load_model, load_operational_data
from pytest_dnnsafety.data.forms import as_tensors, iter_batches
from pytest_dnnsafety.plugin.fixtures import load_operational_profile, load_scenario_table

CPU = torch.device("cpu")
X = np.arange(12, dtype=np.float32).reshape(3, 4)
Y = np.array([0, 1, 2])

#: A user module next to the ini file: factories that work and factories that raise.
HOSTILE_MOD = """\
import torch
from torch import nn


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def exploding_model():
    raise RuntimeError("out of memory while building")


def exploding_data():
    raise ValueError("bucket not mounted")


def exploding_profile():
    raise KeyError("latent")


def exploding_table():
    raise OSError("share offline")
"""


# ------------------------------------------------------------------------------------------ helpers


def tiny_model() -> nn.Module:
    """The architecture of ``hostile_mod:build``, with fixed weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def member_data_offset(path: Path, suffix: str) -> tuple[int, int]:
    """Where the stored bytes of the first member ending in ``suffix`` start, and their length."""
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    local = info.header_offset
    name_len = int.from_bytes(raw[local + 26:local + 28], "little")
    extra_len = int.from_bytes(raw[local + 28:local + 30], "little")
    return local + 30 + name_len + extra_len, info.compress_size


def flip_byte_in_member(path: Path, suffix: str) -> None:
    """Flip one byte in the middle of a member's data: the archive stays readable, its CRC fails."""
    start, size = member_data_offset(path, suffix)
    raw = bytearray(path.read_bytes())
    raw[start + size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def random_bytes(count: int = 2048) -> bytes:
    return np.random.default_rng(0).integers(0, 256, count, dtype=np.uint8).tobytes()


def save_torchscript(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(tiny_model()), str(path))


@pytest.fixture(autouse=True)
def _isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    """import_factory appends the ini folder to sys.path; the user module must not leak between tests."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("hostile_mod", None)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A project folder with ``hostile_mod.py`` next to its ini file."""
    (tmp_path / "hostile_mod.py").write_text(HOSTILE_MOD)
    return tmp_path


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0]


# ---------------------------------------------------------------------------- planted pickles


def planted_pt_model(root: Path, marker: Path) -> str:
    torch.save(WritesMarker(marker), root / "model.pt")
    return "model.pt"


def planted_pt_state_dict(root: Path, marker: Path) -> str:
    torch.save({**tiny_model().state_dict(), "optimizer": WritesMarker(marker)}, root / "model.pt")
    return "model.pt"


def planted_pt_legacy_format(root: Path, marker: Path) -> str:
    (root / "model.pt").write_bytes(torch_save_bytes(WritesMarker(marker), legacy=True))
    return "model.pt"


def planted_plain_pickle_as_pt(root: Path, marker: Path) -> str:
    (root / "model.pth").write_bytes(pickle.dumps(WritesMarker(marker), protocol=4))
    return "model.pth"


def planted_pt2_sample_inputs(root: Path, marker: Path) -> str:
    save_export(root / "good.pt2")
    evil = torch_save_bytes(WritesMarker(marker))
    rewrite_zip(root / "good.pt2", root / "model.pt2",
                replace=lambda name, data: evil if "/sample_inputs/" in name else data)
    return "model.pt2"


def planted_pt2_pickled_weight(root: Path, marker: Path) -> str:
    """A weight that the archive's config says is pickled: torch.load(weights_only=False) reads it."""
    save_export(root / "good.pt2")
    evil = torch_save_bytes(WritesMarker(marker))

    def replace(name: str, data: bytes) -> bytes:
        if name.endswith("_weights_config.json"):
            config = json.loads(data)
            next(iter(config["config"].values()))["use_pickle"] = True
            return json.dumps(config).encode()
        return evil if name.endswith("/data/weights/weight_0") else data

    rewrite_zip(root / "good.pt2", root / "model.pt2", replace=replace)
    return "model.pt2"


def planted_pt2_opaque_constant(root: Path, marker: Path) -> str:
    """An opaque object constant: torch reads it with plain pickle.loads."""
    save_export(root / "good.pt2")

    def replace(name: str, data: bytes) -> bytes:
        if name.endswith("_constants_config.json"):
            config = json.loads(data)
            config["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                                        "tensor_meta": None}
            return json.dumps(config).encode()
        return data

    rewrite_zip(root / "good.pt2", root / "model.pt2", replace=replace,
                add={"data/constants/opaque_obj_0": pickle.dumps(WritesMarker(marker))})
    return "model.pt2"


def planted_pt2_aotinductor(root: Path, marker: Path) -> str:
    """An AOTInductor member: torch.export.load would load it as a native shared library."""
    save_export(root / "good.pt2")
    rewrite_zip(root / "good.pt2", root / "model.pt2",
                add={"data/aotinductor/model/model.so": b"\x7fELF" + random_bytes(64)})
    return "model.pt2"


def planted_pt2_stack_global_pickle(root: Path, marker: Path) -> str:
    """A protocol-4 pickle (STACK_GLOBAL, memoised strings) planted as the sample inputs."""
    save_export(root / "good.pt2")
    evil = pickle.dumps(WritesMarker(marker), protocol=4)
    rewrite_zip(root / "good.pt2", root / "model.pt2",
                replace=lambda name, data: evil if "/sample_inputs/" in name else data)
    return "model.pt2"


def planted_torchscript(member: str) -> Callable[[Path, Path], str]:
    def build(root: Path, marker: Path) -> str:
        save_torchscript(root / "good.pt")
        evil = pickle.dumps(WritesMarker(marker), protocol=2)
        rewrite_zip(root / "good.pt", root / "model.pt",
                    replace=lambda name, data: evil if name.endswith("/" + member) else data)
        return "model.pt"
    return build


def planted_npy(root: Path, marker: Path) -> str:
    np.save(root / "eval.npy", np.array([WritesMarker(marker), None], dtype=object), allow_pickle=True)
    return "eval.npy"


def planted_npz(root: Path, marker: Path) -> str:
    np.savez(root / "eval.npz", x=X, y=np.array([WritesMarker(marker)] * 3, dtype=object))
    return "eval.npz"


def planted_raw_pickle_as_npy(root: Path, marker: Path) -> str:
    (root / "eval.npy").write_bytes(pickle.dumps(WritesMarker(marker)))
    return "eval.npy"


def planted_pt_data(root: Path, marker: Path) -> str:
    torch.save({"x": torch.from_numpy(X), "y": WritesMarker(marker)}, root / "eval.pt")
    return "eval.pt"


def planted_pt_data_legacy(root: Path, marker: Path) -> str:
    (root / "eval.pt").write_bytes(torch_save_bytes({"x": WritesMarker(marker)}, legacy=True))
    return "eval.pt"


@dataclass(frozen=True)
class Planted:
    """A file holding a planted pickle and what the error's first line must say."""

    build: Callable[[Path, Path], str]
    setting: str  # "model" or "data"
    fragments: tuple[str, ...]


REFUSED_MODEL = "refused to unpickle model."
PLANTED = {
    "pt_model_planted_pickle": Planted(planted_pt_model, "model", (REFUSED_MODEL, "builtins.exec", "allow_pickle")),
    "pt_state_dict_with_planted_pickle": Planted(planted_pt_state_dict, "model", (REFUSED_MODEL, "builtins.exec")),
    "pt_legacy_format_planted_pickle": Planted(planted_pt_legacy_format, "model", (REFUSED_MODEL, "builtins.exec")),
    "pth_plain_pickle_not_torch_save": Planted(planted_plain_pickle_as_pt, "model", (REFUSED_MODEL, "builtins.exec")),
    "pt2_planted_pickle": Planted(planted_pt2_sample_inputs, "model",
                                  ("refused to unpickle model.pt2", "builtins.exec", "sample_inputs")),
    "pt2_planted_pickled_weight": Planted(planted_pt2_pickled_weight, "model",
                                          ("refused to unpickle model.pt2", "builtins.exec", "weight_0")),
    "pt2_planted_opaque_object_constant": Planted(planted_pt2_opaque_constant, "model",
                                                  ("refused to unpickle model.pt2", "opaque_obj_0")),
    "pt2_aotinductor_native_code": Planted(planted_pt2_aotinductor, "model",
                                           ("refused to load model.pt2", "AOTInductor compiled code", "native code")),
    "pt2_planted_protocol4_stack_global": Planted(planted_pt2_stack_global_pickle, "model",
                                                  ("refused to unpickle model.pt2", "builtins.exec")),
    "torchscript_planted_pickle_in_data_pkl": Planted(planted_torchscript("data.pkl"), "model",
                                                      ("model.pt is not a valid TorchScript archive",
                                                       "Unknown type name '__builtin__.exec'")),
    "torchscript_planted_pickle_in_constants_pkl": Planted(planted_torchscript("constants.pkl"), "model",
                                                           ("model.pt is not a valid TorchScript archive",
                                                            "Unknown type name '__builtin__.exec'")),
    "npy_planted_pickle": Planted(planted_npy, "data", ("eval.npy holds pickled objects, which are refused",
                                                        "object array")),
    "npz_planted_pickle": Planted(planted_npz, "data", ("eval.npz holds pickled objects, which are refused",
                                                        "y.npy")),
    "npy_that_is_a_raw_pickle": Planted(planted_raw_pickle_as_npy, "data",
                                        ("eval.npy is not a valid NumPy .npy file: found a Python pickle",)),
    "pt_data_planted_pickle": Planted(planted_pt_data, "data",
                                      ("eval.pt holds Python objects, not only tensors; refused (weights_only=True)",
                                       "builtins.exec")),
    "pt_data_legacy_format_planted_pickle": Planted(planted_pt_data_legacy, "data",
                                                    ("eval.pt holds Python objects", "builtins.exec")),
}


def load_through_plugin(root: Path, setting: str, name: str, **more: Any) -> Any:
    if setting == "model":
        return load_model(make_settings(root, model=name, model_factory="hostile_mod:build", **more), CPU)
    return load_dataset(make_settings(root, data=name, **more))


@pytest.mark.parametrize("case", list(PLANTED.values()), ids=list(PLANTED))
def test_planted_pickle_never_runs(root: Path, case: Planted) -> None:
    marker = root / "PWNED"
    name = case.build(root, marker)
    assert not marker.exists()
    with pytest.raises(ModelLoadError if case.setting == "model" else DataError) as info:
        load_through_plugin(root, case.setting, name)
    assert not marker.exists(), "the planted pickle ran"
    line = first_line(info.value)
    assert line.startswith("dnnsafety_model=" if case.setting == "model" else "evaluation data (dnnsafety_data=")
    for fragment in case.fragments:
        assert fragment in line
    assert "Fix:" in line


def _short_unicode(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def crafted_memo_stack_global(marker: Path) -> bytes:
    """builtins.exec reached through memoised strings (BINGET, BINGET, STACK_GLOBAL), then called."""
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    return (b"\x80\x04" + _short_unicode("builtins") + b"\x94" + _short_unicode("exec") + b"\x94"
            + b"h\x00h\x01\x93" + b"X" + len(code).to_bytes(4, "little") + code.encode() + b"\x85R.")


def crafted_python2_global(marker: Path) -> bytes:
    """A protocol-2 GLOBAL spelled the Python 2 way (``__builtin__ exec``), which the unpickler maps."""
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    return b"\x80\x02c__builtin__\nexec\nX" + len(code).to_bytes(4, "little") + code.encode() + b"\x85R."


CRAFTED = {
    "pickle_stack_global_via_memo": (crafted_memo_stack_global, "builtins.exec"),
    "pickle_python2_global_name": (crafted_python2_global, "builtins.exec"),
    "pickle_inst_opcode": (lambda marker: b"(ios\nsystem\nS'true'\n.", "os.system"),
    "pickle_copyreg_extension_code": (lambda marker: b"\x80\x02\x82\x07)R.", "copyreg extension code 7"),
    "pickle_stack_global_of_non_strings": (lambda marker: b"\x80\x04}}\x93.",
                                           "a STACK_GLOBAL whose module and name are not plain strings"),
}


@pytest.mark.parametrize(("craft", "named"), list(CRAFTED.values()), ids=list(CRAFTED))
def test_crafted_pickle_opcodes_are_refused_by_the_static_scan(root: Path, craft: Callable[[Path], bytes],
                                                              named: str) -> None:
    marker = root / "PWNED"
    (root / "model.pt").write_bytes(craft(marker))
    with pytest.raises(ModelLoadError) as info:
        load_through_plugin(root, "model", "model.pt")
    assert not marker.exists()
    line = first_line(info.value)
    assert "refused to unpickle model.pt: it holds Python objects, not only tensors" in line
    assert named in line


@pytest.mark.parametrize("craft", [crafted_memo_stack_global, crafted_python2_global],
                         ids=["memo_stack_global", "python2_global"])
def test_crafted_payloads_really_run_when_unpickled(tmp_path: Path, craft: Callable[[Path], bytes]) -> None:
    """The control for the crafted pickles above: a plain unpickler runs them."""
    marker = tmp_path / "PWNED"
    pickle.loads(craft(marker))
    assert marker.read_text() == "pwned"


def test_planted_payload_really_runs_when_unpickled(tmp_path: Path) -> None:
    """The control: the payload used above does write its marker under a plain unpickler."""
    marker = tmp_path / "PWNED"
    pickle.loads(pickle.dumps(WritesMarker(marker)))
    assert marker.read_text() == "pwned"


def test_allow_pickle_is_the_only_way_a_model_pickle_runs(root: Path) -> None:
    """With the opt-in the user trusts the file: the payload runs (and is then no model)."""
    marker = root / "PWNED"
    planted_pt_model(root, marker)
    with pytest.raises(ModelLoadError, match="holds a NoneType, not a model or state dict"):
        load_through_plugin(root, "model", "model.pt", allow_pickle="true")
    assert marker.exists()


def test_allow_pickle_does_not_open_data_files(root: Path) -> None:
    marker = root / "PWNED"
    planted_pt_data(root, marker)
    with pytest.raises(DataError, match="holds Python objects"):
        load_through_plugin(root, "data", "eval.pt", allow_pickle="true")
    assert not marker.exists()


def test_weights_only_guard_overrides_an_explicit_weights_only_false(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """The guard torch.export.load runs under: even torch.load(weights_only=False) stays safe."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    marker = tmp_path / "PWNED"
    payload = torch_save_bytes(WritesMarker(marker))
    with _weights_only_forced(), pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(payload), weights_only=False)
    assert not marker.exists()
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


# ---------------------------------------------------------------------------- genuine files load


def test_genuine_export_with_parameters_buffers_and_constants_loads(root: Path) -> None:
    reference = WithConstant().eval()
    save_export(root / "model.pt2", reference)
    model = load_model(make_settings(root, model="model.pt2"), CPU)
    x = torch.linspace(-1, 1, 8).reshape(2, 2, 2)
    torch.testing.assert_close(model(x), reference(x))


def test_genuine_legacy_format_state_dict_loads(root: Path) -> None:
    (root / "w.pt").write_bytes(torch_save_bytes(tiny_model().state_dict(), legacy=True))
    model = load_model(make_settings(root, model="w.pt", model_factory="hostile_mod:build"), CPU)
    torch.testing.assert_close(model[1].weight, tiny_model()[1].weight)


def test_genuine_compressed_npz_loads(root: Path) -> None:
    np.savez_compressed(root / "eval.npz", x=X, y=Y)
    x, y = load_dataset(make_settings(root, data="eval.npz")).tensors
    assert x.tolist() == X.tolist() and y.tolist() == Y.tolist()


# ---------------------------------------------------------------------------- damaged files


def write_npz(root: Path) -> Path:
    np.savez(root / "eval.npz", x=X, y=Y)
    return root / "eval.npz"


def write_pt_data(root: Path) -> Path:
    torch.save({"x": torch.from_numpy(X), "y": torch.from_numpy(Y)}, root / "eval.pt")
    return root / "eval.pt"


def write_state_dict(root: Path) -> Path:
    torch.save(tiny_model().state_dict(), root / "model.pt")
    return root / "model.pt"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@dataclass(frozen=True)
class Damaged:
    """A damaged file, the setting it is given to, and what the first line of the error must say."""

    build: Callable[[Path], str]
    setting: str
    fragments: tuple[str, ...]


def _then(write: Callable[[Path], Path], damage: Callable[[Path], None]) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        path = write(root)
        damage(path)
        return path.name
    return build


def _raw(name: str, content: bytes) -> Callable[[Path], str]:
    def build(root: Path) -> str:
        (root / name).write_bytes(content)
        return name
    return build


def _pt2_from_zip(root: Path) -> str:
    with zipfile.ZipFile(root / "model.pt2", "w") as archive:
        archive.writestr("model/weights.bin", random_bytes(64))
        archive.writestr("model/readme.txt", "hello")
    return "model.pt2"


def _broken_torchscript(root: Path) -> str:
    save_torchscript(root / "good.pt")
    rewrite_zip(root / "good.pt", root / "model.pt",
                replace=lambda name, data: b"def forward(self, x):\n    return ??? garbage\n"
                if name.endswith(".py") else data)
    return "model.pt"


def _npz_renamed_pt(root: Path) -> str:
    np.savez(root / "model.npz", x=X)
    (root / "model.npz").rename(root / "model.pt")
    return "model.pt"


def _torchscript_as_data(root: Path) -> str:
    save_torchscript(root / "eval.pt")
    return "eval.pt"


def _export_with_damaged_weight(root: Path) -> str:
    save_export(root / "model.pt2")
    flip_byte_in_member(root / "model.pt2", "/data/weights/weight_0")
    return "model.pt2"


NOT_VALID_NPZ = "eval.npz is not a valid NumPy .npz file: found "
NOT_VALID_MODEL = "model.pt is not a valid model file: found "
DAMAGED = {
    "npz_random_bytes": Damaged(_raw("eval.npz", random_bytes()), "data",
                                (NOT_VALID_NPZ + "2048 bytes of unrecognised data",)),
    "npz_empty_file": Damaged(_raw("eval.npz", b""), "data", (NOT_VALID_NPZ + "an empty file (0 bytes)",)),
    "npz_truncated": Damaged(_then(write_npz, truncate), "data", (NOT_VALID_NPZ + "a truncated or damaged zip",)),
    "npz_crc_corrupted": Damaged(_then(write_npz, lambda p: flip_byte_in_member(p, "x.npy")), "data",
                                 (NOT_VALID_NPZ + "a damaged zip archive (member 'x.npy'", "CRC")),
    "npz_that_is_a_torch_save_file": Damaged(lambda root: write_pt_data(root).rename(root / "eval.npz").name,
                                             "data", (NOT_VALID_NPZ + "a torch.save archive",)),
    "npy_random_bytes": Damaged(_raw("eval.npy", random_bytes()), "data",
                                ("eval.npy is not a valid NumPy .npy file: found 2048 bytes of unrecognised",)),
    "npy_truncated_in_header": Damaged(
        _then(lambda root: (np.save(root / "eval.npy", X), root / "eval.npy")[1], truncate), "data",
        ("eval.npy is not a valid NumPy .npy file: found a damaged .npy header", "EOF")),
    "npy_truncated_in_data": Damaged(
        _then(lambda root: (np.save(root / "eval.npy", np.zeros((64, 4))), root / "eval.npy")[1], truncate), "data",
        ("eval.npy is not a valid NumPy .npy file: found a truncated or damaged .npy array",)),
    "pt_data_random_bytes": Damaged(_raw("eval.pt", random_bytes()), "data",
                                    ("eval.pt is not a valid PyTorch .pt file: found 2048 bytes of unrecognised",)),
    "pt_data_empty_file": Damaged(_raw("eval.pt", b""), "data", ("eval.pt is not a valid PyTorch .pt file: found an "
                                                                 "empty file",)),
    "pt_data_crc_corrupted_tensor_bytes": Damaged(
        _then(write_pt_data, lambda p: flip_byte_in_member(p, "data/0")), "data",
        ("eval.pt is not a valid PyTorch .pt file: found a damaged zip archive", "CRC")),
    "pt_data_that_is_a_torchscript_model": Damaged(_torchscript_as_data, "data",
                                                   ("eval.pt is not a valid PyTorch .pt file: found a TorchScript",)),
    "model_random_bytes": Damaged(_raw("model.pt", random_bytes()), "model",
                                  (NOT_VALID_MODEL + "2048 bytes of unrecognised data",)),
    "model_empty_file": Damaged(_raw("model.pt", b""), "model", (NOT_VALID_MODEL + "an empty file (0 bytes)",)),
    "model_truncated_state_dict": Damaged(_then(write_state_dict, truncate), "model",
                                          (NOT_VALID_MODEL + "a truncated or damaged zip",)),
    "model_crc_corrupted_pickle": Damaged(_then(write_state_dict, lambda p: flip_byte_in_member(p, "data.pkl")),
                                          "model", (NOT_VALID_MODEL + "a damaged zip archive", "CRC")),
    "model_crc_corrupted_weight": Damaged(_then(write_state_dict, lambda p: flip_byte_in_member(p, "data/0")),
                                          "model", (NOT_VALID_MODEL + "a damaged zip archive", "CRC")),
    "model_npz_renamed_to_pt": Damaged(_npz_renamed_pt, "model", (NOT_VALID_MODEL + "a NumPy .npz archive",)),
    "model_unknown_suffix_onnx": Damaged(_raw("model.onnx", random_bytes()), "model",
                                         ("model.onnx is not a valid ONNX model file", "protobuf bytes are malformed")),
    "pt2_random_bytes": Damaged(_raw("model.pt2", random_bytes()), "model",
                                ("model.pt2 is not a valid torch.export program (.pt2) file: found 2048 bytes",)),
    "pt2_zip_that_is_not_an_export_archive": Damaged(_pt2_from_zip, "model",
                                                     ("model.pt2 is not a valid torch.export program (.pt2) file: "
                                                      "found a zip archive with members",)),
    "pt2_truncated": Damaged(_then(lambda root: (save_export(root / "model.pt2"), root / "model.pt2")[1], truncate),
                             "model", ("model.pt2 is not a valid torch.export program (.pt2) file: found a trunc",)),
    "pt2_crc_corrupted_weight": Damaged(_export_with_damaged_weight, "model",
                                        ("model.pt2 is not a valid torch.export program (.pt2) file: found a "
                                         "damaged zip archive", "weight_0")),
    "torchscript_broken_code": Damaged(_broken_torchscript, "model", ("model.pt is not a valid TorchScript archive:",
                                                                      "torch.jit.load failed")),
}


@pytest.mark.parametrize("case", list(DAMAGED.values()), ids=list(DAMAGED))
def test_damaged_file_is_called_damaged_not_pickled(root: Path, case: Damaged) -> None:
    name = case.build(root)
    with pytest.raises(ModelLoadError if case.setting == "model" else DataError) as info:
        load_through_plugin(root, case.setting, name)
    line = first_line(info.value)
    source = f"ini option dnnsafety_{case.setting} in {root / 'pyproject.toml'}"
    assert source in line
    for fragment in case.fragments:
        assert fragment in line
    assert "Fix:" in line
    assert "pickled objects" not in line and "allow_pickle" not in str(info.value)


def test_state_dict_with_a_newer_pickle_protocol_names_torchs_refusal(root: Path) -> None:
    torch.save(tiny_model().state_dict(), root / "model.pt", pickle_protocol=4)
    with pytest.warns(UserWarning, match="pickle protocol 4"), pytest.raises(ModelLoadError) as info:
        load_through_plugin(root, "model", "model.pt")
    line = first_line(info.value)
    assert "refused to unpickle model.pt: torch's weights-only loader rejected it (Unsupported operand 149)" in line
    assert "default pickle protocol" in line


def test_data_file_with_an_unknown_suffix_names_the_accepted_ones(root: Path) -> None:
    (root / "eval.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    with pytest.raises(DataError) as info:
        load_dataset(make_settings(root, data="eval.h5"))
    assert "eval.h5 has an unknown suffix '.h5'. Fix: use .npz, .npy or .pt (or .pth)" in first_line(info.value)


# ---------------------------------------------------------------------------- directories


@pytest.mark.parametrize(("setting", "kind"), [
    ("model", "a model file: a TorchScript archive"),
    ("data", "a data file: .npz (keys x, y), .npy (x only) or .pt/.pth"),
    ("operational_data", "a data file: .npz (key x), .npy or .pt/.pth"),
    ("scenarios", "a CSV file"),
], ids=["model_path_is_a_directory", "data_path_is_a_directory", "operational_data_path_is_a_directory",
        "scenarios_path_is_a_directory"])
def test_directory_given_as_a_file_says_directory(root: Path, setting: str, kind: str) -> None:
    (root / "inputs").mkdir()
    settings = make_settings(root, **{setting: "inputs"})
    load = {"model": lambda: load_model(settings, CPU), "data": lambda: load_dataset(settings),
            "operational_data": lambda: load_operational_data(settings),
            "scenarios": lambda: load_scenario_table(settings)}[setting]
    with pytest.raises(ConfigError) as info:
        load()
    line = first_line(info.value)
    assert line.startswith(f"dnnsafety_{setting}='inputs' (from ini option dnnsafety_{setting} in ")
    assert f"{root / 'inputs'} is a directory, not a file. Fix: point dnnsafety_{setting} at {kind}" in line


# ---------------------------------------------------------------------------- factories that raise


@pytest.mark.parametrize(("settings_of", "load", "error", "expected"), [
    (lambda root: make_settings(root, model="hostile_mod:exploding_model"), lambda s: load_model(s, CPU),
     ModelLoadError, "dnnsafety_model='hostile_mod:exploding_model' (from ini option dnnsafety_model in {ini}): "
                     "the factory hostile_mod:exploding_model raised RuntimeError: out of memory while building."),
    (lambda root: (torch.save(tiny_model().state_dict(), root / "w.pt"),
                   make_settings(root, model="w.pt", model_factory="hostile_mod:exploding_model"))[1],
     lambda s: load_model(s, CPU), ModelLoadError,
     "dnnsafety_model_factory='hostile_mod:exploding_model' (from ini option dnnsafety_model_factory in {ini}): "
     "the factory hostile_mod:exploding_model raised RuntimeError: out of memory while building."),
    (lambda root: make_settings(root, data="hostile_mod:exploding_data"), load_dataset, DataError,
     "dnnsafety_data='hostile_mod:exploding_data' (from ini option dnnsafety_data in {ini}): "
     "the factory hostile_mod:exploding_data raised ValueError: bucket not mounted."),
    (lambda root: make_settings(root, operational_data="hostile_mod:exploding_profile"),
     lambda s: load_operational_profile(s, CPU), DataError,
     "dnnsafety_operational_data='hostile_mod:exploding_profile' (from ini option dnnsafety_operational_data in "
     "{ini}): the factory hostile_mod:exploding_profile raised KeyError: 'latent'."),
    (lambda root: make_settings(root, scenarios="hostile_mod:exploding_table"), load_scenario_table, ConfigError,
     "dnnsafety_scenarios='hostile_mod:exploding_table' (from ini option dnnsafety_scenarios in {ini}): "
     "the factory hostile_mod:exploding_table raised OSError: share offline."),
], ids=["model_factory_raises", "state_dict_module_factory_raises", "data_factory_raises",
        "operational_profile_factory_raises", "scenario_factory_raises"])
def test_factory_that_raises_names_factory_setting_source_and_exception(
        root: Path, settings_of: Callable[[Path], Settings], load: Callable[[Settings], Any],
        error: type[Exception], expected: str) -> None:
    with pytest.raises(error) as info:
        load(settings_of(root))
    line = first_line(info.value)
    assert line.startswith(expected.format(ini=root / "pyproject.toml"))
    assert "Fix: the error is in that factory" in line
    assert info.value.__cause__ is not None  # the user's traceback is kept


# ---------------------------------------------------------------------------- shuffling loaders

TENSORS = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))


class Batches(BatchSampler):
    """A batch sampler that yields batches in reverse: it reorders but has no ``sampler`` to inspect."""

    def __init__(self) -> None:  # noqa: D107 - deliberately skips BatchSampler's arguments
        pass

    def __iter__(self) -> Any:
        return iter([[5, 4], [3, 2], [1, 0]])

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(("loader", "name"), [
    (lambda: DataLoader(TENSORS, batch_size=2, shuffle=True), "RandomSampler"),
    (lambda: DataLoader(TENSORS, batch_size=2, sampler=RandomSampler(TENSORS)), "RandomSampler"),
    (lambda: DataLoader(TENSORS, batch_size=2, sampler=SubsetRandomSampler(range(6))), "SubsetRandomSampler"),
    (lambda: DataLoader(TENSORS, batch_size=2, sampler=WeightedRandomSampler([1.0] * 6, 6)), "WeightedRandomSampler"),
    (lambda: DataLoader(TENSORS, batch_sampler=BatchSampler(RandomSampler(TENSORS), 2, False)), "RandomSampler"),
    (lambda: DataLoader(TENSORS, batch_size=None, shuffle=True), "RandomSampler"),
], ids=["shuffle_true", "random_sampler", "subset_random_sampler", "weighted_random_sampler",
        "batch_sampler_over_random_sampler", "unbatched_shuffle"])
@pytest.mark.parametrize("reader", ["as_tensors", "iter_batches"])
def test_shuffling_dataloader_is_refused(loader: Callable[[], DataLoader], name: str, reader: str) -> None:
    with pytest.raises(DataError) as info:
        if reader == "as_tensors":
            as_tensors(loader(), "my data")
        else:
            next(iter_batches(loader(), 2))
    line = first_line(info.value)
    assert f"the DataLoader shuffles ({name}): gates link data rows to scenario rows by position" in line
    assert "Fix: use shuffle=False (or pass the tensors / a TensorDataset)" in line
    if reader == "as_tensors":
        assert line.startswith("my data: ")


def test_reordering_batch_sampler_is_refused() -> None:
    with pytest.raises(DataError, match=r"the DataLoader does not read its dataset in order \(Batches\)"):
        as_tensors(DataLoader(TENSORS, batch_sampler=Batches()))


def test_data_factory_returning_a_shuffling_loader_is_refused(root: Path) -> None:
    (root / "shuffled.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
        "def load():\n"
        "    return DataLoader(TensorDataset(torch.zeros(4, 2), torch.zeros(4)), batch_size=2, shuffle=True)\n")
    try:
        with pytest.raises(DataError) as info:
            load_dataset(make_settings(root, data="shuffled:load"))
    finally:
        sys.modules.pop("shuffled", None)
    line = first_line(info.value)
    assert line.startswith("evaluation data (dnnsafety_data='shuffled:load' from ini option dnnsafety_data")
    assert "the DataLoader shuffles (RandomSampler)" in line


@pytest.mark.parametrize("loader", [
    lambda: DataLoader(TENSORS, batch_size=4),
    lambda: DataLoader(TENSORS, batch_size=4, sampler=SequentialSampler(TENSORS)),
    lambda: DataLoader(TENSORS, batch_sampler=BatchSampler(SequentialSampler(TENSORS), 4, False)),
], ids=["default", "explicit_sequential_sampler", "batch_sampler_over_sequential_sampler"])
def test_in_order_dataloader_is_accepted(loader: Callable[[], DataLoader]) -> None:
    x, y = as_tensors(loader())
    assert y is not None and y.tolist() == list(range(6))
    assert torch.cat([bx for bx, _ in iter_batches(loader(), 4)]).shape == (6, 2)


class Stream(IterableDataset):
    """An iterable dataset: no sampler; its order is its own."""

    def __iter__(self) -> Any:
        return iter([(torch.tensor([float(i), 0.0]), torch.tensor(i)) for i in range(5)])


def test_iterable_dataset_loader_is_accepted_in_its_own_order() -> None:
    x, y = as_tensors(DataLoader(Stream(), batch_size=2))
    assert y is not None and y.tolist() == [0, 1, 2, 3, 4]
