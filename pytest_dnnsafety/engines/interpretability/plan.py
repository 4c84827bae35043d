"""What the occlusion gates run: an occlusion plan per task (Cheng et al. 2018, §II-F/G, eq. 5).

``min_interpretation_precision``, ``min_occlusion_sensitivity`` and ``max_occlusion_sensitivity`` share one
measurement per model, data and masks: the occluder (``size``, ``stride``, ``fill``), ``rho``, ``target``, the
``no_hot`` and ``empty_mask`` rules and the chunk size ``max_batch``. :class:`OcclusionPlan` holds them in one of two
task variants — as torchmetrics has Binary/Multiclass variants of one metric:

* :class:`ClassifierOcclusion` — per input, against its segmentation mask (:func:`~.occlusion.assess_occlusion`);
  it needs the masks and reads ``outputs``;
* :class:`DetectorOcclusionPlan` — per ground-truth object, its matched score against its box or its own mask
  (:func:`~.detector.assess_detector_occlusion`); ``outputs`` is refused, ``iou`` read.

:meth:`OcclusionPlan.for_task` picks the variant. Each gives the values that identify its measurement (so that
the three gates on the same model, data and masks share one run), runs it, and words the value's detail text,
JSON details and, when the value is a convention rather than a measurement of the model, why (no signal is no
pass, issue #19 §4). Pure torch; no pytest import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pytest_dnnsafety.engines.interpretability.occlusion import _pair
from pytest_dnnsafety.errors import ConfigError

__all__ = ["OcclusionPlan", "ClassifierOcclusion", "DetectorOcclusionPlan", "LABELS"]

#: The metrics of eq. (5) by the name :meth:`~.occlusion.OcclusionResult.value` reads, and their labels.
LABELS = {"interpret": "M_interpret", "occsen": "M_OccSen"}


@dataclass(frozen=True)
class OcclusionPlan(ABC):
    """The occlusion gates' options, resolved (``size`` and ``stride`` as ``(h, w)``); ``marker`` starts every error
    message and ``aggregate`` ("mean", "min" or "max") is the gate's own. Use a task variant (:meth:`for_task`)."""

    marker: str
    size: tuple[int, int]
    stride: tuple[int, int]
    fill: float | str
    rho: float
    target: str
    no_hot: str
    empty_mask: str
    outputs: str
    max_batch: int
    iou: float
    aggregate: str = "mean"

    #: the words of the no-signal reason (:meth:`by_convention`): what is below ρ, of which units, whose geometry
    _unconfident: ClassVar[str] = "the model's probability of the original class is below"
    _units: ClassVar[str] = "inputs"
    _geometry: ClassVar[str] = "masks"
    _fix: ClassVar[str] = "check the model (weights loaded? outputs=?)"

    #: the task this variant measures, its name among the session's memoised results, and whether it needs masks
    task: ClassVar[str] = ""
    memo_name: ClassVar[str] = ""
    needs_masks: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """A variant refuses here the options its task does not read."""

    @staticmethod
    def for_task(task: str, marker: str, options: Mapping[str, Any]) -> ClassifierOcclusion | DetectorOcclusionPlan:
        """The variant of ``task`` (``"detection"`` or a classifier's) for the marker's options by keyword."""
        variant = DetectorOcclusionPlan if task == "detection" else ClassifierOcclusion
        return variant(marker, _pair(options["size"], "size"), _pair(options["stride"], "stride"), options["fill"],
                       float(options["rho"]), options["target"], options["no_hot"], options["empty_mask"],
                       options["outputs"], options["max_batch"], float(options["iou"]), options["aggregate"])

    def _common(self) -> dict[str, Any]:
        return {"size": self.size, "stride": self.stride, "fill": self.fill, "rho": self.rho, "target": self.target,
                "no_hot": self.no_hot, "empty_mask": self.empty_mask}

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The keyword arguments of this variant's ``assess`` function (besides the model, data, masks, run)."""

    @abstractmethod
    def assess(self, model: Any, data: Any, masks: Any, *, batch_size: int, device: str, shard: Any = None) -> Any:
        """Run the measurement of the plan on ``model``, ``data`` and ``masks`` (``shard``: this rank's batches)."""

    def key(self, batch_size: int, device: str) -> tuple[Any, ...]:
        """The plain values a shared run is keyed by (besides the model, the data and the masks)."""
        return tuple(self.options().items()), batch_size, device

    def _fill_text(self) -> str:
        return self.fill if isinstance(self.fill, str) else f"{self.fill:g}"

    def by_convention(self, result: Any, metric: str) -> str | None:
        """Why the value is no measurement of the model (no signal is never a pass), else None.

        * every input's clean probability is already below ρ: every position is hot whatever is
          occluded, so M_interpret is the mask's share of the positions and M_OccSen is 1 — geometry,
          not the model;
        * M_interpret with ``no_hot='one'``/``'zero'`` when no input has a hot position (a model that
          ignores its input): every input counts as the convention's 1 or 0.
        """
        if result.n and result.below_rho >= result.n:
            return (f"{self._unconfident} ρ={self.rho:g} on every one of the {result.n} {self._units} before any "
                    f"occlusion, so every position is hot and {LABELS[metric]} reflects the {self._geometry}' geometry, not "
                    f"the model (Cheng et al. 2018, eq. 5 assumes a confident detection). Fix: {self._fix} or lower "
                    "rho=")
        if metric != "interpret" or self.no_hot == "skip" or result.n_interpret == 0 or \
                result.no_hot < result.n_interpret:
            return None
        return (f"no occlusion changed the output on any of the {result.n_interpret} inputs (no hot position), so "
                f"M_interpret is no_hot={self.no_hot!r}'s convention for every input, not a measurement. Fix: check "
                "that the model reads its input; raise rho= or use a larger occluder (size=)")

    @abstractmethod
    def setup(self, result: Any) -> str:
        """The occluder, ρ and what the heat map holds, for the detail text."""

    @abstractmethod
    def report(self, result: Any, metric: str, strict: bool = False) -> dict[str, Any]:
        """``value``, ``detail``, ``details`` and ``inconclusive`` of ``metric`` ("interpret" or "occsen")
        aggregated by the plan's ``aggregate``; ``strict``: a detector's missed objects count as M_OccSen 0."""


class ClassifierOcclusion(OcclusionPlan):
    """A classifier's plan: per input, the probability of its original class against its segmentation mask."""

    task = "single-label"
    memo_name = "occlusion"

    def options(self) -> dict[str, Any]:
        return {**self._common(), "outputs": self.outputs, "max_batch": self.max_batch}

    def assess(self, model: Any, data: Any, masks: Any, *, batch_size: int, device: str, shard: Any = None) -> Any:
        """:func:`~.occlusion.assess_occlusion` of the plan (``shard``: this rank's batches, states all-reduced)."""
        from pytest_dnnsafety.engines.interpretability.occlusion import assess_occlusion

        return assess_occlusion(model, data, masks, batch_size=batch_size, device=device, shard=shard,
                                **self.options())

    def setup(self, result: Any) -> str:
        """``occluder 3x3, stride 1x1, fill 0, ρ=0.5, predicted class`` (``result`` is not read)."""
        return (f"occluder {self.size[0]}x{self.size[1]}, stride {self.stride[0]}x{self.stride[1]}, fill "
                f"{self._fill_text()}, ρ={self.rho:g}, {self.target} class")

    def report(self, result: Any, metric: str, strict: bool = False) -> dict[str, Any]:
        label, aggregate = LABELS[metric], self.aggregate
        value = result.value(metric, aggregate)
        details = {**result.to_details(), "gated": f"M_{metric}", "aggregate": aggregate}
        return {"value": value, "detail": f"{self.setup(result)}: {label} {aggregate} {value:.3f}; {result.detail()}",
                "details": details, "inconclusive": self.by_convention(result, metric)}


class DetectorOcclusionPlan(OcclusionPlan):
    """A detector's plan: per ground-truth object, its matched score (IoU ≥ ``iou``) against its box or mask."""

    task = "detection"
    memo_name = "occlusion (detection)"
    needs_masks = False  # the objects' boxes stand in
    _unconfident = "the detector misses every object: its matched score is below"
    _units = "ground-truth objects"
    _geometry = "boxes (or masks)"
    _fix = "check the detector (weights loaded? boxes in pixels x1, y1, x2, y2? the data's classes?)"

    def __post_init__(self) -> None:
        if self.outputs != "auto":
            raise ConfigError(f"{self.marker}: outputs={self.outputs!r} is for classifiers; a detector's heat map is "
                              "its matched detection score (task='detection'). Fix: drop outputs= for a detector.")

    def options(self) -> dict[str, Any]:
        return {**self._common(), "iou": self.iou, "max_batch": self.max_batch}

    def assess(self, model: Any, data: Any, masks: Any, *, batch_size: int, device: str, shard: Any = None) -> Any:
        """:func:`~.detector.assess_detector_occlusion` of the plan: both readings, eq. (5) and the strict one."""
        from pytest_dnnsafety.engines.interpretability.detector import (
            assess_detector_occlusion,
        )

        return assess_detector_occlusion(model, data, masks, batch_size=batch_size, device=device, shard=shard,
                                         **self.options())

    def setup(self, result: Any) -> str:
        """The classifier's setup with the matching rule, what occludes an object, and the missed objects."""
        return (f"occluder {self.size[0]}x{self.size[1]}, stride {self.stride[0]}x{self.stride[1]}, fill "
                f"{self._fill_text()}, ρ={self.rho:g}, per ground-truth object (matched score, IoU ≥ {self.iou:g}; "
                f"occluding = {result.setup['occluding']}); {result.below_rho} of {result.n} objects missed on the "
                "clean image")

    def report(self, both: Any, metric: str, strict: bool = False) -> dict[str, Any]:
        """Eq. (5) per object; ``strict`` reads the missed objects as M_OccSen 0. Inconclusive, as a classifier's
        gate is, when the detector misses every object on the clean images (every position hot: the boxes'
        geometry, not the detector — the same verdict across tasks, issue #29 §2), and under ``no_hot='one'``/
        ``'zero'`` when no object has a hot position (the convention, not the detector)."""
        result = both.strict if strict else both.result
        label, aggregate = LABELS[metric], self.aggregate
        value = result.value(metric, aggregate)
        details = {**result.to_details(), "gated": f"M_{metric}", "aggregate": aggregate,
                   "missed_objects": int(result.below_rho)}
        # the missed objects are counted on eq. (5)'s reading (the strict one empties their hot sets)
        why = self.by_convention(replace(result, below_rho=both.result.below_rho, n=both.result.n), metric)
        return {"value": value, "detail": f"{self.setup(result)}: {label} {aggregate} {value:.3f}; {result.detail()}",
                "details": details, "inconclusive": why}
