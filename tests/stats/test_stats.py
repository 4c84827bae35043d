"""Unit tests of pytest_dnnsafety.stats.intervals: the paper's aggregation (eqs. 5–7, 13–14) and the sound bounds."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from pytest_dnnsafety.stats import intervals as stats
from pytest_dnnsafety.errors import ConfigError, DataError


# ---------------------------------------------------------------------- eqs. 5–7 by hand
def test_aggregate_normal_matches_hand_computation() -> None:
    op_mean = [0.5, 0.3, 0.2]
    op_var = [1e-4, 4e-4, 9e-4]
    lam_mean = [0.01, 0.0, 1.0]
    lam_var = [2e-6, 0.0, 0.0]
    # eq. (5): 0.5·0.01 + 0.3·0 + 0.2·1
    E = 0.005 + 0.0 + 0.2
    # eq. (6), cell by cell: E[λ]²V[Op] + E[Op]²V[λ] + V[λ]V[Op]
    v1 = 0.01**2 * 1e-4 + 0.5**2 * 2e-6 + 2e-6 * 1e-4
    v2 = 0.0
    v3 = 1.0**2 * 9e-4 + 0.0 + 0.0
    Var = v1 + v2 + v3
    # eq. (7) with z_{0.975} = 1.959963984540054
    Ub = E + 1.959963984540054 * math.sqrt(Var)
    agg = stats.aggregate_normal(op_mean, op_var, lam_mean, lam_var, confidence=0.975)
    assert agg.E == pytest.approx(E, rel=1e-15)
    assert agg.Var == pytest.approx(Var, rel=1e-15)
    assert agg.Ub == pytest.approx(Ub, rel=1e-14)
    assert agg.std == pytest.approx(math.sqrt(Var))
    assert stats.normal_upper(E, Var, 0.975) == pytest.approx(Ub, rel=1e-14)


def test_aggregate_normal_rejects_mismatched_lengths() -> None:
    with pytest.raises(DataError, match="one entry per cell"):
        stats.aggregate_normal([0.5, 0.5], [0, 0], [0.1], [0.0])


def test_binomial_moments_are_eqs_13_14() -> None:
    rng = np.random.default_rng(1)
    for n in (2, 7, 50):
        outcomes = rng.random(n) < 0.3
        k = int(outcomes.sum())
        mean, var = stats.binomial_moments([k], [n])
        assert float(mean[0]) == pytest.approx(outcomes.mean())
        assert float(var[0]) == pytest.approx(outcomes.var(ddof=1) / n)  # s²/n, eq. (14)
    mean, var = stats.binomial_moments([0, 10, 0], [10, 10, 1])
    assert var.tolist() == [0.0, 0.0, 0.25]  # zero variance at k = 0 and k = n; n = 1 → 1/4
    with pytest.raises(DataError, match="trials"):
        stats.binomial_moments([0], [0])
    with pytest.raises(DataError, match="between 0 and trials"):
        stats.binomial_moments([5], [3])


def test_normal_quantile() -> None:
    assert stats.normal_quantile(0.975) == pytest.approx(1.959963984540054)
    assert stats.normal_quantile(0.5) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("bad", [0, 1, 1.0, 0.0, -0.1, 1.5, float("nan"), "0.9", None, True])
def test_confidence_outside_unit_interval_is_rejected(bad: object) -> None:
    with pytest.raises(ConfigError, match="confidence"):
        stats.check_confidence(bad)
    with pytest.raises(ConfigError):
        stats.aggregate_normal([1.0], [0.0], [0.0], [0.0], confidence=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- exact per-cell bounds
def test_clopper_pearson_against_scipy_and_closed_forms() -> None:
    k = np.array([0, 1, 5, 20, 20])
    n = np.array([20, 20, 20, 20, 1000])
    upper = stats.clopper_pearson_upper(k, n, 0.975).numpy()
    expected = np.where(k < n, sps.beta.ppf(0.975, k + 1, np.maximum(n - k, 1)), 1.0)
    np.testing.assert_allclose(upper, expected, rtol=1e-12)
    assert upper[0] == pytest.approx(1 - 0.025 ** (1 / 20))  # zero failures: 1 − α^{1/n}
    assert upper[3] == 1.0
    lower = stats.clopper_pearson_lower(k, n, 0.975).numpy()
    assert lower[0] == 0.0
    for kk, nn in [(0, 20), (3, 20), (20, 20), (7, 1000)]:
        lo, hi = stats.clopper_pearson_interval([kk], [nn], 0.95)
        ci = sps.binomtest(kk, nn).proportion_ci(confidence_level=0.95, method="exact")
        assert float(lo[0]) == pytest.approx(ci.low, abs=1e-12)
        assert float(hi[0]) == pytest.approx(ci.high, abs=1e-12)


def test_jeffreys_upper_is_the_beta_quantile() -> None:
    k, n = np.array([0, 3, 50]), np.array([100, 100, 100])
    np.testing.assert_allclose(stats.jeffreys_upper(k, n, 0.975).numpy(),
                               sps.beta.ppf(0.975, k + 0.5, n - k + 0.5), rtol=1e-12)
    # below the exact bound at zero failures: the Jeffreys bound is not a confidence bound
    assert float(stats.jeffreys_upper([0], [100])[0]) < float(stats.clopper_pearson_upper([0], [100])[0])


# ---------------------------------------------------------------------- the sound weighted-sum bounds
def test_poisson_chernoff_mu_solves_its_equation() -> None:
    assert stats.poisson_chernoff_mu(0.0, 0.975) == pytest.approx(-math.log(0.025))
    for x in (0.3, 1.0, 5.0, 123.4, 1e6):
        mu = stats.poisson_chernoff_mu(x, 0.975)
        assert mu > x
        assert mu - x - x * math.log(mu / x) == pytest.approx(-math.log(0.025), rel=1e-9)
    with pytest.raises(DataError):
        stats.poisson_chernoff_mu(-1.0, 0.975)


def test_chernoff_zero_failures_equal_weights_is_the_exact_poisson_bound() -> None:
    op = torch.full((400,), 1 / 400, dtype=torch.float64)
    ub = stats.chernoff_upper(op, torch.zeros(400), torch.full((400,), 250), 0.975)
    assert ub == pytest.approx(-math.log(0.025) / (400 * 250))  # ln(1/α)/T, T = all samples


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    return sps.binom.pmf(np.arange(n + 1), n, p)


@pytest.mark.parametrize("bound", [stats.chernoff_upper, stats.bonferroni_upper])
def test_sound_bounds_cover_exactly_by_enumeration(bound) -> None:
    """Exact coverage P(λ ≤ Ub) over every outcome of two small cells, for unequal masses and many λ vectors."""
    n1, n2 = 12, 7
    op = torch.tensor([0.7, 0.3], dtype=torch.float64)
    ubs = np.array([[bound(op, torch.tensor([k1, k2]), torch.tensor([n1, n2]), 0.9) for k2 in range(n2 + 1)]
                    for k1 in range(n1 + 1)])
    for lam1, lam2 in itertools.product([0.0, 0.01, 0.05, 0.12, 0.3, 0.6], repeat=2):
        truth = 0.7 * lam1 + 0.3 * lam2
        prob = np.outer(_binomial_pmf(n1, lam1), _binomial_pmf(n2, lam2))
        coverage = float(prob[ubs >= truth - 1e-15].sum())
        assert coverage >= 0.9 - 1e-12, (lam1, lam2, coverage)


def test_bonferroni_is_the_sum_of_per_cell_bounds() -> None:
    op = torch.tensor([0.6, 0.4], dtype=torch.float64)
    ub = stats.bonferroni_upper(op, torch.tensor([0, 2]), torch.tensor([100, 100]), 0.95)
    per_cell = stats.clopper_pearson_upper([0, 2], [100, 100], 1 - 0.05 / 2)
    assert ub == pytest.approx(float((op * per_cell).sum()))


@settings(max_examples=40, deadline=None)
@given(
    ks=st.lists(st.integers(0, 30), min_size=1, max_size=6),
    extra=st.integers(0, 10),
)
def test_chernoff_is_above_the_estimate_and_monotone_in_failures(ks: list[int], extra: int) -> None:
    n = torch.full((len(ks),), 30)
    op = torch.linspace(1, 2, len(ks), dtype=torch.float64)
    op = op / op.sum()
    k = torch.tensor(ks)
    ub = stats.chernoff_upper(op, k, n, 0.975)
    estimate = float((op * k / n).sum())
    assert estimate <= ub <= 1.0 + 1e-12
    k2 = k.clone()
    k2[0] = min(30, int(k2[0]) + extra)
    assert stats.chernoff_upper(op, k2, n, 0.975) >= ub - 1e-12


# ---------------------------------------------------------------------- Jeffreys Monte Carlo
def test_jeffreys_draws_moments_seed_and_rng_isolation() -> None:
    op = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    k, n = torch.tensor([0, 3, 100]), torch.tensor([100, 100, 100])
    state = torch.random.get_rng_state()
    draws = stats.jeffreys_draws(op, k, n, 20000, seed=3, extra=0.01)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert torch.equal(draws, stats.jeffreys_draws(op, k, n, 20000, seed=3, extra=0.01))
    a, b = k + 0.5, n - k + 0.5
    mean = float((op * a / (a + b)).sum()) + 0.01
    var = float((op**2 * a * b / ((a + b) ** 2 * (a + b + 1))).sum())
    assert float(draws.mean()) == pytest.approx(mean, abs=4 * math.sqrt(var / 20000))
    assert float(draws.var()) == pytest.approx(var, rel=0.05)


def test_gamma_draws_follow_the_gamma_law() -> None:
    torch.manual_seed(0)
    for shape in (0.5, 3.5, 60.5, 10000.5):
        sample = stats._gamma_draws(torch.tensor([shape], dtype=torch.float64), 20000)[:, 0].numpy()
        assert sps.kstest(sample, sps.gamma(shape).cdf).pvalue > 1e-3, shape


def test_jeffreys_draws_with_bootstrap_replicates() -> None:
    reps = torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    draws = stats.jeffreys_draws(reps, torch.tensor([1000, 0]), torch.tensor([1000, 1000]), 4000, seed=0,
                                 extra=torch.tensor([0.0, 0.1]))
    # λ_1 ≈ 1, λ_2 ≈ 0: draws cluster at 0.6 (replicate 0) and 0.4 + 0.1 (replicate 1)
    assert set(torch.round(draws, decimals=2).tolist()) <= {0.6, 0.5, 0.59, 0.49, 0.61, 0.51}


def test_bootstrap_quantile_is_conservative() -> None:
    assert stats.bootstrap_quantile([1.0, 2.0, 3.0, 4.0], 0.9) == 4.0
    with pytest.raises(DataError):
        stats.bootstrap_quantile([], 0.9)


@pytest.mark.parametrize(("errors", "n", "bound"), [(137, 3000, 0.00137), (33, 539, 0.048), (0, 50, 0.01),
                                                    (5, 5, 0.9), (22, 270, 0.127), (1, 10**6, 1e-7)])
@pytest.mark.parametrize("confidence", [0.9, 0.975])
def test_labelled_error_check_matches_scipy(errors: int, n: int, bound: float, confidence: float) -> None:
    from scipy import stats as sps

    from pytest_dnnsafety.stats.intervals import labelled_error_check

    check = labelled_error_check(errors, n, bound, confidence)
    lower = 0.0 if errors == 0 else sps.beta.ppf(1 - confidence, errors, n - errors + 1)
    p_value = sps.binomtest(errors, n, bound, alternative="greater").pvalue
    assert check.lower == pytest.approx(lower, rel=1e-9, abs=1e-15)
    assert check.p_value == pytest.approx(p_value, rel=1e-6, abs=1e-300)
    assert check.contradicts == (lower > bound) == (p_value < 1 - confidence)
    assert check.rate == errors / n and check.to_dict()["n"] == n


def test_labelled_error_check_rejects_bad_counts() -> None:
    from pytest_dnnsafety.stats.intervals import labelled_error_check

    for errors, n in ((3, 2), (-1, 5), (1, 0), (1.5, 4)):
        with pytest.raises(DataError):
            labelled_error_check(errors, n, 0.1)
    with pytest.raises(ConfigError):
        labelled_error_check(1, 10, 0.1, confidence=1.0)
