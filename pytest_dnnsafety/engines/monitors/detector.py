"""A score-based runtime monitor for object detectors (docs: gates/monitors.md).

:class:`DetectionScore` is the detector's analogue of the maximum softmax probability (Hendrycks & Gimpel
2017): a detector that recognises what it sees is confident about its best boxes, so per image
``score = 1 − mean of its k highest detection scores`` (a missing detection counts 0; ``k = 1``: one minus
the top detection's score). Higher = more likely out-of-distribution. It reads the detections the
session's shared forward pass already holds (``ModelOutputs.detections``), so it costs no pass of its
own; nothing to fit but the check that the model is a detector, and the threshold is calibrated on
held-out in-distribution images like every monitor's. Pure torch; no pytest import.

**Fault sets and the system view of a detector** (:func:`detector_fault_source`, :func:`detector_wrong`). A detector's monitor (e.g. :class:`~pytest_dnnsafety.engines.monitors.DetectionScore`) scores images; the
fault families perturb the images as for a classifier. A fault set is built from the evaluation data's
images alone (the boxes play no part in scoring an image), so the images must be at hand:
:class:`~pytest_dnnsafety.data.tasks.DetectionData` (what an ``.npz`` with ``x``, ``boxes``, ``labels`` and
``offsets`` loads as) or an image tensor. The adversarial fault families attack a classifier's true class
and are refused. The system view (``max_monitor_selective_risk``) counts an image as the detector's error
when it misses an object or makes a false detection at score 0.5 and IoU 0.5
(:func:`~pytest_dnnsafety.engines.core.detections.image_errors`); a faulted image keeps its objects'
boxes when the fault keeps the geometry (every fault but ``rotation``, which is refused there), and an
image without a right answer (anomalies, novel data) is always an error. No torch import at module level.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.core.detections import top_scores
from pytest_dnnsafety.engines.monitors.base import Monitor, MonitorView

__all__ = ["DetectionScore", "detector_fault_source", "detector_wrong"]


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


def detector_fault_source(data: Any, family: str) -> Any:
    """The images of detection ``data`` for fault ``family`` (a ConfigError for the adversarial families)."""
    import torch

    from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS
    from pytest_dnnsafety.data.tasks import DetectionData

    if family in FAULT_GROUPS["adversarial"]:
        raise ConfigError(
            f"fault family {family!r} attacks a classifier's true class; it does not apply to a detector "
            "(task='detection'). Fix: use the noise, shift, anomaly or novel faults for a detector, e.g. "
            "faults=('noise', 'shift', 'anomaly').")
    if isinstance(data, DetectionData):
        return data.x
    if isinstance(data, torch.Tensor):
        return data
    raise DataError(
        f"the fault sets of a detector are built from its evaluation images, but the data is a "
        f"{type(data).__name__}, whose images cannot be read apart from their boxes. Fix: give the detection "
        "data as an .npz with keys x, boxes, labels and offsets (or a pytest_dnnsafety.data.tasks.DetectionData).")


def detector_wrong(out: Any, family: str | None, source: Any, shard: Any, no_right_answer: tuple[str, ...]) -> Any:
    """Per image of the pass ``out``: is the detector wrong? ``source``: the evaluation data (its boxes)."""
    import torch

    from pytest_dnnsafety.engines.core.detections import image_errors
    from pytest_dnnsafety.data.tasks import BoxSet

    n = out.n_inputs
    if family in no_right_answer:
        return torch.ones(n, dtype=torch.bool, device=out.predictions.device)
    if family == "rotation":
        raise ConfigError("fault family 'rotation' moves a detector's objects off their boxes, so its images have no "
                          "known right answer for the system view. Fix: leave rotation out of faults= for a detector "
                          "(e.g. faults=('noise', 'brightness', 'contrast', 'haze', 'anomaly')).")
    targets = out.labels if family is None else getattr(source, "targets", None)
    if family is not None and isinstance(targets, BoxSet) and shard is not None:
        targets = targets.images(int(shard.rows[0]), int(shard.rows[1]))
    if not isinstance(targets, BoxSet) or out.detections is None:
        raise DataError("the system view compares each image's detections with its ground-truth boxes, but the data "
                        "hold none. Fix: give detection data (an .npz with x, boxes, labels and offsets).")
    return image_errors(out.detections, targets.to(out.detections.device)).to(out.predictions.device)
