"""Unit tests of pytest_dnnsafety.engines.reliability.profile: the torch KDE against scipy, cell masses, bootstrap, PCA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import integrate
from scipy import stats as sps

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile


def _data(n: int, d: int, seed: int = 0, correlated: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * np.linspace(0.5, 2.0, d)
    if correlated and d > 1:
        x[:, 1] += 0.8 * x[:, 0]
    return x


# ---------------------------------------------------------------------- density vs scipy.stats.gaussian_kde
@pytest.mark.parametrize("rule", ["scott", "silverman"])
def test_density_1d_matches_scipy(rule: str) -> None:
    x = _data(300, 1, seed=1)
    kde = sps.gaussian_kde(x.T, bw_method=rule)
    prof = OperationalProfile(x, rule)
    assert prof.factor == pytest.approx(kde.factor)
    assert float(prof.bandwidth[0]) == pytest.approx(float(np.sqrt(kde.covariance[0, 0])), rel=1e-12)
    q = np.linspace(-4, 4, 101)[:, None]
    np.testing.assert_allclose(prof.density(q).numpy(), kde(q.T), rtol=1e-10, atol=1e-300)


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("rule", ["scott", "silverman"])
def test_density_full_covariance_matches_scipy(d: int, rule: str) -> None:
    x = _data(400, d, seed=d, correlated=True)
    kde = sps.gaussian_kde(x.T, bw_method=rule)
    prof = OperationalProfile(x, rule, full_covariance=True)
    np.testing.assert_allclose(prof.covariance.numpy(), kde.covariance, rtol=1e-10)
    q = _data(200, d, seed=10 + d) * 1.2
    np.testing.assert_allclose(prof.density(q).numpy(), kde(q.T), rtol=1e-9)


def test_diagonal_rule_uses_scipy_factor_and_the_data_stds() -> None:
    x = _data(500, 2, seed=4, correlated=True)
    kde = sps.gaussian_kde(x.T, bw_method="scott")
    prof = OperationalProfile(x)  # diagonal Scott
    np.testing.assert_allclose(prof.bandwidth.numpy(), np.sqrt(np.diag(kde.covariance)), rtol=1e-12)
    q = _data(50, 2, seed=5)
    ref = np.mean(np.prod(sps.norm.pdf((q[:, None, :] - x[None, :, :]) / prof.bandwidth.numpy())
                          / prof.bandwidth.numpy(), axis=-1), axis=1)
    np.testing.assert_allclose(prof.density(q).numpy(), ref, rtol=1e-10)


def test_given_bandwidth_scalar_and_per_dimension() -> None:
    x = _data(200, 1, seed=2)
    h = 0.2  # the paper's running example bandwidth
    kde = sps.gaussian_kde(x.T, bw_method=h / x[:, 0].std(ddof=1))  # scipy's factor is relative to the data std
    prof = OperationalProfile(x, h)
    q = np.linspace(-3, 3, 41)[:, None]
    np.testing.assert_allclose(prof.density(q).numpy(), kde(q.T), rtol=1e-10)
    x2 = _data(100, 2, seed=3)
    prof2 = OperationalProfile(x2, [0.1, 0.3])
    assert prof2.bandwidth.tolist() == [0.1, 0.3]
    ref = np.mean(sps.norm.pdf(0.5, x2[:, 0], 0.1) * sps.norm.pdf(-0.2, x2[:, 1], 0.3))
    assert float(prof2.density([[0.5, -0.2]])[0]) == pytest.approx(ref, rel=1e-12)
    assert float(prof2.with_bandwidth(0.3).bandwidth[0]) == 0.3


# ---------------------------------------------------------------------- cell masses
def test_exact_box_mass_1d_against_quad() -> None:
    x = _data(80, 1, seed=7)
    prof = OperationalProfile(x, 0.3)
    boxes = [(-0.4, 0.1), (1.0, 2.5), (-6.0, 6.0), (3.0, 3.01)]
    mass = prof.box_mass([[a] for a, _ in boxes], [[b] for _, b in boxes]).numpy()
    for (a, b), m in zip(boxes, mass):
        ref, _ = integrate.quad(lambda t: float(prof.density([[t]])[0]), a, b, epsabs=1e-13, epsrel=1e-11)
        assert m == pytest.approx(ref, rel=1e-8, abs=1e-13)


def test_exact_box_mass_2d_against_dblquad() -> None:
    x = _data(40, 2, seed=8)
    prof = OperationalProfile(x, [0.4, 0.7])
    lower, upper = np.array([[-0.5, -1.0], [0.2, 0.3]]), np.array([[0.5, 0.2], [1.7, 2.0]])
    mass = prof.box_mass(lower, upper).numpy()
    for lo, hi, m in zip(lower, upper, mass):
        ref, _ = integrate.dblquad(lambda t2, t1: float(prof.density([[t1, t2]])[0]), lo[0], hi[0], lo[1], hi[1],
                                   epsabs=1e-12, epsrel=1e-10)
        assert m == pytest.approx(ref, rel=1e-7)


def test_exact_box_mass_has_no_upper_tail_cancellation() -> None:
    prof = OperationalProfile([[0.0]], 1.0)
    m = float(prof.box_mass([[9.0]], [[10.0]])[0])
    assert m == pytest.approx(sps.norm.sf(9.0) - sps.norm.sf(10.0), rel=1e-10, abs=0)
    assert m > 0


def test_centre_mass_is_eq_9() -> None:
    x = _data(50, 2, seed=9)
    prof = OperationalProfile(x, 0.5)
    lo, hi = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.004, 0.004]])
    expected = float(prof.density([[0.002, 0.002]])[0]) * 0.004**2
    assert float(prof.centre_mass(lo, hi)[0]) == pytest.approx(expected, rel=1e-12)
    # small cells: the centre approximation converges to the exact mass
    assert float(prof.box_mass(lo, hi)[0]) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ConfigError, match="'exact' or 'centre'"):
        prof.cell_mass(lo, hi, method="midpoint")


@pytest.mark.parametrize("method", ["exact", "centre"])
def test_axis_factors_reproduce_cell_masses(method: str) -> None:
    x = _data(30, 2, seed=11)
    prof = OperationalProfile(x, [0.3, 0.6])
    e1 = torch.linspace(-1, 1, 5, dtype=torch.float64)
    e2 = torch.linspace(0, 2, 4, dtype=torch.float64)
    f1, f2 = prof.axis_factors([e1, e2], method)
    grid = (f1.T @ f2) / prof.n  # (4, 3)
    i, j = 2, 1
    lo, hi = [[float(e1[i]), float(e2[j])]], [[float(e1[i + 1]), float(e2[j + 1])]]
    assert float(grid[i, j]) == pytest.approx(float(prof.cell_mass(lo, hi, method)[0]), rel=1e-12)


# ---------------------------------------------------------------------- bootstrap (Appendix A)
def test_bootstrap_weights_are_resampling_counts_and_seeded() -> None:
    prof = OperationalProfile(_data(60, 1, seed=12), 0.3)
    w = prof.bootstrap_weights(25, seed=5)
    assert w.shape == (25, 60)
    assert torch.all(w.sum(1) == 60)
    assert torch.equal(w, prof.bootstrap_weights(25, seed=5))
    assert not torch.equal(w, prof.bootstrap_weights(25, seed=6))
    with pytest.raises(ConfigError, match="bootstrap"):
        prof.bootstrap_weights(-1)


def test_bootstrap_masses_equal_explicit_refits() -> None:
    x = _data(40, 2, seed=13)
    prof = OperationalProfile(x, [0.4, 0.4])
    lo, hi = np.array([[-0.5, -0.5], [0.0, 0.5]]), np.array([[0.5, 0.5], [1.0, 1.5]])
    w = prof.bootstrap_weights(3, seed=1)
    reps = prof.box_mass(lo, hi, weights=w)
    for b in range(3):
        resampled = np.repeat(x, w[b].to(torch.int64).numpy(), axis=0)  # the refit's data set
        refit = OperationalProfile(resampled, [0.4, 0.4])  # same bandwidth (held fixed)
        np.testing.assert_allclose(reps[b].numpy(), refit.box_mass(lo, hi).numpy(), rtol=1e-12)
    mean, var = prof.mass_moments(lo, hi, replicates=50, seed=2)
    np.testing.assert_allclose(mean.numpy(), prof.box_mass(lo, hi).numpy())
    assert torch.all(var > 0)
    boot = prof.bootstrap_masses(lo, hi, 50, seed=2)
    np.testing.assert_allclose(var.numpy(), boot.var(0).numpy())


def test_half_size_bootstrap_is_the_kde_of_n_over_2_resampled_points() -> None:
    x = _data(41, 2, seed=21)  # odd N: m = 20 draws, weights N/m = 2.05 per draw
    prof = OperationalProfile(x, [0.4, 0.4])
    w = prof.bootstrap_weights(6, seed=3, size="half")
    assert w.shape == (6, 41)
    np.testing.assert_allclose(w.sum(1).numpy(), 41.0, rtol=1e-12)  # masses stay on the N-point scale
    counts = w * 20 / 41
    np.testing.assert_allclose(counts.numpy(), np.round(counts.numpy()), atol=1e-12)
    assert torch.all(counts.sum(1).round() == 20)
    assert torch.equal(w, prof.bootstrap_weights(6, seed=3, size="half"))  # same seed, same refits
    assert not torch.equal(w, prof.bootstrap_weights(6, seed=4, size="half"))
    # each refit is the KDE of its 20 drawn points (bandwidth held), built independently
    lo, hi = np.array([[-0.5, -0.5], [0.0, 0.5]]), np.array([[0.5, 0.5], [1.0, 1.5]])
    reps = prof.bootstrap_masses(lo, hi, 6, seed=3, size="half")
    for b in range(6):
        resampled = np.repeat(x, counts[b].round().to(torch.int64).numpy(), axis=0)
        assert resampled.shape[0] == 20
        refit = OperationalProfile(resampled, [0.4, 0.4])
        np.testing.assert_allclose(reps[b].numpy(), refit.box_mass(lo, hi).numpy(), rtol=1e-12)
    with pytest.raises(ConfigError, match="bootstrap_size .*'full', 'half'"):
        prof.bootstrap_weights(3, size="quarter")


def test_half_size_bootstrap_doubles_the_mass_variance() -> None:
    """The paper's half-size refits estimate the variance of an N/2-point KDE: about 2× the full bootstrap's."""
    x = _data(600, 2, seed=22)
    prof = OperationalProfile(x)
    edges = np.linspace(-2.0, 2.0, 9)
    lo = np.array([[a, b] for a in edges[:-1] for b in edges[:-1]]) * [1.0, 2.0]
    hi = lo + np.array([0.5, 1.0])
    _, var_full = prof.mass_moments(lo, hi, replicates=300, seed=1)
    _, var_half = prof.mass_moments(lo, hi, replicates=300, seed=1, size="half")
    ratio = float(torch.median(var_half / var_full))
    assert 1.6 <= ratio <= 2.8, ratio
    # and the same seed gives the same numbers
    _, again = prof.mass_moments(lo, hi, replicates=300, seed=1, size="half")
    assert torch.equal(var_half, again)


@pytest.mark.parametrize("spelling", ["centre", "center"])
def test_center_is_a_spelling_of_centre(spelling: str) -> None:
    x = _data(30, 2, seed=23)
    prof = OperationalProfile(x, 0.5)
    lo, hi = np.array([[0.0, 0.0]]), np.array([[0.1, 0.2]])
    assert torch.equal(prof.cell_mass(lo, hi, spelling), prof.centre_mass(lo, hi))
    edges = [torch.linspace(0, 1, 4, dtype=torch.float64)] * 2
    for a, b in zip(prof.axis_factors(edges, spelling), prof.axis_factors(edges, "centre")):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- latent space, PCA
def test_pca_round_trip_and_sklearn_agreement() -> None:
    from sklearn.decomposition import PCA as SkPCA

    rng = np.random.default_rng(14)
    latent = rng.normal(size=(200, 3))
    mixing = rng.normal(size=(3, 12))
    images = (latent @ mixing + 0.5).reshape(200, 3, 4)
    pca = PCA(3, dtype=torch.float64).fit(images)
    z = pca.encode(images)
    back = pca.decode(z)
    assert back.shape == (200, 3, 4)
    np.testing.assert_allclose(back.numpy(), images, atol=1e-9)  # rank-3 data: exact reconstruction
    sk = SkPCA(3).fit(images.reshape(200, -1))
    np.testing.assert_allclose(np.abs(pca.components.numpy()), np.abs(sk.components_), atol=1e-8)
    np.testing.assert_allclose(pca.explained_variance.numpy(), sk.explained_variance_, rtol=1e-8)
    with pytest.raises(ConfigError, match="not fitted"):
        PCA(2).encode(images)
    with pytest.raises(ConfigError, match="exceeds"):
        PCA(20).fit(images)


def test_profile_in_a_latent_space() -> None:
    rng = np.random.default_rng(15)
    x = rng.normal(size=(150, 2, 5)).astype(np.float32)
    pca = PCA(2).fit(x)
    prof = OperationalProfile(x, encoder=pca.encode, decoder=pca.decode)
    assert prof.latent and prof.dim == 2 and prof.input_shape == (2, 5)
    np.testing.assert_allclose(prof.points.numpy(), pca.encode(x).numpy().astype(np.float64), rtol=1e-6)
    decoded = prof.decode(torch.zeros(4, 2))
    assert decoded.shape == (4, 2, 5)


# ---------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("empty", [np.zeros((0, 2)), [], torch.zeros(0, 3)])
def test_empty_profile_is_rejected(empty) -> None:
    with pytest.raises(DataError, match="empty"):
        OperationalProfile(empty)


def test_nan_inputs_are_rejected_with_their_position() -> None:
    x = _data(10, 2)
    x[7, 1] = np.nan
    with pytest.raises(DataError, match="row 7, column 1"):
        OperationalProfile(x)
    prof = OperationalProfile(_data(10, 2), 0.5)
    with pytest.raises(DataError, match="non-finite"):
        prof.density([[0.0, np.inf]])
    with pytest.raises(DataError, match="row 3"):
        OperationalProfile(np.where(np.arange(20)[:, None, None] == 3, np.nan, np.ones((20, 2, 2))),
                           encoder=lambda t: t.reshape(t.shape[0], -1)[:, :2])


@pytest.mark.parametrize(
    "bandwidth, match",
    [("scot", "not a known rule"), (0.0, "> 0"), (-1.0, "> 0"), ([0.1, 0.2, 0.3], "one entry per dimension"),
     (float("nan"), "finite"), (True, "rule name"), ("silverman!", "not a known rule"), ({"h": 1}, "bandwidth")],
)
def test_bad_bandwidth_is_rejected(bandwidth, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OperationalProfile(_data(20, 2), bandwidth)


def test_rule_on_constant_dimension_and_single_point() -> None:
    x = _data(20, 2)
    x[:, 1] = 3.0
    with pytest.raises(ConfigError, match=r"dimension\(s\) \[1\]"):
        OperationalProfile(x)
    with pytest.raises(ConfigError, match="at least 2"):
        OperationalProfile([[1.0, 2.0]])
    assert OperationalProfile([[1.0, 2.0]], 0.1).n == 1


def test_exact_masses_need_diagonal_kernels() -> None:
    prof = OperationalProfile(_data(50, 2, correlated=True), full_covariance=True)
    with pytest.raises(ConfigError, match="mass='centre'"):
        prof.box_mass([[0, 0]], [[1, 1]])
    assert float(prof.centre_mass([[0, 0]], [[0.1, 0.1]])[0]) > 0


def test_images_keep_their_shape_and_latent_profiles_keep_their_raw_inputs() -> None:
    images = torch.rand(30, 1, 2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat = OperationalProfile(images, bandwidth=0.1)
    assert flat.dim == 6 and flat.input_shape == (1, 2, 3) and flat.inputs.shape == (30, 1, 2, 3)
    assert flat.decode(torch.zeros(4, 6)).shape == (4, 1, 2, 3)  # grid samples reach the model as images
    assert OperationalProfile(images.reshape(30, 6), bandwidth=0.1).decode(torch.zeros(4, 6)).shape == (4, 6)
    pca = PCA(2).fit(images)
    latent = OperationalProfile(images, encoder=pca.encode, decoder=pca.decode)
    assert latent.inputs.shape == (30, 1, 2, 3) and torch.equal(latent.inputs, images)
