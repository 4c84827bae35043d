"""Shared parts of DeepQuant: argument checks, the safety expressions, balls and counter-based draws."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.data.checks import check_choice
from pytest_dnnsafety.engines.core.guard import ForwardGuard, model_dtype_device
from pytest_dnnsafety.engines.perturb.adversarial import OUTPUTS, detect_outputs, log_probs

#: The safety expressions (see the module docstring).
EXPRESSIONS = ("top_vs_runner_up", "top_vs_label", "top_vs_least", "uncertainty", "reachability")
#: The ball norms.
NORMS = ("linf", "l2", "l1")
#: The pattern searches.
SEARCHES = ("gps", "mads")
#: The bound methods of the certified radius.
BOUND_METHODS = ("crown", "ibp")

_CI = ("top_vs_runner_up", "top_vs_label", "top_vs_least")
_LABELLED = ("top_vs_label", "reachability")
_M32 = 0xFFFFFFFF
#: A poll succeeds when its best ratio beats the incumbent's by this relative margin (so rounding noise
#: cannot keep expanding the mesh forever).
_INCREASE = 1e-9
#: The second start's first mesh, relative to the first's: it searches the near field of x, where the ratio tends to
#: the local slope (the dual norm of the gradient), while the first start's coarse mesh explores the whole ball.
_NEAR = 1e-3


# ----------------------------------------------------------------------------- argument checks


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_expression(expression: Any, label: Any, eps: Any) -> tuple[str, int | None, float]:
    if expression not in EXPRESSIONS:
        raise ConfigError(f"expression={expression!r} is not one of {list(EXPRESSIONS)}. Fix: name a safety "
                          f"expression, e.g. expression='top_vs_runner_up'.")
    if label is not None and (isinstance(label, bool) or not isinstance(label, numbers.Integral) or label < 0):
        raise ConfigError(f"label={label!r} is not a class index (an integer ≥ 0). Fix: give the index of a class "
                          f"of the model's output, e.g. label=3.")
    if expression == "top_vs_label" and label is None:
        raise ConfigError("expression='top_vs_label' needs label=: the class the top class must stay ahead of. "
                          "Fix: give label=<class index>, or use expression='top_vs_runner_up'.")
    if label is not None and expression not in _LABELLED:
        raise ConfigError(f"label={label!r} is used only by the expressions {list(_LABELLED)}, not by "
                          f"{expression!r}. Fix: drop label=, or use expression='top_vs_label'.")
    if not _real(eps) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"eps={eps!r} is not a finite number ≥ 0. Fix: give the required margin ε, e.g. eps=0.0.")
    if expression != "uncertainty" and eps > 1:
        raise ConfigError(f"eps={eps!r} exceeds 1; {expression!r} compares probabilities, so ε must lie in [0, 1]. "
                          f"Fix: give a probability margin, e.g. eps=0.1.")
    return str(expression), None if label is None else int(label), float(eps)


def _check_outputs(outputs: Any) -> str:
    return check_choice(outputs, "outputs", ("auto", *OUTPUTS),
                         "say what the model returns: 'auto' (detected), 'logits' or 'probabilities'.")


def _check_label_range(label: int | None, classes: int) -> None:
    if label is not None and label >= classes:
        raise ConfigError(f"label={label} is not a class of the model: it returns {classes} class scores (classes "
                          f"0..{classes - 1}). Fix: give a label in [0, {classes - 1}].")


# ----------------------------------------------------------------------------- expressions


def _to_model(model: Any, x: Any) -> Tensor:
    """``x`` as a non-empty batch on the model's device in its dtype (float32 for a model without parameters)."""
    dtype, device = model_dtype_device(model)
    x = torch.as_tensor(x).detach()
    if x.ndim < 2 or x.shape[0] == 0:
        raise DataError(f"safety quantification needs a non-empty batch of inputs (N, ...); got shape "
                        f"{tuple(x.shape)}. Fix: give at least one input, with the batch as the first dimension.")
    device = device or x.device
    dtype = dtype or (x.dtype if x.is_floating_point() else torch.float32)
    return x.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def _forward(model: Any, x: Tensor, guard: ForwardGuard | None) -> Tensor:
    out = guard(model, x) if guard is not None else model(x)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] < 2 or not out.is_floating_point():
        raise MetricError(f"safety quantification needs class scores of shape (batch, classes); the model returned "
                          f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}. Fix: return logits or "
                          f"probabilities, one row per input.")
    return out


def _classes(kind: str, lp0: Tensor, label: int | None) -> tuple[Tensor, Tensor]:
    """Per input ``(top, other)`` fixed at the centre: ``other`` is the label, the least class, or the top."""
    top = lp0.argmax(dim=1)
    if kind == "top_vs_least":
        other = lp0.argmin(dim=1)
    elif label is not None:
        other = torch.full_like(top, label)
    else:  # top_vs_runner_up (re-taken at x̂), uncertainty (unused), reachability of the top class
        other = top
    return top, other


def _evaluate(kind: str, eps: float, lp: Tensor, top: Tensor, other: Tensor) -> Tensor:
    """``s`` (float64) from log-probabilities ``lp`` (M, m) and each row's fixed classes."""
    lp = lp.to(torch.float64)
    if kind == "uncertainty":
        m = lp.shape[1]
        return -math.log(m) - lp.mean(dim=1) - eps
    p = lp.exp()
    if kind == "reachability":
        return p.gather(1, other[:, None]).squeeze(1) - eps
    p_top = p.gather(1, top[:, None]).squeeze(1)
    if kind == "top_vs_runner_up":
        rival = p.scatter(1, top[:, None], -math.inf).amax(dim=1)
    else:
        rival = p.gather(1, other[:, None]).squeeze(1)
    return p_top - rival - eps


def _applicable(kind: str, top: Tensor, other: Tensor) -> Tensor:
    if kind in ("top_vs_label", "top_vs_least"):
        return top != other
    return torch.ones_like(top, dtype=torch.bool)


def safety_values(model: Any, x: Tensor, expression: str = "top_vs_runner_up", *, label: int | None = None,
                  eps: float = 0.0, outputs: str = "auto") -> Tensor:
    """``s(x)`` per input, float64 ``(N,)``, for one of :data:`EXPRESSIONS` (see the module docstring).

    ``outputs``: ``"logits"``, ``"probabilities"`` or ``"auto"`` (detected on this batch). For
    ``top_vs_label`` an input whose top class is ``label`` gets ``−ε`` (the formula; the search
    treats it as not applicable).
    """
    kind, label, eps = _check_expression(expression, label, eps)
    outputs = _check_outputs(outputs)
    with torch.no_grad():
        out = _forward(model, _to_model(model, x), None)
    _check_label_range(label, out.shape[1])
    if outputs == "auto":
        outputs = detect_outputs(out)
    lp = log_probs(out, outputs)
    top, other = _classes(kind, lp, label)
    return _evaluate(kind, eps, lp, top, other)


def confidence_interval(model: Any, x: Tensor, case: str = "top_vs_runner_up", label: int | None = None,
                        eps: float = 0.0, *, outputs: str = "auto") -> Tensor:
    """``s_CI(x) = f_top(x) − f_other(x) − ε`` per input (eq. 3); ``case`` one of the three CI cases."""
    if case not in _CI:
        raise ConfigError(f"case={case!r} is not one of {list(_CI)}. Fix: pick a confidence-interval case.")
    return safety_values(model, x, case, label=label, eps=eps, outputs=outputs)


def uncertainty(model: Any, x: Tensor, eps: float = 0.0, *, outputs: str = "auto") -> Tensor:
    """``s_U(x) = KL(uniform ‖ f(x)) − ε`` per input, natural logarithms (eq. 8)."""
    return safety_values(model, x, "uncertainty", eps=eps, outputs=outputs)


def reachability(model: Any, x: Tensor, label: int | None = None, eps: float = 0.0, *,
                 outputs: str = "auto") -> Tensor:
    """``s_R(x)(l) = f_l(x) − ε`` per input; ``label=None``: each input's top class."""
    return safety_values(model, x, "reachability", label=label, eps=eps, outputs=outputs)


# ----------------------------------------------------------------------------- balls


def lp_norm(v: Tensor, norm: str) -> Tensor:
    """The norm of each row of ``v`` (..., n) over its last dimension: ``"linf"``, ``"l2"`` or ``"l1"``."""
    if norm == "linf":
        return v.abs().amax(dim=-1)
    if norm == "l2":
        return torch.linalg.vector_norm(v, dim=-1)
    return v.abs().sum(dim=-1)


def project_l1_ball(v: Tensor, radius: float | Tensor) -> Tensor:
    """Euclidean projection of each row of ``v`` (M, n) onto the L1 ball of ``radius`` (a number or (M,)).

    The sort-based algorithm of Duchi et al. 2008 ("Efficient projections onto the l1-ball for
    learning in high dimensions", Fig. 1), batched: with ``u = sort(|v|, desc)`` and
    ``ρ = max{j : u_j − (Σ_{i≤j} u_i − r)/j > 0}``, ``θ = (Σ_{i≤ρ} u_i − r)/ρ`` and the result is
    ``sign(v)·max(|v| − θ, 0)``; rows already inside the ball are returned unchanged.
    """
    a = v.abs()
    n = v.shape[-1]
    # a number stays a Python scalar: a tensor made from it would be a host-to-device copy (a sync on CUDA)
    r: float | Tensor = (radius.to(v.dtype).reshape(*v.shape[:-1], 1) if isinstance(radius, Tensor)
                         else float(radius))
    inside = a.sum(dim=-1, keepdim=True) <= r
    u = a.sort(dim=-1, descending=True).values
    css = u.cumsum(dim=-1)
    j = torch.arange(1, n + 1, device=v.device)
    cond = u - (css - r) / j.to(v.dtype) > 0
    rho = (cond * j).amax(dim=-1, keepdim=True).clamp(min=1)
    theta = (css.gather(-1, rho - 1) - r) / rho.to(v.dtype)
    w = v.sign() * (a - theta).clamp(min=0)
    return torch.where(inside, v, w)


def project_ball(delta: Tensor, radius: float | Tensor, norm: str) -> Tensor:
    """Each row of ``delta`` (..., n) projected onto the ``norm`` ball of ``radius`` (a number or one per row).

    L∞: a clamp; L2: a radial rescale; L1: :func:`project_l1_ball`. All three are the exact
    Euclidean projections.
    """
    per_row = isinstance(radius, Tensor)
    r: float | Tensor = radius.to(delta.dtype) if per_row else float(radius)
    if norm == "linf":
        if per_row:
            r = r.unsqueeze(-1)
            return torch.minimum(torch.maximum(delta, -r), r)
        return delta.clamp(-r, r)
    if norm == "l2":
        n = torch.linalg.vector_norm(delta, dim=-1)
        factor = torch.where(n > r, r / n.clamp_min(torch.finfo(delta.dtype).tiny), torch.ones_like(n))
        return delta * factor.unsqueeze(-1)
    flat = delta.reshape(-1, delta.shape[-1])
    rr = r.expand(delta.shape[:-1]).reshape(-1) if per_row else r
    return project_l1_ball(flat, rr).reshape(delta.shape)


# ----------------------------------------------------------------------------- counter-based random draws


def _mul32(h: Tensor, c: int) -> Tensor:
    """``h·c mod 2^32`` for int64 ``h`` in ``[0, 2^32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32"), on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _uniform(seed: int, index: Tensor, start: Tensor, iteration: int, n: int, stream: int) -> Tensor:
    """Uniform numbers in (0, 1), float64 ``(len(index), n)``: a pure function of (seed, index, start, iteration,
    stream, coordinate), so a row's numbers do not depend on the other rows of the batch."""
    device = index.device
    h = torch.full((1, 1), (seed & _M32) ^ 0x9E3779B9, dtype=torch.int64, device=device)
    for key in ((seed >> 32) & _M32, iteration & _M32, stream & _M32):
        h = _mix32(_mix32(h) ^ key)
    h = _mix32(h ^ (index.to(torch.int64)[:, None] & _M32))
    h = _mix32(h ^ (start.to(torch.int64)[:, None] & _M32))
    h = _mix32(h ^ torch.arange(n, dtype=torch.int64, device=device)[None, :])
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def _gaussian(seed: int, index: Tensor, start: Tensor, iteration: int, n: int) -> Tensor:
    """Standard normal draws ``(len(index), n)`` by Box–Muller from two counter-based streams."""
    u1, u2 = _uniform(seed, index, start, iteration, n, 1), _uniform(seed, index, start, iteration, n, 2)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)



def _check_inputs(x: Tensor, clip: tuple[float, float] | None) -> None:
    """DataError for non-finite inputs or inputs outside ``clip`` (one host read)."""
    from pytest_dnnsafety.engines.bounds.box import outside_clip, outside_clip_error

    bad, outside = torch.stack([(~torch.isfinite(x)).sum(), outside_clip(x, clip)]).tolist()
    if bad:
        raise DataError(f"{bad} input value(s) are NaN or infinite. Fix: give finite inputs.")
    if outside:
        raise outside_clip_error(int(outside), clip)


