"""The runtime-monitor gates on an object detector: what a fault set is made of (``task='detection'``).

A detector's monitor (e.g. :class:`~pytest_dnnsafety.engines.monitors.DetectionScore`) scores images; the
fault families perturb the images as for a classifier. A fault set is built from the evaluation data's
images alone (the boxes play no part in scoring an image), so the images must be at hand:
:class:`~pytest_dnnsafety.tasks.DetectionData` (what an ``.npz`` with ``x``, ``boxes``, ``labels`` and
``offsets`` loads as) or an image tensor. The adversarial fault families attack a classifier's true class
and are refused. No torch import at module level.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, DataError

__all__ = ["detector_fault_source"]


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
