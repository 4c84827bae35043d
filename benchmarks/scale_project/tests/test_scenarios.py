"""Accuracy per operating condition (Cheng et al. 2018, §II-E) and severity-weighted confusion (§II-H)."""

import pytest


@pytest.mark.min_scenario_accuracy(0.2, by=["lighting"], min_samples=30)
def test_accuracy_holds_in_every_lighting():
    """The worst lighting's accuracy lower bound stays above 0.2 (chance is 0.1)."""


@pytest.mark.max_scenario_degradation(0.5, by=["weather"])
def test_weather_does_not_collapse_accuracy():
    """No weather costs more than 50 points of accuracy against all data."""


@pytest.mark.max_weighted_confusion(2.0, confidence=0.95)
def test_expected_severity_of_confusions(severity_matrix):
    """The expected severity per image (upper bound) is at most 2 (a textured/solid mix-up costs 2)."""
