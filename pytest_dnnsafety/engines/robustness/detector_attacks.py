"""Gradient attacks on an object detector's matched scores: FGSM and PGD for eq. (4) with ``task='detection'``.

A classifier's attacks (:mod:`..perturb.adversarial`) climb the true class's cross-entropy. A detector's
"probability of the correct class" of a ground-truth object is its matched score (the best same-class
detection in its image with IoU ≥ ``iou``, Cheng et al. 2018 §II-F step 2), so here the loss each image's
perturbation climbs is ``−Σ`` (matched scores of its objects): the attack lowers the scores of the
detections that match the objects. The gradient flows through the scores of the matched detections (the
pairing of boxes is a selection, not differentiated); an object the detector already misses has no matched
detection and no gradient. The steps, balls, projection and random start are the classifier attacks' own
(L∞ sign steps or L2 normalised steps, clamped to ``clip``); PGD returns per image the iterate with the
lowest matched-score sum seen. Pure torch; no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.data.tasks import matched_scores
from pytest_dnnsafety.engines.perturb.adversarial import _direction, _not_differentiable, _per_input, _project, _random_start

__all__ = ["detector_fgsm", "detector_pgd", "matched_loss_and_grad"]


def _image_loss(dets: BoxSet, targets: BoxSet, n: int, iou: float) -> Tensor:
    per_object = matched_scores(dets, targets, iou)
    return -torch.zeros(n, dtype=per_object.dtype, device=per_object.device).index_add(0, targets.image, per_object)


def matched_loss_and_grad(model: Any, x: Tensor, targets: BoxSet, guard: ForwardGuard, iou: float = 0.5
                          ) -> tuple[Tensor, Tensor]:
    """Per image ``−Σ matched scores`` (detached) and its input gradient (zero where no object is matched)."""
    if torch.is_inference_mode_enabled():
        raise _not_differentiable(model, "it is called under torch.inference_mode()")
    xg = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        dets = guard(model, xg)
        loss = _image_loss(dets, targets, x.shape[0], iou)
        if not loss.requires_grad:
            if dets.scores is not None and len(dets) and not dets.scores.requires_grad:
                raise _not_differentiable(model, "its detection scores do not require grad (it runs under "
                                                 "torch.no_grad() or without autograd)")
            return loss.detach(), torch.zeros_like(x)  # nothing matched: nothing to attack
        try:
            (grad,) = torch.autograd.grad(loss.sum(), [xg], allow_unused=True)
        except RuntimeError as exc:
            raise _not_differentiable(model, f"autograd failed: {str(exc).strip().splitlines()[0]}") from exc
    if grad is None:
        raise _not_differentiable(model, "its detection scores do not depend on the input through autograd")
    return loss.detach(), grad


def _check(x: Tensor, targets: Any) -> None:
    if not isinstance(targets, BoxSet) or targets.n_images != x.shape[0]:
        raise MetricError("the detector attacks need the batch's ground-truth boxes (a BoxSet of one entry per "
                          "image).")


def detector_fgsm(model: Any, x: Tensor, targets: BoxSet, eps: float, *, norm: str = "linf",
                  clip: tuple[float, float] | None = None, guard: ForwardGuard, iou: float = 0.5) -> Tensor:
    """One step of size ε down the matched scores: ``x' = clip(x + ε·direction(∇ₓ(−Σ matched scores)))``."""
    _check(x, targets)
    x0 = x.detach()
    _, grad = matched_loss_and_grad(model, x0, targets, guard, iou)
    xa = x0 + eps * _direction(grad, norm)
    return xa.clamp(clip[0], clip[1]) if clip is not None else xa


def detector_pgd(model: Any, x: Tensor, targets: BoxSet, eps: float, generator: torch.Generator | None = None, *,
                 norm: str = "linf", steps: int = 10, step_size: float | None = None, random_start: bool = True,
                 clip: tuple[float, float] | None = None, guard: ForwardGuard, iou: float = 0.5) -> Tensor:
    """PGD inside the ε-ball on ``−Σ matched scores`` per image; the iterate with the highest loss per image."""
    _check(x, targets)
    if step_size is None:
        step_size = 2.5 * eps / max(steps, 1)
    x0 = x.detach()
    xa = _project(x0 + _random_start(x0, eps, norm, generator), x0, eps, norm, clip) if random_start and eps > 0 \
        else x0.clone()
    best, best_loss = xa, torch.full((x0.shape[0],), float("-inf"), dtype=torch.float64, device=x0.device)

    def keep(candidate: Tensor, value: Tensor) -> None:
        nonlocal best, best_loss
        value = value.to(device=x0.device, dtype=torch.float64)
        better = value > best_loss
        best = torch.where(_per_input(better, candidate), candidate, best)
        best_loss = torch.where(better, value, best_loss)

    for _ in range(steps):
        value, grad = matched_loss_and_grad(model, xa, targets, guard, iou)
        keep(xa, value)
        xa = _project(xa + step_size * _direction(grad, norm), x0, eps, norm, clip)
    with torch.no_grad():
        keep(xa, _image_loss(guard(model, xa), targets, x0.shape[0], iou))
    return best.detach()
