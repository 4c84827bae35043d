"""Cost before work: what a gate will take, estimated before it measures, and the ``max_seconds`` budget.

A gate's :attr:`~pytest_dnnsafety.gates.core.GateDef.cost` says its work in *single-input model forwards*
(one input through the model once; a gradient step counts :data:`GRADIENT` forwards) plus its engine's own
seconds (:class:`Cost`), from its validated options and the :class:`Workload` (inputs, input shape, batch
size). The evaluation measures the time of one forward per input with a short probe on the gate's own model
and data (:func:`probe`: the fastest of two timed forwards of a few inputs, once per session per (model, data)),
multiplies (:class:`Estimate`), shows the estimate on the progress line, records it in the evidence
(``details.cost_estimate``) and refuses a gate whose estimate exceeds ``max_seconds`` (:func:`check_budget`)
before it does any work — after a second, longer probe confirms it (a busy moment must not refuse a gate). No torch import at module level.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pytest_dnnsafety.errors import ConfigError

__all__ = ["GRADIENT", "PROBE_INPUTS", "Cost", "Workload", "Estimate", "BudgetError", "one_pass", "per_input",
           "probe", "estimate_for", "over_budget", "check_budget"]

#: Forwards one gradient step costs (a forward and a backward, the backward about twice a forward).
GRADIENT = 3.0
#: Inputs in the probe's batch.
PROBE_INPUTS = 4


@dataclass(frozen=True)
class Workload:
    """What a cost function knows before the gate runs: the data's inputs (after ``sample=``), one input's
    shape (None when unknown) and the gate's batch size; when the probe ran, the gate's ``model`` and the first
    inputs it probed (``example``, on the model's device) — for a hook whose cost depends on the values (the bounds'
    unstable neurons)."""

    n: int
    shape: tuple[int, ...] | None = None
    batch_size: int = 256
    model: Any = None
    example: Any = None

    @property
    def dims(self) -> int:
        """Elements of one input (1 when its shape is unknown)."""
        return math.prod(self.shape) if self.shape else 1


@dataclass(frozen=True)
class Cost:
    """A gate's work: ``forwards`` single-input model forwards plus ``extra_seconds`` of its engine's own work;
    ``what`` says where they come from (shown in the refusal); ``knobs`` the gate's keywords that shrink it."""

    forwards: float
    extra_seconds: float = 0.0
    what: str = ""
    knobs: tuple[str, ...] = ()


def one_pass(options: Mapping[str, Any], work: Workload) -> Cost:
    """The default cost: one forward per input."""
    return Cost(float(work.n), what=f"one pass over {work.n} inputs")


def per_input(forwards: float, what: str, knobs: tuple[str, ...] = (), extra_per_input: float = 0.0
              ) -> Callable[[Workload], Cost]:
    """``work -> Cost``: ``forwards`` per input (and ``extra_per_input`` engine seconds), for a family's hook."""
    def cost(work: Workload) -> Cost:
        return Cost(forwards * work.n, extra_per_input * work.n, f"{what} per input × {work.n} inputs", knobs)
    return cost


@dataclass(frozen=True)
class Estimate:
    """The estimated seconds of a gate: forwards × probed seconds per forward + engine seconds."""

    cost: Cost
    per_forward: float | None  # seconds of one single-input forward (None: no model to probe)
    probe_inputs: int = 0

    @property
    def seconds(self) -> float:
        return self.cost.forwards * (self.per_forward or 0.0) + self.cost.extra_seconds

    def to_details(self) -> dict[str, Any]:
        return {"estimated_seconds": round(self.seconds, 3), "forwards": round(self.cost.forwards),
                "seconds_per_forward": None if self.per_forward is None else float(f"{self.per_forward:.4g}"),
                "engine_seconds": round(self.cost.extra_seconds, 3), "probe_inputs": self.probe_inputs,
                "work": self.cost.what}

    def text(self) -> str:
        """``estimate 2m10s (80,000 forwards × 1.6 ms + 2s engine)``."""
        parts = []
        if self.per_forward is not None and self.cost.forwards:
            parts.append(f"{self.cost.forwards:,.0f} forwards × {_short(self.per_forward)}")
        if self.cost.extra_seconds:
            parts.append(f"{_short(self.cost.extra_seconds)} engine")
        return f"{_short(self.seconds)} ({' + '.join(parts) or 'no model work'})"


class BudgetError(ConfigError):
    """A gate's estimate exceeds ``max_seconds``: refused before it measures. ``details`` holds the estimate."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.details = details


def _short(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def probe(model: Any, data: Any, device: str, *, seconds: float = 0.0, timings: int = 2
          ) -> tuple[float, int, tuple[int, ...] | None, Any] | None:
    """``(seconds per single-input forward, inputs probed, one input's shape, the inputs)``: the fastest timed forward
    of the data's first :data:`PROBE_INPUTS` inputs, or None when the model or data cannot be probed (the gate's own
    run then names the problem).

    One untimed warm-up, then two timed forwards (three in all: what every gate pays), more while their total stays
    under ``seconds`` (at most ``timings``; the confirming probe before a refusal asks for more): on a busy machine a
    forward can wait a whole scheduler slice, and noise only ever adds time, so the fastest of several is the
    forward's own cost."""
    import torch

    from pytest_dnnsafety.data.forms import iter_batches
    from pytest_dnnsafety.engines.core import guard
    from pytest_dnnsafety.engines.core.runner import model_device

    # like the determinism guard's probe passes, these are not the gate's work: a forward hook that records skips
    # them when guard.probing() is True
    token = guard._PROBING.set(True)
    try:
        x, _ = next(iter(iter_batches(data, PROBE_INPUTS)))
        x = x[:PROBE_INPUTS]
        x = (x if x.is_floating_point() else x.float()).to(model_device(model, device))
        if not callable(model) or x.shape[0] == 0:
            return None
        times: list[float] = []
        with torch.no_grad():
            model(x)  # warm-up
            while len(times) < 2 or (len(times) < timings and sum(times) < seconds):
                start = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - start)
        return min(times) / x.shape[0], int(x.shape[0]), tuple(int(s) for s in x.shape[1:]), x
    except Exception:  # noqa: BLE001 - no estimate; the gate itself meets and names the problem
        return None
    finally:
        guard._PROBING.reset(token)


def over_budget(estimate: Estimate, budget: Any) -> bool:
    """Whether ``estimate`` exceeds the ``max_seconds`` setting ``budget`` (0 or None: no limit)."""
    limit = getattr(budget, "value", budget)
    return bool(limit) and estimate.seconds > limit


def estimate_for(cost_fn: Callable[[Mapping[str, Any], Workload], Cost] | None, options: Mapping[str, Any],
                 work: Workload, per_forward: float | None, probe_inputs: int = 0, marker: str = "?") -> Estimate:
    """The gate's :class:`Estimate`; a cost function that raises or returns no :class:`Cost` is a definition error."""
    from pytest_dnnsafety.gates.core import GateDefinitionError

    fn = cost_fn or one_pass
    try:
        cost = fn(options, work)
    except ConfigError:  # the options refused for this workload (a search over max_queries): the gate's error
        raise
    except Exception as exc:  # noqa: BLE001 - a gate's function: named in the error
        raise GateDefinitionError(f"gate {marker!r}: its cost(options, workload) raised {type(exc).__name__}: {exc}. Fix the GateDef: "
                                  "cost returns pytest_dnnsafety.gates.cost.Cost(forwards, extra_seconds)") from None
    if not isinstance(cost, Cost) or not all(math.isfinite(v) and v >= 0 for v in (cost.forwards, cost.extra_seconds)):
        raise GateDefinitionError(f"gate {marker!r}: its cost(options, workload) gave {cost!r}, not a Cost of finite non-negative "
                                  "forwards and seconds. Fix the GateDef")
    return Estimate(cost, per_forward, probe_inputs)


def check_budget(estimate: Estimate, marker: str, budget: Any, sample: Any, n: int) -> None:
    """Raise :class:`BudgetError` when the estimate exceeds the ``max_seconds`` setting ``budget`` (a resolved setting;
    value 0 or None: no limit), naming the estimate, the budget and where it came from, and the knobs that shrink it."""
    if not over_budget(estimate, budget):
        return
    limit = getattr(budget, "value", budget)
    source = getattr(budget, "source", "the setting")
    knobs = [f"sample=N (a seeded subsample: the data has {n} inputs"
             + (f", already sampled to {sample}" if sample else "") + ")", "fewer images in the data fixture"]
    if estimate.cost.knobs:
        knobs.append("fewer or smaller " + ", ".join(f"{k}=" for k in estimate.cost.knobs))
    knobs.append(f"or raise the budget: @pytest.mark.{marker}(..., max_seconds={math.ceil(estimate.seconds * 1.5)}), "
                 "--dnnsafety-max-seconds, DNNSAFETY_MAX_SECONDS or dnnsafety_max_seconds (0 or none: no limit)")
    details = {"cost_estimate": estimate.to_details(), "max_seconds": limit, "refused": "over budget"}
    raise BudgetError(f"estimated {estimate.text()} for {estimate.cost.what or 'its work'}, over the budget "
                      f"max_seconds={limit:g} (from {source}); refused before measuring. Fix: shrink the work with "
                      + "; ".join(knobs), details)


# ------------------------------------------------------------------------------------- the families' cost hooks
# Rough on purpose: the work the options imply, in forwards per input; the probe supplies the seconds. A family's
# GateDef names its hook (``cost=attack_cost``).

#: Gradient steps of the attack families; the natural families try a few levels each.
_ONE_STEP = ("fgsm", "fgsm_l2")
_MANY_STEPS = ("pgd", "pgd_l2")
_LEVELS = 5


def _attack_forwards(families: Any, steps: int) -> float:
    total = 0.0
    for family in families or ():
        if family in _ONE_STEP:
            total += GRADIENT + 1
        elif family in _MANY_STEPS:
            total += GRADIENT * steps + 1
        else:  # a natural family (a few levels) or a user's callable: one forward per level
            total += _LEVELS
    return total


def attack_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Adversarial confidence loss / robust accuracy: a clean pass, then every family (PGD: ``steps`` gradient steps)."""
    per = 1 + _attack_forwards(options.get("families"), int(options.get("steps") or 1))
    return per_input(per, f"{per:g} forwards (families {', '.join(map(str, options.get('families') or ()))}, "
                          f"steps={options.get('steps')})", ("families", "steps"))(work)


def _bound_forwards(method: Any, work: Workload) -> float:
    """One sound bound of one input: IBP about two forwards; CROWN a backward pass per hidden neuron, which the
    input's size stands in for (a lower figure for a convolutional net); other modes a few passes."""
    if method == "ibp":
        return 2.0
    if method == "crown":
        return max(4.0, float(work.dims))
    return 4.0 * GRADIENT


def verified_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Verified robustness: the attack first (``attack_steps``), then one bound per input (``method``). With the
    probed inputs, the bound's passes are the engine's own estimate on them (IBP's unstable neurons: CROWN's work);
    without, a rough figure from the input's size."""
    method = options.get("method")
    bound, how = _bound_forwards(method, work), "rough"
    if work.model is not None and work.example is not None and method != "ibp":
        from pytest_dnnsafety.engines.robustness.verification import bound_cost

        try:
            bound, how = bound_cost(work.model, work.example, float(options["eps"]), method, options.get("clip"))
        except Exception:  # noqa: BLE001 - a model the bounds cannot handle: the gate itself names the problem
            pass
    per = 1 + GRADIENT * int(options.get("attack_steps") or 0) + bound
    return per_input(per, f"{per:,.0f} forwards (bound {bound:,.0f}: {how}; attack_steps="
                          f"{options.get('attack_steps')})", ("method", "attack_steps"))(work)


def pmi_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """pmi: the Monte Carlo queries of the plan (``query_budget``, else ``samples_per_cell`` per cell; about one cell
    per input unless ``max_cells``/``max_balls`` caps them)."""
    if options.get("query_budget"):
        queries = float(options["query_budget"])
    else:
        cells = options.get("max_balls") or options.get("max_cells") or max(work.n, 1)
        queries = float(options.get("samples_per_cell") or 1) * cells
    return Cost(queries + work.n, what=f"{queries:,.0f} model queries + a pass over {work.n} inputs",
                knobs=("query_budget", "samples_per_cell", "max_cells", "max_balls"))


def _pairs(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return (int(value[0]), int(value[-1])) if isinstance(value, (list, tuple)) and value else (1, 1)


def occlusion_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Occlusion: one forward per occluder position (``size``, ``stride`` over the image) per input, and a clean one."""
    positions = 1
    if work.shape and len(work.shape) >= 2:
        (sh, sw), (th, tw) = _pairs(options.get("size") or 1), _pairs(options.get("stride") or 1)
        height, width = work.shape[-2], work.shape[-1]
        positions = max(1, (height - sh) // max(th, 1) + 1) * max(1, (width - sw) // max(tw, 1) + 1)
    return per_input(1 + positions, f"{1 + positions:,} forwards ({positions:,} occluder positions)",
                     ("size", "stride"))(work)


#: Fault families per fault group of the monitors (about; 'adversarial' runs gradient steps).
_GROUP_SIZES = {"noise": 3, "shift": 4, "anomaly": 3, "novel": 1}
_ADVERSARIAL_STEPS = 10


def monitor_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Monitors: a pass to fit (about the data's size), a clean pass, one pass per fault family and severity."""
    faults = options.get("faults")
    names = [] if faults is None else ([faults] if isinstance(faults, str) else list(faults))
    severity = options.get("severity", (1, 2, 3, 4, 5))
    levels = 1 if isinstance(severity, int) else max(len(severity), 1)
    faulted = sum(GRADIENT * _ADVERSARIAL_STEPS if name == "adversarial" else _GROUP_SIZES.get(name, 1)
                  for name in names) * levels
    per = 2 + faulted
    return per_input(per, f"{per:g} forwards (fit, clean, {faulted:g} faulted)", ("faults", "severity"))(work)


def overhead_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Monitor overhead: fitting (about a pass), the monitor's shared pass, and the model alone timed
    ``1 + repeats`` times (a warm-up, then the repeats whose fastest is taken)."""
    repeats = int(options.get("repeats") or 1)
    per = 3.0 + repeats
    return per_input(per, f"{per:g} forwards (fit, the monitor's pass, the model timed 1 + {repeats} times)",
                     ("repeats",))(work)


#: Engine seconds of one image in one bootstrap resample (matching and averaging; rough).
_BOOTSTRAP_SECONDS = 5e-5


def bootstrap_cost(options: Mapping[str, Any], work: Workload) -> Cost:
    """Detection quality: one pass, then ``bootstrap`` resamples of the images' matches (the engine's own work)."""
    resamples = int(options.get("bootstrap") or 0)
    return Cost(float(work.n), resamples * work.n * _BOOTSTRAP_SECONDS,
                f"a pass over {work.n} images and {resamples} bootstrap resamples", ("bootstrap",))
