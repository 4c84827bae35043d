"""The performance-per-scenario gates end to end, on real images and a conv model (scikit-learn's digits).

A user project with the example's digits CNN, 300 held-out digits and a scenario table whose
``lighting`` condition (day / dusk / night) darkens the images: night images are scaled to 30 % of
their brightness, so the model does worse there. The healthy model passes sensible thresholds, a
plainly wrong model fails, three perfect samples do not pass on luck, bad inputs (an unknown
condition, a group without rows, a misaligned table) are clear errors or failures naming the group,
``-n 2`` gives the serial numbers and bad marker arguments are collection errors.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from _digits import digits_cnn, digits_images
from conftest import GateProject
from _digits_project import COUNTING_CONFTEST, NETDEF, digits_project, gates_of, forward_rows


LIGHT = {"day": 1.0, "dusk": 0.6, "night": 0.3}
N = 300

CONDITIONS = """\
[conditions]
lighting = ["day", "dusk", "night"]
camera = ["a", "b"]
weather = ["clear", "fog", "snow"]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits_scenarios")
    (root / "models").mkdir()
    (root / "data").mkdir()
    model = digits_cnn()
    torch.save(model.state_dict(), root / "models" / "digits.pt")
    x, y = digits_images()
    x, y = x[1200:1200 + N].clone(), y[1200:1200 + N]
    lighting = [list(LIGHT)[i % 3] for i in range(N)]
    x *= torch.tensor([LIGHT[v] for v in lighting]).reshape(-1, 1, 1, 1)
    with torch.no_grad():
        right = (model(x).argmax(1) == y).numpy()
    # three day-lit digits the model gets right are the only foggy ones: a perfect, tiny group
    fog = [i for i in range(N) if lighting[i] == "day" and right[i]][:3]
    rows = ["lighting,camera,weather"] + [f"{lighting[i]},{'ab'[(i // 3) % 2]},{'fog' if i in fog else 'clear'}"
                                          for i in range(N)]
    np.savez(root / "data" / "eval.npz", x=x.numpy(), y=y.numpy())
    (root / "data" / "scenarios.csv").write_text("\n".join(rows) + "\n")
    (root / "data" / "short.csv").write_text("\n".join(rows[:-1]) + "\n")
    (root / "data" / "conditions.toml").write_text(CONDITIONS)
    (root / "netdef.py").write_text(NETDEF)
    return root


def _project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "") -> GateProject:
    return digits_project(gate_project, files, gates, conftest)


def _run(project: GateProject, *args: str, subprocess: bool = False) -> pytest.RunResult:
    return project.run("--dnnsafety-json=evidence.json", *args, subprocess=subprocess)


def _gates(project: GateProject) -> dict[str, dict]:
    return gates_of(project)


HEALTHY = {
    "accuracy": 'min_scenario_accuracy(0.7, by=["lighting"])',
    "degradation": 'max_scenario_degradation(0.15, by=["lighting"])',
    "two_conditions": 'min_scenario_accuracy(0.6, by=["lighting", "camera"], per_class=True)',
    "bound": 'max_scenario_degradation(0.25, by=["lighting"], statistic="bound")',
}


def test_healthy_model_passes_and_night_is_its_worst_group(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, HEALTHY)
    result = _run(project)
    assert result.ret == 0, result.stdout.str()
    gates = _gates(project)
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(HEALTHY, "passed")
    acc = gates["accuracy"]
    d = acc["details"]
    assert d["worst_group"] == "lighting=night" and d["n"] == N
    assert [g["size"] for g in d["groups"]] == [100, 100, 100]
    night = d["groups"][0]
    assert acc["value"] == pytest.approx(night["accuracy"]) and acc["bound"] == pytest.approx(night["lower"])
    assert night["lower"] < night["accuracy"] < min(g["accuracy"] for g in d["groups"][1:])
    assert d["scenario_coverage"] == 1.0 and d["coverage_discounted"] == pytest.approx(d["accuracy"])
    deg = gates["degradation"]
    assert deg["value"] == pytest.approx(d["accuracy"] - night["accuracy"]) and deg["bound"] is None
    assert gates["bound"]["bound"] > gates["bound"]["value"] == pytest.approx(deg["value"])
    two = gates["two_conditions"]["details"]
    assert len(two["groups"]) == 6 and sum(g["size"] for g in two["groups"]) == N
    assert all(len(g["recall"]) == 10 for g in two["groups"])
    assert "worst group lighting=night" in acc["summary"]


def test_one_forward_pass_serves_every_gate(gate_project: GateProject, files: Path) -> None:
    gates = {**HEALTHY, "neurons": 'min_neuron_k_activation(0.0, layer="features.1", k=1)'}
    project = _project(gate_project, files, gates, COUNTING_CONFTEST)
    assert _run(project).ret == 0
    assert forward_rows(project) == N


def test_a_plainly_wrong_model_fails(gate_project: GateProject, files: Path) -> None:
    conftest = """
        import pytest
        import torch
        import netdef


        @pytest.fixture(scope="session")
        def model():
            net = netdef.trained()
            with torch.no_grad():
                net.classifier[2].weight.mul_(-1)
                net.classifier[2].bias.mul_(-1)
            return net
    """
    project = _project(gate_project, files, {"accuracy": HEALTHY["accuracy"]}, textwrap.dedent(conftest))
    assert _run(project).ret != 0
    gate = _gates(project)["accuracy"]
    assert gate["status"] == "failed" and gate["bound"] < 0.05, gate


def test_a_stricter_threshold_fails_on_the_dark_scenario(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {"accuracy": 'min_scenario_accuracy(0.9, by=["lighting"])',
                                             "degradation": 'max_scenario_degradation(0.02, by=["lighting"])'})
    result = _run(project)
    assert result.ret != 0
    gates = _gates(project)
    assert gates["accuracy"]["status"] == gates["degradation"]["status"] == "failed"
    assert gates["degradation"]["details"]["degradation_group"] == "lighting=night"
    result.stdout.fnmatch_lines(["*max_scenario_degradation*lighting=night*"])


def test_three_perfect_samples_do_not_pass_on_luck(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {
        "lucky": 'min_scenario_accuracy(0.5, by=["weather"], min_samples=1, allow_empty_groups=True)',
        "small": 'min_scenario_accuracy(0.5, by=["weather"], allow_empty_groups=True)',
    })
    result = _run(project)
    assert result.ret != 0
    gates = _gates(project)
    lucky = gates["lucky"]
    fog = next(g for g in lucky["details"]["groups"] if g["group"] == "weather=fog")
    assert (fog["size"], fog["correct"]) == (3, 3)
    assert lucky["status"] == "failed" and lucky["value"] == 1.0
    assert lucky["bound"] == pytest.approx(0.05 ** (1 / 3))
    small = gates["small"]  # default min_samples=30: the group is not assessable, and that is named
    assert small["status"] == "inconclusive"
    assert "weather=fog (3 rows)" in small["details"]["inconclusive"]


def test_a_group_with_no_rows_fails_naming_it_unless_allowed(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {
        "strict": 'max_scenario_degradation(0.5, by=["weather"], min_samples=1)',
        "allowed": 'max_scenario_degradation(0.5, by=["weather"], min_samples=1, allow_empty_groups=True)',
    })
    result = _run(project)
    assert result.ret != 0
    gates = _gates(project)
    assert gates["strict"]["status"] == "inconclusive"
    assert "weather=snow" in gates["strict"]["details"]["inconclusive"]
    assert gates["strict"]["details"]["empty_groups"] == ["weather=snow"]
    assert gates["allowed"]["status"] == "passed"
    assert gates["allowed"]["details"]["scenario_coverage"] == pytest.approx(2 / 3)
    result.stdout.fnmatch_lines(["*no rows: weather=snow*allow_empty_groups=True*"])


def test_an_unknown_condition_is_an_error_naming_the_known_ones(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {"accuracy": 'min_scenario_accuracy(0.5, by=["lighting", "season"])'})
    result = _run(project)
    assert result.ret != 0
    assert _gates(project)["accuracy"]["status"] == "error"
    result.stdout.fnmatch_lines(["*unknown condition(s) 'season'*conditions are: lighting, camera, weather*"])


def test_a_table_misaligned_with_the_data_is_an_error(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {"accuracy": HEALTHY["accuracy"]})
    project.ini["dnnsafety_scenarios"] = "data/short.csv"
    result = _run(project)
    assert result.ret != 0
    assert _gates(project)["accuracy"]["status"] == "error"
    result.stdout.fnmatch_lines(["*scenario table has 299 rows but the data has 300 samples*"])


def test_unlabelled_data_is_an_error(gate_project: GateProject, files: Path) -> None:
    conftest = """
        import numpy as np
        import pytest
        import torch


        @pytest.fixture(scope="session")
        def dataset():
            return torch.utils.data.TensorDataset(torch.from_numpy(np.load("data/eval.npz")["x"]))
    """
    project = _project(gate_project, files, {"accuracy": HEALTHY["accuracy"]}, textwrap.dedent(conftest))
    result = _run(project)
    assert _gates(project)["accuracy"]["status"] == "error"
    result.stdout.fnmatch_lines(["*has no labels*"])


@pytest.mark.slow
def test_xdist_gives_the_serial_numbers(gate_project: GateProject, files: Path) -> None:
    gates = {k: HEALTHY[k] for k in ("accuracy", "degradation")}
    project = _project(gate_project, files, gates)
    assert _run(project).ret == 0
    serial = {name: (g["value"], g["bound"]) for name, g in _gates(project).items()}
    assert _run(project, "-n", "2", subprocess=True).ret == 0
    assert {name: (g["value"], g["bound"]) for name, g in _gates(project).items()} == serial


BAD_MARKERS = [
    ("min_scenario_accuracy(0.9)", "argument by*missing*"),
    ("min_scenario_accuracy(0.9, by=[])", "argument by*empty*"),
    ("min_scenario_accuracy(0.9, by='')", "argument by*not a condition name*"),
    ("min_scenario_accuracy(0.9, by=['lighting', 'lighting'])", "argument by*twice*"),
    ("min_scenario_accuracy(0.9, by=[3])", "argument by*not a condition name*"),
    ("min_scenario_accuracy(0.9, by=['lighting'], confidence=1.0)", "argument confidence*strictly between*"),
    ("min_scenario_accuracy(0.9, by=['lighting'], min_samples=0)", "argument min_samples*outside*"),
    ("min_scenario_accuracy(0.9, by=['lighting'], allow_small_groups='yes')", "argument allow_small_groups*bool*"),
    ("max_scenario_degradation(0.1, by=['lighting'], statistic='mean')", "argument statistic*'mean' is not one of*"),
    ("max_scenario_degradation(1.5, by=['lighting'])", "argument threshold*outside*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n")
    result = gate_project.run()
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.{marker.split('(')[0]}: {expected}Fix: *"])


def test_a_user_metric_is_reported_per_group(gate_project: GateProject, files: Path) -> None:
    conftest = """
        def error_count(predictions, labels):
            return float((predictions != labels).sum())
    """
    project = _project(gate_project, files, {}, textwrap.dedent(conftest))
    project.tests(textwrap.dedent("""
        import pytest
        from conftest import error_count

        @pytest.mark.min_scenario_accuracy(0.0, by=["lighting"], min_samples=1, allow_empty_groups=True,
                                           metric=error_count)
        def test_acc(model, dataset, scenario_table):
            pass
    """))
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    details = _gates(project)["acc"]["details"]
    user = details["user_metric"]
    assert user["name"] == "error_count"
    groups = {g["label"] if "label" in g else " × ".join(f"{k}={v}" for k, v in g["key"].items()): g
              for g in details["groups"] if g["size"]}
    for label, value in user["per_group"].items():
        assert value == groups[label]["size"] - groups[label]["correct"]
    assert user["overall"] == sum(user["per_group"].values())


def test_a_model_wrong_only_at_dusk_fails_naming_dusk(gate_project: GateProject, files: Path) -> None:
    """A model that is right by day and at night but wrong at dusk (images scaled to 0.6): the healthy
    thresholds pass on a whole-data view, but the per-scenario gates must fail on dusk."""
    conftest = """
        import pytest
        import torch
        import netdef


        class WrongAtDusk(netdef.DigitsCNN):
            def forward(self, x):
                out = super().forward(x)
                peak = x.flatten(1).amax(dim=1)
                dusk = (peak > 0.45) & (peak < 0.75)
                return torch.where(dusk[:, None], out.roll(1, dims=1), out)


        @pytest.fixture(scope="session")
        def model():
            net = WrongAtDusk()
            net.load_state_dict(netdef.trained().state_dict())
            return net.eval()
    """
    project = _project(gate_project, files, {k: HEALTHY[k] for k in ("accuracy", "degradation")},
                       textwrap.dedent(conftest))
    result = _run(project)
    assert result.ret != 0
    gates = _gates(project)
    assert gates["accuracy"]["status"] == gates["degradation"]["status"] == "failed"
    assert gates["accuracy"]["details"]["groups"][0]["key"] == {"lighting": "dusk"}
    assert gates["accuracy"]["bound"] < 0.05
    result.stdout.fnmatch_lines(["*min_scenario_accuracy*lighting=dusk*"])
