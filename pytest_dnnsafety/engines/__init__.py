"""Metric engines: pure torch, no pytest import (see :class:`~pytest_dnnsafety.engines.core.base.Engine`)."""

from __future__ import annotations

from pytest_dnnsafety.engines.core.base import Engine, Reduce
from pytest_dnnsafety.engines.neurons.kactivation import MAX_NEURON_CELLS, NeuronCoverageResult, NeuronKActivationEngine
from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine, PatternResult
from pytest_dnnsafety.engines.reliability import CellTallyEngine, ReliabilityResult, assess_reliability
from pytest_dnnsafety.engines.coverage.scenario import MAX_CELLS, ScenarioCoverageEngine, ScenarioCoverageOutput
from pytest_dnnsafety.engines.core.projection import ProjectionLayout
from pytest_dnnsafety.engines.core.states import TopK, topk

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
