"""Built-in gate family: reliability (``max_pmi_ub``), engine :mod:`..engines.reliability`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path, PurePath
from typing import Any, Callable, Mapping

from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, is_interval, one_of

__all__ = ["MAX_PMI_UB", "pytest_dnnsafety_register_gates"]


def _measure_pmi_ub(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Upper confidence bound on the pmi (Zhao et al. 2021, eqs. 1–14) under the operational profile.

    Under torchrun each rank samples its contiguous share of the Monte Carlo blocks
    (``ReliabilityAssessor.sample(model, rank=, world_size=)``; blocks are seeded by index, so the
    split changes no sample), the per-cell tallies are all-reduced (``sum``) and every rank
    aggregates the same counts: the single-process result, with the Monte Carlo — the bulk of the
    work — divided by the number of ranks. Only rank 0 writes ``cells_file``.

    Grid cells: the labelled data (``dataset``) are read whole, on every rank, and not sharded:
    ``r̂`` is the smallest distance between differently labelled points (r-separation), and each
    cell's type and label come from the labelled points inside it. Only their inputs ``x`` and
    labels ``y`` are kept (one tensor pair; a float ``TensorDataset``'s own tensors are used as
    they are, a ``DataLoader`` is read once into it), never a second copy.

    Ball cells (``cells="balls"``): a ``DataLoader`` of labelled data — and an operational profile
    given as a ``DataLoader`` of inputs — is streamed instead, never held whole
    (:mod:`~pytest_dnnsafety.engines.reliability.streamed`): the pairwise work (r̂, ball types) runs
    as block nested loops over repeated passes, and per input only its label and the model's
    prediction are kept. The numbers are those of the same data held.
    """
    import time

    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.reliability import ReliabilityAssessor
    from pytest_dnnsafety.engines.reliability.allocation import QueryCapError
    from torch.utils.data import DataLoader

    from pytest_dnnsafety.data.forms import as_tensors

    opts = dict(spec.options)
    data = fx["data"]
    if opts.get("cells") == "balls" and isinstance(data, DataLoader):
        labelled: Any = data  # streamed by the engine: read in passes, never held whole (see the docstring)
    else:  # whole, not sharded: r-separation and the cell labels need every labelled point
        labelled = as_tensors(data, f"labelled data (fixture {spec.fixtures['data']!r})")
    if isinstance(labelled, tuple) and labelled[1] is None:
        raise MetricError(f"fixture {spec.fixtures['data']!r} has no labels; the pmi needs labelled points "
                          "for r-separation and cell labels. Fix: provide (x, y)")
    # Only what the user set reaches the engine (its defaults equal the marker's); grid-only and
    # ball-only options then never collide.
    defaults = {param.name: param.default for param in spec.definition.params}
    given = {k: v for k, v in opts.items() if v != defaults[k]}
    for key in ("box", "clip"):
        if given.get(key) is not None:
            given[key] = tuple(given[key])
    if given.get("failures") is not None:
        given["failures"] = [tuple(pair) for pair in given["failures"]]
    compare = tuple(m for m in opts["compare_methods"] if m != opts["method"])
    given.pop("compare_methods", None)
    cells_file = given.pop("cells_file", None)
    given.pop("max_queries", None)  # the marker keyword overrides the setting dnnsafety_max_queries
    cap = (ctx.settings.get("max_queries", opts["max_queries"], marker=spec.marker)
           if opts.get("max_queries") is not None else ctx.settings.get("max_queries"))
    started = time.perf_counter()
    world = ranks.world_size()
    try:  # a plan above the cap is refused before it is sampled
        assessor = ReliabilityAssessor(fx["profile"], labelled, compare_methods=compare, seed=ctx.seed,
                                       device=ctx.device, max_queries=cap.value, **given)
        engine = ranks.together(lambda: assessor.sample(fx["model"], rank=ranks.rank(), world_size=world),
                                sharded=world > 1)
    except QueryCapError as exc:
        raise exc.with_source(cap.source) from None
    queries = assessor.queries
    if world > 1:
        engine.sync()  # per-cell class tallies: sum
        # Every rank ran the (deterministic) pilot in full: count it once, as one process would.
        pilot = int(getattr(assessor, "queries_pilot", 0) or 0)
        queries = sum(ranks.gather(int(queries))) - (world - 1) * pilot
    result = assessor.finish(engine, model_queries=queries)
    result = replace(result, seconds=time.perf_counter() - started)
    if cells_file is not None:
        # the per-cell audit table, relative to the rootdir (the ini file's folder) like other gate files
        path = Path(str(cells_file)).expanduser()
        path = path if path.is_absolute() else ctx.settings.ini_dir / path
        if ranks.is_main():  # one writer under torchrun; every rank reports the same path
            path = result.write_cells(path)
        result = replace(result, cells_file=str(path))
    return _pmi_measurement(result)


def _pmi_measurement(result: Any) -> Measurement:
    """A :class:`ReliabilityResult` as a Measurement: contradictions fail, violated assumptions are inconclusive.

    * ``contradiction`` — the labelled data refute the bound (the model's labelled error is above
      ``Ub`` at the gate's confidence, or the model's vote, Assumption 5, is refuted where labels
      are known): the gate fails whatever the comparison.
    * ``inconclusive`` — an assumption of the method is violated (``ε``/radius ``≥ r̂``, labelled
      points outside the box, cross-boundary cells), unless the marker says
      ``accept_violated_assumptions=True``: then the bound is compared and the detail says so.
    """
    details = result.to_details()
    detail = result.detail()
    contradiction = "; ".join(result.contradictions) or None
    inconclusive = None
    if result.violations:
        joined = "; ".join(result.violations)
        if result.violations_accepted:
            detail += f"; VIOLATED ASSUMPTIONS ACCEPTED (accept_violated_assumptions=True): {joined}"
        else:
            inconclusive = (f"violated assumption(s) of the reliability method: {joined}. The bound is not evidence "
                            f"until they hold (or, knowingly, accept_violated_assumptions=True)")
    return Measurement(value=result.E, bound=result.Ub, detail=detail, details=details,
                       inconclusive=inconclusive, contradiction=contradiction)


#: The bound methods the marker accepts (checked against ``stats.METHODS`` by a test; no torch here).
_PMI_METHODS = ("chernoff", "normal", "clopper-pearson", "jeffreys")


def _positive_or_auto(value: Any) -> str | None:
    values = value if isinstance(value, (list, tuple)) else [value]
    if value == "auto":
        return None
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        return f"{value!r} must be 'auto', a positive number or a list of positive numbers"
    return None


def _box(value: Any) -> str | None:
    if value is None or value == "padded":
        return None
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(c, (list, tuple)) and c and all(isinstance(v, (int, float)) for v in c) for c in value)
          and len(value[0]) == len(value[1]) and all(lo < hi for lo, hi in zip(*value)))
    return None if ok else (f"{value!r} must be [lower corner, upper corner] with lower < upper in every dimension, "
                            f"None (the data's range) or 'padded' (the data's range ± 3 bandwidths)")


def _pairs(value: Any) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and value and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in p)
        for p in value)
    return None if ok else f"{value!r} must be a non-empty list of (true class, predicted class) integer pairs"


def _methods(value: Any) -> str | None:
    bad = [m for m in value if m not in _PMI_METHODS]
    return f"unknown method(s) {bad}; use {', '.join(_PMI_METHODS)}" if bad else None


def _none_or_positive(value: Any) -> str | None:
    return None if value is None or value >= 1 else f"{value!r} must be >= 1"


def _none_or_at_least(low: int) -> Callable[[Any], str | None]:
    return lambda value: None if value is None or value >= low else f"{value!r} must be >= {low}"


def _none_or_open_unit(value: Any) -> str | None:
    return None if value is None or 0 < value < 1 else f"{value!r} must lie strictly between 0 and 1"


_radius: Callable[[Any], str | None] = lambda v: None if v is None else _positive_or_auto(v)  # noqa: E731

MAX_PMI_UB = GateDef(
    marker="max_pmi_ub",
    metric="pmi upper bound",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(
        Param("confidence", (float,), 0.975, in_range(1e-9, 1 - 1e-9),
              "use a confidence strictly between 0 and 1, e.g. 0.975"),
        Param("method", (str,), "chernoff", one_of(*_PMI_METHODS),
              "chernoff (sound, default), normal (the paper's eq. 7), clopper-pearson or jeffreys"),
        Param("eps", (int, float, str, list, tuple), "auto", _positive_or_auto,
              "cell side: 'auto' (below r-hat), a positive number, or one per dimension"),
        Param("eps_fraction", (int, float), 1.0, in_range(1e-9, 1e9), "a positive fraction of r-hat"),
        Param("box", (list, tuple, str, type(None)), None, _box,
              "box=[[lower...], [upper...]] in profile space; None: the data's range (unpadded); "
              "'padded': the data's range ± 3 bandwidths"),
        Param("samples_per_cell", (int,), 1000, in_range(1, 10**9), "a positive number of samples"),
        Param("allocation", (str,), "uniform", one_of("uniform", "proportional", "adaptive"),
              "uniform, proportional to cell mass, or adaptive (a pilot, then the queries where they tighten "
              "the bound)"),
        Param("query_budget", (int, type(None)), None, _none_or_at_least(2),
              "total Monte Carlo queries of allocation='adaptive' (pilot included), e.g. 1_000_000; None: "
              "samples_per_cell x cells"),
        Param("target_width", (int, float, type(None)), None, _none_or_open_unit,
              "the bound width Ub - E allocation='adaptive' plans for, a number in (0, 1), e.g. 0.001"),
        Param("max_queries", (int, type(None)), None, _none_or_positive,
              "the most Monte Carlo queries a plan may take (a plan above it is refused before sampling); "
              "None: the setting dnnsafety_max_queries (default 1_000_000_000)"),
        Param("pilot_samples", (int, type(None)), None, _none_or_positive,
              "pilot samples per cell of allocation='adaptive' (None: pilot_fraction of the budget)"),
        Param("pilot_fraction", (int, float), 0.05, in_range(1e-9, 1 - 1e-9),
              "the share of the budget allocation='adaptive' spends on its pilot, strictly between 0 and 1"),
        Param("bootstrap", (int,), 100, in_range(0, 10**6), "KDE refits for Var(Op); 0 takes masses as known"),
        Param("bootstrap_size", (str,), "full", one_of("full", "half"),
              "full (the standard bootstrap, N of N points per refit) or half (the paper's N/2-point refits, "
              "about 2x the variance)"),
        Param("bandwidth", (str, int, float, list, tuple, type(None)), None, None,
              "'scott', 'silverman', a number or one per dimension"),
        Param("mass", (str,), "exact", one_of("exact", "centre", "center"),
              "exact box integrals, or centre (also spelt center; the paper's eq. 9)"),
        Param("mass_target", (int, float), 1.0, in_range(1e-9, 1.0), "a share of OP mass in (0, 1]"),
        Param("max_cells", (int, type(None)), None, _none_or_positive,
              "a positive cell budget or None"),
        Param("conservative_rest", (bool,), True, None, "True counts unevaluated mass as failing"),
        Param("failures", (list, tuple, type(None)), None, _pairs,
              "critical confusions as [(true, predicted), ...]; None: any misclassification"),
        Param("compare_methods", (list, tuple), ("normal",), _methods,
              "other methods to report beside the gated one"),
        Param("cells", (str,), "grid", one_of("grid", "balls"),
              "grid (a box of side eps) or balls (norm balls around operational inputs, for images)"),
        Param("radius", (int, float, str, type(None)), None, _radius,
              "ball radius: a positive number or 'auto' (r-hat under the norm)"),
        Param("norm", (str,), "linf", one_of("linf", "l2"), "linf or l2"),
        Param("max_balls", (int, type(None)), None, _none_or_positive,
              "a positive number of balls or None (all operational inputs)"),
        Param("clip", (list, tuple, type(None)), None, is_interval, "the valid input range, e.g. clip=(0, 1)"),
        Param("empty_cell_label", (str,), "model", one_of("model", "nearest"),
              "model (the model's majority vote, the paper's Assumption 5) or nearest (the label of the "
              "nearest labelled point)"),
        Param("labelled_from_profile", (bool,), True, None,
              "True: the labelled data are a sample of the operational profile, so their error rate must "
              "not exceed the bound; False skips that check"),
        Param("cells_file", (str, PurePath, type(None)), None, None,
              "a .csv (or .jsonl) path, relative to the rootdir, for the per-cell audit table (mass, type, "
              "lambda-hat, samples); its path appears in the gate's details"),
        Param("accept_violated_assumptions", (bool,), False, None,
              "True compares the bound even when an assumption (e.g. eps < r-hat) is violated; default: "
              "the gate is inconclusive"),
    ),
    fixtures={"model": "model", "profile": "operational_profile", "data": "dataset"},
    measure=_measure_pmi_ub,
    shards=True,  # each rank samples its share of the Monte Carlo blocks
    doc="fail unless the upper confidence bound on the probability of misclassification per input "
        "under the operational profile is at most `threshold` (Zhao et al. 2021, eqs. 5-7)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_PMI_UB)


