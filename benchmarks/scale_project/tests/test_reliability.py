"""Reliability under the operational profile (Zhao et al.): a ball around each operational image, or latent cells.

The profile is the plugin's ``operational_profile`` fixture, from ``dnnsafety_operational_data``: the
project names a ``DataLoader`` factory (``scale_demo.data:operational_loader``); the benchmark runner's
``test_reliability[npy]`` unit points the same setting at a ``.npy`` file of the same images
(``DNNSAFETY_OPERATIONAL_DATA``). Either way the 3x224x224 images are read a batch or a slice of rows at
a time, never held whole. ``pmi_data`` holds the same images with their labels.
"""

import pytest


@pytest.mark.max_pmi_ub(1.0, cells="balls", norm="linf", radius=0.02, clip=(0, 1), samples_per_cell=50,
                        bootstrap=0, data="pmi_data", accept_violated_assumptions=True)
def test_probability_of_misclassification_per_input():
    """Upper bound on the probability of misclassification per input."""


@pytest.mark.max_pmi_ub(1.0, latent=2, clip=(0, 1), samples_per_cell=20, bootstrap=0, max_cells=50,
                        data="pmi_data", accept_violated_assumptions=True)
def test_probability_of_misclassification_per_latent_cell():
    """The latent route for 224x224 images: a PCA of 2 components fitted in passes over the streamed operational
    images, the KDE and grid cells in that space, the model queried on decoded samples."""
