"""Built-in gate family: detection quality (``min_detection_map``, ``min_detection_recall``).

The metric is COCO's bounding-box mean average precision (Lin et al. 2014, "Microsoft COCO: Common
Objects in Context"; computed as pycocotools' ``COCOeval`` does, see
:mod:`pytest_dnnsafety.engines.detection.matching`) and per-class recall at a score threshold, per scenario
group (crowd regions and COCO's small/medium/large area ranges as ``COCOeval`` treats them: each group's mAP per
range is in the details, and ``area=`` gates one range): with ``by=`` the images are grouped by the values of
those conditions of the scenario table (every combination of their declared domains is a group; the worst group is
gated), which is the scenario-based performance degradation of Cheng et al. 2018, §II-E, for a detector.

The compared number is, by default, the worst group's *lower* bound of a bootstrap over images
(``statistic="bound"``; objects of one image are dependent, images are the independent units), read
by ``method="wide"``: the smaller of Efron's bias-corrected and accelerated (BCa) bootstrap bound and a
bias-extrapolated bound (the estimate less its small-sample bias, extrapolated from random half-subsets of
the images, less the bootstrap spread), read at a fifth of the error rate (99 % for a 95 % gate) as a
margin for the error of those estimates (:mod:`pytest_dnnsafety.engines.detection.bootstrap`).
Sample AP is biased upwards on finite samples — by as much as its standard error when high-scoring false
positives are common — and a plain percentile bound (``method="percentile"``) covered the population mAP
in only 47–87 % of samples on known-truth simulations with image-level difficulty; the coverage of each
method is measured on heterogeneous simulations (several detector behaviours, five classes, 60 and 300
images; the table is in docs/gates/detection.md, "How good is the bound"). It remains an approximation,
not an exact bound, and is labelled so (``bound_kind: "estimate"``). ``statistic="estimate"`` compares the point
estimate and says so. A bootstrap whose work exceeds a budget is refused before it starts, naming
``bootstrap=``; a long one shows a progress line. Groups with fewer than
``min_images`` images, or without images, make the gate inconclusive unless
``allow_small_groups=True`` leaves them out; a group whose images hold no ground-truth object has
no mAP or recall and always makes it inconclusive; nothing assessable at all is an error. The
detections come from the session's shared forward pass; each batch is matched at once and only
per-detection records are kept (:mod:`pytest_dnnsafety.engines.detection.quality`, which also reads the
worst group; the groups are :class:`~pytest_dnnsafety.scenarios.groups.ScenarioGroups`). No torch import at
module level.
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_map_groups
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import bootstrap_cost
from pytest_dnnsafety.gates.checks import in_range, one_of
from pytest_dnnsafety.gates.shared import merged, outputs_for, scenario_table

__all__ = ["MIN_DETECTION_MAP", "MIN_DETECTION_RECALL", "pytest_dnnsafety_register_gates"]

COCO_RANGE = "0.5:0.95"


def _measure(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """``min_detection_map``: the worst group's mAP; ``min_detection_recall``: the worst (group, class) recall at the
    score threshold (or the worst group's, per_class=False) — each its bootstrap lower bound, or its estimate with
    statistic='estimate'. The model and data are matched once per session from the shared forward pass
    (:meth:`GateContext.memo`: the mAP and recall gates on the same fixtures share one matching)."""
    from pytest_dnnsafety.engines.detection.quality import (QualityOptions, match_detections, match_plan, worst_map,
                                                            worst_recall)
    from pytest_dnnsafety.scenarios.groups import ScenarioGroups, by_names

    opts = spec.options
    thresholds, columns = match_plan(opts["iou"])
    by = by_names(opts)
    table = scenario_table(spec, fx) if by else None
    if by:  # unknown conditions and the group cap before the forward pass; the rows are checked after it
        ScenarioGroups.check(table, by)
    engine = ctx.memo("detection matching", (fx["model"], fx["data"]),
                      (thresholds, opts["max_detections"], ctx.batch_size, str(ctx.device)),
                      lambda: merged(spec, fx, ctx, lambda shard: match_detections(
                          outputs_for(spec, fx, ctx, shard=shard), thresholds, shard=shard, batch_size=ctx.batch_size,
                          max_detections=opts["max_detections"], marker=spec.marker, data=spec.fixtures["data"])))
    groups = ScenarioGroups.of(table, by, n_rows=engine.n_images, fixtures=spec.fixtures)
    reading = worst_map if spec.marker == "min_detection_map" else worst_recall
    return reading(engine, groups, columns, QualityOptions.of(opts, marker=spec.marker, seed=ctx.seed))


# ------------------------------------------------------------------------------------- marker keywords


def _by_check(value: Any) -> str | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        return f"{value!r} must be a condition name or a non-empty list of them"
    if len(set(names)) != len(names):
        return f"{value!r} names a condition twice"
    return None


def _iou_map(value: Any) -> str | None:
    if isinstance(value, str):
        if value.strip() == COCO_RANGE:
            return None
        try:
            value = float(value)
        except ValueError:
            return f"{value!r} is neither '0.5:0.95' nor a number"
    return None if 0 < value <= 1 else f"{value!r} is outside (0, 1]"


def _iou_single(value: Any) -> str | None:
    return None if 0 < value <= 1 else f"{value!r} is outside (0, 1]"


def _open_unit(value: Any) -> str | None:
    return None if 0 < value < 1 else f"{value!r} must lie strictly between 0 and 1"


_COMMON = (
    Param("by", (str, list, tuple, type(None)), None, _by_check,
          "name the scenario table's condition(s) to group the images by, e.g. by=\"lighting\" or by=[\"lighting\", "
          "\"weather\"]; leave it out to assess all images as one group"),
    Param("confidence", (float,), 0.95, _open_unit,
          "give the one-sided confidence of the bootstrap bound strictly between 0 and 1, e.g. 0.95"),
    Param("bootstrap", (int,), 1000, in_range(100, 10**6),
          "give the number of bootstrap replicates over images, at least 100, e.g. bootstrap=1000"),
    Param("statistic", (str,), "bound", one_of("bound", "estimate"),
          "use 'bound' (the bootstrap lower bound is compared) or 'estimate' (the point estimate is compared)"),
    Param("method", (str,), "wide", one_of("wide", "conservative", "bca", "extrapolated", "percentile"),
          "use 'wide' (the default: the smaller of the BCa and bias-extrapolated bounds, read at a fifth of the "
          "error rate), 'conservative' (that bound at the nominal rate), 'bca', 'extrapolated' or 'percentile' "
          "(undercovers mAP on small samples); the docs' detection page gives the coverage of each"),
    Param("min_images", (int,), 30, in_range(1, 10**9),
          "give the images a group needs to be assessed, a positive integer, e.g. min_images=30"),
    Param("allow_small_groups", (bool,), False, None,
          "True leaves groups below min_images (or without images) out of the gate instead of failing it"),
    Param("max_detections", (int,), 100, in_range(1, 10**6),
          "give the detections kept per image and class, by score (COCO: 100)"),
)
_FIXTURES = {"model": "model", "data": "dataset", "scenarios": "scenario_table"}

MIN_DETECTION_MAP = GateDef(
    marker="min_detection_map",
    metric="worst scenario group detection mAP",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(Param("iou", (str, float), COCO_RANGE, _iou_map,
                  "give iou='0.5:0.95' (COCO's mAP over ten IoU thresholds), '0.5' or a number in (0, 1]"),
            Param("area", (str,), "all", one_of("all", "small", "medium", "large"),
                  "give area='all' (every object), 'small' (area < 32²), 'medium' (32² to 96²) or 'large' (> 96²): "
                  "COCO's area ranges, by the annotation's area"),
            *_COMMON),
    fixtures=_FIXTURES,
    conditional={"scenarios": "by"},
    measure=_measure,
    cost=bootstrap_cost,
    tasks=("detection",),
    shards=True,
    outputs_only=True,  # reads the shared pass's outputs only: recorded detections can stand in for the model
    doc="fail unless every scenario group of `by` (or all images) has a COCO mAP (Lin et al. 2014) whose "
        "bootstrap lower bound over images at `confidence` (by `method`, default 'wide') reaches `threshold` (scenario-based degradation, Cheng "
        "et al. 2018, §II-E); small groups are inconclusive unless allowed",
)

MIN_DETECTION_RECALL = GateDef(
    marker="min_detection_recall",
    metric="worst scenario group detection recall",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(Param("score_threshold", (int, float), 0.5, in_range(0.0, 1.0),
                  "give the score a detection needs to count, in [0, 1], e.g. score_threshold=0.5"),
            Param("iou", (float,), 0.5, _iou_single, "give the IoU a match needs, a number in (0, 1], e.g. 0.5"),
            Param("per_class", (bool,), True, None,
                  "True gates the worst class of the worst group; False each group's recall over all classes"),
            *_COMMON),
    fixtures=_FIXTURES,
    conditional={"scenarios": "by"},
    measure=_measure,
    cost=bootstrap_cost,
    tasks=("detection",),
    shards=True,
    outputs_only=True,  # reads the shared pass's outputs only: recorded detections can stand in for the model
    doc="fail unless every scenario group of `by` (or all images) finds each class's objects (IoU ≥ `iou`, score "
        "≥ `score_threshold`) with a recall whose bootstrap lower bound (by `method`, default 'wide') reaches `threshold` (Cheng et al. 2018, "
        "§II-E)",
)


#: The detection family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("detection", "Detection quality", (MIN_DETECTION_MAP, MIN_DETECTION_RECALL),
                plots={"map_groups": plot_map_groups}, order=110)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
