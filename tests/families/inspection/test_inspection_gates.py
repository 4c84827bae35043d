"""The DeepInspect gates end to end, on real images and a conv model (scikit-learn's digits).

A user project with the example's digits CNN and 300 held-out digits. The healthy model passes
``max_class_confusion(0.8)`` and ``max_class_bias`` on its first dense layer, with the class names in the
details and one forward pass for every gate. A plainly wrong model — the same features, its classifier
retrained on data whose 1 and 7 labels were mixed up — has 1 and 7 nearly indistinguishable in that layer
and fails the same gate, naming the pair. Bad inputs (two classes for the bias, a class never predicted, an
unknown layer) are errors naming the fix; bad marker arguments are collection errors; ``-n 2`` equals serial.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import GateProject
from _digits import _all_digits, digits_cnn, digits_images
from _digits_project import COUNTING_CONFTEST, digits_project, forward_rows, gates_of, write_digits_files
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.engines.inspection.deepinspect import inspect_classes
from pytest_dnnsafety.engines.inspection.kernels import layer_activity
from pytest_dnnsafety.gates import BUILTIN_FAMILIES

#: Until the family is registered as a built-in, the pytester runs load it as a plugin.
PLUGIN = () if "pytest_dnnsafety.gates.inspection" in BUILTIN_FAMILIES else ("-p", "pytest_dnnsafety.gates.inspection")

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
LAYER = "classifier.0"  # the first dense layer's output (before its ReLU), 64 units


def _mixed_17_state() -> dict[str, torch.Tensor]:
    """The digits CNN with its classifier retrained (features frozen) on labels where 1 and 7 are a coin flip."""
    net = digits_cnn()
    x, y = _all_digits()
    x, y = x[:1200], y[:1200].clone()
    gen = torch.Generator().manual_seed(0)
    pair = (y == 1) | (y == 7)
    coin = torch.rand(y.shape[0], generator=gen) < 0.5
    y[pair] = torch.where(coin[pair], torch.tensor(1), torch.tensor(7))
    with torch.no_grad():
        feats = net.flatten(net.features(x))
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(200):  # full batch: a second or two
        opt.zero_grad()
        nn.functional.cross_entropy(head(feats), y).backward()
        opt.step()
    net.classifier.load_state_dict(head.state_dict())
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    torch.save(_mixed_17_state(), root / "models" / "mixed17.pt")
    x, y = digits_images()
    keep = (y[1200:] == 0) | (y[1200:] == 1)
    np.savez(root / "data" / "two.npz", x=x[1200:][keep].numpy(), y=y[1200:][keep].numpy())
    return root


def _run(project: GateProject, *args: str, subprocess: bool = False):
    return project.run("--dnnsafety-json=evidence.json", *PLUGIN, *args, subprocess=subprocess)


MIXED_17 = """
    from pathlib import Path

    import pytest
    import torch
    import netdef


    @pytest.fixture(scope="session")
    def model():  # the classifier was retrained on data whose 1 and 7 labels were mixed up
        net = netdef.build()
        net.load_state_dict(torch.load(Path(__file__).parent / "models" / "mixed17.pt", weights_only=True))
        return net.eval()
"""

NEVER_SEVEN = """
    import pytest
    import torch
    import netdef


    @pytest.fixture(scope="session")
    def model():  # output 7 can never win: its bias is -1000
        net = netdef.trained()
        with torch.no_grad():
            net.classifier[2].bias[7] = -1000.0
        return net
"""

TWO_CLASSES = """
    import pytest
    import netdef


    class ZeroOrOne(netdef.DigitsCNN):
        def forward(self, x):
            return super().forward(x)[:, :2]


    @pytest.fixture(scope="session")
    def model():
        net = ZeroOrOne()
        net.load_state_dict(netdef.trained().state_dict())
        return net.eval()
"""

HEALTHY = {
    "confusion": f"max_class_confusion(0.8, layer={LAYER!r}, classes={NAMES!r})",
    "share": f"max_class_confusion(0.3, layer={LAYER!r}, statistic='share')",
    "top": f"max_class_confusion(0.8, layer={LAYER!r}, rule='top', top_share=0.05)",
    "bias": f"max_class_bias(0.25, layer={LAYER!r}, classes={NAMES!r})",
    "conv": "max_class_confusion(1.0, layer='features.2', activation_threshold=0.4)",
}


def _expected(model: torch.nn.Module, layer: str = LAYER, threshold: float = 0.5):
    """The engine in-process on the same 300 digits, batch size 128 as the project."""
    x, y = digits_images()
    x, y = x[1200:1500], y[1200:1500]
    outs: list = []
    acts = capture(model, (x, y), [layer], batch_size=128, outputs=outs)[layer]
    return inspect_classes(layer_activity(acts, threshold), outs[0].predictions, y, num_classes=10, classes=NAMES)


def test_healthy_model_passes_with_class_names_in_one_forward_pass(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, HEALTHY, COUNTING_CONFTEST)
    result = _run(project)
    assert result.ret == 0, result.stdout.str()
    assert forward_rows(project) == 300  # every gate, both layers, one pass over the 300 digits
    gates = gates_of(project)
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(HEALTHY, "passed")
    expected = _expected(digits_cnn())
    conf = gates["confusion"]
    assert conf["value"] == pytest.approx(expected.max_confusion(), abs=1e-12)
    d = conf["details"]
    assert d["layer"] == LAYER and d["statistic"] == "confusion" and d["classes"] == NAMES
    assert d["n_inputs"] == 300 and d["n_neurons"] == 64 and d["pairs_total"] == 45 and d["unpredicted"] == []
    napvd = np.asarray(d["napvd"], dtype=float)
    assert napvd.shape == (10, 10) and np.array_equal(napvd, napvd.T) and (np.diag(napvd) == 0).all()
    assert conf["value"] == pytest.approx(1 - napvd[np.triu_indices(10, 1)].min())
    worst = d["pairs"][0]
    assert set(worst["pair"]) <= set(NAMES) and worst["confusion"] == pytest.approx(conf["value"])
    truth = d["ground_truth"]["confusion"]
    assert 0 <= truth["aucec"] <= 1 and truth["aucec_random"] == 0.5 and truth["ground_truth_pairs"] >= 1
    assert gates["share"]["value"] == pytest.approx(expected.confused_share())
    assert gates["share"]["value"] == d["confused_share"]
    assert gates["top"]["value"] == conf["value"] and gates["top"]["details"]["confused_pairs"] == 3  # ⌈0.05·45⌉
    bias = gates["bias"]
    assert bias["value"] == pytest.approx(expected.max_bias(), abs=1e-12) and 0 <= bias["value"] < 0.25
    assert bias["details"]["pairs"][0]["avg_bias"] == bias["value"] and bias["details"]["label_filter"] is True
    assert gates["conv"]["details"]["n_neurons"] == 32
    result.stdout.fnmatch_lines(["*test_confusion*max_class_confusion*PASS*"])


def test_a_model_mixing_up_1_and_7_fails_naming_the_pair(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, {"confusion": HEALTHY["confusion"]}, MIXED_17)
    result = _run(project)
    assert result.ret != 0
    gate = gates_of(project)["confusion"]
    assert gate["status"] == "failed" and gate["value"] > 0.85, gate["value"]
    worst = gate["details"]["pairs"][0]
    assert worst["pair"] == ["one", "seven"] and worst["confused"] and worst["ground_truth_confused"]
    assert worst["type1"] > 0.3  # the labels confirm it: a third of the 1s and 7s go to the other class
    assert gate["details"]["ground_truth"]["confusion"]["aucec"] > 0.9
    result.stdout.fnmatch_lines(["*max_class_confusion*worst pair one–seven: NAPVD*"])


def test_a_class_never_predicted_is_an_error_unless_excluded(gate_project: GateProject, files: Path) -> None:
    gates = {"strict": HEALTHY["confusion"],
             "exclude": f"max_class_confusion(0.8, layer={LAYER!r}, classes={NAMES!r}, unpredicted='exclude')",
             "bias": f"max_class_bias(0.25, layer={LAYER!r}, classes={NAMES!r}, unpredicted='exclude')"}
    project = digits_project(gate_project, files, gates, NEVER_SEVEN)
    result = _run(project)
    assert result.ret != 0
    got = gates_of(project)
    assert got["strict"]["status"] == "error"
    result.stdout.fnmatch_lines(["*class(es) seven were never predicted on the 300 inputs*Fix: *"
                                 "unpredicted='exclude'*"])
    assert got["exclude"]["status"] in ("passed", "failed")
    # without seven no NAPVD of the nine classes falls below the bias cutoff: every avg_bias is 0 for want of
    # evidence, which is inconclusive, never a pass (issue #19 §4)
    assert got["bias"]["status"] == "inconclusive" and got["bias"]["value"] is None
    assert "below the bias cutoff" in got["bias"]["details"]["inconclusive"]
    for name in ("exclude", "bias"):
        d = got[name]["details"]
        assert d["unpredicted"] == ["seven"]
        assert d["pairs_total"] == 36 and "never predicted: seven" in d["warnings"][0]
        assert d["napvd"][7][0] is None


def test_two_classes_give_confusion_but_the_bias_gate_is_an_error(gate_project: GateProject, files: Path) -> None:
    gates = {"bias": f"max_class_bias(0.25, layer={LAYER!r})", "confusion": f"max_class_confusion(0.99, layer={LAYER!r})"}
    project = digits_project(gate_project, files, gates, TWO_CLASSES, data="data/two.npz")
    result = _run(project)
    assert result.ret != 0
    got = gates_of(project)
    assert got["bias"]["status"] == "error"
    assert got["confusion"]["status"] == "passed" and got["confusion"]["details"]["pairs_total"] == 1
    result.stdout.fnmatch_lines(["*avg_bias needs at least three predicted classes*Fix: *max_class_confusion works "
                                 "with two*"])


def test_an_unknown_layer_is_an_error_naming_similar_layers(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, {"typo": "max_class_confusion(0.8, layer='classifer.0')"})
    result = _run(project)
    assert result.ret != 0
    assert gates_of(project)["typo"]["status"] == "error"
    result.stdout.fnmatch_lines(["*unknown layer 'classifer.0' (did you mean 'classifier.0'*Fix: use a name from "
                                 "model.named_modules(): *"])


def test_xdist_equals_serial(gate_project: GateProject, files: Path) -> None:
    gates = {k: HEALTHY[k] for k in ("confusion", "share", "bias")}
    project = digits_project(gate_project, files, gates)
    assert _run(project).ret == 0
    serial = {name: (g["value"], g["details"]["pairs"]) for name, g in gates_of(project).items()}
    assert _run(project, "-n", "2", subprocess=True).ret == 0
    parallel = {name: (g["value"], g["details"]["pairs"]) for name, g in gates_of(project).items()}
    assert parallel == serial


BAD_MARKERS = [
    ("max_class_confusion(1.5, layer='fc')", "max_class_confusion: argument threshold*outside*"),
    ("max_class_bias(0.6, layer='fc')", "max_class_bias: argument threshold*outside ?0.0, 0.5?*"),
    ("max_class_confusion(0.5)", "max_class_confusion: argument layer: missing*"),
    ("max_class_confusion(0.5, layer='')", "max_class_confusion: argument layer*non-empty*"),
    ("max_class_confusion(0.5, layer='fc', activation_threshold=0)",
     "max_class_confusion: argument activation_threshold*0 is outside (0, 1)*"),
    ("max_class_bias(0.1, layer='fc', activation_threshold=1.5)",
     "max_class_bias: argument activation_threshold*1.5 is outside (0, 1)*"),
    ("max_class_confusion(0.5, layer='fc', statistic='mean')", "max_class_confusion: argument statistic*'mean'*"),
    ("max_class_confusion(0.5, layer='fc', rule='median')", "max_class_confusion: argument rule*'median'*"),
    ("max_class_confusion(0.5, layer='fc', top_share=0)", "max_class_confusion: argument top_share*outside*"),
    ("max_class_confusion(0.5, layer='fc', reduce='min')", "max_class_confusion: argument reduce*'min'*"),
    ("max_class_confusion(0.5, layer='fc', classes=['a', 'a'])", "max_class_confusion: argument classes*twice*"),
    ("max_class_bias(0.1, layer='fc', unpredicted='ignore')", "max_class_bias: argument unpredicted*'ignore'*"),
    ("max_class_bias(0.1, layer='fc', label_filter='yes')", "max_class_bias: argument label_filter*expected bool*"),
    ("max_class_bias(0.1, layer='fc', statistic='share')", "max_class_bias: argument statistic*unknown keyword*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n")
    result = gate_project.run(*PLUGIN)
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.{expected}Fix: *"])


def test_the_gate_definitions_are_well_formed() -> None:
    from pytest_dnnsafety.gates.inspection import MAX_CLASS_BIAS, MAX_CLASS_CONFUSION

    for gate in (MAX_CLASS_CONFUSION, MAX_CLASS_BIAS):
        assert gate.problems() == []
    assert MAX_CLASS_BIAS.threshold_range == (0.0, 0.5) and math.isclose(MAX_CLASS_CONFUSION.threshold_range[1], 1)
