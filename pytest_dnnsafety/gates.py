"""Gate markers: definitions, validation at collection, and evaluation into a GateResult.

A gate is ``@pytest.mark.<marker>(threshold, **options)`` on a test. Each marker has one
:class:`GateDef` in :data:`GATES` saying which metric it measures, how the value is compared
(``>=`` or ``<=``), which options it takes (typed and range-checked) and which fixtures it reads
(a keyword may name another fixture, e.g. ``scenarios="night_scenarios"``).

:func:`parse_marker` runs at collection and raises :class:`MarkerError` naming the test, the
marker, the argument and the fix. :func:`evaluate` runs after the test body passed; the metric
itself is computed by an engine, never here. This module imports no torch at import time.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from .config import Settings, parse_setting
from .errors import ConfigError, DnnSafetyError, MarkerError, MetricError
from .results import GateResult, Measurement, format_number

__all__ = ["Param", "GateDef", "GateSpec", "GATES", "parse_marker", "evaluate", "COMMON_SETTINGS",
           "register_gate", "resolve_optional"]

class _Required:
    def __repr__(self) -> str:
        return "..."


#: Default of a keyword the user must give (e.g. ``layer=...``).
REQUIRED: Any = _Required()

#: Settings every gate accepts as a marker keyword (they win over CLI, env and ini).
COMMON_SETTINGS = ("seed", "device", "batch_size")


@dataclass(frozen=True)
class Param:
    """One keyword option of a gate marker."""

    name: str
    types: tuple[type, ...]
    default: Any
    check: Callable[[Any], str | None] | None = None
    doc: str = ""

    def validate(self, value: Any) -> str | None:
        if isinstance(value, bool) and bool not in self.types:
            return f"expected {self._type_names()}, got a bool"
        if not isinstance(value, self.types):
            return f"expected {self._type_names()}, got {type(value).__name__} {value!r}"
        return self.check(value) if self.check else None

    def _type_names(self) -> str:
        names = {int: "int", float: "float", str: "str", dict: "dict", bool: "bool", type(None): "None"}
        return " or ".join(names.get(t, t.__name__) for t in self.types)


@dataclass(frozen=True)
class GateDef:
    """The definition of one gate marker."""

    marker: str
    metric: str
    op: str  # ">=" or "<="
    threshold_range: tuple[float, float]
    params: tuple[Param, ...]
    fixtures: Mapping[str, str]  # keyword -> default fixture name
    measure: Callable[["GateSpec", Mapping[str, Any], "GateContext"], Measurement]
    doc: str
    #: role -> option: the role's fixture is requested only when that option is set (not None)
    conditional: Mapping[str, str] = field(default_factory=dict)
    #: role -> setting name (e.g. ``{"data": "data"}``): an *optional* role. Its fixture is requested
    #: only when the user named it by marker keyword, the setting is configured (not its default),
    #: or a non-plugin fixture of that name is visible to the test (see :func:`resolve_optional`).
    #: The measure function finds the role in its fixture mapping only when it was requested.
    optional: Mapping[str, str] = field(default_factory=dict)

    def signature(self) -> str:
        parts = ["threshold"]
        parts += [f"{p.name}={p.default!r}" for p in self.params]
        parts += [f"{kw}={name!r}" for kw, name in self.fixtures.items()]
        return f"{self.marker}({', '.join(parts)})"


@dataclass(frozen=True)
class GateSpec:
    """A validated gate marker on one test."""

    marker: str
    threshold: float
    options: Mapping[str, Any]
    fixtures: Mapping[str, str]  # role -> fixture name to request
    settings: Mapping[str, Any] = field(default_factory=dict)  # marker overrides of COMMON_SETTINGS
    #: optional roles not (yet) requested: role -> default fixture name (see GateDef.optional)
    optional: Mapping[str, str] = field(default_factory=dict)

    @property
    def definition(self) -> GateDef:
        return GATES[self.marker]

    def plan_entry(self) -> dict[str, Any]:
        """What the controller must know about this gate before it runs (plain JSON)."""
        gate = self.definition
        return {"marker": self.marker, "metric": gate.metric, "op": gate.op, "threshold": self.threshold}


def register_gate(gate: GateDef, *, replace: bool = False) -> GateDef:
    """Add a gate marker (e.g. from a ``conftest.py`` at import time, before ``pytest_configure``).

    A stop-gap until gate registration goes through a plugin hook. A marker that is already defined
    is an error unless ``replace=True`` (for tests that register the same gate in several runs).
    """
    if gate.marker in GATES and GATES[gate.marker] is not gate and not replace:
        raise ValueError(f"gate marker {gate.marker!r} is already registered; pass replace=True to redefine it")
    GATES[gate.marker] = gate
    return gate


def resolve_optional(spec: GateSpec, settings: Settings, overridden: Callable[[str], bool]) -> GateSpec:
    """The spec with each optional role requested when its setting is configured or its fixture overridden.

    ``overridden(fixture_name)`` tells whether a non-plugin fixture of that name is visible to the test.
    """
    if not spec.optional:
        return spec
    fixtures = dict(spec.fixtures)
    rest: dict[str, str] = {}
    for role, fixture in spec.optional.items():
        setting = spec.definition.optional[role]
        if settings.get(setting).source != "default" or overridden(fixture):
            fixtures[role] = fixture
        else:
            rest[role] = fixture
    return replace(spec, fixtures=fixtures, optional=rest)


@dataclass
class GateContext:
    """What a gate may use besides its fixtures: resolved settings for this gate."""

    settings: Settings
    seed: int
    device: str
    batch_size: int
    cache: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- validation


def _in_range(lo: float, hi: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, float) and math.isnan(value):
            return "is NaN"
        if not lo <= value <= hi:
            return f"{value!r} is outside [{lo}, {hi}]"
        return None

    return check


def _check_where(value: Any) -> str | None:
    if value is None:
        return None
    for key, val in value.items():
        if not isinstance(key, str):
            return f"keys must be condition names (str), got {key!r}"
        values = val if isinstance(val, (list, tuple)) else [val]
        if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            return f"values of {key!r} must be a value or a non-empty list of values, got {val!r}"
    return None


def parse_marker(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str) -> GateSpec:
    """Validate one gate marker's arguments; ``where`` names the test for the error message."""
    gate = GATES[name]

    def fail(argument: str, problem: str, fix: str) -> MarkerError:
        return MarkerError(f"{where}: @pytest.mark.{name}: argument {argument}: {problem}. Fix: {fix}.")

    kwargs = dict(kwargs)
    if len(args) > 1:
        return _raise(fail("*args", f"takes one positional argument (the threshold), got {len(args)}",
                           f"pass options by keyword: {gate.signature()}"))
    if args and "threshold" in kwargs:
        return _raise(fail("threshold", "given both positionally and by keyword", "give it once"))
    if not args and "threshold" not in kwargs:
        return _raise(fail("threshold", "missing", f"write @pytest.mark.{gate.signature()}"))
    threshold = args[0] if args else kwargs.pop("threshold")
    lo, hi = gate.threshold_range
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        return _raise(fail("threshold", f"expected a number, got {type(threshold).__name__} {threshold!r}",
                           f"use a number in [{lo}, {hi}]"))
    problem = _in_range(lo, hi)(threshold)
    if problem:
        return _raise(fail("threshold", problem, f"use a number in [{lo}, {hi}]"))

    params = {p.name: p for p in gate.params}
    options: dict[str, Any] = {}
    fixtures = dict(gate.fixtures)
    overrides: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in params:
            problem = params[key].validate(value)
            if problem:
                return _raise(fail(key, problem, params[key].doc or f"see {gate.signature()}"))
            options[key] = value
        elif key in gate.fixtures:
            if not isinstance(value, str) or not value.isidentifier():
                return _raise(fail(key, f"must name a fixture (an identifier string), got {value!r}",
                                   f"write {key}=\"my_fixture\" and define that fixture"))
            fixtures[key] = value
        elif key in COMMON_SETTINGS:
            try:
                parse_setting(key, value, f"marker @pytest.mark.{name}({key}=...)")
            except ConfigError as exc:
                return _raise(fail(key, str(exc).split(". Fix: ")[0], str(exc).split(". Fix: ")[-1].rstrip(".")))
            overrides[key] = value
        else:
            allowed = sorted([*params, *gate.fixtures, *COMMON_SETTINGS])
            return _raise(fail(key, "unknown keyword", f"use one of {', '.join(allowed)}"))
    for param in gate.params:
        if param.name not in options and param.default is REQUIRED:
            return _raise(fail(param.name, "missing", f"write @pytest.mark.{gate.signature()}; {param.doc}"))
        options.setdefault(param.name, param.default)
    for role, option in gate.conditional.items():
        if options.get(option) is None and role not in kwargs:
            fixtures.pop(role)
    # An optional role named by keyword is requested; otherwise the plugin decides per test
    # (resolve_optional), once it knows the settings and the fixtures visible to the test.
    optional = {role: fixtures.pop(role) for role in gate.optional if role not in kwargs and role in fixtures}
    return GateSpec(name, float(threshold), options, fixtures, overrides, optional)


def _raise(error: Exception) -> Any:
    raise error


# ------------------------------------------------------------------------------------- evaluation


def context_for(spec: GateSpec, settings: Settings) -> GateContext:
    """Settings for one gate, marker keywords first; the device is resolved (``auto`` → cuda/cpu)."""
    from .loading import resolve_device

    resolved = {k: settings.get(k, spec.settings[k], marker=spec.marker) if k in spec.settings else settings.get(k)
                for k in COMMON_SETTINGS}
    device = str(resolve_device(resolved["device"]))
    return GateContext(settings, resolved["seed"].value, device, resolved["batch_size"].value)


def evaluate(spec: GateSpec, fixture_values: Mapping[str, Any], settings: Settings, nodeid: str,
             cache: dict[str, Any] | None = None) -> GateResult:
    """Measure the gate's metric and compare it with the threshold; never raises for metric errors.

    Verdicts: ``passed``/``failed`` from the comparison; ``failed`` whatever the comparison when the
    measurement reports a ``contradiction``; ``inconclusive`` when it reports a violated assumption;
    ``error`` when the metric could not be computed — a :class:`DnnSafetyError` (a message naming the
    cause and the fix) or any other exception (the model raised, a dtype mismatch, a bug), recorded
    with ``details.error_type``, ``details.error`` and ``details.traceback`` (the last frames).
    """
    gate = spec.definition
    start = time.perf_counter()
    result = GateResult(nodeid=nodeid, marker=spec.marker, metric=gate.metric, threshold=spec.threshold,
                        op=gate.op, status="error")
    caught: list[warnings.WarningMessage] = []
    try:
        ctx = context_for(spec, settings)
        if cache is not None:
            ctx.cache = cache
        result.device = str(ctx.device)
        with warnings.catch_warnings(record=True) as caught:
            # An engine's warning (e.g. eps >= r-hat) becomes part of the evidence, not a crash under -W error.
            warnings.simplefilter("always")
            measurement = gate.measure(spec, fixture_values, ctx)
        compared = measurement.bound if measurement.bound is not None else measurement.value
        judged = measurement.inconclusive is None and measurement.contradiction is None
        if judged and (compared is None or not math.isfinite(float(compared))):
            raise MetricError(f"the measured {gate.metric} is {compared!r}, which cannot be compared")
    except DnnSafetyError as exc:
        return _error_result(result, spec, exc, f"cannot compute {gate.metric}", caught, start)
    except Exception as exc:  # the model, the data or an engine raised: an error, never a pass
        return _error_result(result, spec, exc, f"error while computing {gate.metric}", caught, start,
                             with_traceback=True)
    value, bound = _finite(measurement.value), _finite(measurement.bound)
    compared = bound if measurement.bound is not None else value
    ok = compared is not None and (compared >= spec.threshold if gate.op == ">=" else compared <= spec.threshold)
    shown_op = gate.op if ok else ("<" if gate.op == ">=" else ">")
    label = "" if measurement.bound is None else " (bound)"
    result.value = value
    result.bound = bound
    result.details = dict(measurement.details)
    notes = sorted({str(w.message) for w in caught})
    if notes:
        result.details["warnings"] = notes
    detail = f" ({measurement.detail})" if measurement.detail else ""
    if notes:
        detail += " [warning: " + "; ".join(notes) + "]"
    comparison = (f"{format_number(compared)}{label} {shown_op} {format_number(spec.threshold)}"
                  if compared is not None else f"{format_number(compared)}{label} vs {format_number(spec.threshold)}")
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
    result.seconds = time.perf_counter() - start
    return result


def _finite(number: Any) -> float | None:
    if number is None:
        return None
    number = float(number)
    return number if math.isfinite(number) else None


def _error_result(result: GateResult, spec: GateSpec, exc: Exception, what: str,
                  caught: list[warnings.WarningMessage], start: float, with_traceback: bool = False) -> GateResult:
    message = str(exc) or repr(exc)
    result.status, result.passed = "error", None
    # An error may carry JSON-able details of its own (e.g. the scenario rows that break a restriction).
    extra = getattr(exc, "details", None)
    result.details = {**(extra if isinstance(extra, dict) else {}), "error": message,
                      "error_type": type(exc).__name__}
    if with_traceback:
        result.details["traceback"] = _traceback_tail(exc)
        result.summary = f"{spec.marker}: {what}: {type(exc).__name__}: {message}"
    else:
        result.summary = f"{spec.marker}: {what}: {message}"
    notes = sorted({str(w.message) for w in caught or ()})
    if notes:
        result.details["warnings"] = notes
    result.seconds = time.perf_counter() - start
    return result


def _traceback_tail(exc: BaseException, frames: int = 5) -> list[str]:
    """The last frames of an exception's traceback as ``file:line in function: source`` lines."""
    return [f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
            for frame in traceback.extract_tb(exc.__traceback__)[-frames:]]


# ------------------------------------------------------------------------------------- the gates


def _measure_scene_coverage(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Scenario k-projection coverage (Cheng et al. 2018, §II-A, eq. 1), via ScenarioTable.coverage."""
    from .scenarios import ScenarioTable

    table = fx["scenarios"]
    if not isinstance(table, ScenarioTable):
        raise MetricError(
            f"fixture {spec.fixtures['scenarios']!r} returned {type(table).__name__}, not a ScenarioTable. "
            "Fix: return pytest_dnnsafety.ScenarioTable(Conditions(domains, restrictions), rows)"
        )
    data = fx.get("data")  # present when the data is configured, overridden or named by keyword
    if data is not None:
        from .scenarios import check_rows_match, count_samples

        check_rows_match(table, count_samples(data), table_fixture=spec.fixtures["scenarios"],
                         data_fixture=spec.fixtures["data"])
    opts = spec.options
    res = table.coverage(k=opts["k"], min_count=opts["min_count"], where=opts["where"], seed=ctx.seed)
    return Measurement(value=res.value, detail=res.detail(), details=res.to_details())


def _layer_activations(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """The gate's layer activations from the session's cache (one forward pass shared by all gates)."""
    from .activations import ActivationCache

    cache = ctx.cache.setdefault("activations", ActivationCache())
    plan = ctx.cache.get("layer_plan", {}).get((spec.fixtures["model"], spec.fixtures["data"]), ())
    layer = spec.options["layer"]
    return cache.get(fx["model"], fx["data"], [layer], batch_size=ctx.batch_size, device=ctx.device,
                     plan=plan)[layer]


def _measure_neuron_k_activation(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Neuron k-activation coverage (Cheng et al. 2018, §II-B, eq. 2) of one layer."""
    from .engines.neurons import NeuronKActivationEngine

    opts = spec.options
    acts = _layer_activations(spec, fx, ctx).reduced(opts["reduce"])
    engine = NeuronKActivationEngine(acts.shape[1], k=opts["k"], activation_threshold=opts["activation_threshold"],
                                     device=acts.device)
    engine.update(acts)
    res = engine.compute()
    details = {"layer": opts["layer"], "reduce": opts["reduce"], **res.to_details()}
    return Measurement(value=res.value, detail=f"layer {opts['layer']}, {res.detail()}", details=details)


def _measure_pattern_deviation(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Neuron activation-pattern deviation (Cheng et al. 2018, §II-C, eq. 3), optionally in one scenario."""
    from .engines.neurons import NeuronPatternEngine
    from .scenarios import ScenarioTable

    opts = spec.options
    acts = _layer_activations(spec, fx, ctx).reduced(opts["reduce"])
    scope = "all inputs"
    if opts["where"] is not None:
        table = fx["scenarios"]
        if not isinstance(table, ScenarioTable):
            raise MetricError(f"fixture {spec.fixtures['scenarios']!r} returned {type(table).__name__}, "
                              "not a ScenarioTable; `where` needs the scenario table")
        from .scenarios import check_rows_match

        check_rows_match(table, int(acts.shape[0]), table_fixture=spec.fixtures["scenarios"],
                         data_fixture=spec.fixtures["data"])
        mask = table.row_mask(opts["where"]).to(acts.device)
        acts = acts[mask]
        scope = ", ".join(f"{k}={v}" for k, v in opts["where"].items())
        if acts.shape[0] == 0:
            raise MetricError(f"no inputs match where={opts['where']!r}; the metric needs at least one")
    engine = NeuronPatternEngine(acts.shape[1], groups=opts["groups"],
                                 activation_threshold=opts["activation_threshold"], device=acts.device)
    engine.update(acts)
    res = engine.compute()
    details = {"layer": opts["layer"], "reduce": opts["reduce"], "where": opts["where"], **res.to_details()}
    return Measurement(value=res.value, detail=f"layer {opts['layer']}, {scope}, {res.detail()}", details=details)


def _measure_pmi_ub(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Upper confidence bound on the pmi (Zhao et al. 2021, eqs. 1–14) under the operational profile."""
    from .engines.reliability import assess_reliability
    from .loading import as_tensors

    opts = dict(spec.options)
    labelled = as_tensors(fx["data"], f"labelled data (fixture {spec.fixtures['data']!r})")
    if labelled[1] is None:
        raise MetricError(f"fixture {spec.fixtures['data']!r} has no labels; the pmi needs labelled points "
                          "for r-separation and cell labels. Fix: provide (x, y)")
    # Only what the user set reaches the engine (its defaults equal the marker's); grid-only and
    # ball-only options then never collide.
    defaults = {param.name: param.default for param in spec.definition.params}
    given = {k: v for k, v in opts.items() if v != defaults[k]}
    for key in ("box", "clip"):
        if given.get(key) is not None:
            given[key] = tuple(given[key])
    if given.get("failures") is not None:
        given["failures"] = [tuple(pair) for pair in given["failures"]]
    compare = tuple(m for m in opts["compare_methods"] if m != opts["method"])
    given.pop("compare_methods", None)
    result = assess_reliability(fx["model"], fx["profile"], labelled, compare_methods=compare,
                                seed=ctx.seed, device=ctx.device, **given)
    return _pmi_measurement(result)


def _pmi_measurement(result: Any) -> Measurement:
    """A :class:`ReliabilityResult` as a Measurement: contradictions fail, violated assumptions are inconclusive.

    * ``contradiction`` — the labelled data refute the bound (the model's labelled error is above
      ``Ub`` at the gate's confidence, or the model's vote, Assumption 5, is refuted where labels
      are known): the gate fails whatever the comparison.
    * ``inconclusive`` — an assumption of the method is violated (``ε``/radius ``≥ r̂``, labelled
      points outside the box, cross-boundary cells), unless the marker says
      ``accept_violated_assumptions=True``: then the bound is compared and the detail says so.
    """
    details = result.to_details()
    detail = result.detail()
    contradiction = "; ".join(result.contradictions) or None
    inconclusive = None
    if result.violations:
        joined = "; ".join(result.violations)
        if result.violations_accepted:
            detail += f"; VIOLATED ASSUMPTIONS ACCEPTED (accept_violated_assumptions=True): {joined}"
        else:
            inconclusive = (f"violated assumption(s) of the reliability method: {joined}. The bound is not evidence "
                            f"until they hold (or, knowingly, accept_violated_assumptions=True)")
    return Measurement(value=result.E, bound=result.Ub, detail=detail, details=details,
                       inconclusive=inconclusive, contradiction=contradiction)


_PMI_METHODS = ("chernoff", "normal", "clopper-pearson", "jeffreys")


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"{value!r} is not one of {', '.join(map(repr, choices))}"


def _positive_or_auto(value: Any) -> str | None:
    values = value if isinstance(value, (list, tuple)) else [value]
    if value == "auto":
        return None
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        return f"{value!r} must be 'auto', a positive number or a list of positive numbers"
    return None


def _box(value: Any) -> str | None:
    if value is None:
        return None
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(c, (list, tuple)) and c and all(isinstance(v, (int, float)) for v in c) for c in value)
          and len(value[0]) == len(value[1]) and all(lo < hi for lo, hi in zip(*value)))
    return None if ok else f"{value!r} must be [lower corner, upper corner] with lower < upper in every dimension"


def _pairs(value: Any) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and value and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in p)
        for p in value)
    return None if ok else f"{value!r} must be a non-empty list of (true class, predicted class) integer pairs"


def _methods(value: Any) -> str | None:
    bad = [m for m in value if m not in _PMI_METHODS]
    return f"unknown method(s) {bad}; use {', '.join(_PMI_METHODS)}" if bad else None


def _none_or_positive(value: Any) -> str | None:
    return None if value is None or value >= 1 else f"{value!r} must be >= 1"


def _is_layer(value: Any) -> str | None:
    return None if value else "must be a non-empty module name such as 'features.3'"


def _is_reduce(value: Any) -> str | None:
    return None if value in ("max", "mean") else f"{value!r} is not one of 'max', 'mean'"


def _is_finite(value: Any) -> str | None:
    return None if math.isfinite(value) else f"{value!r} is not finite"


_K = Param("k", (int,), 2, _in_range(1, 3), "use k = 1, 2 or 3")
_LAYER = Param("layer", (str,), REQUIRED, _is_layer,
               "name the layer as in model.named_modules(), e.g. layer='features.3'")
_ACT_THRESHOLD = Param("activation_threshold", (int, float), 0.0, _is_finite,
                       "a neuron is on when its activation is above this number (default 0: ReLU fires)")
_REDUCE = Param("reduce", (str,), "max", _is_reduce,
                "use 'max' or 'mean': how a conv channel's feature map becomes one activation")

GATES: dict[str, GateDef] = {
    gate.marker: gate
    for gate in [
        GateDef(
            marker="min_scene_coverage",
            metric="scenario k-projection coverage",
            op=">=",
            threshold_range=(0.0, 1.0),
            params=(
                _K,
                Param("min_count", (int,), 1, _in_range(1, 10**9),
                      "use a positive integer: a cell counts as covered with at least min_count rows"),
                Param("where", (dict, type(None)), None, _check_where,
                      "use a dict of condition -> value or list of values, e.g. where={'lighting': 'night'}"),
            ),
            fixtures={"scenarios": "scenario_table", "data": "dataset"},
            optional={"data": "data"},
            measure=_measure_scene_coverage,
            doc="fail unless the scenario table covers at least `threshold` of all feasible k-way "
                "combinations of operating-condition values (Cheng et al. 2018, eq. 1)",
        ),
        GateDef(
            marker="min_neuron_k_activation",
            metric="neuron k-activation coverage",
            op=">=",
            threshold_range=(0.0, 1.0),
            params=(_LAYER, _K, _ACT_THRESHOLD, _REDUCE),
            fixtures={"model": "model", "data": "dataset"},
            measure=_measure_neuron_k_activation,
            doc="fail unless the data shows at least `threshold` of all on/off patterns of every k-tuple of "
                "neurons in `layer` (Cheng et al. 2018, eq. 2)",
        ),
        GateDef(
            marker="max_neuron_pattern_deviation",
            metric="neuron activation-pattern deviation",
            op="<=",
            threshold_range=(0.0, 1.0),
            params=(_LAYER, Param("groups", (int,), 10, _in_range(1, 10**6), "use a positive number of groups"),
                    Param("where", (dict, type(None)), None, _check_where,
                          "use a dict of condition -> value(s) selecting one scenario's inputs"),
                    _ACT_THRESHOLD, _REDUCE),
            fixtures={"model": "model", "data": "dataset", "scenarios": "scenario_table"},
            conditional={"scenarios": "where"},
            measure=_measure_pattern_deviation,
            doc="fail if more than `threshold` of the inputs (of one scenario with `where`) activate a number of "
                "neurons in `layer` outside the dominant group and its neighbours (Cheng et al. 2018, eq. 3)",
        ),
        GateDef(
            marker="max_pmi_ub",
            metric="pmi upper bound",
            op="<=",
            threshold_range=(0.0, 1.0),
            params=(
                Param("confidence", (float,), 0.975, _in_range(1e-9, 1 - 1e-9),
                      "use a confidence strictly between 0 and 1, e.g. 0.975"),
                Param("method", (str,), "chernoff", _one_of(*_PMI_METHODS),
                      "chernoff (sound, default), normal (the paper's eq. 7), clopper-pearson or jeffreys"),
                Param("eps", (int, float, str, list, tuple), "auto", _positive_or_auto,
                      "cell side: 'auto' (below r-hat), a positive number, or one per dimension"),
                Param("eps_fraction", (int, float), 1.0, _in_range(1e-9, 1e9), "a positive fraction of r-hat"),
                Param("box", (list, tuple, type(None)), None, _box,
                      "box=[[lower...], [upper...]] in profile space; None: the data's range"),
                Param("samples_per_cell", (int,), 1000, _in_range(1, 10**9), "a positive number of samples"),
                Param("allocation", (str,), "uniform", _one_of("uniform", "proportional"),
                      "uniform, or proportional to cell mass"),
                Param("bootstrap", (int,), 100, _in_range(0, 10**6), "KDE refits for Var(Op); 0 takes masses as known"),
                Param("bandwidth", (str, int, float, list, tuple, type(None)), None, None,
                      "'scott', 'silverman', a number or one per dimension"),
                Param("mass", (str,), "exact", _one_of("exact", "centre"),
                      "exact box integrals, or centre (the paper's eq. 9)"),
                Param("mass_target", (int, float), 1.0, _in_range(1e-9, 1.0), "a share of OP mass in (0, 1]"),
                Param("max_cells", (int, type(None)), None, _none_or_positive,
                      "a positive cell budget or None"),
                Param("conservative_rest", (bool,), True, None, "True counts unevaluated mass as failing"),
                Param("failures", (list, tuple, type(None)), None, _pairs,
                      "critical confusions as [(true, predicted), ...]; None: any misclassification"),
                Param("compare_methods", (list, tuple), ("normal",), _methods,
                      "other methods to report beside the gated one"),
                Param("cells", (str,), "grid", _one_of("grid", "balls"),
                      "grid (a box of side eps) or balls (norm balls around operational inputs, for images)"),
                Param("radius", (int, float, str, type(None)), None,
                      lambda v: None if v is None else _positive_or_auto(v),
                      "ball radius: a positive number or 'auto' (r-hat under the norm)"),
                Param("norm", (str,), "linf", _one_of("linf", "l2"), "linf or l2"),
                Param("max_balls", (int, type(None)), None, _none_or_positive,
                      "a positive number of balls or None (all operational inputs)"),
                Param("clip", (list, tuple, type(None)), None,
                      lambda v: None if v is None or (len(v) == 2 and all(isinstance(c, (int, float)) for c in v)
                                                      and v[0] < v[1]) else f"{v!r} must be (low, high)",
                      "the valid input range, e.g. clip=(0, 1)"),
                Param("empty_cell_label", (str,), "model", _one_of("model", "nearest"),
                      "model (the model's majority vote, the paper's Assumption 5) or nearest (the label of the "
                      "nearest labelled point)"),
                Param("labelled_from_profile", (bool,), True, None,
                      "True: the labelled data are a sample of the operational profile, so their error rate must "
                      "not exceed the bound; False skips that check"),
                Param("accept_violated_assumptions", (bool,), False, None,
                      "True compares the bound even when an assumption (e.g. eps < r-hat) is violated; default: "
                      "the gate is inconclusive"),
            ),
            fixtures={"model": "model", "profile": "operational_profile", "data": "dataset"},
            measure=_measure_pmi_ub,
            doc="fail unless the upper confidence bound on the probability of misclassification per input "
                "under the operational profile is at most `threshold` (Zhao et al. 2021, eqs. 5-7)",
        ),
    ]
}
