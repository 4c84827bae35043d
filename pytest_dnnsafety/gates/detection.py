"""Built-in gate family: detection quality (``min_detection_map``, ``min_detection_recall``).

The metric is COCO's bounding-box mean average precision (Lin et al. 2014, "Microsoft COCO: Common
Objects in Context"; computed as pycocotools' ``COCOeval`` does, see
:mod:`pytest_dnnsafety.engines.detection.matching`) and per-class recall at a score threshold, per scenario
group: with ``by=`` the images are grouped by the values of those conditions of the scenario table
(every combination of their declared domains is a group; the worst group is gated), which is the
scenario-based performance degradation of Cheng et al. 2018, §II-E, for a detector.

The compared number is, by default, the worst group's *lower* bound of a percentile bootstrap over
images (``statistic="bound"``; objects of one image are dependent, images are the independent
units); ``statistic="estimate"`` compares the point estimate and says so. A bootstrap interval is an
estimate of the sampling uncertainty, not a guaranteed-coverage bound. Groups with fewer than
``min_images`` images, or without images, make the gate inconclusive unless
``allow_small_groups=True`` leaves them out; a group whose images hold no ground-truth object has
no mAP or recall and always makes it inconclusive; nothing assessable at all is an error. The
model is run batch by batch (:class:`~pytest_dnnsafety.engines.core.runner.Runner`); each batch is
matched at once and only per-detection records are kept. No torch import at module level.
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, one_of

__all__ = ["MIN_DETECTION_MAP", "MIN_DETECTION_RECALL", "pytest_dnnsafety_register_gates"]

COCO_RANGE = "0.5:0.95"


def _iou(iou: Any) -> float | None:
    """The IoU threshold of ``iou=`` (None for COCO's ten)."""
    if isinstance(iou, str) and iou.strip() == COCO_RANGE:
        return None
    return float(iou)


def _by(opts: Mapping[str, Any]) -> list[str]:
    by = opts["by"]
    return [] if by is None else [by] if isinstance(by, str) else list(by)


def _records(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, iou: float | None) -> tuple[Any, list[int]]:
    """The filled BoxMatchEngine and the columns of ``iou`` (None: COCO's ten) in its thresholds.

    Matched at COCO's ten thresholds whenever ``iou`` is one of them, once per session for a model and
    data set (:meth:`GateContext.memo`): the mAP and recall gates on the same fixtures share one matching, and
    the detections come from the session's shared forward pass.
    """
    from pytest_dnnsafety.engines.detection.matching import COCO_IOU_THRESHOLDS

    coco = COCO_IOU_THRESHOLDS.tolist()
    if iou is None:
        thresholds, columns = None, list(range(len(coco)))
    else:
        near = [i for i, t in enumerate(coco) if abs(t - iou) < 1e-9]
        thresholds, columns = (None, near[:1]) if near else ((iou,), [0])
    opts = spec.options
    engine = ctx.memo("detection matching", (fx["model"], fx["data"]),
                      (thresholds, opts["max_detections"], ctx.batch_size, str(ctx.device)),
                      lambda: _match_all(spec, fx, ctx, thresholds))
    return engine, columns


def _match_all(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, thresholds: Any) -> Any:
    """Match the detections of the session's shared forward pass (every gate reading this model and data — the
    neuron gates, the monitors — shares that one pass), ``ctx.batch_size`` images at a time."""
    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.detection.matching import COCO_IOU_THRESHOLDS, BoxMatchEngine
    from pytest_dnnsafety.data.tasks import BoxSet
    from pytest_dnnsafety.gates.shared import outputs_for

    shard = ctx.shard(fx["data"])  # None: the whole data on every rank

    def match() -> Any:
        out = outputs_for(spec, fx, ctx, shard=shard)
        if out.detections is None:
            raise MetricError(f"{spec.marker}: the model returned class scores, not detections, but the task is "
                              "'detection'. Fix: give a detector that returns one dict of boxes, scores and labels per "
                              "image (torchvision's format)")
        if not isinstance(out.labels, BoxSet):
            raise DataError(f"{spec.marker}: the data (fixture {spec.fixtures['data']!r}) has no boxes. Fix: give "
                            "detection data, an .npz with x, boxes, labels and offsets (or a DataLoader with "
                            "collate_fn=pytest_dnnsafety.detection_collate)")
        engine = BoxMatchEngine(COCO_IOU_THRESHOLDS if thresholds is None else list(thresholds),
                                max_detections=spec.options["max_detections"])
        first = 0 if shard is None else shard.rows[0]  # the global row of this rank's first image
        n = out.labels.n_images
        for start in range(0, n, ctx.batch_size):
            stop = min(start + ctx.batch_size, n)
            engine.update(out.detections.images(start, stop), out.labels.images(start, stop), first + start)
        return engine

    return ranks.merged(match, shard)  # under torchrun: each rank's records, all-gathered


def _groups(spec: GateSpec, fx: Mapping[str, Any], n_images: int) -> list[tuple[str, Any, bool]]:
    """``(label, image mask, feasible)`` per group of ``by`` (one group ``all`` without ``by``)."""
    import torch

    by = _by(spec.options)
    if not by:
        return [("all", torch.ones(n_images, dtype=torch.bool), True)]
    from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine, resolve_by
    from pytest_dnnsafety.scenarios import ScenarioTable, check_rows_match

    table = fx["scenarios"]
    if not isinstance(table, ScenarioTable):
        raise MetricError(f"fixture {spec.fixtures['scenarios']!r} returned {type(table).__name__}, not a "
                          "ScenarioTable. Fix: return pytest_dnnsafety.ScenarioTable(Conditions(...), rows)")
    resolve_by(table, by)
    check_rows_match(table, n_images, table_fixture=spec.fixtures["scenarios"], data_fixture=spec.fixtures["data"])
    grouping = ScenarioPerformanceEngine.from_table(table, by)
    index = grouping.group_index(table).cpu()
    out = []
    for g in range(grouping.n_groups):
        values = (d[(g // s) % len(d)] for d, s in zip(grouping.domains, grouping.strides))
        label = " × ".join(f"{name}={value}" for name, value in zip(by, values))
        out.append((label, index == g, bool(grouping.feasible[g])))
    return out


def _sort_groups(spec: GateSpec, fx: Mapping[str, Any], engine: Any) -> tuple[list[Any], list[str], list[str]]:
    """(assessable groups, problems, small-group labels) — see the module docstring for the rules."""
    opts = spec.options
    _score, _label, _image, _m, gimage, _gl = engine.records()
    objects = gimage.cpu()
    assessable, small, no_gt = [], [], []
    for label, mask, feasible in _groups(spec, fx, engine.n_images):
        n = int(mask.sum())
        if n == 0 and not feasible:
            continue
        if n < opts["min_images"]:
            small.append(f"{label} ({n} images)")
        elif not bool(mask[objects].any()):
            no_gt.append(label)
        else:
            assessable.append((label, mask))
    problems = []
    if small and not opts["allow_small_groups"]:
        problems.append(f"{len(small)} group(s) have fewer than min_images={opts['min_images']} images: "
                        + ", ".join(small[:10]) + (", …" if len(small) > 10 else "")
                        + ". Fix: add evaluation images for them, or accept them with allow_small_groups=True "
                          "(they are then left out of the gated value)")
    if no_gt:
        problems.append(f"{len(no_gt)} group(s) hold no ground-truth object, so their "
                        f"{'mAP' if spec.marker == 'min_detection_map' else 'recall'} is undefined: "
                        + ", ".join(no_gt[:10]) + ". Fix: add annotated images with objects for them")
    if not assessable:
        raise MetricError(f"{spec.marker}: no group of by={_by(opts) or None} has min_images={opts['min_images']} "
                          "images with at least one ground-truth object; nothing to assess"
                          + ("; " + "; ".join(problems) if problems else "")
                          + ". Fix: add annotated evaluation images or lower min_images")
    return assessable, problems, small


def _generator(ctx: GateContext, g: int) -> Any:
    import torch

    return torch.Generator().manual_seed((int(ctx.seed) * 1_000_003 + g) % (2**63))


def _bound_text(opts: Mapping[str, Any], lower: float) -> str:
    """How the compared number was read: the bootstrap bound, or the estimate (statistic='estimate')."""
    bound = f"{opts['confidence']:.0%} bootstrap lower bound {lower:.3f}"
    if opts["statistic"] == "bound":
        return bound
    return f"the estimate is compared (statistic='estimate'); {bound}, not compared"


def _measure_map(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The worst group's mAP: its bootstrap lower bound (or its estimate, with statistic='estimate')."""
    opts = spec.options
    engine, columns = _records(spec, fx, ctx, _iou(opts["iou"]))
    groups, problems, small = _sort_groups(spec, fx, engine)
    rows = []
    for g, (label, mask) in enumerate(groups):
        res = engine.evaluate(mask, bootstrap=opts["bootstrap"], confidence=opts["confidence"],
                              generator=_generator(ctx, g), columns=columns)
        rows.append({"group": label, "map": res.map, "map50": res.map50, "lower": res.lower, "upper": res.upper,
                     "images": res.images, "objects": res.objects, "detections": res.detections,
                     "class_ap": {str(c): v for c, v in res.class_ap().items()}})
    key = "lower" if opts["statistic"] == "bound" else "map"
    worst = min(rows, key=lambda r: (r[key], r["map"]))
    iou = "@[.5:.95]" if _iou(opts["iou"]) is None else f"@{float(opts['iou']):g}"
    detail = (f"worst group {worst['group']}: mAP{iou} {worst['map']:.3f}, {_bound_text(opts, worst['lower'])} "
              f"({worst['images']} images, {worst['objects']} objects, {opts['bootstrap']} replicates); "
              f"{len(rows)} group(s) assessed")
    details = {"iou": str(opts["iou"]), "statistic": opts["statistic"], "confidence": opts["confidence"],
               "bootstrap": opts["bootstrap"], "bound": "percentile bootstrap over images (an estimate, not exact)",
               "bound_kind": "estimate",
               "by": _by(opts), "max_detections": opts["max_detections"], "min_images": opts["min_images"],
               "worst_group": worst["group"], "small_groups": small, "map_groups": rows}
    bound = worst["lower"] if key == "lower" else None
    return Measurement(value=worst["map"], bound=bound, detail=detail, details=details,
                       inconclusive="; ".join(problems) or None)


def _measure_recall(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The worst (group, class) recall at the score threshold — or the worst group's, per_class=False."""
    opts = spec.options
    engine, columns = _records(spec, fx, ctx, float(opts["iou"]))
    groups, problems, small = _sort_groups(spec, fx, engine)
    rows, candidates = [], []
    for g, (label, mask) in enumerate(groups):
        res = engine.recall(mask, score_threshold=float(opts["score_threshold"]), threshold_index=columns[0],
                            bootstrap=opts["bootstrap"], confidence=opts["confidence"], generator=_generator(ctx, g))
        classes = [{"class": c, "recall": float(res.recall[i]), "lower": float(res.lower[i]),
                    "objects": res.class_objects[i]} for i, c in enumerate(res.classes)]
        rows.append({"group": label, "recall": res.overall, "lower": res.overall_lower, "images": res.images,
                     "objects": res.objects, "classes": classes})
        if opts["per_class"]:
            candidates += [(label, f"class {c['class']}", c) for c in classes]
        else:
            candidates.append((label, "all classes", rows[-1]))
    key = "lower" if opts["statistic"] == "bound" else "recall"
    label, what, worst = min(candidates, key=lambda t: (t[2][key], t[2]["recall"]))
    detail = (f"worst {label}, {what}: recall {worst['recall']:.3f} at score ≥ {opts['score_threshold']:g}, IoU ≥ "
              f"{float(opts['iou']):g}, {_bound_text(opts, worst['lower'])} ({worst['objects']} objects, "
              f"{opts['bootstrap']} replicates); {len(rows)} group(s) assessed")
    details = {"iou": float(opts["iou"]), "score_threshold": opts["score_threshold"], "per_class": opts["per_class"],
               "statistic": opts["statistic"], "confidence": opts["confidence"], "bootstrap": opts["bootstrap"],
               "bound": "percentile bootstrap over images (an estimate, not exact)", "bound_kind": "estimate",
               "by": _by(opts), "worst_group": label, "worst_class": what, "small_groups": small, "recall_groups": rows}
    bound = worst["lower"] if key == "lower" else None
    return Measurement(value=worst["recall"], bound=bound, detail=detail, details=details,
                       inconclusive="; ".join(problems) or None)


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
            *_COMMON),
    fixtures=_FIXTURES,
    conditional={"scenarios": "by"},
    measure=_measure_map,
    tasks=("detection",),
    shards=True,
    doc="fail unless every scenario group of `by` (or all images) has a COCO mAP (Lin et al. 2014) whose "
        "bootstrap lower bound over images at `confidence` reaches `threshold` (scenario-based degradation, Cheng "
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
    measure=_measure_recall,
    tasks=("detection",),
    shards=True,
    doc="fail unless every scenario group of `by` (or all images) finds each class's objects (IoU ≥ `iou`, score "
        "≥ `score_threshold`) with a recall whose bootstrap lower bound reaches `threshold` (Cheng et al. 2018, "
        "§II-E)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MIN_DETECTION_MAP)
    registry.add(MIN_DETECTION_RECALL)
