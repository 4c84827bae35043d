"""The input box of certified bounds: the L∞ ball around an input intersected with its valid range, and its checks.

:func:`input_box` builds ``[x − ε, x + ε] ∩ clip``; :func:`outside_clip` counts the values outside ``clip`` on the
device (no host sync) for a loop that reads the count once afterwards, and :func:`outside_clip_error` is the error
it then raises; :func:`box_problems` is the device-side form of the NaN/inf and ``x_lo > x_hi`` checks that
:class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel` runs on the host unless ``check=False``. Pure torch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["input_box", "outside_clip", "outside_clip_error", "box_problems"]


def _check_box(x_lo: Tensor, x_hi: Tensor) -> None:
    """DataError for a box with NaN/inf or ``x_lo > x_hi`` somewhere (reads it on the host)."""
    if not bool(torch.isfinite(x_lo).all() & torch.isfinite(x_hi).all()):
        raise DataError("the input box holds NaN/inf. Fix: give finite inputs and a finite eps.")
    if bool((x_lo > x_hi).any()):
        raise DataError("the input box has x_lo > x_hi somewhere. Fix: build it with input_box(x, eps, clip).")


def outside_clip(x: Tensor, clip: tuple[float, float] | None) -> Tensor:
    """How many values of ``x`` lie outside ``clip`` (a 0-d int64 tensor on ``x``'s device; no host sync)."""
    if clip is None:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    low, high = (float(v) for v in clip)
    return ((x < low) | (x > high)).sum()


def outside_clip_error(count: int, clip: tuple[float, float] | None) -> DataError:
    """The DataError :func:`input_box` raises for ``count`` input values outside ``clip``."""
    return DataError(f"{count} input value(s) lie outside the valid range clip={clip!r}; the ball around them would "
                     f"not contain them. Fix: give the range the data lives in.")


def box_problems(x_lo: Tensor, x_hi: Tensor) -> Tensor:
    """A 0-d bool tensor: the box holds NaN/inf or ``x_lo > x_hi`` somewhere (no host sync).

    What :meth:`BoundedModel.ibp` checks unless ``check=False``, for a loop that reads it once afterwards.
    """
    return ~(torch.isfinite(x_lo).all() & torch.isfinite(x_hi).all()) | (x_lo > x_hi).any()


def input_box(x: Tensor, eps: float, clip: tuple[float, float] | None = None, *,
              check: bool = True) -> tuple[Tensor, Tensor]:
    """The L∞ ball ``[x − ε, x + ε]`` intersected with the valid range ``clip = (low, high)``.

    Raises :class:`ConfigError` when ``eps`` is negative or not finite, :class:`DataError` when an
    input lies outside ``clip`` (its ball would not contain it). ``check=False`` skips that last
    check, which reads ``x`` on the host: for a device loop that counts :func:`outside_clip` itself.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"eps={eps!r} is not a finite non-negative radius.")
    x = torch.as_tensor(x).detach()
    if not x.is_floating_point():
        x = x.to(torch.float32)
    lo, hi = x - eps, x + eps
    if clip is not None:
        low, high = (float(v) for v in clip)
        if check:
            outside = (x < low) | (x > high)
            if bool(outside.any()):
                raise outside_clip_error(int(outside.sum()), clip)
        lo, hi = lo.clamp(min=low), hi.clamp(max=high)
    return lo, hi
