"""Built-in gate family: DeepQuant safety quantification (``min_safe_radius``; Xu, Ruan, Huang et al., Theorem 1).

The engine is :func:`~pytest_dnnsafety.engines.quantification.quantify_safety`: per input a
safety expression ``s`` (a confidence interval, the uncertainty KL(uniform ‖ f), or the
reachability of a label), a gradient-norm ascent and a derivative-free pattern search (GPS or
MADS polls, batched over inputs) for the Lipschitzian metric ``Q`` over the ball
``B(x, d, p) ∩ clip``, the safe-radius *estimate* ``d' = s(x)/Q ≤ d`` (Theorem 1), and the
radius CROWN/IBP bounds *prove* (``certified``).

The gate compares a lower quantile (``quantile=0``: the minimum) of the per-input radii of the
``statistic``: ``"certified"`` by default — sound: every input's ball of that radius is proved
safe; a model the bounds do not cover makes the gate inconclusive (a fail naming the reason) —
or ``"estimate"`` when the marker asks for it: the search finds a lower bound on ``Q``, so ``d'``
may overstate the true safe radius; it is a heuristic, not a guarantee. Either way, every input
is checked against the nearest adversarial example found (PGD on ``s`` with the gate's budget:
``iterations`` steps, ``starts`` restarts, inside each claimed radius): one inside the gated
radius fails the gate and names the input. The details say which statistic was gated, the PGD
check's counts and the worst inputs with the point ``x̂`` the search found. No torch import at
module level.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import Cost, Workload, per_input
from pytest_dnnsafety.gates.checks import in_range, is_interval, one_of

__all__ = ["MIN_SAFE_RADIUS", "EXPRESSION_NAMES", "pytest_dnnsafety_register_gates"]

#: The safety expressions (:data:`..engines.quantification.EXPRESSIONS`; a test keeps the two equal). Spelled out
#: here so that checking a marker at collection imports no torch.
EXPRESSION_NAMES = ("top_vs_runner_up", "top_vs_label", "top_vs_least", "uncertainty", "reachability")
#: The searches (:data:`..engines.quantification.SEARCH_MODES`) and the input size above which ``search='auto'``
#: never runs the coordinate search (:data:`..engines.quantification.scale.COORDINATE_MAX_DIMS`; tests keep them equal).
SEARCH_NAMES = ("auto", "coordinate", "gradient", "certified")
COORDINATE_MAX_DIMS = 4096


def _settings(opts: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``(safety, search budget, certification, plan)``: the engine's option objects from the marker's options (the
    measure and the cost estimate read the same ones)."""
    from pytest_dnnsafety.engines.quantification import Certification, SafetyProperty, SearchBudget, SearchPlan

    certified = opts["certified"]
    method = "crown" if certified is True else (None if certified is False else certified)
    if opts["statistic"] == "certified" and method is None:
        raise ConfigError("@pytest.mark.min_safe_radius: statistic='certified' (the default) gates the certified "
                          "radius, but certified=False turns it off. Fix: drop certified=False, or gate the heuristic "
                          "estimate explicitly with statistic='estimate' (not a guarantee).")
    safety = SafetyProperty(opts["expression"], d=float(opts["d"]), label=opts["label"], eps=float(opts["eps"]),
                            norm=opts["norm"], clip=opts["clip"])
    search = SearchBudget(opts["method"], opts["iterations"], opts["starts"], float(opts["expansion"]),
                          float(opts["contraction"]), float(opts["mesh_tol"]), ascent_steps=opts["ascent_steps"],
                          ascent_starts=opts["ascent_starts"])
    certification = None if method is None else Certification(method, opts["certified_steps"])
    plan = SearchPlan(opts["search"], opts["max_queries"], opts["attack_steps"], auto_bound=certified is True)
    return safety, search, certification, plan


def _measure_safe_radius(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The ``quantile`` of the per-input certified radii (or, asked for, the estimates d' = s(x)/Q; Theorem 1).

    Under torchrun each rank searches its shard of the data's batches (``ctx.shard``; the draws
    are keyed by the global input index) and the per-input results are all-gathered, so every
    rank gets the single-process result.
    """
    from pytest_dnnsafety.engines.core.guard import eval_mode
    from pytest_dnnsafety.engines.quantification import GatedRadius, quantify_safety

    opts = spec.options
    safety, search, certification, plan = _settings(opts)
    gated = GatedRadius(opts["statistic"], float(opts["quantile"]), opts["worst"])
    with eval_mode(fx["model"]):
        result = quantify_safety(fx["model"], fx["data"], safety, search, certification, gated, seed=ctx.seed,
                                 batch_size=ctx.batch_size, device=ctx.device, outputs=opts["outputs"],
                                 shard=ctx.shard(fx["data"]), plan=plan)
    return Measurement(value=result.value, detail=result.detail(), details=result.to_details(),
                       inconclusive=result.inconclusive, contradiction=result.contradiction)


def _cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """The engine's own per-input estimate (:func:`~pytest_dnnsafety.engines.quantification.scale.resolve_search`:
    the search ``search='auto'`` picks for this input size, its certificate's method) × the inputs. A search over
    ``max_queries`` is refused here — before the time budget, which depends on a probed (and noisy) time."""
    from pytest_dnnsafety.engines.quantification import resolve_search

    _, search, certification, plan = _settings(options)
    method, steps = (None, 0) if certification is None else (certification.method, certification.steps)
    mode, queries, what, _ = resolve_search(plan, work.dims, search, method, steps)
    knobs = (("iterations", "starts", "ascent_starts", "ascent_steps", "certified_steps", "search")
             if mode == "coordinate" else ("attack_steps", "certified_steps", "search"))
    return per_input(queries, f"search={mode!r}: {what}", knobs)(work)


# ------------------------------------------------------------------------------------- marker keywords


def _positive(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value < math.inf else f"{value!r} must be a positive finite number"


def _non_negative(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 <= value < math.inf else f"{value!r} must be a finite number >= 0"


def _label(value: Any) -> str | None:
    return None if value is None or value >= 0 else f"{value!r} is not a class index (an integer >= 0)"


def _certified(value: Any) -> str | None:
    return None if isinstance(value, bool) or value in ("crown", "ibp") else (
        f"{value!r} is not True, False, 'crown' or 'ibp'")


def _expansion(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 1 <= value < math.inf else f"{value!r} must be a finite number >= 1"


def _contraction(value: Any) -> str | None:
    if isinstance(value, float) and math.isnan(value):
        return "is NaN"
    return None if 0 < value < 1 else f"{value!r} must lie strictly between 0 and 1"


MIN_SAFE_RADIUS = GateDef(
    marker="min_safe_radius",
    metric="safe radius",
    op=">=",
    threshold_range=(0.0, math.inf),
    params=(
        Param("expression", (str,), "top_vs_runner_up", one_of(*EXPRESSION_NAMES),
              "name a safety expression: " + ", ".join(EXPRESSION_NAMES)),
        Param("label", (int, type(None)), None, _label,
              "give the class index for top_vs_label (required) or reachability (default: each input's top class)"),
        Param("norm", (str,), "linf", one_of("linf", "l2", "l1"), "use 'linf', 'l2' or 'l1'"),
        Param("d", (int, float), REQUIRED, _positive,
              "give the ball's radius in input units as a positive number, e.g. d=0.1 for inputs in [0, 1]"),
        Param("eps", (int, float), 0.0, _non_negative,
              "give the required margin ε >= 0 (a probability for the confidence intervals and reachability, "
              "a KL divergence in nats for uncertainty), e.g. eps=0.0"),
        Param("quantile", (int, float), 0.0, in_range(0.0, 1.0),
              "give the quantile of the per-input estimates to gate, in [0, 1] (0: the minimum)"),
        Param("method", (str,), "gps", one_of("gps", "mads"),
              "use 'gps' (coordinate polls) or 'mads' (random orthogonal polls)"),
        Param("iterations", (int,), 100, in_range(1, 1_000_000),
              "give the most polls per search, e.g. iterations=100 (the authors used 1500)"),
        Param("starts", (int,), 2, in_range(1, 64),
              "give the searches per input, e.g. starts=2 (from x with a coarse and a fine mesh; more add random "
              "start points)"),
        Param("clip", (list, tuple, type(None)), (0.0, 1.0), is_interval,
              "give the inputs' valid range, e.g. clip=(0, 1), or None for no range"),
        Param("certified", (bool, str), True, _certified,
              "True (CROWN bounds), 'ibp' (interval bounds) or False (no certified radius)"),
        Param("statistic", (str,), "certified", one_of("certified", "estimate"),
              "use 'certified' (the radius the bounds prove, the default) or 'estimate' (the heuristic s(x)/Q, "
              "not a guarantee)"),
        Param("ascent_starts", (int,), 4, in_range(0, 64),
              "give the gradient-norm ascents per input that seed Q, e.g. ascent_starts=4 (0: none)"),
        Param("ascent_steps", (int,), 10, in_range(0, 10_000),
              "give the steps of each gradient-norm ascent, e.g. ascent_steps=10"),
        Param("certified_steps", (int,), 10, in_range(0, 40),
              "give the bisection steps of the certified radius, e.g. certified_steps=10 (resolution d/1024)"),
        Param("search", (str,), "auto", one_of(*SEARCH_NAMES),
              "use 'auto' (the coordinate search for inputs of at most 4096 elements within max_queries, else "
              "'gradient'), 'coordinate' (DeepQuant's pattern search: 2n+1 forwards per poll), 'gradient' (a batched "
              "minimum-norm attack: an upper-bound-style estimate) or 'certified' (the sound bounds only)"),
        Param("max_queries", (int,), 2_000_000, in_range(1, 10**15),
              "give the most single-input forwards per input the search may cost (a gradient step counts 3), e.g. "
              "max_queries=2000000; a search estimated above it is refused before any work"),
        Param("attack_steps", (int,), 10, in_range(0, 100_000),
              "give the gradient steps of the minimum-norm attack (search='gradient') or of the PGD check "
              "(search='certified'), e.g. attack_steps=10"),
        Param("worst", (int,), 5, in_range(0, 1000), "give how many of the worst inputs the details list"),
        Param("outputs", (str,), "auto", one_of("auto", "logits", "probabilities"),
              "say what the model returns: auto (detected), logits or probabilities"),
        Param("expansion", (int, float), 1.3, _expansion, "give the mesh expansion on success, e.g. 1.3"),
        Param("contraction", (int, float), 0.8, _contraction, "give the mesh contraction on failure, e.g. 0.8"),
        Param("mesh_tol", (int, float), 1e-5, _positive, "give the mesh size at which a search stops, e.g. 1e-5"),
    ),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_safe_radius,
    cost=_cost,
    shards=True,  # each rank searches its share of the batches; the per-input results are all-gathered
    doc="fail unless the `quantile` (default: the minimum) of the per-input safe radii reaches `threshold` "
        "(input units): by default the radii CROWN/IBP prove (`statistic='certified'`), or with "
        "`statistic='estimate'` DeepQuant's d' = s(x)/Q, Q the Lipschitz metric found by gradient-norm ascent "
        "and pattern search (a heuristic, not a guarantee) — above 4096 input elements `search='auto'` runs a batched "
        "minimum-norm attack instead (its estimate an upper bound on the minimal adversarial radius), and a search "
        "estimated above `max_queries` forwards per input is refused; every input is checked by PGD: an adversarial "
        "example inside its gated radius fails the gate",
)


#: The quantification family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("quantification", "Safe radius (DeepQuant)", (MIN_SAFE_RADIUS,), order=100)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
