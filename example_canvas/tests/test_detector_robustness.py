"""Does the detector look at the digits, and how much confidence do small perturbations cost it?

Both gates run on ``first_canvases`` (the first 60 evaluation canvases, about 160 digits): each
occluder position and each attack step is a forward pass of the whole canvas. A digit's "probability
of the correct class" is its matched score: the best score of a detection of its class whose box
overlaps its ground-truth box by IoU >= 0.5 (0 when the detector misses it).
"""

import pytest


@pytest.mark.min_interpretation_precision(0.65, size=6, stride=3, rho=0.5, task="detection", data="first_canvases")
def test_detections_break_only_where_the_digit_is(model, first_canvases):
    """Where a 6x6 black patch drops a digit's matched score below 0.5, the patch overlaps that digit's
    box (M_interpret per digit, mean over digits). Measured: see README."""


@pytest.mark.min_interpretation_precision(0.65, size=6, stride=3, rho=0.5, task="detection", data="first_canvases",
                                          masks="first_digit_masks")
def test_detections_break_only_where_the_ink_is(model, first_canvases, first_digit_masks):
    """The same with each digit's ink as its mask instead of its box (a box also holds background)."""


@pytest.mark.max_adversarial_confidence_loss(0.25, eps=0.01, families=("fgsm", "pgd"), clip=(0.0, 1.0),
                                             task="detection", data="first_canvases")
def test_small_attacks_cost_bounded_confidence(model, first_canvases):
    """FGSM and 10-step PGD inside an L-inf ball of 0.03 (about a twentieth of the night gain 0.35 x ink):
    mean over digits of the worst drop of its matched score. Measured: see README."""


@pytest.mark.max_adversarial_confidence_loss(
    0.5, eps=None, families=("gaussian_noise", "brightness", "contrast", "blur", "rotation"),
    budgets={"gaussian_noise": 0.05, "brightness": 0.1, "contrast": 0.2, "blur": 0.6, "rotation": 10.0},
    clip=(0.0, 1.0), task="detection", data="first_canvases")
def test_camera_drift_costs_bounded_confidence(model, first_canvases):
    """Natural drift of the camera (sensor noise 0.05, brightness +-0.1, contrast +-20%, blur 0.6 px,
    roll +-10 degrees): mean over digits of the worst family's drop of the matched score."""
