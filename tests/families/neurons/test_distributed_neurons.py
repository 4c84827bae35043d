"""Neuron engines: Engine.sync over a real 2-rank gloo group equals one process over all inputs."""

from __future__ import annotations

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks

from pytest_dnnsafety.engines import NeuronKActivationEngine, NeuronPatternEngine

NEURONS = 12
ROWS = 301  # odd: the ranks get unequal shares

pytestmark = pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")


def _activations() -> torch.Tensor:
    gen = torch.Generator().manual_seed(2018)
    bias = torch.randn(NEURONS, generator=gen) * 1.5 - 0.5
    return torch.relu(torch.randn(ROWS, NEURONS, generator=gen) + bias)


def _engines() -> list:
    return [
        NeuronKActivationEngine(NEURONS, k=2),
        NeuronKActivationEngine(NEURONS, k=3, activation_threshold=0.25),
        NeuronPatternEngine(NEURONS, groups=5),
    ]


def _rank(rank: int, world: int) -> list[dict]:
    """Count this rank's share of the inputs, sync, hand back the synced payloads."""
    share = _activations().tensor_split(world)[rank]
    payloads = []
    for engine in _engines():
        engine.update(share)
        engine.sync()
        payloads.append(engine.state_payload())
    return payloads


def test_two_gloo_ranks_sync_neuron_engines_to_the_single_process_result() -> None:
    results = run_on_gloo_ranks(_rank, 2)
    acts = _activations()
    for i, single in enumerate(_engines()):
        single.update(acts)
        expected = single.compute()
        for payloads in results:
            synced = type(single).from_payload(payloads[i])
            for name, state in single.states().items():
                assert torch.equal(getattr(synced, name), state), name
            assert synced.compute() == expected
    k2 = NeuronKActivationEngine.from_payload(results[0][0]).compute()
    assert k2.n_inputs == ROWS and 0 < k2.covered < k2.total  # a real, partial coverage
