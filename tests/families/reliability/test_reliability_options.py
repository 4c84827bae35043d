"""The reliability assessment's option records (issue #28): grouped, validated once, built from keywords.

``ReliabilityAssessor`` takes one :class:`ReliabilityOptions` (cells, OP masses, the sampling plan, the
bound, the labels); ``assess_reliability`` keeps its flat keywords (:meth:`ReliabilityOptions.of`).
"""

from __future__ import annotations

import warnings
from dataclasses import FrozenInstanceError, fields, replace
from typing import Any

import pytest
import torch

from pytest_dnnsafety.engines.reliability import (BoundOptions, CellOptions, LabelOptions, MassOptions,
                                                  ReliabilityOptions, SamplingPlan, assess_reliability)
from pytest_dnnsafety.engines.reliability.ranks import assess_over_ranks, labelled_points
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.gates.reliability import MAX_PMI_UB

RECORDS = (CellOptions, MassOptions, SamplingPlan, BoundOptions, LabelOptions)


def test_keywords_go_to_their_records_and_unknown_ones_are_a_type_error() -> None:
    options = ReliabilityOptions.of(eps=0.1, box=[[0, 0], [1, 1]], bootstrap=0, allocation="proportional",
                                    method="normal", compare_methods=("normal", "jeffreys"), failures=[[1, 0], (0, 1)],
                                    seed=3)
    assert options.cells.eps == 0.1 and options.cells.box == ([0, 0], [1, 1])  # a marker's list as a tuple
    assert options.masses.bootstrap == 0 and options.plan.allocation == "proportional"
    assert options.bound.compare_methods == ("jeffreys",)  # the gated method is not compared with itself
    assert options.labels.failures == ((0, 1), (1, 0)) and options.seed == 3
    with pytest.raises(FrozenInstanceError):
        options.seed = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword.*'samples'"):
        assess_reliability(lambda x: x, torch.zeros(3, 2), samples=10)


def test_the_marker_defaults_are_the_records_defaults() -> None:
    """The gate passes only what the user set: that is the same assessment because the defaults agree."""
    defaults = {f.name: f.default for record in RECORDS for f in fields(record)}
    # the gate sets these two itself: the methods besides the gated one, the cap from the setting
    shared = [p for p in MAX_PMI_UB.params if p.name in defaults and p.name not in ("compare_methods", "max_queries")]
    assert len(shared) >= 25
    for param in shared:
        assert defaults[param.name] == param.default, param.name


@pytest.mark.parametrize(("keywords", "message"), [
    ({"bootstrap": 1}, "bootstrap must be 0 (OP masses taken as known) or at least 2 refits, got 1"),
    ({"pilot_fraction": 0.1}, "pilot_fraction applies to allocation='adaptive' only"),
    ({"allocation": "adaptive", "target_width": 2.0}, "target_width is the bound width Ub − E to reach"),
    ({"method": "wald"}, "method: unknown method 'wald'"),
    ({"confidence": 1.5}, "confidence"),
    ({"empty_cell_label": "vote"}, "empty_cell_label must be one of ['model', 'nearest']"),
    ({"labelled_from_profile": "yes"}, "labelled_from_profile must be True or False"),
    ({"failures": [(1, 1)]}, "classes must be distinct non-negative indices"),
    ({"mass": "mean"}, "mass must be 'exact' or 'centre'"),
    ({"batch_size": "big"}, "batch_size must be a positive int or 'auto'"),
    ({"cells": "hexagons"}, "cells must be 'grid'"),
    ({"max_balls": 3}, "max_balls applies to cells='balls' only"),
    ({"norm": "l2"}, "norm='l2' applies to cells='balls' only"),
    ({"cells": "balls", "bootstrap_size": "half"}, "bootstrap_size='half' resizes the KDE refits of grid cells"),
])
def test_each_record_checks_its_options_with_the_keywords_messages(keywords: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ReliabilityOptions.of(**keywords)
    assert message in str(info.value)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(200, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0.5).long()


def test_over_ranks_one_process_is_assess_reliability_and_the_verdict_says_what_it_is_worth(tmp_path) -> None:
    x, y = _data()
    model = lambda z: (z[:, 0] > 0.5).long()  # noqa: E731
    keywords = dict(eps=0.1, box=([0, 0], [1, 1]), samples_per_cell=20, bootstrap=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eps ≥ r̂: a violated assumption, on purpose
        direct = assess_reliability(model, x, (x, y), **keywords)
        ranked = assess_over_ranks(model, x, labelled_points((x, y), "grid", "dataset"),
                                   ReliabilityOptions.of(**keywords), cells_file=tmp_path / "cells.csv")
    assert (ranked.E, ranked.Ub, ranked.model_queries) == (direct.E, direct.Ub, direct.model_queries)
    assert ranked.cells_file is not None and (tmp_path / "cells.csv").exists()
    verdict = ranked.verdict()
    assert verdict["inconclusive"].startswith("violated assumption(s) of the reliability method: ")
    accepted = replace(ranked, violations_accepted=True).verdict()
    assert accepted["inconclusive"] is None and "VIOLATED ASSUMPTIONS ACCEPTED" in accepted["detail"]
    assert replace(ranked, contradictions=("a", "b")).verdict()["contradiction"] == "a; b"
    with pytest.raises(MetricError, match="fixture 'unlabelled' has no labels"):
        labelled_points(x, "grid", "unlabelled")
