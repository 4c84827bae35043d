"""The runtime-monitor gates on an object detector: what a fault set is made of (``task='detection'``).

A detector's monitor (e.g. :class:`~pytest_dnnsafety.engines.monitors.DetectionScore`) scores images; the
fault families perturb the images as for a classifier. A fault set is built from the evaluation data's
images alone (the boxes play no part in scoring an image), so the images must be at hand:
:class:`~pytest_dnnsafety.tasks.DetectionData` (what an ``.npz`` with ``x``, ``boxes``, ``labels`` and
``offsets`` loads as) or an image tensor. The adversarial fault families attack a classifier's true class
and are refused. The system view (``max_monitor_selective_risk``) counts an image as the detector's error
when it misses an object or makes a false detection at score 0.5 and IoU 0.5
(:func:`~pytest_dnnsafety.engines.detector_scores.image_errors`); a faulted image keeps its objects'
boxes when the fault keeps the geometry (every fault but ``rotation``, which is refused there), and an
image without a right answer (anomalies, novel data) is always an error. No torch import at module level.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, DataError

__all__ = ["detector_fault_source", "detector_wrong"]


def detector_fault_source(data: Any, family: str) -> Any:
    """The images of detection ``data`` for fault ``family`` (a ConfigError for the adversarial families)."""
    import torch

    from ..engines.monitors.faults import FAULT_GROUPS
    from ..tasks import DetectionData

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
        "data as an .npz with keys x, boxes, labels and offsets (or a pytest_dnnsafety.tasks.DetectionData).")


def detector_wrong(out: Any, family: str | None, source: Any, shard: Any, no_right_answer: tuple[str, ...]) -> Any:
    """Per image of the pass ``out``: is the detector wrong? ``source``: the evaluation data (its boxes)."""
    import torch

    from ..engines.detector_scores import image_errors
    from ..tasks import BoxSet

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
