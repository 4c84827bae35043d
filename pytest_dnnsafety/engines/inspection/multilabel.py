"""Multi-label DeepInspect: NAP from the predicted sets, type-1/type-2 confusion, coincidence.

Tian, Zhong, Ray, Yang (2020), *Testing DNN Image Classifiers for Confusion & Bias Errors*, ICSE 2020,
§III (NAP, NAPVD), §IV-B1 (type-1 and type-2 confusion) and RQ1c (coincidence score).

**Predicted set.** A multi-label model gives one output per class; input ``i`` predicts class ``c``
when ``p_ic ≥ t_c`` (a threshold per class, or one for all; 0.5 by default) with ``p = sigmoid(logits)``
— or the outputs themselves when they are probabilities (``outputs="probabilities"``; ``"auto"``
takes them as probabilities when every output lies in [0, 1], else as logits: one host read).
``P`` is the ``(N, K)`` multi-hot prediction matrix, ``Y`` the ``(N, K)`` 0/1 label matrix.

**NAP** (eq. 1 for multi-label). An input contributes to every class it predicts:
``p(n | k) = (Aᵀ P)_nk / colsum(P)_k`` with ``A`` the ``(N, units)`` binary activation matrix, i.e. the
same per-class active counts and predicted counts as the single-label engine keeps, with the
one-hot arg-max replaced by ``P``; NAPVD, the confused-pair rules and avg_bias are then exactly the
single-label ones (:func:`pytest_dnnsafety.engines.inspection.deepinspect.analyse`). Counts are matrix products
(no per-class loops), accumulated in int64 (each batch's product in float32, exact for batches
below 2²⁴ rows; larger batches are split).

**Type-2 confusion** (§IV-B1): ``c₂(a, b) = P(a and b both predicted | a ∈ Y, b ∉ Y)`` =
``((Y∘P)ᵀ((1−Y)∘P))_ab / (Yᵀ(1−Y))_ab`` — the share of the inputs that hold ``a`` and not ``b``
on which the model predicts both. The pair's value is the bi-directional mean
``(c₂(a, b) + c₂(b, a)) / 2`` (symmetric, in [0, 1]); it is *undefined* (NaN) when either
conditioning set is empty (e.g. ``a`` never appears without ``b``), and its *support* is the
smaller of the two conditioning-set sizes. **Type-1** (single-label): ``c₁(a → b)`` = share of the
true-``a`` inputs predicted ``b``; pair value ``(c₁(a→b) + c₁(b→a)) / 2``, support the smaller class
count, undefined when a class has no true input.

**Gated ground-truth confusion** (:func:`worst_pair`): the largest pair value over the pairs whose
support reaches ``min_support`` inputs in *each* conditioning set. Pairs below it are not passed:
they are counted and named in the details; when no pair has support the value is NaN (the gate is
inconclusive).

**Coincidence** (RQ1c): ``co(a, b) = (P(a, b ∈ Y | a ∈ Y) + P(a, b ∈ Y | b ∈ Y)) / 2`` from ``YᵀY``
(the mean of the two directions, as the paper's text describes its role; NaN when a class never
appears). Its Spearman correlation with NAPVD over the pairs (``scipy.stats.spearmanr``, with its
p-value) is reported, not gated: the paper expects it negative (labels that co-occur are hard to
separate).

Predicted sets: :mod:`pytest_dnnsafety.engines.core.multilabel`; precision/recall/F1 and their bounds:
:mod:`pytest_dnnsafety.engines.performance.multilabel`. Pure torch (scipy only for the Spearman p-value);
no pytest import.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.inspection.deepinspect import layer_counts
from pytest_dnnsafety.engines.inspection.kernels import DEFAULT_THRESHOLD, unpack_active
from pytest_dnnsafety.errors import DataError

__all__ = ["MultiLabelInspectionEngine", "GroundTruth", "type1_pairs", "type2_pairs", "coincidence", "worst_pair",
           "spearman"]

_EXACT_ROWS = 1 << 23  # float32 sums of 0/1 stay exact below 2**24


def _gram(a: Tensor, b: Tensor) -> Tensor:
    """``aᵀ b`` of 0/1 matrices as exact int64 (float32 products of row chunks below 2²⁴)."""
    out = torch.zeros((a.shape[1], b.shape[1]), dtype=torch.int64, device=a.device)
    for start in range(0, a.shape[0], _EXACT_ROWS):
        stop = start + _EXACT_ROWS
        out += (a[start:stop].float().T @ b[start:stop].float()).round().to(torch.int64)
    return out


# ------------------------------------------------------------------------------------- the engine
class MultiLabelInspectionEngine(Engine):
    """Streaming DeepInspect counts of one layer for a multi-label model (states all reduce ``sum``).

    ``active_counts`` ``(units, K)`` = ``Aᵀ P``; ``predicted_counts`` ``(K,)`` = colsum ``P``; with labels
    ``both`` = ``(Y∘P)ᵀ((1−Y)∘P)``, ``only`` = ``Yᵀ(1−Y)``, ``together`` = ``YᵀY`` (all ``K × K``).
    """

    def __init__(self, n_neurons: int, num_classes: int, *, threshold: float | None = DEFAULT_THRESHOLD,
                 device: torch.device | str | None = None) -> None:
        super().__init__(device)
        layer_counts(self, n_neurons, num_classes, threshold)
        k = num_classes
        for name in ("both", "only", "together"):
            self.add_state(name, torch.zeros((k, k), dtype=torch.int64), "sum")
        self.add_state("labelled", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("seen", torch.zeros((), dtype=torch.int64), "sum")

    def config(self) -> dict[str, Any]:
        return {"n_neurons": self.n_neurons, "num_classes": self.num_classes, "threshold": self.threshold}

    def update(self, active: Tensor, predicted: Tensor, labels: Tensor | None = None) -> None:
        """Fold a batch: ``active`` bool ``(B, units)`` (or bit-packed uint8), ``predicted`` bool ``(B, K)``
        (:func:`predicted_sets`), ``labels`` ``(B, K)`` 0/1 or None. No host sync."""
        if active.dtype == torch.uint8:
            active = unpack_active(active.to(self.device), self.n_neurons)
        if active.ndim != 2 or active.shape[1] != self.n_neurons or active.dtype != torch.bool:
            raise DataError(f"active must be bool (inputs, {self.n_neurons}), got {tuple(active.shape)} "
                            f"{active.dtype}. "
                            "Fix: pass layer_activity(...).")
        k = self.num_classes
        if predicted.ndim != 2 or predicted.shape != (active.shape[0], k):
            raise DataError(f"predicted must be (inputs, {k}) multi-hot, got {tuple(predicted.shape)}. Fix: pass "
                            "predicted_sets(outputs, threshold).")
        p = predicted.to(self.device, torch.bool)
        self.active_counts = self.active_counts + _gram(active.to(self.device), p)
        self.predicted_counts = self.predicted_counts + p.sum(0)
        self.seen = self.seen + p.shape[0]
        if labels is None:
            return
        if labels.shape != p.shape:
            raise DataError(f"labels have shape {tuple(labels.shape)} but the predictions {tuple(p.shape)}. Fix: a "
                            f"(N, {k}) 0/1 label matrix, one column per model output.")
        y = labels.to(self.device) != 0
        self.both = self.both + _gram(y & p, ~y & p)
        self.only = self.only + _gram(y, ~y)
        self.together = self.together + _gram(y, y)
        self.labelled = self.labelled + p.shape[0]

    def compute(self, **options: Any) -> tuple[Any, GroundTruth | None]:
        """The single-label analysis on the multi-label counts (``analyse`` options) and the ground truth."""
        from pytest_dnnsafety.engines.inspection.deepinspect import analyse

        seen, labelled = int(self.seen), int(self.labelled)
        if seen == 0:
            raise DataError("no inputs were seen; DeepInspect needs predictions on evaluation data. Fix: pass data.")
        if 0 < labelled < seen:
            raise DataError(f"labels came with {labelled} of {seen} inputs; the ground truth needs all or none. "
                            "Fix: pass labels with every batch, or with none.")
        options.pop("label_filter", None)  # the filter reads type-1 confusion, which multi-label data lacks
        res = analyse(self.active_counts, self.predicted_counts, None, n_inputs=seen, threshold=self.threshold,
                      label_filter=False, **options)
        if not labelled:
            return res, None
        matrix, support = type2_pairs(self.both, self.only)
        return res, GroundTruth("type2", matrix, support, coincidence(self.together))


# ------------------------------------------------------------------------------------- ground truth
@dataclass(frozen=True, eq=False)
class GroundTruth:
    """A symmetric ``K × K`` pair matrix of ground-truth confusion (NaN: undefined; diagonal NaN), its support
    (inputs in the smaller conditioning set) and, for multi-label data, the coincidence matrix."""

    kind: str  # "type1" | "type2"
    matrix: Tensor  # (K, K) float64
    support: Tensor  # (K, K) int64
    coincidence: Tensor | None = None  # (K, K) float64


def _directional(num: Tensor, den: Tensor) -> Tensor:
    num, den = num.cpu().double(), den.cpu().double()
    return torch.where(den > 0, num / den.clamp_min(1.0), torch.full_like(num, math.nan))


def _pairs(directional: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    pair = (directional + directional.T) / 2  # NaN when either direction is undefined
    pair.fill_diagonal_(math.nan)
    support = torch.minimum(sizes, sizes.T).to(torch.int64)
    support.fill_diagonal_(0)
    return pair, support


def type2_pairs(both: Tensor, only: Tensor) -> tuple[Tensor, Tensor]:
    """Type-2 pair matrix ``(c₂(a,b) + c₂(b,a))/2`` and its support ``min(|a∈Y,b∉Y|, |b∈Y,a∉Y|)``."""
    return _pairs(_directional(both, only), only.cpu())


def type1_pairs(confusion: Tensor) -> GroundTruth:
    """Type-1 pair matrix from a ``K × K`` (true × predicted) count matrix, support the smaller class count."""
    conf = confusion.cpu().to(torch.int64)
    rows = conf.sum(1, keepdim=True)
    matrix, support = _pairs(_directional(conf, rows.expand_as(conf)), rows.expand_as(conf))
    return GroundTruth("type1", matrix, support)


def coincidence(together: Tensor) -> Tensor:
    """``(P(a,b ∈ Y | a ∈ Y) + P(a,b ∈ Y | b ∈ Y)) / 2`` from ``YᵀY`` (NaN where a class never appears)."""
    co = together.cpu().double()
    given = _directional(co, co.diagonal()[:, None].expand_as(co))  # row a: P(b ∈ Y | a ∈ Y)
    out = (given + given.T) / 2
    out.fill_diagonal_(math.nan)
    return out


def worst_pair(truth: GroundTruth, min_support: int) -> tuple[float, tuple[int, int] | None, int, int]:
    """The largest pair value with support ≥ ``min_support``: (value or NaN, pair, supported, unsupported)."""
    k = truth.matrix.shape[0]
    iu = torch.triu_indices(k, k, 1)
    values, support = truth.matrix[iu[0], iu[1]], truth.support[iu[0], iu[1]]
    ok = (support >= min_support) & ~torch.isnan(values)
    n_ok = int(ok.sum())
    if not n_ok:
        return math.nan, None, 0, int(values.numel())
    masked = torch.where(ok, values, torch.full_like(values, -1.0))
    best = int(torch.argmax(masked))  # first of the largest: lexicographic order breaks ties
    return float(values[best]), (int(iu[0, best]), int(iu[1, best])), n_ok, int(values.numel()) - n_ok


def spearman(napvd: Tensor, co: Tensor) -> dict[str, Any]:
    """Spearman's rho of coincidence vs NAPVD over the pairs where both are defined, with its p-value."""
    k = napvd.shape[0]
    iu = torch.triu_indices(k, k, 1)
    x, y = napvd[iu[0], iu[1]].double(), co[iu[0], iu[1]].double()
    keep = ~(torch.isnan(x) | torch.isnan(y))
    n = int(keep.sum())
    out: dict[str, Any] = {"pairs": n, "rho": None, "p_value": None}
    if n < 3:
        out["note"] = "fewer than 3 pairs with both NAPVD and coincidence defined"
        return out
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant input: rho is NaN, reported as None
        rho, p = spearmanr(x[keep].numpy(), y[keep].numpy())
    out["rho"] = None if math.isnan(float(rho)) else float(rho)
    out["p_value"] = None if math.isnan(float(p)) else float(p)
    return out
