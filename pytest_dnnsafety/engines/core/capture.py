"""Layer activations: forward hooks and the session's activation cache.

:func:`capture` runs the model once over a data set, in eval mode under ``torch.no_grad()``,
with forward hooks on the requested modules (named as in ``model.named_modules()``, e.g.
``features.3``). It keeps only per-neuron reductions — for an (N, C, H, W) feature map the
channel's spatial ``max``, ``mean`` and ``min``, for an (N, c) output the values — so memory grows
with N·c, never with whole feature maps. The per-channel ``min`` (with ``max``) gives the range of
the whole layer tensor of each input, which the DeepInspect activity needs (a min–max scaling per
input over the layer, :func:`pytest_dnnsafety.engines.inspection.kernels.layer_activity`). Hooks are removed
and the model's training mode is restored whatever happens, also when the model raises mid-pass.
A ``torch.export`` program's module (a deployed ``.pt2``) calls no submodules, so hooks would never
fire on it: its layers (named as in the eager model) are read from its graph's nodes instead, by a
tapped copy of its graph run in the same single pass (:mod:`pytest_dnnsafety.files.pt2_taps`); the
values are those the eager model's hooks see.

:class:`ActivationCache` is session-wide: every gate over the same (model, data, layer) shares
one pass, and a pass captures every layer that gates of the session are known to need
(the plan, collected from the markers), so two gates on two layers also cost one pass. The same
pass also keeps the model's outputs (:class:`ModelOutputs`: predicted class, softmax confidence
and the data's labels per input), which :meth:`ActivationCache.outputs` serves to the gates that
need only predictions (per-scenario accuracy, weighted confusion) without a pass of their own. When the
model is :class:`~pytest_dnnsafety.files.predictions.RecordedPredictions` (outputs recorded elsewhere), its rows
are those outputs (:mod:`.recorded`): no forward pass at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.forms import known_length
from pytest_dnnsafety.errors import ConfigError, DataError, DnnSafetyError, MetricError
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.files.predictions import RecordedPredictions
from pytest_dnnsafety.files.pt2_taps import ACTIVATIONS_FROM, graph_layers, is_exported_module, layer_outputs, tapped_forward
from pytest_dnnsafety.files.onnx_model import ACTIVATIONS_FROM as ONNX_ACTIVATIONS_FROM, is_onnx_model

__all__ = ["LayerActivations", "ModelOutputs", "ActivationCache", "capture", "check_layers", "layer_names",
           "activations_from", "REDUCTIONS"]

#: How a multi-dimensional unit (a conv channel) becomes one number per input.
REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class LayerActivations:
    """Per-input, per-neuron activations of one layer: ``max``, ``mean`` and ``min`` over the spatial dims.

    ``min`` is None only for an object built by hand without it (:func:`capture` always fills it);
    :meth:`reduced` offers the ``max`` and ``mean`` reductions (:data:`REDUCTIONS`) as before.
    """

    layer: str
    max: Tensor  # (N, c)
    mean: Tensor  # (N, c)
    unit_shape: tuple[int, ...]  # per-sample output shape, e.g. (16, 8, 8)
    min: Tensor | None = None  # (N, c)

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


@dataclass(frozen=True)
class ModelOutputs:
    """The model's decision on every input of one pass (row i = sample i of the data).

    ``predictions`` (N,) int64: the arg-max class (or the label a label-returning model gave);
    ``confidence`` (N,) float32: the softmax probability of that class (1.0 for a label-returning
    model); ``labels`` (N,) int64 or None for unlabelled data; ``num_classes``: columns of the
    output (None for a label-returning model); ``logits`` (N, K) float32: the model's raw outputs
    (logits or probabilities, as the model returns them; None for a label-returning model), which
    output-based runtime monitors (maximum softmax, energy) score without a pass of their own.
    """

    predictions: Tensor
    confidence: Tensor
    labels: Tensor | None
    num_classes: int | None
    logits: Tensor | None = None
    #: a detector's pass: every image's detections, packed (:class:`~pytest_dnnsafety.data.tasks.BoxSet`); then
    #: ``predictions``/``confidence`` are each image's top-scoring detection (-1 and 0 for an image without
    #: one) and ``labels`` the packed targets (a BoxSet) or None
    detections: Any = None

    @property
    def n_inputs(self) -> int:
        return int(self.predictions.shape[0])

    def check_labels(self, data: str, classes: Sequence[Any] | None = None, *, what: str = "") -> None:
        """Raise :class:`DataError` unless every label is a class the model can output.

        The classes are the output's columns, else (a label-returning model) the declared ``classes=``;
        with neither the range cannot be checked. ``data`` names the data's fixture, ``what`` (optional)
        what read the labels (a gate's verdict already names its marker). One host read (the labels'
        min and max), after the pass, never inside it: every label-reading gate calls this where its
        labels meet the model's outputs. Labels the model
        cannot have make every decision wrong (accuracy 0 everywhere, so nothing "degrades", or an
        error rate of 1 a monitor cannot lower): a gate would measure the data's mismatch, not the model.
        """
        if self.labels is None or self.labels.numel() == 0:
            return
        k = self.num_classes if self.num_classes is not None else (len(classes) if classes is not None else None)
        if k is None:
            return
        low, high = (int(v) for v in torch.stack([self.labels.min(), self.labels.max()]).tolist())
        if low >= 0 and high < k:
            return
        bad = int(((self.labels < 0) | (self.labels >= k)).sum())
        source = "outputs" if self.num_classes is not None else "classes named by classes="
        raise DataError(
            f"{what + ': ' if what else ''}the labels of fixture {data!r} range over {low}..{high}, but the model "
            f"has {k} classes ({source} 0..{k - 1}); {bad} of {self.n_inputs} labels are outside, so the model "
            f"can never be right on them and the metric would measure the data's mismatch, not the model. "
            f"Fix: give class indices "
            f"0..{k - 1} in the model's output order (map the data's labels), or give data that belongs to this "
            f"model.")


def layer_names(model: torch.nn.Module) -> list[str]:
    """The names a gate's ``layer=`` may take: ``named_modules()``, or a torch.export program's graph modules."""
    if is_exported_module(model):
        return list(graph_layers(model).names)
    if is_onnx_model(model):  # an ONNX graph's node output names, then the eager module paths its exporter recorded
        return list(dict.fromkeys([*model.layer_names(), *model.module_outputs()]))
    return [name for name, _ in model.named_modules() if name]


def activations_from(model: Any) -> dict[str, str]:
    """The evidence detail of a gate that read layers of ``model``: ``{"activations_from": "exported graph nodes"}``
    for a torch.export program (its layers were read from the deployed graph's nodes), else nothing."""
    if is_onnx_model(model):
        return {"activations_from": ONNX_ACTIVATIONS_FROM}
    return {"activations_from": ACTIVATIONS_FROM} if is_exported_module(model) else {}


_EAGER_FIX = ("Fix: give the eager torch.nn.Module (dnnsafety_model_factory + a state dict, or a `model` fixture "
              "that builds the module and loads its weights)")


_is_exported = is_exported_module  # the older private name


def _hookable(model: torch.nn.Module, layer: str) -> bool:
    """False when a forward hook on ``layer`` certainly never fires: the model is an fx/export graph
    whose code calls no module at (or above) that name — it runs the layer's operations inline."""
    if not isinstance(model, torch.fx.GraphModule):
        return True
    called = {str(node.target) for node in model.graph.nodes if node.op == "call_module"}
    return any(layer == target or layer.startswith(target + ".") for target in called)


def _check_hooks_work(model: torch.nn.Module, layer: str) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise ConfigError(
            f"layer {layer!r}: layer activations need forward hooks, which TorchScript modules do not support "
            f"(the model is a {type(model).__name__}, e.g. from torch.jit.load: register_forward_hook fails on it, "
            f"and hooks on its submodules never run). {_EAGER_FIX}."
        )
    if not _hookable(model, layer):
        raise ConfigError(
            f"layer {layer!r}: layer activations need forward hooks, and an fx GraphModule never calls that layer "
            f"as a module (its graph runs the layers' operations inline; submodules survive only as holders of "
            f"weights, layers without weights not at all), so a hook on it would never fire. {_EAGER_FIX}."
        )


def check_layers(model: Any, layers: Sequence[str]) -> None:
    """Raise :class:`ConfigError` unless ``layers`` of ``model`` can be read (hooked, or tapped in an exported
    graph) before any pass."""
    _resolve_layers(model, layers)


def _resolve_layers(model: Any, layers: Sequence[str]) -> dict[str, torch.nn.Module]:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"layer activations need a torch.nn.Module with named submodules; the model is a "
            f"{type(model).__name__}. Fix: give a torch.nn.Module as the `model` fixture."
        )
    if not layers:  # model outputs only: no hooks needed
        return {}
    if isinstance(model, torch.jit.ScriptModule):
        _check_hooks_work(model, layers[0])
    if is_exported_module(model):  # read from the graph's nodes (capture taps them): no modules to hook
        layer_outputs(model, layers)
        return {}
    if is_onnx_model(model):  # read as extra outputs of the ONNX graph (capture taps them)
        model.check_layers(layers)
        return {}
    modules = dict(model.named_modules())
    unknown = [layer for layer in layers if layer not in modules or not layer]
    if unknown:
        available = layer_names(model)
        shown = ", ".join(available[:40]) + (", …" if len(available) > 40 else "")
        raise ConfigError(
            f"unknown layer {unknown[0]!r}: the model has no such submodule. Fix: use a name from "
            f"model.named_modules(): {shown}"
        )
    for layer in layers:
        _check_hooks_work(model, layer)
    return {layer: modules[layer] for layer in layers}


def _model_device(model: Any, fallback: torch.device | str) -> torch.device:
    """The device of the model's first parameter or buffer, else ``fallback`` (see the runner's ``model_device``)."""
    from pytest_dnnsafety.engines.core.runner import model_device

    return model_device(model, fallback)


#: What the pass is called in its error messages (the runner's and the forward guard's): the session's shared pass
#: serves every gate that reads the model's outputs (classifier and detection gates alike), and the neuron gates'
#: layers when it records any (:data:`WHAT`; :data:`OUTPUTS_WHAT` when it records none).
WHAT = "the shared forward pass (model outputs and layer activations)"
OUTPUTS_WHAT = "the shared forward pass (model outputs)"


def capture(
    model: Any,
    data: Any,
    layers: Sequence[str],
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    outputs: list[ModelOutputs] | None = None,
    batches: tuple[int, int] | None = None,
    shard: Any = None,
) -> dict[str, LayerActivations]:
    """One forward pass over ``data`` recording per-neuron reductions of ``layers`` (max, mean, min).

    With ``outputs`` (a list), the pass's :class:`ModelOutputs` is appended to it. With ``shard``
    (a torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard`, see
    :func:`pytest_dnnsafety.runtime.torchrun.batch_shard`) only that rank's batches are forwarded: the model
    sees exactly the batches a whole pass would give it, so the shard's rows are bit-identical to
    the same rows of a whole pass (``batches=(start, stop)``, the older spelling, is turned into
    the same shard). No agreement between the ranks happens here: the caller merges.

    The batch loop is the engine :class:`~pytest_dnnsafety.engines.core.runner.Runner`'s: batches from
    any accepted data form without materialising it (a DataLoader streams and must read in order:
    row i stays sample i), inputs to the model's own device (``device`` only for a model without
    parameters), the inputs' NaN/inf check, progress ticks. Every call of the model goes through
    the runner's :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard`: an exception becomes a
    :class:`MetricError` naming the batch, the shapes and dtypes and a fix, and the model's final
    output must be ``(batch, classes)`` and finite. No host synchronisation inside the batch loop:
    the deferred checks and the finiteness of the captured values are read once at the end. A batch
    larger than the working-memory budget allows (:func:`~pytest_dnnsafety.engines.core.budget.chunk_size`,
    measured on the first batch; ``dnnsafety_max_memory``, 1 GiB by default) goes to the model in
    chunks: the same values, since every reduction is per input.

    A ``torch.export`` program's module runs as a tapped copy of its graph
    (:func:`~pytest_dnnsafety.files.pt2_taps.tapped_forward`): each layer's output node feeds the same
    per-batch reductions a hook would, in the same pass; the guard checks its outputs as any model's.
    """
    from pytest_dnnsafety.engines.core.budget import chunk_size, spans
    from pytest_dnnsafety.engines.core.runner import Batch, Runner
    from pytest_dnnsafety.engines.core.guard import check_deterministic, eval_mode, probing

    modules = _resolve_layers(model, layers)
    tapped = tapped_forward(model, list(dict.fromkeys(layers))) if layers and is_exported_module(model) else None
    if layers and is_onnx_model(model):  # the ONNX graph with the layers as extra outputs: one run
        tapped = model.tapped(list(dict.fromkeys(layers)))
    if shard is None and batches is not None:
        shard = _batch_range(data, batch_size, batches)
    what = WHAT if layers else OUTPUTS_WHAT
    runner = Runner(what, model=model, device=device, batch_size=batch_size, shard=shard)
    guard = runner.guard(what, labels_ok=True, task="any")
    maxima: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    means: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    minima: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    shapes: dict[str, tuple[int, ...]] = {}
    sizes: list[int] = []  # rows per batch (host-side shapes, no sync)
    preds: list[Tensor] = []
    confs: list[Tensor] = []
    raw: list[Tensor] = []
    labels: list[Tensor] = []

    def hook_for(layer: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if probing():  # the guard's determinism probe (two passes of a few inputs): not data
                return
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(out, Tensor) or out.ndim < 2:
                raise MetricError(
                    f"layer {layer!r} returned {type(out).__name__} of shape "
                    f"{tuple(getattr(out, 'shape', ()))}; neuron metrics need a tensor (batch, neurons, ...)"
                )
            shapes.setdefault(layer, tuple(out.shape[1:]))
            if out.ndim == 2:  # one value per neuron: max = mean = min, kept once (a third of the memory)
                value = out.detach().float()
                maxima[layer].append(value)
                means[layer].append(value)
                minima[layer].append(value)
                return
            flat = out.detach().flatten(2)
            maxima[layer].append(flat.amax(dim=-1).float())
            means[layer].append(flat.mean(dim=-1, dtype=torch.float32))
            minima[layer].append(flat.amin(dim=-1).float())

        return hook

    def run_tapped(x: Tensor) -> Tensor:
        """The exported program's pass with its layers' outputs handed to the hooks (the guard's checks kept)."""
        assert tapped is not None
        if guard.batches == 0:  # the guard's determinism probe, on the user's module (memoised on it)
            check_deterministic(model, x, what)
        try:
            out = tapped.run(lambda slot, value: hooks[slot](model, (), value), x)
        except MetricError:
            raise
        except Exception:
            guard(model, x)  # the program's own error, worded as for every model: it raises it again
            raise  # only the tapping failed
        return guard.observe(out, x)

    chunk: list[int] = []

    def step(batch: Any) -> None:
        """A batch in the calls the working-memory budget allows (measured on the first batch); each call counts as
        one batch of the captured values (``sizes``)."""
        if not chunk:
            chunk.append(batch.n if isinstance(batch.y, BoxSet) else chunk_size(model, batch.x))
        if chunk[0] >= batch.n:
            return part(batch)
        for a, b in spans(batch.n, chunk[0]):
            part(Batch(index=batch.index, start=batch.start + a, x=batch.x[a:b],
                       y=None if batch.y is None else batch.y[a:b]))

    def part(batch: Any) -> None:
        out = guard(model, batch.x) if tapped is None else run_tapped(batch.x)
        if outputs is not None and isinstance(out, BoxSet):  # a detector: keep its boxes, top detection per image
            top = torch.full((batch.n,), -1.0, device=out.device).scatter_reduce(
                0, out.image, out.scores.float(), reduce="amax", include_self=True)
            best = (out.scores.float() == top[out.image]) & (top[out.image] >= 0)
            label = torch.full((batch.n,), -1, dtype=torch.int64, device=out.device).scatter_reduce(
                0, out.image[best], out.labels[best], reduce="amax", include_self=True)
            preds.append(label)
            confs.append(top.clamp_min(0.0))
            raw.append(out)  # type: ignore[arg-type]
            if batch.y is not None:
                guard.targets(batch.y, batch.index)  # labels beyond the detector's declared classes: flagged
                labels.append(batch.y)
        elif outputs is not None:
            if out.ndim == 1:  # a label-returning model
                preds.append(out.long())
                confs.append(torch.ones(out.shape[0], device=out.device))
            else:
                conf, pred = torch.softmax(out.float(), dim=1).max(dim=1)
                preds.append(pred)
                confs.append(conf)
                raw.append(out.detach().float())
            if batch.y is not None:
                labels.append(batch.y.to(out.device, non_blocking=out.device.type != "cpu"))
        sizes.append(batch.n)

    hooks = [hook_for(layer) for layer in tapped.layers] if tapped is not None else []
    handles = [module.register_forward_hook(hook_for(layer)) for layer, module in modules.items()]
    try:
        with eval_mode(model), torch.no_grad():
            runner.run_local(data, step)
    finally:
        for handle in handles:
            handle.remove()
    if shard is not None and sum(sizes) != shard.n_local:
        raise DataError(
            f"the data yielded {sum(sizes)} rows in batches {shard.batches[0]}..{shard.batches[1] - 1}, "
            f"where rank {shard.rank} of {shard.world_size} expects rows {shard.rows[0]}..{shard.rows[1] - 1} "
            f"of {shard.n_rows}: the data's length or batches changed while it was read. Fix: give data of a "
            f"fixed length whose batches (except the last) all have the batch size")
    if outputs is not None and raw and isinstance(raw[0], BoxSet):
        outputs.append(ModelOutputs(torch.cat(preds), torch.cat(confs),
                                    BoxSet.cat(labels) if len(labels) == len(sizes) else None,  # type: ignore[arg-type]
                                    guard.num_classes, None, BoxSet.cat(raw)))  # type: ignore[arg-type]
    elif outputs is not None:
        joined = (None if len(labels) != len(sizes) else
                  BoxSet.cat(labels) if labels and isinstance(labels[0], BoxSet) else torch.cat(labels))
        outputs.append(ModelOutputs(torch.cat(preds), torch.cat(confs), joined, guard.num_classes,
                                    torch.cat(raw) if len(raw) == len(sizes) else None))
    return {layer: _layer_result(layer, maxima[layer], means[layer], minima[layer], shapes.get(layer), sizes,
                                 0 if shard is None else shard.batches[0], 0 if shard is None else shard.rows[0])
            for layer in layers}


def _layer_result(layer: str, maxima: list[Tensor], means: list[Tensor], minima: list[Tensor],
                  shape: tuple[int, ...] | None, sizes: list[int], first_batch: int, first_row: int
                  ) -> LayerActivations:
    """One layer's captured batches joined and checked (once called per batch, finite: one host sync)."""
    if len(maxima) != len(sizes) or shape is None:
        raise MetricError(
            f"layer {layer!r} was called {len(maxima)} time(s) in {len(sizes)} batch(es); neuron metrics "
            f"need exactly one output per input. Fix: name a layer the model calls once per forward pass "
            f"(not a reused or unused module)."
        )
    mx = torch.cat(maxima)
    same = all(a is b for a, b in zip(maxima, means)) and all(a is b for a, b in zip(maxima, minima))
    mn, lo = (mx, mx) if same else (torch.cat(means), torch.cat(minima))
    if mx.shape[0] != sum(sizes):
        raise MetricError(
            f"layer {layer!r} produced {mx.shape[0]} rows for {sum(sizes)} inputs; neuron metrics need the "
            f"batch as the first dimension of the layer's output."
        )
    bad = ~(torch.isfinite(mx).all(dim=1) & torch.isfinite(mn).all(dim=1) & torch.isfinite(lo).all(dim=1))
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        batch, start = 0, 0
        while start + sizes[batch] <= first:
            start += sizes[batch]
            batch += 1
        raise MetricError(
            f"layer {layer!r} produced NaN/inf activations for {int(bad.sum())} of {mx.shape[0]} inputs; the first "
            f"is input {first_row + first} (batch {first_batch + batch}). Fix: check the model's weights and the "
            f"inputs' range."
        )
    return LayerActivations(layer, mx, mn, shape, lo)


def _batch_range(data: Any, batch_size: int, batches: tuple[int, int]) -> Any:
    """The :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of ``data`` holding batches ``start..stop-1`` (``capture(batches=)``)."""
    from pytest_dnnsafety.runtime.torchrun import Shard

    n = known_length(data)
    if n is None:
        raise DataError("capture(batches=...): the data's length is unknown without reading it. Fix: give sized "
                        "data, or no batches=")
    step = data.batch_size if isinstance(data, torch.utils.data.DataLoader) and data.batch_size else batch_size
    start, stop = batches
    return Shard(rank=0, world_size=1, batches=(start, stop), rows=(min(n, start * step), min(n, stop * step)),
                 n_rows=n)


class _Same:
    """A key part that is one object: equal only to itself (``is``), hashed by identity, kept alive by the key."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


class ActivationCache:
    """Session-wide store of captured activations, keyed by (model, data, shard, layer).

    The keys hold the model and the data *objects* (compared by identity, like
    :meth:`pytest_dnnsafety.gates.core.GateContext.memo`), so they stay alive while the cache
    lives and no other object can take their place. ``forward_passes`` counts the passes run.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], LayerActivations] = {}
        self._errors: dict[tuple[Any, ...], Exception] = {}
        self._outputs: dict[tuple[Any, ...], ModelOutputs] = {}
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
        shard: Any = None,
    ) -> dict[str, LayerActivations]:
        """Activations of ``layers``; missing ones (and the plan's other layers) in one pass.

        ``shard`` (a :class:`pytest_dnnsafety.runtime.torchrun.Shard`, or None for all the data): only this
        torchrun rank's rows, from a pass over its batches alone (cached apart from whole passes).

        A pass that fails (the model raised, its outputs were NaN/inf or of the wrong shape, the
        data was refused) fails every gate that needs one of its layers with the same error: the
        error is cached for all of the pass's layers, and the pass is not retried per gate.
        """
        if isinstance(model, RecordedPredictions):  # a file of outputs: no layers (the evaluation refuses earlier)
            from pytest_dnnsafety.engines.core.recorded import refuse_layers

            raise refuse_layers(model, layers)
        pair = self._key(model, data, shard)
        for layer in layers:
            if (*pair, layer) in self._errors:
                raise self._errors[(*pair, layer)]
        missing = [layer for layer in layers if (*pair, layer) not in self._entries]
        if missing:
            # This gate's own layers first: an unknown or unhookable layer is this gate's error alone.
            check_layers(model, missing)
            extra = [layer for layer in plan if layer not in missing and (*pair, layer) not in self._entries
                     and (*pair, layer) not in self._errors]
            if extra:  # a bad planned layer must not break this gate; its own gate reports it
                extra = [layer for layer in extra if _layer_ok(model, layer)]
            self._pass(model, data, [*missing, *extra], batch_size=batch_size, device=device, shard=shard)
        return {layer: self._entries[(*pair, layer)] for layer in layers}

    def outputs(self, model: Any, data: Any, *, batch_size: int, device: torch.device | str,
                plan: Iterable[str] = (), shard: Any = None) -> ModelOutputs:
        """The model's :class:`ModelOutputs` on ``data``: from a pass already made, else one pass that also
        captures the plan's layers (so a later neuron gate on the same model and data costs nothing).

        ``shard``: as in :meth:`get` (row i of the result is row ``shard.rows[0] + i`` of the data)."""
        pair = self._key(model, data, shard)
        if pair in self._outputs:
            return self._outputs[pair]
        if (*pair, "") in self._errors:
            raise self._errors[(*pair, "")]
        if isinstance(model, RecordedPredictions):  # recorded outputs: served as the pass's, no forward pass
            from pytest_dnnsafety.engines.core.recorded import recorded_outputs

            try:
                self._outputs[pair] = ModelOutputs(**recorded_outputs(model, data, device=device, batch_size=batch_size,
                                                                      shard=shard))
            except DnnSafetyError as exc:
                self._errors[(*pair, "")] = exc
                raise
            return self._outputs[pair]
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"the model is a {type(model).__name__}, not a torch.nn.Module. Fix: give a "
                              f"torch.nn.Module as the `model` fixture.")
        layers = [layer for layer in plan if (*pair, layer) not in self._entries and (*pair, layer) not in self._errors
                  and _layer_ok(model, layer)]
        self._pass(model, data, layers, batch_size=batch_size, device=device, shard=shard)
        return self._outputs[pair]

    @staticmethod
    def _key(model: Any, data: Any, shard: Any) -> tuple[Any, ...]:
        return (_Same(model), _Same(data), None if shard is None else (shard.batches, shard.rows))

    def _pass(self, model: Any, data: Any, layers: list[str], *, batch_size: int, device: torch.device | str,
              shard: Any = None) -> None:
        pair = self._key(model, data, shard)
        self.forward_passes += 1
        sink: list[ModelOutputs] = []
        try:
            captured = capture(model, data, layers, batch_size=batch_size, device=device, outputs=sink, shard=shard)
        except DnnSafetyError as exc:
            for layer in (*layers, ""):
                self._errors[(*pair, layer)] = exc
            raise
        for layer, acts in captured.items():
            self._entries[(*pair, layer)] = acts
        self._outputs.setdefault(pair, sink[0])

    def clear(self) -> None:
        self._entries.clear()
        self._errors.clear()
        self._outputs.clear()


def _layer_ok(model: Any, layer: str) -> bool:
    try:
        check_layers(model, [layer])
    except ConfigError:
        return False
    return True
