"""Trust the model before trusting a metric: guarded forward passes and output checks.

Every gate that queries a model goes through :class:`ForwardGuard`. It

* turns an exception raised by the model into a :class:`~pytest_dnnsafety.errors.MetricError`
  naming the batch, the input's shape, dtype and device, the model's parameter dtype and device,
  and a fix (the common causes: a wrong input shape, float64 weights with float32 data, a model
  and data on different devices, a ``torch.export`` program exported with a fixed batch size);
* checks the output's *shape* on the host (free: shapes are metadata): a tensor of shape
  ``(batch, classes)`` with the expected number of classes;
* checks *finiteness* on the device without a host synchronisation per batch: it keeps one
  running tensor with the index of the first batch holding NaN/inf and one with the count of bad
  rows; :meth:`ForwardGuard.check` reads them once, after the loop, and raises a
  :class:`MetricError` naming the first bad batch.

Pure torch; no pytest import.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .errors import MetricError

__all__ = ["ForwardGuard", "describe_model", "eval_mode", "model_dtype_device"]

_NONE = torch.iinfo(torch.int64).max


def model_dtype_device(model: Any) -> tuple[torch.dtype | None, torch.device | None]:
    """The dtype and device of a module's first floating parameter (or buffer); ``(None, None)`` if none."""
    if isinstance(model, torch.nn.Module):
        try:
            tensors = [*model.parameters(), *model.buffers()]
        except Exception:  # a scripted or exported module may refuse; the caller copes without
            tensors = []
        for tensor in tensors:
            if tensor.is_floating_point():
                return tensor.dtype, tensor.device
        for tensor in tensors:
            return None, tensor.device
    return None, None


@contextlib.contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode inside the block (BatchNorm and Dropout fixed), its mode restored after.

    Restored also when the block raises. A callable without ``train`` and a ``torch.export``
    module (which refuses ``train()``: its mode was fixed at export) pass through unchanged.
    """
    training = getattr(model, "training", None)
    _train(model, False)
    try:
        yield model
    finally:
        if training is not None:
            _train(model, bool(training))


def _train(model: Any, training: bool) -> None:
    if hasattr(model, "train"):
        try:
            model.train(training)
        except NotImplementedError:
            pass


def describe_model(model: Any) -> str:
    dtype, device = model_dtype_device(model)
    kind = type(model).__name__
    if dtype is None and device is None:
        return kind
    return f"{kind} with {str(dtype).replace('torch.', '') if dtype else '?'} weights on {device}"


def _hint(exc: BaseException, x: Tensor, model: Any) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    dtype, device = model_dtype_device(model)
    if dtype is not None and x.is_floating_point() and dtype != x.dtype:
        return (f"Fix: the inputs are {str(x.dtype).replace('torch.', '')} but the model's weights are "
                f"{str(dtype).replace('torch.', '')}; convert one (model.to({x.dtype}) or the data to {dtype}).")
    if device is not None and device.type != x.device.type:
        return f"Fix: the inputs are on {x.device} but the model is on {device}; set dnnsafety_device to match."
    if "dtype" in text or "expected scalar type" in text or "should be the same" in text:
        return "Fix: give the model inputs of the dtype its weights have."
    if any(word in text for word in ("shape", "size", "mat1", "dimension", "expected input", "guard")):
        return ("Fix: give inputs in the shape the model expects (for a torch.export program, export it with a "
                "dynamic batch dimension: torch.export.export(..., dynamic_shapes=...)).")
    return "Fix: the error is in the model or its inputs; run the model on one batch of the data to reproduce it."


class ForwardGuard:
    """Run a model batch by batch and check what it returns (see the module docstring).

    ``what`` names the caller in messages (e.g. ``"max_pmi_ub: model on cell samples"``).
    ``num_classes``: the expected number of output columns, or ``None`` to take it from the first
    batch and then require it of every later batch. ``labels_ok``: also accept integer labels of
    shape ``(batch,)`` (a classifier that returns its decision).
    """

    def __init__(self, what: str, *, num_classes: int | None = None, labels_ok: bool = False) -> None:
        self.what = what
        self.num_classes = num_classes
        self.labels_ok = labels_ok
        self.batches = 0
        self._first_bad: Tensor | None = None
        self._bad_rows: Tensor | None = None
        self._rows = 0

    # -- the forward pass

    def __call__(self, model: Callable[[Tensor], Any], x: Tensor) -> Tensor:
        """``model(x)``, checked; returns the output tensor."""
        index = self.batches
        self.batches += 1
        try:
            out = model(x)
        except MetricError:
            raise
        except Exception as exc:
            raise MetricError(
                f"{self.what}: the model raised {type(exc).__name__} on batch {index} (inputs of shape "
                f"{tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}, on {x.device}; model: "
                f"{describe_model(model)}): {_first_line(exc)}. {_hint(exc, x, model)}"
            ) from exc
        return self.observe(out, x, index)

    def observe(self, out: Any, x: Tensor, index: int | None = None) -> Tensor:
        """Check an output the caller computed itself (e.g. in a hook-driven pass)."""
        if index is None:
            index = self.batches
            self.batches += 1
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            out = out[0]
        if not isinstance(out, Tensor):
            raise MetricError(
                f"{self.what}: on batch {index} the model returned {type(out).__name__}, not a tensor. Fix: return "
                f"logits or probabilities of shape (batch, classes)."
            )
        batch = x.shape[0]
        labels = self.labels_ok and out.ndim == 1 and not out.is_floating_point() and not out.is_complex()
        if labels:
            if out.shape[0] != batch:
                raise MetricError(f"{self.what}: on batch {index} the model returned {out.shape[0]} labels for "
                                  f"{batch} inputs.")
        else:
            if out.ndim != 2 or out.shape[0] != batch:
                raise MetricError(
                    f"{self.what}: on batch {index} the model returned shape {tuple(out.shape)} for {batch} inputs "
                    f"of shape {tuple(x.shape[1:])}; expected ({batch}, classes). Fix: return one row of class "
                    f"scores per input (flatten or squeeze extra dimensions in the model)."
                )
            if out.shape[1] < 2:
                raise MetricError(
                    f"{self.what}: on batch {index} the model returned one score per input (shape "
                    f"{tuple(out.shape)}); a classifier's output needs a column per class. Fix: return two-class "
                    f"logits (batch, 2) for a binary classifier."
                )
            if self.num_classes is None:
                self.num_classes = int(out.shape[1])
            elif out.shape[1] != self.num_classes:
                raise MetricError(
                    f"{self.what}: on batch {index} the model returned {out.shape[1]} class scores, expected "
                    f"{self.num_classes}. Fix: check the model's last layer and the number of classes of the data."
                )
        if out.is_floating_point() or out.is_complex():
            bad = ~torch.isfinite(out)
            bad_rows = bad.reshape(batch, -1).any(dim=1) if batch else bad.reshape(0)
            count = bad_rows.sum()
            first = torch.where(count > 0, torch.full((), index, dtype=torch.int64, device=out.device),
                                torch.full((), _NONE, dtype=torch.int64, device=out.device))
            if self._first_bad is None:
                self._first_bad, self._bad_rows = first, count
            else:  # a model may move between devices mid-run; keep the running state where the output is
                self._first_bad = torch.minimum(self._first_bad.to(out.device), first)
                self._bad_rows = self._bad_rows.to(out.device) + count
        self._rows += batch
        return out

    # -- after the loop

    def check(self) -> None:
        """One host sync: raise a :class:`MetricError` if any output held NaN/inf."""
        if self._first_bad is None:
            return
        first = int(self._first_bad)
        if first == _NONE:
            return
        rows = int(self._bad_rows) if self._bad_rows is not None else 0
        raise MetricError(
            f"{self.what}: the model's outputs hold NaN/inf in {rows} of {self._rows} inputs; the first bad batch "
            f"is batch {first}. A metric computed from them would be meaningless. Fix: check the model's weights "
            f"(corrupted or diverged training) and the inputs' range."
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
