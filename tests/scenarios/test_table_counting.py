"""ScenarioTable.coverage's fast paths (issue #31): the cached int16 columns, pair grids summed out of the
k-projection counts, and the restriction row check skipped when the counts prove no row breaks one.

Each is checked against the plain computation (``pair_grids`` over the codes, ``restriction_violations``,
a brute-force count) on random tables.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable, pair_grids


@st.composite
def tables(draw: st.DrawFn, max_rows: int = 60) -> tuple[ScenarioTable, list[dict]]:
    n = draw(st.integers(2, 5))
    cards = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    domains = {f"c{i}": [f"v{j}" for j in range(card)] for i, card in enumerate(cards)}
    restrictions = []
    for _ in range(draw(st.integers(0, 3))):
        conds = draw(st.lists(st.sampled_from(list(domains)), min_size=1, max_size=min(3, n), unique=True))
        restrictions.append({c: draw(st.lists(st.sampled_from(domains[c]), min_size=1, unique=True)) for c in conds})
    conditions = Conditions(domains, restrictions)
    rows = draw(st.lists(st.tuples(*(st.integers(0, c - 1) for c in cards)), max_size=max_rows))
    codes = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), n)
    return ScenarioTable(conditions, codes), restrictions


def _feasible_rows(table: ScenarioTable) -> ScenarioTable:
    keep = table.conditions.feasible_mask(table.codes)
    return ScenarioTable(table.conditions, table.codes[keep])


@settings(max_examples=60, deadline=None)
@given(tables(), st.integers(1, 3), st.booleans())
def test_pair_grids_equal_the_count_over_the_codes(drawn, k: int, narrow: bool) -> None:
    table, _ = drawn
    table = _feasible_rows(table)
    k = min(k, len(table.conditions))
    feasible, _ = table.conditions.cell_feasibility(k)
    assume(bool(feasible.any()))  # else coverage is undefined: nothing to compare
    result = table.coverage(k=k, propose=0)
    assert result.pair_grids == pair_grids(table.conditions, table.codes)


@settings(max_examples=80, deadline=None)
@given(tables(), st.integers(1, 3), st.integers(1, 3))
def test_rows_breaking_restrictions_are_found_as_by_the_row_scan(drawn, k: int, min_count: int) -> None:
    table, _ = drawn
    k = min(k, len(table.conditions))
    expected = table.restriction_violations()
    feasible, _ = table.conditions.cell_feasibility(k)
    assume(bool(feasible.any()))  # else coverage is undefined (MetricError) before any row check
    result = table.coverage(k=k, min_count=min_count, propose=0, allow_infeasible_rows=True)
    assert (result.infeasible_rows, result.infeasible_row_examples) == expected
    if expected[0]:
        with pytest.raises(DataError, match="break a declared restriction"):
            table.coverage(k=k, min_count=min_count, propose=0)


def test_a_restriction_wider_than_k_is_still_checked_row_by_row() -> None:
    conditions = Conditions({"a": ["0", "1"], "b": ["0", "1"], "c": ["0", "1"]},
                            restrictions=[{"a": "1", "b": "1", "c": "1"}])
    table = ScenarioTable(conditions, torch.tensor([[0, 0, 0], [1, 1, 1], [1, 1, 0]]))
    for k in (1, 2):  # the breaking row lands in feasible k-cells only
        with pytest.raises(DataError, match="1 scenario row"):
            table.coverage(k=k)
        assert table.coverage(k=k, allow_infeasible_rows=True).infeasible_rows == 1


def test_cached_columns_follow_the_codes() -> None:
    conditions = Conditions({"a": ["x", "y", "z"], "b": ["p", "q"]})
    table = ScenarioTable(conditions, torch.tensor([[0, 0], [1, 1]]))
    assert table.coverage(k=2).covered == 2
    columns = table._columns()
    assert columns.dtype == torch.int16 and table._columns() is columns  # built once
    table.codes[0, 0] = 2  # in place, still valid: seen
    assert table.coverage(k=2).uncovered == [{"a": "x", "b": "p"}, {"a": "x", "b": "q"}, {"a": "y", "b": "p"},
                                             {"a": "z", "b": "q"}]
    table.codes = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]])  # replaced
    assert table.coverage(k=2).value == 1.0
    table.codes[3, 1] = 2  # out of the domain: refused, not counted
    with pytest.raises(DataError, match="row 3, condition 'b': code 2"):
        table.coverage(k=2)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_table_above_the_group_threshold_counts_exactly(k: int) -> None:
    cards = [3, 12, 2, 7, 5, 4]
    gen = torch.Generator().manual_seed(k)
    codes = torch.stack([torch.randint(0, c, (40_000,), generator=gen) for c in cards], dim=1)
    codes[codes[:, 1] == 11, 0] = 0  # a hole
    conditions = Conditions({f"c{i}": [str(v) for v in range(c)] for i, c in enumerate(cards)})
    result = ScenarioTable(conditions, codes).coverage(k=k)
    rows = codes.tolist()
    expected = [len(Counter(tuple(r[c] for c in subset) for r in rows))
                for subset in itertools.combinations(range(len(cards)), k)]
    assert [s.covered for s in result.per_subset] == expected
    assert result.pair_grids == pair_grids(conditions, codes)


def test_coverage_runs_on_one_thread_and_restores_the_count() -> None:
    from pytest_dnnsafety.scenarios import table as table_module

    seen: list[int] = []
    real = table_module._pair_grids

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    conditions = Conditions({"a": ["x", "y"], "b": ["p", "q"]})
    table = ScenarioTable(conditions, torch.tensor([[0, 0], [1, 1]]))
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(table_module, "_pair_grids", spy)
        table.coverage()
    assert seen == [1] and torch.get_num_threads() == before
