"""What every transform of the perturbation library shares: the value range, the random draws, image views.

* ``clip`` is the valid input range ``(low, high)`` or None (:func:`check_clip`). The transforms
  clamp their output to it; the constants that scale with the range (noise strengths, fills) read
  it as ``lo`` and ``width`` (:func:`value_range`), the unit range ``lo = 0, width = 1`` when
  ``clip`` is None (then nothing is clamped).
* Random numbers come from a ``torch.Generator`` on its own device and are then moved to the
  input's (:func:`draw`): a CPU generator gives the same numbers whatever device the input is on,
  and the copy to an accelerator is asynchronous, so a device loop does not wait for the host.
  ``generator=None`` draws from torch's global generator on the input's device.
* Spatial transforms work on images ``(N, C, H, W)`` or ``(N, H, W)`` (:func:`as_images`) and
  return the input's shape.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["as_images", "check_clip", "clamp", "draw", "fill_value", "images", "is_real", "value_range"]


def is_real(value: Any) -> bool:
    """A real number (Python, numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_clip(clip: Any) -> tuple[float, float] | None:
    """``clip`` as a ``(low, high)`` pair of floats with finite ``low < high``, or None; else ConfigError."""
    if clip is None:
        return None
    try:
        lo, hi = (float(v) for v in clip)
    except (TypeError, ValueError):
        raise ConfigError(f"clip={clip!r} is not a (low, high) pair of numbers. Fix: give the valid input range, "
                          f"e.g. clip=(0.0, 1.0), or None.") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigError(f"clip={clip!r} is not a valid range: need finite low < high. Fix: e.g. clip=(0.0, 1.0).")
    return lo, hi


def value_range(clip: tuple[float, float] | None) -> tuple[float, float]:
    """``(lo, width)`` of ``clip``; the unit range ``(0, 1)`` when ``clip`` is None."""
    return (clip[0], clip[1] - clip[0]) if clip is not None else (0.0, 1.0)


def fill_value(clip: tuple[float, float] | None, fill: float | None = None) -> float:
    """``fill`` if given, else the low end of ``clip`` (0 without one): the value of uncovered or erased pixels."""
    if fill is not None:
        return float(fill)
    return clip[0] if clip is not None else 0.0


def clamp(x: Tensor, clip: tuple[float, float] | None) -> Tensor:
    """``x`` clamped to ``clip`` (unchanged when None)."""
    return x.clamp(clip[0], clip[1]) if clip is not None else x


def draw(kind: str, shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """``torch.rand`` (``kind="rand"``) or ``torch.randn`` numbers of ``shape`` in ``like``'s dtype, on its device.

    Drawn with ``generator`` on the generator's own device, then moved (asynchronously towards an
    accelerator: a device-to-host copy must complete before the CPU reads it, a host-to-device one
    need not), so a seed gives the same numbers for inputs on any device. Without a generator,
    torch's global generator on ``like``'s device.
    """
    fn = torch.rand if kind == "rand" else torch.randn
    if generator is None:
        return fn(shape, dtype=like.dtype, device=like.device)
    drawn = fn(shape, dtype=like.dtype, device=generator.device, generator=generator)
    return drawn.to(like.device, non_blocking=like.device.type != "cpu")


def as_images(x: Tensor) -> Tensor | None:
    """``x`` as ``(N, C, H, W)`` (a channel added to ``(N, H, W)``), or None for any other shape."""
    if x.ndim == 4:
        return x
    if x.ndim == 3:
        return x.unsqueeze(1)
    return None


def images(x: Tensor, what: str = "this transform") -> Tensor:
    """:func:`as_images`, raising :class:`DataError` for non-image shapes."""
    imgs = as_images(x)
    if imgs is None:
        raise DataError(f"{what} is spatial and needs images (N, C, H, W) or (N, H, W), but the input has shape "
                        f"{tuple(x.shape)}. Fix: give the data its image shape, or use a pointwise transform.")
    return imgs
