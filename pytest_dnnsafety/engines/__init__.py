"""Metric engines: pure torch, no pytest import (see :class:`~pytest_dnnsafety.engines.base.Engine`)."""

from __future__ import annotations

from pytest_dnnsafety.engines.base import Engine, Reduce
from pytest_dnnsafety.engines.neurons import (
    MAX_NEURON_CELLS,
    NeuronCoverageResult,
    NeuronKActivationEngine,
    NeuronPatternEngine,
    PatternResult,
)
from pytest_dnnsafety.engines.reliability import CellTallyEngine, ReliabilityResult, assess_reliability
from pytest_dnnsafety.engines.scenario import (
    MAX_CELLS,
    ProjectionLayout,
    ScenarioCoverageEngine,
    ScenarioCoverageOutput,
)
from pytest_dnnsafety.engines.states import TopK, topk

__all__ = [
    "Engine",
    "Reduce",
    "TopK",
    "topk",
    "MAX_CELLS",
    "ProjectionLayout",
    "ScenarioCoverageEngine",
    "ScenarioCoverageOutput",
    "MAX_NEURON_CELLS",
    "NeuronCoverageResult",
    "NeuronKActivationEngine",
    "NeuronPatternEngine",
    "PatternResult",
    "CellTallyEngine",
    "ReliabilityResult",
    "assess_reliability",
]
