"""DeepInspect for multi-label classifiers (Tian et al. 2020, §III, §IV-B1, RQ1c): known answers and references.

The engine's NAP (``Aᵀ P / colsum P``), type-2 confusion and coincidence equal brute-force loops over
inputs, classes and pairs (to 1e-12); type-2 is symmetric and in [0, 1] (hypothesis); with one-hot
predictions the multi-label NAPVD is the single-label one. End to end: a multi-label project whose
model predicts classes 3 and 5 together whenever either is present has type-2 confusion ≈ 1 for (3, 5)
and fails ``max_class_confusion(0.3, statistic="type2")`` naming the pair; the honest model passes;
single-label data given a multi-label statistic or option, and a detector task, are errors naming the fix.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import GateProject
from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine
from pytest_dnnsafety.engines.inspection.multilabel import MultiLabelInspectionEngine, coincidence, spearman, type1_pairs, type2_pairs, worst_pair
from pytest_dnnsafety.engines.core.multilabel import predicted_sets, probabilities


def _random(seed: int, n: int = 40, units: int = 7, k: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, units, generator=g) < 0.5, torch.rand(n, k, generator=g) < 0.5,
            torch.rand(n, k, generator=g) < 0.4)


def _engine(a: torch.Tensor, p: torch.Tensor, y: torch.Tensor | None, split: int = 17) -> MultiLabelInspectionEngine:
    engine = MultiLabelInspectionEngine(a.shape[1], p.shape[1])
    for part in (slice(0, split), slice(split, None)):  # two batches: the counts add up
        engine.update(a[part], p[part], None if y is None else y[part].long())
    return engine


# ------------------------------------------------------------------------------------- brute-force references
def _brute(a: np.ndarray, p: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, k = p.shape
    nap = np.full((a.shape[1], k), np.nan)
    for c in range(k):
        rows = [i for i in range(n) if p[i, c]]
        if rows:
            nap[:, c] = [sum(a[i, u] for i in rows) / len(rows) for u in range(a.shape[1])]
    t2 = np.full((k, k), np.nan)
    co = np.full((k, k), np.nan)
    for s, t in itertools.combinations(range(k), 2):
        dirs = []
        for u, v in ((s, t), (t, s)):
            cond = [i for i in range(n) if y[i, u] and not y[i, v]]
            dirs.append(sum(bool(p[i, s] and p[i, t]) for i in cond) / len(cond) if cond else math.nan)
        t2[s, t] = t2[t, s] = (dirs[0] + dirs[1]) / 2
        has_s, has_t = [i for i in range(n) if y[i, s]], [i for i in range(n) if y[i, t]]
        both = sum(1 for i in range(n) if y[i, s] and y[i, t])
        if has_s and has_t:
            co[s, t] = co[t, s] = (both / len(has_s) + both / len(has_t)) / 2
    return nap, t2, co


@pytest.mark.parametrize("seed", range(4))
def test_nap_type2_and_coincidence_equal_brute_force_loops(seed: int) -> None:
    a, p, y = _random(seed)
    res, truth = _engine(a, p, y).compute(bias=False)
    nap, t2, co = _brute(a.numpy(), p.numpy(), y.numpy())
    np.testing.assert_allclose(res.probabilities.numpy(), nap, atol=1e-12, rtol=0)
    np.testing.assert_allclose(truth.matrix.numpy(), t2, atol=1e-12, rtol=0)
    np.testing.assert_allclose(truth.coincidence.numpy(), co, atol=1e-12, rtol=0)
    assert res.n_inputs == 40 and truth.kind == "type2"


def test_one_hot_predictions_give_the_single_label_napvd() -> None:
    g = torch.Generator().manual_seed(5)
    a = torch.rand(60, 9, generator=g) < 0.5
    pred = torch.arange(60) % 4
    single = InspectionEngine(9, 4)
    single.update(a, pred)
    multi, _ = _engine(a, torch.nn.functional.one_hot(pred, 4).bool(), None).compute(bias=True)
    expected = single.compute(bias=True)
    np.testing.assert_allclose(multi.napvd.numpy(), expected.napvd.numpy(), atol=1e-12)
    np.testing.assert_allclose(multi.pair_bias.numpy(), expected.pair_bias.numpy(), atol=1e-12)


def test_type1_pairs_and_worst_pair_follow_the_support_rule() -> None:
    conf = torch.tensor([[8, 2, 0], [1, 9, 0], [0, 3, 2]])  # class 2 has 5 true inputs
    truth = type1_pairs(conf)
    assert truth.matrix[0, 1] == pytest.approx((2 / 10 + 1 / 10) / 2)
    assert truth.matrix[1, 2] == pytest.approx((0 / 10 + 3 / 5) / 2) and truth.support[1, 2] == 5
    assert worst_pair(truth, 5)[:2] == (pytest.approx(0.3), (1, 2))
    value, pair, ok, bad = worst_pair(truth, 6)  # the (1, 2) and (0, 2) pairs lack support: not gated
    assert (pair, ok, bad) == ((0, 1), 1, 2) and value == pytest.approx(0.15)
    value, pair, ok, bad = worst_pair(truth, 11)
    assert math.isnan(value) and pair is None and ok == 0 and bad == 3


def test_a_class_never_alone_leaves_its_pairs_undefined() -> None:
    y = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 1]]).bool()  # 0 and 1 always together
    p = y.clone()
    both = (y & p).double().T @ (~y & p).double()
    matrix, support = type2_pairs(both, y.double().T @ (~y).double())
    assert math.isnan(matrix[0, 1]) and support[0, 1] == 0 and matrix[0, 2] == 0
    assert coincidence(y.double().T @ y.double())[0, 1] == 1.0


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 30), st.integers(2, 6), st.integers(0, 10**6))
def test_type2_is_symmetric_and_in_the_unit_interval(n: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    y, p = torch.rand(n, k, generator=g) < 0.5, torch.rand(n, k, generator=g) < 0.5
    matrix, support = type2_pairs((y & p).double().T @ (~y & p).double(), y.double().T @ (~y).double())
    m = matrix.numpy()
    assert np.array_equal(np.isnan(m), np.isnan(m.T)) and np.allclose(np.nan_to_num(m), np.nan_to_num(m.T))
    finite = m[~np.isnan(m)]
    assert ((finite >= 0) & (finite <= 1)).all() and np.isnan(np.diag(m)).all()
    assert torch.equal(support, support.T)


def test_outputs_and_decision_thresholds() -> None:
    logits = torch.tensor([[-2.0, 0.1, 3.0], [0.0, -0.1, 1.5]])
    assert torch.equal(predicted_sets(logits), torch.tensor([[False, True, True], [True, False, True]]))
    probs = torch.tensor([[0.2, 0.55, 0.9], [0.5, 0.45, 0.7]])
    assert torch.equal(probabilities(probs), probs)  # auto: already in [0, 1]
    expected = torch.tensor([[True, False, True], [True, False, False]])
    assert torch.equal(predicted_sets(probs, [0.1, 0.6, 0.8]), expected)
    with pytest.raises(Exception, match="outputs='logits'"):
        probabilities(logits, "probabilities")
    with pytest.raises(Exception, match="2 values but the model has 3"):
        predicted_sets(probs, [0.5, 0.5])


def test_spearman_is_reported_with_its_p_value() -> None:
    d = torch.tensor([[0, .1, .5, .9], [.1, 0, .4, .8], [.5, .4, 0, .3], [.9, .8, .3, 0]]).double()
    out = spearman(d, 1 - d)
    assert out["pairs"] == 6 and out["rho"] == pytest.approx(-1.0) and out["p_value"] < 0.01


# ------------------------------------------------------------------------------------- end to end
K, N = 6, 300

MLNET = f"""
import torch
from torch import nn

K = {K}


class Net(nn.Module):
    '''logits = 4·x through a hidden layer of 2K units ([x]+ and [−x]+); confused: 3 and 5 fire together.'''

    def __init__(self, confused=False):
        super().__init__()
        self.hidden = nn.Linear(K, 2 * K)
        self.act = nn.ReLU()
        self.head = nn.Linear(2 * K, K)
        eye = torch.eye(K)
        with torch.no_grad():
            self.hidden.weight.copy_(torch.cat([eye, -eye]))
            self.hidden.bias.zero_()
            self.head.weight.copy_(4 * torch.cat([eye, -eye], 1))
            self.head.bias.zero_()
            if confused:  # logit = 4 (x3 + x5) + 4: positive whenever 3 or 5 is present
                for c in (3, 5):
                    row = torch.zeros(K)
                    row[3] = row[5] = 4.0
                    self.head.weight[c] = torch.cat([row, -row])
                    self.head.bias[c] = 4.0

    def forward(self, x):
        return self.head(self.act(self.hidden(x)))


def data(single=False):
    g = torch.Generator().manual_seed(0)
    y = (torch.rand({N}, K, generator=g) < 0.4).long()
    noise = torch.randn({N}, K, generator=g) * torch.where(torch.arange({N}) % 2 == 1, 0.9, 0.2)[:, None]
    x = 2 * y.float() - 1 + noise
    if single:  # one class per input, its column raised: a single-label model clearly better than chance
        label = torch.arange({N}) % K
        return torch.utils.data.TensorDataset(x + 3 * torch.nn.functional.one_hot(label, K), label)
    return torch.utils.data.TensorDataset(x, y)
"""

CONFTEST = """
import pytest
import mlnet


@pytest.fixture(scope="session")
def model():
    return mlnet.Net(confused={confused}).eval()


@pytest.fixture(scope="session")
def dataset():
    return mlnet.data(single={single})
"""


def ml_project(gate_project: GateProject, gates: dict[str, str], *, confused: bool = False,
               single: bool = False) -> GateProject:
    """A multi-label project (or single-label data for the refusals): one test per gate, evidence in JSON."""
    gate_project.write("mlnet.py", MLNET)
    gate_project.write("conftest.py", CONFTEST.format(confused=confused, single=single))
    gate_project.write("data/conditions.toml", '[conditions]\nlighting = ["day", "night"]\n')
    gate_project.write("data/scenarios.csv", "lighting\n" + "".join(("day", "night")[i % 2] + "\n" for i in range(N)))
    lines = ["import pytest", ""]
    for name, marker in gates.items():
        lines += [f"@pytest.mark.{marker}", f"def test_{name}(model, dataset, scenario_table):", "    pass", ""]
    gate_project.tests("\n".join(lines))
    return gate_project


def run_gates(project: GateProject) -> tuple[pytest.RunResult, dict[str, dict]]:
    result = project.run("--dnnsafety-json=evidence.json")
    evidence = json.loads((project.pytester.path / "evidence.json").read_text())
    return result, {g["nodeid"].split("::test_")[1]: g for g in evidence["gates"]}


GATES = {
    "type2": "max_class_confusion(0.3, layer='hidden', statistic='type2')",
    "napvd": "max_class_confusion(1.0, layer='hidden')",
    "bias": "max_class_bias(0.5, layer='hidden', decision_threshold=0.5, outputs='logits')",
}


def test_the_honest_model_passes_with_the_heat_map_keys(gate_project: GateProject) -> None:
    result, gates = run_gates(ml_project(gate_project, GATES))
    assert gates["type2"]["status"] == "passed", result.stdout.str()
    d = gates["type2"]["details"]
    assert d["task"] == "multi-label" and d["classes"] == [str(i) for i in range(K)]
    m = np.array([[np.nan if v is None else v for v in row] for row in d["type2_matrix"]])
    assert m.shape == (K, K) and np.isnan(np.diag(m)).all() and np.nanmax(m) < 0.3
    assert d["type2_worst"]["supported_pairs"] == K * (K - 1) // 2
    assert set(d["coincidence_napvd_spearman"]) >= {"rho", "p_value", "pairs"}
    assert gates["napvd"]["status"] == "passed" and 0 <= gates["napvd"]["value"] <= 1
    assert gates["bias"]["status"] in ("passed", "inconclusive"), gates["bias"]


def test_a_model_predicting_3_and_5_together_fails_naming_the_pair(gate_project: GateProject) -> None:
    result, gates = run_gates(ml_project(gate_project, {"type2": GATES["type2"]}, confused=True))
    assert result.ret != 0
    gate = gates["type2"]
    assert gate["status"] == "failed" and gate["value"] > 0.9, gate  # 1 on the clean half, noise at night
    assert gate["details"]["type2_worst"]["pair"] == ["3", "5"]
    assert gate["details"]["type2_matrix"][3][5] == pytest.approx(gate["value"])
    result.stdout.fnmatch_lines(["*max type2 confusion * for 3–5*"])


def test_single_label_data_and_detectors_are_refused_naming_the_fix(gate_project: GateProject) -> None:
    gates = {"type2": "max_class_confusion(0.3, layer='hidden', statistic='type2')",
             "threshold": "max_class_confusion(0.9, layer='hidden', decision_threshold=0.4)",
             "type1": "max_class_confusion(0.9, layer='hidden', statistic='type1', min_support=5, "
                      "unpredicted='exclude')"}
    result, got = run_gates(ml_project(gate_project, gates, single=True))
    out = result.stdout.str()
    assert got["type2"]["status"] == "error" and "statistic='type1' for a single-label model" in out
    assert got["threshold"]["status"] == "error" and "decision_threshold only applies to multi-label" in out
    assert got["type1"]["status"] in ("passed", "failed") and got["type1"]["details"]["type1_worst"]["pair"]
    detector = ml_project(gate_project, {"detector": "max_class_confusion(0.9, layer='hidden', task='detection')"})
    detector.run().stdout.fnmatch_lines(["*max_class_confusion does not support task 'detection'*Fix:*"])
