"""Argument checks shared by the engines: one copy of "a share in (0, 1)", "a number > 0", "a count", "one of".

Each returns the checked value (as float, int or str) or raises :class:`~pytest_dnnsafety.errors.ConfigError`
naming the argument, the value and a fix. Pure Python; no torch, no pytest import.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from pytest_dnnsafety.errors import ConfigError

__all__ = ["check_share", "check_positive", "check_count", "check_choice"]


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def check_share(value: Any, name: str, fix: str) -> float:
    """A finite real strictly between 0 and 1."""
    if not _real(value) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"{name}={value!r} is not a number strictly between 0 and 1. Fix: {fix}")
    return float(value)


def check_positive(value: Any, name: str, *, allow_zero: bool = False, fix: str = "") -> float:
    """A finite real ``> 0`` (``>= 0`` with ``allow_zero``)."""
    if not _real(value) or float(value) < 0 or (float(value) == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name}={value!r} must be a finite number {bound}. Fix: {fix or f'pass {name} {bound}.'}")
    return float(value)


def check_count(value: Any, name: str, minimum: int = 1, fix: str = "", *, maximum: int | None = None) -> int:
    """An int ``>= minimum`` (and ``<= maximum`` when given; not a bool)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum
            or (maximum is not None and int(value) > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        fix = fix or f"pass {name} {bounds}."
        raise ConfigError(f"{name}={value!r} must be an integer {bounds}. Fix: {fix}")
    return int(value)


def check_choice(value: Any, name: str, choices: tuple[str, ...], fix: str = "") -> str:
    """One of ``choices`` (a str)."""
    if not isinstance(value, str) or value not in choices:
        fix = fix or f"use one of {', '.join(repr(c) for c in choices)}."
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}. Fix: {fix}")
    return value
