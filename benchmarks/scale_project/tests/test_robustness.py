"""Robustness: attacks on a subset at 224x224, certified bounds and safe radii at 16x16.

CROWN bounds Conv, BatchNorm, ReLU and residual additions, not LayerNorm or softmax, so the certified
gates run on the CIFAR-stem ResNet (``small_model``, trained on the images averaged down to 16x16;
CROWN's cost grows steeply with the image: over 4 minutes for one 32x32 image on a loaded 2-core CPU).
"""

import pytest


@pytest.mark.max_adversarial_confidence_loss(0.9, eps=1 / 255, families=["fgsm", "pgd"], steps=2, clip=(0, 1),
                                             data="attack_data")
def test_confidence_under_attack():
    """Mean drop of the true class's probability under the worse of FGSM and 2-step PGD at 1/255."""


@pytest.mark.min_robust_accuracy(0.05, eps=1 / 255, families=["fgsm", "pgd"], steps=2, clip=(0, 1),
                                 data="attack_data")
def test_robust_accuracy():
    """Share of images classified correctly clean and under both attacks (reuses the run above)."""


@pytest.mark.min_verified_robustness(0.0, eps=0.5 / 255, method="crown", clip=(0, 1), attack_steps=5,
                                     model="small_model", data="small_data")
def test_verified_robustness_16px():
    """Share of 16x16 images CROWN proves robust at 0.5/255 (reported; the threshold only needs a verdict)."""


@pytest.mark.min_safe_radius(0.0, d=0.05, iterations=3, starts=1, ascent_starts=1, ascent_steps=2,
                             certified_steps=3, certified="ibp", model="small_model", data="radius_data")
def test_safe_radius_16px():
    """The certified minimum safe radius over a few 16x16 images."""
