"""Ranking many methods over many data sets: Friedman's test, the Nemenyi critical difference and the
cliques of a critical-difference diagram (Demšar 2006, "Statistical comparisons of classifiers over
multiple data sets", JMLR 7, §3.2.2), as the safety-monitor benchmark (Ferreira et al.) ranks monitors.

Pure functions of numbers and arrays; also importable from :mod:`pytest_dnnsafety.stats.intervals`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["FriedmanResult", "friedman", "nemenyi_cd", "cd_cliques"]


@dataclass(frozen=True)
class FriedmanResult:
    """Friedman's test on the ranks of ``k`` methods within ``n_blocks`` blocks (Demšar 2006, §3.2.2).

    ``average_ranks[j]`` is method ``j``'s mean rank over the blocks, rank 1 the best; ``statistic``
    is the tie-corrected χ²_F (as ``scipy.stats.friedmanchisquare``) with ``pvalue`` from χ²(k − 1);
    ``iman_davenport`` is F_F = (N − 1) χ²_F / (N (k − 1) − χ²_F) with ``iman_davenport_pvalue``
    from F(k − 1, (k − 1)(N − 1)).
    """

    statistic: float
    pvalue: float
    iman_davenport: float
    iman_davenport_pvalue: float
    average_ranks: tuple[float, ...]
    n_blocks: int
    k: int

    def to_dict(self) -> dict[str, float | int | list[float]]:
        return {"statistic": self.statistic, "pvalue": self.pvalue, "iman_davenport": self.iman_davenport,
                "iman_davenport_pvalue": self.iman_davenport_pvalue, "average_ranks": list(self.average_ranks),
                "n_blocks": self.n_blocks, "k": self.k}


def _score_table(table: object) -> np.ndarray:
    try:
        values = np.asarray(table.detach().cpu().numpy() if isinstance(table, Tensor) else table, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"table must be a 2-D array of numbers (blocks × methods), got {type(table).__name__} "
                        f"({exc}). Fix: pass one row per benchmark data set and one column per method") from None
    if values.ndim != 2:
        raise DataError(f"table must be 2-D (blocks × methods), got shape {values.shape}. "
                        f"Fix: pass one row per benchmark data set and one column per method")
    n_blocks, k = values.shape
    if n_blocks < 2 or k < 2:
        raise DataError(f"table has {n_blocks} block(s) × {k} method(s); the Friedman test needs at least "
                        f"2 blocks and 2 methods. Fix: rank at least two methods on at least two data sets")
    if not np.isfinite(values).all():
        bad = int((~np.isfinite(values)).sum())
        raise DataError(f"table holds {bad} non-finite value(s) (NaN or inf). Fix: give every method a finite "
                        f"score on every data set, or drop the data sets where one is missing")
    return values


def friedman(table: object, *, higher_is_better: bool = True) -> FriedmanResult:
    """Friedman's test and the Iman–Davenport correction on a blocks × methods table of scores.

    Within each block (a benchmark data set, a fault family × severity) the ``k`` methods are
    ranked, 1 the best (the highest score when ``higher_is_better``, else the lowest), ties
    sharing their average rank (``scipy.stats.rankdata``). With ``R_j`` the rank sums and
    ``T = Σ_blocks Σ_ties (t³ − t)`` (Friedman 1937; Demšar 2006, JMLR 7, eq. for χ²_F)::

        χ²_F = (12 / (N k (k + 1)) Σ_j R_j² − 3 N (k + 1)) / (1 − T / (N k (k² − 1)))

    which is exactly ``scipy.stats.friedmanchisquare`` (which needs k ≥ 3; k = 2 works here, where
    the test is the sign test's χ² form). Demšar recommends Iman & Davenport's (1980) less
    conservative ``F_F = (N − 1) χ²_F / (N (k − 1) − χ²_F)`` ~ F(k − 1, (k − 1)(N − 1)); when every
    block ranks the methods identically ``χ²_F = N (k − 1)`` and ``F_F = inf`` (p-value 0). When every
    block ties all methods the statistic is 0/0: reported as 0.0 with p-value 1.0 (no evidence of a
    difference). DataError for a table smaller than 2 × 2 or with non-finite values.
    """
    from scipy import stats as sps

    if not isinstance(higher_is_better, bool):
        raise ConfigError(f"higher_is_better must be True or False, got {higher_is_better!r}. Fix: "
                          f"higher_is_better=True for scores like MCC or AUROC, False for FPR or error rates")
    values = _score_table(table)
    n_blocks, k = values.shape
    ranks = sps.rankdata(-values if higher_is_better else values, axis=1, method="average")
    ties = 0.0
    for row in np.sort(values, axis=1):
        _, counts = np.unique(row, return_counts=True)
        ties += float((counts.astype(np.float64) ** 3 - counts).sum())
    correction = 1.0 - ties / (k * (k * k - 1.0) * n_blocks)
    rank_sums = ranks.sum(axis=0)
    average = tuple(float(r) for r in rank_sums / n_blocks)
    if correction <= 1e-12:
        return FriedmanResult(statistic=0.0, pvalue=1.0, iman_davenport=0.0, iman_davenport_pvalue=1.0,
                              average_ranks=average, n_blocks=n_blocks, k=k)
    statistic = (12.0 / (k * n_blocks * (k + 1)) * float((rank_sums ** 2).sum())
                 - 3.0 * n_blocks * (k + 1)) / correction
    statistic = max(statistic, 0.0)
    pvalue = float(sps.chi2.sf(statistic, k - 1))
    ceiling = n_blocks * (k - 1.0)
    denominator = ceiling - statistic
    if denominator <= 1e-12 * ceiling:
        statistic = min(statistic, ceiling)
        f_stat, f_pvalue = math.inf, 0.0
    else:
        f_stat = (n_blocks - 1.0) * statistic / denominator
        f_pvalue = float(sps.f.sf(f_stat, k - 1, (k - 1) * (n_blocks - 1)))
    return FriedmanResult(statistic=float(statistic), pvalue=pvalue, iman_davenport=float(f_stat),
                          iman_davenport_pvalue=f_pvalue, average_ranks=average, n_blocks=n_blocks, k=k)


def nemenyi_cd(k: int, n_blocks: int, alpha: float = 0.05) -> float:
    """Nemenyi's critical difference of average ranks, ``CD = q_α √(k (k + 1) / (6 N))`` (Demšar 2006, §3.2.2).

    ``q_α`` is the studentized range statistic's ``1 − α`` quantile for ``k`` groups and infinite
    degrees of freedom, divided by √2 (``scipy.stats.studentized_range``): 1.960, 2.343, 2.569,
    2.728, 2.850, 2.949, 3.031, 3.102, 3.164 for k = 2 … 10 at α = 0.05, Demšar's Table 5(a). Two
    methods whose average ranks differ by at least CD differ significantly at level α (all pairs
    together, family-wise). ConfigError for k < 2, n_blocks < 1 or α outside (0, 1).
    """
    for name, value, least in (("k", k, 2), ("n_blocks", n_blocks, 1)):
        check_count(value, name, least, "pass the number of "
                    + ("methods ranked" if name == "k" else "blocks (benchmark data sets)"))
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating)) or not 0.0 < float(alpha) < 1.0:
        raise ConfigError(f"alpha must lie strictly between 0 and 1, got {alpha!r}. Fix: e.g. alpha=0.05")
    return _q_alpha(int(k), float(alpha)) * math.sqrt(k * (k + 1) / (6.0 * n_blocks))


_Q_CACHE: dict[tuple[int, float], float] = {}


def _q_alpha(k: int, alpha: float) -> float:
    key = (k, alpha)
    if key not in _Q_CACHE:
        from scipy.stats import studentized_range

        _Q_CACHE[key] = float(studentized_range.ppf(1.0 - alpha, k, np.inf)) / math.sqrt(2.0)
    return _Q_CACHE[key]


def cd_cliques(average_ranks: Sequence[float], cd: float) -> list[tuple[int, ...]]:
    """The maximal groups of methods whose average ranks all differ by less than ``cd``.

    Demšar (2006) calls two methods significantly different when their average ranks differ by
    *at least* CD, so a group is not significantly different when its largest minus smallest
    rank is ``< cd``; on the rank axis such groups are intervals, and the maximal ones are the
    thick bars of the critical-difference diagram. Each group lists indices into
    ``average_ranks``, best (smallest) rank first; groups are ordered by their best rank. A
    method in a one-element group differs significantly from every other method (the diagram
    draws no bar for it). Ties in rank keep the input order.
    """
    ranks = np.asarray(average_ranks, dtype=np.float64).reshape(-1)
    if ranks.size == 0 or not np.isfinite(ranks).all():
        raise DataError(f"average_ranks must be a non-empty sequence of finite numbers, got {list(ranks)!r}. "
                        f"Fix: pass FriedmanResult.average_ranks")
    cd = float(cd)
    if not math.isfinite(cd) or cd < 0:
        raise ConfigError(f"cd must be a finite number ≥ 0, got {cd!r}. Fix: pass nemenyi_cd(k, n_blocks)")
    order = np.argsort(ranks, kind="stable")
    sorted_ranks = ranks[order]
    groups: list[tuple[int, ...]] = []
    last_end = -1
    for start in range(order.size):
        end = start
        while end + 1 < order.size and sorted_ranks[end + 1] - sorted_ranks[start] < cd:
            end += 1
        if end > last_end:  # not contained in the previous (maximal) group
            groups.append(tuple(int(i) for i in order[start : end + 1]))
            last_end = end
    return groups
