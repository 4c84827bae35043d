"""Lower bounds from a bootstrap over images: wide (the default), conservative, BCa, bias-extrapolated, percentile.

The detection gates' statistics (COCO mAP, per-class and overall recall) are computed from the records of a
group's images; the images are the independent units (one dark frame loses all its objects together). A
bootstrap replicate reweights the images (multinomial counts), a jackknife replicate leaves a group of
images out, a half-subset keeps a random ``n // 2`` of them (0/1 weights, no repeats). From the ``B``
bootstrap replicates ``θ*``, the estimate ``θ̂``, the ``G`` jackknife values ``θ(g)`` and the ``H`` half-subset
values ``θ½``, the one-sided lower bound at confidence ``1 − α`` is:

* ``"percentile"`` — the ``α`` quantile of ``θ*`` (``lower`` interpolation). It assumes ``θ̂`` is
  median-unbiased; AP is not: on a finite sample the precision envelope (precision made monotone from
  the right, a running maximum) picks up favourable noise, so sample AP is biased *upwards* — by about
  its standard error when many false positives score high — and the bound undercovers the population
  value (47–87 % in docs/gates/detection.md, "How good is the bound");
* ``"bca"`` — Efron's bias-corrected and accelerated percentile (Efron 1987, *Better bootstrap confidence
  intervals*, JASA 82:171; Efron & Tibshirani 1993, §14.3): the quantile read is
  ``Φ(z₀ + (z₀ + z_α) / (1 − a (z₀ + z_α)))`` with ``z₀ = Φ⁻¹(share of θ* below θ̂, ties counted half)``
  and ``a = Σ d³ / (6 (Σ d²)^{3/2})``, ``d = mean(θ(·)) − θ(g)``. Upward bias shows as ``z₀ < 0`` and moves
  the quantile read down. The jackknife is *grouped* (image ``i`` in group ``i mod G``, ``G = min(n, 100)``;
  for recall the exact delete-one values, cheap for a ratio): ``a`` is a ratio of the third cumulant to the
  second to the power 3/2, and both cumulants of a sum over a group of ``m`` images scale with ``m``, so the
  grouped ratio estimates the same ``a`` at ``G`` extra evaluations instead of ``n``. BCa corrects a bias of
  order ``1/n``; the envelope's bias is of order ``1/√n`` and the bootstrap world (whose "population" is the
  already rough sample curve) underestimates it, so BCa still undercovers mAP on small samples;
* ``"extrapolated"`` — ``θ̂ − b̂ − s``. The bias ``b̂``: the mean of ``θ½`` over random half-subsets of the
  images is an unbiased estimate of the expected statistic on ``n/2`` images drawn from the population
  (an average over subsets of a sample, a U-statistic), so ``mean(θ½) − θ̂`` estimates ``b(n/2) − b(n)``;
  with a bias decaying as ``c·n^{−γ}``, ``b(n) = (b(n/2) − b(n)) / (2^γ − 1)``, and ``γ = 1/2`` (the slowest
  decay of a bias no larger than the standard error) gives the largest ``b̂``: ``(mean(θ½) − θ̂)/(√2 − 1)``,
  never below 0. The spread ``s``: the larger of ``mean(θ*) − α-quantile(θ*)`` and ``z_{1−α}·sd(θ½)`` (half-
  sampling: without replacement, the half-subsets' variance around the sample is the full sample's
  variance, ``(1/(n/2) − 1/n)σ² = σ²/n``);
* ``"conservative"`` — the smaller of ``"bca"`` and ``"extrapolated"``;
* ``"wide"`` (default) — ``"conservative"`` read at confidence ``1 − α/5`` (99 % for a 95 % gate): a margin for the
  error of the two estimated pieces (bias and spread), which the simulations show is needed on 60 images.

None of these is exact; each is a large-sample approximation, and the argument for ``"extrapolated"``
rests on the assumed bias decay (``γ ≥ 1/2``). Their coverage on heterogeneous known-truth simulations
(image-level difficulty, several detector behaviours and classes) is measured by
``benchmarks/detection_bound_coverage.py`` and tabulated in the docs. Pure torch, no pytest import.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError

__all__ = ["BOUND_METHODS", "DEFAULT_METHOD", "HALF_SUBSETS", "JACKKNIFE_GROUPS", "WORK_LIMIT", "bootstrap_lower", "check_work",
           "jackknife_groups", "jackknife_weights", "method_text"]

#: The bounds a detection gate can compare (``method=``); see the module docstring.
BOUND_METHODS = ("wide", "conservative", "bca", "extrapolated", "percentile")
DEFAULT_METHOD = "wide"
#: Jackknife groups for BCa's acceleration (delete-one below this many images).
JACKKNIFE_GROUPS = 100
#: Random half-subsets of the images whose mean statistic estimates the small-sample bias ("extrapolated").
HALF_SUBSETS = 200
#: The most bootstrap work a gate starts: replicates × (detections × IoU thresholds + images) for mAP,
#: replicates × images × (classes + 1) for recall. About 7·10⁷ such units a second on a 2-core CPU, so the
#: limit is about 10 minutes there.
WORK_LIMIT = 4 * 10**10
_RATE = 7e7  # units a second on a 2-core CPU (measured: 1,000 replicates of 18,837 detections × 10 in 2.8 s)

_TEXT = {
    "wide": "the conservative bootstrap lower bound read at a fifth of the error rate (1 − α/5) (approximate; "
            "coverage measured on simulations, see docs)",
    "conservative": "the smaller of a BCa and a bias-extrapolated bootstrap lower bound over images (approximate; "
                    "coverage measured ≥ nominal on simulations, see docs)",
    "bca": "BCa bootstrap lower bound over images (bias-corrected and accelerated; approximate, coverage measured "
           "≥ nominal on simulations, see docs)",
    "extrapolated": "bias-extrapolated bootstrap lower bound over images (approximate; see docs)",
    "percentile": "percentile bootstrap lower bound over images (approximate; undercovers mAP on small samples, "
                  "see docs)",
}


def method_text(method: str) -> str:
    """How a bound of ``method`` was read, for the details' ``bound`` and the gate's detail line."""
    return _TEXT[method]


def _check_method(method: str) -> str:
    if method not in BOUND_METHODS:
        raise ConfigError(f"bound method must be one of {', '.join(BOUND_METHODS)}, got {method!r}")
    return method


def jackknife_groups(n: int, groups: int = JACKKNIFE_GROUPS) -> int:
    """The number of jackknife groups of ``n`` images: ``min(n, groups)`` (at least 1)."""
    return max(1, min(n, groups))


def jackknife_weights(n: int, groups: int = JACKKNIFE_GROUPS, rows: range | None = None) -> Tensor:
    """``(G, n)`` float64 weights, ``G = min(n, groups)``: row ``g`` leaves out the images ``i`` with ``i mod G == g``;
    ``rows``: only those rows (a chunk, so the working set stays within the bootstrap's block)."""
    G = jackknife_groups(n, groups)
    rows = range(G) if rows is None else rows
    member = torch.arange(n) % G
    return (member[None, :] != torch.tensor(list(rows), dtype=torch.int64)[:, None]).to(torch.float64)


def half_weights(n: int, generator: torch.Generator, count: int = HALF_SUBSETS) -> Tensor:
    """``(count, n)`` float64 0/1 weights: each row keeps a random ``n // 2`` of the ``n`` images (no repeats)."""
    if n < 2:
        return torch.ones(count, n, dtype=torch.float64)
    kept = torch.rand(count, n, generator=generator).argsort(1)[:, : n // 2]  # the n // 2 smallest random keys
    return torch.zeros(count, n, dtype=torch.float64).scatter_(1, kept, 1.0)


def _ndtri(p: Tensor) -> Tensor:
    return math.sqrt(2.0) * torch.special.erfinv(2.0 * p - 1.0)


def _ndtr(z: Tensor) -> Tensor:
    return torch.special.ndtr(z)


def _quantile_lower(values: Tensor, q: Tensor) -> Tensor:
    """Per column of ``values`` ``(B, K)`` its ``q[k]`` quantile with ``lower`` interpolation (order statistic
    ``floor(q (B − 1))``), as ``torch.quantile(..., interpolation="lower")`` for one ``q``."""
    B = values.shape[0]
    ranks = torch.floor(q.clamp(0.0, 1.0) * (B - 1)).long().clamp(0, B - 1)
    return values.sort(0).values.gather(0, ranks[None, :])[0]


def bootstrap_lower(replicates: Tensor, estimate: Tensor | float, confidence: float, method: str = DEFAULT_METHOD,
                    jackknife: Tensor | None = None, halves: Tensor | None = None, n: int | None = None) -> Tensor:
    """The one-sided lower bound at ``confidence`` of ``method`` (module docstring), per column.

    ``replicates`` ``(B,)`` or ``(B, K)``; ``estimate`` scalar or ``(K,)``; ``jackknife`` ``(G,)`` or ``(G, K)``
    (BCa only; without it the acceleration is 0, the bias-corrected percentile "BC"). Returns a tensor of
    ``estimate``'s shape, on the host, float64. A column whose jackknife values are all equal has ``a = 0``.
    """
    _check_method(method)
    rep = replicates.to(torch.float64).cpu()
    scalar = rep.dim() == 1
    rep = rep[:, None] if scalar else rep
    est = torch.as_tensor(estimate, dtype=torch.float64).reshape(-1).cpu().expand(rep.shape[1])
    alpha = 1.0 - float(confidence)
    B = rep.shape[0]
    if method == "percentile":
        out = _quantile_lower(rep, torch.full((rep.shape[1],), alpha, dtype=torch.float64))
    elif method == "extrapolated":
        half = halves.to(torch.float64).cpu()
        half = half[:, None] if half.dim() == 1 else half
        bias = ((half.mean(0) - est) / (math.sqrt(2.0) - 1.0)).clamp_min(0.0)
        spread = rep.mean(0) - _quantile_lower(rep, torch.full((rep.shape[1],), alpha, dtype=torch.float64))
        spread = torch.maximum(spread, -_ndtri(torch.tensor(alpha, dtype=torch.float64)) * half.std(0))
        out = (est - bias - spread).clamp_min(0.0)  # mAP and recall are shares: below 0 says nothing more
    elif method == "wide":
        out = bootstrap_lower(rep, est, 1.0 - alpha / 5, "conservative", jackknife, halves)
    elif method == "conservative":
        out = torch.minimum(bootstrap_lower(rep, est, confidence, "bca", jackknife),
                            bootstrap_lower(rep, est, confidence, "extrapolated", jackknife, halves))
    else:
        share = ((rep < est).sum(0) + 0.5 * (rep == est).sum(0)).to(torch.float64) / B
        z0 = _ndtri(share.clamp(0.5 / B, 1.0 - 0.5 / B))
        a = torch.zeros_like(z0)
        if jackknife is not None:
            jk = jackknife.to(torch.float64).cpu()
            jk = jk[:, None] if jk.dim() == 1 else jk
            d = jk.mean(0) - jk
            s2 = (d * d).sum(0)
            a = torch.where(s2 > 0, (d ** 3).sum(0) / (6.0 * s2.clamp_min(1e-300) ** 1.5), a)
        za = _ndtri(torch.tensor(alpha, dtype=torch.float64))
        denom = 1.0 - a * (z0 + za)
        level = torch.where(denom > 0, _ndtr(z0 + (z0 + za) / denom.clamp_min(1e-12)), torch.zeros_like(z0))
        out = _quantile_lower(rep, level)
    return out[0] if scalar else out


def check_work(marker: str, bootstrap: int, units: int, what: str) -> None:
    """Refuse, before any replicate runs, a bootstrap of ``bootstrap`` replicates over ``units`` work units each
    (``what`` says what they count) that exceeds :data:`WORK_LIMIT`; the message names the marker, the
    ``bootstrap`` argument, the estimate and the fix."""
    work = int(bootstrap) * int(units)
    if work <= WORK_LIMIT:
        return
    fits = max(1, WORK_LIMIT // max(1, int(units)))
    minutes = work / _RATE / 60
    raise MetricError(
        f"{marker}: bootstrap={bootstrap} replicates over {what} ({units:,} units each) is {work:.2e} units of work, "
        f"more than the limit {WORK_LIMIT:.0e} (about {minutes:,.0f} min on a 2-core CPU). Fix: lower bootstrap= "
        f"(at most {fits:,} here; the default 1000 gives a stable 95% bound), or gate fewer images per group")
