"""Recorded predictions as the shared pass's outputs: the fields of
:class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` from a
:class:`~pytest_dnnsafety.files.predictions.RecordedPredictions`, with no forward pass.

:meth:`ActivationCache.outputs <pytest_dnnsafety.engines.core.capture.ActivationCache.outputs>` calls
:func:`recorded_outputs` when the gate's model is recorded predictions: the rows stand for the model's outputs on
the data they were recorded on (the same object, or a subsample view made with them), turned into the decision,
confidence, raw scores and, for a detector, the packed detections exactly as the pass turns a model's outputs
(softmax arg-max and its probability; an image's top-scoring detection). The data's labels are read beside them
(without the inputs where the data's form allows). Layer activations have no recorded stand-in:
:func:`refuse_layers` names the file and the fix. Pure torch.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.predictions import RecordedPredictions, data_labels

__all__ = ["recorded_outputs", "refuse_layers"]

_FIX = ("Fix: give the model too (dnnsafety_model, or RecordedPredictions.from_file(..., model=...)): the gates "
        "that need it run it, the output-only gates read the recorded predictions")


def refuse_layers(recorded: RecordedPredictions, layers: Any) -> ConfigError:
    """The error of a gate asking recorded predictions for layer activations."""
    return ConfigError(f"layer(s) {', '.join(map(repr, layers))}: the model is recorded predictions only "
                       f"({recorded.path}); a file of outputs has no layers to read. {_FIX}.")


def recorded_outputs(recorded: RecordedPredictions, data: Any, *, device: torch.device | str, batch_size: int,
                     shard: Any = None) -> dict[str, Any]:
    """The fields of the :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` the recorded rows give on ``data``
    (rows ``shard.rows`` of it under torchrun), which the cache builds."""
    if data is not recorded.data:
        raise ConfigError(f"the recorded predictions {recorded.path} are outputs on the data they were read with (a "
                          f"{type(recorded.data).__name__}), not on this {type(data).__name__}; a file of outputs "
                          f"cannot answer for other inputs. {_FIX}, or record the predictions on this data.")
    labels, rows = data_labels(data, batch_size)
    if rows != recorded.n_rows:
        raise DataError(f"the recorded predictions {recorded.path} hold {recorded.n_rows} rows but the evaluation data "
                        f"hold {rows} samples; recorded predictions need one row per evaluation sample, in the data's "
                        "order. Fix: record the predictions on exactly this data.")
    start, stop = (0, rows) if shard is None else shard.rows
    scores, detections = recorded.span(start, stop)
    if labels is not None:
        labels = labels.images(start, stop) if isinstance(labels, BoxSet) else labels[start:stop]
        labels = labels.to(device)
    if detections is not None:
        if torch.device(device).type == "mps":  # no float64 there
            detections = BoxSet(detections.boxes.float(), detections.labels, detections.image,
                                detections.n_images, detections.scores.float())  # type: ignore[union-attr]
        out = detections.to(device)
        n = out.n_images
        assert out.scores is not None
        top = torch.full((n,), -1.0, device=out.device).scatter_reduce(
            0, out.image, out.scores.float(), reduce="amax", include_self=True)
        best = (out.scores.float() == top[out.image]) & (top[out.image] >= 0)
        label = torch.full((n,), -1, dtype=torch.int64, device=out.device).scatter_reduce(
            0, out.image[best], out.labels[best], reduce="amax", include_self=True)
        return {"predictions": label, "confidence": top.clamp_min(0.0), "labels": labels,
                "num_classes": recorded.num_classes, "logits": None, "detections": out}
    assert scores is not None
    scores = scores.to(device)
    if scores.ndim == 1:  # predicted class indices
        return {"predictions": scores.long(), "confidence": torch.ones(scores.shape[0], device=scores.device),
                "labels": labels, "num_classes": None}
    conf, pred = torch.softmax(scores.float(), dim=1).max(dim=1)
    return {"predictions": pred, "confidence": conf, "labels": labels, "num_classes": int(scores.shape[1]),
            "logits": scores}
