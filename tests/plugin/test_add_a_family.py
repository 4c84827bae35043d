"""The walk of ``docs/add-a-family.md``: a new gate family, written the way that page says, works end to end.

A toy family (``toyfam``: one gate marker, ``min_toy_accuracy``, measured by one pure-torch engine with
two summed states) is written as a NEW package in a temporary directory, declared with
:class:`~pytest_dnnsafety.Family` and registered through the one-line ``pytest_dnnsafety_register_gates``
hook. It then shows up wherever a built-in family does: among the registered markers (a run with
``--strict-markers`` accepts it), in the generated marker reference
(:func:`pytest_dnnsafety.plugin.reference.markers_markdown`), in the registry's families and plot table,
and in the JSON evidence of a run where the right model passes and a plainly wrong one fails (the
known answer); its declared plot is drawn on the HTML page. Only new files are written.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from typing import Any

import pytest

from conftest import GateProject
from pytest_dnnsafety import Family, GateRegistry
from pytest_dnnsafety.plugin.reference import markers_markdown

PACKAGE = "toyfam"

#: ``toyfam/engine.py``: pure torch, an Engine with its states and their reduce rules.
ENGINE = '''
"""The toy family's engine: how many top-1 predictions are right (pure torch, no pytest)."""

from __future__ import annotations

from typing import Any

import torch

from pytest_dnnsafety.engines.core.base import Engine


class HitEngine(Engine):
    """States ``hits`` and ``seen`` (both ``sum``): batches, merges and ranks add up."""

    def __init__(self, device: Any = None) -> None:
        super().__init__(device)
        self.add_state("hits", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("seen", torch.zeros((), dtype=torch.int64), "sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.hits += (logits.argmax(dim=1) == labels).sum().to(self.device)
        self.seen += labels.numel()

    def compute(self) -> dict[str, Any]:
        hits, seen = int(self.hits), int(self.seen)
        return {"accuracy": hits / seen if seen else float("nan"), "hits": hits, "seen": seen}
'''

#: ``toyfam/gates.py``: the declarations, the checks, ``measure``, the plot, and ``FAMILY`` with its hook.
GATES = '''
"""The toy family's gate: min_toy_accuracy (the share of right top-1 predictions)."""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety import Family, GateDef, GateRegistry, Measurement, hookimpl


def _measure(spec: Any, fx: Mapping[str, Any], ctx: Any) -> Measurement:
    from pytest_dnnsafety.engines.core.runner import Runner
    from toyfam.engine import HitEngine

    model, data = fx["model"], fx["data"]
    engine = HitEngine(device=ctx.device)
    runner = Runner("toy accuracy", model=model, device=ctx.device, batch_size=ctx.batch_size,
                    labels="required", shard=ctx.shard(data))
    guard = runner.guard()
    runner.run(data, lambda batch: engine.update(guard(model, batch.x), batch.y), engine)
    result = engine.compute()
    return Measurement(result["accuracy"], detail=f"{result['hits']} of {result['seen']} right",
                       details={"toy_hits": [result["hits"], result["seen"]]})


def plot_toy_hits(details: Mapping[str, Any], prefix: str) -> list[Any]:
    hits = details.get("toy_hits")
    if not isinstance(hits, list):
        return []
    return [lambda: (f"{hits[0]} of {hits[1]} right", f'<svg id="{prefix}toy"><text>{hits[0]}</text></svg>')]


MIN_TOY_ACCURACY = GateDef(
    marker="min_toy_accuracy", metric="toy accuracy", op=">=", threshold_range=(0.0, 1.0), params=(),
    fixtures={"model": "model", "data": "dataset"}, measure=_measure, shards=True,
    doc="fail unless at least `threshold` of the top-1 predictions are right",
)

FAMILY = Family("toyfam", "Toy accuracy", (MIN_TOY_ACCURACY,), plots={"toy_hits": plot_toy_hits})


@hookimpl
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
'''

#: The project's fixtures: a linear model that is right on every input, and the same model negated.
CONFTEST = '''
import pytest
import torch

_GEN = torch.Generator().manual_seed(0)
X = torch.randn(64, 4, generator=_GEN)
WEIGHT = torch.randn(3, 4, generator=_GEN)


def _linear(weight):
    model = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(weight)
    return model.eval()


@pytest.fixture(scope="session")
def dataset():
    return torch.utils.data.TensorDataset(X, (X @ WEIGHT.T).argmax(dim=1))


@pytest.fixture(scope="session")
def model():
    return _linear(WEIGHT)  # the labels' own rule: right on every input


@pytest.fixture(scope="session")
def wrong_model():
    return _linear(-WEIGHT)  # picks the least likely class: a plainly wrong model
'''

TESTS = '''
import pytest


@pytest.mark.min_toy_accuracy(0.9)
def test_right_model():
    pass


@pytest.mark.min_toy_accuracy(0.9, model="wrong_model")
def test_wrong_model():
    pass
'''


@pytest.fixture
def toy(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch) -> GateProject:
    """The project with the toy family's package importable (``-p toyfam.gates``) and freshly imported."""
    gate_project.write(f"{PACKAGE}/__init__.py", '"""A gate family outside pytest_dnnsafety."""\n')
    gate_project.write(f"{PACKAGE}/engine.py", ENGINE)
    gate_project.write(f"{PACKAGE}/gates.py", GATES)
    gate_project.write("conftest.py", CONFTEST)
    gate_project.tests(TESTS, "test_toy.py")
    monkeypatch.syspath_prepend(str(gate_project.pytester.path))
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(f"{PACKAGE}.")]:
        monkeypatch.delitem(sys.modules, name)
    return gate_project


def test_the_family_is_declared_once_and_registered(toy: GateProject) -> None:
    module = importlib.import_module(f"{PACKAGE}.gates")
    family = module.FAMILY
    assert isinstance(family, Family) and family.problems() == []
    assert family.page == "gates/toyfam.md" and family.markers == ("min_toy_accuracy",)
    registry = GateRegistry()
    module.pytest_dnnsafety_register_gates(registry=registry)
    assert list(registry) == ["min_toy_accuracy"] and list(registry.families) == ["toyfam"]
    assert registry.plots == {"toy_hits": module.plot_toy_hits}
    assert "toyfam.gates" in registry.source("min_toy_accuracy")
    reference = markers_markdown(registry)
    assert "## `min_toy_accuracy` { #min_toy_accuracy }" in reference
    assert "fail unless at least `threshold` of the top-1 predictions are right" in reference.lower()


def test_the_marker_is_registered_for_strict_markers(toy: GateProject) -> None:
    result = toy.run("-p", f"{PACKAGE}.gates", "--strict-markers", "--markers")
    line = ("@pytest.mark.min_toy_accuracy(threshold, model='model', data='dataset'): fail unless at least "
            "`threshold` of the top-1 predictions are right")
    result.stdout.fnmatch_lines([line])


def test_a_run_passes_the_right_model_fails_the_wrong_one_and_draws_the_plot(toy: GateProject) -> None:
    html = all(importlib.util.find_spec(name) is not None for name in ("jinja2", "matplotlib"))  # the [html] extra
    result = toy.run("-p", f"{PACKAGE}.gates", "--strict-markers", "--dnnsafety-json=evidence.json",
                     *(["--dnnsafety-html=report.html"] if html else []))
    result.assert_outcomes(passed=1, failed=1)
    evidence = json.loads((toy.pytester.path / "evidence.json").read_text())
    gates: dict[str, Any] = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
    right, wrong = gates["test_right_model"], gates["test_wrong_model"]
    assert right["marker"] == wrong["marker"] == "min_toy_accuracy"
    assert (right["status"], right["value"], right["details"]["toy_hits"]) == ("passed", 1.0, [64, 64])
    assert wrong["status"] == "failed" and wrong["value"] < 0.5, wrong
    if html:  # the family's declared plot reaches the page through the run's plot table
        page = (toy.pytester.path / "report.html").read_text()
        assert page.count('<figure class="plot" data-plot="toy_hits">') == 2 and "64 of 64 right" in page
