"""The activation-reading gates on a deployed ``torch.export`` program (issue #21, item 3).

A ``.pt2`` program's module runs ATen operations inline, so forward hooks never fire on its layers;
the plugin reads them from the graph's nodes instead (:mod:`pytest_dnnsafety.files.pt2_taps`). For the
example project's digits CNN and the benchmark's ResNet-18-style CNN (width 8, 32x32) and ViT (dim 64,
depth 2, 32x32 patches of 8), each exported with a dynamic batch dimension, saved, and loaded through
the plugin's loader, the layer activations, the neuron, pattern, DeepInspect and feature-monitor
gates all give exactly the eager model's values in the same number of forward passes; the evidence
says the program was a torch.export program read from its graph nodes. Also: an unknown layer lists
the graph's modules, a module that returns a tuple (or is called twice) is refused with the reason,
and the user's module is left as it was.
"""

from __future__ import annotations

import copy
import warnings
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from _digits import DigitsCNN, digits_images
from _digits_project import NETDEF, digits_project, gates_of
from conftest import GateProject
from pytest_dnnsafety import Mahalanobis
from pytest_dnnsafety.engines.core.capture import ActivationCache, capture, layer_names
from pytest_dnnsafety.settings import SETTINGS, Settings
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.files.pt2_taps import graph_layers, is_exported_module
from pytest_dnnsafety.gates import evaluate, parse_marker
from pytest_dnnsafety.files.loading import load_model
from pytest_dnnsafety.files.provenance import fingerprint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scale_project"))
from scale_demo.models import resnet18, vit  # noqa: E402

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
#: The example project's trained weights (example_project/models), in the architecture of its digits_demo.model.
WEIGHTS = ROOT / "example_project" / "models" / "digits_cnn.pt"


def _digits_cnn() -> nn.Module:
    net = DigitsCNN()
    net.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    return net.eval()


def _settings(root: Path, **ini: str) -> Settings:
    values = {SETTINGS[name].ini: value for name, value in ini.items()}
    return Settings(cli={}, ini=values.get, env={}, ini_file=root / "pyproject.toml", invocation_dir=root)


def _export(model: nn.Module, x: torch.Tensor, path: Path) -> Any:
    """``model`` exported with a dynamic batch, saved to ``path`` and loaded back by the plugin's loader."""
    batch = torch.export.Dim("batch", min=1)
    torch.export.save(torch.export.export(model, (x[:2],), dynamic_shapes=({0: batch},)), str(path))
    return load_model(_settings(path.parent, model=path.name), CPU)


def _spread(model: nn.Module, head: nn.Linear, x: torch.Tensor) -> nn.Module:
    """Standardise the head's logits on ``x`` so that an untrained model predicts every class (DeepInspect needs it)."""
    with torch.no_grad():
        z = model(x)
        mean, std = z.mean(0), z.std(0)
        head.weight /= std.view(-1, 1)
        head.bias.sub_(mean).div_(std)
    return model


@dataclass
class Case:
    name: str
    eager: nn.Module
    exported: Any
    x: torch.Tensor
    y: torch.Tensor
    layers: dict[str, dict[str, Any]]  # gate kind -> the layer and options (where the values are not degenerate)


@pytest.fixture(scope="module", params=["digits_cnn", "resnet18", "vit"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    gen = torch.Generator().manual_seed(0)
    if request.param == "digits_cnn":
        x, y = digits_images(1500)
        x, y = x[1200:1296], y[1200:1296]  # digits the example's model did not train on
        eager = _digits_cnn()
        layers = {"neurons": {"layer": "classifier.1"}, "patterns": {"layer": "features.3"},
                  "inspect": {"layer": "classifier.1"}, "monitor": {"layer": "features.4"}}
    else:
        x = torch.rand(96, 3, 32, 32, generator=gen)
        if request.param == "resnet18":
            eager = resnet18(width=8, stem="cifar")
            eager = _spread(eager, eager.fc, x)
            layers = {"neurons": {"layer": "layer4.1.relu2"},
                      "patterns": {"layer": "layer4.1.relu2", "activation_threshold": 0.1},
                      "inspect": {"layer": "layer4.1.relu2", "reduce": "max"}, "monitor": {"layer": "layer4.1.relu2"}}
        else:
            eager = vit(image=32, patch=8, dim=64, depth=2, heads=2)
            eager = _spread(eager, eager.head, x)
            layers = {"neurons": {"layer": "blocks.1.mlp.act"},
                      "patterns": {"layer": "blocks.1.mlp.act", "activation_threshold": 0.1, "reduce": "mean"},
                      "inspect": {"layer": "patch_embed", "reduce": "max"}, "monitor": {"layer": "blocks.1"}}
        with torch.no_grad():
            y = eager(x).argmax(1)
        y[::7] = (y[::7] + 1) % 10  # a few mistakes
    exported = _export(eager, x, tmp_path_factory.mktemp(request.param) / "model.pt2")
    return Case(request.param, eager, exported, x, y, layers)


def test_the_loaded_program_is_an_exported_graph_without_hookable_layers(case: Case) -> None:
    assert is_exported_module(case.exported) and not is_exported_module(case.eager)
    called = {str(n.target) for n in case.exported.graph.nodes if n.op == "call_module"}
    assert not any(opts["layer"] in called for opts in case.layers.values())  # a hook would never fire
    eager_names = {name for name, _ in case.eager.named_modules() if name}
    assert set(layer_names(case.exported)) <= eager_names  # the eager model's names, as the gates take them


def test_capture_equals_the_eager_hooks_in_one_pass(case: Case) -> None:
    layers = [name for name in graph_layers(case.exported).outputs]  # every module with one output
    eager_out: list[Any] = []
    exported_out: list[Any] = []
    eager = capture(case.eager, (case.x, case.y), layers, batch_size=32, outputs=eager_out)
    exported = capture(case.exported, (case.x, case.y), layers, batch_size=32, outputs=exported_out)
    for layer in layers:
        got, want = exported[layer], eager[layer]
        assert got.unit_shape == want.unit_shape, layer
        for field in ("max", "mean", "min"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=1e-6, msg=layer)
    for field in ("predictions", "confidence", "labels", "logits"):
        torch.testing.assert_close(getattr(exported_out[0], field), getattr(eager_out[0], field), rtol=0, atol=1e-6)


def _gates(case: Case) -> dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]]:
    opts = case.layers
    return {
        "neurons": ("min_neuron_k_activation", (0.0,), {**opts["neurons"], "k": 2}),
        "patterns": ("max_neuron_pattern_deviation", (1.0,), {**opts["patterns"], "groups": 4}),
        "confusion": ("max_class_confusion", (1.0,), {**opts["inspect"], "unpredicted": "exclude"}),
        "bias": ("max_class_bias", (0.5,), {**opts["inspect"], "unpredicted": "exclude", "label_filter": False}),
        "detection": ("min_monitor_detection", (-1.0,), {"monitor": "maha", "faults": ["gaussian_noise", "impulse_noise"],
                                                         "severity": 3}),
        "risk": ("max_monitor_selective_risk", (1.0,), {"monitor": "maha"}),
    }


def _evaluate_all(case: Case, model: Any, root: Path) -> tuple[dict[str, Any], int]:
    """Every gate of :func:`_gates` on ``model``, sharing one session cache; (results, forward passes)."""
    settings = _settings(root, batch_size="32")
    fit = (case.x.flip(0), case.y.flip(0))  # other batches than the evaluation data: a pass of its own
    monitors = {"maha": Mahalanobis(layer=case.layers["monitor"]["layer"], reduce="mean")}
    fx = {"model": model, "data": (case.x, case.y), "fit_data": fit, "monitors": monitors}
    cache: dict[str, Any] = {}
    results = {}
    for name, (marker, args, kwargs) in _gates(case).items():
        spec = parse_marker(marker, args, kwargs, f"test_x.py::test_{name}")
        results[name] = evaluate(spec, {role: fx[role] for role in spec.fixtures if role in fx}, settings,
                                 f"test_x.py::test_{name}", cache)
    return results, cache["activations"].forward_passes


def test_every_activation_reading_gate_gives_the_eager_models_value(case: Case, tmp_path: Path) -> None:
    eager, eager_passes = _evaluate_all(case, case.eager, tmp_path)
    exported, exported_passes = _evaluate_all(case, case.exported, tmp_path)
    assert exported_passes == eager_passes  # fit data, evaluation data, each fault set: one pass each
    for name, want in eager.items():
        got = exported[name]
        assert want.status in ("passed", "failed", "inconclusive"), (name, want.details.get("error"))
        assert (got.status, got.value, got.bound) == (want.status, want.value, want.bound), name
        assert "activations_from" not in want.details
        assert got.details.pop("activations_from") == "exported graph nodes", name
        got.details.pop("cost_estimate", None), want.details.pop("cost_estimate", None)  # a probed timing: differs per run
        assert got.details == want.details, name


# ----------------------------------------------------------------------------------- refusals


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.relu(), x.sigmoid()


class _TupleNet(nn.Module):
    """``pair`` returns a tuple; ``act`` is called twice; ``skip`` (nn.Identity) computes nothing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.act, self.pair, self.skip, self.out = (nn.Linear(4, 6), nn.ReLU(), _Pair(), nn.Identity(),
                                                              nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.act(self.fc(x)) - 0.1)
        a, b = self.pair(h)
        return self.out(self.skip(a * b))


@pytest.fixture(scope="module")
def tuple_net(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Any]:
    eager = _TupleNet().eval()
    return eager, _export(eager, torch.rand(4, 4), tmp_path_factory.mktemp("tuple") / "tuple_net.pt2")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(20, 4, generator=torch.Generator().manual_seed(1)), torch.arange(20) % 3


def test_unknown_layer_lists_the_exported_graphs_modules(tuple_net: tuple[nn.Module, Any]) -> None:
    _, exported = tuple_net
    for layer in ("nope", "skip"):  # not a module; a module that left no node in the graph
        with pytest.raises(ConfigError) as info:
            capture(exported, _data(), [layer])
        message = str(info.value)
        assert message.startswith(f"unknown layer {layer!r}: the torch.export program's graph runs no module of "
                                  "that name")
        assert message.endswith("Fix: use a name from the exported graph's modules (as in the eager model's "
                                "named_modules()): fc, act, pair, out")
    settings = _settings(Path.cwd())
    for marker in ("min_neuron_k_activation", "max_class_confusion"):  # the gates say the same
        spec = parse_marker(marker, (0.5,), {"layer": "skip"}, "test_x.py::test_layer")
        result = evaluate(spec, {"model": exported, "data": _data()}, settings, "test_x.py::test_layer", {})
        assert result.status == "error"
        assert "unknown layer 'skip'" in result.details["error"]
        assert result.details["error"].endswith("graph's modules (as in the eager model's named_modules()): fc, act, "
                                                "pair, out")


def test_a_module_returning_a_tuple_or_called_twice_is_refused(tuple_net: tuple[nn.Module, Any]) -> None:
    _, exported = tuple_net
    with pytest.raises(ConfigError, match=r"^layer 'pair' of the torch.export program: its scope in the graph hands "
                                          r"on 2 value\(s\) \(graph node\(s\) \w+, \w+\): the module returns a tuple"):
        capture(exported, _data(), ["pair"])
    with pytest.raises(ConfigError, match="^layer 'act' of the torch.export program: the program calls this module "
                                          "2 times per forward pass"):
        ActivationCache().get(exported, _data(), ["act"], batch_size=8, device="cpu")
    eager, _ = tuple_net  # the layers that have one output still work, and equal the eager hooks
    want, got = capture(eager, _data(), ["fc", "out"]), capture(exported, _data(), ["fc", "out"])
    assert all(torch.equal(want[k].max, got[k].max) for k in ("fc", "out"))


def test_a_fixed_batch_program_fails_the_tapped_pass_as_the_plain_one(tmp_path: Path) -> None:
    """The tapped pass reports the program's own error, worded as for any model (here: the exported batch size)."""
    fixed = torch.export.export(_TupleNet().eval(), (torch.rand(4, 4),))
    torch.export.save(fixed, str(tmp_path / "fixed.pt2"))
    module = load_model(_settings(tmp_path, model="fixed.pt2"), CPU)
    messages = []
    for layers in ([], ["fc"]):
        with pytest.raises(MetricError) as info:
            capture(module, _data(), layers, batch_size=8)
        messages.append(str(info.value))
    # the same error, prefixed by what the pass read (outputs only, or outputs and the tapped layer)
    assert messages[0].startswith("the shared forward pass (model outputs): ")
    assert messages[1].startswith("the shared forward pass (model outputs and layer activations): ")
    assert messages[0].split("): ", 1)[1] == messages[1].split("): ", 1)[1]
    assert "the model raised AssertionError on batch 0 (inputs of shape (8, 4)" in messages[1]
    assert "export it with a dynamic batch dimension" in messages[1]
    assert capture(module, _data(), ["fc"], batch_size=4)["fc"].max.shape == (20, 6)


def test_the_users_module_is_unchanged_by_capture(case: Case) -> None:
    module = case.exported
    code, graph = module.code, module.graph
    nodes = [(n.name, n.op, str(n.target)) for n in graph.nodes]
    state = {k: v.clone() for k, v in module.state_dict().items()}
    names = [name for name, _ in module.named_modules()]
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in module.modules()]  # torch's own
    with torch.no_grad():
        before = module(case.x[:8])
    capture(module, (case.x, case.y), [opts["layer"] for opts in case.layers.values()], batch_size=32)
    assert module.code == code and module.graph is graph
    assert [(n.name, n.op, str(n.target)) for n in module.graph.nodes] == nodes
    assert [name for name, _ in module.named_modules()] == names
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    assert [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in module.modules()] == hooks
    with torch.no_grad():
        assert torch.equal(module(case.x[:8]), before)


def test_the_fingerprint_names_a_torch_export_program(case: Case) -> None:
    record = fingerprint(case.exported)
    assert record["model_format"] == "torch.export program"
    assert record["graph_digest"].startswith("sha256:") and record["digest"].startswith("sha256:")
    assert "model_format" not in fingerprint(case.eager)


# ------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def digits_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits project's files with the model as a .pt2 (exported here: an in-process pytester run must not
    import torch.export's modules itself)."""
    root = tmp_path_factory.mktemp("digits_pt2")
    for folder in ("models", "data"):
        (root / folder).mkdir()
    (root / "netdef.py").write_text(NETDEF)
    (root / "models" / "digits.pt").write_bytes(WEIGHTS.read_bytes())
    x, y = digits_images(1500)
    np.savez(root / "data" / "fit.npz", x=x[:1000].numpy(), y=y[:1000].numpy())
    np.savez(root / "data" / "eval.npz", x=x[1200:].numpy(), y=y[1200:].numpy())
    _export(_digits_cnn(), x, root / "models" / "digits.pt2")
    return root


def test_a_pt2_project_runs_the_gates_with_evidence_of_the_program(gate_project: GateProject,
                                                                    digits_files: Path) -> None:
    gates = {"coverage": 'min_neuron_k_activation(0.0, layer="classifier.1", k=2)',
             "confusion": 'max_class_confusion(1.0, layer="features.3")',
             "detection": 'min_monitor_detection(-1.0, monitor="maha", faults="gaussian_noise", severity=3)'}
    conftest = """
        import pytest
        from pytest_dnnsafety import Mahalanobis


        @pytest.fixture(scope="session")
        def monitors():
            return {"maha": Mahalanobis(layer="features.4", reduce="mean")}
    """
    project = digits_project(gate_project, digits_files, gates, conftest, monitor_data="data/fit.npz")
    eager_run = project.run("--dnnsafety-json=evidence.json")
    eager_run.assert_outcomes(passed=3)
    eager = gates_of(project)
    del project.ini["dnnsafety_model_factory"]
    project.ini["dnnsafety_model"] = "models/digits.pt2"
    project.run("--dnnsafety-json=evidence.json").assert_outcomes(passed=3)
    exported = gates_of(project)
    for name in gates:
        assert exported[name]["value"] == eager[name]["value"], name
        assert exported[name]["details"]["activations_from"] == "exported graph nodes"
        model = exported[name]["inputs"]["model"]
        assert model["model_format"] == "torch.export program"
        assert model["origin"]["settings"]["model"]["path"].endswith("digits.pt2")
        assert model["origin"]["settings"]["model"]["sha256"].startswith("sha256:")
    assert json.dumps(eager["coverage"]["details"]).count("activations_from") == 0


def test_a_broken_program_or_wrong_labels_never_pass(case: Case, tmp_path: Path) -> None:
    """Known answers on the deployed artifact: a program with a NaN weight errors on every gate, labels outside
    its classes error on every label-reading gate, and a threshold it misses fails as the eager model does."""
    if case.name != "digits_cnn":
        pytest.skip("one model suffices for the known answers")
    with warnings.catch_warnings():  # torch's own pytree spec warns on a deep copy of an exported module
        warnings.simplefilter("ignore", FutureWarning)
        broken = copy.deepcopy(case.exported)
    with torch.no_grad():
        next(p for p in broken.parameters() if p.ndim == 1).fill_(float("nan"))
    results, _ = _evaluate_all(case, broken, tmp_path)
    assert {name: r.status for name, r in results.items()} == dict.fromkeys(results, "error")
    wrong = Case(case.name, case.eager, case.exported, case.x, case.y + 42, case.layers)
    results, _ = _evaluate_all(wrong, case.exported, tmp_path)
    for name in ("confusion", "bias", "risk"):
        assert results[name].status == "error", (name, results[name].summary)
        assert "class" in results[name].details.get("error", results[name].summary), name
    settings = _settings(tmp_path, batch_size="32")
    spec = parse_marker("min_neuron_k_activation", (1.0,), {**case.layers["neurons"], "k": 2}, "t.py::t")
    got = evaluate(spec, {"model": case.exported, "data": (case.x, case.y)}, settings, "t.py::t", {})
    want = evaluate(spec, {"model": case.eager, "data": (case.x, case.y)}, settings, "t.py::t", {})
    assert got.status == want.status == "failed" and got.value == want.value < 1.0
