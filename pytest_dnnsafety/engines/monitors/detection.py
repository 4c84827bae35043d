"""A score-based runtime monitor for object detectors (docs: gates/monitors.md).

:class:`DetectionScore` is the detector's analogue of the maximum softmax probability (Hendrycks & Gimpel
2017): a detector that recognises what it sees is confident about its best boxes, so per image
``score = 1 − mean of its k highest detection scores`` (a missing detection counts 0; ``k = 1``: one minus
the top detection's score). Higher = more likely out-of-distribution. It reads the detections the
session's shared forward pass already holds (``ModelOutputs.detections``), so it costs no pass of its
own; nothing to fit but the check that the model is a detector, and the threshold is calibrated on
held-out in-distribution images like every monitor's. Pure torch; no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError, MetricError
from ..detector_scores import top_scores
from .base import Monitor, MonitorView

__all__ = ["DetectionScore"]


class DetectionScore(Monitor):
    """``score = 1 − (mean of the image's top-k detection scores)`` for a detector (see the module docstring)."""

    kind = "detection_score"

    def __init__(self, k: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"DetectionScore: k={k!r} is not a positive integer. Fix: pass k=1 (the top "
                              "detection) or the number of top detections to average, e.g. k=3.")
        self.k = k

    def _detections(self, view: MonitorView) -> Any:
        detections = view.outputs().detections
        if detections is None:
            raise MetricError(
                f"monitor {self.name!r} (detection_score) reads a detector's box scores, but the model returns "
                "class scores (batch, classes): it is a classifier. Fix: use msp, odin or energy for a classifier, "
                "or give this monitor an object detector (one dict of boxes, scores and labels per image).")
        return detections

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        self._detections(view)

    def _score(self, view: MonitorView) -> Tensor:
        return 1.0 - top_scores(self._detections(view), self.k)

    def _config(self) -> dict[str, Any]:
        return {"k": self.k}
