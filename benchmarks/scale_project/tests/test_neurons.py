"""Neuron coverage of the last stage (Cheng et al. 2018, §II-B/C): 64 channels at width 8."""

import pytest


@pytest.mark.min_neuron_k_activation(0.3, layer="layer4.1.relu2", k=2)
def test_last_stage_pairs_of_channels_are_exercised():
    """At least 30 % of the on/off patterns of every pair of last-stage channels occur."""


@pytest.mark.max_neuron_pattern_deviation(0.5, layer="layer4.1.relu2", groups=8, where={"lighting": "night"})
def test_night_activation_patterns_stay_typical():
    """At night at most half the images have an atypical number of active channels."""
