"""Gate-side access to the session's shared forward pass: layer activations and model outputs.

Every gate that reads a layer's activations or the model's predictions gets them here, from the
session's one :class:`~pytest_dnnsafety.activations.ActivationCache` (in ``GateContext.cache``):
one forward pass per (model, data, shard) for all gates of the session, which also captures every
layer the session's markers name for that pair of fixtures (the *layer plan*, collected at
collection time), so two gates on two layers cost one pass. The cache is keyed by the model and
data objects themselves (compared by identity and kept alive), never by a bare ``id()``.

``shard``: this torchrun rank's :class:`~pytest_dnnsafety.ranks.Shard` (``ctx.shard(fx[data])``),
or None for the whole data. A gate that passes a shard gets only this rank's rows, and must then
run its rank-local work inside :func:`pytest_dnnsafety.ranks.together` /
:func:`~pytest_dnnsafety.ranks.merged` (so a rank that fails tells the others) and all-reduce its
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

from collections.abc import Sequence
from typing import Any, Mapping

from .core import GateContext, GateSpec

__all__ = ["activation_cache", "layer_plan", "activations_for", "outputs_for"]


def activation_cache(ctx: GateContext) -> Any:
    """The session's :class:`~pytest_dnnsafety.activations.ActivationCache` (created on first use)."""
    cache = ctx.cache.get("activations")
    if cache is None:
        from ..activations import ActivationCache

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
    :meth:`~pytest_dnnsafety.activations.ActivationCache.get`).
    """
    return activation_cache(ctx).get(fx[model], fx[data], list(layers), batch_size=ctx.batch_size,
                                     device=ctx.device, plan=layer_plan(spec, ctx, model=model, data=data),
                                     shard=shard)


def outputs_for(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, *, model: str = "model",
                data: str = "data", shard: Any = None) -> Any:
    """The model's :class:`~pytest_dnnsafety.activations.ModelOutputs` on the gate's data, from the shared pass."""
    return activation_cache(ctx).outputs(fx[model], fx[data], batch_size=ctx.batch_size, device=ctx.device,
                                         plan=layer_plan(spec, ctx, model=model, data=data), shard=shard)
