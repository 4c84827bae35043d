"""DeepInspect engine (Tian et al., ICSE 2020) against a direct implementation with Python loops.

The reference below follows §10 (and the authors' ``reproduce/util.py``) literally: p(n|k) by counting,
NAPVD pair by pair over the units either class uses, bias triplet by triplet with the cutoff, the distance
floor and the label filter, type-1 confusion and avg_cd by counting. The engine's matrix and chunked
triplet computations must give the same values to 1e-12 in float64, and the same flagged pairs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.engines.core.guard import probing
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine, inspect_classes
from pytest_dnnsafety.engines.inspection.kernels import InspectionError, aucec, class_bias, layer_activity, napvd_matrix, pack_active, scaled_activity, unpack_active
from pytest_dnnsafety.errors import ConfigError, DataError, DnnSafetyError


# ----------------------------------------------------------------------------- the direct reference
def reference(active: np.ndarray, pred: np.ndarray, labels: np.ndarray | None, k: int, *,
              label_filter: bool = True, rule: str = "std", top_share: float = 0.01) -> dict:
    """§10 with Python loops over inputs, units, pairs and triplets (no matrix algebra)."""
    n_inputs, n = active.shape
    count = [sum(1 for i in range(n_inputs) if pred[i] == c) for c in range(k)]
    kept = [c for c in range(k) if count[c] > 0]
    p = {}
    for c in kept:
        for u in range(n):
            p[u, c] = sum(1 for i in range(n_inputs) if pred[i] == c and active[i, u]) / count[c]
    d = {}
    for a in kept:
        for b in kept:
            if a == b:
                d[a, b] = 0.0
                continue
            total, size = 0.0, 0
            for u in range(n):
                if p[u, a] > 0 or p[u, b] > 0:
                    total += (p[u, a] - p[u, b]) ** 2
                    size += 1
            d[a, b] = math.sqrt(total) / math.sqrt(size) if size else 0.0
    pairs = [(a, b) for ia, a in enumerate(kept) for b in kept[ia + 1:]]
    napvd = [d[pair] for pair in pairs]
    out: dict = {"kept": kept, "pairs": pairs, "d": d, "p": p, "napvd": napvd,
                 "confused": _flags(napvd, rule, top_share, low=True)}
    t1 = None
    if labels is not None:
        t1 = {}
        for a in kept:
            total = sum(1 for i in range(n_inputs) if labels[i] == a)
            for b in kept:
                hits = sum(1 for i in range(n_inputs) if labels[i] == a and pred[i] == b)
                t1[a, b] = hits / total if total else 0.0
        gt = [(t1[a, b] + t1[b, a]) / 2 for a, b in pairs]
        out.update(type1=t1, pair_type1=gt, gt_confused=_flags(gt, "std", top_share, low=False))
    kk = len(kept)
    if kk >= 3:
        entries = [d[a, b] for a in kept for b in kept]
        cutoff = np.mean(entries) - np.std(entries)
        bias, cd = [], []
        for a, b in pairs:
            total_b = total_cd = 0.0
            for c in kept:
                ok = d[a, c] > 1e-5 and d[b, c] > 1e-5
                if t1 is not None and label_filter:
                    ok = ok and (t1[a, c] > 0 or t1[b, c] > 0 or t1[c, a] > 0 or t1[c, b] > 0)
                if not ok:
                    continue
                if d[a, c] < cutoff or d[b, c] < cutoff:
                    total_b += abs(d[a, c] / (d[a, c] + d[b, c]) - 1 / 2)
                if t1 is not None:
                    total_cd += abs(t1[a, c] + t1[c, a] - t1[b, c] - t1[c, b])
            bias.append(total_b / (kk - 2))
            cd.append(total_cd / (kk - 2))
        out.update(bias=bias, biased=_flags(bias, rule, top_share, low=False))
        if t1 is not None:
            out.update(cd=cd, gt_biased=_flags(cd, "std", top_share, low=False))
    return out


def _flags(values: list[float], rule: str, top_share: float, *, low: bool) -> list[bool]:
    if rule == "std":
        cut = np.mean(values) - np.std(values) if low else np.mean(values) + np.std(values)
        return [v < cut for v in values] if low else [v > cut for v in values]
    m = max(1, math.ceil(top_share * len(values) - 1e-9))
    order = sorted(range(len(values)), key=lambda i: (values[i] if low else -values[i], i))
    chosen = set(order[:m])
    return [i in chosen for i in range(len(values))]


def _random_case(seed: int, *, k: int = 8, n: int = 12, n_inputs: int = 300, missing: int | None = None):
    """Classes with random unit profiles, some of them near-copies of others (so some pairs are confusable)."""
    rng = np.random.default_rng(seed)
    profiles = rng.random((k, n)) ** 2
    for c in range(1, k, 3):
        profiles[c] = np.clip(profiles[c - 1] + rng.normal(0, 0.08, n), 0, 1)
    pred = rng.integers(0, k, n_inputs)
    if missing is not None:
        pred[pred == missing] = (missing + 1) % k
    active = rng.random((n_inputs, n)) < profiles[pred]
    labels = np.where(rng.random(n_inputs) < 0.7, pred, rng.integers(0, k, n_inputs))
    return active, pred, labels


def _assert_matches(res, ref: dict, *, labels: bool) -> None:
    kept = ref["kept"]
    assert [tuple(x) for x in res.pair_index.tolist()] == ref["pairs"]
    for (a, b), value in zip(ref["pairs"], ref["napvd"]):
        assert abs(float(res.napvd[a, b]) - value) <= 1e-12 and abs(float(res.napvd[b, a]) - value) <= 1e-12
    assert torch.allclose(res.pair_napvd, torch.tensor(ref["napvd"], dtype=torch.float64), rtol=0, atol=1e-12)
    for (u, c), value in ref["p"].items():
        assert abs(float(res.probabilities[u, c]) - value) <= 1e-12
    assert res.confused.tolist() == ref["confused"]
    if len(kept) >= 3:
        assert torch.allclose(res.pair_bias, torch.tensor(ref["bias"], dtype=torch.float64), rtol=0, atol=1e-12)
        assert res.biased.tolist() == ref["biased"]
    if labels:
        assert torch.allclose(res.pair_type1, torch.tensor(ref["pair_type1"], dtype=torch.float64), rtol=0, atol=1e-12)
        assert res.gt_confused.tolist() == ref["gt_confused"]
        for (a, b), value in ref["type1"].items():
            assert abs(float(res.type1[a, b]) - value) <= 1e-12
        if len(kept) >= 3:
            assert torch.allclose(res.pair_cd, torch.tensor(ref["cd"], dtype=torch.float64), rtol=0, atol=1e-12)
            assert res.gt_biased.tolist() == ref["gt_biased"]


# ----------------------------------------------------------------------------- against the reference
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("with_labels", [True, False])
def test_engine_equals_the_direct_loops(seed: int, with_labels: bool) -> None:
    active, pred, labels = _random_case(seed)
    lab = labels if with_labels else None
    res = inspect_classes(active, pred, lab, num_classes=8)
    ref = reference(active, pred, lab, 8)
    _assert_matches(res, ref, labels=with_labels)
    assert res.pair_bias is not None and float(res.pair_bias.max()) > 0  # the case exercises the bias
    assert res.confused.any()


@pytest.mark.parametrize("rule", ["std", "top"])
def test_rules_and_label_filter_match_the_reference(rule: str) -> None:
    active, pred, labels = _random_case(7, k=9, n=10)
    for label_filter in (True, False):
        res = inspect_classes(active, pred, labels, num_classes=9, rule=rule, top_share=0.1, label_filter=label_filter)
        _assert_matches(res, reference(active, pred, labels, 9, label_filter=label_filter, rule=rule, top_share=0.1),
                        labels=True)
        assert res.label_filter is label_filter
    if rule == "top":
        assert int(res.confused.sum()) == math.ceil(0.1 * 36) and int(res.biased.sum()) == 4


def test_a_class_never_predicted_is_excluded_and_named() -> None:
    active, pred, labels = _random_case(4, missing=5)
    res = inspect_classes(active, pred, labels, num_classes=8, classes=[f"c{i}" for i in range(8)])
    ref = reference(active, pred, labels, 8)
    assert ref["kept"] == [0, 1, 2, 3, 4, 6, 7]
    _assert_matches(res, ref, labels=True)
    assert res.unpredicted == (5,)
    assert "classes never predicted: c5" in res.warnings[0]
    assert torch.isnan(res.napvd[5]).all() and torch.isnan(res.napvd[:, 5]).all()
    assert torch.isnan(res.probabilities[:, 5]).all() and torch.isnan(res.avg_bias[5]).all()
    assert res.n_pairs == 21 and 5 not in res.pair_index.reshape(-1).tolist()
    details = res.to_details()
    assert details["unpredicted"] == ["c5"] and details["napvd"][5][0] is None
    assert "never predicted (excluded): c5" in res.detail()


def test_chunked_triplets_equal_one_chunk() -> None:
    active, pred, labels = _random_case(5, k=11)
    res = inspect_classes(active, pred, labels, num_classes=11)
    d = res.napvd
    link = (res.type1 > 0) | (res.type1.T > 0)
    whole = class_bias(d, link, res.type1, chunk_elements=1 << 30)
    for chunk in (1, 121, 500):
        parts = class_bias(d, link, res.type1, chunk_elements=chunk)
        assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])


def test_large_counts_use_the_float_gram_and_agree() -> None:
    """Counts beyond the exact int64 range: the float64 Gram of p gives the same NAPVD to ~1e-8."""
    gen = torch.Generator().manual_seed(3)
    c = torch.tensor([3_000_000, 2_000_000, 1_000_000, 5], dtype=torch.int64)
    counts = (torch.rand(64, 4, generator=gen, dtype=torch.float64) * c).floor().to(torch.int64)
    counts[:, 1] = counts[:, 0] * 2 // 3  # nearly the same rates as class 0
    fast = napvd_matrix(counts, c)
    p = counts.double() / c.double()
    direct = torch.zeros(4, 4, dtype=torch.float64)
    for a in range(4):
        for b in range(4):
            m = (p[:, a] > 0) | (p[:, b] > 0)
            direct[a, b] = ((p[m, a] - p[m, b]) ** 2).sum().sqrt() / math.sqrt(int(m.sum())) if a != b else 0.0
    assert torch.allclose(fast, direct, rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------- properties
@st.composite
def _activity(draw):
    k = draw(st.integers(3, 6))
    n = draw(st.integers(1, 9))
    n_inputs = draw(st.integers(k, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    pred = np.concatenate([np.arange(k), rng.integers(0, k, n_inputs - k)])
    active = rng.random((n_inputs, n)) < rng.random((k, n))[pred]
    return active, pred, k


@settings(max_examples=60, deadline=None)
@given(_activity())
def test_napvd_and_bias_properties(case) -> None:
    active, pred, k = case
    res = inspect_classes(active, pred, num_classes=k)
    d = res.napvd
    assert torch.equal(d, d.T)
    assert torch.equal(d.diagonal(), torch.zeros(k, dtype=torch.float64))
    assert bool((d >= 0).all()) and bool((d <= 1 + 1e-12).all())
    assert bool((res.pair_bias >= 0).all()) and bool((res.pair_bias <= 0.5).all())
    assert torch.equal(res.avg_bias, res.avg_bias.T)
    assert 0 <= res.max_confusion() <= 1 and 0 <= res.confused_share() <= 1


@settings(max_examples=40, deadline=None)
@given(_activity())
def test_identical_class_profiles_have_napvd_zero(case) -> None:
    """Duplicating class 0's inputs as class k: the two columns of p are equal, NAPVD exactly 0."""
    active, pred, k = case
    rows = pred == 0
    active2 = np.concatenate([active, active[rows]])
    pred2 = np.concatenate([pred, np.full(int(rows.sum()), k)])
    res = inspect_classes(active2, pred2, num_classes=k + 1)
    assert float(res.napvd[0, k]) == 0.0 and float(res.napvd[k, 0]) == 0.0
    assert res.max_confusion() == 1.0


# ----------------------------------------------------------------------------- the engine protocol
def test_merge_of_two_halves_equals_the_whole_and_payload_round_trips() -> None:
    active, pred, labels = _random_case(9)
    a, p, y = torch.as_tensor(active), torch.as_tensor(pred), torch.as_tensor(labels)
    whole = InspectionEngine(12, 8)
    whole.update(a, p, y)
    first, second = InspectionEngine(12, 8), InspectionEngine(12, 8)
    first.update(a[:130], p[:130], y[:130])
    second.update(pack_active(a[130:]), p[130:], y[130:])  # bit-packed activity works the same
    merged = first.merge(second)
    for name in whole.state_names:
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name
    back = Engine.from_payload(merged.state_payload())
    r1, r2 = whole.compute(), back.compute()
    assert torch.equal(r1.napvd, r2.napvd) and torch.equal(r1.avg_bias, r2.avg_bias)
    with pytest.raises(ValueError, match="threshold"):
        InspectionEngine(12, 8, threshold=0.4).merge(InspectionEngine(12, 8))


def test_pack_and_unpack_follow_numpy_packbits() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 7, 8, 13, 64):
        bits = rng.random((5, n)) < 0.5
        packed = pack_active(torch.as_tensor(bits))
        assert np.array_equal(packed.numpy(), np.packbits(bits, axis=1))
        assert torch.equal(unpack_active(packed, n), torch.as_tensor(bits))
    res_packed = inspect_classes(np.packbits(bits, axis=1), np.arange(5) % 3, n_neurons=64)
    res_bool = inspect_classes(bits, np.arange(5) % 3)
    assert torch.equal(res_packed.napvd, res_bool.napvd)


def test_aucec_definition() -> None:
    truth = torch.tensor([True, True, False, False, False, False, False, False, False, False])
    perfect = torch.arange(10, dtype=torch.float64)  # ascending: the two true pairs first
    assert aucec(perfect, truth) == pytest.approx(1 - 2 / (2 * 10))
    assert aucec(-perfect, truth) == pytest.approx(2 / (2 * 10))  # the true pairs last
    assert aucec(torch.zeros(10), truth) == pytest.approx(0.5)  # all tied: the random ranking's expectation
    assert aucec(perfect, truth, descending=True) == aucec(-perfect, truth)
    assert aucec(perfect, torch.zeros(10, dtype=torch.bool)) is None
    # a direct step-by-step trapezoid over the ranked list
    rng = np.random.default_rng(0)
    scores = torch.as_tensor(rng.random(30))
    hits = torch.as_tensor(rng.random(30) < 0.3)
    order = np.argsort(scores.numpy(), kind="stable")
    found, area, prev = 0, 0.0, 0.0
    for i in order:
        found += int(hits[i])
        y = found / int(hits.sum())
        area += (prev + y) / 2 / 30
        prev = y
    assert aucec(scores, hits) == pytest.approx(area, abs=1e-12)


def test_results_score_the_prediction_against_the_ground_truth() -> None:
    active, pred, labels = _random_case(11, k=10)
    res = inspect_classes(active, pred, labels)
    scores = res.confusion_scores()
    tp = int((res.confused & res.gt_confused).sum())
    assert scores["true_positives"] == tp
    assert scores["precision"] == pytest.approx(tp / int(res.confused.sum()))
    assert scores["recall"] == pytest.approx(tp / int(res.gt_confused.sum()))
    assert scores["aucec"] == aucec(res.pair_napvd, res.gt_confused)
    assert 0 <= scores["aucec"] <= 1 and scores["aucec_random"] == 0.5
    bias = res.bias_scores()
    assert set(bias) >= {"precision", "recall", "aucec", "ground_truth_pairs"}
    details = res.to_details(top=3, by="bias")
    assert len(details["pairs"]) == 3 and details["pairs"][0]["avg_bias"] == res.max_bias()
    assert details["ground_truth"]["confusion"]["aucec"] == scores["aucec"]
    assert len(details["napvd"]) == 10 and len(details["type1_confusion"]) == 10


# ----------------------------------------------------------------------------- activity on real images
def _direct_activity(outputs: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input: min–max scale the whole layer tensor, channel mean of the scaled values (float64)."""
    x = outputs.double()
    scaled = torch.empty(x.shape[:2], dtype=torch.float64)
    for i in range(x.shape[0]):
        lo, hi = x[i].min(), x[i].max()
        z = (x[i] - lo) / (hi - lo) if hi > lo else torch.zeros_like(x[i])
        scaled[i] = z.flatten(1).mean(1)
    return scaled > threshold, scaled


@pytest.mark.parametrize("layer", ["features.2", "classifier.0"])
def test_digits_conv_layer_activity_and_napvd_equal_the_direct_computation(layer: str) -> None:
    model = digits_cnn()
    x, y = digits_images(400)
    full: list[torch.Tensor] = []
    module = dict(model.named_modules())[layer]
    handle = module.register_forward_hook(  # not the determinism probe's passes
            lambda m, i, o: None if probing() else full.append(o.detach().clone()))
    try:
        outs: list = []
        acts = capture(model, (x, y), [layer], batch_size=128, outputs=outs)[layer]
    finally:
        handle.remove()
    out = torch.cat(full)
    assert acts.min is not None and torch.equal(acts.min, out.flatten(2).amin(-1) if out.ndim > 2 else out)
    for t in (0.3, 0.5):
        direct, scaled = _direct_activity(out if out.ndim > 2 else out.unsqueeze(-1), t)
        ours = layer_activity(acts, t)
        clear = (scaled - t).abs() > 1e-5  # float32 means of the cache vs float64 here: ties at t aside
        assert torch.equal(ours[clear], direct[clear])
        assert int(clear.sum()) >= 0.99 * clear.numel()
        pred = outs[0].predictions
        res = inspect_classes(direct, pred, y)
        ref = reference(direct.numpy(), pred.numpy(), y.numpy(), 10)
        _assert_matches(res, ref, labels=True)
    if layer == "features.2":
        assert tuple(acts.unit_shape) == (32, 8, 8)


def test_a_constant_layer_output_activates_nothing() -> None:
    mean = torch.full((3, 4), 2.0)
    active = scaled_activity(mean, mean, mean, 0.5)
    assert not active.any()
    lo, hi = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 3.0]])
    assert scaled_activity(torch.tensor([[0.5, 2.0]]), lo, hi, 0.5).tolist() == [[False, True]]
    assert scaled_activity(torch.tensor([[0.5, 2.0]]), lo, hi, 0.5, reduce="max").tolist() == [[False, True]]
    assert scaled_activity(torch.tensor([[0.5, 1.5]]), lo, hi, 0.5).tolist() == [[False, False]]


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("threshold", [0, 1, 1.5, -0.1, float("nan"), True])
def test_thresholds_outside_the_open_unit_interval_are_refused(threshold) -> None:
    with pytest.raises(ConfigError, match=r"strictly between 0 and 1.*Fix: "):
        InspectionEngine(4, 3, threshold=threshold)
    with pytest.raises(ConfigError, match="Fix: "):
        scaled_activity(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), threshold)


def test_two_classes_give_confusion_but_no_bias() -> None:
    rng = np.random.default_rng(2)
    pred = rng.integers(0, 2, 50)
    active = rng.random((50, 6)) < 0.5
    res = inspect_classes(active, pred, pred, num_classes=2)
    assert res.n_pairs == 1 and 0 <= res.max_confusion() <= 1
    assert res.pair_bias is None and "three" in res.bias_problem
    with pytest.raises(InspectionError, match=r"at least three predicted classes.*Fix: .*max_class_confusion"):
        res.max_bias()
    assert isinstance(InspectionError("x"), DnnSafetyError)
    assert "bias_problem" in res.to_details()
    # three outputs, one never predicted: the same
    res3 = inspect_classes(active, pred, num_classes=3)
    assert res3.unpredicted == (2,)
    with pytest.raises(InspectionError, match="three"):
        res3.max_bias()


def test_one_predicted_class_is_an_error_naming_the_fix() -> None:
    with pytest.raises(InspectionError, match=r"only 1 of 4 classes .*Fix: "):
        inspect_classes(np.ones((5, 3), dtype=bool), np.zeros(5, dtype=int), num_classes=4)


def test_bad_update_arguments_are_named() -> None:
    engine = InspectionEngine(4, 3)
    with pytest.raises(DataError, match="4 units need 1"):
        engine.update(torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(DataError, match="dtype torch.float32.*Fix: "):
        engine.update(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(DataError, match="3 predictions for 2 rows"):
        engine.update(torch.zeros(2, 4, dtype=torch.bool), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(DataError, match="integer tensor"):
        engine.update(torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2))
    engine.update(torch.zeros(2, 4, dtype=torch.bool), torch.tensor([0, 5]))
    with pytest.raises(DataError, match=r"1 of 2 inputs have a prediction or label outside 0\.\.2"):
        engine.compute()
    mixed = InspectionEngine(4, 3)
    mixed.update(torch.zeros(2, 4, dtype=torch.bool), torch.tensor([0, 1]), torch.tensor([0, 1]))
    mixed.update(torch.zeros(2, 4, dtype=torch.bool), torch.tensor([2, 1]))
    with pytest.raises(DataError, match="labels came with 2 of 4 inputs"):
        mixed.compute()
    with pytest.raises(DataError, match="no inputs"):
        InspectionEngine(4, 3).compute()
    with pytest.raises(ConfigError, match="rule='median'"):
        inspect_classes(np.ones((3, 2), dtype=bool), np.arange(3), rule="median")
    with pytest.raises(ConfigError, match="top_share=0"):
        inspect_classes(np.ones((3, 2), dtype=bool), np.arange(3), rule="top", top_share=0)
    with pytest.raises(DataError, match="other than 0 and 1"):
        inspect_classes(np.full((3, 2), 0.5), np.arange(3))
    with pytest.raises(ConfigError, match="n_neurons"):
        inspect_classes(np.zeros((3, 1), dtype=np.uint8), np.arange(3))
    with pytest.raises(ConfigError, match="names 2 classes but there are 3"):
        inspect_classes(np.ones((3, 2), dtype=bool), np.arange(3), classes=["a", "b"], num_classes=3)
