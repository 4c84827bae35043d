"""Fault families with severities 1–5 (Ferreira et al. 2021, §IV-A; constants of Hendrycks & Dietterich 2019).

Each pointwise family is checked against its formula written in numpy, with the random draws
reproduced from a generator seeded alike; the blur against ``scipy.ndimage.gaussian_filter``;
the rotation against ``torch.rot90``/flips; the row families against per-row Python loops; the
haze field against a separable numpy bilinear upsampling. Hypothesis checks shape, dtype,
range and determinism on random shapes; a fixed batch checks that severities are monotone.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import ndimage
from torch import nn

from pytest_dnnsafety.engines import perturb
from pytest_dnnsafety.engines.monitors import faults
from pytest_dnnsafety.engines.monitors.faults import (
    FAULT_FAMILIES,
    FAULT_GROUPS,
    NOVEL,
    SEVERITIES,
    apply_fault,
    check_severity,
    expand_faults,
    fault_parameters,
    make_fault_data,
)
from pytest_dnnsafety.engines.perturb.adversarial import fgsm
from pytest_dnnsafety.errors import ConfigError, DataError

POINTWISE = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "brightness", "contrast",
             "black_frame", "fgsm", "pgd")
SPATIAL = tuple(f for f in FAULT_FAMILIES if f not in POINTWISE)
RANDOM = ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "haze", "rotation",
          "zeroed_rows", "copied_rows", "shifted_rows", "pgd")
ADVERSARIAL = ("fgsm", "pgd")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add contention (100× slower on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int = 4, c: int = 3, h: int = 8, w: int = 8, seed: int = 7, dtype=torch.float64) -> torch.Tensor:
    return torch.rand(n, c, h, w, generator=gen(seed), dtype=dtype)


def tiny_model(d: int, k: int = 3, seed: int = 0, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 6), nn.Tanh(), nn.Linear(6, k)).to(dtype).eval()


def labels(n: int, k: int = 3) -> torch.Tensor:
    return torch.arange(n) % k


def run(family: str, x: torch.Tensor, severity: int, seed: int = 0, **kw) -> torch.Tensor:
    if family in ADVERSARIAL and "model" not in kw:
        kw["model"] = tiny_model(int(np.prod(x.shape[1:])), dtype=x.dtype)
        kw["y"] = labels(x.shape[0])
    return apply_fault(family, x, severity, generator=gen(seed), **kw)


# ----------------------------------------------------------------------------- names, severities, parameters


def test_families_and_groups():
    assert FAULT_FAMILIES == tuple(f for names in FAULT_GROUPS.values() for f in names)
    assert len(FAULT_FAMILIES) == len(set(FAULT_FAMILIES)) == 15
    assert SEVERITIES == (1, 2, 3, 4, 5)
    assert NOVEL == "novel" and NOVEL not in FAULT_FAMILIES


def test_expand_faults():
    assert expand_faults("noise") == FAULT_GROUPS["noise"]
    assert expand_faults(["fgsm", "adversarial", "novel", "brightness", "shift"]) == (
        "fgsm", "pgd", "novel", "brightness", "contrast", "haze", "rotation")
    assert expand_faults(list(FAULT_GROUPS)) == FAULT_FAMILIES
    with pytest.raises(ConfigError, match=r"'gausian_noise'.*noise.*did you mean 'gaussian_noise'"):
        expand_faults(["gausian_noise"])
    with pytest.raises(ConfigError, match="names no fault family"):
        expand_faults([])
    with pytest.raises(ConfigError, match="not a string"):
        expand_faults(["noise", 3])


def test_check_severity():
    assert check_severity(3) == (3,)
    assert check_severity(np.int64(5)) == (5,)
    assert check_severity([1, 3, 3, 2]) == (1, 3, 2)
    assert check_severity(range(1, 6)) == SEVERITIES
    assert check_severity(np.array([2, 4])) == (2, 4)
    for bad in (0, 6, 2.0, True, "3", None, [], [1, 7]):
        with pytest.raises(ConfigError, match=r"use an int in 1\.\.5"):
            check_severity(bad)


def test_fault_parameters_cover_every_family():
    for family in FAULT_FAMILIES:
        table = fault_parameters(family)
        assert list(table) == list(SEVERITIES) and all(isinstance(v, str) and v for v in table.values())
        assert list(fault_parameters(family, shape=(3, 32, 32))) == list(SEVERITIES)
    assert fault_parameters("gaussian_noise")[3] == "σ = 0.08 × clip width"
    assert fault_parameters("shot_noise")[1] == "λ = 500 counts per clip width"
    assert fault_parameters("gaussian_blur", shape=(1, 64, 64))[5] == "σ = 2 px, radius 8"
    assert fault_parameters("zeroed_rows", shape=(1, 8, 8))[1] == "1 of 8 rows set to clip low"
    assert fault_parameters("shifted_rows", shape=(3, 32, 32))[5] == "16 of 32 rows shifted ±6 px, clip-low fill"
    assert fault_parameters(NOVEL) == {}
    with pytest.raises(ConfigError, match="Known names"):
        fault_parameters("fog")


# ----------------------------------------------------------------------------- pointwise formulas


@pytest.mark.parametrize("severity", SEVERITIES)
@pytest.mark.parametrize("clip", [(0.0, 1.0), (-1.0, 1.0)])
def test_gaussian_and_speckle_noise_formula(severity, clip):
    lo, hi = clip
    x = lo + (hi - lo) * images(2, 3, 4, 5)
    z = torch.randn(x.shape, generator=gen(3), dtype=x.dtype).numpy()
    xn = x.numpy()
    sigma = [0.04, 0.06, 0.08, 0.09, 0.10][severity - 1] * (hi - lo)
    got = run("gaussian_noise", x, severity, seed=3, clip=clip).numpy()
    np.testing.assert_allclose(got, np.clip(xn + sigma * z, lo, hi), rtol=0, atol=1e-12)
    sigma = [0.06, 0.10, 0.12, 0.16, 0.20][severity - 1]
    got = run("speckle_noise", x, severity, seed=3, clip=clip).numpy()
    np.testing.assert_allclose(got, np.clip(xn + (xn - lo) * sigma * z, lo, hi), rtol=0, atol=1e-12)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_shot_noise_formula(severity):
    x = images(2, 1, 6, 6)
    lam = [500, 250, 100, 75, 50][severity - 1]
    counts = torch.poisson(x * lam, generator=gen(4)).numpy()
    got = run("shot_noise", x, severity, seed=4).numpy()
    np.testing.assert_allclose(got, np.clip(counts / lam, 0, 1), rtol=0, atol=1e-12)
    assert np.allclose(got * lam, np.round(got * lam))  # multiples of 1/λ (below the clamp)


def test_shot_noise_moments():
    """Independent of torch's sampler: E[x'] = x and Var[x'] = x/λ for Poisson(λx)/λ (severity 5, λ = 50)."""
    x = torch.full((20000, 3), 0.3, dtype=torch.float64)
    x[:, 1], x[:, 2] = 0.05, 0.6
    got = run("shot_noise", x, 5, seed=1, clip=None)
    np.testing.assert_allclose(got.mean(0).numpy(), [0.3, 0.05, 0.6], atol=0.004)
    np.testing.assert_allclose(got.var(0).numpy(), np.array([0.3, 0.05, 0.6]) / 50, rtol=0.05)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_impulse_noise_formula(severity):
    x = images(3, 2, 8, 8)
    g = gen(5)
    u = torch.rand(x.shape, generator=g, dtype=x.dtype).numpy()
    v = torch.rand(x.shape, generator=g, dtype=x.dtype).numpy()
    share = [0.01, 0.02, 0.03, 0.05, 0.07][severity - 1]
    want = np.where(u < share, np.where(v < 0.5, 1.0, 0.0), x.numpy())
    got = run("impulse_noise", x, severity, seed=5).numpy()
    np.testing.assert_array_equal(got, want)


def test_impulse_noise_share_on_a_large_batch():
    x = torch.full((200, 1000), 0.5)
    got = run("impulse_noise", x, 5, seed=0)
    hit = got != 0.5
    assert abs(hit.float().mean().item() - 0.07) < 0.003
    assert abs((got[hit] == 1).float().mean().item() - 0.5) < 0.02


@pytest.mark.parametrize("severity", SEVERITIES)
@pytest.mark.parametrize("clip", [(0.0, 1.0), (-2.0, 2.0), None])
def test_brightness_contrast_black_frame_formulas(severity, clip):
    lo, hi = clip if clip is not None else (0.0, 1.0)
    x = lo + (hi - lo) * images(3, 2, 4, 4)
    xn = x.numpy()
    limit = (lambda a: np.clip(a, lo, hi)) if clip is not None else (lambda a: a)
    delta = [0.05, 0.10, 0.15, 0.20, 0.30][severity - 1] * (hi - lo)
    np.testing.assert_allclose(run("brightness", x, severity, clip=clip).numpy(), limit(xn + delta), atol=1e-12)
    c = [0.75, 0.50, 0.40, 0.30, 0.15][severity - 1]
    m = xn.reshape(3, -1).mean(axis=1).reshape(3, 1, 1, 1)
    np.testing.assert_allclose(run("contrast", x, severity, clip=clip).numpy(), limit((xn - m) * c + m), atol=1e-12)
    np.testing.assert_array_equal(run("black_frame", x, severity, clip=clip).numpy(), np.full_like(xn, lo))


def test_clip_none_does_not_clamp():
    x = torch.ones(2, 5)
    assert torch.allclose(run("brightness", x, 5, clip=None), torch.full((2, 5), 1.3))
    assert run("brightness", x, 5).max().item() == 1.0


# ----------------------------------------------------------------------------- spatial references


@pytest.mark.parametrize("severity", SEVERITIES)
@pytest.mark.parametrize("hw", [(8, 8), (12, 9), (32, 32), (64, 40)])
def test_gaussian_blur_matches_scipy_mirror(severity, hw):
    h, w = hw
    x = images(2, 3, h, w)
    sigma = [0.4, 0.6, 0.7, 0.8, 1.0][severity - 1] * max(1.0, min(h, w) / 32)
    want = ndimage.gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="mirror", truncate=4.0)
    got = run("gaussian_blur", x, severity).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # torch's 'reflect' padding is scipy's 'mirror' (d c b | a b c d), not scipy's 'reflect' (d c b a | a b c d)
    other = ndimage.gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="reflect", truncate=4.0)
    assert not np.allclose(got, other, atol=1e-6)


def test_blur_grey_images_and_three_dims():
    x = images(3, 1, 10, 10)
    a = run("gaussian_blur", x, 2)
    b = run("gaussian_blur", x[:, 0], 2)
    assert b.shape == (3, 10, 10) and torch.equal(a[:, 0], b)


@pytest.mark.parametrize("hw", [(6, 6), (9, 9)])
def test_rotate_by_90_degrees_is_rot90(hw):
    x = images(3, 2, *hw)
    turned = torch.cat([perturb.rotate(x[:2], 90.0, fill=0.0), perturb.rotate(x[2:], -90.0, fill=0.0)])
    torch.testing.assert_close(turned[:2], torch.rot90(x[:2], k=1, dims=(-2, -1)), atol=1e-6, rtol=0)
    torch.testing.assert_close(turned[2:], torch.rot90(x[2:], k=-1, dims=(-2, -1)), atol=1e-6, rtol=0)


def test_rotate_by_180_degrees_non_square_and_0_degrees():
    x = images(2, 1, 5, 8)
    turned = torch.cat([perturb.rotate(x[:1], 180.0, fill=0.0), perturb.rotate(x[1:], 0.0, fill=0.0)])
    torch.testing.assert_close(turned[0], torch.flip(x[0], dims=(-2, -1)), atol=1e-6, rtol=0)
    torch.testing.assert_close(turned[1], x[1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_rotation_family_draws_a_sign_per_input(severity):
    x = images(6, 3, 8, 8)
    sign = torch.where(torch.rand(6, generator=gen(2), dtype=x.dtype) < 0.5, 1.0, -1.0)
    angle = [6, 12, 18, 24, 30][severity - 1]
    want = torch.cat([perturb.rotate(x[i:i + 1], float(sign[i]) * angle, fill=0.0) for i in range(6)])
    torch.testing.assert_close(run("rotation", x, severity, seed=2), want.clamp(0, 1), atol=0, rtol=0)
    # the corners leave the image: filled with the clip's low value
    x1 = torch.ones(1, 1, 16, 16, dtype=torch.float64)
    out = run("rotation", x1, 5, clip=(-1.0, 1.0))
    assert out[0, 0, 0, 0] == -1.0 and out[0, 0, 8, 8] == 1.0


def _bilinear_np(z: np.ndarray, h: int, w: int) -> np.ndarray:
    """align_corners=True bilinear upsampling of (g, g) to (h, w), separable with np.interp."""
    g = z.shape[0]
    rows = np.linspace(0, g - 1, h) if h > 1 else np.zeros(1)
    cols = np.linspace(0, g - 1, w) if w > 1 else np.zeros(1)
    tmp = np.stack([np.interp(cols, np.arange(g), z[r]) for r in range(g)])  # (g, w)
    return np.stack([np.interp(rows, np.arange(g), tmp[:, j]) for j in range(w)], axis=1)


@pytest.mark.parametrize("severity", SEVERITIES)
@pytest.mark.parametrize("hw", [(8, 8), (16, 20)])
def test_haze_formula(severity, hw):
    h, w = hw
    x = images(3, 2, h, w)
    g = 2 if min(h, w) < 16 else 4
    z = torch.randn(3, 1, g, g, generator=gen(6), dtype=x.dtype).numpy()
    a = [0.2, 0.5, 0.75, 1.0, 1.5][severity - 1]
    a = a / (1 + a)
    want = np.empty_like(x.numpy())
    for n in range(3):
        p = _bilinear_np(z[n, 0], h, w)
        p = (p - p.min()) / (p.max() - p.min())
        want[n] = x.numpy()[n] * (1 - a) + a * (0.5 + 0.5 * p)[None]
    np.testing.assert_allclose(run("haze", x, severity, seed=6).numpy(), want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- rows: per-row loops


def _hit_rows(n: int, h: int, severity: int, g: torch.Generator, dtype) -> list[set[int]]:
    keys = torch.rand(n, h, generator=g, dtype=dtype)
    k = max(1, min(h - 1, math.ceil([5, 10, 20, 30, 50][severity - 1] * h / 100)))
    return [set(torch.argsort(keys[i], descending=True)[:k].tolist()) for i in range(n)]


@pytest.mark.parametrize("severity", SEVERITIES)
@pytest.mark.parametrize("hw", [(8, 8), (32, 12), (3, 5)])
def test_row_families_match_per_row_loops(severity, hw):
    h, w = hw
    lo = -1.0
    x = lo + 2 * images(3, 2, h, w)
    xn = x.numpy()

    g = gen(8)
    hit = _hit_rows(3, h, severity, g, x.dtype)
    right = (torch.rand(3, h, generator=g, dtype=x.dtype) < 0.5).numpy()
    d = max(1, min(w, math.ceil([1, 2, 3, 4, 6][severity - 1] * w / 32)))

    zeroed, copied, shifted = xn.copy(), xn.copy(), xn.copy()
    for n in range(3):
        kept = [r for r in range(h) if r not in hit[n]]
        last = None
        for r in range(h):
            if r not in hit[n]:
                last = r
                continue
            zeroed[n, :, r, :] = lo
            copied[n, :, r, :] = xn[n, :, last if last is not None else kept[0], :]
            s = d if right[n, r] else -d
            for j in range(w):
                shifted[n, :, r, j] = xn[n, :, r, j - s] if 0 <= j - s < w else lo
    clip = (-1.0, 1.0)
    np.testing.assert_array_equal(run("zeroed_rows", x, severity, seed=8, clip=clip).numpy(), zeroed)
    np.testing.assert_array_equal(run("copied_rows", x, severity, seed=8, clip=clip).numpy(), copied)
    np.testing.assert_array_equal(run("shifted_rows", x, severity, seed=8, clip=clip).numpy(), shifted)


def test_copied_rows_when_the_top_rows_are_hit():
    hit = torch.tensor([[True, True, False, True, False], [False, True, True, True, False]])
    assert perturb.copy_source(hit).tolist() == [[2, 2, 2, 2, 4], [0, 0, 0, 0, 4]]


def test_rows_on_three_dim_images_and_at_least_one_row():
    x = images(5, 1, 8, 8)
    out = run("zeroed_rows", x[:, 0], 1)
    assert out.shape == (5, 8, 8)
    assert ((out == 0).all(dim=2).sum(dim=1) >= 1).all()
    torch.testing.assert_close(out, run("zeroed_rows", x, 1)[:, 0], atol=0, rtol=0)


# ----------------------------------------------------------------------------- adversarial


@pytest.mark.parametrize("family", ADVERSARIAL)
@pytest.mark.parametrize("severity", SEVERITIES)
def test_adversarial_within_eps_and_clip(family, severity):
    x = images(6, 1, 4, 4)
    model = tiny_model(16)
    eps = [1, 2, 4, 8, 16][severity - 1] / 255
    out = apply_fault(family, x, severity, generator=gen(0), model=model, y=labels(6))
    assert (out - x).abs().max().item() <= eps + 1e-12
    assert out.min().item() >= 0 and out.max().item() <= 1
    if family == "fgsm":
        torch.testing.assert_close(out, fgsm(model, x, labels(6), eps, clip=(0.0, 1.0)), atol=0, rtol=0)
    x2 = -1 + 2 * x  # clip (-1, 1): ε scales with the range width
    out2 = apply_fault(family, x2, severity, generator=gen(0), model=model, y=labels(6), clip=(-1.0, 1.0))
    assert (out2 - x2).abs().max().item() <= 2 * eps + 1e-12
    assert (out2 - x2).abs().max().item() > eps


def test_adversarial_on_vectors_and_errors():
    x = torch.rand(5, 7, generator=gen(1), dtype=torch.float64)
    model = tiny_model(7)
    out = apply_fault("pgd", x, 4, generator=gen(0), model=model, y=labels(5))
    assert out.shape == x.shape and (out - x).abs().max() <= 8 / 255 + 1e-12
    with pytest.raises(ConfigError, match=r"needs the model.*model and y not given.*Fix: pass model="):
        apply_fault("fgsm", x, 1, generator=gen(0))
    with pytest.raises(ConfigError, match=r"y not given"):
        apply_fault("pgd", x, 1, generator=gen(0), model=model)
    with pytest.raises(DataError, match=r"one integer label per input, shape \(5,\)"):
        apply_fault("fgsm", x, 1, generator=gen(0), model=model, y=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"y not given"):
        make_fault_data("fgsm", x, None, 1, seed=0, model=model)


# ----------------------------------------------------------------------------- properties


SHAPES = st.one_of(
    st.tuples(st.integers(1, 3), st.sampled_from([1, 3]), st.integers(2, 9), st.integers(2, 9)),
    st.tuples(st.integers(1, 3), st.integers(2, 9), st.integers(2, 9)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(FAULT_FAMILIES), severity=st.sampled_from(SEVERITIES), shape=SHAPES,
       seed=st.integers(0, 2**31), dtype=st.sampled_from([torch.float32, torch.float64]),
       clip=st.sampled_from([(0.0, 1.0), (-1.0, 2.0)]))
def test_property_shape_dtype_range_determinism(family, severity, shape, seed, dtype, clip):
    lo, hi = clip
    x = lo + (hi - lo) * torch.rand(shape, generator=gen(seed % 1000), dtype=dtype)
    a = run(family, x, severity, seed=seed, clip=clip)
    b = run(family, x, severity, seed=seed, clip=clip)
    assert a.shape == x.shape and a.dtype == x.dtype and a.device == x.device
    assert torch.isfinite(a).all() and a.min() >= lo and a.max() <= hi
    assert torch.equal(a, b)
    assert a.data_ptr() != x.data_ptr()


@settings(max_examples=25, deadline=None)
@given(family=st.sampled_from(POINTWISE), severity=st.sampled_from(SEVERITIES),
       shape=st.tuples(st.integers(1, 4), st.integers(1, 12)), seed=st.integers(0, 2**31))
def test_property_vectors_for_pointwise_families(family, severity, shape, seed):
    x = torch.rand(shape, generator=gen(seed % 1000), dtype=torch.float64)
    a = run(family, x, severity, seed=seed)
    assert a.shape == x.shape and 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, run(family, x, severity, seed=seed))


@pytest.mark.parametrize("family", RANDOM)
def test_random_families_differ_between_seeds(family):
    x = 0.1 + 0.8 * images(16, 3, 8, 8)
    for severity in (1, 5):
        assert not torch.equal(run(family, x, severity, seed=0), run(family, x, severity, seed=1))


@pytest.mark.parametrize("family", FAULT_FAMILIES)
def test_deterministic_families_ignore_the_seed_and_random_ones_change_x(family):
    x = 0.1 + 0.8 * images(8, 1, 8, 8)
    for severity in SEVERITIES:
        out = run(family, x, severity, seed=0)
        assert not torch.equal(out, x)  # every family changes 8 × 8 digits, even at severity 1
        if family not in RANDOM:
            assert torch.equal(out, run(family, x, severity, seed=99))


@pytest.mark.parametrize("family", FAULT_FAMILIES)
@pytest.mark.parametrize("shape", [(32, 1, 8, 8), (8, 3, 32, 32)])
def test_severity_is_monotone_on_average(family, shape):
    """Mean |x' − x| is non-decreasing in the severity (a generator seeded alike at every severity)."""
    x = images(*shape, seed=11)
    means = [(run(family, x, s, seed=5) - x).abs().mean().item() for s in SEVERITIES]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(means)), means
    if family != "black_frame":
        assert means[-1] > means[0]


def test_half_precision_is_kept():
    x = images(2, 1, 8, 8, dtype=torch.float16)
    for family in FAULT_FAMILIES:
        if family in ADVERSARIAL:
            continue
        out = run(family, x, 3)
        assert out.dtype == torch.float16 and out.shape == x.shape


def test_input_is_not_modified_and_grad_is_detached():
    x = images(2, 3, 8, 8).requires_grad_(True)
    before = x.detach().clone()
    for family in FAULT_FAMILIES:
        out = run(family, x, 5)
        assert not out.requires_grad
    assert torch.equal(x.detach(), before)


# ----------------------------------------------------------------------------- make_fault_data


def test_fault_seed_is_sha256_of_seed_family_severity():
    digest = hashlib.sha256(b"pytest-dnnsafety/faults:3:haze:2").digest()
    assert faults._fault_seed(3, "haze", 2) == int.from_bytes(digest[:8], "big") & (2**63 - 1)
    assert faults._fault_seed(3, "haze", 2) != faults._fault_seed(3, "haze", 3)


def test_make_fault_data_batches_seeds_and_passes_labels_through():
    x = images(10, 1, 8, 8)
    y = labels(10)
    a, ya = make_fault_data("gaussian_noise", x, y, 2, seed=3, batch_size=4)
    b, _ = make_fault_data("gaussian_noise", x, y, 2, seed=3, batch_size=4)
    assert ya is y and torch.equal(a, b)
    assert not torch.equal(a, make_fault_data("gaussian_noise", x, y, 2, seed=4, batch_size=4)[0])
    # one batch: the same as apply_fault with the generator seeded from (seed, family, severity)
    whole, none = make_fault_data("rotation", x, None, 4, seed=3, batch_size=256)
    g = torch.Generator().manual_seed(faults._fault_seed(3, "rotation", 4))
    assert none is None and torch.equal(whole, apply_fault("rotation", x, 4, generator=g))
    # batches: the generator runs on through them (rows drawn batch by batch)
    g = torch.Generator().manual_seed(faults._fault_seed(0, "zeroed_rows", 3))
    want = torch.cat([apply_fault("zeroed_rows", x[i:i + 3], 3, generator=g) for i in range(0, 10, 3)])
    assert torch.equal(make_fault_data("zeroed_rows", x, y, 3, seed=0, batch_size=3)[0], want)
    model = tiny_model(64)
    adv, _ = make_fault_data("pgd", x, y, 5, seed=0, model=model, batch_size=3)
    assert (adv - x).abs().max() <= 16 / 255 + 1e-12
    empty, _ = make_fault_data("haze", x[:0], None, 1, seed=0)
    assert empty.shape == (0, 1, 8, 8)


@pytest.mark.slow
def test_make_fault_data_is_stable_across_processes():
    code = (
        "import torch, hashlib\n"
        "from pytest_dnnsafety.engines.monitors.faults import make_fault_data\n"
        "x = torch.linspace(0, 1, 2*3*8*8, dtype=torch.float64).reshape(2, 3, 8, 8)\n"
        "out = [make_fault_data(f, x, None, 3, seed=7)[0] for f in ('gaussian_noise', 'shifted_rows', 'haze')]\n"
        "print(hashlib.sha256(b''.join(o.numpy().tobytes() for o in out)).hexdigest())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    x = torch.linspace(0, 1, 2 * 3 * 8 * 8, dtype=torch.float64).reshape(2, 3, 8, 8)
    out = [make_fault_data(f, x, None, 3, seed=7)[0] for f in ("gaussian_noise", "shifted_rows", "haze")]
    here = hashlib.sha256(b"".join(o.numpy().tobytes() for o in out)).hexdigest()
    assert there.stdout.strip() == here


def test_make_fault_data_bad_arguments():
    x = images(3, 1, 8, 8)
    with pytest.raises(ConfigError, match="seed="):
        make_fault_data("haze", x, None, 1, seed=1.5)
    with pytest.raises(ConfigError, match="batch_size=0"):
        make_fault_data("haze", x, None, 1, seed=0, batch_size=0)
    with pytest.raises(DataError, match=r"shape \(2,\)"):
        make_fault_data("haze", x, labels(2), 1, seed=0)
    with pytest.raises(ConfigError, match=r"severity=6.*use an int in 1\.\.5"):
        make_fault_data("haze", x, None, 6, seed=0)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_family_names():
    x = images(2)
    with pytest.raises(ConfigError, match=r"family='fog'.*Known names: groups: noise = \[.*'novel'"):
        apply_fault("fog", x, 1, generator=gen())
    with pytest.raises(ConfigError, match=r"family='noise' is a group.*expand_faults"):
        apply_fault("noise", x, 1, generator=gen())
    with pytest.raises(ConfigError, match=r"data-provided"):
        apply_fault(NOVEL, x, 1, generator=gen())
    with pytest.raises(ConfigError, match=r"data-provided"):
        make_fault_data(NOVEL, x, None, 1, seed=0)


@pytest.mark.parametrize("severity", [0, 6, -1, 2.0, True, "1", None])
def test_bad_severity(severity):
    with pytest.raises(ConfigError, match=rf"severity={severity!r}.*Fix: use an int in 1\.\.5"):
        apply_fault("brightness", images(2), severity, generator=gen())


@pytest.mark.parametrize("family", SPATIAL)
def test_spatial_families_refuse_vectors(family):
    with pytest.raises(DataError, match=rf"{family}.*spatial.*shape \(4, 10\).*Fix"):
        apply_fault(family, torch.rand(4, 10), 1, generator=gen())
    with pytest.raises(DataError, match=r"spatial.*shape \(1, 2, 3, 4, 5\)"):
        apply_fault(family, torch.rand(1, 2, 3, 4, 5), 1, generator=gen())


@pytest.mark.parametrize("family", ["zeroed_rows", "copied_rows", "shifted_rows"])
def test_row_families_need_two_rows(family):
    with pytest.raises(DataError, match="at least 2 rows"):
        apply_fault(family, torch.rand(2, 3, 1, 8), 1, generator=gen())


def test_bad_inputs():
    x = images(2)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        apply_fault("brightness", bad, 1, generator=gen())
    with pytest.raises(DataError, match=r"values in \[0.*, 1\.49.*\], outside clip=\(0\.0, 1\.0\).*Fix: rescale"):
        apply_fault("brightness", x * 1.5, 1, generator=gen())
    with pytest.raises(DataError, match="dtype torch.uint8.*Fix"):
        apply_fault("brightness", (x * 255).to(torch.uint8), 1, generator=gen())
    with pytest.raises(DataError, match=r"shape \(5,\).*batch"):
        apply_fault("brightness", torch.rand(5), 1, generator=gen())
    with pytest.raises(DataError, match="not a torch tensor"):
        apply_fault("brightness", np.zeros((2, 3)), 1, generator=gen())
    with pytest.raises(ConfigError, match="generator=None.*torch.Generator"):
        apply_fault("brightness", x, 1, generator=None)
    with pytest.raises(ConfigError, match="clip="):
        apply_fault("brightness", x, 1, generator=gen(), clip=(1.0, 0.0))
    with pytest.raises(DataError, match="shot_noise.*non-negative"):
        apply_fault("shot_noise", x - 0.5, 1, generator=gen(), clip=None)
    assert apply_fault("brightness", x[:0], 1, generator=gen()).shape == (0, 3, 8, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_and_determinism():
    x = images(4, 3, 16, 16, dtype=torch.float32).cuda()
    model = tiny_model(3 * 16 * 16, dtype=torch.float32).cuda()
    y = labels(4).cuda()
    for family in FAULT_FAMILIES:
        kw = {"model": model} if family in ADVERSARIAL else {}
        a, _ = make_fault_data(family, x, y, 3, seed=1, **kw)
        b, _ = make_fault_data(family, x, y, 3, seed=1, **kw)
        assert a.device == x.device and a.dtype == x.dtype and torch.equal(a, b)
        c = apply_fault(family, x, 3, generator=torch.Generator(device="cuda").manual_seed(0), y=y, **kw)
        assert c.device == x.device and 0 <= c.min() and c.max() <= 1
        d = apply_fault(family, x, 3, generator=gen(0), y=y, **kw)  # a CPU generator: drawn there, moved
        assert d.device == x.device and 0 <= d.min() and d.max() <= 1
        if family not in ADVERSARIAL:
            h = apply_fault(family, x.half(), 3, generator=torch.Generator(device="cuda").manual_seed(0))
            assert h.dtype == torch.float16 and h.device == x.device
