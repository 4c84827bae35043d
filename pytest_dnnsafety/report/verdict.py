"""The baseline verdict of a gate: its measured result compared with the configured baseline run.

:func:`judge` is called by :func:`pytest_dnnsafety.gates.evaluate` once a gate has a measured
result; :func:`check_configured` at the start of a run. The comparison itself (statuses, what
counts as a regression, changed inputs) is :func:`pytest_dnnsafety.report.baseline.compare`, looked
up when called. Nothing here imports torch or pytest.
"""

from __future__ import annotations

from typing import Any

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.results import GateResult

__all__ = ["configured", "check_configured", "judge"]


def configured(settings: Any) -> Any:
    """The resolved ``baseline`` setting when one is configured, else None."""
    try:
        resolved = settings.get("baseline")
    except KeyError:  # the setting is not defined
        return None
    return resolved if resolved.value is not None else None


def check_configured(settings: Any) -> None:
    """Load the configured baseline once at the start of a run: a :class:`ConfigError` naming the setting if
    it cannot be read (the run stops before any test)."""
    resolved = configured(settings)
    if resolved is None:
        return
    from pytest_dnnsafety.report.baseline import Baseline

    try:
        Baseline.load(settings.path(resolved))
    except ConfigError as exc:
        raise ConfigError(f"dnnsafety_baseline (from {resolved.source}): {exc}") from None


def _load_once(settings: Any, resolved: Any, cache: dict[str, Any] | None) -> Any:
    """The stored baseline, loaded once per process (kept in the session cache); the exception if unreadable."""
    store = cache if cache is not None else {}
    path = settings.path(resolved)
    key = ("baseline", str(path))
    if key not in store:
        try:
            from pytest_dnnsafety.report.baseline import Baseline

            store[key] = Baseline.load(path)
        except Exception as exc:  # a ConfigError naming the file, or the module is missing
            store[key] = exc
    return store[key]


def judge(result: GateResult, limit: float | None, settings: Any, cache: dict[str, Any] | None = None) -> None:
    """The baseline verdict: compare a measured ``result`` with the configured baseline, in place.

    ``limit`` is the marker's ``max_drop``/``max_rise``. A regression beyond it fails a gate that had
    passed; ``missing`` (no stored result) and ``inputs-changed`` (the gate read other inputs than the
    stored run) are recorded in ``result.baseline`` and never fail the gate; ``unverifiable`` (a stored row without
    its inputs, its number or its comparable set) is recorded, and makes a passed gate an error when the marker set a
    limit, which could not be checked. A baseline that cannot be
    read or compared makes the gate an error: the user asked for a comparison that could not be made.
    Nothing happens without a ``baseline`` setting.
    """
    resolved = configured(settings)
    if resolved is None:
        return
    try:
        baseline = _load_once(settings, resolved, cache)
        if isinstance(baseline, Exception):
            raise baseline
        from pytest_dnnsafety.report.baseline import compare

        comparison = compare(result, baseline.lookup(result.nodeid, result.marker), limit)
    except Exception as exc:
        message = str(exc) or repr(exc)
        result.status, result.passed = "error", None
        result.details["baseline_error"] = message
        result.details["baseline_error_type"] = type(exc).__name__
        result.summary += f"; baseline: cannot compare: {message}"
        return
    result.baseline = dict(comparison)
    if comparison.get("status") == "unverifiable" and limit is not None and result.status == "passed":
        # the marker asked for a regression check the stored row cannot support: no pass on an unchecked limit
        result.status, result.passed = "error", None
        result.details["baseline_error"] = str(comparison.get("message", ""))
        result.summary += f"; baseline: cannot compare: {comparison.get('message', '')}"
        return
    if comparison.get("status") == "regressed" and result.status == "passed":
        result.status, result.passed = "failed", False
        result.summary += f"; regression: {comparison.get('message', '')}"
