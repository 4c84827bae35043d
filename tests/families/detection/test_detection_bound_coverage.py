"""The detection gates' bootstrap lower bounds (issue #29): BCa against a brute-force implementation and
scipy's, the bias-extrapolated bound on a hand case, the weights, progress and the work refusal, and a reduced
known-truth coverage simulation (``_detection_truth``; the full table: benchmarks/detection_bound_coverage.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import special, stats

from _detection_truth import SCENARIOS, coverage_run, cp_lower, population, truth
from pytest_dnnsafety.engines.detection.bootstrap import DEFAULT_METHOD, bootstrap_lower, half_weights, jackknife_weights
from pytest_dnnsafety.engines.detection.quality import QualityOptions, worst_map, worst_recall
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.scenarios.groups import ScenarioGroups


def _bca_numpy(rep: np.ndarray, est: float, jk: np.ndarray, alpha: float) -> float:
    """Efron & Tibshirani (1993) §14.3, written out: z0 from the share below (ties half), a from the jackknife."""
    B = len(rep)
    share = (np.sum(rep < est) + 0.5 * np.sum(rep == est)) / B
    z0 = special.ndtri(min(max(share, 0.5 / B), 1 - 0.5 / B))
    d = jk.mean() - jk
    a = np.sum(d ** 3) / (6 * np.sum(d ** 2) ** 1.5)
    za = special.ndtri(alpha)
    level = special.ndtr(z0 + (z0 + za) / (1 - a * (z0 + za)))
    return float(np.sort(rep)[int(np.floor(level * (B - 1)))])


def test_bca_equals_the_textbook_formula_per_column() -> None:
    rng = np.random.default_rng(0)
    rep = rng.gamma(2.0, 0.1, size=(997, 3))
    est = np.array([0.25, 0.15, 0.2])
    jk = rng.gamma(3.0, 0.05, size=(40, 3))
    ours = bootstrap_lower(torch.tensor(rep), torch.tensor(est), 0.95, "bca", torch.tensor(jk))
    for k in range(3):
        assert float(ours[k]) == _bca_numpy(rep[:, k], est[k], jk[:, k], 0.05)
    scalar = bootstrap_lower(torch.tensor(rep[:, 0]), float(est[0]), 0.95, "bca", torch.tensor(jk[:, 0]))
    assert scalar.dim() == 0 and float(scalar) == float(ours[0])


def test_bca_agrees_with_scipy_on_a_skewed_ratio() -> None:
    """A recall-like ratio of sums over 80 clustered units: our BCa (numpy resampling, exact jackknife) against
    ``scipy.stats.bootstrap(method='BCa')``'s lower end of the 90 % two-sided interval (= one-sided 95 %)."""
    rng = np.random.default_rng(3)
    objects = rng.integers(1, 6, 80).astype(float)
    hits = rng.binomial(objects.astype(int), rng.beta(1.2, 0.6, 80)).astype(float)
    def ratio(h: np.ndarray, o: np.ndarray, axis: int = -1) -> np.ndarray:
        return h.sum(axis) / o.sum(axis)

    idx = rng.integers(0, 80, (40_000, 80))
    rep = ratio(hits[idx], objects[idx])
    jk = np.array([(hits.sum() - hits[i]) / (objects.sum() - objects[i]) for i in range(80)])
    ours = float(bootstrap_lower(torch.tensor(rep), ratio(hits, objects), 0.95, "bca", torch.tensor(jk)))
    ref = stats.bootstrap((hits, objects), ratio, paired=True, vectorized=True, n_resamples=40_000,
                          confidence_level=0.90, method="BCa", random_state=np.random.default_rng(4))
    assert ours == pytest.approx(ref.confidence_interval.low, abs=0.15 * ref.standard_error)


def test_extrapolated_subtracts_the_half_sample_bias_and_the_wider_spread() -> None:
    rep = torch.linspace(0.4, 0.6, 1001, dtype=torch.float64)  # mean 0.5, 5 % quantile 0.41: spread 0.09
    halves = torch.tensor([0.52, 0.54], dtype=torch.float64)  # mean 0.53, sd 0.0141
    low = float(bootstrap_lower(rep, 0.5, 0.95, "extrapolated", halves=halves))
    assert low == pytest.approx(0.5 - 0.03 / (2 ** 0.5 - 1) - 0.09, abs=1e-12)
    wide = torch.tensor([0.4, 0.66], dtype=torch.float64)  # sd 0.184: z·sd = 0.302 > 0.09
    assert float(bootstrap_lower(rep, 0.5, 0.95, "extrapolated", halves=wide)) == pytest.approx(
        0.5 - 0.03 / (2 ** 0.5 - 1) - stats.norm.ppf(0.95) * float(wide.std()), abs=1e-12)
    below = torch.tensor([0.45, 0.47], dtype=torch.float64)  # a downward bias is never added back
    assert float(bootstrap_lower(rep, 0.5, 0.95, "extrapolated", halves=below)) == pytest.approx(0.41, abs=1e-12)
    jk = torch.rand(30, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cons = float(bootstrap_lower(rep, 0.5, 0.95, "conservative", jk, halves))
    assert cons == min(float(bootstrap_lower(rep, 0.5, 0.95, "bca", jk)), low)
    wide_bound = float(bootstrap_lower(rep, 0.5, 0.95, "wide", jk, halves))  # the default: conservative at 99 %
    assert wide_bound == float(bootstrap_lower(rep, 0.5, 0.99, "conservative", jk, halves)) <= cons
    with pytest.raises(ConfigError, match="bound method must be one of"):
        bootstrap_lower(rep, 0.5, 0.95, "basic")


def test_jackknife_groups_and_half_subsets() -> None:
    w = jackknife_weights(250)
    assert w.shape == (100, 250) and torch.equal(w.sum(0), torch.full((250,), 99.0))
    assert torch.equal(jackknife_weights(7), 1 - torch.eye(7, dtype=torch.float64))  # delete-one below 100
    h = half_weights(61, torch.Generator().manual_seed(0), count=50)
    assert h.shape == (50, 61) and torch.equal(h.sum(1), torch.full((50,), 30.0))


# ------------------------------------------------------------------------------------- progress and refusal


def _one_group(n: int) -> ScenarioGroups:
    return ScenarioGroups.of(None, [], n_rows=n, fixtures={"data": "dataset"})


def test_the_bootstrap_ticks_the_progress_line_in_replicates(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, str]] = []
    monkeypatch.setattr(progress, "tick", lambda done, total, unit="": seen.append((done, total, unit)))
    engine = population(SCENARIOS["good"], 200, seed=0)
    engine.evaluate(bootstrap=300, columns=[0])
    assert seen and seen[-1] == (300, 300, "bootstrap replicates")
    assert all(type(d) is int and t == 300 for d, t, _ in seen)
    seen.clear()
    engine.recall(bootstrap=300)
    assert seen and seen[-1] == (300, 300, "bootstrap replicates")


@pytest.fixture(scope="module")
def big_engine():
    return population(SCENARIOS["good"], 6000, seed=0)  # ~20,000 detections × 10 thresholds; 6,000 images


@pytest.mark.parametrize("reading", [worst_map, worst_recall])
def test_a_bootstrap_over_the_work_limit_is_refused_before_it_starts(reading, big_engine, monkeypatch) -> None:
    engine = big_engine
    marker = "min_detection_map" if reading is worst_map else "min_detection_recall"
    opts = QualityOptions.of({"bootstrap": 10**6, "iou": 0.5, "min_images": 1}, marker=marker, seed=0)
    started: list[int] = []
    monkeypatch.setattr(engine, "evaluate", lambda *a, **k: started.append(1))
    monkeypatch.setattr(engine, "recall", lambda *a, **k: started.append(1))
    with pytest.raises(MetricError, match=rf"{marker}: bootstrap=1000000 replicates .* units of work, more than the "
                                          r"limit .* min on a 2-core CPU\)\. Fix: lower bootstrap="):
        reading(engine, _one_group(engine.n_images), list(range(10)) if reading is worst_map else [0], opts)
    assert not started  # refused before any replicate (the default 1,000 runs: the other tests)


# ------------------------------------------------------------------------------------- coverage


@pytest.mark.slow
def test_the_default_bound_covers_on_a_heterogeneous_known_truth_population() -> None:
    """Over-confident false positives and image-level difficulty (the case where the percentile bound covered
    mAP in about half of the samples): 300 samples of 60 images from 20,000; the default bound's coverage has a
    Clopper–Pearson lower end of at least nominal − 3 points for mAP@0.5, per-class recall (the rarest class) and
    recall over all objects. (mAP@[.5:.95] and the minimum over classes the gate reads are in the docs' table; the
    minimum covers whenever the bound of the class with the smallest true recall does, since the minimum of the
    bounds lies at or below that class's bound.)"""
    engine = population(SCENARIOS["overconfident"], 20_000, seed=1)
    values = truth(engine)
    stats_ = ("mAP@0.5", "recall, one class (rarest)", "recall, all objects")
    cov = coverage_run(engine, values, 60, 300, bootstrap=1000, seed=7, methods=(DEFAULT_METHOD,),
                       statistics=stats_)
    for stat in stats_:
        k, n = cov.count(stat, DEFAULT_METHOD)
        assert cp_lower(k, n) >= 0.92, (stat, k, n)
