"""Project-specific gates for the digits_demo tests, registered through pytest-dnnsafety's hook."""

from pytest_dnnsafety import hookimpl

from digits_demo.calibration import MAX_CALIBRATION_ERROR


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(MAX_CALIBRATION_ERROR)
