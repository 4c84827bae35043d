"""Detection metrics of a runtime safety monitor, and the monitor + model seen as one system.

OOD is the positive class throughout (Ferreira et al.). The monitor's alarm is its prediction of
"this input is out of distribution"; with the truth ``is_ood`` of each input::

    TP = OOD ∧ alarm      FP = ID ∧ alarm      FN = OOD ∧ ¬alarm      TN = ID ∧ ¬alarm

    FPR = FP/(FP+TN)   FNR = FN/(FN+TP)   precision = TP/(TP+FP)   recall = TP/(TP+FN)
    specificity = TN/(TN+FP)   F1 = 2TP/(2TP+FP+FN)
    MCC = (TP·TN − FP·FN) / √((TP+FP)(TP+FN)(TN+FP)(TN+FN))          (Matthews 1975)

Where we differ from the published reference code of the monitor benchmark (Ferreira et al.):
that code read the per-class figures of a classification report for the *ID* class, which swaps
FPR and FNR and reports the negative predictive value as "precision" (and its "micro-F1" is a
weighted F1). Here every figure is the OOD class's, as defined above; ``tests/families/monitors/test_monitor_metrics.py``
pins the difference on the acceptance case (tn=630, fp=70, fn=90, tp=210: FPR 0.10, FNR 0.30,
precision 0.75 — the swapped reading would say FPR 0.30, FNR 0.10, precision 0.875).

Conventions:

* A ratio whose denominator is zero is undefined and reported as ``nan`` (no alarm at all →
  precision ``nan``; no OOD input → FNR/recall ``nan``), never silently as 0 or 1. F1 uses the
  count form ``2TP/(2TP+FP+FN)``, ``nan`` only when there is neither an alarm nor an OOD input.
* MCC with a zero margin (no alarm, all alarms, no ID or no OOD input) is ``0.0`` — the limit
  scikit-learn's ``matthews_corrcoef`` also returns: the alarm carries no information about the
  truth then. It is computed from exact Python integers (no overflow for any count) and float64.

Threshold-free metrics (both on the monitor's scores, higher = more likely OOD):

* :func:`auroc` — the Mann–Whitney statistic ``P(s_ood > s_id) + ½ P(s_ood = s_id)`` (Hanley &
  McNeil 1982), exact, ties counted ½, in O(n log n) by one sort and two ``searchsorted``; equal
  to ``sklearn.metrics.roc_auc_score`` with OOD = 1.
* :func:`fpr_at_tpr` — "FPR at 95 % TPR" with OOD as the positive class: the smallest FPR over
  all thresholds whose TPR (share of OOD inputs alarmed) is at least ``tpr``, read off the exact
  empirical ROC curve without interpolation. This is the convention of pytorch-ood
  (``pytorch_ood.utils.fpr_at_tpr``: the first point of torchmetrics' ``binary_roc`` with
  ``tpr ≥ k``) and OpenOOD v1.5 (``fpr_list[argmax(tpr_list >= 0.95)]`` with OOD positive); it
  equals ``fpr[np.argmax(tpr >= 0.95)]`` on ``sklearn.metrics.roc_curve(..., drop_intermediate=False)``
  (with the default ``drop_intermediate=True`` sklearn may drop a collinear point of a tied run
  and report a slightly larger FPR). Not interpolated (some papers interpolate linearly between
  ROC points: that FPR is achieved by no threshold) and not "the point whose TPR is closest to
  0.95" (which may have TPR < 0.95). Note: ODIN (Liang et al. 2018) and Hendrycks & Gimpel's code
  take *ID* as the positive class — their "FPR at 95 % TPR" is the share of OOD inputs accepted
  when 95 % of ID inputs are accepted, i.e. the FNR of a monitor calibrated with ``accept=0.95``
  in our terms (a different number; compare with :attr:`DetectionMetrics.fnr`).

System view (Ferreira et al.): the monitor's reaction is right when it rejects a wrong decision of the model
or accepts a right one. :func:`system_view` treats the alarm as a prediction of the model's error
and reports coverage (share accepted), selective risk (error rate among accepted inputs, Geifman &
El-Yaniv 2017) against the model alone (its error rate on all inputs), and the MCC of alarm vs
error. For novel classes every model decision counts as wrong (the caller passes ``error`` all
true there).

:class:`DetectionEngine` streams the four counts as int64 ``sum`` states (merge/sync/payload via
:class:`~pytest_dnnsafety.engines.core.base.Engine`); ``update`` never synchronises with the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = [
    "DetectionEngine",
    "DetectionMetrics",
    "SystemView",
    "auroc",
    "detection_metrics",
    "fpr_at_tpr",
    "mcc_from_counts",
    "system_view",
]


# ---------------------------------------------------------------------------------- helpers
def _ratio(num: int, den: int) -> float:
    return num / den if den else math.nan


def mcc_from_counts(tp: int, fp: int, tn: int, fn: int) -> float:
    """Matthews correlation from the four counts; 0.0 when a margin is zero (sklearn's convention).

    The numerator is an exact Python integer and the denominator's factors are multiplied as
    Python integers before one float64 square root, so counts of any size (1e9 and beyond) give
    no overflow and a correctly rounded result up to a few ulps.
    """
    a, b, c, d = tp + fp, tp + fn, tn + fp, tn + fn
    if a == 0 or b == 0 or c == 0 or d == 0:
        return 0.0
    num = tp * tn - fp * fn
    value = num / (math.sqrt(a * b) * math.sqrt(c * d))
    return max(-1.0, min(1.0, value))


def _check_count(name: str, value: Any) -> int:
    integral_tensor = (isinstance(value, Tensor) and value.numel() == 1 and value.dtype != torch.bool
                       and not value.dtype.is_floating_point and not value.dtype.is_complex)
    if isinstance(value, np.integer) or integral_tensor:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataError(f"{name} must be an int count, got {value!r} ({type(value).__name__}). "
                        f"Fix: pass the number of inputs as an int, e.g. int(tensor.sum())")
    if value < 0:
        raise DataError(f"{name} must be a count ≥ 0, got {value}. Fix: pass the number of inputs in that cell")
    return value


def _scores(value: Any, name: str) -> Tensor:
    """A 1-D floating tensor of scores (float64 for exact comparisons), not empty, without NaN."""
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataError(f"{name} must be a 1-D tensor of scores, got {type(value).__name__} ({exc}). "
                            f"Fix: pass the monitor's scores, e.g. monitor.score(view)") from None
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise DataError(f"{name} must hold real scores, got dtype {value.dtype}. "
                        f"Fix: pass the monitor's scores (higher = more likely OOD), not its alarms")
    flat = value.detach().reshape(-1)
    if value.ndim > 1 and flat.numel() != max(value.shape, default=0):  # (N,), (N, 1), (1, N) are fine
        raise DataError(f"{name} must be 1-D (one score per input), got shape {tuple(value.shape)}. "
                        f"Fix: pass a (N,) tensor")
    if flat.numel() == 0:
        raise DataError(f"{name} is empty: the metric needs at least one score. "
                        f"Fix: evaluate the monitor on a non-empty data set")
    flat = flat.to(torch.float64)
    if bool(torch.isnan(flat).any()):
        raise DataError(f"{name} holds NaN scores ({int(torch.isnan(flat).sum())} of {flat.numel()}). "
                        f"Fix: make the monitor's score finite (check its inputs and normalisation)")
    return flat


def _check_tpr(tpr: Any) -> float:
    if isinstance(tpr, bool) or not isinstance(tpr, (int, float)) or not (0.0 < float(tpr) <= 1.0):
        raise ConfigError(f"tpr must be a number in (0, 1], got {tpr!r}. Fix: give the target true positive "
                          f"rate as a fraction, e.g. tpr=0.95")
    return float(tpr)


# ---------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class DetectionMetrics:
    """Confusion counts of alarm vs OOD truth (OOD positive) and the figures derived from them.

    Undefined ratios are ``nan``; ``mcc`` is ``0.0`` when a margin is zero (module docstring).
    ``auroc`` and ``fpr_at_95tpr`` are set by :func:`detection_metrics` (None from counts alone).
    """

    tp: int
    fp: int
    tn: int
    fn: int
    fpr: float
    fnr: float
    precision: float
    recall: float
    f1: float
    mcc: float
    specificity: float
    auroc: float | None = None
    fpr_at_95tpr: float | None = None

    @classmethod
    def from_counts(cls, *, tp: int, fp: int, tn: int, fn: int, auroc: float | None = None,
                    fpr_at_95tpr: float | None = None) -> DetectionMetrics:
        """The figures of the four counts (each an int ≥ 0; DataError naming the bad one otherwise)."""
        tp, fp = _check_count("tp", tp), _check_count("fp", fp)
        tn, fn = _check_count("tn", tn), _check_count("fn", fn)
        return cls(
            tp=tp, fp=fp, tn=tn, fn=fn,
            fpr=_ratio(fp, fp + tn),
            fnr=_ratio(fn, fn + tp),
            precision=_ratio(tp, tp + fp),
            recall=_ratio(tp, tp + fn),
            f1=_ratio(2 * tp, 2 * tp + fp + fn),
            mcc=mcc_from_counts(tp, fp, tn, fn),
            specificity=_ratio(tn, tn + fp),
            auroc=auroc,
            fpr_at_95tpr=fpr_at_95tpr,
        )

    @property
    def n_id(self) -> int:
        return self.fp + self.tn

    @property
    def n_ood(self) -> int:
        return self.tp + self.fn

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (floats may be nan; the evidence writer encodes non-finite floats)."""
        return asdict(self)


def auroc(scores_id: Tensor, scores_ood: Tensor) -> float:
    """Area under the ROC curve of the scores with OOD positive: ``P(s_ood > s_id) + ½ P(s_ood = s_id)``.

    The Mann–Whitney U statistic divided by ``n_id · n_ood`` (Hanley & McNeil 1982, eq. 1), exact:
    the ID scores are sorted once and each OOD score's count of smaller and equal ID scores comes
    from two ``searchsorted`` calls, ``U = Σ_ood (#id < s + #id ≤ s) / 2``, summed in int64
    (O(n log n), no n_id × n_ood matrix). Equal to ``sklearn.metrics.roc_auc_score`` with OOD = 1.
    Runs on the scores' device; both must be non-empty and NaN-free (DataError otherwise).
    """
    sid = _scores(scores_id, "scores_id")
    sood = _scores(scores_ood, "scores_ood").to(sid.device)
    ordered, _ = torch.sort(sid)
    less = torch.searchsorted(ordered, sood, right=False)
    less_equal = torch.searchsorted(ordered, sood, right=True)
    twice_u = int((less + less_equal).sum())  # exact integer: 2U
    return twice_u / (2.0 * sid.numel() * sood.numel())


def fpr_at_tpr(scores_id: Tensor, scores_ood: Tensor, tpr: float = 0.95) -> float:
    """The smallest FPR over thresholds whose TPR (OOD inputs alarmed) is at least ``tpr``.

    Alarms are ``score ≥ c`` for the candidate thresholds ``c`` (the distinct scores, and +∞), as
    ``sklearn.metrics.roc_curve``. TPR and FPR both fall as ``c`` rises, so the answer is at the
    largest ``c`` reaching the target: with ``m`` the fewest OOD inputs giving ``m / n_ood ≥ tpr``
    (compared in float64 like sklearn), ``c`` is the ``m``-th largest OOD score and the result is
    ``#(id ≥ c) / n_id``. Equal to ``fpr[argmax(tpr_curve >= tpr)]`` of
    ``roc_curve(y, s, drop_intermediate=False)`` with OOD = 1 (see the module docstring for the
    convention and the other ones in use).
    """
    tpr = _check_tpr(tpr)
    sid = _scores(scores_id, "scores_id")
    sood = _scores(scores_ood, "scores_ood").to(sid.device)
    n_ood = sood.numel()
    m = min(n_ood, max(0, math.ceil(tpr * n_ood)))
    while m > 0 and (m - 1) / n_ood >= tpr:  # float64 comparison, exactly as roc_curve's tps / tps[-1]
        m -= 1
    while m < n_ood and m / n_ood < tpr:
        m += 1
    if m == 0:
        return 0.0
    c = torch.kthvalue(sood, n_ood - m + 1).values  # the m-th largest OOD score
    return int((sid >= c).sum()) / sid.numel()


def detection_metrics(scores_id: Tensor, scores_ood: Tensor, threshold: float) -> DetectionMetrics:
    """Counts at ``alarm = score > threshold`` on ID and OOD scores, with :func:`auroc` and FPR@95TPR.

    ``threshold`` is the monitor's calibrated threshold (a finite float; ConfigError if None,
    DataError if NaN). Both score sets must be non-empty (DataError naming the empty one).
    """
    if threshold is None:
        raise ConfigError("threshold is None: the monitor has not been calibrated. "
                          "Fix: fit it with fit_monitor(...) (or call monitor.calibrate(id_scores)) first")
    if isinstance(threshold, Tensor):
        if threshold.numel() != 1:
            raise ConfigError(f"threshold must be one number, got a tensor of shape {tuple(threshold.shape)}. "
                              f"Fix: pass monitor.threshold")
        threshold = float(threshold)
    if isinstance(threshold, (np.floating, np.integer)):
        threshold = float(threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ConfigError(f"threshold must be a number, got {threshold!r}. Fix: pass monitor.threshold")
    if math.isnan(float(threshold)):
        raise DataError("threshold is NaN. Fix: calibrate the monitor on finite in-distribution scores")
    sid = _scores(scores_id, "scores_id")
    sood = _scores(scores_ood, "scores_ood").to(sid.device)
    t = float(threshold)
    fp = int((sid > t).sum())
    tp = int((sood > t).sum())
    return DetectionMetrics.from_counts(tp=tp, fp=fp, tn=sid.numel() - fp, fn=sood.numel() - tp,
                                        auroc=auroc(sid, sood), fpr_at_95tpr=fpr_at_tpr(sid, sood, 0.95))


# ---------------------------------------------------------------------------------- system view
@dataclass(frozen=True)
class SystemView:
    """The monitor + model as one system (alarm = reject the model's decision).

    ``coverage`` = accepted / n; ``selective_risk`` = accepted errors / accepted (nan when nothing
    is accepted); ``model_risk`` = errors / n (the model alone, every decision accepted);
    ``mcc``: Matthews correlation of alarm vs model error (0.0 when a margin is zero).
    """

    n: int
    accepted: int
    errors: int
    accepted_errors: int
    coverage: float
    selective_risk: float
    model_risk: float
    mcc: float

    @property
    def rejected(self) -> int:
        return self.n - self.accepted

    @property
    def rejected_errors(self) -> int:
        """Wrong decisions the monitor caught."""
        return self.errors - self.accepted_errors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bool_tensor(value: Any, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise DataError(f"{name} must be a bool tensor, got {type(value).__name__}. "
                        f"Fix: pass a torch.Tensor of dtype torch.bool, e.g. torch.as_tensor(x, dtype=torch.bool)")
    if value.dtype != torch.bool:
        raise DataError(f"{name} must have dtype torch.bool, got {value.dtype}. "
                        f"Fix: pass {name}.bool() (or a comparison such as scores > threshold)")
    return value.detach()


def system_view(alarm: Tensor, error: Tensor) -> SystemView:
    """Coverage, selective risk, model risk and MCC of ``alarm`` (reject) vs ``error`` (model wrong).

    Both are bool tensors of the same shape with at least one element (DataError naming the
    argument otherwise); ``error`` is on any device, moved to ``alarm``'s.
    """
    alarm = _bool_tensor(alarm, "alarm")
    error = _bool_tensor(error, "error")
    if alarm.shape != error.shape:
        raise DataError(f"alarm has shape {tuple(alarm.shape)} but error has {tuple(error.shape)}. "
                        f"Fix: pass one alarm and one error flag per input, in the same order")
    if alarm.numel() == 0:
        raise DataError("alarm is empty: the system view needs at least one input. "
                        "Fix: evaluate the monitor on a non-empty data set")
    error = error.to(alarm.device)
    counts = torch.stack([(alarm & error).sum(), (alarm & ~error).sum(), (~alarm & ~error).sum(),
                          (~alarm & error).sum()]).tolist()  # one host sync
    tp, fp, tn, fn = (int(c) for c in counts)
    n = tp + fp + tn + fn
    accepted, errors = tn + fn, tp + fn
    return SystemView(n=n, accepted=accepted, errors=errors, accepted_errors=fn,
                      coverage=accepted / n, selective_risk=_ratio(fn, accepted), model_risk=errors / n,
                      mcc=mcc_from_counts(tp, fp, tn, fn))


# ---------------------------------------------------------------------------------- engine
class DetectionEngine(Engine):
    """Streaming confusion counts of alarm vs OOD truth (OOD positive), int64 ``sum`` states.

    ``update(alarm, is_ood)`` folds a batch: ``alarm`` a bool tensor, ``is_ood`` a bool tensor
    of the same shape, or a Python bool meaning every input of the batch (a fault data set is all
    OOD, the clean set all ID). No host sync in ``update``; ``compute()`` returns
    :class:`DetectionMetrics` (without the threshold-free figures, which need the scores).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        for name in ("tp", "fp", "tn", "fn"):
            self.add_state(name, torch.zeros((), dtype=torch.int64), "sum")

    def update(self, alarm: Tensor, is_ood: Tensor | bool) -> None:  # type: ignore[override]
        alarm = _bool_tensor(alarm, "alarm").to(self.device)
        n = alarm.numel()
        if isinstance(is_ood, bool):
            hits = alarm.sum()
            if is_ood:
                self.tp = self.tp + hits
                self.fn = self.fn + (n - hits)
            else:
                self.fp = self.fp + hits
                self.tn = self.tn + (n - hits)
            return
        truth = _bool_tensor(is_ood, "is_ood")
        if truth.shape != alarm.shape:
            raise DataError(f"alarm has shape {tuple(alarm.shape)} but is_ood has {tuple(truth.shape)}. "
                            f"Fix: pass one OOD flag per input (or is_ood=True/False for a whole batch)")
        truth = truth.to(self.device)
        tp = (alarm & truth).sum()
        fp = alarm.sum() - tp
        ood = truth.sum()
        self.tp = self.tp + tp
        self.fp = self.fp + fp
        self.fn = self.fn + (ood - tp)
        self.tn = self.tn + (n - ood - fp)

    def compute(self) -> DetectionMetrics:
        tp, fp, tn, fn = (int(v) for v in torch.stack([self.tp, self.fp, self.tn, self.fn]).tolist())
        return DetectionMetrics.from_counts(tp=tp, fp=fp, tn=tn, fn=fn)

    def config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], device: torch.device | str | None = None) -> DetectionEngine:
        if config:
            raise ConfigError(f"DetectionEngine takes no configuration, got {dict(config)!r}. "
                              f"Fix: build it with DetectionEngine(device=...)")
        return cls(device=device)
