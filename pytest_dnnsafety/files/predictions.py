"""Recorded predictions: outputs a model produced elsewhere (on the target, on a test bench) standing in for it.

``dnnsafety_predictions`` (or :meth:`RecordedPredictions.from_file` in a fixture) names a file of outputs recorded
on the evaluation data:

* **class scores or logits**: ``.npy`` or ``.npz`` (one array, or the key ``logits``, ``scores``,
  ``probabilities`` or ``outputs``), ``(N, classes)`` floating, one row per evaluation sample in the data's
  order; an ``(N,)`` integer array holds predicted class indices (a label-returning model); an ``.npz`` may add
  ``ids`` (or ``image_ids``), one integer per row naming its sample (the data's COCO image id, else its row
  index): the rows are then joined to the data by them, in any order, each sample exactly once;
* **detections**: a COCO results JSON, a list of ``{"image_id", "category_id", "bbox": [x, y, w, h], "score"}``,
  joined to the data's images by ``image_id`` (``data.image_ids``: COCO data) and to its labels by
  ``category_id`` (label ``i`` is ``data.category_ids[i]``); ``bbox`` becomes ``x1, y1, x2, y2``.

The file is read once, within the read budget (:func:`~pytest_dnnsafety.files.parsing.read_bounded`); its ``sha256``
is of the bytes parsed, so the evidence names what was evaluated even if the file changes afterwards (a JSON file
refuses ``NaN``/``Infinity`` and deep nesting; arrays are never unpickled).

A :class:`RecordedPredictions` is pure data: the rows (or the packed detections), the file and its ``sha256``, the
data object the rows belong to (row ``i`` is sample ``i`` of it) and ``model``, the real model when one was given
too (else None). The session's shared pass (:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`)
serves its rows as the outputs of that data without a forward pass; gates that need the model itself are refused
(or run ``model``) by the evaluation. Every check happens here, once, when the file is read: a row count other than
the data's, NaN/inf, a 1-D float or 3-D array, an image id or category id the data does not hold, a score outside
``[0, 1]`` — each a :class:`~pytest_dnnsafety.errors.DataError` naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.data.forms import as_tensors, detection_source, iter_batches, known_length
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.parsing import read_bounded, read_json_file

__all__ = ["ARRAY_KEYS", "ID_KEYS", "SUFFIXES", "RecordedPredictions", "read_predictions"]

#: The keys an ``.npz`` of recorded scores may use (or hold a single array under any key).
ARRAY_KEYS = ("logits", "scores", "probabilities", "outputs")
#: The keys of an optional ``(N,)`` integer array in the ``.npz`` naming each row's sample: the data's COCO image id
#: (COCO data) or its row index; the rows are then joined to the data by it instead of trusted to be in order.
ID_KEYS = ("ids", "image_ids")
#: The file kinds read.
SUFFIXES = (".npy", ".npz", ".json")
_SHOWN = 5


@dataclass(frozen=True, eq=False)
class RecordedPredictions:
    """Outputs recorded elsewhere, standing in for the model on ``data`` (compared by identity, like a model).

    ``rows``: ``(N, K)`` float32 scores/logits or ``(N,)`` int64 predicted classes (None for detections);
    ``detections``: the packed detections with scores (a :class:`~pytest_dnnsafety.data.tasks.BoxSet` over the N
    images, None for scores); ``num_classes``: the detector's classes (the data's categories) or None;
    ``path``/``sha256``: the file read; ``data``: the data object row ``i`` belongs to; ``model``: the real model
    given together with the predictions (run by the gates that need one), else None; ``rows_of``: the file's rows
    this object holds (None: all of them, in order; a subsample's or shard's view keeps their indices);
    ``aligned_by``: how the rows were matched to the data's samples (``"row order"``: trusted, unverifiable;
    ``"ids"``: joined on the ``.npz``'s ids; ``"image_id"``: a COCO results file's image ids).
    """

    path: str
    sha256: str
    data: Any
    rows: Tensor | None = None
    detections: BoxSet | None = None
    num_classes: int | None = None
    model: Any = None
    rows_of: tuple[int, ...] | None = None
    aligned_by: str = "row order"

    # -- reading

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], data: Any, model: Any = None, *, ids: str = "coco",
                  what: str = "recorded predictions") -> RecordedPredictions:
        """The predictions of the file ``path`` (see the module docstring), checked against ``data``.

        ``ids`` (COCO results only): ``"coco"`` joins ``image_id``/``category_id`` to the data's ``image_ids`` and
        ``category_ids`` (COCO data); ``"rows"`` reads ``image_id`` as the data's row index ``0 .. N-1`` and
        ``category_id`` as the label, for detection data without COCO ids.
        """
        return read_predictions(Path(path), data, model, ids=ids, what=what)

    # -- what the gates read

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0]) if self.rows is not None else int(self.detections.n_images)  # type: ignore[union-attr]

    @property
    def is_detection(self) -> bool:
        return self.detections is not None

    def describe(self) -> str:
        """``recorded predictions <file> sha256:<hex>`` (the evidence's ``outputs_from``)."""
        return f"recorded predictions {self.path} {self.sha256}"

    def to_details(self) -> dict[str, Any]:
        """The evidence of a gate that read these predictions."""
        return {"file": self.path, "sha256": self.sha256, "rows": self.n_rows,
                "kind": "detections (COCO results)" if self.is_detection else
                ("predicted classes" if self.rows is not None and self.rows.ndim == 1 else "class scores"),
                "model_run": False, "aligned_by": self.aligned_by,
                **({"rows_of_file": len(self.rows_of)} if self.rows_of is not None else {})}

    def take(self, indices: Sequence[int], data: Any) -> RecordedPredictions:
        """The predictions of rows ``indices`` (ascending) of :attr:`data`, bound to ``data`` (its subsample)."""
        pick = [int(i) for i in indices]
        index = torch.as_tensor(pick, dtype=torch.int64)
        of = tuple(pick) if self.rows_of is None else tuple(self.rows_of[i] for i in pick)
        if self.rows is not None:
            return replace(self, data=data, rows=self.rows[index], rows_of=of)
        dets = self.detections
        assert dets is not None
        return replace(self, data=data, detections=BoxSet.cat([dets.images(i, i + 1) for i in pick]), rows_of=of)

    def span(self, start: int, stop: int) -> tuple[Tensor | None, BoxSet | None]:
        """Rows ``start .. stop - 1`` (a torchrun shard): ``(scores, detections)``."""
        if self.rows is not None:
            return self.rows[start:stop], None
        assert self.detections is not None
        return None, self.detections.images(start, stop)


def read_predictions(path: Path, data: Any, model: Any = None, *, ids: str = "coco",
                     what: str = "recorded predictions") -> RecordedPredictions:
    """:meth:`RecordedPredictions.from_file` (see there); every problem a :class:`DataError` naming the file."""
    if ids not in ("coco", "rows"):
        raise ConfigError(f"{what}: ids={ids!r}: use 'coco' (join on the data's COCO image and category ids) or "
                          "'rows' (image_id is the data's row index, category_id its label)")
    suffix = path.suffix.lower()
    label = f"{what} {path}"
    if suffix not in SUFFIXES:
        raise DataError(f"{label}: {suffix or 'no suffix'} is not a predictions format. Fix: give class scores or "
                        "logits as .npy/.npz (one row per evaluation sample) or detections as a COCO results .json.")
    n = known_length(data)
    if suffix == ".json":
        boxes, classes, sha = _coco_results(path, data, n, ids, label, what)
        return RecordedPredictions(str(path), sha, data, detections=boxes, num_classes=classes, model=model,
                                   aligned_by="image_id" if ids == "coco" else "image_id as row index")
    raw = read_bounded(path, what, "record fewer samples per file (split the evaluation) or evaluate a subset.")
    sha = "sha256:" + hashlib.sha256(raw).hexdigest()  # the bytes parsed below: the evidence names what was read
    rows, row_ids = _score_rows(path, label, raw)
    if n is not None and int(rows.shape[0]) != n:
        raise DataError(f"{label}: the file holds {int(rows.shape[0])} rows but the evaluation data hold {n} samples; "
                        "recorded predictions need one row per evaluation sample, in the data's order. Fix: record "
                        "the predictions on exactly this data (or point dnnsafety_data at the data they were "
                        "recorded on).")
    if row_ids is None:
        return RecordedPredictions(str(path), sha, data, rows=rows, model=model)
    order = _joined(row_ids, data, n, label)
    return RecordedPredictions(str(path), sha, data, rows=rows[order], model=model, aligned_by="ids")


def _joined(row_ids: Any, data: Any, n: int | None, label: str) -> Tensor:
    """``order[j]``: the file's row of the data's sample ``j``, by the ``.npz``'s ids (the data's COCO image ids,
    else its row indices); a duplicate, unknown or missing id is a DataError naming a few."""
    if n is None:
        raise DataError(f"{label}: rows joined on ids need sized evaluation data (its length unknown without reading "
                        "it). Fix: give a sized data set.")
    keys = getattr(data, "image_ids", None)
    what = "COCO image id" if keys is not None else "row index"
    keys = [int(k) for k in keys] if keys is not None else list(range(n))
    row_of: dict[int, int] = {}
    duplicates = []
    for row, key in enumerate(int(v) for v in row_ids):
        if key in row_of:
            duplicates.append(key)
        row_of[key] = row
    unknown = sorted(set(row_of) - set(keys))
    missing = [k for k in keys if k not in row_of]
    problems = [f"{name} {', '.join(map(str, found[:_SHOWN]))}{', ...' if len(found) > _SHOWN else ''}"
                for name, found in (("ids given twice:", duplicates), (f"ids that are no {what} of the data:", unknown),
                                    (f"samples without a row (by {what}):", missing)) if found]
    if problems:
        raise DataError(f"{label}: its ids do not name each evaluation sample once: {'; '.join(problems)}. Fix: "
                        f"record one row per sample with ids = the sample's {what}.")
    return torch.as_tensor([row_of[k] for k in keys], dtype=torch.int64)


def _score_rows(path: Path, label: str, raw: bytes) -> tuple[Tensor, Any]:
    """The rows and, when the ``.npz`` holds one of :data:`ID_KEYS`, each row's id (a 1-D integer array)."""
    from pytest_dnnsafety.files.loading import (
        read_array_file,  # the bounded, unpickling-free array reader
    )

    raw = read_array_file(path, label, raw=raw)
    row_ids = None
    if isinstance(raw, Mapping):
        raw = dict(raw)
        named = [key for key in ID_KEYS if key in raw]
        if len(named) > 1:
            raise DataError(f"{label}: the .npz holds both {' and '.join(named)}. Fix: save the rows' ids once.")
        if named:
            row_ids = np.asarray(raw.pop(named[0]))
            if row_ids.ndim != 1 or not np.issubdtype(row_ids.dtype, np.integer) or row_ids.dtype == np.bool_:
                raise DataError(f"{label}: {named[0]} is a {row_ids.dtype} array of shape {row_ids.shape}; the rows' "
                                "ids are one integer per row, (N,). Fix: save the samples' ids (COCO image ids, or "
                                "row indices of the evaluation data) as integers.")
        keys = [key for key in ARRAY_KEYS if key in raw]
        if len(raw) == 1:
            raw = next(iter(raw.values()))
        elif len(keys) == 1:
            raw = raw[keys[0]]
        else:
            raise DataError(f"{label}: the .npz holds the arrays {sorted(raw)}; which one holds the predictions is "
                            f"not clear. Fix: save one array, or name it one of {', '.join(ARRAY_KEYS)}.")
    array = np.asarray(raw)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise DataError(f"{label}: the array's dtype is {array.dtype}; recorded predictions are class scores or logits "
                        "(floating, (N, classes)) or predicted class indices (integers, (N,)). Fix: save those.")
    if np.issubdtype(array.dtype, np.integer):
        if array.ndim != 1:
            raise DataError(f"{label}: an integer array of shape {array.shape}: predicted classes are one index per "
                            "sample, (N,). Fix: save class scores as floats (N, classes), or the indices as (N,).")
        if array.size and array.min() < 0:
            raise DataError(f"{label}: predicted class {int(array.min())} is negative. Fix: save class indices "
                            "0 .. classes - 1.")
        return torch.from_numpy(array.astype(np.int64)), row_ids
    if array.ndim != 2 or array.shape[1] < 1:
        raise DataError(f"{label}: the scores have shape {array.shape}; recorded class scores or logits are a "
                        "(N, classes) array, one row per evaluation sample. Fix: save the model's (N, classes) "
                        "outputs (stack the batches), or (N,) integer class indices.")
    rows = torch.from_numpy(array.astype(np.float32))
    bad = ~torch.isfinite(rows).all(dim=1)
    if bool(bad.any()):
        which = torch.nonzero(bad).flatten()[:_SHOWN].tolist()
        raise DataError(f"{label}: {int(bad.sum())} of {rows.shape[0]} rows hold NaN/inf (rows "
                        f"{', '.join(map(str, which))}{', ...' if int(bad.sum()) > _SHOWN else ''}); a metric computed "
                        "from them would be meaningless. Fix: check how the outputs were recorded (a diverged or "
                        "overflowing run on the target).")
    return rows, row_ids


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)


def _coco_results(path: Path, data: Any, n: int | None, ids: str, label: str, what: str
                  ) -> tuple[BoxSet, int | None, str]:
    """The COCO results of ``path`` packed per image of ``data`` (in the data's order), the class count and the
    sha256 of the bytes parsed."""
    if n is None:
        raise DataError(f"{label}: the evaluation data's length is unknown without reading it, so the results' images "
                        "cannot be placed. Fix: give sized detection data (COCO data, DetectionData).")
    image_ids = getattr(data, "image_ids", None)
    category_ids = getattr(data, "category_ids", None)
    if ids == "coco" and (image_ids is None or category_ids is None):
        raise DataError(f"{label}: the evaluation data ({type(data).__name__}) carry no COCO image ids and category "
                        "ids to join the results on. Fix: give the data as COCO annotations (dnnsafety_data = "
                        "\"annotations.json\" with dnnsafety_images, or CocoDetectionData.from_coco), or, when each "
                        "image_id is the data's row index and each category_id its label, "
                        "RecordedPredictions.from_file(path, data, ids='rows').")
    if ids == "rows":
        row_of = {i: i for i in range(n)}
        label_of: dict[Any, int] | None = None
        classes = None
    else:
        row_of = {int(v): i for i, v in enumerate(image_ids)}  # type: ignore[arg-type]
        label_of = {int(v): k for k, v in enumerate(category_ids)}  # type: ignore[arg-type]
        classes = len(label_of)
        if len(row_of) != n:
            raise DataError(f"{label}: the data list {len(row_of)} distinct image ids for {n} images. Fix: one id "
                            "per image.")
    doc, sha = read_json_file(path, what, "record fewer detections per image (a score floor) or evaluate a subset.")
    if not isinstance(doc, list):
        raise DataError(f"{label}: a COCO results file is a JSON list of detections, got {type(doc).__name__}. Fix: "
                        "write [{\"image_id\", \"category_id\", \"bbox\": [x, y, w, h], \"score\"}, ...].")
    problems: list[str] = []
    rows, labels, boxes, scores = [], [], [], []
    for i, r in enumerate(doc):
        if len(problems) >= _SHOWN:
            break
        if not isinstance(r, dict):
            problems.append(f"[{i}] is a {type(r).__name__}, not an object")
            continue
        image, cat, bbox, score = r.get("image_id"), r.get("category_id"), r.get("bbox"), r.get("score")
        if not isinstance(image, int) or isinstance(image, bool) or image not in row_of:
            where = "the data's image ids" if ids == "coco" else f"the data's rows 0..{n - 1}"
            problems.append(f"[{i}].image_id {image!r} is not one of {where}")
            continue
        if not isinstance(cat, int) or isinstance(cat, bool) or (label_of is not None and cat not in label_of) \
                or (label_of is None and cat < 0):
            known = f"the data's category ids {list(label_of)[:10]}" if label_of is not None else "a label >= 0"
            problems.append(f"[{i}].category_id {cat!r} is not {known}")
            continue
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(_number(v) for v in bbox)) or bbox[2] < 0 \
                or bbox[3] < 0:
            problems.append(f"[{i}].bbox {bbox!r} is not [x, y, width, height] of finite numbers, width, height >= 0")
            continue
        if not _number(score) or not 0.0 <= score <= 1.0:
            problems.append(f"[{i}].score {score!r} is not a probability in [0, 1]")
            continue
        x, y, w, h = (float(v) for v in bbox)
        rows.append(row_of[image])
        labels.append(label_of[cat] if label_of is not None else int(cat))
        boxes.append((x, y, x + w, y + h))
        scores.append(float(score))
    if problems:
        raise DataError(f"{label}: {'; '.join(problems)}. Fix: record detections of the evaluation data's images "
                        "(image_id as in its annotations), of its categories, with bbox [x, y, w, h] in pixels and "
                        "score a probability.")
    row = torch.tensor(rows, dtype=torch.int64)
    order = torch.sort(row, stable=True).indices  # by image, the file's order within one
    packed = BoxSet(torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4)[order],
                    torch.tensor(labels, dtype=torch.int64)[order], row[order], n,
                    torch.tensor(scores, dtype=torch.float64)[order])
    return packed, classes, sha


def data_labels(data: Any, batch_size: int = 256) -> tuple[Any, int]:
    """``(labels, rows)`` of ``data`` in its order: class labels (a tensor), detection targets (a BoxSet) or None
    (unlabelled), and its number of rows. Read without the inputs where the form allows (tensors, a TensorDataset,
    detection data, ``(x, y)``, ``{"x", "y"}``), else batch by batch."""
    data = detection_source(data, "data")
    if isinstance(data, DetectionData):
        return data.targets, len(data)
    if not isinstance(data, torch.utils.data.DataLoader):
        x, y = as_tensors(data)
        return y, int(x.shape[0])
    ys: list[Any] = []
    rows = 0
    for x, y in iter_batches(data, batch_size):
        rows += int(x.shape[0])
        ys.append(y)
    if not ys or any(y is None for y in ys):
        return None, rows
    return (BoxSet.cat(ys) if isinstance(ys[0], BoxSet) else torch.cat([torch.as_tensor(y) for y in ys])), rows
