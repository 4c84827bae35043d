"""Runtime monitors, fitted on the training split (``monitor_data``), against the evaluation data."""

import pytest


@pytest.mark.min_monitor_detection(-1.0, monitor="energy", faults="gaussian_noise", severity=3)
def test_energy_flags_sensor_noise():
    """MCC of the energy monitor's alarm on Gaussian noise (severity 3) against clean data (reported)."""


@pytest.mark.max_monitor_selective_risk(1.0, monitor="maha")
def test_mahalanobis_selective_risk():
    """The error rate among the images the Mahalanobis monitor accepts (upper bound)."""


@pytest.mark.max_monitor_overhead(1000.0, monitor="maha", repeats=1, data="attack_data")
def test_mahalanobis_overhead():
    """The monitor's time per image against the model's forward time."""
