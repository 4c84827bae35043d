"""The DeepQuant gate ``min_safe_radius`` end to end, on real images and a conv model (scikit-learn's digits).

A user project with the example's digits CNN and held-out digits as ``(N, 1, 8, 8)`` images in
``[0, 1]`` (the gates read the first 40 through a ``small`` fixture, to keep the pattern search
quick on a CPU). The healthy model passes sensible thresholds with the certified radius (the
default statistic), the estimate beside it, the PGD check's counts and the worst inputs in the
details; a noise-sensitive model (a logit that oscillates with the input) is inconclusive by
default (the bounds do not cover it, the reason given) and fails with ``statistic='estimate'``; a
model whose cliff the search misses fails by default, and with ``statistic='estimate'`` the PGD
check names the inputs; ``-n 2`` gives the same numbers; bad arguments are collection errors, or
gate errors naming the fix where only the model can tell. The family is passed with ``-p`` until the
plugin lists it among its built-ins.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from _details import reproducible
from _digits_project import digits_project, gates_of, write_digits_files
from conftest import GateProject

PLUGIN: tuple[str, ...] = ()  # the family is built in (registered in gates.BUILTIN_FAMILIES)

SMALL = """
    from pathlib import Path

    import numpy as np
    import pytest
    import torch


    @pytest.fixture(scope="session")
    def small():
        data = np.load(Path(__file__).parent / "data" / "eval.npz")
        return torch.as_tensor(data["x"][:40]), torch.as_tensor(data["y"][:40])
"""

STEEP = """
    import netdef
    from torch import nn


    class Steep(nn.Module):
        \"\"\"The digits CNN plus a class-0 logit that oscillates with the sum of the pixels (period ≈ 0.02).\"\"\"

        def __init__(self):
            super().__init__()
            self.net = netdef.trained()

        def forward(self, x):
            z = self.net(x)
            wobble = 20 * torch.sin(300 * x.flatten(1).sum(dim=1))
            return z + nn.functional.pad(wobble[:, None], (0, z.shape[1] - 1))


    @pytest.fixture(scope="session")
    def model():
        return Steep().eval()
"""

HEALTHY = {
    "runner_up": "min_safe_radius(0.001, d=0.05, iterations=10, data='small')",
    "uncertainty": ("min_safe_radius(0.05, expression='uncertainty', eps=0.5, norm='l2', d=0.5, quantile=0.5, "
                    "method='mads', iterations=10, starts=1, certified='ibp', certified_steps=6, statistic='estimate', "
                    "data='small')"),
}

CLIFF = """
    import pytest
    import torch
    from torch import nn


    @pytest.fixture(scope="session")
    def model():
        \"\"\"Margin 1.5 − 0.5·(u + 1) − 200·relu(u − 0.05), u = mean(x − 0.5): zero at u ≈ 0.0575.\"\"\"
        first, last = nn.Linear(16, 2).double(), nn.Linear(2, 2).double()
        with torch.no_grad():
            first.weight.fill_(1.0 / 16)
            first.bias.copy_(torch.tensor([-0.55, 0.5]))
            last.weight.copy_(torch.tensor([[-200.0, -0.5], [0.0, 0.0]]))
            last.bias.copy_(torch.tensor([1.5, -0.5]))
        return nn.Sequential(first, nn.ReLU(), last).eval()


    @pytest.fixture(scope="session")
    def centres():
        x = torch.full((3, 16), 0.5, dtype=torch.float64)
        return x, torch.zeros(3, dtype=torch.int64)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    return root


def _project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "") -> GateProject:
    return digits_project(gate_project, files, gates, textwrap.dedent(SMALL) + textwrap.dedent(conftest))


def _run(project: GateProject, *args: str, subprocess: bool = False) -> pytest.RunResult:
    return project.run(*PLUGIN, "--dnnsafety-json=evidence.json", *args, subprocess=subprocess)


def test_healthy_digits_cnn_passes(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, HEALTHY)
    result = _run(project)
    assert result.ret == 0, result.stdout.str()
    gates = gates_of(project)
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(HEALTHY, "passed")
    runner_up, unc = gates["runner_up"], gates["uncertainty"]
    details = runner_up["details"]
    assert details["n"] == 40 and details["n_applicable"] == 40 and details["quantile"] == 0.0
    assert 0.001 <= runner_up["value"] <= 0.05
    assert details["statistic"] == "certified" and details["statistic_label"] == "certified (CROWN)"
    assert runner_up["value"] == details["certified"]["min"] and details["estimate"]["min"] > 0
    pgd = details["pgd_check"]
    assert pgd["checked"] == 40 and pgd["closer_than_gated"] == 0 and pgd["closer_than_gated_first"] == []
    assert pgd["steps"] == 10 and pgd["restarts"] == 2
    assert details["settings"]["expression"] == "top_vs_runner_up" and details["settings"]["norm"] == "linf"
    assert details["settings"]["method"] == "gps" and details["settings"]["starts"] == 2
    cert = details["certified"]
    assert cert["method"] == "crown" and 0 < cert["min"] <= 0.05 and cert["value"] == cert["min"]
    worst = details["worst"]
    assert len(worst) == 5 and worst[0]["gated"] == worst[0]["certified"] == runner_up["value"]
    assert [w["gated"] for w in worst] == sorted(w["gated"] for w in worst)
    for entry in worst:
        assert 0 <= entry["index"] < 40 and len(entry["x_hat"]) == 64
        assert entry["linf_distance"] <= 0.05 + 1e-6 and entry["q"] > 0
        assert entry["certified"] is not None and entry["certified"] <= (entry["unsafe_distance"] or 1.0)
    assert unc["details"]["settings"]["norm"] == "l2" and unc["details"]["certified"]["method"] == "ibp"
    assert unc["value"] == pytest.approx(unc["details"]["estimate"]["median"])
    assert unc["details"]["statistic_label"] == "estimate (heuristic lower bound on Q ⇒ not a guarantee)"
    result.stdout.fnmatch_lines(["*min_safe_radius*"])


def test_a_noise_sensitive_model_fails(gate_project: GateProject, files: Path) -> None:
    estimate = HEALTHY["runner_up"].replace("data=", "statistic='estimate', data=")
    project = _project(gate_project, files, {"runner_up": estimate, "default": HEALTHY["runner_up"]}, STEEP)
    result = _run(project)
    assert result.ret != 0
    gates = gates_of(project)
    default = gates["default"]  # nothing sound to gate: the bounds do not cover the model
    assert default["status"] == "inconclusive", default
    why = default["details"]["inconclusive"]
    assert "statistic='certified'" in why and "statistic='estimate'" in why and "'sum" in why
    gate = gates["runner_up"]
    assert gate["status"] == "failed" and gate["value"] < 0.001, gate
    details = gate["details"]
    assert details["certified"] is None
    assert "'sum" in details["certified_reason"] and "not supported by certified bounds" in details["certified_reason"]
    assert details["worst"][0]["q"] > 100  # the search found the steep logit


def test_same_seed_same_numbers_and_xdist_agrees(gate_project: GateProject, files: Path) -> None:
    gates = {**HEALTHY, "mads": "min_safe_radius(0.0, d=0.05, method='mads', iterations=5, starts=3, "
                                "certified=False, statistic='estimate', data='small')"}
    project = _project(gate_project, files, gates)
    assert _run(project).ret == 0
    serial = {name: (g["value"], reproducible(g["details"])) for name, g in gates_of(project).items()}
    assert _run(project, "-n", "2", subprocess=True).ret == 0
    parallel = {name: (g["value"], reproducible(g["details"])) for name, g in gates_of(project).items()}
    assert parallel == serial


def test_an_adversarial_example_inside_the_estimate_fails_the_gate(gate_project: GateProject, files: Path) -> None:
    """The search misses the cliff (no gradient seeds, 3 polls) and estimates the radius at d = 0.1; PGD finds s < 0
    inside it. By default the gate compares the certified radius (≈ 0.057 < 0.08) and fails; with
    statistic='estimate' the PGD check refutes the estimate and names the inputs. With the default seeds the estimate
    is below the true radius (0.0575) and the gate at 0.005 passes."""
    common = "d=0.1, iterations=3, ascent_starts=0, data='centres'"
    gates = {"default": f"min_safe_radius(0.08, {common})",
             "estimate": f"min_safe_radius(0.08, statistic='estimate', {common})",
             "seeded": "min_safe_radius(0.005, d=0.1, iterations=3, statistic='estimate', data='centres')"}
    project = digits_project(gate_project, files, gates, textwrap.dedent(CLIFF))
    result = _run(project)
    assert result.ret != 0
    got = gates_of(project)
    default, estimate, seeded = got["default"], got["estimate"], got["seeded"]
    assert default["status"] == "failed" and default["value"] <= 0.0575, default
    assert default["details"]["pgd_check"]["closer_than_estimate"] == 3
    assert "certified (CROWN)" in default["summary"]
    assert estimate["status"] == "failed" and estimate["value"] == 0.1  # above the threshold: failed by the check
    assert "#0, #1, #2" in estimate["details"]["contradiction"]
    assert estimate["details"]["pgd_check"]["closer_than_gated_first"] == [0, 1, 2]
    assert "estimate (heuristic lower bound on Q ⇒ not a guarantee)" in estimate["summary"]
    assert seeded["status"] == "passed" and seeded["value"] < 0.0575, seeded
    result.stdout.fnmatch_lines(["*adversarial example (s < 0) closer than their gated radius*#0, #1, #2*"])


RUN_ERRORS = [
    ("min_safe_radius(0.001, expression='top_vs_label', label=12, d=0.05, iterations=2, data='small')",
     "*label=12 is not a class of the model: it returns 10 class scores*Fix: give a label in ?0, 9?*"),
    ("min_safe_radius(0.001, expression='top_vs_label', d=0.05, iterations=2, data='small')",
     "*expression='top_vs_label' needs label=*Fix: *"),
    ("min_safe_radius(0.001, expression='uncertainty', label=3, d=0.05, iterations=2, data='small')",
     "*label=3 is used only by the expressions*Fix: drop label=*"),
    ("min_safe_radius(0.001, d=0.05, clip=(0, 0.5), iterations=2, data='small')",
     "*input value(s) lie outside the valid range clip=(0.0, 0.5)*Fix: give the range the data lives in*"),
    ("min_safe_radius(0.001, d=0.05, eps=2.0, iterations=2, data='small')", "*eps=2.0 exceeds 1*Fix: *"),
    ("min_safe_radius(0.001, d=0.05, certified=False, iterations=2, data='small')",
     "*statistic='certified' (the default) gates the certified radius, but certified=False*Fix: *"),
    ("min_safe_radius(0.001, d=0.05, search='coordinate', max_queries=1000, data='small')",
     "*search='coordinate' on inputs of 64 elements is estimated at 27,695 forwards per input*above "
     "max_queries=1,000; refused before any work. Fix: *"),
]


@pytest.mark.parametrize(("marker", "expected"), RUN_ERRORS, ids=[m.split(", d=")[0] for m, _ in RUN_ERRORS])
def test_arguments_only_the_model_or_data_can_refuse_are_gate_errors(gate_project: GateProject, files: Path,
                                                                      marker: str, expected: str) -> None:
    project = _project(gate_project, files, {"bad": marker})
    result = _run(project)
    assert result.ret != 0
    assert gates_of(project)["bad"]["status"] == "error"
    result.stdout.fnmatch_lines([expected])


BAD_MARKERS = [
    ("min_safe_radius(0.01, d=0)", "argument d*positive*"),
    ("min_safe_radius(0.01, d=-0.1)", "argument d*positive*"),
    ("min_safe_radius(0.01, d=float('nan'))", "argument d*NaN*"),
    ("min_safe_radius(0.01)", "argument d*missing*"),
    ("min_safe_radius(0.01, d=0.1, norm='l3')", "argument norm*'l3' is not one of*"),
    ("min_safe_radius(0.01, d=0.1, expression='margin')", "argument expression*'margin' is not one of*"),
    ("min_safe_radius(0.01, d=0.1, method='cma')", "argument method*'cma' is not one of*"),
    ("min_safe_radius(0.01, d=0.1, label=-1)", "argument label*not a class index*"),
    ("min_safe_radius(0.01, d=0.1, label='7')", "argument label*expected int or None*"),
    ("min_safe_radius(0.01, d=0.1, quantile=1.5)", "argument quantile*outside*"),
    ("min_safe_radius(0.01, d=0.1, eps=-0.1)", "argument eps*>= 0*"),
    ("min_safe_radius(0.01, d=0.1, iterations=0)", "argument iterations*outside*"),
    ("min_safe_radius(0.01, d=0.1, certified='exact')", "argument certified*'exact' is not True, False*"),
    ("min_safe_radius(0.01, d=0.1, contraction=1.5)", "argument contraction*strictly between 0 and 1*"),
    ("min_safe_radius(0.01, d=0.1, expansion=0.5)", "argument expansion*>= 1*"),
    ("min_safe_radius(0.01, d=0.1, clip=(1, 0))", "argument clip*low < high*"),
    ("min_safe_radius(-0.01, d=0.1)", "argument threshold*outside*"),
    ("min_safe_radius(0.01, d=0.1, radius=3)", "argument radius*unknown keyword*"),
    ("min_safe_radius(0.01, d=0.1, statistic='upper')", "argument statistic*'upper' is not one of*"),
    ("min_safe_radius(0.01, d=0.1, ascent_starts=-1)", "argument ascent_starts*outside*"),
    ("min_safe_radius(0.01, d=0.1, search='grid')", "argument search*'grid' is not one of*"),
    ("min_safe_radius(0.01, d=0.1, max_queries=0)", "argument max_queries*outside*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n")
    result = gate_project.run(*PLUGIN)
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.min_safe_radius: {expected}Fix: *"])


NAN_LOGITS = """
    import netdef
    from torch import nn


    class NaNWhenDark(nn.Module):
        \"\"\"The digits CNN, but NaN logits wherever the top-left pixel is blank (most digits).\"\"\"

        def __init__(self):
            super().__init__()
            self.net = netdef.trained()

        def forward(self, x):
            z = self.net(x)
            blank = x.flatten(1)[:, :1] == 0
            return torch.where(blank, torch.full_like(z, float("nan")), z)


    @pytest.fixture(scope="session")
    def model():
        return NaNWhenDark().eval()
"""


def test_nan_logits_are_an_error_for_both_statistics_and_every_search(gate_project: GateProject, files: Path) -> None:
    """A model that returns NaN on some inputs never passes, whichever radius the gate compares and whichever search
    (the coordinate search, the batched gradient search, the bounds only) ran."""
    estimate = HEALTHY["runner_up"].replace("data=", "statistic='estimate', data=")
    gradient = HEALTHY["runner_up"].replace("data=", "search='gradient', data=")
    certified = HEALTHY["runner_up"].replace("data=", "search='certified', data=")
    markers = {"default": HEALTHY["runner_up"], "estimate": estimate, "gradient": gradient, "certified": certified}
    project = _project(gate_project, files, markers, NAN_LOGITS)
    assert _run(project).ret != 0
    for name, gate in gates_of(project).items():
        assert gate["status"] == "error", (name, gate)
        assert "nan" in gate["summary"].lower(), (name, gate["summary"])
