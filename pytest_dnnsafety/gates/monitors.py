"""Built-in gate family: runtime safety monitors (``min_monitor_detection``, ``max_monitor_selective_risk``,
``max_monitor_overhead``; the benchmark of Ferreira et al.; docs: gates/monitors.md).

A monitor rejects inputs the model should not decide on. The gates read it from the ``monitors``
fixture (a mapping name → monitor: the plugin's default holds ``msp``, ``odin``, ``energy`` and, for
detectors, ``detection_score``; a
project's ``conftest.py`` configures its own, feature-based and user monitors included) and fit it
once per session on ``monitor_data`` (in-distribution data only; a seeded share is held out to
calibrate the alarm threshold). Fault data are the evaluation data under the seeded fault families
of :mod:`..engines.monitors.faults` at severities 1–5, plus novel classes from ``ood_data``.

* ``min_monitor_detection`` — detection with OOD as the positive class (MCC by default) of every
  fault set (family × severity) against the in-distribution evaluation data; the gate compares the
  worst set (or the mean) and the summary names it. ``compare=`` ranks the monitor against others over
  the same sets (Friedman test, Nemenyi critical difference; the diagram is in the HTML report).
* ``max_monitor_selective_risk`` — the system view: error rate among the inputs the monitor accepts
  (model + monitor), with a Clopper–Pearson upper bound, against the model alone. Novel classes and
  anomalies have no right answer: every decision on them counts as an error.
* ``max_monitor_overhead`` — the monitor's time per input relative to the model's forward pass.

The measurements are :mod:`pytest_dnnsafety.engines.monitors.gating`'s, on the gate's fixtures as a
:class:`~pytest_dnnsafety.engines.monitors.bench.MonitorBench` (the classifier and detector variants:
:mod:`~pytest_dnnsafety.engines.monitors.variants`). Fitted monitors, scores and fault sets are
memoised per session (``ctx.memo``, keyed by the fixture objects): three gates on one monitor fit it
once and score each data set once; the forward passes go through the shared activation cache.
Nothing holds the evaluation images: a fault set is a lazy :class:`~..engines.monitors.FaultStream`
(faulted batch by batch as it is read; its seeds depend on the batch size), shapes are compared on
first batches, and what is kept per input is a score, a prediction or an error flag. Under torchrun
the scoring of the evaluation and fault data is sharded by batches (each rank forwards its share;
the per-input scores and errors are all-gathered, so every rank computes the single-process values);
``max_monitor_overhead`` is timed on rank 0 alone (the other ranks adopt its verdict). No torch
import at module level.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_faults, plot_ranking
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import monitor_cost, overhead_cost
from pytest_dnnsafety.gates.checks import in_range, is_interval, one_of
from pytest_dnnsafety.gates.shared import activation_cache

if TYPE_CHECKING:  # pragma: no cover
    from pytest_dnnsafety.engines.monitors.bench import MonitorBench

__all__ = [
    "MIN_MONITOR_DETECTION", "MAX_MONITOR_SELECTIVE_RISK", "MAX_MONITOR_OVERHEAD", "FAULT_GROUP_NAMES",
    "DETECTION_METRICS", "SEVERITY_FREE_NAMES",
    "pytest_dnnsafety_register_gates",
]

#: Detection metrics a ``min_monitor_detection`` gate can compare (all: higher is better).
DETECTION_METRICS = ("mcc", "f1", "recall", "precision", "specificity", "auroc")

#: The fault groups and families by name, without importing torch at collection (a test checks them
#: against :mod:`..engines.monitors.faults`).
FAULT_GROUP_NAMES = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "gaussian_blur"),
    "shift": ("brightness", "contrast", "haze", "rotation"),
    "anomaly": ("black_frame", "zeroed_rows", "copied_rows", "shifted_rows"),
    "adversarial": ("fgsm", "pgd"),
}

#: The families that have one fault set whatever the severities (checked against the engine's by a test).
SEVERITY_FREE_NAMES = ("black_frame",)


# ------------------------------------------------------------------------------------- measurements


def _bench(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> MonitorBench:
    """The monitor benchmark of this gate's fixtures on the session's memo and shared forward pass."""
    from pytest_dnnsafety.engines.monitors.bench import MonitorBench
    from pytest_dnnsafety.engines.monitors.session import MonitorSession

    session = MonitorSession(ctx.memo, activation_cache(ctx), seed=ctx.seed, batch_size=ctx.batch_size,
                             device=ctx.device, task=ctx.task)
    return MonitorBench(session, fx, roles=spec.fixtures, marker=spec.marker)


def _measure_detection(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Detection (OOD positive) of each fault set against the in-distribution data; the worst set or the mean."""
    from pytest_dnnsafety.engines.monitors.gating import detection

    o = spec.options
    result = detection(_bench(spec, fx, ctx), o["monitor"], faults=o["faults"], severity=o["severity"],
                       clip=o["clip"], metric=o["metric"], aggregate=o["aggregate"], compare=o["compare"],
                       alpha=o["alpha"])
    return Measurement(value=result.value, detail=result.detail(), details=result.to_details(),
                       inconclusive=result.inconclusive)


def _measure_selective_risk(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Error rate among accepted inputs (model + monitor), its upper confidence bound, and the model alone."""
    from pytest_dnnsafety.engines.monitors.gating import selective_risk

    o = spec.options
    result = selective_risk(_bench(spec, fx, ctx), o["monitor"], faults=o["faults"], severity=o["severity"],
                            clip=o["clip"], confidence=o["confidence"], gate_on=o["gate_on"])
    return Measurement(value=result.value, bound=result.gated_bound, detail=result.detail(),
                       details=result.to_details(), inconclusive=result.inconclusive)


def _measure_overhead(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The monitor's time per input relative to the model's forward pass, and its memory (rank 0 times it)."""
    from pytest_dnnsafety.engines.monitors.gating import overhead

    result = overhead(_bench(spec, fx, ctx), spec.options["monitor"], repeats=spec.options["repeats"])
    return Measurement(value=result.value, detail=result.detail(), details=result.to_details())


# ------------------------------------------------------------------------------------- marker keywords


def _faults_spec(value: Any) -> str | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not names or not all(isinstance(n, str) and n for n in names):
        return "must be a family or group name, or a non-empty list of them"
    families = [f for group in FAULT_GROUP_NAMES.values() for f in group]
    unknown = [n for n in names if n not in {*families, *FAULT_GROUP_NAMES, "novel"}]
    if unknown:
        return (f"unknown fault(s) {unknown}; known groups: {', '.join(FAULT_GROUP_NAMES)}; families: "
                f"{', '.join(families)}; and 'novel'")
    return None


def _severity_spec(value: Any) -> str | None:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(values, (list, tuple)) or not values
            or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 5 for v in values)):
        return f"{value!r} is not a severity in 1..5 or a non-empty list of them"
    return None


def _names_spec(value: Any) -> str | None:
    if not all(isinstance(n, str) and n for n in value):
        return "must list monitor names (str) of the monitors fixture"
    return None


def _fault_set_names(faults: Any, severity: Any) -> list[str]:
    """The fault sets the (validated) ``faults`` and ``severity`` give, named as the engine names them."""
    names = [faults] if isinstance(faults, str) else list(faults)
    families = dict.fromkeys(f for name in names for f in FAULT_GROUP_NAMES.get(name, (name,)))
    levels = dict.fromkeys([severity] if isinstance(severity, int) else severity)
    return [f if f == "novel" or f in SEVERITY_FREE_NAMES else f"{f} s{level}"
            for f in families for level in (levels if f != "novel" and f not in SEVERITY_FREE_NAMES else [None])]


def _compare_problem(options: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """("compare", problem, fix) of ``compare=`` given the other keywords, or None (:attr:`GateDef.together`, checked
    at collection): what the ranking needs that the marker alone decides — a monitor besides the gate's own and two
    or more fault sets."""
    compare, monitor = list(options.get("compare") or ()), options["monitor"]
    if not compare:
        return None
    if not [name for name in compare if name != monitor]:
        return ("compare", f"compare={compare!r} names no monitor besides monitor={monitor!r}",
                "list other monitors of the `monitors` fixture to rank against, e.g. compare=['msp', 'odin'], or "
                "leave compare= out")
    sets = _fault_set_names(options["faults"], options["severity"])
    if len(sets) < 2:
        return ("compare", f"compare={compare!r} ranks monitors over fault sets (Friedman test), but faults="
                f"{options['faults']!r} with severity={options['severity']!r} gives {len(sets)} fault set "
                f"({', '.join(sets)}); the ranking needs at least two",
                "request two or more fault sets (several families, or severities such as severity=(3, 4, 5)), or "
                "leave compare= out")
    return None


_MONITOR = Param("monitor", (str,), REQUIRED, lambda v: None if v else "is empty",
                 "name a monitor of the `monitors` fixture, e.g. monitor='energy' (the default fixture has 'msp', "
                 "'odin', 'energy' and 'detection_score'; conftest.py may define more)")
_FAULTS_DOC = ("list fault families or groups: 'noise', 'shift', 'anomaly', 'adversarial', 'novel' (needs "
               "ood_data), or single families such as 'gaussian_noise'")
_CLIP = Param("clip", (tuple, list, type(None)), (0.0, 1.0), is_interval,
              "give the valid input range as clip=(low, high) (faults stay inside it), or clip=None")
_SEVERITY = Param("severity", (int, tuple, list), (1, 2, 3, 4, 5), _severity_spec,
                  "give a severity 1..5 or a list of them, e.g. severity=3 or severity=(3, 4, 5)")
_FIXTURES = {"model": "model", "data": "dataset", "fit_data": "monitor_data", "monitors": "monitors",
             "novel": "ood_data"}

MIN_MONITOR_DETECTION = GateDef(
    marker="min_monitor_detection",
    metric="monitor detection",
    op=">=",
    threshold_range=(-1.0, 1.0),
    params=(
        _MONITOR,
        Param("faults", (str, tuple, list), ("noise", "shift", "anomaly"), _faults_spec, _FAULTS_DOC),
        _SEVERITY,
        Param("metric", (str,), "mcc", one_of(*DETECTION_METRICS),
              f"use one of {', '.join(DETECTION_METRICS)} (OOD is the positive class)"),
        Param("aggregate", (str,), "worst", one_of("worst", "mean"),
              "use 'worst' (the gate compares the worst fault set) or 'mean' (the mean over the sets)"),
        Param("compare", (tuple, list), (), _names_spec,
              "list other monitors of the `monitors` fixture to rank against, e.g. compare=['msp', 'odin']"),
        Param("alpha", (float,), 0.05, in_range(0.001, 0.5), "use a significance level in [0.001, 0.5]"),
        _CLIP,
    ),
    fixtures=_FIXTURES,
    optional={"novel": "ood_data"},
    measure=_measure_detection,
    cost=monitor_cost,
    together=_compare_problem,  # compare= misuse is a collection error, before any monitor is fitted
    signal=("model", "data"),  # checked on the labelled in-distribution evaluation data (OOD data have no labels)
    tasks=("single-label", "detection"),  # a detector: a score-based monitor (DetectionScore), faults on the images
    shards=True,  # each rank scores its share of every data set's batches; the scores are all-gathered
    doc="fail if the monitor's detection (OOD positive; MCC by default) of the worst fault family and severity "
        "falls below `threshold` (Ferreira et al., safety-monitor benchmark; docs: gates/monitors.md)",
)

MAX_MONITOR_SELECTIVE_RISK = GateDef(
    marker="max_monitor_selective_risk",
    metric="selective risk",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(
        _MONITOR,
        Param("faults", (str, tuple, list, type(None)), None, _faults_spec,
              _FAULTS_DOC + "; None (default): the in-distribution data alone"),
        _SEVERITY,
        Param("confidence", (float,), 0.95, in_range(0.5, 0.999999), "use a confidence in [0.5, 0.999999]"),
        Param("gate_on", (str,), "bound", one_of("bound", "value"),
              "use 'bound' (the upper confidence bound must stay below the threshold) or 'value' (the estimate)"),
        _CLIP,
    ),
    fixtures=_FIXTURES,
    optional={"novel": "ood_data"},
    measure=_measure_selective_risk,
    cost=monitor_cost,
    signal=("model", "data"),  # checked on the labelled in-distribution evaluation data (OOD data have no labels)
    tasks=("single-label", "detection"),  # a detector's error: a missed object or a false detection per image
    shards=True,  # each rank scores its share of every data set's batches; scores and errors all-gathered
    doc="fail if the error rate among the inputs the monitor accepts (its upper confidence bound by default) "
        "exceeds `threshold` (the system view of Ferreira et al.'s benchmark)",
)

MAX_MONITOR_OVERHEAD = GateDef(
    marker="max_monitor_overhead",
    metric="monitor overhead",
    op="<=",
    threshold_range=(0.0, math.inf),
    params=(
        _MONITOR,
        Param("repeats", (int,), 5, in_range(1, 1000), "give how many timed repetitions to take the fastest of"),
    ),
    fixtures={"model": "model", "data": "dataset", "fit_data": "monitor_data", "monitors": "monitors"},
    measure=_measure_overhead,
    cost=overhead_cost,
    timed=True,  # a wall-clock ratio: under torchrun only rank 0 times it and every rank takes its verdict
    doc="fail if the monitor's time per input exceeds `threshold` times the model's forward time per input",
)


#: The monitors family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("monitors", "Runtime monitors",
                (MIN_MONITOR_DETECTION, MAX_MONITOR_SELECTIVE_RISK, MAX_MONITOR_OVERHEAD),
                plots={"faults": plot_faults, "ranking": plot_ranking}, order=80)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
