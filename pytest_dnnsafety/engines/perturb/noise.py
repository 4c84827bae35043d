"""Noise: additive Gaussian, shot (Poisson), impulse (salt and pepper) and speckle noise.

The four noise corruptions of Hendrycks & Dietterich, *Benchmarking Neural Network Robustness to
Common Corruptions and Perturbations* (ICLR 2019), and the ``x + ε·N(0, 1)`` transformer of Cheng
et al. 2018 (§II-D, eq. 4), as batched torch transforms ``f(x, parameter, generator, clip)``:
one draw of the batch's shape per random field (see each function for the order of draws), the
result clamped to ``clip``, the input's shape, dtype and device kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pytest_dnnsafety.engines.perturb.common import clamp, draw, value_range

__all__ = ["gaussian_noise", "impulse_noise", "shot_noise", "speckle_noise"]


def gaussian_noise(x: Tensor, std: float, generator: torch.Generator | None = None,
                   clip: tuple[float, float] | None = None) -> Tensor:
    """``x + std·z``, ``z ~ N(0, 1)`` per element (one ``randn(x.shape)`` draw)."""
    return clamp(x + std * draw("randn", tuple(x.shape), x, generator), clip)


def shot_noise(x: Tensor, lam: float, generator: torch.Generator | None = None,
               clip: tuple[float, float] | None = None) -> Tensor:
    """``lo + w·Poisson(λ·(x − lo)/w)/λ``: photon counts at ``λ`` counts per range width ``w`` (one ``poisson`` draw).

    The rates are clamped at 0; the Poisson draw runs on the generator's device.
    """
    lo, width = value_range(clip)
    rates = ((x - lo) * (lam / width)).clamp_min(0.0)
    if generator is None:
        counts = torch.poisson(rates)
    else:
        counts = torch.poisson(rates.to(generator.device), generator=generator).to(x.device)
    return clamp(lo + counts * (width / lam), clip)


def impulse_noise(x: Tensor, share: float, generator: torch.Generator | None = None,
                  clip: tuple[float, float] | None = None) -> Tensor:
    """A ``share`` of the values set to ``lo`` (pepper) or ``lo + w`` (salt), ½ each (skimage's ``s&p``).

    Two ``rand(x.shape)`` draws: which values flip (``< share``), then which of them are salt (``< ½``).
    """
    lo, width = value_range(clip)
    shape = tuple(x.shape)
    flip = draw("rand", shape, x, generator) < share
    salt = draw("rand", shape, x, generator) < 0.5
    values = torch.where(salt, torch.full_like(x, lo + width), torch.full_like(x, lo))
    return clamp(torch.where(flip, values, x), clip)


def speckle_noise(x: Tensor, std: float, generator: torch.Generator | None = None,
                  clip: tuple[float, float] | None = None) -> Tensor:
    """``x + (x − lo)·std·z``, ``z ~ N(0, 1)``: multiplicative noise (one ``randn(x.shape)`` draw)."""
    lo, _ = value_range(clip)
    return clamp(x + (x - lo) * (std * draw("randn", tuple(x.shape), x, generator)), clip)
