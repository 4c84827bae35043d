"""Argument checks of marker keywords: small validators a :class:`~pytest_dnnsafety.gates.core.Param` takes.

Each returns None for a good value, else the problem in a few words (the marker, the keyword and the fix are
added by the parser). No torch import.
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["in_range", "one_of", "check_where", "is_finite", "is_interval", "class_names"]


def in_range(lo: float, hi: float) -> Callable[[Any], str | None]:
    """A Param check: the value is a number in ``[lo, hi]`` (NaN refused)."""

    def check(value: Any) -> str | None:
        if isinstance(value, float) and math.isnan(value):
            return "is NaN"
        if not lo <= value <= hi:
            return f"{value!r} is outside [{lo}, {hi}]"
        return None

    return check


def one_of(*choices: str) -> Callable[[Any], str | None]:
    """A Param check: the value is one of ``choices``."""
    return lambda value: None if value in choices else f"{value!r} is not one of {', '.join(map(repr, choices))}"


def is_finite(value: Any) -> str | None:
    """A Param check: the number is finite."""
    return None if math.isfinite(value) else f"{value!r} is not finite"


def is_interval(value: Any) -> str | None:
    """A Param check for a valid input range ``(low, high)`` with finite ``low < high`` (None allowed)."""
    if value is None:
        return None
    if (len(value) == 2 and all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                                for c in value) and value[0] < value[1]):
        return None
    return f"{value!r} must be (low, high) with finite low < high"


def class_names(value: Any) -> str | None:
    """A Param check for ``classes=[...]``: at least two distinct non-empty names (None allowed)."""
    if value is None:
        return None
    if len(value) < 2 or not all(isinstance(c, str) and c.strip() for c in value):
        return "must list at least two non-empty class names (str), in the model's output order"
    if len(set(value)) != len(value):
        return "lists a class twice"
    return None


def check_where(value: Any) -> str | None:
    """A Param check for ``where={condition: value or [values]}`` (None allowed)."""
    if value is None:
        return None
    for key, val in value.items():
        if not isinstance(key, str):
            return f"keys must be condition names (str), got {key!r}"
        values = val if isinstance(val, (list, tuple)) else [val]
        if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            return f"values of {key!r} must be a value or a non-empty list of values, got {val!r}"
    return None


# ------------------------------------------------------------------------------------- definitions
