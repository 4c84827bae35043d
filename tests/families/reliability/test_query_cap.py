"""A plan above the query cap (``max_queries`` / ``dnnsafety_max_queries``) is refused before it is sampled (issue #19 §6).

``max_pmi_ub(allocation="adaptive", target_width=1e-9)`` used to plan 2·10¹² model queries and start sampling
them (an ETA of years); a uniform plan of 10¹⁰ queries started too. Both are now a :class:`QueryCapError`
naming the planned queries, the time they would take, where the cap came from and the fix.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import GateProject
from pytest_dnnsafety.settings import SETTINGS
from pytest_dnnsafety.engines.reliability import assess_reliability
from pytest_dnnsafety.engines.reliability.allocation import DEFAULT_MAX_QUERIES, QueryCapError
from pytest_dnnsafety.errors import ConfigError
from _reliability import _quiet, _truth, write_pmi_project

UNIT_BOX = ([0.0, 0.0], [1.0, 1.0])
GRID = dict(eps=0.1, box=UNIT_BOX, bootstrap=5)  # 100 cells


def _data() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    op = 0.5 + 0.2 * torch.randn(2000, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    lab = torch.rand(500, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return op.clamp(0, 1), (lab, _truth(lab))


class Counting:
    """A threshold classifier that counts the inputs it is queried on."""

    def __init__(self) -> None:
        self.queries = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.queries += int(x.shape[0])
        return torch.stack([0.52 - x[:, 0], x[:, 0] - 0.52], dim=1)


def test_the_engine_default_is_the_settings_default() -> None:
    assert SETTINGS["max_queries"].default == DEFAULT_MAX_QUERIES == 10**9


def test_a_uniform_plan_above_the_cap_is_refused_before_any_query() -> None:
    op, labelled = _data()
    model = Counting()
    with pytest.raises(QueryCapError) as info:
        _quiet(assess_reliability, model, op, labelled, samples_per_cell=10**8, **GRID)
    message = str(info.value)
    assert model.queries == 0
    assert "allocation='uniform' (100,000,000 samples per cell × 100 cells) plans 10,000,000,000 model queries" \
           in message
    assert "more than max_queries=1,000,000,000" in message and "queries/s (assumed)" in message
    assert "Fix: fewer samples_per_cell" in message and "dnnsafety_max_queries" in message
    assert isinstance(info.value, ConfigError)
    # an explicit cap: 100 × 1000 queries are over 50,000, and within 100,000
    with pytest.raises(QueryCapError, match=r"plans 100,000 model queries .* more than max_queries=50,000"):
        _quiet(assess_reliability, model, op, labelled, samples_per_cell=1000, max_queries=50_000, **GRID)
    assert model.queries == 0
    result = _quiet(assess_reliability, model, op, labelled, samples_per_cell=1000, max_queries=100_000, **GRID)
    assert result.model_queries == 100_000
    with pytest.raises(ConfigError, match="max_queries=0 must be an integer >= 1"):
        _quiet(assess_reliability, model, op, labelled, max_queries=0, **GRID)


def test_a_tiny_target_width_is_refused_after_the_pilot_not_sampled() -> None:
    op, labelled = _data()
    model = Counting()
    started = time.perf_counter()
    with pytest.raises(QueryCapError) as info:
        _quiet(assess_reliability, model, op, labelled, allocation="adaptive", target_width=1e-9,
               samples_per_cell=100, **GRID)
    assert time.perf_counter() - started < 10
    message = str(info.value)
    # the pilot (5 per cell) and the labelled points only: the final stage's 2·10¹² queries never started
    assert model.queries < 100 * 5 + 500 + 2 * 4096
    assert "the adaptive plan for target_width=1e-09 (pilot 500 + final stage" in message
    assert "the target not reached even by the finest plan" in message
    assert "(measured on the pilot)" in message and "Refused before sampling them" in message
    assert "Fix: a looser target_width, or a query_budget" in message
    planned = int(message.split(" plans ")[1].split(" model queries")[0].replace(",", ""))
    assert planned > 10**12


def test_a_query_budget_above_the_cap_is_refused_before_the_pilot() -> None:
    op, labelled = _data()
    model = Counting()
    with pytest.raises(QueryCapError, match=r"query_budget=2,000,000,000 plans 2,000,000,000 model queries.*"
                                             r"Fix: a query_budget of at most 1,000,000,000"):
        _quiet(assess_reliability, model, op, labelled, allocation="adaptive", query_budget=2 * 10**9, **GRID)
    assert model.queries == 0


def test_adaptive_without_budget_or_target_takes_the_uniform_budget() -> None:
    """Documented default (``query_budget`` = ``samples_per_cell`` × the sampled cells); it used to plan 2·10¹²."""
    op, labelled = _data()
    result = _quiet(assess_reliability, Counting(), op, labelled, allocation="adaptive", samples_per_cell=200,
                    **GRID)
    assert result.allocation_plan["query_budget"] == 200 * 100
    assert result.model_queries <= 200 * 100


MARKER = 'eps=0.05, box=[[0, 0], [1, 1]], bootstrap=5, accept_violated_assumptions=True, empty_cell_label="nearest"'


@pytest.fixture
def pmi_project(gate_project: GateProject) -> GateProject:
    return write_pmi_project(gate_project)


def _gates(project: GateProject) -> dict:
    evidence = json.loads((project.pytester.path / "e.json").read_text())
    return {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}


def test_the_gate_refuses_plans_above_the_cap_naming_where_it_came_from(pmi_project: GateProject) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub(0.2, {MARKER}, allocation="adaptive", target_width=1e-9, samples_per_cell=100)
        def test_tiny_width():
            pass

        @pytest.mark.max_pmi_ub(0.2, {MARKER}, samples_per_cell=1000, max_queries=10_000)
        def test_marker_cap():
            pass

        @pytest.mark.max_pmi_ub(0.2, {MARKER}, samples_per_cell=10)
        def test_within():
            pass
    """)
    started = time.perf_counter()
    result = pmi_project.run("--dnnsafety-json=e.json")
    assert time.perf_counter() - started < 60
    result.assert_outcomes(passed=1, failed=2)
    gates = _gates(pmi_project)
    tiny, marker = gates["test_tiny_width"], gates["test_marker_cap"]
    assert tiny["status"] == "error" and marker["status"] == "error"
    assert "the adaptive plan for target_width=1e-09" in tiny["summary"]
    assert "more than max_queries=1,000,000,000" in tiny["summary"]
    assert "max_queries=1,000,000,000 (from default): at" in tiny["summary"] and "Fix: a looser target_width" in tiny["summary"]
    assert "more than max_queries=10,000" in marker["summary"]
    assert "max_queries=10,000 (from marker @pytest.mark.max_pmi_ub(max_queries=...))" in marker["summary"]
    assert gates["test_within"]["status"] == "passed"
    # the setting: from the command line (the marker keyword still wins over it)
    result = pmi_project.run("--dnnsafety-json=e.json", "--dnnsafety-max-queries=100")
    result.assert_outcomes(failed=3)
    gates = _gates(pmi_project)
    assert "more than max_queries=100 (from command-line option --dnnsafety-max-queries)" \
           in gates["test_within"]["summary"]
    assert "more than max_queries=10,000" in gates["test_marker_cap"]["summary"]


def test_a_bad_cap_is_a_configuration_error(pmi_project: GateProject) -> None:
    pmi_project.tests(f"""
        import pytest

        @pytest.mark.max_pmi_ub(0.2, {MARKER}, max_queries=0)
        def test_bad_marker():
            pass
    """)
    result = pmi_project.run()
    result.stdout.fnmatch_lines(["*argument max_queries: 0 must be >= 1. Fix: the most Monte Carlo queries*"])
    result = pmi_project.run("--dnnsafety-max-queries=zero")
    result.stderr.fnmatch_lines(["*dnnsafety_max_queries='zero' (from command-line option --dnnsafety-max-queries): "
                                 "expected an integer. Fix: use a positive integer*"])
