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

__all__ = ["ALIGNED", "subsampled", "estimated"]

#: Roles whose fixture has one row per input of the ``data`` role (restricted with it).
ALIGNED = ("scenarios", "masks")


def subsampled(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext
               ) -> tuple[Mapping[str, Any], dict[str, Any] | None]:
    """``(fixture values, evidence)``: the values with ``data`` (and :data:`ALIGNED` roles) restricted to the seeded
    subsample when ``sample`` is set, else as they are (evidence None). Too large a sample is a ConfigError."""
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

    def compute() -> tuple[dict[str, Any], dict[str, Any]]:
        groups = [tuple(row) for row in table.codes.tolist()] if table is not None else None
        sub = choose(total, n, ctx.seed, groups)
        views: dict[str, Any] = {"data": take(data, sub.indices, f"fixture {name!r}")}
        for role, value in aligned.items():
            if isinstance(value, ScenarioTable):
                views[role] = _table_rows(value, sub.indices) if len(value) == total else value
            else:
                views[role] = take(value, sub.indices, f"fixture {spec.fixtures.get(role, role)!r}")
        by = None if table is None else (f"scenario table {spec.fixtures.get('scenarios', 'scenarios')!r} "
                                         f"(rows with equal {', '.join(table.conditions.names)})")
        return views, sub.to_details(by)

    objects = (data, table, *aligned.values())
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


def estimated(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Estimate:
    """The gate's estimate: its cost hook on the :class:`Workload` × the probed seconds per forward of its model on
    its data (once per session per pair; under torchrun the slowest rank's)."""
    from pytest_dnnsafety.data.forms import known_length
    from pytest_dnnsafety.runtime import torchrun as ranks

    data = fx.get("data")
    n = (known_length(data) or 0) if data is not None else 0
    found = None
    if "model" in fx and data is not None:
        found = ctx.memo("cost-probe", (fx["model"], data), (ctx.device,),
                         lambda: probe(fx["model"], data, ctx.device))
    per, probed, shape, example = found if found is not None else (None, 0, None, None)
    if ranks.active():  # every rank must refuse or run alike: the slowest rank's time per forward
        times = [t for t in ranks.gather(per) if t is not None]
        per = max(times) if times else None
    work = Workload(n, shape, ctx.batch_size, fx.get("model") if example is not None else None, example)
    return estimate_for(spec.definition.cost, spec.options, work, per, probed, spec.marker)
