"""Built-in gate family: severity-weighted confusion (``max_weighted_confusion``, Cheng et al. 2018, §II-H).

The engine is :class:`~pytest_dnnsafety.engines.confusion.weighted.WeightedConfusionEngine` (filled and read by
:mod:`pytest_dnnsafety.engines.confusion.gating`); the predictions
come from the session's shared forward pass (:func:`.shared.outputs_for`), so a gate on a model and
data that another gate already ran costs no forward pass. Under torchrun (:mod:`pytest_dnnsafety.runtime.torchrun`)
each rank forwards only its share of the data's batches and the engine's confusion counts are
all-reduced (``sum``): the same counts, hence the same value and bound, as one process.

Where the severity matrix comes from, first match wins:

* ``severity="data/severity.toml"`` or ``.csv`` — a file, relative to the rootdir (the ini file's folder);
* ``severity={"1": {"7": 10.0}}`` (or ``{"1 -> 7": 10.0}``) — class names (``classes=[...]``, else
  ``"0" … "K-1"``) or integer indices; a nested list is a full matrix;
* otherwise the fixture ``severity_matrix`` (or the one named by ``severity_matrix="..."``), which the
  project's ``conftest.py`` defines (returning a SeverityMatrix, a path, a dict, or a K×K tensor/array).
  The fixture is requested only then, so projects that give ``severity=`` need no such fixture.

Pairs that a file or dict does not list weigh ``default`` (1.0: an unrated error still counts as one
plain error; 0 ignores it). A matrix that weighs every misclassification 0 (an all-zero file, or
``default=0`` with no positive entry) is an error naming its source: the weighted confusion would be 0
by construction, a gate that cannot fail. Labels outside the model's classes are an error too. The gate compares the upper confidence bound by default (``gate_on="bound"``):
"with 95 % confidence the expected severity per input in operation is below the threshold" is the claim a
safety case needs, and a small or lucky test set cannot pass on its point estimate alone; ``gate_on="value"``
compares the estimate (the bound stays in the details). No torch import at module level.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any, Mapping

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.checks import class_names, in_range, one_of
from pytest_dnnsafety.gates.shared import merged, outputs_for

__all__ = ["MAX_WEIGHTED_CONFUSION", "pytest_dnnsafety_register_gates"]


def _measure_weighted_confusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Expected severity per input Σ W∘C / N with an upper confidence bound and the per-pair breakdown."""
    from pytest_dnnsafety.engines.confusion.gating import ConfusionOptions, count_confusion, weighted_confusion

    opts = ConfusionOptions.of(spec.options, lambda: fx["severity_matrix"],
                               fixture_name=spec.fixtures.get("severity_matrix"), marker=spec.marker,
                               data=spec.fixtures["data"], base_dir=ctx.settings.ini_dir)
    engine = merged(spec, fx, ctx, lambda shard: count_confusion(outputs_for(spec, fx, ctx, shard=shard), opts))
    return weighted_confusion(engine, opts)  # the confusion counts and out-of-range rows: summed over the ranks


# ------------------------------------------------------------------------------------- marker keywords


def _severity_spec(value: Any) -> str | None:
    """Collection-time shape check of severity= (the names and sizes are checked against the model later)."""
    if value is None:
        return None
    if isinstance(value, (str, PurePath)):
        suffix = PurePath(value).suffix.lower()
        return None if suffix in (".toml", ".csv") else f"{str(value)!r} is not a .toml or .csv file"
    if isinstance(value, dict):
        if not value:
            return "is an empty dict"
        for key, row in value.items():
            cells = row.items() if isinstance(row, dict) else [(key, row)]
            if not isinstance(row, dict) and not (isinstance(key, str) and "->" in key):
                return f"entry {key!r} must be a dict {{predicted: weight}} or a 'true -> predicted' key"
            for pred, weight in cells:
                if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                    return f"entry {key!r} -> {pred!r}: {weight!r} is not a number"
                if not math.isfinite(weight) or weight < 0:
                    return f"entry {key!r} -> {pred!r}: {weight!r} is not a finite number >= 0"
        return None
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(r, (list, tuple)) and len(r) == len(value) for r in value):
            return "a matrix must be a non-empty square list of rows"
        return None
    return f"{value!r} is neither a file path, a dict nor a matrix"




def _non_negative(value: Any) -> str | None:
    return None if math.isfinite(value) and value >= 0 else f"{value!r} is not a finite number >= 0"



MAX_WEIGHTED_CONFUSION = GateDef(
    marker="max_weighted_confusion",
    metric="severity-weighted confusion",
    op="<=",
    threshold_range=(0.0, math.inf),
    params=(
        Param("severity", (str, PurePath, dict, list, tuple, type(None)), None, _severity_spec,
              "give a .toml/.csv file (relative to the rootdir), a dict {'true': {'predicted': weight}} or a K×K "
              "list; leave it out to read the fixture `severity_matrix` (or the one named by severity_matrix=...)"),
        Param("classes", (list, tuple, type(None)), None, class_names,
              "list the class names in the model's output order, e.g. classes=['cat', 'dog', 'car']"),
        Param("default", (int, float), 1.0, _non_negative,
              "give the weight of off-diagonal pairs the severity does not list (>= 0; default 1.0)"),
        Param("confidence", (float,), 0.95, in_range(0.5, 0.999999), "use a confidence in [0.5, 0.999999]"),
        Param("gate_on", (str,), "bound", one_of("bound", "value"),
              "use 'bound' (the upper confidence bound must stay below the threshold) or 'value' (the estimate)"),
        Param("method", (str,), "kl", one_of("kl", "hoeffding"),
              "use 'kl' (Chernoff–KL bound, sound and tighter) or 'hoeffding'"),
        Param("top", (int,), 10, in_range(0, 10**6), "give how many worst pairs the details list, e.g. top=10"),
    ),
    fixtures={"model": "model", "data": "dataset", "severity_matrix": "severity_matrix"},
    conditional={"severity_matrix": "!severity"},
    measure=_measure_weighted_confusion,
    shards=True,
    outputs_only=True,  # reads the shared pass's outputs only: recorded predictions can stand in for the model
    signal=("model", "data"),  # a collapsed model confuses only the pairs the severity may not weigh  # confusion counts: each rank its share of the batches, then sum
    doc="fail if the expected severity per input Σ W∘C / N (its upper confidence bound by default) exceeds "
        "`threshold` (Cheng et al. 2018, §II-H, Table I)",
)


#: The confusion family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("confusion", "Weighted confusion", (MAX_WEIGHTED_CONFUSION,), order=60)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
