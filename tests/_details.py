"""The parts of a gate's ``details`` that are timings of this run, which no two runs (or ranks) repeat.

Tests that compare the evidence of two runs (serial and ``-n 2``, one process and two torchrun ranks) compare
``reproducible(details)``: everything but these timings (the probed cost estimate, the shared pass's seconds).
"""

from __future__ import annotations

from typing import Any, Mapping

#: Keys of ``details`` holding timings of the run.
TIMING_DETAILS = frozenset({"seconds", "startup_seconds", "shared_pass_seconds", "cost_estimate"})


def reproducible(details: Mapping[str, Any]) -> dict[str, Any]:
    """``details`` without :data:`TIMING_DETAILS`."""
    return {k: v for k, v in details.items() if k not in TIMING_DETAILS}
