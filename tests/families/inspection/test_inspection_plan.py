"""The DeepInspect gates' plan (:mod:`pytest_dnnsafety.engines.inspection.plan`): the task variants, what each
refuses, and that a plan's counts over the shared pass equal the engine's on the same activations and predictions."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.inspection.deepinspect import inspect_classes
from pytest_dnnsafety.engines.inspection.kernels import layer_activity
from pytest_dnnsafety.engines.inspection.plan import (InspectionPlan, MultiLabelInspection, SingleLabelInspection,
                                                      check_layer)
from pytest_dnnsafety.errors import ConfigError, MetricError

#: the options of max_class_confusion as the marker parser gives them (defaults filled in)
OPTIONS: dict[str, Any] = {"layer": "1", "activation_threshold": 0.5, "reduce": "mean", "statistic": "confusion",
                           "rule": "std", "top_share": 0.01, "classes": None, "unpredicted": "error", "top": 10,
                           "min_support": 1, "decision_threshold": None, "outputs": None}


def _model_and_data(n: int = 60, k: int = 4, predicted: int = 4) -> tuple[torch.nn.Module, tuple[Any, Any]]:
    """An identity network (``k`` outputs, layer "1" its ReLU) and inputs predicted as classes ``0..predicted-1``."""
    model = torch.nn.Sequential(torch.nn.Linear(k, k), torch.nn.ReLU(), torch.nn.Linear(k, k)).eval()
    for layer in (model[0], model[2]):
        torch.nn.init.eye_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(n) % predicted
    x = torch.rand(n, k, generator=gen) + 3 * torch.nn.functional.one_hot(y, k)
    y[::7] = (y[::7] + 1) % predicted  # some labelled confusion
    return model, (x, y)


def _reader(model: Any, data: Any, layer: str) -> Any:
    cache = ActivationCache()
    return lambda shard: (cache.get(model, data, [layer], batch_size=16, device="cpu", shard=shard)[layer],
                          cache.outputs(model, data, batch_size=16, device="cpu", shard=shard))


def test_for_task_picks_the_variant() -> None:
    assert isinstance(InspectionPlan.for_task("single-label", "max_class_confusion", "dataset", OPTIONS),
                      SingleLabelInspection)
    plan = InspectionPlan.for_task("multi-label", "max_class_confusion", "dataset", OPTIONS)
    assert isinstance(plan, MultiLabelInspection) and plan.multi and plan.task == "multi-label"


def test_a_statistic_of_the_other_task_and_multilabel_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="statistic='type2' is the multi-label ground-truth confusion, but this "
                                          "model is single-label .*Fix: statistic='type1'"):
        InspectionPlan.for_task("single-label", "m", "dataset", {**OPTIONS, "statistic": "type2"})
    with pytest.raises(ConfigError, match="statistic='type1' is the single-label .*Fix: statistic='type2'"):
        InspectionPlan.for_task("multi-label", "m", "dataset", {**OPTIONS, "statistic": "type1"})
    with pytest.raises(ConfigError, match="m: decision_threshold, outputs only applies to multi-label models"):
        InspectionPlan.for_task("single-label", "m", "dataset", {**OPTIONS, "decision_threshold": 0.3,
                                                                 "outputs": "logits"})
    InspectionPlan.for_task("multi-label", "m", "dataset", {**OPTIONS, "decision_threshold": 0.3})  # read there


def test_an_unknown_layer_names_the_closest() -> None:
    model, _ = _model_and_data()
    with pytest.raises(ConfigError, match=r"m: unknown layer '11' \(did you mean '1'\?\).*model.named_modules"):
        check_layer(model, "11", "m")
    check_layer(model, "1", "m")


def test_the_plan_equals_the_engine_on_the_same_pass() -> None:
    model, data = _model_and_data()
    plan = InspectionPlan.for_task("single-label", "max_class_confusion", "dataset",
                                   {**OPTIONS, "statistic": "type1", "unpredicted": "exclude"})
    read = _reader(model, data, "1")
    res, truth = plan.inspect(model, read, None, bias=False)
    acts, out = read(None)
    direct = inspect_classes(layer_activity(acts, 0.5, reduce="mean"), out.predictions, out.labels, num_classes=4,
                             bias=False)
    assert torch.equal(res.napvd.nan_to_num(-1), direct.napvd.nan_to_num(-1))
    assert truth is not None and truth.kind == "type1"
    report = plan.confusion_report(res, truth, model)
    assert report["details"]["statistic"] == "type1" and report["details"]["task"] == "single-label"
    assert report["detail"].startswith("layer 1, max type1 confusion ")
    assert not math.isnan(report["value"])


def test_a_class_never_predicted_is_an_error_naming_the_data() -> None:
    model, data = _model_and_data()
    plan = InspectionPlan.for_task("single-label", "max_class_confusion", "dataset",
                                   {**OPTIONS, "classes": ["a", "b", "c", "d", "e"]})
    with pytest.raises(ConfigError, match="classes= names 5 classes but the model has 4 outputs"):
        plan.inspect(model, _reader(model, data, "1"), None, bias=False)
    model, data = _model_and_data(predicted=3)
    plan = InspectionPlan.for_task("single-label", "max_class_confusion", "dataset", OPTIONS)
    with pytest.raises(MetricError, match="class\\(es\\) 3 were never predicted on the 60 inputs of fixture 'dataset'"):
        plan.inspect(model, _reader(model, data, "1"), None, bias=False)
    excluded = InspectionPlan.for_task("single-label", "m", "dataset", {**OPTIONS, "unpredicted": "exclude"})
    res, _ = excluded.inspect(model, _reader(model, data, "1"), None, bias=False)
    assert res.unpredicted == (3,)
