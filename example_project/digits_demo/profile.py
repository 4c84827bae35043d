"""The operational profile of the digit reader: a 2-D PCA latent space, and its labelled inputs.

Robustness cells of side epsilon cannot tile the 64-pixel input space, so (as Zhao et al. 2021
suggest for high-dimensional inputs) the profile lives in a latent space: the first two
principal components of the operational images. The decoder is the inverse PCA, clamped to the
valid pixel range; the model is always queried on decoded images, in input space. The profile
keeps the raw operational images (``profile.inputs``): norm-ball cells (``cells="balls"``) are
centred on them, in input space.

:func:`operational_dataset` gives the same operational images *with their labels* — a labelled
sample of the operational profile, which the pmi gate needs for honest cell labels and for
checking its bound against the model's observed error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile

DATA = Path(__file__).resolve().parents[1] / "data"
LATENT_DIMS = 2


def operational_profile() -> OperationalProfile:
    """KDE of ``data/operation.npz`` in the PCA plane; referenced by ``dnnsafety_operational_data``."""
    x = torch.from_numpy(np.load(DATA / "operation.npz")["x"])
    pca = PCA(LATENT_DIMS).fit(x)

    def decode(z: torch.Tensor) -> torch.Tensor:
        return pca.decode(z).clamp(0.0, 1.0).to(torch.float32)

    return OperationalProfile(x, encoder=pca.encode, decoder=decode)


def operational_dataset() -> torch.utils.data.TensorDataset:
    """The operational images ``(270, 1, 8, 8)`` with their digit labels (a labelled sample of the profile)."""
    with np.load(DATA / "operation.npz") as data:
        if "y" not in data.files:
            raise ValueError("data/operation.npz holds no labels y; regenerate it with python -m digits_demo.train")
        return torch.utils.data.TensorDataset(torch.from_numpy(data["x"]), torch.from_numpy(data["y"]).long())
