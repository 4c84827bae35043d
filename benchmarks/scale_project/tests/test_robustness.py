"""Robustness: attacks on a subset at 224x224; certified bounds and safe radii on ``certified_model``.

CROWN bounds Conv, BatchNorm, ReLU and residual additions, not LayerNorm or softmax, so the certified
gates run on a ResNet: by default the CIFAR-stem one on images averaged down to 16x16, with
``SCALE_CERTIFIED_SIZE=224`` the project's ResNet itself on the full images. ``method="auto"`` (the
default) lets the cost model choose CROWN or CROWN-IBP per input; the safe radius's ``search="auto"``
runs the coordinate search on 16x16 inputs and the batched gradient search at 224x224.
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


@pytest.mark.min_verified_robustness(0.0, eps=0.5 / 255, clip=(0, 1), attack_steps=5,
                                     model="certified_model", data="certified_data")
def test_verified_robustness():
    """Share of images the bounds prove robust at 0.5/255 (reported; the threshold only needs a verdict)."""


@pytest.mark.min_safe_radius(0.0, d=0.05, iterations=3, starts=1, ascent_starts=1, ascent_steps=2,
                             certified_steps=3, certified="ibp", model="certified_model", data="radius_data")
def test_safe_radius():
    """The certified minimum safe radius over a few images."""
