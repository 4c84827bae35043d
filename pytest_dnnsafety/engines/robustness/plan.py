"""What the robustness gates run: an attack plan per task, and a verification plan.

The ``max_adversarial_confidence_loss`` and ``min_robust_accuracy`` gates share one measurement: the
marker's families (names of :data:`~.perturbations.FAMILIES` or user callables), their budgets, the
clip range, the model's output kind, the PGD steps and (detectors) the IoU. :class:`AttackPlan` holds
them, resolved once into ``{name: family}`` and ``{name: budget}`` with the marker's error messages,
in one of two task variants — as torchmetrics has Binary/Multiclass variants of one metric:

* :class:`ClassifierAttack` — the true-class probability of Cheng et al. 2018, eq. (4)
  (:func:`~.confidence.assess_adversarial_confidence`); the loss carries no signal when the clean
  accuracy is not above chance (:func:`at_chance`);
* :class:`DetectorAttack` — per ground-truth object, its matched score (§II-F step 2;
  :func:`~.detector.assess_detector_confidence`); the loss carries no signal when no object is
  detected on the clean images (:func:`no_detection`).

:meth:`AttackPlan.for_task` picks the variant. Each gives the values that identify its measurement
(so that two gates naming the same model, data and perturbations share one run), runs it, and words
its detail text and JSON details. :class:`VerificationPlan` is the same for ``min_verified_robustness``
(:func:`~.verification.verify_robustness`, in eval mode). Pure torch; no pytest import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pytest_dnnsafety.engines.core.signal import CONFIDENCE as SIGNAL_CONFIDENCE
from pytest_dnnsafety.errors import ConfigError

__all__ = ["AttackPlan", "ClassifierAttack", "DetectorAttack", "VerificationPlan", "CHANCE_CONFIDENCE", "at_chance",
           "no_detection"]

#: One-sided confidence of the lower bound on the clean accuracy that must exceed chance (no-signal check): the
#: relative gates' (:data:`pytest_dnnsafety.engines.core.signal.CONFIDENCE`)
CHANCE_CONFIDENCE = SIGNAL_CONFIDENCE


def _clip(clip: Any) -> tuple[float, float] | None:
    return None if clip is None else (float(clip[0]), float(clip[1]))


@dataclass(frozen=True)
class AttackPlan(ABC):
    """The empirical robustness gates' options, resolved: ``named`` families and one ``budget`` each.

    ``families``: names or callables ``(model, x, y, eps, generator) -> x'``, in the marker's order;
    ``eps``: every family's budget unless ``budgets`` (``{name: budget}``) names it; ``marker``
    starts every error message. Construction builds the named families (``steps`` for the PGD ones)
    and raises :class:`ConfigError` for a family listed twice, ``budgets`` naming an unlisted family,
    or a family without a budget. Use a task variant (:meth:`for_task`).
    """

    marker: str
    families: tuple[Any, ...]
    eps: float | None
    budgets: Mapping[str, float] | None = None
    clip: tuple[float, float] | None = None
    outputs: str = "auto"
    steps: int = 10
    iou: float = 0.5
    named: dict[str, Any] = field(init=False, compare=False, repr=False)
    budget: dict[str, float] = field(init=False, compare=False)

    #: the task this variant measures, and its name among the session's memoised results
    task: ClassVar[str] = ""
    memo_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        from pytest_dnnsafety.engines.robustness.perturbations import family_name, make_family

        object.__setattr__(self, "families", tuple(self.families))
        object.__setattr__(self, "clip", _clip(self.clip))
        named: dict[str, Any] = {}
        for item in self.families:
            if isinstance(item, str):
                options = {"steps": self.steps} if item.startswith("pgd") else {}
                family = make_family(item, clip=self.clip, outputs=self.outputs, **options)
            else:
                family = item
            name = family_name(family)
            if name in named:
                raise ConfigError(f"{self.marker}: family {name!r} is listed twice in families=. Fix: list it once.")
            named[name] = family
        unknown = sorted(set(self.budgets or {}) - set(named))
        if unknown:
            raise ConfigError(f"{self.marker}: budgets= names {unknown}, which are not in families={list(named)}. "
                              f"Fix: give budgets only for listed families.")
        given = dict(self.budgets or {})
        missing = [name for name in named if name not in given and self.eps is None]
        if missing:
            raise ConfigError(f"{self.marker}: no budget for {missing}: eps= is not set and budgets= does not name "
                              f"them. Fix: give eps=... (the budget of every family) or budgets={{name: value}}.")
        object.__setattr__(self, "named", named)
        object.__setattr__(self, "budget", {name: float(given.get(name, self.eps)) for name in named})

    @staticmethod
    def for_task(task: str, marker: str, options: Mapping[str, Any]) -> ClassifierAttack | DetectorAttack:
        """The variant of ``task`` (``"detection"`` or a classifier's) for the marker's options by keyword."""
        variant = DetectorAttack if task == "detection" else ClassifierAttack
        return variant(marker, tuple(options["families"]), options["eps"], options["budgets"], options["clip"],
                       options["outputs"], options["steps"], float(options["iou"]))

    @property
    def callables(self) -> tuple[Any, ...]:
        """The user's family callables (the objects, besides the model and data, a shared run is keyed by)."""
        return tuple(item for item in self.families if not isinstance(item, str))

    def key(self, seed: int, batch_size: int, device: str) -> tuple[Any, ...]:
        """The plain values a shared run is keyed by (besides :attr:`callables`, the model and the data)."""
        names = tuple(item if isinstance(item, str) else None for item in self.families)
        return (tuple(self.budget.items()), names, self.clip, *self._own_key(), seed, batch_size, device)

    @abstractmethod
    def _own_key(self) -> tuple[Any, ...]:
        """The variant's own values a shared run is keyed by (its output kind, steps, IoU)."""

    def setup(self) -> str:
        """``ε=0.1; rotation=15; clip=[0, 1]``: the budgets and the range, as the marker gave them."""
        parts = [f"ε={self.eps:g}" if self.eps is not None else "per-family budgets"]
        if self.budgets:
            parts.append(", ".join(f"{k}={v:g}" for k, v in self.budgets.items()))
        if self.clip is not None:
            parts.append(f"clip=[{self.clip[0]:g}, {self.clip[1]:g}]")
        return "; ".join(parts)

    @abstractmethod
    def accuracy_report(self, result: Any) -> dict[str, Any]:
        """``detail`` and ``details`` of the robust accuracy (share correct clean and under every family)."""


class ClassifierAttack(AttackPlan):
    """A classifier's attack plan: the true-class probability's worst drop (Cheng et al. 2018, eq. 4)."""

    task = "single-label"
    memo_name = "robustness.adversarial"

    def _own_key(self) -> tuple[Any, ...]:
        return self.outputs, self.steps

    def assess(self, model: Any, data: Any, *, batch_size: int, device: str, seed: int, shard: Any = None) -> Any:
        """:func:`~.confidence.assess_adversarial_confidence` of the plan (``shard``: this rank's batches)."""
        from pytest_dnnsafety.engines.robustness.confidence import assess_adversarial_confidence

        note = gradient_note(model, self.named)  # an ONNX graph: translated (or refused by name) before any work
        result = assess_adversarial_confidence(model, data, self.named, self.budget, batch_size=batch_size,
                                               device=device, seed=seed, clip=self.clip, outputs=self.outputs,
                                               shard=shard)
        if note:  # kept with the (memoised) result, for every gate that reads it
            object.__setattr__(result, "gradients", note)
        return result

    def no_signal(self, result: Any) -> str | None:
        """Why the loss says nothing (:func:`at_chance`), else None."""
        return at_chance(result)

    def loss_report(self, result: Any) -> dict[str, Any]:
        """``detail`` and ``details`` of the confidence loss."""
        return {"detail": f"{self.setup()}: {result.detail()}",
                "details": {**result.to_details(), "setup": self.setup(), **_gradients(result)}}

    def accuracy_report(self, result: Any) -> dict[str, Any]:
        per_family = ", ".join(f"{name} {acc:.3f}" for name, acc in zip(result.family_names, result.robust_accuracy))
        detail = (f"{self.setup()}: robust accuracy {result.robust_accuracy_all:.3f} under all families "
                  f"(clean {result.clean_accuracy:.3f}; {per_family}), n={result.n}")
        return {"detail": detail, "details": {**result.to_details(), "setup": self.setup(), **_gradients(result)}}


class DetectorAttack(AttackPlan):
    """A detector's attack plan: per ground-truth object, its matched score's worst drop (IoU ≥ ``iou``).

    ``outputs`` must be ``"auto"``: a detector's confidence is its matched detection score.
    """

    task = "detection"
    memo_name = "robustness.adversarial (detection)"

    def __post_init__(self) -> None:
        if self.outputs != "auto":
            raise ConfigError(f"{self.marker}: outputs={self.outputs!r} is for classifiers; a detector's confidence "
                              "is its matched detection score (task='detection'). Fix: drop outputs= for a detector.")
        super().__post_init__()

    def _own_key(self) -> tuple[Any, ...]:
        return (float(self.iou),)

    def assess(self, model: Any, data: Any, *, batch_size: int, device: str, seed: int, shard: Any = None) -> Any:
        """:func:`~.detector.assess_detector_confidence` of the plan (``shard``: this rank's batches)."""
        from pytest_dnnsafety.engines.robustness.detector import assess_detector_confidence

        return assess_detector_confidence(model, data, self.named, self.budget, batch_size=batch_size,
                                          device=device, seed=seed, clip=self.clip, iou=float(self.iou), shard=shard)

    def no_signal(self, result: Any) -> str | None:
        """Why the loss says nothing (:func:`no_detection`), else None."""
        return no_detection(result)

    def loss_report(self, result: Any) -> dict[str, Any]:
        details = {**result.to_details(), "setup": self.setup()}
        details.update(units="ground-truth objects", confidence="matched score", iou=float(self.iou))
        return {"detail": f"{self.setup()}: per object (matched score) {result.detail()}", "details": details}

    def accuracy_report(self, result: Any) -> dict[str, Any]:
        per_family = ", ".join(f"{name} {acc:.3f}" for name, acc in zip(result.family_names, result.robust_accuracy))
        detail = (f"{self.setup()}: {result.robust_accuracy_all:.3f} of the ground-truth objects detected (matched "
                  f"score ≥ 0.5) clean and under every family (clean {result.clean_accuracy:.3f}; {per_family}), "
                  f"n={result.n} objects")
        return {"detail": detail,
                "details": {**result.to_details(), "setup": self.setup(), "units": "ground-truth objects"}}


def gradient_note(model: Any, families: Mapping[str, Any]) -> str | None:
    """For an ONNX model (:class:`~pytest_dnnsafety.files.onnx_model.OnnxModel`) and a gradient family: what the
    gradients are computed on (its graph translated into torch layers, checked against onnxruntime; every prediction
    stays onnxruntime's). The translation is built here, so a graph it cannot go through is refused, its operators
    named, before any model run. None otherwise."""
    from pytest_dnnsafety.files.onnx_model import is_onnx_model

    if not is_onnx_model(model) or not any(getattr(f, "gradient", False) for f in families.values()):
        return None
    translated = model.translated(ConfigError)
    return (f"attack gradients from the ONNX graph translated into torch layers ({translated.onnx_nodes} nodes, "
            f"checked against onnxruntime); predictions from onnxruntime")


def _gradients(result: Any) -> dict[str, str]:
    note = getattr(result, "gradients", None)
    return {"gradients": note} if note else {}


def at_chance(result: Any) -> str | None:
    """Why the confidence loss carries no signal: the clean accuracy is not above chance, else None.

    Eq. (4) of Cheng et al. 2018 averages the drop of ``NN(in)``, the model's probability of the true
    class. A model whose clean decisions are no better than always answering the most frequent label
    (a random-output, constant or untrained model) has no true-class confidence to lose: its loss is
    about 0 however fragile it is. So the one-sided 95 % Clopper–Pearson lower bound on the clean
    accuracy must exceed that chance accuracy (the share of the most frequent label): the relative gates'
    shared precondition (:func:`pytest_dnnsafety.engines.core.signal.chance_lower_bound`), on the attack's clean pass.
    """
    from pytest_dnnsafety.engines.core.signal import chance_lower_bound

    chance = result.chance_accuracy
    if chance is None:
        return None
    correct = round(result.clean_accuracy * result.n)
    lower, above = chance_lower_bound(correct, result.n, chance, CHANCE_CONFIDENCE)
    if above:
        return None
    return (f"the model's clean accuracy {result.clean_accuracy:.3f} ({correct}/{result.n}; "
            f"{CHANCE_CONFIDENCE:.0%} lower bound {lower:.3f}) is not above chance ({chance:.3f}, the share of the "
            "most frequent label), so its true-class probabilities carry no signal and their drop under "
            "perturbation (M_adv, Cheng et al. 2018 eq. 4) is meaningless: a loss near 0 would say nothing about "
            "robustness. Fix: check the model (weights loaded? the right model for this data?) and the data's "
            "labels; gate robustness on a model that is better than chance")


def no_detection(result: Any) -> str | None:
    """A detector's loss carries no signal when it detects no object on the clean images (nothing to lose)."""
    if result.clean_accuracy > 0:
        return None
    return (f"the detector detects none of the {result.n} ground-truth objects on the clean images (no matched "
            "score reaches 0.5), so it has no confidence to lose and its loss (M_adv, Cheng et al. 2018 eq. 4) "
            "would say nothing about robustness. Fix: check the detector (weights loaded? boxes in pixels x1, y1, "
            "x2, y2? the data's classes?) and gate robustness on a detector that finds the objects")


@dataclass(frozen=True)
class VerificationPlan:
    """``min_verified_robustness``'s options: the L∞ radius, the bound method, the range, the PGD steps, memory.

    ``max_memory`` is not in :meth:`key`: chunking never changes the bounds, so gates differing only
    in it share one run.
    """

    eps: float
    method: str = "crown"
    clip: tuple[float, float] | None = None
    attack_steps: int = 20
    max_memory: int | str | None = None

    memo_name: ClassVar[str] = "robustness.verified"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "clip", _clip(self.clip))

    def key(self, seed: int, batch_size: int, device: str) -> tuple[Any, ...]:
        """The plain values a shared run is keyed by (besides the model and the data)."""
        return self.eps, self.method, self.clip, self.attack_steps, seed, batch_size, device

    def verify(self, model: Any, data: Any, *, batch_size: int, device: str, seed: int, shard: Any = None) -> Any:
        """:func:`~.verification.verify_robustness` of the plan, the model in eval mode (its mode restored)."""
        from pytest_dnnsafety.engines.core.guard import eval_mode
        from pytest_dnnsafety.engines.robustness.verification import verify_robustness

        with eval_mode(model):
            return verify_robustness(model, data, self.eps, method=self.method, clip=self.clip, batch_size=batch_size,
                                     device=device, seed=seed, attack_steps=self.attack_steps, shard=shard,
                                     max_memory=self.max_memory)

    @staticmethod
    def details(result: Any, model: Any) -> dict[str, Any]:
        """The result's details, with what the bounds were computed on for a ``torch.export`` program."""
        from pytest_dnnsafety.engines.bounds.export import bounds_model_note

        details = result.to_details()
        note = bounds_model_note(model)  # a torch.export program: the bounds are its translated ATen graph's
        if note:
            details["bounds_model"] = note
        return details
