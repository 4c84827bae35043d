"""Adversarial confidence loss of an object detector, per ground-truth object (Cheng et al. 2018, §II-D, eq. (4)).

Eq. (4) averages, over inputs, the worst drop of ``NN(in)``, the probability of the correct class. For
a detector that probability is, per ground-truth object, its *matched score* (§II-F step 2: the highest
score of a same-class detection in its image with IoU ≥ ``iou``, else 0;
:func:`~pytest_dnnsafety.data.tasks.matched_scores`). So here an "input" of eq. (4)
is a ground-truth object: per object and family ``drop = clean matched score − perturbed matched
score`` (the image perturbed by the family, :mod:`.perturbations`), the worst family per object, and
the loss ``−M_adv`` is the mean worst drop over objects.

The natural families perturb images as for a classifier; a family that compares candidates keeps, per
image, the one with the lowest sum of its objects' matched scores. The gradient families (fgsm, pgd)
descend that sum, ``−Σ`` matched scores of each image's objects being the loss they climb
(:mod:`.detector_attacks`): they need a detector whose scores are differentiable in its input. A user
callable family is
called as ``f(model, x, y, eps, generator)`` with ``y`` the batch's packed ground-truth
:class:`~pytest_dnnsafety.data.tasks.BoxSet`.

"Correct" for the robust-accuracy counts is *detected*: matched score ≥ ``score_threshold`` (0.5). The
result's ``clean_accuracy`` is then the clean detection recall at that score and ``robust_accuracy`` the
recall under each family. Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.engines.core.guard import eval_mode, model_dtype_device
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.data.tasks import matched_scores
from pytest_dnnsafety.engines.core.runner import Runner
from pytest_dnnsafety.engines.perturb.adversarial import check_clip
from pytest_dnnsafety.engines.robustness.confidence import (AdversarialConfidenceEngine, AdversarialConfidenceResult, _eps_per_family, _family_seed,
                         _run_family, checked_families)

__all__ = ["assess_detector_confidence", "SCORE_THRESHOLD"]

#: A ground-truth object counts as detected when its matched score reaches this.
SCORE_THRESHOLD = 0.5


def assess_detector_confidence(model: Any, data: Any, families: Mapping[str, Any], eps: float | Mapping[str, float],
                               *, batch_size: int = 256, device: torch.device | str = "cpu", seed: int = 0,
                               clip: tuple[float, float] | None = None, iou: float = 0.5,
                               shard: Any = None) -> AdversarialConfidenceResult:
    """M_adv (eq. (4)) of a detector per ground-truth object of detection ``data`` under ``families``.

    As :func:`~.confidence.assess_adversarial_confidence` (seeds per family and global batch, guards, the
    data's range checked against ``clip`` after the loop; ``shard``: this rank's batches, states all-reduced),
    with matched scores in place of true-class probabilities.
    """
    names, fams = checked_families(families, "adversarial confidence (detection)")
    budgets = _eps_per_family(eps, names)
    clip = check_clip(clip)
    check_count(batch_size, "batch_size", fix="give a positive batch size, e.g. batch_size=256.")
    _, model_device = model_dtype_device(model)
    target = model_device if model_device is not None else torch.device(device)
    acc = torch.device("cpu") if target.type == "mps" else target
    runner = Runner("adversarial confidence (detection)", device=target, batch_size=batch_size, shard=shard,
                    labels="required", task="detection")
    clean_guard = runner.guard("adversarial confidence: detector on clean images", task="detection")
    guards = [runner.guard(f"adversarial confidence: detector on {name!r} perturbations (eps={e:g})",
                           task="detection") for name, e in zip(names, budgets)]
    engine = AdversarialConfidenceEngine(len(fams), device=acc)
    objects = {"seen": 0}
    targets = getattr(data, "targets", None)
    # each image's first object row in the whole data (host tensor): the same object indices on every rank
    starts = targets.offsets() if isinstance(targets, BoxSet) else None

    def step(batch: Any) -> None:
        x, t = batch.x, batch.y  # boxes: the runner checked the labels' form for task='detection'
        with torch.no_grad():
            p_clean = matched_scores(clean_guard(model, x), t, iou)
        clean_guard.targets(t, batch.index)  # target labels beyond the detector's declared classes: flagged
        p_pert = []
        for i, (name, fam) in enumerate(zip(names, fams)):
            gen = torch.Generator().manual_seed(_family_seed(seed, i, batch.index))
            xp = _run_family(fam, name, model, x, t, budgets[i], gen, guards[i], "logits")
            runner.flag(f"family {i}", ~torch.isfinite(xp), batch,
                        f"adversarial confidence: perturbation family {name!r} returned NaN/inf values in {{count}} "
                        "batch(es), the first being batch {first}. Fix: the family must return finite inputs.")
            if clip is not None:
                xp = xp.clamp(clip[0], clip[1])
            with torch.no_grad():
                p_pert.append(matched_scores(guards[i](model, xp), t, iou))
        stacked = torch.stack(p_pert) if p_pert else torch.zeros((0, len(t)))
        first = int(starts[batch.start]) if starts is not None else objects["seen"]
        rows = first + torch.arange(len(t), device=acc)
        objects["seen"] += len(t)
        engine.update(p_clean, stacked, p_clean >= SCORE_THRESHOLD, stacked >= SCORE_THRESHOLD, rows=rows,
                      inputs=x)

    with eval_mode(model):
        runner.run(data, step, engine)
    x_lo, x_hi = torch.stack([engine.input_min, engine.input_max]).tolist()
    if clip is not None and not (x_lo >= clip[0] and x_hi <= clip[1]):
        raise DataError(f"adversarial confidence: the data lie in [{x_lo:g}, {x_hi:g}], outside the valid input range "
                        f"clip=({clip[0]:g}, {clip[1]:g}); the perturbations are clamped to that range, so they would "
                        "move inputs beyond ε. Fix: scale the data into the range or set the clip range to the "
                        "data's.")
    return replace(engine.compute(tuple(names)), eps=tuple(budgets))
