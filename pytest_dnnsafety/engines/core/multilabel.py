"""Multi-label outputs: per-class probabilities, decision thresholds and the predicted sets (the multi-hot matrix).

A multi-label model gives one output per class; input ``i`` predicts class ``c`` when ``p_ic ≥ t_c`` (a
threshold per class, or one for all; 0.5 by default) with ``p = sigmoid(logits)`` — or the outputs
themselves when they are probabilities (``outputs="probabilities"``; ``"auto"`` takes them as
probabilities when every output lies in [0, 1], else as logits: one host read). ``P`` is the ``(N, K)``
multi-hot prediction matrix, ``Y`` the ``(N, K)`` 0/1 label matrix. Shared by the families that read a
multi-label model (inspection, performance). No pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["OUTPUT_KINDS", "check_label_matrix", "probabilities", "decision_thresholds", "predicted_sets",
           "output_kind", "refuse_multilabel_options"]

OUTPUT_KINDS = ("auto", "logits", "probabilities")

def probabilities(outputs: Tensor, kind: str = "auto") -> Tensor:
    """Per-class probabilities ``(N, K)`` float: sigmoid of logits, or the outputs themselves (see module doc)."""
    if kind not in OUTPUT_KINDS:
        raise ConfigError(f"outputs={kind!r} is not one of {OUTPUT_KINDS}. Fix: 'logits' (sigmoid applied), "
                          "'probabilities' (used as they are) or 'auto'.")
    out = outputs.float()
    if kind == "logits":
        return torch.sigmoid(out)
    inside = bool(((out >= 0) & (out <= 1)).all()) if out.numel() else True
    if kind == "probabilities" and not inside:
        raise DataError(f"outputs='probabilities' but the model's outputs range over {float(out.min()):.4g}.."
                        f"{float(out.max()):.4g}, outside [0, 1]. Fix: outputs='logits' (a sigmoid is applied), "
                        "or end the model with a sigmoid.")
    return out if inside else torch.sigmoid(out)


def decision_thresholds(threshold: Any, k: int, device: torch.device | str = "cpu") -> Tensor:
    """``(K,)`` float thresholds from one number or a list of ``K`` numbers, each in (0, 1)."""
    values = [threshold] if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) else threshold
    if not isinstance(values, (list, tuple)) or not values or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in values):
        raise ConfigError(f"decision threshold {threshold!r} must be a number in (0, 1) or a list of them, one per "
                          "class. Fix: e.g. decision_threshold=0.5.")
    if len(values) not in (1, k):
        raise ConfigError(f"decision threshold lists {len(values)} values but the model has {k} classes. Fix: give "
                          "one number, or one per class in the model's output order.")
    return torch.tensor([float(v) for v in values] * (k if len(values) == 1 else 1), device=device)


def predicted_sets(outputs: Tensor, threshold: Any = 0.5, kind: str = "auto") -> Tensor:
    """The multi-hot prediction matrix ``P`` (bool ``(N, K)``): ``p_ic ≥ t_c``."""
    if outputs.ndim != 2:
        raise DataError(f"multi-label outputs must be (batch, classes), got shape {tuple(outputs.shape)}.")
    return probabilities(outputs, kind) >= decision_thresholds(threshold, outputs.shape[1], outputs.device)


def check_label_matrix(out: Any, marker: str, data: str, *, required: bool = True) -> int:
    """K, after checking a pass's :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` for a multi-label gate:
    ``(N, K)`` outputs and (``required``, or present) a ``(N, K)`` 0/1 label matrix; a DataError naming the fix."""
    if out.logits is None or out.logits.ndim != 2:
        raise DataError(f"{marker}: a multi-label gate needs the model's (batch, classes) outputs, one logit or "
                        "probability per class, but this model returns one class index per input. Fix: return the "
                        "per-class scores (logits or sigmoid probabilities).")
    k = int(out.logits.shape[1])
    labels = out.labels
    if labels is None:
        if required:
            raise DataError(f"{marker}: the data (fixture {data!r}) has no labels. Fix: give a (N, {k}) 0/1 label "
                            "matrix, e.g. an .npz with arrays x and y.")
        return k
    if labels.ndim != 2 or labels.shape[1] != k:
        raise DataError(f"{marker}: multi-label labels must be a (N, {k}) 0/1 matrix (one column per model output), "
                        f"but fixture {data!r} gives shape {tuple(labels.shape)}. Fix: give a (N, {k}) 0/1 matrix "
                        "with the columns in the model's output order (for class-index labels the model is "
                        "single-label: task='single-label').")
    if labels.numel() and not bool(((labels == 0) | (labels == 1)).all()):
        raise DataError(f"{marker}: the labels of fixture {data!r} hold values other than 0 and 1. Fix: a 0/1 "
                        "matrix, 1 where the class is present.")
    return k


def output_kind(kind: str | None, logits: Tensor, sharded: bool = False) -> str:
    """A gate's ``outputs=`` (None: ``"auto"``) resolved to 'logits' or 'probabilities', the same on every rank:
    'auto' is probabilities when every output lies in [0, 1] — on every torchrun rank when ``sharded`` (each
    rank's answer gathered, so all ranks read the outputs alike)."""
    from pytest_dnnsafety.runtime import torchrun as ranks

    kind = kind or "auto"
    if kind != "auto":
        return kind
    inside = bool(((logits >= 0) & (logits <= 1)).all()) if logits.numel() else True
    return "probabilities" if all(ranks.gather(inside) if sharded else [inside]) else "logits"


def refuse_multilabel_options(marker: str, options: Any, multi: bool) -> None:
    """A ConfigError when a single-label model (``multi`` False) is given an option of ``options`` (a gate's
    options by keyword) that only a multi-label model reads: ``decision_threshold``, ``outputs``."""
    if multi:
        return
    given = [name for name in ("decision_threshold", "outputs") if options.get(name) is not None]
    if given:
        raise ConfigError(f"{marker}: {', '.join(given)} only applies to multi-label models (one probability "
                          "per class, a class predicted when it reaches the decision threshold); this model is "
                          "single-label (its labels are class indices). Fix: drop it, or give multi-label data (a "
                          "(N, classes) 0/1 label matrix) or task='multi-label'.")
