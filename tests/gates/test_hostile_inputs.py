"""Hostile and broken inputs, end to end: every case gets a clear first line and no gate passes.

One small but real user project (a trained conv net on 1×8×8 images, labelled evaluation data, a
scenario table with one row per sample, operational data) passes all its gates; each case below
breaks exactly one thing, as a new user or a corrupted pipeline would, and runs pytest on it.
Every case asserts

* the first line of the error the user reads (a pattern matched against a whole output line),
* that no gate passed (from the JSON evidence, when the run got far enough to write it),
* and that the run failed.

The catalogue is the answer to "what happens if ...": a case is named by what it tries.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

from conftest import GateProject

N = 48  # evaluation samples (and scenario rows)

NETMOD = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.classifier(self.features(x))


def build():
    return Net()


def trained():
    net = Net()
    net.load_state_dict(torch.load(__file__.replace("netmod.py", "model.pt"), weights_only=True))
    return net.eval()
'''

CONDITIONS = """\
[conditions]
light = ["day", "dusk", "night"]
blur = ["none", "low"]
"""


def _images(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Class c lights rows 3c..3c+1 of an 8×8 image; pixels in [0, 1]."""
    y = torch.randint(0, 3, (n,), generator=gen)
    x = torch.rand(n, 1, 8, 8, generator=gen) * 0.3
    for c in range(3):
        x[y == c, 0, 3 * c:3 * c + 2, :] += 0.6
    return x.clamp(0, 1), y


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The healthy project's files: netmod.py, model.pt (state dict), data/*."""
    root = tmp_path_factory.mktemp("healthy")
    (root / "netmod.py").write_text(NETMOD)
    namespace: dict = {}
    exec(compile(NETMOD, "netmod", "exec"), namespace)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = namespace["Net"]()
    x, y = _images(400, gen)
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    torch.save(net.state_dict(), root / "model.pt")
    data = root / "data"
    data.mkdir()
    xe, ye = _images(N, gen)
    np.savez(data / "eval.npz", x=xe.numpy(), y=ye.numpy())
    xo, _ = _images(N, gen)
    np.savez(data / "operation.npz", x=xo.numpy())
    xf, yf = _images(200, gen)  # what the runtime monitors are fitted on
    np.savez(data / "fit.npz", x=xf.numpy(), y=yf.numpy())
    lights, blurs = ["day", "dusk", "night"], ["none", "low"]
    rows = [f"{lights[i % 3]},{blurs[(i // 3) % 2]}" for i in range(N)]
    (data / "scenarios.csv").write_text("light,blur\n" + "\n".join(rows) + "\n")
    (data / "conditions.toml").write_text(CONDITIONS)
    return root


#: The healthy project's gates, by short name; thresholds every healthy measurement meets.
GATES = {
    "coverage": ("min_scene_coverage(0.5, k=2)", "scenario_table"),
    "kact": ('min_neuron_k_activation(0.0, layer="features.1", k=1)', "model, dataset"),
    "pattern": ('max_neuron_pattern_deviation(1.0, layer="classifier.2", groups=3, where={"light": "night"})',
                "model, dataset, scenario_table"),
    "pmi": ('max_pmi_ub(1.0, cells="balls", radius=0.05, norm="linf", clip=(0, 1), max_balls=6, '
            'samples_per_cell=20, bootstrap=0, labelled_from_profile=False, accept_violated_assumptions=True)',
            "model, operational_profile, dataset"),
    "adv": ('max_adversarial_confidence_loss(1.0, eps=0.05, families=["fgsm", "pgd", "rotation"], '
            'budgets={"rotation": 10}, clip=(0, 1))', "model, dataset"),
    "verified": ("min_verified_robustness(0.0, eps=0.01, clip=(0, 1))", "model, dataset"),
    "scenacc": ('min_scenario_accuracy(0.0, by=["light"], min_samples=1)', "model, dataset, scenario_table"),
    "confusion": ('max_weighted_confusion(100.0, severity={"0": {"1": 5.0}})', "model, dataset"),
    "detect": ('min_monitor_detection(-1.0, monitor="msp", faults=["black_frame", "gaussian_noise"], severity=3)',
               "model, dataset"),
    "risk": ('max_monitor_selective_risk(1.0, monitor="energy")', "model, dataset"),
}


@dataclass
class Case:
    """One hostile input: how to break the healthy project, which gates to run, what the user must read."""

    id: str
    gates: tuple[str, ...]
    expected: str  # fnmatch pattern of the error's first line, as printed
    breaks: Callable[[GateProject], None] = lambda project: None
    args: tuple[str, ...] = ()
    usage_error: bool = False
    extra: list[str] = field(default_factory=list)  # further patterns the output must hold


def _write(relpath: str, content: str | bytes) -> Callable[[GateProject], None]:
    def apply(project: GateProject) -> None:
        path = project.pytester.path / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content))
    return apply


def _ini(**values: str) -> Callable[[GateProject], None]:
    def apply(project: GateProject) -> None:
        for key, value in values.items():
            if value is None:
                project.ini.pop(f"dnnsafety_{key}", None)
            else:
                project.ini[f"dnnsafety_{key}"] = value
    return apply


def _both(*steps: Callable[[GateProject], None]) -> Callable[[GateProject], None]:
    def apply(project: GateProject) -> None:
        for step in steps:
            step(project)
    return apply


def _model_fixture(body: str) -> Callable[[GateProject], None]:
    """A conftest ``model`` fixture: the trained net, then ``body`` (which may change ``net``) returns it."""
    return _write("conftest.py", f"""
import pytest
import torch
from torch import nn

import netmod


@pytest.fixture(scope="session")
def model():
    net = netmod.trained()
{textwrap.indent(textwrap.dedent(body), "    ")}
""")


def _data_fixture(body: str) -> Callable[[GateProject], None]:
    """A data factory ``datamod:load`` returning what ``body`` builds from ``x``, ``y`` (the healthy data)."""
    return _both(
        _write("datamod.py", f"""
import numpy as np
import torch


def load():
    raw = np.load(__file__.replace("datamod.py", "data/eval.npz"))
    x, y = torch.from_numpy(raw["x"]), torch.from_numpy(raw["y"])
{textwrap.indent(textwrap.dedent(body), "    ")}
"""),
        _ini(data="datamod:load"),
    )


def _npz(relpath: str, **arrays: Callable[[dict], np.ndarray]) -> Callable[[GateProject], None]:
    """Rewrite an .npz file from the healthy one: each keyword maps the old arrays to a new array."""
    def apply(project: GateProject) -> None:
        path = project.pytester.path / relpath
        with np.load(path) as old:
            current = {key: old[key] for key in old.files}
        np.savez(path, **{key: make(current) for key, make in arrays.items()})
    return apply


def _mangle(relpath: str, how: str) -> Callable[[GateProject], None]:
    def apply(project: GateProject) -> None:
        path = project.pytester.path / relpath
        raw = path.read_bytes()
        if how == "truncate":
            path.write_bytes(raw[: len(raw) // 2])
        elif how == "random":
            path.write_bytes(np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8).tobytes())
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "crc":  # flip one byte inside the first stored member's data: the CRC check fails
            with zipfile.ZipFile(path) as archive:
                info = archive.infolist()[0]
            offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
            mangled = bytearray(raw)
            mangled[offset] ^= 0xFF
            path.write_bytes(bytes(mangled))
        elif how == "directory":
            path.unlink()
            path.mkdir()
        else:  # pragma: no cover
            raise ValueError(how)
    return apply


def _scenarios(rows: list[str], header: str = "light,blur") -> Callable[[GateProject], None]:
    return _write("data/scenarios.csv", header + "\n" + "\n".join(rows) + ("\n" if rows else ""))


def _healthy_rows(n: int = N) -> list[str]:
    lights, blurs = ["day", "dusk", "night"], ["none", "low"]
    return [f"{lights[i % 3]},{blurs[(i // 3) % 2]}" for i in range(n)]


CASES = [
    # ------------------------------------------------------------------ the model's outputs
    Case("model_logits_all_nan", ("kact", "pmi"),
         "*the model's outputs hold NaN/inf in * inputs; the first bad batch is batch 0*",
         _model_fixture('with torch.no_grad():\n    net.classifier[3].bias.fill_(float("nan"))\nreturn net')),
    Case("model_logits_positive_inf", ("kact", "pmi"),
         "*the model's outputs hold NaN/inf*first bad batch is batch 0*",
         _model_fixture('with torch.no_grad():\n    net.classifier[3].bias.fill_(float("inf"))\nreturn net')),
    Case("model_nan_in_some_rows", ("kact",),
         "*the model's outputs hold NaN/inf in * of 48 inputs; the first bad batch is batch 1*",
         _both(_model_fixture("""
             class Poisoned(netmod.Net):
                 batches = 0

                 def forward(self, x):
                     from pytest_dnnsafety.engines.core.guard import probing
                     out = super().forward(x)
                     if probing():  # the determinism probe: the same answer for the same input
                         return out
                     type(self).batches += 1
                     if type(self).batches == 2:  # one row of the second batch goes bad
                         out = out.clone()
                         out[0, 0] = float("nan")
                     return out
             poisoned = Poisoned()
             poisoned.load_state_dict(net.state_dict())
             return poisoned.eval()"""), _ini(batch_size="16"))),
    Case("model_bit_flipped_weight", ("kact", "pmi"),
         "*the model's outputs hold NaN/inf*",
         _model_fixture("""
             with torch.no_grad():
                 w = net.classifier[1].weight.view(-1).view(torch.int32)
                 w[:] = w | 0x7F800000  # every exponent bit set: inf/NaN weights
             return net""")),
    Case("model_raises_in_forward", ("kact", "pmi"),
         "*the model raised RuntimeError on batch 0 (inputs of shape (*, 1, 8, 8), float32, on cpu*",
         _model_fixture("""
             class Broken(nn.Module):
                 def forward(self, x):
                     raise RuntimeError("sensor driver not initialised")
             return Broken()""")),
    Case("model_expects_another_input_shape", ("kact", "pmi"),
         "*the model raised RuntimeError on batch 0*",
         _model_fixture("return nn.Sequential(nn.Flatten(), nn.Linear(10, 3))"),
         extra=["*Fix: give inputs in the shape the model expects*"]),
    Case("model_float64_weights_float32_data", ("kact", "pmi"),
         "*the model raised RuntimeError on batch 0*",
         _model_fixture("return net.double()"),
         extra=["*the inputs are float32 but the model's weights are float64*"]),
    Case("model_returns_one_score_per_input", ("pmi",),
         "*the model returned shape (48, 1)*A single score per input is ambiguous*",
         _model_fixture("return nn.Sequential(net, nn.Linear(3, 1))")),
    Case("model_returns_a_list", ("pmi",),
         "*the model returned shape (48,) (dtype torch.float64)*A 1-D output must hold integer class labels*",
         _model_fixture("""
             class Listy(nn.Module):
                 def forward(self, x):
                     return [1.0] * x.shape[0]
             return Listy()""")),
    Case("model_class_count_changes_between_batches", ("kact",),
         "*returned 4 class scores, expected 3*",
         _both(_model_fixture("""
             class Growing(netmod.Net):
                 calls = 0

                 def forward(self, x):
                     from pytest_dnnsafety.engines.core.guard import probing
                     out = super().forward(x)
                     if probing():  # the determinism probe: the same answer for the same input
                         return out
                     type(self).calls += 1
                     return out if type(self).calls == 1 else torch.cat([out, out[:, :1]], dim=1)
             grown = Growing()
             grown.load_state_dict(net.state_dict())
             return grown.eval()"""), _ini(batch_size="16"))),
    Case("model_drops_a_row_of_its_batch", ("kact",),
         "*the model returned shape (47, 3) for 48 inputs*",
         _model_fixture("""
             class Dropping(netmod.Net):
                 def forward(self, x):
                     return super().forward(x)[:-1]
             dropping = Dropping()
             dropping.load_state_dict(net.state_dict())
             return dropping.eval()""")),
    # ------------------------------------------------------------------ the model file
    Case("model_file_random_bytes", ("kact",),
         "*model.pt is not a valid model file: found 2048 bytes of unrecognised data*", _mangle("model.pt", "random")),
    Case("model_file_empty", ("kact",), "*model.pt is not a valid model file: found an empty file (0 bytes)*", _mangle("model.pt", "empty")),
    Case("model_file_truncated", ("kact",),
         "*model.pt is not a valid model file: found a truncated or damaged zip archive*", _mangle("model.pt", "truncate")),
    Case("model_path_is_a_directory", ("kact",), "*model.pt*directory*", _mangle("model.pt", "directory")),
    Case("model_factory_raises", ("kact",), "*netmod:exploding*RuntimeError*out of memory*",
         _both(_write("netmod.py", NETMOD + "\n\ndef exploding():\n    raise RuntimeError('out of memory')\n"),
               _ini(model_factory="netmod:exploding"))),
    Case("model_factory_missing", ("kact",), "*netmod:nothing*no attribute*", _ini(model_factory="netmod:nothing")),
    Case("model_state_dict_of_another_architecture", ("kact",), "*state dict does not fit the module*",
         _both(_write("netmod.py", NETMOD + "\n\ndef other():\n    return nn.Linear(64, 3)\n"),
               _ini(model_factory="netmod:other"))),
    Case("model_saved_as_a_full_pickle", ("kact",), "*refused to unpickle model.pt*",
         lambda project: torch.save(nn.Linear(2, 3), project.pytester.path / "model.pt")),
    Case("model_torchscript_archive_with_broken_code", ("kact",), "*model.pt is not a valid TorchScript archive*",
         lambda project: _broken_torchscript(project.pytester.path / "model.pt")),
    Case("model_pt2_exported_with_a_fixed_batch_size", ("pmi",),
         "*the model raised AssertionError on batch 0 (inputs of shape (48, 1, 8, 8)*Guard failed: x.size()[[]0] == 7*",
         lambda project: _fixed_batch_export(project), extra=["*export it with a dynamic batch dimension*"]),
    # ------------------------------------------------------------------ the data
    Case("data_with_nan", ("kact", "pmi"), "*x holds 1 NaN/inf value(s)*",
         _npz("data/eval.npz", x=lambda a: np.where(np.arange(a["x"].size).reshape(a["x"].shape) == 7, np.nan, a["x"]),
              y=lambda a: a["y"])),
    Case("data_with_inf", ("kact",), "*x holds 2 NaN/inf value(s)*",
         _npz("data/eval.npz", x=lambda a: np.where(np.arange(a["x"].size).reshape(a["x"].shape) < 2, np.inf, a["x"]),
              y=lambda a: a["y"])),
    Case("data_empty", ("kact",), "*no samples*",
         _npz("data/eval.npz", x=lambda a: a["x"][:0], y=lambda a: a["y"][:0])),
    Case("data_more_labels_than_inputs", ("kact",), "*x has 47 samples but y has 48 labels*",
         _npz("data/eval.npz", x=lambda a: a["x"][:-1], y=lambda a: a["y"])),
    Case("data_fractional_labels", ("pmi",), "*labels y must be integer class indices*",
         _npz("data/eval.npz", x=lambda a: a["x"], y=lambda a: a["y"] + 0.5)),
    Case("data_without_key_x", ("kact",), "*expected keys 'x'*",
         _npz("data/eval.npz", images=lambda a: a["x"], y=lambda a: a["y"])),
    Case("data_npz_random_bytes", ("kact",),
         "*eval.npz is not a valid NumPy .npz file: found 2048 bytes of unrecognised data*", _mangle("data/eval.npz", "random")),
    Case("data_npz_truncated", ("kact",),
         "*eval.npz is not a valid NumPy .npz file: found a truncated or damaged zip archive*", _mangle("data/eval.npz", "truncate")),
    Case("data_npz_crc_corrupted", ("kact",),
         "*eval.npz is not a valid NumPy .npz file: found a damaged zip archive (member 'x.npy': *Bad CRC-32*", _mangle("data/eval.npz", "crc")),
    Case("data_path_is_a_directory", ("kact",), "*eval.npz*directory*", _mangle("data/eval.npz", "directory")),
    Case("data_npy_object_array", ("kact",),
         "*eval.npy holds pickled objects, which are refused: an object array (dtype object)*",
         _both(lambda project: np.save(project.pytester.path / "data/eval.npy",
                                       np.array([{"x": 1}, None], dtype=object), allow_pickle=True),
               _ini(data="data/eval.npy"))),
    Case("data_pt_holding_a_python_object", ("kact",),
         "*eval.pt holds Python objects, not only tensors; refused (weights_only=True): test_hostile_inputs._Meta*",
         _both(lambda project: torch.save({"x": torch.zeros(3, 1, 8, 8), "meta": _Meta()},
                                          project.pytester.path / "data/eval.pt"),
               _ini(data="data/eval.pt"))),
    Case("data_negative_labels", ("pmi",),
         "*max_pmi_ub: cannot compute pmi upper bound: labels must be non-negative class indices, found -1. Fix:*",
         _npz("data/eval.npz", x=lambda a: a["x"], y=lambda a: a["y"] - 1)),
    Case("data_factory_returns_none", ("kact",), "*dnnsafety_data='datamod:load'*the factory returned None*",
         _data_fixture("return None")),
    Case("data_unknown_suffix", ("kact",), "*unknown suffix '.csv'*", _ini(data="data/scenarios.csv")),
    Case("data_factory_raises", ("kact",), "*datamod:load*ValueError*",
         _data_fixture("raise ValueError('bucket not mounted')")),
    Case("data_factory_shuffles_rows", ("pattern",), "*DataLoader shuffles*",
         _data_fixture("return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, "
                       "shuffle=True)")),
    Case("data_in_wrong_layout_for_the_model", ("kact", "pmi"), "*the model raised RuntimeError on batch 0*",
         _data_fixture("return x.reshape(x.shape[0], 64), y")),
    Case("labels_beyond_the_models_classes", ("pmi",),
         "*max_pmi_ub: cannot compute pmi upper bound: labelled data holds class 7 but the model has 3 classes. Fix:*",
         _npz("data/eval.npz", x=lambda a: a["x"], y=lambda a: a["y"] + 5)),
    # ------------------------------------------------------------------ the scenario table
    Case("scenarios_with_rows_describing_no_sample", ("coverage",),
         "*the scenario table has 52 rows but the data has 48 samples*",
         _scenarios(_healthy_rows() + ["night,low"] * 4)),
    Case("scenarios_shorter_than_the_data", ("coverage", "pattern"),
         "*the scenario table has 40 rows but the data has 48 samples*",
         _scenarios(_healthy_rows(40))),
    Case("scenarios_value_outside_the_domain", ("coverage",),
         "*scenarios.csv', line 49, column 1 ('light'): value 'foggy' is not in the domain*",
         _scenarios(_healthy_rows(N - 1) + ["foggy,none"])),
    Case("scenarios_missing_a_condition_column", ("coverage",),
         "*scenarios.csv', line 1: missing column(s) for condition(s) 'blur'*",
         _scenarios([row.split(",")[0] for row in _healthy_rows()], header="light")),
    Case("scenarios_empty_table", ("coverage",), "*the scenario table has 0 rows but the data has 48 samples*",
         _scenarios([])),
    Case("scenarios_break_a_declared_restriction", ("coverage",), "*row*night*low*",
         _both(_write("data/conditions.toml", CONDITIONS + '\n[[restrictions]]\nlight = "night"\nblur = "low"\n'))),
    Case("conditions_toml_is_not_toml", ("coverage",), "*conditions.toml' is not valid TOML: Expected ']'*",
         _write("data/conditions.toml", "[conditions\nlight = day\n")),
    Case("conditions_file_missing", ("coverage",), "*dnnsafety_conditions='data/nothing.toml'*file not found*",
         _ini(conditions="data/nothing.toml")),
    Case("where_names_an_unknown_condition", ("pattern",), "*where: unknown condition 'season'; use one of light, blur*",
         _write("test_gates.py", """
             import pytest

             @pytest.mark.max_neuron_pattern_deviation(1.0, layer="classifier.2", where={"season": "winter"})
             def test_gate(model, dataset, scenario_table):
                 pass
         """)),
    Case("where_selects_no_rows", ("pattern",), "*no inputs match where*",
         _write("data/scenarios.csv", "light,blur\n" + "\n".join(r.replace("night", "dusk") for r in _healthy_rows())
                + "\n")),
    # ------------------------------------------------------------------ layers
    Case("layer_that_does_not_exist", ("kact",), "*unknown layer 'features.9'*",
         _write("test_gates.py", """
             import pytest

             @pytest.mark.min_neuron_k_activation(0.0, layer="features.9")
             def test_gate(model, dataset):
                 pass
         """)),
    Case("torchscript_model_in_a_neuron_gate", ("kact",), "*TorchScript*",
         _model_fixture("return torch.jit.script(net)")),
    # ------------------------------------------------------------------ the operational profile
    Case("operational_data_with_nan", ("pmi",), "*operational data*NaN/inf*",
         _npz("data/operation.npz", x=lambda a: np.where(np.arange(a["x"].size).reshape(a["x"].shape) == 0, np.nan,
                                                        a["x"]))),
    Case("operational_data_unset", ("pmi",), "*dnnsafety_operational_data is unset*", _ini(operational_data=None)),
    Case("pmi_constant_model_refuted_by_the_labels", ("pmi",), "*max_pmi_ub: contradiction: *",
         _both(_model_fixture("""
             class Constant(nn.Module):
                 def forward(self, x):
                     return torch.tensor([[5.0, 0.0, 0.0]]).expand(x.shape[0], 3)
             return Constant()"""), _write("test_gates.py", """
             import pytest

             @pytest.mark.max_pmi_ub(0.5, cells="balls", radius=0.05, clip=(0, 1), max_balls=6, samples_per_cell=20,
                                     bootstrap=0, accept_violated_assumptions=True)
             def test_pmi(model, operational_profile, dataset):
                 pass
         """))),
    Case("pmi_radius_beyond_r_hat_is_inconclusive", ("pmi",), "*max_pmi_ub: inconclusive: *",
         _write("test_gates.py", """
             import pytest

             @pytest.mark.max_pmi_ub(1.0, cells="balls", radius=0.9, clip=(0, 1), max_balls=6, samples_per_cell=20,
                                     bootstrap=0, labelled_from_profile=False)
             def test_pmi(model, operational_profile, dataset):
                 pass
         """)),
    Case("pmi_without_labels", ("pmi",), "*has no labels*",
         _npz("data/eval.npz", x=lambda a: a["x"])),
    # ------------------------------------------------------------------ robustness
    Case("robustness_model_logits_all_nan", ("adv", "verified"),
         "*the model's outputs hold NaN/inf in * inputs; the first bad batch is batch 0*",
         _model_fixture('with torch.no_grad():\n    net.classifier[3].bias.fill_(float("nan"))\nreturn net')),
    Case("robustness_model_without_gradient", ("adv",), "*differentiable*",
         _model_fixture("""
             class Frozen(netmod.Net):
                 def forward(self, x):
                     with torch.no_grad():
                         return super().forward(x)
             frozen = Frozen()
             frozen.load_state_dict(net.state_dict())
             return frozen.eval()""")),
    Case("robustness_unsupported_layer", ("verified",), "*layer 'classifier.4' (Softmax) is not supported*",
         _model_fixture("net.classifier.append(nn.Softmax(dim=1))\nreturn net")),
    Case("robustness_data_outside_the_valid_range", ("adv", "verified"), "*outside*clip*",
         _data_fixture("return x * 3 - 1, y")),
    Case("robustness_data_without_labels", ("adv", "verified"), "*no labels*",
         _npz("data/eval.npz", x=lambda a: a["x"])),
    Case("robustness_torchscript_model_in_the_certified_gate", ("verified",), "*TorchScript*",
         _model_fixture("return torch.jit.script(net)")),
    # ------------------------------------------------------------------ predictions from the shared pass
    Case("prediction_gates_model_logits_all_nan", ("scenacc", "confusion", "kact", "detect", "risk"),
         "*the model's outputs hold NaN/inf in * inputs; the first bad batch is batch 0*",
         _model_fixture('with torch.no_grad():\n    net.classifier[3].bias.fill_(float("nan"))\nreturn net')),
    Case("prediction_gates_scenarios_shorter_than_the_data", ("scenacc",), "*46 rows*48 samples*",
         _scenarios(_healthy_rows(46))),
    Case("prediction_and_robustness_gates_data_shuffled", ("scenacc", "confusion", "adv", "verified", "detect",
                                                           "risk"),
         "*DataLoader shuffles*",
         _data_fixture("return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, "
                       "shuffle=True)")),
    Case("prediction_gates_data_without_labels", ("scenacc", "confusion", "risk"), "*no labels*",
         _npz("data/eval.npz", x=lambda a: a["x"])),
    # ------------------------------------------------------------------ runtime monitors
    Case("monitor_fit_data_empty", ("detect", "risk"), "*monitor fitting data*Fix*",
         _npz("data/fit.npz", x=lambda a: a["x"][:0], y=lambda a: a["y"][:0])),
    Case("monitor_fit_data_of_another_shape", ("detect", "risk"), "*'monitor_data' has inputs of shape (1, 6, 8)*",
         _npz("data/fit.npz", x=lambda a: a["x"][:, :, :6], y=lambda a: a["y"])),
    Case("monitor_fit_data_with_nan", ("detect",), "*NaN*",
         _npz("data/fit.npz", x=lambda a: np.where(np.arange(8) == 3, np.nan, a["x"]).astype(np.float32),
              y=lambda a: a["y"])),
    Case("monitor_eval_data_outside_the_fault_range", ("detect",), "*clip*",
         _data_fixture("return x * 3 - 1, y")),
    # ------------------------------------------------------------------ settings
    Case("seed_beyond_64_bits", ("kact",), "*dnnsafety_seed='100000000000000000000000'*", _ini(seed="1" + "0" * 23),
         usage_error=True),
    Case("device_cuda_without_cuda", ("kact",), "*CUDA is not available*", _ini(device="cuda")),
    Case("operational_data_empty", ("pmi",), "*operational data*no samples*",
         _npz("data/operation.npz", x=lambda a: a["x"][:0])),
    Case("batch_size_zero_in_the_ini", ("kact",), "*dnnsafety_batch_size='0' (from ini option*must be >= 1*",
         _ini(batch_size="0"), usage_error=True),
    Case("json_path_inside_a_file", ("kact",), "*--dnnsafety-json*", args=("--dnnsafety-json=data/eval.npz/e.json",),
         usage_error=True),
    Case("json_path_is_a_directory", ("kact",), "*--dnnsafety-json*directory*", args=("--dnnsafety-json=.",),
         usage_error=True),
]


class _Meta:
    """A Python object inside a data file: unpickling it would import this test module."""


def _broken_torchscript(path: Path) -> None:
    """A zip laid out like a TorchScript archive whose code is garbage."""
    path.unlink()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/code/__torch__.py", "def forward(self, x):\n    return ???\n")
        archive.writestr("model/data.pkl", b"\x80\x02}q\x00.")
        archive.writestr("model/constants.pkl", b"\x80\x02)q\x00.")
        archive.writestr("model/version", "3\n")


def _fixed_batch_export(project: GateProject) -> None:
    """The trained net exported by torch.export for batches of exactly 7 images."""
    namespace: dict = {}
    exec(compile(NETMOD, "netmod", "exec"), namespace)
    net = namespace["Net"]()
    net.load_state_dict(torch.load(project.pytester.path / "model.pt", weights_only=True))
    program = torch.export.export(net.eval(), (torch.rand(7, 1, 8, 8),))
    torch.export.save(program, project.pytester.path / "model.pt2")
    project.ini["dnnsafety_model"] = "model.pt2"


def _gate_module(names: tuple[str, ...]) -> str:
    lines = ["import pytest", ""]
    for name in names:
        marker, fixtures = GATES[name]
        lines += [f"@pytest.mark.{marker}", f"def test_{name}({fixtures}):", "    pass", ""]
    return "\n".join(lines)


def _setup(project: GateProject, healthy: Path, gates: tuple[str, ...]) -> None:
    for item in healthy.iterdir():
        target = project.pytester.path / item.name
        if item.is_dir():
            shutil.copytree(item, target, dirs_exist_ok=True)
        else:
            shutil.copy(item, target)
    project.ini.clear()
    project.ini.update({
        "dnnsafety_model": "model.pt",
        "dnnsafety_model_factory": "netmod:build",
        "dnnsafety_data": "data/eval.npz",
        "dnnsafety_scenarios": "data/scenarios.csv",
        "dnnsafety_conditions": "data/conditions.toml",
        "dnnsafety_operational_data": "data/operation.npz",
        "dnnsafety_monitor_data": "data/fit.npz",
        "dnnsafety_seed": "7",
        "dnnsafety_device": "cpu",
    })
    project.tests(_gate_module(gates))
    project.pytester.syspathinsert()


def _evidence(project: GateProject) -> dict | None:
    path = project.pytester.path / "evidence.json"
    return json.loads(path.read_text()) if path.is_file() else None


def test_the_healthy_project_passes_every_gate(gate_project: GateProject, healthy: Path) -> None:
    """The baseline the cases break: all gates compute and pass."""
    _setup(gate_project, healthy, tuple(GATES))
    result = gate_project.run("--dnnsafety-json=evidence.json")
    assert result.ret == 0, result.stdout.str()
    evidence = _evidence(gate_project)
    assert [g["status"] for g in evidence["gates"]] == ["passed"] * len(GATES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input_gets_a_clear_error_and_no_gate_passes(gate_project: GateProject, healthy: Path,
                                                            case: Case) -> None:
    _setup(gate_project, healthy, case.gates)
    case.breaks(gate_project)
    result = gate_project.run("--dnnsafety-json=evidence.json", *case.args)
    output = result.stdout.lines + result.stderr.lines
    assert result.ret != 0, "\n".join(output)
    if case.usage_error:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(output)
    result_lines = pytest.LineMatcher(output)
    result_lines.fnmatch_lines([case.expected, *case.extra])
    evidence = _evidence(gate_project)
    if evidence is not None:
        assert not [g for g in evidence["gates"] if g["status"] == "passed"], evidence["gates"]
    assert "passed" not in result.parseoutcomes() if not case.usage_error else True
