"""The model adapter of the reliability assessment: guarded model queries turned into class indices.

Part of :mod:`pytest_dnnsafety.engines.reliability`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard


class _CheckedModel(torch.nn.Module):
    """The user's model with its output validated and made a tensor (for :class:`ForwardGuard`).

    A module, so :class:`ForwardGuard` still sees the wrapped model's parameters (its error hints
    name their dtype and device); named after the wrapped model's type by :func:`_checked`.
    """

    def __init__(self, model: Callable[[Tensor], Any], adapter: _ModelAdapter) -> None:
        super().__init__()
        if isinstance(model, torch.nn.Module):
            self.inner = model
        else:
            self._callable = model
        self._adapter = adapter

    def forward(self, x: Tensor) -> Tensor:
        model = self.inner if hasattr(self, "inner") else self._callable
        return self._adapter.validate(model(x), x)


class _EstimatorModel:
    """A scikit-learn style estimator as a model callable: ``predict_proba`` (preferred) or ``predict``.

    Inputs ``(B, *shape)`` are moved to the CPU and flattened to the 2-D ``(B, features)`` numpy
    array scikit-learn expects (in the sampling dtype, float32 by default); the output comes back
    as a tensor on the inputs' device. ``predict_proba``'s columns follow ``estimator.classes_``:
    when those are the integers ``0..K-1`` the columns are the class scores as they are; other
    non-negative integers (e.g. an estimator fitted on labels ``{1, 2}`` only) are scattered into
    columns ``0..max(classes_)`` (absent classes score 0, so they are never predicted); any other
    ``classes_`` (strings, negative numbers) is a :class:`ConfigError`, as class indices must match
    the labelled data's. ``predict`` must return integer labels (or integral floats).

    The transfer to numpy is a host sync per model batch — inherent to a CPU estimator, and the
    batch (the sampler's, :data:`~pytest_dnnsafety.engines.reliability.BLOCK` samples or more) keeps
    it rare.
    """

    def __init__(self, estimator: Any) -> None:
        self.estimator = estimator
        self.method = "predict_proba" if callable(getattr(estimator, "predict_proba", None)) else "predict"
        self._columns: np.ndarray | None = None
        self._width = 0
        classes = getattr(estimator, "classes_", None)
        if classes is None:
            return
        values = np.asarray(classes)
        name = type(estimator).__name__
        if values.ndim != 1 or not (np.issubdtype(values.dtype, np.integer)
                                    or (np.issubdtype(values.dtype, np.floating)
                                        and bool(np.all(values == np.round(values))))) \
                or (values.size and int(values.min()) < 0):
            raise ConfigError(
                f"the model {name} has classes_ {values.tolist()[:10]!r}; the reliability assessment needs integer "
                f"class indices 0..K-1, the same as the labelled data's. Fix: fit the estimator on integer labels "
                f"(e.g. sklearn.preprocessing.LabelEncoder) or wrap it in a callable returning class indices"
            )
        ints = values.astype(np.int64)
        if not np.array_equal(ints, np.arange(ints.size)):
            self._columns, self._width = ints, int(ints.max()) + 1

    def __call__(self, x: Tensor) -> Tensor:
        arr = x.detach().to("cpu").reshape(x.shape[0], -1).numpy()
        out = np.asarray(getattr(self.estimator, self.method)(arr))
        if self.method == "predict_proba":
            if self._columns is not None and out.ndim == 2 and out.shape[1] == self._columns.size:
                full = np.zeros((out.shape[0], self._width), dtype=out.dtype)
                full[:, self._columns] = out
                out = full
        elif out.dtype.kind in "iu" or (out.dtype.kind == "f" and bool(np.all(out == np.round(out)))):
            out = out.astype(np.int64)  # labels (the classes_ values are the class indices themselves)
        return torch.from_numpy(np.ascontiguousarray(out)).to(x.device)


def _is_estimator(model: Any) -> bool:
    """A scikit-learn style estimator (not a torch module, not callable) with ``predict_proba``/``predict``."""
    return (not isinstance(model, torch.nn.Module) and not callable(model)
            and (callable(getattr(model, "predict_proba", None)) or callable(getattr(model, "predict", None))))


def _checked(model: Callable[[Tensor], Any], adapter: _ModelAdapter) -> _CheckedModel:
    named = model.estimator if isinstance(model, _EstimatorModel) else model  # errors name the user's type
    kind = type(type(named).__name__, (_CheckedModel,), {"__doc__": _CheckedModel.__doc__})
    return kind(model, adapter)


class _ModelAdapter:
    """Calls a model (torch module, any callable, or a scikit-learn style estimator) and turns its output
    into class indices ``(B,)``.

    Callables may return tensors or numpy arrays (moved to the inputs' device). An object that is
    not callable but has ``predict_proba`` or ``predict`` (scikit-learn's API) is called through
    :class:`_EstimatorModel`: 2-D CPU numpy inputs, ``predict_proba``'s columns aligned with
    ``classes_``.

    Accepted outputs: logits or probabilities ``(B, K)`` with ``K ≥ 2`` (arg-max), or integer
    labels ``(B,)``. Anything else is a :class:`MetricError` naming the shape. Every call goes
    through a :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard`: an exception in the model becomes
    a :class:`MetricError` naming the batch, and NaN/inf outputs are tracked on the device (no
    host sync per batch); :meth:`check` raises after the loop, naming the first bad batch — a
    model whose logits are NaN would otherwise "predict" class 0 everywhere.
    """

    def __init__(self, model: Callable[[Tensor], Any], num_classes: int | None,
                 what: str = "max_pmi_ub: model on cell samples") -> None:
        if _is_estimator(model):
            model = _EstimatorModel(model)
        if not callable(model):
            raise ConfigError(f"model must be a torch module, a callable or an estimator with predict_proba/predict "
                              f"(scikit-learn style), got {type(model).__name__}")
        self.model = model
        self.num_classes = num_classes
        self.outputs_labels = False
        self.guard = ForwardGuard(what, labels_ok=True)
        self._checked = _checked(model, self)

    def __call__(self, x: Tensor) -> Tensor:
        return self.to_labels(self.raw(x))

    def raw(self, x: Tensor) -> Tensor:
        """The model's validated output tensor for ``x`` (guarded: exceptions named, NaN/inf tracked)."""
        with torch.inference_mode():
            return self.guard(self._checked, x)

    def check(self) -> None:
        """Raise a :class:`MetricError` if any output so far held NaN/inf (one host sync)."""
        self.guard.check()

    def convert(self, out: Any, x: Tensor) -> Tensor:
        """The model's output ``out`` for inputs ``x`` as class indices ``(B,)`` (or a :class:`MetricError`)."""
        return self.to_labels(self.validate(out, x))

    @staticmethod
    def to_labels(out: Tensor) -> Tensor:
        if out.ndim == 1:
            return out.to(torch.int64)
        if out.shape[1] == 2:  # the same as argmax (ties → class 0), 5× faster on CPUs
            return (out[:, 1] > out[:, 0]).to(torch.int64)
        return out.argmax(1)

    def validate(self, out: Any, x: Tensor) -> Tensor:
        """``out`` as a tensor of logits/probabilities ``(B, K ≥ 2)`` or integer labels ``(B,)``, else a MetricError."""
        if not isinstance(out, Tensor):
            try:
                out = torch.as_tensor(np.asarray(out), device=x.device)
            except (TypeError, ValueError):
                raise MetricError(
                    f"the model returned {type(out).__name__}; it must return logits or probabilities of shape "
                    f"(batch, classes) or labels of shape (batch,)"
                ) from None
        batch = x.shape[0]
        if out.ndim == 2 and out.shape[0] == batch and out.shape[1] >= 2:
            if self.num_classes is not None and out.shape[1] != self.num_classes:
                raise MetricError(
                    f"the model returned {out.shape[1]} class scores but num_classes={self.num_classes}"
                )
            return out
        if out.ndim == 1 and out.shape[0] == batch and not out.dtype.is_floating_point and not out.dtype.is_complex:
            self.outputs_labels = True
            return out
        hint = ""
        if out.ndim == 2 and out.shape[0] == batch and out.shape[1] == 1:
            hint = " A single score per input is ambiguous: return two-class logits (B, 2) or integer labels."
        elif out.ndim == 1 and out.shape[0] == batch:
            hint = " A 1-D output must hold integer class labels, not floating-point scores."
        raise MetricError(
            f"the model returned shape {tuple(out.shape)} (dtype {out.dtype}) for a batch of {batch} inputs of shape "
            f"{tuple(x.shape[1:])}; expected logits/probabilities ({batch}, K≥2) or integer labels ({batch},).{hint}"
        )


def _check_label_range(preds: Tensor, k: int) -> None:
    """Refuse labels outside ``0..k-1`` (one host sync: call it outside batch loops)."""
    _check_label_bounds(int(preds.min()), int(preds.max()), k)


def _check_label_bounds(lo: int, hi: int, k: int) -> None:
    if lo < 0 or hi >= k:
        raise MetricError(
            f"the model predicted label {hi if hi >= k else lo}, outside 0..{k - 1}. Fix: pass num_classes "
            f"(the number of classes the model can predict)"
        )
