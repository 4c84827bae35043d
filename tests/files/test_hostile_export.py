"""Planted ``.pt2`` files: nothing in a torch.export archive runs code before the model is trusted.

Issue #19 §1: a ``.pt2`` whose constants config declares an opaque object constant at
``opaque_obj_0/x``, holding a protocol-0 pickle (no ``0x80`` header) whose ``__reduce__`` calls
``os.system``, ran the command under the default settings. Every variant below is built from a
genuine ``torch.export.save`` file by rewriting its zip members, loaded through the plugin with the
default settings, and must fail with an error that names the file and the member while the marker
file that the payload would create never appears.

Which members torch unpickles is read from torch 2.13 (``torch/export/pt2_archive/_package.py``,
``torch/_export/serde/serialize.py``, ``torch/export/_unlift.py``): constants by ``path_name``
prefix (``tensor_`` with ``use_pickle`` → ``torch.load``, ``custom_obj_`` → TorchScript's
unpickler, ``opaque_obj_`` → ``pickle.loads``), weights with ``use_pickle``, the legacy
``data/weights|constants/<model>.pt`` and the sample inputs (``torch.load``), and the pre-2.8
root-level members. The program JSON becomes code through ``sympy.sympify`` (``expr_str``),
``guards_code`` and node targets. ``test_planted_variant_is_live`` is the control: torch alone
runs the payload of each variant marked live, so the refusal is what keeps the marker away.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from _hostile import Members, genuine, make_settings, save_export, torch_save_bytes  # noqa: F401 (fixture)
from conftest import GateProject
from pytest_dnnsafety.files.archives import weights_only_forced
from pytest_dnnsafety.errors import ModelLoadError
from pytest_dnnsafety.files.loading import load_model

CPU = torch.device("cpu")


class RunsCommand:
    """The issue's payload: unpickling it calls ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def payload(marker: Path, protocol: int = 0) -> bytes:
    return pickle.dumps(RunsCommand(marker), protocol=protocol)


# ------------------------------------------------------------------------------ building archives




def write_zip(path: Path, members: Members) -> None:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as archive:
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": duplicates are the point
        for name, data in members:
            archive.writestr(name, data)


class Archive:
    """The genuine members under edit; names are relative to the archive's top folder."""

    def __init__(self, members: Members) -> None:
        self.top = members[0][0].split("/", 1)[0] + "/"
        self.members = list(members)

    def get(self, name: str) -> bytes:
        return next(data for member, data in self.members if member == self.top + name)

    def set(self, name: str, data: bytes) -> None:
        """Replace every member called ``name``, or add it at the end."""
        full = self.top + name
        if any(member == full for member, _ in self.members):
            self.members = [(member, data if member == full else old) for member, old in self.members]
        else:
            self.members.append((full, data))

    def add(self, name: str, data: bytes, first: bool = False, at_root: bool = False) -> None:
        """Add a member (a duplicate if the name exists), at the end or before every other."""
        item = (name if at_root else self.top + name, data)
        self.members = [item, *self.members] if first else [*self.members, item]

    def config(self, kind: str) -> dict[str, Any]:
        return json.loads(self.get(f"data/{kind}/model_{kind}_config.json"))

    def set_config(self, kind: str, config: dict[str, Any]) -> None:
        self.set(f"data/{kind}/model_{kind}_config.json", json.dumps(config).encode())

    def declare(self, kind: str, fqn: str, path_name: str, use_pickle: bool = True) -> None:
        """A config entry: ``kind`` is "constants" or "weights"."""
        config = self.config(kind)
        config["config"][fqn] = {"path_name": path_name, "is_param": False, "use_pickle": use_pickle,
                                 "tensor_meta": None}
        self.set_config(kind, config)

    def program(self) -> dict[str, Any]:
        return json.loads(self.get("models/model.json"))

    def set_program(self, program: dict[str, Any]) -> None:
        self.set("models/model.json", json.dumps(program).encode())


Build = Callable[[Archive, Path], None]


@dataclass(frozen=True)
class Variant:
    build: Build
    fragments: tuple[str, ...]  # what the error's first line must say besides the file name
    live: bool = False  # torch.export.load (+ .module() and a forward call) alone runs the payload


def planted(members: Members, root: Path, build: Build, marker: Path) -> Path:
    archive = Archive(members)
    build(archive, marker)
    write_zip(root / "model.pt2", archive.members)
    return root / "model.pt2"


# ------------------------------------------------------------------------------------- variants


def issue_exploit(archive: Archive, marker: Path) -> None:
    """The issue's file: an opaque constant at ``opaque_obj_0/x``, a protocol-0 pickle calling os.system."""
    archive.declare("constants", "evil", "opaque_obj_0/x")
    archive.add("data/constants/opaque_obj_0/x", payload(marker, protocol=0))


def constant(path_name: str, protocol: int = 0, data: Callable[[Path], bytes] | None = None) -> Build:
    """A constant at ``path_name`` (any kind: the prefix decides how torch reads it) holding the payload."""
    def build(archive: Archive, marker: Path) -> None:
        archive.declare("constants", "evil", path_name)
        archive.add(f"data/constants/{path_name}", data(marker) if data else payload(marker, protocol))
    return build


def pickled_weight(protocol: int | None) -> Build:
    """``weight_0`` declared ``use_pickle``: a raw pickle of ``protocol``, or a torch.save zip (None)."""
    def build(archive: Archive, marker: Path) -> None:
        config = archive.config("weights")
        entry = next(iter(config["config"].values()))
        entry["use_pickle"] = True
        archive.set_config("weights", config)
        data = torch_save_bytes(RunsCommand(marker)) if protocol is None else payload(marker, protocol)
        archive.set(f"data/weights/{entry['path_name']}", data)
    return build


def sample_inputs(make: Callable[[Path], bytes]) -> Build:
    def build(archive: Archive, marker: Path) -> None:
        archive.set("data/sample_inputs/model.pt", make(marker))
    return build


def outside(kind: str, path_name: str, planted_as: str | None = None) -> Build:
    """A config entry whose path leaves its folder; the payload is planted where a lookup could find it."""
    def build(archive: Archive, marker: Path) -> None:
        archive.declare(kind, "evil", path_name)
        archive.add(planted_as or f"data/{kind}/{path_name}", payload(marker))
    return build


def duplicate_member(evil_first: bool) -> Build:
    """Two members called ``data/constants/tensor_9``: a genuine pickled tensor and the payload."""
    def build(archive: Archive, marker: Path) -> None:
        archive.declare("constants", "extra", "tensor_9")
        pair = [torch_save_bytes(torch.ones(3)), torch_save_bytes(RunsCommand(marker))]
        for data in reversed(pair) if evil_first else pair:
            archive.add("data/constants/tensor_9", data)
    return build


def duplicate_config(evil_first: bool) -> Build:
    """Two constants configs: the genuine one and one declaring the issue's opaque constant."""
    def build(archive: Archive, marker: Path) -> None:
        genuine_config = archive.get("data/constants/model_constants_config.json")
        archive.members = [item for item in archive.members
                           if item[0] != archive.top + "data/constants/model_constants_config.json"]
        evil = json.loads(genuine_config)
        evil["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                                  "tensor_meta": None}
        configs = [json.dumps(evil).encode(), genuine_config]
        for data in configs if evil_first else reversed(configs):
            archive.add("data/constants/model_constants_config.json", data, first=True)
        archive.add("data/constants/opaque_obj_0", payload(marker))
    return build


def other_case_member(archive: Archive, marker: Path) -> None:
    """The config says ``tensor_9``; the archive holds ``TENSOR_9`` (torch's lookup ignores case)."""
    archive.declare("constants", "evil", "tensor_9")
    archive.add("DATA/CONSTANTS/TENSOR_9", payload(marker))


def other_case_config(archive: Archive, marker: Path) -> None:
    """An upper-case constants config before the genuine one: torch lists the genuine, may read this one."""
    evil = archive.config("constants")
    evil["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                              "tensor_meta": None}
    archive.add("DATA/CONSTANTS/MODEL_CONSTANTS_CONFIG.JSON", json.dumps(evil).encode(), first=True)
    archive.add("data/constants/opaque_obj_0", payload(marker))


def legacy_member(name: str, make: Callable[[Path], bytes]) -> Build:
    def build(archive: Archive, marker: Path) -> None:
        archive.add(name, make(marker))
    return build


def pre_2_8_format(archive: Archive, marker: Path) -> None:
    """The root-level members torch.export.load's fallback reader torch.loads (weights_only=False)."""
    archive.add("version", b"8.13", at_root=True)
    archive.add("serialized_exported_program.json", archive.get("models/model.json"), at_root=True)
    archive.add("serialized_state_dict.pt", payload(marker), at_root=True)
    archive.add("serialized_constants.pt", torch_save_bytes({}), at_root=True)
    archive.add("serialized_example_inputs.pt", torch_save_bytes(((torch.zeros(2, 2, 2),), {})), at_root=True)


def broken_after_reduce(marker: Path) -> bytes:
    """A protocol-0 pickle that calls os.system and only then stops parsing: REDUCE runs first."""
    return f"cposix\nsystem\n(Vtouch {shlex.quote(str(marker))}\ntR".encode() + b"\xff\xfe"


def legacy_torch_save(marker: Path) -> bytes:
    return torch_save_bytes(RunsCommand(marker), legacy=True)


def zip_torch_save(marker: Path) -> bytes:
    return torch_save_bytes(RunsCommand(marker))


def command(marker: Path) -> str:
    return f"import os; os.system({'touch ' + shlex.quote(str(marker))!r})"


def program_expr(archive: Archive, marker: Path) -> None:
    """A tensor size whose ``expr_str`` sympy.sympify evaluates while torch.export.load runs."""
    program = archive.program()
    meta = program["graph_module"]["graph"]["tensor_values"]["x"]
    expr = f"__import__('os').system({'touch ' + shlex.quote(str(marker))!r}) + 2"
    meta["sizes"][0] = {"as_expr": {"expr_str": expr, "hint": {"as_int": 2}}}
    archive.set_program(program)


def program_guard(archive: Archive, marker: Path) -> None:
    """A ``guards_code`` line: ExportedProgram.module() pastes it into the code its forward runs."""
    program = archive.program()
    program["guards_code"] = [f"__import__('os').system({'touch ' + shlex.quote(str(marker))!r}) == 0"]
    archive.set_program(program)


def calling(target: str, argument: Callable[[Path], str]) -> Build:
    """A first node calling ``target`` with one string argument, its result unused."""
    def build(archive: Archive, marker: Path) -> None:
        program = archive.program()
        program["graph_module"]["graph"]["nodes"].insert(0, {
            "target": target, "name": "pwn", "metadata": {}, "is_hop_single_tensor_return": None,
            "inputs": [{"name": "arg0", "arg": {"as_string": argument(marker)}, "kind": 1}],
            "outputs": [{"as_none": True}]})
        archive.set_program(program)
    return build


def importable_module(marker: Path) -> str:
    """A module next to the marker (on ``sys.path`` in these tests) whose import touches it.

    Stands for any module the user's environment can import: the file names it, torch imports it.
    """
    name = f"planted_{abs(hash(str(marker))):x}"
    (marker.parent / f"{name}.py").write_text(f"import os\nos.system({'touch ' + shlex.quote(str(marker))!r})\n")
    return f"{name}.Function"


def program_name(archive: Archive, marker: Path) -> None:
    """An input name that would end the generated ``def forward(self, ...)`` line and add a statement."""
    text = archive.get("models/model.json").decode().replace('"x"', json.dumps(f"x):\n    {command(marker)}\n"
                                                                                f"def _f(x"))
    archive.set("models/model.json", text.encode())


def stray_pickle(archive: Archive, marker: Path) -> None:
    """A protocol-0 pickle at a name nothing reads: refused all the same (decided from the bytes)."""
    archive.add("data/weights/notes.txt", payload(marker))


REFUSED = "refused to unpickle model.pt2"
NOT_VALID = "model.pt2 is not a valid torch.export program (.pt2) file"
VARIANTS: dict[str, Variant] = {
    "issue_opaque_obj_0_x_protocol0": Variant(issue_exploit, (REFUSED, "opaque_obj_0/x", "opaque object"),
                                              live=True),
    **{f"opaque_constant_protocol{p}": Variant(constant("opaque_obj_0", p), (REFUSED, "opaque_obj_0"), live=True)
       for p in range(6)},
    **{f"tensor_constant_use_pickle_protocol{p}": Variant(constant("tensor_7", p),
                                                          (REFUSED, "tensor_7", "posix.system"), live=True)
       for p in range(6)},
    "tensor_constant_torch_save_zip": Variant(constant("tensor_7", data=zip_torch_save),
                                              (REFUSED, "tensor_7", "posix.system"), live=True),
    "tensor_constant_legacy_torch_save": Variant(constant("tensor_7", data=legacy_torch_save),
                                                 (REFUSED, "tensor_7", "posix.system"), live=True),
    "tensor_constant_broken_after_reduce": Variant(constant("tensor_7", data=broken_after_reduce),
                                                   (REFUSED, "tensor_7", "not a well-formed pickle"), live=True),
    "custom_object_constant": Variant(constant("custom_obj_0", 2), (REFUSED, "custom_obj_0", "custom object")),
    "custom_object_constant_nested": Variant(constant("custom_obj_0/a/b", 2), (REFUSED, "custom_obj_0/a/b")),
    "nested_tensor_constant": Variant(constant("tensor_0/a/b/c", 0), (REFUSED, "tensor_0/a/b/c"), live=True),
    "nested_opaque_constant": Variant(constant("opaque_obj_1/deep/er/x", 5), (REFUSED, "opaque_obj_1/deep/er/x"),
                                      live=True),
    "tensor_named_like_an_opaque_file": Variant(constant("tensor_9/opaque_obj_0", 0),
                                                (REFUSED, "tensor_9/opaque_obj_0"), live=True),
    "opaque_named_like_a_tensor_file": Variant(constant("opaque_obj_9/tensor_0", 1),
                                               (REFUSED, "opaque_obj_9/tensor_0"), live=True),
    **{f"weight_use_pickle_protocol{p}": Variant(pickled_weight(p), (REFUSED, "weight_0", "posix.system"), live=True)
       for p in range(6)},
    "weight_use_pickle_torch_save_zip": Variant(pickled_weight(None), (REFUSED, "weight_0", "posix.system"),
                                                live=True),
    **{f"sample_inputs_raw_pickle_protocol{p}": Variant(sample_inputs(lambda m, p=p: payload(m, p)),
                                                        (REFUSED, "sample_inputs", "posix.system"), live=True)
       for p in range(6)},
    "sample_inputs_legacy_torch_save": Variant(sample_inputs(legacy_torch_save),
                                               (REFUSED, "sample_inputs", "posix.system"), live=True),
    "sample_inputs_broken_after_reduce": Variant(sample_inputs(broken_after_reduce),
                                                 (REFUSED, "sample_inputs", "not a well-formed pickle"), live=True),
    "opaque_path_with_dotdot": Variant(outside("constants", "opaque_obj_0/../../x"),
                                       (NOT_VALID, "'opaque_obj_0/../../x'", "not a plain name"), live=True),
    "tensor_path_with_dotdot": Variant(outside("constants", "tensor_0/../x"), (NOT_VALID, "'tensor_0/../x'")),
    "constant_path_dotdot": Variant(outside("constants", "../x"), (NOT_VALID, "'../x'")),
    "constant_path_backslash": Variant(outside("constants", "opaque_obj_0\\..\\x"),
                                       (NOT_VALID, "'opaque_obj_0\\\\..\\\\x'"), live=True),
    "constant_path_dot_component": Variant(outside("constants", "opaque_obj_0/./x"), (NOT_VALID, "'opaque_obj_0/./x'"),
                                           live=True),
    "weight_path_dotdot": Variant(outside("weights", "../constants/tensor_0"),
                                  (NOT_VALID, "'../constants/tensor_0'"), live=True),
    "weight_path_absolute": Variant(outside("weights", "/tmp/evil", planted_as="/tmp/evil"),
                                    (NOT_VALID, "'/tmp/evil'")),
    "weight_path_empty": Variant(outside("weights", "", planted_as="data/weights/x"), (NOT_VALID, "path_name ''")),
    "config_names_a_missing_member": Variant(lambda archive, marker: archive.declare("constants", "evil", "tensor_8"),
                                             (NOT_VALID, "data/constants/tensor_8", "does not hold")),
    "duplicate_member_evil_first": Variant(duplicate_member(True), (REFUSED, "tensor_9", "posix.system")),
    "duplicate_member_evil_last": Variant(duplicate_member(False), (REFUSED, "tensor_9", "posix.system"), live=True),
    "duplicate_constants_config_evil_first": Variant(duplicate_config(True), (REFUSED, "opaque_obj_0")),
    "duplicate_constants_config_evil_last": Variant(duplicate_config(False), (REFUSED, "opaque_obj_0"), live=True),
    "member_in_other_case": Variant(other_case_member, (REFUSED, "TENSOR_9", "posix.system"), live=True),
    "config_in_other_case": Variant(other_case_config, (REFUSED, "opaque_obj_0")),
    "legacy_weights_member": Variant(legacy_member("data/weights/model.pt", zip_torch_save),
                                     (REFUSED, "data/weights/model.pt", "posix.system"), live=True),
    "legacy_weights_member_raw_protocol0": Variant(legacy_member("data/weights/model.pt", payload),
                                                   (REFUSED, "data/weights/model.pt", "posix.system"), live=True),
    "legacy_constants_member": Variant(legacy_member("data/constants/model.pt", legacy_torch_save),
                                       (REFUSED, "data/constants/model.pt", "posix.system"), live=True),
    "pre_2_8_root_members": Variant(pre_2_8_format, (REFUSED, "serialized_state_dict.pt", "posix.system"),
                                    live=True),
    "sample_inputs_key_with_code": Variant(
        sample_inputs(lambda m: torch_save_bytes(((), {f"x']\n{command(m)}\n#": torch.zeros(2, 2, 2)}))),
        ("refused to load model.pt2", "example input key", "not a plain name")),
    "stray_protocol0_pickle": Variant(stray_pickle, (REFUSED, "notes.txt", "posix.system")),
    "program_expr_str_code": Variant(program_expr, ("refused to load model.pt2", "expr_str", "sympify"), live=True),
    "program_guards_code": Variant(program_guard, ("refused to load model.pt2", "guards_code"), live=True),
    "program_target_torch_os_system": Variant(calling("torch.os.system", lambda m: f"touch {shlex.quote(str(m))}"),
                                              ("refused to load model.pt2", "'torch.os.system'", "not an operator")),
    "program_target_imports_a_named_module": Variant(
        calling("torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch", importable_module),
        ("refused to load model.pt2", "_call_custom_autograd_function_in_pre_dispatch", "not an operator"),
        live=True),
    "program_target_load_library": Variant(calling("torch.ops.load_library", lambda m: str(m.parent / "x.so")),
                                           ("refused to load model.pt2", "'torch.ops.load_library'")),
    "program_input_name_with_code": Variant(program_name, ("refused to load model.pt2", "not a plain name")),
}


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=list(VARIANTS))
def test_planted_export_never_runs_code(genuine: Members, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        variant: Variant) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "PWNED"
    planted(genuine, tmp_path, variant.build, marker)
    with pytest.raises(ModelLoadError) as info:
        load_model(make_settings(tmp_path, model="model.pt2"), CPU)
    assert not marker.exists(), "the planted payload ran"
    line = str(info.value).splitlines()[0]
    assert line.startswith("dnnsafety_model='model.pt2' (from ini option dnnsafety_model")
    for fragment in variant.fragments:
        assert fragment in line, line
    assert "Fix:" in line
    assert "got <class" not in str(info.value)  # never a value that came out of an unpickler


@pytest.mark.parametrize("name", [name for name, variant in VARIANTS.items() if variant.live])
def test_planted_variant_is_live(genuine: Members, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 name: str) -> None:
    """The control: torch alone (load, .module(), one forward) runs each live variant's payload."""
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "PWNED"
    path = planted(genuine, tmp_path, VARIANTS[name].build, marker)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.load(str(path)).module()(torch.zeros(2, 2, 2))
    except Exception:  # the payload runs before torch notices anything wrong, if it ever does
        pass
    assert marker.exists(), f"{name} does not run its payload under torch.export.load"


@pytest.mark.parametrize("name", [name for name, variant in VARIANTS.items()
                                  if variant.live and not name.startswith("program_")])
def test_load_guard_alone_stops_every_pickle(genuine: Members, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             name: str) -> None:
    """The second lock: under the guard torch.export.load runs in, no planted pickle runs, scan or not."""
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    marker = tmp_path / "PWNED"
    path = planted(genuine, tmp_path, VARIANTS[name].build, marker)
    with weights_only_forced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.export.load(str(path))
        except Exception:  # refused by torch's weights-only unpickler or by the pickle.loads stand-in
            pass
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    assert torch.export.pt2_archive._package.pickle is pickle


def test_issue_exploit_through_a_project_with_default_settings(genuine: Members, gate_project: GateProject) -> None:
    """The issue's reproduction: the planted file as ``dnnsafety_model`` of a pytest project."""
    root = gate_project.pytester.path
    marker = root / "PWNED"
    planted(genuine, root, issue_exploit, marker)
    gate_project.ini["dnnsafety_model"] = "model.pt2"
    gate_project.tests("def test_model(model):\n    pass\n")
    result = gate_project.run()
    result.assert_outcomes(errors=1)
    assert not marker.exists()
    result.stdout.fnmatch_lines(["*refused to unpickle model.pt2*opaque_obj_0/x*dnnsafety_allow_pickle=true*"])
    assert "got <class" not in result.stdout.str()


def test_genuine_export_still_loads(genuine: Members, tmp_path: Path) -> None:
    write_zip(tmp_path / "model.pt2", genuine)
    model = load_model(make_settings(tmp_path, model="model.pt2"), CPU)
    assert model(torch.zeros(2, 2, 2)).shape == (2, 3)
