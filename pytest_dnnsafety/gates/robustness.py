"""Built-in gate family: robustness (``max_adversarial_confidence_loss``, ``min_robust_accuracy``,
``min_verified_robustness``).

Engines in :mod:`..engines.robustness`: perturbation families (gradient attacks and natural
perturbations), the adversarial confidence loss of Cheng et al. 2018 (§II-D, eq. 4), and certified
bounds (IBP, CROWN) with a PGD search for counterexamples. The two empirical gates share one
measurement when they name the same model, data and perturbations (one run of the families, not
one per gate). ``max_adversarial_confidence_loss`` is *inconclusive* when the model's clean accuracy is
not above chance (the share of the most frequent label, by a one-sided 95 % Clopper–Pearson lower
bound): a random-output or constant model has no true-class confidence to lose, so its loss near 0
is no evidence of robustness. Detectors (``task='detection'``): per ground-truth object, the confidence is
its matched score (the best same-class detection with IoU ≥ ``iou``, Cheng et al. 2018 §II-F step 2), the
natural families perturb the images and the gradient families (fgsm, pgd) descend the sum of each
image's matched scores (:mod:`..engines.robustness.detection`); robust accuracy is then the share of
objects detected (matched score ≥ 0.5) clean and under every family, and the loss is inconclusive when
no object is detected on the clean images (no confidence to lose). Under torchrun every gate measures its
rank's shard of the batches and the ranks' states are all-reduced (the single-process values). No torch
import at module level.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, is_interval, one_of

__all__ = [
    "MAX_ADVERSARIAL_CONFIDENCE_LOSS", "MIN_ROBUST_ACCURACY", "MIN_VERIFIED_ROBUSTNESS",
    "pytest_dnnsafety_register_gates",
]


def _family_key(family: Any) -> str:
    from pytest_dnnsafety.engines.robustness.perturbations import family_name

    return family_name(family)


def _families(spec: GateSpec) -> dict[str, Any]:
    """The marker's families as name -> callable, each with its budget checked."""
    from pytest_dnnsafety.engines.robustness.perturbations import make_family

    opts = spec.options
    out: dict[str, Any] = {}
    for item in opts["families"]:
        if isinstance(item, str):
            options = {"steps": opts["steps"]} if item.startswith("pgd") else {}
            family = make_family(item, clip=_clip(opts), outputs=opts["outputs"], **options)
        else:
            family = item
        name = _family_key(family)
        if name in out:
            raise ConfigError(f"{spec.marker}: family {name!r} is listed twice in families=. Fix: list it once.")
        out[name] = family
    unknown = sorted(set(opts["budgets"] or {}) - set(out))
    if unknown:
        raise ConfigError(f"{spec.marker}: budgets= names {unknown}, which are not in families={list(out)}. Fix: "
                          f"give budgets only for listed families.")
    return out


def _budgets(spec: GateSpec, names: list[str]) -> dict[str, float]:
    opts = spec.options
    given = dict(opts["budgets"] or {})
    missing = [name for name in names if name not in given and opts["eps"] is None]
    if missing:
        raise ConfigError(f"{spec.marker}: no budget for {missing}: eps= is not set and budgets= does not name "
                          f"them. Fix: give eps=... (the budget of every family) or budgets={{name: value}}.")
    return {name: float(given.get(name, opts["eps"])) for name in names}


def _clip(opts: Mapping[str, Any]) -> tuple[float, float] | None:
    return None if opts["clip"] is None else (float(opts["clip"][0]), float(opts["clip"][1]))


def _adversarial(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """The adversarial confidence result of the gate's model, data and families (shared between gates).

    Memoised by the objects (model, data, the user's family callables) and the values that set the
    measurement; under torchrun each rank measures its shard of the batches (:meth:`GateContext.shard`).
    """
    from pytest_dnnsafety.engines.robustness.confidence import assess_adversarial_confidence

    if ctx.task == "detection":
        return _detector_adversarial(spec, fx, ctx)
    families = _families(spec)
    budgets = _budgets(spec, list(families))
    opts = spec.options
    callables = tuple(item for item in opts["families"] if not isinstance(item, str))
    values = (tuple(budgets.items()), tuple(item if isinstance(item, str) else None for item in opts["families"]),
              _clip(opts), opts["outputs"], opts["steps"], ctx.seed, ctx.batch_size, ctx.device)
    return ctx.memo("robustness.adversarial", (fx["model"], fx["data"], *callables), values, lambda: (
        assess_adversarial_confidence(fx["model"], fx["data"], families, budgets, batch_size=ctx.batch_size,
                                      device=ctx.device, seed=ctx.seed, clip=_clip(opts), outputs=opts["outputs"],
                                      shard=ctx.shard(fx["data"]))))


def _detector_adversarial(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """A detector's adversarial confidence per ground-truth object (shared between the two empirical gates)."""
    from pytest_dnnsafety.engines.robustness.detector import assess_detector_confidence

    opts = spec.options
    if opts["outputs"] != "auto":
        raise ConfigError(f"{spec.marker}: outputs={opts['outputs']!r} is for classifiers; a detector's confidence is "
                          "its matched detection score (task='detection'). Fix: drop outputs= for a detector.")
    families = _families(spec)
    budgets = _budgets(spec, list(families))
    callables = tuple(item for item in opts["families"] if not isinstance(item, str))
    values = (tuple(budgets.items()), tuple(item if isinstance(item, str) else None for item in opts["families"]),
              _clip(opts), float(opts["iou"]), ctx.seed, ctx.batch_size, ctx.device)
    return ctx.memo("robustness.adversarial (detection)", (fx["model"], fx["data"], *callables), values, lambda: (
        assess_detector_confidence(fx["model"], fx["data"], families, budgets, batch_size=ctx.batch_size,
                                   device=ctx.device, seed=ctx.seed, clip=_clip(opts), iou=float(opts["iou"]),
                                   shard=ctx.shard(fx["data"]))))


def _no_detection(result: Any) -> str | None:
    """A detector's loss carries no signal when it detects no object on the clean images (nothing to lose)."""
    if result.clean_accuracy > 0:
        return None
    return (f"the detector detects none of the {result.n} ground-truth objects on the clean images (no matched "
            "score reaches 0.5), so it has no confidence to lose and its loss (M_adv, Cheng et al. 2018 eq. 4) "
            "would say nothing about robustness. Fix: check the detector (weights loaded? boxes in pixels x1, y1, "
            "x2, y2? the data's classes?) and gate robustness on a detector that finds the objects")


def _setup(spec: GateSpec) -> str:
    opts = spec.options
    parts = [f"ε={opts['eps']:g}" if opts["eps"] is not None else "per-family budgets"]
    if opts["budgets"]:
        parts.append(", ".join(f"{k}={v:g}" for k, v in opts["budgets"].items()))
    if opts["clip"] is not None:
        parts.append(f"clip=[{opts['clip'][0]:g}, {opts['clip'][1]:g}]")
    return "; ".join(parts)


#: One-sided confidence of the lower bound on the clean accuracy that must exceed chance (no-signal check).
CHANCE_CONFIDENCE = 0.95


def _at_chance(result: Any) -> str | None:
    """Why the confidence loss carries no signal: the clean accuracy is not above chance, else None.

    Eq. (4) of Cheng et al. 2018 averages the drop of ``NN(in)``, the model's probability of the true
    class. A model whose clean decisions are no better than always answering the most frequent label
    (a random-output, constant or untrained model) has no true-class confidence to lose: its loss is
    about 0 however fragile it is. So the one-sided 95 % Clopper–Pearson lower bound on the clean
    accuracy must exceed that chance accuracy (the share of the most frequent label).
    """
    from pytest_dnnsafety.stats.intervals import clopper_pearson_lower

    chance = result.chance_accuracy
    if chance is None:
        return None
    correct = round(result.clean_accuracy * result.n)
    lower = float(clopper_pearson_lower([correct], result.n, CHANCE_CONFIDENCE)[0])
    if lower > chance:
        return None
    return (f"the model's clean accuracy {result.clean_accuracy:.3f} ({correct}/{result.n}; "
            f"{CHANCE_CONFIDENCE:.0%} lower bound {lower:.3f}) is not above chance ({chance:.3f}, the share of the "
            "most frequent label), so its true-class probabilities carry no signal and their drop under "
            "perturbation (M_adv, Cheng et al. 2018 eq. 4) is meaningless: a loss near 0 would say nothing about "
            "robustness. Fix: check the model (weights loaded? the right model for this data?) and the data's "
            "labels; gate robustness on a model that is better than chance")


def _measure_confidence_loss(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Adversarial confidence loss −M_adv (Cheng et al. 2018, §II-D, eq. 4) over the marker's families.

    Inconclusive when the clean accuracy is not above chance (:func:`_at_chance`): no signal, no pass.
    """
    result = _adversarial(spec, fx, ctx)
    details = {**result.to_details(), "setup": _setup(spec)}
    if ctx.task == "detection":
        details.update(units="ground-truth objects", confidence="matched score", iou=float(spec.options["iou"]))
        return Measurement(value=result.loss, detail=f"{_setup(spec)}: per object (matched score) {result.detail()}",
                           details=details, inconclusive=_no_detection(result))
    return Measurement(value=result.loss, detail=f"{_setup(spec)}: {result.detail()}", details=details,
                       inconclusive=_at_chance(result))


def _measure_robust_accuracy(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Share of inputs classified correctly clean and under every family (the worst case per input)."""
    result = _adversarial(spec, fx, ctx)
    per_family = ", ".join(f"{name} {acc:.3f}" for name, acc in zip(result.family_names, result.robust_accuracy))
    if ctx.task == "detection":
        detail = (f"{_setup(spec)}: {result.robust_accuracy_all:.3f} of the ground-truth objects detected (matched "
                  f"score ≥ 0.5) clean and under every family (clean {result.clean_accuracy:.3f}; {per_family}), "
                  f"n={result.n} objects")
        details = {**result.to_details(), "setup": _setup(spec), "units": "ground-truth objects"}
        return Measurement(value=result.robust_accuracy_all, detail=detail, details=details)
    detail = (f"{_setup(spec)}: robust accuracy {result.robust_accuracy_all:.3f} under all families "
              f"(clean {result.clean_accuracy:.3f}; {per_family}), n={result.n}")
    details = {**result.to_details(), "setup": _setup(spec)}
    return Measurement(value=result.robust_accuracy_all, detail=detail, details=details)


def _measure_verified(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Share of inputs whose prediction is certified constant and correct in the L∞ ball (IBP / CROWN)."""
    from pytest_dnnsafety.engines.bounds.export import bounds_model_note
    from pytest_dnnsafety.engines.robustness.verification import verify_robustness
    from pytest_dnnsafety.engines.core.guard import eval_mode

    opts = spec.options

    def measure() -> Any:
        with eval_mode(fx["model"]):
            return verify_robustness(fx["model"], fx["data"], float(opts["eps"]), method=opts["method"],
                                     clip=_clip(opts), batch_size=ctx.batch_size, device=ctx.device, seed=ctx.seed,
                                     attack_steps=opts["attack_steps"], shard=ctx.shard(fx["data"]),
                                     max_memory=opts["max_memory"])

    # max_memory is not in the key: chunking never changes the bounds, so gates differing only in it share one run
    values = (float(opts["eps"]), opts["method"], _clip(opts), opts["attack_steps"], ctx.seed, ctx.batch_size,
              ctx.device)
    result = ctx.memo("robustness.verified", (fx["model"], fx["data"]), values, measure)
    details = result.to_details()
    note = bounds_model_note(fx["model"])  # a torch.export program: the bounds are its translated ATen graph's
    if note:
        details["bounds_model"] = note
    return Measurement(value=result.verified_share, detail=result.detail(), details=details)


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
    measure=_measure_confidence_loss,
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
    measure=_measure_robust_accuracy,
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
        Param("method", (str,), "crown", one_of("crown", "ibp"),
              "crown (linear relaxation, tighter) or ibp (interval bounds, faster)"),
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
    shards=True,  # each rank its share of the batches; counts, margins, counterexamples all-reduced
    doc="fail unless at least `threshold` of the inputs are verified: the true class's certified lower "
        "bound beats every other class in the whole L∞ ball of radius eps (IBP or CROWN bounds)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_ADVERSARIAL_CONFIDENCE_LOSS)
    registry.add(MIN_ROBUST_ACCURACY)
    registry.add(MIN_VERIFIED_ROBUSTNESS)
