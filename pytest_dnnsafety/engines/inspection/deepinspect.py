"""DeepInspect: class-level confusion and bias from neuron activation probabilities.

Tian, Zhong, Ray, Yang (2020), *Testing DNN Image Classifiers for Confusion & Bias Errors*, ICSE 2020
(the paper's text states the definitions loosely; those below are as the authors' code — ``ARiSE-Lab/DeepInspect``, ``torchncoverage.py``, ``*_deepinspect.py`` and
``reproduce/util.py`` — computes them).

**Activity**. For one input, a layer's output (the module's output, before any BN/ReLU that
follows as a separate module) is min–max scaled over the *whole* layer tensor of that input; a
unit (a dense neuron or a conv channel) is *active* when the mean of its scaled values exceeds the
threshold ``t`` (0.5 by default, any ``t`` in (0, 1) allowed). Because the scaling is affine, it
follows from the per-channel reductions the activation cache keeps (``mean_c``, ``min_c``,
``max_c``): with ``lo = min_c min_c`` and ``hi = max_c max_c`` over the input's channels,
``active_c ⇔ (mean_c − lo)/(hi − lo) > t`` (:func:`layer_activity`). A constant layer output
(``hi = lo``) activates no unit, as in the authors' ``scale`` (which returns zeros). With
``reduce="max"`` a channel is active when its *largest* scaled value exceeds ``t`` (a variant,
not the paper's).

**Probabilities** (the paper's eq. 1). ``p(n | k)`` = share of the inputs *predicted* as class
``k`` on which unit ``n`` is active: a units × classes matrix ``p = A / c`` with ``A`` the active
counts by predicted class and ``c`` the predicted-class counts. A class the model never predicts
has no column (0/0): it is *excluded* from every pair (its NAPVD row and column are NaN), the
result names it in ``unpredicted`` and ``warnings``, and the gates refuse it unless told to
exclude it (``unpredicted="exclude"``) — a class that is never predicted is itself a defect that a
silent exclusion would hide.

**NAPVD** (eq. 2). ``NAPVD(a, b) = √Σ_{n∈M} (p(n|a) − p(n|b))² / √|M|``, ``M`` = units with
``p > 0`` for ``a`` or ``b`` (an RMS difference over the units either class uses, so in [0, 1];
small = confusable). Computed for all pairs at once with matrix products only: the sum is
``‖p_a‖² + ‖p_b‖² − 2 p_a·p_b`` from the Gram matrix (units outside ``M`` add 0), and
``|M| = |A| + |B| − |A ∩ B|`` from the product of the 0/1 indicator matrix with itself. To keep
identical columns at exactly 0 (no cancellation residue under the square root), the Gram matrix is
taken of the integer counts: ``Σ (A_a/c_a − A_b/c_b)² = (c_b² G_aa + c_a² G_bb − 2 c_a c_b G_ab) /
(c_a c_b)²`` with ``G = AᵀA`` exact in float64 and the numerator exact in int64 (whenever
``n·c_max² < 2⁵³`` and ``2n(c₁c₂)² < 2⁶³`` for the two largest class counts — e.g. 512 units and
≤ 80,000 inputs of the largest class; beyond, the float64 Gram of ``p`` with a clamp at 0 is used,
accurate to about 1e-8 near 0). ``|M| = 0`` (neither class activates any unit) gives NAPVD 0: the
two classes are indistinguishable at this layer.

**Confused pairs.** Rule ``"std"`` (the paper's default): pairs ``i < j`` with
``NAPVD < mean − 1·std`` over all pairs (population std, as ``np.std``). Rule ``"top"``: the
``⌈top_share·P⌉`` pairs (at least one) of smallest NAPVD, ties broken by pair order; the authors'
``int(top_share·P)`` flags nothing below 100 pairs, hence the ceiling. *Statistically loose:* the
std rule is relative — it flags pairs by comparison with the model's other pairs, so a model whose
pairs are all well separated still gets flagged pairs and one whose pairs are all confused may get
none; on a skewed NAPVD distribution ``mean − std`` may lie below every pair. It is kept as the
default because it is the paper's rule; the gates' ``confusion`` statistic is absolute.

**Bias** (eqs. 3–4, as ``reproduce/util.py`` computes them). ``D`` = the NAPVD matrix of the
predicted classes (``K'`` of them, zero diagonal); ``cutoff = mean − std`` of all ``K'²`` entries
(diagonal included, as the authors do — the ``K'`` zeros pull it down). For a pair ``(i, j)`` and a
third class ``k``: ``bias(i,j,k) = |D_ik/(D_ik + D_jk) − ½|`` when ``D_ik < cutoff`` or
``D_jk < cutoff``, else 0; a triplet counts only when ``D_ik > 1e-5`` and ``D_jk > 1e-5`` (which
also drops ``k ∈ {i, j}``) and, with labels and ``label_filter``, when the model confused ``k``
with ``i`` or ``j`` at least once in either direction (the authors' ``t1 = 0`` filter; so labelled
and unlabelled data can give different values). ``avg_bias(i, j) = Σ_k bias(i,j,k) / (K' − 2)`` ∈
[0, ½). Vectorised over all triplets, in chunks of first classes ``i`` so that 1,000 classes fit
in memory (chunks of ``i`` × all ``j`` × all ``k``). Biased pairs: ``avg_bias > mean + 1·std``
(rule ``"std"``) or the ``⌈top_share·P⌉`` largest (rule ``"top"``). Needs ``K' ≥ 3``:
:class:`InspectionError` otherwise (confusion works with two classes). *No signal:* when no ``D``
entry lies below the cutoff (random activations; the authors' own CIFAR-10 model at activation
thresholds 0.25 and 0.5) or no triplet passes the filters, every avg_bias is 0 for want of evidence
and no pair is the worst: ``InspectionResult.bias_no_signal`` says why (the gate is inconclusive).
The kernels live in :mod:`pytest_dnnsafety.engines.inspection.kernels` (re-exported here).

**With labels** (§IV-B of the paper). Type-1 confusion ``c(a→b)`` = share of the true-``a``
inputs predicted ``b`` (0 for a class without true inputs). Ground-truth confused pairs: pairs
whose ``(c(a→b) + c(b→a))/2 > mean + 1·std`` over the pairs of predicted classes. Ground-truth
biased pairs: ``avg_cd(i, j) = Σ_k |c(i→k) + c(k→i) − c(j→k) − c(k→j)| / (K' − 2)`` over the same
triplets as ``avg_bias`` (without the cutoff), ``> mean + 1·std``. The predicted pairs are scored
by precision (flagged pairs that are ground truth), recall (ground-truth pairs flagged) and AUCEC.

**AUCEC** (area under the cost-effectiveness curve, :func:`aucec`). Rank the ``P`` pairs from most
to least suspicious (confusion: ascending NAPVD; bias: descending avg_bias). Inspecting the first
``m`` pairs costs ``x = m/P`` and finds ``y = (ground-truth pairs among them)/G``. The curve is
piecewise linear through ``(0, 0)`` and the points after each block of tied scores (within a tie
block it is the expected curve of a random order); AUCEC is its area, in [0, 1]. A random ranking
scores 0.5 in expectation, the perfect one ``1 − G/(2P)``. Undefined (None) without ground-truth
pairs. (The authors sample the curve at 40 points and divide by 39; this is the exact area.)

State (:class:`InspectionEngine`, all reduce ``sum``, so ``merge`` and ``sync`` add): ``active_counts``
(units × K int64, by predicted class), ``predicted_counts`` (K), ``confusion`` (K × K, true ×
predicted, labelled inputs only), ``labelled``, ``seen`` and ``out_of_range`` counters. ``update``
is a few scatter-adds (``scatter_add_``, ``index_add_``) with no host sync. :func:`inspect_classes` runs the same on
precomputed binary activations (bool or bit-packed) and predictions, e.g. other tools' dumps.
Pure torch, no pytest import.

Measured (``tests/benchmarks/test_bench_inspection.py``; updates in batches of 2,048, then ``compute``
with avg_bias, no labels): 100 classes × 512 units × 10,000 inputs in 0.035 s on one CPU thread
(0.1 s on two heavily shared cores; a direct loop over pairs and triplets, numpy over units, 0.17 s);
1,000 classes × 512 units × 50,000 inputs in 0.7 s on one thread (2.8 s on the shared cores; the
direct loop, extrapolated from 100 classes, about 2 minutes). On an H100: 0.005 s and 0.06 s, the
same values as the CPU to 1e-16 and no host sync in ``update``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.inspection.kernels import (
    _TRIPLET_CHUNK, DEFAULT_THRESHOLD, InspectionError, _bias_no_signal, _pop_std, aucec,
    check_threshold, class_bias, napvd_matrix, unpack_active,
)
from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = [
    "InspectionEngine", "InspectionResult", "inspect_classes", "RULES",
]

#: Rules for flagging pairs: "std" (mean ∓ 1·std, the paper's default) and "top" (a share of the pairs).
RULES = ("std", "top")


def _flag(values: Tensor, rule: str, top_share: float, *, low: bool) -> tuple[Tensor, float | None]:
    """Flag pairs by rule; ``low``: small values are suspicious (NAPVD) else large ones (avg_bias)."""
    if rule == "std":
        mean, std = values.mean(), _pop_std(values)
        cut = float(mean - std) if low else float(mean + std)
        return (values < cut) if low else (values > cut), cut
    m = min(values.numel(), max(1, math.ceil(top_share * values.numel() - 1e-9)))
    order = torch.sort(values if low else -values, stable=True).indices
    flags = torch.zeros_like(values, dtype=torch.bool)
    flags[order[:m]] = True
    return flags, None


def _check_rule(rule: Any, top_share: Any) -> None:
    if rule not in RULES:
        raise ConfigError(f"rule={rule!r} is not one of {RULES}. Fix: use 'std' (mean − 1·std, the paper's default) "
                          "or 'top' (the top_share most suspicious pairs).")
    if isinstance(top_share, bool) or not isinstance(top_share, (int, float)) or not 0 < top_share <= 1:
        raise ConfigError(f"top_share={top_share!r} must be in (0, 1]. Fix: e.g. top_share=0.01 (the top 1 %).")


# ----------------------------------------------------------------------------- the result
@dataclass(frozen=True, eq=False)
class InspectionResult:
    """DeepInspect on one layer: p(n|k), NAPVD, confused and biased pairs, and the ground truth with labels.

    Pair tensors (``pair_*``, ``confused``, ``biased``, ``gt_*``) have one entry per pair ``i < j`` of
    *predicted* classes, in lexicographic order; ``pair_index`` gives the class indices. K×K matrices
    are NaN in the rows and columns of classes never predicted (``unpredicted``).
    """

    classes: tuple[str, ...]
    n_inputs: int
    n_neurons: int
    threshold: float | None
    rule: str
    top_share: float
    predicted_counts: Tensor  # (K,) int64
    probabilities: Tensor  # (n, K) float64
    napvd: Tensor  # (K, K) float64
    unpredicted: tuple[int, ...]
    pair_index: Tensor  # (P, 2) int64
    pair_napvd: Tensor  # (P,)
    confused: Tensor  # (P,) bool
    confusion_cutoff: float | None
    avg_bias: Tensor | None = None  # (K, K)
    pair_bias: Tensor | None = None
    biased: Tensor | None = None
    bias_cutoff: float | None = None
    bias_problem: str | None = None
    #: why every avg_bias is 0 for want of evidence (no triplet entered eq. 3–4), else None
    bias_no_signal: str | None = None
    label_filter: bool = False
    type1: Tensor | None = None  # (K, K): c(a→b), row = true class
    pair_type1: Tensor | None = None  # (P,): (c(a→b) + c(b→a)) / 2
    gt_confused: Tensor | None = None
    pair_cd: Tensor | None = None
    gt_biased: Tensor | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    # ------------------------------------------------------------------ values
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def n_pairs(self) -> int:
        return int(self.pair_index.shape[0])

    @property
    def has_labels(self) -> bool:
        return self.type1 is not None

    def confusion_values(self) -> Tensor:
        """Per pair ``1 − NAPVD`` ∈ [0, 1]: 1 = the two classes use the same units at the same rates."""
        return 1.0 - self.pair_napvd

    def max_confusion(self) -> float:
        """The gates' ``confusion`` statistic: ``1 − min NAPVD`` over the pairs of predicted classes."""
        return float(self.confusion_values().max())

    def confused_share(self) -> float:
        """The share of pairs flagged confused by the rule."""
        return float(self.confused.double().mean())

    def require_bias(self) -> Tensor:
        if self.pair_bias is None:
            raise InspectionError(self.bias_problem or "avg_bias was not computed. Fix: compute(bias=True).")
        return self.pair_bias

    def max_bias(self) -> float:
        """The largest ``avg_bias`` over the pairs (in [0, ½))."""
        return float(self.require_bias().max())

    @staticmethod
    def _score(flags: Tensor | None, truth: Tensor | None) -> tuple[float | None, float | None, int]:
        if flags is None or truth is None:
            return None, None, 0
        tp = int((flags & truth).sum())
        n_flag, n_true = int(flags.sum()), int(truth.sum())
        return (tp / n_flag if n_flag else None), (tp / n_true if n_true else None), tp

    def confusion_scores(self) -> dict[str, Any]:
        """Precision, recall and AUCEC of the confused pairs against the ground truth (labels needed)."""
        if self.gt_confused is None:
            return {}
        precision, recall, tp = self._score(self.confused, self.gt_confused)
        g, p = int(self.gt_confused.sum()), self.n_pairs
        return {"ground_truth_pairs": g, "true_positives": tp, "precision": precision, "recall": recall,
                "aucec": aucec(self.pair_napvd, self.gt_confused),
                "aucec_random": 0.5 if g else None, "aucec_optimal": 1 - g / (2 * p) if g else None}

    def bias_scores(self) -> dict[str, Any]:
        """Precision, recall and AUCEC of the biased pairs against avg_cd's ground truth (labels needed)."""
        if self.gt_biased is None or self.pair_bias is None or self.biased is None:
            return {}
        precision, recall, tp = self._score(self.biased, self.gt_biased)
        g, p = int(self.gt_biased.sum()), self.n_pairs
        return {"ground_truth_pairs": g, "true_positives": tp, "precision": precision, "recall": recall,
                "aucec": aucec(self.pair_bias, self.gt_biased, descending=True),
                "aucec_random": 0.5 if g else None, "aucec_optimal": 1 - g / (2 * p) if g else None}

    # ------------------------------------------------------------------ records
    def worst_pairs(self, top: int | None = 10, *, by: str = "confusion") -> list[dict[str, Any]]:
        """Pairs by class name, most suspicious first: by ``"confusion"`` (ascending NAPVD) or ``"bias"``."""
        if by == "bias":
            key, descending = self.require_bias(), True
        else:
            key, descending = self.pair_napvd, False
        order = torch.sort(-key if descending else key, stable=True).indices[:top]
        out = []
        for idx in order.tolist():
            a, b = self.pair_index[idx].tolist()
            row: dict[str, Any] = {"pair": [self.classes[a], self.classes[b]], "napvd": float(self.pair_napvd[idx]),
                                   "confusion": 1.0 - float(self.pair_napvd[idx]),
                                   "confused": bool(self.confused[idx])}
            if self.pair_bias is not None and self.biased is not None:
                row["avg_bias"] = float(self.pair_bias[idx])
                row["biased"] = bool(self.biased[idx])
            if self.pair_type1 is not None and self.gt_confused is not None and self.type1 is not None:
                row["type1"] = float(self.pair_type1[idx])
                row[f"type1 {self.classes[a]}->{self.classes[b]}"] = float(self.type1[a, b])
                row[f"type1 {self.classes[b]}->{self.classes[a]}"] = float(self.type1[b, a])
                row["ground_truth_confused"] = bool(self.gt_confused[idx])
            if self.pair_cd is not None and self.gt_biased is not None:
                row["avg_cd"] = float(self.pair_cd[idx])
                row["ground_truth_biased"] = bool(self.gt_biased[idx])
            out.append(row)
        return out

    def to_details(self, top: int = 10, *, by: str = "confusion", matrix_limit: int = 64) -> dict[str, Any]:
        """Plain JSON-able details (NaN as None); the NAPVD matrix when K ≤ ``matrix_limit``."""
        out: dict[str, Any] = {
            "classes": list(self.classes), "n_inputs": self.n_inputs, "n_neurons": self.n_neurons,
            "activation_threshold": self.threshold, "rule": self.rule, "top_share": self.top_share,
            "predicted_counts": self.predicted_counts.tolist(), "pairs_total": self.n_pairs,
            "unpredicted": [self.classes[i] for i in self.unpredicted], "warnings": list(self.warnings),
            "max_confusion": self.max_confusion(), "min_napvd": float(self.pair_napvd.min()),
            "napvd_mean": float(self.pair_napvd.mean()), "napvd_std": float(_pop_std(self.pair_napvd)),
            "confusion_cutoff": self.confusion_cutoff, "confused_pairs": int(self.confused.sum()),
            "confused_share": self.confused_share(),
            "pairs": self.worst_pairs(top, by=by if self.pair_bias is not None else "confusion"),
        }
        if self.pair_bias is not None and self.biased is not None:
            out.update({"max_avg_bias": self.max_bias(), "bias_cutoff": self.bias_cutoff,
                        "biased_pairs": int(self.biased.sum()), "label_filter": self.label_filter,
                        "bias_no_signal": self.bias_no_signal})
        elif self.bias_problem:
            out["bias_problem"] = self.bias_problem
        if self.has_labels:
            out["ground_truth"] = {"confusion": self.confusion_scores(), **(
                {"bias": self.bias_scores()} if self.pair_cd is not None else {})}
        if self.num_classes <= matrix_limit:
            out["napvd"] = _json_matrix(self.napvd)
            if self.type1 is not None:
                out["type1_confusion"] = _json_matrix(self.type1)
        return out

    def detail(self, *, by: str = "confusion") -> str:
        k = self.num_classes - len(self.unpredicted)
        if by == "bias" and self.bias_no_signal is not None:  # no pair is "worst": every avg_bias is 0
            head = f"no bias signal: every avg_bias is 0 ({self.n_pairs} pairs)"
        elif by == "bias":
            worst = self.worst_pairs(1, by="bias")[0]
            head = (f"max avg_bias {worst['avg_bias']:.4g} for {worst['pair'][0]}–{worst['pair'][1]}; "
                    f"{int(self.biased.sum()) if self.biased is not None else 0} of {self.n_pairs} pairs biased "
                    f"({_rule_text(self.rule, self.top_share, low=False)})")
        else:
            worst = self.worst_pairs(1)[0]
            head = (f"worst pair {worst['pair'][0]}–{worst['pair'][1]}: NAPVD {worst['napvd']:.4g} (confusion "
                    f"{worst['confusion']:.4g}); {int(self.confused.sum())} of {self.n_pairs} pairs confused "
                    f"({_rule_text(self.rule, self.top_share, low=True)})")
        text = f"{head}; {k} predicted classes, {self.n_inputs} inputs, {self.n_neurons} units"
        if self.unpredicted:
            text += f"; never predicted (excluded): {', '.join(self.classes[i] for i in self.unpredicted)}"
        return text


def _rule_text(rule: str, top_share: float, *, low: bool) -> str:
    if rule == "std":
        return "mean − 1·std rule" if low else "mean + 1·std rule"
    return f"top {top_share:.3g} rule"


def _json_matrix(m: Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in m.tolist()]


# ----------------------------------------------------------------------------- analysis
def _class_names(classes: Sequence[Any] | None, k: int) -> tuple[str, ...]:
    if classes is None:
        return tuple(str(i) for i in range(k))
    names = tuple(str(c) for c in classes)
    if len(names) != k:
        raise ConfigError(f"classes= names {len(names)} classes but there are {k}. Fix: name every class, in the "
                          "model's output order.")
    if len(set(names)) != k:
        raise ConfigError(f"classes= names a class twice ({sorted({c for c in names if names.count(c) > 1})}). "
                          "Fix: give each class once.")
    return names


def analyse(active_counts: Tensor, predicted_counts: Tensor, confusion: Tensor | None, *, n_inputs: int,
            threshold: float | None = DEFAULT_THRESHOLD, rule: str = "std", top_share: float = 0.01,
            bias: bool = True, label_filter: bool = True, classes: Sequence[Any] | None = None,
            chunk_elements: int = _TRIPLET_CHUNK) -> InspectionResult:
    """DeepInspect from the count states (see the module doc); the engine's and :func:`inspect_classes`' core."""
    _check_rule(rule, top_share)
    device = active_counts.device if active_counts.device.type != "mps" else torch.device("cpu")  # no float64
    counts = active_counts.to(device, torch.int64)
    c = predicted_counts.to(device, torch.int64)
    n, k = counts.shape
    names = _class_names(classes, k)
    kept = torch.nonzero(c > 0).reshape(-1)
    kept_list = kept.tolist()
    predicted = set(kept_list)
    unpredicted = tuple(i for i in range(k) if i not in predicted)
    warnings: list[str] = []
    if unpredicted:
        shown = ", ".join(names[i] for i in unpredicted)
        warnings.append(f"classes never predicted: {shown}; p(n|k) is undefined for them, so they are excluded "
                        "from NAPVD and avg_bias (every pair with them is left out)")
    if len(kept_list) < 2:
        raise InspectionError(
            f"DeepInspect compares classes by the inputs predicted as each, and only {len(kept_list)} of {k} "
            f"classes ({', '.join(names[i] for i in kept_list) or 'none'}) were predicted on the {n_inputs} inputs. "
            "Fix: use evaluation data on which the model predicts at least two classes (check the model: a "
            "constant prediction is itself a defect).")
    a = counts[:, kept]
    ck = c[kept]
    p_kept = a.to(torch.float64) / ck.to(torch.float64)
    d = napvd_matrix(a, ck)
    kk = len(kept_list)
    iu = torch.triu_indices(kk, kk, 1, device=device)
    pair_local = iu.T
    pair_napvd = d[iu[0], iu[1]]
    confused, conf_cut = _flag(pair_napvd, rule, top_share, low=True)

    type1_k = type1 = pair_type1 = gt_confused = None
    if confusion is not None:
        conf = confusion.to(device, torch.float64)
        rows = conf.sum(1, keepdim=True)
        type1 = torch.where(rows > 0, conf / rows.clamp_min(1.0), torch.zeros_like(conf))
        type1_k = type1[kept][:, kept]
        pair_type1 = (type1_k[iu[0], iu[1]] + type1_k[iu[1], iu[0]]) / 2
        gt_confused, _ = _flag(pair_type1, "std", top_share, low=False)

    avg_bias_full = pair_bias = biased = pair_cd = gt_biased = None
    bias_cut = None
    problem = no_signal = None
    use_filter = bool(label_filter and type1_k is not None)
    if kk < 3:
        problem = (f"avg_bias needs at least three predicted classes (a pair and a third class to compare them "
                   f"against); the model predicted {kk} ({', '.join(names[i] for i in kept_list)}). Fix: gate bias "
                   "only on a model with three or more classes and data on which three or more are predicted; "
                   "max_class_confusion works with two.")
    elif bias:
        link = (type1_k > 0) | (type1_k.T > 0) if use_filter and type1_k is not None else None
        avg, cd = class_bias(d, link, type1_k, chunk_elements=chunk_elements)
        pair_bias = avg[iu[0], iu[1]]
        biased, bias_cut = _flag(pair_bias, rule, top_share, low=False)
        no_signal = _bias_no_signal(d, pair_bias, use_filter)
        avg_bias_full = torch.full((k, k), math.nan, dtype=torch.float64, device=device)
        avg_bias_full[kept[:, None], kept[None, :]] = avg
        if cd is not None:
            pair_cd = cd[iu[0], iu[1]]
            gt_biased, _ = _flag(pair_cd, "std", top_share, low=False)

    napvd_full = torch.full((k, k), math.nan, dtype=torch.float64, device=device)
    napvd_full[kept[:, None], kept[None, :]] = d
    probs = torch.full((n, k), math.nan, dtype=torch.float64, device=device)
    probs[:, kept] = p_kept

    def cpu(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().cpu()

    return InspectionResult(
        classes=names, n_inputs=int(n_inputs), n_neurons=int(n), threshold=threshold, rule=rule,
        top_share=float(top_share), predicted_counts=c.cpu(), probabilities=probs.cpu(), napvd=napvd_full.cpu(),
        unpredicted=unpredicted, pair_index=kept[pair_local].cpu(), pair_napvd=pair_napvd.cpu(),
        confused=confused.cpu(), confusion_cutoff=conf_cut, avg_bias=cpu(avg_bias_full), pair_bias=cpu(pair_bias),
        biased=cpu(biased), bias_cutoff=bias_cut, bias_problem=problem, bias_no_signal=no_signal, label_filter=use_filter,
        type1=cpu(type1), pair_type1=cpu(pair_type1), gt_confused=cpu(gt_confused), pair_cd=cpu(pair_cd),
        gt_biased=cpu(gt_biased), warnings=tuple(warnings))


# ----------------------------------------------------------------------------- the engine
def _int_vector(t: Any, name: str) -> Tensor:
    if not isinstance(t, Tensor) or t.ndim != 1 or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        raise DataError(f"{name} must be a 1-D integer tensor of class indices, got "
                        f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}. Fix: pass "
                        "logits.argmax(1) (and the integer labels).")
    return t


def layer_counts(engine: Engine, n_neurons: int, num_classes: int, threshold: float | None) -> None:
    """The states every DeepInspect engine keeps for one layer: ``active_counts`` ``(units, K)`` and
    ``predicted_counts`` ``(K,)`` (sum-reduced), after checking the sizes and the activation threshold."""
    for name, value, low in (("n_neurons", n_neurons, 1), ("num_classes", num_classes, 2)):
        check_count(value, name, low, "give the layer's number of units and the model's number of classes.")
    engine.n_neurons, engine.num_classes = n_neurons, num_classes  # type: ignore[attr-defined]
    engine.threshold = None if threshold is None else check_threshold(threshold)  # type: ignore[attr-defined]
    engine.add_state("active_counts", torch.zeros((n_neurons, num_classes), dtype=torch.int64), "sum")
    engine.add_state("predicted_counts", torch.zeros(num_classes, dtype=torch.int64), "sum")


class InspectionEngine(Engine):
    """Streaming DeepInspect counts of one layer (see the module doc); ``compute`` gives an :class:`InspectionResult`.

    ``n_neurons`` units, ``num_classes`` K model outputs, ``threshold`` the activation threshold the
    activities were computed with (recorded, and checked on merge; None for activities from elsewhere).
    """

    def __init__(self, n_neurons: int, num_classes: int, *, threshold: float | None = DEFAULT_THRESHOLD,
                 device: torch.device | str | None = None) -> None:
        super().__init__(device)
        layer_counts(self, n_neurons, num_classes, threshold)
        self.add_state("confusion", torch.zeros((num_classes, num_classes), dtype=torch.int64), "sum")
        self.add_state("labelled", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("seen", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("out_of_range", torch.zeros((), dtype=torch.int64), "sum")

    def config(self) -> dict[str, Any]:
        return {"n_neurons": self.n_neurons, "num_classes": self.num_classes, "threshold": self.threshold}

    def update(self, active: Tensor, predictions: Tensor, labels: Tensor | None = None) -> None:
        """Fold a batch: ``active`` bool ``(B, n)`` or bit-packed uint8 ``(B, ⌈n/8⌉)`` (:func:`pack_active`),
        ``predictions`` ``(B,)`` class indices, ``labels`` ``(B,)`` or None. No host sync."""
        if not isinstance(active, Tensor) or active.ndim != 2:
            raise DataError(f"active must be a 2-D tensor (inputs, units), got {getattr(active, 'shape', type(active))}. "
                            "Fix: pass layer_activity(...) or a bool matrix.")
        n = self.n_neurons
        if active.dtype == torch.uint8:
            if active.shape[1] != -(-n // 8):
                raise DataError(f"bit-packed active has {active.shape[1]} bytes per input but {n} units need "
                                f"{-(-n // 8)}. Fix: pack with pack_active or np.packbits(active, axis=1).")
            active = unpack_active(active.to(self.device), n)
        elif active.dtype != torch.bool:
            raise DataError(f"active has dtype {active.dtype}; it must be bool (inputs × units) or bit-packed uint8. "
                            "Fix: pass (scores > threshold) or pack_active(...).")
        elif active.shape[1] != n:
            raise DataError(f"active has {active.shape[1]} units but the engine was built for {n}. Fix: build the "
                            "engine with the layer's number of units.")
        predictions = _int_vector(predictions, "predictions")
        if predictions.shape[0] != active.shape[0]:
            raise DataError(f"{predictions.shape[0]} predictions for {active.shape[0]} rows of activity. Fix: one "
                            "prediction per input.")
        k = self.num_classes
        pred = predictions.to(self.device, torch.int64)
        valid = (pred >= 0) & (pred < k)
        if labels is not None:
            labels = _int_vector(labels, "labels")
            if labels.shape != predictions.shape:
                raise DataError(f"{labels.shape[0]} labels for {predictions.shape[0]} predictions. Fix: one label "
                                "per input.")
            true = labels.to(self.device, torch.int64)
            valid &= (true >= 0) & (true < k)
        slot = torch.where(valid, pred, torch.full_like(pred, k))
        by_class = torch.zeros((k + 1, n), dtype=torch.int64, device=self.device)
        by_class.scatter_add_(0, slot[:, None].expand(-1, n), active.to(self.device, torch.int64))
        self.active_counts = self.active_counts + by_class[:k].T
        ones = torch.ones_like(slot)
        tally = torch.zeros(k + 1, dtype=torch.int64, device=self.device)
        tally.index_add_(0, slot, ones)
        self.predicted_counts = self.predicted_counts + tally[:k]
        self.out_of_range = self.out_of_range + tally[k]
        self.seen = self.seen + pred.shape[0]
        if labels is not None:
            cell = torch.where(valid, true * k + pred, torch.full_like(pred, k * k))
            flat = torch.zeros(k * k + 1, dtype=torch.int64, device=self.device)
            flat.index_add_(0, cell, ones)
            self.confusion = self.confusion + flat[:-1].view(k, k)
            self.labelled = self.labelled + pred.shape[0]

    def compute(self, *, rule: str = "std", top_share: float = 0.01, bias: bool = True, label_filter: bool = True,
                classes: Sequence[Any] | None = None, chunk_elements: int = _TRIPLET_CHUNK) -> InspectionResult:
        """The analysis (host syncs): see :func:`analyse`. ``bias=False`` skips the O(K³) triplets."""
        seen, labelled, bad = int(self.seen), int(self.labelled), int(self.out_of_range)
        if seen == 0:
            raise DataError("no inputs were seen; DeepInspect needs predictions on evaluation data. Fix: pass data.")
        if bad:
            raise DataError(f"{bad} of {seen} inputs have a prediction or label outside 0..{self.num_classes - 1}. "
                            f"Fix: build the engine with num_classes = the model's number of outputs.")
        if 0 < labelled < seen:
            raise DataError(f"labels came with {labelled} of {seen} inputs; the ground truth needs all or none. "
                            "Fix: pass labels with every batch, or with none.")
        return analyse(self.active_counts, self.predicted_counts, self.confusion if labelled else None,
                       n_inputs=seen, threshold=self.threshold, rule=rule, top_share=top_share, bias=bias,
                       label_filter=label_filter, classes=classes, chunk_elements=chunk_elements)


def _as_tensor(x: Any, name: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    try:
        return torch.as_tensor(np.asarray(x))
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} cannot be read as an array ({exc}). Fix: pass a tensor or numpy array.") from None


def inspect_classes(active: Any, predictions: Any, labels: Any = None, *, num_classes: int | None = None,
                    n_neurons: int | None = None, classes: Sequence[Any] | None = None, rule: str = "std",
                    top_share: float = 0.01, bias: bool = True, label_filter: bool = True,
                    threshold: float | None = None, batch_size: int = 65536) -> InspectionResult:
    """DeepInspect on precomputed binary activations (e.g. another tool's dump) and predictions.

    ``active``: bool/0-1 ``(N, n)`` (tensor or array), or bit-packed uint8 ``(N, ⌈n/8⌉)`` with
    ``n_neurons``; ``predictions``/``labels``: ``(N,)`` class indices. ``num_classes`` defaults to
    ``len(classes)``, else the largest index + 1. ``threshold`` is only recorded.
    """
    act, pred = _as_tensor(active, "active"), _as_tensor(predictions, "predictions")
    lab = None if labels is None else _as_tensor(labels, "labels")
    if act.dtype != torch.uint8 and act.dtype != torch.bool:
        if act.is_floating_point() and not bool(((act == 0) | (act == 1)).all()):
            raise DataError("active holds values other than 0 and 1. Fix: pass binary activity (e.g. scores > t), "
                            "or use layer_activity on raw layer outputs.")
        act = act != 0
    if act.ndim != 2:
        raise DataError(f"active must be 2-D (inputs, units), got shape {tuple(act.shape)}.")
    if act.dtype == torch.uint8 and n_neurons is None:
        raise ConfigError("bit-packed active (uint8) needs n_neurons: the padding bits of the last byte are "
                          "ambiguous. Fix: inspect_classes(packed, predictions, n_neurons=...).")
    n = int(n_neurons if act.dtype == torch.uint8 else act.shape[1])
    if num_classes is None:
        top = [int(pred.max()) if pred.numel() else 0]
        if lab is not None and lab.numel():
            top.append(int(lab.max()))
        num_classes = len(classes) if classes is not None else max(top) + 1
    engine = InspectionEngine(n, int(num_classes), threshold=threshold, device=act.device)
    for start in range(0, act.shape[0], batch_size):
        stop = start + batch_size
        engine.update(act[start:stop], pred[start:stop], None if lab is None else lab[start:stop])
    return engine.compute(rule=rule, top_share=top_share, bias=bias, label_filter=label_filter, classes=classes)
