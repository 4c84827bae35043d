"""Real data and a real conv model for engine tests and benchmarks: scikit-learn's digits.

``digits_images()`` gives the 1797 bundled 8x8 images as float32 ``(N, 1, 8, 8)`` in ``[0, 1]``
with int64 labels; ``digits_cnn()`` the example project's architecture (two 3x3 convs, max-pool,
two dense layers; logits out), trained for a few seconds with a fixed seed and cached per process.
No download: the data ships with scikit-learn.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["digits_images", "digits_cnn", "DigitsCNN"]


@functools.lru_cache(maxsize=1)
def _all_digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return x, y


def digits_images(n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` digits (all 1797 when ``n`` is None): ``(x (n,1,8,8) in [0,1], y (n,))``."""
    x, y = _all_digits()
    if n is None:
        return x.clone(), y.clone()
    if n > x.shape[0]:  # benchmarks may ask for more than 1797: repeat the data
        reps = -(-n // x.shape[0])
        x, y = x.repeat(reps, 1, 1, 1), y.repeat(reps)
    return x[:n].clone(), y[:n].clone()


class DigitsCNN(nn.Module):
    """The example project's classifier: conv(1->16) ReLU conv(16->32) ReLU maxpool flatten fc(512->64) ReLU fc."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.features(x)))


@functools.lru_cache(maxsize=2)
def _trained(epochs: int, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = DigitsCNN()
    x, y = _all_digits()
    x, y = x[:1200], y[:1200]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=gen)
        for start in range(0, x.shape[0], 64):
            idx = order[start:start + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def digits_cnn(*, epochs: int = 8, seed: int = 0) -> DigitsCNN:
    """A freshly built :class:`DigitsCNN` in eval mode with trained weights (training is cached)."""
    model = DigitsCNN()
    model.load_state_dict(_trained(epochs, seed))
    return model.eval()
