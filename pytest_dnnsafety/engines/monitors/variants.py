"""The task variants of the monitor benchmark: a classifier's and a detector's (:func:`for_task` picks one).

The benchmark (:mod:`.bench`, :mod:`.gating`) is the same for both tasks but at three points, which a
variant answers (as torchmetrics has binary, multiclass and multilabel variants of one metric):

* **fault source** — what the fault families perturb: a classifier's data as it is; a detector's images
  alone (:func:`~.detector.detector_fault_source`: the boxes play no part in scoring an image, and the
  adversarial families, which attack a classifier's true class, are refused);
* **fit labels** — whether the fit data's labels are classes the model outputs (a classifier's are
  checked; a detector's labels are boxes);
* **wrong** — per input of a pass, whether the model's decision is wrong (the system view): a
  classifier's prediction differs from the label; a detector misses an object or makes a false detection
  (:func:`~.detector.detector_wrong`). Inputs without a right answer (:data:`~.faults.NO_RIGHT_ANSWER`)
  are always wrong.

Pure torch; no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.monitors.detector import detector_fault_source, detector_wrong
from pytest_dnnsafety.engines.monitors.faults import NO_RIGHT_ANSWER
from pytest_dnnsafety.errors import DataError

__all__ = ["ClassifierVariant", "DetectorVariant", "for_task"]


class ClassifierVariant:
    """A classifier's benchmark: faults on its data, labels that are classes, a wrong class is an error."""

    task = "single-label"
    #: the fit data's labels are classes the model outputs (checked before fitting)
    labels_are_classes = True

    def fault_source(self, data: Any, family: str) -> Any:
        """What fault ``family`` perturbs: the data itself."""
        return data

    def wrong(self, out: Any, family: str | None, source: Any, shard: Any, role: str) -> Tensor:
        """Per input of the pass ``out``: is the prediction wrong? (Always, on inputs that have no right answer.)

        ``role`` names the data's fixture in errors; ``source`` and ``shard`` are a detector's concern."""
        if family in NO_RIGHT_ANSWER:
            return torch.ones(out.n_inputs, dtype=torch.bool, device=out.predictions.device)
        if out.labels is None:
            raise DataError(f"fixture {role!r} has no labels; the system view compares each decision with the true "
                            "class. Fix: give labelled data (e.g. an .npz with keys x and y).")
        out.check_labels(role)
        return out.predictions != out.labels.to(out.predictions.device)


class DetectorVariant:
    """An object detector's benchmark: faults on its images, box labels, a miss or false detection is an error."""

    task = "detection"
    labels_are_classes = False

    def fault_source(self, data: Any, family: str) -> Any:
        """What fault ``family`` perturbs: the images of the detection data (see :func:`detector_fault_source`)."""
        return detector_fault_source(data, family)

    def wrong(self, out: Any, family: str | None, source: Any, shard: Any, role: str) -> Tensor:
        """Per image of the pass ``out``: a missed object or a false detection (``source``: the evaluation data,
        whose boxes a faulted image keeps; ``shard``: this rank's rows of it)."""
        return detector_wrong(out, family, source, shard, NO_RIGHT_ANSWER)


def for_task(task: str) -> ClassifierVariant | DetectorVariant:
    """The benchmark variant of the model's task (``detection``: a detector's; any other: a classifier's)."""
    return DetectorVariant() if task == "detection" else ClassifierVariant()
