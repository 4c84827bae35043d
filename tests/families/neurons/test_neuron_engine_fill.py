"""The neuron engines as a gate fills them (``of``): one rank's rows of a layer, of one scenario (``rows``), merged over
the ranks to the single-process value; the pattern metric names the scenario when no input matched it."""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine
from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine, scope
from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.runtime.torchrun import Shard

N = 40


def _acts() -> torch.Tensor:
    return torch.randn(N, 6, generator=torch.Generator().manual_seed(0))


def test_k_activation_of_two_halves_merged_equals_the_whole() -> None:
    acts = _acts()
    whole = NeuronKActivationEngine.of(acts, k=2, activation_threshold=0.1)
    halves = [NeuronKActivationEngine.of(part, k=2, activation_threshold=0.1) for part in (acts[:15], acts[15:])]
    halves[0].merge(halves[1])
    assert halves[0].compute().value == whole.compute().value
    assert whole.n_neurons == 6 and whole.k == 2 and int(whole.n_inputs) == N


def test_patterns_of_one_scenario_per_shard_equal_the_scenario_whole() -> None:
    acts = _acts()
    rows = torch.arange(N) % 3 == 0  # one scenario's rows of the whole data
    whole = NeuronPatternEngine.of(acts[rows], groups=3).compute()
    shards = [Shard(rank=r, world_size=2, batches=(r, r + 1), rows=(0, 25) if r == 0 else (25, N), n_rows=N)
              for r in (0, 1)]
    parts = [NeuronPatternEngine.of(acts[shard.row_slice], groups=3, rows=rows, shard=shard) for shard in shards]
    parts[0].merge(parts[1])
    assert parts[0].compute() == whole
    assert int(parts[0].histogram.sum()) == int(rows.sum())


def test_no_input_of_the_scenario_names_it() -> None:
    engine = NeuronPatternEngine.of(_acts(), groups=3, rows=torch.zeros(N, dtype=torch.bool))
    with pytest.raises(MetricError, match=r"no inputs match where=\{'weather': 'fog'\}; the metric needs at least one"):
        engine.compute(where={"weather": "fog"})
    with pytest.raises(MetricError, match="no inputs were measured"):
        engine.compute()
    assert scope(None) == "all inputs" and scope({"weather": "rain", "road": ["wet", "dry"]}) == \
        "weather=rain, road=['wet', 'dry']"
