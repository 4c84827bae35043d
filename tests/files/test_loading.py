"""Loading models, data, operational data and scenario tables from files and factories, safely."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pytest_dnnsafety.settings import SETTINGS, Settings
from pytest_dnnsafety.errors import ConfigError, DataError, ModelLoadError
from pytest_dnnsafety.files.loading import import_factory, load_dataset, load_model, load_operational_data
from pytest_dnnsafety.data.forms import as_tensors
from pytest_dnnsafety.plugin.fixtures import load_scenario_table
from pytest_dnnsafety.runtime.devices import resolve_device

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
#: Recent torch (2.13 here) deprecates torch.jit; TorchScript files are still a supported model format.
JIT_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch\\.jit\\.:DeprecationWarning")

#: A user module next to the ini file: model factories and data loaders.
USER_MODULE = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def trained():
    torch.manual_seed(0)
    return build()


def build_deeper():
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def build_wider():
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 5))


def not_a_module():
    return "a string"


def pair():
    return torch.arange(12.0).reshape(3, 4), torch.tensor([0, 1, 2])


def dataset():
    return TensorDataset(*pair())


def loader():
    return DataLoader(dataset(), batch_size=2)


def no_x():
    return {"inputs": torch.zeros(2, 4)}


NOT_CALLABLE = 3
"""


def tiny_model() -> nn.Module:
    """The same model (and weights) as ``mymod:trained``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def make_settings(root: Path, *, cli: dict[str, Any] | None = None, **ini: Any) -> Settings:
    """Settings with ini options (short names) from ``root/pyproject.toml``, invoked from ``root``."""
    ini_values = {SETTINGS[name].ini: value for name, value in ini.items()}
    cli_values = {SETTINGS[name].dest: value for name, value in (cli or {}).items()}
    return Settings(cli=cli_values, ini=ini_values.get, env={}, ini_file=root / "pyproject.toml",
                    invocation_dir=root)


@pytest.fixture(autouse=True)
def _isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Any:
    """import_factory appends the ini folder to sys.path; user modules must not leak between tests."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("mymod", None)


@pytest.fixture
def mymod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``mymod`` importable from ``tmp_path``."""
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mymod"


@pytest.fixture
def x() -> torch.Tensor:
    return torch.linspace(-1, 1, 5 * 4).reshape(5, 2, 2)


def assert_same_outputs(loaded: Any, reference: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), reference(x))


def expect_model_error(settings: Settings, error: type[Exception]) -> str:
    with pytest.raises(error) as info:
        load_model(settings, CPU)
    return str(info.value)


# ------------------------------------------------------------------------------------ model files


@JIT_DEPRECATED
@pytest.mark.parametrize("compile_", [torch.jit.script, lambda m: torch.jit.trace(m, torch.zeros(1, 2, 2))],
                         ids=["script", "trace"])
def test_torchscript_file_loads(tmp_path: Path, x: torch.Tensor, compile_: Callable) -> None:
    reference = tiny_model()
    torch.jit.save(compile_(reference), str(tmp_path / "m.pt"))
    model = load_model(make_settings(tmp_path, model="m.pt"), CPU)
    assert isinstance(model, torch.jit.ScriptModule)
    assert not model.training
    assert_same_outputs(model, reference, x)


@JIT_DEPRECATED
def test_torchscript_file_loads_even_with_allow_pickle(tmp_path: Path, x: torch.Tensor) -> None:
    reference = tiny_model()
    torch.jit.save(torch.jit.script(reference), str(tmp_path / "m.pt"))
    assert_same_outputs(load_model(make_settings(tmp_path, model="m.pt", allow_pickle="true"), CPU), reference, x)


def test_torch_export_program_loads(tmp_path: Path, x: torch.Tensor) -> None:
    reference = tiny_model().eval()
    torch.export.save(torch.export.export(reference, (x,)), str(tmp_path / "m.pt2"))
    model = load_model(make_settings(tmp_path, model="m.pt2"), CPU)  # its mode was fixed at export
    assert_same_outputs(model, reference, x)


def test_torch_export_file_that_is_not_a_program_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.pt2").write_bytes(b"not a zip archive")
    message = expect_model_error(make_settings(tmp_path, model="m.pt2"), ModelLoadError)
    assert "dnnsafety_model='m.pt2'" in message
    assert "m.pt2 is not a valid torch.export program (.pt2) file: found text starting with 'not a zip" in message
    assert "dnnsafety_allow_pickle" not in message


@pytest.mark.parametrize("wrap", [lambda sd: sd, lambda sd: {"state_dict": sd, "epoch": 3}],
                         ids=["bare", "wrapped"])
def test_state_dict_loads_into_the_factory_module(tmp_path: Path, mymod: str, x: torch.Tensor,
                                                  wrap: Callable) -> None:
    reference = tiny_model()
    torch.save(wrap(reference.state_dict()), tmp_path / "w.pt")
    model = load_model(make_settings(tmp_path, model="w.pt", model_factory="mymod:build"), CPU)
    assert isinstance(model, nn.Sequential)
    assert not model.training
    assert_same_outputs(model, reference, x)


def test_factory_module_next_to_the_ini_file_imports_without_pythonpath(tmp_path: Path, x: torch.Tensor) -> None:
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    assert str(tmp_path) not in sys.path
    model = load_model(make_settings(tmp_path, model="mymod:trained"), CPU)
    assert_same_outputs(model, tiny_model(), x)


def test_model_factory_spec_builds_the_model_in_eval_mode(tmp_path: Path, mymod: str, x: torch.Tensor) -> None:
    model = load_model(make_settings(tmp_path, model="mymod:trained"), CPU)
    assert isinstance(model, nn.Module) and not model.training
    assert_same_outputs(model, tiny_model(), x)


def test_full_module_pickle_is_refused_by_default(tmp_path: Path) -> None:
    torch.save(tiny_model(), tmp_path / "full.pt")
    message = expect_model_error(make_settings(tmp_path, model="full.pt"), ModelLoadError)
    assert "dnnsafety_model='full.pt'" in message
    assert "refused to unpickle full.pt" in message
    assert "weights_only" in message
    assert "dnnsafety_allow_pickle=true" in message
    assert "dnnsafety_model_factory" in message


def test_full_module_pickle_loads_with_allow_pickle(tmp_path: Path, x: torch.Tensor) -> None:
    reference = tiny_model()
    torch.save(reference, tmp_path / "full.pt")
    model = load_model(make_settings(tmp_path, model="full.pt", allow_pickle=True), CPU)
    assert not model.training
    assert_same_outputs(model, reference, x)


def test_pickled_non_model_object_is_refused_even_with_allow_pickle(tmp_path: Path) -> None:
    torch.save([1, 2, 3], tmp_path / "list.pt")
    message = expect_model_error(make_settings(tmp_path, model="list.pt", allow_pickle=True), ModelLoadError)
    assert "holds a list, not a model or state dict" in message


def test_unreadable_model_file_is_a_model_load_error(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"\x00garbage")
    message = expect_model_error(make_settings(tmp_path, model="junk.pt"), ModelLoadError)
    assert "dnnsafety_model='junk.pt'" in message


def test_state_dict_without_factory_names_the_factory_option(tmp_path: Path) -> None:
    torch.save(tiny_model().state_dict(), tmp_path / "w.pt")
    message = expect_model_error(make_settings(tmp_path, model="w.pt"), ConfigError)
    assert "w.pt is a state dict" in message
    assert "dnnsafety_model_factory" in message


def test_model_factory_that_is_a_path_is_refused(tmp_path: Path) -> None:
    torch.save(tiny_model().state_dict(), tmp_path / "w.pt")
    message = expect_model_error(make_settings(tmp_path, model="w.pt", model_factory="build.py"), ConfigError)
    assert "dnnsafety_model_factory='build.py'" in message and "'package.module:callable'" in message


@pytest.mark.parametrize(("factory", "fragments"), [
    ("mymod:build_deeper", ["missing ['3.weight', '3.bias']", "unexpected []"]),
    ("mymod:build_wider", ["1.weight", "size"]),
], ids=["missing-keys", "shape-mismatch"])
def test_state_dict_that_does_not_fit_the_factory_module(tmp_path: Path, mymod: str, factory: str,
                                                          fragments: list[str]) -> None:
    torch.save(tiny_model().state_dict(), tmp_path / "w.pt")
    message = expect_model_error(make_settings(tmp_path, model="w.pt", model_factory=factory), ModelLoadError)
    assert f"does not fit the module from {factory!r}" in message
    assert "Fix: point dnnsafety_model_factory at the architecture" in message
    for fragment in fragments:
        assert fragment in message


def test_state_dict_with_extra_keys_lists_the_unexpected_keys(tmp_path: Path, mymod: str) -> None:
    state = {**tiny_model().state_dict(), "head.weight": torch.zeros(1)}
    torch.save(state, tmp_path / "w.pt")
    message = expect_model_error(make_settings(tmp_path, model="w.pt", model_factory="mymod:build"), ModelLoadError)
    assert "missing [], unexpected ['head.weight']" in message


def test_factory_returning_a_non_module_for_a_state_dict(tmp_path: Path, mymod: str) -> None:
    torch.save(tiny_model().state_dict(), tmp_path / "w.pt")
    settings = make_settings(tmp_path, model="w.pt", model_factory="mymod:not_a_module")
    assert "returned str, not a torch.nn.Module" in expect_model_error(settings, ModelLoadError)


def test_model_factory_returning_a_non_callable(tmp_path: Path, mymod: str) -> None:
    message = expect_model_error(make_settings(tmp_path, model="mymod:pair"), ModelLoadError)
    assert "gave a tuple, not a torch.nn.Module or callable" in message


@pytest.mark.parametrize("level", ["ini", "cli"])
def test_missing_model_file_names_the_resolved_path_and_source(tmp_path: Path, level: str) -> None:
    settings = (make_settings(tmp_path, model="models/absent.pt") if level == "ini"
                else make_settings(tmp_path, cli={"model": "models/absent.pt"}))
    message = expect_model_error(settings, ConfigError)
    assert "dnnsafety_model='models/absent.pt'" in message
    assert f"file not found at {tmp_path / 'models' / 'absent.pt'}" in message
    assert ("ini option dnnsafety_model" if level == "ini" else "command-line option --dnnsafety-model") in message


def test_model_folder_is_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    message = expect_model_error(make_settings(tmp_path, model="models"), ConfigError)
    assert f"{tmp_path / 'models'} is a directory, not a file" in message
    assert "Fix: point dnnsafety_model at a model file" in message


def test_model_unset_names_the_option_and_the_fixture(tmp_path: Path) -> None:
    message = expect_model_error(make_settings(tmp_path), ConfigError)
    assert "dnnsafety_model is unset" in message and "`model` fixture" in message


# -------------------------------------------------------------------------------------- factories


def test_factory_module_not_importable(tmp_path: Path) -> None:
    message = expect_model_error(make_settings(tmp_path, model="no_such_module_xyz:build"), ConfigError)
    assert "cannot import module 'no_such_module_xyz'" in message
    assert "ini option dnnsafety_model" in message
    assert "pythonpath" in message


def test_factory_attribute_missing(tmp_path: Path, mymod: str) -> None:
    message = expect_model_error(make_settings(tmp_path, model="mymod:nope"), ConfigError)
    assert "module 'mymod' has no attribute 'nope'" in message


def test_factory_attribute_not_callable(mymod: str) -> None:
    with pytest.raises(ConfigError, match="'NOT_CALLABLE' is not callable"):
        import_factory("mymod:NOT_CALLABLE", "test")


def test_factory_dotted_attribute_path(mymod: str) -> None:
    assert import_factory("mymod:nn.Linear", "test") is nn.Linear


# ----------------------------------------------------------------------------------------- device


def device_setting(tmp_path: Path, device: str) -> Any:
    return make_settings(tmp_path, cli={"device": device}).get("device")


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_cpu_machine_names_the_source_and_suggests_auto_or_cpu(tmp_path: Path, device: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_device(device_setting(tmp_path, device))
    message = str(info.value)
    assert f"dnnsafety_device={device!r}" in message
    assert "command-line option --dnnsafety-device" in message
    assert "CUDA is not available" in message
    assert "auto or cpu" in message


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
def test_auto_is_cpu_without_cuda(tmp_path: Path) -> None:
    assert resolve_device(device_setting(tmp_path, "auto")) == CPU
    assert resolve_device("auto") == CPU


def test_cpu_is_cpu(tmp_path: Path) -> None:
    assert resolve_device(device_setting(tmp_path, "cpu")) == CPU


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_mps_when_unavailable_names_the_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dnnsafety_device='mps' \(from command-line option --dnnsafety-device\)"):
        resolve_device(device_setting(tmp_path, "mps"))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_index_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA device"):
        resolve_device(device_setting(tmp_path, f"cuda:{torch.cuda.device_count()}"))


# ------------------------------------------------------------------------------------- data files

X = np.arange(12, dtype=np.float32).reshape(3, 4)
Y = np.array([0, 1, 2])


def write_data(tmp_path: Path, name: str, payload: Any) -> Settings:
    """Write ``payload`` to ``tmp_path/name`` in the format its suffix implies; settings pointing at it."""
    path = tmp_path / name
    if path.suffix == ".npz":
        np.savez(path, **payload)
    elif path.suffix == ".npy":
        np.save(path, payload)
    else:
        torch.save(payload, path)
    return make_settings(tmp_path, data=name, operational_data=name)


def assert_labelled(dataset: TensorDataset) -> None:
    x, y = dataset.tensors
    torch.testing.assert_close(x, torch.from_numpy(X))
    assert y.dtype == torch.long and y.tolist() == Y.tolist()


def test_npz_with_x_and_y(tmp_path: Path) -> None:
    assert_labelled(load_dataset(write_data(tmp_path, "eval.npz", {"x": X, "y": Y})))


def test_npy_is_unlabelled(tmp_path: Path) -> None:
    dataset = load_dataset(write_data(tmp_path, "eval.npy", X))
    assert len(dataset.tensors) == 1
    torch.testing.assert_close(dataset.tensors[0], torch.from_numpy(X))


def test_pt_tensor_is_unlabelled(tmp_path: Path) -> None:
    dataset = load_dataset(write_data(tmp_path, "eval.pt", torch.from_numpy(X)))
    assert len(dataset.tensors) == 1


def test_pt_dict_of_tensors(tmp_path: Path) -> None:
    payload = {"x": torch.from_numpy(X), "y": torch.from_numpy(Y)}
    assert_labelled(load_dataset(write_data(tmp_path, "eval.pt", payload)))


@pytest.mark.parametrize("factory", ["mymod:pair", "mymod:dataset", "mymod:loader"])
def test_data_factory(tmp_path: Path, mymod: str, factory: str) -> None:
    data = load_dataset(make_settings(tmp_path, data=factory))
    if factory == "mymod:loader":  # a loader is kept as it is (streamed by every gate), its batches unchanged
        assert isinstance(data, torch.utils.data.DataLoader)
        data = TensorDataset(*(torch.cat(parts) for parts in zip(*data)))
    assert_labelled(data)


def test_data_factory_without_x_is_refused(tmp_path: Path, mymod: str) -> None:
    with pytest.raises(DataError, match=r"expected keys 'x' \(and 'y'\); found \['inputs'\]"):
        load_dataset(make_settings(tmp_path, data="mymod:no_x"))


def test_integer_inputs_become_float(tmp_path: Path) -> None:
    dataset = load_dataset(write_data(tmp_path, "eval.npz", {"x": X.astype(np.uint8), "y": Y}))
    assert dataset.tensors[0].dtype == torch.float32


def test_integer_valued_float_labels_become_long(tmp_path: Path) -> None:
    dataset = load_dataset(write_data(tmp_path, "eval.npz", {"x": X, "y": Y.astype(np.float64)}))
    assert dataset.tensors[1].dtype == torch.long


def test_data_unset_names_the_option_and_the_fixture(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dnnsafety_data is unset.*`dataset` fixture"):
        load_dataset(make_settings(tmp_path))


def test_missing_data_file_names_the_resolved_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"file not found at .*absent\.npz"):
        load_dataset(make_settings(tmp_path, data="absent.npz"))


def test_npz_without_x_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"eval\.npz.*expected keys 'x' \(and 'y'\); found \['inputs', 'y'\]"):
        load_dataset(write_data(tmp_path, "eval.npz", {"inputs": X, "y": Y}))


@pytest.mark.parametrize("name", ["eval.npy", "eval.npz"])
def test_object_arrays_are_refused_as_pickles(tmp_path: Path, name: str) -> None:
    objects = np.array([{"a": 1}, None], dtype=object)
    payload = objects if name.endswith(".npy") else {"x": objects}
    with pytest.raises(DataError, match=rf"{name} holds pickled objects, which are refused"):
        load_dataset(write_data(tmp_path, name, payload))


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    (tmp_path / "eval.csv").write_text("1,2,3\n")
    with pytest.raises(DataError, match=r"eval\.csv has an unknown suffix '\.csv'. Fix: use \.npz, \.npy or \.pt"):
        load_dataset(make_settings(tmp_path, data="eval.csv"))


def test_pt_holding_a_python_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds Python objects, not only tensors; refused \(weights_only=True\)"):
        load_dataset(write_data(tmp_path, "eval.pt", tiny_model()))


def test_data_errors_name_the_setting_and_its_source(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(write_data(tmp_path, "eval.npz", {"x": np.full((2, 4), np.nan)}))
    message = str(info.value)
    assert message.startswith("evaluation data (dnnsafety_data='eval.npz' from ini option dnnsafety_data")
    assert "8 NaN/inf value(s)" in message


def test_operational_data_from_npz_with_only_x(tmp_path: Path) -> None:
    x = load_operational_data(write_data(tmp_path, "op.npz", {"x": X}))
    torch.testing.assert_close(x, torch.from_numpy(X))


def test_operational_data_ignores_labels(tmp_path: Path) -> None:
    x = load_operational_data(write_data(tmp_path, "op.npz", {"x": X, "y": Y}))
    assert x.shape == (3, 4)


def test_operational_data_unset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dnnsafety_operational_data is unset"):
        load_operational_data(make_settings(tmp_path))


# ------------------------------------------------------------------------------------- as_tensors

FORMS = {
    "tuple": lambda x, y: (x, y),
    "list": lambda x, y: [x, y],
    "numpy": lambda x, y: (x.numpy(), y.numpy()),
    "dict": lambda x, y: {"x": x, "y": y},
    "tensor-dataset": lambda x, y: TensorDataset(x, y),
    "dataloader": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=2),
    "dataloader-of-dicts": lambda x, y: DataLoader([{"x": a, "y": b} for a, b in zip(x, y)], batch_size=2),
}


@pytest.mark.parametrize("form", FORMS)
def test_as_tensors_accepts_every_labelled_form(form: str) -> None:
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    got_x, got_y = as_tensors(FORMS[form](x, y))
    torch.testing.assert_close(got_x, x)
    assert got_y is not None and got_y.dtype == torch.long and got_y.tolist() == Y.tolist()


@pytest.mark.parametrize("data", [
    torch.from_numpy(X), X, (torch.from_numpy(X),), {"x": X}, TensorDataset(torch.from_numpy(X)),
    DataLoader(TensorDataset(torch.from_numpy(X)), batch_size=2),
], ids=["tensor", "numpy", "1-tuple", "dict", "tensor-dataset", "dataloader"])
def test_as_tensors_accepts_unlabelled_forms(data: Any) -> None:
    x, y = as_tensors(data)
    assert y is None
    torch.testing.assert_close(x, torch.from_numpy(X))


def test_as_tensors_detaches() -> None:
    x, _ = as_tensors(torch.ones(2, 3, requires_grad=True))
    assert not x.requires_grad


def nan_inputs(count: int) -> torch.Tensor:
    x = torch.zeros(4, 3)
    x.view(-1)[:count] = float("nan")
    return x


@pytest.mark.parametrize(("data", "pattern"), [
    ((nan_inputs(5), None), r"x holds 5 NaN/inf value\(s\)"),
    ((torch.tensor([[1.0, float("inf")], [float("-inf"), 0.0]]), None), r"x holds 2 NaN/inf value\(s\)"),
    ((torch.zeros(0, 4), None), r"no samples \(x has shape \(0, 4\)\)"),
    ((torch.tensor(1.0), None), r"no samples \(x has shape \(\)\)"),
    ((torch.zeros(3, 4), torch.tensor([0, 1])), "x has 3 samples but y has 2 labels"),
    ((torch.zeros(2, 4), torch.tensor([0.5, 1.0])), "labels y must be integer class indices"),
    ((torch.zeros(2, 4), torch.tensor([float("nan"), 1.0])), "labels y must be integer class indices"),
    ({"inputs": torch.zeros(2, 4)}, r"needs key 'x' \(and 'y' for labels\); got \['inputs'\]"),
    (DataLoader(TensorDataset(torch.zeros(0, 4)), batch_size=2), "the DataLoader yielded no batches"),
    ((["a", "b"], None), "x cannot be turned into a tensor"),
], ids=["nan", "inf", "empty", "scalar", "length-mismatch", "fractional-labels", "nan-labels", "dict-without-x",
        "empty-dataloader", "strings"])
def test_as_tensors_refuses_bad_data(data: Any, pattern: str) -> None:
    with pytest.raises(DataError, match=rf"^my data: .*{pattern}"):
        as_tensors(data, "my data")


# ---------------------------------------------------------------------------------------- scenarios

CONDITIONS = '[conditions]\nweather = ["sunny","cloudy","rainy"]\nroad = ["stone","mud","tarmac"]\n'
SCENARIOS = "weather,road\nsunny,stone\nrainy,tarmac\ncloudy,mud\n"


def test_scenario_table_unset_names_the_option_and_the_fixture(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dnnsafety_scenarios is unset.*`scenario_table` fixture"):
        load_scenario_table(make_settings(tmp_path))


def test_scenario_table_from_csv_and_toml(tmp_path: Path) -> None:
    scenarios = pytest.importorskip("pytest_dnnsafety.scenarios")
    (tmp_path / "conditions.toml").write_text(CONDITIONS)
    (tmp_path / "scenarios.csv").write_text(SCENARIOS)
    table = load_scenario_table(make_settings(tmp_path, scenarios="scenarios.csv", conditions="conditions.toml"))
    assert isinstance(table, scenarios.ScenarioTable)
    coverage = table.coverage(k=2)
    assert coverage.covered == 3 and coverage.value == pytest.approx(3 / 9)


def test_scenario_table_without_conditions_names_the_conditions_option(tmp_path: Path) -> None:
    pytest.importorskip("pytest_dnnsafety.scenarios")
    (tmp_path / "scenarios.csv").write_text(SCENARIOS)
    with pytest.raises(ConfigError, match="dnnsafety_conditions is unset"):
        load_scenario_table(make_settings(tmp_path, scenarios="scenarios.csv"))


LOADER_MODULE = '''
import torch

class Refuses(torch.utils.data.Dataset):
    """Read one input at a time; indexed all at once, it raises (it stands for data larger than memory)."""
    def __len__(self):
        return 10
    def __getitem__(self, i):
        if not isinstance(i, int):
            raise TypeError("read one input at a time")
        return torch.full((2,), float(i)), i % 2

def ordered():
    return torch.utils.data.DataLoader(Refuses(), batch_size=4)

def shuffled():
    return torch.utils.data.DataLoader(Refuses(), batch_size=4, shuffle=True)
'''


def test_a_data_factory_returning_a_dataloader_gets_it_back_unread(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #21: data larger than memory streams; the setting's loader is never concatenated into tensors."""
    (tmp_path / "loaders.py").write_text(LOADER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("data", "monitor_data", "ood_data"):
        loader = load_dataset(make_settings(tmp_path, **{name: "loaders:ordered"}), name)
        assert isinstance(loader, torch.utils.data.DataLoader) and loader.batch_size == 4
    with pytest.raises(DataError, match="shuffl"):
        load_dataset(make_settings(tmp_path, data="loaders:shuffled"))
    sys.modules.pop("loaders", None)
