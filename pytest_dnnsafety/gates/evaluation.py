"""Evaluation of a validated gate into a :class:`GateResult`: measure, compare, check the baseline.

:func:`evaluate` runs after the test body passed; the metric itself is computed by the gate's
``measure`` function (an engine), never here. It never raises for a metric error: any exception
becomes an ``error`` verdict that names the cause. No torch import here.
"""

from __future__ import annotations

import builtins
import math
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Mapping

from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.runtime.sizes import memory_budget
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.errors import ConfigError, DnnSafetyError, MarkerError, MetricError
from pytest_dnnsafety.results import ESTIMATE_SUFFIX, GateResult, Measurement, format_numbers
from pytest_dnnsafety.gates.core import COMMON_SETTINGS, GateContext, GateSpec

__all__ = ["ImportClock", "context_for", "evaluate", "progress_writer"]

#: A progress writer: called with one line of text (see pytest_dnnsafety.runtime.progress).
Writer = Callable[[str], None]


def progress_writer(config: Any) -> Writer | None:
    """``progress.writer_for(config)``: a callable taking progress lines, or None (silent)."""
    return progress.writer_for(config)


# ------------------------------------------------------------------------------------- startup


class ImportClock:
    """Seconds spent, on this thread, in ``import`` statements that loaded new modules while active.

    A gate family imports its engine (and scipy, sklearn, ...) lazily, so that a project pays only
    for the gates it uses; the first gate of a family therefore ran the imports inside its measured
    time (0.3 s of import in a 3 ms neuron gate). That is startup, not the metric: :func:`evaluate`
    runs ``gate.measure`` under this clock and reports those seconds as ``startup_seconds`` (beside ``seconds``),
    outside ``seconds``. Generic (no list of modules per gate to keep in sync, user gates included):
    while active, ``builtins.__import__`` is wrapped; only the outermost import of a statement that
    grew ``sys.modules`` is counted, so an import of an already loaded module costs a few hundred
    nanoseconds and counts nothing. Not seen: ``importlib.import_module`` called by the gate itself,
    and first-call costs that are not imports (torch's lazy kernel set-up).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._thread = threading.get_ident()
        self._busy = False
        self._original: Any = None

    def __enter__(self) -> "ImportClock":
        self._original = builtins.__import__
        self._hook = self._import  # one bound-method object, so that __exit__ can recognise it
        builtins.__import__ = self._hook
        return self

    def __exit__(self, *exc: Any) -> None:
        if builtins.__import__ is self._hook:  # not if someone wrapped it meanwhile: their wrapper stays
            builtins.__import__ = self._original

    def _import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if self._busy or threading.get_ident() != self._thread:
            return self._original(name, globals, locals, fromlist, level)
        loaded = len(sys.modules)
        self._busy = True
        start = time.perf_counter()
        try:
            return self._original(name, globals, locals, fromlist, level)
        finally:
            elapsed = time.perf_counter() - start
            self._busy = False
            if len(sys.modules) != loaded:
                self.seconds += elapsed


# ------------------------------------------------------------------------------------- evaluation


def context_for(spec: GateSpec, settings: Settings) -> GateContext:
    """Settings for one gate, marker keywords first; the device is resolved (``auto`` → cuda/cpu)."""
    from pytest_dnnsafety.runtime.devices import resolve_device

    resolved = {k: settings.get(k, spec.settings[k], marker=spec.marker) if k in spec.settings else settings.get(k)
                for k in COMMON_SETTINGS}
    device = str(resolve_device(resolved["device"]))
    return GateContext(settings, resolved["seed"].value, device, resolved["batch_size"].value,
                       task_setting=resolved["task"], max_seconds=resolved["max_seconds"], sample=resolved["sample"])


def resolve_task(spec: GateSpec, fixture_values: Mapping[str, Any], ctx: GateContext) -> str:
    """The model's task for this gate: the marker keyword or setting, else inferred from its data; refused when the
    gate does not support it (a :class:`~pytest_dnnsafety.errors.DataError` naming the task and the fix)."""
    from pytest_dnnsafety.data.tasks import SINGLE, infer_task, task_mismatch, unsupported

    setting = ctx.task_setting
    gate = spec.definition
    if setting is not None and setting.value != "auto":
        task, source = setting.value, f"set by {setting.source}"
        mismatch = task_mismatch(task, source, fixture_values["data"], spec.fixtures.get("data", "data")) \
            if "data" in fixture_values and task in gate.tasks else None
        if mismatch is not None:
            raise mismatch
    else:
        inferred = infer_task(fixture_values["data"]) if "data" in fixture_values else None
        task = inferred or SINGLE
        source = "inferred from the data's labels" if inferred else "the default: no labels to infer it from"
    if task not in gate.tasks:
        raise unsupported(spec.marker, task, gate.tasks, source)
    return task


def evaluate(spec: GateSpec, fixture_values: Mapping[str, Any], settings: Settings, nodeid: str,
             cache: dict[str, Any] | None = None, *, writer: Writer | None = None,
             inputs: dict[str, Any] | None = None) -> GateResult:
    """Measure the gate's metric and compare it with the threshold; never raises for metric errors.

    Verdicts: ``passed``/``failed`` from the comparison; ``failed`` whatever the comparison when the
    measurement reports a ``contradiction``; ``inconclusive`` when it reports a violated assumption;
    ``error`` when the metric could not be computed — a :class:`DnnSafetyError` (a message naming the
    cause and the fix) or any other exception (the model raised, a dtype mismatch, a bug), recorded
    with ``details.error_type``, ``details.error`` and ``details.traceback`` (the last frames).

    With a ``baseline`` setting the measured result is then compared with the stored run
    (:func:`pytest_dnnsafety.report.verdict.judge`): a regression beyond ``max_drop``/``max_rise``
    fails a passing gate.
    ``writer`` receives progress lines while the metric is measured; ``inputs`` (what the gate read)
    is recorded on the result before the baseline comparison, which uses it.

    ``seconds`` is the gate's own time: imports of modules loaded for the first time while it
    measured (see :class:`ImportClock`) are excluded and reported as ``startup_seconds`` (beside ``seconds``).
    """
    gate = spec.definition
    start = time.perf_counter()
    result = GateResult(nodeid=nodeid, marker=spec.marker, metric=gate.metric, threshold=spec.threshold,
                        op=gate.op, status="error", inputs=dict(inputs or {}))
    caught: list[warnings.WarningMessage] = []
    clock = ImportClock()
    before: dict[str, Any] = {}  # the subsample and the estimate: evidence whatever the verdict
    try:
        ctx = context_for(spec, settings)
        if cache is not None:
            ctx.cache = cache
        ctx.task = resolve_task(spec, fixture_values, ctx)
        result.device = str(ctx.device)
        with clock:  # the probe's first-time imports (the engines, torch's dispatch machinery) are startup too
            fixture_values, estimate = _prepared(spec, fixture_values, ctx, before)
        with warnings.catch_warnings(record=True) as caught:
            # An engine's warning (e.g. eps >= r-hat) becomes part of the evidence, not a crash under -W error.
            warnings.simplefilter("always")
            with progress.active(label=f"{spec.marker} {nodeid}", write=writer, estimate=estimate), clock, \
                    memory_budget(settings.value("max_memory"), "dnnsafety_max_memory"):  # the engines' batch sizes
                measurement = _measured(gate, spec, fixture_values, ctx)
        from pytest_dnnsafety.data.fingerprint import apply_streamed  # streamed data: the digest of the pass read

        apply_streamed(result.inputs, fixture_values)
        compared = measurement.bound if measurement.bound is not None else measurement.value
        judged = measurement.inconclusive is None and measurement.contradiction is None
        if judged:  # a NaN value beside a finite bound is no measurement either (issue #19 §6)
            for name in ("value", "bound"):
                number = getattr(measurement, name)
                if isinstance(number, (int, float)) and math.isnan(number):
                    raise MetricError(
                        f"the measure function returned {name}=nan (value={measurement.value!r}, bound="
                        f"{measurement.bound!r}), which is no measurement of {gate.metric}. Fix: return finite "
                        "numbers, or Measurement(..., inconclusive='why') when the metric cannot be measured")
        if judged and (compared is None or not math.isfinite(float(compared))):
            raise MetricError(f"the measured {gate.metric} is {compared!r}, which cannot be compared")
    except DnnSafetyError as exc:
        return _error_result(result, spec, exc, f"cannot compute {gate.metric}", caught, start, clock, before)
    except Exception as exc:  # the model, the data or an engine raised: an error, never a pass
        return _error_result(result, spec, exc, f"error while computing {gate.metric}", caught, start, clock,
                             before, with_traceback=True)
    value, bound = _finite(measurement.value), _finite(measurement.bound)
    compared = bound if measurement.bound is not None else value
    ok = compared is not None and (compared >= spec.threshold if gate.op == ">=" else compared <= spec.threshold)
    shown_op = gate.op if ok else ("<" if gate.op == ">=" else ">")
    label = "" if measurement.bound is None else " (bound)"
    if measurement.details.get("statistic") == "estimate" or measurement.details.get("bound_kind") == "estimate":
        label += " (estimate)"
    result.value = value
    result.bound = bound
    result.details = {**before, **measurement.details}
    result.details.setdefault("task", ctx.task)  # what kind of model the number is about
    if result.is_estimate:  # an estimate the marker asked for: labelled in every report
        result.metric += ESTIMATE_SUFFIX
    notes = sorted({str(w.message) for w in caught})
    if notes:
        result.details["warnings"] = notes
    detail = f" ({measurement.detail})" if measurement.detail else ""
    if notes:
        detail += " [warning: " + "; ".join(notes) + "]"
    shown, limit = format_numbers(compared, spec.threshold)  # a bound just past the threshold prints so
    comparison = (f"{shown}{label} {shown_op} {limit}" if compared is not None else f"{shown}{label} vs {limit}")
    if measurement.contradiction is not None:
        result.passed, result.status = False, "failed"
        result.details["contradiction"] = str(measurement.contradiction)
        result.summary = f"{spec.marker}: contradiction: {measurement.contradiction}; {comparison}{detail}"
    elif measurement.inconclusive is not None:
        result.passed, result.status = False, "inconclusive"
        result.details["inconclusive"] = str(measurement.inconclusive)
        result.summary = f"{spec.marker}: inconclusive: {measurement.inconclusive}; {comparison}{detail}"
    else:
        result.passed = bool(ok)
        result.status = "passed" if ok else "failed"
        result.summary = f"{spec.marker}: {comparison}{detail}"
    from pytest_dnnsafety.report.verdict import judge  # the baseline verdict is the report package's

    judge(result, spec.regression_limit, settings, cache)
    _timed(result, start, clock)
    return result


# ------------------------------------------------------------------------------------- helpers


def _prepared(spec: GateSpec, fixture_values: Mapping[str, Any], ctx: GateContext, before: dict[str, Any]
              ) -> tuple[Mapping[str, Any], float]:
    """The fixture values with recorded predictions resolved (:func:`~pytest_dnnsafety.gates.prepare.recorded`) and
    ``sample=`` applied, and the gate's estimated seconds — refused (a
    :class:`~pytest_dnnsafety.gates.cost.BudgetError`) above ``max_seconds`` before any work. ``before`` receives the
    evidence: ``outputs_from`` (recorded predictions or the model), ``sample`` (N, seed, the indices' digest, the
    stratification) and ``cost_estimate``."""
    from pytest_dnnsafety.gates.cost import check_budget, over_budget
    from pytest_dnnsafety.gates.prepare import estimated, recorded, subsampled

    fixture_values, read = recorded(spec, fixture_values)  # recorded predictions: read, or the model run, or refused
    before.update(read)
    fixture_values, sample = subsampled(spec, fixture_values, ctx)
    if sample is not None:
        before["sample"] = sample
    estimate = estimated(spec, fixture_values, ctx)
    if estimate.per_forward is not None and over_budget(estimate, ctx.max_seconds):  # confirmed before refusing
        estimate = estimated(spec, fixture_values, ctx, confirm=True)
    if estimate.per_forward is not None or spec.definition.cost is not None:  # a gate with model work, or a hook
        before["cost_estimate"] = estimate.to_details()
    check_budget(estimate, spec.marker, ctx.max_seconds, sample["n"] if sample else None,
                 sample["of"] if sample else _inputs(fixture_values))
    return fixture_values, estimate.seconds


def _inputs(fixture_values: Mapping[str, Any]) -> int:
    from pytest_dnnsafety.data.forms import known_length

    return (known_length(fixture_values["data"]) or 0) if "data" in fixture_values else 0


def _measured(gate: Any, spec: GateSpec, fixture_values: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """``gate.measure``, or — a relative gate on a model without signal — inconclusive with the reason. The measure
    still runs then, so that a configuration mistake (a :class:`ConfigError`: an unknown layer, an option the model's
    task does not take) is named as the error it is rather than hidden behind the model's lack of signal; anything
    else it raises or returns is moot on such a model."""
    without = _without_signal(spec, fixture_values, ctx)
    if without is None:
        return gate.measure(spec, fixture_values, ctx)
    try:
        gate.measure(spec, fixture_values, ctx)
    except (ConfigError, MarkerError):
        raise
    except Exception:  # noqa: BLE001 - an engine's complaint about the broken model: the no-signal verdict says more
        pass
    return without


def _without_signal(spec: GateSpec, fixture_values: Mapping[str, Any], ctx: GateContext) -> Measurement | None:
    """A relative gate (:attr:`GateDef.signal <pytest_dnnsafety.gates.core.GateDef.signal>`) on a model that gives no
    signal on its data: inconclusive with the reason and the numbers, before ``measure`` does any work."""
    if spec.definition.signal is None:
        return None
    from pytest_dnnsafety.gates.shared import no_signal

    found = no_signal(spec, fixture_values, ctx)
    if found is None:
        return None
    why, numbers = found
    return Measurement(value=float("nan"), details={"no_signal": numbers}, inconclusive=why)


def _finite(number: Any) -> float | None:
    if number is None:
        return None
    number = float(number)
    return number if math.isfinite(number) else None


def _error_result(result: GateResult, spec: GateSpec, exc: Exception, what: str,
                  caught: list[warnings.WarningMessage], start: float, clock: ImportClock,
                  before: Mapping[str, Any] | None = None, with_traceback: bool = False) -> GateResult:
    message = str(exc) or repr(exc)
    result.status, result.passed = "error", None
    # An error may carry JSON-able details of its own (e.g. the scenario rows that break a restriction).
    extra = getattr(exc, "details", None)
    result.details = {**(before or {}), **(extra if isinstance(extra, dict) else {}), "error": message,
                      "error_type": type(exc).__name__}
    if with_traceback:
        result.details["traceback"] = _traceback_tail(exc)
        result.summary = f"{spec.marker}: {what}: {type(exc).__name__}: {message}"
    else:
        result.summary = f"{spec.marker}: {what}: {message}"
    notes = sorted({str(w.message) for w in caught or ()})
    if notes:
        result.details["warnings"] = notes
    _timed(result, start, clock)
    return result


def _timed(result: GateResult, start: float, clock: ImportClock) -> None:
    """``result.seconds`` without the startup imports, which go to ``result.startup_seconds``."""
    elapsed = time.perf_counter() - start
    startup = min(clock.seconds, elapsed)
    result.startup_seconds = startup
    result.seconds = elapsed - startup


def _traceback_tail(exc: BaseException, frames: int = 5) -> list[str]:
    """The last frames of an exception's traceback as ``file:line in function: source`` lines."""
    return [f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
            for frame in traceback.extract_tb(exc.__traceback__)[-frames:]]
