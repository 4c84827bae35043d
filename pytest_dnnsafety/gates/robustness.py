"""Built-in gate family: robustness (``max_adversarial_confidence_loss``, ``min_robust_accuracy``,
``min_verified_robustness``).

Engines in :mod:`..engines.robustness`: perturbation families (gradient attacks and natural
perturbations), the adversarial confidence loss of Cheng et al. 2018 (§II-D, eq. 4), and certified
bounds (IBP, CROWN-IBP, CROWN; ``method="auto"`` picks per input by a cost estimate) with a PGD search for
counterexamples run before the tighter bounds. The two empirical gates share one
measurement when they name the same model, data and perturbations (one run of the families, not
one per gate). ``max_adversarial_confidence_loss`` is *inconclusive* when the model's clean accuracy is
not above chance (the share of the most frequent label, by a one-sided 95 % Clopper–Pearson lower
bound): a random-output or constant model has no true-class confidence to lose, so its loss near 0
is no evidence of robustness. Detectors (``task='detection'``): per ground-truth object, the confidence is
its matched score (the best same-class detection with IoU ≥ ``iou``, Cheng et al. 2018 §II-F step 2), the
natural families perturb the images and the gradient families (fgsm, pgd) descend the sum of each
image's matched scores (:mod:`..engines.robustness.detector`); robust accuracy is then the share of
objects detected (matched score ≥ 0.5) clean and under every family, and the loss is inconclusive when
no object is detected on the clean images (no confidence to lose). Under torchrun every gate measures its
rank's shard of the batches and the ranks' states are all-reduced (the single-process values). No torch
import at module level.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_families, plot_verdicts
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import attack_cost, verified_cost
from pytest_dnnsafety.gates.checks import in_range, is_interval, one_of

__all__ = [
    "MAX_ADVERSARIAL_CONFIDENCE_LOSS", "MIN_ROBUST_ACCURACY", "MIN_VERIFIED_ROBUSTNESS",
    "pytest_dnnsafety_register_gates",
]


def _measure_attack(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """``max_adversarial_confidence_loss``: the adversarial confidence loss −M_adv (Cheng et al. 2018, §II-D,
    eq. 4) over the marker's families, inconclusive when it carries no signal
    (:meth:`~..engines.robustness.plan.ClassifierAttack.no_signal`: a clean accuracy not above chance; a detector
    that detects no object). ``min_robust_accuracy``: the share of inputs classified correctly clean and under
    every family (the worst case per input). Gates with the same families share one run."""
    from pytest_dnnsafety.engines.robustness.plan import AttackPlan

    plan = AttackPlan.for_task(ctx.task, spec.marker, spec.options)
    result = ctx.memo(plan.memo_name, (fx["model"], fx["data"], *plan.callables),
                      plan.key(ctx.seed, ctx.batch_size, ctx.device),
                      lambda: plan.assess(fx["model"], fx["data"], batch_size=ctx.batch_size, device=ctx.device,
                                          seed=ctx.seed, shard=ctx.shard(fx["data"])))
    if spec.marker == "min_robust_accuracy":
        return Measurement(value=result.robust_accuracy_all, **plan.accuracy_report(result))
    return Measurement(value=result.loss, inconclusive=plan.no_signal(result), **plan.loss_report(result))


def _measure_verified(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Share of inputs whose prediction is certified constant and correct in the L∞ ball (IBP / CROWN-IBP / CROWN)."""
    from pytest_dnnsafety.engines.robustness.plan import VerificationPlan

    opts = spec.options
    plan = VerificationPlan(opts["eps"], opts["method"], opts["clip"], opts["attack_steps"], opts["max_memory"])
    result = ctx.memo(plan.memo_name, (fx["model"], fx["data"]), plan.key(ctx.seed, ctx.batch_size, ctx.device),
                      lambda: plan.verify(fx["model"], fx["data"], batch_size=ctx.batch_size, device=ctx.device,
                                          seed=ctx.seed, shard=ctx.shard(fx["data"])))
    return Measurement(value=result.verified_share, detail=result.detail(), details=plan.details(result, fx["model"]))


# ------------------------------------------------------------------------------------- marker keywords

#: The built-in perturbation families (:data:`..engines.robustness.perturbations.FAMILIES`; a test keeps
#: the two equal). Spelled out here so that checking a marker at collection imports no torch.
FAMILY_NAMES = ("fgsm", "fgsm_l2", "pgd", "pgd_l2", "gaussian_noise", "brightness", "contrast", "blur", "rotation",
                "translation", "occlusion")


def _positive(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value < math.inf else f"{value!r} must be a positive finite number"


def _family_list(value: Any) -> str | None:
    if not value:
        return "is empty; name at least one family"
    for item in value:
        if isinstance(item, str):
            if item not in FAMILY_NAMES:
                return f"unknown family {item!r}; known: {', '.join(FAMILY_NAMES)}"
        elif not callable(item):
            return f"{item!r} is neither a family name nor a callable (model, x, y, eps, generator) -> x'"
    return None


def _iou(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value <= 1 else f"{value!r} is outside (0, 1]"


def _budget_map(value: Any) -> str | None:
    if value is None:
        return None
    for name, budget in value.items():
        if not isinstance(name, str):
            return f"keys must be family names, got {name!r}"
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or _positive(budget):
            return f"the budget of {name!r} must be a positive finite number, got {budget!r}"
    return None


def _memory(value: Any) -> str | None:
    from pytest_dnnsafety.runtime.sizes import memory_problem

    return None if value is None else memory_problem(value)


_CLIP = Param("clip", (list, tuple, type(None)), None, is_interval,
              "give the inputs' valid range, e.g. clip=(0, 1); perturbed inputs are clamped into it")
_EMPIRICAL = (
    Param("eps", (int, float, type(None)), REQUIRED, _positive,
          "give the perturbation budget as a positive number, in each family's own unit (see the family table in "
          "docs/gates/robustness.md), e.g. eps=0.1; or eps=None with budgets={family: value} for every family"),
    Param("families", (list, tuple), ("fgsm", "pgd"), _family_list,
          f"list family names ({', '.join(FAMILY_NAMES)}) or callables (model, x, y, eps, generator) -> x'"),
    Param("budgets", (dict, type(None)), None, _budget_map,
          "map family names to their own budgets, e.g. budgets={'rotation': 15, 'blur': 0.8}"),
    _CLIP,
    Param("outputs", (str,), "auto", one_of("auto", "logits", "probabilities"),
          "say what the model returns: auto (detected), logits or probabilities"),
    Param("steps", (int,), 10, in_range(1, 10_000), "give the number of PGD steps, e.g. steps=10"),
    Param("iou", (int, float), 0.5, _iou,
          "give the IoU (detectors only) a detection needs with an object's box to count as its match, in (0, 1], "
          "e.g. iou=0.5"),
)

MAX_ADVERSARIAL_CONFIDENCE_LOSS = GateDef(
    marker="max_adversarial_confidence_loss",
    metric="adversarial confidence loss",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=_EMPIRICAL,
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_attack,
    cost=attack_cost,
    tasks=("single-label", "detection"),
    shards=True,  # each rank its share of the batches (seeded by the global batch), states all-reduced
    doc="fail if the mean over inputs of the worst family's drop in the true class's probability exceeds "
        "`threshold` (−M_adv, Cheng et al. 2018, eq. 4)",
)

MIN_ROBUST_ACCURACY = GateDef(
    marker="min_robust_accuracy",
    metric="robust accuracy",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=_EMPIRICAL,
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_attack,
    cost=attack_cost,
    tasks=("single-label", "detection"),
    shards=True,  # shares the confidence-loss measurement and its shard
    doc="fail unless at least `threshold` of the inputs are classified correctly clean and under every "
        "perturbation family at its budget",
)

MIN_VERIFIED_ROBUSTNESS = GateDef(
    marker="min_verified_robustness",
    metric="verified robustness",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(
        Param("eps", (int, float), REQUIRED, _positive,
              "give the L∞ radius in input units as a positive number, e.g. eps=0.02"),
        Param("method", (str,), "auto", one_of("auto", "crown", "crown-ibp", "ibp"),
              "auto (full CROWN where its estimated cost is small, else crown-ibp), crown (tightest; cost grows "
              "with the unstable neurons), crown-ibp (interval bounds inside, one CROWN pass from the margins: "
              "cost grows with the network's size) or ibp (interval bounds, fastest, loosest)"),
        _CLIP,
        Param("attack_steps", (int,), 20, in_range(0, 10_000),
              "give the PGD steps used to find counterexamples for inputs that are not verified (0: none)"),
        Param("max_memory", (int, str, type(None)), None, _memory,
              "give the bounds' working-memory budget as bytes or a size such as max_memory='2GiB' or '512MiB' "
              "(at least 16 MiB; default 1 GiB); CROWN chunks its work over inputs and bounded rows to stay within "
              "it, which changes its speed, never its bounds"),
    ),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_verified,
    cost=verified_cost,
    shards=True,  # each rank its share of the batches; counts, margins, counterexamples all-reduced
    doc="fail unless at least `threshold` of the inputs are verified: the true class's certified lower "
        "bound beats every other class in the whole L∞ ball of radius eps (IBP, CROWN-IBP or CROWN bounds)",
)


#: The robustness family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("robustness", "Robustness",
                (MAX_ADVERSARIAL_CONFIDENCE_LOSS, MIN_ROBUST_ACCURACY, MIN_VERIFIED_ROBUSTNESS),
                plots={"families": plot_families, "verdicts": plot_verdicts}, order=40)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
