"""Gate-side access to the session's shared forward pass: layer activations and model outputs.

Every gate that reads a layer's activations or the model's predictions gets them here, from the
session's one :class:`~pytest_dnnsafety.engines.core.capture.ActivationCache` (in ``GateContext.cache``):
one forward pass per (model, data, shard) for all gates of the session, which also captures every
layer the session's markers name for that pair of fixtures (the *layer plan*, collected at
collection time), so two gates on two layers cost one pass. The cache is keyed by the model and
data objects themselves (compared by identity and kept alive), never by a bare ``id()``.

``shard``: this torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard` (``ctx.shard(fx[data])``),
or None for the whole data. A gate that passes a shard gets only this rank's rows, and must then
run its rank-local work inside :func:`pytest_dnnsafety.runtime.torchrun.together` /
:func:`~pytest_dnnsafety.runtime.torchrun.merged` (so a rank that fails tells the others) and all-reduce its
engine (``merged`` does). Typical use::

    shard = ctx.shard(fx["data"])

    def local():
        acts = activations_for(spec, fx, ctx, [layer], shard=shard)[layer]
        engine = MyEngine(...)
        engine.update(acts.max)
        return engine

    engine = ranks.merged(local, shard)

``model`` and ``data`` name the gate's fixture *roles* (keys of ``spec.fixtures`` and ``fx``), e.g.
``data="fit_data"`` for a monitor's fitting data. No torch import at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Mapping

from pytest_dnnsafety.gates.core import GateContext, GateSpec

__all__ = ["activation_cache", "layer_plan", "activations_for", "outputs_for", "no_signal", "merged", "together",
           "scenario_table"]


def activation_cache(ctx: GateContext) -> Any:
    """The session's :class:`~pytest_dnnsafety.engines.core.capture.ActivationCache` (created on first use)."""
    cache = ctx.cache.get("activations")
    if cache is None:
        from pytest_dnnsafety.engines.core.capture import ActivationCache

        cache = ctx.cache["activations"] = ActivationCache()
    return cache


def layer_plan(spec: GateSpec, ctx: GateContext, *, model: str = "model", data: str = "data") -> tuple[str, ...]:
    """The layers the session's markers read on this gate's (model, data) fixtures (captured in the same pass)."""
    pair = (spec.fixtures.get(model), spec.fixtures.get(data))
    return tuple(ctx.cache.get("layer_plan", {}).get(pair, ()))


def activations_for(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, layers: Sequence[str], *,
                    model: str = "model", data: str = "data", shard: Any = None) -> dict[str, Any]:
    """``{layer: LayerActivations}`` of ``layers`` on the gate's model and data, from the shared pass.

    A missing layer costs one pass (with the plan's other layers); a pass that failed fails every
    gate reading it with the same error, without a rerun (see
    :meth:`~pytest_dnnsafety.engines.core.capture.ActivationCache.get`).
    """
    return activation_cache(ctx).get(fx[model], fx[data], list(layers), batch_size=ctx.batch_size,
                                     device=ctx.device, plan=layer_plan(spec, ctx, model=model, data=data),
                                     shard=shard)


def outputs_for(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, *, model: str = "model",
                data: str = "data", shard: Any = None) -> Any:
    """The model's :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` on the gate's data, from the shared pass."""
    return activation_cache(ctx).outputs(fx[model], fx[data], batch_size=ctx.batch_size, device=ctx.device,
                                         plan=layer_plan(spec, ctx, model=model, data=data), shard=shard)


def no_signal(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> tuple[str, dict[str, Any]] | None:
    """``(reason, details)`` when the gate's model gives no signal on its data (the precondition of a relative gate,
    :attr:`~pytest_dnnsafety.gates.core.GateDef.signal`; :mod:`~pytest_dnnsafety.engines.core.signal`), else None.

    Reads the session's shared pass (:func:`outputs_for`: the pass the gate itself reads, no pass of its own) on
    the roles the definition names; under torchrun each rank counts its shard of a sharding gate's batches and the
    counts are gathered and merged, so every rank reaches the same verdict. A pass that fails, labels outside the
    model's classes and a task that does not fit the outputs are left to the gate (its own error names them).
    """
    from pytest_dnnsafety.engines.core.signal import SignalCounts
    from pytest_dnnsafety.errors import DataError, DnnSafetyError
    from pytest_dnnsafety.runtime import torchrun as ranks

    roles = spec.definition.signal
    if roles is None:
        return None
    model, data = roles
    shard = ctx.shard(fx[data]) if spec.definition.shards else None
    multi = ctx.task == "multi-label"
    threshold = spec.options.get("decision_threshold") if multi else spec.options.get("score_threshold")

    def local() -> SignalCounts | None:
        try:
            out = outputs_for(spec, fx, ctx, model=model, data=data, shard=shard)
        except DnnSafetyError:
            return None  # the gate meets the pass's error itself (kept by the cache: no second pass), in its words
        if (out.detections is not None) != (ctx.task == "detection"):
            return None  # a detector read as a classifier or the reverse: the gate's own check names it
        if ctx.task not in ("multi-label", "detection"):
            try:
                out.check_labels(spec.fixtures.get(data, data), spec.options.get("classes"))
            except DataError:
                return None  # the gate's own check names the labels and the fix
        return SignalCounts.of(out, ctx.task, threshold=threshold, kind=spec.options.get("outputs") if multi else None)

    counts = ranks.together(local, sharded=shard is not None)
    if shard is not None:
        parts = ranks.gather(counts)
        counts = None if any(part is None for part in parts) else SignalCounts.merge_all(parts)
    if counts is None:
        return None
    why = counts.reason(spec.fixtures.get(data, data))
    return None if why is None else (why, counts.to_details())


# ------------------------------------------------------------------------------------- torchrun: the mechanism syncs
def merged(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, fill: Callable[[Any], Any], *,
           data: str = "data") -> Any:
    """``fill(shard)`` on this rank's shard of the gate's ``data`` (None: the whole data), its engine merged over
    the ranks (each state by its reduce rule); one process: ``fill(None)``. A rank that fails tells the others.

    A family's ``measure`` builds and fills its engine in ``fill`` and leaves the syncing to this function::

        engine = merged(spec, fx, ctx, lambda shard: MyEngine.from_outputs(outputs_for(spec, fx, ctx, shard=shard)))
    """
    from pytest_dnnsafety.runtime import torchrun

    shard = ctx.shard(fx[data])
    return torchrun.merged(lambda: fill(shard), shard)


def together(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, compute: Callable[[Any], Any], *,
             data: str = "data") -> Any:
    """``compute(shard)`` on this rank's shard of ``data`` (a value that is not an engine: the caller gathers it);
    under torchrun a rank that fails fails every rank with its error instead of leaving them waiting."""
    from pytest_dnnsafety.runtime import torchrun

    shard = ctx.shard(fx[data])
    return torchrun.together(lambda: compute(shard), sharded=shard is not None)


def scenario_table(spec: GateSpec, fx: Mapping[str, Any], n_rows: int | None = None, *,
                   role: str = "scenarios", data: str = "data") -> Any:
    """The gate's :class:`~pytest_dnnsafety.scenarios.ScenarioTable` (fixture role ``role``), checked: the fixture
    returned a table and, given ``n_rows`` (the data's rows), it has one row per row of the data, in order."""
    from pytest_dnnsafety.errors import MetricError
    from pytest_dnnsafety.scenarios import ScenarioTable, check_rows_match

    table = fx[role]
    if not isinstance(table, ScenarioTable):
        raise MetricError(f"fixture {spec.fixtures[role]!r} returned {type(table).__name__}, not a ScenarioTable. "
                          "Fix: return pytest_dnnsafety.ScenarioTable(Conditions(...), rows)")
    if n_rows is not None:
        check_rows_match(table, n_rows, table_fixture=spec.fixtures[role], data_fixture=spec.fixtures.get(data, data))
    return table
