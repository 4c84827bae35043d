"""pytest-dnnsafety: dependability gates for deep neural networks, as pytest tests.

The public API is what ``__all__`` lists. Objects that need torch (``ScenarioTable``,
``Conditions``, the engines) are imported on first access, so importing the package (which pytest
does for every run once the plugin is installed) costs no torch import. The gate-writing API
(``GateDef``, ``Param``, ``GateSpec``, ``GateContext``, ``GateRegistry``, ``REQUIRED``,
``Measurement``, ``hookimpl``) is what a ``conftest.py`` or a plugin uses to add its own gates
through the ``pytest_dnnsafety_register_gates`` hook (see :mod:`pytest_dnnsafety.hookspecs`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import ConfigError, DataError, DnnSafetyError, MarkerError, MetricError, ModelLoadError
from .results import GateResult, Measurement

if TYPE_CHECKING:  # pragma: no cover
    from .gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
    from .hookspecs import hookimpl
    from .outputs import ForwardGuard
    from .tasks import BoxSet, DetectionData, detection_collate
    from .activations import ActivationCache, capture
    from .engines.neurons import NeuronKActivationEngine, NeuronPatternEngine
    from .engines.reliability import ReliabilityResult, assess_reliability
    from .engines.robustness import (AdversarialConfidenceResult, BoundedModel, VerificationResult,
                                     assess_adversarial_confidence, make_family, verify_robustness)
    from .engines.monitors import (MSP, ODIN, ActivationPatterns, Autoencoder, DetectionMetrics, DetectionScore,
                                   Energy,
                                   Mahalanobis, Monitor, MonitorView, OutsideTheBox, detection_metrics,
                                   fit_monitor, system_view)
    from .engines.scenario import ScenarioCoverageEngine
    from .profile import PCA, OperationalProfile
    from .scenarios import Conditions, CoverageResult, ScenarioTable

__all__ = [
    "__version__",
    "DnnSafetyError",
    "ConfigError",
    "MarkerError",
    "DataError",
    "ModelLoadError",
    "MetricError",
    "GateResult",
    "Measurement",
    "GateDef",
    "Param",
    "REQUIRED",
    "GateSpec",
    "GateContext",
    "GateRegistry",
    "hookimpl",
    "ForwardGuard",
    "Conditions",
    "ScenarioTable",
    "CoverageResult",
    "ScenarioCoverageEngine",
    "NeuronKActivationEngine",
    "NeuronPatternEngine",
    "ActivationCache",
    "capture",
    "OperationalProfile",
    "PCA",
    "assess_reliability",
    "ReliabilityResult",
    "make_family",
    "assess_adversarial_confidence",
    "AdversarialConfidenceResult",
    "BoundedModel",
    "verify_robustness",
    "VerificationResult",
    "Monitor",
    "MonitorView",
    "MSP",
    "DetectionScore",
    "BoxSet",
    "DetectionData",
    "detection_collate",
    "ODIN",
    "Energy",
    "OutsideTheBox",
    "ActivationPatterns",
    "Mahalanobis",
    "Autoencoder",
    "fit_monitor",
    "detection_metrics",
    "DetectionMetrics",
    "system_view",
]

_LAZY = {
    "ForwardGuard": ".outputs",
    # the gate-writing API (no torch; imported on first use so `import pytest_dnnsafety` stays light)
    "GateDef": ".gates.core",
    "Param": ".gates.core",
    "REQUIRED": ".gates.core",
    "GateSpec": ".gates.core",
    "GateContext": ".gates.core",
    "GateRegistry": ".gates.core",
    "hookimpl": ".hookspecs",
    "Conditions": ".scenarios",
    "ScenarioTable": ".scenarios",
    "CoverageResult": ".scenarios",
    "ScenarioCoverageEngine": ".engines.scenario",
    "NeuronKActivationEngine": ".engines.neurons",
    "NeuronPatternEngine": ".engines.neurons",
    "ActivationCache": ".activations",
    "capture": ".activations",
    "OperationalProfile": ".profile",
    "PCA": ".profile",
    "assess_reliability": ".engines.reliability",
    "ReliabilityResult": ".engines.reliability",
    "make_family": ".engines.robustness",
    "assess_adversarial_confidence": ".engines.robustness",
    "AdversarialConfidenceResult": ".engines.robustness",
    "BoundedModel": ".engines.robustness",
    "verify_robustness": ".engines.robustness",
    "VerificationResult": ".engines.robustness",
    "Monitor": ".engines.monitors",
    "MonitorView": ".engines.monitors",
    "MSP": ".engines.monitors",
    "DetectionScore": ".engines.monitors",
    "BoxSet": ".tasks",
    "DetectionData": ".tasks",
    "detection_collate": ".tasks",
    "ODIN": ".engines.monitors",
    "Energy": ".engines.monitors",
    "OutsideTheBox": ".engines.monitors",
    "ActivationPatterns": ".engines.monitors",
    "Mahalanobis": ".engines.monitors",
    "Autoencoder": ".engines.monitors",
    "fit_monitor": ".engines.monitors",
    "detection_metrics": ".engines.monitors",
    "DetectionMetrics": ".engines.monitors",
    "system_view": ".engines.monitors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # Not cached in the package namespace: the name always resolves through sys.modules, so it
        # stays the same object as the defining module's (also when a test harness re-imports it).
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'pytest_dnnsafety' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
