"""Helpers shared by the reliability tests: the synthetic problems' ground truth, warnings silenced."""

from __future__ import annotations

import warnings

import torch

from pytest_dnnsafety.engines.reliability import ReliabilityWarning


def _truth(x: torch.Tensor) -> torch.Tensor:
    """Ground truth of the synthetic problems: class 1 right of x₁ = 0.5."""
    return (x[:, 0] >= 0.5).long()


def _quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with :class:`ReliabilityWarning` (e.g. ε ≥ r̂) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return fn(*args, **kwargs)
