"""Adversarial perturbations: the gradient attacks FGSM and PGD (Cheng et al. 2018, §II-D, eq. (4)).

Eq. (4) takes the worst of a list of input transformers ``T_i(in, ε)``; the paper names FGSM
(Goodfellow et al. 2015) as its strongest one. This module holds the two gradient transformers,
batched and pure torch, used by the robustness families (:mod:`..robustness.perturbations`, also
importable from :mod:`..robustness.perturbations`) and the adversarial fault families of the monitor
benchmark (:mod:`..monitors.faults`):

* :func:`fgsm` — one signed (L∞) or normalised (L2) gradient step of size ε on the
  cross-entropy of the true class: ``x' = x + ε·sign(∇ₓ L)`` / ``x' = x + ε·∇ₓL/‖∇ₓL‖₂``;
* :func:`pgd` — projected gradient descent (Madry et al. 2018): a random start in the ε-ball,
  ``steps`` gradient steps each followed by the projection back onto the ball (and the valid
  input range), returning per input the iterate with the highest loss seen.

Both maximise ``loss(model(x'), y)``: ``"ce"`` is ``−log p_y`` (it pushes the true class's
probability down, which is what eq. (4) measures), ``"margin"`` is ``max_{j≠y} log p_j − log p_y``
(positive once the input is misclassified; the loss for falsifying a certified-robustness claim).

The model's outputs are ``"logits"`` or ``"probabilities"`` (:data:`OUTPUTS`;
:func:`detect_outputs` tells them apart on one batch); :func:`log_probs` turns either into
log-probabilities. Gradients are taken w.r.t. the input only (:func:`input_gradient`): the
model's parameters and their ``.grad`` are never touched, and its train/eval mode is the
caller's business. A PGD step is exactly one forward and one backward pass on the whole batch,
with no host synchronisation in the loop.

Inputs have any shape ``(N, ...)``; per-input norms run over all non-batch dimensions.
``clip=(lo, hi)`` keeps every iterate inside the valid input range *after* the projection onto
the ε-ball: as long as ``x`` itself lies in ``[lo, hi]``, clamping only moves coordinates
towards ``x``, so the result lies in ball ∩ range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard, describe_model
from pytest_dnnsafety.engines.perturb.common import check_clip, draw, is_real

__all__ = [
    "LOSSES",
    "NORMS",
    "OUTPUTS",
    "detect_outputs",
    "fgsm",
    "check_clip",
    "input_gradient",
    "log_probs",
    "pgd",
]

#: What a model's output rows are.
OUTPUTS = ("logits", "probabilities")
#: The perturbation norms of the gradient attacks.
NORMS = ("linf", "l2")
#: The losses PGD maximises.
LOSSES = ("ce", "margin")

_TINY = 1e-12


# ----------------------------------------------------------------------------- outputs


def detect_outputs(out: Tensor) -> str:
    """``"probabilities"`` if every entry of ``out`` is in [0, 1] and every row sums to 1 (±1e-4), else ``"logits"``.

    One host synchronisation; callers use it on the first batch only.
    """
    if not (out.is_floating_point() and out.ndim >= 1):
        return "logits"
    o = out.detach().to(torch.float64)
    rows = o.reshape(o.shape[0], -1) if o.ndim > 1 else o.reshape(1, -1)
    ok = (rows >= 0).all() & (rows <= 1).all() & ((rows.sum(dim=1) - 1).abs() <= 1e-4).all()
    return "probabilities" if bool(ok) else "logits"


def _check_outputs(outputs: str) -> None:
    if outputs not in OUTPUTS:
        raise ConfigError(f"outputs={outputs!r} is not one of {list(OUTPUTS)}. Fix: say whether the model returns "
                          f"logits or probabilities (or pass 'auto' to the runner to detect it).")


def log_probs(out: Tensor, outputs: str) -> Tensor:
    """Log-probabilities per row: ``log_softmax`` of logits, ``log(max(p, 1e-12))`` of probabilities.

    The dtype of ``out`` is kept (float32 stays float32, float64 stays float64).
    """
    _check_outputs(outputs)
    if outputs == "logits":
        return torch.log_softmax(out, dim=1)
    return torch.log(out.clamp_min(_TINY))


def _true_class(lp: Tensor, y: Tensor) -> Tensor:
    return lp.gather(1, y.reshape(-1, 1)).squeeze(1)


def _loss_fn(loss: str, y: Tensor, outputs: str) -> Callable[[Tensor], Tensor]:
    """Per-input loss to *maximise*, from the model output (see the module docstring)."""
    if loss == "ce":
        def ce(out: Tensor) -> Tensor:
            return -_true_class(log_probs(out, outputs), y)

        return ce

    def margin(out: Tensor) -> Tensor:
        lp = log_probs(out, outputs)
        others = lp.scatter(1, y.reshape(-1, 1), float("-inf")).amax(dim=1)
        return others - _true_class(lp, y)

    return margin


# ----------------------------------------------------------------------------- gradients


def _not_differentiable(model: Any, why: str) -> MetricError:
    return MetricError(
        f"the gradient attacks (fgsm, pgd) need a differentiable model, but {why} (model: "
        f"{describe_model(model)}). Fix: load the model as an nn.Module (a state dict with "
        f"dnnsafety_model_factory, or a 'pkg.module:build' factory) rather than a TorchScript or torch.export "
        f"program run without autograd, do not wrap its forward in torch.no_grad()/inference_mode, or use only "
        f"the non-gradient perturbation families (gaussian_noise, brightness, contrast, blur, rotation, "
        f"translation, occlusion)."
    )


def _loss_and_grad(
    model: Any, x: Tensor, loss_fn: Callable[[Tensor], Tensor], guard: ForwardGuard | None
) -> tuple[Tensor, Tensor]:
    """One forward and one backward pass: ``(per-input loss (detached), ∇ₓ Σ loss)``."""
    if torch.is_inference_mode_enabled():
        raise _not_differentiable(model, "it is called under torch.inference_mode()")
    xg = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = guard(model, xg) if guard is not None else model(xg)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            out = out[0]
        if not isinstance(out, Tensor):
            raise MetricError(f"the model returned {type(out).__name__}, not a tensor of class scores "
                              f"(model: {describe_model(model)}). Fix: return logits or probabilities (batch, classes).")
        if not out.requires_grad:
            raise _not_differentiable(
                model, "its output does not require grad (it runs under torch.no_grad() or without autograd)")
        per_input = loss_fn(out)
        try:
            (grad,) = torch.autograd.grad(per_input.sum(), [xg], allow_unused=True)
        except RuntimeError as exc:
            raise _not_differentiable(model, f"autograd failed: {str(exc).strip().splitlines()[0]}") from exc
    if grad is None:
        raise _not_differentiable(model, "its output does not depend on the input through autograd "
                                         "(the input is detached or converted inside the model)")
    return per_input.detach(), grad


def input_gradient(model: Any, x: Tensor, loss_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``∇ₓ loss_fn(model(x)).sum()``, w.r.t. ``x`` only (parameters and their ``.grad`` untouched).

    Raises :class:`MetricError` saying the gradient attacks need a differentiable model when the
    output has no autograd graph (a model run under ``no_grad``, a TorchScript module doing so,
    a program whose backward fails) or autograd raises.
    """
    return _loss_and_grad(model, x, loss_fn, None)[1]


# ----------------------------------------------------------------------------- balls


def _per_input(v: Tensor, x: Tensor) -> Tensor:
    """A per-input value ``(N,)`` shaped to broadcast against ``x`` ``(N, ...)``."""
    return v.reshape((-1,) + (1,) * (x.ndim - 1))


def _l2(v: Tensor) -> Tensor:
    return v.reshape(v.shape[0], -1).norm(dim=1)


def _direction(grad: Tensor, norm: str) -> Tensor:
    """The steepest-ascent unit step: ``sign(g)`` (L∞) or ``g/‖g‖₂`` per input (L2; zero for a zero gradient)."""
    if norm == "linf":
        return grad.sign()
    n = _l2(grad)
    return grad / _per_input(torch.where(n > 0, n, torch.ones_like(n)), grad)


def _project(xa: Tensor, x0: Tensor, eps: float, norm: str, clip: tuple[float, float] | None) -> Tensor:
    """Project ``xa`` onto the ε-ball around ``x0`` (L∞ clamp or L2 rescale per input), then clamp to ``clip``."""
    if norm == "linf":
        xa = torch.minimum(torch.maximum(xa, x0 - eps), x0 + eps)
    else:
        delta = xa - x0
        n = _l2(delta)
        factor = torch.where(n > eps, eps / n.clamp_min(_TINY), torch.ones_like(n))
        xa = x0 + delta * _per_input(factor, delta)
    if clip is not None:
        xa = xa.clamp(clip[0], clip[1])
    return xa


def _random_start(x0: Tensor, eps: float, norm: str, generator: torch.Generator | None) -> Tensor:
    """A perturbation drawn uniformly from the L∞ box or the L2 ball of radius ε (per input)."""
    if norm == "linf":
        return (2 * draw("rand", tuple(x0.shape), x0, generator) - 1) * eps
    n, d = x0.shape[0], max(1, math.prod(x0.shape[1:]))
    direction = draw("randn", tuple(x0.shape), x0, generator)
    direction = direction / _per_input(_l2(direction).clamp_min(_TINY), direction)
    radius = eps * draw("rand", (n,), x0, generator) ** (1.0 / d)
    return direction * _per_input(radius, x0)


# ----------------------------------------------------------------------------- validation


def _check_args(x: Tensor, y: Tensor, eps: float, norm: str, outputs: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim < 2:
        raise MetricError(f"the attacks need a floating-point input batch (N, ...) of at least 2 dimensions, got "
                          f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}.")
    if not is_real(eps) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"eps={eps!r} is not a finite non-negative perturbation budget.")
    if norm not in NORMS:
        raise ConfigError(f"norm={norm!r} is not one of {list(NORMS)}.")
    _check_outputs(outputs)
    y = torch.as_tensor(y)
    if y.shape != (x.shape[0],):
        raise MetricError(f"the attacks need one integer label per input: labels of shape {tuple(y.shape)} for "
                          f"inputs of shape {tuple(x.shape)}.")
    return y.to(device=x.device, dtype=torch.int64, non_blocking=x.device.type != "cpu")


# ----------------------------------------------------------------------------- attacks


def fgsm(
    model: Any,
    x: Tensor,
    y: Tensor,
    eps: float,
    generator: torch.Generator | None = None,
    *,
    norm: str = "linf",
    clip: tuple[float, float] | None = None,
    outputs: str = "logits",
    guard: ForwardGuard | None = None,
) -> Tensor:
    """Fast gradient sign method: one step of size ε up the true class's cross-entropy.

    ``x' = clip(x + ε·sign(∇ₓ L))`` (L∞) or ``clip(x + ε·∇ₓL/‖∇ₓL‖₂)`` (L2, per input), with
    ``L = −log p_y`` — the paper's strongest transformer ``T_i(in, ε)`` in eq. (4). One forward and
    one backward pass (through ``guard`` when given). ``generator`` is unused (FGSM is
    deterministic) and accepted for the family signature. ``x`` must lie inside ``clip``.
    """
    y = _check_args(x, y, eps, norm, outputs)
    clip = check_clip(clip)
    x0 = x.detach()
    _, grad = _loss_and_grad(model, x0, _loss_fn("ce", y, outputs), guard)
    xa = x0 + eps * _direction(grad, norm)
    return xa.clamp(clip[0], clip[1]) if clip is not None else xa


def pgd(
    model: Any,
    x: Tensor,
    y: Tensor,
    eps: float,
    generator: torch.Generator | None = None,
    *,
    norm: str = "linf",
    steps: int = 10,
    step_size: float | None = None,
    random_start: bool = True,
    clip: tuple[float, float] | None = None,
    outputs: str = "logits",
    loss: str = "ce",
    guard: ForwardGuard | None = None,
) -> Tensor:
    """Projected gradient descent (Madry et al. 2018) inside the ε-ball, for eq. (4)'s ``T_i(in, ε)``.

    Start at ``x`` plus a perturbation drawn uniformly from the ball (``random_start``; drawn with
    ``generator``, so a seed reproduces the result), then ``steps`` times: one forward and one
    backward pass on the whole batch, a step of ``step_size`` (default ``2.5·ε/steps``) along
    ``sign(∇)`` (L∞) or ``∇/‖∇‖₂`` (L2), the projection onto the ball and the clamp to ``clip``.
    The loss of each iterate is read from the forward pass of its own step (plus one final
    forward of the last iterate); per input the iterate with the highest loss is returned, so the
    result is never worse than the start. ``loss``: ``"ce"`` (``−log p_y``) or ``"margin"``
    (``max_{j≠y} log p_j − log p_y``). No host synchronisation inside the loop.
    """
    y = _check_args(x, y, eps, norm, outputs)
    clip = check_clip(clip)
    if loss not in LOSSES:
        raise ConfigError(f"loss={loss!r} is not one of {list(LOSSES)}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps={steps!r} is not a non-negative integer.")
    if step_size is None:
        step_size = 2.5 * eps / max(steps, 1)
    elif not is_real(step_size) or not math.isfinite(step_size) or step_size <= 0:
        raise ConfigError(f"step_size={step_size!r} is not a finite positive number.")
    loss_fn = _loss_fn(loss, y, outputs)
    x0 = x.detach()
    if random_start and eps > 0:
        xa = _project(x0 + _random_start(x0, eps, norm, generator), x0, eps, norm, clip)
    else:
        xa = x0.clone()
    best = xa
    best_loss = torch.full((x0.shape[0],), float("-inf"), dtype=x0.dtype, device=x0.device)

    def keep(candidate: Tensor, value: Tensor) -> None:
        nonlocal best, best_loss
        better = value.to(best_loss.dtype) > best_loss  # NaN never wins
        best = torch.where(_per_input(better, candidate), candidate, best)
        best_loss = torch.where(better, value.to(best_loss.dtype), best_loss)

    for _ in range(steps):
        value, grad = _loss_and_grad(model, xa, loss_fn, guard)
        keep(xa, value)
        xa = _project(xa + step_size * _direction(grad, norm), x0, eps, norm, clip)
    with torch.no_grad():
        out = guard(model, xa) if guard is not None else model(xa)
        if isinstance(out, (tuple, list)):
            out = out[0]
        keep(xa, loss_fn(out).detach())
    return best.detach()
