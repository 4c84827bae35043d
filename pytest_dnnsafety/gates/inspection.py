"""Built-in gate family: class-level confusion and bias (DeepInspect; Tian et al., ICSE 2020; docs: gates/inspection.md).

``max_class_confusion(threshold, layer=...)`` and ``max_class_bias(threshold, layer=...)``. The engine is
:mod:`pytest_dnnsafety.engines.inspection.deepinspect`; the layer's per-channel max/mean/min and the model's
predictions (and the data's labels) come from the session's shared forward pass
(:func:`.shared.activations_for`, :func:`.shared.outputs_for`): a gate on a model, data and layer that
another gate already ran costs no forward pass, and the activation threshold is applied afterwards, so
gates with different thresholds share the pass too. Under torchrun (:mod:`pytest_dnnsafety.runtime.torchrun`) each
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

**Multi-label models** (``tasks=("single-label", "multi-label")``). An input counts for every class it
predicts (probability — sigmoid of the logit, or the output itself, ``outputs=`` — at least
``decision_threshold``, one number or one per class, default 0.5): p(n | k), NAPVD and avg_bias as
above (avg_bias without the type-1 label filter). The labels are a ``(N, K)`` 0/1 matrix.

**Ground truth** (``statistic="type1"`` single-label, ``"type2"`` multi-label; Tian et al. §IV-B1): the
largest pair value — type-1: mean of P(predicted b | true a) and P(predicted a | true b); type-2: mean
of P(both predicted | a present, b absent) and the reverse — over the pairs with ``min_support``
(default 10) or more inputs in *each* conditioning set; the rest are counted in the details, not
gated, and with no supported pair the gate is inconclusive. The details carry the pair matrix
(``type1_matrix``/``type2_matrix``, null where undefined, K ≤ 64) with ``classes``, its support, and
for multi-label data the label coincidence matrix and its Spearman correlation with NAPVD (reported,
not gated). :mod:`pytest_dnnsafety.engines.inspection.multilabel` has the definitions.

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

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, class_names, in_range, one_of
from pytest_dnnsafety.gates.shared import activations_for, outputs_for

__all__ = ["MAX_CLASS_CONFUSION", "MAX_CLASS_BIAS", "pytest_dnnsafety_register_gates"]


def _check_layer(model: Any, layer: str, marker: str) -> None:
    """ConfigError naming the layer and the closest names when ``model`` has no such submodule."""
    from pytest_dnnsafety.engines.core.capture import layer_names  # a torch.export program's: its graph's modules
    from pytest_dnnsafety.files.pt2_taps import is_exported_module

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


def output_kind(spec: GateSpec, logits: Any, shard: Any) -> str:
    """``outputs=`` resolved to 'logits' or 'probabilities' the same on every rank ('auto': probabilities when every
    output of every rank lies in [0, 1])."""
    from pytest_dnnsafety.runtime import torchrun as ranks

    kind = spec.options.get("outputs") or "auto"
    if kind != "auto":
        return kind
    inside = bool(((logits >= 0) & (logits <= 1)).all()) if logits.numel() else True
    return "probabilities" if all(ranks.gather(inside) if shard is not None else [inside]) else "logits"


def refuse_multilabel_options(spec: GateSpec, multi: bool) -> None:
    """A ConfigError when a single-label model is given an option only a multi-label model reads."""
    if multi:
        return
    given = [name for name in ("decision_threshold", "outputs") if spec.options.get(name) is not None]
    if given:
        raise ConfigError(f"{spec.marker}: {', '.join(given)} only applies to multi-label models (one probability "
                          "per class, a class predicted when it reaches the decision threshold); this model is "
                          "single-label (its labels are class indices). Fix: drop it, or give multi-label data (a "
                          "(N, classes) 0/1 label matrix) or task='multi-label'.")


def _inspect(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, *, bias: bool) -> tuple[Any, Any]:
    """The engine's result for this gate's layer and the ground truth (type-1 or type-2 pair matrix; None
    without labels), from the shared forward pass (sharded under torchrun)."""
    import torch

    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine
    from pytest_dnnsafety.engines.inspection.kernels import layer_activity
    from pytest_dnnsafety.engines.inspection.multilabel import MultiLabelInspectionEngine, type1_pairs
    from pytest_dnnsafety.engines.core.multilabel import check_label_matrix, predicted_sets

    opts = spec.options
    multi = ctx.task == "multi-label"
    refuse_multilabel_options(spec, multi)
    model, data, layer = fx["model"], fx["data"], opts["layer"]
    _check_layer(model, layer, spec.marker)
    classes = list(opts["classes"]) if opts["classes"] is not None else None
    shard = ctx.shard(data)  # None: the whole data on every rank

    def read() -> tuple[Any, Any, int]:  # this rank's rows of the shared pass, checked
        acts = activations_for(spec, fx, ctx, [layer], shard=shard)[layer]
        out = outputs_for(spec, fx, ctx, shard=shard)
        if multi:
            check_label_matrix(out, spec.marker, spec.fixtures["data"], required=False)
        k = out.num_classes
        if k is not None and classes is not None and len(classes) != k:
            raise ConfigError(f"{spec.marker}: classes= names {len(classes)} classes but the model has {k} outputs. "
                              "Fix: name every output, in order.")
        if not multi:
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
    kind = output_kind(spec, out.logits, shard) if multi else None
    threshold = 0.5 if opts.get("decision_threshold") is None else opts["decision_threshold"]

    def fill() -> Any:  # per-class unit and prediction counts (and label products): sums
        active = layer_activity(acts, opts["activation_threshold"], reduce=opts["reduce"])
        device = out.predictions.device
        labels = out.labels.to(device) if out.labels is not None else None
        if multi:
            engine: Any = MultiLabelInspectionEngine(int(active.shape[1]), int(k),
                                                     threshold=opts["activation_threshold"], device=device)
            engine.update(active.to(device), predicted_sets(out.logits.to(device), threshold, kind), labels)
            return engine
        engine = InspectionEngine(int(active.shape[1]), int(k), threshold=opts["activation_threshold"], device=device)
        engine.update(active.to(device), out.predictions, labels)
        return engine

    engine = ranks.merged(fill, shard)
    options = dict(rule=opts["rule"], top_share=opts["top_share"], bias=bias,
                   label_filter=opts.get("label_filter", True), classes=classes)
    if multi:
        res, truth = engine.compute(**options)
    else:
        res = engine.compute(**options)
        truth = type1_pairs(engine.confusion) if int(engine.labelled) else None
    if res.unpredicted and opts["unpredicted"] == "error":
        names = ", ".join(res.classes[i] for i in res.unpredicted)
        raise MetricError(
            f"{spec.marker}: class(es) {names} were never predicted on the {res.n_inputs} inputs of fixture "
            f"{spec.fixtures['data']!r}, so p(n | class) is undefined for them and their confusion with the other "
            "classes cannot be measured (a class the model never outputs is itself a defect). Fix: check the model "
            "(e.g. its last layer for these outputs) and give data with inputs of every class; or pass "
            "unpredicted='exclude' to gate on the other classes only.")
    return res, truth


def _truth_details(res: Any, truth: Any, spec: GateSpec, multi: bool) -> dict[str, Any]:
    """The ground truth for the details: the pair matrix (K ≤ 64), its worst supported pair, coincidence."""
    from pytest_dnnsafety.engines.inspection.deepinspect import _json_matrix
    from pytest_dnnsafety.engines.inspection.multilabel import spearman, worst_pair

    min_support = spec.options["min_support"]
    value, pair, n_ok, n_bad = worst_pair(truth, min_support)
    out: dict[str, Any] = {f"{truth.kind}_worst": {
        "value": None if pair is None else value, "pair": None if pair is None else [res.classes[i] for i in pair],
        "min_support": min_support, "supported_pairs": n_ok, "unsupported_pairs": n_bad}}
    if res.num_classes <= 64:
        out[f"{truth.kind}_matrix"] = _json_matrix(truth.matrix)
        out[f"{truth.kind}_support"] = truth.support.tolist()
    if multi and truth.coincidence is not None:
        if res.num_classes <= 64:
            out["coincidence"] = _json_matrix(truth.coincidence)
        out["coincidence_napvd_spearman"] = spearman(res.napvd, truth.coincidence)
    return out


def _base_details(spec: GateSpec, res: Any, by: str, model: Any) -> dict[str, Any]:
    from pytest_dnnsafety.engines.core.capture import activations_from

    opts = spec.options
    return {"layer": opts["layer"], "reduce": opts["reduce"], **activations_from(model),
            "unpredicted_policy": opts["unpredicted"], **res.to_details(top=opts["top"], by=by)}


def _measure_class_confusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest class-pair confusion 1 − NAPVD (or the share of confused pairs, or the largest ground-truth
    type-1/type-2 confusion over the supported pairs) of one layer."""
    stat = spec.options["statistic"]
    multi = ctx.task == "multi-label"
    if stat in ("type1", "type2") and (stat == "type2") != multi:
        want, task = ("multi-label", "single-label") if stat == "type2" else ("single-label", "multi-label")
        other = "type1" if stat == "type2" else "type2"
        raise ConfigError(f"{spec.marker}: statistic={stat!r} is the {want} ground-truth confusion, but this model "
                          f"is {task} (task {ctx.task!r}). Fix: statistic={other!r} for a {task} model, or give "
                          f"{want} data (or task='{want}').")
    res, truth = _inspect(spec, fx, ctx, bias=False)
    details = {"statistic": stat, "task": ctx.task, **_base_details(spec, res, "confusion", fx["model"]),
               **(_truth_details(res, truth, spec, multi) if truth is not None else {})}
    if stat in ("type1", "type2"):
        return _ground_truth_measurement(spec, res, truth, details)
    value = res.max_confusion() if stat == "confusion" else res.confused_share()
    label = "max confusion 1 − NAPVD" if stat == "confusion" else "share of confused pairs"
    return Measurement(value=value, detail=f"layer {spec.options['layer']}, {label} {value:.4g}; {res.detail()}",
                       details=details)


def _ground_truth_measurement(spec: GateSpec, res: Any, truth: Any, details: dict[str, Any]) -> Measurement:
    """The largest type-1/type-2 confusion over the pairs with ``min_support`` inputs in each conditioning set."""
    from pytest_dnnsafety.engines.inspection.multilabel import worst_pair

    stat, layer, min_support = spec.options["statistic"], spec.options["layer"], spec.options["min_support"]
    if truth is None:
        raise MetricError(f"{spec.marker}: statistic={stat!r} is measured against the labels, and fixture "
                          f"{spec.fixtures['data']!r} has none. Fix: give labelled data, or statistic='confusion'.")
    value, pair, n_ok, n_bad = worst_pair(truth, min_support)
    what = ("P(both predicted | one present, the other absent)" if stat == "type2"
            else "P(predicted as the other | true class)")
    if pair is None:
        why = (f"no class pair has {min_support} or more inputs in each conditioning set ({what}; {n_bad} pairs "
               "undefined or below min_support), so the ground-truth confusion cannot be measured. Fix: add labelled "
               "data with the classes apart (and present), or lower min_support")
        return Measurement(value=float("nan"), detail=f"layer {layer}, {stat} confusion: no supported pair",
                           details=details, inconclusive=why)
    a, b = (res.classes[i] for i in pair)
    detail = (f"layer {layer}, max {stat} confusion {value:.4g} for {a}–{b} (mean of both directions of {what}); "
              f"{n_ok} pairs with ≥ {min_support} inputs per condition" + (f", {n_bad} without (not gated)"
                                                                           if n_bad else ""))
    return Measurement(value=value, detail=detail, details=details)


def _measure_class_bias(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest avg_bias over the class pairs of one layer."""
    refuse_multilabel_options(spec, ctx.task == "multi-label")
    res, _ = _inspect(spec, fx, ctx, bias=True)
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



def _decision_threshold(value: Any) -> str | None:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        return "is an empty list"
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            return f"{v!r} is not a number strictly between 0 and 1"
    return None


#: multi-label only (a single-label model given them is an error): the decision threshold and what the outputs are
_MULTI = (
    Param("decision_threshold", (int, float, list, tuple, type(None)), None,
          lambda v: None if v is None else _decision_threshold(v),
          "multi-label only: a class is predicted when its probability reaches this; one number in (0, 1) "
          "(default 0.5) or a list with one per class"),
    Param("outputs", (str, type(None)), None,
          lambda v: None if v is None else one_of("auto", "logits", "probabilities")(v),
          "multi-label only: 'logits' (a sigmoid is applied), 'probabilities' or 'auto' (default: probabilities "
          "when every output lies in [0, 1])"),
)

MAX_CLASS_CONFUSION = GateDef(
    marker="max_class_confusion",
    metric="class confusion (DeepInspect)",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(_LAYER, _ACT, _REDUCE,
            Param("statistic", (str,), "confusion", one_of("confusion", "share", "type1", "type2"),
                  "use 'confusion' (the largest 1 − NAPVD over class pairs), 'share' (the share of pairs the "
                  "rule flags as confused), 'type1' (single-label ground truth: mean of P(pred b | true a) and "
                  "P(pred a | true b)) or 'type2' (multi-label ground truth: mean of P(both predicted | a present, "
                  "b absent) and the reverse)"),
            _RULE, _TOP_SHARE, _CLASSES, _UNPREDICTED, _TOP,
            Param("min_support", (int,), 10, in_range(1, 10**9),
                  "give the inputs each conditioning set of a pair needs before its type1/type2 confusion is gated, "
                  "e.g. min_support=10"),
            *_MULTI),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_class_confusion,
    tasks=("single-label", "multi-label"),
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
    params=(_LAYER, _ACT, _REDUCE, _RULE, _TOP_SHARE, _CLASSES, _UNPREDICTED, _TOP, *_MULTI,
            Param("label_filter", (bool,), True, None,
                  "use True (with labels, only triplets where the model confused the third class with one of the "
                  "pair, as the authors do) or False (distance filter only)")),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_class_bias,
    tasks=("single-label", "multi-label"),
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,  # per-class counts: each rank its share of the batches, then sum
    doc="fail if the largest avg_bias over class pairs in `layer` — how differently the model places two "
        "classes relative to third classes — exceeds `threshold` (in [0, 0.5]; DeepInspect, Tian et al. 2020; "
        "docs: gates/inspection.md)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_CLASS_CONFUSION)
    registry.add(MAX_CLASS_BIAS)
