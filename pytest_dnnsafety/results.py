"""The typed records a gate produces; reports render them and never recompute them.

A :class:`GateResult` crosses pytest-xdist workers as a JSON string (only plain str/int/float/bool
values inside), so the controller sees exactly what the worker measured.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Measurement", "GateResult", "STATUSES", "format_number"]

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


def format_number(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.3f}"


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
