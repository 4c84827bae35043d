"""The JSON evidence file (``--dnnsafety-json=PATH``) for a safety case.

Layout (``schema`` = ``pytest-dnnsafety/1``)::

    {"schema": ..., "created": ISO-8601, "environment": {...},
     "summary": {"total", "passed", "failed", "error", "not-evaluated", "lost"},
     "gates": [{"nodeid", "marker", "metric", "value", "bound", "threshold", "op", "passed",
                "status", "summary", "details", "seconds", "device"}, ...]}

Non-finite floats are written as strings ("nan", "inf") so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ..results import STATUSES, GateResult

__all__ = ["SCHEMA", "build_evidence", "write_evidence"]

SCHEMA = "pytest-dnnsafety/1"


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def build_evidence(results: Sequence[GateResult], env: dict[str, Any], lost: Sequence[str] = ()) -> dict[str, Any]:
    summary = {status: sum(r.status == status for r in results) for status in STATUSES}
    summary["total"] = len(results)
    summary["lost"] = len(lost)
    return _strict({
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "summary": summary,
        "lost": list(lost),
        "gates": [r.to_dict() for r in results],
    })


def write_evidence(path: Path, evidence: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(evidence, indent=2, sort_keys=False, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
