"""Occlusion (Cheng et al. 2018, §II-F/G): a 56x56 grey-free occluder at 16 positions of a 224x224 image."""

import pytest

OCCLUSION = dict(size=56, stride=56, fill=0.0, rho=0.5, data="occlusion_data", masks="occlusion_masks")


@pytest.mark.min_interpretation_precision(0.0, no_hot="zero", **OCCLUSION)
def test_hot_positions_cover_the_object():
    """Share of hot occluder positions that cover the object."""


@pytest.mark.min_occlusion_sensitivity(0.0, **OCCLUSION)
def test_the_object_drives_the_decision():
    """Share of object-covering positions that are hot."""


@pytest.mark.max_occlusion_sensitivity(1.0, **OCCLUSION)
def test_not_fragile_to_partial_occlusion():
    """The paper's reading of M_OccSen: at most all positions hot."""
