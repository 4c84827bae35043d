"""The perturbation library (``engines/perturb``): each transform once, and both front-ends on top of it.

Every transform of :data:`TRANSFORMS` keeps the input's shape, dtype and device, lies inside
``clip``, leaves ``x`` alone and gives the same numbers for a generator seeded alike. Each is
checked against a reference written here on a tiny input: numpy formulas with the random draws
reproduced, ``scipy.ndimage.gaussian_filter`` for the blur, a per-pixel bilinear loop for the
warps, per-row loops for the row transforms. Then the robustness families (Cheng et al. 2018,
eq. 4) and the monitor fault families (Ferreira et al. 2021) are shown to return exactly the
library's output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import ndimage
from torch import nn

from pytest_dnnsafety.engines import perturb
from pytest_dnnsafety.engines.monitors import faults
from pytest_dnnsafety.engines.monitors.faults import FAULT_FAMILIES, apply_fault
from pytest_dnnsafety.engines.perturb import adversarial as attacks
from pytest_dnnsafety.engines.robustness.perturbations import make_family, worst_of
from pytest_dnnsafety.engines.core.guard import ForwardGuard

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: A parameter per transform (and options) that changes an 8 × 8 image visibly.
PARAMETERS: dict[str, tuple[object, dict]] = {
    "gaussian_noise": (0.1, {}),
    "shot_noise": (50.0, {}),
    "impulse_noise": (0.2, {}),
    "speckle_noise": (0.3, {}),
    "brightness": (0.2, {}),
    "contrast": (0.5, {}),
    "haze": (0.4, {}),
    "blur": (0.9, {}),
    "rotate": (17.0, {}),
    "random_rotation": (17.0, {}),
    "translate": ((1.5, -0.5), {}),
    "occlude": (3, {"top": 2, "left": 1}),
    "black_frame": (None, {}),
    "zeroed_rows": (3, {}),
    "copied_rows": (3, {}),
    "shifted_rows": (3, {"shift": 2}),
}
RANDOM = {"gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "haze", "random_rotation",
          "zeroed_rows", "copied_rows", "shifted_rows"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a loaded box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(n: int = 3, c: int = 2, h: int = 8, w: int = 8, seed: int = 7, dtype=torch.float64) -> torch.Tensor:
    return torch.rand(n, c, h, w, generator=gen(seed), dtype=dtype)


def call(name: str, x: torch.Tensor, seed: int = 0, clip=(0.0, 1.0)) -> torch.Tensor:
    parameter, options = PARAMETERS[name]
    return perturb.TRANSFORMS[name](x, parameter, gen(seed), clip, **options)


# ----------------------------------------------------------------------------- every transform


def test_the_table_covers_every_transform():
    assert set(PARAMETERS) == set(perturb.TRANSFORMS)
    assert perturb.fgsm is attacks.fgsm and perturb.pgd is attacks.pgd  # one implementation, two import paths


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_shape_dtype_device_clip_determinism(name, dtype, device):
    for clip in [(0.0, 1.0), (-1.0, 2.0)]:
        lo, hi = clip
        x = (lo + (hi - lo) * images(dtype=dtype)).to(device)
        before = x.clone()
        a, b = call(name, x, seed=3, clip=clip), call(name, x, seed=3, clip=clip)
        assert a.shape == x.shape and a.dtype == x.dtype and a.device == x.device
        assert bool(torch.isfinite(a).all()) and float(a.min()) >= lo and float(a.max()) <= hi
        assert torch.equal(a, b) and torch.equal(x, before) and a.data_ptr() != x.data_ptr()
        assert not torch.equal(a, x)
        other = call(name, x, seed=4, clip=clip)
        assert torch.equal(a, other) != (name in RANDOM)
        # (N, H, W) images: the same as one channel
        assert torch.equal(call(name, x[:, 0], seed=3, clip=clip), call(name, x[:, :1], seed=3, clip=clip)[:, 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_a_cpu_generator_gives_the_same_numbers_on_cuda(name):
    x = images(dtype=torch.float64)
    torch.testing.assert_close(call(name, x.cuda(), seed=5).cpu(), call(name, x, seed=5), atol=1e-12, rtol=0)


def test_clip_none_does_not_clamp():
    x = torch.ones(2, 5, dtype=torch.float64)
    assert torch.equal(perturb.brightness(x, 0.5), torch.full((2, 5), 1.5, dtype=torch.float64))
    assert torch.equal(perturb.brightness(x, 0.5, clip=(0.0, 1.0)), x)


# ----------------------------------------------------------------------------- known answers


@pytest.mark.parametrize("clip", [(0.0, 1.0), (-1.0, 1.0), None])
def test_noise_formulas(clip):
    lo, hi = clip if clip is not None else (0.0, 1.0)
    limit = (lambda a: np.clip(a, lo, hi)) if clip is not None else (lambda a: a)
    x = lo + (hi - lo) * images(2, 1, 3, 4)
    xn = x.numpy()
    z = torch.randn(x.shape, generator=gen(1), dtype=x.dtype).numpy()
    np.testing.assert_allclose(perturb.gaussian_noise(x, 0.3, gen(1), clip).numpy(), limit(xn + 0.3 * z), atol=1e-12)
    np.testing.assert_allclose(perturb.speckle_noise(x, 0.3, gen(1), clip).numpy(),
                               limit(xn + (xn - lo) * 0.3 * z), atol=1e-12)
    g = gen(2)
    u, v = (torch.rand(x.shape, generator=g, dtype=x.dtype).numpy() for _ in range(2))
    want = np.where(u < 0.25, np.where(v < 0.5, hi, lo), xn)
    np.testing.assert_array_equal(perturb.impulse_noise(x, 0.25, gen(2), clip).numpy(), want)
    counts = torch.poisson(torch.as_tensor((xn - lo) * 40 / (hi - lo)), generator=gen(3)).numpy()
    np.testing.assert_allclose(perturb.shot_noise(x, 40.0, gen(3), clip).numpy(),
                               limit(lo + counts * (hi - lo) / 40), atol=1e-12)


def test_brightness_contrast_black_frame_formulas():
    x = images(2, 2, 3, 3)
    xn = x.numpy()
    np.testing.assert_allclose(perturb.brightness(x, -0.25, clip=(0.0, 1.0)).numpy(), np.clip(xn - 0.25, 0, 1))
    m = xn.reshape(2, -1).mean(axis=1).reshape(2, 1, 1, 1)
    np.testing.assert_allclose(perturb.contrast(x, 1.7).numpy(), m + (xn - m) * 1.7, atol=1e-12)
    vec = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)  # any (N, ...) shape: means 0.5 and 0.5
    assert perturb.contrast(vec, 0.5).tolist() == [[0.25, 0.75], [0.5, 0.5]]
    assert torch.equal(perturb.black_frame(x, None, clip=(-1.0, 1.0)), torch.full_like(x, -1.0))


def _bilinear_np(z: np.ndarray, h: int, w: int) -> np.ndarray:
    """align_corners=True bilinear upsampling of (g, g) to (h, w), separable with np.interp."""
    g = z.shape[0]
    rows, cols = np.linspace(0, g - 1, h), np.linspace(0, g - 1, w)
    tmp = np.stack([np.interp(cols, np.arange(g), z[r]) for r in range(g)])
    return np.stack([np.interp(rows, np.arange(g), tmp[:, j]) for j in range(w)], axis=1)


@pytest.mark.parametrize("hw", [(6, 9), (16, 17)])
def test_haze_formula(hw):
    h, w = hw
    x = images(2, 3, h, w)
    g = 2 if min(h, w) < 16 else 4
    z = torch.randn(2, 1, g, g, generator=gen(6), dtype=x.dtype).numpy()
    want = np.empty_like(x.numpy())
    for n in range(2):
        p = _bilinear_np(z[n, 0], h, w)
        p = (p - p.min()) / (p.max() - p.min())
        want[n] = x.numpy()[n] * 0.7 + 0.3 * (-1 + 2 * (0.5 + 0.5 * p))[None]
    np.testing.assert_allclose(perturb.haze(x, 0.3, gen(6), (-1.0, 1.0)).numpy(), want, atol=1e-12)


@pytest.mark.parametrize("sigma", [0.4, 0.9, 1.7])
@pytest.mark.parametrize("hw", [(5, 7), (12, 12)])
def test_blur_is_scipy_gaussian_filter_mirror(sigma, hw):
    x = images(2, 2, *hw)
    for radius in (None, math.ceil(3 * sigma)):
        r = perturb.blur_radius(sigma) if radius is None else radius
        if r >= min(hw):  # the radius is capped at size − 1 per axis: scipy has no such cap
            continue
        want = ndimage.gaussian_filter(x.numpy(), sigma=(0, 0, sigma, sigma), mode="mirror", truncate=r / sigma)
        np.testing.assert_allclose(perturb.blur(x, sigma, radius=radius).numpy(), want, atol=1e-12)
    assert perturb.blur_radius(1.0) == 4 and perturb.blur_radius(0.4) == 2  # scipy: int(4σ + ½)
    assert torch.equal(perturb.blur(x, 1e-300), x) and torch.equal(perturb.blur(x, 0.0), x)


def _warp_np(img: np.ndarray, theta: np.ndarray, fill: float) -> np.ndarray:
    """grid_sample(affine_grid(theta), bilinear, zeros, align_corners=False) + fill, pixel by pixel."""
    c, h, w = img.shape
    out = np.full_like(img, fill)
    for i in range(h):
        for j in range(w):
            xn, yn = (2 * j + 1) / w - 1, (2 * i + 1) / h - 1
            sx, sy = theta @ np.array([xn, yn, 1.0])
            px, py = ((sx + 1) * w - 1) / 2, ((sy + 1) * h - 1) / 2
            x0, y0 = math.floor(px), math.floor(py)
            acc = np.zeros(c)
            for yy, wy in ((y0, 1 - (py - y0)), (y0 + 1, py - y0)):
                for xx, wx in ((x0, 1 - (px - x0)), (x0 + 1, px - x0)):
                    if 0 <= yy < h and 0 <= xx < w:
                        acc += wy * wx * (img[:, yy, xx] - fill)
            out[:, i, j] = acc + fill
    return out


@pytest.mark.parametrize("degrees", [17.0, -40.0, 90.0])
def test_rotate_matches_a_bilinear_loop(degrees):
    x = images(2, 2, 5, 7)
    h, w = 5, 7
    r = math.radians(degrees)
    theta = np.array([[math.cos(r), -math.sin(r) * h / w, 0.0], [math.sin(r) * w / h, math.cos(r), 0.0]])
    got = perturb.rotate(x, degrees, clip=(-0.5, 1.0))
    for n in range(2):
        np.testing.assert_allclose(got[n].numpy(), np.clip(_warp_np(x[n].numpy(), theta, -0.5), -0.5, 1.0),
                                   atol=1e-12)
    square = images(3, 1, 6, 6)
    torch.testing.assert_close(perturb.rotate(square, 90.0), torch.rot90(square, 1, dims=(2, 3)), atol=1e-12, rtol=0)
    torch.testing.assert_close(perturb.rotate(square, -90.0), torch.rot90(square, -1, dims=(2, 3)), atol=1e-12,
                               rtol=0)
    torch.testing.assert_close(perturb.rotate(square, 0.0), square, atol=1e-15, rtol=0)
    np.testing.assert_allclose(perturb.rotation_map(30.0, 4, 8), [[math.sqrt(3) / 2, -0.25, 0.0],
                                                                  [1.0, math.sqrt(3) / 2, 0.0]], atol=1e-15)


def test_random_rotation_draws_one_sign_per_input():
    x = images(6, 1, 8, 8)
    sign = torch.where(torch.rand(6, generator=gen(2), dtype=x.dtype) < 0.5, 1.0, -1.0)
    assert len(set(sign.tolist())) == 2
    want = torch.cat([perturb.rotate(x[i:i + 1], float(sign[i]) * 25.0) for i in range(6)])
    assert torch.equal(perturb.random_rotation(x, 25.0, gen(2)), want)


def test_translate_matches_shifts_and_a_bilinear_loop():
    x = images(2, 2, 5, 6)
    got = perturb.translate(x, (2.0, -1.0), clip=(0.0, 1.0))
    want = torch.zeros_like(x)
    want[:, :, :-1, 2:] = x[:, :, 1:, :-2]  # right by 2, up by 1, fill 0
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    theta = np.array([[1.0, 0.0, -2 * 0.5 / 6], [0.0, 1.0, -2 * 1.25 / 5]])
    half = perturb.translate(x, (0.5, 1.25), fill=0.25)
    np.testing.assert_allclose(half[0].numpy(), _warp_np(x[0].numpy(), theta, 0.25), atol=1e-12)


def test_occlude_sets_one_square():
    x = images(2, 3, 6, 7)
    got = perturb.occlude(x, 2, top=1, left=4, clip=(-1.0, 1.0))
    want = x.clone()
    want[:, :, 1:3, 4:6] = -1.0
    assert torch.equal(got, want)
    assert torch.equal(perturb.occlude(x, 3, fill=0.5)[..., :3, :3], torch.full((2, 3, 3, 3), 0.5, dtype=x.dtype))


@pytest.mark.parametrize("count", [1, 3, 5])
def test_row_transforms_match_per_row_loops(count):
    n, c, h, w, lo, d = 3, 2, 6, 5, -1.0, 2
    x = lo + 2 * images(n, c, h, w)
    xn = x.numpy()
    g = gen(8)
    keys = torch.rand(n, h, generator=g, dtype=x.dtype)
    hit = [set(torch.argsort(keys[i], descending=True)[:count].tolist()) for i in range(n)]
    right = (torch.rand(n, h, generator=g, dtype=x.dtype) < 0.5).numpy()
    zeroed, copied, shifted = xn.copy(), xn.copy(), xn.copy()
    for i in range(n):
        kept = [r for r in range(h) if r not in hit[i]]
        last = None
        for r in range(h):
            if r not in hit[i]:
                last = r
                continue
            zeroed[i, :, r] = lo
            copied[i, :, r] = xn[i, :, last if last is not None else kept[0]]
            s = d if right[i, r] else -d
            for j in range(w):
                shifted[i, :, r, j] = xn[i, :, r, j - s] if 0 <= j - s < w else lo
    clip = (-1.0, 1.0)
    np.testing.assert_array_equal(perturb.zeroed_rows(x, count, gen(8), clip).numpy(), zeroed)
    np.testing.assert_array_equal(perturb.copied_rows(x, count, gen(8), clip).numpy(), copied)
    np.testing.assert_array_equal(perturb.shifted_rows(x, count, gen(8), clip, shift=d).numpy(), shifted)
    hit_t = torch.tensor([[True, True, False, True, False]])
    assert perturb.copy_source(hit_t).tolist() == [[2, 2, 2, 2, 4]]


# ----------------------------------------------------------------------------- the front-ends call the library


def _tiny_model(d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, 3)).to(torch.float64).eval()


#: Severity 3 of each non-adversarial fault family on 8 × 8 images in clip (−1, 1) (width 2): the library call.
FAULT_CALLS = {
    "gaussian_noise": lambda x, g: perturb.gaussian_noise(x, 0.08 * 2, g, (-1.0, 1.0)),
    "shot_noise": lambda x, g: perturb.shot_noise(x, 100.0, g, (-1.0, 1.0)),
    "impulse_noise": lambda x, g: perturb.impulse_noise(x, 0.03, g, (-1.0, 1.0)),
    "speckle_noise": lambda x, g: perturb.speckle_noise(x, 0.12, g, (-1.0, 1.0)),
    "gaussian_blur": lambda x, g: perturb.blur(x, 0.7, g, (-1.0, 1.0)),
    "brightness": lambda x, g: perturb.brightness(x, 0.15 * 2, g, (-1.0, 1.0)),
    "contrast": lambda x, g: perturb.contrast(x, 0.4, g, (-1.0, 1.0)),
    "haze": lambda x, g: perturb.haze(x, 0.75 / 1.75, g, (-1.0, 1.0)),
    "rotation": lambda x, g: perturb.random_rotation(x, 18.0, g, (-1.0, 1.0)),
    "black_frame": lambda x, g: perturb.black_frame(x, None, g, (-1.0, 1.0)),
    "zeroed_rows": lambda x, g: perturb.zeroed_rows(x, 2, g, (-1.0, 1.0)),
    "copied_rows": lambda x, g: perturb.copied_rows(x, 2, g, (-1.0, 1.0)),
    "shifted_rows": lambda x, g: perturb.shifted_rows(x, 2, g, (-1.0, 1.0), shift=1),
    "fgsm": lambda x, g: perturb.fgsm(_tiny_model(128), x, torch.arange(3) % 3, 4 / 255 * 2, g, clip=(-1.0, 1.0)),
    "pgd": lambda x, g: perturb.pgd(_tiny_model(128), x, torch.arange(3) % 3, 4 / 255 * 2, g, clip=(-1.0, 1.0)),
}


@pytest.mark.parametrize("family", FAULT_FAMILIES)
def test_fault_families_are_the_library_transforms(family):
    x = -1 + 2 * images(3, 2, 8, 8)
    kw = {"model": _tiny_model(128), "y": torch.arange(3) % 3} if family in ("fgsm", "pgd") else {}
    got = apply_fault(family, x, 3, generator=gen(4), clip=(-1.0, 1.0), **kw)
    assert torch.equal(got, FAULT_CALLS[family](x, gen(4)))
    assert set(FAULT_CALLS) == set(faults.FAULT_FAMILIES)


@pytest.mark.parametrize("name", ["gaussian_noise", "brightness", "contrast", "blur", "rotation", "translation",
                                  "occlusion", "fgsm", "pgd_l2"])
def test_robustness_families_are_the_library_transforms(name):
    x = images(4, 2, 8, 8)
    y = torch.tensor([0, 1, 2, 0])
    model, clip, eps = _tiny_model(128), (0.0, 1.0), {"rotation": 20.0, "translation": 1.5, "blur": 0.8,
                                                      "occlusion": 0.25}.get(name, 0.1)
    got = make_family(name, clip=clip)(model, x, y, eps, gen(9))

    def worst(candidates):
        return worst_of(model, y, candidates, "logits", ForwardGuard("test"))

    want = {
        "gaussian_noise": lambda: perturb.gaussian_noise(x, eps, gen(9), clip),
        "brightness": lambda: worst([perturb.brightness(x, eps, clip=clip), perturb.brightness(x, -eps, clip=clip)]),
        "contrast": lambda: worst([perturb.contrast(x, 1 + eps, clip=clip), perturb.contrast(x, 1 - eps, clip=clip)]),
        "blur": lambda: perturb.blur(x, eps, clip=clip, radius=math.ceil(3 * eps)),
        "rotation": lambda: worst([perturb.rotate(x, eps, clip=clip), perturb.rotate(x, -eps, clip=clip)]),
        "translation": lambda: worst([perturb.translate(x, s, clip=clip)
                                      for s in ((eps, 0.0), (-eps, 0.0), (0.0, eps), (0.0, -eps))]),
        "occlusion": lambda: worst([perturb.occlude(x, 2, clip=clip, top=t, left=left)
                                    for t in (0, 3, 6) for left in (0, 3, 6)]),
        "fgsm": lambda: perturb.fgsm(model, x, y, eps, gen(9), clip=clip),
        "pgd_l2": lambda: perturb.pgd(model, x, y, eps, gen(9), norm="l2", clip=clip),
    }[name]()
    assert torch.equal(got, want)
