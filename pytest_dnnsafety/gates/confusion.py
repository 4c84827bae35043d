"""Built-in gate family: severity-weighted confusion (``max_weighted_confusion``, Cheng et al. 2018, §II-H).

The engine is :class:`~pytest_dnnsafety.engines.confusion.weighted.WeightedConfusionEngine`; the predictions
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

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param, class_names, in_range, one_of
from pytest_dnnsafety.gates.shared import outputs_for

__all__ = ["MAX_WEIGHTED_CONFUSION", "pytest_dnnsafety_register_gates"]


def _measure_weighted_confusion(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Expected severity per input Σ W∘C / N with an upper confidence bound and the per-pair breakdown."""
    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.confusion.weighted import SeverityMatrix, WeightedConfusionEngine

    opts = spec.options
    given, origin = opts["severity"], "marker severity="
    if given is None:
        given, origin = fx["severity_matrix"], f"fixture {spec.fixtures['severity_matrix']!r}"
    elif isinstance(given, (str, PurePath)):
        origin = f"file {given}"
    classes = list(opts["classes"]) if opts["classes"] is not None else None
    shard = ctx.shard(fx["data"])  # None: the whole data on every rank

    def local() -> WeightedConfusionEngine:  # this rank's rows; the confusion counts are sums
        out = outputs_for(spec, fx, ctx, shard=shard)
        if out.labels is None:
            raise DataError(f"fixture {spec.fixtures['data']!r} has no labels; the weighted confusion compares each "
                            "prediction with the true class. Fix: give labelled data (e.g. an .npz with keys x and "
                            "y).")
        if out.num_classes is not None and classes is not None and len(classes) != out.num_classes:
            raise ConfigError(f"{spec.marker}: classes= names {len(classes)} classes but the model has "
                              f"{out.num_classes} outputs. Fix: name every output, in order.")
        out.check_labels(spec.fixtures["data"], classes)
        matrix = SeverityMatrix.load(given, classes, num_classes=out.num_classes, base_dir=ctx.settings.ini_dir,
                                     default=float(opts["default"]))
        if matrix.max_weight == 0:  # Σ W∘C / N is 0 by construction: no signal, never a pass (issue #19 §6)
            raise ConfigError(f"{spec.marker}: the severity matrix of {origin} weighs every misclassification 0 "
                              f"(no positive entry; pairs it does not list weigh default={opts['default']!r}), so "
                              "the weighted confusion is 0 whatever the model predicts and the gate could never "
                              "fail. Fix: give the costly confusions a positive severity, e.g. "
                              "severity={'1': {'7': 10.0}}, and leave default=1.0 so that unlisted errors count once.")
        engine = WeightedConfusionEngine(matrix, confidence=opts["confidence"], method=opts["method"],
                                         device=out.predictions.device)
        engine.update(out.predictions, out.labels.to(out.predictions.device))
        return engine

    engine = ranks.merged(local, shard)  # confusion counts and out-of-range rows: sum
    res, matrix = engine.compute(), engine.severity
    details = {**res.to_details(top=opts["top"]), "gate_on": opts["gate_on"], "severity_source": origin,
               "severity_matrix_source": matrix.source, "severity_sha256": matrix.digest()}
    if len(res.classes) <= 64:  # small enough to show and plot
        details["severity"] = res.weights.tolist()
    bound = res.bound if opts["gate_on"] == "bound" else None
    return Measurement(value=res.value, bound=bound, detail=res.detail(), details=details)


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
    shards=True,  # confusion counts: each rank its share of the batches, then sum
    doc="fail if the expected severity per input Σ W∘C / N (its upper confidence bound by default) exceeds "
        "`threshold` (Cheng et al. 2018, §II-H, Table I)",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_WEIGHTED_CONFUSION)
