"""Built-in gate family: class-level confusion and bias (DeepInspect; Tian et al., ICSE 2020; README "Class confusion and bias").

``max_class_confusion(threshold, layer=...)`` and ``max_class_bias(threshold, layer=...)``. The engine is
:mod:`pytest_dnnsafety.engines.inspection`; the layer's per-channel max/mean/min and the model's
predictions (and the data's labels) come from the session's shared forward pass
(:func:`.shared.activations_for`, :func:`.shared.outputs_for`): a gate on a model, data and layer that
another gate already ran costs no forward pass, and the activation threshold is applied afterwards, so
gates with different thresholds share the pass too. Under torchrun (:mod:`pytest_dnnsafety.ranks`) each
rank forwards only its share of the data's batches and the engine's counts (active units and
predictions per class, the labelled confusion) are all-reduced (``sum``): the analysis then runs on the
same counts as one process's, so the values are identical.

**Values.**

* ``max_class_confusion``, ``statistic="confusion"`` (default): ``1 − min NAPVD`` over the pairs of
  predicted classes. NAPVD is an RMS difference of activation probabilities, so it lies in [0, 1], and
  ``1 − NAPVD`` is 1 when two classes activate the same units at the same rates (indistinguishable at
  this layer) and 0 when, on every unit either uses, one always fires and the other never. It is
  absolute — not relative to the model's other pairs — so runs of the same layer and activation
  threshold are comparable. ``statistic="share"``: the share of pairs the rule flags as confused
  (``rule="std"``: NAPVD < mean − 1·std, the paper's; ``rule="top"``: the ``top_share`` closest pairs —
  note that this share is fixed by construction, and the std rule's is relative, see the engine doc).
* ``max_class_bias``: the largest ``avg_bias`` over the pairs, in [0, ½). Needs three or more
  predicted classes. **No signal is no pass**: a triplet enters avg_bias only when one of its NAPVDs lies
  below the cutoff (mean − std of the NAPVD matrix; eqs. 3–4); when none does (random activations, or
  the authors' own CIFAR-10 model at activation thresholds 0.25 and 0.5) or no triplet passes the
  filters, every avg_bias is 0 for want of evidence and there is no worst pair. The gate is then
  *inconclusive*, naming the cutoff and the smallest NAPVD (value NaN, not 0): it does not report a
  "strongest" signal, because below the paper's cutoff there is none to report.

**A class never predicted** on the data has no activation profile: by default (``unpredicted="error"``)
the gate is an error naming the class, because such a class is a defect the pairwise metrics would
hide; ``unpredicted="exclude"`` leaves it out of every pair and names it in the details and summary.

**Details**: the worst pairs by class name (``classes=[...]`` names the outputs, else ``"0" … "K-1"``),
the NAPVD matrix when K ≤ 64, and with labelled data the ground truth (type-1 confusion, ground-truth
confused/biased pairs) with the precision, recall and AUCEC of the flagged pairs. No torch import at
module level.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Mapping

from ..errors import ConfigError, MetricError
from ..hookspecs import hookimpl
from ..results import Measurement
from .core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, class_names, in_range, one_of
from .shared import activations_for, outputs_for

__all__ = ["MAX_CLASS_CONFUSION", "MAX_CLASS_BIAS", "pytest_dnnsafety_register_gates"]


def _check_layer(model: Any, layer: str, marker: str) -> None:
    """ConfigError naming the layer and the closest names when ``model`` has no such submodule."""
    from ..activations import layer_names  # a torch.export program's: its graph's modules
    from ..export_taps import is_exported_module

    if not callable(getattr(model, "named_modules", None)):
        return  # the cache names the problem (not a torch.nn.Module)
    names = layer_names(model)
    if layer in names:
        return
    close = difflib.get_close_matches(layer, names, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    shown = ", ".join(names[:40]) + (", …" if len(names) > 40 else "")
    where = ("the torch.export program's graph runs no module of that name. Fix: use a name from the exported "
             "graph's modules (as in the eager model's named_modules())" if is_exported_module(model) else
             "the model has no such submodule. Fix: use a name from model.named_modules()")
    raise ConfigError(f"{marker}: unknown layer {layer!r}{hint}: {where}: {shown}")


def _inspect(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, *, bias: bool) -> Any:
    """The engine's result for this gate's layer, from the shared forward pass (sharded under torchrun)."""
    import torch

    from .. import ranks
    from ..engines.inspection import InspectionEngine, layer_activity

    opts = spec.options
    model, data, layer = fx["model"], fx["data"], opts["layer"]
    _check_layer(model, layer, spec.marker)
    classes = list(opts["classes"]) if opts["classes"] is not None else None
    shard = ctx.shard(data)  # None: the whole data on every rank

    def read() -> tuple[Any, Any, int]:  # this rank's rows of the shared pass, checked
        acts = activations_for(spec, fx, ctx, [layer], shard=shard)[layer]
        out = outputs_for(spec, fx, ctx, shard=shard)
        k = out.num_classes
        if k is not None and classes is not None and len(classes) != k:
            raise ConfigError(f"{spec.marker}: classes= names {len(classes)} classes but the model has {k} outputs. "
                              "Fix: name every output, in order.")
        out.check_labels(spec.fixtures["data"], classes)
        top = -1
        if k is None and classes is None:  # a label-returning model: the largest class index seen
            top = int(out.predictions.max() if out.labels is None
                      else torch.maximum(out.predictions.max(), out.labels.max()))
        return acts, out, top

    acts, out, top = ranks.together(read, sharded=shard is not None)
    k = out.num_classes
    if k is None:  # the names, else the largest class index any rank saw
        k = len(classes) if classes is not None else max(ranks.gather(top) if shard is not None else [top]) + 1

    def fill() -> InspectionEngine:  # per-class unit and prediction counts: sums
        active = layer_activity(acts, opts["activation_threshold"], reduce=opts["reduce"])
        engine = InspectionEngine(int(active.shape[1]), int(k), threshold=opts["activation_threshold"],
                                  device=out.predictions.device)
        labels = out.labels.to(out.predictions.device) if out.labels is not None else None
        engine.update(active.to(out.predictions.device), out.predictions, labels)
        return engine

    engine = ranks.merged(fill, shard)
    res = engine.compute(rule=opts["rule"], top_share=opts["top_share"], bias=bias,
                         label_filter=opts.get("label_filter", True), classes=classes)
    if res.unpredicted and opts["unpredicted"] == "error":
        names = ", ".join(res.classes[i] for i in res.unpredicted)
        raise MetricError(
            f"{spec.marker}: class(es) {names} were never predicted on the {res.n_inputs} inputs of fixture "
            f"{spec.fixtures['data']!r}, so p(n | class) is undefined for them and their confusion with the other "
            "classes cannot be measured (a class the model never outputs is itself a defect). Fix: check the model "
            "(e.g. its last layer for these outputs) and give data with inputs of every class; or pass "
            "unpredicted='exclude' to gate on the other classes only.")
    return res


def _base_details(spec: GateSpec, res: Any, by: str, model: Any) -> dict[str, Any]:
    from ..activations import activations_from

    opts = spec.options
    return {"layer": opts["layer"], "reduce": opts["reduce"], **activations_from(model),
            "unpredicted_policy": opts["unpredicted"], **res.to_details(top=opts["top"], by=by)}


def _measure_class_confusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest class-pair confusion 1 − NAPVD (or the share of confused pairs) of one layer."""
    res = _inspect(spec, fx, ctx, bias=False)
    stat = spec.options["statistic"]
    value = res.max_confusion() if stat == "confusion" else res.confused_share()
    details = {"statistic": stat, **_base_details(spec, res, "confusion", fx["model"])}
    label = "max confusion 1 − NAPVD" if stat == "confusion" else "share of confused pairs"
    return Measurement(value=value, detail=f"layer {spec.options['layer']}, {label} {value:.4g}; {res.detail()}",
                       details=details)


def _measure_class_bias(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest avg_bias over the class pairs of one layer."""
    res = _inspect(spec, fx, ctx, bias=True)
    value = res.max_bias()  # raises InspectionError (naming the fix) with fewer than three classes
    details = _base_details(spec, res, "bias", fx["model"])
    detail = f"layer {spec.options['layer']}, {res.detail(by='bias')}"
    if res.bias_no_signal is not None:  # every avg_bias 0 because no triplet counted: no evidence, not no bias
        return Measurement(value=float("nan"), detail=detail, details=details, inconclusive=res.bias_no_signal)
    return Measurement(value=value, detail=detail, details=details)


# ------------------------------------------------------------------------------------- marker keywords


def _is_layer(value: Any) -> str | None:
    return None if value.strip() else "must be a non-empty module name such as 'features.3'"


def _open_unit(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value < 1 else f"{value!r} is outside (0, 1)"


def _share(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value <= 1 else f"{value!r} is outside (0, 1]"




_LAYER = Param("layer", (str,), REQUIRED, _is_layer,
               "name the layer as in model.named_modules(), e.g. layer='classifier.0'")
_ACT = Param("activation_threshold", (int, float), 0.5, _open_unit,
             "a unit is active when the mean of its min–max scaled outputs exceeds this; use a number in (0, 1) "
             "(default 0.5, the paper's)")
_REDUCE = Param("reduce", (str,), "mean", one_of("mean", "max"),
                "use 'mean' (the paper: a channel's mean scaled value) or 'max' (its largest scaled value)")
_RULE = Param("rule", (str,), "std", one_of("std", "top"),
              "use 'std' (mean ∓ 1·std over the pairs, the paper's) or 'top' (the top_share most suspicious pairs)")
_TOP_SHARE = Param("top_share", (int, float), 0.01, _share, "use a share in (0, 1], e.g. top_share=0.01 (1 %)")
_CLASSES = Param("classes", (list, tuple, type(None)), None, class_names,
                 "list the class names in the model's output order, e.g. classes=['cat', 'dog', 'car']")
_UNPREDICTED = Param("unpredicted", (str,), "error", one_of("error", "exclude"),
                     "use 'error' (a class never predicted fails the gate as an error) or 'exclude'")
_TOP = Param("top", (int,), 10, in_range(0, 10**6), "give how many worst pairs the details list, e.g. top=10")

MAX_CLASS_CONFUSION = GateDef(
    marker="max_class_confusion",
    metric="class confusion (DeepInspect)",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(_LAYER, _ACT, _REDUCE,
            Param("statistic", (str,), "confusion", one_of("confusion", "share"),
                  "use 'confusion' (the largest 1 − NAPVD over class pairs) or 'share' (the share of pairs the "
                  "rule flags as confused)"),
            _RULE, _TOP_SHARE, _CLASSES, _UNPREDICTED, _TOP),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_class_confusion,
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,  # per-class counts: each rank its share of the batches, then sum
    doc="fail if two classes are too alike in `layer`: the largest 1 − NAPVD over class pairs (or, with "
        "statistic='share', the share of pairs flagged confused) exceeds `threshold` (DeepInspect, Tian et al. "
        "2020)",
)

MAX_CLASS_BIAS = GateDef(
    marker="max_class_bias",
    metric="class bias (DeepInspect avg_bias)",
    op="<=",
    threshold_range=(0.0, 0.5),
    params=(_LAYER, _ACT, _REDUCE, _RULE, _TOP_SHARE, _CLASSES, _UNPREDICTED, _TOP,
            Param("label_filter", (bool,), True, None,
                  "use True (with labels, only triplets where the model confused the third class with one of the "
                  "pair, as the authors do) or False (distance filter only)")),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_class_bias,
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,  # per-class counts: each rank its share of the batches, then sum
    doc="fail if the largest avg_bias over class pairs in `layer` — how differently the model places two "
        "classes relative to third classes — exceeds `threshold` (in [0, 0.5]; DeepInspect, Tian et al. 2020; "
        "README: Class confusion and bias)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_CLASS_CONFUSION)
    registry.add(MAX_CLASS_BIAS)
