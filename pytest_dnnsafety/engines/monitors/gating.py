"""The three measurements of the monitor benchmark (Ferreira et al.), each with its result and its report text.

* :func:`detection` → :class:`DetectionResult` — detection with OOD as the positive class (MCC by default)
  of every fault set (family × severity) against the in-distribution evaluation data; the worst set (or the
  mean), and with ``compare=`` the monitor ranked against others over the same sets (Friedman test,
  Nemenyi critical difference);
* :func:`selective_risk` → :class:`SelectiveRiskResult` — the system view: the error rate among the inputs
  the monitor accepts (model + monitor), with a Clopper–Pearson upper bound, against the model alone;
  inputs without a right answer count as errors whatever the decision;
* :func:`overhead` → :class:`OverheadResult` — the monitor's time per input relative to the model's forward
  pass, and its state's memory; under torchrun timed on rank 0 alone (the other ranks get a placeholder
  and adopt rank 0's verdict).

Each takes a :class:`~.bench.MonitorBench` (the gate's fixtures on the session) and plain options, and
returns a result whose ``value``, ``detail()`` and ``to_details()`` are what the gate reports. Pure torch;
no pytest import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_dnnsafety.engines.monitors.base import Monitor
from pytest_dnnsafety.engines.monitors.bench import FaultSet, MonitorBench, set_name
from pytest_dnnsafety.engines.monitors.faults import fault_parameters
from pytest_dnnsafety.engines.monitors.metrics import DetectionMetrics, SystemView, detection_metrics, system_view
from pytest_dnnsafety.engines.monitors.overhead import Overhead, measure_overhead
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.stats.intervals import clopper_pearson_upper
from pytest_dnnsafety.stats.ranking import cd_cliques, friedman, nemenyi_cd

__all__ = ["DetectionResult", "OverheadResult", "SelectiveRiskResult", "detection", "overhead", "selective_risk"]


# ------------------------------------------------------------------------------------- detection


def _metric_of(metrics: DetectionMetrics, metric: str) -> float:
    value = getattr(metrics, metric)
    value = float("nan") if value is None else float(value)
    # No alarm at all leaves precision undefined: the monitor caught nothing, which counts as 0.
    return 0.0 if math.isnan(value) and metric == "precision" else value


def _detection_table(bench: MonitorBench, name: str, sets: Sequence[FaultSet], metric: str
                     ) -> tuple[Monitor, list[dict[str, Any]], list[float]]:
    """The fitted monitor ``name``, its detection counts per fault set (rows) and its ``metric`` per set."""
    monitor, key = bench.fitted(name)
    id_scores = bench.scores(monitor, key, bench.fx["data"])
    rows, values = [], []
    for family, severity, data in sets:
        m = detection_metrics(id_scores, bench.scores(monitor, key, data), monitor.threshold)
        rows.append({"family": family, "severity": severity, "n_ood": m.tp + m.fn, **m.to_dict()})
        values.append(_metric_of(m, metric))
    return monitor, rows, values


def _check_compare(bench: MonitorBench, name: str, compare: Sequence[str], n_sets: int | None = None) -> None:
    """ConfigError naming the fix unless ``compare`` names monitors of the bank besides ``name`` and there are two or
    more fault sets: called before any monitor is fitted or any data scored (the gate checks the first and the
    number of sets at collection already; the bank's names are known only once its fixture ran)."""
    others = [n for n in dict.fromkeys(compare) if n != name]
    role = bench.roles["monitors"]
    if not others:
        raise ConfigError(f"{bench.marker}: compare= names no monitor besides {name!r}. Fix: list other monitors of "
                          f"the {role!r} fixture, e.g. compare=['msp', 'odin'].")
    bank = bench.fx["monitors"]
    unknown = [n for n in others if isinstance(bank, Mapping) and n not in bank]
    if unknown:
        raise ConfigError(f"{bench.marker}: compare= names {', '.join(map(repr, unknown))}, which "
                          f"{'is' if len(unknown) == 1 else 'are'} not in fixture {role!r} (it has "
                          f"{', '.join(map(repr, bank)) or 'none'}). Fix: name monitors of that fixture, or add them "
                          "to it in conftest.py.")
    for other in others:
        bench.monitor(other)  # a ConfigError when the bank's entry is not a monitor
    if n_sets is not None and n_sets < 2:
        raise ConfigError(f"{bench.marker}: compare= ranks monitors over fault sets, but only one set is requested. "
                          "Fix: request at least two (several families or severities).")


def _ranking(bench: MonitorBench, sets: Sequence[FaultSet], name: str, values: list[float], *, metric: str,
             compare: Sequence[str], alpha: float) -> dict[str, Any]:
    """``name`` ranked against the ``compare`` monitors by ``metric`` over the fault sets (Friedman, Nemenyi CD)."""
    names = [name] + [n for n in dict.fromkeys(compare) if n != name]  # checked by detection() before the work
    columns = [values] + [_detection_table(bench, other, sets, metric)[2] for other in names[1:]]
    table = [[col[i] for col in columns] for i in range(len(sets))]
    result = friedman(table, higher_is_better=True)
    cd = nemenyi_cd(len(names), len(sets), alpha)
    return {"monitors": names, "average_ranks": list(result.average_ranks), "cd": cd, "alpha": alpha,
            "statistic": result.statistic, "pvalue": result.pvalue, "n_blocks": result.n_blocks,
            "cliques": [list(c) for c in cd_cliques(result.average_ranks, cd)],
            "table": {"sets": [set_name(f, s) for f, s, _ in sets], "values": table}}


@dataclass
class DetectionResult:
    """A monitor's detection of each fault set: the worst set's (or the mean) ``metric``, the counts per set.

    ``undefined`` names the sets whose metric is undefined (the result is inconclusive then, and carries
    neither the monitor's description nor a ranking)."""

    monitor: str
    metric: str
    aggregate: str
    rows: list[dict[str, Any]]
    values: list[float]
    about: dict[str, Any] = field(default_factory=dict)
    ranking: dict[str, Any] | None = None

    @property
    def undefined(self) -> list[str]:
        return [set_name(r["family"], r["severity"]) for r, v in zip(self.rows, self.values) if math.isnan(v)]

    @property
    def inconclusive(self) -> str | None:
        bad = self.undefined
        return f"{self.metric} is undefined for {', '.join(bad)}" if bad else None

    @property
    def worst(self) -> int:
        return min(range(len(self.values)), key=self.values.__getitem__)

    @property
    def value(self) -> float:
        if self.undefined:
            return float("nan")
        return self.values[self.worst] if self.aggregate == "worst" else sum(self.values) / len(self.values)

    def detail(self) -> str:
        if self.undefined:
            return f"{self.metric} undefined for {', '.join(self.undefined)}"
        name, metric, rows, worst = self.monitor, self.metric, self.rows, self.worst
        worst_set = set_name(rows[worst]["family"], rows[worst]["severity"])
        worst_text = f"worst {worst_set} {metric} {self.values[worst]:.3f}"
        detail = (f"{name}: {worst_text} over {len(rows)} fault set(s); in-distribution alarms "
                  f"{rows[0]['fp']}/{rows[0]['fp'] + rows[0]['tn']}")
        if self.aggregate == "mean":
            detail = f"{name}: mean {metric} {self.value:.3f} over {len(rows)} fault set(s); {worst_text}"
        if self.ranking is not None:
            r = self.ranking
            detail += (f"; Friedman p={r['pvalue']:.3g}, average rank {r['average_ranks'][0]:.2f} of "
                       f"{len(r['monitors'])} (CD {r['cd']:.2f})")
        return detail

    def to_details(self) -> dict[str, Any]:
        rows, metric = self.rows, self.metric
        if self.undefined:
            return {"faults": rows, "metric": metric}
        worst = self.worst
        details: dict[str, Any] = {
            **self.about, "metric": metric, "aggregate": self.aggregate, "faults": rows,
            "worst": {"family": rows[worst]["family"], "severity": rows[worst]["severity"], metric: self.values[worst]},
            "fault_parameters": {f: {str(s): t for s, t in fault_parameters(f).items()
                                     if s in {r["severity"] for r in rows if r["family"] == f}}
                                 for f in dict.fromkeys(r["family"] for r in rows) if f != "novel"},
            "id_alarms": rows[0]["fp"], "id_inputs": rows[0]["fp"] + rows[0]["tn"],
        }
        if self.ranking is not None:
            details["ranking"] = self.ranking
        return details


def detection(bench: MonitorBench, name: str, *, faults: Any, severity: Any, clip: Any, metric: str,
              aggregate: str, compare: Sequence[str], alpha: float) -> DetectionResult:
    """Detection (OOD positive) by monitor ``name`` of each fault set against the in-distribution data."""
    if compare:
        _check_compare(bench, name, compare)  # before any work: the sets are lazy streams
    sets = bench.sets(faults, severity, clip)
    if compare:
        _check_compare(bench, name, compare, len(sets))
    monitor, rows, values = _detection_table(bench, name, sets, metric)
    result = DetectionResult(name, metric, aggregate, rows, values)
    if result.undefined:
        return result
    result.about = bench.about(name, monitor)
    if compare:
        result.ranking = _ranking(bench, sets, name, values, metric=metric, compare=compare, alpha=alpha)
    return result


# ------------------------------------------------------------------------------------- system view


@dataclass
class SelectiveRiskResult:
    """The monitor + model as one system over all the data sets pooled (``system``) and per set.

    ``bound``: the upper confidence bound on the selective risk (None when the monitor accepted nothing:
    the risk is undefined and the result inconclusive)."""

    monitor: str
    system: SystemView
    per_set: dict[str, dict[str, Any]]
    confidence: float
    gate_on: str
    about: dict[str, Any]
    bound: float | None

    @property
    def value(self) -> float:
        return float("nan") if self.bound is None else self.system.selective_risk

    @property
    def gated_bound(self) -> float | None:
        """The bound the gate compares (``gate_on='bound'``), else None (the estimate is compared)."""
        return self.bound if self.gate_on == "bound" else None

    @property
    def inconclusive(self) -> str | None:
        if self.bound is not None:
            return None
        return (f"monitor {self.monitor!r} rejected every input: the selective risk is undefined "
                "(a monitor that rejects everything is useless, not safe)")

    def detail(self) -> str:
        name, pooled = self.monitor, self.system
        if self.bound is None:
            return f"{name} rejected all {pooled.n} inputs"
        return (f"{name}: {pooled.accepted_errors}/{pooled.accepted} errors among accepted inputs "
                f"(risk {pooled.selective_risk:.4f}, {self.confidence:.0%} bound {self.bound:.4f}); coverage "
                f"{pooled.coverage:.3f}; model alone {pooled.model_risk:.4f} over {pooled.n} inputs")

    def to_details(self) -> dict[str, Any]:
        details: dict[str, Any] = {**self.about, "system": self.system.to_dict(), "per_set": self.per_set,
                                   "confidence": self.confidence, "gate_on": self.gate_on}
        if self.bound is not None:
            details["bound"] = self.bound
        return details


def selective_risk(bench: MonitorBench, name: str, *, faults: Any, severity: Any, clip: Any, confidence: float,
                   gate_on: str) -> SelectiveRiskResult:
    """Error rate among the inputs monitor ``name`` accepts, on the evaluation data and (``faults``) the fault
    sets, its upper confidence bound, and the model alone."""
    monitor, key = bench.fitted(name)
    data = bench.fx["data"]
    parts: list[tuple[str, torch.Tensor, torch.Tensor]] = [
        ("in-distribution", monitor.alarm(bench.scores(monitor, key, data)), bench.errors(data, None))]
    if faults:
        for family, level, fault_data in bench.sets(faults, severity, clip):
            parts.append((set_name(family, level), monitor.alarm(bench.scores(monitor, key, fault_data)),
                          bench.errors(fault_data, family, data)))
    device = parts[0][1].device
    pooled = system_view(torch.cat([a.to(device) for _, a, _ in parts]), torch.cat([e.to(device) for _, _, e in parts]))
    per_set = {label: system_view(a, e.to(a.device)).to_dict() for label, a, e in parts}
    about = bench.about(name, monitor)
    bound = None if pooled.accepted == 0 else float(
        clopper_pearson_upper([pooled.accepted_errors], [pooled.accepted], confidence)[0])
    return SelectiveRiskResult(name, pooled, per_set, confidence, gate_on, about, bound)


# ------------------------------------------------------------------------------------- overhead


@dataclass
class OverheadResult:
    """The monitor's time per input against the model's; ``overhead`` None: not timed on this torchrun rank."""

    monitor: str
    overhead: Overhead | None
    about: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    inputs: int = 0

    @property
    def value(self) -> float:
        return 0.0 if self.overhead is None else self.overhead.ratio

    def detail(self) -> str:
        o = self.overhead
        if o is None:
            return f"{self.monitor}: timed on rank 0"
        return (f"{self.monitor}: {o.monitor_s_per_input * 1e6:.1f} µs per input vs the model's "
                f"{o.model_s_per_input * 1e6:.1f} µs (×{o.ratio:.2f}); state {o.state_bytes / 1024:.1f} KiB")

    def to_details(self) -> dict[str, Any]:
        o = self.overhead
        if o is None:
            return {"monitor": self.monitor}
        return {**self.about, "monitor_s_per_input": o.monitor_s_per_input, "model_s_per_input": o.model_s_per_input,
                "ratio": o.ratio, "state_bytes": o.state_bytes, "repeats": o.repeats, "device": self.device,
                "inputs": self.inputs}


def overhead(bench: MonitorBench, name: str, *, repeats: int) -> OverheadResult:
    """Monitor ``name``'s time per input relative to the model's forward pass, and its memory.

    A timed measurement: under torchrun only rank 0 times it (and reads the data); the other ranks get a
    placeholder, which the caller replaces by rank 0's result before it is reported."""
    if ranks.active() and not ranks.is_main():
        return OverheadResult(name, None)
    monitor, _ = bench.fitted(name)
    data = bench.fx["data"]
    view = bench.view(data, monitor.layers())
    shard = bench.session.shard(data)  # torchrun: the monitor is timed on rank 0's shard, whose pass is cached
    scored = None if shard is None else bench.view(data, (*monitor.layers(), *bench.layers), shard=shard,
                                                   gather=False)
    o = measure_overhead(monitor, view, repeats=repeats, monitor_view=scored)
    return OverheadResult(name, o, bench.about(name, monitor), bench.session.device, view.n_inputs)
