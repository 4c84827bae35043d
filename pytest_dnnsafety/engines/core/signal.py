"""Does the model give any signal? The shared precondition of the relative gates (issue #29 §2).

A *relative* gate compares the model with itself: a group's accuracy against the whole data
(degradation), activation patterns of one class against another (confusion, bias, pattern deviation),
in-distribution scores against faulted ones (monitors), occluded against clean outputs (occlusion).
On a model that gives no signal those comparisons compare nothing, and their value (a degradation of
0.008, a deviation of 0, a detection MCC of 0.97 on a detector that detects nothing) says nothing
about the model. So before such a gate measures, its model must show a signal on its data:

* **a classifier** (single-label) must be shown better than chance: the one-sided 95 %
  Clopper–Pearson lower bound of its accuracy must exceed the share of the most frequent label
  (:func:`chance_lower_bound`; a collapsed model that always answers one class is at chance too).
  Unlabelled data cannot show it: then nothing is checked;
* **a detector** must make at least one detection with a score of at least :data:`DETECTION_SCORE`;
* **a multi-label model** must predict at least one class on some input (a probability reaching the
  decision threshold, 0.5 by default).

:class:`SignalCounts` holds what the check reads of one pass's
:class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` (counts, a label histogram, the highest score):
the counts of torchrun ranks merge by :meth:`SignalCounts.merge` (sums, maxima), so every rank
reaches the single-process verdict. :meth:`SignalCounts.reason` words the verdict with its numbers.
The confidence-loss gate's own check (``max_adversarial_confidence_loss``) uses :func:`chance_lower_bound`
too. Pure torch; no pytest import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["CONFIDENCE", "DETECTION_SCORE", "DECISION_THRESHOLD", "SignalCounts", "chance_lower_bound"]

#: One-sided confidence of the Clopper–Pearson lower bound on the accuracy that must exceed chance.
CONFIDENCE = 0.95
#: The score a detector's detection needs to count (the plugin's convention: robust accuracy, recall, errors).
DETECTION_SCORE = 0.5
#: A multi-label model's default decision threshold.
DECISION_THRESHOLD = 0.5


def chance_lower_bound(correct: int, n: int, chance: float, confidence: float = CONFIDENCE) -> tuple[float, bool]:
    """``(lower, above)``: the one-sided Clopper–Pearson lower bound of ``correct / n`` at ``confidence``, and
    whether it lies above ``chance`` (the share of the most frequent label). ``n = 0`` is never above chance."""
    from pytest_dnnsafety.stats.intervals import clopper_pearson_lower

    if n <= 0:
        return 0.0, False
    lower = float(clopper_pearson_lower([int(correct)], int(n), confidence)[0])
    return lower, lower > chance


def _n(value: int) -> str:
    return f"{value:,}"


@dataclass(frozen=True)
class SignalCounts:
    """What the no-signal check reads of a pass (one torchrun rank's rows, or all of them after :meth:`merge`).

    ``task``: ``single-label``, ``multi-label`` or ``detection``; ``n``: inputs (images); ``correct`` and
    ``label_counts`` (per class) / ``predicted_counts`` (per class): single-label with labels, else None;
    ``classes``: the model's classes (None: a label-returning model without ``classes=``); ``positives``:
    detections scoring at least ``threshold`` (detection) or predicted (input, class) pairs (multi-label) —
    for a multi-label model by reading, ``{"probabilities": .., "logits": ..}`` (``auto`` picks after the merge,
    as every rank must read the outputs alike), with ``inside`` (every output in [0, 1]); ``highest``: the
    highest score or probability seen (same keys).
    """

    task: str
    n: int
    threshold: float | None = None
    kind: str = "auto"
    correct: int | None = None
    label_counts: tuple[int, ...] | None = None
    predicted_counts: tuple[int, ...] | None = None
    classes: int | None = None
    positives: dict[str, int] = field(default_factory=dict)
    highest: dict[str, float] = field(default_factory=dict)
    inside: bool = True

    @staticmethod
    def of(outputs: Any, task: str, *, threshold: Any = None, kind: str | None = None) -> "SignalCounts":
        """The counts of one pass's :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs`.

        ``threshold``: a detection's score (detection; default :data:`DETECTION_SCORE`) or the multi-label
        decision threshold (one number or one per class; default :data:`DECISION_THRESHOLD`); ``kind``: what a
        multi-label model's outputs are (``auto``, ``logits``, ``probabilities``).
        """
        n = int(outputs.n_inputs)
        if task == "detection":
            return SignalCounts._detection(outputs, n, threshold)
        if task == "multi-label":
            return SignalCounts._multilabel(outputs, n, threshold, kind)
        labels = outputs.labels
        k = outputs.num_classes
        if labels is None or not isinstance(labels, torch.Tensor) or labels.ndim != 1 or n == 0:
            return SignalCounts(task, n, classes=k)
        predictions = outputs.predictions.to(labels.device)
        size = max(int(k or 0), int(labels.max()) + 1, int(predictions.max()) + 1, 1)
        label_counts = torch.bincount(labels.clamp(min=0), minlength=size)
        predicted = torch.bincount(predictions.clamp(min=0), minlength=size)
        correct = int((predictions == labels).sum())
        return SignalCounts(task, n, correct=correct, label_counts=tuple(int(c) for c in label_counts.tolist()),
                            predicted_counts=tuple(int(c) for c in predicted.tolist()), classes=k)

    @staticmethod
    def _detection(outputs: Any, n: int, threshold: Any) -> "SignalCounts":
        score = DETECTION_SCORE if threshold is None else float(threshold)
        boxes = outputs.detections
        scores = getattr(boxes, "scores", None)
        if scores is None or scores.numel() == 0:
            return SignalCounts("detection", n, threshold=score, positives={"scores": 0}, highest={})
        return SignalCounts("detection", n, threshold=score, positives={"scores": int((scores >= score).sum())},
                            highest={"scores": float(scores.max())})

    @staticmethod
    def _multilabel(outputs: Any, n: int, threshold: Any, kind: str | None) -> "SignalCounts":
        from pytest_dnnsafety.engines.core.multilabel import decision_thresholds

        kind = kind or "auto"
        logits = outputs.logits
        if logits is None or logits.ndim != 2:  # not a multi-label output: the gate's own check names it
            return SignalCounts("multi-label", n, kind=kind)
        out = logits.float()
        t = decision_thresholds(DECISION_THRESHOLD if threshold is None else threshold, int(out.shape[1]),
                                out.device)
        inside = bool(((out >= 0) & (out <= 1)).all()) if out.numel() else True
        positives, highest = {}, {}
        for reading, p in (("probabilities", out), ("logits", torch.sigmoid(out))):
            positives[reading] = int((p >= t).sum())
            if p.numel():
                highest[reading] = float(p.max())
        shown = float(t[0]) if bool((t == t[0]).all()) else None
        return SignalCounts("multi-label", n, threshold=shown, kind=kind, classes=int(out.shape[1]),
                            positives=positives, highest=highest, inside=inside)

    def merge(self, other: "SignalCounts") -> "SignalCounts":
        """The counts of two disjoint shares of the data (sums; maxima of the highest scores)."""

        def add(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
            if a is None or b is None:
                return a if b is None else b
            size = max(len(a), len(b))
            return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size))

        correct = (None if self.correct is None and other.correct is None
                   else (self.correct or 0) + (other.correct or 0))
        keys = {*self.highest, *other.highest}
        return replace(self, n=self.n + other.n, correct=correct,
                       label_counts=add(self.label_counts, other.label_counts),
                       predicted_counts=add(self.predicted_counts, other.predicted_counts),
                       positives={k: self.positives.get(k, 0) + other.positives.get(k, 0)
                                  for k in {*self.positives, *other.positives}},
                       highest={k: max(d[k] for d in (self.highest, other.highest) if k in d) for k in keys},
                       inside=self.inside and other.inside)

    @staticmethod
    def merge_all(parts: list["SignalCounts"]) -> "SignalCounts":
        """Every rank's counts merged, in rank order."""
        total = parts[0]
        for part in parts[1:]:
            total = total.merge(part)
        return total

    # ------------------------------------------------------------------------------------- the verdict

    @property
    def reading(self) -> str:
        """A multi-label model's outputs as read: ``probabilities`` or ``logits`` (``auto``: by their range)."""
        if self.kind != "auto":
            return self.kind
        return "probabilities" if self.inside else "logits"

    def chance(self) -> tuple[float, float, bool] | None:
        """A labelled classifier's ``(chance, lower, above)`` (:func:`chance_lower_bound`), else None."""
        if self.correct is None or not self.label_counts or self.n == 0:
            return None
        chance = max(self.label_counts) / self.n
        lower, above = chance_lower_bound(self.correct, self.n, chance)
        return chance, lower, above

    def reason(self, data: str = "data") -> str | None:
        """Why the model gives no signal on ``data`` (its fixture's name), with the numbers and the fix; else None."""
        if self.task == "detection":
            return self._detection_reason(data)
        if self.task == "multi-label":
            return self._multilabel_reason(data)
        verdict = self.chance()
        if verdict is None:
            return None
        chance, lower, above = verdict
        if above:
            return None
        assert self.label_counts is not None and self.correct is not None
        k = self.classes if self.classes is not None else sum(1 for c in self.label_counts if c)
        predicted = sum(1 for c in (self.predicted_counts or ()) if c)
        collapsed = f"; it predicts {predicted} of {k} classes" if predicted < k else ""
        return (f"no signal: the model's accuracy {self.correct / self.n:.3f} ({_n(self.correct)}/{_n(self.n)}; "
                f"{CONFIDENCE:.0%} Clopper–Pearson lower bound {lower:.3f}) is not above chance {chance:.3f} (the share "
                f"of the most frequent label, {k} classes, {_n(self.n)} inputs of fixture {data!r}){collapsed}; a "
                "relative gate compares nothing on a model that is not shown better than chance. Fix: check the "
                "model (weights loaded? eval mode? the right model for this data?) and the data's labels (the "
                "model's class order?); gate a model that is better than chance")

    def _detection_reason(self, data: str) -> str | None:
        if self.positives.get("scores", 0) > 0 or self.n == 0:
            return None
        high = self.highest.get("scores")
        seen = "no detection at all" if high is None else f"the highest score {high:.3f}"
        return (f"no signal: the detector makes no detection with a score of at least {self.threshold:g} on any of "
                f"the {_n(self.n)} images of fixture {data!r} ({seen}); a relative gate compares nothing on a "
                "detector that detects nothing. Fix: check the detector (weights loaded? eval mode? scores in "
                "[0, 1]? boxes in pixels x1, y1, x2, y2?) and the data")

    def _multilabel_reason(self, data: str) -> str | None:
        reading = self.reading
        if reading not in self.positives or self.positives[reading] > 0 or self.n == 0:
            return None
        high = self.highest.get(reading)
        threshold = "its decision threshold" + (f" {self.threshold:g}" if self.threshold is not None else "s")
        highest = "" if high is None else f"; the highest probability {high:.3f}"
        return (f"no signal: the multi-label model predicts no class on any of the {_n(self.n)} inputs of fixture "
                f"{data!r} (no probability, its outputs read as {reading}, reaches {threshold}{highest}); a "
                "relative gate compares nothing on a model that predicts nothing. Fix: check the model (weights "
                "loaded? eval mode? outputs= logits or probabilities?) or lower decision_threshold=")

    def to_details(self) -> dict[str, Any]:
        """The numbers of the check (JSON-able)."""
        out: dict[str, Any] = {"task": self.task, "inputs": self.n}
        verdict = self.chance()
        if verdict is not None:
            chance, lower, above = verdict
            out.update(accuracy=self.correct / self.n if self.n else None, accuracy_lower_bound=lower,
                       chance_accuracy=chance, confidence=CONFIDENCE, above_chance=above,
                       predicted_classes=sum(1 for c in (self.predicted_counts or ()) if c), classes=self.classes)
        elif self.task == "single-label":
            out["checked"] = "no labels: a classifier's accuracy cannot be checked against chance"
        if self.task == "detection":
            out.update(score_threshold=self.threshold, detections_above=self.positives.get("scores", 0),
                       highest_score=self.highest.get("scores"))
        if self.task == "multi-label":
            reading = self.reading
            out.update(decision_threshold=self.threshold, outputs=reading,
                       predicted_labels=self.positives.get(reading), highest_probability=self.highest.get(reading))
        return out
