"""ScenarioPerformanceEngine: per-group accuracy and exact lower bounds against hand references.

References are written out per group with numpy and scipy's beta quantiles (no statsmodels); the
lower bound's coverage is checked by simulation over hundreds of seeds, and compared with the
normal (Wald) bound it replaces, which under-covers exactly where a gate on a few lucky samples
would pass.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine, resolve_by
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

DOMAINS = {"lighting": ["day", "dusk", "night"], "noise": ["low", "high"], "camera": ["a", "b"]}


def _table(n: int = 400, seed: int = 0, restrictions: tuple = ()) -> ScenarioTable:
    conditions = Conditions(DOMAINS, list(restrictions))
    gen = torch.Generator().manual_seed(seed)
    codes = torch.stack([torch.randint(0, len(d), (n,), generator=gen) for d in DOMAINS.values()], 1)
    return ScenarioTable(conditions, codes[conditions.feasible_mask(codes)])


def _cp_lower(k: int, n: int, c: float) -> float:
    return 0.0 if k == 0 else float(stats.beta.ppf(1 - c, k, n - k + 1))


def _cp_upper(k: int, n: int, c: float) -> float:
    return 1.0 if k == n else float(stats.beta.ppf(c, k + 1, n - k))


def _reference(table: ScenarioTable, by: list[str], correct: np.ndarray, c: float) -> dict[tuple, tuple]:
    """Per group key: (size, correct, accuracy, lower) by an explicit loop over the rows."""
    rows = list(table.rows())
    out = {}
    for key in np.ndindex(*[len(DOMAINS[b]) for b in by]):
        values = tuple(DOMAINS[b][i] for b, i in zip(by, key))
        hits = [bool(correct[r]) for r, row in enumerate(rows) if tuple(row[b] for b in by) == values]
        n, k = len(hits), sum(hits)
        out[values] = (n, k, k / n if n else None, _cp_lower(k, n, c) if n else None)
    return out


@pytest.mark.parametrize("by", [["lighting"], ["noise", "lighting"], ["lighting", "noise", "camera"]])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_groups_match_a_hand_reference(by: list[str], confidence: float) -> None:
    table = _table()
    gen = np.random.default_rng(1)
    correct = gen.random(len(table)) < 0.85
    engine = ScenarioPerformanceEngine.from_table(table, by, confidence=confidence, min_samples=5)
    engine.update(engine.group_index(table), torch.from_numpy(correct))
    res = engine.compute()
    ref = _reference(table, by, correct, confidence)
    assert len(res.groups) == len(ref) == math.prod(len(DOMAINS[b]) for b in by)
    n, k = len(table), int(correct.sum())
    overall_upper = _cp_upper(k, n, (1 + confidence) / 2)
    for group in res.groups:
        size, hits, acc, lower = ref[tuple(group.key[b] for b in by)]
        assert (group.size, group.correct) == (size, hits)
        assert group.accuracy == pytest.approx(acc)
        assert group.lower == pytest.approx(lower, abs=1e-10)
        assert group.drop == pytest.approx(k / n - acc)
        assert group.drop_bound == pytest.approx(overall_upper - _cp_lower(hits, size, (1 + confidence) / 2),
                                                 abs=1e-10)
    assert res.accuracy == pytest.approx(k / n) and res.n == n
    assert res.overall_upper == pytest.approx(overall_upper, abs=1e-10)
    worst = min((g for g in res.groups if g.size >= 5), key=lambda g: g.lower)
    assert res.worst is not None and res.worst.lower == worst.lower
    assert res.degradation == pytest.approx(max(k / n - g.accuracy for g in res.groups if g.size >= 5))
    details = json.loads(json.dumps(res.to_details()))
    lowers = [g["lower"] for g in details["groups"] if g["assessable"]]
    assert lowers == sorted(lowers) and details["worst_group"] == res.worst.label()
    assert res.worst.label() in res.detail()


def test_three_perfect_samples_have_a_low_bound() -> None:
    """3/3 correct: the exact 95% lower bound is 0.05^(1/3) ≈ 0.368, nowhere near 1."""
    engine = ScenarioPerformanceEngine(["weather"], [["fog"]], confidence=0.95)
    engine.update(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool))
    (group,) = engine.compute().groups
    assert group.accuracy == 1.0 and group.lower == pytest.approx(0.05 ** (1 / 3))


def test_empty_groups_are_groups_and_restricted_ones_are_not_required() -> None:
    table = _table(restrictions=({"lighting": "night", "noise": "high"},))
    keep = ~((table.codes[:, 0] == 1) & (table.codes[:, 1] == 0))  # no dusk × low rows
    table = ScenarioTable(table.conditions, table.codes[keep])
    engine = ScenarioPerformanceEngine.from_table(table, ["lighting", "noise"])
    engine.update(engine.group_index(table), torch.ones(len(table), dtype=torch.bool))
    res = engine.compute()
    assert [g.label() for g in res.empty] == ["lighting=dusk × noise=low"]
    infeasible = [g for g in res.groups if not g.feasible]
    assert [g.label() for g in infeasible] == ["lighting=night × noise=high"] and infeasible[0].size == 0
    # M_scene of the `by` subset: 4 of the 5 feasible groups hold a row, as the table's own coverage says
    assert res.scenario_coverage == pytest.approx(4 / 5)
    coverage = table.coverage(k=2, propose=0)
    subset = next(s for s in coverage.per_subset if s.conditions == ("lighting", "noise"))
    assert res.scenario_coverage == pytest.approx(subset.value)
    assert res.coverage_discounted == pytest.approx(res.accuracy * 4 / 5)
    assert res.to_details()["empty_groups"] == ["lighting=dusk × noise=low"]


def test_per_class_recall_matches_a_reference() -> None:
    table = _table(300, seed=3)
    gen = np.random.default_rng(3)
    labels = gen.integers(0, 4, len(table))
    preds = np.where(gen.random(len(table)) < 0.7, labels, gen.integers(0, 4, len(table)))
    engine = ScenarioPerformanceEngine.from_table(table, ["lighting"], num_classes=4)
    engine.update(engine.group_index(table), torch.from_numpy(preds == labels), torch.from_numpy(labels))
    light = table.codes[:, 0].numpy()
    for group in engine.compute().groups:
        for cls in range(4):
            rows = (light == group.index) & (labels == cls)
            assert group.class_sizes[cls] == rows.sum()
            expected = (preds[rows] == cls).mean() if rows.any() else None
            assert group.recall[cls] == (pytest.approx(expected) if expected is not None else None)


def test_merge_equals_one_engine_on_all_data_and_payload_round_trips() -> None:
    table = _table(500, seed=5)
    gen = np.random.default_rng(5)
    correct = torch.from_numpy(gen.random(len(table)) < 0.9)
    labels = torch.from_numpy(gen.integers(0, 3, len(table)))
    whole = ScenarioPerformanceEngine.from_table(table, ["camera", "lighting"], num_classes=3, min_samples=10)
    index = whole.group_index(table)
    whole.update(index, correct, labels)
    parts = [ScenarioPerformanceEngine.from_table(table, ["camera", "lighting"], num_classes=3, min_samples=10)
             for _ in range(3)]
    for part, chunk in zip(parts, np.array_split(np.arange(len(table)), 3)):
        part.update(index[chunk], correct[chunk], labels[chunk])
    merged = parts[0].merge(parts[1]).merge(parts[2])
    for name in whole.state_names:
        assert torch.equal(getattr(merged, name), getattr(whole, name))
    assert merged.compute() == whole.compute()
    payload = json.loads(json.dumps(whole.state_payload()))
    again = Engine.from_payload(payload)
    assert isinstance(again, ScenarioPerformanceEngine) and again.compute() == whole.compute()
    with pytest.raises(ValueError, match="different 'min_samples'"):
        whole.merge(ScenarioPerformanceEngine.from_table(table, ["camera", "lighting"], num_classes=3))


# ------------------------------------------------------------------ coverage of the lower bound by simulation
SIZES = (3, 10, 30, 100)
ACCURACIES = (0.5, 0.8, 0.95, 0.99)
SEEDS = 1000


def _simulated_lowers(n: int, p: float, confidence: float) -> np.ndarray:
    """One group per seed: the engine's lower bound on each seed's n Bernoulli(p) outcomes."""
    draws = torch.stack([torch.rand(n, generator=torch.Generator().manual_seed(seed)) < p for seed in range(SEEDS)])
    engine = ScenarioPerformanceEngine(["seed"], [[str(s) for s in range(SEEDS)]], confidence=confidence)
    engine.update(torch.arange(SEEDS).repeat_interleave(n), draws.reshape(-1))
    return np.array([g.lower for g in engine.compute().groups])


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_lower_bound_covers_at_least_nominal_over_seeds(confidence: float) -> None:
    """Per (n, p): the exact coverage P(L ≤ p) is ≥ nominal, and the simulated share of seeds whose bound
    lies below p agrees with it within 3 Monte Carlo standard errors; pooled over all (n, p) the simulated
    coverage is ≥ nominal. (Clopper–Pearson's exact coverage touches the nominal level at some (n, p),
    e.g. 0.9506 at n = 30, p = 0.5, so a finite simulation of that one cell may land just below it.)"""
    pooled = []
    se = math.sqrt(confidence * (1 - confidence) / SEEDS)
    for n in SIZES:
        for p in ACCURACIES:
            hits = _simulated_lowers(n, p, confidence) <= p
            exact = float(sum(stats.binom.pmf(k, n, p) for k in range(n + 1) if _cp_lower(k, n, confidence) <= p))
            assert exact >= confidence - 1e-12, (n, p, exact)
            assert hits.mean() >= min(exact, confidence) - 3 * se, (n, p, hits.mean(), exact)
            pooled.append(hits)
    assert len(pooled) * SEEDS >= 200 * len(SIZES) * len(ACCURACIES)
    assert np.concatenate(pooled).mean() >= confidence


def test_the_normal_bound_it_replaces_under_covers() -> None:
    """Wald's p̂ − z√(p̂(1−p̂)/n) is 1 on a perfect group: at p = 0.95, n = 10 it covers ~40%."""
    n, p, confidence = 10, 0.95, 0.95
    draws = torch.stack([torch.rand(n, generator=torch.Generator().manual_seed(s)) < p for s in range(SEEDS)])
    phat = draws.double().mean(1).numpy()
    wald = phat - stats.norm.ppf(confidence) * np.sqrt(phat * (1 - phat) / n)
    assert (wald <= p).mean() < 0.5
    assert (_simulated_lowers(n, p, confidence) <= p).mean() >= confidence


def test_a_gate_on_the_worst_bound_rarely_passes_a_bad_group() -> None:
    """Intersection–union: one group below the threshold, five far above; false passes ≤ 1 − confidence."""
    threshold, bad, n = 0.9, 0.88, 100
    false_passes = 0
    for seed in range(SEEDS):
        gen = torch.Generator().manual_seed(seed)
        accuracy = torch.tensor([bad, 0.99, 0.99, 0.99, 0.99, 0.99]).repeat_interleave(n)
        engine = ScenarioPerformanceEngine(["g"], [list("abcdef")], min_samples=30)
        engine.update(torch.arange(6).repeat_interleave(n), torch.rand(6 * n, generator=gen) < accuracy)
        false_passes += engine.compute().worst.lower >= threshold
    assert false_passes / SEEDS <= 0.05


# ------------------------------------------------------------------ properties
@settings(deadline=None, max_examples=30)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=80),
       st.sampled_from([0.8, 0.95, 0.99]), st.integers(1, 5))
def test_properties(rows: list[tuple[int, bool]], confidence: float, min_samples: int) -> None:
    group = torch.tensor([g for g, _ in rows])
    correct = torch.tensor([c for _, c in rows])
    engine = ScenarioPerformanceEngine(["x"], [list("abcdef")], confidence=confidence, min_samples=min_samples)
    engine.update(group, correct)
    res = engine.compute()
    assert sum(g.size for g in res.groups) == len(rows) and res.correct == int(correct.sum())
    for g in res.groups:
        if g.size:
            assert 0 <= g.lower <= g.accuracy <= 1
            assert g.drop_bound >= g.drop - 1e-12  # the bound is never below the estimate
        assert g.assessable == (g.size >= min_samples)
    if res.worst is not None:
        assert all(res.worst.lower <= g.lower for g in res.assessable)
    assert 0 <= res.scenario_coverage <= 1
    # row order does not matter
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    shuffled = ScenarioPerformanceEngine(["x"], [list("abcdef")], confidence=confidence, min_samples=min_samples)
    shuffled.update(group[perm], correct[perm])
    assert shuffled.compute() == res
    # a higher confidence never raises a bound
    stricter = ScenarioPerformanceEngine(["x"], [list("abcdef")], confidence=0.999, min_samples=min_samples)
    stricter.update(group, correct)
    assert all(s.lower <= g.lower + 1e-12 for s, g in zip(stricter.compute().groups, res.groups) if g.size)


# ------------------------------------------------------------------ bad inputs
def test_unknown_condition_names_the_known_ones() -> None:
    table = _table(50)
    with pytest.raises(ConfigError, match="unknown condition.*'season'.*lighting, noise, camera"):
        ScenarioPerformanceEngine.from_table(table, ["lighting", "season"])
    with pytest.raises(ConfigError, match="'season'"):
        resolve_by(table, ["season"])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"by": [], "domains": []}, "distinct condition names"),
    ({"by": ["a", "a"], "domains": [["x"], ["y"]]}, "distinct condition names"),
    ({"by": ["a"], "domains": [[]]}, "non-empty domain"),
    ({"by": ["a"], "domains": [["x"]], "confidence": 1.0}, "confidence"),
    ({"by": ["a"], "domains": [["x"]], "min_samples": 0}, "min_samples"),
    ({"by": ["a"], "domains": [["x"]], "num_classes": 0}, "num_classes"),
    ({"by": ["a"], "domains": [["x", "y"]], "feasible": [True]}, "feasible has 1 entries for 2 groups"),
    ({"by": ["a", "b"], "domains": [[str(i) for i in range(400)]] * 2}, "more than 100000"),
])
def test_bad_configuration_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ScenarioPerformanceEngine(**kwargs)


def test_no_rows_and_missing_labels_are_errors() -> None:
    engine = ScenarioPerformanceEngine(["a"], [["x", "y"]])
    with pytest.raises(MetricError, match="every group is empty"):
        engine.compute()
    with pytest.raises(DataError, match="correct has 2"):
        engine.update(torch.zeros(3, dtype=torch.int64), torch.ones(2, dtype=torch.bool))
    per_class = ScenarioPerformanceEngine(["a"], [["x", "y"]], num_classes=3)
    with pytest.raises(DataError, match="needs the labels"):
        per_class.update(torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool))


def test_group_index_refuses_a_table_with_other_domains() -> None:
    engine = ScenarioPerformanceEngine(["lighting"], [["day", "night"]])
    with pytest.raises(DataError, match="differ from the engine's"):
        engine.group_index(_table(20))
