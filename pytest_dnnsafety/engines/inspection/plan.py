"""What the DeepInspect gates run: an inspection plan per task (Tian et al., ICSE 2020).

``max_class_confusion`` and ``max_class_bias`` read one layer of the model and its predictions (and the data's
labels) from the session's shared forward pass. :class:`InspectionPlan` holds the marker's options in one of two
task variants — as torchmetrics has Binary/Multiclass/Multilabel variants of one metric:

* :class:`SingleLabelInspection` — an input counts for the class it predicts
  (:class:`~.deepinspect.InspectionEngine`; ground truth: type-1 confusion from the labelled confusion counts);
* :class:`MultiLabelInspection` — an input counts for every class whose probability reaches
  ``decision_threshold`` (:class:`~.multilabel.MultiLabelInspectionEngine`; ground truth: type-2 confusion and
  the label coincidence).

:meth:`InspectionPlan.for_task` picks the variant and refuses the options the task does not read.
:meth:`~InspectionPlan.inspect` checks the layer, reads this rank's rows through the caller's ``read(shard)``
(the gate's access to the shared pass), checks them, counts them into the task's engine and merges the counts over
the torchrun ranks (every count is a sum, so the analysis is the single process's); :meth:`~InspectionPlan.
confusion_report` and :meth:`~InspectionPlan.bias_report` give the gates' value, detail text and JSON details.
Pure torch; no pytest import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pytest_dnnsafety.errors import ConfigError, MetricError

__all__ = ["InspectionPlan", "SingleLabelInspection", "MultiLabelInspection", "check_layer", "EXCLUDED_SET"]

#: What the gates' ``details["comparable_set"]`` holds: the classes left out of every pair. A baseline comparison
#: (:func:`pytest_dnnsafety.report.baseline.compare`) flags a change of this set as a regression: values measured
#: on other classes are not comparable, and fewer predicted classes must never read as "improved".
EXCLUDED_SET = "classes never predicted (excluded)"


def check_layer(model: Any, layer: str, marker: str) -> None:
    """ConfigError naming the layer and the closest names when ``model`` has no such submodule."""
    from pytest_dnnsafety.engines.core.capture import layer_names  # a torch.export program's: its graph's modules
    from pytest_dnnsafety.files.pt2_taps import is_exported_module
    from pytest_dnnsafety.files.onnx_model import is_onnx_model

    if not callable(getattr(model, "named_modules", None)):
        return  # the cache names the problem (not a torch.nn.Module)
    names = layer_names(model)
    if layer in names:
        return
    close = difflib.get_close_matches(layer, names, n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    shown = ", ".join(names[:40]) + (", …" if len(names) > 40 else "")
    where = ("the torch.export program's graph runs no module of that name. Fix: use a name from the exported "
             "graph's modules (as in the eager model's named_modules())" if is_exported_module(model) else
             "the ONNX graph has no tensor of that name. Fix: use a node output name of the graph"
             if is_onnx_model(model) else
             "the model has no such submodule. Fix: use a name from model.named_modules()")
    raise ConfigError(f"{marker}: unknown layer {layer!r}{hint}: {where}: {shown}")


@dataclass(frozen=True)
class InspectionPlan(ABC):
    """A DeepInspect gate's options (``options``, by keyword, as the marker gave them); ``marker`` starts every
    error message and ``data`` (the data fixture's name) names the data in them. Use a task variant
    (:meth:`for_task`): construction refuses what the task cannot measure."""

    marker: str
    data: str
    options: Mapping[str, Any]

    #: the task this variant measures, whether its model is multi-label, and its ground truth's statistic
    task: ClassVar[str] = ""
    multi: ClassVar[bool] = False
    ground_truth: ClassVar[str] = ""

    def __post_init__(self) -> None:
        from pytest_dnnsafety.engines.core.multilabel import refuse_multilabel_options

        stat = self.options.get("statistic")
        if stat in ("type1", "type2") and stat != self.ground_truth:
            want, task = ("multi-label", "single-label") if stat == "type2" else ("single-label", "multi-label")
            other = "type1" if stat == "type2" else "type2"
            raise ConfigError(f"{self.marker}: statistic={stat!r} is the {want} ground-truth confusion, but this "
                              f"model is {task} (task {self.task!r}). Fix: statistic={other!r} for a {task} model, "
                              f"or give {want} data (or task='{want}').")
        refuse_multilabel_options(self.marker, self.options, self.multi)

    @staticmethod
    def for_task(task: str, marker: str, data: str, options: Mapping[str, Any]) -> InspectionPlan:
        """The variant of ``task`` (``"multi-label"`` or single-label) for the marker's options by keyword."""
        variant = MultiLabelInspection if task == "multi-label" else SingleLabelInspection
        return variant(marker, data, options)

    @property
    def classes(self) -> list[Any] | None:
        return list(self.options["classes"]) if self.options["classes"] is not None else None

    # ------------------------------------------------------------------------------------- the counts
    def inspect(self, model: Any, read: Callable[[Any], tuple[Any, Any]], shard: Any, *,
                bias: bool) -> tuple[Any, Any]:
        """The engine's result for the layer and the ground truth (a :class:`~.multilabel.GroundTruth`; None
        without labels). ``read(shard)``: this rank's ``(LayerActivations, ModelOutputs)`` of the layer (``shard``:
        this torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard`, None for the whole data)."""
        from pytest_dnnsafety.runtime import torchrun as ranks

        check_layer(model, self.options["layer"], self.marker)
        acts, out, top = ranks.together(lambda: self._checked(*read(shard)), sharded=shard is not None)
        k = out.num_classes
        classes = self.classes
        if k is None:  # the names, else the largest class index any rank saw
            k = len(classes) if classes is not None else max(ranks.gather(top) if shard is not None else [top]) + 1
        kind = self._kind(out, shard is not None)
        engine = ranks.merged(lambda: self._engine(acts, out, int(k), kind), shard)  # per-class counts: sums
        res, truth = self._compute(engine, {"rule": self.options["rule"], "top_share": self.options["top_share"],
                                            "bias": bias, "label_filter": self.options.get("label_filter", True),
                                            "classes": classes})
        if res.unpredicted and self.options["unpredicted"] == "error":
            names = ", ".join(res.classes[i] for i in res.unpredicted)
            raise MetricError(
                f"{self.marker}: class(es) {names} were never predicted on the {res.n_inputs} inputs of fixture "
                f"{self.data!r}, so p(n | class) is undefined for them and their confusion with the other classes "
                "cannot be measured (a class the model never outputs is itself a defect). Fix: check the model "
                "(e.g. its last layer for these outputs) and give data with inputs of every class; or pass "
                "unpredicted='exclude' to gate on the other classes only.")
        return res, truth

    def _checked(self, acts: Any, out: Any) -> tuple[Any, Any, int]:
        """This rank's rows, checked: the labels and the number of classes; the largest class index seen (-1 unless
        a label-returning model without ``classes=`` leaves the number of classes to the data)."""
        import torch

        self._check_labels(out)
        k, classes = out.num_classes, self.classes
        if k is not None and classes is not None and len(classes) != k:
            raise ConfigError(f"{self.marker}: classes= names {len(classes)} classes but the model has {k} outputs. "
                              "Fix: name every output, in order.")
        self._check_class_labels(out)
        if k is None and classes is None:  # a label-returning model: the largest class index seen
            return acts, out, int(out.predictions.max() if out.labels is None
                                  else torch.maximum(out.predictions.max(), out.labels.max()))
        return acts, out, -1

    def _check_labels(self, out: Any) -> None:
        """The task's check of the outputs and labels before the number of classes is compared."""

    def _check_class_labels(self, out: Any) -> None:
        """The task's check of the labels against the classes."""

    def _kind(self, out: Any, sharded: bool) -> str | None:
        """What the outputs are (multi-label: 'logits' or 'probabilities', the same on every rank)."""
        return None

    @abstractmethod
    def _engine(self, acts: Any, out: Any, k: int, kind: str | None) -> Any:
        """The task's engine, filled with this rank's active units, predictions and labels."""

    @abstractmethod
    def _compute(self, engine: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        """The analysis of the merged counts and the ground truth (None without labels)."""

    def _active(self, acts: Any) -> Any:
        from pytest_dnnsafety.engines.inspection.kernels import layer_activity

        return layer_activity(acts, self.options["activation_threshold"], reduce=self.options["reduce"])

    # ------------------------------------------------------------------------------------- the reports
    def _base_details(self, res: Any, by: str, model: Any) -> dict[str, Any]:
        from pytest_dnnsafety.engines.core.capture import activations_from

        opts = self.options
        return {"layer": opts["layer"], "reduce": opts["reduce"], **activations_from(model),
                "unpredicted_policy": opts["unpredicted"], **res.to_details(top=opts["top"], by=by),
                "comparable_set": {"what": EXCLUDED_SET, "items": [res.classes[i] for i in res.unpredicted]}}

    def _excluded_too_many(self, res: Any) -> str | None:
        """Why the gate is inconclusive when ``unpredicted='exclude'`` left out more than half of the classes."""
        k, left = res.num_classes, len(res.unpredicted)
        if 2 * left <= k:
            return None
        names = [res.classes[i] for i in res.unpredicted]
        shown = ", ".join(names[:20]) + (f", … ({left - 20} more)" if left > 20 else "")
        return (f"{self.marker}: unpredicted='exclude' left out {left} of {k} classes, never predicted on the "
                f"{res.n_inputs} inputs of fixture {self.data!r}: {shown}. A model that predicts only {k - left} of "
                f"its {k} classes (collapsed, untrained or broken) gives no signal, and the pairs that remain say "
                "nothing about its confusion or bias. Fix: check the model and give data with inputs of every "
                "class; unpredicted='exclude' is for a few classes the data rarely shows (at most half of them)")

    def _no_signal(self, res: Any, details: dict[str, Any]) -> dict[str, Any]:
        k = res.num_classes
        detail = (f"layer {self.options['layer']}: {k - len(res.unpredicted)} of {k} classes predicted on "
                  f"{res.n_inputs} inputs, the rest excluded (unpredicted='exclude'): no signal")
        return {"value": float("nan"), "detail": detail, "details": details,
                "inconclusive": self._excluded_too_many(res)}

    def _truth_details(self, res: Any, truth: Any) -> dict[str, Any]:
        """The ground truth for the details: the pair matrix (K ≤ 64), its worst supported pair, coincidence."""
        from pytest_dnnsafety.engines.inspection.deepinspect import _json_matrix
        from pytest_dnnsafety.engines.inspection.multilabel import spearman, worst_pair

        min_support = self.options["min_support"]
        value, pair, n_ok, n_bad = worst_pair(truth, min_support)
        out: dict[str, Any] = {f"{truth.kind}_worst": {
            "value": None if pair is None else value, "pair": None if pair is None else [res.classes[i] for i in pair],
            "min_support": min_support, "supported_pairs": n_ok, "unsupported_pairs": n_bad}}
        if res.num_classes <= 64:
            out[f"{truth.kind}_matrix"] = _json_matrix(truth.matrix)
            out[f"{truth.kind}_support"] = truth.support.tolist()
        if self.multi and truth.coincidence is not None:
            if res.num_classes <= 64:
                out["coincidence"] = _json_matrix(truth.coincidence)
            out["coincidence_napvd_spearman"] = spearman(res.napvd, truth.coincidence)
        return out

    def confusion_report(self, res: Any, truth: Any, model: Any) -> dict[str, Any]:
        """``value``, ``detail``, ``details`` (and ``inconclusive``) of ``max_class_confusion``: the largest
        1 − NAPVD, the share of confused pairs, or the largest ground-truth type-1/type-2 confusion."""
        stat, layer = self.options["statistic"], self.options["layer"]
        details = {"statistic": stat, "task": self.task, **self._base_details(res, "confusion", model),
                   **(self._truth_details(res, truth) if truth is not None else {})}
        if self._excluded_too_many(res):
            return self._no_signal(res, details)
        if stat in ("type1", "type2"):
            return self._ground_truth_report(res, truth, details)
        value = res.max_confusion() if stat == "confusion" else res.confused_share()
        label = "max confusion 1 − NAPVD" if stat == "confusion" else "share of confused pairs"
        return {"value": value, "detail": f"layer {layer}, {label} {value:.4g}; {res.detail()}", "details": details}

    def _ground_truth_report(self, res: Any, truth: Any, details: dict[str, Any]) -> dict[str, Any]:
        """The largest type-1/type-2 confusion over the pairs with ``min_support`` inputs in each conditioning set."""
        from pytest_dnnsafety.engines.inspection.multilabel import worst_pair

        stat, layer, min_support = self.options["statistic"], self.options["layer"], self.options["min_support"]
        if truth is None:
            raise MetricError(f"{self.marker}: statistic={stat!r} is measured against the labels, and fixture "
                              f"{self.data!r} has none. Fix: give labelled data, or statistic='confusion'.")
        value, pair, n_ok, n_bad = worst_pair(truth, min_support)
        what = ("P(both predicted | one present, the other absent)" if stat == "type2"
                else "P(predicted as the other | true class)")
        if pair is None:
            why = (f"no class pair has {min_support} or more inputs in each conditioning set ({what}; {n_bad} pairs "
                   "undefined or below min_support), so the ground-truth confusion cannot be measured. Fix: add "
                   "labelled data with the classes apart (and present), or lower min_support")
            return {"value": float("nan"), "detail": f"layer {layer}, {stat} confusion: no supported pair",
                    "details": details, "inconclusive": why}
        a, b = (res.classes[i] for i in pair)
        detail = (f"layer {layer}, max {stat} confusion {value:.4g} for {a}–{b} (mean of both directions of {what}); "
                  f"{n_ok} pairs with ≥ {min_support} inputs per condition" + (f", {n_bad} without (not gated)"
                                                                               if n_bad else ""))
        return {"value": value, "detail": detail, "details": details}

    def bias_report(self, res: Any, model: Any) -> dict[str, Any]:
        """``value``, ``detail``, ``details`` and ``inconclusive`` of ``max_class_bias``: the largest avg_bias;
        inconclusive when every avg_bias is 0 because no triplet counted (no evidence, not no bias)."""
        details = self._base_details(res, "bias", model)
        if self._excluded_too_many(res):
            return self._no_signal(res, details)
        value = res.max_bias()  # raises InspectionError (naming the fix) with fewer than three classes
        detail = f"layer {self.options['layer']}, {res.detail(by='bias')}"
        if res.bias_no_signal is not None:
            return {"value": float("nan"), "detail": detail, "details": details, "inconclusive": res.bias_no_signal}
        return {"value": value, "detail": detail, "details": details}


class SingleLabelInspection(InspectionPlan):
    """A single-label model: an input counts for its predicted class; ground truth: type-1 confusion."""

    task = "single-label"
    ground_truth = "type1"

    def _check_class_labels(self, out: Any) -> None:
        out.check_labels(self.data, self.classes)

    def _engine(self, acts: Any, out: Any, k: int, kind: str | None) -> Any:
        from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine

        active = self._active(acts)
        device = out.predictions.device
        labels = out.labels.to(device) if out.labels is not None else None
        engine = InspectionEngine(int(active.shape[1]), k, threshold=self.options["activation_threshold"],
                                  device=device)
        engine.update(active.to(device), out.predictions, labels)
        return engine

    def _compute(self, engine: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        from pytest_dnnsafety.engines.inspection.multilabel import type1_pairs

        res = engine.compute(**options)
        return res, (type1_pairs(engine.confusion) if int(engine.labelled) else None)


class MultiLabelInspection(InspectionPlan):
    """A multi-label model: an input counts for every class it predicts (probability ≥ ``decision_threshold``);
    ground truth: type-2 confusion and the label coincidence."""

    task = "multi-label"
    multi = True
    ground_truth = "type2"

    def _check_labels(self, out: Any) -> None:
        from pytest_dnnsafety.engines.core.multilabel import check_label_matrix

        check_label_matrix(out, self.marker, self.data, required=False)

    def _kind(self, out: Any, sharded: bool) -> str | None:
        from pytest_dnnsafety.engines.core.multilabel import output_kind

        return output_kind(self.options.get("outputs"), out.logits, sharded)

    def _engine(self, acts: Any, out: Any, k: int, kind: str | None) -> Any:
        from pytest_dnnsafety.engines.core.multilabel import predicted_sets
        from pytest_dnnsafety.engines.inspection.multilabel import (
            MultiLabelInspectionEngine,
        )

        active = self._active(acts)
        device = out.predictions.device
        labels = out.labels.to(device) if out.labels is not None else None
        threshold = 0.5 if self.options.get("decision_threshold") is None else self.options["decision_threshold"]
        engine = MultiLabelInspectionEngine(int(active.shape[1]), k, threshold=self.options["activation_threshold"],
                                            device=device)
        engine.update(active.to(device), predicted_sets(out.logits.to(device), threshold, kind), labels)
        return engine

    def _compute(self, engine: Any, options: dict[str, Any]) -> tuple[Any, Any]:
        return engine.compute(**options)
