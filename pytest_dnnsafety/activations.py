"""Layer activations: forward hooks and the session's activation cache.

:func:`capture` runs the model once over a data set, in eval mode under ``torch.no_grad()``,
with forward hooks on the requested modules (named as in ``model.named_modules()``, e.g.
``features.3``). It keeps only per-neuron reductions — for an (N, C, H, W) feature map the
channel's spatial ``max`` and ``mean``, for an (N, c) output the values — so memory grows
with N·c, never with whole feature maps. Hooks are removed and the model's training mode is
restored whatever happens, also when the model raises mid-pass.

:class:`ActivationCache` is session-wide: every gate over the same (model, data, layer) shares
one pass, and a pass captures every layer that gates of the session are known to need
(the plan, collected from the markers), so two gates on two layers also cost one pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .errors import ConfigError, DataError, MetricError
from .loading import iter_batches

__all__ = ["LayerActivations", "ActivationCache", "capture", "layer_names", "REDUCTIONS"]

#: How a multi-dimensional unit (a conv channel) becomes one number per input.
REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class LayerActivations:
    """Per-input, per-neuron activations of one layer: ``max`` and ``mean`` over the spatial dims."""

    layer: str
    max: Tensor  # (N, c)
    mean: Tensor  # (N, c)
    unit_shape: tuple[int, ...]  # per-sample output shape, e.g. (16, 8, 8)

    @property
    def n_neurons(self) -> int:
        return int(self.max.shape[1])

    @property
    def n_inputs(self) -> int:
        return int(self.max.shape[0])

    def reduced(self, reduce: str) -> Tensor:
        if reduce not in REDUCTIONS:
            raise ConfigError(f"reduce={reduce!r}: use one of {', '.join(REDUCTIONS)}")
        return self.max if reduce == "max" else self.mean


def layer_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def _resolve_layers(model: Any, layers: Sequence[str]) -> dict[str, torch.nn.Module]:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"layer activations need a torch.nn.Module with named submodules; the model is a "
            f"{type(model).__name__}. Fix: give a torch.nn.Module as the `model` fixture."
        )
    modules = dict(model.named_modules())
    unknown = [layer for layer in layers if layer not in modules or not layer]
    if unknown:
        available = layer_names(model)
        shown = ", ".join(available[:40]) + (", …" if len(available) > 40 else "")
        raise ConfigError(
            f"unknown layer {unknown[0]!r}: the model has no such submodule. Fix: use a name from "
            f"model.named_modules(): {shown}"
        )
    return {layer: modules[layer] for layer in layers}


def _model_device(model: torch.nn.Module, fallback: torch.device) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return fallback


def capture(
    model: Any,
    data: Any,
    layers: Sequence[str],
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> dict[str, LayerActivations]:
    """One forward pass over ``data`` recording per-neuron reductions of ``layers``.

    Batches go to the model's own device (``device`` only for a model without parameters);
    the reductions stay there. No host synchronisation inside the batch loop: finiteness of
    the captured values is checked once at the end.
    """
    modules = _resolve_layers(model, layers)
    target = _model_device(model, torch.device(device))
    maxima: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    means: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    shapes: dict[str, tuple[int, ...]] = {}

    def hook_for(layer: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(out, Tensor) or out.ndim < 2:
                raise MetricError(
                    f"layer {layer!r} returned {type(out).__name__} of shape "
                    f"{tuple(getattr(out, 'shape', ()))}; neuron metrics need a tensor (batch, neurons, ...)"
                )
            shapes.setdefault(layer, tuple(out.shape[1:]))
            flat = out.detach().flatten(2) if out.ndim > 2 else out.detach().unsqueeze(-1)
            maxima[layer].append(flat.amax(dim=-1).float())
            means[layer].append(flat.mean(dim=-1, dtype=torch.float32))

        return hook

    was_training = model.training
    handles = [module.register_forward_hook(hook_for(layer)) for layer, module in modules.items()]
    try:
        model.eval()
        with torch.no_grad():
            for x, _ in iter_batches(data, batch_size):
                model(x.to(target, non_blocking=True))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    result = {}
    for layer in layers:
        if not maxima[layer]:
            raise DataError("no inputs: the data set is empty. Fix: provide evaluation data with at least one sample.")
        mx, mn = torch.cat(maxima[layer]), torch.cat(means[layer])
        if not bool(torch.isfinite(mx).all() and torch.isfinite(mn).all()):
            raise DataError(f"layer {layer!r} produced NaN/inf activations. Fix: check the inputs and the model.")
        result[layer] = LayerActivations(layer, mx, mn, shapes[layer])
    return result


class ActivationCache:
    """Session-wide store of captured activations, keyed by (model, data, layer).

    Entries keep a reference to their model and data, so the ``id`` keys cannot be reused by
    other objects while the cache lives. ``forward_passes`` counts the passes actually run.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, str], LayerActivations] = {}
        self._keep: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.forward_passes = 0

    def get(
        self,
        model: Any,
        data: Any,
        layers: Sequence[str],
        *,
        batch_size: int,
        device: torch.device | str,
        plan: Iterable[str] = (),
    ) -> dict[str, LayerActivations]:
        """Activations of ``layers``; missing ones (and the plan's other layers) in one pass."""
        pair = (id(model), id(data))
        missing = [layer for layer in layers if (*pair, layer) not in self._entries]
        if missing:
            extra = [layer for layer in plan if layer not in missing and (*pair, layer) not in self._entries]
            if extra:  # a bad planned layer must not break this gate; its own gate reports it
                valid = set(layer_names(model)) if isinstance(model, torch.nn.Module) else set()
                extra = [layer for layer in extra if layer in valid]
            captured = capture(model, data, [*missing, *extra], batch_size=batch_size, device=device)
            self.forward_passes += 1
            self._keep[pair] = (model, data)
            for layer, acts in captured.items():
                self._entries[(*pair, layer)] = acts
        return {layer: self._entries[(*pair, layer)] for layer in layers}

    def clear(self) -> None:
        self._entries.clear()
        self._keep.clear()
