"""Built-in gate family: occlusion interpretability (``min_interpretation_precision``,
``min_occlusion_sensitivity``, ``max_occlusion_sensitivity``).

Engine in :mod:`pytest_dnnsafety.engines.interpretability.occlusion` (Cheng et al. 2018, §II-F/G, eq. 5):
occlusion heat maps, hot positions (probability of the original class below ``rho``) and occluding positions
(the occluder overlaps the object's segmentation mask). The gates read the ``model``, ``dataset`` and
``masks`` fixtures; ``masks`` loads ``dnnsafety_masks`` (:func:`pytest_dnnsafety.plugin.fixtures.load_masks`).
Gates on the same model, data, masks and occlusion options share one computation of the heat maps; what that
computation is per task, and how its value is worded, is the engine's
:class:`~pytest_dnnsafety.engines.interpretability.plan.OcclusionPlan`. No torch import at module level.

M_OccSen is gated both ways: ``max_occlusion_sensitivity`` follows the paper (a high share of
the object whose occlusion breaks the prediction is fragility to partial occlusion), and
``min_occlusion_sensitivity`` asks that the object matter at all (a model that reads the
context keeps its prediction wherever the object is occluded, so its M_OccSen is near 0).

Detectors (``task='detection'``): per ground-truth object, the heat map is the object's matched score
(the best same-class detection with IoU ≥ ``iou``) on the occluded image, and the occluding positions
overlap the object's box (or its own mask when ``masks`` holds one ``(M, H, W)`` mask per object); see
:mod:`pytest_dnnsafety.engines.interpretability.detector`. An object the detector misses on the clean image
counts with every position hot (eq. 5: it lowers M_interpret and raises M_OccSen), and with M_OccSen 0 for
``min_occlusion_sensitivity``. The masks fixture is optional for detectors (the boxes stand in).

No signal, no pass: the gates are relative (``GateDef.signal``): a classifier not shown better than chance, or a
detector without a detection scoring 0.5, makes them inconclusive before anything is occluded
(:mod:`pytest_dnnsafety.engines.core.signal`). A gate is also *inconclusive* when the model's probability of the
original class (a detector's matched score) is below ``rho`` on every input (object) before any occlusion (every
position is hot: the value is the masks' or boxes' geometry), and ``min_interpretation_precision`` also when, under
``no_hot='one'``/``'zero'``, no input has a hot position (every input scores the convention).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import occlusion_cost
from pytest_dnnsafety.gates.checks import in_range, one_of

__all__ = [
    "MIN_INTERPRETATION_PRECISION", "MIN_OCCLUSION_SENSITIVITY", "MAX_OCCLUSION_SENSITIVITY",
    "pytest_dnnsafety_register_gates",
]


def _measure_occlusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """M_interpret or M_OccSen (Cheng et al. 2018, §II-F/G, eq. 5; :data:`_READS`) aggregated over the inputs (a
    detector's: over its ground-truth objects), from the run the gates on the same model, data and masks share.

    Under torchrun each rank runs its shard of the data's batches (``ctx.shard``) and the engine's states are
    all-reduced, so every rank gets the single-process result.
    """
    from pytest_dnnsafety.engines.interpretability.plan import OcclusionPlan

    plan = OcclusionPlan.for_task(ctx.task, spec.marker, spec.options)
    if plan.needs_masks and "masks" not in fx:  # optional for detectors (their boxes stand in), not classifiers
        ctx.settings.require("masks", "the segmentation masks (fixture `masks`)")
    model, data, masks = fx["model"], fx["data"], fx.get("masks")
    result = ctx.memo(plan.memo_name, (model, data, masks), plan.key(ctx.batch_size, ctx.device),
                      lambda: plan.assess(model, data, masks, batch_size=ctx.batch_size, device=ctx.device,
                                          shard=ctx.shard(data)))
    return Measurement(**plan.report(result, *_READS[spec.marker]))


# ------------------------------------------------------------------------------------- marker keywords


def _pixels(value: Any) -> str | None:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and len(items) != 2:
        return f"{value!r} must be an int or a pair (h, w)"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items):
        return f"{value!r} must hold positive integers (pixels)"
    return None


def _fill(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value == "mean" else f"{value!r} is neither a number nor 'mean'"
    return None if math.isfinite(value) else f"{value!r} is not finite"


def _rho(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value < 1 else f"{value!r} is outside (0, 1)"


def _iou(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value <= 1 else f"{value!r} is outside (0, 1]"


#: the occluder and the hot threshold (before ``aggregate``, whose choices depend on the gate's direction)
_OCCLUDER = (
    Param("size", (int, list, tuple), REQUIRED, _pixels,
          "give the occluder's side in pixels, e.g. size=3, or (h, w), e.g. size=(2, 4); at most the image size"),
    Param("stride", (int, list, tuple), 1, _pixels,
          "give the step between occluder positions in pixels, e.g. stride=1 (a dense map) or stride=(2, 2)"),
    Param("fill", (int, float, str), 0.0, _fill,
          "give the occluded pixels' value (a number, e.g. fill=0.0) or fill='mean' (each image's channel mean)"),
    Param("rho", (int, float), 0.5, _rho,
          "give the probability below which a position is hot, strictly between 0 and 1, e.g. rho=0.5"),
)
_MIN_AGGREGATE = Param("aggregate", (str,), "mean", one_of("mean", "min"),
                       "aggregate the per-input values by 'mean' or 'min'")
_MAX_AGGREGATE = Param("aggregate", (str,), "mean", one_of("mean", "max"),
                       "aggregate the per-input values by 'mean' or 'max'")
#: the original class, the empty cases, the outputs, the chunking and (detectors) the matching IoU
_RULES = (
    Param("target", (str,), "predicted", one_of("predicted", "label"),
          "'predicted' (the class the model predicts on the clean image, the paper's original class) or "
          "'label' (the true label)"),
    Param("no_hot", (str,), "skip", one_of("skip", "one", "zero"),
          "say how an input without hot positions counts for M_interpret (0/0): 'skip' (left out), 'one' or "
          "'zero'"),
    Param("empty_mask", (str,), "error", one_of("error", "skip"),
          "say what an empty mask (no occluding position) does: 'error' or 'skip' (left out)"),
    Param("outputs", (str,), "auto", one_of("auto", "logits", "probabilities"),
          "say what the model returns: auto (detected), logits or probabilities"),
    Param("max_batch", (int,), 4096, in_range(1, 10**7),
          "give a cap on the occluded images per forward pass (below it the working-memory budget, "
          "dnnsafety_max_memory, sizes each forward), e.g. max_batch=256"),
    Param("iou", (int, float), 0.5, _iou,
          "give the IoU (detectors only) a detection needs with an object's box to count as its match, in "
          "(0, 1], e.g. iou=0.5"),
)
#: what each gate reads: the metric of eq. (5) and whether a detector's missed objects count as M_OccSen 0
#: (``min_occlusion_sensitivity`` asks that the object matter to its detection; a missed object has none)
_READS = {"min_interpretation_precision": ("interpret", False), "min_occlusion_sensitivity": ("occsen", True),
          "max_occlusion_sensitivity": ("occsen", False)}

_FIXTURES = {"model": "model", "data": "dataset", "masks": "masks"}
#: the masks are optional for detectors (their ground-truth boxes stand in); a classifier without them is the
#: setting's error (raised in the measurement)
_OPTIONAL = {"masks": "masks"}
_TASKS = ("single-label", "detection")

MIN_INTERPRETATION_PRECISION = GateDef(
    marker="min_interpretation_precision",
    metric="interpretation precision",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(*_OCCLUDER, _MIN_AGGREGATE, *_RULES),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    signal=("model", "data"),  # relative: occluded against clean outputs of a model that gives a signal
    measure=_measure_occlusion,
    cost=occlusion_cost,
    doc="fail unless the share of hot occlusion positions (probability of the original class below rho) that "
        "overlap the object's mask reaches `threshold` (M_interpret, Cheng et al. 2018, eq. 5)",
)

MIN_OCCLUSION_SENSITIVITY = GateDef(
    marker="min_occlusion_sensitivity",
    metric="occlusion sensitivity",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(*_OCCLUDER, _MIN_AGGREGATE, *_RULES),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    signal=("model", "data"),  # relative: occluded against clean outputs of a model that gives a signal
    measure=_measure_occlusion,
    cost=occlusion_cost,
    doc="fail unless at least `threshold` of the occlusion positions on the object are hot: the object "
        "matters to the prediction (M_OccSen, Cheng et al. 2018, §II-G)",
)

MAX_OCCLUSION_SENSITIVITY = GateDef(
    marker="max_occlusion_sensitivity",
    metric="occlusion sensitivity",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(*_OCCLUDER, _MAX_AGGREGATE, *_RULES),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    signal=("model", "data"),  # relative: occluded against clean outputs of a model that gives a signal
    measure=_measure_occlusion,
    cost=occlusion_cost,
    doc="fail if more than `threshold` of the occlusion positions on the object are hot: the prediction "
        "breaks under small partial occlusions (M_OccSen, Cheng et al. 2018, §II-G)",
)


#: The interpretability family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("interpretability", "Occlusion and interpretation",
                (MIN_INTERPRETATION_PRECISION, MIN_OCCLUSION_SENSITIVITY, MAX_OCCLUSION_SENSITIVITY), order=70)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
