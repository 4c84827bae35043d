"""Memory sizes given as bytes or text (``2GiB``, ``512MiB``, ``1.5GB``): parsed and checked once.

Used by the ``max_memory`` budget of certified bounds (the ``min_verified_robustness`` marker and
:class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel`). Binary units (KiB, MiB, GiB,
TiB: powers of 1024) and decimal ones (kB, MB, GB, TB: powers of 1000), case-insensitive, with an
optional space; a bare number is bytes. No torch import (marker checks run at collection).

Also the engines' **working-memory budget** (issue #30 §5): batch sizes of the memory-hungry loops
(occlusion's occluded copies, the attack families, the shared activation pass, the monitors) are
derived from a budget in bytes and the measured per-input cost
(:mod:`pytest_dnnsafety.engines.core.budget`), not from a fixed count. :func:`working_memory` is the
budget now (:data:`DEFAULT_WORKING_MEMORY` unless a caller set one with :func:`memory_budget`, as the
gate evaluation does from the ``dnnsafety_max_memory`` setting); :func:`batch_for` turns a per-input
cost into a batch size.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import re
from typing import Any, Iterator

from pytest_dnnsafety.errors import ConfigError

__all__ = ["UNITS", "MIN_MEMORY", "DEFAULT_WORKING_MEMORY", "parse_memory", "memory_problem", "format_memory",
           "working_memory", "memory_budget", "batch_for"]

#: Unit suffixes (lower case) and their sizes in bytes.
UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
#: The smallest budget accepted (below it not even one sample's state fits a useful model).
MIN_MEMORY = 16 * 2**20
#: The engines' working-memory budget when none is set (``dnnsafety_max_memory``'s default): 1 GiB, so that
#: a gate on a 224x224 ResNet-18 stays under ~2 GiB peak RSS with the model, the data and the interpreter.
DEFAULT_WORKING_MEMORY = 2**30

_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("dnnsafety_working_memory", default=None)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def memory_problem(value: Any) -> str | None:
    """None when ``value`` is a valid memory size (int bytes or text like ``"2GiB"``), else the problem."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        return f"expected bytes (int) or a size like '2GiB', got {type(value).__name__} {value!r}"
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in UNITS:
            return (f"{value!r} is not a memory size; write a number with a unit "
                    f"({', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB', 'kB', 'MB', 'GB', 'TB'))}), e.g. '2GiB'")
        size = float(match.group(1)) * UNITS[match.group(2).lower()]
    else:
        size = int(value)
    if not math.isfinite(size) or size < MIN_MEMORY:
        return f"{value!r} is below the minimum of {format_memory(MIN_MEMORY)}"
    return None


def parse_memory(value: Any, name: str = "max_memory") -> int:
    """``value`` in bytes (int): an int of bytes or text like ``"2GiB"``; :class:`ConfigError` naming ``name`` else."""
    problem = memory_problem(value)
    if problem is not None:
        raise ConfigError(f"{name}={value!r}: {problem}. Fix: give {name} as bytes (int) or a size such as "
                          f"'2GiB' or '512MiB' (at least {format_memory(MIN_MEMORY)}).")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        assert match is not None
        return int(float(match.group(1)) * UNITS[match.group(2).lower()])
    return int(value)


def format_memory(size: int) -> str:
    """``2.0 GiB``-style text for a size in bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def working_memory() -> int:
    """The working-memory budget in bytes now: the innermost :func:`memory_budget`, else the default."""
    value = _BUDGET.get()
    return DEFAULT_WORKING_MEMORY if value is None else value


@contextlib.contextmanager
def memory_budget(value: Any, name: str = "max_memory") -> Iterator[int]:
    """Within the block, :func:`working_memory` is ``value`` (bytes or text like ``"512MiB"``; None: the default)."""
    size = DEFAULT_WORKING_MEMORY if value is None else parse_memory(value, name)
    token = _BUDGET.set(size)
    try:
        yield size
    finally:
        _BUDGET.reset(token)


def batch_for(per_input: int | float, *, fixed: int | float = 0, budget: int | None = None,
              cap: int | None = None) -> int:
    """The most inputs whose working memory (``fixed + n * per_input`` bytes) fits ``budget`` (default: the
    :func:`working_memory`), at least 1 (one input is always tried) and at most ``cap`` when given."""
    budget = working_memory() if budget is None else int(budget)
    room = max(0.0, budget - float(fixed))
    n = int(room // per_input) if per_input > 0 else (cap or 2**31)
    n = max(1, n)
    return min(n, cap) if cap is not None else n
