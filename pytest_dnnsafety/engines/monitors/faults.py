"""Fault families with severities 1–5: the out-of-distribution data a safety monitor is benchmarked on.

Ferreira, Arlat, Guiochet & Waeselynck, *Benchmarking Safety Monitors for Image Classifiers with
Machine Learning* (PRDC 2021), §II-B and §IV-A, build their benchmark data sets from five kinds of
out-of-distribution (OOD) data: novel classes, noise, distributional shift, anomalies and
adversarial inputs, the noise and shift transforms at severities 1 to 5 taken from the common
corruption benchmark of Hendrycks & Dietterich, *Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations* (ICLR 2019; constants from its CIFAR-10-C generator
``make_cifar_c.py``, for 32 × 32 images in [0, 1]). This module is that fault template as batched,
seeded torch transforms: each family is one transform of the perturbation library
:mod:`..perturb` (shared with the robustness families) at the severity's parameter. Novel classes
are data the user provides (:data:`NOVEL`), not a transform.

Per-severity parameters (``w`` = width of ``clip``, ``lo`` = its low end; with ``clip=None`` the
constants are read against the unit range, ``lo = 0``, ``w = 1``, and nothing is clamped):

==================  =======  ==========================================  ====================================
family              group    x'                                          severity 1 / 2 / 3 / 4 / 5
==================  =======  ==========================================  ====================================
``gaussian_noise``  noise    ``x + σ·w·z``, ``z ~ N(0, 1)``              σ = .04 / .06 / .08 / .09 / .10 [HD]
``shot_noise``      noise    ``lo + w·Poisson(λ·(x − lo)/w)/λ``           λ = 500 / 250 / 100 / 75 / 50 [HD]
``impulse_noise``   noise    a share of values set to ``lo`` or          share = .01 / .02 / .03 / .05 / .07
                             ``lo + w`` (salt or pepper, ½ each)         [HD, skimage ``s&p``]
``speckle_noise``   noise    ``x + (x − lo)·σ·z``                        σ = .06 / .10 / .12 / .16 / .20 [HD]
``gaussian_blur``   noise    Gaussian blur, σ in pixels × ``r``          σ = .4 / .6 / .7 / .8 / 1 px [HD]
``brightness``      shift    ``x + δ·w``                                 δ = .05 / .10 / .15 / .20 / .30 [HD]
``contrast``        shift    ``(x − m)·c + m``, ``m`` the input's mean   c = .75 / .50 / .40 / .30 / .15 [HD]
``haze``            shift    ``x·(1 − a) + a·field``                     a = c/(1+c) of fog's c = .2/.5/.75/1/1.5:
                                                                         a = .17 / .33 / .43 / .50 / .60 [HD]
``rotation``        shift    rotation by ``±θ`` (random sign per input)  θ = 6° / 12° / 18° / 24° / 30° [E]
``black_frame``     anomaly  every value ``lo`` (a dead frame)           the same at every severity
``zeroed_rows``     anomaly  ``k`` random rows per image set to ``lo``   ``k = ⌈p·H⌉`` (≥ 1, ≤ H − 1),
``copied_rows``     anomaly  ``k`` rows repeat the last kept row above   p = 5 / 10 / 20 / 30 / 50 %
``shifted_rows``    anomaly  ``k`` rows shifted ``±d`` px, ``lo`` fill   same k; ``d = ⌈s·W/32⌉``, s = 1/2/3/4/6
``fgsm``            adv.     :func:`~..perturb.fgsm`, L∞                 ε = 1 / 2 / 4 / 8 / 16 (/255) × w
``pgd``             adv.     :func:`~..perturb.pgd`, L∞,                 ε as fgsm [MM]
                             10 steps of 2.5ε/10, random start
==================  =======  ==========================================  ====================================

[HD] Hendrycks & Dietterich 2019, CIFAR-10-C constants. [E] Engstrom et al., *Exploring the
Landscape of Spatial Robustness* (ICML 2019): ±30° is their CIFAR rotation budget, the top
severity here. [MM] Goodfellow et al. 2015 (FGSM), Madry et al. 2018 (PGD); the ε ladder
1/255 … 16/255 doubles per severity around the usual CIFAR budget 8/255. The anomaly
parameters are ours: the paper names the anomalies (black frames, zeroed, copied and shifted
rows) without constants; severity 5 corrupts half of the rows.

Spatial parameters grow with the image: the blur σ is multiplied by ``r = max(1, min(H, W)/32)``
and the row shift is ``⌈s·W/32⌉`` pixels, so 32-pixel images get the CIFAR constants, larger
images proportionally larger ones, and the floors (``r ≥ 1``, ``d ≥ 1``, ``k ≥ 1`` row) keep 8 × 8
digits changing at severity 1 (at 8 px the shift is 1/1/1/1/2 px and the rows 1/1/2/3/4).
:func:`fault_parameters` gives the table per family (concrete for one image shape with
``shape=``).

Where we differ from CIFAR-10-C, and why:

* every family is one batched torch transform on the input's device (no per-image loop, no
  PIL/OpenCV/ImageMagick round trip, no uint8 quantisation), seeded by a ``torch.Generator``;
* the values are read against ``clip`` (any valid input range), not fixed [0, 255];
* ``brightness`` adds δ to every value rather than to the HSV value channel (it also works on
  grey images and feature vectors); ``contrast`` takes the mean over the whole input rather
  than per channel (the same for grey images; defined for vectors);
* ``gaussian_blur`` pads by reflection (scipy's ``mode='mirror'``) where skimage's default
  replicates the edge (``'nearest'``), which over-weights the border pixels; the kernel radius
  is scipy's ``⌊4σ + ½⌋`` (truncate = 4), capped at ``size − 1``;
* ``haze`` replaces the diamond-square plasma of ``fog`` by a coarse Gaussian random grid
  (2 × 2 below 16 px, else 4 × 4 per input) bilinearly upsampled and min–max normalised to
  [0, 1], shifted to the bright half of the range: ``field = lo + w·(½ + ½·p)``. The plasma
  is a sequential per-image recursion; the grid is one batched draw and equally smooth;
  the blend weight ``a = c/(1 + c)`` is what fog's ``(x + c·p)·max/(max + c)`` gives a bright
  pixel;
* ``rotation`` is not in CIFAR-10-C; the paper's benchmark uses rotated images.

Random draws, in this order, with ``generator`` (on the generator's device, then moved to
the input's; the tests reproduce them): noise — ``randn(x.shape)`` (gaussian, speckle),
``poisson(rates)`` (shot), ``rand(x.shape)`` then ``rand(x.shape)`` (impulse: flip, then salt);
haze — ``randn(N, 1, g, g)``; rotation — ``rand(N)`` (sign = + where < ½); rows —
``rand(N, H)`` (the ``k`` rows with the largest keys are hit), then for ``shifted_rows``
``rand(N, H)`` (shift right where < ½). ``gaussian_blur``, ``brightness``, ``contrast``,
``black_frame`` and ``fgsm`` draw nothing. Draws use the input's dtype (float32 for half
inputs, which are processed in float32 and cast back).

Monotone severities: for a fixed batch and a generator seeded alike at every severity, the mean
``|x' − x|`` is non-decreasing in the severity for every family. For most it holds per value:
the draws are the same, so noise, brightness and FGSM scale one perturbation up (clamping is
monotone), contrast and haze move each value further along one line, impulse noise and the
row families hit nested sets (the top-``k`` keys for a larger ``k``). Shot noise (Poisson
draws at another rate), rotation (a larger angle), copied rows (the source row moves further
up), shifted rows (a larger shift) and PGD are monotone on average. ``black_frame`` is constant
in the severity (non-decreasing, trivially). No family is excluded. :func:`make_fault_data`
seeds each severity separately (from ``(seed, family, severity)``), so across its data sets
monotonicity is in expectation.

Inputs: ``(N, C, H, W)`` or ``(N, H, W)`` images for every family; ``(N, d)`` (any ``(N, ...)``)
for the pointwise ones (noise except blur, brightness, contrast, black_frame, adversarial). Values
must be finite and inside ``clip``. Outputs have the input's shape, dtype and device and lie in
``clip``.
"""

from __future__ import annotations

import difflib
import hashlib
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines import perturb
from pytest_dnnsafety.engines.core.budget import chunk_size, spans
from pytest_dnnsafety.engines.perturb import fgsm, pgd
from pytest_dnnsafety.engines.perturb.common import as_images, check_clip, value_range

__all__ = [
    "FAULT_FAMILIES",
    "FAULT_GROUPS",
    "NOVEL",
    "SEVERITIES",
    "apply_fault",
    "check_severity",
    "expand_faults",
    "fault_parameters",
    "make_fault_data",
]

FAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "gaussian_blur"),
    "shift": ("brightness", "contrast", "haze", "rotation"),
    "anomaly": ("black_frame", "zeroed_rows", "copied_rows", "shifted_rows"),
    "adversarial": ("fgsm", "pgd"),
}
#: The data-provided family (novel classes): not a transform; the gate takes it from a fixture.
NOVEL = "novel"
#: Every transform family, in group order.
FAULT_FAMILIES: tuple[str, ...] = tuple(name for names in FAULT_GROUPS.values() for name in names)
SEVERITIES = (1, 2, 3, 4, 5)
#: Families that are the same at every severity: a benchmark evaluates them once and reports no severity.
SEVERITY_FREE = ("black_frame",)
#: Families whose inputs have no right answer: every decision on them counts as a model error (system view).
NO_RIGHT_ANSWER = (NOVEL, "black_frame", "zeroed_rows", "copied_rows", "shifted_rows")

#: Families that need images (N, C, H, W) or (N, H, W).
_SPATIAL = frozenset({"gaussian_blur", "haze", "rotation", "zeroed_rows", "copied_rows", "shifted_rows"})
_ROWS = ("zeroed_rows", "copied_rows", "shifted_rows")
_ADVERSARIAL = FAULT_GROUPS["adversarial"]

# --- per-severity constants (index = severity − 1); see the module table
_GAUSSIAN_SIGMA = (0.04, 0.06, 0.08, 0.09, 0.10)
_SHOT_LAMBDA = (500.0, 250.0, 100.0, 75.0, 50.0)
_IMPULSE_SHARE = (0.01, 0.02, 0.03, 0.05, 0.07)
_SPECKLE_SIGMA = (0.06, 0.10, 0.12, 0.16, 0.20)
_BLUR_SIGMA = (0.4, 0.6, 0.7, 0.8, 1.0)
_BRIGHTNESS = (0.05, 0.10, 0.15, 0.20, 0.30)
_CONTRAST = (0.75, 0.50, 0.40, 0.30, 0.15)
_FOG = (0.2, 0.5, 0.75, 1.0, 1.5)
_HAZE = tuple(c / (1.0 + c) for c in _FOG)
_ROTATION_DEG = (6.0, 12.0, 18.0, 24.0, 30.0)
_ROW_PERCENT = (5, 10, 20, 30, 50)
_ROW_SHIFT_AT_32 = (1, 2, 3, 4, 6)
_ADV_EPS_255 = (1, 2, 4, 8, 16)
_PGD_STEPS = 10
_BLUR_TRUNCATE = 4.0


# ----------------------------------------------------------------------------- names and severities


def _known_names() -> str:
    groups = ", ".join(f"{g} = {list(names)}" for g, names in FAULT_GROUPS.items())
    return f"groups: {groups}; and {NOVEL!r} (novel classes, data you provide)"


def _unknown(name: Any, argument: str) -> ConfigError:
    candidates = [*FAULT_FAMILIES, *FAULT_GROUPS, NOVEL]
    close = difflib.get_close_matches(str(name), candidates, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"{argument}={name!r} is not a fault family or group. Known names: {_known_names()}. "
                       f"Fix: {hint}use one of those names.")


def expand_faults(names: str | Sequence[str]) -> tuple[str, ...]:
    """Families named by ``names``: groups expand to their families, ``"novel"`` is kept; dedup'd, order kept.

    ``names`` is one name or a sequence of names (family, group or ``"novel"``). An unknown name,
    a non-string or an empty selection raises :class:`ConfigError` listing the known names.
    """
    items = [names] if isinstance(names, str) else names
    if not isinstance(items, Sequence) or isinstance(items, (bytes, bytearray)):
        raise ConfigError(f"faults={names!r} is not a name or a sequence of names. Known names: {_known_names()}. "
                          f"Fix: pass e.g. 'noise' or ['noise', 'fgsm', 'novel'].")
    out: list[str] = []
    for name in items:
        if not isinstance(name, str):
            raise ConfigError(f"faults: {name!r} in {names!r} is not a string. Fix: name families or groups as "
                              f"strings, e.g. ['noise', 'fgsm'].")
        if name in FAULT_GROUPS:
            out.extend(FAULT_GROUPS[name])
        elif name in FAULT_FAMILIES or name == NOVEL:
            out.append(name)
        else:
            raise _unknown(name, "faults")
    if not out:
        raise ConfigError(f"faults={names!r} names no fault family. Known names: {_known_names()}. "
                          f"Fix: name at least one family or group.")
    return tuple(dict.fromkeys(out))


def _severity(severity: Any) -> int:
    if isinstance(severity, bool) or not isinstance(severity, numbers.Integral) or not 1 <= int(severity) <= 5:
        raise ConfigError(f"severity={severity!r} is not a severity. Fix: use an int in 1..5.")
    return int(severity)


def check_severity(severity: Any) -> tuple[int, ...]:
    """``severity`` (an int or a sequence of ints in 1..5) as a tuple, dedup'd in order; else ConfigError."""
    if isinstance(severity, (str, bytes, Tensor)) or not isinstance(severity, (Iterable, numbers.Integral)):
        raise ConfigError(f"severity={severity!r} is not a severity. Fix: use an int in 1..5 or a sequence of them.")
    if isinstance(severity, numbers.Integral):
        return (_severity(severity),)
    values = list(severity)
    if not values:
        raise ConfigError(f"severity={severity!r} names no severity. Fix: use an int in 1..5 or a sequence of them.")
    return tuple(dict.fromkeys(_severity(s) for s in values))


def _family(family: Any) -> str:
    if family == NOVEL:
        raise ConfigError(f"family={NOVEL!r} is data-provided (novel classes), not a transform. Fix: give the "
                          f"novel-class data set itself; apply_fault/make_fault_data take one of {list(FAULT_FAMILIES)}.")
    if not isinstance(family, str) or family not in FAULT_FAMILIES:
        if isinstance(family, str) and family in FAULT_GROUPS:
            raise ConfigError(f"family={family!r} is a group, not a family. Fix: expand_faults({family!r}) gives its "
                              f"families {list(FAULT_GROUPS[family])}; transform with one at a time.")
        raise _unknown(family, "family")
    return family


# ----------------------------------------------------------------------------- parameters


def _blur_sigma(severity: int, h: int, w: int) -> float:
    return _BLUR_SIGMA[severity - 1] * max(1.0, min(h, w) / 32.0)


def _blur_radius(sigma: float, size: int) -> int:
    return min(perturb.blur_radius(sigma, _BLUR_TRUNCATE), size - 1)


def _row_count(severity: int, h: int) -> int:
    """``⌈p·H⌉`` rows, at least 1, at most ``H − 1`` (integer arithmetic: no float ceil surprises)."""
    return max(1, min(h - 1, (_ROW_PERCENT[severity - 1] * h + 99) // 100))


def _row_shift(severity: int, w: int) -> int:
    """``⌈s·W/32⌉`` pixels, at least 1, at most ``W``."""
    return max(1, min(w, (_ROW_SHIFT_AT_32[severity - 1] * w + 31) // 32))


def _describe(family: str, s: int, hw: tuple[int, int] | None) -> str:
    i = s - 1
    if family == "gaussian_noise":
        return f"σ = {_GAUSSIAN_SIGMA[i]:g} × clip width"
    if family == "shot_noise":
        return f"λ = {_SHOT_LAMBDA[i]:g} counts per clip width"
    if family == "impulse_noise":
        return f"{_IMPULSE_SHARE[i]:.0%} of values set to clip low or high (½ each)"
    if family == "speckle_noise":
        return f"σ = {_SPECKLE_SIGMA[i]:g} × (x − clip low)"
    if family == "gaussian_blur":
        if hw is None:
            return f"σ = {_BLUR_SIGMA[i]:g} px × max(1, min(H, W)/32), radius ⌊4σ + ½⌋"
        sigma = _blur_sigma(s, *hw)
        return f"σ = {sigma:g} px, radius {_blur_radius(sigma, min(hw))}"
    if family == "brightness":
        return f"δ = +{_BRIGHTNESS[i]:g} × clip width"
    if family == "contrast":
        return f"c = {_CONTRAST[i]:g}"
    if family == "haze":
        return f"a = {_HAZE[i]:.2f} towards a bright smooth random field (fog c = {_FOG[i]:g})"
    if family == "rotation":
        return f"±{_ROTATION_DEG[i]:g}° (random sign per input)"
    if family == "black_frame":
        return "every value at clip low (the same at every severity)"
    if hw is None:
        rows = f"⌈{_ROW_PERCENT[i]}% · H⌉ rows (≥ 1)"
    else:
        rows = f"{_row_count(s, hw[0])} of {hw[0]} rows"
    if family == "zeroed_rows":
        return f"{rows} set to clip low"
    if family == "copied_rows":
        return f"{rows} repeat the last kept row above"
    if family == "shifted_rows":
        shift = f"⌈{_ROW_SHIFT_AT_32[i]}·W/32⌉" if hw is None else f"{_row_shift(s, hw[1])}"
        return f"{rows} shifted ±{shift} px, clip-low fill"
    eps = f"ε = {_ADV_EPS_255[i]}/255 × clip width (L∞)"
    if family == "fgsm":
        return eps
    return f"{eps}, {_PGD_STEPS} steps of 2.5ε/{_PGD_STEPS}, random start"


def fault_parameters(family: str, *, shape: Sequence[int] | None = None) -> dict[int, str]:
    """Human-readable parameters per severity, e.g. ``{1: "σ = 0.04 × clip width", ...}``.

    ``shape`` (optional, an input shape ending in ``(H, W)``) makes the size-dependent parameters
    of the spatial families concrete. ``"novel"`` has no severities: ``{}``.
    """
    if family == NOVEL:
        return {}
    family = _family(family)
    hw: tuple[int, int] | None = None
    if shape is not None:
        dims = tuple(int(d) for d in shape)
        if len(dims) < 2 or min(dims[-2:]) < 1:
            raise ConfigError(f"shape={shape!r} does not end in (H, W). Fix: pass an image shape such as (3, 32, 32).")
        hw = (dims[-2], dims[-1])
    return {s: _describe(family, s, hw) for s in SEVERITIES}


# ----------------------------------------------------------------------------- validation


def _images(x: Tensor, family: str) -> Tensor:
    imgs = as_images(x)
    if imgs is not None:
        return imgs
    raise DataError(f"fault family {family!r} is spatial and needs images (N, C, H, W) or (N, H, W), but x has shape "
                    f"{tuple(x.shape)}. Fix: give the data its image shape, or drop {family!r} for non-image data "
                    f"(the pointwise families gaussian_noise, shot_noise, impulse_noise, speckle_noise, brightness, "
                    f"contrast, black_frame, fgsm and pgd work on any (N, ...) shape).")


def _check_x(family: str, x: Any, clip: tuple[float, float] | None) -> None:
    """Type, shape, finiteness and range of ``x`` (a few host syncs: call once per data set, not per batch)."""
    if not isinstance(x, Tensor):
        raise DataError(f"fault family {family!r}: x is a {type(x).__name__}, not a torch tensor. "
                        f"Fix: pass a float tensor (N, ...).")
    if not x.is_floating_point():
        raise DataError(f"fault family {family!r}: x has dtype {x.dtype}, not a floating-point dtype. Fix: convert it, "
                        f"e.g. x.float() / 255 for uint8 images, so that it lies in clip={clip}.")
    if x.ndim < 2:
        raise DataError(f"fault family {family!r}: x has shape {tuple(x.shape)}; need a batch (N, ...) of at least "
                        f"2 dimensions. Fix: add the batch dimension, e.g. x.unsqueeze(0).")
    if family in _SPATIAL:
        imgs = _images(x, family)
        if family in _ROWS and imgs.shape[-2] < 2:
            raise DataError(f"fault family {family!r} needs images with at least 2 rows, but x has shape "
                            f"{tuple(x.shape)}. Fix: use images (N, C, H, W) with H ≥ 2 or drop {family!r}.")
    if x.numel() == 0:
        return
    xd = x.detach()
    if not bool(torch.isfinite(xd).all()):
        raise DataError(f"fault family {family!r}: x contains NaN or infinite values. Fix: clean the data (every "
                        f"input value must be finite).")
    low, high = (float(v) for v in torch.aminmax(xd))
    if clip is not None and (low < clip[0] or high > clip[1]):
        raise DataError(f"fault family {family!r}: x has values in [{low:g}, {high:g}], outside clip={clip}. "
                        f"Fix: rescale x into {clip} or pass the input range of your data as clip=(low, high) "
                        f"(clip=None: no range, nothing clamped).")
    if clip is None and family == "shot_noise" and low < 0:
        raise DataError(f"fault family 'shot_noise' needs non-negative intensities with clip=None, but x has values "
                        f"down to {low:g}. Fix: pass the input range as clip=(low, high).")


def _check_generator(generator: Any) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator={generator!r} is not a torch.Generator. Fix: pass "
                          f"generator=torch.Generator(device=x.device).manual_seed(seed).")
    return generator


def _check_y(family: str, x: Tensor, y: Any) -> Tensor | None:
    if y is None:
        return None
    yt = torch.as_tensor(y)
    if yt.shape != (x.shape[0],) or yt.is_floating_point() or yt.is_complex() or yt.dtype == torch.bool:
        raise DataError(f"fault family {family!r}: y has shape {tuple(yt.shape)} and dtype {yt.dtype}; need one "
                        f"integer label per input, shape ({x.shape[0]},). Fix: pass the class indices of x.")
    return yt


def _check_attack_args(family: str, model: Any, y: Tensor | None) -> None:
    if family in _ADVERSARIAL and (model is None or y is None):
        missing = " and ".join(n for n, v in (("model", model), ("y", y)) if v is None)
        raise ConfigError(f"fault family {family!r} is a gradient attack and needs the model and the true labels; "
                          f"{missing} not given. Fix: pass model=<your nn.Module> and y=<class indices of x>.")


# ----------------------------------------------------------------------------- transforms


def _apply(family: str, x: Tensor, severity: int, generator: torch.Generator, y: Tensor | None, model: Any,
           clip: tuple[float, float] | None, outputs: str) -> Tensor:
    """The library transform at the severity's parameter (no validation, no host sync): the caller checked."""
    i = severity - 1
    _, width = value_range(clip)
    if family in _ADVERSARIAL:
        eps = _ADV_EPS_255[i] / 255.0 * width
        yd = y.to(device=x.device, dtype=torch.int64)  # type: ignore[union-attr]
        # chunks of the batch that fit the working-memory budget with a backward pass (one call when it fits)
        size = chunk_size(model, x, grad=True, extra=4 * x[0].numel() * x.element_size()) if x.shape[0] > 1 else 1
        if family == "fgsm":
            parts = [fgsm(model, x[a:b], yd[a:b], eps, generator, norm="linf", clip=clip, outputs=outputs)
                     for a, b in spans(x.shape[0], size)]
        else:
            parts = [pgd(model, x[a:b], yd[a:b], eps, generator, norm="linf", steps=_PGD_STEPS, clip=clip,
                         outputs=outputs) for a, b in spans(x.shape[0], size)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    xw = x.detach()
    if xw.dtype in (torch.float16, torch.bfloat16):
        xw = xw.float()
    h, w = xw.shape[-2:]
    if family == "gaussian_noise":
        out = perturb.gaussian_noise(xw, _GAUSSIAN_SIGMA[i] * width, generator, clip)
    elif family == "shot_noise":
        out = perturb.shot_noise(xw, _SHOT_LAMBDA[i], generator, clip)
    elif family == "impulse_noise":
        out = perturb.impulse_noise(xw, _IMPULSE_SHARE[i], generator, clip)
    elif family == "speckle_noise":
        out = perturb.speckle_noise(xw, _SPECKLE_SIGMA[i], generator, clip)
    elif family == "gaussian_blur":
        sigma = _blur_sigma(severity, h, w)
        out = perturb.blur(xw, sigma, generator, clip, radius=perturb.blur_radius(sigma, _BLUR_TRUNCATE))
    elif family == "brightness":
        out = perturb.brightness(xw, _BRIGHTNESS[i] * width, generator, clip)
    elif family == "contrast":
        out = perturb.contrast(xw, _CONTRAST[i], generator, clip)
    elif family == "haze":
        out = perturb.haze(xw, _HAZE[i], generator, clip)
    elif family == "rotation":
        out = perturb.random_rotation(xw, _ROTATION_DEG[i], generator, clip)
    elif family == "black_frame":
        out = perturb.black_frame(xw, None, generator, clip)
    elif family == "zeroed_rows":
        out = perturb.zeroed_rows(xw, _row_count(severity, h), generator, clip)
    elif family == "copied_rows":
        out = perturb.copied_rows(xw, _row_count(severity, h), generator, clip)
    else:  # shifted_rows
        out = perturb.shifted_rows(xw, _row_count(severity, h), generator, clip, shift=_row_shift(severity, w))
    return out.to(x.dtype)


def apply_fault(
    family: str,
    x: Tensor,
    severity: int,
    *,
    generator: torch.Generator,
    y: Tensor | None = None,
    model: Any = None,
    clip: tuple[float, float] | None = (0.0, 1.0),
    outputs: str = "logits",
) -> Tensor:
    """Fault family ``family`` at ``severity`` (1–5) applied to the batch ``x`` (see the module table).

    Returns a new tensor of ``x``'s shape, dtype and device, inside ``clip``; the same ``x`` and
    a generator seeded alike give the same result. ``x`` must be finite and inside ``clip``.
    The adversarial families (``fgsm``, ``pgd``) need ``model`` and the labels ``y`` (and
    ``outputs``: whether the model returns ``"logits"`` or ``"probabilities"``).

    Raises :class:`ConfigError` (unknown family, bad severity, clip or generator, attack without
    model/labels) or :class:`DataError` (x not a finite float batch inside ``clip``, a spatial
    family on non-images, labels of the wrong shape).
    """
    family = _family(family)
    severity = _severity(severity)
    clip = check_clip(clip)
    generator = _check_generator(generator)
    _check_x(family, x, clip)
    yt = _check_y(family, x, y)
    _check_attack_args(family, model, yt)
    if x.shape[0] == 0:
        return x.detach().clone()
    return _apply(family, x, severity, generator, yt, model, clip, outputs)


def _fault_seed(seed: int, family: str, severity: int) -> int:
    """A 63-bit seed from ``(seed, family, severity)`` by SHA-256: stable across processes and platforms."""
    digest = hashlib.sha256(f"pytest-dnnsafety/faults:{seed}:{family}:{severity}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def make_fault_data(
    family: str,
    x: Tensor,
    y: Tensor | None,
    severity: int,
    *,
    seed: int,
    model: Any = None,
    batch_size: int = 256,
    clip: tuple[float, float] | None = (0.0, 1.0),
    outputs: str = "logits",
) -> tuple[Tensor, Tensor | None]:
    """The fault data set ``(x', y)``: ``family`` at ``severity`` applied to ``x`` in batches of ``batch_size``.

    One generator on ``x``'s device, seeded by SHA-256 of ``(seed, family, severity)`` (never
    Python's salted ``hash``), runs through the batches in order, so the result is the same in
    every run and process for the same ``x``, ``batch_size`` and device kind. ``y`` is passed
    through unchanged (the label the model should still give for noise and shift; the gate
    decides how labels count). ``x`` is validated once, before the batches; the loop itself
    does not synchronise with the host.
    """
    family = _family(family)
    severity = _severity(severity)
    clip = check_clip(clip)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ConfigError(f"seed={seed!r} is not an int. Fix: pass an integer seed, e.g. seed=0.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} is not a positive int. Fix: e.g. batch_size=256.")
    _check_x(family, x, clip)
    yt = _check_y(family, x, y)
    _check_attack_args(family, model, yt)
    generator = torch.Generator(device=x.device)
    generator.manual_seed(_fault_seed(int(seed), family, severity))
    n, bs = x.shape[0], int(batch_size)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start in range(0, n, bs):
        stop = min(n, start + bs)
        yb = yt[start:stop] if yt is not None else None
        out[start:stop] = _apply(family, x[start:stop], severity, generator, yb, model, clip, outputs)
    return out, y
