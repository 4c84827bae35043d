"""Helpers shared by the reliability tests: the synthetic problems' ground truth, warnings silenced."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
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


#: A user conftest whose ``model`` is a threshold classifier at x₁ = 0.52 (close to the truth at 0.5).
THRESHOLD_CONFTEST = """
import pytest
import torch


class Threshold(torch.nn.Module):
    def forward(self, x):
        return torch.stack([0.52 - x[:, 0], x[:, 0] - 0.52], dim=1)


@pytest.fixture(scope="session")
def model():
    return Threshold()
"""


def write_pmi_project(project: Any, conftest: str = THRESHOLD_CONFTEST) -> Any:
    """A ``GateProject`` for ``max_pmi_ub`` on 2-d points: 400 operational points, 300 labelled by :func:`_truth`."""
    gen = np.random.default_rng(0)
    x_op = gen.random((400, 2)).astype(np.float32)
    x_lab = gen.random((300, 2)).astype(np.float32)
    np.savez(project.pytester.path / "operation.npz", x=x_op)
    np.savez(project.pytester.path / "labelled.npz", x=x_lab, y=(x_lab[:, 0] > 0.5).astype(np.int64))
    project.ini.update({"dnnsafety_operational_data": "operation.npz", "dnnsafety_data": "labelled.npz"})
    project.write("conftest.py", conftest)
    return project
