"""Built-in gate family: occlusion interpretability (``min_interpretation_precision``,
``min_occlusion_sensitivity``, ``max_occlusion_sensitivity``).

Engine in :mod:`..engines.occlusion` (Cheng et al. 2018, §II-F/G, eq. 5): occlusion heat maps,
hot positions (probability of the original class below ``rho``) and occluding positions (the
occluder overlaps the object's segmentation mask). The gates read the ``model``, ``dataset`` and
``masks`` fixtures; ``masks`` loads ``dnnsafety_masks`` (:func:`..loading.load_masks`). Gates on the same
model, data, masks and occlusion options share one computation of the heat maps. No torch
import at module level.

M_OccSen is gated both ways: ``max_occlusion_sensitivity`` follows the paper (a high share of
the object whose occlusion breaks the prediction is fragility to partial occlusion), and
``min_occlusion_sensitivity`` asks that the object matter at all (a model that reads the
context keeps its prediction wherever the object is occluded, so its M_OccSen is near 0).

Detectors (``task='detection'``): per ground-truth object, the heat map is the object's matched score
(the best same-class detection with IoU ≥ ``iou``) on the occluded image, and the occluding positions
overlap the object's box (or its own mask when ``masks`` holds one ``(M, H, W)`` mask per object); see
:mod:`..engines.occlusion_detection`. An object the detector misses on the clean image counts with every
position hot (eq. 5: it lowers M_interpret and raises M_OccSen), and with M_OccSen 0 for
``min_occlusion_sensitivity``: a detector that finds nothing fails every occlusion gate. The masks
fixture is optional for detectors (the boxes stand in).

No signal, no pass: a classifier's gate is *inconclusive* when the model's probability of the original class is
below ``rho`` on every input before any occlusion (every position is hot: the value is the masks'
geometry), and ``min_interpretation_precision`` also when, under ``no_hot='one'``/``'zero'``, no input
has a hot position (every input scores the convention).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, one_of

__all__ = [
    "MIN_INTERPRETATION_PRECISION", "MIN_OCCLUSION_SENSITIVITY", "MAX_OCCLUSION_SENSITIVITY",
    "pytest_dnnsafety_register_gates",
]


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def _occlusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """The occlusion result of the gate's model, data, masks and options (shared between gates).

    Under torchrun each rank runs its shard of the data's batches (``ctx.shard``) and the
    engine's states are all-reduced, so every rank gets the single-process result.
    """
    from pytest_dnnsafety.engines.interpretability.occlusion import assess_occlusion

    o = spec.options
    if ctx.task == "detection":
        return _detector_occlusion(spec, fx, ctx)
    if "masks" not in fx:  # the role is optional for detectors (their boxes stand in); a classifier needs masks
        ctx.settings.require("masks", "the segmentation masks (fixture `masks`)")
    options = {"size": _pair(o["size"]), "stride": _pair(o["stride"]), "fill": o["fill"], "rho": float(o["rho"]),
               "target": o["target"], "no_hot": o["no_hot"], "empty_mask": o["empty_mask"],
               "outputs": o["outputs"], "max_batch": o["max_batch"]}
    return ctx.memo("occlusion", (fx["model"], fx["data"], fx["masks"]),
                    (tuple(options.items()), ctx.batch_size, ctx.device),
                    lambda: assess_occlusion(fx["model"], fx["data"], fx["masks"], batch_size=ctx.batch_size,
                                             device=ctx.device, shard=ctx.shard(fx["data"]), **options))


def _detector_occlusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """A detector's occlusion measurement per ground-truth object (shared between the gates)."""
    from pytest_dnnsafety.engines.interpretability.detector import assess_detector_occlusion

    o = spec.options
    if o["outputs"] != "auto":
        from pytest_dnnsafety.errors import ConfigError

        raise ConfigError(f"{spec.marker}: outputs={o['outputs']!r} is for classifiers; a detector's heat map is its "
                          "matched detection score (task='detection'). Fix: drop outputs= for a detector.")
    masks = fx.get("masks")
    options = {"size": _pair(o["size"]), "stride": _pair(o["stride"]), "fill": o["fill"], "rho": float(o["rho"]),
               "target": o["target"], "no_hot": o["no_hot"], "empty_mask": o["empty_mask"], "iou": float(o["iou"]),
               "max_batch": o["max_batch"]}
    return ctx.memo("occlusion (detection)", (fx["model"], fx["data"], masks),
                    (tuple(options.items()), ctx.batch_size, ctx.device),
                    lambda: assess_detector_occlusion(fx["model"], fx["data"], masks, batch_size=ctx.batch_size,
                                                      device=ctx.device, shard=ctx.shard(fx["data"]), **options))


def _setup(spec: GateSpec) -> str:
    o = spec.options
    h, w = _pair(o["size"])
    sh, sw = _pair(o["stride"])
    fill = o["fill"] if isinstance(o["fill"], str) else f"{o['fill']:g}"
    return f"occluder {h}x{w}, stride {sh}x{sw}, fill {fill}, ρ={o['rho']:g}, {o['target']} class"


def _detector_setup(spec: GateSpec, result: Any) -> str:
    o = spec.options
    h, w = _pair(o["size"])
    sh, sw = _pair(o["stride"])
    fill = o["fill"] if isinstance(o["fill"], str) else f"{o['fill']:g}"
    return (f"occluder {h}x{w}, stride {sh}x{sw}, fill {fill}, ρ={o['rho']:g}, per ground-truth object (matched "
            f"score, IoU ≥ {o['iou']:g}; occluding = {result.setup['occluding']}); {result.below_rho} of {result.n} "
            "objects missed on the clean image")


def _all_by_convention(spec: GateSpec, metric: str, result: Any) -> str | None:
    """Why the value is no measurement of the model (issue #19 §4: no signal is never a pass), else None.

    * every input's clean probability is already below ρ: every position is hot whatever is
      occluded, so M_interpret is the mask's share of the positions and M_OccSen is 1 — geometry,
      not the model;
    * M_interpret with ``no_hot='one'``/``'zero'`` when no input has a hot position (a model that
      ignores its input): every input counts as the convention's 1 or 0.
    """
    if result.n and result.below_rho >= result.n:
        return (f"the model's probability of the original class is below ρ={spec.options['rho']:g} on every one of "
                f"the {result.n} inputs before any occlusion, so every position is hot and M_{metric} reflects the "
                "masks' geometry, not the model (Cheng et al. 2018, eq. 5 assumes a confident detection). Fix: "
                "check the model (weights loaded? outputs=?) or lower rho=")
    rule = spec.options["no_hot"]
    if metric != "interpret" or rule == "skip" or result.n_interpret == 0 or result.no_hot < result.n_interpret:
        return None
    return (f"no occlusion changed the output on any of the {result.n_interpret} inputs (no hot position), so "
            f"M_interpret is no_hot={rule!r}'s convention for every input, not a measurement. Fix: check that the "
            "model reads its input; raise rho= or use a larger occluder (size=)")


def _measure(metric: str, label: str) -> Any:
    def measure(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
        result = _occlusion(spec, fx, ctx)
        if ctx.task == "detection":
            return _measure_detector(spec, metric, label, result)
        aggregate = spec.options["aggregate"]
        value = result.value(metric, aggregate)
        details = {**result.to_details(), "gated": f"M_{metric}", "aggregate": aggregate}
        return Measurement(value=value, detail=f"{_setup(spec)}: {label} {aggregate} {value:.3f}; {result.detail()}",
                           details=details, inconclusive=_all_by_convention(spec, metric, result))

    measure.__doc__ = f"{label} (Cheng et al. 2018, §II-F/G, eq. 5) aggregated over the inputs."
    return measure


def _measure_detector(spec: GateSpec, metric: str, label: str, both: Any) -> Measurement:
    """A detector's value: eq. (5) per object; ``min_occlusion_sensitivity`` reads missed objects as M_OccSen 0.

    Never inconclusive for missing every object (that is the detector's failure, measured); inconclusive only
    under ``no_hot='one'``/``'zero'`` when no object has a hot position (the convention, not the detector)."""
    result = both.strict if spec.marker == "min_occlusion_sensitivity" else both.result
    aggregate = spec.options["aggregate"]
    value = result.value(metric, aggregate)
    details = {**result.to_details(), "gated": f"M_{metric}", "aggregate": aggregate,
               "missed_objects": int(result.below_rho)}
    why = None
    if result.below_rho < result.n:  # every object missed: measured (every gate fails), not a convention
        why = _all_by_convention(spec, metric, result)
    setup = _detector_setup(spec, result)
    return Measurement(value=value, detail=f"{setup}: {label} {aggregate} {value:.3f}; {result.detail()}",
                       details=details, inconclusive=why)


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


def _params(aggregates: tuple[str, ...]) -> tuple[Param, ...]:
    return (
        Param("size", (int, list, tuple), REQUIRED, _pixels,
              "give the occluder's side in pixels, e.g. size=3, or (h, w), e.g. size=(2, 4); at most the image size"),
        Param("stride", (int, list, tuple), 1, _pixels,
              "give the step between occluder positions in pixels, e.g. stride=1 (a dense map) or stride=(2, 2)"),
        Param("fill", (int, float, str), 0.0, _fill,
              "give the occluded pixels' value (a number, e.g. fill=0.0) or fill='mean' (each image's channel mean)"),
        Param("rho", (int, float), 0.5, _rho,
              "give the probability below which a position is hot, strictly between 0 and 1, e.g. rho=0.5"),
        Param("aggregate", (str,), "mean", one_of(*aggregates),
              f"aggregate the per-input values by {' or '.join(map(repr, aggregates))}"),
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
              "give the most occluded images per forward pass, e.g. max_batch=4096"),
        Param("iou", (int, float), 0.5, _iou,
              "give the IoU (detectors only) a detection needs with an object's box to count as its match, in "
              "(0, 1], e.g. iou=0.5"),
    )


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
    params=_params(("mean", "min")),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    measure=_measure("interpret", "M_interpret"),
    doc="fail unless the share of hot occlusion positions (probability of the original class below rho) that "
        "overlap the object's mask reaches `threshold` (M_interpret, Cheng et al. 2018, eq. 5)",
)

MIN_OCCLUSION_SENSITIVITY = GateDef(
    marker="min_occlusion_sensitivity",
    metric="occlusion sensitivity",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=_params(("mean", "min")),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    measure=_measure("occsen", "M_OccSen"),
    doc="fail unless at least `threshold` of the occlusion positions on the object are hot: the object "
        "matters to the prediction (M_OccSen, Cheng et al. 2018, §II-G)",
)

MAX_OCCLUSION_SENSITIVITY = GateDef(
    marker="max_occlusion_sensitivity",
    metric="occlusion sensitivity",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=_params(("mean", "max")),
    fixtures=_FIXTURES,
    optional=_OPTIONAL,
    tasks=_TASKS,
    shards=True,  # each rank its share of the batches; counts, minima, maxima and per-input values all-reduced
    measure=_measure("occsen", "M_OccSen"),
    doc="fail if more than `threshold` of the occlusion positions on the object are hot: the prediction "
        "breaks under small partial occlusions (M_OccSen, Cheng et al. 2018, §II-G)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MIN_INTERPRETATION_PRECISION)
    registry.add(MIN_OCCLUSION_SENSITIVITY)
    registry.add(MAX_OCCLUSION_SENSITIVITY)
