"""DeepQuant's option records (issue #28): the property, the search's budget, the certificate, the gated statistic.

Each record checks its options once, when it is built, with the messages the keywords of
``lipschitz_search`` / ``quantify_safety`` had; the results list their settings as before.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest
import torch

from pytest_dnnsafety.engines.quantification import (Certification, GatedRadius, SafetyProperty, SearchBudget,
                                                     lipschitz_search, quantify_safety)
from pytest_dnnsafety.errors import ConfigError


def test_records_normalise_their_options() -> None:
    safety = SafetyProperty("top_vs_label", d=1, label=2, eps=0, clip=[0, 1])
    assert (safety.d, safety.eps, safety.clip) == (1.0, 0.0, (0.0, 1.0))
    assert isinstance(safety.d, float) and isinstance(safety.eps, float)
    search = SearchBudget("mads", iterations=3, expansion=2, contraction=0.5)
    assert isinstance(search.expansion, float) and search.settings()["expansion"] == 2.0
    assert GatedRadius(quantile=0).quantile == 0.0 and Certification().method == "crown"
    with pytest.raises(FrozenInstanceError):
        safety.d = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SafetyProperty()  # type: ignore[call-arg]  # the ball's radius d has no default


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SafetyProperty("margin", d=0.1), "expression='margin' is not one of"),
    (lambda: SafetyProperty("top_vs_label", d=0.1), "expression='top_vs_label' needs label="),
    (lambda: SafetyProperty(d=0.0), "d=0.0 must be a finite number > 0"),
    (lambda: SafetyProperty(d=0.1, norm="l3"), "norm='l3' is not one of"),
    (lambda: SafetyProperty(d=0.1, clip=(1, 0)), "clip=(1, 0) is not a valid range"),
    (lambda: SearchBudget("cma"), "method='cma' is not one of"),
    (lambda: SearchBudget(iterations=0), "iterations=0 must be an integer >= 1"),
    (lambda: SearchBudget(expansion=0.5), "expansion=0.5 is not a finite number ≥ 1"),
    (lambda: SearchBudget(contraction=1.2), "contraction=1.2 is not in (0, 1)"),
    (lambda: SearchBudget(ascent_starts=-1), "ascent_starts=-1 must be an integer >= 0"),
    (lambda: Certification("exact"), "certified='exact' is not one of ['crown', 'ibp']. Fix: use 'crown', 'ibp'"),
    (lambda: GatedRadius(quantile=1.5), "quantile=1.5 is not in [0, 1]. Fix: 0 gates the minimum"),
    (lambda: GatedRadius(worst=-1), "worst=-1 must be an integer >= 0"),
    (lambda: GatedRadius("median"), "statistic='median' is not one of ['certified', 'estimate']"),
])
def test_each_record_checks_its_options_when_built(build: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert message in str(info.value) and "Fix: " in str(info.value)


def test_the_certified_statistic_needs_a_certification_and_settings_keep_their_order() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 3)).double().eval()
    x = torch.rand(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="statistic='certified' needs a certified radius.*Fix: "):
        quantify_safety(net, x, SafetyProperty(d=0.1), SearchBudget(iterations=2), None)
    res = lipschitz_search(net, x, SafetyProperty(d=0.1), SearchBudget(iterations=2, starts=1), seed=3)
    assert list(res.settings) == ["expression", "label", "eps", "d", "norm", "method", "iterations", "starts", "clip",
                                  "seed", "expansion", "contraction", "mesh_tol", "mesh_init", "ascent_steps",
                                  "ascent_starts"]
    assert res.settings["seed"] == 3 and res.settings["clip"] == [0.0, 1.0]
