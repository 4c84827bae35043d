"""The weighted-confusion gate's steps on :class:`~pytest_dnnsafety.engines.confusion.weighted.WeightedConfusionEngine`.

* :class:`ConfusionOptions` — the gate's options and where its severity matrix comes from, first match wins:
  the marker's ``severity=`` (a ``.toml``/``.csv`` file relative to the rootdir, a dict or a nested list),
  else the value of the severity fixture (``severity_matrix``, or the one ``severity_matrix=`` names);
* :func:`count_confusion` — one torchrun rank's pass (or the whole data's) counted: the labels checked against
  the model's classes, the matrix loaded in the model's class order and refused when it weighs every
  misclassification 0 (the value would be 0 whatever the model predicts: a gate that cannot fail);
* :func:`weighted_confusion` — the merged engine's value, its upper confidence bound (compared by default,
  ``gate_on="bound"``) and the per-pair breakdown, as the gate's :class:`~pytest_dnnsafety.results.Measurement`.

Pure torch, no pytest import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from pytest_dnnsafety.engines.confusion.weighted import (
    SeverityMatrix,
    WeightedConfusionEngine,
)
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.results import Measurement

__all__ = ["ConfusionOptions", "count_confusion", "weighted_confusion"]


@dataclass(frozen=True)
class ConfusionOptions:
    """A weighted-confusion gate's options; ``severity`` is what the matrix is loaded from and ``origin`` where
    it came from (both named in the details and errors); ``marker`` and ``data`` (the data fixture's name) are
    named by the errors; ``base_dir`` resolves a relative severity file."""

    marker: str
    data: str
    severity: Any
    origin: str
    base_dir: str | Path | None
    classes: list[str] | None
    default: float
    confidence: float
    method: str
    gate_on: str
    top: int

    @classmethod
    def of(cls, options: Mapping[str, Any], fixture: Callable[[], Any], *, fixture_name: str | None, marker: str,
           data: str, base_dir: str | Path | None) -> ConfusionOptions:
        """The record of a gate's ``options``; ``fixture()`` gives the severity fixture's value, read only when the
        marker gives no ``severity=`` (the fixture is then the source, ``fixture_name`` its name)."""
        given, origin = options["severity"], "marker severity="
        if given is None:
            given, origin = fixture(), f"fixture {fixture_name!r}"
        elif isinstance(given, (str, PurePath)):
            origin = f"file {given}"
        classes = list(options["classes"]) if options["classes"] is not None else None
        return cls(marker=marker, data=data, severity=given, origin=origin, base_dir=base_dir, classes=classes,
                   default=options["default"], confidence=options["confidence"], method=options["method"],
                   gate_on=options["gate_on"], top=options["top"])


def count_confusion(out: Any, opts: ConfusionOptions) -> WeightedConfusionEngine:
    """The engine filled with one pass's predictions (``out``, a
    :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs`); its confusion counts are sums over ranks."""
    classes = opts.classes
    if out.labels is None:
        raise DataError(f"fixture {opts.data!r} has no labels; the weighted confusion compares each "
                        "prediction with the true class. Fix: give labelled data (e.g. an .npz with keys x and "
                        "y).")
    if out.num_classes is not None and classes is not None and len(classes) != out.num_classes:
        raise ConfigError(f"{opts.marker}: classes= names {len(classes)} classes but the model has "
                          f"{out.num_classes} outputs. Fix: name every output, in order.")
    out.check_labels(opts.data, classes)
    matrix = SeverityMatrix.load(opts.severity, classes, num_classes=out.num_classes, base_dir=opts.base_dir,
                                 default=float(opts.default))
    if matrix.max_weight == 0:  # Σ W∘C / N is 0 by construction: no signal, never a pass (issue #19 §6)
        raise ConfigError(f"{opts.marker}: the severity matrix of {opts.origin} weighs every misclassification 0 "
                          f"(no positive entry; pairs it does not list weigh default={opts.default!r}), so "
                          "the weighted confusion is 0 whatever the model predicts and the gate could never "
                          "fail. Fix: give the costly confusions a positive severity, e.g. "
                          "severity={'1': {'7': 10.0}}, and leave default=1.0 so that unlisted errors count once.")
    engine = WeightedConfusionEngine(matrix, confidence=opts.confidence, method=opts.method,
                                     device=out.predictions.device)
    engine.update(out.predictions, out.labels.to(out.predictions.device))
    return engine


def weighted_confusion(engine: WeightedConfusionEngine, opts: ConfusionOptions) -> Measurement:
    """Expected severity per input Σ W∘C / N with its upper confidence bound and the per-pair breakdown."""
    res, matrix = engine.compute(), engine.severity
    details = {**res.to_details(top=opts.top), "gate_on": opts.gate_on, "severity_source": opts.origin,
               "severity_matrix_source": matrix.source, "severity_sha256": matrix.digest()}
    if len(res.classes) <= 64:  # small enough to show and plot
        details["severity"] = res.weights.tolist()
    bound = res.bound if opts.gate_on == "bound" else None
    return Measurement(value=res.value, bound=bound, detail=res.detail(), details=details)
