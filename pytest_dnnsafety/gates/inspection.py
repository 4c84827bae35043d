"""Built-in gate family: class-level confusion and bias (DeepInspect; Tian et al., ICSE 2020; docs: gates/inspection.md).

``max_class_confusion(threshold, layer=...)`` and ``max_class_bias(threshold, layer=...)``. The engine is
:mod:`pytest_dnnsafety.engines.inspection.deepinspect`, and what a gate runs for its task (single-label or
multi-label: the checks, the counts, the rank merging, the value's wording) is
:class:`~pytest_dnnsafety.engines.inspection.plan.InspectionPlan`; the layer's per-channel max/mean/min and the
model's predictions (and the data's labels) come from the session's shared forward pass
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
hide; ``unpredicted="exclude"`` leaves it out of every pair and names it in the details and summary. Excluding
more than half of the classes (a collapsed model) is inconclusive, naming them; the excluded classes are the
gates' ``details["comparable_set"]``, which a baseline comparison flags as a regression when it changes.

**Details**: the worst pairs by class name (``classes=[...]`` names the outputs, else ``"0" … "K-1"``),
the NAPVD matrix when K ≤ 64, and with labelled data the ground truth (type-1 confusion, ground-truth
confused/biased pairs) with the precision, recall and AUCEC of the flagged pairs. No torch import at
module level.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_type2_matrix
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.checks import class_names, in_range, one_of
from pytest_dnnsafety.gates.shared import activations_for, outputs_for

__all__ = ["MAX_CLASS_CONFUSION", "MAX_CLASS_BIAS", "pytest_dnnsafety_register_gates"]


def _measure_class_confusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest class-pair confusion 1 − NAPVD (or the share of confused pairs, or the largest ground-truth
    type-1/type-2 confusion over the supported pairs) of one layer, from the shared forward pass."""
    from pytest_dnnsafety.engines.inspection.plan import InspectionPlan

    plan = InspectionPlan.for_task(ctx.task, spec.marker, spec.fixtures["data"], spec.options)
    layer = spec.options["layer"]
    res, truth = plan.inspect(fx["model"], lambda shard: (activations_for(spec, fx, ctx, [layer], shard=shard)[layer],
                                                          outputs_for(spec, fx, ctx, shard=shard)),
                              ctx.shard(fx["data"]), bias=False)
    return Measurement(**plan.confusion_report(res, truth, fx["model"]))


def _measure_class_bias(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Largest avg_bias over the class pairs of one layer, from the shared forward pass."""
    from pytest_dnnsafety.engines.inspection.plan import InspectionPlan

    plan = InspectionPlan.for_task(ctx.task, spec.marker, spec.fixtures["data"], spec.options)
    layer = spec.options["layer"]
    res, _ = plan.inspect(fx["model"], lambda shard: (activations_for(spec, fx, ctx, [layer], shard=shard)[layer],
                                                      outputs_for(spec, fx, ctx, shard=shard)),
                          ctx.shard(fx["data"]), bias=True)
    return Measurement(**plan.bias_report(res, fx["model"]))


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
                     "use 'error' (a class never predicted fails the gate as an error) or 'exclude' (left out of "
                     "every pair; leaving out more than half of the classes is inconclusive)")
_TOP = Param("top", (int,), 10, in_range(0, 10**6), "give how many worst pairs the details list, e.g. top=10")



def _decision_threshold(value: Any) -> str | None:
    if value is None:  # the default, 0.5
        return None
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
          _decision_threshold,
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
    signal=("model", "data"),  # relative: classes against classes of a model that gives a signal
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
    signal=("model", "data"),  # relative: classes against classes of a model that gives a signal
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,  # per-class counts: each rank its share of the batches, then sum
    doc="fail if the largest avg_bias over class pairs in `layer` — how differently the model places two "
        "classes relative to third classes — exceeds `threshold` (in [0, 0.5]; DeepInspect, Tian et al. 2020; "
        "docs: gates/inspection.md)",
)


#: The inspection family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("inspection", "Class confusion and bias (DeepInspect)", (MAX_CLASS_CONFUSION, MAX_CLASS_BIAS),
                plots={"type2_matrix": plot_type2_matrix}, order=90)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
