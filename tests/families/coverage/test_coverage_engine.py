"""The engine protocol (engines/base.py) and the scenario k-projection coverage engine."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_dnnsafety.engines import Engine, ProjectionLayout, ScenarioCoverageEngine
from pytest_dnnsafety.engines.core.base import PAYLOAD_VERSION
from pytest_dnnsafety.engines.coverage.scenario import MAX_CELLS
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

FIG2_CARDS = [3, 3, 2]  # weather, road, orientation (Cheng et al. 2018, Fig. 2)


def reference_counts(codes: list[list[int]], cards: list[int], k: int) -> list[int]:
    """Per-cell counts in the engine's flat layout, with itertools and a Counter."""
    flat: list[int] = []
    for subset in itertools.combinations(range(len(cards)), k):
        seen = Counter(tuple(row[c] for c in subset) for row in codes)
        flat.extend(seen[cell] for cell in itertools.product(*(range(cards[c]) for c in subset)))
    return flat


@st.composite
def code_tables(draw: st.DrawFn, max_conditions: int = 5, max_card: int = 4, max_rows: int = 40):
    n = draw(st.integers(1, max_conditions))
    cards = draw(st.lists(st.integers(1, max_card), min_size=n, max_size=n))
    rows = draw(st.lists(st.tuples(*(st.integers(0, c - 1) for c in cards)), max_size=max_rows))
    k = draw(st.integers(1, min(3, n)))
    return cards, [list(r) for r in rows], k


def as_codes(rows: list[list[int]], n: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), n)


# ---------------------------------------------------------------------- layout and counting
def test_fig2_two_rows_give_6_of_21_then_9_of_21() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS, k=2)
    engine.update(torch.tensor([[0, 0, 0], [2, 2, 1]]))
    out = engine.compute()
    assert (int(out.covered), int(out.total)) == (6, 21)
    assert out.covered_per_subset.tolist() == [2, 2, 2]
    assert out.total_per_subset.tolist() == [9, 6, 6]
    engine.update(torch.tensor([[1, 1, 1]]))
    out = engine.compute()
    assert (int(out.covered), int(out.total)) == (9, 21)
    assert float(out.value) == pytest.approx(9 / 21)


def test_layout_is_combinations_then_mixed_radix_product_order() -> None:
    layout = ProjectionLayout((3, 2, 4), 2)
    assert layout.subsets == ((0, 1), (0, 2), (1, 2))
    assert layout.offsets == (0, 6, 18, 26)
    flat = torch.arange(layout.total)
    subset_ids, values = layout.decode(flat)
    expected = [
        (s, cell)
        for s, subset in enumerate(layout.subsets)
        for cell in itertools.product(*(range(layout.cardinalities[c]) for c in subset))
    ]
    assert list(zip(subset_ids.tolist(), map(tuple, values.tolist()))) == expected
    for s in range(layout.n_subsets):
        block = layout.subset_cells(s)
        assert [tuple(v) for v in block.tolist()] == [cell for sid, cell in expected if sid == s]


@settings(max_examples=60, deadline=None)
@given(code_tables())
def test_counts_equal_itertools_reference(table) -> None:
    cards, rows, k = table
    engine = ScenarioCoverageEngine(cards, k=k)
    engine.update(as_codes(rows, len(cards)))
    assert engine.counts.tolist() == reference_counts(rows, cards, k)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_counts_for_every_k_up_to_n(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    cards = [3, 4, 2, 5, 3]
    codes = torch.stack([torch.randint(0, c, (300,), generator=gen) for c in cards], dim=1)
    engine = ScenarioCoverageEngine(cards, k=k)
    engine.update(codes)
    assert engine.counts.tolist() == reference_counts(codes.tolist(), cards, k)


def test_cell_indices_agree_with_float_matmul_path() -> None:
    gen = torch.Generator().manual_seed(3)
    cards = [8, 7, 6, 5, 4, 3]
    codes = torch.stack([torch.randint(0, c, (500,), generator=gen) for c in cards], dim=1)
    engine = ScenarioCoverageEngine(cards, k=3)
    exact = engine.layout.cell_indices(codes)
    assert torch.equal(engine._chunk_indices(codes).to(torch.int64), exact)


@pytest.mark.parametrize("use_bincount", [True, False])
@pytest.mark.parametrize("use_float_index", [True, False])
def test_accelerator_code_paths_count_the_same(use_bincount: bool, use_float_index: bool) -> None:
    """index_add_ (used off the CPU) and the integer gather (used where float64 is missing) agree."""
    gen = torch.Generator().manual_seed(5)
    cards = [4, 3, 5, 2]
    codes = torch.stack([torch.randint(0, c, (777,), generator=gen) for c in cards], dim=1)
    engine = ScenarioCoverageEngine(cards, k=2)
    engine._use_bincount, engine._use_float_index, engine.chunk_rows = use_bincount, use_float_index, 100
    engine.update(codes)
    assert engine.counts.tolist() == reference_counts(codes.tolist(), cards, 2)


def test_min_count_and_feasible_mask_shape_the_value() -> None:
    feasible = torch.ones(21, dtype=torch.bool)
    feasible[[1, 2]] = False  # weather=sunny × road=mud/tarmac declared impossible
    engine = ScenarioCoverageEngine(FIG2_CARDS, k=2, min_count=2, feasible=feasible)
    engine.update(torch.tensor([[0, 0, 0], [0, 0, 0], [2, 2, 1], [0, 1, 1]]))
    out = engine.compute()
    # (0,0)@weather×road, (0,0)@weather×orient, (0,0)@road×orient have 2 rows each.
    assert (int(out.covered), int(out.total)) == (3, 19)
    assert out.infeasible_per_subset.tolist() == [2, 0, 0]
    assert int(out.occupied_infeasible_per_subset.sum()) == 0
    assert bool(out.uncovered[1]) is False  # infeasible cells are never holes


def test_data_in_infeasible_cells_is_reported_not_counted() -> None:
    feasible = torch.ones(21, dtype=torch.bool)
    feasible[1] = False
    engine = ScenarioCoverageEngine(FIG2_CARDS, feasible=feasible)
    engine.update(torch.tensor([[0, 1, 0]]))
    out = engine.compute()
    assert int(out.covered) == 2 and int(out.total) == 20
    assert out.occupied_infeasible_per_subset.tolist() == [1, 0, 0]


def test_no_rows_gives_zero_coverage() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS)
    engine.update(torch.zeros(0, 3, dtype=torch.int64))
    out = engine.compute()
    assert float(out.value) == 0.0 and int(out.total) == 21


def test_all_cells_infeasible_is_a_metric_error() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS, feasible=torch.zeros(21, dtype=torch.bool))
    with pytest.raises(MetricError, match="all 21 k=2 projection cells are infeasible"):
        engine.compute()


# ---------------------------------------------------------------------- validation
def test_codes_out_of_range_name_condition_row_and_value() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS, names=["weather", "road", "orientation"])
    with pytest.raises(DataError, match=r"condition 'road' \(column 1\) has value 3 at row 1, outside 0\.\.2"):
        engine.update(torch.tensor([[0, 0, 0], [0, 3, 0]]))
    with pytest.raises(DataError, match=r"condition 'orientation' \(column 2\) has value -1 at row 0"):
        engine.update(torch.tensor([[0, 0, -1]]))
    assert int(engine.counts.sum()) == 0  # a rejected batch changes nothing


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (torch.zeros(2, 3), "integer tensor"),
        (torch.zeros(2, 3, dtype=torch.bool), "integer tensor"),
        (torch.zeros(2, 4, dtype=torch.int64), r"shape \(rows, 3\)"),
        (torch.zeros(3, dtype=torch.int64), r"shape \(rows, 3\)"),
        ([[0, 0, 0]], "must be a torch.Tensor"),
    ],
)
def test_bad_codes_are_data_errors(codes, message: str) -> None:
    with pytest.raises(DataError, match=message):
        ScenarioCoverageEngine(FIG2_CARDS).update(codes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cardinalities": []}, "at least one condition"),
        ({"cardinalities": [3, 0]}, "cardinality of condition 1"),
        ({"cardinalities": [3, 2], "k": 3}, "k must be an int between 1 and"),
        ({"cardinalities": [3, 2], "k": 0}, "k must be an int between 1 and"),
        ({"cardinalities": [3, 2], "min_count": 0}, "min_count must be a positive int"),
        ({"cardinalities": [3, 2], "feasible": torch.ones(5, dtype=torch.bool)}, r"shape \(6,\)"),
        ({"cardinalities": [3, 2], "names": ["a"]}, "names has 1 entries"),
        ({"cardinalities": [64] * 8, "k": 5}, f"cap of {MAX_CELLS:,} cells"),
    ],
)
def test_bad_configuration_is_a_config_error(kwargs, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ScenarioCoverageEngine(**kwargs)


# ---------------------------------------------------------------------- protocol: merge, payload, reset
def test_merge_payload_and_reset() -> None:
    gen = torch.Generator().manual_seed(1)
    cards = [4, 3, 5, 2]
    codes = torch.stack([torch.randint(0, c, (200,), generator=gen) for c in cards], dim=1)
    feasible = torch.rand(ProjectionLayout(tuple(cards), 2).total, generator=gen) > 0.2
    whole = ScenarioCoverageEngine(cards, feasible=feasible, names=list("abcd"))
    whole.update(codes)
    left = ScenarioCoverageEngine(cards, feasible=feasible, names=list("abcd"))
    right = ScenarioCoverageEngine(cards, feasible=feasible, names=list("abcd"))
    left.update(codes[:77])
    right.update(codes[77:])
    wire = json.loads(json.dumps(right.state_payload()))
    rebuilt = Engine.from_payload(wire)
    assert isinstance(rebuilt, ScenarioCoverageEngine)
    assert torch.equal(rebuilt.feasible, feasible) and rebuilt.names == tuple("abcd")
    assert left.merge(rebuilt) is left
    assert torch.equal(left.counts, whole.counts)
    assert float(left.compute().value) == float(whole.compute().value)
    left.reset()
    assert int(left.counts.sum()) == 0 and left.counts.device == left.device


def test_payload_holds_only_plain_python_values() -> None:
    engine = ScenarioCoverageEngine([2, 2], min_count=2)
    engine.update(torch.tensor([[0, 1]]))
    payload = engine.state_payload()

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (str, int, float, bool))

    assert plain(payload)
    assert ScenarioCoverageEngine.from_payload(payload).counts.tolist() == engine.counts.tolist()


@pytest.mark.parametrize(
    ("other", "difference"),
    [
        (lambda: ScenarioCoverageEngine([3, 3, 2], k=3), "'k'"),
        (lambda: ScenarioCoverageEngine([3, 3, 3]), "'cardinalities'"),
        (lambda: ScenarioCoverageEngine([3, 3, 2], min_count=2), "'min_count'"),
        (lambda: ScenarioCoverageEngine([3, 3, 2], feasible=torch.arange(21) != 4), "'infeasible'"),
    ],
)
def test_merge_refuses_a_different_configuration_and_names_it(other, difference: str) -> None:
    with pytest.raises(ValueError, match=f"different {difference}"):
        ScenarioCoverageEngine(FIG2_CARDS).merge(other())


def test_merge_refuses_another_engine_class() -> None:
    with pytest.raises(ValueError, match="same class"):
        ScenarioCoverageEngine(FIG2_CARDS).merge(ToyEngine())


def test_payload_for_another_engine_is_refused() -> None:
    payload = ToyEngine().state_payload()
    with pytest.raises(ValueError, match="not 'pytest_dnnsafety.engines.coverage.scenario.ScenarioCoverageEngine'"):
        ScenarioCoverageEngine.from_payload(payload)


def test_sync_without_distributed_is_a_no_op() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS)
    engine.update(torch.tensor([[0, 0, 0]]))
    before = engine.counts.clone()
    assert engine.sync() is engine
    assert torch.equal(engine.counts, before)


def test_to_moves_states_and_buffers() -> None:
    engine = ScenarioCoverageEngine(FIG2_CARDS).to("cpu")
    engine.update(torch.tensor([[1, 1, 1]]))
    assert engine.counts.device.type == "cpu" and engine.feasible.device.type == "cpu"
    assert "ScenarioCoverageEngine(cardinalities=[3, 3, 2]" in repr(engine)


# ---------------------------------------------------------------------- the generic protocol
class ToyEngine(Engine):
    """One state per reduce rule, to test the protocol itself."""

    def __init__(self, size: int = 3, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.size = size
        self.add_state("total", torch.zeros(size, dtype=torch.int64), reduce="sum")
        self.add_state("high", torch.full((size,), -1e9), reduce="max")
        self.add_state("low", torch.full((size,), 1e9), reduce="min")
        self.add_state("seen", torch.zeros(size, dtype=torch.bool), reduce="or")
        self.add_state("always", torch.ones(size, dtype=torch.uint8), reduce="and")

    def config(self) -> dict[str, object]:
        return {"size": self.size}

    def update(self, x: torch.Tensor) -> None:
        self.total += (x > 0).sum(0)
        self.high = torch.maximum(self.high, x.max(0).values)
        self.low = torch.minimum(self.low, x.min(0).values)
        self.seen |= (x > 0).any(0)
        self.always &= (x > 0).all(0).to(torch.uint8)

    def compute(self) -> dict[str, list]:
        return {name: state.tolist() for name, state in self.states().items()}


def test_every_reduce_rule_merges_like_one_pass() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0], [0.5, 2.0, 7.0], [-1.0, 3.0, 1.0]])
    whole, a, b = ToyEngine(), ToyEngine(), ToyEngine()
    whole.update(x)
    a.update(x[:2])
    b.update(x[2:])
    b_wire = Engine.from_payload(json.loads(json.dumps(b.state_payload())))
    assert a.merge(b_wire).compute() == whole.compute()


def test_non_finite_floats_survive_the_payload() -> None:
    engine = ToyEngine()
    engine.high = torch.tensor([float("inf"), float("-inf"), float("nan")])
    text = json.dumps(engine.state_payload(), allow_nan=False)
    rebuilt = ToyEngine.from_payload(json.loads(text))
    assert rebuilt.high[0] == float("inf") and rebuilt.high[1] == float("-inf") and rebuilt.high[2].isnan()


def test_add_state_validates() -> None:
    engine = ToyEngine()
    with pytest.raises(ValueError, match="already defined"):
        engine.add_state("total", torch.zeros(1), reduce="sum")
    with pytest.raises(ValueError, match="reduce must be one of"):
        engine.add_state("other", torch.zeros(1), reduce="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a bool or integer tensor"):
        engine.add_state("flag", torch.zeros(1), reduce="or")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        engine.add_state("plain", [0], reduce="sum")  # type: ignore[arg-type]


def test_engine_is_abstract() -> None:
    with pytest.raises(TypeError):
        Engine()  # type: ignore[abstract]


def test_unknown_payloads_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        Engine.from_payload({"engine": "nowhere.Engine", "version": PAYLOAD_VERSION, "config": {}, "states": {}})
    with pytest.raises(ValueError, match="version"):
        Engine.from_payload({"engine": "x", "version": 99})
    payload = ToyEngine().state_payload()
    payload["states"]["total"]["data"] = [1, 2]  # type: ignore[index]
    with pytest.raises(ValueError, match="has 2 values but shape"):
        Engine.from_payload(payload)


# ---------------------------------------------------------------------- properties
@settings(max_examples=50, deadline=None)
@given(code_tables(), st.data())
def test_value_is_a_ratio_and_monotone_in_rows(table, data) -> None:
    cards, rows, k = table
    n = len(cards)
    engine = ScenarioCoverageEngine(cards, k=k)
    engine.update(as_codes(rows, n))
    before = float(engine.compute().value)
    more = data.draw(st.lists(st.tuples(*(st.integers(0, c - 1) for c in cards)), max_size=10))
    engine.update(as_codes([list(r) for r in more], n))
    after = float(engine.compute().value)
    assert 0.0 <= before <= after <= 1.0


@settings(max_examples=50, deadline=None)
@given(code_tables(), st.data())
def test_merge_of_halves_and_batch_splitting_equal_one_pass(table, data) -> None:
    cards, rows, k = table
    n = len(cards)
    codes = as_codes(rows, n)
    min_count = data.draw(st.integers(1, 3))
    whole = ScenarioCoverageEngine(cards, k=k, min_count=min_count)
    whole.update(codes)
    cut = data.draw(st.integers(0, len(rows)))
    left = ScenarioCoverageEngine(cards, k=k, min_count=min_count)
    right = ScenarioCoverageEngine(cards, k=k, min_count=min_count)
    left.update(codes[:cut])
    right.update(codes[cut:])
    merged = ScenarioCoverageEngine.from_payload(json.loads(json.dumps(left.state_payload())))
    merged.merge(right)
    assert torch.equal(merged.counts, whole.counts)
    batched = ScenarioCoverageEngine(cards, k=k, min_count=min_count)
    batched.chunk_rows = data.draw(st.integers(1, 7))
    sizes = data.draw(st.lists(st.integers(0, 9), max_size=8))
    start = 0
    for size in sizes:
        batched.update(codes[start : start + size])
        start += size
    batched.update(codes[start:])
    assert torch.equal(batched.counts, whole.counts)
    assert float(batched.compute().value) == float(whole.compute().value)
