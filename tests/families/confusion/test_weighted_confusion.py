"""The severity-weighted confusion engine (Cheng et al. 2018, §II-H): numbers, loaders, bound, errors.

* the engine against a direct numpy reference on random data (value, confusion, sorted breakdown);
* hypothesis properties: zero severity gives zero, scaling W scales value and bound, permuting the
  classes changes nothing, the bound lies between the value and Hoeffding's;
* TOML (flat, nested, matrix), CSV, dict and tensor loaders agree; every bad input is a clear error;
* the upper bound covers the true expected severity at least at the nominal rate over ≥ 200 seeds
  (where a normal-approximation bound does not);
* merge and state_payload round trips.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.confusion.weighted import (
    SeverityMatrix,
    WeightedConfusionEngine,
    kl_upper,
    severity_upper_bound,
)
from pytest_dnnsafety.errors import ConfigError, DataError

TABLE_I = ["pedestrian", "vehicle", "background"]
#: The paper's Table I, "+" counted: pedestrian -> background is the worst confusion.
TABLE_I_W = [[0, 4, 8], [2, 0, 6], [2, 2, 0]]


def _random_case(seed: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.uniform(0, 5, (k, k)) * (rng.random((k, k)) < 0.7)
    np.fill_diagonal(w, 0.0)
    y = rng.integers(0, k, n)
    pred = np.where(rng.random(n) < 0.3, rng.integers(0, k, n), y)
    return w, y, pred


def _engine(w: np.ndarray, y: np.ndarray, pred: np.ndarray, batch: int = 37, **kw: object) -> WeightedConfusionEngine:
    engine = WeightedConfusionEngine(torch.tensor(w), **kw)  # type: ignore[arg-type]
    for start in range(0, len(y), batch):
        engine.update(torch.tensor(pred[start:start + batch]), torch.tensor(y[start:start + batch]))
    return engine


@pytest.mark.parametrize("seed", range(8))
def test_engine_matches_a_direct_numpy_reference(seed: int) -> None:
    k, n = [(2, 50), (3, 400), (10, 1000), (7, 1), (12, 333), (5, 2000), (4, 10), (10, 5000)][seed]
    w, y, pred = _random_case(seed, k, n)
    res = _engine(w, y, pred).compute()
    c = np.zeros((k, k), dtype=np.int64)
    np.add.at(c, (y, pred), 1)
    assert np.array_equal(res.confusion.numpy(), c)
    # the definition, one input at a time: the mean severity W[y_i, ŷ_i]
    assert res.value == pytest.approx(np.mean(w[y, pred]), rel=1e-12, abs=1e-15)
    assert res.value == pytest.approx((w * c).sum() / n, rel=1e-12, abs=1e-15)
    assert res.accuracy == pytest.approx(np.mean(y == pred)) and res.n == n
    ref = sorted(((w[i, j] * c[i, j] / n, c[i, j], i, j) for i in range(k) for j in range(k) if i != j and c[i, j]),
                 key=lambda r: (-r[0], -r[1], r[2] * k + r[3]))
    got = res.pairs()
    assert [(p["true"], p["predicted"], p["count"]) for p in got] == [(str(i), str(j), cnt) for _, cnt, i, j in ref]
    assert [p["contribution"] for p in got] == pytest.approx([r[0] for r in ref], rel=1e-12)
    assert [p["weight"] for p in got] == [w[i, j] for _, _, i, j in ref]
    assert sum(p["contribution"] for p in got) == pytest.approx(res.value, rel=1e-12, abs=1e-15)
    assert res.value <= res.bound <= res.max_weight


def test_table_i_detail_names_the_worst_pair_by_class_names() -> None:
    engine = WeightedConfusionEngine(SeverityMatrix.from_tensor(TABLE_I_W, TABLE_I), confidence=0.9)
    y = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    pred = y.clone()
    pred[:3] = 2  # three pedestrians read as background (weight 8)
    pred[50:55] = 2  # five vehicles read as background (weight 6)
    pred[80:84] = 0  # four background read as pedestrian (weight 2)
    engine.update(pred, y)
    res = engine.compute()
    assert res.value == pytest.approx((3 * 8 + 5 * 6 + 4 * 2) / 100)
    assert [(p["true"], p["predicted"]) for p in res.pairs()] == [
        ("vehicle", "background"), ("pedestrian", "background"), ("background", "pedestrian")]
    assert "worst pair vehicle -> background: 5× weight 6" in res.detail()
    details = res.to_details(top=1)
    assert len(details["pairs"]) == 1 and details["pairs_total"] == 3 and details["errors"] == 12
    json.dumps(details)


# ----------------------------------------------------------------------------- properties

_cases = st.tuples(st.integers(0, 10**6), st.integers(2, 8), st.integers(1, 300))


@settings(max_examples=40, deadline=None)
@given(case=_cases)
def test_zero_severity_gives_zero(case: tuple[int, int, int]) -> None:
    _, y, pred = _random_case(*case)
    k = case[1]
    res = _engine(np.zeros((k, k)), y, pred).compute()
    assert res.value == 0.0 and res.bound == 0.0
    assert all(p["contribution"] == 0 for p in res.pairs())


@settings(max_examples=40, deadline=None)
@given(case=_cases, scale=st.floats(1e-3, 1e3), method=st.sampled_from(["kl", "hoeffding"]))
def test_scaling_w_scales_value_and_bound(case: tuple[int, int, int], scale: float, method: str) -> None:
    w, y, pred = _random_case(*case)
    base = _engine(w, y, pred, method=method).compute()
    scaled = _engine(w * scale, y, pred, method=method).compute()
    assert scaled.value == pytest.approx(base.value * scale, rel=1e-9, abs=1e-300)
    assert scaled.bound == pytest.approx(base.bound * scale, rel=1e-9, abs=1e-300)


@settings(max_examples=40, deadline=None)
@given(case=_cases, confidence=st.floats(0.5, 0.999))
def test_the_bound_lies_between_the_value_and_hoeffding(case: tuple[int, int, int], confidence: float) -> None:
    w, y, pred = _random_case(*case)
    kl = _engine(w, y, pred, confidence=confidence).compute()
    hoeffding = _engine(w, y, pred, confidence=confidence, method="hoeffding").compute()
    assert kl.value <= kl.bound <= hoeffding.bound + 1e-12
    perm = np.random.default_rng(case[0]).permutation(case[1])  # relabelling the classes changes nothing
    inv = np.argsort(perm)
    relabelled = _engine(w[np.ix_(perm, perm)], inv[y], inv[pred], confidence=confidence).compute()
    assert relabelled.value == pytest.approx(kl.value, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("x", "n", "confidence"), [(0.0, 10, 0.95), (0.0, 300, 0.99), (0.05, 100, 0.95),
                                                    (0.3, 50, 0.9), (0.9, 1000, 0.95), (0.999, 20, 0.95)])
def test_kl_upper_solves_its_equation(x: float, n: int, confidence: float) -> None:
    """Against scipy's root finder on n·kl(x, q) = ln(1/α) (and the Clopper–Pearson zero-failure bound)."""
    budget = math.log(1 / (1 - confidence))

    def kl(q: float) -> float:
        a = x * math.log(x / q) if x > 0 else 0.0
        return a + (1 - x) * math.log((1 - x) / (1 - q))

    top = 1 - 1e-15
    ref = 1.0 if n * kl(top) <= budget else brentq(lambda q: n * kl(q) - budget, x + 1e-15, top, xtol=1e-15)
    got = float(kl_upper(x, n, confidence))
    assert ref - 1e-14 <= got <= ref + 1e-12
    if x == 0:
        assert got == pytest.approx(1 - (1 - confidence) ** (1 / n), rel=1e-10)
    assert float(kl_upper(1.0, n, confidence)) == 1.0


# ----------------------------------------------------------------------------- coverage by simulation

SIMULATIONS = [
    # (name, K, class shares, P(ŷ | y) off-diagonal error rates, W, n)
    ("table-I, rare severe errors", TABLE_I_W, [0.3, 0.3, 0.4], 0.02, 60),
    ("digits-like 1<->7 weight 10", None, [0.1] * 10, 0.01, 200),
    ("0/1 severity (error rate)", [[0, 1], [1, 0]], [0.5, 0.5], 0.05, 40),
]


def _simulate(w: np.ndarray, shares: list[float], err: float, n: int, seed: int) -> tuple[float, float, float]:
    k = len(shares)
    p_pred = np.full((k, k), err / (k - 1)) + np.eye(k) * (1 - err - err / (k - 1))
    cell_p = (np.asarray(shares)[:, None] * p_pred).reshape(-1)
    rng = np.random.default_rng(seed)
    cells = rng.choice(k * k, size=n, p=cell_p)
    engine = WeightedConfusionEngine(torch.tensor(w), confidence=0.95)
    engine.update(torch.tensor(cells % k), torch.tensor(cells // k))
    res = engine.compute()
    severity = w.reshape(-1)[cells]
    normal = res.value + 1.6449 * severity.std(ddof=1) / math.sqrt(n) if n > 1 else res.value
    return float((cell_p * w.reshape(-1)).sum()), res.bound, normal


@pytest.mark.parametrize(("name", "w", "shares", "err", "n"), SIMULATIONS, ids=[s[0] for s in SIMULATIONS])
def test_the_upper_bound_covers_at_least_the_nominal_rate(name: str, w: list | None, shares: list[float],
                                                           err: float, n: int) -> None:
    if w is None:
        w_arr = np.ones((10, 10))
        w_arr[1, 7] = w_arr[7, 1] = 10.0
        np.fill_diagonal(w_arr, 0.0)
    else:
        w_arr = np.asarray(w, dtype=np.float64)
    seeds = 300
    runs = [_simulate(w_arr, shares, err, n, seed) for seed in range(seeds)]
    truth = runs[0][0]
    coverage = np.mean([bound >= truth for _, bound, _ in runs])
    normal = np.mean([nb >= truth for _, _, nb in runs])
    assert coverage >= 0.95, (name, coverage)
    # the normal approximation (mean + z·s/√n) does not cover when severe errors are rare
    if name.startswith("table-I"):
        assert normal < 0.95, (name, normal)


# ----------------------------------------------------------------------------- loaders

TOML_FLAT = """\
# Table I of the paper, "+" counted
classes = ["pedestrian", "vehicle", "background"]
default = 2.0  # every pair not listed below

[severity]
"pedestrian -> vehicle" = 4
"pedestrian -> background" = 8.0
"vehicle -> background" = 6
"""

TOML_NESTED = """\
classes = ["pedestrian", "vehicle", "background"]

[severity.pedestrian]
vehicle = 4
background = 8

[severity.vehicle]
pedestrian = 2
background = 6

[severity.background]
pedestrian = 2
vehicle = 2
"""

TOML_MATRIX = 'classes = ["pedestrian", "vehicle", "background"]\nmatrix = [[0, 4, 8], [2, 0, 6], [2, 2, 0]]\n'

CSV = """\
# rows: true class; columns: predicted class
true\\predicted,pedestrian,vehicle,background
pedestrian,,4,8
vehicle,2,0,6
background,2,2,
"""


def test_toml_csv_dict_and_tensor_loaders_agree(tmp_path: Path) -> None:
    files = {"flat.toml": TOML_FLAT, "nested.toml": TOML_NESTED, "matrix.toml": TOML_MATRIX, "table.csv": CSV}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    loaded = [SeverityMatrix.load(name, base_dir=tmp_path) for name in files]
    loaded.append(SeverityMatrix.load({"pedestrian": {"vehicle": 4, "background": 8}, "vehicle -> background": 6},
                                      TABLE_I, default=2.0))
    loaded.append(SeverityMatrix.load(torch.tensor(TABLE_I_W), TABLE_I))
    loaded.append(SeverityMatrix.load(np.asarray(TABLE_I_W), TABLE_I))
    for matrix in loaded:
        assert matrix.classes == tuple(TABLE_I), matrix.source
        assert torch.equal(matrix.weights, torch.tensor(TABLE_I_W, dtype=torch.float64)), matrix.source
    assert len({m.digest() for m in loaded}) == 1
    # the model's order differs from the file's: the matrix is permuted to it
    order = ["background", "pedestrian", "vehicle"]
    moved = SeverityMatrix.load(tmp_path / "table.csv", order)
    assert moved.classes == tuple(order) and moved.weights[1, 0] == 8 and moved.weights[0, 1] == 2


def test_defaults_indices_and_digit_names() -> None:
    matrix = SeverityMatrix.from_mapping({1: {7: 10}, "7 -> 1": 10}, num_classes=10)
    assert matrix.classes == tuple(map(str, range(10)))
    assert matrix.weights[1, 7] == matrix.weights[7, 1] == 10 and matrix.weights[0, 1] == 1.0
    assert float(matrix.weights.diagonal().abs().sum()) == 0
    zero = SeverityMatrix.from_mapping({"1": {"7": 3}}, num_classes=10, default=0.0)
    assert float(zero.weights.sum()) == 3
    # a file listing the digits in another order is put back in index order
    shuffled = SeverityMatrix.from_tensor(torch.ones(3, 3) - torch.eye(3), ["2", "0", "1"])
    shuffled.weights[0, 1] = 5  # true 2 -> predicted 0
    assert SeverityMatrix.load(shuffled).weights[2, 0] == 5


BAD = [
    (lambda p: SeverityMatrix.load(p / "flat.toml", num_classes=10),
     "is 3×3 (3 classes) but the model has 10 classes*Fix: give a 10×10"),
    (lambda p: SeverityMatrix.load(np.zeros((4, 4)), num_classes=3), "is 4×4 (4 classes) but the model has 3"),
    (lambda p: SeverityMatrix.from_mapping({"1": {"7": 1}}, num_classes=3), "names unknown class '7'"),
    (lambda p: SeverityMatrix.from_mapping({"pedestrain": {"vehicle": 1}}, TABLE_I),
     "unknown class 'pedestrain' (did you mean 'pedestrian'?)"),
    (lambda p: SeverityMatrix.from_mapping({"car -> bus": 1}, TABLE_I), "entry 'car -> bus' names unknown class 'car'"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"pedestrian": -1}}, TABLE_I),
     "entry vehicle -> pedestrian = -1.0 is negative*Fix: "),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"pedestrian": float("nan")}}, TABLE_I),
     "vehicle -> pedestrian = nan is not finite"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"vehicle": 3}}, TABLE_I),
     "vehicle -> vehicle = 3.0 is on the diagonal"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"bus": "x"}}, TABLE_I), "unknown class 'bus'"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"background": "x"}}, TABLE_I), "'x' is not a number"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": {"background": 1}, "vehicle -> background": 2}, TABLE_I),
     "vehicle -> background is given twice"),
    (lambda p: SeverityMatrix.from_mapping({"vehicle": 3}, TABLE_I), "entry 'vehicle' = 3 is neither a table"),
    (lambda p: SeverityMatrix.from_mapping({"1": {"7": 1}}), "the classes are unknown. Fix: give classes"),
    (lambda p: SeverityMatrix.from_tensor([[0, 1], [1]]), "not a K×K table of numbers"),
    (lambda p: SeverityMatrix.from_tensor(np.zeros((2, 3))), "has shape (2, 3)"),
    (lambda p: SeverityMatrix.from_tensor(np.zeros((1, 1))), "K ≥ 2"),
    (lambda p: SeverityMatrix.from_tensor(np.zeros((3, 3)), ["a", "b"]), "is 3×3 but names 2 classes"),
    (lambda p: SeverityMatrix.from_tensor(np.zeros((2, 2)), ["a", "a"]), "class names ['a'] appear twice"),
    (lambda p: SeverityMatrix.load(p / "table.csv", ["pedestrian", "vehicle", "cyclist"]),
     "names unknown classes ['background'] (missing: ['cyclist'])"),
    (lambda p: SeverityMatrix.load("missing.toml", base_dir=p), "missing.toml cannot be read as TOML"),
    (lambda p: SeverityMatrix.load("weights.json", base_dir=p), "must end in .toml or .csv"),
    (lambda p: SeverityMatrix.load(p / "extra.toml"), "has unknown keys ['weights']"),
    (lambda p: SeverityMatrix.load(p / "both.toml"), "must have exactly one of [severity] or matrix"),
    (lambda p: SeverityMatrix.load(p / "broken.toml"), "cannot be read as TOML"),
    (lambda p: SeverityMatrix.load(p / "ragged.csv"), "data row 2 ('b') has 1 weights for 2 classes"),
    (lambda p: SeverityMatrix.load(p / "word.csv"), "entry a -> b = 'high' is not a number"),
    (lambda p: SeverityMatrix.load(p / "negative.csv"), "entry b -> a = -2.0 is negative"),
    (lambda p: SeverityMatrix.load(p / "twice.csv"), "true class 'a' has two rows"),
    (lambda p: SeverityMatrix.load(p / "header.csv"), "no header row naming at least two classes"),
]


@pytest.mark.parametrize(("make", "expected"), BAD, ids=[e for _, e in BAD])
def test_bad_severity_inputs_are_clear_errors(tmp_path: Path, make: object, expected: str) -> None:
    (tmp_path / "flat.toml").write_text(TOML_FLAT)
    (tmp_path / "table.csv").write_text(CSV)
    (tmp_path / "extra.toml").write_text('weights = 1\n[severity]\n"0 -> 1" = 2\n')
    (tmp_path / "both.toml").write_text('matrix = [[0, 1], [1, 0]]\n[severity]\n"0 -> 1" = 2\n')
    (tmp_path / "broken.toml").write_text("[severity\n")
    (tmp_path / "ragged.csv").write_text(",a,b\na,,1\nb,1\n")
    (tmp_path / "word.csv").write_text(",a,b\na,,high\n")
    (tmp_path / "negative.csv").write_text(",a,b\nb,-2,\n")
    (tmp_path / "twice.csv").write_text(",a,b\na,,1\na,,2\n")
    (tmp_path / "header.csv").write_text(",a\n")
    with pytest.raises(ConfigError) as info:
        make(tmp_path)  # type: ignore[operator]
    assert "Fix:" in str(info.value)
    pattern = ".*".join(re.escape(part) for part in expected.split("*"))
    assert re.search(pattern, str(info.value), re.DOTALL), str(info.value)


def test_bad_batches_and_out_of_range_classes_are_data_errors() -> None:
    engine = WeightedConfusionEngine(torch.ones(3, 3) - torch.eye(3))
    with pytest.raises(DataError, match="1-D integer tensor"):
        engine.update(torch.zeros(4), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(DataError, match="3 predictions but 4 labels"):
        engine.update(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(DataError, match="no inputs were seen"):
        engine.compute()
    engine.update(torch.tensor([0, 5, 1]), torch.tensor([0, 1, -1]))  # no sync: counted, refused in compute
    with pytest.raises(DataError, match="2 inputs have a label or prediction outside 0..2"):
        engine.compute()
    with pytest.raises(ConfigError, match="confidence"):
        WeightedConfusionEngine(torch.ones(2, 2) - torch.eye(2), confidence=1.0)
    with pytest.raises(ConfigError, match="method"):
        severity_upper_bound(0.1, 10, 1.0, 0.95, method="normal")


# ----------------------------------------------------------------------------- merge and payloads


def test_merge_and_state_payload_round_trip() -> None:
    w, y, pred = _random_case(7, 6, 500)
    whole = _engine(w, y, pred).compute()
    first, second = _engine(w, y[:200], pred[:200]), _engine(w, y[200:], pred[200:])
    merged = first.merge(second).compute()
    assert torch.equal(merged.confusion, whole.confusion)
    assert (merged.value, merged.bound, merged.pairs()) == (whole.value, whole.bound, whole.pairs())
    payload = json.loads(json.dumps(_engine(w, y, pred, confidence=0.9).state_payload()))
    rebuilt = Engine.from_payload(payload)
    assert isinstance(rebuilt, WeightedConfusionEngine) and rebuilt.confidence == 0.9
    again = rebuilt.compute()
    assert torch.equal(again.confusion, whole.confusion) and again.value == whole.value
    other = WeightedConfusionEngine(torch.tensor(w * 2))
    with pytest.raises(ValueError, match="different 'weights'"):
        first.merge(other)
