"""The same dependability questions for the ViT-style model (LayerNorm, GELU, attention)."""

import pytest


@pytest.mark.min_scenario_accuracy(0.15, by=["lighting"], min_samples=30, model="vit_model")
def test_vit_accuracy_holds_in_every_lighting():
    """The worst lighting's accuracy lower bound."""


@pytest.mark.max_weighted_confusion(2.0, model="vit_model")
def test_vit_expected_severity_of_confusions(severity_matrix):
    """Expected severity per image (upper bound)."""


@pytest.mark.max_adversarial_confidence_loss(0.9, eps=1 / 255, families=["fgsm", "pgd"], steps=2, clip=(0, 1),
                                             model="vit_model", data="attack_data")
def test_vit_confidence_under_attack():
    """Mean drop of the true class's probability under attack."""
