"""Runtime safety monitors (Ferreira et al.): every monitor against a direct reference on small cases.

References written here: MSP/energy/ODIN by hand formulas (ODIN by a per-input autograd loop), Mahalanobis by
numpy (explicit per-class loop, ``np.linalg.pinv``), outside-the-box by per-class / per-box Python loops,
activation patterns by Python sets of bit tuples and a Hamming loop, the autoencoder by its formula. Then the
protocol: calibration accepts ``accept`` of fresh ID data within sampling error, merges of half-fits equal full
fits, image inputs with a conv model for every monitor, and the errors a user can run into.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.monitors import (
    MSP,
    ODIN,
    UNSEEN_SCORE,
    ActivationPatterns,
    Autoencoder,
    ClassGaussianStats,
    CustomMonitor,
    Energy,
    Mahalanobis,
    Monitor,
    MonitorView,
    OutsideTheBox,
    Overhead,
    as_monitor,
    fit_monitor,
    hamming_distances,
    measure_overhead,
    pack_patterns,
    unpack_patterns,
)
from pytest_dnnsafety.engines.monitors.features import kmeans_by_class
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

# ----------------------------------------------------------------------------- models and data


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """4 -> 16 -> 8 -> 3; layer "1" (ReLU, 16 neurons) and "3" (ReLU, 8 neurons) feed the feature monitors."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype).eval()


def smooth_mlp(seed: int = 3) -> nn.Module:
    """A float64 tanh MLP: gradients without zero components, so ODIN's signs are stable."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 3)).to(torch.float64).eval()


def cnn(seed: int = 0) -> nn.Module:
    """(N, 1, 8, 8) -> 3 classes; conv layers "1" (ReLU after conv, 4 channels) and "3" (6 channels)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(384, 3)).eval()


CENTRES = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])


def blobs(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=gen)
    x = CENTRES[y] + 0.7 * torch.randn(n, 4, generator=gen)
    return x.to(dtype), y


def images(n: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def layer_out(model: nn.Module, x: torch.Tensor, upto: int) -> torch.Tensor:
    with torch.no_grad():
        return model[: upto + 1](x)


def fitted(monitor: Monitor, model: nn.Module, data, **kw) -> Monitor:
    """Fit on all rows (no calibration split) — for comparisons with references fitted on the same rows."""
    return monitor.fit(MonitorView(model, data, **kw), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------- output monitors


def test_msp_and_energy_match_their_formulas() -> None:
    model, (x, y) = mlp(), blobs(60)
    logits = model(x).detach().double().numpy()
    view = MonitorView(model, (x, y))
    msp = fitted(MSP(), model, (x, y)).score(view)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(msp.numpy(), -p.max(1), rtol=1e-5, atol=1e-6)
    for t in (1.0, 2.5):
        energy = fitted(Energy(temperature=t), model, (x, y)).score(view)
        z = logits / t
        ref = -t * (z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)))
        np.testing.assert_allclose(energy.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert msp.dtype == torch.float32 and msp.shape == (60,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_msp_and_energy_on_logits_are_the_plain_torch_scores_bit_for_bit(dtype: torch.dtype) -> None:
    """MSP reads the shared pass's confidence (max softmax per batch) and energy at T=1 skips the division: the
    scores equal the plain torch formulas on the view's float32 logits exactly, rows subset or not, no new pass."""
    model, (x, y) = mlp(dtype=dtype), blobs(70, dtype=dtype)
    cache = ActivationCache()
    view = MonitorView(model, (x, y), batch_size=16, cache=cache)
    msp, energy = fitted(MSP(), model, (x, y), batch_size=16), fitted(Energy(), model, (x, y), batch_size=16)
    logits = view.logits()
    passes = cache.forward_passes
    assert torch.equal(msp.score(view), -torch.softmax(logits.float(), dim=1).amax(dim=1))
    assert torch.equal(energy.score(view), -torch.logsumexp(logits.float(), dim=1))
    rows = torch.tensor([65, 3, 17, 40])
    sub = view.subset(rows)
    assert torch.equal(msp.score(sub), -torch.softmax(logits[rows].float(), dim=1).amax(dim=1))
    assert torch.equal(energy.score(sub), -torch.logsumexp(logits[rows].float(), dim=1))
    assert cache.forward_passes == passes  # scoring read the shared pass only


def test_probability_outputs_msp_exact_and_energy_refused() -> None:
    base = mlp()
    prob_model = nn.Sequential(base, nn.Softmax(dim=1)).eval()
    x, y = blobs(40)
    msp = fitted(MSP(), prob_model, (x, y))
    assert msp.config()["outputs"] == "probabilities"
    ref = -torch.softmax(base(x), 1).amax(1).detach()
    torch.testing.assert_close(msp.score(MonitorView(prob_model, (x, y))), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(MetricError, match=r"'energy'.*probabilities.*Fix: return logits"):
        fitted(Energy(), prob_model, (x, y))


def odin_reference(model: nn.Module, x: torch.Tensor, t: float, eps: float) -> torch.Tensor:
    """Liang et al. 2018, eq. (2), one input at a time with loss.backward()."""
    out = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].clone().requires_grad_(True)
        log_s = torch.log_softmax(model(xi) / t, dim=1).max()
        log_s.backward()
        xt = xi.detach() - eps * torch.sign(-xi.grad)
        with torch.no_grad():
            out.append(-torch.softmax(model(xt) / t, dim=1).max())
    model.zero_grad(set_to_none=True)
    return torch.stack(out).float()


@pytest.mark.parametrize("t, eps", [(1000.0, 0.0014), (2.0, 0.05), (10.0, 0.0)])
def test_odin_matches_a_per_input_autograd_loop(t: float, eps: float) -> None:
    model, (x, y) = smooth_mlp(), blobs(25, dtype=torch.float64)
    monitor = fitted(ODIN(temperature=t, epsilon=eps), model, (x, y), batch_size=8)
    model.train()  # ODIN must score in eval mode and give the mode back
    scores = monitor.score(MonitorView(model, (x, y), batch_size=8))
    assert model.training
    model.eval()
    assert all(p.grad is None for p in model.parameters())  # input gradient only
    torch.testing.assert_close(scores, odin_reference(model, x, t, eps), rtol=1e-5, atol=1e-7)


def test_odin_with_zero_epsilon_is_temperature_scaled_msp() -> None:
    model, (x, y) = mlp(), blobs(30)
    scores = fitted(ODIN(temperature=3.0, epsilon=0.0), model, (x, y)).score(MonitorView(model, (x, y)))
    torch.testing.assert_close(scores, -torch.softmax(model(x).detach() / 3.0, 1).amax(1))


def test_odin_on_a_model_without_autograd_says_so() -> None:
    class NoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.inner(x)

    model, data = NoGrad().eval(), blobs(20)
    monitor = fitted(ODIN(), model, data)
    with pytest.raises(MetricError, match=r"'odin'.*differentiable.*Fix"):
        monitor.score(MonitorView(model, data))


# ----------------------------------------------------------------------------- Mahalanobis


def mahalanobis_reference(f_fit: np.ndarray, y_fit: np.ndarray, f: np.ndarray, ridge: float,
                          k: int = 3) -> np.ndarray:
    c = f_fit.shape[1]
    means = {}
    cov = np.zeros((c, c))
    for cls in range(k):
        rows = f_fit[y_fit == cls]
        if len(rows) == 0:
            continue
        means[cls] = rows.mean(0)
        for row in rows:
            d = (row - means[cls])[:, None]
            cov += d @ d.T
    cov /= len(f_fit)
    scale = np.trace(cov) / c
    reg = cov + ridge * (scale if scale > 0 else 1.0) * np.eye(c)
    prec = np.linalg.pinv(reg, rcond=c * np.finfo(np.float64).eps, hermitian=True)
    out = []
    for row in f:
        out.append(min(float((row - mu) @ prec @ (row - mu)) for mu in means.values()))
    return np.array(out)


@pytest.mark.parametrize("ridge", [1e-6, 0.0, 0.1])
def test_mahalanobis_matches_numpy(ridge: float) -> None:
    model, (x, y) = mlp(), blobs(120)
    xt, _ = blobs(50, seed=9)
    monitor = fitted(Mahalanobis("3", ridge=ridge), model, (x, y))
    scores = monitor.score(MonitorView(model, xt))
    f_fit, f = layer_out(model, x, 3).double().numpy(), layer_out(model, xt, 3).double().numpy()
    ref = mahalanobis_reference(f_fit, y.numpy(), f, ridge)
    np.testing.assert_allclose(scores.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_mahalanobis_singular_covariance_dead_neuron() -> None:
    model, (x, y) = mlp(), blobs(80)
    with torch.no_grad():  # neuron 0 of layer "1" never fires: a zero row/column of the covariance
        model[0].bias[0] = -100.0
        model[0].weight[0] = 0.0
    monitor = fitted(Mahalanobis("1"), model, (x, y))
    f_fit = layer_out(model, x, 1).double().numpy()
    ref = mahalanobis_reference(f_fit, y.numpy(), f_fit, 1e-6)
    scores = monitor.score(MonitorView(model, (x, y)))
    assert torch.isfinite(scores).all()
    np.testing.assert_allclose(scores.numpy(), ref, rtol=1e-4, atol=1e-4)
    # the plain pseudo-inverse ignores the dead direction; the ridge makes moving along it far
    plain = fitted(Mahalanobis("1", ridge=0.0), model, (x, y))
    assert torch.linalg.matrix_rank(plain.precision()) == 15
    np.testing.assert_allclose(plain.score(MonitorView(model, (x, y))).numpy(),
                               mahalanobis_reference(f_fit, y.numpy(), f_fit, 0.0), rtol=1e-4, atol=1e-4)


def test_class_gaussian_stats_engine_merges_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    f, cls = torch.randn(50, 5, generator=gen), torch.randint(0, 3, (50,), generator=gen)
    whole, a, b = ClassGaussianStats(3, 5), ClassGaussianStats(3, 5), ClassGaussianStats(3, 5)
    whole.update(f, cls)
    a.update(f[:20], cls[:20])
    b.update(f[20:], cls[20:])
    a.merge(b)
    for name in whole.state_names:
        torch.testing.assert_close(getattr(a, name), getattr(whole, name))
    again = ClassGaussianStats.from_payload(whole.state_payload())
    _, cov, seen = again.compute()
    ref = sum(((f[cls == k] - f[cls == k].mean(0)).T @ (f[cls == k] - f[cls == k].mean(0))).double()
              for k in range(3)) / 50
    torch.testing.assert_close(cov, ref, rtol=1e-6, atol=1e-8)
    assert seen.all()


# ----------------------------------------------------------------------------- outside the box


def box_scores_reference(f_fit: np.ndarray, groups: np.ndarray, cls_of_group: dict, f: np.ndarray,
                         pred: np.ndarray, enlarge: float) -> np.ndarray:
    """Boxes per (class, cluster) group by a loop; score = min over the predicted class's boxes of the L∞
    outside-distance in box widths (floor max(1e-3·range, 1e-6))."""
    span = f_fit.max(0) - f_fit.min(0)
    floor = np.maximum(1e-3 * span, 1e-6)
    boxes: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for g in sorted(set(groups.tolist())):
        rows = f_fit[groups == g]
        lo, hi = rows.min(0), rows.max(0)
        w = hi - lo
        boxes.setdefault(cls_of_group[g], []).append((lo - enlarge * w, hi + enlarge * w))
    out = []
    for row, p in zip(f, pred):
        if p not in boxes:
            out.append(UNSEEN_SCORE)
            continue
        best = math.inf
        for lo, hi in boxes[p]:
            d = 0.0
            for j in range(len(row)):
                outside = max(lo[j] - row[j], row[j] - hi[j], 0.0)
                d = max(d, outside / max(hi[j] - lo[j], floor[j]))
            best = min(best, d)
        out.append(best)
    return np.array(out)


@pytest.mark.parametrize("enlarge", [0.0, 0.2])
def test_outside_the_box_one_box_per_class_matches_a_loop(enlarge: float) -> None:
    model, (x, y) = mlp(), blobs(90)
    xt, _ = blobs(40, seed=5)
    xt = torch.cat([xt, 3 * xt[:10]])  # some far outside
    monitor = fitted(OutsideTheBox("3", enlarge=enlarge), model, (x, y))
    view = MonitorView(model, xt)
    scores = monitor.score(view)
    f_fit, f = layer_out(model, x, 3).numpy(), layer_out(model, xt, 3).numpy()
    pred = model(xt).argmax(1).numpy()
    ref = box_scores_reference(f_fit, y.numpy(), {k: k for k in range(3)}, f, pred, enlarge)
    np.testing.assert_allclose(scores.numpy(), ref, rtol=1e-5, atol=1e-6)
    own = monitor.score(MonitorView(model, (x, y)))
    right = model(x).argmax(1) == y
    assert (own[right] == 0).all()  # a fit input predicted as its label lies in its class's box


def test_outside_the_box_kmeans_boxes_match_a_loop_over_the_partition() -> None:
    model, (x, y) = mlp(), blobs(150)
    xt, _ = blobs(40, seed=6)
    monitor = OutsideTheBox("1", clusters=3, enlarge=0.1).fit(MonitorView(model, (x, y)),
                                                               generator=torch.Generator().manual_seed(11))
    f_fit = layer_out(model, x, 1)
    assign = kmeans_by_class(f_fit, y, 3, 3, torch.Generator().manual_seed(11))
    groups = (y * 3 + assign).numpy()
    cls_of = {g: g // 3 for g in set(groups.tolist())}
    pred = model(xt).argmax(1).numpy()
    ref = box_scores_reference(f_fit.numpy(), groups, cls_of, layer_out(model, xt, 1).numpy(), pred, 0.1)
    np.testing.assert_allclose(monitor.score(MonitorView(model, xt)).numpy(), ref, rtol=1e-5, atol=1e-6)
    assert int(monitor.valid.sum()) == len(cls_of)


def test_kmeans_by_class_recovers_separated_clusters_like_sklearn() -> None:
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    gen = torch.Generator().manual_seed(3)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    cls = torch.arange(240) % 2
    sub = torch.randint(0, 3, (240,), generator=gen)
    f = centres[sub] + 20 * cls[:, None] + 0.5 * torch.randn(240, 2, generator=gen)
    assign = kmeans_by_class(f, cls, 2, 3, torch.Generator().manual_seed(0))
    for k in range(2):
        rows = cls == k
        ref = KMeans(3, n_init=10, random_state=0).fit_predict(f[rows].numpy())
        assert adjusted_rand_score(ref, assign[rows].numpy()) == 1.0
        assert adjusted_rand_score(sub[rows].numpy(), assign[rows].numpy()) == 1.0


def test_outside_the_box_paper_rule_and_unseen_class() -> None:
    model, (x, y) = mlp(), blobs(60)
    monitor = fit_monitor(OutsideTheBox("3", rule="box"), model, (x, y))
    assert monitor.threshold == 0.0 and monitor.fit_info["n_fit"] == 60  # the paper's rule: fit on all rows
    only0 = (x[y == 0], torch.zeros(int((y == 0).sum()), dtype=torch.int64))
    lonely = fitted(OutsideTheBox("3"), model, only0)
    pred = model(x).argmax(1)
    scores = lonely.score(MonitorView(model, x))
    assert (scores[pred != 0] == UNSEEN_SCORE).all()


# ----------------------------------------------------------------------------- activation patterns


def test_pack_patterns_is_numpy_packbits_and_hamming_is_xor_popcount() -> None:
    gen = torch.Generator().manual_seed(0)
    bits = torch.rand(30, 21, generator=gen) > 0.5
    packed = pack_patterns(bits)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy(), axis=1))
    assert torch.equal(unpack_patterns(packed, 21), bits)
    dist = hamming_distances(packed[:7], packed)
    ref = (bits[:7, None, :] != bits[None, :, :]).sum(-1)
    np.testing.assert_array_equal(dist.numpy(), ref.numpy())


def test_activation_patterns_match_brute_force_sets() -> None:
    model, (x, y) = mlp(), blobs(100)
    xt, _ = blobs(40, seed=8)
    xt = torch.cat([xt, -2 * xt[:10]])
    monitor = fitted(ActivationPatterns("1"), model, (x, y))
    f_fit = (layer_out(model, x, 1) > 0).numpy()
    stored: dict[int, set[tuple[bool, ...]]] = {}
    for row, cls in zip(f_fit, y.tolist()):
        stored.setdefault(cls, set()).add(tuple(bool(v) for v in row))
    assert monitor.patterns.shape[0] == sum(len(s) for s in stored.values())
    pred = model(xt).argmax(1).tolist()
    ref = []
    for row, p in zip((layer_out(model, xt, 1) > 0).numpy(), pred):
        pats = stored.get(p, set())
        ref.append(min((sum(a != b for a, b in zip(row, pat)) for pat in pats), default=16 + 1))
    np.testing.assert_array_equal(monitor.score(MonitorView(model, xt)).numpy(), np.array(ref, dtype=np.float32))


def test_activation_patterns_tolerance_rule_is_the_papers() -> None:
    model, (x, y) = mlp(), blobs(80)
    xt, _ = blobs(60, seed=4)
    monitor = fit_monitor(ActivationPatterns("1", tolerance=2, rule="tolerance"), model, (x, y))
    assert monitor.threshold == 2.0
    scores = monitor.score(MonitorView(model, xt))
    torch.testing.assert_close(monitor.alarm(scores), scores > 2)
    assert monitor.fit_info["n_calibration"] == 0


# ----------------------------------------------------------------------------- autoencoder


def test_autoencoder_score_is_the_mean_squared_reconstruction_error() -> None:
    torch.manual_seed(0)
    ae = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 64), nn.Unflatten(1, (1, 8, 8)))
    model, (x, y) = cnn(), images(30)
    monitor = fitted(Autoencoder(ae), model, (x, y))
    scores = monitor.score(MonitorView(model, (x, y), batch_size=7))
    with torch.no_grad():
        ref = ((ae(x) - x) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(scores, ref)
    assert monitor.state_bytes() == sum(p.numel() * 4 for p in ae.parameters())


def test_autoencoder_wrong_shape_names_the_module() -> None:
    class Squeezer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)

    model, data = cnn(), images(10)
    monitor = fitted(Autoencoder(Squeezer()), model, data)
    with pytest.raises(MetricError, match=r"Squeezer.*returned \(10, 64\).*input's shape.*Fix"):
        monitor.score(MonitorView(model, data))


# ----------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("make, accept", [(Energy, 0.95), (lambda **kw: Mahalanobis("3", **kw), 0.9),
                                          (MSP, 0.8), (lambda **kw: OutsideTheBox("1", enlarge=0.05, **kw), 0.95)])
def test_calibration_accepts_accept_share_of_fresh_id_data(make, accept: float) -> None:
    model = mlp()
    fit_data, fresh = blobs(3000, seed=21), blobs(3000, seed=22)[0]
    monitor = fit_monitor(make(accept=accept, calibration_share=0.5), model, fit_data, seed=3)
    n_cal, n_fresh = monitor.fit_info["n_calibration"], fresh.shape[0]
    accepted = 1.0 - monitor.alarm(monitor.score(MonitorView(model, fresh))).double().mean().item()
    sigma = math.sqrt(accept * (1 - accept) * (1 / n_cal + 1 / n_fresh))
    assert abs(accepted - accept) <= 3 * sigma, (accepted, accept, sigma)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=40), st.floats(0.01, 0.99))
def test_calibrate_is_the_smallest_score_accepting_accept(values: list[int], accept: float) -> None:
    monitor = MSP(accept=accept)
    scores = torch.tensor(values, dtype=torch.float32)
    t = monitor.calibrate(scores)
    assert t in values
    assert (scores <= t).double().mean().item() >= accept - 1e-9
    assert (scores < t).double().mean().item() < accept  # nothing smaller among the scores would do
    assert monitor.alarm(scores).tolist() == [v > t for v in values]


def test_fit_monitor_is_seeded_and_shares_one_forward_pass() -> None:
    model, data = mlp(), blobs(200)
    cache = ActivationCache()
    a = fit_monitor(OutsideTheBox("1", clusters=2), model, data, seed=5, cache=cache)
    assert cache.forward_passes == 1  # outputs (predictions) and layer "1" in one pass
    b = fit_monitor(OutsideTheBox("1", clusters=2), model, data, seed=5)
    c = fit_monitor(OutsideTheBox("1", clusters=2), model, data, seed=6)
    assert a.threshold == b.threshold and torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)
    assert a.fit_info == {"seed": 5, "n_inputs": 200, "n_fit": 160, "n_calibration": 40, "threshold_rule": "calibrated"}
    assert not torch.equal(a.lo, c.lo)


# ----------------------------------------------------------------------------- merging


def _halves(model: nn.Module, make, data) -> tuple[Monitor, Monitor]:
    view = MonitorView(model, data)
    n = view.n_inputs
    whole = make().fit(view)
    a = make().fit(view.subset(torch.arange(0, n // 2)))
    b = make().fit(view.subset(torch.arange(n // 2, n)))
    return whole, a.merge(b)


def test_merge_of_half_fits_equals_the_full_fit() -> None:
    model, data = mlp(), blobs(150)
    xt = blobs(50, seed=3)[0]
    for make in (lambda: Mahalanobis("3"), lambda: OutsideTheBox("3", enlarge=0.1), lambda: ActivationPatterns("1"),
                 lambda: Energy(), lambda: MSP()):
        whole, merged = _halves(model, make, data)
        assert merged.threshold is None  # recalibrate after a merge
        torch.testing.assert_close(merged.score(MonitorView(model, xt)), whole.score(MonitorView(model, xt)),
                                   rtol=1e-4, atol=1e-4)
        assert merged.state_bytes() == whole.state_bytes()
    whole, merged = _halves(model, lambda: ActivationPatterns("1"), data)
    assert torch.equal(whole.patterns, merged.patterns) and torch.equal(whole.pattern_class, merged.pattern_class)
    whole, merged = _halves(model, lambda: OutsideTheBox("3"), data)
    assert torch.equal(whole.lo, merged.lo) and torch.equal(whole.hi, merged.hi)


def test_merge_refuses_kmeans_boxes_and_different_configurations() -> None:
    model, data = mlp(), blobs(60)
    with pytest.raises(ConfigError, match=r"k-means.*clusters=2.*Fix.*clusters=1"):
        _halves(model, lambda: OutsideTheBox("3", clusters=2), data)
    a, b = fitted(Mahalanobis("3"), model, data), fitted(Mahalanobis("1"), model, data)
    with pytest.raises(ConfigError, match=r"'layer' differs.*Fix"):
        a.merge(b)
    with pytest.raises(ConfigError, match="same kind"):
        a.merge(fitted(MSP(), model, data))


# ----------------------------------------------------------------------------- image inputs, every monitor


def _every_monitor() -> list[Monitor]:
    torch.manual_seed(0)
    ae = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 64), nn.Unflatten(1, (1, 8, 8)))
    return [MSP(), Energy(), ODIN(temperature=100.0, epsilon=0.01), OutsideTheBox("1"),
            OutsideTheBox("3", clusters=2, enlarge=0.05), ActivationPatterns("3", reduce="mean"),
            Mahalanobis("1"), Mahalanobis("3", reduce="max"), Autoencoder(ae),
            CustomMonitor(MeanDistance(), name="mean_distance")]


class MeanDistance:
    """A user monitor: squared distance of the flattened input to the fit inputs' mean."""

    def fit(self, model, x, y) -> None:
        self.mean = x.flatten(1).mean(0)

    def score(self, model, x):
        return ((x.flatten(1) - self.mean) ** 2).sum(1)


def test_every_monitor_on_images_with_a_conv_model() -> None:
    model, data = cnn(), images(120)
    fresh = images(80, seed=9)[0]
    cache = ActivationCache()
    monitors = _every_monitor()
    plan = sorted({layer for monitor in monitors for layer in monitor.layers()})
    for monitor in monitors:
        fit_monitor(monitor, model, data, seed=1, batch_size=32, cache=cache, plan=plan)
        scores = monitor.score(MonitorView(model, fresh, batch_size=32, cache=cache, plan=plan))
        assert scores.shape == (80,) and scores.dtype == torch.float32 and torch.isfinite(scores).all()
        assert monitor.threshold is not None and math.isfinite(monitor.threshold)
        assert monitor.alarm(scores).dtype == torch.bool
        config = monitor.config()
        assert config["name"] == monitor.name and isinstance(monitor.state_bytes(), int)
        again = fit_monitor(type(monitor)(**_kwargs(monitor)), model, data, seed=1, batch_size=32)
        assert again.threshold == monitor.threshold, monitor.name  # deterministic
    assert cache.forward_passes == 2  # one pass per data set, shared by every monitor and layer


def _kwargs(monitor: Monitor) -> dict:
    if isinstance(monitor, CustomMonitor):
        return {"obj": MeanDistance(), "name": monitor.name}
    if isinstance(monitor, Autoencoder):
        return {"module": monitor.module}
    keys = {"temperature", "epsilon", "layer", "clusters", "enlarge", "reduce", "by", "ridge", "tolerance", "rule"}
    return {k: v for k, v in monitor.config().items() if k in keys}


def test_monitors_detect_obvious_ood_images() -> None:
    model, data = cnn(), images(200)
    ood = torch.ones(40, 1, 8, 8) * 5.0  # far outside [0, 1]
    for monitor in (OutsideTheBox("3"), Mahalanobis("3"), ActivationPatterns("3"),
                    CustomMonitor(MeanDistance(), name="mean_distance")):
        fit_monitor(monitor, model, data)
        assert monitor.alarm(monitor.score(MonitorView(model, ood))).all(), monitor.name


# ----------------------------------------------------------------------------- the view


def test_monitor_view_subsets_without_a_new_pass() -> None:
    model, (x, y) = mlp(), blobs(50)
    cache = ActivationCache()
    view = MonitorView(model, (x, y), batch_size=8, cache=cache, plan=("1",))
    rows = torch.tensor([40, 3, 17, 5, 49])
    sub = view.subset(rows)
    torch.testing.assert_close(sub.logits(), view.logits()[rows])
    torch.testing.assert_close(sub.features("1"), view.features("1")[rows])
    assert torch.equal(sub.labels(), y[rows]) and sub.n_inputs == 5
    assert torch.equal(sub.inputs(), x[rows])  # unsorted rows: gathered in the given order
    assert cache.forward_passes == 1
    sorted_sub = view.subset(torch.tensor([2, 9, 10, 31]))
    batches = list(sorted_sub.batches())
    assert torch.equal(torch.cat([b for b, _ in batches]), x[[2, 9, 10, 31]])
    assert torch.equal(torch.cat([l for _, l in batches]), y[[2, 9, 10, 31]])
    nested = sorted_sub.subset(torch.tensor([1, 3]))
    assert torch.equal(nested.inputs(), x[[9, 31]])


def test_monitor_view_works_with_a_tensor_dataset_and_a_loader() -> None:
    model, (x, y) = mlp(), blobs(64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)
    a = fit_monitor(Mahalanobis("3"), model, loader, seed=2)
    b = fit_monitor(Mahalanobis("3"), model, (x, y), seed=2)
    assert a.threshold == pytest.approx(b.threshold, rel=1e-5)


def test_label_returning_model_has_no_logits() -> None:
    class Labels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).argmax(1)

    model, data = Labels().eval(), blobs(30)
    with pytest.raises(MetricError, match=r"class labels.*Fix: return logits"):
        fit_monitor(MSP(), model, data)
    monitor = fit_monitor(OutsideTheBox("net.3"), model, data)  # features still work
    assert monitor.num_classes == 3


# ----------------------------------------------------------------------------- user monitors and overhead


def test_custom_monitor_adapter() -> None:
    model, (x, y) = mlp(), blobs(60)
    user = MeanDistance()
    monitor = as_monitor(user)
    assert isinstance(monitor, CustomMonitor) and monitor.name == "MeanDistance"
    fit_monitor(monitor, model, (x, y))
    scores = monitor.score(MonitorView(model, x, batch_size=7))
    torch.testing.assert_close(scores, ((x - user.mean) ** 2).sum(1))
    assert monitor.state_bytes() == 16  # the user object's tensor attributes
    assert as_monitor(monitor) is monitor
    with pytest.raises(ConfigError, match=r"a int is not a monitor.*fit\(model, x, y\)"):
        as_monitor(3)
    with pytest.raises(ConfigError, match=r"MSP is a class.*Fix: pass an instance"):
        as_monitor(MSP)


def test_user_monitor_returning_nan_names_the_monitor() -> None:
    class Broken(MeanDistance):
        name = "broken_detector"

        def score(self, model, x):
            out = super().score(model, x)
            out[1] = float("nan")
            return out

    model, data = mlp(), blobs(40)
    with pytest.raises(MetricError, match=r"'broken_detector'.*NaN/inf.*input 1.*Fix"):
        fit_monitor(Broken(), model, data)


def test_measure_overhead() -> None:
    model, data = cnn(), images(64)
    view = MonitorView(model, data, batch_size=32)
    for monitor in (Energy(), ODIN()):
        fit_monitor(monitor, model, data)
        over = measure_overhead(monitor, view, repeats=2)
        assert isinstance(over, Overhead) and over.repeats == 2
        assert over.model_s_per_input > 0 and over.monitor_s_per_input > 0
        assert over.ratio == pytest.approx(over.monitor_s_per_input / over.model_s_per_input)
        assert over.to_dict()["state_bytes"] == monitor.state_bytes()
    with pytest.raises(ConfigError, match="repeats"):
        measure_overhead(Energy(), view, repeats=0)


def test_overhead_keeps_the_fastest_run_not_a_busy_spell() -> None:
    """A monitor whose first three timed runs wait 40 ms (a busy machine) of five: the median would read them; the
    fastest of the interleaved runs is the monitor's own cost."""
    import time

    class Hiccup(Energy):
        calls = 0

        def score(self, view):
            Hiccup.calls += 1
            if 2 <= Hiccup.calls <= 4:  # call 1 is the untimed warm-up
                time.sleep(0.04)
            return super().score(view)

    model, data = cnn(), images(64)
    view = MonitorView(model, data, batch_size=32)
    monitor = Hiccup()
    fit_monitor(monitor, model, data)
    Hiccup.calls = 0
    over = measure_overhead(monitor, view, repeats=5)
    assert Hiccup.calls == 6
    assert over.monitor_s_per_input * 64 < 0.02


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("arg", ["accept", "calibration_share"])
@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, float("nan"), True, "0.9"])
def test_shares_outside_the_open_unit_interval(arg: str, value) -> None:
    with pytest.raises(ConfigError, match=rf"{arg}=.*strictly between 0 and 1.*Fix"):
        Energy(**{arg: value})


def test_fit_on_empty_or_tiny_data() -> None:
    model = mlp()
    with pytest.raises(DataError, match=r"'energy'.*empty.*Fix"):
        fit_monitor(Energy(), model, (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64)))
    with pytest.raises(DataError, match=r"3 input\(s\).*at least 2.*Fix: pass more"):
        fit_monitor(Energy(), model, blobs(3))


def test_unknown_layer_names_the_layer() -> None:
    model, data = mlp(), blobs(20)
    with pytest.raises(ConfigError, match=r"unknown layer 'features\.9'.*Fix"):
        fit_monitor(Mahalanobis("features.9"), model, data)


def test_unlabelled_fit_data_falls_back_to_predictions_unless_labels_are_required() -> None:
    model, (x, _) = mlp(), blobs(60)
    monitor = fit_monitor(OutsideTheBox("3"), model, x)
    assert monitor.config()["fitted_by"] == "prediction"
    with pytest.raises(DataError, match=r"by='label' needs labelled fit data.*Fix"):
        fit_monitor(ActivationPatterns("1", by="label"), model, x)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ConfigError, match="temperature"):
        Energy(temperature=0)
    with pytest.raises(ConfigError, match="epsilon"):
        ODIN(epsilon=-1)
    with pytest.raises(ConfigError, match="clusters"):
        OutsideTheBox("1", clusters=0)
    with pytest.raises(ConfigError, match="reduce"):
        Mahalanobis("1", reduce="median")
    with pytest.raises(ConfigError, match="rule"):
        ActivationPatterns("1", rule="bdd")
    with pytest.raises(ConfigError, match="by"):
        OutsideTheBox("1", by="truth")
    with pytest.raises(ConfigError, match="layer"):
        OutsideTheBox("")
    with pytest.raises(ConfigError, match="not callable"):
        Autoencoder(3)
    with pytest.raises(ConfigError, match="name"):
        MSP(name="")


def test_score_and_alarm_before_fit() -> None:
    model, data = mlp(), blobs(10)
    with pytest.raises(ConfigError, match=r"'msp' is not fitted.*Fix: call fit_monitor"):
        MSP().score(MonitorView(model, data))
    with pytest.raises(ConfigError, match=r"no threshold.*Fix"):
        MSP().alarm(torch.zeros(3))


# ----------------------------------------------------------------------------- CUDA (skipped without it)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_monitor_gives_the_cpu_result_on_cuda() -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    data, fresh = images(150), images(60, seed=9)[0]
    results = {}
    for device in ("cpu", "cuda"):
        model = cnn().to(torch.float64).to(device)
        x64, fresh64 = (data[0].double(), data[1]), fresh.double()
        out = []
        for monitor in _every_monitor():
            if isinstance(monitor, Autoencoder):
                monitor = Autoencoder(monitor.module.to(torch.float64).to(device))
            fit_monitor(monitor, model, x64, seed=1, batch_size=64, device=device)
            scores = monitor.score(MonitorView(model, fresh64, batch_size=64, device=device))
            assert scores.device.type == device, monitor.name
            out.append((monitor.name, monitor.threshold, scores.cpu()))
        results[device] = out
    for (name, t_cpu, s_cpu), (_, t_gpu, s_gpu) in zip(results["cpu"], results["cuda"]):
        assert t_gpu == pytest.approx(t_cpu, rel=1e-4, abs=1e-5), name
        torch.testing.assert_close(s_gpu, s_cpu, rtol=1e-4, atol=1e-5, msg=name)
