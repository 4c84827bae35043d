"""Ranking methods over benchmarks: Friedman's test, Iman–Davenport, Nemenyi's CD and its cliques (Demšar 2006)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.stats.ranking import FriedmanResult, cd_cliques, friedman, nemenyi_cd

# In the style of Demšar (2006), JMLR 7, Table 6: AUC of C4.5, C4.5+m, C4.5+cf, C4.5+m+cf on 14 data sets.
# Ranks by hand (higher AUC is better, rank 1 best, ties share the average rank):
#   adult           4    3    2    1         liver         3    2    4    1
#   breast cancer   1    2    3    4         lung cancer   2.5  2.5  4    1
#   breast wisc.    4    1    2    3         lymphography  4    3    2    1
#   cmc             4    1    3    2         mushroom      2.5  2.5  2.5  2.5
#   ionosphere      4    2    3    1         primary tumor 4    2.5  1    2.5
#   iris            1    2.5  4    2.5       rheum         3    2    4    1
#   voting          4    1    2.5  2.5       wine          3    1    4    2
# rank sums 44, 28, 41, 27 (total 140 = 14·4·5/2) → average ranks 3.1429, 2.0000, 2.9286, 1.9286.
# Ties: four rows with a pair (t³ − t = 6 each) and mushroom with four (60): T = 84, correction
# 1 − 84 / (14·4·15) = 0.9. Uncorrected χ²_F = 12/(14·4·5)·(44² + 28² + 41² + 27²) − 3·14·5 = 9.857142…,
# corrected 9.857142… / 0.9 = 10.952381; F_F = 13·10.952381 / (14·3 − 10.952381) = 4.585890.
# CD(α = 0.05) = 2.569·√(4·5/(6·14)) = 1.2536: the largest gap, 3.1429 − 1.9286 = 1.2143, is not significant.
# CD(α = 0.10) = 2.291·√(20/84) = 1.1179: now C4.5 differs from C4.5+m+cf (as in Demšar's text).
DEMSAR_STYLE = np.array([
    [0.763, 0.768, 0.771, 0.798], [0.599, 0.591, 0.590, 0.569], [0.954, 0.971, 0.968, 0.967],
    [0.628, 0.661, 0.654, 0.657], [0.882, 0.888, 0.886, 0.898], [0.936, 0.931, 0.916, 0.931],
    [0.661, 0.668, 0.609, 0.685], [0.583, 0.583, 0.563, 0.625], [0.775, 0.838, 0.866, 0.875],
    [1.000, 1.000, 1.000, 1.000], [0.940, 0.962, 0.965, 0.962], [0.619, 0.666, 0.614, 0.669],
    [0.972, 0.981, 0.975, 0.975], [0.957, 0.978, 0.946, 0.970],
])


def test_demsar_style_table_by_hand() -> None:
    result = friedman(DEMSAR_STYLE)
    assert isinstance(result, FriedmanResult) and (result.n_blocks, result.k) == (14, 4)
    assert result.average_ranks == pytest.approx((44 / 14, 28 / 14, 41 / 14, 27 / 14))
    assert result.statistic == pytest.approx((12 / 280 * (44**2 + 28**2 + 41**2 + 27**2) - 210) / 0.9)
    assert result.statistic == pytest.approx(10.952381, abs=1e-6)
    assert result.iman_davenport == pytest.approx(4.585890, abs=1e-6)
    assert result.pvalue == pytest.approx(sps.chi2.sf(result.statistic, 3))
    assert result.iman_davenport_pvalue == pytest.approx(sps.f.sf(result.iman_davenport, 3, 39))
    cd = nemenyi_cd(4, 14)
    assert round(cd, 4) == 1.2536
    assert cd_cliques(result.average_ranks, cd) == [(3, 1, 2, 0)]  # all four: no significant difference
    cd10 = nemenyi_cd(4, 14, alpha=0.10)
    assert cd10 == pytest.approx(2.291 * math.sqrt(20 / 84), abs=5e-4)
    assert cd_cliques(result.average_ranks, cd10) == [(3, 1, 2), (2, 0)]
    # lower-is-better on the negated table gives the same ranks
    flipped = friedman(-DEMSAR_STYLE, higher_is_better=False)
    assert flipped.average_ranks == pytest.approx(result.average_ranks)
    assert flipped.to_dict()["statistic"] == pytest.approx(result.statistic)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(3, 7), st.integers(1, 5), st.integers(0, 2**31 - 1), st.booleans())
def test_friedman_matches_scipy_on_random_tables_with_ties(n_blocks: int, k: int, levels: int, seed: int,
                                                           higher: bool) -> None:
    table = np.random.default_rng(seed).integers(0, levels + 1, size=(n_blocks, k)).astype(float)
    result = friedman(table, higher_is_better=higher)
    ranks = sps.rankdata(-table if higher else table, axis=1)
    assert result.average_ranks == pytest.approx(tuple(ranks.mean(axis=0)))
    if np.all(table == table[:, :1]):  # every block ties all methods: scipy divides 0 by 0
        assert (result.statistic, result.pvalue) == (0.0, 1.0)
        return
    reference = sps.friedmanchisquare(*table.T)
    assert result.statistic == pytest.approx(reference.statistic, rel=1e-10, abs=1e-12)
    assert result.pvalue == pytest.approx(reference.pvalue, rel=1e-9, abs=1e-15)
    ceiling = n_blocks * (k - 1)
    if result.statistic < ceiling * (1 - 1e-9):
        expected = (n_blocks - 1) * reference.statistic / (ceiling - reference.statistic)
        assert result.iman_davenport == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert result.iman_davenport_pvalue == pytest.approx(
            sps.f.sf(expected, k - 1, (k - 1) * (n_blocks - 1)), rel=1e-8, abs=1e-15)
    else:
        assert result.iman_davenport == math.inf and result.iman_davenport_pvalue == 0.0


def test_friedman_edge_cases() -> None:
    same_order = np.tile([0.9, 0.5, 0.7], (6, 1))  # every block ranks the methods alike
    result = friedman(same_order)
    assert result.statistic == pytest.approx(6 * 2) and result.iman_davenport == math.inf
    assert result.iman_davenport_pvalue == 0.0 and result.average_ranks == (1.0, 3.0, 2.0)
    two = friedman([[1.0, 2.0], [3.0, 1.0], [2.0, 5.0]])  # k = 2 (scipy refuses it; the formula holds)
    assert two.average_ranks == pytest.approx((5 / 3, 4 / 3))
    assert two.statistic == pytest.approx(12 / (3 * 2 * 3) * (5**2 + 4**2) - 3 * 3 * 3)
    tied = friedman(np.ones((3, 4)))
    assert (tied.statistic, tied.pvalue, tied.average_ranks) == (0.0, 1.0, (2.5,) * 4)


def test_friedman_rejects_bad_tables() -> None:
    with pytest.raises(DataError, match=r"1 block\(s\) × 3 method\(s\).*Fix"):
        friedman([[1.0, 2.0, 3.0]])
    with pytest.raises(DataError, match=r"3 block\(s\) × 1 method\(s\)"):
        friedman([[1.0], [2.0], [3.0]])
    with pytest.raises(DataError, match=r"must be 2-D.*Fix"):
        friedman([1.0, 2.0, 3.0])
    with pytest.raises(DataError, match=r"1 non-finite value.*Fix"):
        friedman([[1.0, 2.0], [np.nan, 1.0]])
    with pytest.raises(DataError, match=r"table must be a 2-D array of numbers"):
        friedman([["a", "b"], ["c", "d"]])
    with pytest.raises(ConfigError, match=r"higher_is_better must be True or False"):
        friedman([[1.0, 2.0], [2.0, 1.0]], higher_is_better="yes")  # type: ignore[arg-type]


def test_nemenyi_q_alpha_is_demsars_table() -> None:
    # Demšar (2006), Table 5(a): q_0.05 for k = 2 … 10; CD with n_blocks = 6 makes √(k(k+1)/(6N)) = √(k(k+1))/6
    published = [1.960, 2.343, 2.569, 2.728, 2.850, 2.949, 3.031, 3.102, 3.164]
    for k, q in zip(range(2, 11), published):
        assert nemenyi_cd(k, 6) / math.sqrt(k * (k + 1) / 36) == pytest.approx(q, abs=1e-3)  # the printed digit
    # Table 5(b), α = 0.10
    for k, q in zip(range(2, 6), [1.645, 2.052, 2.291, 2.459]):
        assert nemenyi_cd(k, 1, alpha=0.10) / math.sqrt(k * (k + 1) / 6) == pytest.approx(q, abs=1e-3)


def test_nemenyi_cd_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"k=.* must be an integer >= 2.*Fix"):
        nemenyi_cd(1, 10)
    with pytest.raises(ConfigError, match=r"n_blocks=.* must be an integer >= 1"):
        nemenyi_cd(3, 0)
    with pytest.raises(ConfigError, match=r"k=.* must be an integer"):
        nemenyi_cd(2.5, 10)  # type: ignore[arg-type]
    for alpha in (0.0, 1.0, -0.1, True, "0.05"):
        with pytest.raises(ConfigError, match=r"alpha must lie strictly between 0 and 1.*Fix"):
            nemenyi_cd(3, 10, alpha=alpha)  # type: ignore[arg-type]


def test_cd_cliques_on_known_rank_vectors() -> None:
    assert cd_cliques([1.0, 1.5, 3.0, 3.2, 5.0], 1.25) == [(0, 1), (2, 3), (4,)]
    assert cd_cliques([2.0, 1.0, 3.0], 5.0) == [(1, 0, 2)]  # everything together, best first
    assert cd_cliques([1.0, 2.0, 3.0], 0.5) == [(0,), (1,), (2,)]  # all significantly different
    # overlapping maximal groups: 1–2.1 and 2–3 (1 and 3 differ)
    assert cd_cliques([3.0, 1.0, 2.0, 2.1], 1.15) == [(1, 2, 3), (2, 3, 0)]
    # a difference of exactly CD is significant (Demšar: "differ by at least the critical difference")
    assert cd_cliques([1.0, 2.0], 1.0) == [(0,), (1,)]
    assert cd_cliques([1.0, 1.0, 4.0], 0.1) == [(0, 1), (2,)]  # tied ranks keep the input order
    with pytest.raises(DataError, match=r"average_ranks must be a non-empty sequence of finite numbers"):
        cd_cliques([1.0, float("nan")], 1.0)
    with pytest.raises(ConfigError, match=r"cd must be a finite number ≥ 0"):
        cd_cliques([1.0, 2.0], -1.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1, 8, allow_nan=False), min_size=1, max_size=9), st.floats(0, 4))
def test_cd_cliques_are_exactly_the_maximal_not_significant_groups(ranks: list[float], cd: float) -> None:
    cliques = cd_cliques(ranks, cd)
    sets = [set(c) for c in cliques]
    for group in sets:  # not significant inside
        values = [ranks[i] for i in group]
        assert max(values) - min(values) < cd or len(group) == 1
    for a in range(len(sets)):  # maximal: no clique inside another
        assert not any(a != b and sets[a] <= sets[b] for b in range(len(sets)))
    for i in range(len(ranks)):  # every pair not significantly different shares a clique
        assert any(i in s for s in sets)
        for j in range(len(ranks)):
            if abs(ranks[i] - ranks[j]) < cd:
                assert any({i, j} <= s for s in sets)
