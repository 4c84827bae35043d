"""Photometric shifts: brightness, contrast and haze.

Hendrycks & Dietterich 2019 (ICLR) corrupt brightness, contrast and fog; Cheng et al. 2018 (§II-D,
eq. 4) list such simple transformers beside the gradient attacks. Here they act on every value
(grey or colour images, feature vectors), as batched torch transforms ``f(x, parameter, generator,
clip)`` that keep the input's shape, dtype and device and clamp to ``clip``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_dnnsafety.engines.perturb.common import clamp, draw, images, value_range

__all__ = ["brightness", "contrast", "haze", "haze_field"]


def brightness(x: Tensor, delta: float, generator: torch.Generator | None = None,
               clip: tuple[float, float] | None = None) -> Tensor:
    """``x + delta`` (draws nothing)."""
    return clamp(x + delta, clip)


def contrast(x: Tensor, factor: float, generator: torch.Generator | None = None,
             clip: tuple[float, float] | None = None) -> Tensor:
    """``m + (x − m)·factor``, ``m`` each input's mean over all its values (draws nothing)."""
    m = x.reshape(x.shape[0], -1).mean(dim=1).reshape((-1,) + (1,) * (x.ndim - 1))
    return clamp(m + (x - m) * factor, clip)


def haze_field(n: int, h: int, w: int, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """A smooth random field in [0, 1] per input ``(N, 1, H, W)``: a coarse Gaussian grid, bilinear, min–max.

    The grid is 2 × 2 below 16 px, else 4 × 4 (one ``randn(N, 1, g, g)`` draw), upsampled with
    ``align_corners=True`` and min–max normalised per input: a batched stand-in for the
    diamond-square plasma of Hendrycks & Dietterich's ``fog``.
    """
    g = 2 if min(h, w) < 16 else 4
    z = draw("randn", (n, 1, g, g), like, generator)
    up = F.interpolate(z, size=(h, w), mode="bilinear", align_corners=True)
    flat = up.reshape(n, -1)
    lo, hi = flat.amin(dim=1), flat.amax(dim=1)
    return ((flat - lo[:, None]) / (hi - lo).clamp_min(1e-12)[:, None]).reshape(n, 1, h, w)


def haze(x: Tensor, amount: float, generator: torch.Generator | None = None,
         clip: tuple[float, float] | None = None) -> Tensor:
    """``x·(1 − a) + a·field`` with ``a = amount`` and ``field = lo + w·(½ + ½·p)``, ``p`` = :func:`haze_field`.

    The field lies in the bright half of the range; fog's ``(x + c·p)·max/(max + c)`` gives a
    bright pixel the weight ``a = c/(1 + c)``. Images only.
    """
    imgs = images(x, "haze")
    n, _, h, w = imgs.shape
    lo, width = value_range(clip)
    field = lo + width * (0.5 + 0.5 * haze_field(n, h, w, imgs, generator))
    return clamp((imgs * (1.0 - amount) + amount * field).reshape(x.shape), clip)
