"""Built-in gate family: reliability (``max_pmi_ub``), engine :mod:`..engines.reliability`."""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any, Callable, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_cells
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.cost import pmi_cost
from pytest_dnnsafety.gates.checks import in_range, is_interval, one_of

__all__ = ["MAX_PMI_UB", "pytest_dnnsafety_register_gates"]


def _measure_pmi_ub(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Upper confidence bound on the pmi (Zhao et al. 2021, eqs. 1–14) under the operational profile.

    Under torchrun each rank samples its contiguous share of the Monte Carlo blocks and the per-cell
    tallies are all-reduced (:func:`~pytest_dnnsafety.engines.reliability.ranks.assess_over_ranks`): the
    single-process result, with the Monte Carlo — the bulk of the work — divided by the number of
    ranks. Only rank 0 writes ``cells_file`` (relative to the rootdir, the ini file's folder, like
    other gate files).

    The labelled data (``dataset``) are read whole, on every rank, and not sharded — or, for ball
    cells (``cells="balls"``), a ``DataLoader`` is streamed, never held whole
    (:func:`~pytest_dnnsafety.engines.reliability.ranks.labelled_points`). Only what the user set
    reaches the engine (its defaults equal the marker's), so grid-only and ball-only options never
    collide; the marker's ``max_queries`` overrides the setting ``dnnsafety_max_queries``. Violated
    assumptions make the gate inconclusive, contradictions fail it
    (:meth:`~pytest_dnnsafety.engines.reliability.result.ReliabilityResult.verdict`).
    """
    from pytest_dnnsafety.engines.reliability.options import ReliabilityOptions
    from pytest_dnnsafety.engines.reliability.ranks import assess_over_ranks, labelled_points

    opts = spec.options
    labelled = labelled_points(fx["data"], opts["cells"], spec.fixtures["data"], stream=opts["latent"] is not None)
    defaults = {param.name: param.default for param in spec.definition.params}
    engine_side = ("compare_methods", "cells_file", "max_queries", "latent") + (("clip",) if opts["latent"] else ())
    given = {k: v for k, v in opts.items() if v != defaults[k] and k not in engine_side}
    cap = (ctx.settings.get("max_queries", opts["max_queries"], marker=spec.marker)
           if opts["max_queries"] is not None else ctx.settings.get("max_queries"))
    cells_file = (None if opts["cells_file"] is None  # relative to the rootdir, like other gate files
                  else ctx.settings.ini_dir / Path(str(opts["cells_file"])).expanduser())
    compare = tuple(m for m in opts["compare_methods"] if m != opts["method"])
    options = ReliabilityOptions.of(**given, compare_methods=compare, seed=ctx.seed, device=ctx.device,
                                    max_queries=cap.value)
    profile = fx["profile"] if opts["latent"] is None else _latent_profile(fx["profile"], opts, ctx)
    result = assess_over_ranks(fx["model"], profile, labelled, options, cells_file=cells_file,
                               cap_source=cap.source)
    return Measurement(value=result.E, bound=result.Ub, details=result.to_details(), **result.verdict())


def _latent_profile(data: Any, opts: Mapping[str, Any], ctx: GateContext) -> Any:
    """``latent=``: the operational profile in a latent space — a PCA of ``latent`` components fitted in passes
    over the operational data, or the encoder/decoder a ``pkg.module:make`` factory returns."""
    from pytest_dnnsafety.engines.reliability.latent import latent_profile
    from pytest_dnnsafety.errors import ConfigError
    from pytest_dnnsafety.files.loading import import_factory

    if opts["cells"] != "grid":
        raise ConfigError("max_pmi_ub: latent= puts grid cells in a latent space; cells='balls' are norm balls in "
                          "input space. Fix: drop latent= (balls in input space) or drop cells='balls' (grid cells "
                          "in the latent space)")
    latent = opts["latent"]
    if isinstance(latent, str):
        make = import_factory(latent, "max_pmi_ub(latent=...)", ctx.settings.ini_dir)
        try:
            latent = make()
        except Exception as exc:
            raise ConfigError(f"max_pmi_ub(latent={opts['latent']!r}): the factory raised {type(exc).__name__}: "
                              f"{exc}. Fix: called with no arguments it must return an object with encode/decode "
                              f"methods or an (encoder, decoder) pair") from exc
    return latent_profile(data, latent, clip=opts["clip"], device=ctx.device,
                          bandwidth="scott" if opts["bandwidth"] is None else opts["bandwidth"])


def _latent(value: Any) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    if isinstance(value, str) and ":" in value:
        return None
    return (f"{value!r} must be None (input space), a positive number of PCA components (e.g. 16) or "
            f"'package.module:make' returning an encoder/decoder pair")


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


def _none_or_at_least_two(value: Any) -> str | None:
    return None if value is None or value >= 2 else f"{value!r} must be >= 2"


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
        Param("query_budget", (int, type(None)), None, _none_or_at_least_two,
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
        Param("latent", (int, str, type(None)), None, _latent,
              "the operational profile in a latent space, for inputs above 1,024 values (images): an int k (a "
              "PCA of k components fitted in passes over the operational data) or 'package.module:make' "
              "returning an object with encode/decode (or an (encoder, decoder) pair); the KDE and the grid "
              "cells live there and the model is queried on decoded samples. None: input space"),
        Param("accept_violated_assumptions", (bool,), False, None,
              "True compares the bound even when an assumption (e.g. eps < r-hat) is violated; default: "
              "the gate is inconclusive"),
    ),
    fixtures={"model": "model", "profile": "operational_profile", "data": "dataset"},
    measure=_measure_pmi_ub,
    cost=pmi_cost,
    shards=True,  # each rank samples its share of the Monte Carlo blocks
    doc="fail unless the upper confidence bound on the probability of misclassification per input "
        "under the operational profile is at most `threshold` (Zhao et al. 2021, eqs. 5-7)",
)


#: The reliability family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("reliability", "Reliability (pmi)", (MAX_PMI_UB,), plots={"cells_plot": plot_cells}, order=30)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
