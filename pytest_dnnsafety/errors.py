"""The error family of pytest-dnnsafety.

Every error names what was wrong (the marker, option or file), the bad value, where it came
from and the fix. They derive from one base so a user can catch them all.
"""

from __future__ import annotations

__all__ = [
    "DnnSafetyError",
    "ConfigError",
    "MarkerError",
    "DataError",
    "ModelLoadError",
    "MetricError",
]


class DnnSafetyError(Exception):
    """Base class of every error raised by pytest-dnnsafety."""


class ConfigError(DnnSafetyError, ValueError):
    """A setting (ini option, CLI flag, environment variable) is missing or has a bad value."""


class MarkerError(DnnSafetyError, ValueError):
    """A gate marker was given a bad argument (reported as a collection error)."""


class DataError(DnnSafetyError, ValueError):
    """Input data (evaluation data, scenarios, conditions) is empty, malformed or not finite."""


class ModelLoadError(DnnSafetyError):
    """A model file or factory could not be loaded safely."""


class MetricError(DnnSafetyError):
    """A metric could not be computed; the gate fails rather than passes."""
