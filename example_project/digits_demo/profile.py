"""The operational profile of the digit reader, in a 2-D PCA latent space.

Robustness cells of side epsilon cannot tile the 64-pixel input space, so (as Zhao et al. 2021
suggest for high-dimensional inputs) the profile lives in a latent space: the first two
principal components of the operational images. The decoder is the inverse PCA, clamped to the
valid pixel range; the model is always queried on decoded images, in input space.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pytest_dnnsafety.profile import PCA, OperationalProfile

DATA = Path(__file__).resolve().parents[1] / "data"
LATENT_DIMS = 2


def operational_profile() -> OperationalProfile:
    """KDE of ``data/operation.npz`` in the PCA plane; referenced by ``dnnsafety_operational_data``."""
    x = torch.from_numpy(np.load(DATA / "operation.npz")["x"])
    pca = PCA(LATENT_DIMS).fit(x)

    def decode(z: torch.Tensor) -> torch.Tensor:
        return pca.decode(z).clamp(0.0, 1.0).to(torch.float32)

    return OperationalProfile(x, encoder=pca.encode, decoder=decode)
