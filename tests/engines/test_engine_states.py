"""The row states of the engine base: ``cat`` (every row) and ``topk(k, key)`` (the k best rows).

A toy engine holds a sum, cat and topk states; the tests check that its result does not depend
on the batch split, the merge of partial engines or their order, the JSON payload round trip,
or a 2-rank gloo ``sync``, and that bad arguments are refused with a message naming the state.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_dnnsafety.engines import Engine, TopK, topk

N = 40


class _Toy(Engine):
    """Scores with their global input index: a count, every row (cat) and the k best (topk)."""

    def __init__(
        self, k: int = 5, largest: bool = True, tie_break: bool = True, device: torch.device | str | None = None
    ) -> None:
        super().__init__(device)
        self.k, self.largest, self.tie_break = k, largest, tie_break
        self.add_state("n", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("rows", torch.zeros(0, 2, dtype=torch.float64), "cat")
        self.add_state("positive", torch.zeros(0, dtype=torch.bool), "cat")
        self.add_state("index", torch.zeros(0, 1, 1, dtype=torch.int32), "cat")
        rule = topk(k, 0, largest=largest, tie_break=1 if tie_break else None)
        self.add_state("best", torch.zeros(0, 2, dtype=torch.float64), rule)
        self.add_state("best_int", torch.zeros(0, 2, dtype=torch.int64), topk(k, 0, largest=largest, tie_break=1))

    def update(self, scores: torch.Tensor, start: int) -> None:
        index = torch.arange(start, start + scores.shape[0], device=self.device)
        rows = torch.stack([scores.to(self.device, torch.float64), index.to(torch.float64)], dim=1)
        self.n += scores.shape[0]
        self.append_state("rows", rows)
        self.append_state("positive", scores > 1)
        self.append_state("index", index.reshape(-1, 1, 1))
        self.append_state("best", rows)
        self.append_state("best_int", rows.to(torch.int64))

    def compute(self) -> dict[str, Any]:
        return {name: state.tolist() for name, state in self.states().items()}

    def config(self) -> dict[str, Any]:
        return {"k": self.k, "largest": self.largest, "tie_break": self.tie_break}


def _scores(n: int = N, seed: int = 0) -> torch.Tensor:
    """Small integer scores, so that many are tied."""
    return torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(seed)).to(torch.float32)


def _run(scores: torch.Tensor, sizes: list[int], start: int = 0, **kwargs: Any) -> _Toy:
    engine = _Toy(**kwargs)
    for chunk in scores.split(sizes):
        engine.update(chunk, start)
        start += chunk.shape[0]
    return engine


def _expected_best(scores: list[float], k: int, largest: bool = True, start: int = 0) -> list[list[float]]:
    rows = [(s, float(start + i)) for i, s in enumerate(scores)]
    ordered = sorted(rows, key=lambda r: (-r[0] if largest else r[0], r[1]))
    return [list(r) for r in ordered[:k]]


@pytest.mark.parametrize("sizes", [[N], [1] * N, [7, 13, 20], [0, 25, 0, 15], [39, 1]])
@pytest.mark.parametrize("largest", [True, False])
def test_result_does_not_depend_on_the_batch_split(sizes: list[int], largest: bool) -> None:
    scores = _scores()
    one = _run(scores, [N], largest=largest).compute()
    assert _run(scores, sizes, largest=largest).compute() == one
    assert one["n"] == N
    assert one["rows"] == [[float(s), float(i)] for i, s in enumerate(scores.tolist())]
    assert one["positive"] == (scores > 1).tolist()
    assert one["index"] == [[[i]] for i in range(N)]
    assert one["best"] == _expected_best(scores.tolist(), 5, largest)
    assert one["best_int"] == [[int(a), int(b)] for a, b in _expected_best(scores.tolist(), 5, largest)]


def test_merge_of_two_halves_equals_one_pass_and_topk_ignores_the_merge_order() -> None:
    scores = _scores()
    one = _run(scores, [N]).compute()
    left, right = _run(scores[:17], [5, 12]), _run(scores[17:], [23], start=17)
    assert _run(scores[:17], [5, 12]).merge(right).compute() == one
    swapped = _run(scores[17:], [23], start=17).merge(left).compute()
    assert swapped["best"] == one["best"] and swapped["best_int"] == one["best_int"]
    assert swapped["n"] == one["n"]
    # cat states concatenate this engine's rows, then the other's
    assert swapped["rows"] == one["rows"][17:] + one["rows"][:17]


def test_without_a_tie_break_tied_rows_stay_in_arrival_order() -> None:
    engine = _Toy(k=3, tie_break=False)
    engine.update(torch.tensor([1.0, 2.0, 1.0]), start=10)
    engine.update(torch.tensor([1.0, 2.0]), start=0)
    assert engine.best.tolist() == [[2.0, 11.0], [2.0, 1.0], [1.0, 10.0]]
    first, second = _Toy(k=3, tie_break=False), _Toy(k=3, tie_break=False)
    first.update(torch.tensor([1.0, 1.0]), start=5)
    second.update(torch.tensor([1.0, 1.0]), start=0)
    assert first.merge(second).best[:, 1].tolist() == [5.0, 6.0, 0.0]


def test_cat_appends_are_joined_once_when_read() -> None:
    engine = _Toy()
    for start in range(0, 200, 2):
        engine.update(torch.tensor([1.0, 3.0]), start)
    assert len(engine._row_chunks["rows"]) == 100  # nothing copied yet
    assert engine.rows.shape == (200, 2) and len(engine._row_chunks["rows"]) == 1
    assert engine.rows is engine.rows  # the joined tensor is kept
    assert engine.best.shape == (5, 2)  # topk is pruned at every append


@pytest.mark.parametrize("sizes", [[N], [0], [3]])
def test_payload_round_trip(sizes: list[int]) -> None:
    scores = _scores(sum(sizes))
    engine = _run(scores, sizes) if sum(sizes) else _Toy()
    payload = json.loads(json.dumps(engine.state_payload()))
    back = Engine.from_payload(payload)
    assert isinstance(back, _Toy)
    assert back.compute() == engine.compute()
    for name, state in engine.states().items():
        assert back.states()[name].dtype == state.dtype and back.states()[name].shape == state.shape
    if not sum(sizes):
        assert back.rows.shape == (0, 2) and back.index.shape == (0, 1, 1) and back.best.shape == (0, 2)
    # a restored engine keeps accumulating
    back.update(torch.tensor([9.0]), start=100)
    assert back.best[0].tolist() == [9.0, 100.0] and back.rows.shape[0] == sum(sizes) + 1


def test_payload_with_bad_row_states_is_refused() -> None:
    payload = _run(_scores(), [N]).state_payload()
    wrong = _Toy(k=10)
    wrong.update(_scores(), 0)
    states = dict(payload["states"])  # type: ignore[call-overload]
    states["best"] = wrong.state_payload()["states"]["best"]  # type: ignore[index]
    with pytest.raises(ValueError, match=r"'best' has 10 rows.*at most 5"):
        Engine.from_payload({**payload, "states": states})
    states["best"] = payload["states"]["rows"]  # type: ignore[index]
    states["rows"] = payload["states"]["index"]  # type: ignore[index]
    with pytest.raises(ValueError, match=r"'rows' is \(40, 1, 1\)/torch.int32, expected rows \(n, 2\)"):
        Engine.from_payload({**payload, "states": states})


def test_reset_and_to_cpu() -> None:
    engine = _run(_scores(), [10, 30])
    before = engine.compute()
    assert engine.to("cpu") is engine and engine.compute() == before
    engine.reset()
    empty = engine.compute()
    assert empty == {"n": 0, "rows": [], "positive": [], "index": [], "best": [], "best_int": []}
    assert engine.rows.shape == (0, 2) and engine.best.dtype == torch.float64
    engine.rows[:0] = 1.0  # reading an empty state gives a copy, never the default itself
    assert engine._defaults["rows"].shape == (0, 2)
    engine.update(_scores(), 0)
    assert engine.compute() == before


def test_assigning_a_cat_state_replaces_its_rows() -> None:
    engine = _run(_scores(), [N])
    engine.rows = engine.rows[:3]
    assert engine.rows.shape == (3, 2) and "rows" not in engine.__dict__
    engine.update(torch.tensor([1.0]), 3)
    assert engine.rows[:, 1].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"state 'rows': rows must have shape \(n, 2\), got \(3,\)"):
        engine.rows = torch.zeros(3)


def test_bool_topk_keys_and_int_cat_rows() -> None:
    class _Flags(Engine):
        def __init__(self, device: torch.device | str | None = None) -> None:
            super().__init__(device)
            self.add_state("first_true", torch.zeros(0, 2, dtype=torch.bool), topk(2, 0, tie_break=1))
            self.add_state("codes", torch.zeros(0, 3, dtype=torch.int16), "cat")

        def update(self, rows: torch.Tensor) -> None:
            self.append_state("first_true", rows)
            self.append_state("codes", rows.to(torch.int16).repeat(1, 2)[:, :3])

        def compute(self) -> Any:
            return self.first_true.tolist(), self.codes.tolist()

    flags = _Flags()
    flags.update(torch.tensor([[False, True], [True, True], [True, False], [False, False]]))
    assert flags.compute()[0] == [[True, False], [True, True]]
    assert flags.codes.dtype == torch.int16 and flags.codes.shape == (4, 3)
    back = Engine.from_payload(json.loads(json.dumps(flags.state_payload())))
    assert back.compute() == flags.compute()


def test_bad_arguments_are_refused_naming_the_state() -> None:
    for bad_k in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="k must be an integer >= 1"):
            topk(bad_k, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key must be a column index >= 0, got -1"):
        topk(3, -1)
    with pytest.raises(ValueError, match="tie_break must be a column other than key"):
        topk(3, 1, tie_break=1)

    class _Bad(Engine):
        def __init__(self, default: torch.Tensor, reduce: Any, device: Any = None) -> None:
            super().__init__(device)
            self.add_state("worst", default, reduce)

        def update(self) -> None:  # pragma: no cover - never called
            pass

        def compute(self) -> None:  # pragma: no cover - never called
            pass

    with pytest.raises(ValueError, match=r"'worst': topk\(k=3, key=2\) key column 2 is out of range for rows of 2"):
        _Bad(torch.zeros(0, 2), topk(3, 2))
    with pytest.raises(ValueError, match=r"tie_break column 5 is out of range"):
        _Bad(torch.zeros(0, 2), topk(3, 0, tie_break=5))
    with pytest.raises(ValueError, match=r"state 'worst': a cat state's default must be an empty tensor"):
        _Bad(torch.zeros(3, 2), "cat")
    with pytest.raises(ValueError, match=r"state 'worst': a topk state holds rows of shape \(m, d\)"):
        _Bad(torch.zeros(0, 2, 2), topk(3, 0))
    with pytest.raises(ValueError, match=r"reduce must be one of .*'cat'\] or topk\(k, key\), got 'concat'"):
        _Bad(torch.zeros(0, 2), "concat")

    engine = _Toy()
    with pytest.raises(ValueError, match=r"state 'rows': rows must have shape \(n, 2\), got \(4, 3\)"):
        engine.append_state("rows", torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"state 'best': rows must have shape \(n, 2\), got \(2,\)"):
        engine.append_state("best", torch.zeros(2))
    with pytest.raises(TypeError, match="state 'rows': rows must be a torch.Tensor, got list"):
        engine.append_state("rows", [[1.0, 2.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"append_state: 'n' is not a cat or topk state of _Toy"):
        engine.append_state("n", torch.zeros(1))
    with pytest.raises(ValueError, match="different 'k': 5 vs 4"):
        engine.merge(_Toy(k=4))
    with pytest.raises(AttributeError, match="no attribute 'rowz'"):
        engine.rowz  # noqa: B018
    assert isinstance(_Toy()._reductions["best"], TopK) and str(_Toy()._reductions["best"]) == (
        "topk(k=5, key=0, tie_break=1)"
    )


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.integers(-3, 3), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=4),
    k=st.integers(1, 8),
    largest=st.booleans(),
    tie_break=st.booleans(),
)
def test_topk_matches_a_sorted_reference(
    scores: list[int], cuts: list[int], k: int, largest: bool, tie_break: bool
) -> None:
    """Any split into batches and partial engines keeps what ``sorted()`` over all the rows keeps."""
    bounds = sorted({0, len(scores), *(min(c, len(scores)) for c in cuts)})
    engines = []
    for lo, hi in zip(bounds, bounds[1:]):
        engine = _Toy(k=k, largest=largest, tie_break=tie_break)
        engine.update(torch.tensor(scores[lo:hi], dtype=torch.float32), lo)
        engines.append(engine)
    total = _Toy(k=k, largest=largest, tie_break=tie_break)
    for engine in engines:
        total.merge(engine)
    # by the indices ascending: that is arrival order too, so the reference holds with and without a tie-break
    assert total.best.tolist() == _expected_best([float(s) for s in scores], k, largest)
    assert total.rows[:, 1].tolist() == [float(i) for i in range(len(scores))]
    if tie_break and len(engines) > 1:
        reverse = _Toy(k=k, largest=largest, tie_break=True)
        for engine in reversed(engines):
            reverse.merge(engine)
        assert reverse.best.tolist() == total.best.tolist()


def _rank(rank: int, world: int) -> dict[str, Any]:
    """Each split: rank r folds its share of the scores, syncs, and returns the synced result."""
    scores = _scores()
    out = {}
    for label, shares in {"uneven": [13, 27], "one_empty": [0, N], "other_empty": [N, 0], "all_empty": [0, 0]}.items():
        start = sum(shares[:rank])
        mine = scores[start : start + shares[rank]] if sum(shares) else scores[:0]
        engine = _run(mine, [mine.shape[0]], start=start)
        engine.sync()
        out[label] = engine.compute()
    return out


@pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_sync_row_states_to_the_single_process_result() -> None:
    results = run_on_gloo_ranks(_rank, 2)
    single = json.loads(json.dumps(_run(_scores(), [N]).compute()))
    empty = json.loads(json.dumps(_Toy().compute()))
    for result in results:
        assert result["uneven"] == single
        assert result["one_empty"] == single
        assert result["other_empty"] == single
        assert result["all_empty"] == empty
