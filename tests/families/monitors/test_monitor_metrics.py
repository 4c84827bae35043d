"""Detection metrics of runtime monitors (OOD positive), AUROC, FPR@95TPR, the system view, DetectionEngine.

References are independent: scikit-learn's metrics, numpy, exact rational arithmetic.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.monitors.metrics import (
    DetectionEngine,
    DetectionMetrics,
    SystemView,
    auroc,
    detection_metrics,
    fpr_at_tpr,
    mcc_from_counts,
    system_view,
)
from pytest_dnnsafety.errors import ConfigError, DataError


def _nan_equal(a: float, b: float, tol: float = 1e-12) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol


def _labels_from_counts(tp: int, fp: int, tn: int, fn: int) -> tuple[np.ndarray, np.ndarray]:
    """(is_ood, alarm) arrays holding exactly these counts."""
    y = np.array([1] * tp + [0] * fp + [0] * tn + [1] * fn)
    alarm = np.array([1] * tp + [1] * fp + [0] * tn + [0] * fn)
    return y, alarm


# ------------------------------------------------------------------------------- the acceptance case
def test_acceptance_case_ood_is_the_positive_class() -> None:
    m = DetectionMetrics.from_counts(tn=630, fp=70, fn=90, tp=210)
    assert m.fpr == pytest.approx(0.10)  # 70 / 700
    assert m.fnr == pytest.approx(0.30)  # 90 / 300
    assert m.precision == pytest.approx(0.75)  # 210 / 280
    assert m.recall == pytest.approx(0.70)  # 210 / 300
    assert m.specificity == pytest.approx(0.90)
    assert round(m.mcc, 4) == 0.6124  # (210·630 − 70·90) / √(280·300·700·720)
    assert round(m.f1, 4) == 0.7241  # 420 / 580
    assert (m.n_id, m.n_ood) == (700, 300)
    assert m.auroc is None and m.fpr_at_95tpr is None
    assert m.to_dict()["mcc"] == m.mcc and m.to_dict()["tp"] == 210


def test_the_reference_codes_swapped_reading_gives_other_numbers() -> None:
    """Reading the per-class report for the ID class (the published code) swaps FPR/FNR, gives NPV as precision."""
    tp, fp, tn, fn = 210, 70, 630, 90
    y, alarm = _labels_from_counts(tp, fp, tn, fn)
    ours = DetectionMetrics.from_counts(tp=tp, fp=fp, tn=tn, fn=fn)
    # the ID class as "positive": its recall is our specificity, its precision our NPV
    id_precision = skm.precision_score(y, alarm, pos_label=0)
    id_recall = skm.recall_score(y, alarm, pos_label=0)
    swapped_fpr = 1.0 - skm.recall_score(y, alarm, pos_label=1)  # "ID flagged" read off the OOD row: our FNR
    swapped_fnr = 1.0 - id_recall  # our FPR
    weighted_f1 = skm.f1_score(y, alarm, average="weighted")  # the reference's "micro-F1"
    assert (swapped_fpr, swapped_fnr) == pytest.approx((0.30, 0.10))
    assert id_precision == pytest.approx(0.875)  # 630 / 720, not 0.75
    assert (ours.fpr, ours.fnr, ours.precision) != pytest.approx((swapped_fpr, swapped_fnr, id_precision))
    assert ours.fpr == pytest.approx(swapped_fnr) and ours.fnr == pytest.approx(swapped_fpr)
    assert abs(weighted_f1 - ours.f1) > 0.05  # ≈ 0.838 against 0.724
    # MCC is symmetric in the classes: the one figure the swap cannot change
    assert ours.mcc == pytest.approx(skm.matthews_corrcoef(1 - y, 1 - alarm))


# ------------------------------------------------------------------------------- counts against sklearn
@pytest.mark.filterwarnings("ignore:A single label was found:UserWarning")  # sklearn, on one-class draws
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_detection_metrics_match_sklearn(pairs: list[tuple[bool, bool]]) -> None:
    y = np.array([int(o) for o, _ in pairs])
    alarm = np.array([int(a) for _, a in pairs])
    tn, fp, fn, tp = skm.confusion_matrix(y, alarm, labels=[0, 1]).ravel()
    m = DetectionMetrics.from_counts(tp=int(tp), fp=int(fp), tn=int(tn), fn=int(fn))
    assert _nan_equal(m.precision, skm.precision_score(y, alarm, zero_division=np.nan))
    assert _nan_equal(m.recall, skm.recall_score(y, alarm, zero_division=np.nan))
    assert _nan_equal(m.f1, skm.f1_score(y, alarm, zero_division=np.nan))
    assert _nan_equal(m.specificity, skm.recall_score(y, alarm, pos_label=0, zero_division=np.nan))
    assert m.mcc == pytest.approx(skm.matthews_corrcoef(y, alarm), abs=1e-12)
    assert _nan_equal(m.fpr, fp / (fp + tn) if fp + tn else math.nan)
    assert _nan_equal(m.fnr, fn / (fn + tp) if fn + tp else math.nan)
    # the engine counts the same, from tensors, in two batches
    engine = DetectionEngine()
    half = len(pairs) // 2
    for part in (slice(0, half), slice(half, None)):
        engine.update(torch.as_tensor(alarm[part], dtype=torch.bool), torch.as_tensor(y[part], dtype=torch.bool))
    assert engine.compute() == m


def test_undefined_ratios_are_nan_and_mcc_with_a_zero_margin_is_zero() -> None:
    silent = DetectionMetrics.from_counts(tp=0, fp=0, tn=50, fn=10)  # no alarm at all
    assert math.isnan(silent.precision) and silent.recall == 0.0 and silent.f1 == 0.0 and silent.mcc == 0.0
    only_id = DetectionMetrics.from_counts(tp=0, fp=3, tn=7, fn=0)
    assert math.isnan(only_id.fnr) and math.isnan(only_id.recall) and only_id.mcc == 0.0
    assert math.isnan(DetectionMetrics.from_counts(tp=0, fp=0, tn=5, fn=0).f1)
    perfect = DetectionMetrics.from_counts(tp=5, fp=0, tn=5, fn=0)
    assert perfect.mcc == 1.0 and perfect.fpr == 0.0 and perfect.f1 == 1.0
    assert DetectionMetrics.from_counts(tp=0, fp=5, tn=0, fn=5).mcc == -1.0


def test_mcc_is_exact_for_counts_beyond_a_billion() -> None:
    tp, fp, tn, fn = 3_000_000_007, 1_000_000_009, 2_999_999_999, 700_000_001
    num = Fraction(tp * tn - fp * fn)
    den_sq = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)  # ~1e38: far past int64, exact in Python
    expected = float(num) / math.sqrt(den_sq)
    got = DetectionMetrics.from_counts(tp=tp, fp=fp, tn=tn, fn=fn).mcc
    assert got == pytest.approx(expected, rel=1e-14)
    assert mcc_from_counts(10**9, 0, 10**9, 0) == 1.0
    # int64 states near the top of their range survive compute()
    engine = DetectionEngine()
    engine.tp, engine.fp = torch.tensor(tp), torch.tensor(fp)
    engine.tn, engine.fn = torch.tensor(tn), torch.tensor(fn)
    assert engine.compute().mcc == got


def test_counts_are_validated() -> None:
    with pytest.raises(DataError, match=r"fp must be a count ≥ 0.*Fix"):
        DetectionMetrics.from_counts(tp=1, fp=-1, tn=1, fn=1)
    with pytest.raises(DataError, match=r"tn must be an int count"):
        DetectionMetrics.from_counts(tp=1, fp=1, tn=1.5, fn=1)  # type: ignore[arg-type]
    assert DetectionMetrics.from_counts(tp=np.int64(2), fp=torch.tensor(1), tn=3, fn=0).tp == 2


# ------------------------------------------------------------------------------- AUROC and FPR@95TPR
def _sklearn_fpr_at_tpr(y: np.ndarray, s: np.ndarray, tpr: float, drop: bool = False) -> float:
    fpr, tpr_curve, _ = skm.roc_curve(y, s, drop_intermediate=drop)
    return float(fpr[np.argmax(tpr_curve >= tpr)])


score_lists = st.lists(st.integers(-6, 6), min_size=1, max_size=40)  # small range: many ties


@settings(max_examples=80, deadline=None)
@given(score_lists, score_lists, st.sampled_from([0.95, 0.9, 0.5, 1.0, 0.05, 0.8, 1 / 3]),
       st.floats(0.01, 3.0))
def test_auroc_and_fpr_at_tpr_match_sklearn_with_ties(ids: list[int], oods: list[int], tpr: float,
                                                      scale: float) -> None:
    sid = torch.tensor(ids, dtype=torch.float32) * scale
    sood = torch.tensor(oods, dtype=torch.float32) * scale
    y = np.r_[np.zeros(len(ids)), np.ones(len(oods))]
    s = np.r_[sid.numpy(), sood.numpy()].astype(np.float64)
    if len(set(y)) == 2:
        assert auroc(sid, sood) == pytest.approx(skm.roc_auc_score(y, s), abs=1e-12)
    ours = fpr_at_tpr(sid, sood, tpr)
    assert ours == _sklearn_fpr_at_tpr(y, s, tpr)
    # sklearn's default curve drops collinear points: its reading can only be larger, never smaller
    assert ours <= _sklearn_fpr_at_tpr(y, s, tpr, drop=True)
    # symmetry of the Mann–Whitney statistic
    assert auroc(sid, sood) + auroc(sood, sid) == pytest.approx(1.0, abs=1e-12)


def test_auroc_and_fpr_at_tpr_on_continuous_scores_and_known_values() -> None:
    g = torch.Generator().manual_seed(3)
    sid = torch.randn(2000, generator=g)
    sood = torch.randn(1500, generator=g) + 1.0
    y = np.r_[np.zeros(2000), np.ones(1500)]
    s = np.r_[sid.numpy(), sood.numpy()].astype(np.float64)
    assert auroc(sid, sood) == pytest.approx(skm.roc_auc_score(y, s), abs=1e-12)
    assert fpr_at_tpr(sid, sood) == _sklearn_fpr_at_tpr(y, s, 0.95)
    # hand cases: separable, reversed, all tied
    assert auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 1.0
    assert fpr_at_tpr(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 0.0
    assert auroc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 0.0
    assert fpr_at_tpr(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auroc(torch.ones(4), torch.ones(3)) == 0.5
    # 20 OOD scores 1..20, ID scores 0.5..19.5: TPR 19/20 = 0.95 is reached at c = 2 → ID ≥ 2: 18 of 20
    sood = torch.arange(1, 21, dtype=torch.float64)
    sid = sood - 0.5
    assert fpr_at_tpr(sid, sood, 0.95) == 18 / 20


def test_detection_metrics_from_scores_and_threshold() -> None:
    g = torch.Generator().manual_seed(0)
    sid, sood = torch.randn(300, generator=g), torch.randn(200, generator=g) + 1.5
    threshold = float(torch.quantile(sid, 0.95))
    m = detection_metrics(sid, sood, threshold)
    y = np.r_[np.zeros(300), np.ones(200)]
    alarm = np.r_[(sid > threshold).numpy(), (sood > threshold).numpy()].astype(int)
    tn, fp, fn, tp = skm.confusion_matrix(y, alarm, labels=[0, 1]).ravel()
    assert (m.tp, m.fp, m.tn, m.fn) == (tp, fp, tn, fn)
    assert m.mcc == pytest.approx(skm.matthews_corrcoef(y, alarm))
    assert m.auroc == auroc(sid, sood) and m.fpr_at_95tpr == fpr_at_tpr(sid, sood, 0.95)
    assert detection_metrics(sid, sood, torch.tensor(threshold)).to_dict() == m.to_dict()
    # alarm is strictly above the threshold: a score equal to it is accepted
    tied = detection_metrics(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.0]), 2.0)
    assert (tied.fp, tied.tp) == (0, 1)


def test_score_and_threshold_errors_name_the_argument() -> None:
    ok = torch.tensor([0.0, 1.0])
    with pytest.raises(DataError, match=r"scores_ood is empty.*Fix"):
        auroc(ok, torch.tensor([]))
    with pytest.raises(DataError, match=r"scores_id holds NaN"):
        fpr_at_tpr(torch.tensor([0.0, float("nan")]), ok)
    with pytest.raises(DataError, match=r"scores_id must be 1-D"):
        auroc(torch.zeros(2, 3), ok)
    with pytest.raises(DataError, match=r"scores_ood must hold real scores"):
        auroc(ok, torch.tensor([True, False]))
    for bad in (0.0, 1.5, -0.1, True, "0.95"):
        with pytest.raises(ConfigError, match=r"tpr must be a number in \(0, 1\].*Fix"):
            fpr_at_tpr(ok, ok, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"threshold is None.*Fix"):
        detection_metrics(ok, ok, None)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"threshold is NaN"):
        detection_metrics(ok, ok, float("nan"))
    assert auroc([0.0, 1.0], [0.5, 2.0]) == 0.75  # sequences are accepted too


# ------------------------------------------------------------------------------- system view
@pytest.mark.filterwarnings("ignore:A single label was found:UserWarning")  # sklearn, on one-class draws
@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=50))
def test_system_view_matches_a_direct_numpy_computation(pairs: list[tuple[bool, bool]]) -> None:
    alarm = np.array([a for a, _ in pairs])
    error = np.array([e for _, e in pairs])
    view = system_view(torch.as_tensor(alarm), torch.as_tensor(error))
    accepted = ~alarm
    assert view.n == len(pairs) and view.accepted == accepted.sum() and view.errors == error.sum()
    assert view.accepted_errors == (accepted & error).sum()
    assert view.coverage == pytest.approx(accepted.mean())
    assert view.model_risk == pytest.approx(error.mean())
    expected_risk = error[accepted].mean() if accepted.any() else math.nan
    assert _nan_equal(view.selective_risk, float(expected_risk))
    assert view.mcc == pytest.approx(skm.matthews_corrcoef(error.astype(int), alarm.astype(int)), abs=1e-12)
    assert view.rejected_errors == (alarm & error).sum() and view.rejected == alarm.sum()
    assert view.to_dict()["coverage"] == view.coverage


def test_system_view_of_a_perfect_monitor_and_of_novel_classes() -> None:
    error = torch.tensor([True, False, False, True, False])
    perfect = system_view(error.clone(), error)
    assert perfect.selective_risk == 0.0 and perfect.mcc == 1.0 and perfect.model_risk == 0.4
    assert perfect.coverage == pytest.approx(0.6)
    novel = system_view(torch.tensor([True, True, False]), torch.ones(3, dtype=torch.bool))
    assert novel.selective_risk == 1.0 and novel.model_risk == 1.0 and novel.mcc == 0.0
    everything_rejected = system_view(torch.ones(3, dtype=torch.bool), torch.tensor([True, False, False]))
    assert everything_rejected.coverage == 0.0 and math.isnan(everything_rejected.selective_risk)
    assert isinstance(perfect, SystemView)


def test_system_view_errors_name_the_argument() -> None:
    with pytest.raises(DataError, match=r"alarm has shape \(3,\) but error has \(2,\).*Fix"):
        system_view(torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(DataError, match=r"alarm is empty.*Fix"):
        system_view(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool))
    with pytest.raises(DataError, match=r"error must have dtype torch.bool.*Fix"):
        system_view(torch.zeros(2, dtype=torch.bool), torch.zeros(2))
    with pytest.raises(DataError, match=r"alarm must be a bool tensor"):
        system_view([True], torch.zeros(1, dtype=torch.bool))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- the engine
def test_engine_merge_of_two_halves_equals_the_whole_and_payload_round_trips() -> None:
    g = torch.Generator().manual_seed(1)
    alarm = torch.rand(1000, generator=g) < 0.3
    is_ood = torch.rand(1000, generator=g) < 0.4
    whole = DetectionEngine()
    for start in range(0, 1000, 128):
        whole.update(alarm[start : start + 128], is_ood[start : start + 128])
    first, second = DetectionEngine(), DetectionEngine()
    first.update(alarm[:437], is_ood[:437])
    second.update(alarm[437:], is_ood[437:])
    merged = first.merge(second).compute()
    assert merged == whole.compute()
    rebuilt = Engine.from_payload(whole.state_payload())
    assert isinstance(rebuilt, DetectionEngine) and rebuilt.compute() == merged
    assert (merged.tp, merged.fp) == (int((alarm & is_ood).sum()), int((alarm & ~is_ood).sum()))
    whole.reset()
    assert whole.compute().tp == 0 and math.isnan(whole.compute().fpr)


def test_engine_update_with_a_whole_batch_flag_and_without_host_sync() -> None:
    engine = DetectionEngine()
    engine.update(torch.tensor([True, False, False]), False)  # clean data: all ID
    engine.update(torch.tensor([True, True, False, True]), True)  # a fault data set: all OOD
    assert engine.compute() == DetectionMetrics.from_counts(tp=3, fp=1, tn=2, fn=1)
    # on the meta device any host sync (.item(), bool(), .tolist()) would raise: update has none
    meta = DetectionEngine(device="meta")
    meta.update(torch.zeros(5, dtype=torch.bool, device="meta"), torch.zeros(5, dtype=torch.bool, device="meta"))
    meta.update(torch.zeros(5, dtype=torch.bool, device="meta"), True)
    assert meta.tp.device.type == "meta"


def test_engine_errors() -> None:
    engine = DetectionEngine()
    with pytest.raises(DataError, match=r"alarm has shape \(2,\) but is_ood has \(3,\).*Fix"):
        engine.update(torch.zeros(2, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(DataError, match=r"alarm must have dtype torch.bool"):
        engine.update(torch.zeros(2), True)
    with pytest.raises(DataError, match=r"is_ood must have dtype torch.bool"):
        engine.update(torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ConfigError, match=r"takes no configuration"):
        DetectionEngine.from_config({"bins": 3})
    assert DetectionEngine.from_config({}).config() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode:UserWarning")
def test_engine_and_metrics_on_cuda_without_sync_in_update() -> None:
    engine = DetectionEngine(device="cuda")
    alarm = torch.rand(10_000, device="cuda") < 0.3
    is_ood = torch.rand(10_000, device="cuda") < 0.5
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.update(alarm, is_ood)
        engine.update(alarm, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    m = engine.compute()
    assert m.tp == int((alarm & is_ood).sum()) + int(alarm.sum())
    sid, sood = torch.randn(500, device="cuda"), torch.randn(400, device="cuda") + 1
    assert auroc(sid, sood) == auroc(sid.cpu(), sood.cpu())
    assert fpr_at_tpr(sid, sood) == fpr_at_tpr(sid.cpu(), sood.cpu())
