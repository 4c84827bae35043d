"""Counting k-projection cells by condition groups (engines/coverage/counting.py) and the engine's CPU path.

Everything is checked exactly against a brute force (itertools and a Counter per k-subset).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest_dnnsafety.engines.coverage.scenario as scenario_module
from pytest_dnnsafety.engines import ProjectionLayout, ScenarioCoverageEngine
from pytest_dnnsafety.engines.coverage.counting import (
    MAX_GROUP_CELLS,
    column_major,
    count_projections,
    default_cap,
    key_dtype,
    plan_groups,
)
from pytest_dnnsafety.errors import DataError


def brute_force(codes: list[list[int]], cards: list[int], k: int) -> list[int]:
    flat: list[int] = []
    for subset in itertools.combinations(range(len(cards)), k):
        seen = Counter(tuple(row[c] for c in subset) for row in codes)
        flat.extend(seen[cell] for cell in itertools.product(*(range(cards[c]) for c in subset)))
    return flat


def random_codes(cards: list[int], rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, c, (rows,), generator=gen) for c in cards], dim=1).reshape(rows, len(cards))


@pytest.fixture
def always_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CPU update counts by groups, however small."""
    monkeypatch.setattr(scenario_module, "GROUP_MIN_INDICES", 0)
    monkeypatch.setattr(scenario_module, "GROUP_ALWAYS_INDICES", 0)
    monkeypatch.setattr(scenario_module, "GROUP_MIN_ROWS_PER_SUBSET", 0)


# ---------------------------------------------------------------------- the plan
@pytest.mark.parametrize("cards, k", [((3, 4, 2, 5, 3, 6), 2), ((3, 4, 2, 5, 3, 6), 3), ((2,) * 12, 3),
                                      ((7, 9, 12, 2, 3), 1), ((5, 4, 3), 3), ((40, 40, 40, 2), 2)])
@pytest.mark.parametrize("cap", [1, 64, 4096, MAX_GROUP_CELLS])
def test_plan_covers_every_subset_once_within_the_cap(cards: tuple[int, ...], k: int, cap: int) -> None:
    plan = plan_groups(cards, k, cap)
    layout = ProjectionLayout(cards, k)
    assert list(plan.groups) == sorted(plan.groups)
    seen: list[int] = []
    for members, size, parts in zip(plan.groups, plan.sizes, plan.parts):
        assert list(members) == sorted(set(members)) and size == math.prod(cards[c] for c in members)
        assert size <= cap or len(members) == k  # only a single k-subset may exceed the cap
        for s, summed in parts:
            subset = layout.subsets[s]
            assert set(subset) <= set(members)
            assert summed == tuple(d for d, c in enumerate(members) if c not in subset)
            seen.append(s)
    assert sorted(seen) == list(range(layout.n_subsets))
    assert plan.dtype == key_dtype(max(plan.sizes))


def test_plan_groups_many_subsets_together() -> None:
    plan = plan_groups((2, 5, 7, 2, 5, 3, 7, 3, 2, 2), 3, MAX_GROUP_CELLS)
    assert len(plan.groups) < 20  # 120 triples, far fewer passes
    assert plan.dtype == torch.int16


def test_key_dtype_and_default_cap() -> None:
    assert key_dtype(1) == key_dtype(1 << 15) == torch.int16
    assert key_dtype((1 << 15) + 1) == key_dtype(1 << 31) == torch.int32
    assert key_dtype((1 << 31) + 1) == torch.int64
    assert default_cap(0) == default_cap(100) == 256
    assert default_cap(10**6) == default_cap(10**9) == MAX_GROUP_CELLS
    assert all(default_cap(r) <= default_cap(2 * r) for r in (10, 1_000, 100_000))


def test_column_major_copies_once_and_keeps_a_laid_out_tensor() -> None:
    codes = random_codes([3, 4, 5], 40_000, 1)
    columns = column_major(codes, torch.int16)
    assert columns.dtype == torch.int16 and columns.is_contiguous() and columns.shape == (3, 40_000)
    assert torch.equal(columns.t().to(torch.int64), codes)
    assert column_major(columns.t(), torch.int16).data_ptr() == columns.data_ptr()  # no copy
    assert column_major(columns.t(), torch.int32).dtype == torch.int32  # one dtype only: converted


# ---------------------------------------------------------------------- counting
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_group_counts_equal_brute_force(data) -> None:
    n = data.draw(st.integers(1, 6))
    cards = data.draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    k = data.draw(st.integers(1, n))
    rows = data.draw(st.lists(st.tuples(*(st.integers(0, c - 1) for c in cards)), max_size=60))
    cap = data.draw(st.sampled_from([1, 8, 50, 1000, MAX_GROUP_CELLS]))
    block = data.draw(st.sampled_from([None, 1, 7]))
    codes = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), n)
    layout = ProjectionLayout(tuple(cards), k)
    plan = plan_groups(tuple(cards), k, cap)
    counts = torch.zeros(layout.total, dtype=torch.int64)
    count_projections(column_major(codes, plan.dtype), layout, plan, counts, block_rows=block)
    assert counts.tolist() == brute_force([list(r) for r in rows], cards, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_engine_cpu_path_equals_brute_force_on_random_tables(k: int, always_groups: None) -> None:
    cards = [3, 12, 2, 7, 5, 4]
    codes = random_codes(cards, 3_000, k)
    engine = ScenarioCoverageEngine(cards, k=k)
    assert engine._by_groups(codes.shape[0])
    engine.update(codes)
    engine.update(codes[:1_000])
    head = brute_force(codes[:1_000].tolist(), cards, k)
    expected = [a + b for a, b in zip(brute_force(codes.tolist(), cards, k), head)]
    assert engine.counts.tolist() == expected


def test_engine_paths_agree_on_a_large_table() -> None:
    """The default choice (groups from a few 10^5 indices) against the matrix-product path."""
    cards = [2, 5, 12, 3, 7, 2, 9, 4, 6, 11]
    codes = random_codes(cards, 60_000, 7)
    for k in (2, 3):
        grouped = ScenarioCoverageEngine(cards, k=k)
        assert grouped._by_groups(codes.shape[0])
        grouped.update(codes)
        direct = ScenarioCoverageEngine(cards, k=k)
        direct._use_groups = False
        direct.update(codes)
        assert torch.equal(grouped.counts, direct.counts)
        assert torch.equal(direct.counts, torch.cat([
            torch.bincount(codes[:, list(subset)].to(torch.int64) @ torch.tensor(strides), minlength=size)
            for subset, strides, size in zip(grouped.layout.subsets, grouped.layout.strides, grouped.layout.sizes)
        ]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_engine_cpu_path_takes_every_integer_dtype_and_layout(dtype: torch.dtype, always_groups: None) -> None:
    cards = [3, 4, 5, 2]
    codes = random_codes(cards, 500, 3)
    expected = brute_force(codes.tolist(), cards, 2)
    for given_codes in (codes.to(dtype), codes.to(dtype).t().contiguous().t()):
        engine = ScenarioCoverageEngine(cards, k=2)
        engine.update(given_codes)
        assert engine.counts.tolist() == expected


@pytest.mark.parametrize("bad, message", [
    (lambda c: c.index_put_((torch.tensor([17]), torch.tensor([1])), torch.tensor(4)), "column 1.*value 4 at row 17"),
    (lambda c: c.index_put_((torch.tensor([3]), torch.tensor([0])), torch.tensor(-1)), "column 0.*value -1 at row 3"),
    (lambda c: c.index_put_((torch.tensor([9]), torch.tensor([2])), torch.tensor(70_000)), "column 2.*value 70000"),
])
def test_engine_cpu_path_refuses_out_of_range_codes_before_counting(bad, message: str, always_groups: None) -> None:
    cards = [3, 4, 5]
    codes = random_codes(cards, 100, 2)
    engine = ScenarioCoverageEngine(cards, k=2)
    with pytest.raises(DataError, match=message):
        engine.update(bad(codes.clone()))
    assert int(engine.counts.sum()) == 0


def test_engine_cpu_path_runs_on_one_thread_and_restores_the_count(always_groups: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = scenario_module.count_projections

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(scenario_module, "count_projections", spy)
    before = torch.get_num_threads()
    engine = ScenarioCoverageEngine([3, 4], k=2)
    engine.update(random_codes([3, 4], 200, 0))
    assert seen == [1] and torch.get_num_threads() == before
