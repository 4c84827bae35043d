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

Fitted monitors, scores and fault sets are memoised per session (``ctx.memo``, keyed by the fixture
objects): three gates on one monitor fit it once and score each data set once; the forward passes go
through the shared activation cache. Nothing holds the evaluation images: a fault set is a lazy
:class:`~..engines.monitors.FaultStream` (faulted batch by batch as it is read; its seeds depend on
the batch size), shapes are compared on first batches, and what is kept per input is a score, a
prediction or an error flag. Under torchrun the scoring of the evaluation and fault data is sharded
by batches (each rank forwards its share; the per-input scores and errors are all-gathered, so every
rank computes the single-process values); ``max_monitor_overhead`` is timed on rank 0 alone (the
other ranks adopt its verdict). No torch import at module level.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Sequence

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, is_interval, one_of

__all__ = [
    "MIN_MONITOR_DETECTION", "MAX_MONITOR_SELECTIVE_RISK", "MAX_MONITOR_OVERHEAD", "FAULT_GROUP_NAMES",
    "DETECTION_METRICS", "fault_set",
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

#: Families that are the same at every severity: evaluated once, reported without a severity.
_SEVERITY_FREE = ("black_frame",)

#: Families whose inputs have no right answer: every decision on them counts as a model error.
_NO_RIGHT_ANSWER = ("novel", "black_frame", "zeroed_rows", "copied_rows", "shifted_rows")


# ------------------------------------------------------------------------------------- shared state


def _activations(ctx: GateContext) -> Any:
    from pytest_dnnsafety.engines.core.capture import ActivationCache

    return ctx.cache.setdefault("activations", ActivationCache())


def _clip(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


def _first_batch(data: Any, batch_size: int) -> tuple[Any, Any] | None:
    """The first ``(x, y)`` batch of ``data`` (one batch read, not the data set), or None for empty data."""
    from pytest_dnnsafety.data.forms import iter_batches

    for x, y in iter_batches(data, batch_size):
        return x, y
    return None


def _stream(ctx: GateContext, data: Any, family: str, severity: int, *, model: Any, clip: Any, role: str,
            plan: Sequence[str] = ()) -> Any:
    """``data`` under fault ``family`` at ``severity`` as a lazy :class:`~..engines.monitors.FaultStream`,
    one object per (data, family, severity, seed, clip, model) for the session: its forward pass and monitor
    scores are shared by every gate (and the ``fault_data`` fixture) that asks for it.

    An adversarial family attacks the true class: the data must be labelled (read from its first batch)
    with classes the model outputs (checked on the shared pass; ``role`` names the fixture).
    """
    import torch

    from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS
    from pytest_dnnsafety.engines.monitors.stream import fault_stream

    adversarial = family in FAULT_GROUPS["adversarial"]
    if ctx.task == "detection":
        from pytest_dnnsafety.engines.monitors.detector import detector_fault_source

        data_key, data = data, detector_fault_source(data, family)
    else:
        data_key = data

    def make() -> Any:
        if adversarial:
            first = _first_facts(ctx, data)
            if first is not None and not first[1]:
                raise DataError(f"fault family {family!r} attacks the true class, but the evaluation data has no "
                                "labels. Fix: give labelled data (x, y).")
            if isinstance(model, torch.nn.Module):  # the attack's loss reads the true class
                _outputs(ctx, model, data, plan, role, f"fault family {family!r} (it attacks the true class)")
        return fault_stream(data, family, severity, seed=ctx.seed, model=model, batch_size=ctx.batch_size,
                            device=ctx.device, clip=_clip(clip))

    return ctx.memo("monitor fault set", (data_key, model if adversarial else None),
                    (family, severity, ctx.seed, _clip(clip), ctx.batch_size, str(ctx.device)), make)


def fault_set(cache: dict[str, Any], data: Any, family: str, severity: int, *, seed: int, model: Any = None,
              batch_size: int = 256, device: str = "cpu", clip: Any = (0.0, 1.0), role: str = "dataset") -> Any:
    """``data`` under fault ``family`` at ``severity`` as a ``TensorDataset`` (labels kept), cached per session.

    The ``fault_data`` fixture's form: the gates' own lazy fault set (:func:`_stream`, the same seeded
    values) read into memory once, the same object for the same arguments. ``role`` names ``data``'s
    fixture in errors.
    """
    ctx = GateContext(settings=None, seed=seed, device=device, batch_size=batch_size, cache=cache)  # type: ignore[arg-type]

    def make() -> Any:
        return _stream(ctx, data, family, severity, model=model, clip=clip, role=role).materialise()

    from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS

    adversarial = family in FAULT_GROUPS["adversarial"]
    return ctx.memo("monitor fault set (tensors)", (data, model if adversarial else None),
                    (family, severity, seed, _clip(clip), batch_size, str(device)), make)


def _outputs(ctx: GateContext, model: Any, data: Any, plan: Sequence[str], role: str, what: str = "") -> Any:
    """The model's outputs on ``data`` (this rank's shard under torchrun), their labels checked against its classes.

    The pass is the shared one (its plan's layers captured with it); under torchrun every rank checks its
    shard and the ranks agree (a bad label on one rank's shard fails the gate on every rank).
    """
    from pytest_dnnsafety.runtime import torchrun as ranks

    shard = ctx.shard(data)

    def local() -> Any:
        out = _activations(ctx).outputs(model, data, batch_size=ctx.batch_size, device=ctx.device, plan=plan,
                                        shard=shard)
        out.check_labels(role, what=what)
        return out

    return ranks.together(local, sharded=shard is not None)


def _monitor(spec: GateSpec, fx: Mapping[str, Any], name: str) -> Any:
    from pytest_dnnsafety.engines.monitors import as_monitor

    bank = fx["monitors"]
    role = spec.fixtures["monitors"]
    if not isinstance(bank, Mapping):
        raise ConfigError(f"{spec.marker}: fixture {role!r} returned {type(bank).__name__}; it must return a mapping "
                          f"name -> monitor. Fix: return e.g. {{'energy': Energy(), 'oob': OutsideTheBox(layer=...)}}.")
    if name not in bank:
        raise ConfigError(f"{spec.marker}: monitor={name!r} is not in fixture {role!r} (it has "
                          f"{', '.join(map(repr, bank)) or 'none'}). Fix: name one of them, or add {name!r} to the "
                          f"{role!r} fixture in conftest.py, e.g. return {{**defaults, {name!r}: "
                          "Mahalanobis(layer='...')}.")
    try:
        return as_monitor(bank[name])
    except ConfigError as exc:
        raise ConfigError(f"{spec.marker}: monitor {name!r} of fixture {role!r}: {exc}") from None


def _bank_layers(bank: Any) -> tuple[str, ...]:
    """Every layer the monitors of the fixture read: one pass per data set captures them all."""
    from pytest_dnnsafety.engines.monitors import Monitor

    layers: dict[str, None] = {}
    for monitor in bank.values() if isinstance(bank, Mapping) else ():
        if isinstance(monitor, Monitor):
            layers.update(dict.fromkeys(monitor.layers()))
    return tuple(layers)


def _fitted(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, name: str) -> tuple[Any, tuple[Any, ...]]:
    """The monitor ``name`` fitted on the fit data, once per session: (fitted copy, the objects it was fitted from)."""
    from pytest_dnnsafety.engines.monitors import fit_monitor

    monitor = _monitor(spec, fx, name)
    _check_like(spec, ctx, "fit_data", fx["fit_data"], fx["data"], "data")
    objects = (fx["monitors"], fx["model"], fx["fit_data"])

    def fit() -> Any:
        fitted = copy.deepcopy(monitor)  # the fixture's monitor stays as configured
        fitted.name = name  # reported under the name the gates use
        _check_fit_labels(ctx, fx, spec.fixtures["fit_data"], name)
        return fit_monitor(fitted, fx["model"], fx["fit_data"], seed=ctx.seed, batch_size=ctx.batch_size,
                           device=ctx.device, cache=_activations(ctx), plan=_bank_layers(fx["monitors"]))

    return ctx.memo("fitted monitor", objects, (name, ctx.seed), fit), objects


def _check_fit_labels(ctx: GateContext, fx: Mapping[str, Any], role: str, name: str) -> None:
    """DataError when the fit data's labels are classes the model cannot output (the pass is the fit's own, shared)."""
    import torch

    if not isinstance(fx["model"], torch.nn.Module) or ctx.task == "detection":  # a detector's labels are boxes
        return
    out = _activations(ctx).outputs(fx["model"], fx["fit_data"], batch_size=ctx.batch_size, device=ctx.device,
                                    plan=_bank_layers(fx["monitors"]))
    out.check_labels(role, what=f"fitting monitor {name!r}")


def _scores(ctx: GateContext, monitor: Any, key: tuple[Any, ...], model: Any, data: Any, plan: Sequence[str] = ()
            ) -> Any:
    """The fitted monitor's scores on ``data``: one forward pass shared through the activation cache, and under
    torchrun on this rank's batches only (every rank then holds all the scores, see ``Monitor.score``)."""
    from pytest_dnnsafety.engines.monitors import MonitorView

    def score() -> Any:
        view = MonitorView(model, data, batch_size=ctx.batch_size, device=ctx.device, cache=_activations(ctx),
                           plan=(*monitor.layers(), *plan), shard=ctx.shard(data))
        return monitor.score(view)

    return ctx.memo("monitor scores", (*key, data), (monitor.name, ctx.seed), score)


def _first_facts(ctx: GateContext, data: Any) -> tuple[tuple[int, ...], bool] | None:
    """(per-sample input shape, labelled?) of ``data`` from its first batch (read once per session); None: empty."""
    def read() -> tuple[tuple[int, ...], bool] | None:
        first = _first_batch(data, ctx.batch_size)
        return None if first is None or first[0].shape[0] == 0 else (tuple(first[0].shape[1:]), first[1] is not None)

    return ctx.memo("monitor first batch", (data,), (ctx.batch_size,), read)


def _check_like(spec: GateSpec, ctx: GateContext, role: str, data: Any, reference: Any, ref_role: str) -> None:
    """Inputs of ``data`` have the per-sample shape of ``reference`` (e.g. OOD data vs evaluation data).

    Compares the first batch of each (one batch read per data set and session, not the data set)."""
    first, ref = _first_facts(ctx, data), _first_facts(ctx, reference)
    if first is None:
        raise DataError(f"{spec.marker}: fixture {spec.fixtures[role]!r} is empty. Fix: give at least one input.")
    shape, ref_shape = first[0], (ref[0] if ref is not None else first[0])
    if shape != ref_shape:
        raise DataError(f"{spec.marker}: fixture {spec.fixtures[role]!r} has inputs of shape {shape}, "
                        f"but {spec.fixtures[ref_role]!r} has {ref_shape}. Fix: give inputs of the shape "
                        "the model takes (same preprocessing as the evaluation data).")


def _sets(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> list[tuple[str, int | None, Any]]:
    """The fault sets of the marker: (family, severity or None, data) in a stable order."""
    from pytest_dnnsafety.engines.monitors.faults import NOVEL, check_severity, expand_faults

    opts = spec.options
    families = expand_faults(opts["faults"])
    severities = check_severity(opts["severity"])
    out: list[tuple[str, int | None, Any]] = []
    for family in families:
        if family == NOVEL:
            if "novel" not in fx:
                raise ConfigError(
                    f"{spec.marker}: faults= includes 'novel', but no novel-class data is configured. Fix: set "
                    "dnnsafety_ood_data (inputs of classes the model never saw), define an `ood_data` fixture, or "
                    "name one with novel=\"my_fixture\".")
            _check_like(spec, ctx, "novel", fx["novel"], fx["data"], "data")
            out.append((NOVEL, None, fx["novel"]))
            continue
        for severity in severities[:1] if family in _SEVERITY_FREE else severities:
            data = _stream(ctx, fx["data"], family, severity, model=fx["model"], clip=opts["clip"],
                           role=spec.fixtures["data"], plan=_bank_layers(fx["monitors"]))
            out.append((family, None if family in _SEVERITY_FREE else severity, data))
    return out


def _set_name(family: str, severity: int | None) -> str:
    return family if severity is None else f"{family} s{severity}"


def _monitor_details(name: str, monitor: Any, spec: GateSpec, model: Any) -> dict[str, Any]:
    """What the gate evaluated: the monitor's configuration, its fitted state's fingerprint and threshold."""
    from pytest_dnnsafety.engines.core.capture import activations_from
    from pytest_dnnsafety.files.provenance import monitor_state_digest

    return {"monitor": name, "monitor_config": monitor.config(), "monitor_threshold": monitor.threshold,
            "monitor_state": monitor_state_digest(monitor), "fit_data": spec.fixtures["fit_data"],
            **(activations_from(model) if monitor.layers() else {})}


# ------------------------------------------------------------------------------------- detection


def _metric_of(metrics: Any, metric: str) -> float:
    value = getattr(metrics, metric)
    value = float("nan") if value is None else float(value)
    # No alarm at all leaves precision undefined: the monitor caught nothing, which counts as 0.
    return 0.0 if math.isnan(value) and metric == "precision" else value


def _detection_table(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, name: str,
                     sets: Sequence[tuple[str, int | None, Any]]) -> tuple[Any, list[dict[str, Any]], list[float]]:
    from pytest_dnnsafety.engines.monitors import detection_metrics

    monitor, key = _fitted(spec, fx, ctx, name)
    id_scores = _scores(ctx, monitor, key, fx["model"], fx["data"], _bank_layers(fx["monitors"]))
    rows, values = [], []
    for family, severity, data in sets:
        ood = _scores(ctx, monitor, key, fx["model"], data, _bank_layers(fx["monitors"]))
        m = detection_metrics(id_scores, ood, monitor.threshold)
        rows.append({"family": family, "severity": severity, "n_ood": m.tp + m.fn, **m.to_dict()})
        values.append(_metric_of(m, spec.options["metric"]))
    return monitor, rows, values


def _ranking(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, sets: Sequence[tuple[str, int | None, Any]],
             name: str, values: list[float]) -> dict[str, Any]:
    from pytest_dnnsafety.stats.ranking import cd_cliques, friedman, nemenyi_cd

    names = [name] + [n for n in dict.fromkeys(spec.options["compare"]) if n != name]
    if len(names) < 2:
        raise ConfigError(f"{spec.marker}: compare= names no monitor besides {name!r}. Fix: list other monitors of "
                          f"the {spec.fixtures['monitors']!r} fixture, e.g. compare=['msp', 'odin'].")
    if len(sets) < 2:
        raise ConfigError(f"{spec.marker}: compare= ranks monitors over fault sets, but only one set is requested. "
                          "Fix: request at least two (several families or severities).")
    columns = [values] + [_detection_table(spec, fx, ctx, other, sets)[2] for other in names[1:]]
    table = [[col[i] for col in columns] for i in range(len(sets))]
    result = friedman(table, higher_is_better=True)
    alpha = spec.options["alpha"]
    cd = nemenyi_cd(len(names), len(sets), alpha)
    return {"monitors": names, "average_ranks": list(result.average_ranks), "cd": cd, "alpha": alpha,
            "statistic": result.statistic, "pvalue": result.pvalue, "n_blocks": result.n_blocks,
            "cliques": [list(c) for c in cd_cliques(result.average_ranks, cd)],
            "table": {"sets": [_set_name(f, s) for f, s, _ in sets], "values": table}}


def _measure_detection(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Detection (OOD positive) of each fault set against the in-distribution data; the worst set or the mean."""
    from pytest_dnnsafety.engines.monitors.faults import fault_parameters

    opts = spec.options
    name, metric = opts["monitor"], opts["metric"]
    sets = _sets(spec, fx, ctx)
    monitor, rows, values = _detection_table(spec, fx, ctx, name, sets)
    if any(math.isnan(v) for v in values):
        bad = [_set_name(r["family"], r["severity"]) for r, v in zip(rows, values) if math.isnan(v)]
        return Measurement(value=float("nan"), detail=f"{metric} undefined for {', '.join(bad)}",
                           details={"faults": rows, "metric": metric},
                           inconclusive=f"{metric} is undefined for {', '.join(bad)}")
    worst = min(range(len(values)), key=values.__getitem__)
    value = values[worst] if opts["aggregate"] == "worst" else sum(values) / len(values)
    details: dict[str, Any] = {
        **_monitor_details(name, monitor, spec, fx["model"]), "metric": metric, "aggregate": opts["aggregate"],
        "faults": rows,
        "worst": {"family": rows[worst]["family"], "severity": rows[worst]["severity"], metric: values[worst]},
        "fault_parameters": {f: {str(s): t for s, t in fault_parameters(f).items()
                                 if s in {r["severity"] for r in rows if r["family"] == f}}
                             for f in dict.fromkeys(r["family"] for r in rows) if f != "novel"},
        "id_alarms": rows[0]["fp"], "id_inputs": rows[0]["fp"] + rows[0]["tn"],
    }
    worst_text = f"worst {_set_name(rows[worst]['family'], rows[worst]['severity'])} {metric} {values[worst]:.3f}"
    detail = (f"{name}: {worst_text} over {len(rows)} fault set(s); in-distribution alarms "
              f"{details['id_alarms']}/{details['id_inputs']}")
    if opts["aggregate"] == "mean":
        detail = f"{name}: mean {metric} {value:.3f} over {len(rows)} fault set(s); {worst_text}"
    if opts["compare"]:
        details["ranking"] = _ranking(spec, fx, ctx, sets, name, values)
        r = details["ranking"]
        detail += (f"; Friedman p={r['pvalue']:.3g}, average rank {r['average_ranks'][0]:.2f} of "
                   f"{len(r['monitors'])} (CD {r['cd']:.2f})")
    return Measurement(value=value, detail=detail, details=details)


# ------------------------------------------------------------------------------------- system view


def _errors(ctx: GateContext, model: Any, data: Any, family: str | None, role: str, source: Any = None) -> Any:
    """Per input: is the model's decision wrong? (Always, on inputs that have no right answer.)

    From the shared pass (under torchrun this rank's shard, then all-gathered: every rank holds every input's)."""
    import torch

    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.core.states import all_gather_rows

    shard = ctx.shard(data)

    def local() -> Any:
        out = _activations(ctx).outputs(model, data, batch_size=ctx.batch_size, device=ctx.device, shard=shard)
        if ctx.task == "detection":  # a missed object or a false detection (source: the boxes of faulted images)
            from pytest_dnnsafety.engines.monitors.detector import detector_wrong
            return detector_wrong(out, family, source, shard, _NO_RIGHT_ANSWER)
        if family in _NO_RIGHT_ANSWER:
            return torch.ones(out.n_inputs, dtype=torch.bool, device=out.predictions.device)
        if out.labels is None:
            raise DataError(f"fixture {role!r} has no labels; the system view compares each decision with the true "
                            "class. Fix: give labelled data (e.g. an .npz with keys x and y).")
        out.check_labels(role)
        return out.predictions != out.labels.to(out.predictions.device)

    wrong = ranks.together(local, sharded=shard is not None)
    return wrong if shard is None else all_gather_rows(wrong)


def _measure_selective_risk(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Error rate among accepted inputs (model + monitor), its upper confidence bound, and the model alone."""
    import torch

    from pytest_dnnsafety.engines.monitors import system_view
    from pytest_dnnsafety.stats.intervals import clopper_pearson_upper

    opts = spec.options
    name = opts["monitor"]
    monitor, key = _fitted(spec, fx, ctx, name)
    parts: list[tuple[str, Any, Any]] = []
    id_scores = _scores(ctx, monitor, key, fx["model"], fx["data"], _bank_layers(fx["monitors"]))
    parts.append(("in-distribution", monitor.alarm(id_scores),
                  _errors(ctx, fx["model"], fx["data"], None, spec.fixtures["data"])))
    if opts["faults"]:
        for family, severity, data in _sets(spec, fx, ctx):
            scores = _scores(ctx, monitor, key, fx["model"], data, _bank_layers(fx["monitors"]))
            parts.append((_set_name(family, severity), monitor.alarm(scores),
                          _errors(ctx, fx["model"], data, family, spec.fixtures["data"], fx["data"])))
    device = parts[0][1].device
    alarm = torch.cat([a.to(device) for _, a, _ in parts])
    error = torch.cat([e.to(device) for _, _, e in parts])
    pooled = system_view(alarm, error)
    per_set = {label: system_view(a, e.to(a.device)).to_dict() for label, a, e in parts}
    details: dict[str, Any] = {**_monitor_details(name, monitor, spec, fx["model"]), "system": pooled.to_dict(),
                               "per_set": per_set, "confidence": opts["confidence"], "gate_on": opts["gate_on"]}
    if pooled.accepted == 0:
        return Measurement(value=float("nan"), detail=f"{name} rejected all {pooled.n} inputs", details=details,
                           inconclusive=f"monitor {name!r} rejected every input: the selective risk is undefined "
                                        "(a monitor that rejects everything is useless, not safe)")
    bound = float(clopper_pearson_upper([pooled.accepted_errors], [pooled.accepted], opts["confidence"])[0])
    details["bound"] = bound
    detail = (f"{name}: {pooled.accepted_errors}/{pooled.accepted} errors among accepted inputs "
              f"(risk {pooled.selective_risk:.4f}, {opts['confidence']:.0%} bound {bound:.4f}); coverage "
              f"{pooled.coverage:.3f}; model alone {pooled.model_risk:.4f} over {pooled.n} inputs")
    return Measurement(value=pooled.selective_risk, bound=bound if opts["gate_on"] == "bound" else None,
                       detail=detail, details=details)


# ------------------------------------------------------------------------------------- overhead


def _measure_overhead(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The monitor's time per input relative to the model's forward pass, and its memory."""
    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.monitors import MonitorView, measure_overhead

    name = spec.options["monitor"]
    if ranks.active() and not ranks.is_main():
        # A timed gate: every rank adopts rank 0's verdict (GateDef.timed), so only rank 0 times (and reads the
        # data); this placeholder is replaced by rank 0's result before it is reported.
        return Measurement(value=0.0, detail=f"{name}: timed on rank 0", details={"monitor": name})
    monitor, _ = _fitted(spec, fx, ctx, name)
    view = MonitorView(fx["model"], fx["data"], batch_size=ctx.batch_size, device=ctx.device,
                       cache=_activations(ctx), plan=monitor.layers())
    shard = ctx.shard(fx["data"])  # torchrun: the monitor is timed on rank 0's shard, whose pass is cached
    scored = None if shard is None else MonitorView(fx["model"], fx["data"], batch_size=ctx.batch_size,
                                                    device=ctx.device, cache=_activations(ctx),
                                                    plan=(*monitor.layers(), *_bank_layers(fx["monitors"])),
                                                    shard=shard, gather=False)
    o = measure_overhead(monitor, view, repeats=spec.options["repeats"], monitor_view=scored)
    details = {**_monitor_details(name, monitor, spec, fx["model"]), "monitor_s_per_input": o.monitor_s_per_input,
               "model_s_per_input": o.model_s_per_input, "ratio": o.ratio, "state_bytes": o.state_bytes,
               "repeats": o.repeats, "device": ctx.device, "inputs": view.n_inputs}
    detail = (f"{name}: {o.monitor_s_per_input * 1e6:.1f} µs per input vs the model's "
              f"{o.model_s_per_input * 1e6:.1f} µs (×{o.ratio:.2f}); state {o.state_bytes / 1024:.1f} KiB")
    return Measurement(value=o.ratio, detail=detail, details=details)


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
        Param("repeats", (int,), 5, in_range(1, 1000), "give how many timed repetitions to take the median of"),
    ),
    fixtures={"model": "model", "data": "dataset", "fit_data": "monitor_data", "monitors": "monitors"},
    measure=_measure_overhead,
    timed=True,  # a wall-clock ratio: under torchrun only rank 0 times it and every rank takes its verdict
    doc="fail if the monitor's time per input exceeds `threshold` times the model's forward time per input",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MIN_MONITOR_DETECTION)
    registry.add(MAX_MONITOR_SELECTIVE_RISK)
    registry.add(MAX_MONITOR_OVERHEAD)
