"""Multi-label (and single-label) precision, recall and F1 per input, with bootstrap bounds over inputs.

**Precision / recall / F1** (:func:`score_counts`, :func:`scores`). Per input a ``(3, K)`` count
matrix of true positives, false positives and false negatives (single-label: one-hot prediction and
label). ``micro`` pools the counts over classes; ``macro`` averages per-class values over all K
classes, a 0/0 value counting 0 (scikit-learn's ``zero_division=0``: an absent class lowers the
score, never raises it). ``accuracy`` for multi-label is subset accuracy (all K decisions right).

**Bounds for precision/recall/F1** (:func:`bootstrap_bounds`). The labels of one image are dependent,
so the pooled counts are not binomial. The bound is a seeded percentile bootstrap over *inputs*:
``R`` multinomial resampling-count vectors ``W`` (``R × n``, drawn as ``randint`` indices scattered
into counts) times the per-input count matrix ``C`` (``n × 3K``) give every replicate's counts in one
matrix product, in chunks of replicates. The percentile bootstrap is an *estimate* of a confidence
bound, not an exact one; it cannot see variation a small sample does not show (30 perfect inputs
give a bootstrap lower bound of 1). So each bound is the more conservative of the bootstrap
percentile and a Clopper–Pearson bound with the *inputs* as trials (``⌊score·n⌋`` of ``n``; the
effective sample size of positively dependent labels is at most the number of inputs). Subset
accuracy keeps its exact Clopper–Pearson bound. Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["SCORES", "AVERAGES", "score_counts", "scores", "bootstrap_bounds"]

SCORES = ("accuracy", "precision", "recall", "f1")
AVERAGES = ("micro", "macro")


def score_counts(predicted: Tensor, labels: Tensor, num_classes: int | None = None) -> Tensor:
    """Per input ``(N, 3, K)`` int64 counts of true positives, false positives, false negatives.

    Multi-label: ``predicted`` and ``labels`` ``(N, K)`` 0/1. Single-label: ``(N,)`` class indices
    with ``num_classes`` (one-hot).
    """
    if predicted.ndim == 1:
        if num_classes is None:
            raise ConfigError("single-label counts need num_classes")
        k = num_classes
        p = torch.nn.functional.one_hot(predicted.clamp(0, k - 1).long(), k).bool() & (predicted >= 0)[:, None]
        y = torch.nn.functional.one_hot(labels.long(), k).bool()
    else:
        p, y = predicted != 0, labels.to(predicted.device) != 0
    return torch.stack([p & y, p & ~y, ~p & y], dim=1).to(torch.int64)


def _safe(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))


def scores(counts: Tensor, score: str, average: str) -> tuple[Tensor, Tensor]:
    """Score of summed counts ``(..., 3, K)``: (``(...)`` value, ``(..., K)`` per-class values)."""
    if score not in SCORES[1:] or average not in AVERAGES:
        raise ConfigError(f"score={score!r}, average={average!r}: use one of {SCORES[1:]} and {AVERAGES}.")
    c = counts.double()
    tp, fp, fn = c[..., 0, :], c[..., 1, :], c[..., 2, :]

    def of(tp: Tensor, fp: Tensor, fn: Tensor) -> Tensor:
        if score == "precision":
            return _safe(tp, tp + fp)
        if score == "recall":
            return _safe(tp, tp + fn)
        return _safe(2 * tp, 2 * tp + fp + fn)

    per_class = of(tp, fp, fn)
    value = of(tp.sum(-1), fp.sum(-1), fn.sum(-1)) if average == "micro" else per_class.mean(-1)
    return value, per_class


def bootstrap_bounds(counts: Tensor, score: str, average: str, *, levels: Sequence[float], replicates: int = 2000,
                     seed: int = 0, chunk_elements: int = 1 << 24) -> tuple[Tensor, Tensor]:
    """Percentile-bootstrap (lower, upper) bounds of the score of ``counts`` ``(n, 3, K)`` at each one-sided level.

    ``R`` multinomial count vectors ``W`` (``randint`` indices scattered into counts) times the per-input
    counts ``C`` (``n × 3K``), in chunks of replicates; seeded (same seed, device and data: same numbers).
    Returns two ``(len(levels),)`` float64 tensors (CPU).
    """
    n = counts.shape[0]
    if n == 0:
        raise DataError("bootstrap over no inputs")
    gen = torch.Generator(device=counts.device).manual_seed(int(seed))
    flat = counts.reshape(n, -1).double()
    step = max(1, chunk_elements // n)
    values = []
    for start in range(0, replicates, step):
        r = min(step, replicates - start)
        idx = torch.randint(0, n, (r, n), generator=gen, device=counts.device)
        weights = torch.zeros((r, n), dtype=torch.float64, device=counts.device).scatter_add_(
            1, idx, torch.ones((r, n), dtype=torch.float64, device=counts.device))
        values.append(scores((weights @ flat).reshape(r, *counts.shape[1:]), score, average)[0])
    draws = torch.cat(values).cpu()
    lows = torch.tensor([float(torch.quantile(draws, 1 - c, interpolation="lower")) for c in levels],
                        dtype=torch.float64)
    highs = torch.tensor([float(torch.quantile(draws, c, interpolation="higher")) for c in levels],
                         dtype=torch.float64)
    return lows, highs
