"""Reliability under the operational profile (Zhao et al.): a ball around each operational image."""

import pytest


@pytest.mark.max_pmi_ub(1.0, cells="balls", norm="linf", radius=0.02, clip=(0, 1), samples_per_cell=50,
                        bootstrap=0, data="pmi_data", profile="pmi_data",
                        accept_violated_assumptions=True)
def test_probability_of_misclassification_per_input():
    """Upper bound on the probability of misclassification per input."""


@pytest.mark.max_pmi_ub(1.0, latent=2, clip=(0, 1), samples_per_cell=20, bootstrap=0, max_cells=50,
                        data="pmi_data", profile="pmi_data", accept_violated_assumptions=True)
def test_probability_of_misclassification_per_latent_cell():
    """The latent route for 224x224 images: a PCA of 2 components fitted in passes over the streamed operational
    images, the KDE and grid cells in that space, the model queried on decoded samples."""
