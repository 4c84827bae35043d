"""Before a gate measures: its data subsampled (``sample=``), its cost estimated and checked against ``max_seconds``.

:func:`subsampled` applies ``sample=N`` at one place for every gate: the ``data`` role becomes a seeded
subsample of N inputs (:mod:`pytest_dnnsafety.data.subsample`), stratified by the gate's scenario table
when it reads one (proportional per row-group: the rows with the same conditions), and the roles with one
row per input (:data:`ALIGNED`: the scenario table, the masks) are restricted to the same rows, so that row
*i* still matches row *i*. Every number the gate computes is then computed on the N inputs — nothing
scales it back up, so its bounds widen honestly. The subsample is memoised per session: the gates with the
same data, N, seed and stratification read the same view (and share its forward pass).

:func:`estimated` is the gate's :class:`~pytest_dnnsafety.gates.cost.Estimate` (its cost hook × a probed
time per forward); :func:`~pytest_dnnsafety.gates.cost.check_budget` refuses it above ``max_seconds``.
No torch import at module level.
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.gates.core import GateContext, GateSpec
from pytest_dnnsafety.gates.cost import Estimate, Workload, estimate_for, probe

__all__ = ["ALIGNED", "recorded", "subsampled", "estimated"]

#: Roles whose fixture has one row per input of the ``data`` role (restricted with it).
ALIGNED = ("scenarios", "masks")


def recorded(spec: GateSpec, fx: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """``(fixture values, evidence)`` with recorded predictions (a role holding a
    :class:`~pytest_dnnsafety.files.predictions.RecordedPredictions`) resolved for this gate: an output-only gate
    (:attr:`GateDef.outputs_only <pytest_dnnsafety.gates.core.GateDef.outputs_only>`) on the data they were recorded
    on reads them; any other gate gets the real model given with them (``model``), or is refused — a ConfigError
    naming the marker, the file and the fix. The evidence says what the gate read (``outputs_from``)."""
    from pytest_dnnsafety.files.predictions import RecordedPredictions

    gate = spec.definition
    out, details = dict(fx), {}
    for role, value in fx.items():
        if not isinstance(value, RecordedPredictions):
            continue
        data = gate.signal[1] if gate.signal is not None and gate.signal[0] == role else "data"
        if gate.outputs_only and fx.get(data) is value.data:
            details = {"outputs_from": f"{value.describe()}; the model was not run",
                       "recorded_predictions": value.to_details()}
            continue
        name = spec.fixtures.get(role, role)
        why = (f"{spec.marker} reads outputs on fixture {spec.fixtures.get(data, data)!r}, not on the data the "
               "predictions were recorded on" if gate.outputs_only else
               f"{spec.marker} needs the model itself (inputs it makes, layers, gradients or bounds), not only its "
               "outputs on the evaluation data")
        if value.model is None:
            raise ConfigError(f"{spec.marker}: the model (fixture {name!r}) is recorded predictions only, the outputs "
                              f"read from {value.path}; {why}. Fix: give dnnsafety_model too (or "
                              "RecordedPredictions.from_file(..., model=...)): the output-only gates then read the "
                              "recorded predictions and the others run the model; or drop this gate")
        out[role] = value.model
        details = {"outputs_from": "model run", "recorded_predictions_not_read": f"{value.describe()}: {why}"}
    return out, details


def subsampled(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext
               ) -> tuple[Mapping[str, Any], dict[str, Any] | None]:
    """``(fixture values, evidence)``: the values with ``data`` (and :data:`ALIGNED` roles) restricted to the seeded
    subsample when ``sample`` is set, else as they are (evidence None). Too large a sample is a ConfigError."""
    table = fx.get("scenarios")
    if getattr(table, "_join", None) is not None and "data" in fx:  # rows keyed by COCO image id / file name
        data = fx["data"]
        fx = {**fx, "scenarios": ctx.memo("scenario join", (table, data), (), lambda: table.aligned_to(data))}
    resolved = ctx.sample
    n = getattr(resolved, "value", None)
    if n is None:
        return fx, None
    source = getattr(resolved, "source", "the sample setting")
    if "data" not in fx:
        if source.startswith("marker"):
            raise ConfigError(f"sample={n} (from {source}): {spec.marker} reads no evaluation data to subsample. "
                              "Fix: drop sample= from this marker")
        return fx, None
    from pytest_dnnsafety.data.forms import known_length
    from pytest_dnnsafety.data.subsample import choose, take
    from pytest_dnnsafety.scenarios import ScenarioTable

    data, name = fx["data"], spec.fixtures.get("data", "data")
    total = known_length(data)
    if total is None:
        raise ConfigError(f"sample={n} (from {source}): the inputs of fixture {name!r} ({type(data).__name__}) "
                          "cannot be counted without reading them all, so they cannot be subsampled. Fix: give a "
                          "sized dataset (tensors, a TensorDataset, a DataLoader over a map-style dataset), or "
                          "drop sample=")
    if n > total:
        raise ConfigError(f"sample={n} (from {source}): fixture {name!r} holds only {total} inputs. Fix: use "
                          f"sample= at most {total}, or none (dnnsafety_sample=none) for all the data")
    table = fx.get("scenarios")
    table = table if isinstance(table, ScenarioTable) and len(table) == total else None
    aligned = {role: fx[role] for role in ALIGNED if role in fx and fx[role] is not None}
    from pytest_dnnsafety.files.predictions import RecordedPredictions

    recorded_roles = {role: value for role, value in fx.items()
                      if isinstance(value, RecordedPredictions) and value.data is data}

    def compute() -> tuple[dict[str, Any], dict[str, Any]]:
        groups = [tuple(row) for row in table.codes.tolist()] if table is not None else None
        sub = choose(total, n, ctx.seed, groups)
        views: dict[str, Any] = {"data": take(data, sub.indices, f"fixture {name!r}")}
        for role, value in recorded_roles.items():  # recorded predictions follow their data's rows
            views[role] = value.take(sub.indices, views["data"])
        for role, value in aligned.items():
            if isinstance(value, ScenarioTable):
                views[role] = _table_rows(value, sub.indices) if len(value) == total else value
            else:
                views[role] = take(value, sub.indices, f"fixture {spec.fixtures.get(role, role)!r}")
        by = None if table is None else (f"scenario table {spec.fixtures.get('scenarios', 'scenarios')!r} "
                                         f"(rows with equal {', '.join(table.conditions.names)})")
        return views, sub.to_details(by)

    objects = (data, table, *aligned.values(), *recorded_roles.values())
    views, details = ctx.memo("sample", objects, (n, ctx.seed, tuple(aligned)), compute)
    return {**fx, **views}, dict(details)


def _table_rows(table: Any, indices: tuple[int, ...]) -> Any:
    """The scenario table's rows ``indices`` (their CSV lines kept for the error messages)."""
    import torch

    from pytest_dnnsafety.scenarios import ScenarioTable

    out = ScenarioTable(table.conditions, table.codes[torch.as_tensor(indices, dtype=torch.int64)],
                        source=getattr(table, "_source", None))
    lines = getattr(table, "_lines", None)
    if lines is not None:
        out._lines = tuple(lines[i] for i in indices)
    return out


def estimated(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, *, confirm: bool = False) -> Estimate:
    """The gate's estimate: its cost hook on the :class:`Workload` × the probed seconds per forward of its model on
    its data (once per session per pair; under torchrun the slowest rank's). ``confirm``: also a longer probe (once
    per session per pair), the faster of the two kept — asked before a refusal, so that a busy moment on a shared
    machine does not refuse a gate."""
    from pytest_dnnsafety.data.forms import known_length
    from pytest_dnnsafety.runtime import torchrun as ranks

    data = fx.get("data")
    n = (known_length(data) or 0) if data is not None else 0
    found = None
    from pytest_dnnsafety.files.predictions import RecordedPredictions

    if "model" in fx and data is not None and not isinstance(fx["model"], RecordedPredictions):  # recorded: no forward
        found = ctx.memo("cost-probe", (fx["model"], data), (ctx.device,),
                         lambda: probe(fx["model"], data, ctx.device))
        if confirm and found is not None:
            again = ctx.memo("cost-probe-confirmed", (fx["model"], data), (ctx.device,),
                             lambda: probe(fx["model"], data, ctx.device, seconds=0.5, timings=200))
            found = again if again is not None and again[0] < found[0] else found
    per, probed, shape, example = found if found is not None else (None, 0, None, None)
    if ranks.active():  # every rank must refuse or run alike: the slowest rank's time per forward
        times = [t for t in ranks.gather(per) if t is not None]
        per = max(times) if times else None
    work = Workload(n, shape, ctx.batch_size, fx.get("model") if example is not None else None, example)
    return estimate_for(spec.definition.cost, spec.options, work, per, probed, spec.marker)
