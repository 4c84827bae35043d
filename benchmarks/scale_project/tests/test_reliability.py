"""Reliability under the operational profile (Zhao et al.): a ball around each operational image."""

import pytest


@pytest.mark.max_pmi_ub(1.0, cells="balls", norm="linf", radius=0.02, clip=(0, 1), samples_per_cell=50,
                        bootstrap=0, data="pmi_data", profile="pmi_data",
                        accept_violated_assumptions=True)
def test_probability_of_misclassification_per_input():
    """Upper bound on the probability of misclassification per input."""
