"""The classifier under test: a small CNN for 1x8x8 digit images.

Inputs are float32 tensors of shape ``(N, 1, 8, 8)`` with intensities in ``[0, 1]``; the output
is ``(N, 10)`` logits. Submodules are named so that layers can be addressed by their dotted
names (``model.get_submodule("features.3")``):

=================  ==========================================  ==============
name               layer                                       output shape
=================  ==========================================  ==============
``features.0``     Conv2d(1, 16, 3, padding=1)                 (N, 16, 8, 8)
``features.1``     ReLU                                        (N, 16, 8, 8)
``features.2``     Conv2d(16, 32, 3, padding=1)                (N, 32, 8, 8)
``features.3``     ReLU                                        (N, 32, 8, 8)
``features.4``     MaxPool2d(2)                                (N, 32, 4, 4)
``flatten``        Flatten                                     (N, 512)
``classifier.0``   Linear(512, 64)                             (N, 64)
``classifier.1``   ReLU                                        (N, 64)
``classifier.2``   Linear(64, 10)                              (N, 10) logits
=================  ==========================================  ==============
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["DigitsCNN", "build_model", "NUM_CLASSES", "INPUT_SHAPE"]

NUM_CLASSES = 10
INPUT_SHAPE = (1, 8, 8)


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers, one max-pool, and a two-layer fully connected head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.flatten(self.features(x)))


def build_model(num_classes: int = NUM_CLASSES) -> nn.Module:
    """Return a fresh, untrained :class:`DigitsCNN` (the ``dnnsafety_model_factory``)."""
    return DigitsCNN(num_classes)
