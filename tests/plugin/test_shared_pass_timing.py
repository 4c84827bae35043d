"""Honest timing (issue #30, item 8): the session's shared forward pass is its own entry (time, images/s) in the
evidence, the terminal, the JUnit file and the HTML page, and the gate that triggered it is not charged for it."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from conftest import GateProject
from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.plugin.session.passes import PASS_METHOD, PassClock

#: A model whose forward takes 0.15 s a batch (not during the guard's determinism probe): 3 batches of 16.
CONFTEST = """
import time

import pytest
import torch
from torch import nn

from pytest_dnnsafety.engines.core.guard import probing


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        if not probing():
            time.sleep(0.5)
        return self.classifier(self.features(x))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return Slow()


@pytest.fixture(scope="session")
def dataset():
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(48, 1, 6, 6, generator=gen))
"""

TESTS = """
import pytest


@pytest.mark.min_neuron_k_activation(0.0, layer="classifier.2", k=2)
def test_first(model, dataset):
    pass


@pytest.mark.min_neuron_k_activation(0.0, layer="features.1", k=1, reduce="mean")
def test_second(model, dataset):
    pass
"""


def test_the_activation_cache_still_has_the_method_the_clock_times() -> None:
    assert callable(getattr(ActivationCache(), PASS_METHOD, None))
    cache: dict = {}
    clock = PassClock()
    clock.watch(cache)  # torch is loaded: the cache is made and timed before any gate
    assert isinstance(cache["activations"], ActivationCache)
    assert getattr(cache["activations"], PASS_METHOD).__wrapped__ is not None


def test_shared_pass_has_its_own_entry_and_is_not_charged_to_the_first_gate(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", CONFTEST)
    gate_project.ini["dnnsafety_batch_size"] = "16"
    gate_project.tests(TESTS)
    result = gate_project.run("--dnnsafety-json=e.json", "--junitxml=junit.xml")
    result.assert_outcomes(passed=2)
    evidence = json.loads((gate_project.pytester.path / "e.json").read_text())
    passes = evidence["shared_passes"]
    assert len(passes) == 1, passes
    entry = passes[0]
    assert entry["model"] == "model" and entry["data"] == "dataset" and entry["images"] == 48
    assert sorted(entry["layers"]) == ["classifier.2", "features.1"]  # the layer plan: one pass for both gates
    assert entry["seconds"] >= 1.5 and entry["images_per_second"] == pytest.approx(48 / entry["seconds"])
    assert entry["nodeid"].endswith("test_first") and entry["marker"] == "min_neuron_k_activation"
    first, second = evidence["gates"]
    assert first["details"]["shared_pass_seconds"] == pytest.approx(entry["seconds"])
    assert first["seconds"] < 1.5 <= entry["seconds"]  # the gate's own time, without the pass
    assert "shared_pass_seconds" not in second["details"] and second["seconds"] < 1.5
    result.stdout.fnmatch_lines(["*shared forward pass model × dataset (2 layers): 48 images in * s "
                                 "(* images/s), first needed by *test_first ?min_neuron_k_activation?*"])
    root = ET.parse(gate_project.pytester.path / "junit.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["dnnsafety.shared_pass.0"].startswith("shared forward pass model × dataset (2 layers): 48 images")
    first_case = next(c for c in root.iter("testcase") if c.get("name") == "test_first")
    assert "[dnnsafety] shared forward pass" in (first_case.findtext("system-out") or "")


def test_the_html_page_lists_the_shared_passes() -> None:
    pytest.importorskip("jinja2")
    from pytest_dnnsafety.report.evidence import build_evidence
    from pytest_dnnsafety.report.html import render_html

    entry = {"model": "model", "data": "dataset", "layers": ["features.1"], "images": 2000, "seconds": 564.2,
             "images_per_second": 2000 / 564.2, "nodeid": "tests/test_a.py::test_a", "marker": "min_neuron_k_activation",
             "worker": None}
    page = render_html(build_evidence([], {"pytest_dnnsafety": "x"}, shared_passes=[entry]))
    assert 'id="shared-passes"' in page and "model × dataset" in page and "564.2" in page
    assert 'id="incomplete"' not in page
    partial = render_html(build_evidence([], {"pytest_dnnsafety": "x"}, complete=False))
    assert 'id="incomplete"' in partial


def test_under_xdist_each_workers_pass_reaches_the_controller(gate_project: GateProject) -> None:
    pytest.importorskip("xdist")
    gate_project.write("conftest.py", CONFTEST)
    gate_project.ini["dnnsafety_batch_size"] = "16"
    gate_project.tests(TESTS)
    gate_project.run("--dnnsafety-json=e.json", "-n", "2").assert_outcomes(passed=2)
    evidence = json.loads((gate_project.pytester.path / "e.json").read_text())
    passes = evidence["shared_passes"]
    assert 1 <= len(passes) <= 2 and all(str(p["worker"]).startswith("gw") and p["images"] == 48 for p in passes)
    charged = [g for g in evidence["gates"] if "shared_pass_seconds" in g["details"]]
    assert len(charged) == len(passes)  # each pass taken out of the gate that triggered it on its worker
    assert all(g["seconds"] < 1.5 for g in evidence["gates"]), [(g["seconds"], g["details"]) for g in evidence["gates"]]
