"""Cost before work and ``sample=`` end to end (issue #30 items 1 and 6).

A tiny project (a linear model on 60 4×4 inputs with a 3-condition scenario table): a gate whose
estimate exceeds ``max_seconds`` is an error within seconds naming the estimate, the budget and the
knobs; a gate within the budget records its estimate; ``sample=N`` gives the same subsample, value
and verdict on repeated runs with the same seed, records it in the evidence (N, seed, digest,
stratification), changes with the seed, and bad values are clear errors; ``--strict-markers`` takes
the new keywords.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import GateProject

N = 60
CONFTEST = """
import pytest
import torch


@pytest.fixture(scope="session")
def model():
    linear = torch.nn.Linear(16, 3)
    with torch.no_grad():  # the class is the brightest of the first three pixels: the labels' rule
        linear.weight.zero_()
        linear.bias.zero_()
        linear.weight[[0, 1, 2], [0, 1, 2]] = 10.0
    return torch.nn.Sequential(torch.nn.Flatten(), linear).eval()
"""
CONDITIONS = """\
[conditions]
light = ["day", "night", "dusk"]
"""


def _project(gate_project: GateProject, gates: dict[str, str]) -> GateProject:
    rng = np.random.default_rng(0)
    x = rng.random((N, 1, 4, 4), dtype=np.float32)
    y = x.reshape(N, 16)[:, :3].argmax(1)
    y[::6] = (y[::6] + 1) % 3  # some mistakes
    path = gate_project.pytester.path / "data"
    path.mkdir(exist_ok=True)
    np.savez(path / "eval.npz", x=x, y=y)
    # 30 day, 20 night, 10 dusk rows
    light = ["day"] * 30 + ["night"] * 20 + ["dusk"] * 10
    gate_project.write("data/scenarios.csv", "light\n" + "\n".join(light) + "\n")
    gate_project.write("data/conditions.toml", CONDITIONS)
    gate_project.write("conftest.py", CONFTEST)
    gate_project.ini["dnnsafety_data"] = "data/eval.npz"
    body = "\n\n".join(f"@pytest.mark.{marker}\ndef test_{name}():\n    pass" for name, marker in gates.items())
    gate_project.tests("import pytest\n\n\n" + body + "\n")
    return gate_project


def _gates(project: GateProject) -> dict[str, dict]:
    evidence = json.loads((project.pytester.path / "evidence.json").read_text())
    return {g["nodeid"].split("::test_")[1]: g for g in evidence["gates"]}


def test_over_budget_is_refused_within_seconds_naming_the_estimate_and_knobs(gate_project: GateProject) -> None:
    project = _project(gate_project, {
        "attack": "max_adversarial_confidence_loss(0.5, eps=0.1, steps=10000, max_seconds=0.5)",
        "cheap": 'min_scenario_accuracy(0.0, by=["light"], min_samples=1, max_seconds=60)',
    })
    start = time.perf_counter()
    result = project.run("--dnnsafety-json=evidence.json", "--strict-markers")
    elapsed = time.perf_counter() - start
    assert elapsed < 10
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "max_seconds=0.5" in out and "estimated" in out and "refused before measuring" in out
    for knob in ("sample=N", "fewer images", "steps=", "families="):
        assert knob in out
    gates = _gates(project)
    attack, cheap = gates["attack"], gates["cheap"]
    assert attack["status"] == "error"
    assert attack["details"]["cost_estimate"]["estimated_seconds"] > 0.5
    assert attack["details"]["cost_estimate"]["forwards"] >= N * 30_000
    assert cheap["status"] == "passed"
    assert cheap["details"]["cost_estimate"]["forwards"] == N  # one pass over the data
    assert cheap["details"]["cost_estimate"]["seconds_per_forward"] > 0


HICCUP = """
import time

import pytest
import torch

from pytest_dnnsafety.engines.core import guard


class Hiccup(torch.nn.Module):
    \"\"\"The tiny linear reader, but its first three probed forwards wait 30 ms each: a busy spell on a shared machine.\"\"\"

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.slow = 3

    def forward(self, x):
        if guard.probing() and self.slow > 0:
            self.slow -= 1
            time.sleep(0.03)
        return self.net(x)


@pytest.fixture(scope="session")
def model():
    linear = torch.nn.Linear(16, 3)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
        linear.weight[[0, 1, 2], [0, 1, 2]] = 10.0
    return Hiccup(torch.nn.Sequential(torch.nn.Flatten(), linear)).eval()
"""


def test_a_busy_moment_during_the_probe_does_not_refuse_the_gate(gate_project: GateProject) -> None:
    """The first probe reads 7.5 ms per forward (60 inputs: 0.45 s > max_seconds=0.2); a refusal is confirmed by
    a second, longer probe first, which finds the forward's own cost, so the gate runs."""
    project = _project(gate_project, {"cheap": 'min_scenario_accuracy(0.0, by=["light"], min_samples=1, max_seconds=0.2)'})
    project.write("conftest.py", HICCUP)
    result = project.run("--dnnsafety-json=evidence.json")
    result.assert_outcomes(passed=1)
    estimate = _gates(project)["cheap"]["details"]["cost_estimate"]
    assert estimate["seconds_per_forward"] < 1e-3 and estimate["estimated_seconds"] < 0.2


def test_budget_from_the_setting_and_zero_turns_it_off(gate_project: GateProject) -> None:
    project = _project(gate_project, {"attack": "max_adversarial_confidence_loss(1.0, eps=0.1, steps=300)"})
    result = project.run("--dnnsafety-json=evidence.json", "--dnnsafety-max-seconds=0.001")
    result.assert_outcomes(failed=1)
    assert "from command-line option --dnnsafety-max-seconds" in result.stdout.str()
    result = project.run("--dnnsafety-json=evidence.json", "--dnnsafety-max-seconds=none")
    result.assert_outcomes(passed=1)
    assert _gates(project)["attack"]["details"]["cost_estimate"]["estimated_seconds"] > 0


def test_sample_is_seeded_stratified_recorded_and_repeatable(gate_project: GateProject) -> None:
    gate = 'min_scenario_accuracy(0.0, by=["light"], min_samples=1, sample=12)'
    project = _project(gate_project, {"sampled": gate, "whole": 'min_scenario_accuracy(0.0, by=["light"], min_samples=1)'})
    runs = []
    for _ in range(2):
        project.run("--dnnsafety-json=evidence.json", "--strict-markers").assert_outcomes(passed=2)
        runs.append(_gates(project))
    first, second = runs[0]["sampled"], runs[1]["sampled"]
    sample = first["details"]["sample"]
    assert sample["n"] == 12 and sample["of"] == N and sample["seed"] == 1234
    assert sample["stratified_by"].startswith("scenario table")
    assert sample["groups"] == 3 and sample["groups_sampled"] == 3
    assert second["details"]["sample"] == sample
    assert (first["value"], first["bound"], first["status"]) == (second["value"], second["bound"], second["status"])
    assert "sample" not in runs[0]["whole"]["details"]
    # proportional: 6 day, 4 night, 2 dusk rows
    assert {g["key"]["light"]: g["size"] for g in first["details"]["groups"]} == {"day": 6, "night": 4, "dusk": 2}
    # every bound computed on the 12 inputs, nothing scaled back up: the lower bound is lower than on all 60
    assert first["details"]["n"] == 12
    assert first["bound"] < runs[0]["whole"]["bound"]
    project.ini["dnnsafety_seed"] = "99"
    project.run("--dnnsafety-json=evidence.json").assert_outcomes(passed=2)
    assert _gates(project)["sampled"]["details"]["sample"]["indices_sha256"] != sample["indices_sha256"]


@pytest.mark.parametrize("value, problem", [
    ("0", "must be >= 1"), ("-3", "must be >= 1"), ("2.5", "whole number"), ('"many"', "whole number"),
])
def test_bad_sample_on_a_marker_is_a_collection_error(gate_project: GateProject, value: str, problem: str) -> None:
    project = _project(gate_project, {"bad": f'min_scenario_accuracy(0.0, by=["light"], sample={value})'})
    result = project.run()
    out = result.stdout.str()
    assert result.ret != 0
    assert "sample" in out and problem in out and "Fix:" in out


def test_sample_bigger_than_the_data_names_the_fixture_and_fix(gate_project: GateProject) -> None:
    project = _project(gate_project, {"big": 'min_scenario_accuracy(0.0, by=["light"], sample=61)'})
    result = project.run("--dnnsafety-json=evidence.json")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "sample=61" in out and "holds only 60 inputs" in out and "Fix: use sample= at most 60" in out


def test_bad_settings_are_errors_naming_the_setting(gate_project: GateProject) -> None:
    project = _project(gate_project, {"ok": 'min_scenario_accuracy(0.0, by=["light"])'})
    for option, problem in (("--dnnsafety-sample=0", "dnnsafety_sample"),
                            ("--dnnsafety-max-seconds=-1", "dnnsafety_max_seconds")):
        result = project.run(option)
        assert result.ret != 0
        assert problem in result.stdout.str() + result.stderr.str()
