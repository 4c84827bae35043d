"""The typed records a gate produces; reports render them and never recompute them.

A :class:`GateResult` crosses pytest-xdist workers as a JSON string (only plain str/int/float/bool
values inside), so the controller sees exactly what the worker measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Measurement", "GateResult", "STATUSES", "ESTIMATE_SUFFIX", "format_number", "format_numbers"]

#: Appended to a result's ``metric`` when the compared number is an estimate, not a bound.
ESTIMATE_SUFFIX = " (estimate, not a guarantee)"

#: The verdicts of a gate; only ``passed`` passes.
#:
#: * passed / failed: the metric was computed and compared with the threshold (``failed`` also
#:   when the engine found a contradiction in its own result, whatever the comparison);
#: * error: the metric could not be computed (a bad input, a fixture that failed, an exception in
#:   the model or the engine); ``details`` names the cause (``error_type``, ``error``);
#: * not-evaluated: the gate never ran because the test body failed or was skipped, its setup
#:   failed outside the gate's fixtures, or the run stopped before the test;
#: * inconclusive: the metric was computed but an assumption of its method is violated; it fails;
#: * lost: the gate's result never reached the controller (a pytest-xdist worker died); the run fails.
STATUSES = ("passed", "failed", "error", "not-evaluated", "inconclusive", "lost")


@dataclass(frozen=True)
class Measurement:
    """What an engine hands a gate: the value, an optional statistical bound, and details.

    ``bound`` is the quantity the gate compares when present (e.g. an upper confidence bound);
    ``detail`` is the short human text shown after the comparison; ``details`` is JSON-able.

    ``inconclusive``: why the result cannot be trusted (an assumption of the method is violated);
    the gate's status becomes ``inconclusive`` and the test fails, whatever the comparison.
    ``contradiction``: why the result contradicts itself (e.g. a bound below the estimate); the
    gate's status becomes ``failed`` whatever the comparison and the summary names the reason.
    """

    value: float
    detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    bound: float | None = None
    inconclusive: str | None = None
    contradiction: str | None = None


def format_number(value: float | None, extra_digits: int = 0) -> str:
    """A number for reports: 3 decimals (``0.950``), or 3 mantissa decimals in scientific notation
    below 1e-3 and from 1e5 (``4.870e-04``); ``extra_digits`` more of either. ``None`` is ``-``.

    Use :func:`format_numbers` for numbers shown side by side (value, bound, threshold).
    """
    if value is None:
        return "-"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    digits = 3 + max(0, int(extra_digits))
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.{digits}e}"
    return f"{value:.{digits}f}"


#: :func:`format_numbers` adds at most this many digits to tell numbers apart.
MAX_EXTRA_DIGITS = 12


def format_numbers(*values: float | None) -> list[str]:
    """Numbers shown side by side (a gate's value, bound and threshold), with enough digits that
    numbers that differ print differently.

    Each starts as :func:`format_number` (``0.950``); while two different numbers print alike
    (``E = 0.00487`` and ``Ub = 0.00493`` both ``0.005``), every number of the row gets one more
    digit (``0.00487``, ``0.00493``), up to :data:`MAX_EXTRA_DIGITS`. Equal numbers stay equal.
    """
    finite = [(v, i) for i, v in enumerate(values) if isinstance(v, (int, float)) and math.isfinite(v)]
    texts = [format_number(v) for v in values]
    for extra in range(MAX_EXTRA_DIGITS + 1):
        texts = [format_number(v, extra) for v in values]
        shown: dict[str, float] = {}
        clash = False
        for v, i in finite:
            if shown.setdefault(texts[i], float(v)) != float(v):
                clash = True
                break
        if not clash:
            break
    return texts


@dataclass
class GateResult:
    """One gate's outcome for one test."""

    nodeid: str
    marker: str
    metric: str
    threshold: float
    op: str  # ">=" (value must reach threshold) or "<=" (value must stay below)
    status: str
    value: float | None = None
    bound: float | None = None
    passed: bool | None = None
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    #: seconds of first-time module imports while the gate measured (startup, not the metric; not in ``seconds``)
    startup_seconds: float = 0.0
    device: str = ""
    #: role -> what the gate read for it: fixture name, origin, object type and content digest
    inputs: dict[str, Any] = field(default_factory=dict)
    #: the comparison with a stored baseline run (``--dnnsafety-baseline``), or None without one:
    #: ``status`` (ok, improved, regressed, missing, inputs-changed), ``baseline_value``, ``change``,
    #: ``limit`` (the marker's ``max_drop``/``max_rise``) and ``message``
    baseline: dict[str, Any] | None = None

    @property
    def compared(self) -> float | None:
        """The number compared with the threshold: the bound when there is one."""
        return self.bound if self.bound is not None else self.value

    @property
    def is_estimate(self) -> bool:
        """The compared number is an estimate the user asked for by name, not a sound bound.

        A gate says so with ``details["statistic"] = "estimate"`` (e.g. ``min_safe_radius(statistic="estimate")``),
        or with ``details["bound_kind"] = "estimate"`` when its confidence bound is a resampling estimate (a
        bootstrap percentile of an F1 score or an mAP, which no exact interval covers); every report then labels
        it (:attr:`label`, and ``metric`` gets :data:`ESTIMATE_SUFFIX`).
        """
        return self.details.get("statistic") == "estimate" or self.details.get("bound_kind") == "estimate"

    @property
    def label(self) -> str:
        """The marker as reports show it: ``min_safe_radius (estimate)`` for an estimate."""
        return f"{self.marker} (estimate)" if self.is_estimate else self.marker

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=True, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GateResult":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> "GateResult":
        return cls.from_dict(json.loads(text))
