"""Occlusion and frame anomalies: a square patch, a black frame, zeroed, copied and shifted rows.

The patch is Cheng et al. 2018's occlusion transformer (§II-D, eq. 4); the black frame and the
row corruptions are the anomalies of Ferreira et al., *Benchmarking Safety Monitors for Image
Classifiers with Machine Learning* (PRDC 2021, §IV-A): a dead sensor frame, lost scan lines
(zeroed), lines repeated from above (copied) and lines displaced sideways (shifted). Batched
torch transforms ``f(x, parameter, generator, clip)`` that keep the input's shape, dtype and
device and clamp to ``clip``; erased pixels take ``fill`` (default ``clip``'s low end, 0 without
one).

The row transforms pick, per input, the ``count`` rows with the largest keys of one
``rand(N, H)`` draw (so a larger ``count`` hits a superset of the rows), then :func:`shifted_rows`
draws one more ``rand(N, H)`` for the directions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pytest_dnnsafety.engines.perturb.common import clamp, draw, fill_value, images

__all__ = ["black_frame", "copied_rows", "copy_source", "occlude", "row_mask", "shifted_rows", "zeroed_rows"]


def occlude(x: Tensor, side: int, generator: torch.Generator | None = None, clip: tuple[float, float] | None = None,
            *, top: int = 0, left: int = 0, fill: float | None = None) -> Tensor:
    """A ``side`` × ``side`` patch at ``(top, left)`` set to ``fill`` in every image and channel (draws nothing)."""
    patched = images(x, "occlusion").clone()
    patched[..., top:top + side, left:left + side] = fill_value(clip, fill)
    return clamp(patched.reshape(x.shape), clip)


def black_frame(x: Tensor, parameter: object = None, generator: torch.Generator | None = None,
                clip: tuple[float, float] | None = None, *, fill: float | None = None) -> Tensor:
    """Every value ``fill`` (a dead frame); ``parameter`` is ignored (draws nothing)."""
    return clamp(torch.full_like(x, fill_value(clip, fill)), clip)


def row_mask(n: int, h: int, count: int, like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Bool ``(N, H)``: per input the ``count`` rows with the largest keys of one ``rand(N, H)`` draw."""
    keys = draw("rand", (n, h), like, generator)
    idx = keys.topk(count, dim=1).indices
    return torch.zeros((n, h), dtype=torch.bool, device=like.device).scatter_(1, idx, True)


def copy_source(hit: Tensor) -> Tensor:
    """Per row, the row it shows: itself when kept, else the last kept row above (the first kept row if none)."""
    n, h = hit.shape
    kept = ~hit
    rows = torch.arange(h, device=hit.device).expand(n, h)
    last = torch.where(kept, rows, torch.full_like(rows, -1)).cummax(dim=1).values
    first = kept.to(torch.int32).argmax(dim=1, keepdim=True).expand(n, h)
    return torch.where(last < 0, first, last)


def zeroed_rows(x: Tensor, count: int, generator: torch.Generator | None = None,
                clip: tuple[float, float] | None = None, *, fill: float | None = None) -> Tensor:
    """``count`` random rows per image set to ``fill`` (lost scan lines)."""
    imgs = images(x, "zeroed_rows")
    n, _, h, _ = imgs.shape
    hit = row_mask(n, h, count, imgs, generator)
    return clamp(imgs.masked_fill(hit[:, None, :, None], fill_value(clip, fill)).reshape(x.shape), clip)


def copied_rows(x: Tensor, count: int, generator: torch.Generator | None = None,
                clip: tuple[float, float] | None = None) -> Tensor:
    """``count`` random rows per image replaced by the last kept row above them (:func:`copy_source`)."""
    imgs = images(x, "copied_rows")
    n, c, h, w = imgs.shape
    src = copy_source(row_mask(n, h, count, imgs, generator))
    return clamp(imgs.gather(2, src[:, None, :, None].expand(n, c, h, w)).reshape(x.shape), clip)


def shifted_rows(x: Tensor, count: int, generator: torch.Generator | None = None,
                 clip: tuple[float, float] | None = None, *, shift: int = 1, fill: float | None = None) -> Tensor:
    """``count`` random rows per image shifted by ``±shift`` pixels (right where the second draw is < ½).

    ``x'[j] = x[j − s]`` along the row, ``s = ±shift``; uncovered columns take ``fill``.
    """
    imgs = images(x, "shifted_rows")
    n, c, h, w = imgs.shape
    hit = row_mask(n, h, count, imgs, generator)
    right = draw("rand", (n, h), imgs, generator) < 0.5
    s = torch.where(right, shift, -shift)
    cols = torch.arange(w, device=imgs.device)
    src = cols[None, None, :] - s[:, :, None]
    inside = (src >= 0) & (src < w)
    moved = imgs.gather(3, src.clamp(0, w - 1)[:, None].expand(n, c, h, w))
    moved = moved.masked_fill(~inside[:, None], fill_value(clip, fill))
    return clamp(torch.where(hit[:, None, :, None], moved, imgs).reshape(x.shape), clip)
