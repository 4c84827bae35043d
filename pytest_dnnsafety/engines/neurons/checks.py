"""Argument and activation checks shared by the neuron engines (:mod:`.kactivation`, :mod:`.patterns`).

Their own module so that :mod:`.patterns` needs nothing from :mod:`.kactivation` (which re-exports the
pattern engine): the imports run one way. Pure torch; no pytest import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__: list[str] = []


def _check_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(
            f"activation_threshold must be a finite number, got {value!r}; a neuron is on when its "
            f"activation is above it (use 0.0 for 'ReLU fires')"
        )
    return float(value)


def _check_activations(activations: Any, n_neurons: int, validate: bool, what: str) -> Tensor:
    """The (N, c) activations as given, or a DataError naming the problem and the fix."""
    if not isinstance(activations, Tensor):
        raise DataError(
            f"{what}: activations must be a torch.Tensor of shape (inputs, {n_neurons}), "
            f"got {type(activations).__name__}"
        )
    if activations.dtype.is_complex:
        raise DataError(f"{what}: activations must be real numbers, got dtype {activations.dtype}")
    if activations.ndim != 2:
        hint = (
            "; reduce each channel's feature map to one number first, e.g. x.amax(dim=(2, 3)) or x.mean(dim=(2, 3))"
            if activations.ndim > 2
            else "; pass a batch of rows, e.g. x.reshape(1, -1) for a single input"
        )
        raise DataError(
            f"{what}: activations must be 2-D (inputs, neurons), got shape {tuple(activations.shape)}{hint}"
        )
    if activations.shape[1] != n_neurons:
        raise DataError(
            f"{what}: activations have {activations.shape[1]} neurons (shape {tuple(activations.shape)}) but the "
            f"engine was built for n_neurons={n_neurons}; build it with n_neurons={activations.shape[1]} or pass "
            f"the right layer"
        )
    if validate and activations.dtype.is_floating_point and activations.numel():
        low, high = torch.aminmax(activations)  # one pass; NaN and ±inf reach the min or the max
        if not bool(torch.isfinite(low) & torch.isfinite(high)):
            bad = ~torch.isfinite(activations)
            row, col = (int(v) for v in torch.nonzero(bad)[0])
            n_bad = int(bad.sum())
            raise DataError(
                f"{what}: activations contain {n_bad} non-finite value(s) (NaN or inf), first at input {row}, "
                f"neuron {col} ({float(activations[row, col])}); on/off is undefined for them — fix the model "
                f"or the data (e.g. torch.nan_to_num) before measuring"
            )
    return activations


def _fmt_int(value: int) -> str:
    return f"{value:,}"
