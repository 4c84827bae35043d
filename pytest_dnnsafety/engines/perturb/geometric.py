"""Geometric transforms of images: Gaussian blur, rotation, translation.

Cheng et al. 2018 (§II-D, eq. 4) name "rotation, distortion" among the input transformers;
Hendrycks & Dietterich 2019 (ICLR) blur; Engstrom et al., *Exploring the Landscape of Spatial
Robustness* (ICML 2019), rotate and translate. Batched torch transforms ``f(x, parameter,
generator, clip)`` on images ``(N, C, H, W)`` or ``(N, H, W)``, keeping the input's shape, dtype
and device and clamping to ``clip``:

* :func:`blur` — separable depthwise convolution with a sampled Gaussian kernel, reflect padding
  (torch's ``'reflect'`` is scipy's ``mode='mirror'``: ``d c b | a b c d``), kernel radius
  scipy's ``⌊4σ + ½⌋`` unless given, capped at ``size − 1`` per axis;
* :func:`rotate` / :func:`random_rotation` / :func:`translate` — bilinear ``grid_sample`` through
  an affine map (:func:`warp`), uncovered pixels filled with ``fill`` (default ``clip``'s low
  end, 0 without one). The maps are computed on the host in float64, cast to the input's dtype
  and copied asynchronously to its device, so the same angle gives the same map on every
  device. Rotation is rigid in pixel space for non-square images too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_dnnsafety.engines.perturb.common import clamp, draw, fill_value, images

__all__ = ["blur", "blur_radius", "gaussian_kernel", "random_rotation", "rotate", "rotation_map", "translate", "warp"]

#: Below this sigma the neighbours' weight ``exp(−1/(2σ²))`` is 0 even in float64: blur is the identity.
_MIN_SIGMA = 1e-3


def gaussian_kernel(sigma: float, radius: int, like: Tensor) -> Tensor:
    """The sampled Gaussian ``exp(−t²/(2σ²))`` at ``t = −radius … radius``, normalised to sum 1 (``like``'s dtype)."""
    t = torch.arange(-radius, radius + 1, dtype=like.dtype, device=like.device)
    k = torch.exp(-(t * t) / (2.0 * sigma * sigma))
    return k / k.sum()


def blur_radius(sigma: float, truncate: float = 4.0) -> int:
    """scipy's kernel radius ``⌊truncate·σ + ½⌋`` (``scipy.ndimage.gaussian_filter``)."""
    return max(0, int(truncate * sigma + 0.5))


def blur(x: Tensor, sigma: float, generator: torch.Generator | None = None,
         clip: tuple[float, float] | None = None, *, radius: int | None = None) -> Tensor:
    """Gaussian blur with ``sigma`` pixels along both image axes, each channel alone (draws nothing).

    ``radius`` (default :func:`blur_radius`) is capped at ``size − 1`` per axis (reflect padding
    needs ``pad < size``). ``sigma < 10⁻³`` is the identity.
    """
    imgs = images(x, "blur")
    if sigma < _MIN_SIGMA:
        return clamp(x.clone(), clip)
    reach = blur_radius(sigma) if radius is None else radius
    n, c, h, w = imgs.shape
    out = imgs.reshape(n * c, 1, h, w)
    rw, rh = max(0, min(reach, w - 1)), max(0, min(reach, h - 1))
    if rw > 0:
        kw = gaussian_kernel(sigma, rw, imgs).reshape(1, 1, 1, -1)
        out = F.conv2d(F.pad(out, (rw, rw, 0, 0), mode="reflect"), kw)
    if rh > 0:
        kh = gaussian_kernel(sigma, rh, imgs).reshape(1, 1, -1, 1)
        out = F.conv2d(F.pad(out, (0, 0, rh, rh), mode="reflect"), kh)
    return clamp(out.reshape(x.shape), clip)


def warp(imgs: Tensor, theta: Tensor, fill: float) -> Tensor:
    """Bilinear ``grid_sample`` of ``imgs`` ``(N, C, H, W)`` through ``affine_grid(theta)``; outside = ``fill``.

    ``theta`` is one map ``(2, 3)`` or one per input ``(N, 2, 3)``, in ``affine_grid``'s normalised
    coordinates (``align_corners=False``).
    """
    n = imgs.shape[0]
    grid = F.affine_grid(theta.to(imgs.dtype).expand(n, 2, 3), list(imgs.shape), align_corners=False)
    return F.grid_sample(imgs - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def rotation_map(degrees: float, h: int, w: int) -> list[list[float]]:
    """The ``affine_grid`` map ``θ`` (2 × 3) of a rotation by ``degrees`` about the centre of an ``h`` × ``w`` image.

    The rotation in pixel space written in normalised coordinates, ``[[cos, −sin·H/W, 0],
    [sin·W/H, cos, 0]]`` (rigid for non-square images too), computed on the host in float64.
    """
    cos, sin = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    return [[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]]


def _maps(maps: list[list[list[float]]], like: Tensor) -> Tensor:
    """Host-built maps as one tensor in ``like``'s dtype, copied asynchronously to its device (no wait)."""
    return torch.tensor(maps, dtype=like.dtype).to(like.device, non_blocking=True)


def rotate(x: Tensor, degrees: float, generator: torch.Generator | None = None,
           clip: tuple[float, float] | None = None, *, fill: float | None = None) -> Tensor:
    """Rotation about the image centre by ``degrees`` (:func:`rotation_map`, bilinear); draws nothing."""
    imgs = images(x, "rotation")
    h, w = imgs.shape[-2:]
    theta = _maps([rotation_map(float(degrees), h, w)], imgs)[0]
    return clamp(warp(imgs, theta, fill_value(clip, fill)).reshape(x.shape), clip)


def random_rotation(x: Tensor, degrees: float, generator: torch.Generator | None = None,
                    clip: tuple[float, float] | None = None, *, fill: float | None = None) -> Tensor:
    """:func:`rotate` by ``+degrees`` or ``−degrees``, the sign drawn per input (one ``rand(N)``: + where < ½).

    Both maps are built on the host; each input picks its own on the device (no host round trip).
    """
    imgs = images(x, "rotation")
    n, _, h, w = imgs.shape
    maps = _maps([rotation_map(float(degrees), h, w), rotation_map(-float(degrees), h, w)], imgs)
    minus = (draw("rand", (n,), imgs, generator) >= 0.5).long()
    return clamp(warp(imgs, maps[minus], fill_value(clip, fill)).reshape(x.shape), clip)


def translate(x: Tensor, shift: tuple[float, float], generator: torch.Generator | None = None,
              clip: tuple[float, float] | None = None, *, fill: float | None = None) -> Tensor:
    """A shift by ``shift = (dx, dy)`` pixels, right and down for positive values (sub-pixel ok); draws nothing.

    The map is built on the host and copied asynchronously to the input's device.
    """
    imgs = images(x, "translation")
    h, w = imgs.shape[-2:]
    dx, dy = (float(v) for v in shift)
    theta = _maps([[[1.0, 0.0, -2 * dx / w], [0.0, 1.0, -2 * dy / h]]], imgs)[0]
    return clamp(warp(imgs, theta, fill_value(clip, fill)).reshape(x.shape), clip)
