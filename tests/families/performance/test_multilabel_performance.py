"""Scenario performance for multi-label classifiers: subset accuracy, precision/recall/F1 (micro/macro), bootstrap.

Micro and macro F1 (and precision, recall) of the counts equal scikit-learn's on random cases, for
multi-label and single-label decisions; the bootstrap is seeded (same seed, same numbers) and its
bound is never above the point value; a group of perfect inputs does not get a lower bound of 1.
End to end (the multi-label project of ``test_multilabel_inspection``): subset accuracy with its exact
Clopper–Pearson bound and F1 per ``lighting`` group equal a numpy/scikit-learn reference, the night
(noisier) group is the worst, a model that predicts the opposite of every class fails, and a
multi-label option given to single-label data is an error naming the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_score, recall_score

from conftest import GateProject
from pytest_dnnsafety.engines.performance.multilabel import bootstrap_bounds, score_counts, scores
from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine
from pytest_dnnsafety.stats.intervals import clopper_pearson_lower
from test_multilabel_inspection import N, ml_project, run_gates

SKLEARN = {"precision": precision_score, "recall": recall_score, "f1": f1_score}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("score", ["precision", "recall", "f1"])
@pytest.mark.parametrize("average", ["micro", "macro"])
def test_scores_equal_sklearn_on_random_multilabel_cases(seed: int, score: str, average: str) -> None:
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(50, 7, generator=g) < 0.3).long()
    p = (torch.rand(50, 7, generator=g) < 0.3).long()
    p[:, 6] = 0  # a class never predicted (precision 0/0 counts 0, as zero_division=0)
    y[:, 5] = 0
    value, per = scores(score_counts(p, y).sum(0), score, average)
    ref = SKLEARN[score](y.numpy(), p.numpy(), average=average, zero_division=0)
    assert float(value) == pytest.approx(ref, abs=1e-12)
    per_ref = SKLEARN[score](y.numpy(), p.numpy(), average=None, zero_division=0)
    np.testing.assert_allclose(per.numpy(), per_ref, atol=1e-12)


@pytest.mark.parametrize("average", ["micro", "macro"])
def test_single_label_scores_equal_sklearn(average: str) -> None:
    g = torch.Generator().manual_seed(3)
    y, p = torch.randint(0, 4, (80,), generator=g), torch.randint(0, 4, (80,), generator=g)
    value, _ = scores(score_counts(p, y, 4).sum(0), "f1", average)
    assert float(value) == pytest.approx(f1_score(y.numpy(), p.numpy(), average=average, labels=range(4)), abs=1e-12)


def test_bootstrap_is_seeded_and_brackets_the_point_value() -> None:
    g = torch.Generator().manual_seed(0)
    y, p = torch.rand(120, 5, generator=g) < 0.4, torch.rand(120, 5, generator=g) < 0.4
    counts = score_counts(p, y)
    first = bootstrap_bounds(counts, "f1", "micro", levels=[0.95, 0.975], replicates=500, seed=7)
    again = bootstrap_bounds(counts, "f1", "micro", levels=[0.95, 0.975], replicates=500, seed=7, chunk_elements=999)
    other = bootstrap_bounds(counts, "f1", "micro", levels=[0.95, 0.975], replicates=500, seed=8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    point = float(scores(counts.sum(0), "f1", "micro")[0])
    assert first[0][1] <= first[0][0] <= point <= first[1][0] <= first[1][1]


def test_a_group_of_perfect_inputs_is_not_bounded_at_one() -> None:
    y = (torch.rand(30, 4, generator=torch.Generator().manual_seed(1)) < 0.5).long()
    engine = ScenarioPerformanceEngine(["g"], [["a"]], confidence=0.95, min_samples=1)
    result = engine.compute_scores(torch.zeros(30, dtype=torch.int64), score_counts(y, y), "recall", "micro",
                                   replicates=200, seed=0)
    group = result.groups[0]
    assert group.accuracy == 1.0 and result.bound_kind == "estimate"
    assert group.lower == pytest.approx(float(clopper_pearson_lower([30], [30], 0.95)[0]))  # not the bootstrap's 1


# ------------------------------------------------------------------------------------- end to end
GATES = {
    "subset": 'min_scenario_accuracy(0.3, by=["lighting"])',
    "f1": 'min_scenario_accuracy(0.5, by=["lighting"], score="f1", average="macro", per_class=True, replicates=500)',
    "recall_drop": 'max_scenario_degradation(0.5, by=["lighting"], score="recall", statistic="bound", replicates=500)',
    "precision": 'min_scenario_accuracy(0.5, by=["lighting"], score="precision", decision_threshold=[0.5] * 6, '
                 'outputs="logits", replicates=500)',
}


def _reference() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, decisions (logit 4x ≥ 0) and night mask of the project's data, computed here."""
    import importlib.util
    import sys
    import tempfile
    from pathlib import Path

    from test_multilabel_inspection import MLNET

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mlnet_ref.py"
        path.write_text(MLNET)
        spec = importlib.util.spec_from_file_location("mlnet_ref", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["mlnet_ref"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    x, y = module.data().tensors
    with torch.no_grad():
        pred = (torch.sigmoid(module.Net()(x)) >= 0.5).long()
    return y.numpy(), pred.numpy(), (np.arange(N) % 2 == 1)


def test_multilabel_scores_per_group_match_the_reference(gate_project: GateProject) -> None:
    result, gates = run_gates(ml_project(gate_project, GATES))
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(GATES, "passed"), result.stdout.str()
    y, p, night = _reference()
    subset = (y == p).all(1)
    worst = gates["subset"]
    assert worst["details"]["worst_group"] == "lighting=night" and worst["details"]["score"] == "accuracy"
    assert worst["value"] == pytest.approx(subset[night].mean())
    hits = int(subset[night].sum())
    assert worst["bound"] == pytest.approx(float(clopper_pearson_lower([hits], [night.sum()], 0.95)[0]))
    f1 = gates["f1"]
    assert f1["details"]["worst_group"] == "lighting=night" and f1["details"]["bound_kind"] == "estimate"
    assert f1["value"] == pytest.approx(f1_score(y[night], p[night], average="macro", zero_division=0), abs=1e-12)
    night_row = next(g for g in f1["details"]["groups"] if g["group"] == "lighting=night")
    np.testing.assert_allclose(night_row["per_class"], f1_score(y[night], p[night], average=None, zero_division=0))
    assert f1["bound"] <= f1["value"]
    drop = gates["recall_drop"]
    overall = recall_score(y, p, average="micro")
    assert drop["details"]["accuracy"] == pytest.approx(overall, abs=1e-12)
    assert drop["value"] >= overall - recall_score(y[night], p[night], average="micro") - 1e-12
    assert gates["precision"]["details"]["score"] == "precision"


def test_a_model_predicting_the_opposite_fails(gate_project: GateProject) -> None:
    project = ml_project(gate_project, {"f1": GATES["f1"], "subset": GATES["subset"]})
    project.write("conftest.py", "import pytest\nimport mlnet\n\n\n@pytest.fixture(scope='session')\ndef model():\n"
                                 "    net = mlnet.Net()\n    with __import__('torch').no_grad():\n"
                                 "        net.head.weight.neg_()\n    return net.eval()\n\n\n"
                                 "@pytest.fixture(scope='session')\ndef dataset():\n    return mlnet.data()\n")
    result, gates = run_gates(project)
    assert result.ret != 0
    assert gates["f1"]["status"] == "failed" and gates["f1"]["value"] < 0.2
    assert gates["subset"]["status"] == "failed" and gates["subset"]["value"] < 0.05


def test_multilabel_options_on_single_label_data_are_errors(gate_project: GateProject) -> None:
    gates = {"threshold": 'min_scenario_accuracy(0.1, by=["lighting"], decision_threshold=0.4)',
             "f1": 'min_scenario_accuracy(0.0, by=["lighting"], score="f1", average="macro", replicates=200)'}
    result, got = run_gates(ml_project(gate_project, gates, single=True))
    assert got["threshold"]["status"] == "error"
    result.stdout.fnmatch_lines(["*decision_threshold only applies to multi-label models*Fix: drop it*"])
    assert got["f1"]["status"] in ("passed", "failed") and got["f1"]["details"]["average"] == "macro"
