"""Known-truth detection populations for measuring the coverage of the detection gates' bootstrap bounds.

A population is ``n`` synthetic images with *image-level difficulty*: each image draws a latent hardness
``h`` (most images easy, a tail of hard ones, as night or fog), and in a hard image all of its objects get
harder together — lower detection probability, worse localisation (larger box jitter, so lower IoU), lower
scores — and more false positives appear. Detector behaviours (:data:`SCENARIOS`):

* ``good`` — finds most objects with tight boxes, few false positives;
* ``mediocre`` — misses more, looser boxes, scores that separate hits from false positives less well;
* ``overconfident`` — many false positives with *high* scores (they outrank true detections);
* ``imbalanced`` — class frequencies 55/25/12/6/2 %, and the rare classes found less well.

The population's truth is :class:`~pytest_dnnsafety.engines.detection.matching.BoxMatchEngine`'s mAP and
recall over all its images (the engine equals pycocotools to 1e-15, tests/families/detection); a sample is
``n`` images drawn without replacement, and the question is whether a sample's lower bound lies at or below
the population value. :func:`coverage_run` draws the samples and returns, per statistic and bound method,
how many of them covered. Used by ``benchmarks/detection_bound_coverage.py`` (the docs' table) and by
``test_detection_bound_coverage.py`` (a reduced run in CI).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from scipy import stats

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.detection.bootstrap import BOUND_METHODS, bootstrap_lower
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine


@dataclass(frozen=True)
class Scenario:
    """A detector's behaviour on a population with image-level difficulty (see the module docstring)."""

    name: str
    class_share: tuple[float, ...] = (0.3, 0.25, 0.2, 0.15, 0.1)
    class_skill: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)  # multiplies the detection probability
    detect: float = 0.9  # detection probability of an object in an easy image
    hard_drop: float = 0.6  # detection probability lost at hardness 1
    jitter: float = 0.06  # box jitter (share of the box size) in an easy image
    hard_jitter: float = 0.18  # extra jitter at hardness 1
    fp_rate: float = 0.5  # false positives per easy image (Poisson)
    hard_fp: float = 2.0  # extra false positives per image at hardness 1
    hit_score: tuple[float, float] = (2.0, 1.0)  # logit mean and sd of a true detection's score
    fp_score: tuple[float, float] = (-1.0, 1.2)  # logit mean and sd of a false positive's score
    hard_score: float = 1.5  # logit lost at hardness 1
    objects: float = 2.0  # objects per image: 1 + Poisson(objects)


SCENARIOS = {
    "good": Scenario("good"),
    "mediocre": Scenario("mediocre", detect=0.75, hard_drop=0.5, jitter=0.1, hard_jitter=0.25, fp_rate=1.0,
                         hit_score=(1.0, 1.2), fp_score=(-0.5, 1.2)),
    "overconfident": Scenario("overconfident", fp_rate=1.5, hard_fp=3.0, fp_score=(1.5, 1.0)),
    "imbalanced": Scenario("imbalanced", class_share=(0.55, 0.25, 0.12, 0.06, 0.02),
                           class_skill=(1.0, 0.95, 0.85, 0.75, 0.65)),
}


def population(scenario: Scenario, n_images: int, seed: int) -> BoxMatchEngine:
    """``n_images`` images of ``scenario`` matched at COCO's ten IoU thresholds (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    s = scenario
    K = len(s.class_share)
    hard = torch.rand(n_images, generator=g) ** 3  # latent hardness: most images easy, a tail of hard ones
    n_obj = 1 + torch.poisson(torch.full((n_images,), s.objects), generator=g).long()
    image = torch.repeat_interleave(torch.arange(n_images), n_obj)
    m = image.numel()
    h = hard[image]
    labels = torch.multinomial(torch.tensor(s.class_share), m, replacement=True, generator=g)
    size = 20 + 80 * torch.rand(m, 2, generator=g)
    xy = torch.rand(m, 2, generator=g) * 400
    boxes = torch.cat([xy, xy + size], 1)
    p = (s.detect - s.hard_drop * h).clamp(0.02, 1) * torch.tensor(s.class_skill)[labels]
    found = torch.rand(m, generator=g) < p
    scale = (s.jitter + s.hard_jitter * h)[:, None] * size.repeat(1, 2)
    det_boxes = boxes + scale * torch.randn(m, 4, generator=g)
    det_boxes = torch.cat([det_boxes[:, :2], torch.maximum(det_boxes[:, 2:], det_boxes[:, :2] + 1)], 1)
    hit_logit = s.hit_score[0] - s.hard_score * h + s.hit_score[1] * torch.randn(m, generator=g)
    n_fp = torch.poisson(s.fp_rate + s.hard_fp * hard, generator=g).long()
    fp_image = torch.repeat_interleave(torch.arange(n_images), n_fp)
    f = fp_image.numel()
    fp_xy = torch.rand(f, 2, generator=g) * 400
    fp_boxes = torch.cat([fp_xy, fp_xy + 20 + 80 * torch.rand(f, 2, generator=g)], 1)
    fp_labels = torch.multinomial(torch.tensor(s.class_share), f, replacement=True, generator=g)
    fp_logit = s.fp_score[0] + s.hard_score * 0.5 * hard[fp_image] + s.fp_score[1] * torch.randn(f, generator=g)
    d_img = torch.cat([image[found], fp_image])
    order = torch.sort(d_img, stable=True).indices
    dets = BoxSet(torch.cat([det_boxes[found], fp_boxes])[order], torch.cat([labels[found], fp_labels])[order],
                  d_img[order], n_images, torch.sigmoid(torch.cat([hit_logit[found], fp_logit]))[order])
    targets = BoxSet(boxes, labels, image, n_images)
    engine = BoxMatchEngine()
    for start in range(0, n_images, 2000):
        stop = min(start + 2000, n_images)
        engine.update(dets.images(start, stop), targets.images(start, stop), start)
    return engine


#: The statistics whose bounds are measured: mAP@0.5, mAP@[.5:.95], recall (score ≥ 0.5, IoU ≥ 0.5) of
#: every class (coverage reported for the worst-covered class, and for the minimum over classes against the
#: minimum of the classes' truths, which is what the gate reads) and over all objects.
STATISTICS = ("mAP@0.5", "mAP@[.5:.95]", "recall, one class (rarest)", "recall, worst-covered class",
              "recall, min over classes",
              "recall, all objects")


def truth(engine: BoxMatchEngine) -> dict[str, object]:
    """The population values of :data:`STATISTICS`."""
    rec = engine.recall(score_threshold=0.5)
    return {"mAP@0.5": engine.evaluate(columns=[0]).map, "mAP@[.5:.95]": engine.evaluate().map,
            "class recall": rec.recall.clone(), "recall, all objects": rec.overall}


@dataclass
class Coverage:
    """Covered samples per (statistic, method) over ``samples`` samples, and the estimates' mean (bias)."""

    samples: int = 0
    covered: dict[tuple[str, str], int] = field(default_factory=dict)
    estimate_sum: dict[str, float] = field(default_factory=dict)
    trials: dict[tuple[str, str], int] = field(default_factory=dict)  # per class: the samples holding it

    def count(self, statistic: str, method: str) -> tuple[int, int]:
        """(covered, samples) of a statistic; a class absent from a sample has no bound there."""
        key = (statistic, method)
        return self.covered[key], self.trials.get(key, self.samples)

    def add(self, statistic: str, method: str, ok: bool) -> None:
        self.covered[(statistic, method)] = self.covered.get((statistic, method), 0) + int(ok)

    def rate(self, statistic: str, method: str) -> float:
        k, n = self.count(statistic, method)
        return k / n

    def interval(self, statistic: str, method: str, level: float = 0.95) -> tuple[float, float]:
        """The Clopper–Pearson interval of the coverage."""
        k, n = self.count(statistic, method)
        lo = 0.0 if k == 0 else float(stats.beta.ppf((1 - level) / 2, k, n - k + 1))
        hi = 1.0 if k == n else float(stats.beta.ppf(1 - (1 - level) / 2, k + 1, n - k))
        return lo, hi


def _lows(replicates, estimate, confidence, methods, jackknife, halves):
    return {m: bootstrap_lower(replicates, estimate, confidence, m, jackknife, halves) for m in methods}


def coverage_run(engine: BoxMatchEngine, values: dict[str, object], n: int, samples: int, *, bootstrap: int = 1000,
                 confidence: float = 0.95, seed: int = 0, methods: tuple[str, ...] = BOUND_METHODS,
                 statistics: tuple[str, ...] = STATISTICS) -> Coverage:
    """``samples`` samples of ``n`` images of the population ``engine`` (truth ``values``): how many of each
    statistic's lower bounds (one bootstrap per sample, read by every method) lie at or below the truth."""
    picker = torch.Generator().manual_seed(10_000 + seed)
    out = Coverage()
    class_truth = values["class recall"]
    for s in range(samples):
        sample = torch.randperm(engine.n_images, generator=picker)[:n]
        gen_seed = seed * 100_003 + s
        out.samples += 1
        for stat, cols in (("mAP@0.5", [0]), ("mAP@[.5:.95]", None)):
            if stat not in statistics:
                continue
            res = engine.evaluate(sample, bootstrap=bootstrap, confidence=confidence, columns=cols,
                                  generator=torch.Generator().manual_seed(gen_seed))
            out.estimate_sum[stat] = out.estimate_sum.get(stat, 0.0) + res.map
            for method, low in _lows(res.replicates, res.map, confidence, methods, res.jackknife, res.halves).items():
                out.add(stat, method, float(low) <= values[stat] + 1e-12)
        if not any(st.startswith("recall") for st in statistics):
            continue
        rec = engine.recall(sample, score_threshold=0.5, bootstrap=bootstrap, confidence=confidence,
                            generator=torch.Generator().manual_seed(gen_seed))
        rep, overall_rep, jk, jk_all, sub, sub_all = rec.replicates
        classes = torch.tensor(rec.classes)
        lows = _lows(rep, rec.recall, confidence, methods, jk, sub)
        overall_lows = _lows(overall_rep, rec.overall, confidence, methods, jk_all, sub_all)
        for method, low in lows.items():
            t = class_truth[classes]
            for i, c in enumerate(rec.classes):
                out.add(f"class {c}", method, bool(low[i] <= t[i] + 1e-12))
                out.trials[(f"class {c}", method)] = out.trials.get((f"class {c}", method), 0) + 1
            out.add("recall, min over classes", method, bool(low.min() <= class_truth.min() + 1e-12))
            overall = float(overall_lows[method])
            out.add("recall, all objects", method, overall <= values["recall, all objects"] + 1e-12)
    for method in methods:  # a class absent from a sample has no bound there: rate over the samples it was in
        per_class = [k for k in out.covered if k[0].startswith("class ") and k[1] == method]
        if per_class:
            worst = min(per_class, key=lambda k: out.covered[k] / out.trials[k])
            out.covered[("recall, worst-covered class", method)] = out.covered[worst]
            out.trials[("recall, worst-covered class", method)] = out.trials[worst]
            rarest = max(per_class)  # the class with the largest index: the rarest in "imbalanced"
            out.covered[("recall, one class (rarest)", method)] = out.covered[rarest]
            out.trials[("recall, one class (rarest)", method)] = out.trials[rarest]
    return out


def cp_lower(covered: int, samples: int, level: float = 0.95) -> float:
    """The lower end of the two-sided ``level`` Clopper–Pearson interval of ``covered`` of ``samples``."""
    return 0.0 if covered == 0 else float(stats.beta.ppf((1 - level) / 2, covered, samples - covered + 1))


__all__ = ["SCENARIOS", "STATISTICS", "Coverage", "Scenario", "coverage_run", "cp_lower", "population", "truth"]
