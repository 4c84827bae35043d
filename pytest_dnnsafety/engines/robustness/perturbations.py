"""Perturbation families: the input transformers ``T_i(in, ε)`` of eq. (4) (Cheng et al. 2018, §II-D).

Eq. (4) assumes "a list of input transformers ⟨T_1, …, T_n⟩ where … given a parameter ε
specifying the allowed perturbation, one derives a new input in' = T_i(in, ε)", ranging "from
simple rotation, distortion, to advanced techniques such as FGSM". A family here is a callable
object ``family(model, x, y, eps, generator) -> x'`` working on a whole batch, with the
attributes ``name``, ``unit`` (what ε is measured in) and ``gradient`` (needs a differentiable
model). Users may pass any plain callable with that signature instead (:func:`family_name`
names it).

========================  ==============================  ===================================================
family                    ε means                         x'
========================  ==============================  ===================================================
``gaussian_noise``        noise std. dev., input units    ``x + ε·N(0, 1)`` (seeded by ``generator``)
``brightness``            shift, input units              ``x + ε`` or ``x − ε``, the worse of the two
``contrast``              relative contrast change        ``m + (x − m)·(1 ± ε)``, ``m`` the input's mean,
                                                          the worse of the two
``blur``                  Gaussian sigma, pixels          Gaussian blur (separable, reflect padding,
                                                          kernel radius ⌈3σ⌉)
``rotation``              angle, degrees                  rotation by ``+ε`` or ``−ε`` about the centre
                                                          (bilinear, filled with ``clip[0]`` or 0), worse
``translation``           shift, pixels (sub-pixel ok)    shift right/left/down/up by ε (bilinear, filled
                                                          like rotation), the worst of four
``occlusion``             patch side / shorter side       a square patch of side ``max(1, round(ε·min(H,W)))``
                                                          filled with ``clip[0]`` or 0 at up to 3×3
                                                          positions, the worst of them
``fgsm`` / ``fgsm_l2``    L∞ / L2 radius, input units     :func:`~pytest_dnnsafety.engines.perturb.adversarial.fgsm`
``pgd`` / ``pgd_l2``      L∞ / L2 radius, input units     :func:`~pytest_dnnsafety.engines.perturb.adversarial.pgd` (10 steps, random start)
========================  ==============================  ===================================================

"The worse/worst of k candidates" is decided per input by one forward pass of all k·N
candidates stacked as one batch (:func:`worst_of`): the candidate with the lowest true-class
log-probability wins, which is the transformer eq. (4)'s ``min`` would pick. The spatial families
(blur, rotation, translation, occlusion) need images ``(N, C, H, W)`` (or ``(N, H, W)``). Every
output is clamped to ``clip`` when one is given. All families are batched, pure torch and
deterministic given the generator: each candidate is one transform of the perturbation
library :mod:`..perturb` (shared with the monitor fault families), called with the family's ``clip``.

**Detectors.** Given a detector and its packed ground-truth boxes as ``y`` (a
:class:`~pytest_dnnsafety.data.tasks.BoxSet`), the natural families perturb the same way and "the worse of k
candidates" is, per image, the candidate with the lowest sum of its objects' matched scores (the best
same-class detection with IoU ≥ 0.5, Cheng et al. 2018 §II-F step 2). The gradient families (fgsm, pgd)
then climb ``−Σ`` matched scores of each image's objects instead of the cross-entropy
(:mod:`.detector_attacks`; the same steps, balls and projection).

When called by the runner, families also receive ``guard=`` (a ForwardGuard every model query
goes through) and ``outputs=`` (the detected output kind); called alone, a family uses its own
guard (checked at the end of the call) and its constructor's ``outputs``.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.budget import chunk_size, spans
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.perturb import blur, brightness, contrast, gaussian_noise, occlude, rotate, translate
from pytest_dnnsafety.engines.perturb.adversarial import OUTPUTS, _check_outputs, detect_outputs, fgsm, log_probs, pgd
from pytest_dnnsafety.engines.perturb.common import as_images, check_clip, fill_value
from pytest_dnnsafety.engines.perturb.common import is_real as _is_real

__all__ = [
    "FAMILIES",
    "FGSM",
    "FGSML2",
    "PGD",
    "PGDL2",
    "Blur",
    "Brightness",
    "Contrast",
    "Family",
    "GaussianNoise",
    "Occlusion",
    "Rotation",
    "Translation",
    "family_name",
    "make_family",
    "worst_of",
]


def family_name(family: Any) -> str:
    """A family's ``name``, a plain function's ``__name__``, else its type's name."""
    for attr in ("name", "__name__"):
        value = getattr(family, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(family).__name__


def worst_of(
    model: Any, y: Any, candidates: list[Tensor], outputs: str, guard: ForwardGuard
) -> Tensor:
    """Per input, the candidate with the lowest true-class log-probability (one forward of all k·N); for a
    detector (``y`` a :class:`~pytest_dnnsafety.data.tasks.BoxSet`) the lowest sum of its objects' matched scores."""
    if len(candidates) == 1:
        return candidates[0]
    k, n = len(candidates), candidates[0].shape[0]
    stacked = torch.cat(candidates, dim=0)
    with torch.no_grad():  # the k·N candidates in calls the working-memory budget allows
        size = chunk_size(model, stacked) if k * n > 1 else k * n
        parts = [guard(model, stacked[a:b]) for a, b in spans(k * n, size)]
        joined = BoxSet.cat if isinstance(parts[0], BoxSet) else torch.cat
        out = parts[0] if len(parts) == 1 else joined(parts)  # type: ignore[operator]
    if isinstance(y, BoxSet):
        from pytest_dnnsafety.engines.core.detections import repeat_targets
        from pytest_dnnsafety.data.tasks import matched_scores

        copies, obj = repeat_targets(y, torch.arange(n, device=y.device).repeat(k))
        per_object = matched_scores(out, copies)
        total = torch.zeros(k * n, device=per_object.device).index_add(0, copies.image, per_object)
        pick = total.reshape(k, n).argmin(dim=0).to(stacked.device)
        return stacked.reshape(k, n, *stacked.shape[1:])[pick, torch.arange(n, device=pick.device)]
    lp = log_probs(out, outputs)
    true = lp.gather(1, y.repeat(k).reshape(-1, 1)).reshape(k, n)
    pick = true.argmin(dim=0)
    return stacked.reshape(k, n, *stacked.shape[1:])[pick, torch.arange(n, device=pick.device)]


def _images(x: Tensor, family: str) -> Tensor:
    """``x`` as ``(N, C, H, W)``; ``(N, H, W)`` gets a channel; anything else is refused."""
    imgs = as_images(x)
    if imgs is not None:
        return imgs
    raise MetricError(
        f"perturbation family {family!r} is spatial and needs images (N, C, H, W) or (N, H, W), but the inputs have "
        f"shape {tuple(x.shape)}. Fix: drop {family!r} for non-image data and use gaussian_noise, brightness, "
        f"contrast or the gradient attacks (fgsm, pgd), or give the data its image shape."
    )


class Family(abc.ABC):
    """Base class of the built-in families (see the module table). Subclasses implement ``_perturb``."""

    name: ClassVar[str] = "family"
    unit: ClassVar[str] = ""
    gradient: ClassVar[bool] = False
    #: Spatial families need image inputs.
    spatial: ClassVar[bool] = False
    #: Whether the family compares candidates (then it needs to know the output kind).
    uses_outputs: ClassVar[bool] = True
    #: The runner passes ``guard=`` and ``outputs=`` to families saying so.
    accepts_guard: ClassVar[bool] = True
    #: Candidates per input the family compares (each a copy of the batch held at once).
    candidates: ClassVar[int] = 1

    def __init__(self, *, clip: tuple[float, float] | None = None, outputs: str = "logits") -> None:
        self.clip = check_clip(clip)
        if outputs != "auto":
            _check_outputs(outputs)
        self.outputs = outputs

    @property
    def fill(self) -> float:
        """The value of pixels uncovered by rotation/translation and of occluding patches."""
        return fill_value(self.clip)

    def __call__(
        self,
        model: Any,
        x: Tensor,
        y: Tensor,
        eps: float,
        generator: torch.Generator | None = None,
        *,
        guard: ForwardGuard | None = None,
        outputs: str | None = None,
    ) -> Tensor:
        if not _is_real(eps) or not math.isfinite(eps) or eps < 0:
            raise ConfigError(f"perturbation family {self.name!r}: eps={eps!r} is not a finite non-negative number "
                              f"({self.unit}).")
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.ndim < 2:
            raise MetricError(f"perturbation family {self.name!r} needs a floating-point batch (N, ...), got "
                              f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}.")
        if self.spatial:
            _images(x, self.name)
        boxes = isinstance(y, BoxSet)
        if boxes:
            y = y.to(x.device)
        else:
            y = torch.as_tensor(y).to(device=x.device, dtype=torch.int64, non_blocking=x.device.type != "cpu")
        own = guard is None
        if guard is None:
            guard = ForwardGuard(f"perturbation family {self.name!r}: model on perturbed inputs",
                                 task="detection" if boxes else "single-label")
        outputs = outputs or self.outputs
        if boxes:
            outputs = "logits"  # unused: a detector's candidates are compared by their matched scores
        elif outputs == "auto" and self.uses_outputs:
            with torch.no_grad():
                outputs = detect_outputs(guard(model, x))
        out = self._chunked(model, x.detach(), y, float(eps), generator, guard, outputs)
        if own:
            guard.check()
        return self._clamp(out)

    def _chunked(self, model: Any, x: Tensor, y: Any, eps: float, generator: torch.Generator | None,
                 guard: ForwardGuard, outputs: str) -> Tensor:
        """:meth:`_perturb` on chunks of the batch that fit the working-memory budget (the model's measured bytes
        per input, with a backward pass for a gradient family, and the family's candidate copies); one call
        when the batch fits. The generator is drawn on from chunk to chunk."""
        n = x.shape[0]
        if n < 2 or isinstance(y, BoxSet) or not (self.gradient or self.uses_outputs):
            return self._perturb(model, x, y, eps, generator, guard, outputs)
        held = (2 * self.candidates + 2) * x[0].numel() * x.element_size()
        size = chunk_size(model, x, grad=self.gradient, extra=held)
        if size >= n:
            return self._perturb(model, x, y, eps, generator, guard, outputs)
        return torch.cat([self._perturb(model, x[a:b], y[a:b], eps, generator, guard, outputs)
                          for a, b in spans(n, size)])

    def _clamp(self, x: Tensor) -> Tensor:
        return x.clamp(self.clip[0], self.clip[1]) if self.clip is not None else x

    @abc.abstractmethod
    def _perturb(self, model: Any, x: Tensor, y: Tensor, eps: float, generator: torch.Generator | None,
                 guard: ForwardGuard, outputs: str) -> Tensor:
        """The perturbed batch (same shape as ``x``; the caller clamps it to ``clip``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, clip={self.clip}, outputs={self.outputs!r})"


# ----------------------------------------------------------------------------- natural families


class GaussianNoise(Family):
    """``x + ε·N(0, 1)``, independent per element, drawn with ``generator``."""

    name = "gaussian_noise"
    unit = "noise standard deviation in input units"
    uses_outputs = False

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        return gaussian_noise(x, eps, generator)


class Brightness(Family):
    """``x ± ε``, per input the worse of the two."""

    name = "brightness"
    unit = "brightness shift in input units (L∞ radius)"

    candidates = 2

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        return worst_of(model, y, [brightness(x, eps, clip=self.clip), brightness(x, -eps, clip=self.clip)],
                        outputs, guard)


class Contrast(Family):
    """``m + (x − m)·(1 ± ε)`` with ``m`` each input's mean over all its elements, the worse of the two."""

    name = "contrast"
    unit = "relative contrast change (0.1 = ±10%)"

    candidates = 2

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        up, down = contrast(x, 1 + eps, clip=self.clip), contrast(x, 1 - eps, clip=self.clip)
        return worst_of(model, y, [up, down], outputs, guard)


class Blur(Family):
    """Gaussian blur with ``sigma = ε`` pixels: separable depthwise conv2d, reflect padding, radius ⌈3σ⌉."""

    name = "blur"
    unit = "Gaussian sigma in pixels"
    spatial = True
    uses_outputs = False

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        return blur(x, eps, radius=math.ceil(3 * eps))  # the identity below σ = 10⁻³ (no 0/0 in the kernel)


class Rotation(Family):
    """Rotation by ``±ε`` degrees about the image centre (bilinear), per input the worse of the two."""

    name = "rotation"
    unit = "rotation angle in degrees"
    spatial = True

    candidates = 2

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        candidates = [rotate(x, angle, clip=self.clip) for angle in (eps, -eps)]
        return worst_of(model, y, candidates, outputs, guard)


class Translation(Family):
    """A shift by ε pixels right, left, down or up (bilinear, sub-pixel ok), per input the worst of four."""

    name = "translation"
    unit = "shift in pixels"
    spatial = True

    candidates = 4

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        candidates = [translate(x, shift, clip=self.clip) for shift in ((eps, 0.0), (-eps, 0.0), (0.0, eps),
                                                                          (0.0, -eps))]
        return worst_of(model, y, candidates, outputs, guard)


def _positions(size: int, side: int) -> list[int]:
    """Up to three evenly spread start offsets of a patch of ``side`` along an axis of ``size``."""
    span = size - side
    return sorted({math.floor(span * f + 0.5) for f in (0.0, 0.5, 1.0)})


class Occlusion(Family):
    """A square patch of side ``max(1, round(ε·min(H, W)))`` filled with ``clip[0]`` (or 0), worst of ≤ 3×3 spots."""

    name = "occlusion"
    unit = "patch side as a fraction of the shorter image side"
    spatial = True

    candidates = 9

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        imgs = _images(x, self.name)
        h, w = imgs.shape[-2:]
        side = min(max(1, math.floor(eps * min(h, w) + 0.5)), h, w)
        candidates = [occlude(x, side, clip=self.clip, top=top, left=left)
                      for top in _positions(h, side) for left in _positions(w, side)]
        return worst_of(model, y, candidates, outputs, guard)


# ----------------------------------------------------------------------------- attack families


def _norm_name(norm: str) -> str:
    return "L∞" if norm == "linf" else "L2"


class FGSM(Family):
    """:func:`~pytest_dnnsafety.engines.perturb.adversarial.fgsm` as a family (``fgsm``, or ``fgsm_l2`` with ``norm="l2"``)."""

    name = "fgsm"
    unit = "L∞ radius in input units"
    gradient = True
    default_norm: ClassVar[str] = "linf"

    def __init__(self, *, norm: str | None = None, clip: tuple[float, float] | None = None,
                 outputs: str = "logits") -> None:
        super().__init__(clip=clip, outputs=outputs)
        self.norm = _check_norm(norm or self.default_norm)
        self.name = "fgsm" if self.norm == "linf" else "fgsm_l2"  # type: ignore[misc]
        self.unit = f"{_norm_name(self.norm)} radius in input units"  # type: ignore[misc]

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        if isinstance(y, BoxSet):  # a detector: down its objects' matched scores
            from pytest_dnnsafety.engines.robustness.detector_attacks import detector_fgsm

            return detector_fgsm(model, x, y, eps, norm=self.norm, clip=self.clip, guard=guard)
        return fgsm(model, x, y, eps, generator, norm=self.norm, clip=self.clip, outputs=outputs, guard=guard)


class FGSML2(FGSM):
    """FGSM with an L2 step (``fgsm_l2``)."""

    name = "fgsm_l2"
    unit = "L2 radius in input units"
    default_norm = "l2"


class PGD(Family):
    """:func:`~pytest_dnnsafety.engines.perturb.adversarial.pgd` as a family (``pgd``, or ``pgd_l2`` with ``norm="l2"``); 10 steps, random start."""

    name = "pgd"
    unit = "L∞ radius in input units"
    gradient = True
    default_norm: ClassVar[str] = "linf"

    def __init__(self, *, norm: str | None = None, steps: int = 10, step_size: float | None = None,
                 random_start: bool = True, loss: str = "ce", clip: tuple[float, float] | None = None,
                 outputs: str = "logits") -> None:
        super().__init__(clip=clip, outputs=outputs)
        self.norm = _check_norm(norm or self.default_norm)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"perturbation family 'pgd': steps={steps!r} is not a non-negative integer.")
        if step_size is not None and not (_is_real(step_size) and math.isfinite(step_size)
                                          and step_size > 0):
            raise ConfigError(f"perturbation family 'pgd': step_size={step_size!r} is not a finite positive number.")
        if loss not in ("ce", "margin"):
            raise ConfigError(f"perturbation family 'pgd': loss={loss!r} is not one of ['ce', 'margin'].")
        self.steps, self.step_size, self.random_start, self.loss = steps, step_size, bool(random_start), loss
        self.name = "pgd" if self.norm == "linf" else "pgd_l2"  # type: ignore[misc]
        self.unit = f"{_norm_name(self.norm)} radius in input units"  # type: ignore[misc]

    def _perturb(self, model, x, y, eps, generator, guard, outputs):  # type: ignore[no-untyped-def]
        if isinstance(y, BoxSet):  # a detector: down its objects' matched scores (loss='ce'/'margin' do not apply)
            from pytest_dnnsafety.engines.robustness.detector_attacks import detector_pgd

            return detector_pgd(model, x, y, eps, generator, norm=self.norm, steps=self.steps,
                                step_size=self.step_size, random_start=self.random_start, clip=self.clip, guard=guard)
        return pgd(model, x, y, eps, generator, norm=self.norm, steps=self.steps, step_size=self.step_size,
                   random_start=self.random_start, clip=self.clip, outputs=outputs, loss=self.loss, guard=guard)


class PGDL2(PGD):
    """PGD in the L2 ball (``pgd_l2``)."""

    name = "pgd_l2"
    unit = "L2 radius in input units"
    default_norm = "l2"


def _check_norm(norm: str) -> str:
    if norm not in ("linf", "l2"):
        raise ConfigError(f"norm={norm!r} is not one of ['linf', 'l2'].")
    return norm


# ----------------------------------------------------------------------------- registry

#: The built-in families by name.
FAMILIES: dict[str, Callable[..., Family]] = {
    cls.name: cls
    for cls in (GaussianNoise, Brightness, Contrast, Blur, Rotation, Translation, Occlusion, FGSM, FGSML2, PGD, PGDL2)
}


def make_family(name: str, *, clip: tuple[float, float] | None = None, outputs: str = "logits",
                **options: Any) -> Family:
    """Build the built-in family ``name`` (see :data:`FAMILIES`) with ``clip``, ``outputs`` and its own options.

    An unknown name or option is a :class:`ConfigError` listing what is known.
    """
    try:
        factory = FAMILIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown perturbation family {name!r}; the known families are "
                          f"{', '.join(sorted(FAMILIES))} (or pass your own callable f(model, x, y, eps, generator)).")\
            from None
    accepted = [p for p in inspect.signature(factory).parameters if p not in ("clip", "outputs")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(f"perturbation family {name!r} has no option(s) {', '.join(unknown)}; it accepts "
                          f"{', '.join(accepted) if accepted else 'none besides clip and outputs'}.")
    if outputs not in (*OUTPUTS, "auto"):
        raise ConfigError(f"outputs={outputs!r} is not one of {[*OUTPUTS, 'auto']}.")
    return factory(clip=clip, outputs=outputs, **options)
