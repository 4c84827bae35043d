"""pytest-dnnsafety: dependability gates for deep neural networks, as pytest tests.

The public API is what ``__all__`` lists. Objects that need torch (``ScenarioTable``,
``Conditions``, the engines) are imported on first access, so importing the package (which pytest
does for every run once the plugin is installed) costs no torch import. The gate-writing API
(``GateDef``, ``Family``, ``Param``, ``GateSpec``, ``GateContext``, ``GateRegistry``, ``REQUIRED``,
``Measurement``, ``hookimpl``) is what a ``conftest.py`` or a plugin uses to add its own gates
through the ``pytest_dnnsafety_register_gates`` hook (see :mod:`pytest_dnnsafety.gates.hookspecs`).

**The house plan.** The package is layered; each folder imports only the core and the folders below
it (``tests/core/test_import_graph.py`` enforces it, type-checking imports included)::

    data < files < runtime < stats < engines < scenarios < report < gates < plugin

* core (the modules directly here): ``errors``, ``results``, ``settings``, ``_version``;
* ``data/``: input forms and batches, the tasks (single-label, multi-label, detection boxes), argument checks;
* ``files/``: model and data loading, pickle/zip archive checks, ``.pt2`` archive/program checks and graph
  taps, depth-safe parsing, fingerprints of what was read;
* ``runtime/``: torchrun ranks and shards, devices, CPU threads, the allocator, memory sizes, progress;
* ``stats/``: confidence intervals and bounds, rank statistics;
* ``engines/``: ``core/`` (engine protocol, states, the runner, the model-output guard, activation
  capture), the libraries ``perturb/`` and ``bounds/``, then one package per gate family
  (``engines/<family>/``, its task variants inside it); families import the libraries, never each other;
* ``scenarios/``: operating conditions and the scenario table;
* ``report/``: terminal, JSON evidence (and its schema), JUnit, HTML and plots, baselines;
* ``gates/``: the gate mechanism (``Family`` and ``GateDef`` declarations, keyword checks, evaluation, the shared
  forward pass and torchrun merge), the hook specs, and one module per family (``gates/<family>.py``: its
  declarations, keyword checks, a short ``measure`` and its ``FAMILY``);
* ``plugin/``: the pytest adapter (hooks, options, fixtures), the run's process roles, the generated reference.

One word names a family everywhere: ``gates/<family>.py``, ``engines/<family>/``,
``docs/gates/<family>.md``, ``tests/families/<family>/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pytest_dnnsafety._version import __version__
from pytest_dnnsafety.errors import ConfigError, DataError, DnnSafetyError, MarkerError, MetricError, ModelLoadError
from pytest_dnnsafety.results import GateResult, Measurement

if TYPE_CHECKING:  # pragma: no cover
    from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
    from pytest_dnnsafety.gates.family import Family
    from pytest_dnnsafety.gates.hookspecs import hookimpl
    from pytest_dnnsafety.engines.core.guard import ForwardGuard
    from pytest_dnnsafety.data.tasks import BoxSet, DetectionData, detection_collate
    from pytest_dnnsafety.files.coco import CocoDetectionData, from_coco
    from pytest_dnnsafety.files.onnx_model import OnnxModel
    from pytest_dnnsafety.files.predictions import RecordedPredictions
    from pytest_dnnsafety.engines.core.capture import ActivationCache, capture
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine
    from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine
    from pytest_dnnsafety.engines.reliability import ReliabilityResult, assess_reliability
    from pytest_dnnsafety.engines.robustness import (AdversarialConfidenceResult, BoundedModel, VerificationResult,
                                     assess_adversarial_confidence, make_family, verify_robustness)
    from pytest_dnnsafety.engines.monitors import (MSP, ODIN, ActivationPatterns, Autoencoder, DetectionMetrics, DetectionScore,
                                   Energy,
                                   Mahalanobis, Monitor, MonitorView, OutsideTheBox, detection_metrics,
                                   fit_monitor, system_view)
    from pytest_dnnsafety.engines.coverage.scenario import ScenarioCoverageEngine
    from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile
    from pytest_dnnsafety.scenarios import Conditions, CoverageResult, ScenarioTable

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
    "Family",
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
    "CocoDetectionData",
    "from_coco",
    "OnnxModel",
    "RecordedPredictions",
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
    "ForwardGuard": "pytest_dnnsafety.engines.core.guard",
    # the gate-writing API (no torch; imported on first use so `import pytest_dnnsafety` stays light)
    "GateDef": "pytest_dnnsafety.gates.core",
    "Family": "pytest_dnnsafety.gates.family",
    "Param": "pytest_dnnsafety.gates.core",
    "REQUIRED": "pytest_dnnsafety.gates.core",
    "GateSpec": "pytest_dnnsafety.gates.core",
    "GateContext": "pytest_dnnsafety.gates.core",
    "GateRegistry": "pytest_dnnsafety.gates.core",
    "hookimpl": "pytest_dnnsafety.gates.hookspecs",
    "Conditions": "pytest_dnnsafety.scenarios",
    "ScenarioTable": "pytest_dnnsafety.scenarios",
    "CoverageResult": "pytest_dnnsafety.scenarios",
    "ScenarioCoverageEngine": "pytest_dnnsafety.engines.coverage.scenario",
    "NeuronKActivationEngine": "pytest_dnnsafety.engines.neurons.kactivation",
    "NeuronPatternEngine": "pytest_dnnsafety.engines.neurons.patterns",
    "ActivationCache": "pytest_dnnsafety.engines.core.capture",
    "capture": "pytest_dnnsafety.engines.core.capture",
    "OperationalProfile": "pytest_dnnsafety.engines.reliability.profile",
    "PCA": "pytest_dnnsafety.engines.reliability.profile",
    "assess_reliability": "pytest_dnnsafety.engines.reliability",
    "ReliabilityResult": "pytest_dnnsafety.engines.reliability",
    "make_family": "pytest_dnnsafety.engines.robustness",
    "assess_adversarial_confidence": "pytest_dnnsafety.engines.robustness",
    "AdversarialConfidenceResult": "pytest_dnnsafety.engines.robustness",
    "BoundedModel": "pytest_dnnsafety.engines.robustness",
    "verify_robustness": "pytest_dnnsafety.engines.robustness",
    "VerificationResult": "pytest_dnnsafety.engines.robustness",
    "Monitor": "pytest_dnnsafety.engines.monitors",
    "MonitorView": "pytest_dnnsafety.engines.monitors",
    "MSP": "pytest_dnnsafety.engines.monitors",
    "DetectionScore": "pytest_dnnsafety.engines.monitors",
    "BoxSet": "pytest_dnnsafety.data.tasks",
    "DetectionData": "pytest_dnnsafety.data.tasks",
    "detection_collate": "pytest_dnnsafety.data.tasks",
    "CocoDetectionData": "pytest_dnnsafety.files.coco",
    "from_coco": "pytest_dnnsafety.files.coco",
    "OnnxModel": "pytest_dnnsafety.files.onnx_model",
    "RecordedPredictions": "pytest_dnnsafety.files.predictions",
    "ODIN": "pytest_dnnsafety.engines.monitors",
    "Energy": "pytest_dnnsafety.engines.monitors",
    "OutsideTheBox": "pytest_dnnsafety.engines.monitors",
    "ActivationPatterns": "pytest_dnnsafety.engines.monitors",
    "Mahalanobis": "pytest_dnnsafety.engines.monitors",
    "Autoencoder": "pytest_dnnsafety.engines.monitors",
    "fit_monitor": "pytest_dnnsafety.engines.monitors",
    "detection_metrics": "pytest_dnnsafety.engines.monitors",
    "DetectionMetrics": "pytest_dnnsafety.engines.monitors",
    "system_view": "pytest_dnnsafety.engines.monitors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # Not cached in the package namespace: the name always resolves through sys.modules, so it
        # stays the same object as the defining module's (also when a test harness re-imports it).
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pytest_dnnsafety' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
