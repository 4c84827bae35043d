"""Trust the model before trusting a metric: guarded forward passes and output checks.

Every gate that queries a model goes through :class:`ForwardGuard`. It

* turns an exception raised by the model into a :class:`~pytest_dnnsafety.errors.MetricError`
  naming the batch, the input's shape, dtype and device, the model's parameter dtype and device,
  and a fix (the common causes: a wrong input shape, float64 weights with float32 data, a model
  and data on different devices, a ``torch.export`` program exported with a fixed batch size);
* checks, on its first batch, that the model is *deterministic* (:func:`check_deterministic`,
  once per model and device): two passes of a few inputs must agree, or a model with dropout left
  on at inference would give every gate a different number for the same seed;
* checks the output's *shape* on the host (free: shapes are metadata): a tensor of shape
  ``(batch, classes)`` with the expected number of classes;
* checks *finiteness* on the device without a host synchronisation per batch: it keeps one
  running tensor with the index of the first batch holding NaN/inf and one with the count of bad
  rows; :meth:`ForwardGuard.check` reads them once, after the loop, and raises a
  :class:`MetricError` naming the first bad batch;
* for a detector, the same way: boxes finite and not inverted, labels inside the classes the
  detector declares (:func:`~pytest_dnnsafety.engines.core.detections.declared_classes`), scores
  probabilities in ``[0, 1]`` (not NaN, percent or logits: every detection gate reads a score as a
  probability), and, through :meth:`ForwardGuard.targets`, the data's target labels inside those
  classes; the output's form (one dict per image, not torchvision's training-mode ``(losses,
  detections)`` nor one dict per batch) on the host.

Pure torch; no pytest import.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.data.tasks import (BoxSet, bad_boxes, bad_scores, detections_from_output, detector_output_problem,
                                         is_detection_output)
from pytest_dnnsafety.engines.core.detections import declared_classes

__all__ = ["ForwardGuard", "check_deterministic", "describe_model", "eval_mode", "model_dtype_device", "probing"]

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
    shape ``(batch,)`` (a classifier that returns its decision). ``task``: ``"single-label"`` and
    ``"multi-label"`` expect ``(batch, classes)`` tensors; ``"detection"`` expects one dict of
    boxes, scores and labels per image and returns them packed as a
    :class:`~pytest_dnnsafety.data.tasks.BoxSet` (boxes finite, ``x2 >= x1``, labels inside the classes
    when ``num_classes`` is given, flagged on the device); ``"any"`` takes either (a pass that reads
    only layer activations). A detector's output given to a classifier's guard is an error naming
    the task.
    """

    def __init__(self, what: str, *, num_classes: int | None = None, labels_ok: bool = False,
                 task: str = "single-label") -> None:
        self.what = what
        self.task = task
        self.num_classes = num_classes
        self.labels_ok = labels_ok
        self.batches = 0
        self._first_bad: Tensor | None = None
        self._bad_rows: Tensor | None = None
        self._rows = 0
        self._deterministic = False  # checked on this guard's first batch (see check_deterministic)
        self._boxes = False
        self._classes_from = "given" if num_classes is not None else ""  # a detector: where its classes were read
        self._scores: dict[str, Tensor] = {}  # a detector's scores: first bad batch, bad, NaN count, min, max
        self._n_detections = 0
        self._targets: dict[str, Tensor] = {}  # the data's target labels: first bad batch, bad, min, max
        self._objects = 0

    # -- the forward pass

    def __call__(self, model: Callable[[Tensor], Any], x: Tensor) -> Tensor:
        """``model(x)``, checked; returns the output tensor."""
        index = self.batches
        self.batches += 1
        if not self._deterministic:
            check_deterministic(model, x, self.what)
            self._deterministic = True
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
        if self.num_classes is None and not self._classes_from and is_detection_output(out):
            found = declared_classes(model)  # a detector's declared class count (host attributes, once)
            self._classes_from = "none declared"
            if found is not None:
                self.num_classes, self._classes_from = found
        return self.observe(out, x, index)

    def observe(self, out: Any, x: Tensor, index: int | None = None) -> Tensor:
        """Check an output the caller computed itself (e.g. in a hook-driven pass)."""
        if index is None:
            index = self.batches
            self.batches += 1
        if self.task in ("detection", "any"):
            problem = detector_output_problem(out, int(x.shape[0]))
            if problem is not None:
                raise MetricError(f"{self.what}: on batch {index} {problem}.")
        if is_detection_output(out):
            return self._detections(out, x, index)
        if self.task == "detection":
            detections_from_output(out, x.shape[0], f"{self.what} (batch {index})")  # raises: not detections
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

    def _detections(self, out: Any, x: Tensor, index: int) -> Any:
        if self.task not in ("detection", "any"):
            raise MetricError(
                f"{self.what}: on batch {index} the model returned detections (one dict of boxes, scores and labels "
                f"per image): it is an object detector, and this pass needs a {self.task} classifier's (batch, "
                "classes) scores. Fix: use a gate that supports task='detection' (min_detection_map, "
                "min_detection_recall, occlusion, adversarial confidence, monitors, neuron and scene coverage), or "
                "give this gate a classifier.")
        boxes = detections_from_output(out, int(x.shape[0]), f"{self.what} (batch {index})")
        bad = bad_boxes(boxes, self.num_classes)
        count = bad.sum()
        first = torch.where(count > 0, torch.full((), index, dtype=torch.int64, device=bad.device),
                            torch.full((), _NONE, dtype=torch.int64, device=bad.device))
        if self._first_bad is None:
            self._first_bad, self._bad_rows = first, count
        else:
            self._first_bad = torch.minimum(self._first_bad.to(bad.device), first)
            self._bad_rows = self._bad_rows.to(bad.device) + count
        self._rows += int(x.shape[0])
        self._boxes = True
        if len(boxes) and boxes.scores is not None:  # shapes are host metadata: no sync
            scores = boxes.scores.detach().float()  # float32: MPS has no float64
            nan = torch.isnan(scores)
            _running(self._scores, index, bad_scores(scores), {"nan": nan.sum()},
                     scores.masked_fill(nan, math.inf).amin(), scores.masked_fill(nan, -math.inf).amax())
            self._n_detections += len(boxes)
        return boxes

    def targets(self, targets: Any, index: int) -> None:
        """Flag, on the device, the data's target labels outside the detector's classes (read by :meth:`check`).

        Only where the class count is known: given to the guard, or declared by the detector (read on its first
        batch, :func:`~pytest_dnnsafety.engines.core.detections.declared_classes`); call it after the batch's
        forward pass. An object of a class the detector cannot output can never be found: recall and AP would
        measure the data's mismatch, not the detector (the classifier gates refuse such labels the same way)."""
        if not isinstance(targets, BoxSet) or self.num_classes is None or len(targets) == 0:
            return
        labels = targets.labels.detach()
        _running(self._targets, index, (labels < 0) | (labels >= self.num_classes), {}, labels.amin(), labels.amax())
        self._objects += len(targets)

    # -- after the loop

    def check(self) -> None:
        """One host sync: raise a :class:`MetricError` if any output held NaN/inf (or a detector's scores left
        [0, 1]), a :class:`DataError` if target labels lay outside the detector's classes."""
        self._check_outputs()
        self._check_scores()
        self._check_targets()

    def _check_scores(self) -> None:
        if not self._scores:
            return
        first, bad, nan, lo, hi = torch.stack([self._scores[key].cpu().double() for key in
                                               ("first", "bad", "nan", "min", "max")]).tolist()
        if first >= 2.0**62:  # _NONE, read back through float64 (one read for all five)
            return
        nans = f"; {int(nan)} are NaN" if nan else ""
        seen = f"scores range over {lo:.6g}..{hi:.6g}{nans}" if math.isfinite(lo) else "all are NaN"
        raise MetricError(
            f"{self.what}: the model's detection scores are NaN or outside [0, 1] for {int(bad)} of "
            f"{self._n_detections} detections ({seen}); the first bad batch is "
            f"batch {int(first)}. Every detection gate reads a score as a probability (score_threshold, COCO's "
            "ranking, the matched score), so scores in percent, logits or shifted scores would move the verdict. "
            "Fix: return probabilities in [0, 1] (divide percent by 100, apply a sigmoid or softmax to logits), e.g. "
            "in a wrapper module around the detector.")

    def _check_targets(self) -> None:
        if not self._targets:
            return
        first, bad, lo, hi = torch.stack([self._targets[key].cpu() for key in
                                          ("first", "bad", "min", "max")]).tolist()
        if int(first) == _NONE:
            return
        k = self.num_classes
        raise DataError(
            f"{self.what}: the data's target labels range over {int(lo)}..{int(hi)}, but the detector has {k} classes "
            f"(0..{k - 1}, {self._classes_from}); {int(bad)} of {self._objects} objects lie outside, the first bad "
            f"batch is batch {int(first)}. The detector can never find them: recall and AP would measure the data's "
            f"mismatch, not the detector. Fix: map the data's classes to the detector's class indices (torchvision's "
            f"detectors count the background as class 0), or give data that belongs to this detector (or declare "
            f"its true class count as model.num_classes).")

    def _check_outputs(self) -> None:
        if self._first_bad is None:
            return
        first = int(self._first_bad)
        if first == _NONE:
            return
        rows = int(self._bad_rows) if self._bad_rows is not None else 0
        if self._boxes:
            classes = f", or a label outside the {self.num_classes} classes" if self.num_classes else ""
            raise MetricError(
                f"{self.what}: the model's detections hold {rows} box(es) that are NaN/inf, have x2 < x1 or y2 < y1"
                f"{classes} (of {self._rows} images); the first bad batch is batch {first}. Fix: check the detector's "
                "box decoding (x1, y1, x2, y2 in pixels), its weights and the inputs' range.")
        raise MetricError(
            f"{self.what}: the model's outputs hold NaN/inf in {rows} of {self._rows} inputs; the first bad batch "
            f"is batch {first}. A metric computed from them would be meaningless. Fix: check the model's weights "
            f"(corrupted or diverged training) and the inputs' range."
        )


def _running(state: dict[str, Tensor], index: int, bad: Tensor, counts: dict[str, Tensor], low: Tensor,
             high: Tensor) -> None:
    """Fold one batch into a running on-device record: first bad batch, bad count, extra counts, min, max."""
    hit = bad.sum()
    first = torch.where(hit > 0, torch.full((), index, dtype=torch.int64, device=hit.device),
                        torch.full((), _NONE, dtype=torch.int64, device=hit.device))
    batch = {"first": first, "bad": hit, **counts, "min": low, "max": high}
    if not state:
        state.update(batch)
        return
    device = state["first"].device
    for key, value in batch.items():
        value = value.to(device)
        state[key] = (torch.minimum(state[key], value) if key in ("first", "min")
                      else torch.maximum(state[key], value) if key == "max" else state[key] + value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# -------------------------------------------------------------------------------- determinism

#: Inputs of the probe batch: the first rows of the first batch a model is given.
PROBE_ROWS = 8

_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("dnnsafety_probing", default=False)
_CHECKED: "weakref.WeakKeyDictionary[Any, dict[str, str | None]]" = weakref.WeakKeyDictionary()


def probing() -> bool:
    """True while :func:`check_deterministic` runs its probe passes: a forward hook that records should skip them."""
    return _PROBING.get()


def _tolerance(dtype: torch.dtype) -> float:
    """Relative (and, times the output's scale, absolute) tolerance of the probe comparison for ``dtype``.

    Outputs ``a``, ``b`` agree where ``|a − b| ≤ rtol·|b| + 0.1·rtol·max(1, max|b|)``.
    Float32/64: ``rtol`` 1e-4 — GPU kernels that reduce with atomics (cuDNN, scatter/index adds, split-K
    matmuls) give run-to-run differences of a few ulps (~1e-7 relative in float32), while a dropout
    mask or a sampled layer moves outputs by whole units of the activations (≥ 1e-2 relative).
    Half precision: 8 ulps of the format.
    """
    if dtype in (torch.float16, torch.bfloat16):
        return 8.0 * torch.finfo(dtype).eps
    return 1e-4


def _first_tensor(out: Any) -> Tensor | None:
    if is_detection_output(out):  # a detector: compare every image's boxes and scores, packed
        try:
            boxes = detections_from_output(out, len(out), "determinism probe")
        except Exception:
            return None
        return torch.cat([boxes.boxes.reshape(-1), boxes.scores.reshape(-1).to(boxes.boxes.dtype),
                          boxes.labels.to(boxes.boxes.dtype)])
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    return out if isinstance(out, Tensor) else None


def _memo(model: Any) -> dict[str, str | None] | None:
    """The model's probe results by device (``None``: deterministic), or ``None`` if it cannot be memoised."""
    try:
        return _CHECKED.setdefault(model, {})
    except TypeError:  # not weak-referenceable: checked once per guard only
        return None


def _differs(first: Tensor, second: Tensor) -> str | None:
    """How two probe outputs differ beyond float nondeterminism (:func:`_tolerance`), or ``None``."""
    if first.shape != second.shape:
        return f"shapes {tuple(first.shape)} and {tuple(second.shape)}"
    if not (first.is_floating_point() or first.is_complex()):
        mismatch = first != second
        return f"{int(mismatch.sum())} of {first.numel()} labels differ" if bool(mismatch.any()) else None
    a, b = first.detach(), second.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # equal infinities and NaN in both places agree
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=math.inf))
    size = b.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    scale = float(size.max()) if size.numel() else 0.0
    rtol = _tolerance(first.dtype)
    atol = 0.1 * rtol * max(scale, 1.0)  # 1e-5 for outputs within ±1 (probabilities), scaled for logits
    if not bool((diff > atol + rtol * size).any()):
        return None
    return f"a largest difference of {float(diff.max()):.3g}, outputs up to {scale:.3g}"


def check_deterministic(model: Callable[[Tensor], Any], x: Tensor, what: str = "model") -> None:
    """Raise a :class:`MetricError` if the model answers the same inputs differently twice.

    A model with dropout (or any sampling) active at inference — ``F.dropout(x, p, training=True)``
    in ``forward``, a module whose ``eval()`` leaves its dropout on, a sampling layer, a model
    fixture left in train mode where the engine does not switch it — gives every gate a different
    number for the same seed (a pass on one run, a fail on the next). Once per model and device
    (memoised on the model object, the verdict too), two passes of the first :data:`PROBE_ROWS`
    rows of ``x`` (all of ``x`` if the model refuses the smaller batch, e.g. a ``torch.export``
    program with a fixed batch size) run under ``no_grad`` with torch's RNG state saved and *not*
    reset between them, so a random layer draws afresh; the outputs must agree within
    :func:`_tolerance` (exactly, for integer labels). The RNG state is restored afterwards, so
    seeded results are unchanged. A model that raises on the probe is left to the guarded pass,
    which names the error. Forward hooks that record activations skip the probe passes
    (:func:`probing`).
    """
    memo = _memo(model)
    device = str(x.device)
    if memo is not None and device in memo:
        problem = memo[device]
    else:
        problem = _probe(model, x)
        if memo is not None:
            memo[device] = problem
    if problem is not None:
        raise MetricError(
            f"{what}: the model is not deterministic: two forward passes of the same inputs gave different outputs "
            f"({problem}; model: {describe_model(model)}). Every metric would change from run to run with the same "
            f"seed. Fix: call model.eval() and keep dropout and any sampling off at inference (no "
            f"F.dropout(..., training=True) or torch.rand/bernoulli in forward); switch the model's stochastic "
            f"layers off, or give the gate a deterministic wrapper of the model."
        )


@contextlib.contextmanager
def _sync_allowed(t: Tensor) -> Iterator[None]:
    """The one deliberate host read of the determinism probe (once per model and device, before the batch loop),
    allowed under ``torch.cuda.set_sync_debug_mode("error")``, which checks that batch loops do not sync."""
    if t.device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _probe(model: Callable[[Tensor], Any], x: Tensor) -> str | None:
    """Two passes of the probe rows, RNG state saved before and restored after (see :func:`check_deterministic`)."""
    n = int(x.shape[0]) if x.ndim else 0
    if n == 0:
        return None
    probes = [x[:PROBE_ROWS], x] if n > PROBE_ROWS else [x]
    cuda = [x.device.index if x.device.index is not None else torch.cuda.current_device()] \
        if x.device.type == "cuda" else []
    token = _PROBING.set(True)
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            for probe in probes:
                probe = probe.detach()
                try:
                    first, second = _first_tensor(model(probe)), _first_tensor(model(probe))
                except Exception:  # the guarded pass reports it (with the batch, shapes and a fix)
                    continue
                if first is None or second is None:
                    return None
                with _sync_allowed(first):  # once per model and device: the probe's verdict is read on the host
                    problem = _differs(first, second)
                return None if problem is None else f"{probe.shape[0]} input(s): {problem}"
    finally:
        _PROBING.reset(token)
    return None
