"""Gradient attacks (FGSM, PGD) and the perturbation families of M_adv (Cheng et al. 2018, §II-D, eq. 4).

The attacks are checked against straightforward per-image reference loops written here; the
families against their definitions (module table of ``perturbations``); hypothesis checks that
every output stays in its ε-ball and in the clip range.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.perturb.adversarial import (
    detect_outputs,
    fgsm,
    input_gradient,
    log_probs,
    pgd,
)
from pytest_dnnsafety.engines.robustness.perturbations import (
    FAMILIES,
    family_name,
    make_family,
    worst_of,
)
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard, probing

NATURAL = ("gaussian_noise", "brightness", "contrast", "blur", "rotation", "translation", "occlusion")
ATTACKS = ("fgsm", "fgsm_l2", "pgd", "pgd_l2")


def small_mlp(dtype: torch.dtype = torch.float64, seed: int = 3) -> nn.Module:
    """A smooth random MLP on (N, 1, 4, 4) inputs: gradients have no zero components, so signs are stable."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4)).to(dtype).eval()


def small_cnn(seed: int = 0) -> nn.Module:
    """An untrained conv net on digits (N, 1, 8, 8): fast to build, enough for the ball properties."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)).eval()


def toy_data(n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (n,), generator=gen)
    return x, y


# ----------------------------------------------------------------------------- reference implementations


def ref_grad(model: nn.Module, xi: torch.Tensor, yi: torch.Tensor, loss: str = "ce") -> tuple[float, torch.Tensor]:
    """Loss and gradient for ONE image (batch of 1), written plainly."""
    xi = xi.clone().requires_grad_(True)
    logits = model(xi.unsqueeze(0))[0]
    lp = torch.log_softmax(logits, dim=0)
    if loss == "ce":
        value = -lp[yi]
    else:
        value = max(lp[j] for j in range(lp.shape[0]) if j != int(yi)) - lp[yi]
    (g,) = torch.autograd.grad(value, xi)
    return float(value.detach()), g


def ref_fgsm(model, x, y, eps, norm, clip=None):
    out = []
    for i in range(x.shape[0]):
        _, g = ref_grad(model, x[i], y[i])
        step = g.sign() if norm == "linf" else g / g.norm()
        xi = x[i] + eps * step
        if clip is not None:
            xi = xi.clamp(*clip)
        out.append(xi)
    return torch.stack(out)


def ref_pgd(model, x, y, eps, norm, steps, step_size, clip=None, loss="ce"):
    """PGD without random start, one image at a time, keeping the iterate with the highest loss."""
    out = []
    for i in range(x.shape[0]):
        x0, xa = x[i], x[i].clone()
        best, best_loss = xa, -math.inf
        for _ in range(steps):
            value, g = ref_grad(model, xa, y[i], loss)
            if value > best_loss:
                best, best_loss = xa, value
            step = g.sign() if norm == "linf" else g / g.norm()
            xa = xa + step_size * step
            delta = xa - x0
            if norm == "linf":
                delta = delta.clamp(-eps, eps)
            elif delta.norm() > eps:
                delta = delta * (eps / delta.norm())
            xa = x0 + delta
            if clip is not None:
                xa = xa.clamp(*clip)
        value, _ = ref_grad(model, xa, y[i], loss)
        if value > best_loss:
            best = xa
        out.append(best.detach())
    return torch.stack(out)


# ----------------------------------------------------------------------------- attacks = references


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("clip", [None, (0.0, 1.0)])
def test_fgsm_equals_reference(norm, clip):
    model, (x, y) = small_mlp(), toy_data()
    got = fgsm(model, x, y, 0.07, norm=norm, clip=clip)
    torch.testing.assert_close(got, ref_fgsm(model, x, y, 0.07, norm, clip), atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("clip", [None, (0.0, 1.0)])
@pytest.mark.parametrize("loss", ["ce", "margin"])
def test_pgd_equals_reference(norm, clip, loss):
    model, (x, y) = small_mlp(), toy_data()
    eps = 0.1 if norm == "linf" else 0.4
    got = pgd(model, x, y, eps, norm=norm, steps=6, random_start=False, clip=clip, loss=loss)
    want = ref_pgd(model, x, y, eps, norm, 6, 2.5 * eps / 6, clip, loss)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_pgd_random_start_reproducible_and_in_ball():
    model, (x, y) = small_mlp(), toy_data()
    for norm, eps in (("linf", 0.1), ("l2", 0.3)):
        a = pgd(model, x, y, eps, torch.Generator().manual_seed(5), norm=norm, steps=2, step_size=eps / 10)
        b = pgd(model, x, y, eps, torch.Generator().manual_seed(5), norm=norm, steps=2, step_size=eps / 10)
        c = pgd(model, x, y, eps, torch.Generator().manual_seed(6), norm=norm, steps=2, step_size=eps / 10)
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
        start = pgd(model, x, y, eps, torch.Generator().manual_seed(5), norm=norm, steps=0)
        d = (start - x).flatten(1)
        size = d.abs().amax(1) if norm == "linf" else d.norm(dim=1)
        assert bool((size <= eps + 1e-9).all()) and bool((size > 0).all())


def test_pgd_never_worse_than_its_start_and_beats_fgsm_on_digits():
    model = digits_cnn()
    x, y = digits_images(200)

    def ce(xa):
        return F.cross_entropy(model(xa), y, reduction="none")

    with torch.no_grad():
        clean = ce(x)
        adv_pgd = ce(pgd(model, x, y, 0.1, steps=10, random_start=False, clip=(0, 1)))
        adv_fgsm = ce(fgsm(model, x, y, 0.1, clip=(0, 1)))
    assert bool((adv_pgd >= clean - 1e-5).all())  # the start (x) is one of the iterates kept
    assert float(adv_pgd.mean()) >= float(adv_fgsm.mean())
    assert float((adv_pgd >= adv_fgsm - 1e-5).float().mean()) >= 0.8


class Counting(nn.Module):
    """Counts forward calls (with their batch sizes) and backward passes through the output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.forwards: list[int] = []
        self.backwards = 0

    def forward(self, x):
        if not probing():  # the guard's determinism probe (once per model) is not a step
            self.forwards.append(x.shape[0])
        out = self.inner(x)
        if out.requires_grad:
            out.register_hook(self._count)
        return out

    def _count(self, grad):
        self.backwards += 1
        return grad


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_is_one_forward_and_one_backward_per_step(norm):
    model, (x, y) = Counting(small_mlp()), toy_data()
    guard = ForwardGuard("test")
    pgd(model, x, y, 0.1, torch.Generator().manual_seed(0), norm=norm, steps=7, guard=guard)
    assert model.forwards == [x.shape[0]] * 8  # 7 steps + the final iterate, always the whole batch
    assert model.backwards == 7
    assert guard.batches == 8
    guard.check()
    fgsm_model = Counting(small_mlp())
    fgsm(fgsm_model, x, y, 0.1, norm=norm)
    assert fgsm_model.forwards == [x.shape[0]] and fgsm_model.backwards == 1


def test_parameters_untouched():
    model, (x, y) = small_mlp(), toy_data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pgd(model, x, y, 0.1, steps=2)
    g = input_gradient(model, x, lambda out: -log_probs(out, "logits")[:, 0])
    assert g.shape == x.shape
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training


class NoGradModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        with torch.no_grad():
            return self.lin(x.flatten(1))


class Detaching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x.detach().flatten(1).float())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", ["script_no_grad", "no_grad", "detached", "inference_mode"])
def test_non_differentiable_model_is_a_clear_error(kind):
    x, y = toy_data()
    x = x.float()
    model = {"script_no_grad": lambda: torch.jit.script(NoGradModel()), "no_grad": NoGradModel,
             "detached": Detaching, "inference_mode": NoGradModel}[kind]()
    for attack in (fgsm, pgd):
        with pytest.raises(MetricError, match="differentiable") as info:
            if kind == "inference_mode":
                with torch.inference_mode():
                    attack(model, x, y, 0.1)
            else:
                attack(model, x, y, 0.1)
        assert "Fix" in str(info.value) and "non-gradient" in str(info.value)


def test_detect_outputs_and_log_probs():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 0.3]])
    probs = torch.softmax(logits, 1)
    assert detect_outputs(logits) == "logits"
    assert detect_outputs(probs) == "probabilities"
    assert detect_outputs(torch.tensor([[0.2, 0.3], [0.5, 0.4]])) == "logits"  # rows do not sum to 1
    torch.testing.assert_close(log_probs(logits, "logits"), torch.log(probs))
    torch.testing.assert_close(log_probs(probs, "probabilities"), torch.log(probs))
    zero = log_probs(torch.tensor([[0.0, 1.0]], dtype=torch.float64), "probabilities")
    assert zero.dtype == torch.float64 and float(zero[0, 0]) == pytest.approx(math.log(1e-12))
    with pytest.raises(ConfigError, match="outputs"):
        log_probs(logits, "scores")


def test_attacks_on_a_probability_model():
    base = small_mlp()
    model = nn.Sequential(base, nn.Softmax(dim=1))
    x, y = toy_data()
    a = pgd(model, x, y, 0.1, steps=4, random_start=False, outputs="probabilities")
    b = pgd(base, x, y, 0.1, steps=4, random_start=False, outputs="logits")
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def test_attacks_on_flat_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.rand(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    out = pgd(model, x, y, 0.2, torch.Generator().manual_seed(0), norm="l2", steps=3)
    assert out.shape == x.shape and bool(((out - x).norm(dim=1) <= 0.2 + 1e-9).all())


def test_bad_attack_arguments():
    model, (x, y) = small_mlp(), toy_data()
    with pytest.raises(ConfigError, match="norm"):
        pgd(model, x, y, 0.1, norm="l1")
    with pytest.raises(ConfigError, match="eps"):
        fgsm(model, x, y, float("nan"))
    with pytest.raises(ConfigError, match="loss"):
        pgd(model, x, y, 0.1, loss="hinge")
    with pytest.raises(ConfigError, match="clip"):
        pgd(model, x, y, 0.1, clip=(1.0, 0.0))
    with pytest.raises(MetricError, match="label"):
        fgsm(model, x, y[:2], 0.1)


# ----------------------------------------------------------------------------- balls (hypothesis)


def _ball_size(delta: torch.Tensor, norm: str) -> torch.Tensor:
    flat = delta.flatten(1)
    return flat.abs().amax(1) if norm == "linf" else flat.norm(dim=1)


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(ATTACKS),
    eps=st.floats(0.01, 0.6),
    seed=st.integers(0, 2**31 - 1),
    clipped=st.booleans(),
    steps=st.integers(0, 4),
)
def test_attacks_stay_in_ball_and_clip(name, eps, seed, clipped, steps):
    model = small_cnn()
    x, y = digits_images(8)
    clip = (0.0, 1.0) if clipped else None
    options = {"steps": steps} if name.startswith("pgd") else {}
    family = make_family(name, clip=clip, **options)
    out = family(model, x, y, eps, torch.Generator().manual_seed(seed))
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    assert bool((_ball_size(out - x, family.norm) <= eps + 1e-6).all())
    if clip:
        assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0


@settings(max_examples=14, deadline=None)
@given(name=st.sampled_from(NATURAL), eps=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       clipped=st.booleans())
def test_natural_families_stay_in_their_ball_and_clip(name, eps, seed, clipped):
    model = small_cnn()
    x, y = digits_images(8)
    clip = (0.0, 1.0) if clipped else None
    if name in ("rotation",):
        eps *= 45
    elif name in ("translation", "blur"):
        eps *= 3
    family = make_family(name, clip=clip)
    out = family(model, x, y, eps, torch.Generator().manual_seed(seed))
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    if clip:
        assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    delta = out - x
    if name == "brightness":
        assert bool((delta.abs() <= eps + 1e-6).all())
    if name == "contrast":
        m = x.flatten(1).mean(1).view(-1, 1, 1, 1)
        assert bool((delta.abs() <= eps * (x - m).abs() + 1e-6).all())
    if name == "occlusion":
        side = min(max(1, math.floor(eps * 8 + 0.5)), 8)
        assert bool(((delta != 0).flatten(1).sum(1) <= side * side).all())
    again = family(model, x, y, eps, torch.Generator().manual_seed(seed))
    assert torch.equal(out, again)  # deterministic given the generator


# ----------------------------------------------------------------------------- natural families on digits


@pytest.fixture(scope="module")
def digits():
    x, y = digits_images(32)
    return digits_cnn(), x, y


def _true_logp(model, x, y):
    with torch.no_grad():
        return log_probs(model(x), "logits").gather(1, y[:, None]).squeeze(1)


def _is_worst_of(model, out, y, candidates):
    """out equals, per input, the candidate with the lowest true-class log-probability."""
    scores = torch.stack([_true_logp(model, c, y) for c in candidates])
    pick = scores.argmin(0)
    want = torch.stack(candidates)[pick, torch.arange(y.shape[0])]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_gaussian_noise(digits):
    model, x, y = digits
    fam = make_family("gaussian_noise")
    out = fam(model, x, y, 0.2, torch.Generator().manual_seed(0))
    z = (out - x) / 0.2
    assert abs(float(z.mean())) < 0.1 and abs(float(z.std()) - 1) < 0.1
    assert not torch.equal(out, fam(model, x, y, 0.2, torch.Generator().manual_seed(1)))
    clipped = make_family("gaussian_noise", clip=(0, 1))(model, x, y, 0.2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(clipped, out.clamp(0, 1))


def test_brightness_and_contrast_pick_the_worse(digits):
    model, x, y = digits
    out = make_family("brightness", clip=(0, 1))(model, x, y, 0.15)
    _is_worst_of(model, out, y, [(x + 0.15).clamp(0, 1), (x - 0.15).clamp(0, 1)])
    out = make_family("contrast")(model, x, y, 0.3)
    m = x.mean(dim=(1, 2, 3), keepdim=True)
    _is_worst_of(model, out, y, [m + (x - m) * 1.3, m + (x - m) * 0.7])


def test_blur_equals_numpy_reference(digits):
    model, x, y = digits
    sigma = 0.8
    out = make_family("blur")(model, x, y, sigma)
    r = math.ceil(3 * sigma)
    t = np.arange(-r, r + 1)
    k = np.exp(-(t**2) / (2 * sigma**2))
    k /= k.sum()
    img = x[:4, 0].numpy().astype(np.float64)
    for i in range(4):
        p = np.pad(img[i], r, mode="reflect")
        ref = np.array([[sum(k[a] * k[b] * p[u + a, v + b] for a in range(2 * r + 1) for b in range(2 * r + 1))
                         for v in range(8)] for u in range(8)])
        np.testing.assert_allclose(out[i, 0].numpy(), ref, atol=1e-5)
    assert torch.equal(make_family("blur")(model, x, y, 0.0), x)
    assert torch.equal(make_family("blur")(model, x, y, 1e-300), x)  # no 0/0 in the kernel


def test_rotation_by_90_degrees_is_rot90(digits):
    model, x, y = digits
    out = make_family("rotation")(model, x, y, 90.0)
    _is_worst_of(model, out, y, [torch.rot90(x, 1, dims=(2, 3)), torch.rot90(x, -1, dims=(2, 3))])
    small = make_family("rotation", clip=(0, 1))(model, x, y, 10.0)
    assert not torch.equal(small, x) and float((small - x).abs().max()) < 1.0


def test_translation_by_one_pixel_is_a_shift(digits):
    model, x, y = digits
    out = make_family("translation", clip=(0, 1))(model, x, y, 1.0)
    z = torch.zeros_like(x)
    right = torch.cat([z[..., :1], x[..., :-1]], dim=3)
    left = torch.cat([x[..., 1:], z[..., :1]], dim=3)
    down = torch.cat([z[..., :1, :], x[..., :-1, :]], dim=2)
    up = torch.cat([x[..., 1:, :], z[..., :1, :]], dim=2)
    _is_worst_of(model, out, y, [right, left, down, up])


def test_occlusion_patches_one_square(digits):
    model, x, y = digits
    out = make_family("occlusion", clip=(0, 1))(model, x, y, 0.25)  # side 2, 3x3 positions
    candidates = []
    for top in (0, 3, 6):
        for left in (0, 3, 6):
            c = x.clone()
            c[..., top:top + 2, left:left + 2] = 0.0
            candidates.append(c)
    _is_worst_of(model, out, y, candidates)
    filled = make_family("occlusion", clip=(-1, 1))(model, x, y, 0.25)
    assert bool(((filled == -1).flatten(1).sum(1) == 4).all())


def test_worst_of_is_one_forward_of_all_candidates():
    model, (x, y) = Counting(small_mlp()), toy_data()
    out = worst_of(model, y, [x, x + 0.1, x - 0.1], "logits", ForwardGuard("test"))
    assert model.forwards == [3 * x.shape[0]] and out.shape == x.shape


def test_families_metadata_and_registry():
    assert set(FAMILIES) == set(NATURAL) | set(ATTACKS)
    for name in FAMILIES:
        fam = make_family(name)
        assert fam.name == name and family_name(fam) == name and fam.unit
        assert fam.gradient == (name in ATTACKS)
    assert make_family("pgd", norm="l2").name == "pgd_l2"
    assert make_family("pgd_l2").norm == "l2" and make_family("fgsm_l2").norm == "l2"

    def my_family(model, x, y, eps, generator):
        return x

    assert family_name(my_family) == "my_family"
    with pytest.raises(ConfigError, match="known families.*blur"):
        make_family("snow")
    with pytest.raises(ConfigError, match="steps"):
        make_family("blur", steps=3)
    with pytest.raises(ConfigError, match="steps"):
        make_family("pgd", steps=-1)


@pytest.mark.parametrize("name", ["blur", "rotation", "translation", "occlusion"])
def test_spatial_family_on_flat_input_is_a_clear_error(name):
    model = nn.Linear(6, 3)
    x, y = torch.rand(4, 6), torch.tensor([0, 1, 2, 0])
    with pytest.raises(MetricError, match=rf"{name}.*\(4, 6\).*Fix"):
        make_family(name)(model, x, y, 1.0)


def test_non_spatial_families_on_flat_input():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = torch.rand(4, 6), torch.tensor([0, 1, 2, 0])
    for name in ("gaussian_noise", "brightness", "contrast", *ATTACKS):
        assert make_family(name, clip=(0, 1))(model, x, y, 0.1, torch.Generator().manual_seed(0)).shape == x.shape


def test_family_outputs_auto_and_own_guard():
    base = small_mlp()
    probs = nn.Sequential(base, nn.Softmax(dim=1))
    x, y = toy_data()
    a = make_family("brightness", outputs="auto")(probs, x, y, 0.2)
    b = make_family("brightness")(base, x, y, 0.2)
    torch.testing.assert_close(a, b)

    class NaNModel(nn.Module):
        def forward(self, x):
            return torch.full((x.shape[0], 4), float("nan"))

    with pytest.raises(MetricError, match="brightness.*NaN"):
        make_family("brightness")(NaNModel(), x, y, 0.1)
