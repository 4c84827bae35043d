"""Batch sizes from a memory budget: the measured working memory of one model call per input.

A fixed count of inputs per forward (e.g. occlusion's former ``max_batch=4096``) is a memory bet that
only holds for small inputs: 222 occluded copies of a 224x224 image in one ResNet-18 forward took
2.3 GiB. Here the cost is measured instead, once per (model, input shape, dtype, device, gradient):

* :func:`input_cost` runs the model on 1 and on 2 inputs of the batch at hand (under ``no_grad``, or with
  a backward pass to the input when ``grad``) while a dispatch mode counts the bytes of the live tensors
  the call creates; the peak on 2 inputs less the peak on 1 is the cost **per input**, the rest is
  **fixed** (e.g. the parameters' gradients). A model the mode cannot follow falls back to the input's
  size times :data:`FALLBACK_FACTOR` (the measured ratio on a ResNet-18 at 224x224 is ~11 without and ~35
  with a backward pass).
* :func:`chunk_size` turns it into the most inputs per call within the working-memory budget
  (:func:`pytest_dnnsafety.runtime.sizes.working_memory`: the ``dnnsafety_max_memory`` setting, 1 GiB by
  default), with :data:`MARGIN` for what the count does not see (a convolution library's scratch
  buffers, the allocator's fragmentation), plus the caller's own per-input tensors (``extra``).

The probe's calls are the model's own (not through a guard: they are no queries of the data) and cost
two forwards of one and two inputs. No host synchronisation: the sizes are the tensors' metadata.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pytest_dnnsafety.engines.core.guard import _PROBING
from pytest_dnnsafety.runtime.sizes import batch_for

__all__ = ["MARGIN", "FALLBACK_FACTOR", "input_cost", "chunk_size", "spans"]

#: Headroom on the counted per-input bytes (scratch buffers, fragmentation, weight reorders).
MARGIN = 1.5
#: Bytes per input over the input's own bytes when the probe cannot count: (without, with) a backward pass.
FALLBACK_FACTOR = (16, 64)

_CACHE: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[int, int]]]" = weakref.WeakKeyDictionary()


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the ops create while they are alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}
        self.now = 0
        self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.now -= entry[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            entry = self.live.get(key)
            if entry is None:
                entry = self.live[key] = [0, storage.nbytes()]
                self.now += entry[1]
                self.peak = max(self.peak, self.now)
            entry[0] += 1
            weakref.finalize(t, self._drop, key)
        return out


def _warm() -> None:
    """The first op under a dispatch mode imports torch's dispatch machinery (torch.distributed's functional
    collectives among it, which register a library once per process): done when this module is imported, not in
    the middle of a gate (nor inside a pytester run, whose module snapshot would drop and re-register it)."""
    try:
        with _LiveBytes():
            torch.zeros(1) + 0
    except Exception:  # noqa: BLE001 - the probe then falls back per model
        pass


_warm()


def _peak(model: Any, x: Tensor, grad: bool) -> int:
    """Peak live bytes of one call; recording hooks skip it (:func:`~.guard.probing`), the RNG state is kept."""
    token = _PROBING.set(True)
    cuda = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            return _call(model, x, grad)
    finally:
        _PROBING.reset(token)


def _call(model: Any, x: Tensor, grad: bool) -> int:
    mode = _LiveBytes()
    if grad:
        xg = x.detach().clone().requires_grad_(True)
        with torch.enable_grad(), mode:
            out = model(xg)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not isinstance(out, Tensor) or not out.requires_grad:
                raise TypeError("the output does not require grad")
            torch.autograd.grad(out.float().sum(), [xg])
    else:
        with torch.no_grad(), mode:
            model(x)
    return mode.peak


def input_cost(model: Any, x: Tensor, *, grad: bool = False) -> tuple[int, int]:
    """``(bytes per input, fixed bytes)`` of one call of ``model`` on inputs like ``x`` (see the module docstring).

    ``grad``: a forward and a backward pass to the input (an attack step), else a forward under
    ``no_grad``. Measured on ``x[:1]`` and ``x[:2]`` (a single input is repeated), once per model and input
    form; a model the probe cannot follow gets the fallback estimate.
    """
    key = (tuple(x.shape[1:]), x.dtype, str(x.device), bool(grad))
    try:
        known = _CACHE.setdefault(model, {})
    except TypeError:  # not weak-referenceable: measured every time
        known = {}
    if key in known:
        return known[key]
    one = x[:1].detach()
    two = x[:2].detach() if x.shape[0] >= 2 else one.expand(2, *one.shape[1:]).clone()
    try:
        p1, p2 = _peak(model, one, grad), _peak(model, two, grad)
        per = max(p2 - p1, one.numel() * one.element_size())
        cost = (int(per), int(max(0, p1 - per)))
    except Exception:  # noqa: BLE001 - the model's own errors are the guarded calls' business, not the probe's
        cost = (int(one.numel() * one.element_size() * FALLBACK_FACTOR[bool(grad)]), 0)
    known[key] = cost
    return cost


def chunk_size(model: Any, x: Tensor, *, grad: bool = False, extra: int = 0, budget: int | None = None,
               cap: int | None = None) -> int:
    """The most inputs like ``x`` per call of ``model`` within ``budget`` bytes (default: the working memory).

    ``extra``: bytes per input the caller holds beside the call (e.g. the occluded copies it builds).
    """
    per, fixed = input_cost(model, x, grad=grad)
    return batch_for(per * MARGIN + extra, fixed=fixed, budget=budget, cap=cap)


def spans(n: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive chunks of at most ``size`` of ``n`` rows."""
    for start in range(0, n, max(1, size)):
        yield start, min(n, start + size)
