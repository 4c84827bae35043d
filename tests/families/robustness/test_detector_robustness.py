"""Adversarial confidence and robust accuracy gates on an object detector: per ground-truth object, the matched
score (Cheng et al. 2018, §II-F step 2) in place of the true class's probability in eq. (4).

Known answers on the blob detector (:mod:`_blob_detector`): the detector that scores the box's mean
brightness keeps its scores under small noise, brightness and translation (it passes); the one that scores
the share of pixels in an exact intensity band collapses under noise (it fails); shifted boxes match
nothing (no confidence to lose: inconclusive, never a pass). The gradient families descend the matched
scores: FGSM at ε lowers the box-mean score by exactly ε (its gradient is 1/area on every box pixel), and a
detector whose scores have no gradient is an error naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from _blob_detector import BlobDetector, blob_data, blob_project, gates_of
from conftest import GateProject
from pytest_dnnsafety.engines.robustness.perturbations import worst_of
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.data.tasks import DetectionData

FAMILIES = "families=('gaussian_noise', 'brightness', 'translation'), clip=(0, 1)"
BUDGETS = "eps=None, budgets={'gaussian_noise': 0.1, 'brightness': 0.05, 'translation': 1.0}"
GATES = {
    "loss": f"max_adversarial_confidence_loss(0.1, {FAMILIES}, {BUDGETS})",
    "robust": f"min_robust_accuracy(0.9, {FAMILIES}, {BUDGETS})",
    "gradient": "max_adversarial_confidence_loss(0.1, eps=0.05, clip=(0, 1))",  # the default fgsm and pgd
}


def _statuses(project) -> dict[str, str]:
    return {k: g["status"] for k, g in gates_of(project).items()}


def test_stable_detector_passes(gate_project: GateProject) -> None:
    project = blob_project(gate_project, GATES)
    result = project.run("--dnnsafety-json=evidence.json")
    assert _statuses(project) == dict.fromkeys(GATES, "passed"), result.stdout.str()
    gates = gates_of(project)
    assert gates["gradient"]["value"] == pytest.approx(0.05, abs=1e-5)
    assert gates["gradient"]["details"]["per_family_loss"]["fgsm"] == pytest.approx(0.05, abs=1e-5)
    assert gates["loss"]["details"]["units"] == "ground-truth objects" and gates["loss"]["details"]["n"] == 24
    assert gates["robust"]["value"] == 1.0


def test_detector_whose_score_collapses_under_noise_fails(pytester: pytest.Pytester) -> None:
    project = blob_project(GateProject(pytester), GATES, model={"score": "exact"})
    result = project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert _statuses(project) == {"loss": "failed", "robust": "failed", "gradient": "error"}
    result.stdout.fnmatch_lines(["*the gradient attacks (fgsm, pgd) need a differentiable model, but its detection "
                                 "scores do not require grad*"])
    assert gates["loss"]["value"] > 0.3


def test_detector_that_finds_nothing_is_inconclusive_and_classifier_options_are_errors(
        gate_project: GateProject) -> None:
    project = blob_project(gate_project, {
        "missed": GATES["loss"],
        "gradient": GATES["gradient"],
        "probs": f"max_adversarial_confidence_loss(0.1, {FAMILIES}, {BUDGETS}, outputs='probabilities')",
    }, model={"shift": 8.0})
    result = project.run("--dnnsafety-json=evidence.json")
    statuses = _statuses(project)
    assert statuses["missed"] == statuses["gradient"] == "inconclusive", statuses
    assert statuses["probs"] == "error"
    result.stdout.fnmatch_lines(["*outputs='probabilities' is for classifiers*"])


def test_worst_of_picks_the_candidate_with_the_lowest_matched_scores() -> None:
    d = blob_data(6)
    data = DetectionData.from_offsets(d["x"], d["boxes"], d["labels"], d["offsets"])
    x, targets = data.batch(0, 6)
    dark = x.clone()
    dark[3:] = 0.0  # images 3..5: the blob gone in the second candidate
    picked = worst_of(BlobDetector(), targets, [x, dark], "logits", ForwardGuard("t", task="detection"))
    assert torch.equal(picked[:3], x[:3]) and torch.equal(picked[3:], dark[3:])
