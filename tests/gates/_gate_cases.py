"""Bad gate-marker arguments generated from the built-in gates' definitions (issue #20, item 6).

For every built-in :class:`~pytest_dnnsafety.gates.core.GateDef` (the registry the plugin builds,
:func:`~pytest_dnnsafety.gates.builtin_registry`) and every :class:`~pytest_dnnsafety.gates.core.Param`
of it, :func:`bad_arguments` yields marker arguments ``parse_marker`` must refuse with a
``MarkerError``:

* a value of a wrong type (one from :data:`WRONG_TYPES` that the Param's types do not admit; a
  bool is wrong unless ``bool`` is admitted, as ``Param.validate`` says);
* for a Param with a check, values of an admitted type that the check refuses (found by trying the
  :data:`PROBES` of each admitted type against ``Param.validate``; a probe whose check raises counts
  too: ``parse_marker`` must turn it into a MarkerError as well);
* the arguments every gate takes: the threshold (wrong type, outside ``threshold_range``), the
  common settings (``seed``, ``device``, ``batch_size``, ``task``), the regression keyword and a fixture role.

Each case is ``(marker, argument, args, kwargs)``: a valid threshold plus the one bad keyword.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import PurePath
from typing import Any

from pytest_dnnsafety.gates import GateDef, Param, builtin_registry

__all__ = ["GATES", "GateCase", "bad_arguments", "wrong_types", "out_of_range", "threshold_ok", "cases_by_param",
           "checked_params", "marker_source"]

GATES: dict[str, GateDef] = dict(builtin_registry())

#: Values of the wrong type, by kind: one of each that a Param does not admit is tried.
WRONG_TYPES: tuple[Any, ...] = ("text", 7, 2.5, True, [1, 2], {"key": 1}, None, (1.0, "a"))

#: Candidate values of each admitted type, tried against a Param's check for out-of-range values.
PROBES: dict[type, tuple[Any, ...]] = {
    int: (-1, 0, -(10 ** 9), 10 ** 9, 2 ** 63),
    float: (-1.0, -0.5, 0.0, 1.5, 1e9, -1e9, math.nan, math.inf, -math.inf),
    str: ("", "no-such-choice", " ", "-1"),
    list: ([], [1.0, 0.0], [math.nan, 1.0], ["a"], ["a", "a"], [1, 2, 3], [-1], [[0, 0], [1]]),
    tuple: ((), (1.0, 0.0), (math.nan, 1.0), ("a",), ("a", "a"), (1, 2, 3), (-1,)),
    dict: ({}, {1: "x"}, {"x": []}, {"x": True}, {"x": {"y": 1}}, {"x": -1.0}),
    bool: (),
    type(None): (),
    PurePath: (PurePath(""),),
}

GateCase = tuple[str, str, tuple[Any, ...], dict[str, Any]]


def threshold_ok(gate: GateDef) -> float:
    """A threshold inside the gate's range."""
    lo, hi = gate.threshold_range
    return float(lo) if math.isfinite(lo) else (float(hi) if math.isfinite(hi) else 0.0)


def _admits(param: Param, value: Any) -> bool:
    if isinstance(value, bool) and bool not in param.types:
        return False
    return isinstance(value, param.types)


def wrong_types(param: Param) -> list[Any]:
    """The values of :data:`WRONG_TYPES` that ``param`` does not admit."""
    return [value for value in WRONG_TYPES if not _admits(param, value)]


def _refused(param: Param, value: Any) -> bool:
    try:
        return param.validate(value) is not None
    except Exception:  # noqa: BLE001 - a check that raises refuses too; parse_marker must say so cleanly
        return True


def out_of_range(param: Param) -> list[Any]:
    """Values of an admitted type that ``param``'s check refuses (empty without a check)."""
    if param.check is None:
        return []
    found: list[Any] = []
    for kind in param.types:
        for probe in PROBES.get(kind, ()):
            if _admits(param, probe) and _refused(param, probe) and probe not in found:
                found.append(probe)
    return found


def _common(gate: GateDef) -> Iterator[tuple[str, Any]]:
    """Bad values of the keywords every gate takes: settings, regression limits, fixture roles."""
    yield "seed", "abc"
    yield "seed", -5
    yield "seed", 1.5
    yield "seed", [1]
    yield "device", 3
    yield "device", "warp-drive"
    yield "batch_size", 0
    yield "batch_size", "many"
    yield "batch_size", 2.5
    yield "task", "segmentation"
    yield "task", 3
    for task in ("single-label", "multi-label", "detection"):
        if task not in gate.tasks:  # a task the gate cannot measure: refused at collection
            yield "task", task
    yield "batch_size", [8]
    yield gate.regression_keyword, -0.1
    yield gate.regression_keyword, "a lot"
    yield gate.regression_keyword, math.nan
    other = "max_rise" if gate.regression_keyword == "max_drop" else "max_drop"
    yield other, 0.1
    yield "no_such_keyword", 1
    for role in gate.fixtures:
        yield role, 42
        yield role, "not an identifier"


def bad_arguments(gate: GateDef) -> Iterator[GateCase]:
    """Every generated bad argument of ``gate``: ``(marker, argument, args, kwargs)``."""
    ok = threshold_ok(gate)
    lo, hi = gate.threshold_range
    for value in ("0.5", True, None, [0.5]):
        yield gate.marker, "threshold", (value,), {}
    for value in (lo - 1, hi + 1, math.nan):
        if not math.isinf(value):
            yield gate.marker, "threshold", (value,), {}
    yield gate.marker, "threshold", (ok,), {"threshold": ok}
    yield gate.marker, "threshold", (), {}
    yield gate.marker, "*args", (ok, ok), {}
    for param in gate.params:
        for value in (*wrong_types(param), *out_of_range(param)):
            yield gate.marker, param.name, (ok,), {param.name: value}
    for key, value in _common(gate):
        yield gate.marker, key, (ok,), {key: value}


def cases_by_param() -> dict[str, list[GateCase]]:
    """The cases grouped as ``marker.argument`` (one test per group)."""
    groups: dict[str, list[GateCase]] = {}
    for gate in GATES.values():
        for case in bad_arguments(gate):
            groups.setdefault(f"{case[0]}.{case[1]}", []).append(case)
    return groups


def checked_params() -> Iterator[tuple[GateDef, Param]]:
    for gate in GATES.values():
        for param in gate.params:
            if param.check is not None:
                yield gate, param


def marker_source(case: GateCase, render: Callable[[Any], str] = repr) -> str:
    """``@pytest.mark.<marker>(<args>, <kwargs>)`` for a test file."""
    marker, _, args, kwargs = case
    parts = [render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()]
    return f"@pytest.mark.{marker}({', '.join(parts)})"
