"""Built-in gate family: neuron coverage (``min_neuron_k_activation``, ``max_neuron_pattern_deviation``).

Engines in :mod:`pytest_dnnsafety.engines.neurons.kactivation` and :mod:`pytest_dnnsafety.engines.neurons.patterns`;
layer activations come from the session's shared forward pass (:func:`.shared.activations_for`: one pass per model
and data).

Under torchrun (:mod:`pytest_dnnsafety.runtime.torchrun`) each rank forwards only its share of the data's
batches and the engine states are all-reduced (coverage flags: ``or``; the pattern histogram:
``sum``), which gives exactly the single-process value: eq. (2)'s occupied cells are the union of
the cells each shard occupies, eq. (3)'s group sizes the sum of the shards' counts.
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_per_neuron_coverage
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.settings import TASK_NAMES
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.checks import check_where, in_range, is_finite, one_of
from pytest_dnnsafety.gates.coverage import K
from pytest_dnnsafety.gates.shared import activations_for, merged, scenario_table

__all__ = ["MIN_NEURON_K_ACTIVATION", "MAX_NEURON_PATTERN_DEVIATION", "pytest_dnnsafety_register_gates"]


def _measure_neuron_k_activation(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Neuron k-activation coverage (Cheng et al. 2018, §II-B, eq. 2) of one layer; each torchrun rank folds its rows
    of the shared pass, and the occupied cells are merged (``or``)."""
    from pytest_dnnsafety.engines.core.capture import activations_from
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine

    o = spec.options

    def fill(shard: Any) -> NeuronKActivationEngine:  # this rank's rows of the shared pass
        acts = activations_for(spec, fx, ctx, [o["layer"]], shard=shard)[o["layer"]].reduced(o["reduce"])
        return NeuronKActivationEngine.of(acts, k=o["k"], activation_threshold=o["activation_threshold"])

    res = merged(spec, fx, ctx, fill).compute()
    details = {"layer": o["layer"], "reduce": o["reduce"], **activations_from(fx["model"]), **res.to_details()}
    return Measurement(value=res.value, detail=f"layer {o['layer']}, {res.detail()}", details=details)


def _measure_pattern_deviation(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Neuron activation-pattern deviation (Cheng et al. 2018, §II-C, eq. 3), optionally in one scenario (``where``:
    the rows of the scenario table it selects); each torchrun rank counts its rows, the histograms are summed."""
    from pytest_dnnsafety.engines.core.capture import activations_from
    from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine, scope
    from pytest_dnnsafety.scenarios import ScenarioTable

    o = spec.options
    where = o["where"]

    def fill(shard: Any) -> NeuronPatternEngine:  # this rank's rows of the shared pass (of the scenario `where`)
        acts = activations_for(spec, fx, ctx, [o["layer"]], shard=shard)[o["layer"]].reduced(o["reduce"])
        if where is not None and not isinstance(fx["scenarios"], ScenarioTable):
            raise MetricError(f"fixture {spec.fixtures['scenarios']!r} returned {type(fx['scenarios']).__name__}, "
                              "not a ScenarioTable; `where` needs the scenario table")
        table = None if where is None else scenario_table(spec, fx, acts.shape[0] if shard is None else shard.n_rows)
        return NeuronPatternEngine.of(acts, groups=o["groups"], activation_threshold=o["activation_threshold"],
                                      rows=None if table is None else table.row_mask(where), shard=shard)

    res = merged(spec, fx, ctx, fill).compute(where=where)
    details = {"layer": o["layer"], "reduce": o["reduce"], **activations_from(fx["model"]), "where": where,
               **res.to_details()}
    return Measurement(value=res.value, detail=f"layer {o['layer']}, {scope(where)}, {res.detail()}", details=details)


def _is_layer(value: Any) -> str | None:
    return None if value else "must be a non-empty module name such as 'features.3'"


_LAYER = Param("layer", (str,), REQUIRED, _is_layer,
               "name the layer as in model.named_modules(), e.g. layer='features.3'")
_ACT_THRESHOLD = Param("activation_threshold", (int, float), 0.0, is_finite,
                       "a neuron is on when its activation is above this number (default 0: ReLU fires)")
_REDUCE = Param("reduce", (str,), "max", one_of("max", "mean"),
                "use 'max' or 'mean': how a conv channel's feature map becomes one activation")

MIN_NEURON_K_ACTIVATION = GateDef(
    marker="min_neuron_k_activation",
    metric="neuron k-activation coverage",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(_LAYER, K, _ACT_THRESHOLD, _REDUCE),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure_neuron_k_activation,
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,
    tasks=TASK_NAMES,  # reads no class scores: any model whose layers it can read
    doc="fail unless the data shows at least `threshold` of all on/off patterns of every k-tuple of "
        "neurons in `layer` (Cheng et al. 2018, eq. 2)",
)

MAX_NEURON_PATTERN_DEVIATION = GateDef(
    marker="max_neuron_pattern_deviation",
    metric="neuron activation-pattern deviation",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(_LAYER, Param("groups", (int,), 10, in_range(1, 10**6), "use a positive number of groups"),
            Param("where", (dict, type(None)), None, check_where,
                  "use a dict of condition -> value(s) selecting one scenario's inputs"),
            _ACT_THRESHOLD, _REDUCE),
    fixtures={"model": "model", "data": "dataset", "scenarios": "scenario_table"},
    conditional={"scenarios": "where"},
    measure=_measure_pattern_deviation,
    layers=lambda options: (options["layer"],),  # the shared forward pass captures it
    shards=True,
    signal=("model", "data"),  # relative: a model without signal has one pattern, deviating nowhere
    tasks=TASK_NAMES,  # reads no class scores: any model whose layers it can read
    doc="fail if more than `threshold` of the inputs (of one scenario with `where`) activate a number of "
        "neurons in `layer` outside the dominant group and its neighbours (Cheng et al. 2018, eq. 3)",
)


#: The neurons family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("neurons", "Neuron coverage and patterns", (MIN_NEURON_K_ACTIVATION, MAX_NEURON_PATTERN_DEVIATION),
                plots={"per_neuron_coverage": plot_per_neuron_coverage}, order=20)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
