"""Cell caps of scenario coverage and ``by=`` groups (issue #29 §3): refused before anything is allocated.

Condition domains of ~3,000 values made ``min_scene_coverage(k=3)`` and a ``by=`` of three conditions ask for
27 GB (one bool per cell of the 3000³ grid) and die in the allocator. The cell count is now computed from the
domain sizes first and refused over the cap — the k-projection cells against the coverage engine's
``MAX_CELLS``, the ``by=`` groups against the performance engine's ``MAX_GROUPS`` — naming k or by, the count,
the cap and the fix; ``by=`` groups compute the feasibility of their own subset only, so conditions outside
``by`` never make a small grouping expensive.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import GateProject
from pytest_dnnsafety.engines.coverage.scenario import MAX_CELLS, ScenarioCoverageEngine, projection_cells
from pytest_dnnsafety.engines.performance.scenario import MAX_GROUPS, ScenarioPerformanceEngine
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.scenarios.groups import ScenarioGroups
from pytest_dnnsafety.scenarios.table import MAX_TABLE_CELLS

FIXTURES = {"scenarios": "scenario_table", "data": "dataset"}


def wide(n: int = 3, values: int = 3000, restrictions: list | None = None, **extra: list[str]) -> Conditions:
    domains = {name: [f"{name}{i}" for i in range(values)] for name in "abcde"[:n]}
    return Conditions({**domains, **extra}, restrictions or [])


def table_of(conditions: Conditions, rows: int = 5) -> ScenarioTable:
    return ScenarioTable(conditions, torch.zeros(rows, len(conditions), dtype=torch.int64))


def quickly(call):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        call()
    assert time.perf_counter() - start < 2, "refused only after allocating"
    return str(info.value)


def test_projection_cells_is_the_sum_over_k_subsets_of_the_domain_products() -> None:
    assert projection_cells((3, 3, 2), 2) == 3 * 3 + 3 * 2 + 3 * 2
    assert projection_cells((3000,) * 3, 3) == 27_000_000_000
    assert projection_cells((2,) * 200, 3) == 8 * (200 * 199 * 198 // 6)  # no loop over 1.3 M subsets


@pytest.mark.parametrize("restricted", [False, True], ids=["free", "restricted"])
def test_coverage_k3_over_3000_value_domains_is_refused_before_allocating(restricted: bool) -> None:
    restrictions = [{"a": "a0", "b": "b1"}] if restricted else []
    table = table_of(wide(restrictions=restrictions))
    message = quickly(lambda: table.coverage(k=3))
    assert "k=3" in message and "27,000,000,000 projection cells" in message
    assert f"cap of {MAX_TABLE_CELLS:,} cells (the result lists every uncovered cell)" in message
    assert "a 3000 × b 3000 × c 3000" in message
    assert "Fix:" in message and "smaller k (k=1 gives 9,000 cells)" in message
    assert "coarser domains" in message and "where=" in message


def test_cell_feasibility_itself_is_capped() -> None:
    message = quickly(lambda: wide(restrictions=[{"a": "a0", "b": "b1"}]).cell_feasibility(3))
    assert "k=3" in message and "27,000,000,000" in message and f"cap of {MAX_CELLS:,} cells;" in message


def test_coverage_under_the_cap_still_counts() -> None:
    table = table_of(wide(values=300), rows=3)
    result = table.coverage(k=2, propose=0)
    assert result.total == 3 * 300 * 300 and result.covered == 3


def test_coverage_over_the_table_cap_but_under_the_engine_cap_is_refused() -> None:
    """3 × 300 values at k=3: 27·10⁶ cells fit the engine but listing them took 118 s and 11 GB."""
    message = quickly(lambda: table_of(wide(values=300)).coverage(k=3))
    assert "27,000,000 projection cells" in message and "k=2 gives 270,000 cells" in message


def test_where_narrows_the_domains_under_the_cap() -> None:
    table = table_of(wide())
    result = table.coverage(k=3, where={"a": ["a0", "a1"], "b": "b0"}, propose=0)
    assert result.total == 2 * 1 * 3000 and result.covered == 1


def test_the_engine_names_the_same_cap() -> None:
    message = quickly(lambda: ScenarioCoverageEngine((3000, 3000, 3000), k=3, names=("a", "b", "c")))
    assert "k=3" in message and f"cap of {MAX_CELLS:,}" in message


def test_by_three_3000_value_conditions_is_refused_before_allocating() -> None:
    table = table_of(wide())
    message = quickly(lambda: ScenarioGroups.of(table, ["a", "b", "c"], n_rows=5, fixtures=FIXTURES))
    assert "by=['a', 'b', 'c']" in message and "27,000,000,000 groups" in message
    assert "a 3000 × b 3000 × c 3000" in message and f"cap of {MAX_GROUPS:,} groups" in message
    assert "Fix:" in message and "fewer by conditions (by=['a'] gives 3,000 groups)" in message
    assert "coarser domains" in message


def test_by_three_conditions_with_restrictions_is_refused_before_allocating() -> None:
    table = table_of(wide(restrictions=[{"a": "a0", "b": "b1"}]))
    message = quickly(lambda: ScenarioGroups.of(table, ["a", "b", "c"], n_rows=5, fixtures=FIXTURES))
    assert "27,000,000,000 groups" in message


def test_a_small_by_is_not_charged_for_large_conditions_outside_it() -> None:
    """by=[lighting, noise, a]: 2·3·3000 groups; the full k=3 projection (a×b×c: 2.7·10¹⁰ cells) is never built."""
    conditions = wide(restrictions=[{"a": "a0", "b": "b1"}, {"lighting": "night", "noise": "high"}],
                      lighting=["day", "night"], noise=["low", "mid", "high"])
    table = table_of(conditions)
    groups = ScenarioGroups.of(table, ["lighting", "noise", "a"], n_rows=5, fixtures=FIXTURES)
    assert groups.n_groups == 2 * 3 * 3000
    infeasible = [g for g in range(groups.n_groups) if not bool(groups.feasible[g])]
    assert len(infeasible) == 3000 and groups.key(infeasible[0]) == {"lighting": "night", "noise": "high", "a": "a0"}


@pytest.mark.parametrize("by", [["lighting", "noise"], ["noise", "lighting"], ["noise", "weather", "lighting"],
                                ["weather"], ["road", "lighting"]])
def test_subset_feasibility_equals_the_projection_block(by: list[str]) -> None:
    conditions = Conditions(
        {"lighting": ["day", "dusk", "night"], "noise": ["low", "high"], "weather": ["sun", "rain", "snow"],
         "road": ["dry", "wet"]},
        [{"lighting": "night", "noise": "high"}, {"weather": "snow", "road": "dry"},
         {"lighting": ["day", "dusk"], "weather": "snow", "noise": "low"}])
    table = ScenarioTable(conditions, torch.zeros(4, 4, dtype=torch.int64))
    groups = ScenarioGroups.of(table, by, n_rows=4, fixtures=FIXTURES)
    reference = ScenarioPerformanceEngine.from_table(table, by)
    assert torch.equal(groups.feasible, reference.feasible)


def test_min_scene_coverage_k3_over_wide_domains_is_an_error_naming_the_marker(gate_project: GateProject) -> None:
    values = ", ".join(f'"v{i}"' for i in range(3000))
    gate_project.write("data/conditions.toml", f"[conditions]\na = [{values}]\nb = [{values}]\nc = [{values}]\n")
    gate_project.write("data/scenarios.csv", "a,b,c\nv0,v1,v2\nv3,v4,v5\n")
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.5, k=3)
        def test_cov(scenario_table):
            pass
    """)
    start = time.perf_counter()
    result = gate_project.run()
    assert time.perf_counter() - start < 60
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*min_scene_coverage*k=3*27,000,000,000 projection cells*cap of 4,194,304 cells*Fix: a smaller k*"])
